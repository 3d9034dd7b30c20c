//! multirail as a NIXL backend plugin: `libplugin_MULTIRAIL.so`.
//!
//! Two layers, one shared object:
//! - `shim/plugin.cpp`: the C++ engine class NIXL's agent drives (NIXL's backend interface is
//!   C++: `std::string`, `std::vector` and `std::unordered_map` cross it). It declares the
//!   interface itself (names, order and types from NIXL's documented backend API; layout
//!   checked against the nixl-cu12 wheel's own plugins), converts arguments and calls:
//! - this crate's C ABI (`mr_nixl_*`): plain integers, pointers and (pointer, length) byte
//!   strings; byte strings going back are handed to a sink callback.
//!
//! No panic leaves a `mr_nixl_*` function (each runs under `catch_unwind` and returns
//! `NIXL_ERR_UNKNOWN` instead), and no C++ exception leaves the shim (every method catches).
//! `nixl_plugin_init`/`nixl_plugin_fini` are defined here so the cdylib exports them.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub mod affinity;
pub mod engine;
pub mod host;
pub mod params;
pub mod topo;

use engine::{log, status_of, Engine, MetaRow, Xfer};

/// NIXL's status values (`nixl_status_t`).
pub mod status {
    pub const IN_PROG: i32 = 1;
    pub const SUCCESS: i32 = 0;
    pub const ERR_NOT_POSTED: i32 = -1;
    pub const ERR_INVALID_PARAM: i32 = -2;
    pub const ERR_BACKEND: i32 = -3;
    pub const ERR_NOT_FOUND: i32 = -4;
    pub const ERR_MISMATCH: i32 = -5;
    pub const ERR_NOT_ALLOWED: i32 = -6;
    pub const ERR_UNKNOWN: i32 = -8;
    pub const ERR_NOT_SUPPORTED: i32 = -9;
    pub const ERR_REMOTE_DISCONNECT: i32 = -10;
}
use status::*;

/// Receives byte strings: `(ctx, a, a_len, b, b_len)`; returns 0, or nonzero when it could not
/// take them (allocation failure on the C++ side).
pub type Sink = unsafe extern "C" fn(*mut c_void, *const u8, usize, *const u8, usize) -> c_int;

/// The version string NIXL shows for the plugin.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

fn guard<T>(fallback: T, what: &str, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            log(&format!("ERROR: internal error (panic) in {what}: {msg}"));
            fallback
        }
    }
}

/// # Safety
/// `p` is null with `n == 0`, or points to `n` readable bytes that outlive the returned slice.
unsafe fn bytes<'a>(p: *const u8, n: usize) -> &'a [u8] {
    if n == 0 || p.is_null() {
        &[]
    } else {
        std::slice::from_raw_parts(p, n)
    }
}

unsafe fn text<'a>(p: *const u8, n: usize) -> Result<&'a str, i32> {
    std::str::from_utf8(bytes(p, n)).map_err(|_| ERR_INVALID_PARAM)
}

/// NIXL's descriptor rows, read in place.
///
/// # Safety
/// `p` is null with `n == 0`, or points to `n` readable `MetaRow`s.
unsafe fn rows<'a>(p: *const MetaRow, n: usize) -> std::borrow::Cow<'a, [MetaRow]> {
    if n == 0 || p.is_null() {
        std::borrow::Cow::Borrowed(&[])
    } else if p.is_aligned() {
        std::borrow::Cow::Borrowed(std::slice::from_raw_parts(p, n))
    } else {
        std::borrow::Cow::Owned((0..n).map(|i| std::ptr::read_unaligned(p.add(i))).collect())
    }
}

unsafe fn give(sink: Sink, ctx: *mut c_void, a: &[u8], b: &[u8]) -> i32 {
    if sink(ctx, a.as_ptr(), a.len(), b.as_ptr(), b.len()) == 0 {
        SUCCESS
    } else {
        ERR_BACKEND
    }
}

fn fail(what: &str, e: multirail::Error) -> i32 {
    log(&format!("ERROR: {what}: {e}"));
    status_of(&e)
}

unsafe fn engine<'a>(e: *const Engine) -> Option<&'a Engine> {
    e.as_ref()
}

extern "C" {
    fn mr_nixl_shim_init() -> *mut c_void;
    fn mr_nixl_shim_fini();
}

