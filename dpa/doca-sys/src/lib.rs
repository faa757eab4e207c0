//! Hand-written FFI for the few NVIDIA DOCA calls DPUmesh uses: devices, memory maps
//! (export over PCI and import), the buffer inventory, the progress engine and tasks,
//! DOCA DMA memcpy, and DOCA Comch (the host↔DPU communication channel).
//!
//! No crate binds DOCA and its headers are not redistributable, so the declarations
//! are written from the DOCA headers (`doca_dev.h`, `doca_error.h`, `doca_types.h`,
//! `doca_mmap.h`, `doca_buf.h`, `doca_buf_inventory.h`, `doca_pe.h`, `doca_ctx.h`,
//! `doca_dma.h`, `doca_comch.h`) of DOCA 2.7 and later (Comch first appears in 2.7).
//! C enums are `c_int`/`u32` with constants, never Rust enums: a code a newer DOCA adds
//! must not be undefined behaviour here.
//!
//! Linking: `libdoca_common`, `libdoca_dma`, `libdoca_comch` from
//! `/opt/mellanox/doca/lib/<arch>-linux-gnu`; set `DOCA_LIB_DIR` to override. The
//! `link` attributes are on the extern blocks, so only binaries that call these
//! functions need the libraries.
#![allow(unsafe_code, non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            #[repr(C)]
            pub struct $name {
                _data: [u8; 0],
                _marker: PhantomData<(*mut u8, PhantomPinned)>,
            }
        )*
    };
}

opaque!(
    doca_devinfo,
    doca_devinfo_rep,
    doca_dev,
    doca_dev_rep,
    doca_mmap,
    doca_buf,
    doca_buf_inventory,
    doca_pe,
    doca_ctx,
    doca_task,
    doca_dma,
    doca_dma_task_memcpy,
    doca_comch_server,
    doca_comch_client,
    doca_comch_connection,
    doca_comch_task_send,
    doca_comch_event_msg_recv,
    doca_comch_event_connection_status_changed,
);

/// `doca_error_t`.
pub type doca_error_t = c_int;
pub const DOCA_SUCCESS: doca_error_t = 0;
pub const DOCA_ERROR_UNKNOWN: doca_error_t = 1;
pub const DOCA_ERROR_NOT_PERMITTED: doca_error_t = 2;
pub const DOCA_ERROR_IN_USE: doca_error_t = 3;
pub const DOCA_ERROR_NOT_SUPPORTED: doca_error_t = 4;
pub const DOCA_ERROR_AGAIN: doca_error_t = 5;
pub const DOCA_ERROR_INVALID_VALUE: doca_error_t = 6;
pub const DOCA_ERROR_NO_MEMORY: doca_error_t = 7;
pub const DOCA_ERROR_INITIALIZATION: doca_error_t = 8;
pub const DOCA_ERROR_TIME_OUT: doca_error_t = 9;
pub const DOCA_ERROR_SHUTDOWN: doca_error_t = 10;
pub const DOCA_ERROR_CONNECTION_RESET: doca_error_t = 11;
pub const DOCA_ERROR_CONNECTION_ABORTED: doca_error_t = 12;
pub const DOCA_ERROR_CONNECTION_INPROGRESS: doca_error_t = 13;
pub const DOCA_ERROR_NOT_CONNECTED: doca_error_t = 14;
pub const DOCA_ERROR_NO_LOCK: doca_error_t = 15;
pub const DOCA_ERROR_NOT_FOUND: doca_error_t = 16;
pub const DOCA_ERROR_IO_FAILED: doca_error_t = 17;
pub const DOCA_ERROR_BAD_STATE: doca_error_t = 18;
pub const DOCA_ERROR_UNSUPPORTED_VERSION: doca_error_t = 19;
pub const DOCA_ERROR_OPERATING_SYSTEM: doca_error_t = 20;
pub const DOCA_ERROR_DRIVER: doca_error_t = 21;
pub const DOCA_ERROR_UNEXPECTED: doca_error_t = 22;
pub const DOCA_ERROR_ALREADY_EXIST: doca_error_t = 23;
pub const DOCA_ERROR_FULL: doca_error_t = 24;
pub const DOCA_ERROR_EMPTY: doca_error_t = 25;
pub const DOCA_ERROR_IN_PROGRESS: doca_error_t = 26;
pub const DOCA_ERROR_TOO_BIG: doca_error_t = 27;

