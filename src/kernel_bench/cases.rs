//! The op case tables: which op, at which shapes.
//!
//! The parity set mirrors the shape lists of tests/cuda_ops.rs (and, for `qk_norm_rope_write`,
//! tests/cuda_fused.rs), so that the harness validates and times exactly the cases the op-parity tests
//! check. Keep the two in step when either changes. The perf set adds a few cases at the shapes of
//! Qwen3-VL-8B (text: hidden 4096, 32 q / 8 kv heads of 128, MLP 12288, vocab 151936; vision: hidden
//! 1152, 16 heads of 72), large enough to time a kernel rather than its launch.

use crate::backend::AttnShape;

/// One op of the harness (a [`Backend`](crate::backend::Backend) op, or one mode of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Scale,
    Add,
    SiluMul,
    GeluTanh,
    GeluErf,
    GatherRows,
    /// `scatter_rows` replacing rows.
    ScatterRows,
    /// `scatter_rows` accumulating into rows.
    ScatterRowsAdd,
    Embedding,
    WeightedEmbedding,
    Linear,
    LinearBias,
    RmsNorm,
    AddRmsNorm,
    LayerNorm,
    Rope,
    QkNormRopeWrite,
    PagedAttention,
    AttentionSegments,
    LogSoftmaxGather,
    Argmax,
}

impl Op {
    /// Every op, in table order.
    pub const ALL: [Op; 21] = [
        Op::Scale,
        Op::Add,
        Op::SiluMul,
        Op::GeluTanh,
        Op::GeluErf,
        Op::GatherRows,
        Op::ScatterRows,
        Op::ScatterRowsAdd,
        Op::Embedding,
        Op::WeightedEmbedding,
        Op::Linear,
        Op::LinearBias,
        Op::RmsNorm,
        Op::AddRmsNorm,
        Op::LayerNorm,
        Op::Rope,
        Op::QkNormRopeWrite,
        Op::PagedAttention,
        Op::AttentionSegments,
        Op::LogSoftmaxGather,
        Op::Argmax,
    ];

    /// The name on the command line and in the table (`linear_bias`, `paged_attention`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Scale => "scale",
            Op::Add => "add",
            Op::SiluMul => "silu_mul",
            Op::GeluTanh => "gelu_tanh",
            Op::GeluErf => "gelu_erf",
            Op::GatherRows => "gather_rows",
            Op::ScatterRows => "scatter_rows",
            Op::ScatterRowsAdd => "scatter_rows_add",
            Op::Embedding => "embedding",
            Op::WeightedEmbedding => "weighted_embedding",
            Op::Linear => "linear",
            Op::LinearBias => "linear_bias",
            Op::RmsNorm => "rms_norm",
            Op::AddRmsNorm => "add_rms_norm",
            Op::LayerNorm => "layer_norm",
            Op::Rope => "rope",
            Op::QkNormRopeWrite => "qk_norm_rope_write",
            Op::PagedAttention => "paged_attention",
            Op::AttentionSegments => "attention_segments",
            Op::LogSoftmaxGather => "log_softmax_gather",
            Op::Argmax => "argmax",
        }
    }

    /// The op named `name` (see [`name`](Self::name)).
    pub fn parse(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == name)
    }

    /// Whether the op writes into one of its inputs (its operands are uploaded again before each
    /// version's checked run).
    pub fn mutates(self) -> bool {
        matches!(self, Op::ScatterRows | Op::ScatterRowsAdd | Op::QkNormRopeWrite)
    }
}

/// Which table to take cases from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CaseSet {
    /// The op-parity tests' shapes (small; fast on a CPU).
    #[default]
    Parity,
    /// Model-sized shapes (Qwen3-VL-8B), for timing.
    Perf,
    /// Both.
    All,
}

