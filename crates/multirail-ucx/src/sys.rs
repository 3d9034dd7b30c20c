//! Hand-written FFI declarations for the part of UCP this crate uses, and the table of function
//! pointers resolved from a `dlopen`ed libucp.
//!
//! Every struct below mirrors the **UCX 1.22** layout (`libucx-cu12` 1.22.0 wheel,
//! `include/ucp/api/ucp.h`), which is a superset of the **UCX 1.13** layout (Debian 12
//! `libucx-dev` 1.13.1, `/usr/include/ucp/api/ucp.h`): 1.13 structs are prefixes of the 1.22
//! ones, and every field this crate sets has the same offset in both (checked with
//! `tools/layout.c` compiled against both header sets; the offsets are asserted at compile time
//! below). UCP reads only the fields whose bit is set in `field_mask`, and we only set bits that
//! exist in 1.13, so handing a 1.22-sized struct to a 1.13 library is fine.
//!
//! Enum values and flag bits used here are identical in 1.13 and 1.22. `ucs_status_t` is declared
//! `UCS_S_PACKED` (`__attribute__((packed))`), so it is **one byte** (`i8`) in both versions.
//!
//! Three functions used here are marked deprecated in 1.22 (`ucp_worker_get_address`,
//! `ucp_rkey_pack`, `ucp_rkey_buffer_release`, moved to `ucp_compat.h`) but are still exported;
//! their replacements (`ucp_worker_query`, `ucp_memh_pack`) do not exist in 1.13.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use libloading::os::unix::Library;

/// `ucs_status_t`: a packed enum, one byte.
pub type ucs_status_t = i8;
/// `ucs_status_ptr_t`: a request pointer, NULL (`UCS_OK`) or an error code cast to a pointer.
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_context_h = *mut c_void;
pub type ucp_config_t = c_void;
pub type ucp_worker_h = *mut c_void;
pub type ucp_ep_h = *mut c_void;
pub type ucp_mem_h = *mut c_void;
pub type ucp_rkey_h = *mut c_void;
pub type ucp_address_t = c_void;

/// `ucp_err_handler_cb_t`.
pub type ucp_err_handler_cb_t = Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;
/// `ucp_send_nbx_callback_t` (we poll requests instead, so it is never set).
pub type ucp_send_nbx_callback_t = Option<unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void)>;

// ---- enum values and flag bits (identical in 1.13 and 1.22) ----

/// `enum ucp_feature`.
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;
/// `enum ucp_params_field`.
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
/// `enum ucp_worker_params_field`.
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `ucs_thread_mode_t` (a plain `int` enum).
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
/// `enum ucp_ep_params_field`.
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `ucp_err_handling_mode_t` (a plain `int` enum).
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
/// `enum ucp_mem_map_params_field`.
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
/// `ucs_memory_type_t` (`ucp_mem_map_params_t::memory_type`).
pub const UCS_MEMORY_TYPE_HOST: c_int = 0;
pub const UCS_MEMORY_TYPE_CUDA: c_int = 1;
/// `enum ucp_mem_map_prot` (`ucp_mem_map_params_t::prot`).
pub const UCP_MEM_MAP_PROT_LOCAL_READ: u32 = 1 << 0;
pub const UCP_MEM_MAP_PROT_LOCAL_WRITE: u32 = 1 << 1;
pub const UCP_MEM_MAP_PROT_REMOTE_READ: u32 = 1 << 8;
pub const UCP_MEM_MAP_PROT_REMOTE_WRITE: u32 = 1 << 9;
/// `ucp_op_attr_t`.
pub const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;
/// `ucp_ep_close_flags_t`.
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
/// `enum ucp_dt_type`: `ucp_dt_make_iov()`.
pub const UCP_DATATYPE_IOV: u64 = 2;
/// `ucp_dt_make_contig(1)`: bytes.
pub const UCP_DATATYPE_CONTIG_BYTES: u64 = 1 << 3;
/// `enum ucp_send_am_flags`: eager protocol only (never rendezvous).
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
/// `enum ucp_send_am_flags`: the receiver gets an endpoint to answer on (`reply_ep`).
pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1 << 0;
/// `ucp_am_recv_attr_t`: `reply_ep` is set (the sender asked for it).
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
/// `enum ucp_am_cb_flags`: the whole message in one callback.
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
/// `ucp_am_recv_attr_t`: data may be kept (returning `UCS_INPROGRESS`); we never keep it.
pub const UCP_AM_RECV_ATTR_FLAG_DATA: u64 = 1 << 16;
/// `ucp_am_recv_attr_t`: `data` is a rendezvous descriptor, not the bytes.
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;
/// `enum ucp_am_handler_param_field`.
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
/// `enum ucp_ep_attr_field`. `TRANSPORTS` exists from UCX 1.14 on (not in 1.13).
pub const UCP_EP_ATTR_FIELD_TRANSPORTS: u64 = 1 << 3;

