//! UCP contexts (one per rail), memory mapping and packed remote keys.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use crate::capture::capture;
use crate::error::{Error, Result};
use crate::load::Ucx;
use crate::status::Status;
use crate::sys;

/// The largest packed rkey accepted (real ones are tens to a few hundred bytes per memory domain).
pub const MAX_RKEY_LEN: usize = 16 * 1024;

/// Settings for [`Context::new`]: which environment prefix UCX reads its defaults from, and
/// overrides applied with `ucp_config_modify` (these win over the environment).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContextConfig {
    env_prefix: Option<String>,
    settings: Vec<(String, String)>,
    wakeup: bool,
    active_messages: bool,
    name: Option<String>,
}

impl ContextConfig {
    pub fn new() -> Self {
        Self::default()
    }

    /// Read `<prefix>_UCX_*` variables instead of `UCX_*` (`ucp_config_read`'s `env_prefix`).
    pub fn env_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.env_prefix = Some(prefix.into());
        self
    }

    /// Sets a UCX configuration variable, named without its `UCX_` prefix (`"TLS"`,
    /// `"NET_DEVICES"`, `"KEEPALIVE_INTERVAL"`; a leading `UCX_` is stripped).
    pub fn set(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        let name = name.strip_prefix("UCX_").map(str::to_string).unwrap_or(name);
        self.settings.push((name, value.into()));
        self
    }

    /// `NET_DEVICES`: restrict the context to one device: `mlx5_0:1` (an RDMA device and port)
    /// or a netdev name for tcp (`eth1`, `lo`). One context per rail, each on its rail's device.
    pub fn net_devices(self, devices: impl Into<String>) -> Self {
        self.set("NET_DEVICES", devices)
    }

    /// `TLS`: the transports UCX may use (`rc,ud,sm,self`, `tcp`, `^tcp`, ...).
    pub fn tls(self, tls: impl Into<String>) -> Self {
        self.set("TLS", tls)
    }

    /// Adds `UCP_FEATURE_WAKEUP`, so workers get an event fd ([`crate::Worker::wait_for_events`]).
    pub fn wakeup(mut self, on: bool) -> Self {
        self.wakeup = on;
        self
    }

    /// Adds `UCP_FEATURE_AM`: workers take active-message handlers
    /// ([`crate::Worker::set_am_handler`]) and endpoints send active messages
    /// ([`crate::Endpoint::am_send`]).
    pub fn active_messages(mut self, on: bool) -> Self {
        self.active_messages = on;
        self
    }

    /// A name for the context in UCX's logs.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The `ucp_config_modify` settings, in order.
    pub fn settings(&self) -> &[(String, String)] {
        &self.settings
    }
}

pub(crate) struct ContextInner {
    pub(crate) ucx: Ucx,
    pub(crate) handle: sys::ucp_context_h,
    pub(crate) wakeup: bool,
}

// SAFETY: the context is created with mt_workers_shared = 1, which makes UCP's context-level
// calls (mem_map/unmap, rkey_pack, print_info) thread-safe; `handle` is never mutated.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        let _t = crate::quiesce::teardown();
        // SAFETY: the last owner is gone: every worker and mapped region holds an Arc to this,
        // so none is left when ucp_cleanup runs.
        unsafe { (self.ucx.api().cleanup)(self.handle) };
    }
}

/// A UCP context (`ucp_init`) with the RMA feature. One per rail, restricted to the rail's device.
/// Cheap to clone; workers and mapped regions keep it alive.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("handle", &self.inner.handle).finish()
    }
}

fn cstring(s: &str, what: &'static str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Nul { what })
}

struct Config<'a> {
    api: &'a sys::Api,
    ptr: *mut sys::ucp_config_t,
}

impl Drop for Config<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from ucp_config_read and is released once.
        unsafe { (self.api.config_release)(self.ptr) };
    }
}