/// The sizes of one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    /// `[rows, cols]`, elementwise.
    Elems { rows: usize, cols: usize },
    /// Rows `index` of a `[rows, cols]` tensor (gather), or `index.len()` rows written into it (scatter).
    Rows {
        rows: usize,
        cols: usize,
        index: Vec<usize>,
    },
    /// `rows` output rows from a `[vocab, cols]` table, each the sum of `taps` table rows (1 for a
    /// plain embedding).
    Table {
        vocab: usize,
        cols: usize,
        rows: usize,
        taps: usize,
    },
    /// `[n, inp] · [out, inp]ᵀ`.
    Gemm { n: usize, inp: usize, out: usize },
    /// `[rows, cols]` normalised in groups of `group` columns.
    Norm { rows: usize, cols: usize, group: usize },
    /// `n` rows of `heads` heads of `d`.
    Heads { n: usize, heads: usize, d: usize },
    /// `n` new rows of q (`q_heads`) and k, v (`kv_heads`) written into a pool of `2n + 13` rows.
    QkWrite {
        n: usize,
        q_heads: usize,
        kv_heads: usize,
        d: usize,
        norms: bool,
    },
    /// Paged attention: `(rows, context_len)` per sequence.
    Paged {
        shape: AttnShape,
        seqs: Vec<(usize, usize)>,
    },
    /// Varlen attention of `heads` heads of `d` within segments `cu`.
    Segments { heads: usize, d: usize, cu: Vec<usize> },
    /// `[rows, vocab]` logits.
    Logits { rows: usize, vocab: usize },
}

/// One op at one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    pub op: Op,
    pub shape: Shape,
    /// From the perf table (else the parity table).
    pub perf: bool,
}

impl Case {
    /// A short description of the shape for the table.
    pub fn label(&self) -> String {
        match &self.shape {
            Shape::Elems { rows, cols } | Shape::Logits { rows, vocab: cols } => format!("[{rows}, {cols}]"),
            Shape::Rows { rows, cols, index } if index.len() <= 5 => {
                format!("{index:?} of [{rows}, {cols}]")
            }
            Shape::Rows { rows, cols, index } => format!("{} of [{rows}, {cols}]", index.len()),
            Shape::Table {
                vocab,
                cols,
                rows,
                taps,
            } => {
                format!("{rows}×{taps} of vocab {vocab} × {cols}")
            }
            Shape::Gemm { n, inp, out } => format!("[{n}, {inp}] · [{out}, {inp}]ᵀ"),
            Shape::Norm { rows, cols, group } => format!("[{rows}, {cols}] groups of {group}"),
            Shape::Heads { n, heads, d } => format!("n {n}, {heads} heads × {d}"),
            Shape::QkWrite {
                n,
                q_heads,
                kv_heads,
                d,
                norms,
            } => {
                let norms = if *norms { "norms" } else { "no norms" };
                format!("n {n}, {q_heads}q/{kv_heads}kv × {d}, {norms}")
            }
            Shape::Paged { shape: s, seqs } => {
                // Long batches as `n × (rows, context)`, after a different first sequence if any.
                let seqs = match seqs.as_slice() {
                    [first, rest @ ..] if seqs.len() > 3 && rest.iter().all(|s| s == first) => {
                        format!("{} × {first:?}", seqs.len())
                    }
                    [first, rest @ ..] if seqs.len() > 3 => {
                        format!("{first:?} + {} × {:?}", rest.len(), rest[rest.len() - 1])
                    }
                    _ => format!("{seqs:?}"),
                };
                format!(
                    "{}q/{}kv × {} bs {} {seqs}",
                    s.q_heads, s.kv_heads, s.head_dim, s.block_size
                )
            }
            Shape::Segments { heads, d, cu } => format!("{heads} × {d}, cu {cu:?}"),
        }
    }
}

