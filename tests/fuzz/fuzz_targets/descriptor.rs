//! Descriptor bytes: anything decodes to a checked descriptor or a typed error, never
//! a panic; whatever decodes encodes back to the same descriptor.
#![no_main]

use dpumesh_dpa::Descriptor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = Descriptor::decode(data) {
        let valid = u32::from_le_bytes([data[60], data[61], data[62], data[63]]);
        assert_eq!(Descriptor::decode(&d.encode(valid)), Ok(d));
    }
});
