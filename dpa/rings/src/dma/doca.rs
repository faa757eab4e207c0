//! DOCA DMA: the BlueField's DMA engine behind [`DmaEngine`] (`doca` feature).
//!
//! Each region the manager copies between is registered once as a DOCA mmap over its
//! mapping in this process; a copy batch becomes one memcpy task per job, submitted
//! together and progressed until every task has completed. This covers memory mapped
//! where the manager runs (DPU-local pools, or host-side DOCA DMA between host pools).
//! Host regions seen from the DPU are imported from their PCI export
//! ([`DocaDma::import`]: `RegionExport::hw_export`, `doca_mmap_create_from_export`)
//! and copied to and from with [`DocaDma::transfer`].
//!
//! Compiled (type-checked) wherever the feature is enabled; it needs a BlueField and
//! the DOCA libraries to link and run, and has not been run on hardware.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::ptr;

use doca_sys as sys;

use super::export::PciExport;
use super::reach::{Reach, RemoteId, RemoteSide, SyncRange};
use super::{CopyJob, DmaEngine, DmaError};

pub(super) fn err(call: &str, code: sys::doca_error_t) -> DmaError {
    // SAFETY: doca_error_get_name returns a static NUL-terminated string for any code.
    let name = unsafe {
        let p = sys::doca_error_get_name(code);
        if p.is_null() {
            "unknown".into()
        } else {
            CStr::from_ptr(p).to_string_lossy()
        }
    };
    DmaError::Engine {
        engine: "doca",
        detail: format!("{call} failed: {name} ({code})"),
    }
}

pub(super) fn check(call: &str, code: sys::doca_error_t) -> Result<(), DmaError> {
    if code == sys::DOCA_SUCCESS {
        Ok(())
    } else {
        Err(err(call, code))
    }
}

/// Where a task's completion lands: written by the callbacks, read by `copy`.
#[repr(C)]
struct Done {
    finished: bool,
    status: sys::doca_error_t,
}

unsafe extern "C" fn on_done(
    task: *mut sys::doca_dma_task_memcpy,
    task_user_data: sys::doca_data,
    _ctx_user_data: sys::doca_data,
) {
    // SAFETY: `copy` set the user data to a `Done` it keeps alive until every task of
    // the batch has finished, and DOCA calls back once per task, on the thread that
    // progresses the engine (the one running `copy`).
    unsafe {
        let done = task_user_data.ptr.cast::<Done>();
        let as_task = sys::doca_dma_task_memcpy_as_task(task);
        (*done).status = sys::doca_task_get_status(as_task);
        (*done).finished = true;
        sys::doca_task_free(as_task);
    }
}

/// Opens the DOCA device at PCI address `pci` that `capable` accepts (it returns
/// `DOCA_SUCCESS` for a device with the capability named `what`).
pub(super) fn open_device(
    pci: &str,
    what: &str,
    capable: impl Fn(*const sys::doca_devinfo) -> sys::doca_error_t,
) -> Result<*mut sys::doca_dev, DmaError> {
    let pci_c = std::ffi::CString::new(pci).map_err(|_| DmaError::Engine {
        engine: "doca",
        detail: format!("{pci:?} is not a PCI address"),
    })?;
    let mut list: *mut *mut sys::doca_devinfo = ptr::null_mut();
    let mut count = 0u32;
    // SAFETY: out-pointers to locals; the list is destroyed below on every path.
    check("doca_devinfo_create_list", unsafe {
        sys::doca_devinfo_create_list(&mut list, &mut count)
    })?;
    let mut dev = ptr::null_mut();
    for i in 0..count as usize {
        // SAFETY: `list` has `count` entries.
        let info = unsafe { *list.add(i) };
        let mut equal = 0u8;
        // SAFETY: valid devinfo and NUL-terminated string.
        let same = unsafe { sys::doca_devinfo_is_equal_pci_addr(info, pci_c.as_ptr(), &mut equal) };
        if same == sys::DOCA_SUCCESS && equal == 1 && capable(info) == sys::DOCA_SUCCESS {
            // SAFETY: valid devinfo; `dev` is an out-pointer.
            let opened = unsafe { sys::doca_dev_open(info, &mut dev) };
            if opened != sys::DOCA_SUCCESS {
                // SAFETY: the list is ours.
                unsafe { sys::doca_devinfo_destroy_list(list) };
                return Err(err("doca_dev_open", opened));
            }
            break;
        }
    }
    // SAFETY: the list is ours; an opened device outlives it.
    unsafe { sys::doca_devinfo_destroy_list(list) };
    if dev.is_null() {
        return Err(DmaError::Engine {
            engine: "doca",
            detail: format!(
                "no DOCA device with {what} support at PCI address {pci} ({count} devices found)"
            ),
        });
    }
    Ok(dev)
}

