//! The host's DOCA exporter (`doca` feature): each region is registered with the
//! BlueField's PCI function as a DOCA mmap (local and PCI read-write, never relaxed
//! ordering: the DPU's ring writes must land in address order, docs/data-path.md) and
//! exported with `doca_mmap_export_pci` for the DPU to import.
//!
//! Compiled (type-checked) wherever the feature is enabled; it needs a BlueField host
//! and the DOCA libraries to link and run, and has not been run on hardware.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr;

use doca_sys as sys;

use super::DmaError;
use super::doca::{check, open_device};
use super::export::{PciExport, RegionExporter};
use crate::shm::SharedRegion;

/// Registers and exports host regions through one PCI function of the BlueField.
pub struct DocaExporter {
    dev: *mut sys::doca_dev,
    /// The live exports, by (address, length).
    mmaps: HashMap<(u64, u64), *mut sys::doca_mmap>,
}

// SAFETY: the handles are used by one thread at a time (the registry's lock).
unsafe impl Send for DocaExporter {}

impl std::fmt::Debug for DocaExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocaExporter")
            .field("exports", &self.mmaps.len())
            .finish_non_exhaustive()
    }
}

impl DocaExporter {
    /// Opens the host's BlueField function at PCI address `pci` (e.g. `3b:00.0`).
    pub fn open(pci: &str) -> Result<Self, DmaError> {
        // Any function that opens can register memory; export support shows at export.
        let dev = open_device(pci, "DOCA", |_| sys::DOCA_SUCCESS)?;
        Ok(Self {
            dev,
            mmaps: HashMap::new(),
        })
    }
}

impl RegionExporter for DocaExporter {
    fn name(&self) -> &'static str {
        "doca"
    }

    fn export(&mut self, region: &SharedRegion) -> Result<PciExport, DmaError> {
        let (addr, len) = (region.base_addr(), region.len() as u64);
        let mut mmap = ptr::null_mut();
        let mut descriptor: *const c_void = ptr::null();
        let mut descriptor_len = 0usize;
        // SAFETY: the range is the region's whole live mapping, which the registry keeps
        // mapped until it unexports it; every handle is created here and destroyed on
        // failure; the descriptor DOCA returns lives as long as the mmap and is copied
        // before anything can destroy it.
        unsafe {
            check("doca_mmap_create", sys::doca_mmap_create(&mut mmap))?;
            let setup = (|| {
                check(
                    "doca_mmap_set_memrange",
                    sys::doca_mmap_set_memrange(mmap, addr as *mut c_void, len as usize),
                )?;
                check(
                    "doca_mmap_set_permissions",
                    sys::doca_mmap_set_permissions(
                        mmap,
                        sys::DOCA_ACCESS_FLAG_LOCAL_READ_WRITE
                            | sys::DOCA_ACCESS_FLAG_PCI_READ_WRITE,
                    ),
                )?;
                check("doca_mmap_add_dev", sys::doca_mmap_add_dev(mmap, self.dev))?;
                check("doca_mmap_start", sys::doca_mmap_start(mmap))?;
                check(
                    "doca_mmap_export_pci",
                    sys::doca_mmap_export_pci(mmap, self.dev, &mut descriptor, &mut descriptor_len),
                )
            })();
            if let Err(e) = setup {
                sys::doca_mmap_destroy(mmap);
                return Err(e);
            }
            if descriptor.is_null() || descriptor_len == 0 {
                sys::doca_mmap_stop(mmap);
                sys::doca_mmap_destroy(mmap);
                return Err(DmaError::Engine {
                    engine: "doca",
                    detail: "doca_mmap_export_pci returned an empty descriptor".to_owned(),
                });
            }
            let bytes =
                std::slice::from_raw_parts(descriptor.cast::<u8>(), descriptor_len).to_vec();
            if let Some(old) = self.mmaps.insert((addr, len), mmap) {
                // The same range exported twice (a region unmapped and mapped again at
                // the same address without its unexport): the old one goes.
                sys::doca_mmap_stop(old);
                sys::doca_mmap_destroy(old);
            }
            Ok(PciExport {
                addr,
                len,
                descriptor: bytes,
            })
        }
    }

    fn unexport(&mut self, export: &PciExport) {
        if let Some(mmap) = self.mmaps.remove(&(export.addr, export.len)) {
            // SAFETY: the mmap is ours and destroyed once.
            unsafe {
                sys::doca_mmap_stop(mmap);
                sys::doca_mmap_destroy(mmap);
            }
        }
    }
}

impl Drop for DocaExporter {
    fn drop(&mut self) {
        // SAFETY: every handle is ours and freed once, the device last.
        unsafe {
            for (_, mmap) in self.mmaps.drain() {
                sys::doca_mmap_stop(mmap);
                sys::doca_mmap_destroy(mmap);
            }
            if !self.dev.is_null() {
                sys::doca_dev_close(self.dev);
            }
        }
    }
}
