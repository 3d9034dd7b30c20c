//! Which NIXL loaded us, and whether this plugin was built and tested for it.
//!
//! NIXL's plugin `api_version` has been 1 while the engine base class and its vtable changed,
//! so it protects nothing. The plugin therefore finds the `libnixl.so` mapped into the process
//! and the version of the package that installed it (the `*.dist-info` beside it in
//! site-packages), and refuses anything but the versions it was tested with. A NIXL built and
//! installed from source (Dynamo's containers: meson into /opt/nvidia/nvda_nixl, no dist-info
//! beside the library) is known by the version its build compiled into `libnixl_common.so`
//! (meson's project version, which NIXL logs as "NIXL version: ..."): accepted when supported,
//! with a log line saying so. `MULTIRAIL_NIXL_ALLOW_UNTESTED=1` loads any other anyway (with a
//! warning).

use std::ffi::CStr;
use std::path::{Path, PathBuf};

/// NIXL versions whose engine ABI the shim was checked against (layout and vtable compared
/// with the wheel's own plugins; tests/test_nixl_plugin.py run against it in CI): a release
/// series, `1.5` meaning every 1.5.x, of any of NIXL's distributions (`nixl_cu12`, `nixl_cu13`:
/// the same sources built for another CUDA).
pub const SUPPORTED: &[&str] = &["1.5"];

/// Whether `version` belongs to a supported release series.
pub fn supported(version: &str) -> bool {
    SUPPORTED.iter().any(|s| version == *s || version.strip_prefix(s).is_some_and(|rest| rest.starts_with('.')))
}

pub const ENV_ALLOW: &str = "MULTIRAIL_NIXL_ALLOW_UNTESTED";

/// What was found about the host NIXL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub lib: Option<PathBuf>,
    /// (distribution name, version) from the dist-info beside it.
    pub dist: Option<(String, String)>,
    /// (library, version) compiled into NIXL's own `libnixl_common.so` (a source build).
    pub built: Option<(PathBuf, String)>,
}

/// Paths of every shared object mapped into this process.
fn loaded_objects() -> Vec<PathBuf> {
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut libc::c_void) -> libc::c_int {
        // SAFETY: the loader hands a valid info for the duration of the call; `data` is the
        // Vec below.
        let v = &mut *(data as *mut Vec<PathBuf>);
        let name = (*info).dlpi_name;
        if !name.is_null() {
            let s = CStr::from_ptr(name).to_string_lossy();
            if !s.is_empty() {
                v.push(PathBuf::from(s.into_owned()));
            }
        }
        0
    }
    let mut v: Vec<PathBuf> = Vec::new();
    // SAFETY: the callback only reads the entries and pushes into `v`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(Some(each), &mut v as *mut Vec<PathBuf> as *mut libc::c_void);
    }
    v
}

/// The dist-info of the package that ships `lib`: site-packages holds `<dist>-<ver>.dist-info`
/// and the library sits one or two directories below site-packages.
fn dist_of(lib: &Path) -> Option<(String, String)> {
    // Lexically: the loader reports `site/nixl_cu12/../.nixl_cu12.mesonpy.libs/libnixl.so`, and
    // `..` after a linked directory would lead the kernel elsewhere.
    let mut norm = PathBuf::new();
    for c in lib.components() {
        match c {
            std::path::Component::ParentDir => {
                norm.pop();
            }
            std::path::Component::CurDir => {}
            c => norm.push(c),
        }
    }
    for dir in norm.ancestors().skip(1).take(3) {
        let Ok(rd) = std::fs::read_dir(dir) else { continue };
        let mut found = Vec::new();
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if let Some(stem) = n.strip_suffix(".dist-info") {
                if let Some((dist, ver)) = stem.rsplit_once('-') {
                    if dist == "nixl" || dist.starts_with("nixl_cu") {
                        found.push((dist.to_string(), ver.to_string()));
                    }
                }
            }
        }
        // The distribution that holds the library (`.nixl_cu12.mesonpy.libs`, `nixl_cu13.libs`
        // in its path) first, then any CUDA build (`nixl_cuNN`), then the `nixl` meta package,
        // which only depends on one of them and carries its own version.
        let path = norm.to_string_lossy().into_owned();
        found.sort_by_key(|(d, v)| (d == "nixl", !path.contains(d.as_str()), d.clone(), v.clone()));
        if let Some(f) = found.into_iter().next() {
            return Some(f);
        }
    }
    None
}

/// The version NIXL's build compiled into `bytes` (libnixl_common.so): the string that follows
/// "NIXL version: " in its read-only data, a dotted number such as "1.5.1". None when there is
/// none (another library, or a build without the version).
pub fn version_in_library(bytes: &[u8]) -> Option<String> {
    const MARK: &[u8] = b"NIXL version: \0";
    let at = bytes.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    // The next strings (the compiler may put others between): the first that is a version.
    bytes[at..bytes.len().min(at + 256)].split(|b| *b == 0).filter(|s| !s.is_empty()).find_map(|s| {
        let v = std::str::from_utf8(s).ok()?;
        let parts: Vec<&str> = v.split('.').collect();
        (parts.len() >= 2 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))).then(|| v.to_string())
    })
}

/// NIXL's `libnixl_common.so` (loaded with libnixl.so, or beside it) and the version in it.
fn built_version(loaded: &[PathBuf], lib: &Path) -> Option<(PathBuf, String)> {
    let is_common = |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libnixl_common.so"));
    let common = loaded.iter().find(|p| is_common(p)).cloned().or_else(|| Some(lib.parent()?.join("libnixl_common.so")))?;
    let bytes = std::fs::read(&common).ok()?;
    version_in_library(&bytes).map(|v| (common, v))
}

