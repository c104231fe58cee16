//! How a version runs an op: operands in, outputs out, generic over the backend.

use super::cases::Op;
use crate::backend::cpu::CpuBackend;
use crate::backend::{AttnShape, Backend, Gelu, PagedSeq};
use crate::error::{Error, Result};

/// A case's parameters that are not tensors (the same on every backend).
#[derive(Debug, Clone)]
pub struct Params {
    /// `scale`'s factor.
    pub scalar: f32,
    /// The norms' epsilon.
    pub eps: f32,
    pub gelu: Gelu,
    /// Rows of `gather_rows` / `scatter_rows`; the pool slots of `qk_norm_rope_write`.
    pub index: Vec<usize>,
    /// Token ids (`embedding`), table rows (`weighted_embedding`), targets (`log_softmax_gather`).
    pub ids: Vec<u32>,
    pub taps: usize,
    pub tap_weights: Vec<f32>,
    /// `linear_bias`'s bias as the host holds it (bf16 values), for the CPU GEMM versions.
    pub bias: Vec<f32>,
    /// Whether `scatter_rows` adds into the rows (else replaces them).
    pub accumulate: bool,
    /// Whether `qk_norm_rope_write` normalises q and k.
    pub norms: bool,
    pub attn: Option<AttnShape>,
    /// `(rows, context_len)` per sequence, and its block table.
    pub seqs: Vec<(usize, usize)>,
    pub tables: Vec<Vec<u32>>,
    /// `attention_segments`' heads and segment bounds.
    pub heads: usize,
    pub cu: Vec<usize>,
    /// The backend under test keeps activations in bf16: the CPU twin rounds the intermediates the
    /// fused ops round (the sum of `add_rms_norm`).
    pub round_bf16: bool,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            scalar: 1.0,
            eps: 1e-6,
            gelu: Gelu::Tanh,
            index: Vec::new(),
            ids: Vec::new(),
            taps: 1,
            tap_weights: Vec::new(),
            bias: Vec::new(),
            accumulate: false,
            norms: false,
            attn: None,
            seqs: Vec::new(),
            tables: Vec::new(),
            heads: 1,
            cu: Vec::new(),
            round_bf16: false,
        }
    }
}

impl Params {
    /// The paged attention batch.
    pub fn batch(&self) -> Vec<PagedSeq<'_>> {
        self.seqs
            .iter()
            .zip(&self.tables)
            .map(|(&(rows, context_len), t)| PagedSeq {
                rows,
                context_len,
                block_table: t,
            })
            .collect()
    }

    fn attn(&self) -> Result<AttnShape> {
        self.attn
            .ok_or_else(|| Error::InvalidRequest("kernel bench: paged case without a shape".into()))
    }
}

/// A case's tensors on one backend: activations `x` and weights `w` in the order the op takes them.
pub struct Operands<B: Backend> {
    pub x: Vec<B::Tensor>,
    pub w: Vec<B::Weight>,
    pub p: Params,
}

impl<B: Backend> Operands<B> {
    /// Activation `i`, or an error naming the op (a case built for another op).
    pub fn act(&self, i: usize) -> Result<&B::Tensor> {
        self.x.get(i).ok_or_else(|| missing("activation", i))
    }

    /// Weight `i`.
    pub fn weight(&self, i: usize) -> Result<&B::Weight> {
        self.w.get(i).ok_or_else(|| missing("weight", i))
    }
}

fn missing(what: &str, i: usize) -> Error {
    Error::InvalidRequest(format!("kernel bench: the case has no {what} {i}"))
}

/// One output of a run.
pub enum Out<B: Backend> {
    /// A new tensor.
    Tensor(B::Tensor),
    /// Values the op returns to the host (f32 results, argmax indices as f32).
    Host(Vec<f32>),
    /// Activation `i` of the operands, written in place.
    Operand(usize),
}

/// A run: the outputs, or `None` when this version does not cover the case (a kernel that declines
/// the shape; nothing was launched).
pub type Outs<B> = Option<Vec<Out<B>>>;

/// Runs one version of an op on a case's operands.
pub type RunFn<B> = fn(&B, &mut Operands<B>) -> Result<Outs<B>>;