/// NIXL's entry point: the plugin struct, or null (with a log line saying why) when this
/// process's NIXL is not a version the plugin supports.
#[no_mangle]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    guard(std::ptr::null_mut(), "nixl_plugin_init", || {
        let allow = std::env::var(host::ENV_ALLOW).is_ok_and(|v| v == "1");
        match host::verdict(&host::detect(), allow) {
            Ok(what) => {
                if what.contains("anyway") {
                    log(&format!("WARNING: {what}"));
                } else if what.contains("built from source") {
                    log(&format!("loading for {what}"));
                }
                // SAFETY: the shim's init only builds its static plugin struct.
                unsafe { mr_nixl_shim_init() }
            }
            Err(why) => {
                log(&format!("ERROR: MULTIRAIL plugin refused to load: {why}"));
                std::ptr::null_mut()
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn nixl_plugin_fini() {
    // SAFETY: the shim's fini touches nothing NIXL still uses.
    guard((), "nixl_plugin_fini", || unsafe { mr_nixl_shim_fini() })
}

/// The host check alone (for `multirail nixl-plugin check`): 0 when supported, 1 when not;
/// the description goes to `sink`.
///
/// # Safety
/// `sink` is a valid callback for `ctx`.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_host_check(sink: Sink, ctx: *mut c_void) -> c_int {
    guard(ERR_UNKNOWN, "host_check", || {
        let allow = std::env::var(host::ENV_ALLOW).is_ok_and(|v| v == "1");
        let (rc, msg) = match host::verdict(&host::detect(), allow) {
            Ok(m) => (0, m),
            Err(m) => (1, m),
        };
        give(sink, ctx, msg.as_bytes(), &[]);
        rc
    })
}

#[no_mangle]
pub extern "C" fn mr_nixl_version() -> *const c_char {
    VERSION.as_ptr() as *const c_char
}

/// Every backend parameter with its default, as (key, default) pairs.
///
/// # Safety
/// `sink` is a valid callback for `ctx`.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_backend_options(sink: Sink, ctx: *mut c_void) -> c_int {
    guard(ERR_UNKNOWN, "backend_options", || {
        for (k, _, d, _) in params::PARAMS {
            if give(sink, ctx, k.as_bytes(), d.as_bytes()) != SUCCESS {
                return ERR_BACKEND;
            }
        }
        SUCCESS
    })
}

/// Create an engine for agent `name` with the `n` backend parameters `keys[i]`/`vals[i]`.
/// The settings in force go to `effective` as (key, value); on failure the reason goes to
/// `err` and null is returned.
///
/// # Safety
/// Every pointer/length pair is readable; `effective` and `err` are valid for `ctx`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mr_nixl_engine_new(
    name: *const u8,
    name_len: usize,
    keys: *const *const u8,
    key_lens: *const usize,
    vals: *const *const u8,
    val_lens: *const usize,
    n: usize,
    effective: Sink,
    err: Sink,
    ctx: *mut c_void,
) -> *mut Engine {
    guard(std::ptr::null_mut(), "engine_new", || {
        let fail = |m: String| {
            give(err, ctx, m.as_bytes(), &[]);
            std::ptr::null_mut()
        };
        let Ok(name) = text(name, name_len) else { return fail("agent name is not UTF-8".into()) };
        let mut p = HashMap::new();
        for i in 0..n {
            let k = text(*keys.add(i), *key_lens.add(i));
            let v = text(*vals.add(i), *val_lens.add(i));
            match (k, v) {
                (Ok(k), Ok(v)) => {
                    p.insert(k.to_string(), v.to_string());
                }
                _ => return fail("a backend parameter is not UTF-8".into()),
            }
        }
        let s = match params::settings(&p, &|k| std::env::var(k).ok()) {
            Ok(s) => s,
            Err(m) => return fail(m),
        };
        match Engine::new(name, s.cfg) {
            Ok(e) => {
                if let Err(m) = e.apply_affinity(&s.affinity, s.rails_auto, &|k| std::env::var(k).ok()) {
                    return fail(m);
                }
                for (k, v) in &s.effective {
                    give(effective, ctx, k.as_bytes(), v.as_bytes());
                }
                Box::into_raw(Box::new(e))
            }
            Err(e) => fail(format!("cannot start the multirail agent: {e}")),
        }
    })
}

