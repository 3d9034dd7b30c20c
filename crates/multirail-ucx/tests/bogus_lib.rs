//! `MULTIRAIL_UCX_LIB` naming something that is not a usable libucp gives a typed error and
//! tries nothing else. Its own test binary (own process): it sets environment variables, and a
//! process keeps the first UCX it loads.

use multirail_ucx::{Error, LoadOptions, Ucx, ENV_LIB};

#[test]
fn bogus_explicit_library_is_a_typed_error() {
    // A path that does not exist.
    std::env::set_var(ENV_LIB, "/nonexistent/multirail/libucp.so.0");
    let e = Ucx::load().unwrap_err();
    assert!(matches!(e, Error::ExplicitLoad { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("MULTIRAIL_UCX_LIB") && msg.contains("/nonexistent/multirail/libucp.so.0"), "{msg}");
    assert!(msg.contains("pip install \"multirail[ucx]\"") && msg.contains("libucx0"), "{msg}");

    // A file that is not a shared library.
    let not_elf = std::env::temp_dir().join(format!("mr-ucx-bogus-{}.so", std::process::id()));
    std::fs::write(&not_elf, b"this is not an ELF file").unwrap();
    std::env::set_var(ENV_LIB, &not_elf);
    let e = Ucx::load().unwrap_err();
    assert!(matches!(e, Error::ExplicitLoad { .. }), "{e}");
    eprintln!("{e}");
    std::fs::remove_file(&not_elf).unwrap();
    std::env::remove_var(ENV_LIB);

    // A real shared library that is not libucp (libm: harmless to load, lacks ucp_*).
    let libm =
        ["/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6", "/lib64/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6"]
            .into_iter()
            .find(|p| std::path::Path::new(p).is_file());
    if let Some(libm) = libm {
        let e = Ucx::load_with(&LoadOptions { explicit: Some(libm.into()), system: false, wheel_dirs: vec![] }).unwrap_err();
        assert!(matches!(e, Error::MissingSymbol { symbol: "ucp_get_version", .. }), "{e}");
        eprintln!("{e}");
    }

    // Nothing at all: no explicit path, no system search, no wheel.
    let e = Ucx::load_with(&LoadOptions { explicit: None, system: false, wheel_dirs: vec!["/nonexistent/wheel".into()] }).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/wheel"), "{e}");
    assert!(Ucx::loaded().is_none());
}
