//! The CPU kernels behind [`super::CpuBackend`], each a plain loop with a fixed reduction order.

use rayon::prelude::*;

use super::simd::{dot, dot_4x4, exp, multiversion, pv_accumulate};
use super::{CpuTensor, CpuWeight};
use crate::backend::{AttnShape, PagedSeq};

/// `x · Wᵀ (+ bias)` through the GEMM (see `gemm.rs` for its fixed reduction order); `w` is 2-D
/// (checked by the caller).
pub(super) fn linear(x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> CpuTensor {
    let w = w.matrix().expect("linear weights are 2-D");
    let mut bias_buf = Vec::new();
    let bias = bias.map(|b| b.all(&mut bias_buf));
    let mut data = vec![0f32; x.rows * w.n];
    super::gemm::gemm(&x.data, x.rows, &w, bias, &mut data);
    CpuTensor {
        data,
        rows: x.rows,
        cols: w.n,
    }
}

multiversion! {
    /// `g ← silu(g) · u = g / (1 + e^-g) · u`, elementwise.
    pub(super) fn silu_mul(g: &mut [f32], u: &[f32]) {
        g.iter_mut().zip(u).for_each(|(g, u)| *g = *g / (1.0 + exp(-*g)) * u);
    }
}

/// RMSNorm of one group in place, in HF's order: `w · (x · rsqrt(mean(x²) + eps))`.
pub(super) fn rms_norm_group(x: &mut [f32], w: &[f32], eps: f32) {
    let var = dot(x, x) / x.len() as f32;
    let r = 1.0 / (var + eps).sqrt();
    x.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * r));
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

/// Query rows per attention task: the keys and values a tile reads are loaded once for all its
/// rows.
const QUERY_TILE: usize = 16;

/// Causal grouped-query attention over the paged pool; one task per (tile of query rows, head).
pub(super) fn paged_attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    s: AttnShape,
    seqs: &[PagedSeq<'_>],
) -> CpuTensor {
    let d = s.head_dim;
    let group = s.q_heads / s.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    // Per sequence: its pool slots, and its first row in q.
    let mut tasks = Vec::new();
    let mut row0 = 0;
    for seq in seqs {
        let slots: Vec<usize> = (0..seq.context_len)
            .map(|t| seq.block_table[t / s.block_size] as usize * s.block_size + t % s.block_size)
            .collect();
        let slots = std::sync::Arc::new(slots);
        let first = seq.context_len - seq.rows;
        for t0 in (0..seq.rows).step_by(QUERY_TILE) {
            let rows = QUERY_TILE.min(seq.rows - t0);
            // Row i of the tile sees the sequence's first `first + t0 + i + 1` tokens.
            let visible: Vec<usize> = (0..rows).map(|i| first + t0 + i + 1).collect();
            for h in 0..s.q_heads {
                tasks.push(AttnTask {
                    row0: row0 + t0,
                    head: h,
                    kv_col: (h / group) * d,
                    keys: slots.clone(),
                    visible: visible.clone(),
                });
            }
        }
        row0 += seq.rows;
    }
    run_attention(q, k, v, d, scale, &tasks)
}

/// One attention task: query rows `row0..row0 + visible.len()` of head `head` (columns
/// `head · d..`), attending to the first `visible[i]` of `keys` (pool rows; K/V columns `kv_col..`).
struct AttnTask {
    row0: usize,
    head: usize,
    kv_col: usize,
    keys: std::sync::Arc<Vec<usize>>,
    visible: Vec<usize>,
}

/// Runs attention tasks in parallel and assembles the output `[q.rows, q.cols]`.
fn run_attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    d: usize,
    scale: f32,
    tasks: &[AttnTask],
) -> CpuTensor {
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|t| attend_tile(q, k, v, d, scale, t))
        .collect();
    let mut out = vec![0f32; q.rows * q.cols];
    for (t, part) in tasks.iter().zip(parts) {
        for (i, o) in part.chunks(d).enumerate() {
            let at = (t.row0 + i) * q.cols + t.head * d;
            out[at..at + d].copy_from_slice(o);
        }
    }
    CpuTensor {
        data: out,
        rows: q.rows,
        cols: q.cols,
    }
}