/// The DOCA DMA engine of one device.
pub struct DocaDma {
    dev: *mut sys::doca_dev,
    dma: *mut sys::doca_dma,
    pe: *mut sys::doca_pe,
    inventory: *mut sys::doca_buf_inventory,
    mmaps: HashMap<(u64, usize), *mut sys::doca_mmap>,
    /// Host regions adopted ([`Reach`]), by id.
    remotes: HashMap<RemoteId, RemoteRegion>,
    /// Mirror regions (by base address) whose copies act on a host region.
    aliases: HashMap<u64, RemoteId>,
    next_remote: u32,
    /// Whether the missing wake channel was reported (once).
    told_wake: bool,
}

// SAFETY: the handles are used only by the thread that owns the engine (the DMA
// manager's); DOCA objects may move between threads when not used concurrently.
unsafe impl Send for DocaDma {}

impl std::fmt::Debug for DocaDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocaDma")
            .field("mmaps", &self.mmaps.len())
            .finish_non_exhaustive()
    }
}

const TASKS: u32 = 64;

impl DocaDma {
    /// Opens the device at PCI address `pci` (e.g. `03:00.0`) and starts its DMA
    /// context.
    pub fn open(pci: &str) -> Result<Self, DmaError> {
        // SAFETY: the capability query only reads the devinfo it is given.
        let dev = open_device(pci, "DMA memcpy", |info| unsafe {
            sys::doca_dma_cap_task_memcpy_is_supported(info)
        })?;
        let mut engine = Self {
            dev,
            dma: ptr::null_mut(),
            pe: ptr::null_mut(),
            inventory: ptr::null_mut(),
            mmaps: HashMap::new(),
            remotes: HashMap::new(),
            aliases: HashMap::new(),
            next_remote: 0,
            told_wake: false,
        };
        // SAFETY: each call gets valid handles created just before; failures leave
        // the partially built engine to `Drop`, which frees what exists.
        unsafe {
            check(
                "doca_dma_create",
                sys::doca_dma_create(engine.dev, &mut engine.dma),
            )?;
            check("doca_pe_create", sys::doca_pe_create(&mut engine.pe))?;
            let ctx = sys::doca_dma_as_ctx(engine.dma);
            check(
                "doca_dma_task_memcpy_set_conf",
                sys::doca_dma_task_memcpy_set_conf(engine.dma, Some(on_done), Some(on_done), TASKS),
            )?;
            check(
                "doca_pe_connect_ctx",
                sys::doca_pe_connect_ctx(engine.pe, ctx),
            )?;
            check("doca_ctx_start", sys::doca_ctx_start(ctx))?;
            check(
                "doca_buf_inventory_create",
                sys::doca_buf_inventory_create(2 * TASKS as usize, &mut engine.inventory),
            )?;
            check(
                "doca_buf_inventory_start",
                sys::doca_buf_inventory_start(engine.inventory),
            )?;
        }
        Ok(engine)
    }

