//! Finding and `dlopen`ing libucp at run time.
//!
//! Order (docs/ucx.md, /work/shared/ucx-notes.md):
//! 1. an explicit path (`MULTIRAIL_UCX_LIB`, or [`LoadOptions::explicit`]); if it fails, that is
//!    the error (nothing else is tried: an explicit choice must not silently become another UCX);
//! 2. a system libucp (`libucp.so.0` in `LD_LIBRARY_PATH`, the `ldconfig` cache, the standard
//!    library directories) whose module directory has an InfiniBand transport (`ucx/libuct_ib*`);
//! 3. the `libucx` wheel: directories handed in by the caller (the Python side passes the wheel's
//!    `libucx/lib`) or listed in `MULTIRAIL_UCX_WHEEL_DIR`;
//! 4. a system libucp without InfiniBand (tcp/shm only), as a last resort.
//!
//! libucp's dependencies (libucm, libucs, libuct) are preloaded from libucp's own directory so
//! that a second UCX elsewhere on the search path (for example the wheel's in `LD_LIBRARY_PATH`)
//! cannot be mixed in, and afterwards checked (`dladdr`): a mix is [`Error::MixedInstall`].
//! Everything is opened `RTLD_NOW | RTLD_LOCAL` (UCX's symbols stay out of the
//! global namespace, as the wheel's own `load_library` does) and never closed: UCX installs
//! memory hooks and threads that must not outlive their code. Hence **one UCX per process**: the
//! first successful load is reused by every later call, and a library that was loaded but found
//! unusable (a missing symbol, too old) ends the search rather than letting a second UCX in.

use std::ffi::{c_uint, CStr, OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, PoisonError};

use libloading::os::unix::{Library, RTLD_LAZY, RTLD_LOCAL, RTLD_NOW};

use crate::error::{Attempt, Attempts, Error, Result};
use crate::sys::Api;

/// Environment variable naming libucp explicitly (a path to `libucp.so[.0]`).
pub const ENV_LIB: &str = "MULTIRAIL_UCX_LIB";
/// Environment variable with `:`-separated directories of the `libucx` wheel (its `libucx/lib`,
/// the `libucx` package directory or the `site-packages` holding it).
pub const ENV_WHEEL_DIR: &str = "MULTIRAIL_UCX_WHEEL_DIR";
/// Environment variable that, set to `0`, `false`, `no` or `off`, skips the system search.
pub const ENV_SYSTEM: &str = "MULTIRAIL_UCX_SYSTEM";
/// The oldest UCX whose headers these bindings were checked against.
pub const MIN_VERSION: Version = Version { major: 1, minor: 13, release: 0 };
/// The soname searched for.
pub const LIBUCP_SONAME: &str = "libucp.so.0";
/// Dependencies preloaded from libucp's directory (see `preload`).
const DEPS: [&str; 3] = ["libucm.so.0", "libucs.so.0", "libuct.so.0"];

/// A UCX release number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub release: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.release)
    }
}

/// Where the loaded library came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `MULTIRAIL_UCX_LIB` / [`LoadOptions::explicit`].
    Explicit,
    /// The system's libucp (with or without InfiniBand: see [`LibInfo::has_ib`]).
    System,
    /// The `libucx` wheel.
    Wheel,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Explicit => "explicit (MULTIRAIL_UCX_LIB)",
            Source::System => "system",
            Source::Wheel => "libucx wheel",
        })
    }
}

/// What was loaded: report it (doctor, agent start-up logs).
#[derive(Clone, Debug)]
pub struct LibInfo {
    /// The libucp that was opened (symlinks resolved).
    pub path: PathBuf,
    pub source: Source,
    /// `ucp_get_version`.
    pub version: Version,
    /// `ucp_get_version_string`.
    pub version_string: String,
    /// The libucs, libuct and libucm that libucp was bound to (all in libucp's directory).
    pub deps: Vec<PathBuf>,
    /// Transport modules found in the module directory (`<libdir>/ucx/libuct_<name>.so*`), e.g.
    /// `ib`, `ib_mlx5`, `rdmacm`, `cma`, `cuda`. Transports built into libuct itself (tcp, shm,
    /// self) are not listed.
    pub modules: Vec<String>,
    /// Whether an InfiniBand transport module (`ib`, `ib_*`) is present. `false` on a host with
    /// RDMA NICs means UCX will silently use TCP: say so loudly.
    pub has_ib: bool,
}

