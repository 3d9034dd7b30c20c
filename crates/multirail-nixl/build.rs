//! Compiles the C++ engine shim (shim/plugin.cpp) that NIXL's plugin loader talks to. The shim
//! is linked into this crate's cdylib; `nixl_plugin_init`/`nixl_plugin_fini` are exported from
//! Rust (src/lib.rs) so that the cdylib's export list holds exactly them.
fn main() {
    println!("cargo:rerun-if-changed=shim/plugin.cpp");
    cc::Build::new()
        .cpp(true)
        .file("shim/plugin.cpp")
        .std("c++20")
        // NIXL's wheel is built with the C++11 string ABI; the engine's base class layout
        // depends on it (static_asserts in the shim check the sizes).
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .flag("-fvisibility=hidden")
        .flag("-Wno-invalid-offsetof")
        .warnings(true)
        .extra_warnings(true)
        .compile("multirail_nixl_shim");
}