/// Close the engine's agent (returns once nothing of it touches registered memory) and free it.
///
/// # Safety
/// `e` came from `mr_nixl_engine_new` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_engine_free(e: *mut Engine) {
    guard((), "engine_free", || {
        if !e.is_null() {
            drop(Box::from_raw(e));
        }
    })
}

/// # Safety
/// `e` is a live engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_register(e: *const Engine, addr: u64, len: u64, dev: u64, mem: c_int, out: *mut u64) -> c_int {
    guard(ERR_UNKNOWN, "register", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        match e.register(addr, len, dev, mem) {
            Ok(id) => {
                *out = id;
                SUCCESS
            }
            Err(err) => fail(&format!("registerMem({addr:#x}, {len} bytes, dev {dev})"), err),
        }
    })
}

/// # Safety
/// `e` is a live engine.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_deregister(e: *const Engine, id: u64) -> c_int {
    guard(ERR_UNKNOWN, "deregister", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        match e.deregister(id) {
            Ok(()) => SUCCESS,
            Err(err) => fail("deregisterMem", err),
        }
    })
}

/// # Safety
/// `e` is a live engine; `sink` is valid for `ctx`.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_conn_info(e: *const Engine, sink: Sink, ctx: *mut c_void) -> c_int {
    guard(ERR_UNKNOWN, "conn_info", || match engine(e) {
        Some(e) => give(sink, ctx, &e.conn_info(), &[]),
        None => ERR_INVALID_PARAM,
    })
}

/// # Safety
/// `e` is a live engine; `sink` is valid for `ctx`.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_public_data(e: *const Engine, id: u64, sink: Sink, ctx: *mut c_void) -> c_int {
    guard(ERR_UNKNOWN, "public_data", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        match e.public_data(id) {
            Ok(b) => give(sink, ctx, &b, &[]),
            Err(err) => fail("getPublicData", err),
        }
    })
}

/// # Safety
/// `e` is a live engine; the byte strings are readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_load_conn_info(
    e: *const Engine,
    agent: *const u8,
    agent_len: usize,
    blob: *const u8,
    blob_len: usize,
) -> c_int {
    guard(ERR_UNKNOWN, "load_conn_info", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        match e.load_conn_info(agent, bytes(blob, blob_len)) {
            Ok(()) => SUCCESS,
            Err(err) => fail(&format!("loadRemoteConnInfo({agent:?})"), err),
        }
    })
}

/// # Safety
/// `e` is a live engine; the byte strings are readable; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_load_remote_md(
    e: *const Engine,
    agent: *const u8,
    agent_len: usize,
    blob: *const u8,
    blob_len: usize,
    out: *mut u64,
) -> c_int {
    guard(ERR_UNKNOWN, "load_remote_md", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        match e.load_remote_md(agent, bytes(blob, blob_len)) {
            Ok(id) => {
                *out = id;
                SUCCESS
            }
            Err(err) => fail(&format!("loadRemoteMD({agent:?})"), err),
        }
    })
}

/// # Safety
/// `e` is a live engine; the agent name is readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_unload_remote_md(e: *const Engine, agent: *const u8, agent_len: usize, id: u64) -> c_int {
    guard(ERR_UNKNOWN, "unload_remote_md", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        e.unload_remote_md(agent, id);
        SUCCESS
    })
}

/// # Safety
/// `e` is a live engine; the agent name is readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_connect(e: *const Engine, agent: *const u8, agent_len: usize) -> c_int {
    guard(ERR_UNKNOWN, "connect", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        match e.connect(agent) {
            Ok(()) => SUCCESS,
            Err(err) => fail(&format!("connect({agent:?})"), err),
        }
    })
}

/// # Safety
/// `e` is a live engine; the agent name is readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_disconnect(e: *const Engine, agent: *const u8, agent_len: usize) -> c_int {
    guard(ERR_UNKNOWN, "disconnect", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        e.disconnect(agent);
        SUCCESS
    })
}