impl fmt::Display for LibInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "UCX {} ({}) from {}; modules: [{}]; InfiniBand: {}",
            self.version_string,
            self.source,
            self.path.display(),
            self.modules.join(", "),
            if self.has_ib { "yes" } else { "no" }
        )
    }
}

impl LibInfo {
    /// The warning to print (doctor, agent start-up) when this host has RDMA devices but the
    /// loaded UCX has no InfiniBand transport, so UCX would silently carry the rails over TCP.
    pub fn rdma_warning(&self) -> Option<String> {
        self.rdma_warning_for(&rdma_devices())
    }

    /// [`LibInfo::rdma_warning`] for a given list of RDMA devices.
    pub fn rdma_warning_for(&self, devices: &[String]) -> Option<String> {
        if self.has_ib || devices.is_empty() {
            return None;
        }
        Some(format!(
            "this host has RDMA devices ({}) but the loaded UCX ({} {} at {}) has no InfiniBand transport: \
             UCX would move the data over TCP. Install the system UCX (`apt-get install libucx0` on Debian/Ubuntu, \
             DOCA/MLNX_OFED UCX on clusters) or set {ENV_LIB}=/path/to/libucp.so.0 of an RDMA-capable build",
            devices.join(", "),
            self.source,
            self.version_string,
            self.path.display()
        ))
    }
}

/// RDMA devices of this host (`/sys/class/infiniband/*`), sorted.
pub fn rdma_devices() -> Vec<String> {
    let mut devs: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    devs.sort();
    devs
}

/// Where to look for libucp. [`LoadOptions::from_env`] is the usual start; the Python side adds
/// the wheel's library directory with [`LoadOptions::wheel_dir`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Load exactly this libucp (and fail if it cannot be loaded).
    pub explicit: Option<PathBuf>,
    /// Search the system's libraries.
    pub system: bool,
    /// Candidate directories of the `libucx` wheel, in order.
    pub wheel_dirs: Vec<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { explicit: None, system: true, wheel_dirs: Vec::new() }
    }
}

impl LoadOptions {
    /// From `MULTIRAIL_UCX_LIB`, `MULTIRAIL_UCX_WHEEL_DIR` and `MULTIRAIL_UCX_SYSTEM`.
    pub fn from_env() -> Self {
        Self::from_vars(std::env::var_os(ENV_LIB), std::env::var_os(ENV_WHEEL_DIR), std::env::var_os(ENV_SYSTEM))
    }

    /// [`LoadOptions::from_env`] with the variables' values passed in.
    pub fn from_vars(lib: Option<OsString>, wheel_dirs: Option<OsString>, system: Option<OsString>) -> Self {
        let explicit = lib.filter(|v| !v.is_empty()).map(PathBuf::from);
        let wheel_dirs = wheel_dirs.map(|v| std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()).collect()).unwrap_or_default();
        let system = !matches!(
            system.as_deref().and_then(OsStr::to_str).map(|s| s.trim().to_ascii_lowercase()).as_deref(),
            Some("0" | "false" | "no" | "off")
        );
        LoadOptions { explicit, system, wheel_dirs }
    }

    /// Adds a candidate wheel directory (after those already listed).
    pub fn wheel_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.wheel_dirs.push(dir.into());
        self
    }
}

struct Loaded {
    api: Api,
    info: LibInfo,
    /// Never closed (see the module docs); kept here so they are visibly owned.
    _libs: Vec<Library>,
}

/// A loaded libucp. Cheap to clone; every [`crate::Context`] keeps one.
#[derive(Clone)]
pub struct Ucx(Arc<Loaded>);

impl fmt::Debug for Ucx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Ucx").field(&self.0.info).finish()
    }
}

/// The process's UCX, once loaded (never unloaded).
static LOADED: Mutex<Option<Ucx>> = Mutex::new(None);

impl Ucx {
    /// Loads UCX as [`LoadOptions::from_env`] says.
    pub fn load() -> Result<Ucx> {
        Self::load_with(&LoadOptions::from_env())
    }

