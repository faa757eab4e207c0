//! Mesh frames from a peer over the fabric: anything decodes to a frame or a typed
//! error, never a panic or an allocation sized by a length field; a decoded frame
//! encodes back to the same bytes.
#![no_main]

use dpumesh_dpa::frame::Frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = Frame::decode(data) {
        let mut out = Vec::new();
        frame.encode_into(&mut out).unwrap();
        assert_eq!(out, data);
    }
});
