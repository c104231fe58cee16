//! The CUDA backend's device side: opening the device, memory and staging, kernel launches (recorded
//! or replayed inside CUDA graphs), copies and profiling. The ops themselves (`impl Backend`) are in
//! `mod.rs` and call down into these.

use super::*;
use cudarc::driver::sys;

impl CudaBackend {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its architecture
    /// and creates the cuBLASLt handle. Errors, never panics, when anything is missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        std::panic::catch_unwind(AssertUnwindSafe(|| Self::init(ordinal)))
            .unwrap_or_else(|p| Err(cuda_err(kernels::panic_text(&p))))
    }

    pub(super) fn init(ordinal: usize) -> Result<Self> {
        libs::ensure_driver()?;
        let count = CudaContext::device_count().map_err(|e| cuda_err(format!("no usable GPU: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(cuda_err(format!("device {ordinal} requested, {count} present")));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| cuda_err(format!("context on device {ordinal}: {e:?}")))?;
        // SAFETY: the backend uses one stream only, so cross-stream event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx)?;
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

    /// The release threshold of the memory pool the backend allocates from (stream-ordered
    /// `cuMemAllocAsync`): `u64::MAX` once [`CudaBackend::new`] has set it, so that freed memory stays
    /// in the pool instead of going back to the driver at every synchronisation.
    pub fn pool_release_threshold(&self) -> Result<u64> {
        let mut v: u64 = 0;
        let pool = current_pool(&self.ctx)?;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        // SAFETY: the pool is the device's current pool; the attribute is a u64.
        unsafe { drv::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast()) }
            .map_err(|e| cuda_err(format!("reading the memory pool's release threshold: {e:?}")))?;
        Ok(v)
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

    /// GEMM shapes `(rows, out, in)` planned in batch-invariant mode whose reference algorithm did not
    /// apply, so that they use their own (not batch-invariant) algorithm; empty when the mode holds
    /// for every shape run so far.
    pub fn batch_invariant_fallbacks(&self) -> Vec<(usize, usize, usize)> {
        self.lt.invariant_fallbacks()
    }

    pub(super) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    pub(super) fn steps(&self) -> Result<MutexGuard<'_, graph::Steps>> {
        self.steps
            .lock()
            .map_err(|_| cuda_err("step state lock poisoned"))
    }

    /// Whether the work hashed by `hash` must be issued now (false while replaying a step).
    pub(super) fn issue(&self, hash: u64) -> Result<bool> {
        Ok(self.steps()?.on_launch(hash))
    }

    pub(super) fn launch<P: DeviceRepr + Traced>(
        &self,
        name: &'static str,
        cfg: LaunchConfig,
        p: P,
    ) -> Result<()> {
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
    pub(super) fn profile_start(&self) -> Result<Option<CudaEvent>> {
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

    pub(super) fn profile_end(&self, name: &'static str, start: Option<CudaEvent>) -> Result<()> {
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
    pub(super) fn fold_profile(p: &mut Profile) -> Result<()> {
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
    pub(super) fn alloc_bytes(&self, bytes: usize) -> Result<DevBuf> {
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
    pub(super) fn alloc(&self, len: usize) -> Result<DevBuf> {
        let buf = self.alloc_bytes(2 * len.max(1))?;
        if self.poison.load(Ordering::Relaxed) {
            self.fill(buf.ptr, len.max(1), BF16_NAN)?;
        }
        Ok(buf)
    }

    pub(super) fn fill(&self, ptr: u64, n: usize, bits: u32) -> Result<()> {
        let p = FillParams {
            out: ptr,
            n: n as i64,
            bits,
        };
        self.launch("fill_u16_v1", grid_1d(n), p)
    }

    pub(super) fn alloc_tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            buf: self.alloc(rows * cols)?,
            rows,
            cols,
        })
    }

    /// Copies host data to the device for an op: staged (graph.rs) inside a recorded or replayed
    /// step, else a fresh buffer.
    #[track_caller]
    pub(super) fn stage<T: DeviceRepr + Copy + Default>(&self, v: &[T]) -> Result<Staged> {
        self.stage_with(v, true)
    }

    /// As [`stage`](Self::stage); `dedup` lets identical arrays staged at the same call site in one
    /// step (e.g. one layer's attention metadata and the next's) share a staged copy (only for data no
    /// op writes). Arrays from different call sites never share one, so two different inputs that
    /// happen to be equal in one step (token ids and slots) cannot make a replay's addresses differ
    /// from the recording's.
    #[track_caller]
    pub(super) fn stage_with<T: DeviceRepr + Copy + Default>(&self, v: &[T], dedup: bool) -> Result<Staged> {
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
    pub(super) fn stage_direct(&self, bytes: &[u8]) -> Result<Staged> {
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
    pub(super) fn paged_attention_mixed(
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
    pub(super) fn synthetic_weight(&self, shape: &[usize], fill: Fill, first: u64) -> Result<CudaWeight> {
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

    /// Refuses host reads inside a recorded or replayed step (a graph cannot return data mid-step).
    pub(super) fn direct_only(&self, op: &str) -> Result<()> {
        if self.steps()?.mode == graph::Mode::Direct {
            Ok(())
        } else {
            Err(cuda_err(format!(
                "{op} reads device data on the host inside a recorded step"
            )))
        }
    }

    pub(super) fn dtoh<T: DeviceRepr + Copy + Default>(&self, ptr: u64, len: usize) -> Result<Vec<T>> {
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
    pub(super) fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
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
    pub(super) fn index_u32(&self, op: &str, index: &[usize], bound: usize) -> Result<Staged> {
        if let Some(bad) = index.iter().find(|&&i| i >= bound) {
            return Err(shape_err(op, format!("row {bad} of {bound}")));
        }
        let v: Vec<u32> = index.iter().map(|&i| i as u32).collect();
        self.stage(&v)
    }

    pub(super) fn unary(&self, name: &'static str, x: &CudaTensor, s: f32, kind: i32) -> Result<CudaTensor> {
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

    pub(super) fn binary(&self, name: &'static str, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
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

    pub(super) fn rms_norm_impl(
        &self,
        x: &CudaTensor,
        residual: Option<(&CudaTensor, &CudaTensor)>,
        weight: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor> {
        let g = check::rms_norm_groups(x.cols, weight.len())?;
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

    pub(super) fn gather(&self, src: u64, index: &Staged, n: usize, cols: usize) -> Result<CudaTensor> {
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
    pub(super) fn broadcast_row(&self, row: &CudaWeight, rows: usize) -> Result<CudaTensor> {
        let index = self.stage(&vec![0u32; rows])?;
        self.gather(self.ptr(&row.buf), &index, rows, row.len())
    }
}

impl capture::StepDriver for CudaBackend {
    type Graph = capture::StepGraph;

    fn begin(&self, key: StepKey) -> Result<graph::Mode> {
        self.steps()?.begin(key, &self.stream)
    }

    fn begin_capture(&self) -> Result<()> {
        capture::begin_capture(&self.stream)
    }

    fn end_capture(&self) -> Result<Option<capture::StepGraph>> {
        capture::end_capture(&self.stream)
    }

    fn finish_replay(&self, key: StepKey) -> Result<bool> {
        self.steps()?.finish_replay(key, &self.stream)
    }

    fn finish_record(&self, key: StepKey, graph: Option<capture::StepGraph>) -> Result<bool> {
        self.steps()?.finish_record(key, graph, &self.stream)
    }

    fn record_failed(&self, key: StepKey) {
        if let Ok(mut s) = self.steps() {
            s.record_failed(key);
        }
    }

    /// Back to direct mode: captured work is discarded, replayed work was never issued.
    fn abandon(&self, key: StepKey) -> Result<()> {
        self.steps()?.abandon(key);
        Ok(())
    }
}

/// The memory pool stream-ordered allocations on `ctx`'s device come from.
fn current_pool(ctx: &Arc<CudaContext>) -> Result<sys::CUmemoryPool> {
    // SAFETY: the device handle comes from a live context.
    unsafe { drv::device::get_mem_pool(ctx.cu_device()) }
        .map_err(|e| cuda_err(format!("the device's memory pool: {e:?}")))
}

/// Sets the pool's release threshold to the maximum. Its default, 0, returns every freed byte to the
/// driver at each synchronisation, so every step's activations would be allocated from the driver
/// again (the cost PyTorch's caching allocator exists to avoid). A device without stream-ordered
/// allocation keeps cudarc's synchronous allocations and has no pool to set.
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    let pools = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
    if ctx
        .attribute(pools)
        .map_err(|e| cuda_err(format!("device attribute {pools:?}: {e:?}")))?
        == 0
    {
        return Ok(());
    }
    let pool = current_pool(ctx)?;
    let mut v = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the pool is the device's current pool; the attribute is a u64.
    unsafe { drv::mem_pool::set_attribute(pool, attr, (&mut v as *mut u64).cast()) }
        .map_err(|e| cuda_err(format!("setting the memory pool's release threshold: {e:?}")))
}