impl Context {
    /// `ucp_config_read` + `ucp_config_modify` (each setting) + `ucp_init` with `UCP_FEATURE_RMA`
    /// (and `WAKEUP` when asked), `mt_workers_shared = 1`.
    pub fn new(ucx: &Ucx, cfg: &ContextConfig) -> Result<Context> {
        let api = ucx.api();
        let prefix = cfg.env_prefix.as_deref().map(|p| cstring(p, "env prefix")).transpose()?;
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: prefix is NULL or a C string; filename NULL means "environment only".
        let st = unsafe { (api.config_read)(prefix.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()), std::ptr::null(), &mut config) };
        Status::check(st).map_err(|s| Error::ucx("ucp_config_read", s))?;
        let config = Config { api, ptr: config };
        for (key, value) in &cfg.settings {
            let k = cstring(key, "UCX configuration name")?;
            let v = cstring(value, "UCX configuration value")?;
            // SAFETY: config is live; both strings are NUL-terminated and copied by UCX.
            let st = unsafe { (api.config_modify)(config.ptr, k.as_ptr(), v.as_ptr()) };
            Status::check(st).map_err(|status| Error::Config { key: key.clone(), value: value.clone(), status })?;
        }
        let name = cfg.name.as_deref().map(|n| cstring(n, "context name")).transpose()?;
        let mut params: sys::ucp_params_t = sys::zeroed();
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED;
        params.features = sys::UCP_FEATURE_RMA
            | if cfg.wakeup { sys::UCP_FEATURE_WAKEUP } else { 0 }
            | if cfg.active_messages { sys::UCP_FEATURE_AM } else { 0 };
        params.mt_workers_shared = 1;
        if let Some(n) = &name {
            params.field_mask |= sys::UCP_PARAM_FIELD_NAME;
            params.name = n.as_ptr();
        }
        let mut handle: sys::ucp_context_h = std::ptr::null_mut();
        // SAFETY: params is fully initialised for the fields in field_mask; config is live. The
        // API version passed is the oldest checked (1.13): ucp_init_version only compares it.
        let st =
            unsafe { (api.init_version)(crate::load::MIN_VERSION.major, crate::load::MIN_VERSION.minor, &params, config.ptr, &mut handle) };
        Status::check(st).map_err(|s| Error::ucx("ucp_init", s))?;
        drop(config);
        Ok(Context { inner: Arc::new(ContextInner { ucx: ucx.clone(), handle, wakeup: cfg.wakeup }) })
    }

    /// The library this context runs on.
    pub fn ucx(&self) -> &Ucx {
        &self.inner.ucx
    }

    /// `ucp_context_print_info`: the resources (transports and devices) this context may use.
    pub fn info_string(&self) -> Result<String> {
        let api = self.inner.ucx.api();
        // SAFETY: the context is live; the stream is valid during the call.
        capture(|f| unsafe { (api.context_print_info)(self.inner.handle, f) })
    }

    /// Maps (registers) existing memory with `ucp_mem_map` (no allocation) for RMA.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory UCX can register (host memory, or device memory of a
    /// kind the loaded UCX supports) that stays allocated until the region's last user is gone:
    /// the returned [`MemRegion`] and every [`crate::Request`] posted with it (wait for them, or
    /// close their endpoints, which completes or cancels them). While mapped, peers holding its
    /// packed rkey may read and write it at any time, and local GETs write into it: do not keep
    /// Rust references to it that assume no one else writes.
    pub unsafe fn map(&self, addr: *mut u8, len: usize) -> Result<MemRegion> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.map_with(addr, len, Protection::RemoteReadWrite) }
    }

    /// As [`Context::map`], with the access peers get (`UCP_MEM_MAP_PARAM_FIELD_PROT`): what an
    /// rkey packed from the mapping allows. Over RDMA the HCA enforces it; UCX's tcp and shm
    /// transports do not (docs/ucx.md, "Trust").
    ///
    /// # Safety
    /// As for [`Context::map`] (a `LocalOnly` or `RemoteRead` mapping still lets local GETs and
    /// peers' reads touch it).
    pub unsafe fn map_with(&self, addr: *mut u8, len: usize, prot: Protection) -> Result<MemRegion> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.map_typed(addr, len, prot, MemoryType::Detect) }
    }

    /// As [`Context::map_with`], declaring what kind of memory it is
    /// (`UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`): device memory must be declared
    /// [`MemoryType::Cuda`], so that UCX registers it with the memory domains that take CUDA
    /// memory (GPUDirect RDMA by peermem or dma-buf) instead of guessing from the address.
    ///
    /// # Safety
    /// As for [`Context::map`]; `mem` must be what the memory is (UCX trusts it).
    pub unsafe fn map_typed(&self, addr: *mut u8, len: usize, prot: Protection, mem: MemoryType) -> Result<MemRegion> {
        if len == 0 {
            return Err(Error::Empty { what: "memory region" });
        }
        let params = map_params(addr, len, prot, mem);
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the caller vouches for the memory; no ALLOCATE flag, so UCX registers it as is.
        let st = unsafe { (self.inner.ucx.api().mem_map)(self.inner.handle, &params, &mut memh) };
        Status::check(st).map_err(|s| Error::ucx("ucp_mem_map", s))?;
        Ok(MemRegion { inner: Arc::new(MemInner { ctx: self.inner.clone(), memh, addr: addr as usize, len, prot }) })
    }

    pub(crate) fn same(&self, other: &Arc<ContextInner>) -> bool {
        Arc::ptr_eq(&self.inner, other)
    }
}

