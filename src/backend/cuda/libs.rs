//! Finding the CUDA libraries and headers at run time, and checking them before cudarc touches them.
//!
//! cudarc (with `dynamic-loading`) opens `libcuda.so.1`, `libnvrtc.so.13` and `libcublasLt.so.13` by
//! name on first use and panics when a library or symbol is missing. We look first, in the places
//! listed in docs/CUDA.md, open what we find by full path with `RTLD_GLOBAL` (so cudarc's later
//! `dlopen` by name reuses it: the loader matches an already loaded library by its soname), and then
//! ask cudarc's `is_culib_present()`; a miss becomes an [`Error`] that names what is missing and where
//! we looked.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// `RECALL_NVRTC_LIB`: the path of `libnvrtc.so.13`, or the directory holding it.
pub const ENV_NVRTC_LIB: &str = "RECALL_NVRTC_LIB";
/// `RECALL_CUDA_LIB_DIR`: a directory searched first for every CUDA library.
pub const ENV_CUDA_LIB_DIR: &str = "RECALL_CUDA_LIB_DIR";
/// `RECALL_CUDA_INCLUDE`: the directory holding `cuda_bf16.h` (and `cuda_fp16.h`).
pub const ENV_CUDA_INCLUDE: &str = "RECALL_CUDA_INCLUDE";

/// The error every CUDA failure turns into.
pub(crate) fn cuda_err(msg: impl std::fmt::Display) -> Error {
    Error::Cuda(msg.to_string())
}

/// Roots of CUDA installations: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`, `/usr/local/cuda-13*`.
fn cuda_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut versioned: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("cuda-13"))
                })
                .collect()
        })
        .unwrap_or_default();
    versioned.sort();
    versioned.reverse();
    roots.extend(versioned);
    roots
}

/// Directories searched for libraries, in order.
pub fn lib_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os(ENV_CUDA_LIB_DIR) {
        dirs.push(PathBuf::from(d));
    }
    for root in cuda_roots() {
        dirs.push(root.join("targets/x86_64-linux/lib"));
        dirs.push(root.join("lib64"));
        dirs.push(root.join("lib"));
    }
    dirs
}

/// Directories searched for `cuda_bf16.h`, in order.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os(ENV_CUDA_INCLUDE) {
        dirs.push(PathBuf::from(d));
    }
    // Beside a libnvrtc from the nvidia pip wheels (`nvidia/cu13/lib` → `nvidia/cu13/include`).
    if let Some(lib) = std::env::var_os(ENV_NVRTC_LIB).map(PathBuf::from) {
        let dir = if lib.is_dir() {
            lib
        } else {
            lib.parent().map(Path::to_path_buf).unwrap_or(lib)
        };
        if let Some(parent) = dir.parent() {
            dirs.push(parent.join("include"));
            dirs.push(parent.join("../cuda_runtime/include"));
        }
    }
    for root in cuda_roots() {
        dirs.push(root.join("targets/x86_64-linux/include"));
        dirs.push(root.join("include"));
    }
    dirs
}

/// The CUDA include directory: the first of [`include_dirs`] holding `cuda_bf16.h`.
pub fn find_cuda_include() -> Result<PathBuf> {
    let dirs = include_dirs();
    dirs.iter()
        .find(|d| d.join("cuda_bf16.h").is_file() && d.join("cuda_fp16.h").is_file())
        .cloned()
        .ok_or_else(|| {
            cuda_err(format!(
                "cuda_bf16.h not found (NVRTC has no built-in bf16 header); set {ENV_CUDA_INCLUDE} to the CUDA \
                 include directory (e.g. /usr/local/cuda-13.0/targets/x86_64-linux/include, or the pip \
                 wheel's site-packages/nvidia/cu13/include from nvidia-cuda-runtime==13.0.96); searched: {}",
                dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
            ))
        })
}

#[cfg(target_os = "linux")]
mod dl {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        pub fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    }
    pub const RTLD_NOW: c_int = 2;
    pub const RTLD_GLOBAL: c_int = 0x100;
}

/// Libraries already opened by full path (kept open for the life of the process).
static OPENED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Opens `path` with `RTLD_GLOBAL`, once; the handle is never closed.
fn open_global(path: &Path) -> bool {
    let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    if opened.iter().any(|p| p == path) {
        return true;
    }
    #[cfg(target_os = "linux")]
    {
        let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: a valid NUL-terminated path; dlopen has no other preconditions. Loading runs the
        // library's initialisers, which for the CUDA libraries have no side effects on our state.
        let handle = unsafe { dl::dlopen(c.as_ptr(), dl::RTLD_NOW | dl::RTLD_GLOBAL) };
        if handle.is_null() {
            return false;
        }
        opened.push(path.to_path_buf());
        true
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = CString::new("");
        false
    }
}

/// Looks for `file` (e.g. `libnvrtc.so.13`) in `extra` and then [`lib_dirs`]; opens it globally when
/// found. Returns the path opened, or `None` (the system loader's search path is then cudarc's only hope).
fn preload(file: &str, extra: Option<PathBuf>) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = extra.into_iter().collect();
    dirs.extend(lib_dirs());
    let path = dirs.iter().map(|d| d.join(file)).find(|p| p.is_file())?;
    open_global(&path).then_some(path)
}

/// Makes libnvrtc (and its builtins library beside it) loadable and checks it with cudarc.
pub fn ensure_nvrtc() -> Result<()> {
    let explicit = std::env::var_os(ENV_NVRTC_LIB).map(PathBuf::from);
    let (extra_dir, explicit_file) = match &explicit {
        Some(p) if p.is_file() => (p.parent().map(Path::to_path_buf), Some(p.clone())),
        Some(p) => (Some(p.clone()), None),
        None => (None, None),
    };
    // The builtins library first: libnvrtc dlopens it by name when compiling.
    if let Some(dir) = &extra_dir {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with("libnvrtc-builtins.so.13") && !name.contains("alt") {
                    open_global(&e.path());
                }
            }
        }
    }
    let found = match explicit_file {
        Some(f) => open_global(&f).then_some(f),
        None => preload("libnvrtc.so.13", extra_dir.clone()),
    };
    if found.is_none() {
        preload("libnvrtc-builtins.so.13.0", extra_dir);
    }
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(cuda_err(format!(
            "libnvrtc.so.13 not found; install CUDA 13.0 or `pip install nvidia-cuda-nvrtc==13.0.88` and set \
             {ENV_NVRTC_LIB} to its nvidia/cu13/lib/libnvrtc.so.13 (or add that directory to LD_LIBRARY_PATH); \
             searched: {}",
            lib_dirs().iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        )))
    }
}

/// Checks that the driver library (`libcuda.so.1`) can be loaded.
pub fn ensure_driver() -> Result<()> {
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(cuda_err(
            "the NVIDIA driver library (libcuda.so.1) is not loadable: no GPU driver on this machine",
        ))
    }
}

/// Makes libcublasLt loadable and checks it with cudarc.
pub fn ensure_cublaslt() -> Result<()> {
    preload("libcublasLt.so.13", None);
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(cuda_err(format!(
            "libcublasLt.so.13 not found; set {ENV_CUDA_LIB_DIR} to the CUDA 13 lib directory \
             (e.g. /usr/local/cuda-13.0/targets/x86_64-linux/lib)"
        )))
    }
}
