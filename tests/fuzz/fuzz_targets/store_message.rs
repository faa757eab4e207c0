//! BlueCache control messages (`DTRF`): any bytes decode to a message or a typed
//! error, never a panic, and a decoded message encodes back to bytes that decode the
//! same.
#![no_main]

use dpumesh_store::protocol::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = decode(data) {
        assert_eq!(decode(&encode(&message)).ok(), Some(message));
    }
    let _ = dpumesh_store::protocol::peek_id(data);
});
