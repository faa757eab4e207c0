//! Regions the DPU's DMA engine reaches across PCIe: on a BlueField the pods' pools,
//! rings and bells live in host memory, which the host registers with the device and
//! exports (`doca_mmap_export_pci`), and which the DPU imports
//! (`doca_mmap_create_from_export`) to name it in DMA tasks. docs/data-path.md ("On a
//! BlueField") has the design; this is its first layer.
//!
//! - [`RegionExporter`]: the host side (DOCA's in [`super::doca_export`], `doca`
//!   feature). The software path has none: its regions are mapped by both sides.
//! - [`PciExport`]: what crosses to the DPU for one region, in
//!   `RegionExport::hw_export`: the region's address in the exporting process (DOCA
//!   buffers name host memory by it), its length, and the device's descriptor. It comes
//!   from the less trusted side of the control channel, so it is decoded with every
//!   length checked.
//! - [`export_all`]: a pod's whole set, exported in order, undone in full when one
//!   region fails (a pod is registered with every region reachable or not at all).

use crate::shm::SharedRegion;

use super::DmaError;

/// The largest device export descriptor accepted (DOCA's are a few hundred bytes).
pub const MAX_DESCRIPTOR: usize = 4096;
/// Bytes before the descriptor: the address and the length, little-endian.
const FIXED: usize = 16;

/// One region as exported for the DPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciExport {
    /// The region's first byte in the exporting process.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The device's export descriptor (opaque here).
    pub descriptor: Vec<u8>,
}

/// Why an export descriptor from the other side was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    #[error("a hardware export of {0} bytes is shorter than its 16-byte address and length")]
    Short(usize),
    #[error("a hardware export names an empty region")]
    Empty,
    #[error("a hardware export's region at {addr:#x} of {len} bytes runs past the address space")]
    Wraps { addr: u64, len: u64 },
    #[error("a hardware export's region is {got} bytes, the region exported is {want}")]
    Length { got: u64, want: u64 },
    #[error("a hardware export's descriptor is {len} bytes (at most {MAX_DESCRIPTOR}, at least 1)")]
    Descriptor { len: usize },
}

impl PciExport {
    /// The bytes of `RegionExport::hw_export`: address, length, descriptor.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + self.descriptor.len());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.descriptor);
        out
    }

    /// Reads `hw_export` for a region the control message says is `region_len` bytes.
    pub fn decode(bytes: &[u8], region_len: u64) -> Result<Self, ExportError> {
        if bytes.len() < FIXED {
            return Err(ExportError::Short(bytes.len()));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let (addr, len) = (word(0), word(8));
        if len == 0 {
            return Err(ExportError::Empty);
        }
        if addr.checked_add(len).is_none() {
            return Err(ExportError::Wraps { addr, len });
        }
        if len != region_len {
            return Err(ExportError::Length {
                got: len,
                want: region_len,
            });
        }
        let descriptor = &bytes[FIXED..];
        if descriptor.is_empty() || descriptor.len() > MAX_DESCRIPTOR {
            return Err(ExportError::Descriptor {
                len: descriptor.len(),
            });
        }
        Ok(Self {
            addr,
            len,
            descriptor: descriptor.to_vec(),
        })
    }
}

/// The host side: registers regions with the device and exports them for the DPU.
pub trait RegionExporter: Send + std::fmt::Debug {
    /// A name for logs.
    fn name(&self) -> &'static str;

    /// Registers `region` with the device and exports it; it stays registered until
    /// [`Self::unexport`].
    fn export(&mut self, region: &SharedRegion) -> Result<PciExport, DmaError>;

    /// Withdraws an export (its pod left, or its set failed): the device forgets the
    /// region, and what the DPU imported of it stops working.
    fn unexport(&mut self, export: &PciExport);
}

