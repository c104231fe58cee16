//! The CPU reference backend: f32 math on f32, bf16 or f16 weights that stay memory-mapped.
//!
//! Every reduction (dot products, norms, softmax sums) runs in a fixed order per row, so a row's
//! result is bitwise the same whether it is computed alone or together with other rows: this is what
//! makes prefix reuse and chunked prefill exact on CPU. Work is spread over threads with rayon, by
//! output blocks, which does not change any row's order of operations.

mod attention;
pub mod gemm;
mod ops;
pub use attention::{bf16_attention, set_bf16_attention};
/// The index of the first maximum of a row over its non-NaN entries (numpy's `nanargmax`; 0 when
/// all are NaN): the CPU argmax, for callers that choose on the host.
pub use ops::argmax as argmax_row;
pub mod peak;
mod profile;
#[macro_use]
mod simd;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use super::check::{self, shape_err};
use super::{AttnShape, Backend, Gelu, OpTime, PagedSeq};
use crate::checkpoint::{Dtype, MappedFile, TensorRef};
use crate::error::{Error, Result};

/// Activations on the CPU: row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>, // [rows, cols]
    pub rows: usize,
    pub cols: usize,
}

/// A weight on the CPU: a view into the checkpoint's mapping, in its dtype (or an aligned copy when
/// the file's f32 data is not 4-byte aligned). The GEMM reads it there (`gemm.rs`); with
/// [`set_decode_panels`] on, matrices also get decode panels at load.
#[derive(Debug)]
pub struct CpuWeight {
    shape: Vec<usize>,
    storage: Storage,
    panels: OnceLock<gemm::Panels>,
}

/// Whether weights loaded from now on get decode panels (see [`set_decode_panels`]).
static DECODE_PANELS: AtomicBool = AtomicBool::new(false);

/// Makes the CPU backend pack every matrix it loads from now on into [`gemm::Panels`] for decode:
/// decode then streams each weight contiguously (measured 1.3–1.5x faster per token on the 2B
/// shape, docs/PERFORMANCE.md), at the price of packing at load and a second copy of the
/// model in memory. Off by default (a one-shot run starts at once from the mapping); `recall
/// serve` turns it on. The output is the same bits either way.
pub fn set_decode_panels(on: bool) {
    DECODE_PANELS.store(on, Ordering::Relaxed);
}

#[derive(Debug)]
enum Storage {
    Mapped {
        dtype: Dtype,
        file: Arc<MappedFile>,
        range: std::ops::Range<usize>,
    },
    Owned(Vec<f32>),
}

impl CpuWeight {
    /// Number of elements per row (the last dimension; 1-D weights are one row).
    fn row_len(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Row `i` (of `row_len()` elements) as f32: borrowed when stored as aligned f32, else converted
    /// into `buf`.
    fn row<'a>(&'a self, i: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let n = self.row_len();
        self.span(i * n, n, buf)
    }