pub fn detect() -> Host {
    let loaded = loaded_objects();
    let lib = loaded.iter().find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libnixl.so"))).cloned();
    let dist = lib.as_deref().and_then(dist_of);
    let built = match (&lib, &dist) {
        (Some(l), None) => built_version(&loaded, l),
        _ => None,
    };
    Host { lib, dist, built }
}

/// Ok(description) when the plugin may run in this NIXL; Err(the reason) otherwise.
pub fn verdict(host: &Host, allow_untested: bool) -> Result<String, String> {
    let what = match (&host.lib, &host.dist) {
        (None, _) => "no libnixl.so is loaded in this process".to_string(),
        (Some(l), None) => match &host.built {
            Some((common, v)) if supported(v) => {
                return Ok(format!(
                    "NIXL {v} built from source at {} (no package beside it; version {v} read from {})",
                    l.display(),
                    common.display()
                ));
            }
            Some((common, v)) => format!(
                "NIXL {v} built from source at {} (version read from {}) is not a version this plugin was built and tested for",
                l.display(),
                common.display()
            ),
            None => format!("NIXL at {} has no package version beside it and no version in its libnixl_common.so", l.display()),
        },
        (Some(l), Some((d, v))) => {
            if supported(v) {
                return Ok(format!("{d} {v} ({})", l.display()));
            }
            format!("NIXL {v} ({d}, {}) is not a version this plugin was built and tested for", l.display())
        }
    };
    let msg = format!("{what}; supported: {}", SUPPORTED.iter().map(|s| format!("{s}.x")).collect::<Vec<_>>().join(", "));
    if allow_untested {
        Ok(format!("{msg}; loading anyway because {ENV_ALLOW}=1"))
    } else {
        Err(format!("{msg}. Set {ENV_ALLOW}=1 to load it anyway (at your own risk: the engine ABI may differ)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let ok = Host { lib: Some("/x/libnixl.so".into()), dist: Some(("nixl_cu12".into(), "1.5.1".into())), built: None };
        assert!(verdict(&ok, false).is_ok());
        let old = Host { lib: Some("/x/libnixl.so".into()), dist: Some(("nixl_cu12".into(), "1.4.0".into())), built: None };
        let e = verdict(&old, false).unwrap_err();
        assert!(e.contains("1.4.0") && e.contains("1.5.x") && e.contains(ENV_ALLOW), "{e}");
        let cu13 = Host { lib: Some("/x/libnixl.so".into()), dist: Some(("nixl_cu13".into(), "1.5.2".into())), built: None };
        assert!(verdict(&cu13, false).is_ok());
        assert!(!supported("1.50.0") && !supported("1.6.0") && supported("1.5") && supported("1.5.0rc1".trim_end_matches("rc1")));
        assert!(verdict(&old, true).unwrap().contains("anyway"));
        let none = Host { lib: None, dist: None, built: None };
        assert!(verdict(&none, false).unwrap_err().contains("no libnixl.so"));
        // a source build: the version compiled into libnixl_common.so decides
        let src = |v: &str| Host {
            lib: Some("/opt/nixl/libnixl.so".into()),
            dist: None,
            built: Some(("/opt/nixl/libnixl_common.so".into(), v.into())),
        };
        assert!(verdict(&src("1.5.1"), false).unwrap().contains("built from source"));
        let e = verdict(&src("1.6.0"), false).unwrap_err();
        assert!(e.contains("1.6.0") && e.contains(ENV_ALLOW), "{e}");
        let unknown = Host { lib: Some("/opt/nixl/libnixl.so".into()), dist: None, built: None };
        assert!(verdict(&unknown, false).is_err());
    }

    #[test]
    fn the_version_compiled_into_the_library() {
        let lib = b"\x7fELF...\0ERROR\0NIXL_LOG_LEVEL\0NIXL version: \0\x001.5.1\0 (git: \0abc1d2a52eb\0";
        assert_eq!(version_in_library(lib).as_deref(), Some("1.5.1"));
        assert_eq!(version_in_library(b"NIXL version: \0 (git: \0abc\0"), None);
        assert_eq!(version_in_library(b"no mark here 1.5.1\0"), None);
    }

    #[test]
    fn dist_info_beside_the_library() {
        let d = std::env::temp_dir().join(format!("mrnixl-{}", std::process::id()));
        let libs = d.join(".nixl_cu12.mesonpy.libs");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::create_dir_all(d.join("nixl_cu12-1.5.1.dist-info")).unwrap();
        assert_eq!(dist_of(&libs.join("libnixl.so")), Some(("nixl_cu12".into(), "1.5.1".into())));
        let via_pkg = d.join("nixl_cu12").join("..").join(".nixl_cu12.mesonpy.libs").join("libnixl.so");
        assert_eq!(dist_of(&via_pkg), Some(("nixl_cu12".into(), "1.5.1".into())));
        // the `nixl` meta package beside it does not decide (it sorts first by name)
        std::fs::create_dir_all(d.join("nixl-0.9.0.dist-info")).unwrap();
        assert_eq!(dist_of(&libs.join("libnixl.so")), Some(("nixl_cu12".into(), "1.5.1".into())));
        // of two CUDA builds, the one whose directory holds the library
        std::fs::create_dir_all(d.join("nixl_cu11-0.1.0.dist-info")).unwrap();
        assert_eq!(dist_of(&libs.join("libnixl.so")), Some(("nixl_cu12".into(), "1.5.1".into())));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