/// `union doca_data` (8 bytes, passed by value).
#[repr(C)]
#[derive(Clone, Copy)]
pub union doca_data {
    pub ptr: *mut c_void,
    pub u64_: u64,
}

/// `enum doca_access_flag` bits.
pub const DOCA_ACCESS_FLAG_LOCAL_READ_ONLY: u32 = 0;
pub const DOCA_ACCESS_FLAG_LOCAL_READ_WRITE: u32 = 1 << 0;
pub const DOCA_ACCESS_FLAG_RDMA_READ: u32 = 1 << 1;
pub const DOCA_ACCESS_FLAG_RDMA_WRITE: u32 = 1 << 2;
pub const DOCA_ACCESS_FLAG_RDMA_ATOMIC: u32 = 1 << 3;
pub const DOCA_ACCESS_FLAG_PCI_READ_ONLY: u32 = 1 << 4;
pub const DOCA_ACCESS_FLAG_PCI_READ_WRITE: u32 = 1 << 5;
pub const DOCA_ACCESS_FLAG_PCI_RELAXED_ORDERING: u32 = 1 << 6;

/// `enum doca_devinfo_rep_filter`.
pub const DOCA_DEVINFO_REP_FILTER_ALL: c_int = 0;
pub const DOCA_DEVINFO_REP_FILTER_NET: c_int = 1 << 1;
pub const DOCA_DEVINFO_REP_FILTER_EMULATED: c_int = 1 << 2;
/// Size of a PCI address string buffer, with its NUL.
pub const DOCA_DEVINFO_PCI_ADDR_SIZE: usize = 13;

/// `enum doca_ctx_states`.
pub const DOCA_CTX_STATE_IDLE: c_int = 0;
pub const DOCA_CTX_STATE_STARTING: c_int = 1;
pub const DOCA_CTX_STATE_RUNNING: c_int = 2;
pub const DOCA_CTX_STATE_STOPPING: c_int = 3;

pub type doca_dma_task_memcpy_completion_cb_t = Option<
    unsafe extern "C" fn(
        task: *mut doca_dma_task_memcpy,
        task_user_data: doca_data,
        ctx_user_data: doca_data,
    ),
>;
pub type doca_comch_task_send_completion_cb_t = Option<
    unsafe extern "C" fn(
        task: *mut doca_comch_task_send,
        task_user_data: doca_data,
        ctx_user_data: doca_data,
    ),
>;
pub type doca_comch_event_msg_recv_cb_t = Option<
    unsafe extern "C" fn(
        event: *mut doca_comch_event_msg_recv,
        recv_buffer: *mut u8,
        msg_len: u32,
        connection: *mut doca_comch_connection,
    ),
>;
pub type doca_comch_event_connection_status_changed_cb_t = Option<
    unsafe extern "C" fn(
        event: *mut doca_comch_event_connection_status_changed,
        connection: *mut doca_comch_connection,
        change_successful: u8,
    ),
>;