/// One kernel version (or launch configuration) of an op.
pub struct Version<B: Backend> {
    /// Short name for the table (`dispatch`, `v1`, `flash`, `gemm-avx2`, ...).
    pub name: &'static str,
    pub run: RunFn<B>,
}

impl<B: Backend> Version<B> {
    /// The trait op itself: what the models run.
    pub fn dispatch(op: Op) -> Self {
        Version {
            name: "dispatch",
            run: dispatch::<B>(op),
        }
    }
}

fn one<B: Backend>(t: Result<B::Tensor>) -> Result<Outs<B>> {
    Ok(Some(vec![Out::Tensor(t?)]))
}

/// The [`Backend`] op behind `op`.
pub fn dispatch<B: Backend>(op: Op) -> RunFn<B> {
    match op {
        Op::Scale => |be, o| one(be.scale(o.act(0)?, o.p.scalar)),
        Op::Add => |be, o| one(be.add(o.act(0)?, o.act(1)?)),
        Op::SiluMul => |be, o| one(be.silu_mul(o.act(0)?, o.act(1)?)),
        Op::GeluTanh | Op::GeluErf => |be, o| one(be.gelu(o.act(0)?, o.p.gelu)),
        Op::GatherRows => |be, o| one(be.gather_rows(o.act(0)?, &o.p.index)),
        Op::ScatterRows | Op::ScatterRowsAdd => scatter::<B>,
        Op::Embedding => |be, o| one(be.embedding(o.weight(0)?, &o.p.ids)),
        Op::WeightedEmbedding => {
            |be, o| one(be.weighted_embedding(o.weight(0)?, &o.p.ids, &o.p.tap_weights, o.p.taps))
        }
        Op::Linear | Op::LinearBias => |be, o| one(be.linear(o.act(0)?, o.weight(0)?, o.w.get(1))),
        Op::RmsNorm => |be, o| one(be.rms_norm(o.act(0)?, o.weight(0)?, o.p.eps)),
        Op::AddRmsNorm => |be, o| {
            let (sum, normed) = be.add_rms_norm(o.act(0)?, o.act(1)?, o.weight(0)?, o.p.eps)?;
            Ok(Some(vec![Out::Tensor(sum), Out::Tensor(normed)]))
        },
        Op::LayerNorm => |be, o| one(be.layer_norm(o.act(0)?, o.weight(0)?, o.weight(1)?, o.p.eps)),
        Op::Rope => |be, o| one(be.rope(o.act(0)?, o.act(1)?, o.act(2)?)),
        Op::QkNormRopeWrite => qk_write::<B>,
        Op::PagedAttention => |be, o| {
            let s = o.p.attn()?;
            one(be.paged_attention(o.act(0)?, o.act(1)?, o.act(2)?, s, &o.p.batch()))
        },
        Op::AttentionSegments => {
            |be, o| one(be.attention_segments(o.act(0)?, o.act(1)?, o.act(2)?, o.p.heads, &o.p.cu))
        }
        Op::LogSoftmaxGather => {
            |be, o| Ok(Some(vec![Out::Host(be.log_softmax_gather(o.act(0)?, &o.p.ids)?)]))
        }
        Op::Argmax => |be, o| {
            let ids = be.argmax(o.act(0)?)?;
            Ok(Some(vec![Out::Host(ids.into_iter().map(|i| i as f32).collect())]))
        },
    }
}

/// `scatter_rows` of activation 1 into activation 0, in place.
fn scatter<B: Backend>(be: &B, o: &mut Operands<B>) -> Result<Outs<B>> {
    let (dst, src) = o.x.split_at_mut(1);
    let (Some(dst), Some(src)) = (dst.first_mut(), src.first()) else {
        return Err(missing("activation", 1));
    };
    be.scatter_rows(dst, &o.p.index, src, o.p.accumulate)?;
    Ok(Some(vec![Out::Operand(0)]))
}

/// Activations `q, k, v, cos, sin` and the pools (5, 6), split for one call.
type QkParts<'a, T> = (&'a [T], &'a mut T, &'a mut T);