pub(crate) struct MemInner {
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) memh: sys::ucp_mem_h,
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) prot: Protection,
}

/// What peers may do to a mapping through an rkey packed from it (`ucp_mem_map`'s `prot`).
/// Local reads and writes (this process's own GETs and PUT sources) are always allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// No remote access: memory only this process sends from or receives into.
    LocalOnly,
    /// Peers may read it (RDMA READ / GET), not write it.
    RemoteRead,
    /// Peers may read and write it.
    RemoteReadWrite,
}

impl Protection {
    /// The `UCP_MEM_MAP_PROT_*` bits.
    pub fn bits(self) -> u32 {
        let local = sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE;
        match self {
            Protection::LocalOnly => local,
            Protection::RemoteRead => local | sys::UCP_MEM_MAP_PROT_REMOTE_READ,
            Protection::RemoteReadWrite => local | sys::UCP_MEM_MAP_PROT_REMOTE_READ | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE,
        }
    }
}

/// The memory a mapping covers, as declared to `ucp_mem_map` (`ucs_memory_type_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryType {
    /// Not declared: UCX detects it (its memory-type cache and hooks).
    Detect,
    /// Host memory (`UCS_MEMORY_TYPE_HOST`).
    Host,
    /// CUDA device memory (`UCS_MEMORY_TYPE_CUDA`).
    Cuda,
}

/// The `ucp_mem_map` parameters for existing memory with `prot` (no allocation), declaring
/// `mem` unless it is [`MemoryType::Detect`].
fn map_params(addr: *mut u8, len: usize, prot: Protection, mem: MemoryType) -> sys::ucp_mem_map_params_t {
    let mut params: sys::ucp_mem_map_params_t = sys::zeroed();
    params.field_mask = sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH | sys::UCP_MEM_MAP_PARAM_FIELD_PROT;
    params.address = addr.cast::<c_void>();
    params.length = len;
    params.prot = prot.bits();
    let declared = match mem {
        MemoryType::Detect => None,
        MemoryType::Host => Some(sys::UCS_MEMORY_TYPE_HOST),
        MemoryType::Cuda => Some(sys::UCS_MEMORY_TYPE_CUDA),
    };
    if let Some(t) = declared {
        params.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        params.memory_type = t;
    }
    params
}

// SAFETY: memh is used only in context-level calls (thread-safe, see ContextInner) and as a
// parameter of operations posted under the worker lock; it is unmapped once, in Drop.
unsafe impl Send for MemInner {}
// SAFETY: as above.
unsafe impl Sync for MemInner {}

