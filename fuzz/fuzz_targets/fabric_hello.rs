//! The first bytes a stranger sends to a TCP fabric port: the 16-byte hello. Never a
//! panic, and only the two well-formed hellos are accepted.
#![no_main]

use dpumesh_dpa::fabric::soft::parse_hello;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(tls) = parse_hello(data) {
        assert!(data.len() >= 16);
        assert_eq!(&data[0..4], b"DPRF");
        assert_eq!(u32::from_le_bytes(data[12..16].try_into().unwrap()), u32::from(tls));
    }
});
