//! A region's hardware export as the DPU receives it from the host (`hw_export`):
//! any bytes decode to an export or a typed error, never a panic, and a decoded
//! export encodes back to the same bytes.
#![no_main]

use dpumesh_dpa::dma::export::PciExport;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (len, bytes) = data.split_at(8);
    let region_len = u64::from_le_bytes(len.try_into().unwrap());
    if let Ok(export) = PciExport::decode(bytes, region_len) {
        assert_eq!(export.encode(), bytes);
        assert_eq!(export.len, region_len);
    }
});