/// The cases of `set`, in table order.
///
/// ```
/// use recall::kernel_bench::{cases, CaseSet, Op};
/// let parity = cases(CaseSet::Parity);
/// assert!(Op::ALL.iter().all(|op| parity.iter().any(|c| c.op == *op)));
/// ```
pub fn cases(set: CaseSet) -> Vec<Case> {
    let mut v = Vec::new();
    if set != CaseSet::Perf {
        v.extend(parity().into_iter().map(|(op, shape)| Case {
            op,
            shape,
            perf: false,
        }));
    }
    if set != CaseSet::Parity {
        v.extend(perf().into_iter().map(|(op, shape)| Case {
            op,
            shape,
            perf: true,
        }));
    }
    v
}

const ELEMENTWISE: [Op; 5] = [Op::Scale, Op::Add, Op::SiluMul, Op::GeluTanh, Op::GeluErf];

/// Paged attention shapes of tests/cuda_ops.rs: GQA 2:1, 4:1 and 1:1, odd block sizes, head dims 16
/// to 128.
const PAGED_SHAPES: [(usize, usize, usize, usize); 4] =
    [(4, 2, 32, 16), (2, 1, 16, 3), (8, 2, 128, 16), (3, 3, 72, 5)];

/// Prefill (with history), mixed chunked prefill + decode, pure decode (split-K), long decode.
const PAGED_BATCHES: [&[(usize, usize)]; 5] = [
    &[(7, 7)],
    &[(5, 12), (1, 30), (17, 17)],
    &[(1, 1), (1, 9), (1, 40)],
    &[(1, 700), (1, 257), (1, 3)],
    &[(1, 2049)],
];

fn attn(q_heads: usize, kv_heads: usize, head_dim: usize, block_size: usize) -> AttnShape {
    AttnShape {
        q_heads,
        kv_heads,
        head_dim,
        block_size,
    }
}

/// tests/cuda_ops.rs's shape lists (and tests/cuda_fused.rs's for `qk_norm_rope_write`).
fn parity() -> Vec<(Op, Shape)> {
    let mut v = Vec::new();
    for op in ELEMENTWISE {
        for (rows, cols) in [(1, 1), (3, 7), (17, 130), (64, 1000)] {
            v.push((op, Shape::Elems { rows, cols }));
        }
    }
    let rows = |index: &[usize]| Shape::Rows {
        rows: 9,
        cols: 13,
        index: index.to_vec(),
    };
    v.push((Op::GatherRows, rows(&[8, 0, 3, 3, 1])));
    for op in [Op::ScatterRows, Op::ScatterRowsAdd] {
        v.extend([rows(&[4, 0, 7]), rows(&[2, 2, 5])].map(|s| (op, s)));
    }
    for (vocab, cols) in [(50, 33), (1040, 64), (7, 1)] {
        let table = |rows, taps| Shape::Table {
            vocab,
            cols,
            rows,
            taps,
        };
        v.push((Op::Embedding, table(37, 1)));
        v.push((Op::WeightedEmbedding, table(11, 4)));
    }
    for op in [Op::Linear, Op::LinearBias] {
        for (n, inp, out) in [
            (1, 64, 32),
            (7, 33, 17),
            (130, 128, 96),
            (3, 256, 1040),
            (1, 1, 1),
            (64, 4096, 8),
        ] {
            v.push((op, Shape::Gemm { n, inp, out }));
        }
    }
    for op in [Op::RmsNorm, Op::AddRmsNorm, Op::LayerNorm] {
        for (rows, cols, group) in [
            (5, 64, 64),
            (7, 128, 32),
            (3, 130, 130),
            (2, 4096, 4096),
            (9, 48, 16),
            (1, 1, 1),
        ] {
            v.push((op, Shape::Norm { rows, cols, group }));
        }
    }
    for (n, heads, d) in [(1, 1, 2), (5, 4, 16), (9, 2, 32), (33, 8, 128), (3, 3, 80)] {
        v.push((Op::Rope, Shape::Heads { n, heads, d }));
    }
    for norms in [true, false] {
        for d in [128, 64, 16, 80, 256, 512] {
            for (q_heads, kv_heads) in [(8, 2), (4, 4)] {
                for n in [1, 7, 300] {
                    v.push((
                        Op::QkNormRopeWrite,
                        Shape::QkWrite {
                            n,
                            q_heads,
                            kv_heads,
                            d,
                            norms,
                        },
                    ));
                }
            }
        }
    }
    for (q, kv, d, bs) in PAGED_SHAPES {
        for seqs in PAGED_BATCHES {
            let shape = attn(q, kv, d, bs);
            v.push((
                Op::PagedAttention,
                Shape::Paged {
                    shape,
                    seqs: seqs.to_vec(),
                },
            ));
        }
    }
    for (heads, d) in [(2, 16), (2, 32), (4, 64), (3, 72), (2, 80), (1, 128)] {
        for cu in [vec![0usize, 5], vec![0, 1, 17, 17, 50], vec![0, 64, 128, 200]] {
            v.push((Op::AttentionSegments, Shape::Segments { heads, d, cu }));
        }
    }
    for op in [Op::LogSoftmaxGather, Op::Argmax] {
        for (rows, vocab) in [(1, 1), (3, 151), (5, 1040), (2, 151_936)] {
            v.push((op, Shape::Logits { rows, vocab }));
        }
    }
    v
}

