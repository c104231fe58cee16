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

mod blas;
pub mod kernels;
pub mod libs;
mod params;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use half::bf16;

pub use kernels::{compile_all, KernelSource, SOURCES};
use libs::cuda_err;
use params::*;

use super::check::{self, shape_err};
use super::{AttnShape, Backend, Gelu, PagedSeq};
use crate::error::{Error, Result};
use crate::model::loader::{Dtype, TensorRef};

/// Keys per split of split-K decode attention.
const DECODE_CHUNK: usize = 256;
/// Most splits of one decode row.
const MAX_SPLITS: usize = 64;
/// Largest head dimension the v1 attention kernels hold in registers (4 per lane).
const MAX_HEAD_DIM: usize = 128;
/// Warps per block of the attention kernels (one (row, head) each).
const ATTN_WARPS: u32 = 4;
/// A bf16 quiet NaN, written into fresh outputs when poisoning is on.
const BF16_NAN: u32 = 0x7fc0;

/// Activations on the GPU: row-major bf16 `[rows, cols]`.
#[derive(Debug)]
pub struct CudaTensor {
    buf: CudaSlice<bf16>, // [rows, cols] (at least one element is allocated)
    rows: usize,
    cols: usize,
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

fn grid_warps(items: usize, splits: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(ATTN_WARPS as usize) as u32, splits as u32, 1),
        block_dim: (32 * ATTN_WARPS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its architecture
    /// and creates the cuBLASLt handle. Errors, never panics, when anything is missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        std::panic::catch_unwind(AssertUnwindSafe(|| Self::init(ordinal)))
            .unwrap_or_else(|p| Err(cuda_err(kernels::panic_text(&p))))
    }

    fn init(ordinal: usize) -> Result<Self> {
        libs::ensure_driver()?;
        let count = CudaContext::device_count().map_err(|e| cuda_err(format!("no usable GPU: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(cuda_err(format!("device {ordinal} requested, {count} present")));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| cuda_err(format!("context on device {ordinal}: {e:?}")))?;
        // SAFETY: the backend uses one stream only, so cross-stream event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
        let arch = format!("sm_{major}{minor}");
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        libs::ensure_nvrtc()?;
        libs::ensure_cublaslt()?;
        let mut funcs = HashMap::new();
        for k in SOURCES {
            let cubin = kernels::load_cubin(k, &arch)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(|e| cuda_err(format!("loading kernels/{}.cu for {arch}: {e:?}", k.name)))?;
            for &f in k.functions {
                let func = module
                    .load_function(f)
                    .map_err(|e| cuda_err(format!("kernel {f} in kernels/{}.cu: {e:?}", k.name)))?;
                funcs.insert(f, func);
            }
        }
        let lt = blas::Lt::new(&stream)?;
        tracing::info!("CUDA backend on {device_name} ({arch})");
        Ok(CudaBackend {
            ctx,
            stream,
            funcs,
            lt,
            poison: AtomicBool::new(false),
            arch,
            device_name,
        })
    }

    /// The device's architecture, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// When on, every output buffer is filled with NaN before the op writes it (tests: an element an
    /// op forgets to write shows up as NaN instead of stale memory that happens to be right).
    pub fn set_poison(&self, on: bool) {
        self.poison.store(on, Ordering::Relaxed);
    }

    /// Waits for all queued work; surfaces asynchronous kernel errors.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err(format!("synchronize: {e:?}")))
    }

    /// GEMM shapes planned so far (descriptors and algorithms cached by cuBLASLt shape).
    pub fn cached_gemm_plans(&self) -> usize {
        self.lt.cached_plans()
    }

    /// Fused residual add + RMSNorm (`norm.cu`): returns `(x + residual, rms_norm(x + residual))`, the
    /// sum rounded to bf16 first exactly as the unfused `add` then `rms_norm` would. Not yet used by the
    /// models (the trait has no fused op); covered by the parity tests.
    pub fn add_rms_norm(
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

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn launch<P: DeviceRepr>(&self, name: &str, cfg: LaunchConfig, p: P) -> Result<()> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| cuda_err(format!("kernel {name} not loaded")))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&p);
        // SAFETY: `p` matches the kernel's C parameter struct (params.rs); every pointer in it is a live
        // allocation of this context whose size the caller validated against the counts in `p`.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err(format!("launching {name}: {e:?}")))?;
        Ok(())
    }