fn qk_parts<T>(x: &mut [T]) -> Result<QkParts<'_, T>> {
    if x.len() != 7 {
        return Err(missing("activation", 6));
    }
    let (ins, pools) = x.split_at_mut(5);
    let (k, v) = pools.split_at_mut(1);
    Ok((ins, &mut k[0], &mut v[0]))
}

/// The trait's `qk_norm_rope_write` (fused on CUDA, the composition on the CPU).
fn qk_write<B: Backend>(be: &B, o: &mut Operands<B>) -> Result<Outs<B>> {
    let (ins, kp, vp) = qk_parts(&mut o.x)?;
    let norms = match (o.p.norms, o.w.as_slice()) {
        (true, [qn, kn, ..]) => Some((qn, kn, o.p.eps)),
        (true, _) => return Err(missing("weight", 1)),
        (false, _) => None,
    };
    let q = be.qk_norm_rope_write(
        &ins[0],
        &ins[1],
        &ins[2],
        norms,
        (&ins[3], &ins[4]),
        (kp, vp),
        &o.p.index,
    )?;
    Ok(Some(vec![Out::Tensor(q), Out::Operand(5), Out::Operand(6)]))
}

/// `qk_norm_rope_write` composed op by op (`rms_norm`, `rope`, `scatter_rows`), as the trait's
/// default does it: the unfused version on a backend that fuses it.
pub fn qk_write_composed<B: Backend>(be: &B, o: &mut Operands<B>) -> Result<Outs<B>> {
    let (ins, kp, vp) = qk_parts(&mut o.x)?;
    let (cos, sin) = (&ins[3], &ins[4]);
    let rotate = |x: &B::Tensor, w: Option<&B::Weight>| match w {
        Some(w) => be.rope(&be.rms_norm(x, w, o.p.eps)?, cos, sin),
        None => be.rope(x, cos, sin),
    };
    let (qn, kn) = if o.p.norms {
        (o.w.first(), o.w.get(1))
    } else {
        (None, None)
    };
    let q = rotate(&ins[0], qn)?;
    let k = rotate(&ins[1], kn)?;
    be.scatter_rows(kp, &o.p.index, &k, false)?;
    be.scatter_rows(vp, &o.p.index, &ins[2], false)?;
    Ok(Some(vec![Out::Tensor(q), Out::Operand(5), Out::Operand(6)]))
}

/// `add_rms_norm` as `add` then `rms_norm`: the unfused version.
pub fn add_rms_norm_unfused<B: Backend>(be: &B, o: &mut Operands<B>) -> Result<Outs<B>> {
    let sum = be.add(o.act(0)?, o.act(1)?)?;
    let normed = be.rms_norm(&sum, o.weight(0)?, o.p.eps)?;
    Ok(Some(vec![Out::Tensor(sum), Out::Tensor(normed)]))
}

/// The CPU twin's run of `op`: the CPU backend's op, except that for a bf16 backend the sum of
/// `add_rms_norm` is rounded to bf16 before the norm, as the fused kernel does (tests/cuda_ops.rs).
pub fn reference(op: Op) -> RunFn<CpuBackend> {
    match op {
        Op::AddRmsNorm => |be, o| {
            let mut sum = be.add(o.act(0)?, o.act(1)?)?;
            if o.p.round_bf16 {
                sum.data = bf16_round(&sum.data);
            }
            let normed = be.rms_norm(&sum, o.weight(0)?, o.p.eps)?;
            Ok(Some(vec![Out::Tensor(sum), Out::Tensor(normed)]))
        },
        _ => dispatch::<CpuBackend>(op),
    }
}

/// The outputs of a run on the host, in order.
pub fn to_host<B: Backend>(be: &B, o: &Operands<B>, outs: Vec<Out<B>>) -> Result<Vec<Vec<f32>>> {
    outs.into_iter()
        .map(|out| match out {
            Out::Tensor(t) => be.download(&t),
            Out::Host(v) => Ok(v),
            Out::Operand(i) => be.download(o.act(i)?),
        })
        .collect()
}

/// Values rounded to bf16 (returned as f32).
pub fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
}