    /// Elements `start..start + n` as f32.
    fn span<'a>(&'a self, start: usize, n: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        match &self.storage {
            Storage::Owned(v) => &v[start..start + n],
            Storage::Mapped { dtype, file, range } => {
                let bytes = &file.data()[range.clone()];
                match dtype {
                    Dtype::F32 => {
                        let b = &bytes[start * 4..(start + n) * 4];
                        // SAFETY: `load_weight` only keeps F32 data mapped when it is 4-byte aligned;
                        // the byte length is exactly 4·n and every bit pattern is a valid f32.
                        unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), n) }
                    }
                    Dtype::BF16 => {
                        buf.clear();
                        buf.extend(
                            bytes[start * 2..(start + n) * 2]
                                .chunks_exact(2)
                                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                        );
                        buf
                    }
                    Dtype::F16 => {
                        buf.clear();
                        buf.extend(
                            bytes[start * 2..(start + n) * 2]
                                .chunks_exact(2)
                                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
                        );
                        buf
                    }
                }
            }
        }
    }

    /// The whole weight as f32 (borrowed when possible).
    fn all<'a>(&'a self, buf: &'a mut Vec<f32>) -> &'a [f32] {
        self.span(0, self.len(), buf)
    }

    fn new(shape: Vec<usize>, storage: Storage) -> Self {
        CpuWeight {
            shape,
            storage,
            panels: OnceLock::new(),
        }
    }

    /// Packs the decode panels of a matrix, when [`set_decode_panels`] is on (not for the weights
    /// [`gemm::set_bf16_dot`] takes: its kernel reads pairs, not widened panels).
    fn pack_if_asked(&self) {
        if DECODE_PANELS.load(Ordering::Relaxed) {
            if let Some(w) = self
                .row_major()
                .filter(|w| !(gemm::bf16_dot() && gemm::takes_bf16_dot(w)))
            {
                self.panels.get_or_init(|| {
                    let _op = profile::start("pack");
                    gemm::Panels::pack(&w)
                });
            }
        }
    }

    /// The 2-D weight as the GEMM's [`gemm::Matrix`] (`None` for other ranks): a view of its
    /// row-major storage, so that [`gemm::gemm_with`] can run it on a chosen instruction set (the
    /// kernel benchmark's CPU GEMM versions, `crate::kernel_bench`).
    pub fn matrix(&self) -> Option<gemm::Matrix<'_>> {
        let w = self.row_major()?;
        Some(match self.panels.get() {
            Some(p) => w.with_panels(p),
            None => w,
        })
    }

    /// The 2-D weight's row-major storage as a [`gemm::Matrix`] (without panels).
    fn row_major(&self) -> Option<gemm::Matrix<'_>> {
        let [n, k] = self.shape[..] else {
            return None;
        };
        let data = match &self.storage {
            Storage::Owned(v) => gemm::RowMajor::F32(v),
            Storage::Mapped { dtype, file, range } => {
                let bytes = &file.data()[range.clone()];
                match dtype {
                    // SAFETY: `load_weight` only keeps F32 data mapped when it is 4-byte
                    // aligned; every bit pattern is a valid f32.
                    Dtype::F32 => gemm::RowMajor::F32(unsafe {
                        std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4)
                    }),
                    Dtype::BF16 => gemm::RowMajor::Bf16(bytes),
                    Dtype::F16 => gemm::RowMajor::F16(bytes),
                }
            }
        };
        Some(gemm::Matrix::new(n, k, data))
    }
}

/// `rope(rms_norm(x, w), cos, sin)` with the same bits, each row normed and rotated while it is in
/// cache: q's and k's norms in `qk_norm_rope_write`.
fn norm_rope(
    x: &CpuTensor,
    w: &CpuWeight,
    eps: f32,
    (cos, sin): (&CpuTensor, &CpuTensor),
) -> Result<CpuTensor> {
    let _op = profile::start("qk_norm_rope");
    let g = check::rms_norm_groups(x.cols, w.len())?;
    let d = check::rope((x.rows, x.cols), (cos.rows, cos.cols), (sin.rows, sin.cols))?;
    if x.data.is_empty() {
        return Ok(x.clone());
    }
    let mut buf = Vec::new();
    let w = w.all(&mut buf);
    let cols = x.cols;
    let fill = |r: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
        for (x, out) in x.data[r * cols..(r + 1) * cols].chunks(g).zip(out.chunks_mut(g)) {
            ops::rms_norm_into(x, w, eps, out);
        }
        // SAFETY: the groups, which tile the row, were all written just above.
        let out = unsafe { ops::assume_written(out) };
        let (c, s) = (&cos.data[r * d..(r + 1) * d], &sin.data[r * d..(r + 1) * d]);
        out.chunks_mut(d).for_each(|head| ops::rope_head(head, c, s));
    };
    // SAFETY: `fill` writes every value of its row (its norm's groups tile it).
    let data = unsafe { ops::rows_written(x.data.len(), cols, fill) };
    Ok(CpuTensor { data, ..*x })
}

