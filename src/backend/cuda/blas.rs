//! Dense GEMMs through cuBLASLt, with the matmul descriptor, matrix layouts and algorithm planned once
//! per shape and cached (cudarc's safe wrapper re-creates all of them and re-runs the heuristic on every
//! call, which costs more than a decode-sized GEMM).
//!
//! `linear` is `y[n, out] = x[n, in] · W[out, in]ᵀ + bias`, all row-major bf16. In cuBLAS's column-major
//! terms that is `Yᶜ[out, n] = op(A)·B` with `A` = W viewed as column-major `[in, out]` (ld = in,
//! op = T), `B` = x viewed as column-major `[in, n]` (ld = in), `Yᶜ` column-major `[out, n]` (ld = out),
//! i.e. exactly row-major `y`. The bias epilogue adds `bias[out]` per row of `Yᶜ` = per output feature.
//! Compute in f32 (`CUBLAS_COMPUTE_32F`), scale type f32.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::libs::cuda_err;
use crate::error::Result;

/// Workspace handed to cuBLASLt (its recommendation for Hopper is 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Rows at which the batch-invariant mode picks each weight shape's one algorithm (a prefill chunk).
const INVARIANT_REF_ROWS: u64 = 2048;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    n: usize,
    out: usize,
    inner: usize,
    bias: bool,
    invariant: bool,
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// Batch-invariant mode could not use the reference algorithm for this shape (see
    /// [`Lt::invariant_algo`]): the plan is not batch-invariant.
    fallback: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once in `Lt::plan` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

struct State {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<Key, Plan>,
}

/// A cuBLASLt handle, its workspace and the per-shape plans.
pub(super) struct Lt {
    state: Mutex<State>,
    workspace: CudaSlice<u8>,
    /// Batch-invariant mode (see [`Lt::set_batch_invariant`]).
    invariant: std::sync::atomic::AtomicBool,
}

// SAFETY: the raw cuBLASLt handles are only used under the mutex, on the backend's one stream.
unsafe impl Send for Lt {}
// SAFETY: as above.
unsafe impl Sync for Lt {}

