//! The CUDA backend: bf16 activations and weights on one GPU, f32 accumulation in every kernel,
//! cuBLASLt for dense GEMMs and hand-written kernels (`kernels/*.cu`) for everything else.
//!
//! Built on cudarc with dynamic loading: the crate builds and runs its CPU tests on machines without
//! CUDA, and [`CudaBackend::new`] returns an error (never panics) when the driver, NVRTC, cuBLASLt or
//! the CUDA headers are missing. Kernels are compiled at start-up with NVRTC to CUBIN for the device's
//! compute capability and cached on disk ([`kernels`]). Every kernel has a CPU twin in
//! `backend/cpu` and a parity test in tests/cuda_ops.rs; docs/CUDA.md lists their status.
//!
//! One stream per backend; cudarc's per-buffer event tracking is disabled (one stream needs none) and
//! kernels receive raw device addresses in `#[repr(C)]` parameter structs ([`params`]). Every argument
//! is validated on the host before a launch, as in the CPU backend.

mod attention_v1;
mod blas;
mod capture;
mod decode;
mod device;
mod flash;
mod fused;
mod graph;
pub mod kernels;
pub mod libs;
mod params;
mod staging;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{
    result as drv, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use half::bf16;

use attention_v1::{check_paged, check_segments};
pub use kernels::{compile_all, KernelSource, SOURCES};
use libs::cuda_err;
use params::Traced;
use params::*;

use super::check::{self, shape_err};
use super::{AttnShape, Backend, Gelu, OpTime, PagedSeq, StepKey, StepStats};
use crate::checkpoint::{Dtype, Fill, TensorRef};
use crate::error::{Error, Result};

/// A bf16 quiet NaN, written into fresh outputs when poisoning is on.
const BF16_NAN: u32 = 0x7fc0;

/// Activations on the GPU: row-major bf16 `[rows, cols]`.
#[derive(Debug)]
pub struct CudaTensor {
    buf: DevBuf, // [rows, cols] bf16 (at least one element is allocated)
    rows: usize,
    cols: usize,
}

impl CudaTensor {
    /// Device address of the first element.
    fn ptr(&self) -> u64 {
        self.buf.ptr
    }
}

/// Device memory of a tensor: its own allocation, or step memory while a step is recorded or
/// replayed (graph.rs).
#[derive(Debug)]
struct DevBuf {
    ptr: u64,
    _owner: Owner,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields keep the memory alive
enum Owner {
    Slice(CudaSlice<u8>),
    Step(graph::Lease),
    /// Uploaded data: its own copy, or (`None`) the step's staging buffer.
    Staged(Option<CudaSlice<u8>>),
}

/// Host data copied to the device for one op: its address, kept alive until the op is queued.
struct Staged {
    ptr: u64,
    _keep: Option<CudaSlice<u8>>,
}

impl Staged {
    fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// Per-kernel CUDA event pairs while profiling.
#[derive(Default)]
struct Profile {
    on: bool,
    events: Vec<(&'static str, CudaEvent, CudaEvent)>,
    totals: HashMap<&'static str, (usize, f64)>,
}

/// A checkpoint tensor on the GPU, stored as bf16 whatever its dtype in the file.
#[derive(Debug)]
pub struct CudaWeight {
    buf: CudaSlice<bf16>, // shape.iter().product() elements
    shape: Vec<usize>,
}

impl CudaWeight {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    lt: blas::Lt,
    poison: AtomicBool,
    arch: String,
    device_name: String,
    steps: Mutex<graph::Steps>,
    profile: Mutex<Profile>,
    /// `RECALL_ATTN=v1` (or [`CudaBackend::set_attention_v1_only`]): use only the v1 attention
    /// kernels (the reference the v2 ones are checked against), e.g. to bisect a suspected kernel bug
    /// on a device.
    attn_v1_only: AtomicBool,
    /// The flash kernels got their shared memory (see `init`).
    flash_ok: bool,
    /// Pinned host memory for direct-mode copies of op inputs (staging.rs).
    ring: Mutex<staging::PinnedRing>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device_name)
            .field("arch", &self.arch)
            .finish()
    }
}

fn to_i32(op: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape_err(op, format!("size {v} exceeds the kernels' 32-bit range")))
}

fn grid_1d(n: usize) -> LaunchConfig {
    const BLOCK: usize = 256;
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row; `width` threads rounded up to whole warps, at most `max`.
fn grid_rows(rows: usize, width: usize, max: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (width.div_ceil(32).clamp(1, max / 32) as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Host-side conversion of a checkpoint tensor to bf16 (round to nearest even, as torch's `.to()`).
fn to_bf16(t: &TensorRef) -> Vec<bf16> {
    let b = t.bytes();
    match t.dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_f32(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn element_bytes(&self) -> usize {
        2
    }

    fn describe(&self) -> String {
        let mode = if self.batch_invariant() {
            ", batch-invariant"
        } else {
            ""
        };
        format!("{} ({}{mode})", self.device_name, self.arch)
    }

    fn synchronize(&self) -> Result<()> {
        CudaBackend::synchronize(self)
    }

    fn memory_info(&self) -> Result<Option<(usize, usize)>> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| cuda_err(format!("querying device memory: {e:?}")))?;
        Ok(Some((free, total)))
    }

    fn load_weight(&self, t: &TensorRef) -> Result<CudaWeight> {
        if let Some((fill, first)) = t.synthetic() {
            return self.synthetic_weight(&t.shape, fill, first);
        }
        let mut host = to_bf16(t);
        // An empty tensor (e.g. a weight with no inputs) still gets one element: the driver refuses
        // zero-byte allocations.
        if host.is_empty() {
            host.push(bf16::ZERO);
        }
        let buf = self
            .stream
            .clone_htod(&host)
            .map_err(|e| cuda_err(format!("host to device copy: {e:?}")))?;
        Ok(CudaWeight {
            buf,
            shape: t.shape.clone(),
        })
    }

    fn weight_shape<'w>(&self, w: &'w CudaWeight) -> &'w [usize] {
        &w.shape
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        if data.len() != rows * cols {
            return Err(shape_err(
                "upload",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        let host: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
        // Not deduplicated: the tensor may be written later (e.g. scattered into).
        let staged = self.stage_with(&host, false)?;
        Ok(CudaTensor {
            buf: DevBuf {
                ptr: staged.ptr,
                _owner: Owner::Staged(staged._keep),
            },
            rows,
            cols,
        })
    }

    fn download(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        Ok(self
            .dtoh::<bf16>(x.ptr(), x.rows * x.cols)?
            .into_iter()
            .map(f32::from)
            .collect())
    }

    fn dims(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let bytes = 2 * (rows * cols).max(1);
        let buf = self.alloc_bytes(bytes)?;
        let hash = graph::launch_hash("memset", (0, 0, 0), (0, 0, 0), 0, |h| {
            h.update(&buf.ptr.to_le_bytes());
            h.update(&(bytes as u64).to_le_bytes());
        });
        if self.issue(hash)? {
            // SAFETY: `buf` holds `bytes` bytes.
            unsafe { drv::memset_d8_async(buf.ptr, 0, bytes, self.stream.cu_stream()) }
                .map_err(|e| cuda_err(format!("memset: {e:?}")))?;
        }
        Ok(CudaTensor { buf, rows, cols })
    }

    fn rows(&self, x: &CudaTensor, start: usize, len: usize) -> Result<CudaTensor> {
        if start + len > x.rows {
            return Err(shape_err(
                "rows",
                format!("{start}..{} of {} rows", start + len, x.rows),
            ));
        }
        let out = self.alloc_tensor(len, x.cols)?;
        let n = len * x.cols;
        if n > 0 {
            self.copy_dtod(out.ptr(), x.ptr() + 2 * (start * x.cols) as u64, 2 * n)?;
        }
        Ok(out)
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        let vocab = *table.shape.first().unwrap_or(&0);
        let cols = *table.shape.last().unwrap_or(&1);
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::InvalidRequest(format!(
                "token id {id} is outside the vocabulary of {vocab}"
            )));
        }
        let index = self.stage(ids)?;
        self.gather(self.ptr(&table.buf), &index, ids.len(), cols)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaWeight>) -> Result<CudaTensor> {
        let out = check::linear(x.cols, &w.shape, bias.map(|b| &b.shape[..]))?;
        let inner = x.cols;
        if x.rows == 0 || out == 0 {
            return self.alloc_tensor(x.rows, out);
        }
        if inner == 0 {
            // An empty sum: every row is the bias (zeros without one), as on the CPU; cuBLASLt has no
            // k = 0 GEMM.
            return match bias {
                Some(b) => self.broadcast_row(b, x.rows),
                None => self.zeros(x.rows, out),
            };
        }
        // Planned before hashing: the trace must change when the algorithm does (batch-invariant mode
        // switched at run time), or a replay would run GEMMs the direct path no longer chooses.
        let plan = self.lt.prepare(x.rows, out, inner, bias.is_some())?;
        let y = self.alloc_tensor(x.rows, out)?;
        let bias = bias.map(|b| self.ptr(&b.buf));
        let hash = graph::launch_hash("gemm", (0, 0, 0), (0, 0, 0), 0, |h| {
            for v in [x.ptr(), self.ptr(&w.buf), bias.unwrap_or(0), y.ptr(), plan.tag()] {
                h.update(&v.to_le_bytes());
            }
            for v in [x.rows, out, inner] {
                h.update(&(v as u64).to_le_bytes());
            }
        });
        if !self.issue(hash)? {
            return Ok(y);
        }
        let timer = self.profile_start()?;
        let operands = blas::Operands {
            x: x.ptr(),
            w: self.ptr(&w.buf),
            bias,
            y: y.ptr(),
        };
        self.lt.linear(&self.stream, &plan, operands)?;
        self.profile_end("gemm", timer)?;
        Ok(y)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaWeight, eps: f32) -> Result<CudaTensor> {
        self.rms_norm_impl(x, None, weight, eps)
    }

    fn scale(&self, x: &CudaTensor, s: f32) -> Result<CudaTensor> {
        self.unary("scale_v1", x, s, 0)
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        self.binary("add_v1", a, b)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        self.binary("silu_mul_v1", gate, up)
    }

    fn rope(&self, x: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor) -> Result<CudaTensor> {
        let d = check::rope((x.rows, x.cols), (cos.rows, cos.cols), (sin.rows, sin.cols))?;
        let out = self.alloc_tensor(x.rows, x.cols)?;
        let heads = x.cols / d;
        let pairs = x.rows * heads * d / 2;
        if pairs > 0 {
            let p = RopeParams {
                x: x.ptr(),
                cos: cos.ptr(),
                sin: sin.ptr(),
                out: out.ptr(),
                n: x.rows as i64,
                heads: to_i32("rope", heads)?,
                d: to_i32("rope", d)?,
            };
            self.launch("rope_v1", grid_1d(pairs), p)?;
        }
        Ok(out)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        s: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<CudaTensor> {
        check_paged(q, k, v, s, seqs)?;
        let rows = q.rows;
        if rows > 0 && !self.attention_v1_only() && self.flash_ok && self.batch_invariant() {
            // One kernel for every row, whatever its sequence: results independent of the batch.
            if let Some(out) = self.paged_attention_flash(q, k, v, s, seqs)? {
                return Ok(out);
            }
        }
        let decode = seqs.iter().all(|x| x.rows <= 1);
        if !decode && seqs.iter().any(|x| x.rows == 1) {
            return self.paged_attention_mixed(q, k, v, s, seqs);
        }
        // Pure decode calls take split-K, calls of prefill rows the tensor-core flash kernel; mixed
        // calls are split into one of each above, so a row's kernel depends on its own sequence only.
        if rows > 0 && !self.attention_v1_only() {
            let v2 = if decode {
                self.paged_decode_v2(q, k, v, s, seqs)?
            } else {
                self.flash_ok
                    .then(|| self.paged_attention_flash(q, k, v, s, seqs))
                    .transpose()?
                    .flatten()
            };
            if let Some(out) = v2 {
                return Ok(out);
            }
        }
        self.launch_paged_v1(q, k, v, s, seqs)
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        bias: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor> {
        if weight.len() != x.cols || bias.len() != x.cols {
            return Err(shape_err(
                "layer_norm",
                format!(
                    "{} columns, weight {:?}, bias {:?}",
                    x.cols, weight.shape, bias.shape
                ),
            ));
        }
        let out = self.alloc_tensor(x.rows, x.cols)?;
        if x.rows > 0 && x.cols > 0 {
            let p = LayerNormParams {
                x: x.ptr(),
                w: self.ptr(&weight.buf),
                b: self.ptr(&bias.buf),
                out: out.ptr(),
                rows: x.rows as i64,
                cols: to_i32("layer_norm", x.cols)?,
                eps,
            };
            self.launch("layer_norm_v1", grid_rows(x.rows, x.cols, 256), p)?;
        }
        Ok(out)
    }

    fn gelu(&self, x: &CudaTensor, kind: Gelu) -> Result<CudaTensor> {
        let k = match kind {
            Gelu::Tanh => 0,
            Gelu::Erf => 1,
        };
        self.unary("gelu_v1", x, 0.0, k)
    }

    fn attention_segments(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<CudaTensor> {
        check_segments(q, k, v, heads, cu_seqlens)?;
        if q.rows > 0 && !self.attention_v1_only() && self.flash_ok {
            if let Some(out) = self.attention_segments_flash(q, k, v, heads, cu_seqlens)? {
                return Ok(out);
            }
        }
        self.launch_segments_v1(q, k, v, heads, cu_seqlens)
    }

    fn reshape(&self, x: CudaTensor, rows: usize, cols: usize) -> Result<CudaTensor> {
        check::reshape((x.rows, x.cols), rows, cols)?;
        Ok(CudaTensor {
            buf: x.buf,
            rows,
            cols,
        })
    }

    fn gather_rows(&self, x: &CudaTensor, index: &[usize]) -> Result<CudaTensor> {
        let idx = self.index_u32("gather_rows", index, x.rows)?;
        self.gather(x.ptr(), &idx, index.len(), x.cols)
    }

    /// Each part one strided copy (`split_cols_v1`), without the default's staged row indices.
    fn split_cols(&self, x: CudaTensor, parts: usize) -> Result<Vec<CudaTensor>> {
        let width = check::split_cols((x.rows, x.cols), parts)?;
        (0..parts)
            .map(|j| {
                let out = self.alloc_tensor(x.rows, width)?;
                if x.rows > 0 && width > 0 {
                    let p = SplitColsParams {
                        src: x.ptr(),
                        out: out.ptr(),
                        n: to_i32("split_cols", x.rows)?,
                        cols: to_i32("split_cols", x.cols)?,
                        col0: to_i32("split_cols", j * width)?,
                        width: to_i32("split_cols", width)?,
                    };
                    self.launch("split_cols_v1", grid_rows(x.rows, width, 256), p)?;
                }
                Ok(out)
            })
            .collect()
    }

    fn scatter_rows(
        &self,
        dst: &mut CudaTensor,
        index: &[usize],
        src: &CudaTensor,
        accumulate: bool,
    ) -> Result<()> {
        check::scatter_rows((dst.rows, dst.cols), index, (src.rows, src.cols))?;
        if index.is_empty() || dst.cols == 0 {
            return Ok(());
        }
        // Rows written twice would race inside one launch: then go row by row, in order, as the CPU.
        let mut seen = index.to_vec();
        seen.sort_unstable();
        let distinct = seen.windows(2).all(|w| w[0] != w[1]);
        let launches: Vec<(usize, usize)> = if distinct {
            vec![(0, index.len())]
        } else {
            (0..index.len()).map(|i| (i, 1)).collect()
        };
        let idx = self.index_u32("scatter_rows", index, dst.rows)?;
        let cols = to_i32("scatter_rows", dst.cols)?;
        for (start, n) in launches {
            let p = ScatterParams {
                dst: dst.ptr(),
                index: idx.ptr() + 4 * start as u64,
                src: src.ptr() + 2 * (start * src.cols) as u64,
                n: n as i32,
                cols,
                accumulate: accumulate as i32,
            };
            self.launch("scatter_rows_v1", grid_rows(n, dst.cols, 256), p)?;
        }
        Ok(())
    }

    fn weighted_embedding(
        &self,
        table: &CudaWeight,
        indices: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<CudaTensor> {
        check::weighted_embedding(&table.shape, indices, weights, taps)?;
        let cols = *table.shape.last().unwrap_or(&1);
        let rows = indices.len() / taps;
        let out = self.alloc_tensor(rows, cols)?;
        if rows > 0 && cols > 0 {
            let (idx, w) = (self.stage(indices)?, self.stage(weights)?);
            let op = "weighted_embedding";
            let p = WeightedParams {
                table: self.ptr(&table.buf),
                index: idx.ptr(),
                weights: w.ptr(),
                out: out.ptr(),
                rows: to_i32(op, rows)?,
                cols: to_i32(op, cols)?,
                taps: to_i32(op, taps)?,
            };
            self.launch("weighted_embedding_v1", grid_rows(rows, cols, 256), p)?;
        }
        Ok(out)
    }

    fn log_softmax_gather(&self, logits: &CudaTensor, targets: &[u32]) -> Result<Vec<f32>> {
        if targets.len() != logits.rows || targets.iter().any(|&t| t as usize >= logits.cols) {
            return Err(shape_err(
                "log_softmax_gather",
                format!(
                    "{} targets for [{}, {}] logits",
                    targets.len(),
                    logits.rows,
                    logits.cols
                ),
            ));
        }
        if logits.rows == 0 {
            return Ok(Vec::new());
        }
        let t = self.stage(targets)?;
        let out = self.stream.alloc_zeros::<f32>(logits.rows).map_err(cuda_err)?;
        let p = RowReduceParams {
            logits: logits.ptr(),
            targets: t.ptr(),
            out_f32: self.ptr(&out),
            out_u32: 0,
            n: logits.rows as i64,
            vocab: to_i32("log_softmax_gather", logits.cols)?,
        };
        self.launch("log_softmax_gather_v1", grid_rows(logits.rows, 256, 256), p)?;
        self.dtoh(self.ptr(&out), logits.rows)
    }

    fn argmax(&self, logits: &CudaTensor) -> Result<Vec<u32>> {
        if logits.cols == 0 {
            return Err(shape_err("argmax", "zero columns".into()));
        }
        if logits.rows == 0 {
            return Ok(Vec::new());
        }
        let out = self.stream.alloc_zeros::<u32>(logits.rows).map_err(cuda_err)?;
        let p = RowReduceParams {
            logits: logits.ptr(),
            targets: 0,
            out_f32: 0,
            out_u32: self.ptr(&out),
            n: logits.rows as i64,
            vocab: to_i32("argmax", logits.cols)?,
        };
        self.launch("argmax_v1", grid_rows(logits.rows, 256, 256), p)?;
        self.dtoh(self.ptr(&out), logits.rows)
    }

    fn qk_norm_rope_write(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        norms: Option<(&CudaWeight, &CudaWeight, f32)>,
        tables: (&CudaTensor, &CudaTensor),
        pools: (&mut CudaTensor, &mut CudaTensor),
        slots: &[usize],
    ) -> Result<CudaTensor> {
        self.qk_norm_rope_write_fused(q, k, v, norms, tables, pools, slots)
    }

    /// One `rms_norm_v1` launch that also adds the residual; the sum is rounded to bf16 before
    /// normalising, exactly as `add` then `rms_norm`.
    fn add_rms_norm(
        &self,
        x: &CudaTensor,
        residual: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
    ) -> Result<(CudaTensor, CudaTensor)> {
        check::same("add_rms_norm", (x.rows, x.cols), (residual.rows, residual.cols))?;
        let sum = self.alloc_tensor(x.rows, x.cols)?;
        let out = self.rms_norm_impl(x, Some((residual, &sum)), weight, eps)?;
        Ok((sum, out))
    }

    fn run_step<R>(&self, key: StepKey, f: &mut dyn FnMut() -> Result<R>) -> Result<R> {
        capture::drive_step(self, key, f)
    }

    fn set_step_replay(&self, on: bool) {
        if let Ok(mut s) = self.steps() {
            s.set_enabled(on);
        }
    }

    fn step_stats(&self) -> StepStats {
        self.steps().map(|s| s.stats()).unwrap_or_default()
    }

    fn set_profiling(&self, on: bool) {
        if let Ok(mut p) = self.profile.lock() {
            p.on = on;
        }
    }

    fn take_profile(&self) -> Result<Vec<OpTime>> {
        let mut p = self
            .profile
            .lock()
            .map_err(|_| cuda_err("profile lock poisoned"))?;
        Self::fold_profile(&mut p)?;
        let mut out: Vec<OpTime> = p
            .totals
            .drain()
            .map(|(op, (calls, seconds))| OpTime {
                op: op.to_string(),
                calls,
                seconds,
                flops: 0.0,
            })
            .collect();
        out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        Ok(out)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Queued work must finish before the buffers it reads are freed with the backend's tensors.
        let _ = self.stream.synchronize();
        let _ = &self.ctx;
    }
}
