//! The first bytes a stranger sends to a fabric: the TCP fabric's 16-byte hello, and
//! the private data of a verbs connect request (the admission ticket). Never a panic;
//! only well-formed hellos and tickets are accepted.
#![no_main]

use dpumesh_dpa::fabric::admission::{PRIVATE_DATA_LEN, Ticket};
use dpumesh_dpa::fabric::soft::parse_hello;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(tls) = parse_hello(data) {
        assert!(data.len() >= 16);
        assert_eq!(&data[0..4], b"DPRF");
        assert_eq!(
            u32::from_le_bytes(data[12..16].try_into().unwrap()),
            u32::from(tls)
        );
    }
    if let Ok(ticket) = Ticket::from_private_data(data) {
        assert_eq!(&ticket.to_private_data()[..], &data[..PRIVATE_DATA_LEN]);
        assert!(data[PRIVATE_DATA_LEN..].iter().all(|&b| b == 0));
    }
});