    /// The mmap over a region, registered on first use.
    fn mmap(&mut self, region: &crate::shm::SharedRegion) -> Result<*mut sys::doca_mmap, DmaError> {
        let key = (region.base_addr(), region.len());
        if let Some(&m) = self.mmaps.get(&key) {
            return Ok(m);
        }
        let mut m = ptr::null_mut();
        // SAFETY: the region stays mapped while the manager holds its pool (and the
        // manager drops the engine before the pools); the range is the whole mapping.
        unsafe {
            check("doca_mmap_create", sys::doca_mmap_create(&mut m))?;
            let setup = (|| {
                check(
                    "doca_mmap_set_memrange",
                    sys::doca_mmap_set_memrange(m, key.0 as *mut c_void, key.1),
                )?;
                check(
                    "doca_mmap_set_permissions",
                    sys::doca_mmap_set_permissions(
                        m,
                        sys::DOCA_ACCESS_FLAG_LOCAL_READ_WRITE
                            | sys::DOCA_ACCESS_FLAG_PCI_READ_WRITE,
                    ),
                )?;
                check("doca_mmap_add_dev", sys::doca_mmap_add_dev(m, self.dev))?;
                check("doca_mmap_start", sys::doca_mmap_start(m))
            })();
            if let Err(e) = setup {
                sys::doca_mmap_destroy(m);
                return Err(e);
            }
        }
        self.mmaps.insert(key, m);
        Ok(m)
    }
}

/// A region the host exported, imported into a [`DocaDma`] on the DPU
/// (`doca_mmap_create_from_export`): DMA tasks name it by the host's addresses.
#[derive(Debug)]
pub struct RemoteRegion {
    addr: u64,
    len: u64,
    mmap: *mut sys::doca_mmap,
}

// SAFETY: the mmap handle is used by the engine's thread only, during `transfer`.
unsafe impl Send for RemoteRegion {}

impl RemoteRegion {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never, once imported).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for RemoteRegion {
    fn drop(&mut self) {
        // SAFETY: the mmap is this region's own, destroyed once; no task names it
        // once the region is gone (a transfer borrows it).
        unsafe {
            sys::doca_mmap_destroy(self.mmap);
        }
    }
}

/// One end of a transfer: memory mapped here, or a region imported from the host.
#[derive(Debug, Clone, Copy)]
pub enum End<'a> {
    Local(&'a crate::shm::SharedRegion, u64),
    Remote(&'a RemoteRegion, u64),
}

/// One copy between any two ends.
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    pub src: End<'a>,
    pub dst: End<'a>,
    pub len: u64,
}

impl DocaDma {
    /// Imports a region the host exported ([`PciExport`]) through this engine's device.
    pub fn import(&self, export: &PciExport) -> Result<RemoteRegion, DmaError> {
        let mut mmap = ptr::null_mut();
        // SAFETY: the descriptor bytes are live for the call; DOCA checks them (a
        // descriptor it cannot read is an error, not a fault); `mmap` is an out-pointer.
        check("doca_mmap_create_from_export", unsafe {
            sys::doca_mmap_create_from_export(
                ptr::null(),
                export.descriptor.as_ptr().cast(),
                export.descriptor.len(),
                self.dev,
                &mut mmap,
            )
        })?;
        Ok(RemoteRegion {
            addr: export.addr,
            len: export.len,
            mmap,
        })
    }