    /// Loads UCX from the first usable candidate of `opts` (see the module docs for the order),
    /// or returns the UCX this process loaded before.
    pub fn load_with(opts: &LoadOptions) -> Result<Ucx> {
        let mut slot = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(explicit) = &opts.explicit {
            let path = explicit.canonicalize().map_err(|e| Error::ExplicitLoad { path: explicit.clone(), reason: e.to_string() })?;
            if let Some(ucx) = slot.as_ref() {
                if ucx.0.info.path == path {
                    return Ok(ucx.clone());
                }
                return Err(Error::AlreadyLoaded { loaded: ucx.0.info.path.clone(), requested: path });
            }
            let ucx = match open(&path, Source::Explicit) {
                Ok(ucx) => ucx,
                Err(Fail::Soft(reason)) => return Err(Error::ExplicitLoad { path, reason }),
                Err(Fail::Fatal(e)) => return Err(e),
            };
            *slot = Some(ucx.clone());
            return Ok(ucx);
        }
        if let Some(ucx) = slot.as_ref() {
            return Ok(ucx.clone());
        }
        let mut tried = Vec::new();
        let system = if opts.system { system_candidates() } else { Vec::new() };
        let (with_ib, without_ib): (Vec<_>, Vec<_>) = system.into_iter().partition(|p| scan_modules(p).1);
        let mut order: Vec<(PathBuf, Source)> = with_ib.into_iter().map(|p| (p, Source::System)).collect();
        for dir in &opts.wheel_dirs {
            match wheel_libucp(dir) {
                Some(p) => order.push((p, Source::Wheel)),
                None => tried.push(Attempt { path: dir.clone(), reason: "no libucp.so.0 in this wheel directory".into() }),
            }
        }
        order.extend(without_ib.into_iter().map(|p| (p, Source::System)));
        if opts.system && order.iter().all(|(_, s)| *s != Source::System) {
            tried.push(Attempt { path: PathBuf::from(LIBUCP_SONAME), reason: "not found on this system".into() });
        }
        for (path, source) in order {
            let path = path.canonicalize().unwrap_or(path);
            match open(&path, source) {
                Ok(ucx) => {
                    *slot = Some(ucx.clone());
                    return Ok(ucx);
                }
                Err(Fail::Soft(reason)) => tried.push(Attempt { path, reason }),
                Err(Fail::Fatal(e)) => return Err(e),
            }
        }
        Err(Error::NotFound { tried: Attempts(tried) })
    }

