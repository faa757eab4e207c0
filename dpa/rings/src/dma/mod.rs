//! DMA engines: what copies buffers between pools for the DMA manager. The software
//! engine is `memcpy` between mapped regions (the product on machines without a
//! DPU); the `doca` feature adds DOCA DMA, which posts memcpy tasks to the BlueField's
//! engine and progresses them to completion.
//!
//! An engine copies a batch and returns when all of it has landed, which is how the
//! DMA manager uses its engine: post the jobs of one descriptor,
//! wait for their completions, then write the next ring.

#[cfg(feature = "doca")]
pub mod doca;
#[cfg(feature = "doca")]
pub mod doca_export;
pub mod export;
pub mod manager;
pub mod reach;

use crate::shm::{SharedRegion, ShmError};

/// One copy.
#[derive(Debug, Clone, Copy)]
pub struct CopyJob<'a> {
    pub src: &'a SharedRegion,
    /// Offset in the source.
    pub src_offset: u64,
    pub dst: &'a SharedRegion,
    /// Offset in the destination.
    pub dst_offset: u64,
    pub len: u64,
}

/// Why a copy failed.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// A range outside its region.
    #[error(transparent)]
    Bounds(#[from] ShmError),
    /// The hardware engine failed.
    #[error("DMA engine {engine}: {detail}")]
    Engine {
        engine: &'static str,
        /// What it said.
        detail: String,
    },
}

/// Copies buffers between regions.
pub trait DmaEngine: Send + 'static {
    /// A name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Copies every job; returns when all have landed, or the first error.
    fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError>;

    /// Its reach across PCIe, if it has one (see [`reach`]): what a manager whose
    /// pods' regions are on the other side needs.
    fn reach(&mut self) -> Option<&mut dyn reach::Reach> {
        None
    }
}

/// The software engine: bounds-checked `memcpy` between mapped regions.
#[derive(Debug, Default, Clone, Copy)]
pub struct SoftwareDma;

impl DmaEngine for SoftwareDma {
    fn name(&self) -> &'static str {
        "software"
    }

    fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError> {
        for job in jobs {
            job.dst
                .copy_from(job.dst_offset, job.src, job.src_offset, job.len)?;
        }
        Ok(())
    }
}

/// A boxed engine is an engine (a node picks its shards' engines at run time).
impl DmaEngine for Box<dyn DmaEngine> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError> {
        (**self).copy(jobs)
    }

    fn reach(&mut self) -> Option<&mut dyn reach::Reach> {
        (**self).reach()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_software_engine_copies_between_regions_and_checks_bounds() {
        let a = SharedRegion::create_unique("dpumesh-test-dma", 1 << 20).unwrap();
        let b = SharedRegion::create_unique("dpumesh-test-dma", 1 << 20).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        a.write(4096, &data).unwrap();
        let mut dma = SoftwareDma;
        dma.copy(&[CopyJob {
            src: &a,
            src_offset: 4096,
            dst: &b,
            dst_offset: 8,
            len: data.len() as u64,
        }])
        .unwrap();
        assert_eq!(b.read_vec(8, data.len()).unwrap(), data);
        let err = dma
            .copy(&[CopyJob {
                src: &a,
                src_offset: (1 << 20) - 10,
                dst: &b,
                dst_offset: 0,
                len: 11,
            }])
            .unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
    }
}