#[link(name = "doca_common")]
unsafe extern "C" {
    pub fn doca_error_get_name(error: doca_error_t) -> *const c_char;
    pub fn doca_error_get_descr(error: doca_error_t) -> *const c_char;

    pub fn doca_devinfo_create_list(
        dev_list: *mut *mut *mut doca_devinfo,
        nb_devs: *mut u32,
    ) -> doca_error_t;
    pub fn doca_devinfo_destroy_list(dev_list: *mut *mut doca_devinfo) -> doca_error_t;
    pub fn doca_devinfo_get_pci_addr_str(
        devinfo: *const doca_devinfo,
        pci_addr_str: *mut c_char,
    ) -> doca_error_t;
    pub fn doca_devinfo_is_equal_pci_addr(
        devinfo: *const doca_devinfo,
        pci_addr_str: *const c_char,
        is_equal: *mut u8,
    ) -> doca_error_t;
    pub fn doca_dev_open(devinfo: *mut doca_devinfo, dev: *mut *mut doca_dev) -> doca_error_t;
    pub fn doca_dev_close(dev: *mut doca_dev) -> doca_error_t;
    pub fn doca_dev_as_devinfo(dev: *const doca_dev) -> *mut doca_devinfo;
    pub fn doca_devinfo_rep_create_list(
        dev: *mut doca_dev,
        filter: c_int,
        dev_list_rep: *mut *mut *mut doca_devinfo_rep,
        nb_devs_rep: *mut u32,
    ) -> doca_error_t;
    pub fn doca_devinfo_rep_destroy_list(dev_list_rep: *mut *mut doca_devinfo_rep) -> doca_error_t;
    pub fn doca_devinfo_rep_is_equal_pci_addr(
        devinfo_rep: *const doca_devinfo_rep,
        pci_addr_str: *const c_char,
        is_equal: *mut u8,
    ) -> doca_error_t;
    pub fn doca_dev_rep_open(
        devinfo: *mut doca_devinfo_rep,
        dev_rep: *mut *mut doca_dev_rep,
    ) -> doca_error_t;
    pub fn doca_dev_rep_close(dev: *mut doca_dev_rep) -> doca_error_t;

    pub fn doca_mmap_create(mmap: *mut *mut doca_mmap) -> doca_error_t;
    pub fn doca_mmap_destroy(mmap: *mut doca_mmap) -> doca_error_t;
    pub fn doca_mmap_start(mmap: *mut doca_mmap) -> doca_error_t;
    pub fn doca_mmap_stop(mmap: *mut doca_mmap) -> doca_error_t;
    pub fn doca_mmap_set_memrange(
        mmap: *mut doca_mmap,
        addr: *mut c_void,
        len: usize,
    ) -> doca_error_t;
    pub fn doca_mmap_set_permissions(mmap: *mut doca_mmap, access_mask: u32) -> doca_error_t;
    pub fn doca_mmap_add_dev(mmap: *mut doca_mmap, dev: *mut doca_dev) -> doca_error_t;
    pub fn doca_mmap_export_pci(
        mmap: *mut doca_mmap,
        dev: *const doca_dev,
        export_desc: *mut *const c_void,
        export_desc_len: *mut usize,
    ) -> doca_error_t;
    pub fn doca_mmap_create_from_export(
        user_data: *const doca_data,
        export_desc: *const c_void,
        export_desc_len: usize,
        dev: *mut doca_dev,
        mmap: *mut *mut doca_mmap,
    ) -> doca_error_t;

    pub fn doca_buf_inventory_create(
        num_elements: usize,
        inventory: *mut *mut doca_buf_inventory,
    ) -> doca_error_t;
    pub fn doca_buf_inventory_destroy(inventory: *mut doca_buf_inventory) -> doca_error_t;
    pub fn doca_buf_inventory_start(inventory: *mut doca_buf_inventory) -> doca_error_t;
    pub fn doca_buf_inventory_stop(inventory: *mut doca_buf_inventory) -> doca_error_t;
    /// The exported call behind the header's `static inline` `buf_get_by_addr` and
    /// `buf_get_by_data` (see [`doca_buf_inventory_buf_get_by_addr`]).
    pub fn doca_buf_inventory_buf_get_by_args(
        inventory: *mut doca_buf_inventory,
        mmap: *mut doca_mmap,
        addr: *mut c_void,
        len: usize,
        data: *mut c_void,
        data_len: usize,
        buf: *mut *mut doca_buf,
    ) -> doca_error_t;
    pub fn doca_buf_dec_refcount(buf: *mut doca_buf, refcount: *mut u16) -> doca_error_t;
    pub fn doca_buf_set_data(
        buf: *mut doca_buf,
        data: *mut c_void,
        data_len: usize,
    ) -> doca_error_t;
    pub fn doca_buf_get_data_len(buf: *const doca_buf, data_len: *mut usize) -> doca_error_t;

    pub fn doca_pe_create(pe: *mut *mut doca_pe) -> doca_error_t;
    pub fn doca_pe_destroy(pe: *mut doca_pe) -> doca_error_t;
    pub fn doca_pe_connect_ctx(pe: *mut doca_pe, ctx: *mut doca_ctx) -> doca_error_t;
    /// Returns 0 when no completion was processed (not a `doca_error_t`).
    pub fn doca_pe_progress(pe: *mut doca_pe) -> u8;

    pub fn doca_ctx_start(ctx: *mut doca_ctx) -> doca_error_t;
    pub fn doca_ctx_stop(ctx: *mut doca_ctx) -> doca_error_t;
    pub fn doca_ctx_get_state(ctx: *const doca_ctx, state: *mut c_int) -> doca_error_t;
    pub fn doca_ctx_set_user_data(ctx: *mut doca_ctx, user_data: doca_data) -> doca_error_t;

    pub fn doca_task_submit(task: *mut doca_task) -> doca_error_t;
    pub fn doca_task_free(task: *mut doca_task);
    pub fn doca_task_get_status(task: *const doca_task) -> doca_error_t;
}