/// Exports every region of `regions`, in order. When one fails, those exported
/// before it are withdrawn and the error names the region that failed.
pub fn export_all(
    exporter: &mut dyn RegionExporter,
    regions: &[&SharedRegion],
) -> Result<Vec<PciExport>, DmaError> {
    let mut done = Vec::with_capacity(regions.len());
    for region in regions {
        match exporter.export(region) {
            Ok(export) => done.push(export),
            Err(e) => {
                for export in done.iter().rev() {
                    exporter.unexport(export);
                }
                return Err(DmaError::Engine {
                    engine: exporter.name(),
                    detail: format!("exporting region {}: {e}", region.name()),
                });
            }
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_crosses_whole_and_a_bad_one_is_refused_with_its_reason() {
        let export = PciExport {
            addr: 0x7f00_0000_1000,
            len: 1 << 20,
            descriptor: vec![7; 300],
        };
        let bytes = export.encode();
        assert_eq!(PciExport::decode(&bytes, 1 << 20), Ok(export.clone()));
        let cases: Vec<(Vec<u8>, u64, ExportError)> = vec![
            (bytes[..10].to_vec(), 1 << 20, ExportError::Short(10)),
            (
                bytes[..16].to_vec(),
                1 << 20,
                ExportError::Descriptor { len: 0 },
            ),
            (
                PciExport {
                    descriptor: vec![0; MAX_DESCRIPTOR + 1],
                    ..export.clone()
                }
                .encode(),
                1 << 20,
                ExportError::Descriptor {
                    len: MAX_DESCRIPTOR + 1,
                },
            ),
            (
                PciExport {
                    len: 0,
                    ..export.clone()
                }
                .encode(),
                0,
                ExportError::Empty,
            ),
            (
                PciExport {
                    addr: u64::MAX - 10,
                    ..export.clone()
                }
                .encode(),
                1 << 20,
                ExportError::Wraps {
                    addr: u64::MAX - 10,
                    len: 1 << 20,
                },
            ),
            (
                bytes.clone(),
                4096,
                ExportError::Length {
                    got: 1 << 20,
                    want: 4096,
                },
            ),
        ];
        for (bytes, region_len, want) in cases {
            assert_eq!(PciExport::decode(&bytes, region_len), Err(want));
        }
    }

    /// Exports by recording, failing at the `fail_at`-th export.
    #[derive(Debug, Default)]
    struct Recorder {
        live: Vec<PciExport>,
        fail_at: Option<usize>,
        calls: usize,
    }

    impl RegionExporter for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn export(&mut self, region: &SharedRegion) -> Result<PciExport, DmaError> {
            self.calls += 1;
            if self.fail_at == Some(self.calls) {
                return Err(DmaError::Engine {
                    engine: "recorder",
                    detail: "the device is out of memory keys".into(),
                });
            }
            let export = PciExport {
                addr: region.base_addr(),
                len: region.len() as u64,
                descriptor: region.name().as_bytes().to_vec(),
            };
            self.live.push(export.clone());
            Ok(export)
        }
        fn unexport(&mut self, export: &PciExport) {
            self.live.retain(|e| e != export);
        }
    }

    #[test]
    fn a_set_is_exported_whole_or_not_at_all() {
        let regions: Vec<SharedRegion> = (0..4)
            .map(|_| SharedRegion::create_sealed("dpumesh-test-export", 8192).unwrap())
            .collect();
        let refs: Vec<&SharedRegion> = regions.iter().collect();
        let mut ok = Recorder::default();
        let exports = export_all(&mut ok, &refs).unwrap();
        for (export, region) in exports.iter().zip(&regions) {
            assert_eq!((export.addr, export.len), (region.base_addr(), 8192));
        }
        assert_eq!(ok.live, exports);
        let mut failing = Recorder {
            fail_at: Some(3),
            ..Recorder::default()
        };
        let e = export_all(&mut failing, &refs).unwrap_err().to_string();
        assert!(
            e.contains("out of memory keys") && e.contains("dpumesh-test-export"),
            "{e}"
        );
        assert!(
            failing.live.is_empty(),
            "the two exported first were withdrawn"
        );
    }
}
