//! Random inputs of a case, as tests/cuda_ops.rs draws them: uniform values in the ranges the parity
//! tests use, activations uploaded to the backend under test and read back (bf16 rounding on a GPU)
//! so that its CPU twin gets exactly the values it sees, and weights stored once as bf16 in a
//! safetensors file that both backends load.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::cases::{Case, Op, Shape};
use super::ops::{bf16_round, Operands, Params};
use crate::backend::cpu::CpuBackend;
use crate::backend::{AttnShape, Backend, Gelu};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::rng::Rng;

/// One activation: row-major values and its `[rows, cols]`.
pub struct Act {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// A case's inputs on the host, before any backend has seen them.
pub struct HostInputs {
    pub acts: Vec<Act>,
    /// `(name, values, shape)`, stored as bf16.
    pub weights: Vec<(&'static str, Vec<f32>, Vec<usize>)>,
    pub params: Params,
}

/// A `[rows, cols]` activation uniform in `[-range, range)`.
fn act(rng: &mut Rng, rows: usize, cols: usize, range: f32) -> Act {
    Act {
        data: rng.vec(rows * cols, -range, range),
        rows,
        cols,
    }
}

/// Draws the inputs of `case`.
pub fn host_inputs(case: &Case, rng: &mut Rng) -> HostInputs {
    let mut h = HostInputs {
        acts: Vec::new(),
        weights: Vec::new(),
        params: Params::default(),
    };
    match &case.shape {
        Shape::Elems { rows, cols } => {
            h.acts = vec![act(rng, *rows, *cols, 10.0), act(rng, *rows, *cols, 10.0)];
            h.acts.truncate(if matches!(case.op, Op::Add | Op::SiluMul) {
                2
            } else {
                1
            });
            h.params.scalar = 0.37;
            h.params.gelu = if case.op == Op::GeluErf {
                Gelu::Erf
            } else {
                Gelu::Tanh
            };
        }
        Shape::Rows { rows, cols, index } => {
            h.acts.push(act(rng, *rows, *cols, 3.0));
            if case.op != Op::GatherRows {
                h.acts.push(act(rng, index.len(), *cols, 3.0));
            }
            h.params.index = index.clone();
            h.params.accumulate = case.op == Op::ScatterRowsAdd;
        }
        Shape::Table {
            vocab,
            cols,
            rows,
            taps,
        } => {
            let table = rng.vec(vocab * cols, -1.0, 1.0);
            h.weights
                .push(("embed_tokens.weight", table, vec![*vocab, *cols]));
            h.params.ids = (0..rows * taps)
                .map(|_| rng.below(*vocab as u64) as u32)
                .collect();
            h.params.taps = *taps;
            if case.op == Op::WeightedEmbedding {
                h.params.tap_weights = rng.vec(rows * taps, 0.0, 1.0);
            }
        }
        Shape::Gemm { n, inp, out } => {
            let scale = 1.0 / (*inp as f32).sqrt();
            h.weights
                .push(("w", rng.vec(out * inp, -scale, scale), vec![*out, *inp]));
            let bias = rng.vec(*out, -1.0, 1.0);
            if case.op == Op::LinearBias {
                h.params.bias = bf16_round(&bias);
                h.weights.push(("b", bias, vec![*out]));
            }
            h.acts.push(act(rng, *n, *inp, 1.0));
        }
        Shape::Norm { rows, cols, group } => norm_inputs(&mut h, rng, case.op, (*rows, *cols, *group)),
        Shape::Heads { n, heads, d } => {
            h.acts.push(act(rng, *n, heads * d, 2.0));
            h.acts.extend(rope_tables(rng, *n, *d, 20.0));
        }
        Shape::QkWrite { .. } => qk_inputs(&mut h, rng, &case.shape),
        Shape::Paged { shape, seqs } => paged_inputs(&mut h, rng, *shape, seqs),
        Shape::Segments { heads, d, cu } => {
            let n = *cu.last().unwrap_or(&0);
            h.acts = (0..3).map(|_| act(rng, n, heads * d, 2.0)).collect();
            h.params.heads = *heads;
            h.params.cu = cu.clone();
        }
        Shape::Logits { rows, vocab } => {
            h.acts.push(act(rng, *rows, *vocab, 8.0));
            h.params.ids = (0..*rows).map(|_| rng.below(*vocab as u64) as u32).collect();
        }
    }
    h
}

fn norm_inputs(h: &mut HostInputs, rng: &mut Rng, op: Op, (rows, cols, group): (usize, usize, usize)) {
    h.params.eps = 1e-6;
    h.acts.push(act(rng, rows, cols, 4.0));
    if op == Op::LayerNorm {
        h.weights.push(("lw", rng.vec(cols, 0.5, 1.5), vec![cols]));
        h.weights.push(("lb", rng.vec(cols, -0.5, 0.5), vec![cols]));
        return;
    }
    h.weights.push(("w", rng.vec(group, 0.5, 1.5), vec![group]));
    if op == Op::AddRmsNorm {
        h.acts.push(act(rng, rows, cols, 4.0));
    }
}

/// `cos` and `sin` tables `[n, d]` of random angles in `[-range, range)`.
fn rope_tables(rng: &mut Rng, n: usize, d: usize, range: f32) -> [Act; 2] {
    let angles = rng.vec(n * d, -range, range);
    let table = |f: fn(f32) -> f32| Act {
        data: angles.iter().map(|&a| f(a)).collect(),
        rows: n,
        cols: d,
    };
    [table(f32::cos), table(f32::sin)]
}

/// tests/cuda_fused.rs's inputs: q, k, v in `[-4, 4)`, angles in `[-30, 30)`, pools in `[-1, 1)` of
/// `2n + 13` rows, `n` distinct shuffled slots.
fn qk_inputs(h: &mut HostInputs, rng: &mut Rng, shape: &Shape) {
    let Shape::QkWrite {
        n,
        q_heads,
        kv_heads,
        d,
        norms,
    } = *shape
    else {
        return;
    };
    let pool_rows = 2 * n + 13;
    h.acts.push(act(rng, n, q_heads * d, 4.0));
    h.acts.push(act(rng, n, kv_heads * d, 4.0));
    h.acts.push(act(rng, n, kv_heads * d, 4.0));
    h.acts.extend(rope_tables(rng, n, d, 30.0));
    h.acts.push(act(rng, pool_rows, kv_heads * d, 1.0));
    h.acts.push(act(rng, pool_rows, kv_heads * d, 1.0));
    h.weights.push(("q_norm", rng.vec(d, 0.5, 1.5), vec![d]));
    h.weights.push(("k_norm", rng.vec(d, 0.5, 1.5), vec![d]));
    let mut slots: Vec<usize> = (0..pool_rows).collect();
    rng.shuffle(&mut slots);
    slots.truncate(n);
    h.params.index = slots;
    h.params.norms = norms;
    h.params.eps = 1e-6;
}

/// tests/cuda_ops.rs's `attention_case`: block tables drawn without repetition from a shuffled pool
/// with 3 spare blocks; q, k, v in `[-2, 2)`.
fn paged_inputs(h: &mut HostInputs, rng: &mut Rng, shape: AttnShape, seqs: &[(usize, usize)]) {
    let blocks: Vec<usize> = seqs.iter().map(|&(_, c)| c.div_ceil(shape.block_size)).collect();
    let num_blocks = blocks.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let mut next = 0;
    for &n in &blocks {
        h.params.tables.push(ids[next..next + n].to_vec());
        next += n;
    }
    let slots = num_blocks * shape.block_size;
    let kvd = shape.kv_heads * shape.head_dim;
    for _ in 0..2 {
        h.acts.push(act(rng, slots, kvd, 2.0));
    }
    let rows: usize = seqs.iter().map(|s| s.0).sum();
    let qd = shape.q_heads * shape.head_dim;
    h.acts.insert(0, act(rng, rows, qd, 2.0));
    h.params.attn = Some(shape);
    h.params.seqs = seqs.to_vec();
}

/// The activations on `be`, and the same values as it holds them (read back) on the CPU.
fn upload_acts<B: Backend>(
    be: &B,
    host: &HostInputs,
) -> Result<(Vec<B::Tensor>, Vec<crate::backend::cpu::CpuTensor>)> {
    let target = upload_targets(be, host)?;
    let cpu = target
        .iter()
        .zip(&host.acts)
        .map(|(t, a)| CpuBackend.upload(&be.download(t)?, a.rows, a.cols))
        .collect::<Result<_>>()?;
    Ok((target, cpu))
}

/// The case's activations on `be` alone (a fresh copy for an op that wrote them in place).
pub fn upload_targets<B: Backend>(be: &B, host: &HostInputs) -> Result<Vec<B::Tensor>> {
    host.acts
        .iter()
        .map(|a| be.upload(&a.data, a.rows, a.cols))
        .collect()
}

/// The case's operands on `be` and on its CPU twin.
pub fn upload<B: Backend>(be: &B, host: &HostInputs) -> Result<(Operands<B>, Operands<CpuBackend>)> {
    let (x, cx) = upload_acts(be, host)?;
    let mut params = host.params.clone();
    params.round_bf16 = be.element_bytes() == 2;
    let (mut w, mut cw) = (Vec::new(), Vec::new());
    if !host.weights.is_empty() {
        let ckpt = bf16_checkpoint(&host.weights)?;
        for (name, _, _) in &host.weights {
            let t = ckpt.get(name)?;
            w.push(be.load_weight(t)?);
            cw.push(CpuBackend.load_weight(t)?);
        }
    }
    let target = Operands {
        x,
        w,
        p: params.clone(),
    };
    Ok((
        target,
        Operands {
            x: cx,
            w: cw,
            p: params,
        },
    ))
}

/// The tensors written as one bf16 safetensors file in the temporary directory, opened (mapped) and
/// unlinked again: the mapping keeps the data where the system allows that.
fn bf16_checkpoint(tensors: &[(&'static str, Vec<f32>, Vec<usize>)]) -> Result<Checkpoint> {
    static FILES: AtomicUsize = AtomicUsize::new(0);
    let path: PathBuf = std::env::temp_dir().join(format!(
        "recall-kernels-{}-{}.safetensors",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    let bad = |e: safetensors::SafeTensorError| Error::Safetensors {
        path: path.clone(),
        message: e.to_string(),
    };
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, d, _)| {
            d.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect()
        })
        .collect();
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, _, shape), b) in tensors.iter().zip(&bytes) {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), b).map_err(bad)?;
        views.push((name.to_string(), view));
    }
    let file = safetensors::serialize(views, &None).map_err(bad)?;
    std::fs::write(&path, file).map_err(|e| Error::io(&path, e))?;
    let ckpt = Checkpoint::open_file(&path);
    if cfg!(unix) {
        let _ = std::fs::remove_file(&path);
    }
    ckpt
}
