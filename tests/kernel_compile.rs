//! Compiles every kernel in `kernels/` to CUBIN for sm_90 with NVRTC. Needs libnvrtc and the CUDA
//! headers but no GPU. Point it at them with `RECALL_NVRTC_LIB` (libnvrtc.so.13 or its directory) and
//! `RECALL_CUDA_INCLUDE` (the directory holding cuda_bf16.h); `.ci/run` installs the pip wheels
//! nvidia-cuda-nvrtc==13.0.88 and nvidia-cuda-runtime==13.0.96 into `.venv-nvrtc` and sets both.
//! Without NVRTC the test is skipped with a message, except under CI (`CI=true`), where it fails.
#![cfg(feature = "cuda")]

use recall::backend::cuda::{compile_all, libs, SOURCES};

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

#[test]
fn every_kernel_compiles_for_sm_90() {
    if let Err(e) = libs::ensure_nvrtc().and_then(|()| libs::find_cuda_include().map(|_| ())) {
        if in_ci() {
            panic!("CI=true but NVRTC or the CUDA headers are missing: {e}");
        }
        eprintln!("SKIP kernel_compile: {e}");
        return;
    }
    let cubins = compile_all("sm_90").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cubins.len(), SOURCES.len());
    let total: usize = cubins.iter().map(|(_, n)| n).sum();
    for (name, bytes) in &cubins {
        assert!(*bytes > 0, "{name}: empty CUBIN");
        eprintln!("kernels/{name}.cu -> sm_90 CUBIN, {bytes} bytes");
    }
    let functions: usize = SOURCES.iter().map(|k| k.functions.len()).sum();
    eprintln!(
        "{} files, {functions} kernels, {total} bytes of CUBIN for sm_90",
        cubins.len()
    );
}

#[test]
fn bad_arch_is_an_error_not_a_panic() {
    if libs::ensure_nvrtc().is_err() {
        return;
    }
    assert!(compile_all("compute_90").is_err());
    assert!(compile_all("sm_").is_err());
}