    /// The UCX this process has loaded, if any.
    pub fn loaded() -> Option<Ucx> {
        LOADED.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Which library, version and transports were loaded.
    pub fn info(&self) -> &LibInfo {
        &self.0.info
    }

    pub(crate) fn api(&self) -> &Api {
        &self.0.api
    }
}

enum Fail {
    /// Nothing was loaded: try the next candidate.
    Soft(String),
    /// Something of this UCX is loaded now: stop.
    Fatal(Error),
}

fn dlopen(path: &Path, flags: std::ffi::c_int) -> std::result::Result<Library, String> {
    // SAFETY: loading runs the library's initialisers. For UCX (libucm/libucs/libuct/libucp)
    // these are the documented way to use it; a file that is not UCX is the caller's choice
    // (explicit path) or a file named like libucp in a library directory.
    unsafe { Library::open(Some(path), flags) }.map_err(|e| e.to_string())
}

/// Preloads libucp's dependencies from its own directory, so that the loader binds libucp to
/// them (a loaded object satisfies a NEEDED entry with its soname) and not to another UCX on the
/// search path. libucm comes first and **lazily**: it calls two libucs functions but does not
/// list libucs as a dependency (libucs depends on libucm), so `RTLD_NOW` fails on it; the calls
/// bind once libucs is loaded (glibc adds libucs's scope to libucm's when libucs is opened) and
/// happen only from `ucp_init` on. If that lazy open is refused (`LD_BIND_NOW`), nothing is
/// preloaded and the loader's search decides; [`check_deps`] catches a mix either way.
fn preload(dir: &Path, libucp: &Path) -> std::result::Result<Vec<Library>, Fail> {
    let mut libs = Vec::new();
    let ucm = dir.join(DEPS[0]);
    if !ucm.is_file() {
        return Ok(libs);
    }
    match dlopen(&ucm, RTLD_LAZY | RTLD_LOCAL) {
        Ok(lib) => libs.push(lib),
        Err(_) => return Ok(libs),
    }
    for dep in &DEPS[1..] {
        let p = dir.join(dep);
        if !p.is_file() {
            continue;
        }
        if let Err(reason) = dlopen(&p, RTLD_NOW | RTLD_LOCAL).map(|lib| libs.push(lib)) {
            return Err(partly_loaded(libs, libucp, format!("{}: {reason}", p.display())));
        }
    }
    Ok(libs)
}

/// A libucs, libuct and libucm symbol as seen from libucp's handle, and which file it is in.
const DEP_PROBES: [(&str, &str); 3] =
    [("libucs", "ucs_status_string\0"), ("libuct", "uct_query_components\0"), ("libucm", "ucm_set_event_handler\0")];

/// The files libucp's dependencies were bound to (`dladdr` of a symbol of each).
fn dep_paths(ucp: &Library) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for (_, sym) in DEP_PROBES {
        // SAFETY: only the symbol's address is taken, never dereferenced or called.
        let Ok(s) = (unsafe { ucp.get::<*mut std::ffi::c_void>(sym.as_bytes()) }) else { continue };
        let addr = s.into_raw();
        // SAFETY: Dl_info is plain pointers and integers; all-zero is valid.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr only reads the address and fills `info`.
        if unsafe { libc::dladdr(addr, &mut info) } != 0 && !info.dli_fname.is_null() {
            // SAFETY: dli_fname is a NUL-terminated path owned by the loader for as long as the
            // object stays loaded (forever here); copied at once.
            let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
            let p = PathBuf::from(name);
            out.push(p.canonicalize().unwrap_or(p));
        }
    }
    out
}

/// Fails when a dependency was bound to a file outside libucp's directory (two UCX builds mixed).
fn check_deps(libucp: &Path, deps: &[PathBuf]) -> std::result::Result<(), Error> {
    let dir = libucp.parent().map(|d| d.canonicalize().unwrap_or_else(|_| d.to_path_buf()));
    for dep in deps {
        if dep.parent().map(Path::to_path_buf) != dir {
            return Err(Error::MixedInstall { libucp: libucp.to_path_buf(), dependency: dep.clone() });
        }
    }
    Ok(())
}

fn open(path: &Path, source: Source) -> std::result::Result<Ucx, Fail> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mut libs = preload(dir, path)?;
    let ucp = match dlopen(path, RTLD_NOW | RTLD_LOCAL) {
        Ok(lib) => lib,
        Err(reason) if libs.is_empty() => return Err(Fail::Soft(reason)),
        Err(reason) => return Err(partly_loaded(libs, path, reason)),
    };
    // SAFETY: a file found as libucp (or named so explicitly) is taken to be libucp; Api::load
    // fails cleanly if it lacks any of the functions.
    let api = match unsafe { Api::load(&ucp) } {
        Ok(api) => api,
        Err(missing) => {
            std::mem::forget((libs, ucp));
            return Err(Fail::Fatal(Error::MissingSymbol { path: path.to_path_buf(), symbol: missing.0, reason: missing.1 }));
        }
    };
    let deps = dep_paths(&ucp);
    libs.push(ucp);
    if let Err(e) = check_deps(path, &deps) {
        std::mem::forget(libs);
        return Err(Fail::Fatal(e));
    }
    let (mut major, mut minor, mut release): (c_uint, c_uint, c_uint) = (0, 0, 0);
    // SAFETY: ucp_get_version writes three unsigned ints.
    unsafe { (api.get_version)(&mut major, &mut minor, &mut release) };
    let version = Version { major, minor, release };
    if version < MIN_VERSION || version.major != MIN_VERSION.major {
        std::mem::forget(libs);
        return Err(Fail::Fatal(Error::UnsupportedVersion { path: path.to_path_buf(), found: version, min: MIN_VERSION }));
    }
    // SAFETY: returns a static NUL-terminated string (or NULL, handled).
    let vs = unsafe { (api.get_version_string)() };
    let version_string = if vs.is_null() {
        version.to_string()
    } else {
        // SAFETY: non-NULL, NUL-terminated, static in libucp.
        unsafe { CStr::from_ptr(vs) }.to_string_lossy().into_owned()
    };
    let (modules, has_ib) = scan_modules(path);
    let info = LibInfo { path: path.to_path_buf(), source, version, version_string, deps, modules, has_ib };
    crate::quiesce::hook();
    Ok(Ucx(Arc::new(Loaded { api, info, _libs: libs })))
}

