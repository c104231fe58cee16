//! The CPU kernels behind [`super::CpuBackend`], each a plain loop with a fixed reduction order.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::simd::{dot, exp, multiversion};
use super::{CpuTensor, CpuWeight};

/// `x · Wᵀ (+ bias)` through the GEMM (see `gemm.rs` for its fixed reduction order); `w` is 2-D
/// (checked by the caller).
pub(super) fn linear(x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> CpuTensor {
    let mut one = linears(x, &[(w, bias)]);
    one.pop().expect("one output for one weight")
}

/// [`linear`] of one `x` by each `(weight, bias)`, through [`gemm_shared`](super::gemm::gemm_shared)
/// (the bf16 tiles of `x` rounded once for all); every weight 2-D (checked by the caller).
pub(super) fn linears(x: &CpuTensor, ws: &[(&CpuWeight, Option<&CpuWeight>)]) -> Vec<CpuTensor> {
    let mats: Vec<_> = ws
        .iter()
        .map(|(w, _)| w.matrix().expect("linear weights are 2-D"))
        .collect();
    let mut bias_bufs = vec![Vec::new(); ws.len()];
    let biases: Vec<Option<&[f32]>> = ws
        .iter()
        .zip(bias_bufs.iter_mut())
        .map(|((_, b), buf)| b.map(|b| b.all(buf)))
        .collect();
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| zeros(x.rows * w.n)).collect();
    let mut jobs: Vec<_> = mats
        .iter()
        .zip(biases)
        .zip(outs.iter_mut())
        .map(|((w, b), y)| (w, b, y.as_mut_slice()))
        .collect();
    super::gemm::gemm_shared(&x.data, x.rows, &mut jobs);
    drop(jobs);
    outs.into_iter()
        .zip(&mats)
        .map(|(data, w)| CpuTensor {
            data,
            rows: x.rows,
            cols: w.n,
        })
        .collect()
}

/// `silu(x·Gᵀ + g) · (x·Uᵀ + u)` through [`gemm_gated`](super::gemm::gemm_gated), which the
/// caller checked fuses these weights: the bits of [`linears`] then [`silu_mul`].
pub(super) fn swiglu(
    x: &CpuTensor,
    (gate, up): (&super::gemm::Matrix<'_>, &super::gemm::Matrix<'_>),
    (gate_bias, up_bias): (Option<&CpuWeight>, Option<&CpuWeight>),
) -> CpuTensor {
    let (mut gb, mut ub) = (Vec::new(), Vec::new());
    let gate_bias = gate_bias.map(|b| b.all(&mut gb));
    let up_bias = up_bias.map(|b| b.all(&mut ub));
    let mut data = zeros(x.rows * gate.n);
    super::gemm::gemm_gated(
        &x.data,
        x.rows,
        (gate, gate_bias),
        (up, up_bias),
        &mut data,
        silu_mul,
    );
    CpuTensor {
        data,
        rows: x.rows,
        cols: gate.n,
    }
}

multiversion! {
    /// `g ← silu(g) · u = g / (1 + e^-g) · u`, elementwise.
    pub(super) fn silu_mul(g: &mut [f32], u: &[f32]) {
        g.iter_mut().zip(u).for_each(|(g, u)| *g = *g / (1.0 + exp(-*g)) * u);
    }
}

/// `len` zeros, written on all threads: `vec!` writes them (and takes the page faults of fresh
/// memory) on the calling thread alone, a tenth of `linear`'s time in a prefill.
pub(super) fn zeros(len: usize) -> Vec<f32> {
    let mut data = Vec::with_capacity(len);
    data.spare_capacity_mut()[..len]
        .par_chunks_mut(1 << 16)
        .for_each(|c| c.fill(MaybeUninit::new(0.0)));
    // SAFETY: every value of `0..len` was written just above.
    unsafe { data.set_len(len) };
    data
}