impl Drop for MemInner {
    fn drop(&mut self) {
        // SAFETY: no request using this memh is pending (each holds an Arc to this).
        let st = unsafe { (self.ctx.ucx.api().mem_unmap)(self.ctx.handle, self.memh) };
        // Nothing to report to from Drop; ucp_mem_unmap fails only on an invalid handle.
        let _ = st;
    }
}

/// Memory mapped with [`Context::map`]. Unmapped (`ucp_mem_unmap`) when this and every request
/// that uses it are gone.
#[derive(Clone)]
pub struct MemRegion {
    pub(crate) inner: Arc<MemInner>,
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion").field("addr", &format_args!("{:#x}", self.inner.addr)).field("len", &self.inner.len).finish()
    }
}

impl MemRegion {
    /// The first byte's address (what a peer passes as remote address, plus an offset).
    pub fn addr(&self) -> u64 {
        self.inner.addr as u64
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The access it was mapped with ([`Context::map_with`]).
    pub fn protection(&self) -> Protection {
        self.inner.prot
    }

    /// The region as a peer sees it: put this with the packed rkey into the metadata.
    pub fn remote_region(&self) -> RemoteRegion {
        RemoteRegion { addr: self.inner.addr as u64, len: self.inner.len as u64 }
    }

    /// `ucp_rkey_pack` → bytes (bounded by [`MAX_RKEY_LEN`]) → `ucp_rkey_buffer_release`.
    pub fn pack_rkey(&self) -> Result<PackedRkey> {
        let api = self.inner.ctx.ucx.api();
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: context and memh are live; UCX allocates `buf` (released below).
        let st = unsafe { (api.rkey_pack)(self.inner.ctx.handle, self.inner.memh, &mut buf, &mut size) };
        Status::check(st).map_err(|s| Error::ucx("ucp_rkey_pack", s))?;
        let bytes = if buf.is_null() || size == 0 {
            Vec::new()
        } else {
            // SAFETY: UCX wrote `size` bytes at `buf`.
            unsafe { std::slice::from_raw_parts(buf as *const u8, size.min(MAX_RKEY_LEN + 1)) }.to_vec()
        };
        if !buf.is_null() {
            // SAFETY: `buf` came from ucp_rkey_pack and is released once.
            unsafe { (api.rkey_buffer_release)(buf) };
        }
        if size > MAX_RKEY_LEN {
            return Err(Error::TooLarge { what: "packed rkey", len: size, max: MAX_RKEY_LEN });
        }
        if bytes.is_empty() {
            return Err(Error::Empty { what: "packed rkey" });
        }
        Ok(PackedRkey(bytes))
    }

    pub(crate) fn check(&self, offset: usize, len: usize) -> Result<*mut u8> {
        if !matches!(offset.checked_add(len), Some(end) if end <= self.inner.len) {
            return Err(Error::OutOfBounds {
                what: "local region",
                offset: offset as u64,
                len: len as u64,
                base: 0,
                size: self.inner.len as u64,
            });
        }
        Ok((self.inner.addr + offset) as *mut u8)
    }
}

/// The remote memory an rkey covers, as the peer's metadata says: `[addr, addr + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    pub addr: u64,
    pub len: u64,
}

impl RemoteRegion {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_sub(self.addr), addr.checked_add(len), self.addr.checked_add(self.len)) {
            (Some(_), Some(end), Some(region_end)) => end <= region_end,
            _ => false,
        }
    }
}

/// A packed remote key: opaque bytes made by `ucp_rkey_pack`, to travel in the metadata.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PackedRkey(Vec<u8>);

impl std::fmt::Debug for PackedRkey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedRkey({} bytes)", self.0.len())
    }
}

impl PackedRkey {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// Wraps bytes received from a peer.
    ///
    /// # Safety
    /// `bytes` must be exactly what `ucp_rkey_pack` produced on the peer (delivered intact over an
    /// authenticated channel, e.g. the agent's metadata). `ucp_ep_rkey_unpack` takes no length and
    /// trusts the contents: a truncated or forged buffer makes it read out of bounds. Only the
    /// length is checked here (1 ..= [`MAX_RKEY_LEN`]).
    pub unsafe fn from_peer(bytes: Vec<u8>) -> Result<PackedRkey> {
        Self::check_len(&bytes)?;
        Ok(PackedRkey(bytes))
    }