/// Embedding tables, read by row rather than multiplied.
fn is_table(name: &str) -> bool {
    name.ends_with("embed_tokens.weight") || name.ends_with("pos_embed.weight")
}

/// Whether a weight may get decode panels ([`set_decode_panels`]): not a table, and not the vision
/// tower's (prefix `visual.` or `model.visual.`), whose products run on a screenshot's hundreds of
/// patches, never on a decode's few rows; its panels were a quarter of the packed bytes of the
/// f32 2B shape at 4 layers, never read. Either layout gives the same bits (`gemm.rs`).
fn decodes(name: &str) -> bool {
    !is_table(name) && !name.starts_with("visual.") && !name.starts_with("model.visual.")
}

/// The CPU backend. Stateless; threads come from rayon's global pool. Profiling
/// ([`Backend::set_profiling`]) times the ops of the thread that switched it on (see `profile.rs`).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn element_bytes(&self) -> usize {
        4
    }

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn load_weight(&self, t: &TensorRef) -> Result<CpuWeight> {
        if let Some((fill, first)) = t.synthetic() {
            let n = t.numel() as u64;
            let data = (0..n).into_par_iter().map(|i| fill.value(first + i)).collect();
            let w = CpuWeight::new(t.shape.clone(), Storage::Owned(data));
            if decodes(&t.name) {
                w.pack_if_asked();
            }
            return Ok(w);
        }
        let (file, range) = t.mapping();
        let aligned = (file.data()[range.clone()].as_ptr() as usize).is_multiple_of(4);
        let storage = if t.dtype == Dtype::F32 && !(aligned && cfg!(target_endian = "little")) {
            Storage::Owned(t.to_f32())
        } else {
            Storage::Mapped {
                dtype: t.dtype,
                file: file.clone(),
                range,
            }
        };
        // Nothing is copied: the GEMM reads the mapping (`gemm.rs`). Embedding tables are
        // gathered by row; a tied lm_head gets its panels through `prepare_linear`.
        let w = CpuWeight::new(t.shape.clone(), storage);
        if decodes(&t.name) {
            w.pack_if_asked();
        }
        Ok(w)
    }

    fn warm_weight(&self, w: &CpuWeight, more: &dyn Fn() -> bool) {
        if let Storage::Mapped { file, range, .. } = &w.storage {
            let done = file.populate(range.clone(), more);
            tracing::debug!(bytes = done, of = range.len(), "weight pages mapped ahead");
        }
    }

    fn prepare_linear(&self, w: &CpuWeight) -> Result<()> {
        w.pack_if_asked();
        Ok(())
    }

    fn weight_shape<'w>(&self, w: &'w CpuWeight) -> &'w [usize] {
        &w.shape
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        let _op = profile::start("upload");
        if data.len() != rows * cols {
            return Err(shape_err(
                "upload",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        Ok(CpuTensor {
            data: data.to_vec(),
            rows,
            cols,
        })
    }

    fn download(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        let _op = profile::start("download");
        Ok(x.data.clone())
    }

    fn dims(&self, x: &CpuTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CpuTensor> {
        let _op = profile::start("zeros");
        Ok(CpuTensor {
            data: ops::zeros(rows * cols),
            rows,
            cols,
        })
    }

    fn rows(&self, x: &CpuTensor, start: usize, len: usize) -> Result<CpuTensor> {
        let _op = profile::start("rows");
        if start + len > x.rows {
            return Err(shape_err(
                "rows",
                format!("{start}..{} of {} rows", start + len, x.rows),
            ));
        }
        Ok(CpuTensor {
            data: x.data[start * x.cols..(start + len) * x.cols].to_vec(),
            rows: len,
            cols: x.cols,
        })
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor> {
        let _op = profile::start("embedding");
        let vocab = table.shape[0];
        let cols = table.row_len();
        let mut data = Vec::with_capacity(ids.len() * cols);
        let mut buf = Vec::new();
        for &id in ids {
            if id as usize >= vocab {
                return Err(Error::InvalidRequest(format!(
                    "token id {id} is outside the vocabulary of {vocab}"
                )));
            }
            data.extend_from_slice(table.row(id as usize, &mut buf));
        }
        Ok(CpuTensor {
            data,
            rows: ids.len(),
            cols,
        })
    }

    fn linear(&self, x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> Result<CpuTensor> {
        // Under a micro-kernel's rows (8) the product is bound by reading the weights (decode, the
        // prompt's last row through lm_head), not by FMAs: profiled apart so that GEMM rates mean
        // the compute-bound calls.
        let mut op = profile::start(if x.rows < gemm::MR {
            "linear_gemv"
        } else {
            "linear"
        });
        check::linear(x.cols, &w.shape, bias.map(|b| &b.shape[..]))?;
        op.flops(2.0 * x.rows as f64 * w.shape[0] as f64 * x.cols as f64);
        Ok(ops::linear(x, w, bias))
    }

    fn linears(&self, x: &CpuTensor, ws: &[(&CpuWeight, Option<&CpuWeight>)]) -> Result<Vec<CpuTensor>> {
        if x.rows < gemm::MR || ws.len() < 2 {
            return ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect();
        }
        let mut op = profile::start("linear");
        let mut flops = 0.0;
        for &(w, b) in ws {
            check::linear(x.cols, &w.shape, b.map(|b| &b.shape[..]))?;
            flops += 2.0 * x.rows as f64 * w.shape[0] as f64 * x.cols as f64;
        }
        op.flops(flops);
        Ok(ops::linears(x, ws))
    }

    fn swiglu(
        &self,
        x: &CpuTensor,
        gate: (&CpuWeight, Option<&CpuWeight>),
        up: (&CpuWeight, Option<&CpuWeight>),
    ) -> Result<CpuTensor> {
        let fused = match (gate.0.matrix(), up.0.matrix()) {
            (Some(g), Some(u)) if gemm::fuses_gated(x.rows, &g, &u) => Some((g, u)),
            _ => None,
        };
        let Some((g, u)) = fused else {
            return super::swiglu_composed(self, x, gate, up);
        };
        let mut op = profile::start("swiglu");
        for (w, b) in [gate, up] {
            check::linear(x.cols, &w.shape, b.map(|b| &b.shape[..]))?;
        }
        op.flops(4.0 * x.rows as f64 * g.n as f64 * x.cols as f64);
        Ok(ops::swiglu(x, (&g, &u), (gate.1, up.1)))
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuWeight, eps: f32) -> Result<CpuTensor> {
        let _op = profile::start("rms_norm");
        let g = check::rms_norm_groups(x.cols, weight.len())?;
        let mut buf = Vec::new();
        let w = weight.all(&mut buf);
        if x.data.is_empty() {
            return Ok(x.clone());
        }
        let cols = x.cols;
        let fill = |r: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
            for (x, out) in x.data[r * cols..(r + 1) * cols].chunks(g).zip(out.chunks_mut(g)) {
                ops::rms_norm_into(x, w, eps, out);
            }
        };
        // SAFETY: `rms_norm_into` writes every value of each group, and the groups tile the row.
        let data = unsafe { ops::rows_written(x.data.len(), cols, fill) };
        Ok(CpuTensor { data, ..*x })
    }

    fn scale(&self, x: &CpuTensor, s: f32) -> Result<CpuTensor> {
        let _op = profile::start("scale");
        let mut out = x.clone();
        out.data.iter_mut().for_each(|v| *v *= s);
        Ok(out)
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor> {
        self.add_owned(a.clone(), b)
    }

    fn add_owned(&self, mut a: CpuTensor, b: &CpuTensor) -> Result<CpuTensor> {
        let _op = profile::start("add");
        check::same("add", (a.rows, a.cols), (b.rows, b.cols))?;
        a.data
            .par_chunks_mut(4096)
            .zip(b.data.par_chunks(4096))
            .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(o, b)| *o += b));
        Ok(a)
    }

    fn add_rms_norm_owned(
        &self,
        mut x: CpuTensor,
        residual: &CpuTensor,
        weight: &CpuWeight,
        eps: f32,
    ) -> Result<(CpuTensor, CpuTensor)> {
        // The default's composition (the sum over `x`, then its norm), in one pass over the rows.
        let _op = profile::start("add_rms_norm");
        check::same("add", (x.rows, x.cols), (residual.rows, residual.cols))?;
        let g = check::rms_norm_groups(x.cols, weight.len())?;
        let mut buf = Vec::new();
        let w = weight.all(&mut buf);
        let (len, cols) = (x.data.len(), x.cols);
        if len == 0 {
            return Ok((x.clone(), x));
        }
        let mut normed = Vec::with_capacity(len);
        x.data
            .par_chunks_mut(cols)
            .zip(residual.data.par_chunks(cols))
            .zip(normed.spare_capacity_mut()[..len].par_chunks_mut(cols))
            .for_each(|((sum, r), out)| {
                sum.iter_mut().zip(r).for_each(|(s, r)| *s += r);
                for (s, out) in sum.chunks(g).zip(out.chunks_mut(g)) {
                    ops::rms_norm_into(s, w, eps, out);
                }
            });
        // SAFETY: the rows of `normed` (as many as `x` has) were each written in full above.
        unsafe { normed.set_len(len) };
        let normed = CpuTensor { data: normed, ..x };
        Ok((x, normed))
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        self.silu_mul_owned(gate.clone(), up)
    }

    fn silu_mul_owned(&self, mut gate: CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        let _op = profile::start("silu_mul");
        check::same("silu_mul", (gate.rows, gate.cols), (up.rows, up.cols))?;
        gate.data
            .par_chunks_mut(4096)
            .zip(up.data.par_chunks(4096))
            .for_each(|(g, u)| ops::silu_mul(g, u));
        Ok(gate)
    }

    fn rope(&self, x: &CpuTensor, cos: &CpuTensor, sin: &CpuTensor) -> Result<CpuTensor> {
        self.rope_owned(x.clone(), cos, sin)
    }

    fn rope_owned(&self, mut x: CpuTensor, cos: &CpuTensor, sin: &CpuTensor) -> Result<CpuTensor> {
        let _op = profile::start("rope");
        let d = check::rope((x.rows, x.cols), (cos.rows, cos.cols), (sin.rows, sin.cols))?;
        let cols = x.cols;
        if cols == 0 {
            return Ok(x); // no heads (`par_chunks_mut` takes no empty chunks)
        }
        x.data.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
            let (c, s) = (&cos.data[r * d..(r + 1) * d], &sin.data[r * d..(r + 1) * d]);
            row.chunks_mut(d).for_each(|head| ops::rope_head(head, c, s));
        });
        Ok(x)
    }

    fn qk_norm_rope_write(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        norms: Option<(&CpuWeight, &CpuWeight, f32)>,
        (cos, sin): (&CpuTensor, &CpuTensor),
        (k_pool, v_pool): (&mut CpuTensor, &mut CpuTensor),
        slots: &[usize],
    ) -> Result<CpuTensor> {
        // The default's composition, each norm and its rotation in one pass over the rows.
        let (q, k) = match norms {
            Some((qn, kn, eps)) => (
                norm_rope(q, qn, eps, (cos, sin))?,
                norm_rope(k, kn, eps, (cos, sin))?,
            ),
            None => (self.rope(q, cos, sin)?, self.rope(k, cos, sin)?),
        };
        self.scatter_rows(k_pool, slots, &k, false)?;
        self.scatter_rows(v_pool, slots, v, false)?;
        Ok(q)
    }

    fn paged_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        s: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<CpuTensor> {
        let _op = profile::start("paged_attention");
        check::paged_attention((q.rows, q.cols), (k.rows, k.cols), (v.rows, v.cols), s, seqs)?;
        Ok(attention::paged_attention(
            attention::Products::current(),
            q,
            k,
            v,
            s,
            seqs,
        ))
    }

    fn layer_norm(&self, x: &CpuTensor, weight: &CpuWeight, bias: &CpuWeight, eps: f32) -> Result<CpuTensor> {
        let _op = profile::start("layer_norm");
        if weight.len() != x.cols || bias.len() != x.cols {
            return Err(shape_err(
                "layer_norm",
                format!(
                    "{} columns, weight {:?}, bias {:?}",
                    x.cols, weight.shape, bias.shape
                ),
            ));
        }
        let (mut wb, mut bb) = (Vec::new(), Vec::new());
        let (w, b) = (weight.all(&mut wb), bias.all(&mut bb));
        if x.data.is_empty() {
            return Ok(x.clone());
        }
        let (cols, ones) = (x.cols, vec![1f32; x.cols]);
        let fill = |r: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
            ops::layer_norm_into(&x.data[r * cols..(r + 1) * cols], (w, b, &ones), eps, out)
        };
        // SAFETY: `layer_norm_into` writes every value of its row.
        let data = unsafe { ops::rows_written(x.data.len(), cols, fill) };
        Ok(CpuTensor { data, ..*x })
    }

    fn gelu(&self, x: &CpuTensor, kind: Gelu) -> Result<CpuTensor> {
        self.gelu_owned(x.clone(), kind)
    }

    fn gelu_owned(&self, mut x: CpuTensor, kind: Gelu) -> Result<CpuTensor> {
        let _op = profile::start("gelu");
        match kind {
            Gelu::Tanh => x.data.par_chunks_mut(4096).for_each(ops::gelu_tanh_all),
            Gelu::Erf => x.data.par_iter_mut().for_each(|v| *v = ops::gelu_erf(*v)),
        }
        Ok(x)
    }

    fn attention_segments(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<CpuTensor> {
        let _op = profile::start("attention_segments");
        check::attention_segments(
            (q.rows, q.cols),
            (k.rows, k.cols),
            (v.rows, v.cols),
            heads,
            cu_seqlens,
        )?;
        Ok(attention::attention_segments(
            attention::Products::current(),
            q,
            k,
            v,
            heads,
            cu_seqlens,
        ))
    }

    fn reshape(&self, x: CpuTensor, rows: usize, cols: usize) -> Result<CpuTensor> {
        check::reshape((x.rows, x.cols), rows, cols)?;
        Ok(CpuTensor {
            data: x.data,
            rows,
            cols,
        })
    }

    fn gather_rows(&self, x: &CpuTensor, index: &[usize]) -> Result<CpuTensor> {
        let _op = profile::start("gather_rows");
        if let Some(bad) = index.iter().find(|&&i| i >= x.rows) {
            return Err(shape_err("gather_rows", format!("row {bad} of {}", x.rows)));
        }
        let (rows, cols) = (index.len(), x.cols);
        if rows == 0 || cols == 0 {
            return Ok(CpuTensor {
                data: Vec::new(),
                rows,
                cols,
            });
        }
        let fill = |r: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
            let i = index[r];
            out.iter_mut()
                .zip(&x.data[i * cols..(i + 1) * cols])
                .for_each(|(o, v)| {
                    o.write(*v);
                });
        };
        // SAFETY: `fill` writes every value of its row (a row of `x` as long).
        let data = unsafe { ops::rows_written(rows * cols, cols, fill) };
        Ok(CpuTensor { data, rows, cols })
    }

    fn scatter_rows(
        &self,
        dst: &mut CpuTensor,
        index: &[usize],
        src: &CpuTensor,
        accumulate: bool,
    ) -> Result<()> {
        let _op = profile::start("scatter_rows");
        check::scatter_rows((dst.rows, dst.cols), index, (src.rows, src.cols))?;
        let c = dst.cols;
        for (r, &i) in index.iter().enumerate() {
            let (d, s) = (&mut dst.data[i * c..(i + 1) * c], &src.data[r * c..(r + 1) * c]);
            if accumulate {
                d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
            } else {
                d.copy_from_slice(s);
            }
        }
        Ok(())
    }

    fn weighted_embedding(
        &self,
        table: &CpuWeight,
        indices: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<CpuTensor> {
        let _op = profile::start("weighted_embedding");
        check::weighted_embedding(&table.shape, indices, weights, taps)?;
        let cols = table.row_len();
        let rows = indices.len() / taps;
        let mut data = ops::zeros(rows * cols);
        // Each row's sum in tap order, on all threads (a bf16 table widens rows into `buf`).
        data.par_chunks_mut(cols.max(1))
            .enumerate()
            .for_each_init(Vec::new, |buf, (r, out)| {
                for j in 0..taps {
                    let (i, w) = (indices[r * taps + j] as usize, weights[r * taps + j]);
                    out.iter_mut()
                        .zip(table.row(i, buf))
                        .for_each(|(o, e)| *o += e * w);
                }
            });
        Ok(CpuTensor { data, rows, cols })
    }

    fn log_softmax_gather(&self, logits: &CpuTensor, targets: &[u32]) -> Result<Vec<f32>> {
        let _op = profile::start("log_softmax_gather");
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
        Ok(logits
            .data
            .par_chunks(logits.cols)
            .zip(targets)
            .map(|(row, &t)| ops::log_softmax_at(row, t as usize))
            .collect())
    }

    fn argmax(&self, logits: &CpuTensor) -> Result<Vec<u32>> {
        let _op = profile::start("argmax");
        if logits.cols == 0 {
            return Err(shape_err("argmax", "zero columns".into()));
        }
        Ok(logits.data.chunks(logits.cols).map(ops::argmax).collect())
    }

    fn set_profiling(&self, on: bool) {
        profile::set(on);
    }

    fn take_profile(&self) -> Result<Vec<OpTime>> {
        Ok(profile::take())
    }
}