#[link(name = "doca_dma")]
unsafe extern "C" {
    pub fn doca_dma_create(dev: *mut doca_dev, dma: *mut *mut doca_dma) -> doca_error_t;
    pub fn doca_dma_destroy(dma: *mut doca_dma) -> doca_error_t;
    pub fn doca_dma_as_ctx(dma: *mut doca_dma) -> *mut doca_ctx;
    pub fn doca_dma_cap_task_memcpy_is_supported(devinfo: *const doca_devinfo) -> doca_error_t;
    pub fn doca_dma_cap_task_memcpy_get_max_buf_size(
        devinfo: *const doca_devinfo,
        buf_size: *mut u64,
    ) -> doca_error_t;
    pub fn doca_dma_task_memcpy_set_conf(
        dma: *mut doca_dma,
        task_completion_cb: doca_dma_task_memcpy_completion_cb_t,
        task_error_cb: doca_dma_task_memcpy_completion_cb_t,
        num_memcpy_tasks: u32,
    ) -> doca_error_t;
    pub fn doca_dma_task_memcpy_alloc_init(
        dma: *mut doca_dma,
        src: *const doca_buf,
        dst: *mut doca_buf,
        user_data: doca_data,
        task: *mut *mut doca_dma_task_memcpy,
    ) -> doca_error_t;
    pub fn doca_dma_task_memcpy_as_task(task: *mut doca_dma_task_memcpy) -> *mut doca_task;
}