    /// An uninitialised bf16 buffer of `len` elements (NaN-filled when poisoning).
    fn alloc(&self, len: usize) -> Result<CudaSlice<bf16>> {
        // SAFETY: every op writes all `len` elements of the buffers it allocates before they are read;
        // the poison mode checks exactly that.
        let buf = unsafe { self.stream.alloc::<bf16>(len.max(1)) }
            .map_err(|e| cuda_err(format!("alloc: {e:?}")))?;
        if self.poison.load(Ordering::Relaxed) {
            self.fill(&buf, len.max(1), BF16_NAN)?;
        }
        Ok(buf)
    }

    fn fill(&self, buf: &CudaSlice<bf16>, n: usize, bits: u32) -> Result<()> {
        let p = FillParams {
            out: self.ptr(buf),
            n: n as i64,
            bits,
        };
        self.launch("fill_u16_v1", grid_1d(n), p)
    }

    fn alloc_tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            buf: self.alloc(rows * cols)?,
            rows,
            cols,
        })
    }

    fn htod<T: DeviceRepr + Copy + Default>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        let r = if v.is_empty() {
            self.stream.clone_htod(&[T::default()][..])
        } else {
            self.stream.clone_htod(v)
        };
        r.map_err(|e| cuda_err(format!("host to device copy: {e:?}")))
    }

    fn dtoh<T: DeviceRepr + Copy>(&self, s: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let v = self
            .stream
            .clone_dtoh(&s.slice(0..len))
            .map_err(|e| cuda_err(format!("device to host copy: {e:?}")))?;
        self.synchronize()?;
        Ok(v)
    }

    fn index_u32(&self, op: &str, index: &[usize], bound: usize) -> Result<CudaSlice<u32>> {
        if let Some(bad) = index.iter().find(|&&i| i >= bound) {
            return Err(shape_err(op, format!("row {bad} of {bound}")));
        }
        let v: Vec<u32> = index.iter().map(|&i| i as u32).collect();
        self.htod(&v)
    }

    fn unary(&self, name: &str, x: &CudaTensor, s: f32, kind: i32) -> Result<CudaTensor> {
        let n = x.rows * x.cols;
        let out = self.alloc_tensor(x.rows, x.cols)?;
        if n > 0 {
            let p = UnaryParams {
                x: self.ptr(&x.buf),
                out: self.ptr(&out.buf),
                n: n as i64,
                s,
                kind,
            };
            self.launch(name, grid_1d(n), p)?;
        }
        Ok(out)
    }

    fn binary(&self, name: &str, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        check::same(name, (a.rows, a.cols), (b.rows, b.cols))?;
        let n = a.rows * a.cols;
        let out = self.alloc_tensor(a.rows, a.cols)?;
        if n > 0 {
            let p = BinaryParams {
                a: self.ptr(&a.buf),
                b: self.ptr(&b.buf),
                out: self.ptr(&out.buf),
                n: n as i64,
            };
            self.launch(name, grid_1d(n), p)?;
        }
        Ok(out)
    }

    fn rms_norm_impl(
        &self,
        x: &CudaTensor,
        residual: Option<(&CudaTensor, &CudaTensor)>,
        weight: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor> {
        let g = weight.len();
        if g == 0 || x.cols % g != 0 {
            return Err(shape_err(
                "rms_norm",
                format!("{} columns, weight of {g}", x.cols),
            ));
        }
        let groups = x.rows * x.cols / g;
        let out = self.alloc_tensor(x.rows, x.cols)?;
        if groups > 0 {
            let (res, sum) = residual.map_or((0, 0), |(r, s)| (self.ptr(&r.buf), self.ptr(&s.buf)));
            let p = RmsNormParams {
                x: self.ptr(&x.buf),
                w: self.ptr(&weight.buf),
                residual: res,
                sum_out: sum,
                out: self.ptr(&out.buf),
                groups: groups as i64,
                g: to_i32("rms_norm", g)?,
                eps,
            };
            self.launch("rms_norm_v1", grid_rows(groups, g, 256), p)?;
        }
        Ok(out)
    }

    fn gather(&self, src: u64, index: &CudaSlice<u32>, n: usize, cols: usize) -> Result<CudaTensor> {
        let out = self.alloc_tensor(n, cols)?;
        if n > 0 && cols > 0 {
            let p = GatherParams {
                src,
                index: self.ptr(index),
                out: self.ptr(&out.buf),
                n: to_i32("gather", n)?,
                cols: to_i32("gather", cols)?,
            };
            self.launch("gather_rows_v1", grid_rows(n, cols, 256), p)?;
        }
        Ok(out)
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

    fn load_weight(&self, t: &TensorRef) -> Result<CudaWeight> {
        let host = to_bf16(t);
        Ok(CudaWeight {
            buf: self.htod(&host)?,
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
        Ok(CudaTensor {
            buf: self.htod(&host)?,
            rows,
            cols,
        })
    }

    fn download(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        Ok(self
            .dtoh(&x.buf, x.rows * x.cols)?
            .into_iter()
            .map(f32::from)
            .collect())
    }

    fn dims(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let buf = self
            .stream
            .alloc_zeros::<bf16>((rows * cols).max(1))
            .map_err(|e| cuda_err(format!("alloc: {e:?}")))?;
        Ok(CudaTensor { buf, rows, cols })
    }

    fn rows(&self, x: &CudaTensor, start: usize, len: usize) -> Result<CudaTensor> {
        if start + len > x.rows {
            return Err(shape_err(
                "rows",
                format!("{start}..{} of {} rows", start + len, x.rows),
            ));
        }
        let mut out = self.alloc_tensor(len, x.cols)?;
        let n = len * x.cols;
        if n > 0 {
            let src = x.buf.slice(start * x.cols..start * x.cols + n);
            let mut dst = out.buf.slice_mut(0..n);
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| cuda_err(format!("device copy: {e:?}")))?;
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
        let index = self.htod(ids)?;
        self.gather(self.ptr(&table.buf), &index, ids.len(), cols)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaWeight>) -> Result<CudaTensor> {
        let out = check::linear(x.cols, &w.shape, bias.map(|b| &b.shape[..]))?;
        let inner = x.cols;
        let y = self.alloc_tensor(x.rows, out)?;
        if x.rows == 0 || out == 0 {
            return Ok(y);
        }
        if inner == 0 {
            return self.zeros(x.rows, out);
        }
        let bias = bias.map(|b| self.ptr(&b.buf));
        self.lt.linear(
            &self.stream,
            self.ptr(&x.buf),
            self.ptr(&w.buf),
            bias,
            self.ptr(&y.buf),
            x.rows,
            out,
            inner,
        )?;
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
        check::same("rope", (cos.rows, cos.cols), (sin.rows, sin.cols))?;
        let d = cos.cols;
        if cos.rows != x.rows || d == 0 || d % 2 != 0 || x.cols % d != 0 {
            return Err(shape_err(
                "rope",
                format!("x [{}, {}] with tables [{}, {d}]", x.rows, x.cols, cos.rows),
            ));
        }
        let out = self.alloc_tensor(x.rows, x.cols)?;
        let heads = x.cols / d;
        let pairs = x.rows * heads * d / 2;
        if pairs > 0 {
            let p = RopeParams {
                x: self.ptr(&x.buf),
                cos: self.ptr(&cos.buf),
                sin: self.ptr(&sin.buf),
                out: self.ptr(&out.buf),
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
        check::paged_attention((q.rows, q.cols), (k.rows, k.cols), (v.rows, v.cols), s, seqs)?;
        let rows = q.rows;
        if s.head_dim == 0 || s.head_dim > MAX_HEAD_DIM {
            return Err(shape_err(
                "paged_attention",
                format!("head_dim {} (at most {MAX_HEAD_DIM})", s.head_dim),
            ));
        }
        let out = self.alloc_tensor(q.rows, q.cols)?;
        if rows == 0 {
            return Ok(out);
        }
        // Per-row metadata: its sequence and how many keys it sees; block tables concatenated.
        let (mut row_seq, mut row_visible, mut table_start, mut tables) = (vec![], vec![], vec![], vec![]);
        for (i, seq) in seqs.iter().enumerate() {
            table_start.push(tables.len() as u32);
            tables.extend_from_slice(seq.block_table);
            let first = seq.context_len - seq.rows;
            for r in 0..seq.rows {
                row_seq.push(i as u32);
                row_visible.push((first + r + 1) as u32);
            }
        }
        let max_visible = row_visible.iter().copied().max().unwrap_or(1) as usize;
        let decode = seqs.iter().all(|x| x.rows <= 1);
        let splits = if decode {
            max_visible.div_ceil(DECODE_CHUNK).clamp(1, MAX_SPLITS)
        } else {
            1
        };
        let chunk = max_visible.div_ceil(splits);
        let (row_seq, row_visible) = (self.htod(&row_seq)?, self.htod(&row_visible)?);
        let (table_start, tables) = (self.htod(&table_start)?, self.htod(&tables)?);
        let items = rows * s.q_heads;
        let d = s.head_dim;
        let part = if splits > 1 {
            // SAFETY: every (item, split) slot is written by paged_attention_v1 before the combine reads it.
            Some(unsafe { self.stream.alloc::<f32>(items * splits * (d + 2)) }.map_err(cuda_err)?)
        } else {
            None
        };
        let op = "paged_attention";
        let p = PagedAttnParams {
            q: self.ptr(&q.buf),
            k: self.ptr(&k.buf),
            v: self.ptr(&v.buf),
            row_seq: self.ptr(&row_seq),
            row_visible: self.ptr(&row_visible),
            seq_table_start: self.ptr(&table_start),
            tables: self.ptr(&tables),
            out: self.ptr(&out.buf),
            part: part.as_ref().map_or(0, |b| self.ptr(b)),
            rows: to_i32(op, rows)?,
            q_heads: to_i32(op, s.q_heads)?,
            kv_heads: to_i32(op, s.kv_heads)?,
            d: to_i32(op, d)?,
            block_size: to_i32(op, s.block_size)?,
            splits: splits as i32,
            chunk: to_i32(op, chunk)?,
            scale: 1.0 / (d as f32).sqrt(),
        };
        self.launch("paged_attention_v1", grid_warps(items, splits), p)?;
        if let Some(part) = &part {
            let c = CombineParams {
                part: self.ptr(part),
                out: self.ptr(&out.buf),
                items: to_i32(op, items)?,
                splits: splits as i32,
                d: d as i32,
            };
            self.launch("attn_combine_v1", grid_warps(items, 1), c)?;
        }
        Ok(out)
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
                x: self.ptr(&x.buf),
                w: self.ptr(&weight.buf),
                b: self.ptr(&bias.buf),
                out: self.ptr(&out.buf),
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
        check::attention_segments(
            (q.rows, q.cols),
            (k.rows, k.cols),
            (v.rows, v.cols),
            heads,
            cu_seqlens,
        )?;
        if q.cols / heads > MAX_HEAD_DIM {
            return Err(shape_err(
                "attention_segments",
                format!("head_dim {} (at most {MAX_HEAD_DIM})", q.cols / heads),
            ));
        }
        let out = self.alloc_tensor(q.rows, q.cols)?;
        if q.rows == 0 || q.cols == 0 {
            return Ok(out);
        }
        let (mut lo, mut hi) = (vec![0u32; q.rows], vec![0u32; q.rows]);
        for w in cu_seqlens.windows(2) {
            for r in w[0]..w[1] {
                (lo[r], hi[r]) = (w[0] as u32, w[1] as u32);
            }
        }
        let (lo, hi) = (self.htod(&lo)?, self.htod(&hi)?);
        let d = q.cols / heads;
        let op = "attention_segments";
        let p = SegAttnParams {
            q: self.ptr(&q.buf),
            k: self.ptr(&k.buf),
            v: self.ptr(&v.buf),
            row_lo: self.ptr(&lo),
            row_hi: self.ptr(&hi),
            out: self.ptr(&out.buf),
            rows: to_i32(op, q.rows)?,
            heads: to_i32(op, heads)?,
            d: d as i32,
            scale: 1.0 / (d as f32).sqrt(),
        };
        self.launch("attention_segments_v1", grid_warps(q.rows * heads, 1), p)?;
        Ok(out)
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
        self.gather(self.ptr(&x.buf), &idx, index.len(), x.cols)
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
                dst: self.ptr(&dst.buf),
                index: self.ptr(&idx) + 4 * start as u64,
                src: self.ptr(&src.buf) + 2 * (start * src.cols) as u64,
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
            let (idx, w) = (self.htod(indices)?, self.htod(weights)?);
            let op = "weighted_embedding";
            let p = WeightedParams {
                table: self.ptr(&table.buf),
                index: self.ptr(&idx),
                weights: self.ptr(&w),
                out: self.ptr(&out.buf),
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
        let t = self.htod(targets)?;
        let out = self.stream.alloc_zeros::<f32>(logits.rows).map_err(cuda_err)?;
        let p = RowReduceParams {
            logits: self.ptr(&logits.buf),
            targets: self.ptr(&t),
            out_f32: self.ptr(&out),
            out_u32: 0,
            n: logits.rows as i64,
            vocab: to_i32("log_softmax_gather", logits.cols)?,
        };
        self.launch("log_softmax_gather_v1", grid_rows(logits.rows, 256, 256), p)?;
        self.dtoh(&out, logits.rows)
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
            logits: self.ptr(&logits.buf),
            targets: 0,
            out_f32: 0,
            out_u32: self.ptr(&out),
            n: logits.rows as i64,
            vocab: to_i32("argmax", logits.cols)?,
        };
        self.launch("argmax_v1", grid_rows(logits.rows, 256, 256), p)?;
        self.dtoh(&out, logits.rows)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Queued work must finish before the buffers it reads are freed with the backend's tensors.
        let _ = self.stream.synchronize();
        let _ = &self.ctx;
    }
}
