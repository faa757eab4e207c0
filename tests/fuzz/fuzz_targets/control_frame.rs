//! Control-channel frames: any bytes decode to a frame or a typed error, never a
//! panic, and a decoded frame encodes back to bytes that decode the same.
#![no_main]

use dpumesh_dpa::control::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = decode(data) {
        assert_eq!(decode(&encode(&frame)).ok(), Some(frame));
    }
    let _ = dpumesh_dpa::control::read_frame(&mut &data[..]);
});
