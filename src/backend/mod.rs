//! Backends own device buffers and implement the ops the models compose.
//!
//! A model is written once against [`Backend`]; the CPU backend ([`cpu::CpuBackend`]) is the f32
//! reference every other backend is checked against. Ops take and return activations as
//! [`Backend::Tensor`] (row-major, shape `[rows, cols]`) and read weights as [`Backend::Weight`]
//! (resident copies or views of checkpoint tensors).
//!
//! Contract that makes prefix reuse exact: the result for one row never depends on how many other rows
//! were computed in the same call (reductions run in a fixed order per row).

mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod select;

pub use select::{select, BackendArgs, BackendChoice, Selected};

/// HBM bandwidth for the rooflines of `recall bench` and `recall kernels`, GB/s: the H200's
/// device-to-device copy rate measured on the workplace's H200 (4.3 TB/s read + write; datasheet
/// 4.8), as docs/BENCH.md's floors use it.
pub const H200_GBS: f64 = 4200.0;
/// Dense bf16 tensor-core rate for the same rooflines, TFLOP/s: an 8192³ bf16 GEMM measured on the
/// H200 (datasheet ≈ 990).
pub const H200_TFLOPS: f64 = 790.0;

use crate::checkpoint::TensorRef;
use crate::Result;

/// Buffers and ops of one compute device.
pub trait Backend: Send + Sync {
    /// Activations: a row-major 2-D array of `[rows, cols]`.
    type Tensor;
    /// A weight tensor loaded from a checkpoint (any supported dtype).
    type Weight;

    /// Short name for logs and errors ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// Bytes of one element of activations and of the KV pool (4 for f32, 2 for bf16): what sizes a
    /// KV pool or a cache of embeddings given in bytes.
    fn element_bytes(&self) -> usize;

    /// What the backend runs on, for logs and reports (e.g. `cpu (2 threads)`, `NVIDIA H200 (sm_90)`).
    fn describe(&self) -> String {
        self.name().to_string()
    }

    /// Waits for all queued work (a no-op where ops complete when they return); surfaces
    /// asynchronous errors. Timings need it.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// `(free, total)` bytes of the device's own memory, for sizing the KV pool from what is left
    /// after the weights; `None` when tensors live in host memory (the CPU backend).
    fn memory_info(&self) -> Result<Option<(usize, usize)>> {
        Ok(None)
    }