// ---- structs ----

/// `ucp_params_t` (1.22: 88 bytes; 1.13: 80, without `node_local_id`).
#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    pub request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
    /// 1.22 only (`UCP_PARAM_FIELD_NODE_LOCAL_ID`, never set here).
    pub node_local_id: usize,
}

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
pub struct ucs_cpu_set_t {
    pub ucs_bits: [u64; 16],
}

/// `ucp_worker_params_t` (200 bytes in both 1.13 and 1.22).
#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: ucs_cpu_set_t,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucp_err_handler_t`.
#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: ucp_err_handler_cb_t,
    pub arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const libc::sockaddr,
    pub addrlen: libc::socklen_t,
}

/// `ucp_ep_params_t` (104 bytes in both 1.13 and 1.22).
#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: c_int,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

/// `ucp_mem_map_params_t` (1.22: 48 bytes; 1.13: 40, without `exported_memh_buffer`).
#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
    /// 1.22 only (never set here).
    pub exported_memh_buffer: *const c_void,
}

/// `ucp_request_param_t` (1.22: 96 bytes; 1.13: 72, without the `remote*` fields). The unions
/// `cb` and `recv_info` hold one pointer each.
#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_send_nbx_callback_t,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: ucp_mem_h,
    /// 1.22 only (never set here).
    pub remote_datatype: u64,
    /// 1.22 only (never set here).
    pub remote: *const c_void,
    /// 1.22 only (never set here).
    pub remote_count: usize,
}

/// `ucp_am_recv_callback_t`.
pub type ucp_am_recv_callback_t = Option<
    unsafe extern "C" fn(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        data: *mut c_void,
        length: usize,
        param: *const ucp_am_recv_param_t,
    ) -> ucs_status_t,
>;

/// `ucp_am_handler_param_t` (32 bytes in both 1.13 and 1.22).
#[repr(C)]
pub struct ucp_am_handler_param_t {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: ucp_am_recv_callback_t,
    pub arg: *mut c_void,
}

/// `struct ucp_am_recv_param` (16 bytes in both).
#[repr(C)]
pub struct ucp_am_recv_param_t {
    pub recv_attr: u64,
    pub reply_ep: ucp_ep_h,
}

/// `ucp_dt_iov_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ucp_dt_iov_t {
    pub buffer: *mut c_void,
    pub length: usize,
}

/// `ucp_transport_entry_t` (1.14+).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ucp_transport_entry_t {
    pub transport_name: *const c_char,
    pub device_name: *const c_char,
}

/// `ucp_transports_t` (1.14+).
#[repr(C)]
pub struct ucp_transports_t {
    pub entries: *mut ucp_transport_entry_t,
    pub num_entries: c_uint,
    pub entry_size: usize,
}

/// `UCP_ENTITY_NAME_MAX` (32 in both).
pub const UCP_ENTITY_NAME_MAX: usize = 32;

/// `ucp_ep_attr_t` (1.22: 328 bytes; 1.13: 296, ending after `remote_sockaddr`). `transports` is
/// only written by 1.14+, and only when its bit is set.
#[repr(C)]
pub struct ucp_ep_attr_t {
    pub field_mask: u64,
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
    pub local_sockaddr: libc::sockaddr_storage,
    pub remote_sockaddr: libc::sockaddr_storage,
    pub transports: ucp_transports_t,
    /// 1.18+ (never requested here).
    pub user_data: *mut c_void,
}