impl Drop for State {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created once in `Lt::new`.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> crate::error::Error {
    cuda_err(format!("cuBLASLt {what}: {e:?}"))
}

impl Lt {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| lt_err("create", e))?;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES).map_err(cuda_err)?;
        Ok(Lt {
            state: Mutex::new(State {
                handle,
                plans: HashMap::new(),
            }),
            workspace,
            invariant: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Batch-invariant mode: every GEMM of a weight shape uses one algorithm, chosen for
    /// `INVARIANT_REF_ROWS` rows, with split-K off, whatever the number of rows; a row's result then
    /// does not depend on how many rows share the call (the CPU backend's row contract), which exact
    /// prefix reuse and chunking-independent results need. Off by default: small-`n` (decode) GEMMs
    /// are faster with the algorithms the heuristic picks for them.
    pub(super) fn set_batch_invariant(&self, on: bool) {
        self.invariant.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether batch-invariant mode is on.
    pub(super) fn batch_invariant(&self) -> bool {
        self.invariant.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Plans currently cached.
    pub(super) fn cached_plans(&self) -> usize {
        self.state.lock().map(|s| s.plans.len()).unwrap_or(0)
    }

    /// Cached batch-invariant plans that fell back to their own heuristic algorithm, as
    /// `(n, out, inner)`.
    pub(super) fn invariant_fallbacks(&self) -> Vec<(usize, usize, usize)> {
        self.state
            .lock()
            .map(|s| {
                let mut v: Vec<_> = s
                    .plans
                    .iter()
                    .filter(|(_, p)| p.fallback)
                    .map(|(k, _)| (k.n, k.out, k.inner))
                    .collect();
                v.sort_unstable();
                v
            })
            .unwrap_or_default()
    }

    fn plan(handle: sys::cublasLtHandle_t, k: Key) -> Result<Plan> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| lt_err("matmul desc", e))?;
        // Layouts are created before the plan exists; on error the partial plan's Drop frees them.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            // SAFETY: a plain C struct of integers, overwritten by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
            fallback: false,
        };
        let (n, out, inner) = (k.n as u64, k.out as u64, k.inner as u64);
        plan.a =
            lt::create_matrix_layout(bf16, inner, out, inner as i64).map_err(|e| lt_err("layout A", e))?;
        plan.b = lt::create_matrix_layout(bf16, inner, n, inner as i64).map_err(|e| lt_err("layout B", e))?;
        plan.d = lt::create_matrix_layout(bf16, out, n, out as i64).map_err(|e| lt_err("layout D", e))?;
        let transa: i32 = 1; // CUBLAS_OP_T (cublasOperation_t, a C int)
                             // SAFETY: live descriptors; attribute buffers are of the sizes cuBLASLt expects.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transa as *const i32).cast(),
                size_of::<i32>(),
            )
            .map_err(|e| lt_err("TRANSA", e))?;
            let epilogue = if k.bias {
                sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
            } else {
                sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT
            };
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epilogue as *const sys::cublasLtEpilogue_t).cast(),
                size_of::<sys::cublasLtEpilogue_t>(),
            )
            .map_err(|e| lt_err("EPILOGUE", e))?;
        }
        (plan.algo, plan.fallback) = if k.invariant {
            Self::invariant_algo(handle, &plan, k)?
        } else {
            let algo = Self::heuristic(handle, &plan, plan.b, plan.d)
                .map_err(|e| lt_err(&format!("no algorithm for n={n} out={out} in={inner}"), e))?;
            (algo, false)
        };
        Ok(plan)
    }

    /// The heuristic's first algorithm for the plan's descriptor with B and D layouts `b`, `d`.
    fn heuristic(
        handle: sys::cublasLtHandle_t,
        plan: &Plan,
        b: sys::cublasLtMatrixLayout_t,
        d: sys::cublasLtMatrixLayout_t,
    ) -> std::result::Result<sys::cublasLtMatmulAlgo_t, cudarc::cublaslt::result::CublasError> {
        // SAFETY: live descriptors; the preference is created and destroyed here.
        unsafe {
            let pref = lt::create_matmul_pref()?;
            let ws = WORKSPACE_BYTES;
            let r = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                size_of::<usize>(),
            )
            .and_then(|()| lt::get_matmul_algo_heuristic(handle, plan.desc, plan.a, b, d, d, pref));
            let _ = lt::destroy_matmul_pref(pref);
            Ok(r?.algo)
        }
    }

    /// Batch-invariant mode: the algorithm the heuristic picks at `INVARIANT_REF_ROWS` rows, with
    /// split-K off, checked (`cublasLtMatmulAlgoCheck`) for this plan's row count. When it does not
    /// apply, the plan falls back to the heuristic for its own `n` and says so (that shape is then
    /// not batch-invariant): `(algorithm, fell back)`.
    fn invariant_algo(
        handle: sys::cublasLtHandle_t,
        plan: &Plan,
        k: Key,
    ) -> Result<(sys::cublasLtMatmulAlgo_t, bool)> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let (out, inner) = (k.out as u64, k.inner as u64);
        let b_ref = lt::create_matrix_layout(bf16, inner, INVARIANT_REF_ROWS, inner as i64)
            .map_err(|e| lt_err("layout B (reference rows)", e))?;
        let d_ref = lt::create_matrix_layout(bf16, out, INVARIANT_REF_ROWS, out as i64);
        let chosen = d_ref
            .map_err(|e| lt_err("layout D (reference rows)", e))
            .and_then(|d_ref| {
                let algo = Self::heuristic(handle, plan, b_ref, d_ref);
                // SAFETY: created just above, destroyed once.
                unsafe {
                    let _ = lt::destroy_matrix_layout(d_ref);
                }
                algo.map_err(|e| lt_err(&format!("no algorithm for out={out} in={inner}"), e))
            });
        // SAFETY: created just above, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(b_ref);
        }
        let mut algo = chosen?;
        // SAFETY: `algo` is a live algorithm struct; the attribute buffers have the sizes cuBLASLt
        // expects (u32 split count, u32 reduction scheme); the check reads live descriptors.
        let checked = unsafe {
            let one: u32 = 1;
            let none: u32 = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
            sys::cublasLtMatmulAlgoConfigSetAttribute(
                &mut algo,
                sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                (&one as *const u32).cast(),
                size_of::<u32>(),
            )
            .result()
            .and_then(|()| {
                sys::cublasLtMatmulAlgoConfigSetAttribute(
                    &mut algo,
                    sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                    (&none as *const u32).cast(),
                    size_of::<u32>(),
                )
                .result()
            })
            .and_then(|()| {
                let mut result = std::mem::MaybeUninit::uninit();
                sys::cublasLtMatmulAlgoCheck(
                    handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.d,
                    plan.d,
                    &algo,
                    result.as_mut_ptr(),
                )
                .result()
            })
        };
        match checked {
            Ok(()) => Ok((algo, false)),
            Err(e) => {
                tracing::warn!(
                    "batch-invariant GEMM: the reference algorithm does not apply to n={} out={out} in={inner} ({e:?}); \
                     this shape uses its own heuristic algorithm",
                    k.n
                );
                Self::heuristic(handle, plan, plan.b, plan.d)
                    .map(|a| (a, true))
                    .map_err(|e| lt_err(&format!("no algorithm for n={} out={out} in={inner}", k.n), e))
            }
        }
    }

    /// The plan for a GEMM of this shape in the current mode (planned now if new): what
    /// [`linear`](Self::linear) runs, and a tag naming its algorithm for step traces.
    pub(super) fn prepare(&self, n: usize, out: usize, inner: usize, bias: bool) -> Result<PlanId> {
        let key = Key {
            n,
            out,
            inner,
            bias,
            invariant: self.batch_invariant(),
        };
        let mut st = self
            .state
            .lock()
            .map_err(|_| cuda_err("cuBLASLt state poisoned"))?;
        let handle = st.handle;
        let plan = match st.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(Self::plan(handle, key)?),
        };
        Ok(PlanId {
            key,
            tag: plan_tag(key.invariant, &plan.algo.data),
        })
    }

    /// `y = x · Wᵀ (+ bias)` with a plan from [`prepare`](Self::prepare): `x` `[n, inner]`, `w`
    /// `[out, inner]`, `bias` `[out]`, `y` `[n, out]`.
    pub(super) fn linear(&self, stream: &Arc<CudaStream>, id: &PlanId, o: Operands) -> Result<()> {
        let st = self
            .state
            .lock()
            .map_err(|_| cuda_err("cuBLASLt state poisoned"))?;
        let plan = st
            .plans
            .get(&id.key)
            .ok_or_else(|| cuda_err("cuBLASLt plan vanished"))?;
        let (alpha, beta) = (1f32, 0f32);
        let (ws, _guard) = self.workspace.device_ptr(stream);
        // SAFETY: the plan's descriptors describe exactly these buffers (sizes checked by the caller);
        // the bias pointer attribute is set under the same lock as the matmul that reads it.
        unsafe {
            if let Some(b) = o.bias {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&b as *const u64).cast(),
                    size_of::<u64>(),
                )
                .map_err(|e| lt_err("BIAS_POINTER", e))?;
            }
            lt::matmul(
                st.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                o.w as *const c_void,
                plan.a,
                o.x as *const c_void,
                plan.b,
                o.y as *const c_void,
                plan.d,
                o.y as *mut c_void,
                plan.d,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
            .map_err(|e| lt_err("matmul", e))
        }
    }
}

