//! The napkin numbers of a case: bytes moved and FLOPs, for the roofline.

use super::cases::{Case, Op, Shape};
use crate::backend::AttnShape;

/// Bytes and floating-point operations of one case: the fewest an implementation must move (each
/// input read once, each output written once) and the multiply-adds of its matrix products (2 FLOP
/// each); elementwise and reduction arithmetic is not counted (those ops are memory-bound).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Cost {
    /// Activation elements read plus written (their width is the backend's element size).
    pub act_elems: f64,
    /// Weight elements read (bf16 on every backend).
    pub weight_elems: f64,
    /// Other bytes: indices, block tables, f32 results.
    pub other_bytes: f64,
    /// Floating-point operations of the matrix products.
    pub flops: f64,
}

impl Cost {
    /// Bytes moved with activations of `element_bytes` each.
    pub fn bytes(&self, element_bytes: usize) -> f64 {
        self.act_elems * element_bytes as f64 + self.weight_elems * 2.0 + self.other_bytes
    }
}

/// The napkin numbers of `case`.
pub fn cost(case: &Case) -> Cost {
    let f = |x: usize| x as f64;
    let c = |act: f64, weight: f64, other: f64, flops: f64| Cost {
        act_elems: act,
        weight_elems: weight,
        other_bytes: other,
        flops,
    };
    match (&case.shape, case.op) {
        (Shape::Elems { rows, cols }, op) => {
            let operands = if matches!(op, Op::Add | Op::SiluMul) {
                3.0
            } else {
                2.0
            };
            c(operands * f(rows * cols), 0.0, 0.0, 0.0)
        }
        (Shape::Rows { cols, index, .. }, op) => {
            let moved = f(index.len() * cols);
            let reads = if op == Op::ScatterRowsAdd { 3.0 } else { 2.0 };
            c(reads * moved, 0.0, 4.0 * f(index.len()), 0.0)
        }
        (Shape::Table { cols, rows, taps, .. }, _) => {
            c(f(rows * cols), f(rows * taps * cols), 8.0 * f(rows * taps), 0.0)
        }
        (Shape::Gemm { n, inp, out }, op) => {
            let bias = if op == Op::LinearBias { f(*out) } else { 0.0 };
            c(
                f(n * inp + n * out),
                f(out * inp) + bias,
                0.0,
                2.0 * f(n * inp * out),
            )
        }
        (Shape::Norm { rows, cols, group }, op) => match op {
            Op::AddRmsNorm => c(4.0 * f(rows * cols), f(*group), 0.0, 0.0),
            Op::LayerNorm => c(2.0 * f(rows * cols), 2.0 * f(*cols), 0.0, 0.0),
            _ => c(2.0 * f(rows * cols), f(*group), 0.0, 0.0),
        },
        (Shape::Heads { n, heads, d }, _) => c(2.0 * f(n * heads * d) + 2.0 * f(n * d), 0.0, 0.0, 0.0),
        (
            Shape::QkWrite {
                n,
                q_heads,
                kv_heads,
                d,
                norms,
            },
            _,
        ) => {
            let acts = 2.0 * f(n * (q_heads + 2 * kv_heads) * d) + 2.0 * f(n * d);
            c(acts, if *norms { 2.0 * f(*d) } else { 0.0 }, 8.0 * f(*n), 0.0)
        }
        (Shape::Paged { shape: s, seqs }, _) => paged_cost(s, seqs),
        (Shape::Segments { heads, d, cu }, _) => {
            let n = f(*cu.last().unwrap_or(&0));
            let pairs: f64 = cu.windows(2).map(|w| f(w[1] - w[0]).powi(2)).sum();
            c(
                4.0 * n * f(heads * d),
                0.0,
                8.0 * f(cu.len()),
                4.0 * pairs * f(heads * d),
            )
        }
        (Shape::Logits { rows, vocab }, _) => c(f(rows * vocab), 0.0, 8.0 * f(*rows), 0.0),
    }
}

/// Paged attention: q in, out, and each sequence's keys and values read once; QKᵀ and PV over the
/// keys each row sees (causal).
fn paged_cost(s: &AttnShape, seqs: &[(usize, usize)]) -> Cost {
    let rows: usize = seqs.iter().map(|x| x.0).sum();
    let keys: usize = seqs.iter().map(|x| x.1).sum();
    let visible: f64 = seqs
        .iter()
        .map(|&(r, ctx)| (0..r).map(|i| (ctx - r + i + 1) as f64).sum::<f64>())
        .sum();
    let blocks: usize = seqs.iter().map(|x| x.1.div_ceil(s.block_size)).sum();
    Cost {
        act_elems: (2 * rows * s.q_heads * s.head_dim + 2 * keys * s.kv_heads * s.head_dim) as f64,
        weight_elems: 0.0,
        other_bytes: 4.0 * blocks as f64,
        flops: 4.0 * visible * (s.q_heads * s.head_dim) as f64,
    }
}