    fn check_len(bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Err(Error::Empty { what: "packed rkey" });
        }
        if bytes.len() > MAX_RKEY_LEN {
            return Err(Error::TooLarge { what: "packed rkey", len: bytes.len(), max: MAX_RKEY_LEN });
        }
        Ok(())
    }

    /// Whether a peer's packed rkey has the structure `ucp_rkey_pack` gives it (UCX 1.13 to
    /// 1.22, `ucp_rkey_packed_size`): a u64 map of memory domains (empty over tcp), a memory-type
    /// byte (below 16), then per domain in the map a size byte and that many bytes, all inside
    /// the buffer; what may follow is the optional system-device byte and 3-byte distances. A
    /// plausibility check before `ucp_ep_rkey_unpack`, which takes no length: it stops garbage
    /// and truncation, not a well-formed forgery (the channel's MAC does that).
    pub fn check_shape(peer: &[u8]) -> Result<()> {
        Self::check_len(peer)?;
        let bad = |why: String| Err(Error::Shape { what: "packed rkey", why });
        if peer.len() < 9 {
            return bad(format!("{} bytes, shorter than its memory-domain map and type", peer.len()));
        }
        // No domain at all is what UCX's tcp transport packs (it needs no registration).
        let md_map = u64::from_le_bytes(peer[..8].try_into().expect("8 bytes"));
        if peer[8] >= 16 {
            return bad(format!("memory type {}", peer[8]));
        }
        let mut at = 9usize;
        for _ in 0..md_map.count_ones() {
            let Some(&n) = peer.get(at) else {
                return bad(format!("{} memory domains announced, the buffer ends at {at}", md_map.count_ones()));
            };
            at += 1 + n as usize;
            if at > peer.len() {
                return bad(format!("a domain's key runs to byte {at}, past the end ({})", peer.len()));
            }
        }
        let rest = peer.len() - at;
        if rest != 0 && !(rest - 1).is_multiple_of(3) {
            return bad(format!("{rest} bytes after the domain keys (a device byte and 3-byte distances expected)"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33, item 2: the structure of a packed rkey is walked before UCX sees it.
    #[test]
    fn packed_rkey_shape() {
        // Two domains (bits 0 and 3), host memory, keys of 2 and 0 bytes.
        let ok = [vec![0b1001, 0, 0, 0, 0, 0, 0, 0, 0], vec![2, 0xaa, 0xbb], vec![0]].concat();
        assert!(PackedRkey::check_shape(&ok).is_ok());
        let with_dev = [ok.clone(), vec![1, 2, 3, 4]].concat();
        assert!(PackedRkey::check_shape(&with_dev).is_ok(), "a device byte and one distance");
        for cut in 0..ok.len() {
            assert!(PackedRkey::check_shape(&ok[..cut]).is_err(), "cut at {cut}");
        }
        assert!(PackedRkey::check_shape(&[ok.clone(), vec![9]].concat()).is_ok(), "a device byte alone");
        assert!(PackedRkey::check_shape(&[ok.clone(), vec![9, 9]].concat()).is_err());
        assert!(PackedRkey::check_shape(&vec![0xff; 4096]).is_err(), "garbage");
        assert!(PackedRkey::check_shape(&[vec![0; 8], vec![0]].concat()).is_ok(), "no domain: UCX's tcp");
        let mut bad_type = ok.clone();
        bad_type[8] = 200;
        assert!(PackedRkey::check_shape(&bad_type).is_err());
    }

    #[test]
    fn worker_address_shape() {
        use crate::worker::WorkerAddress;
        let like = vec![0x11u8; 200];
        assert!(WorkerAddress::check_shape(&[0x01; 180], &like).is_ok());
        assert!(WorkerAddress::check_shape(&[0x12; 180], &like).is_err(), "another version");
        assert!(WorkerAddress::check_shape(&[0x01; 5], &like).is_err(), "too short");
        assert!(WorkerAddress::check_shape(&[0x01; 5000], &like).is_err(), "too long");
        assert!(WorkerAddress::check_shape(&[], &like).is_err());
    }

    /// `ucp_mem_map` gets `prot` (field mask bit 3): read-only exports carry no remote write,
    /// local memory no remote access at all (issue 33, item 4).
    #[test]
    fn mappings_carry_their_protection() {
        let (lr, lw, rr, rw) = (1u32, 2u32, 1u32 << 8, 1u32 << 9);
        let p = map_params(0x1000 as *mut u8, 64, Protection::RemoteRead, MemoryType::Detect);
        assert_eq!(p.field_mask, 0b1011, "ADDRESS | LENGTH | PROT");
        assert_eq!((p.address as usize, p.length), (0x1000, 64));
        assert_eq!(p.prot, lr | lw | rr);
        assert_eq!(map_params(0x1000 as *mut u8, 64, Protection::LocalOnly, MemoryType::Detect).prot, lr | lw);
        assert_eq!(map_params(0x1000 as *mut u8, 64, Protection::RemoteReadWrite, MemoryType::Detect).prot, lr | lw | rr | rw);
    }

    /// Issue 35, item 7a: device memory is declared to `ucp_mem_map` as CUDA memory (field mask
    /// bit 4, `UCS_MEMORY_TYPE_CUDA` = 1), host memory as host (0) when asked, else undeclared.
    #[test]
    fn vram_mappings_declare_cuda_memory() {
        let cuda = map_params(0x7f00_0000 as *mut u8, 1 << 20, Protection::RemoteReadWrite, MemoryType::Cuda);
        assert_eq!(cuda.field_mask, 0b1_1011, "ADDRESS | LENGTH | PROT | MEMORY_TYPE");
        assert_eq!(cuda.memory_type, 1);
        let host = map_params(0x1000 as *mut u8, 64, Protection::RemoteRead, MemoryType::Host);
        assert_eq!((host.field_mask & (1 << 4), host.memory_type), (1 << 4, 0));
        assert_eq!(map_params(0x1000 as *mut u8, 64, Protection::RemoteRead, MemoryType::Detect).field_mask & (1 << 4), 0);
    }

    #[test]
    fn remote_region_bounds() {
        let r = RemoteRegion { addr: 0x1000, len: 0x100 };
        assert!(r.contains(0x1000, 0x100));
        assert!(r.contains(0x10ff, 1));
        assert!(r.contains(0x1100, 0));
        assert!(!r.contains(0x1100, 1));
        assert!(!r.contains(0xfff, 1));
        assert!(!r.contains(u64::MAX, 2));
        let top = RemoteRegion { addr: u64::MAX - 1, len: 1 };
        assert!(top.contains(u64::MAX - 1, 1));
        assert!(!RemoteRegion { addr: u64::MAX, len: 2 }.contains(u64::MAX, 1));
    }

    #[test]
    fn config_builder() {
        let c = ContextConfig::new().tls("tcp").net_devices("lo").set("UCX_KEEPALIVE_INTERVAL", "1s");
        assert_eq!(
            c.settings(),
            &[
                ("TLS".to_string(), "tcp".to_string()),
                ("NET_DEVICES".to_string(), "lo".to_string()),
                ("KEEPALIVE_INTERVAL".to_string(), "1s".to_string())
            ]
        );
    }

    #[test]
    fn packed_rkey_bounds() {
        // SAFETY: never unpacked.
        unsafe {
            assert!(matches!(PackedRkey::from_peer(vec![]), Err(Error::Empty { .. })));
            assert!(matches!(PackedRkey::from_peer(vec![0; MAX_RKEY_LEN + 1]), Err(Error::TooLarge { .. })));
            assert_eq!(PackedRkey::from_peer(vec![1, 2]).unwrap().as_bytes(), &[1, 2]);
        }
    }
}
