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
mod decode;
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
use crate::error::{Error, Result};
use crate::model::loader::{Dtype, Fill, TensorRef};

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
        // Not the legacy default stream: CUDA graphs cannot be captured on it.
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err(format!("creating a stream: {e:?}")))?;
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
        // The flash kernels want more than 48 KB of shared memory (Hopper has 227 KB per block); a GPU
        // that cannot give it keeps the v1 attention kernels instead of failing.
        let flash_ok = flash::configure(&funcs)
            .map_err(|e| tracing::warn!("flash attention disabled, using the v1 kernels: {e}"))
            .is_ok();
        let lt = blas::Lt::new(&stream)?;
        lt.set_batch_invariant(std::env::var("RECALL_BATCH_INVARIANT").is_ok_and(|v| v == "1" || v == "on"));
        tracing::info!("CUDA backend on {device_name} ({arch})");
        Ok(CudaBackend {
            ctx,
            stream,
            funcs,
            lt,
            poison: AtomicBool::new(false),
            arch,
            device_name,
            steps: Mutex::new(graph::Steps::new()),
            profile: Mutex::new(Profile::default()),
            attn_v1_only: AtomicBool::new(std::env::var("RECALL_ATTN").is_ok_and(|v| v == "v1")),
            flash_ok,
            ring: Mutex::new(staging::PinnedRing::new(staging::RING_HALF_BYTES)?),
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

    /// Batch-invariant mode (also `RECALL_BATCH_INVARIANT=1`): a row's result no longer depends on
    /// the other rows of a call, on this backend as on the CPU, so chunked prefill, prefix reuse,
    /// drafting and batching give bitwise the results of running each sequence alone in one piece.
    /// Costs speed: every GEMM of a weight shape uses the one algorithm chosen for 2048 rows (no
    /// split-K), and all paged attention runs the flash kernel (also for decode rows, which then get
    /// no split-K). Off by default.
    pub fn set_batch_invariant(&self, on: bool) {
        self.lt.set_batch_invariant(on);
    }

    /// Whether batch-invariant mode is on.
    pub fn batch_invariant(&self) -> bool {
        self.lt.batch_invariant()
    }

    /// GEMM shapes planned so far (descriptors and algorithms cached by cuBLASLt shape).
    pub fn cached_gemm_plans(&self) -> usize {
        self.lt.cached_plans()
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn steps(&self) -> Result<MutexGuard<'_, graph::Steps>> {
        self.steps
            .lock()
            .map_err(|_| cuda_err("step state lock poisoned"))
    }

    /// Whether the work hashed by `hash` must be issued now (false while replaying a step).
    fn issue(&self, hash: u64) -> Result<bool> {
        Ok(self.steps()?.on_launch(hash))
    }

    fn launch<P: DeviceRepr + Traced>(&self, name: &'static str, cfg: LaunchConfig, p: P) -> Result<()> {
        let hash = graph::launch_hash(name, cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes, |h| {
            p.trace(h)
        });
        if !self.issue(hash)? {
            return Ok(());
        }
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| cuda_err(format!("kernel {name} not loaded")))?;
        let timer = self.profile_start()?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&p);
        // SAFETY: `p` matches the kernel's C parameter struct (params.rs); every pointer in it is a live
        // allocation of this context whose size the caller validated against the counts in `p`.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err(format!("launching {name}: {e:?}")))?;
        self.profile_end(name, timer)
    }

    /// The start event of a profiled launch (`None` when not profiling or inside a step recording).
    fn profile_start(&self) -> Result<Option<CudaEvent>> {
        let on = self.profile.lock().map(|p| p.on).unwrap_or(false);
        if !on || self.steps()?.mode != graph::Mode::Direct {
            return Ok(None);
        }
        let ev = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err(format!("event: {e:?}")))?;
        ev.record(&self.stream)
            .map_err(|e| cuda_err(format!("event: {e:?}")))?;
        Ok(Some(ev))
    }

    fn profile_end(&self, name: &'static str, start: Option<CudaEvent>) -> Result<()> {
        let Some(start) = start else { return Ok(()) };
        let end = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err(format!("event: {e:?}")))?;
        end.record(&self.stream)
            .map_err(|e| cuda_err(format!("event: {e:?}")))?;
        let mut p = self
            .profile
            .lock()
            .map_err(|_| cuda_err("profile lock poisoned"))?;
        p.events.push((name, start, end));
        if p.events.len() >= 4096 {
            Self::fold_profile(&mut p)?;
        }
        Ok(())
    }

    /// Moves finished event pairs into the totals (waits for them).
    fn fold_profile(p: &mut Profile) -> Result<()> {
        for (name, start, end) in p.events.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| cuda_err(format!("event timing: {e:?}")))?;
            let t = p.totals.entry(name).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms as f64 / 1e3;
        }
        Ok(())
    }

    /// `bytes` bytes of device memory: step memory inside a recorded or replayed step (an error when
    /// the arena is full, which abandons the recording), else its own allocation.
    fn alloc_bytes(&self, bytes: usize) -> Result<DevBuf> {
        {
            let mut steps = self.steps()?;
            if steps.mode != graph::Mode::Direct {
                // Full: fail the step (never allocate inside a capture); it then runs directly and
                // the arena grows for the next recording.
                let (ptr, lease) = steps
                    .alloc(bytes)
                    .ok_or_else(|| cuda_err(format!("step memory full ({bytes} bytes more)")))?;
                return Ok(DevBuf {
                    ptr,
                    _owner: Owner::Step(lease),
                });
            }
        }
        // SAFETY: every op writes all the elements of the buffers it allocates before they are read;
        // the poison mode checks exactly that.
        let buf = unsafe { self.stream.alloc::<u8>(bytes.max(2)) }
            .map_err(|e| cuda_err(format!("alloc of {bytes} bytes: {e:?}")))?;
        Ok(DevBuf {
            ptr: self.ptr(&buf),
            _owner: Owner::Slice(buf),
        })
    }

    /// An uninitialised bf16 buffer of `len` elements (NaN-filled when poisoning).
    fn alloc(&self, len: usize) -> Result<DevBuf> {
        let buf = self.alloc_bytes(2 * len.max(1))?;
        if self.poison.load(Ordering::Relaxed) {
            self.fill(buf.ptr, len.max(1), BF16_NAN)?;
        }
        Ok(buf)
    }

    fn fill(&self, ptr: u64, n: usize, bits: u32) -> Result<()> {
        let p = FillParams {
            out: ptr,
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

    /// Copies host data to the device for an op: staged (graph.rs) inside a recorded or replayed
    /// step, else a fresh buffer.
    #[track_caller]
    fn stage<T: DeviceRepr + Copy + Default>(&self, v: &[T]) -> Result<Staged> {
        self.stage_with(v, true)
    }

    /// As [`stage`](Self::stage); `dedup` lets identical arrays staged at the same call site in one
    /// step (e.g. one layer's attention metadata and the next's) share a staged copy (only for data no
    /// op writes). Arrays from different call sites never share one, so two different inputs that
    /// happen to be equal in one step (token ids and slots) cannot make a replay's addresses differ
    /// from the recording's.
    #[track_caller]
    fn stage_with<T: DeviceRepr + Copy + Default>(&self, v: &[T], dedup: bool) -> Result<Staged> {
        let site = std::panic::Location::caller();
        // The file name is a `&'static str`: its address identifies the file within the process.
        let site = (site.file().as_ptr() as u64) ^ (u64::from(site.line()) << 40) ^ u64::from(site.column());
        let one = [T::default()];
        let v = if v.is_empty() { &one[..] } else { v };
        // SAFETY: `T: DeviceRepr` is plain data; we only read its bytes.
        let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) };
        {
            let mut steps = self.steps()?;
            if steps.mode != graph::Mode::Direct {
                // Full: fail the step as for step memory (a host copy cannot be captured).
                let ptr = steps
                    .stage(bytes, dedup.then_some(site))
                    .ok_or_else(|| cuda_err(format!("step staging full ({} bytes more)", bytes.len())))?;
                return Ok(Staged { ptr, _keep: None });
            }
        }
        self.stage_direct(bytes)
    }

    /// A fresh device copy of `bytes` outside recorded steps, through the pinned ring (no stream
    /// synchronisation, see staging.rs); arrays larger than a ring half go from pageable memory.
    fn stage_direct(&self, bytes: &[u8]) -> Result<Staged> {
        // SAFETY: `copy` below (or the pageable copy) writes all `bytes.len()` bytes before any op
        // reads them: both are queued on this stream ahead of the op.
        let buf = unsafe { self.stream.alloc::<u8>(bytes.len()) }
            .map_err(|e| cuda_err(format!("alloc of {} bytes: {e:?}", bytes.len())))?;
        let dst = self.ptr(&buf);
        let pinned = self
            .ring
            .lock()
            .map_err(|_| cuda_err("staging ring lock poisoned"))?
            .copy(&self.ctx, &self.stream, bytes, dst)?;
        if !pinned {
            // SAFETY: `dst` holds `bytes.len()` bytes.
            unsafe { drv::memcpy_htod_async(dst, bytes, self.stream.cu_stream()) }
                .map_err(|e| cuda_err(format!("host to device copy: {e:?}")))?;
        }
        Ok(Staged {
            ptr: dst,
            _keep: Some(buf),
        })
    }

    /// Paged attention for a call mixing decode sequences (one new row) with prefill sequences: each
    /// group runs as its own call and the rows are put back in place. A decode row thus gets exactly
    /// the bits it would get in a pure decode step, whatever else is in the continuous batch (each
    /// kernel is row-independent on its own).
    fn paged_attention_mixed(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        s: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<CudaTensor> {
        let (mut single, mut multi) = ((vec![], vec![]), (vec![], vec![]));
        let mut row = 0;
        for seq in seqs {
            let group = if seq.rows <= 1 { &mut single } else { &mut multi };
            group.0.extend(row..row + seq.rows);
            group.1.push(*seq);
            row += seq.rows;
        }
        let mut out = self.alloc_tensor(q.rows, q.cols)?;
        for (rows, group) in [single, multi] {
            let part = self.paged_attention(&self.gather_rows(q, &rows)?, k, v, s, &group)?;
            self.scatter_rows(&mut out, &rows, &part, false)?;
        }
        Ok(out)
    }

    /// A synthetic checkpoint tensor generated on the device (`fill_random_v1`), bit for bit
    /// [`Fill::value`]: random weights of a real shape without a file or a host copy.
    fn synthetic_weight(&self, shape: &[usize], fill: Fill, first: u64) -> Result<CudaWeight> {
        let n: usize = shape.iter().product();
        // SAFETY: the fill kernel writes all `n` elements before the weight is used.
        let buf = unsafe { self.stream.alloc::<bf16>(n.max(1)) }
            .map_err(|e| cuda_err(format!("alloc of a {shape:?} weight: {e:?}")))?;
        let (kind, seed, scale) = match fill {
            Fill::Zeros => (0, 0, 0.0),
            Fill::Ones => (1, 0, 0.0),
            Fill::Uniform { seed, scale } => (2, seed, scale),
        };
        let p = FillRandomParams {
            out: self.ptr(&buf),
            seed,
            first,
            n: n as i64,
            scale,
            kind,
        };
        self.launch("fill_random_v1", grid_1d(n), p)?;
        Ok(CudaWeight {
            buf,
            shape: shape.to_vec(),
        })
    }

    /// Runs a step directly after its recording or replay was abandoned (nothing of it ran on the
    /// device: captured work is discarded, replayed work was never issued).
    fn run_direct<R>(&self, key: StepKey, f: &mut dyn FnMut() -> Result<R>) -> Result<R> {
        self.steps()?.abandon(key);
        f()
    }

    /// Refuses host reads inside a recorded or replayed step (a graph cannot return data mid-step).
    fn direct_only(&self, op: &str) -> Result<()> {
        if self.steps()?.mode == graph::Mode::Direct {
            Ok(())
        } else {
            Err(cuda_err(format!(
                "{op} reads device data on the host inside a recorded step"
            )))
        }
    }

    fn dtoh<T: DeviceRepr + Copy + Default>(&self, ptr: u64, len: usize) -> Result<Vec<T>> {
        self.direct_only("device to host copy")?;
        let mut v = vec![T::default(); len];
        if len == 0 {
            return Ok(v);
        }
        // SAFETY: `ptr` addresses at least `len` elements of `T` (callers pass a tensor's own size).
        unsafe { drv::memcpy_dtoh_async(&mut v[..], ptr, self.stream.cu_stream()) }
            .map_err(|e| cuda_err(format!("device to host copy: {e:?}")))?;
        self.synchronize()?;
        Ok(v)
    }

    /// `bytes` from `src` to `dst` on the stream (traced like a launch).
    fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let hash = graph::launch_hash("memcpy_dtod", (0, 0, 0), (0, 0, 0), 0, |h| {
            for v in [dst, src, bytes as u64] {
                h.update(&v.to_le_bytes());
            }
        });
        if !self.issue(hash)? {
            return Ok(());
        }
        // SAFETY: callers pass ranges inside live allocations of this context.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda_err(format!("device copy: {e:?}")))
    }

    #[track_caller]
    fn index_u32(&self, op: &str, index: &[usize], bound: usize) -> Result<Staged> {
        if let Some(bad) = index.iter().find(|&&i| i >= bound) {
            return Err(shape_err(op, format!("row {bad} of {bound}")));
        }
        let v: Vec<u32> = index.iter().map(|&i| i as u32).collect();
        self.stage(&v)
    }

    fn unary(&self, name: &'static str, x: &CudaTensor, s: f32, kind: i32) -> Result<CudaTensor> {
        let n = x.rows * x.cols;
        let out = self.alloc_tensor(x.rows, x.cols)?;
        if n > 0 {
            let p = UnaryParams {
                x: x.ptr(),
                out: out.ptr(),
                n: n as i64,
                s,
                kind,
            };
            self.launch(name, grid_1d(n), p)?;
        }
        Ok(out)
    }

    fn binary(&self, name: &'static str, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        check::same(name, (a.rows, a.cols), (b.rows, b.cols))?;
        let n = a.rows * a.cols;
        let out = self.alloc_tensor(a.rows, a.cols)?;
        if n > 0 {
            let p = BinaryParams {
                a: a.ptr(),
                b: b.ptr(),
                out: out.ptr(),
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
        if g == 0 || !x.cols.is_multiple_of(g) {
            return Err(shape_err(
                "rms_norm",
                format!("{} columns, weight of {g}", x.cols),
            ));
        }
        let groups = x.rows * x.cols / g;
        let out = self.alloc_tensor(x.rows, x.cols)?;
        if groups > 0 {
            let (res, sum) = residual.map_or((0, 0), |(r, s)| (r.ptr(), s.ptr()));
            let p = RmsNormParams {
                x: x.ptr(),
                w: self.ptr(&weight.buf),
                residual: res,
                sum_out: sum,
                out: out.ptr(),
                groups: groups as i64,
                g: to_i32("rms_norm", g)?,
                eps,
            };
            self.launch("rms_norm_v1", grid_rows(groups, g, 256), p)?;
        }
        Ok(out)
    }

    fn gather(&self, src: u64, index: &Staged, n: usize, cols: usize) -> Result<CudaTensor> {
        let out = self.alloc_tensor(n, cols)?;
        if n > 0 && cols > 0 {
            let p = GatherParams {
                src,
                index: index.ptr(),
                out: out.ptr(),
                n: to_i32("gather", n)?,
                cols: to_i32("gather", cols)?,
            };
            self.launch("gather_rows_v1", grid_rows(n, cols, 256), p)?;
        }
        Ok(out)
    }

    /// `rows` copies of a 1-D weight as a `[rows, len]` tensor (one gather of row 0).
    fn broadcast_row(&self, row: &CudaWeight, rows: usize) -> Result<CudaTensor> {
        let index = self.stage(&vec![0u32; rows])?;
        self.gather(self.ptr(&row.buf), &index, rows, row.len())
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
        check::same("rope", (cos.rows, cos.cols), (sin.rows, sin.cols))?;
        let d = cos.cols;
        if cos.rows != x.rows || d == 0 || !d.is_multiple_of(2) || !x.cols.is_multiple_of(d) {
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
        let mode = self.steps()?.begin(key, &self.stream)?;
        match mode {
            graph::Mode::Direct => f(),
            graph::Mode::Replay => {
                let r = f();
                let replayed = self.steps()?.finish_replay(key, &self.stream)?;
                match r {
                    Ok(r) if replayed => Ok(r),
                    // Nothing ran on the device: run the step directly.
                    _ => self.run_direct(key, f),
                }
            }
            graph::Mode::Record => {
                graph::begin_capture(&self.stream)?;
                let r = f();
                let g = graph::end_capture(&self.stream);
                let recorded = r.is_ok() && self.steps()?.finish_record(key, g, &self.stream)?;
                match r {
                    Ok(r) if recorded => Ok(r),
                    _ => {
                        self.steps()?.record_failed(key);
                        self.run_direct(key, f)
                    }
                }
            }
        }
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