multiversion! {
/// Softmax-weighted sums of `v` rows for a tile of query rows of one head. Each row's arithmetic is
/// the same as alone and in the same order: its scores `dot(q, k_j) · scale` over its visible keys
/// in key order, `exp(s - max)`, their sum from the first key on, then `o += (e_j / sum) · v_j` in
/// key order. Tiling only shares the loads of `k_j` and `v_j` between the rows.
fn attend_tile(q: &CpuTensor, k: &CpuTensor, v: &CpuTensor, d: usize, scale: f32, t: &AttnTask) -> Vec<f32> {
    let rows = t.visible.len();
    let n = t.visible.iter().copied().max().unwrap_or(0);
    let qrow = |i: usize| {
        let at = (t.row0 + i) * q.cols + t.head * d;
        &q.data[at..at + d]
    };
    let mut scores = vec![0f32; rows * n];
    let key = |j: usize| {
        let at = t.keys[j] * k.cols + t.kv_col;
        &k.data[at..at + d]
    };
    // Blocks of 4 rows × 4 keys that every row of the block sees go 16 dot products at a time; the
    // rest (the causal edge, leftover rows and keys) one at a time. Either way each score is `dot`.
    let (row_quads, key_quads) = (rows / 4 * 4, n / 4 * 4);
    for j0 in (0..key_quads).step_by(4) {
        let ks = [key(j0), key(j0 + 1), key(j0 + 2), key(j0 + 3)];
        for i0 in (0..row_quads).step_by(4) {
            if t.visible[i0..i0 + 4].iter().all(|&v| v >= j0 + 4) {
                let grid = dot_4x4([qrow(i0), qrow(i0 + 1), qrow(i0 + 2), qrow(i0 + 3)], ks);
                for (r, row) in grid.iter().enumerate() {
                    for (c, s) in row.iter().enumerate() {
                        scores[(i0 + r) * n + j0 + c] = s * scale;
                    }
                }
            } else {
                for i in i0..i0 + 4 {
                    for j in j0..(j0 + 4).min(t.visible[i]) {
                        scores[i * n + j] = dot(qrow(i), key(j)) * scale;
                    }
                }
            }
        }
    }
    for i in 0..rows {
        let done = if i < row_quads { key_quads.min(t.visible[i]) } else { 0 };
        for j in done..t.visible[i] {
            scores[i * n + j] = dot(qrow(i), key(j)) * scale;
        }
    }
    let mut sums = vec![0f32; rows];
    for (i, sum) in sums.iter_mut().enumerate() {
        let row = &mut scores[i * n..i * n + t.visible[i]];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter_mut().for_each(|x| *x = exp(*x - max));
        *sum = row.iter().sum();
    }
    for (i, &sum) in sums.iter().enumerate() {
        scores[i * n..i * n + t.visible[i]].iter_mut().for_each(|e| *e /= sum);
    }
    let mut out = vec![0f32; rows * d];
    pv_accumulate(&mut out, d, &scores, n, &t.visible, &v.data, v.cols, &t.keys, t.kv_col);
    out
}
}

/// LayerNorm of one row in place (mean and variance in f32, as torch does for f32 input).
pub(super) fn layer_norm_row(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let ones = vec![1f32; x.len()];
    let mean = dot(x, &ones) / n;
    x.iter_mut().for_each(|v| *v -= mean);
    let var = dot(x, x) / n;
    let r = 1.0 / (var + eps).sqrt();
    x.iter_mut()
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

/// Non-causal attention inside each segment of `cu_seqlens`; one task per (tile of rows, head).
pub(super) fn attention_segments(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    heads: usize,
    cu: &[usize],
) -> CpuTensor {
    let d = q.cols / heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut tasks = Vec::new();
    for w in cu.windows(2) {
        let (a, b) = (w[0], w[1]);
        let keys = std::sync::Arc::new((a..b).collect::<Vec<usize>>());
        for r0 in (a..b).step_by(QUERY_TILE) {
            let rows = QUERY_TILE.min(b - r0);
            for h in 0..heads {
                tasks.push(AttnTask {
                    row0: r0,
                    head: h,
                    kv_col: h * d,
                    keys: keys.clone(),
                    visible: vec![b - a; rows],
                });
            }
        }
    }
    run_attention(q, k, v, d, scale, &tasks)
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