    /// The mmap and address of `len` bytes at an end, bounds checked.
    fn resolve(&mut self, end: End<'_>, len: u64) -> Result<(*mut sys::doca_mmap, u64), DmaError> {
        let (mmap, base, offset, size) = match end {
            End::Local(region, offset) => (
                self.mmap(region)?,
                region.base_addr(),
                offset,
                region.len() as u64,
            ),
            End::Remote(remote, offset) => (remote.mmap, remote.addr, offset, remote.len),
        };
        // Bounds first: DOCA would fault on a bad range.
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(DmaError::Engine {
                engine: "doca",
                detail: format!("copy of {len} bytes at {offset} outside its {size}-byte region"),
            });
        }
        Ok((mmap, base + offset))
    }

    /// Copies every transfer (host to host, host to DPU, DPU to host, local); returns
    /// when all have landed, or the first error. The DMA manager's copies on imported
    /// regions come through here (docs/data-path.md, "On a BlueField", layer 2).
    pub fn transfer(&mut self, jobs: &[Transfer<'_>]) -> Result<(), DmaError> {
        self.run(jobs.len(), |i| jobs[i])
    }

    /// Submits `count` jobs (`job(i)`) in chunks the context takes, progressing each
    /// chunk to completion.
    fn run<'j>(
        &mut self,
        count: usize,
        job: impl Fn(usize) -> Transfer<'j>,
    ) -> Result<(), DmaError> {
        let mut start = 0;
        while start < count {
            let chunk = (count - start).min(TASKS as usize);
            let mut done: Vec<Done> = (0..chunk)
                .map(|_| Done {
                    finished: false,
                    status: sys::DOCA_SUCCESS,
                })
                .collect();
            let mut bufs: Vec<*mut sys::doca_buf> = Vec::new();
            let mut submitted = 0usize;
            let mut first_error = None;
            for (k, slot) in done.iter_mut().enumerate() {
                let t = job(start + k);
                let ends = self
                    .resolve(t.src, t.len)
                    .and_then(|src| Ok((src, self.resolve(t.dst, t.len)?)));
                let ((src_mmap, src_addr), (dst_mmap, dst_addr)) = match ends {
                    Ok(ends) => ends,
                    Err(e) => {
                        first_error = Some(e);
                        break;
                    }
                };
                let (mut src_buf, mut dst_buf) = (ptr::null_mut(), ptr::null_mut());
                let mut task = ptr::null_mut();
                // SAFETY: ranges checked above lie in mmaps registered over live
                // mappings or imported host regions; `slot` outlives the task (we
                // progress until it finishes).
                let result = unsafe {
                    check(
                        "doca_buf_inventory_buf_get_by_data",
                        sys::doca_buf_inventory_buf_get_by_data(
                            self.inventory,
                            src_mmap,
                            src_addr as *mut c_void,
                            t.len as usize,
                            &mut src_buf,
                        ),
                    )
                    .and_then(|()| {
                        check(
                            "doca_buf_inventory_buf_get_by_addr",
                            sys::doca_buf_inventory_buf_get_by_addr(
                                self.inventory,
                                dst_mmap,
                                dst_addr as *mut c_void,
                                t.len as usize,
                                &mut dst_buf,
                            ),
                        )
                    })
                    .and_then(|()| {
                        check(
                            "doca_dma_task_memcpy_alloc_init",
                            sys::doca_dma_task_memcpy_alloc_init(
                                self.dma,
                                src_buf,
                                dst_buf,
                                sys::doca_data {
                                    ptr: (slot as *mut Done).cast(),
                                },
                                &mut task,
                            ),
                        )
                    })
                    .and_then(|()| {
                        let t = sys::doca_dma_task_memcpy_as_task(task);
                        let submitted = sys::doca_task_submit(t);
                        if submitted != sys::DOCA_SUCCESS {
                            sys::doca_task_free(t);
                        }
                        check("doca_task_submit", submitted)
                    })
                };
                bufs.extend([src_buf, dst_buf].into_iter().filter(|b| !b.is_null()));
                match result {
                    Ok(()) => submitted += 1,
                    Err(e) => {
                        first_error = Some(e);
                        break;
                    }
                }
            }
            // Progress until every submitted task has called back.
            while done[..submitted].iter().any(|d| !d.finished) {
                // SAFETY: the progress engine is ours; callbacks write into `done`.
                if unsafe { sys::doca_pe_progress(self.pe) } == 0 {
                    std::hint::spin_loop();
                }
            }
            for b in bufs {
                // SAFETY: each buffer came from the inventory above and is released once.
                unsafe { sys::doca_buf_dec_refcount(b, ptr::null_mut()) };
            }
            if let Some(e) = first_error {
                return Err(e);
            }
            if let Some(d) = done.iter().find(|d| d.status != sys::DOCA_SUCCESS) {
                return Err(err("DMA memcpy task", d.status));
            }
            start += chunk;
        }
        Ok(())
    }
}

impl DocaDma {
    fn remote(&self, id: RemoteId) -> Result<&RemoteRegion, DmaError> {
        self.remotes.get(&id).ok_or_else(|| DmaError::Engine {
            engine: "doca",
            detail: format!("no imported region {}", id.0),
        })
    }

