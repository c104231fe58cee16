//! The kernel sources (`kernels/*.cu`, embedded at build time) and their NVRTC build to CUBIN.
//!
//! Usable without a GPU: [`compile_all`] needs only libnvrtc and the CUDA headers, which is what CI
//! checks (tests/kernel_compile.rs). The backend loads CUBIN, never PTX: PTX from a newer NVRTC cannot be
//! JIT-compiled by an older driver, while CUBIN for the device's exact `sm_XY` loads on any driver that
//! supports that architecture. Compiled modules are cached on disk keyed by an xxh64 of the source,
//! the options (arch, include dir), and the NVRTC version.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::libs::{self, cuda_err};
use crate::error::Result;

/// `RECALL_KERNEL_CACHE`: the cache directory, or `off` to compile every time.
pub const ENV_KERNEL_CACHE: &str = "RECALL_KERNEL_CACHE";

/// One kernel file and the entry points the backend takes from it.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File stem under `kernels/`.
    pub name: &'static str,
    pub source: &'static str,
    pub functions: &'static [&'static str],
}

const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel file.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "elementwise",
        source: include_str!("../../../kernels/elementwise.cu"),
        functions: &[
            "scale_v1",
            "add_v1",
            "silu_mul_v1",
            "gelu_v1",
            "fill_u16_v1",
            "fill_random_v1",
        ],
    },
    KernelSource {
        name: "embedding",
        source: include_str!("../../../kernels/embedding.cu"),
        functions: &[
            "gather_rows_v1",
            "split_cols_v1",
            "scatter_rows_v1",
            "weighted_embedding_v1",
        ],
    },
    KernelSource {
        name: "norm",
        source: include_str!("../../../kernels/norm.cu"),
        functions: &["rms_norm_v1", "layer_norm_v1"],
    },
    KernelSource {
        name: "rope",
        source: include_str!("../../../kernels/rope.cu"),
        functions: &["rope_v1"],
    },
    KernelSource {
        name: "attention",
        source: include_str!("../../../kernels/attention.cu"),
        functions: &["paged_attention_v1", "attn_combine_v1", "attention_segments_v1"],
    },
    KernelSource {
        name: "flash_attention",
        source: include_str!("../../../kernels/flash_attention.cu"),
        functions: &[
            "flash_attention_d16",
            "flash_attention_d32",
            "flash_attention_d48",
            "flash_attention_d64",
            "flash_attention_d80",
            "flash_attention_d96",
            "flash_attention_d112",
            "flash_attention_d128",
        ],
    },
    KernelSource {
        name: "fused",
        source: include_str!("../../../kernels/fused.cu"),
        functions: &["qk_norm_rope_write_v1"],
    },
    KernelSource {
        name: "decode_attention",
        source: include_str!("../../../kernels/decode_attention.cu"),
        functions: &[
            "paged_decode_v2_d128",
            "paged_decode_v2_d128_g16",
            "paged_decode_v2_d64",
            "paged_decode_v2_d64_g16",
        ],
    },
    KernelSource {
        name: "reduce",
        source: include_str!("../../../kernels/reduce.cu"),
        functions: &["log_softmax_gather_v1", "argmax_v1"],
    },
];

/// The translation unit handed to NVRTC: the file with `common.cuh` pasted in.
pub fn full_source(k: &KernelSource) -> String {
    k.source
        .replace("#include \"common.cuh\"", &COMMON.replace("#pragma once", ""))
}

fn check_arch(arch: &str) -> Result<()> {
    let ok = arch
        .strip_prefix("sm_")
        .is_some_and(|v| !v.is_empty() && v.trim_end_matches('a').chars().all(|c| c.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(cuda_err(format!(
            "bad GPU architecture `{arch}` (expected e.g. sm_90)"
        )))
    }
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; libnvrtc was checked by `ensure_nvrtc`.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

fn options(arch: &str, include: &std::path::Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("-I{}", include.display()),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ]
}

/// Compiles one kernel file to CUBIN for `arch` (e.g. `sm_90`), without the cache.
pub fn compile(k: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    check_arch(arch)?;
    libs::ensure_nvrtc()?;
    let include = libs::find_cuda_include()?;
    compile_with(k, arch, &options(arch, &include))
}

fn compile_with(k: &KernelSource, arch: &str, opts: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(full_source(k)).map_err(cuda_err)?;
    let file = CString::new(format!("{}.cu", k.name)).map_err(cuda_err)?;
    let prog = nvrtc::create_program(&src, Some(&file)).map_err(|e| cuda_err(format!("nvrtc: {e:?}")))?;
    // SAFETY: `prog` was just created and is destroyed exactly once below; every out-buffer is sized by
    // the matching Get*Size call.
    unsafe {
        let compiled = nvrtc::compile_program(prog, opts);
        let out = match compiled {
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(cuda_err(format!(
                    "NVRTC failed to compile kernels/{}.cu for {arch} ({e:?}):\n{log}",
                    k.name
                )))
            }
            Ok(()) => {
                let mut size = 0usize;
                let st = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size);
                if st != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                    Err(cuda_err(format!("nvrtcGetCUBINSize for {}: {st:?}", k.name)))
                } else {
                    let mut buf = vec![0u8; size];
                    let st = nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast::<c_char>());
                    if st == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(buf)
                    } else {
                        Err(cuda_err(format!("nvrtcGetCUBIN for {}: {st:?}", k.name)))
                    }
                }
            }
        };
        let _ = nvrtc::destroy_program(prog);
        out
    }
}

/// Compiles every kernel file for `arch` (no cache): `(file stem, CUBIN bytes)`. Needs only libnvrtc
/// and the headers, no GPU. NVRTC panics inside cudarc (a missing symbol) come back as errors.
pub fn compile_all(arch: &str) -> Result<Vec<(String, usize)>> {
    let run = || -> Result<Vec<(String, usize)>> {
        SOURCES
            .iter()
            .map(|k| compile(k, arch).map(|c| (k.name.to_string(), c.len())))
            .collect()
    };
    std::panic::catch_unwind(run).unwrap_or_else(|p| Err(cuda_err(panic_text(&p))))
}

pub(crate) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic in cudarc".into())
}

/// The cache directory: `$RECALL_KERNEL_CACHE`, `$XDG_CACHE_HOME/recall/kernels` or
/// `~/.cache/recall/kernels`; `None` when disabled or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    crate::cache_dir::under(ENV_KERNEL_CACHE, "kernels")
}

/// CUBIN for `k` on `arch`, from the disk cache when present, else compiled (and cached).
pub fn load_cubin(k: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    check_arch(arch)?;
    libs::ensure_nvrtc()?;
    let include = libs::find_cuda_include()?;
    let opts = options(arch, &include);
    let (major, minor) = nvrtc_version();
    let mut key = full_source(k);
    key.push_str(&format!("\n// {opts:?} nvrtc {major}.{minor}"));
    let hash = xxhash_rust::xxh64::xxh64(key.as_bytes(), 0);
    let path = cache_dir().map(|d| d.join(format!("{}-{arch}-{hash:016x}.cubin", k.name)));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile_with(k, arch, &opts)?;
    if let Some(p) = &path {
        // Best effort: a read-only cache only costs a recompile next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(cubin)
}