/// Model-sized cases (Qwen3-VL-8B), sized so that the CPU twin of each stays around a second on a
/// 16-core machine.
fn perf() -> Vec<(Op, Shape)> {
    let elems = |rows, cols| Shape::Elems { rows, cols };
    let spread = |n: usize, rows: usize, cols| Shape::Rows {
        rows,
        cols,
        index: (0..n).map(|i| (i * 7919) % rows).collect(),
    };
    let table = |vocab, cols, rows, taps| Shape::Table {
        vocab,
        cols,
        rows,
        taps,
    };
    let gemm = |n, inp, out| Shape::Gemm { n, inp, out };
    let norm = |rows, cols, group| Shape::Norm { rows, cols, group };
    let qk = |n| Shape::QkWrite {
        n,
        q_heads: 32,
        kv_heads: 8,
        d: 128,
        norms: true,
    };
    let mut v: Vec<(Op, Shape)> = ELEMENTWISE.iter().map(|&op| (op, elems(2048, 12288))).collect();
    v.extend([
        (Op::GatherRows, spread(2048, 4096, 4096)),
        (Op::ScatterRows, spread(4096, 16384, 1024)),
        (Op::ScatterRowsAdd, spread(4096, 16384, 1024)),
        (Op::Embedding, table(16384, 4096, 4096, 1)),
        (Op::WeightedEmbedding, table(2304, 1152, 4096, 4)),
        (Op::Linear, gemm(1, 4096, 12288)),
        (Op::Linear, gemm(8, 4096, 4096)),
        (Op::Linear, gemm(2048, 4096, 12288)),
        (Op::LinearBias, gemm(4096, 1152, 3456)),
        (Op::RmsNorm, norm(4096, 4096, 4096)),
        (Op::RmsNorm, norm(4096, 4096, 128)),
        (Op::AddRmsNorm, norm(4096, 4096, 4096)),
        (Op::LayerNorm, norm(4096, 1152, 1152)),
        (
            Op::Rope,
            Shape::Heads {
                n: 4096,
                heads: 32,
                d: 128,
            },
        ),
        (Op::QkNormRopeWrite, qk(32)),
        (Op::QkNormRopeWrite, qk(4096)),
    ]);
    let text = attn(32, 8, 128, 16);
    for seqs in [
        vec![(1024, 3072)],
        vec![(1, 4096); 32],
        [vec![(512, 2048)], vec![(1, 4096); 8]].concat(),
    ] {
        v.push((Op::PagedAttention, Shape::Paged { shape: text, seqs }));
    }
    let cu = vec![0, 1024, 2048];
    v.push((Op::AttentionSegments, Shape::Segments { heads: 16, d: 72, cu }));
    let logits = || Shape::Logits {
        rows: 32,
        vocab: 151_936,
    };
    v.extend([(Op::LogSoftmaxGather, logits()), (Op::Argmax, logits())]);
    v
}