#[cfg(test)]
mod split_tests {
    use super::*;

    /// `split_cols` (the trait's default, built from `reshape` and `gather_rows`) returns exactly the
    /// column blocks: checked against slicing the rows by hand.
    #[test]
    fn split_cols_is_the_column_blocks() {
        let (rows, cols, parts) = (5, 12, 3);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 7.0).collect();
        let x = CpuBackend.upload(&data, rows, cols).unwrap();
        let split = CpuBackend.split_cols(x, parts).unwrap();
        let w = cols / parts;
        for (j, part) in split.iter().enumerate() {
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| data[r * cols + j * w..r * cols + (j + 1) * w].to_vec())
                .collect();
            assert_eq!((part.rows, part.cols), (rows, w));
            assert_eq!(part.data, want, "part {j}");
        }
        let odd = CpuBackend.upload(&[0.0; 10], 2, 5).unwrap();
        let err = CpuBackend.split_cols(odd, 3).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
    }

    /// `rope` of rows with no heads (no columns) is those rows unchanged, not a panic
    /// (`par_chunks_mut` refuses a chunk size of 0), borrowed or owned.
    #[test]
    fn rope_of_no_columns_is_the_input() {
        let table = CpuBackend.upload(&[0.5; 8], 2, 4).unwrap();
        let x = CpuBackend.upload(&[], 2, 0).unwrap();
        let y = CpuBackend.rope(&x, &table, &table).unwrap();
        assert_eq!((y.rows, y.cols, y.data.len()), (2, 0, 0));
        let y = CpuBackend.rope_owned(x, &table, &table).unwrap();
        assert_eq!((y.rows, y.cols, y.data.len()), (2, 0, 0));
    }
}