    /// Makes a checkpoint tensor available to the ops (a view on CPU, a copy on a device).
    fn load_weight(&self, tensor: &TensorRef) -> Result<Self::Weight>;
    /// The shape of a loaded weight.
    fn weight_shape<'w>(&self, weight: &'w Self::Weight) -> &'w [usize];

    /// Readies a weight for [`linear`](Backend::linear) ahead of the first forward (the CPU backend
    /// packs it into its GEMM panels; weights it cannot tell are linear at load, such as tied
    /// embeddings used as the `lm_head`, come through here). The default does nothing.
    fn prepare_linear(&self, weight: &Self::Weight) -> Result<()> {
        let _ = weight;
        Ok(())
    }

    /// Brings a weight's bytes close while `more()` says this thread has nothing better to do (the
    /// CPU backend maps the pages of a weight read from its file, [`MappedFile::populate`]). The
    /// values are untouched, so this never changes a result. The default does nothing: a device
    /// backend copied its weights at load.
    ///
    /// [`MappedFile::populate`]: crate::checkpoint::MappedFile::populate
    fn warm_weight(&self, weight: &Self::Weight, more: &dyn Fn() -> bool) {
        let _ = (weight, more);
    }

    /// Copies host data into a new `[rows, cols]` tensor.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Copies a tensor back to the host, row-major.
    fn download(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    /// `(rows, cols)` of a tensor.
    fn dims(&self, x: &Self::Tensor) -> (usize, usize);
    /// A zero-filled `[rows, cols]` tensor.
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Rows `start..start + len` of `x` as a new tensor.
    fn rows(&self, x: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor>;

    /// Gathers rows `ids` of an embedding table `[vocab, hidden]`.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x · Wᵀ (+ bias)` for `x: [n, in]`, `W: [out, in]`, `bias: [out]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>)
        -> Result<Self::Tensor>;
    /// [`linear`](Backend::linear) of one `x` by each `(weight, bias)` in turn, each output with
    /// the bits `linear` gives it alone. A backend may prepare `x` once for all of them (the CPU's
    /// bf16 tiles, for q, k and v or gate and up); the default just calls `linear`.
    ///
    /// ```
    /// use recall::backend::{cpu::CpuBackend, Backend};
    /// let be = CpuBackend;
    /// let x = be.upload(&[1.0, 2.0], 1, 2)?;
    /// assert!(be.linears(&x, &[]).unwrap().is_empty());
    /// # Ok::<(), recall::Error>(())
    /// ```
    fn linears(
        &self,
        x: &Self::Tensor,
        ws: &[(&Self::Weight, Option<&Self::Weight>)],
    ) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect()
    }
    /// A SwiGLU MLP's first half, `silu(x·Gᵀ + g) · (x·Uᵀ + u)` for `gate = (G, g)` and
    /// `up = (U, u)`, with the bits of [`linears`](Backend::linears) then
    /// [`silu_mul_owned`](Backend::silu_mul_owned), which the default calls. The CPU runs both
    /// products on each block of columns and multiplies them there, without writing the up
    /// projection out.
    ///
    /// ```
    /// use recall::backend::{cpu::CpuBackend, Backend};
    /// use recall::checkpoint::Checkpoint;
    /// let be = CpuBackend;
    /// let ckpt = Checkpoint::open(std::path::Path::new("tests/fixtures/tiny-qwen3-vl"))?;
    /// let mlp = "model.language_model.layers.0.mlp";
    /// let g = be.load_weight(ckpt.get(&format!("{mlp}.gate_proj.weight"))?)?; // [128, 64]
    /// let u = be.load_weight(ckpt.get(&format!("{mlp}.up_proj.weight"))?)?;
    /// let x = be.upload(&vec![0.5; 40 * 64], 40, 64)?;
    /// let h = be.download(&be.swiglu(&x, (&g, None), (&u, None))?)?;
    /// let (gx, ux) = (be.linear(&x, &g, None)?, be.linear(&x, &u, None)?);
    /// assert_eq!(h, be.download(&be.silu_mul(&gx, &ux)?)?);
    /// # Ok::<(), recall::Error>(())
    /// ```
    fn swiglu(
        &self,
        x: &Self::Tensor,
        gate: (&Self::Weight, Option<&Self::Weight>),
        up: (&Self::Weight, Option<&Self::Weight>),
    ) -> Result<Self::Tensor> {
        swiglu_composed(self, x, gate, up)
    }
    /// RMSNorm over groups of `weight.len()` consecutive columns (one group per row for the
    /// hidden norm, one per head for q/k norms): `x / sqrt(mean(x²) + eps) · weight`.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, eps: f32) -> Result<Self::Tensor>;
    /// Elementwise `s · x`.
    fn scale(&self, x: &Self::Tensor, s: f32) -> Result<Self::Tensor>;
    /// Elementwise `a + b`.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// SwiGLU: `silu(gate) · up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// [`add`](Backend::add) given `a` to keep: a backend may write the sum over it instead of a
    /// new buffer (the same bits). A prefill's activations are tens of megabytes each, and every
    /// new buffer is fresh memory the first layer must fault in.
    fn add_owned(&self, a: Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor> {
        self.add(&a, b)
    }
    /// [`silu_mul`](Backend::silu_mul) given `gate` to keep, as [`add_owned`](Backend::add_owned).
    fn silu_mul_owned(&self, gate: Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor> {
        self.silu_mul(&gate, up)
    }
    /// Rotary embedding of `x: [n, heads · head_dim]` with per-row tables `cos, sin: [n, head_dim]`
    /// (HF's `rotate_half` convention: the two halves of each head are the pair).
    fn rope(&self, x: &Self::Tensor, cos: &Self::Tensor, sin: &Self::Tensor) -> Result<Self::Tensor>;
    /// [`rope`](Backend::rope) given `x` to keep, as [`add_owned`](Backend::add_owned).
    fn rope_owned(&self, x: Self::Tensor, cos: &Self::Tensor, sin: &Self::Tensor) -> Result<Self::Tensor> {
        self.rope(&x, cos, sin)
    }
    /// Causal attention over a paged KV pool for a batch of sequences.
    ///
    /// `q: [Σ rows, q_heads · head_dim]` holds the new tokens of every sequence in `seqs`, in order;
    /// `k_pool, v_pool: [num_blocks · block_size, kv_heads · head_dim]` hold every sequence's keys and
    /// values (the new ones already written). Row `i` of a sequence with `rows` new tokens and
    /// `context_len` valid tokens sits at position `context_len - rows + i` and attends to positions
    /// `0..=context_len - rows + i`, found through its block table. Grouped-query: q head `h` reads kv
    /// head `h / (q_heads / kv_heads)`.
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k_pool: &Self::Tensor,
        v_pool: &Self::Tensor,
        shape: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<Self::Tensor>;
    /// LayerNorm over each row: `(x - mean) / sqrt(var + eps) · weight + bias`.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        bias: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor>;
    /// Elementwise GELU, `Tanh` (gelu_pytorch_tanh) or `Erf` (nn.GELU()).
    fn gelu(&self, x: &Self::Tensor, kind: Gelu) -> Result<Self::Tensor>;
    /// [`gelu`](Backend::gelu) given `x` to keep, as [`add_owned`](Backend::add_owned).
    fn gelu_owned(&self, x: Self::Tensor, kind: Gelu) -> Result<Self::Tensor> {
        self.gelu(&x, kind)
    }
    /// Non-causal attention within segments (varlen): rows `cu_seqlens[s]..cu_seqlens[s + 1]` attend
    /// to each other only. `q, k, v: [n, heads · head_dim]`.
    fn attention_segments(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<Self::Tensor>;
    /// The same data viewed as `[rows, cols]` (row-major; `rows · cols` must be unchanged).
    fn reshape(&self, x: Self::Tensor, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Splits `x: [n, parts · w]` into `parts` tensors `[n, w]` of consecutive column blocks (the q,
    /// k and v of one fused projection GEMM). The default views the rows as `[n · parts, w]` and
    /// gathers every `parts`-th row: a copy, so the parts are bitwise the columns.
    fn split_cols(&self, x: Self::Tensor, parts: usize) -> Result<Vec<Self::Tensor>> {
        let (n, cols) = self.dims(&x);
        let width = check::split_cols((n, cols), parts)?;
        let x = self.reshape(x, n * parts, width)?;
        (0..parts)
            .map(|j| self.gather_rows(&x, &(0..n).map(|i| i * parts + j).collect::<Vec<_>>()))
            .collect()
    }
    /// Rows `index[i]` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Tensor, index: &[usize]) -> Result<Self::Tensor>;
    /// `dst[index[i]] = src[i]` (`accumulate` false) or `dst[index[i]] += src[i]` (true).
    fn scatter_rows(
        &self,
        dst: &mut Self::Tensor,
        index: &[usize],
        src: &Self::Tensor,
        accumulate: bool,
    ) -> Result<()>;
    /// `out[i] = Σ_j weights[i·taps + j] · table[indices[i·taps + j]]` (interpolated embeddings).
    fn weighted_embedding(
        &self,
        table: &Self::Weight,
        indices: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<Self::Tensor>;
    /// Per-row log-softmax of `logits: [n, vocab]` gathered at `targets[i]`.
    fn log_softmax_gather(&self, logits: &Self::Tensor, targets: &[u32]) -> Result<Vec<f32>>;
    /// Per-row index of the maximum (the first one on ties, as `torch.argmax`; NaN never wins, as
    /// numpy's `nanargmax`, and a row of NaN gives 0).
    fn argmax(&self, logits: &Self::Tensor) -> Result<Vec<u32>>;

    /// The residual add and the norm after it: `(x + residual, rms_norm(x + residual))`. The default
    /// composes [`add`](Backend::add) and [`rms_norm`](Backend::rms_norm); a backend may fuse them,
    /// bitwise equal to that composition.
    fn add_rms_norm(
        &self,
        x: &Self::Tensor,
        residual: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        let sum = self.add(x, residual)?;
        let normed = self.rms_norm(&sum, weight, eps)?;
        Ok((sum, normed))
    }

    /// [`add_rms_norm`](Backend::add_rms_norm) given `x` to keep, as
    /// [`add_owned`](Backend::add_owned): a backend may write the sum over it.
    fn add_rms_norm_owned(
        &self,
        x: Self::Tensor,
        residual: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        self.add_rms_norm(&x, residual, weight, eps)
    }

    /// The attention block's step between the projections and the attention itself, for `n` new rows:
    /// per-head RMSNorm of `q` and `k` (when `norms` holds the `[head_dim]` q/k weights and eps, as in
    /// Qwen3), rotary embedding of both with the per-row tables `cos, sin: [n, head_dim]`, and the
    /// write of the rotated `k` and of `v` into rows `slots[i]` of the pools. Returns the rotated `q`.
    ///
    /// The default composes [`rms_norm`](Backend::rms_norm), [`rope`](Backend::rope) and
    /// [`scatter_rows`](Backend::scatter_rows); a backend may fuse it into one kernel, with results
    /// bitwise equal to that composition on the same backend.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_write(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        norms: Option<(&Self::Weight, &Self::Weight, f32)>,
        (cos, sin): (&Self::Tensor, &Self::Tensor),
        (k_pool, v_pool): (&mut Self::Tensor, &mut Self::Tensor),
        slots: &[usize],
    ) -> Result<Self::Tensor> {
        let rotate = |x: &Self::Tensor, norm: Option<(&Self::Weight, f32)>| match norm {
            Some((w, eps)) => self.rope_owned(self.rms_norm(x, w, eps)?, cos, sin),
            None => self.rope(x, cos, sin),
        };
        let q = rotate(q, norms.map(|(qn, _, eps)| (qn, eps)))?;
        let k = rotate(k, norms.map(|(_, kn, eps)| (kn, eps)))?;
        self.scatter_rows(k_pool, slots, &k, false)?;
        self.scatter_rows(v_pool, slots, v, false)?;
        Ok(q)
    }

    /// Runs `f`, one forward step of shape `key`. A backend may record the device work of the first
    /// such step and replay it for later steps of the same key (CUDA graphs), calling `f` again only to
    /// recompute the host-side inputs. The default just calls `f`.
    ///
    /// Contract for `f`: its device work depends on `key` and on data the backend stages itself (token
    /// ids, positions, block tables), never on values read back from the device; tensors it returns are
    /// valid until the next `run_step`. A backend replays only when every launch matches the recording
    /// and falls back to running `f` directly otherwise, so results never depend on whether it replayed.
    ///
    /// ```
    /// use recall::backend::{cpu::CpuBackend, Backend, StepKey};
    /// let be = CpuBackend;
    /// let key = StepKey { rows: 1, tag: 0 };
    /// let x = be.run_step(key, &mut || be.upload(&[1.0, 2.0], 1, 2))?;
    /// assert_eq!(be.download(&x)?, vec![1.0, 2.0]);
    /// # Ok::<(), recall::Error>(())
    /// ```
    fn run_step<R>(&self, key: StepKey, f: &mut dyn FnMut() -> Result<R>) -> Result<R> {
        let _ = key;
        f()
    }

    /// Turns step recording/replay (see [`run_step`](Backend::run_step)) on or off; off by default
    /// where unsupported.
    fn set_step_replay(&self, on: bool) {
        let _ = on;
    }

    /// Counts of recorded, replayed and directly run steps so far.
    fn step_stats(&self) -> StepStats {
        StepStats::default()
    }

    /// Starts (or stops) timing every op; [`take_profile`](Backend::take_profile) returns the totals.
    fn set_profiling(&self, on: bool) {
        let _ = on;
    }

    /// Per-op totals since profiling was switched on (or since the last call), slowest first; resets
    /// them. Empty when the backend does not profile.
    fn take_profile(&self) -> Result<Vec<OpTime>> {
        Ok(Vec::new())
    }
}

/// The two GELU variants of the Qwen-VL vision towers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (`gelu_pytorch_tanh`).
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))` (`nn.GELU()`).
    Erf,
}

/// Shape parameters of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

/// One sequence of a paged attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedSeq<'a> {
    /// New tokens (rows of `q`) of this sequence.
    pub rows: usize,
    /// Tokens whose K/V are valid, the new ones included.
    pub context_len: usize,
    /// Pool blocks holding the sequence's tokens, in order.
    pub block_table: &'a [u32],
}

/// Time spent in one op (or kernel) while profiling.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OpTime {
    /// Op or kernel name, e.g. `linear`, `paged_attention_v1`.
    pub op: String,
    /// How many times it ran.
    pub calls: usize,
    /// Total seconds.
    pub seconds: f64,
    /// Floating-point operations done, where the backend counts them (0 otherwise): `seconds` and
    /// `flops` give the op's throughput.
    pub flops: f64,
}

/// What identifies a replayable forward step: the number of rows and a caller tag (e.g. the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StepKey {
    /// Rows in the step (sequences of a pure decode step).
    pub rows: usize,
    /// Distinguishes callers whose steps have the same row count but different work.
    pub tag: u64,
}

/// Counters of [`Backend::run_step`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Steps recorded (e.g. CUDA graph captures).
    pub recorded: usize,
    /// Steps replayed from a recording.
    pub replayed: usize,
    /// Steps run directly (replay off, unsupported, or the recording did not match).
    pub direct: usize,
    /// Recordings that failed (the step then ran directly).
    pub failed_recordings: usize,
    /// Step keys given up on after repeated failed recordings: they always run directly.
    pub given_up: usize,
}

/// [`Backend::swiglu`] as its definition: [`Backend::linears`] then [`Backend::silu_mul_owned`]
/// (the default, and the CPU's where it does not fuse).
pub(crate) fn swiglu_composed<B: Backend + ?Sized>(
    be: &B,
    x: &B::Tensor,
    gate: (&B::Weight, Option<&B::Weight>),
    up: (&B::Weight, Option<&B::Weight>),
) -> Result<B::Tensor> {
    match <[B::Tensor; 2]>::try_from(be.linears(x, &[gate, up])?) {
        Ok([gate, up]) => be.silu_mul_owned(gate, &up),
        Err(got) => Err(crate::Error::Shape {
            op: "swiglu".into(),
            message: format!("{} outputs of linears for 2 weights", got.len()),
        }),
    }
}