    /// Runs `ranges` as transfers, remote to local (`pull`) or local to remote.
    fn sync(&mut self, ranges: &[SyncRange<'_>], pull: bool) -> Result<(), DmaError> {
        let mut ends = Vec::with_capacity(ranges.len());
        for r in ranges {
            let remote: *const RemoteRegion = self.remote(r.remote)?;
            ends.push((remote, r));
        }
        self.run(ends.len(), |i| {
            let (remote, r) = ends[i];
            // SAFETY: the regions stay in `self.remotes` for the whole call: `run`
            // adopts and releases nothing.
            let remote = unsafe { &*remote };
            let (far, near) = (End::Remote(remote, r.offset), End::Local(r.local, r.offset));
            let (src, dst) = if pull { (far, near) } else { (near, far) };
            Transfer {
                src,
                dst,
                len: r.len,
            }
        })
    }
}

impl Reach for DocaDma {
    fn adopt(&mut self, side: &RemoteSide) -> Result<RemoteId, DmaError> {
        let RemoteSide::Pci(export) = side else {
            return Err(DmaError::Engine {
                engine: "doca",
                detail: "a region of this machine is not on the other side of PCIe".to_owned(),
            });
        };
        let region = self.import(export)?;
        self.next_remote += 1;
        let id = RemoteId(self.next_remote);
        self.remotes.insert(id, region);
        Ok(id)
    }

    fn release(&mut self, id: RemoteId) {
        self.aliases.retain(|_, r| *r != id);
        self.remotes.remove(&id);
    }

    fn pull(&mut self, ranges: &[SyncRange<'_>]) -> Result<(), DmaError> {
        self.sync(ranges, true)
    }

    fn push(&mut self, ranges: &[SyncRange<'_>]) -> Result<(), DmaError> {
        self.sync(ranges, false)
    }

    fn alias(&mut self, mirror: &crate::shm::SharedRegion, remote: RemoteId) {
        self.aliases.insert(mirror.base_addr(), remote);
    }

    fn wake(&mut self, pod: u32) {
        // The wake event to the host agent travels over Comch (layer 3, not written):
        // until then a pod on a BlueField host must poll its ring.
        if !self.told_wake {
            self.told_wake = true;
            tracing::warn!(
                pod,
                "no wake channel to the host yet: host pods must poll their rings"
            );
        }
    }
}

impl DmaEngine for DocaDma {
    fn name(&self) -> &'static str {
        "doca"
    }

    fn reach(&mut self) -> Option<&mut dyn Reach> {
        Some(self)
    }

    fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError> {
        self.run(jobs.len(), |i| Transfer {
            src: End::Local(jobs[i].src, jobs[i].src_offset),
            dst: End::Local(jobs[i].dst, jobs[i].dst_offset),
            len: jobs[i].len,
        })
    }
}

impl Drop for DocaDma {
    fn drop(&mut self) {
        // Imported regions first: their mmaps name the device.
        self.aliases.clear();
        self.remotes.clear();
        // SAFETY: every handle is ours and freed once, in reverse order of creation.
        unsafe {
            for (_, m) in self.mmaps.drain() {
                sys::doca_mmap_stop(m);
                sys::doca_mmap_destroy(m);
            }
            if !self.inventory.is_null() {
                sys::doca_buf_inventory_stop(self.inventory);
                sys::doca_buf_inventory_destroy(self.inventory);
            }
            if !self.dma.is_null() {
                let ctx = sys::doca_dma_as_ctx(self.dma);
                sys::doca_ctx_stop(ctx);
                // Stopping completes through the progress engine.
                let mut state = sys::DOCA_CTX_STATE_STOPPING;
                for _ in 0..1_000_000 {
                    if sys::doca_ctx_get_state(ctx, &mut state) != sys::DOCA_SUCCESS
                        || state == sys::DOCA_CTX_STATE_IDLE
                    {
                        break;
                    }
                    sys::doca_pe_progress(self.pe);
                }
                sys::doca_dma_destroy(self.dma);
            }
            if !self.pe.is_null() {
                sys::doca_pe_destroy(self.pe);
            }
            if !self.dev.is_null() {
                sys::doca_dev_close(self.dev);
            }
        }
    }
}