/// RMSNorm of one group, in HF's order: `out ← w · (x · rsqrt(mean(x²) + eps))`, every value of
/// `out` written.
pub(super) fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    assert!(
        out.len() == x.len() && w.len() == x.len(),
        "one group of x, w and out"
    );
    let var = dot(x, x) / x.len() as f32;
    let r = 1.0 / (var + eps).sqrt();
    out.iter_mut().zip(x).zip(w).for_each(|((o, v), w)| {
        o.write(w * (v * r));
    });
}

/// A `[len / cols, cols]` output whose rows `fill(r, row)` writes in parallel, without the pass over
/// memory that zeroing it first (`vec!`) or cloning the input would cost: the norms read their
/// input once and write their output once. `len` is a multiple of `cols`.
///
/// # Safety
/// `fill` writes every value of each row it is handed.
pub(super) unsafe fn rows_written(
    len: usize,
    cols: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync + Send,
) -> Vec<f32> {
    assert!(cols > 0 && len.is_multiple_of(cols), "whole rows");
    let mut data = Vec::with_capacity(len);
    data.spare_capacity_mut()[..len]
        .par_chunks_mut(cols)
        .enumerate()
        .for_each(|(r, row)| fill(r, row));
    // SAFETY: the caller's `fill` wrote each of the `len / cols` rows, which cover `0..len`.
    unsafe { data.set_len(len) };
    data
}

/// `row` once every value is written.
///
/// # Safety
/// Every value of `row` is initialised.
pub(super) unsafe fn assume_written(row: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the caller wrote every value.
    unsafe { &mut *(row as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// Rotates one head in place: `x·cos + rotate_half(x)·sin` with `rotate_half(x) = [-x₂, x₁]`.
pub(super) fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/// LayerNorm of one row into `out` (mean and variance in f32, as torch does for f32 input; the
/// mean as a dot product with `ones`, a row of 1s as long as `x`), every value of `out` written.
pub(super) fn layer_norm_into(
    x: &[f32],
    (w, b, ones): (&[f32], &[f32], &[f32]),
    eps: f32,
    out: &mut [MaybeUninit<f32>],
) {
    assert!(
        out.len() == x.len() && ones.len() == x.len(),
        "one row of x, ones and out"
    );
    let n = x.len() as f32;
    let mean = dot(x, ones) / n;
    out.iter_mut().zip(x).for_each(|(o, v)| {
        o.write(v - mean);
    });
    // SAFETY: every value of `out` was written just above.
    let out = unsafe { assume_written(out) };
    let var = dot(out, out) / n;
    let r = 1.0 / (var + eps).sqrt();
    out.iter_mut()
        .zip(w.iter().zip(b))
        .for_each(|(v, (w, b))| *v = *v * r * w + b);
}

/// `gelu_pytorch_tanh`, with `tanh(y) = sign(y) · (1 - 2 / (e^{2|y|} + 1))` on [`exp`] (so that it
/// vectorises).
#[inline(always)]
pub(super) fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2/pi)
    let y = K * (x + 0.044715 * x * x * x);
    let t = 1.0 - 2.0 / (exp(2.0 * y.abs()) + 1.0);
    0.5 * x * (1.0 + t.copysign(y))
}

multiversion! {
    /// [`gelu_tanh`] on every element.
    pub(super) fn gelu_tanh_all(xs: &mut [f32]) {
        xs.iter_mut().for_each(|v| *v = gelu_tanh(*v));
    }
}

/// Exact GELU, with erf evaluated in f64.
pub(super) fn gelu_erf(x: f32) -> f32 {
    (0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2))) as f32
}

/// `log_softmax(row)[t]`, with the normaliser summed in f64.
pub(super) fn log_softmax_at(row: &[f32], t: usize) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
    ((row[t] - max) as f64 - sum.ln()) as f32
}

/// Index of the first maximum over the non-NaN entries (numpy's `nanargmax`); 0 when all are NaN.
/// The CUDA twin (`argmax_v1` in kernels/reduce.cu) keeps the same rule, so a NaN logit cannot make
/// the backends pick different tokens (with a bare `x > row[best]`, a NaN at index 0 would win).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i) as u32
}