fn partly_loaded(libs: Vec<Library>, path: &Path, reason: String) -> Fail {
    // Never dlclose a UCX library that initialised (see the module docs).
    std::mem::forget(libs);
    Fail::Fatal(Error::NotFound {
        tried: Attempts(vec![Attempt {
            path: path.to_path_buf(),
            reason: format!("{reason} (its dependencies are loaded now, so no other UCX is tried in this process)"),
        }]),
    })
}

/// The transport modules next to `libucp` (`<dir>/ucx/libuct_<name>.so*`) and whether one is
/// InfiniBand.
pub(crate) fn scan_modules(libucp: &Path) -> (Vec<String>, bool) {
    let dir = libucp.parent().unwrap_or(Path::new("/")).join("ucx");
    let mut modules: Vec<String> = std::fs::read_dir(&dir)
        .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| module_name(&e.file_name().to_string_lossy())).collect())
        .unwrap_or_default();
    modules.sort();
    modules.dedup();
    let has_ib = modules.iter().any(|m| m == "ib" || m.starts_with("ib_"));
    (modules, has_ib)
}

/// `libuct_ib_mlx5.so.0.0.0` → `ib_mlx5`.
fn module_name(file: &str) -> Option<String> {
    let rest = file.strip_prefix("libuct_")?;
    let end = rest.find(".so")?;
    (end > 0).then(|| rest[..end].to_string())
}

/// libucp inside a wheel directory: `dir` may be `libucx/lib`, the `libucx` package or the
/// `site-packages` that holds it.
pub(crate) fn wheel_libucp(dir: &Path) -> Option<PathBuf> {
    const RELS: [&str; 6] =
        ["libucp.so.0", "libucp.so", "lib/libucp.so.0", "lib/libucp.so", "libucx/lib/libucp.so.0", "libucx/lib/libucp.so"];
    RELS.iter().map(|r| dir.join(r)).find(|p| p.is_file())
}

/// System `libucp.so.0` files: `LD_LIBRARY_PATH`, the `ldconfig` cache, standard directories.
fn system_candidates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH").map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    let mut files: Vec<PathBuf> = dirs.iter().map(|d| d.join(LIBUCP_SONAME)).collect();
    files.extend(ldconfig_cache(LIBUCP_SONAME));
    let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    dirs = vec![PathBuf::from(multiarch), "/usr/lib64".into(), "/usr/lib".into(), "/usr/local/lib".into(), "/opt/ucx/lib".into()];
    files.extend(dirs.iter().map(|d| d.join(LIBUCP_SONAME)));
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut out = Vec::new();
    for f in files {
        if !f.is_file() {
            continue;
        }
        let key = f.canonicalize().unwrap_or_else(|_| f.clone());
        if !seen.contains(&key) {
            seen.push(key);
            out.push(f);
        }
    }
    out
}

/// Paths of `soname` in `ldconfig -p` (empty when ldconfig is not there).
fn ldconfig_cache(soname: &str) -> Vec<PathBuf> {
    for exe in ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"] {
        if let Ok(out) = Command::new(exe).arg("-p").output() {
            if out.status.success() {
                return parse_ldconfig(&String::from_utf8_lossy(&out.stdout), soname);
            }
        }
    }
    Vec::new()
}