// Offsets printed by tools/layout.c for both header sets (LP64: x86_64, aarch64).
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ucs_status_t>() == 1);
    assert!(size_of::<ucp_params_t>() == 88);
    assert!(offset_of!(ucp_params_t, features) == 8);
    assert!(offset_of!(ucp_params_t, mt_workers_shared) == 48);
    assert!(offset_of!(ucp_params_t, name) == 72);
    assert!(size_of::<ucp_worker_params_t>() == 200);
    assert!(offset_of!(ucp_worker_params_t, thread_mode) == 8);
    assert!(offset_of!(ucp_worker_params_t, cpu_mask) == 16);
    assert!(offset_of!(ucp_worker_params_t, client_id) == 192);
    assert!(size_of::<ucp_ep_params_t>() == 104);
    assert!(offset_of!(ucp_ep_params_t, address) == 8);
    assert!(offset_of!(ucp_ep_params_t, err_mode) == 16);
    assert!(offset_of!(ucp_ep_params_t, err_handler) == 24);
    assert!(offset_of!(ucp_ep_params_t, user_data) == 40);
    assert!(offset_of!(ucp_ep_params_t, local_sockaddr) == 88);
    assert!(size_of::<ucp_mem_map_params_t>() == 48);
    assert!(offset_of!(ucp_mem_map_params_t, address) == 8);
    assert!(offset_of!(ucp_mem_map_params_t, length) == 16);
    assert!(offset_of!(ucp_mem_map_params_t, memory_type) == 32);
    assert!(size_of::<ucp_request_param_t>() == 96);
    assert!(offset_of!(ucp_request_param_t, flags) == 4);
    assert!(offset_of!(ucp_request_param_t, cb) == 16);
    assert!(offset_of!(ucp_request_param_t, memory_type) == 48);
    assert!(offset_of!(ucp_request_param_t, memh) == 64);
    assert!(size_of::<ucp_ep_attr_t>() == 328);
    assert!(offset_of!(ucp_ep_attr_t, local_sockaddr) == 40);
    assert!(offset_of!(ucp_ep_attr_t, remote_sockaddr) == 168);
    assert!(offset_of!(ucp_ep_attr_t, transports) == 296);
    assert!(size_of::<ucp_transports_t>() == 24);
    assert!(offset_of!(ucp_transports_t, entry_size) == 16);
    assert!(size_of::<ucp_transport_entry_t>() == 16);
    assert!(size_of::<ucp_am_handler_param_t>() == 32);
    assert!(offset_of!(ucp_am_handler_param_t, id) == 8);
    assert!(offset_of!(ucp_am_handler_param_t, flags) == 12);
    assert!(offset_of!(ucp_am_handler_param_t, cb) == 16);
    assert!(offset_of!(ucp_am_handler_param_t, arg) == 24);
    assert!(size_of::<ucp_am_recv_param_t>() == 16);
    assert!(size_of::<ucp_dt_iov_t>() == 16);
};

