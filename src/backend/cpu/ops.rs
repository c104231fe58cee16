//! The CPU kernels behind [`super::CpuBackend`], each a plain loop with a fixed reduction order.

use rayon::prelude::*;

use super::{CpuTensor, CpuWeight};
use crate::backend::{AttnShape, PagedSeq};

/// Lanes of the dot-product accumulator: wide enough for the compiler to vectorise, fixed so that
/// the order of additions never depends on the machine or the batch.
const LANES: usize = 16;

/// `Σ a[i]·b[i]` with `LANES` partial sums combined pairwise.
#[inline]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

/// Output rows of the weight handled by one task (converted to f32 once, then used for every
/// input row).
const OUT_BLOCK: usize = 16;

pub(super) fn linear(x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> CpuTensor {
    let (n, out) = (x.rows, w.shape[0]);
    let mut bias_buf = Vec::new();
    let bias = bias.map(|b| b.all(&mut bias_buf));
    // Computed transposed ([out, n]) so that each task owns a contiguous slice, then transposed back.
    let mut yt = vec![0f32; out * n];
    yt.par_chunks_mut(OUT_BLOCK * n.max(1))
        .enumerate()
        .for_each(|(blk, chunk)| {
            let mut buf = Vec::new();
            for (j, col) in chunk.chunks_mut(n.max(1)).enumerate() {
                let o = blk * OUT_BLOCK + j;
                let wrow = w.row(o, &mut buf);
                let b = bias.map_or(0.0, |b| b[o]);
                for (r, y) in col.iter_mut().enumerate().take(n) {
                    *y = dot(&x.data[r * x.cols..(r + 1) * x.cols], wrow) + b;
                }
            }
        });
    let mut data = vec![0f32; n * out];
    for o in 0..out {
        for r in 0..n {
            data[r * out + o] = yt[o * n + r];
        }
    }
    CpuTensor {
        data,
        rows: n,
        cols: out,
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

/// Causal grouped-query attention over the paged pool; one task per (query row, head).
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
    // Per query row: the pool slots it may attend to (its sequence's slots up to its own position).
    let mut row_slots: Vec<(std::sync::Arc<Vec<usize>>, usize)> = Vec::with_capacity(q.rows);
    for seq in seqs {
        let slots: Vec<usize> = (0..seq.context_len)
            .map(|t| seq.block_table[t / s.block_size] as usize * s.block_size + t % s.block_size)
            .collect();
        let slots = std::sync::Arc::new(slots);
        let first = seq.context_len - seq.rows;
        row_slots.extend((0..seq.rows).map(|i| (slots.clone(), first + i + 1)));
    }
    let mut out = vec![0f32; q.rows * q.cols];
    out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
        let (r, h) = (idx / s.q_heads, idx % s.q_heads);
        let kvh = h / group;
        let qv = &q.data[r * q.cols + h * d..r * q.cols + (h + 1) * d];
        let (slots, visible) = &row_slots[r];
        attend(qv, k, v, slots[..*visible].iter().copied(), kvh * d, scale, o);
    });
    CpuTensor {
        data: out,
        rows: q.rows,
        cols: q.cols,
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

/// `gelu_pytorch_tanh`.
pub(super) fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (K * (x + 0.044715 * x * x * x)).tanh())
}

/// Exact GELU, with erf evaluated in f64.
pub(super) fn gelu_erf(x: f32) -> f32 {
    (0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2))) as f32
}

/// Softmax-weighted sum of `v` rows for one query against keys `keys` (row indices), all in one head.
fn attend(
    qv: &[f32],
    k: &CpuTensor,
    v: &CpuTensor,
    keys: impl Iterator<Item = usize> + Clone,
    col: usize,
    scale: f32,
    o: &mut [f32],
) {
    let d = qv.len();
    let scores: Vec<f32> = keys
        .clone()
        .map(|t| dot(qv, &k.data[t * k.cols + col..t * k.cols + col + d]) * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    for (t, e) in keys.zip(&exps) {
        let p = e / sum;
        let vv = &v.data[t * v.cols + col..t * v.cols + col + d];
        o.iter_mut().zip(vv).for_each(|(o, v)| *o += p * v);
    }
}

/// Non-causal attention inside each segment of `cu_seqlens`; one task per (row, head).
pub(super) fn attention_segments(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    heads: usize,
    cu: &[usize],
) -> CpuTensor {
    let d = q.cols / heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut segment_of = vec![0usize; q.rows];
    for (s, w) in cu.windows(2).enumerate() {
        segment_of[w[0]..w[1]].iter_mut().for_each(|x| *x = s);
    }
    let mut out = vec![0f32; q.rows * q.cols];
    out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
        let (r, h) = (idx / heads, idx % heads);
        let s = segment_of[r];
        let qv = &q.data[r * q.cols + h * d..r * q.cols + (h + 1) * d];
        attend(qv, k, v, cu[s]..cu[s + 1], h * d, scale, o);
    });
    CpuTensor {
        data: out,
        rows: q.rows,
        cols: q.cols,
    }
}

/// `log_softmax(row)[t]`, with the normaliser summed in f64.
pub(super) fn log_softmax_at(row: &[f32], t: usize) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
    ((row[t] - max) as f64 - sum.ln()) as f32
}

/// Index of the first maximum.
pub(super) fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}
