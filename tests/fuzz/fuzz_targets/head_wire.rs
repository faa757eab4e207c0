//! Head wire bytes (what pods and proxies hand each other): anything decodes to a
//! checked head or a typed error, never a panic; a decoded head encodes back to bytes
//! that decode to the same fields.
#![no_main]

use dpumesh_head::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(head) = wire::decode_request(data) {
        let again = wire::decode_request(&wire::encode_request(&head).unwrap()).unwrap();
        assert_eq!(again.method, head.method);
        assert_eq!(again.path, head.path);
        assert_eq!(again.query, head.query);
        assert_eq!(again.headers(), head.headers());
        assert!(again.metadata_entries().eq(head.metadata_entries()));
    }
    if let Ok(head) = wire::decode_response(data) {
        assert_eq!(
            wire::decode_response(&wire::encode_response(&head).unwrap()).unwrap(),
            head
        );
    }
});