/// Prepare a transfer of `ln` local rows against `rn` remote rows (NIXL's meta descriptors,
/// read in place: address, length, device id, metadata pointer; see `MetaRow`) with agent
/// `agent` (this agent itself for a local transfer).
///
/// # Safety
/// `e` is a live engine; the row arrays and the name are readable; `out` is writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mr_nixl_prep(
    e: *const Engine,
    op: c_int,
    lmem: c_int,
    local: *const MetaRow,
    ln: usize,
    rmem: c_int,
    remote: *const MetaRow,
    rn: usize,
    agent: *const u8,
    agent_len: usize,
    out: *mut *mut Xfer,
) -> c_int {
    guard(ERR_UNKNOWN, "prep", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        match e.prep(op, lmem, &rows(local, ln), rmem, &rows(remote, rn), agent) {
            Ok(x) => {
                *out = Box::into_raw(Box::new(x));
                SUCCESS
            }
            Err(err) => fail(&format!("prepXfer to {agent:?}"), err),
        }
    })
}

/// # Safety
/// `e` is a live engine and `x` a live transfer of it; the message is readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_post(e: *const Engine, x: *const Xfer, has_notif: c_int, msg: *const u8, msg_len: usize) -> c_int {
    guard(ERR_UNKNOWN, "post", || {
        let (Some(e), Some(x)) = (engine(e), x.as_ref()) else { return ERR_INVALID_PARAM };
        let notif = (has_notif != 0).then(|| bytes(msg, msg_len));
        match e.post(x, notif) {
            Ok(s) => s,
            Err(err) => fail("postXfer", err),
        }
    })
}

/// # Safety
/// `e` is a live engine and `x` a live transfer of it.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_check(e: *const Engine, x: *const Xfer) -> c_int {
    guard(ERR_UNKNOWN, "check", || {
        let (Some(e), Some(x)) = (engine(e), x.as_ref()) else { return ERR_INVALID_PARAM };
        let (s, err) = e.check(x);
        if let Some(err) = err {
            log(&format!("ERROR: transfer failed: {err}"));
        }
        s
    })
}

/// Abort the transfer if in flight (returns once nothing of it touches memory) and free it.
/// Always SUCCESS: the handle is freed whatever happens, and NIXL keeps a handle whose release
/// failed and releases it again (a double free); an internal error is logged instead.
///
/// # Safety
/// `e` is a live engine; `x` came from `mr_nixl_prep` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_release(e: *const Engine, x: *mut Xfer) -> c_int {
    if x.is_null() {
        return SUCCESS;
    }
    let x = *Box::from_raw(x);
    guard(SUCCESS, "release (the handle is freed)", || {
        match engine(e) {
            Some(e) => e.release(x),
            None => drop(x),
        }
        SUCCESS
    })
}

/// # Safety
/// `e` is a live engine; the byte strings are readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_gen_notif(e: *const Engine, agent: *const u8, agent_len: usize, msg: *const u8, msg_len: usize) -> c_int {
    guard(ERR_UNKNOWN, "gen_notif", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let Ok(agent) = text(agent, agent_len) else { return ERR_INVALID_PARAM };
        match e.gen_notif(agent, bytes(msg, msg_len)) {
            Ok(()) => SUCCESS,
            Err(err) => fail(&format!("genNotif to {agent:?}"), err),
        }
    })
}

/// Hand every notification received since the last call to `sink` as (agent, message).
///
/// # Safety
/// `e` is a live engine; `sink` is valid for `ctx`.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_get_notifs(e: *const Engine, sink: Sink, ctx: *mut c_void) -> c_int {
    guard(ERR_UNKNOWN, "get_notifs", || {
        let Some(e) = engine(e) else { return ERR_INVALID_PARAM };
        let mut rc = SUCCESS;
        for (agent, msg) in e.take_notifs() {
            if give(sink, ctx, agent.as_bytes(), &msg) != SUCCESS {
                rc = ERR_BACKEND;
            }
        }
        rc
    })
}

/// Device memory of this plugin's GPU layer, for tests that move VRAM through NIXL (the
/// stand-in GPU keeps its allocations per loaded copy of the runtime, so a test must allocate
/// through the copy inside the plugin). `kind`: "cuda" or "standin". Returns 0 on failure.
///
/// # Safety
/// `kind` is readable.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_gpu_alloc(kind: *const u8, kind_len: usize, dev: c_int, nbytes: usize) -> u64 {
    guard(0, "gpu_alloc", || {
        let Some(k) = text(kind, kind_len).ok().and_then(multirail_gpu::GpuKind::parse) else { return 0 };
        use multirail_gpu::Device;
        match multirail_gpu::Gpu::open(k, dev).and_then(|g| g.alloc(nbytes)) {
            Ok(p) => p.0,
            Err(e) => {
                log(&format!("ERROR: gpu_alloc: {e}"));
                0
            }
        }
    })
}