/// The libucp functions this crate calls, resolved once per loaded library.
pub struct Api {
    pub get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub get_version_string: unsafe extern "C" fn() -> *const c_char,
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t,
    pub config_modify: unsafe extern "C" fn(*mut ucp_config_t, *const c_char, *const c_char) -> ucs_status_t,
    pub config_release: unsafe extern "C" fn(*mut ucp_config_t),
    pub init_version: unsafe extern "C" fn(c_uint, c_uint, *const ucp_params_t, *const ucp_config_t, *mut ucp_context_h) -> ucs_status_t,
    pub cleanup: unsafe extern "C" fn(ucp_context_h),
    pub context_print_info: unsafe extern "C" fn(ucp_context_h, *mut libc::FILE),
    pub worker_create: unsafe extern "C" fn(ucp_context_h, *const ucp_worker_params_t, *mut ucp_worker_h) -> ucs_status_t,
    pub worker_destroy: unsafe extern "C" fn(ucp_worker_h),
    pub worker_progress: unsafe extern "C" fn(ucp_worker_h) -> c_uint,
    pub worker_get_address: unsafe extern "C" fn(ucp_worker_h, *mut *mut ucp_address_t, *mut usize) -> ucs_status_t,
    pub worker_release_address: unsafe extern "C" fn(ucp_worker_h, *mut ucp_address_t),
    pub worker_print_info: unsafe extern "C" fn(ucp_worker_h, *mut libc::FILE),
    pub worker_get_efd: unsafe extern "C" fn(ucp_worker_h, *mut c_int) -> ucs_status_t,
    pub worker_arm: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub worker_flush_nbx: unsafe extern "C" fn(ucp_worker_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_create: unsafe extern "C" fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t,
    pub ep_close_nbx: unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_flush_nbx: unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_print_info: unsafe extern "C" fn(ucp_ep_h, *mut libc::FILE),
    pub ep_query: unsafe extern "C" fn(ucp_ep_h, *mut ucp_ep_attr_t) -> ucs_status_t,
    pub mem_map: unsafe extern "C" fn(ucp_context_h, *const ucp_mem_map_params_t, *mut ucp_mem_h) -> ucs_status_t,
    pub mem_unmap: unsafe extern "C" fn(ucp_context_h, ucp_mem_h) -> ucs_status_t,
    pub rkey_pack: unsafe extern "C" fn(ucp_context_h, ucp_mem_h, *mut *mut c_void, *mut usize) -> ucs_status_t,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack: unsafe extern "C" fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t,
    pub rkey_destroy: unsafe extern "C" fn(ucp_rkey_h),
    pub put_nbx: unsafe extern "C" fn(ucp_ep_h, *const c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub get_nbx: unsafe extern "C" fn(ucp_ep_h, *mut c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub worker_set_am_recv_handler: unsafe extern "C" fn(ucp_worker_h, *const ucp_am_handler_param_t) -> ucs_status_t,
    pub am_send_nbx:
        unsafe extern "C" fn(ucp_ep_h, c_uint, *const c_void, usize, *const c_void, usize, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> ucs_status_t,
    pub request_free: unsafe extern "C" fn(*mut c_void),
}

/// A symbol that libucp lacks: (name, dlerror text).
pub struct MissingSymbol(pub &'static str, pub String);

impl Api {
    /// Resolves every function from `lib`.
    ///
    /// # Safety
    /// `lib` must be a libucp whose functions have the C signatures declared in [`Api`] (UCX
    /// 1.13 or later); a library exporting the same names with other signatures is undefined
    /// behaviour when called.
    pub unsafe fn load(lib: &Library) -> Result<Api, MissingSymbol> {
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the caller vouches that `lib` is libucp; the declared field type is the
                // C prototype of this symbol in ucp.h (1.13 and 1.22 alike).
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(e) => return Err(MissingSymbol($name, e.to_string())),
                }
            }};
        }
        Ok(Api {
            get_version: sym!("ucp_get_version"),
            get_version_string: sym!("ucp_get_version_string"),
            config_read: sym!("ucp_config_read"),
            config_modify: sym!("ucp_config_modify"),
            config_release: sym!("ucp_config_release"),
            init_version: sym!("ucp_init_version"),
            cleanup: sym!("ucp_cleanup"),
            context_print_info: sym!("ucp_context_print_info"),
            worker_create: sym!("ucp_worker_create"),
            worker_destroy: sym!("ucp_worker_destroy"),
            worker_progress: sym!("ucp_worker_progress"),
            worker_get_address: sym!("ucp_worker_get_address"),
            worker_release_address: sym!("ucp_worker_release_address"),
            worker_print_info: sym!("ucp_worker_print_info"),
            worker_get_efd: sym!("ucp_worker_get_efd"),
            worker_arm: sym!("ucp_worker_arm"),
            worker_flush_nbx: sym!("ucp_worker_flush_nbx"),
            ep_create: sym!("ucp_ep_create"),
            ep_close_nbx: sym!("ucp_ep_close_nbx"),
            ep_flush_nbx: sym!("ucp_ep_flush_nbx"),
            ep_print_info: sym!("ucp_ep_print_info"),
            ep_query: sym!("ucp_ep_query"),
            mem_map: sym!("ucp_mem_map"),
            mem_unmap: sym!("ucp_mem_unmap"),
            rkey_pack: sym!("ucp_rkey_pack"),
            rkey_buffer_release: sym!("ucp_rkey_buffer_release"),
            ep_rkey_unpack: sym!("ucp_ep_rkey_unpack"),
            rkey_destroy: sym!("ucp_rkey_destroy"),
            put_nbx: sym!("ucp_put_nbx"),
            get_nbx: sym!("ucp_get_nbx"),
            worker_set_am_recv_handler: sym!("ucp_worker_set_am_recv_handler"),
            am_send_nbx: sym!("ucp_am_send_nbx"),
            request_check_status: sym!("ucp_request_check_status"),
            request_free: sym!("ucp_request_free"),
        })
    }
}

/// Structs for which all-zero bytes are a valid value.
///
/// # Safety
/// Implement only for `#[repr(C)]` structs whose fields are integers, raw pointers, arrays of
/// those and `Option<extern fn>` (zero is 0, null or `None`).
pub unsafe trait Zeroable: Sized {}
// SAFETY: each is a #[repr(C)] struct of integers, raw pointers and Option<extern fn> only.
unsafe impl Zeroable for ucp_params_t {}
// SAFETY: as above.
unsafe impl Zeroable for ucp_worker_params_t {}
// SAFETY: as above.
unsafe impl Zeroable for ucp_ep_params_t {}
// SAFETY: as above.
unsafe impl Zeroable for ucp_mem_map_params_t {}
// SAFETY: as above.
unsafe impl Zeroable for ucp_request_param_t {}
// SAFETY: as above (libc::sockaddr_storage is plain integers).
unsafe impl Zeroable for ucp_ep_attr_t {}
// SAFETY: as above.
unsafe impl Zeroable for ucp_transport_entry_t {}
// SAFETY: as above.
unsafe impl Zeroable for ucp_am_handler_param_t {}

/// A zeroed parameter struct: every field UCP may read is either set by us or masked out.
pub fn zeroed<T: Zeroable>() -> T {
    // SAFETY: `Zeroable` promises all-zero is a valid `T`.
    unsafe { std::mem::zeroed() }
}
