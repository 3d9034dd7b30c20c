//! The libcudart loader picks a runtime the driver can run (issue 19): fake runtimes, built here
//! with the C compiler, report their own and the driver's version; a CUDA 13 runtime on a CUDA 12
//! driver is skipped (with the reason) and the next candidate, a CUDA 12 runtime, is taken.

use std::path::{Path, PathBuf};
use std::process::Command;

use multirail_gpu::{CudaRuntime, DeviceError, LoadOptions};

/// Every symbol the loader resolves, as stubs returning cudaSuccess (0).
const STUBS: &[&str] = &[
    "cudaGetDeviceCount",
    "cudaGetDevice",
    "cudaSetDevice",
    "cudaMalloc",
    "cudaFree",
    "cudaMallocHost",
    "cudaFreeHost",
    "cudaMemcpyAsync",
    "cudaStreamCreateWithFlags",
    "cudaStreamDestroy",
    "cudaStreamSynchronize",
    "cudaStreamWaitEvent",
    "cudaEventCreateWithFlags",
    "cudaEventRecord",
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaEventDestroy",
    "cudaPointerGetAttributes",
    "cudaIpcGetMemHandle",
    "cudaIpcOpenMemHandle",
    "cudaIpcCloseMemHandle",
    "cudaGetLastError",
];

/// Builds a fake libcudart at `path` reporting runtime `rt` and driver `drv`.
fn fake(path: &Path, rt: i32, drv: i32) -> Option<()> {
    std::fs::create_dir_all(path.parent()?).ok()?;
    let mut c = String::new();
    for s in STUBS {
        c += &format!("int {s}(void) {{ return 0; }}\n");
    }
    c += "const char *cudaGetErrorString(int e) { return \"fake\"; }\nconst char *cudaGetErrorName(int e) { return \"fake\"; }\n";
    c += &format!("int cudaRuntimeGetVersion(int *v) {{ *v = {rt}; return 0; }}\n");
    c += &format!("int cudaDriverGetVersion(int *v) {{ *v = {drv}; return 0; }}\n");
    let src = path.with_extension("c");
    std::fs::write(&src, c).ok()?;
    let ok = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(path).arg(&src).status().ok()?.success();
    ok.then_some(())
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mr-loader-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_runtime_newer_than_the_driver_is_skipped_for_the_next() {
    let root = tmpdir("skip");
    let (a, b) = (root.join("a"), root.join("b"));
    // Site a holds only the CUDA 13 wheel; site b the CUDA 12 one. The driver supports 12.8.
    // cc is part of the build toolchain (crates compile C), so it is always here.
    fake(&a.join("nvidia/cu13/lib/libcudart.so.13"), 13000, 12080).expect("cc builds a fake runtime");
    fake(&b.join("nvidia/cuda_runtime/lib/libcudart.so.12"), 12090, 12080).expect("cc builds a fake runtime");
    let opts = LoadOptions { explicit: None, wheel_dirs: vec![a.clone(), b.clone()], system: false };
    let rt = CudaRuntime::load(&opts).expect("the CUDA 12 runtime is taken");
    assert_eq!(rt.path(), b.join("nvidia/cuda_runtime/lib/libcudart.so.12"));
    assert_eq!((rt.runtime_version(), rt.driver_version()), (12090, 12080));

    // With only the CUDA 13 runtime there is nothing to run: NotFound says why it was skipped.
    let only13 = LoadOptions { explicit: None, wheel_dirs: vec![a.clone()], system: false };
    let e = CudaRuntime::load(&only13).unwrap_err();
    assert!(matches!(e, DeviceError::NotFound { .. }), "{e:?}");
    assert!(e.to_string().contains("runtime 13.0 needs a CUDA 13 driver"), "{e}");

    // Named explicitly, the mismatch is NoDevice with the same reason, nothing else tried.
    let explicit = LoadOptions { explicit: Some(a.join("nvidia/cu13/lib/libcudart.so.13")), wheel_dirs: vec![b], system: false };
    let e = CudaRuntime::load(&explicit).unwrap_err();
    assert!(matches!(e, DeviceError::NoDevice { .. }) && e.to_string().contains("CUDA 12.8"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn with_no_driver_the_first_runtime_is_kept_to_say_so() {
    let root = tmpdir("nodrv");
    fake(&root.join("nvidia/cuda_runtime/lib/libcudart.so.12"), 12090, 0).expect("cc builds a fake runtime");
    let opts = LoadOptions { explicit: None, wheel_dirs: vec![root.clone()], system: false };
    let rt = CudaRuntime::load(&opts).expect("kept, so that device_count reports the cause");
    assert_eq!(rt.driver_version(), 0);
    let _ = std::fs::remove_dir_all(&root);
}