/// Synchronous copy of `n` bytes between host and this plugin's device memory; `dir`: 0 h2d,
/// 1 d2h, 2 d2d. Returns 0 on success.
///
/// # Safety
/// Both ranges are valid for `n` bytes of the kinds `dir` says.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_gpu_copy(kind: *const u8, kind_len: usize, dev: c_int, dst: u64, src: u64, n: usize, dir: c_int) -> c_int {
    guard(ERR_UNKNOWN, "gpu_copy", || {
        use multirail_gpu::{CopyKind, Device};
        let Some(k) = text(kind, kind_len).ok().and_then(multirail_gpu::GpuKind::parse) else { return ERR_INVALID_PARAM };
        let ck = match dir {
            0 => CopyKind::HostToDevice,
            1 => CopyKind::DeviceToHost,
            _ => CopyKind::DeviceToDevice,
        };
        let r = multirail_gpu::Gpu::open(k, dev).and_then(|g| {
            let s = g.create_stream()?;
            let ev = g.create_event()?;
            g.copy_async(ck, dst, src, n, &s)?;
            g.record(&ev, &s)?;
            g.synchronize(&ev)
        });
        match r {
            Ok(()) => SUCCESS,
            Err(e) => {
                log(&format!("ERROR: gpu_copy: {e}"));
                ERR_BACKEND
            }
        }
    })
}

/// # Safety
/// `addr` came from `mr_nixl_gpu_alloc` with the same kind and device, and nothing uses it.
#[no_mangle]
pub unsafe extern "C" fn mr_nixl_gpu_free(kind: *const u8, kind_len: usize, dev: c_int, addr: u64) -> c_int {
    guard(ERR_UNKNOWN, "gpu_free", || {
        use multirail_gpu::Device;
        let Some(k) = text(kind, kind_len).ok().and_then(multirail_gpu::GpuKind::parse) else { return ERR_INVALID_PARAM };
        match multirail_gpu::Gpu::open(k, dev).and_then(|g| g.free(multirail_gpu::DevicePtr(addr))) {
            Ok(()) => SUCCESS,
            Err(_) => ERR_BACKEND,
        }
    })
}

/// The rail plan the plugin reads from a sysfs tree (crate::topo), as JSON
/// (`Topology::plan_json`, or `{"error": "..."}`): what tests/test_nixl_topology.py compares
/// with python/multirail/topology.py on every fixture tree. `gpus`: a `--gpus`-style file,
/// `hints`: a `--hints` file, each empty for none. Writes at most `cap` bytes to `out` and
/// returns the JSON's full length (call again with a larger buffer when it is above `cap`); -1
/// on a panic.
///
/// # Safety
/// `root`, `gpus` and `hints` are readable for their lengths; `out` is writable for `cap` bytes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mr_nixl_topology_json(
    root: *const u8,
    root_len: usize,
    gpus: *const u8,
    gpus_len: usize,
    hints: *const u8,
    hints_len: usize,
    out: *mut u8,
    cap: usize,
) -> isize {
    guard(-1, "topology_json", || {
        let path = |p: *const u8, n: usize| -> Result<Option<&std::path::Path>, i32> {
            if n == 0 {
                return Ok(None);
            }
            text(p, n).map(|t| Some(std::path::Path::new(t)))
        };
        let json = match (path(root, root_len), path(gpus, gpus_len), path(hints, hints_len)) {
            (Ok(Some(r)), Ok(g), Ok(h)) => match topo::Topology::load(r, g, h) {
                Ok(t) => t.plan_json(&t.rail_plan()),
                Err(e) => format!("{{\"error\":{}}}", serde_json::Value::String(e)),
            },
            _ => "{\"error\":\"no root, or a path that is not UTF-8\"}".to_string(),
        };
        if !out.is_null() {
            std::ptr::copy_nonoverlapping(json.as_ptr(), out, json.len().min(cap));
        }
        json.len() as isize
    })
}