/// A planned GEMM shape (see [`Lt::prepare`]).
pub(super) struct PlanId {
    key: Key,
    tag: u64,
}

impl PlanId {
    /// Names the mode and the algorithm (its configuration bytes): equal tags, the same GEMM.
    pub(super) fn tag(&self) -> u64 {
        self.tag
    }
}

/// Device addresses of one GEMM's operands.
pub(super) struct Operands {
    pub x: u64,
    pub w: u64,
    pub bias: Option<u64>,
    pub y: u64,
}

/// Hash of the batch-invariant flag and a `cublasLtMatmulAlgo_t`'s configuration words.
fn plan_tag(invariant: bool, algo: &[u64; 8]) -> u64 {
    let mut h = xxhash_rust::xxh64::Xxh64::new(0);
    h.update(&[u8::from(invariant)]);
    for w in algo {
        h.update(&w.to_le_bytes());
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::plan_tag;

    #[test]
    fn plan_tags_tell_modes_and_algorithms_apart() {
        let algo = [7u64, 1, 0, 0, 0, 0, 0, 3];
        let mut other = algo;
        other[7] = 4;
        assert_eq!(plan_tag(false, &algo), plan_tag(false, &algo));
        assert_ne!(plan_tag(false, &algo), plan_tag(true, &algo));
        assert_ne!(plan_tag(false, &algo), plan_tag(false, &other));
    }
}