#[link(name = "doca_comch")]
unsafe extern "C" {
    pub fn doca_comch_cap_get_max_msg_size(
        devinfo: *const doca_devinfo,
        size: *mut u32,
    ) -> doca_error_t;
    pub fn doca_comch_cap_server_is_supported(devinfo: *const doca_devinfo) -> doca_error_t;
    pub fn doca_comch_cap_client_is_supported(devinfo: *const doca_devinfo) -> doca_error_t;

    pub fn doca_comch_server_create(
        dev: *mut doca_dev,
        repr: *mut doca_dev_rep,
        name: *const c_char,
        server: *mut *mut doca_comch_server,
    ) -> doca_error_t;
    pub fn doca_comch_server_destroy(server: *mut doca_comch_server) -> doca_error_t;
    pub fn doca_comch_server_as_ctx(server: *mut doca_comch_server) -> *mut doca_ctx;
    pub fn doca_comch_server_set_max_msg_size(
        server: *mut doca_comch_server,
        size: u32,
    ) -> doca_error_t;
    pub fn doca_comch_server_task_send_set_conf(
        server: *mut doca_comch_server,
        task_completion_cb: doca_comch_task_send_completion_cb_t,
        task_error_cb: doca_comch_task_send_completion_cb_t,
        num_send_tasks: u32,
    ) -> doca_error_t;
    pub fn doca_comch_server_task_send_alloc_init(
        server: *mut doca_comch_server,
        peer: *mut doca_comch_connection,
        msg: *const c_void,
        len: u32,
        task: *mut *mut doca_comch_task_send,
    ) -> doca_error_t;
    pub fn doca_comch_server_event_msg_recv_register(
        server: *mut doca_comch_server,
        recv_event_cb: doca_comch_event_msg_recv_cb_t,
    ) -> doca_error_t;
    pub fn doca_comch_server_event_connection_status_changed_register(
        server: *mut doca_comch_server,
        connect_event_cb: doca_comch_event_connection_status_changed_cb_t,
        disconnect_event_cb: doca_comch_event_connection_status_changed_cb_t,
    ) -> doca_error_t;

    pub fn doca_comch_client_create(
        dev: *mut doca_dev,
        name: *const c_char,
        client: *mut *mut doca_comch_client,
    ) -> doca_error_t;
    pub fn doca_comch_client_destroy(client: *mut doca_comch_client) -> doca_error_t;
    pub fn doca_comch_client_as_ctx(client: *mut doca_comch_client) -> *mut doca_ctx;
    pub fn doca_comch_client_set_max_msg_size(
        client: *mut doca_comch_client,
        size: u32,
    ) -> doca_error_t;
    pub fn doca_comch_client_get_connection(
        client: *const doca_comch_client,
        connection: *mut *mut doca_comch_connection,
    ) -> doca_error_t;
    pub fn doca_comch_client_task_send_set_conf(
        client: *mut doca_comch_client,
        task_completion_cb: doca_comch_task_send_completion_cb_t,
        task_error_cb: doca_comch_task_send_completion_cb_t,
        num_send_tasks: u32,
    ) -> doca_error_t;
    pub fn doca_comch_client_task_send_alloc_init(
        client: *mut doca_comch_client,
        peer: *mut doca_comch_connection,
        msg: *const c_void,
        len: u32,
        task: *mut *mut doca_comch_task_send,
    ) -> doca_error_t;
    pub fn doca_comch_client_event_msg_recv_register(
        client: *mut doca_comch_client,
        recv_event_cb: doca_comch_event_msg_recv_cb_t,
    ) -> doca_error_t;

    pub fn doca_comch_task_send_as_task(task: *mut doca_comch_task_send) -> *mut doca_task;
    pub fn doca_comch_connection_set_user_data(
        connection: *mut doca_comch_connection,
        user_data: doca_data,
    ) -> doca_error_t;
    pub fn doca_comch_connection_get_user_data(
        connection: *const doca_comch_connection,
    ) -> doca_data;
}

/// The header's `static inline doca_buf_inventory_buf_get_by_addr`: a buffer over
/// `[addr, addr + len)` with no data yet.
///
/// # Safety
/// As `doca_buf_inventory_buf_get_by_args`: valid, started inventory and mmap, and a
/// range inside the mmap.
pub unsafe fn doca_buf_inventory_buf_get_by_addr(
    inventory: *mut doca_buf_inventory,
    mmap: *mut doca_mmap,
    addr: *mut c_void,
    len: usize,
    buf: *mut *mut doca_buf,
) -> doca_error_t {
    // SAFETY: forwarded as the header's inline body does; the caller upholds it.
    unsafe { doca_buf_inventory_buf_get_by_args(inventory, mmap, addr, len, addr, 0, buf) }
}

/// The header's `static inline doca_buf_inventory_buf_get_by_data`: a buffer whose
/// data is the whole range.
///
/// # Safety
/// As [`doca_buf_inventory_buf_get_by_addr`].
pub unsafe fn doca_buf_inventory_buf_get_by_data(
    inventory: *mut doca_buf_inventory,
    mmap: *mut doca_mmap,
    data: *mut c_void,
    data_len: usize,
    buf: *mut *mut doca_buf,
) -> doca_error_t {
    // SAFETY: forwarded as the header's inline body does; the caller upholds it.
    unsafe {
        doca_buf_inventory_buf_get_by_args(inventory, mmap, data, data_len, data, data_len, buf)
    }
}
