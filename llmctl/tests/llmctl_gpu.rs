//! `llmctl gpu-info` and `llmctl run --local --backend gpu` on a real OpenCL runtime (PoCL in
//! CI). Without one the tests that need it say so and pass, unless `LLMD_REQUIRE_OPENCL=1`
//! (scripts/test.sh), which makes a missing runtime a failure.

mod common;

use common::{llmctl, model};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Whether an OpenCL device is there to test (panics when one is required and absent).
fn have_opencl() -> bool {
    let o = llmctl(&["gpu-info", "--gpu-cache", "none"]);
    if o.status.success() {
        return true;
    }
    let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
    assert!(!required, "LLMD_REQUIRE_OPENCL=1 and gpu-info failed: {}", text(&o.stderr));
    eprintln!("skipped: no usable OpenCL device ({})", text(&o.stderr).trim());
    false
}

/// llama.cpp's greedy text of the golden prompt "capital" (tests/golden/smollm2.json).
const CAPITAL_8: &str = " Paris.\n\nThe United States has";

#[test]
fn gpu_info_lists_the_device_and_passes_its_self_check() {
    if !have_opencl() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("llmctl-gpu-info-{}", std::process::id()));
    let cache = dir.to_str().expect("utf-8 path");
    let first = llmctl(&["gpu-info", "--gpu-cache", cache]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let out = text(&first.stdout);
    for want in ["OpenCL library: ", "device 0: ", "fp16 arithmetic (cl_khr_fp16): ", "selected: ", "kernel variant: "]
    {
        assert!(out.contains(want), "no {want:?} in:\n{out}");
    }
    assert!(out.contains("program: built from source"), "{out}");
    assert!(out.contains("self-check: all ") && out.contains("within tolerance"), "{out}");
    // The second start loads the cached binary; a corrupt cache file is rebuilt, not loaded.
    let second = text(&llmctl(&["gpu-info", "--gpu-cache", cache]).stdout);
    assert!(second.contains("program: loaded from the program cache"), "{second}");
    for f in std::fs::read_dir(&dir).expect("cache dir").flatten() {
        let mut b = std::fs::read(f.path()).expect("cache file");
        let last = b.len() - 1;
        b[last] ^= 0x55;
        std::fs::write(f.path(), b).expect("rewrite");
    }
    let third = llmctl(&["gpu-info", "--gpu-cache", cache]);
    assert!(third.status.success(), "{}", text(&third.stderr));
    let third = text(&third.stdout);
    assert!(third.contains("program: built from source") && third.contains("refused: corrupt"), "{third}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn run_local_decodes_on_the_gpu_with_llama_cpp_s_greedy_text() {
    if !have_opencl() {
        return;
    }
    let m = model();
    let m = m.to_str().expect("utf-8 path");
    let o =
        llmctl(&["run", "--local", "--model", m, "--backend", "gpu", "--max-tokens", "8", "The capital of France is"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), CAPITAL_8);
    let e = text(&o.stderr);
    assert!(e.contains("gpu: per decode step ") && e.contains(" kernels, "), "{e}");
}

#[test]
fn without_opencl_the_gpu_path_fails_with_a_one_line_reason() {
    let m = model();
    let m = m.to_str().expect("utf-8 path");
    let o = llmctl(&[
        "run",
        "--local",
        "--model",
        m,
        "--backend",
        "gpu",
        "--opencl-lib",
        "/nonexistent/libOpenCL.so",
        "hi",
    ]);
    assert!(!o.status.success());
    let e = text(&o.stderr);
    assert!(e.contains("cannot load the OpenCL library /nonexistent/libOpenCL.so"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    let o = llmctl(&["gpu-info", "--opencl-lib", "/nonexistent/libOpenCL.so"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("cannot load the OpenCL library"), "{}", text(&o.stderr));
    // A library that is not OpenCL: named by the entry point it lacks.
    let o = llmctl(&["gpu-info", "--opencl-lib", "libc.so.6"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("has no clGetPlatformIDs"), "{}", text(&o.stderr));
}