/// Lines of `ldconfig -p` look like `\tlibucp.so.0 (libc6,x86-64) => /lib/x86_64-linux-gnu/libucp.so.0`.
pub(crate) fn parse_ldconfig(text: &str, soname: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line.strip_prefix(soname)?;
            if !rest.starts_with(' ') {
                return None;
            }
            let (_, path) = rest.split_once("=> ")?;
            Some(PathBuf::from(path.trim()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_from_vars() {
        let o = LoadOptions::from_vars(None, None, None);
        assert_eq!(o, LoadOptions::default());
        assert!(o.system);
        let o = LoadOptions::from_vars(Some("".into()), Some("/a:/b::".into()), Some("0".into()));
        assert_eq!(o.explicit, None);
        assert_eq!(o.wheel_dirs, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert!(!o.system);
        let o = LoadOptions::from_vars(Some("/x/libucp.so.0".into()), None, Some("yes".into())).wheel_dir("/w");
        assert_eq!(o.explicit, Some(PathBuf::from("/x/libucp.so.0")));
        assert_eq!(o.wheel_dirs, vec![PathBuf::from("/w")]);
        assert!(o.system);
    }

    #[test]
    fn ldconfig_lines() {
        let text = "1234 libs found in cache `/etc/ld.so.cache'\n\
                    \tlibucp.so.0 (libc6,x86-64) => /lib/x86_64-linux-gnu/libucp.so.0\n\
                    \tlibucp.so.0 (libc6) => /lib/i386-linux-gnu/libucp.so.0\n\
                    \tlibucp.so (libc6,x86-64) => /usr/lib/libucp.so\n\
                    \tlibucp.so.0x (libc6,x86-64) => /nope\n";
        assert_eq!(
            parse_ldconfig(text, "libucp.so.0"),
            vec![PathBuf::from("/lib/x86_64-linux-gnu/libucp.so.0"), PathBuf::from("/lib/i386-linux-gnu/libucp.so.0")]
        );
    }

    #[test]
    fn module_names_and_wheel_layouts() {
        assert_eq!(module_name("libuct_ib_mlx5.so.0.0.0").as_deref(), Some("ib_mlx5"));
        assert_eq!(module_name("libuct_cma.so").as_deref(), Some("cma"));
        assert_eq!(module_name("libucm_cuda.so.0"), None);
        assert_eq!(module_name("libuct_.so"), None);

        let root = std::env::temp_dir().join(format!("mr-ucx-load-{}", std::process::id()));
        let lib = root.join("site-packages/libucx/lib");
        std::fs::create_dir_all(lib.join("ucx")).unwrap();
        std::fs::write(lib.join("libucp.so.0"), b"").unwrap();
        for m in ["libuct_cma.so.0", "libuct_cma.so.0.0.0", "libuct_ib.so.0", "libucm_cuda.so"] {
            std::fs::write(lib.join("ucx").join(m), b"").unwrap();
        }
        let want = Some(lib.join("libucp.so.0"));
        assert_eq!(wheel_libucp(&lib), want);
        assert_eq!(wheel_libucp(&root.join("site-packages/libucx")), want);
        assert_eq!(wheel_libucp(&root.join("site-packages")), want);
        assert_eq!(wheel_libucp(&root), None);
        assert_eq!(scan_modules(&lib.join("libucp.so.0")), (vec!["cma".to_string(), "ib".to_string()], true));
        std::fs::remove_file(lib.join("ucx/libuct_ib.so.0")).unwrap();
        assert_eq!(scan_modules(&lib.join("libucp.so.0")), (vec!["cma".to_string()], false));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn rdma_warning_only_when_devices_and_no_ib() {
        let mut info = LibInfo {
            path: "/w/libucx/lib/libucp.so.0".into(),
            source: Source::Wheel,
            version: Version { major: 1, minor: 22, release: 0 },
            version_string: "1.22.0".into(),
            deps: vec![],
            modules: vec!["cma".into()],
            has_ib: false,
        };
        assert_eq!(info.rdma_warning_for(&[]), None);
        let w = info.rdma_warning_for(&["mlx5_0".into(), "mlx5_1".into()]).unwrap();
        assert!(w.contains("mlx5_0, mlx5_1") && w.contains("libucx0") && w.contains(ENV_LIB), "{w}");
        info.has_ib = true;
        assert_eq!(info.rdma_warning_for(&["mlx5_0".into()]), None);
    }

    #[test]
    fn not_found_says_how_to_install() {
        let e = Error::NotFound { tried: Attempts(vec![]) };
        let msg = e.to_string();
        assert!(msg.contains("pip install \"multirail[ucx]\""), "{msg}");
        assert!(msg.contains("libucx0"), "{msg}");
        assert!(msg.contains("MULTIRAIL_UCX_LIB"), "{msg}");
    }
}
