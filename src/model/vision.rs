//! What the two Qwen-VL vision towers share: their configuration, the patch order, the 2-D rotary
//! tables and the attention segments. The towers themselves are `vision_qwen3.rs` and
//! `vision_qwen25.rs`.
//!
//! Patches arrive in HF's order: per image, per frame, blocks of `merge × merge` neighbouring patches
//! (block rows, then block columns, then the patches inside a block row by row). Four consecutive
//! rows therefore merge into one LLM token.

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
pub use crate::model::config::VisionConfig;
use crate::model::layers::Linear;
use crate::model::weights::Weights;

/// Patch grid of one image: frames × rows × columns of patches.
pub type GridThw = [usize; 3];

/// The (row, column) of every patch, in HF's merge-block order, frames repeated.
pub fn patch_positions(grid: GridThw, merge: usize) -> Vec<(usize, usize)> {
    let [t, h, w] = grid;
    let mut out = Vec::with_capacity(t * h * w);
    for _ in 0..t {
        for br in 0..h / merge {
            for bc in 0..w / merge {
                for ir in 0..merge {
                    for ic in 0..merge {
                        out.push((br * merge + ir, bc * merge + ic));
                    }
                }
            }
        }
    }
    out
}

/// cos/sin tables `[n, head_dim]` of the axial 2-D rotary embedding: a quarter of the head's
/// frequencies rotate by the row, a quarter by the column, and the halves repeat (`rotate_half`).
pub fn rotary_tables(positions: &[(usize, usize)], head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let spatial = head_dim / 2;
    let inv_freq: Vec<f32> = (0..spatial / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / spatial as f32))
        .collect();
    let q = inv_freq.len();
    let mut cos = vec![0f32; positions.len() * head_dim];
    let mut sin = vec![0f32; positions.len() * head_dim];
    for (r, &(h, w)) in positions.iter().enumerate() {
        for (j, f) in inv_freq.iter().enumerate() {
            for (slot, p) in [(j, h), (q + j, w)] {
                let (s, c) = (p as f32 * f).sin_cos();
                for off in [0, spatial] {
                    cos[r * head_dim + off + slot] = c;
                    sin[r * head_dim + off + slot] = s;
                }
            }
        }
    }
    (cos, sin)
}

/// Boundaries of full-attention segments: one per frame of every image.
pub fn frame_seqlens(grids: &[GridThw]) -> Vec<usize> {
    let mut cu = vec![0];
    for &[t, h, w] in grids {
        for _ in 0..t {
            cu.push(cu.last().copied().unwrap_or(0) + h * w);
        }
    }
    cu
}

/// Checks that every grid splits into whole merge blocks.
pub fn check_grids(grids: &[GridThw], merge: usize) -> Result<()> {
    for (i, &[t, h, w]) in grids.iter().enumerate() {
        if t == 0 || h == 0 || w == 0 || h % merge != 0 || w % merge != 0 {
            return Err(Error::InvalidRequest(format!(
                "image {i}: grid [{t}, {h}, {w}] does not split into {merge}x{merge} merge blocks"
            )));
        }
    }
    Ok(())
}

/// Output of a vision tower for a batch of images.
pub struct VisionOutput<T> {
    /// Merged tokens of all images, in order: `[Σ t·h·w / merge², out_hidden]`.
    pub embeds: T,
    /// Qwen3-VL deepstack features, one tensor shaped like `embeds` per deepstack layer.
    pub deepstack: Vec<T>,
}

/// Where the vision weights live: `model.visual` (Qwen3-VL, and Qwen2.5-VL saved by recent
/// transformers) or `visual` (the Qwen2.5-VL hub checkpoints).
pub(crate) fn vision_prefix(ckpt: &Checkpoint) -> &'static str {
    if ckpt.contains("visual.patch_embed.proj.weight") {
        "visual"
    } else {
        "model.visual"
    }
}

/// The patch embedding: a Conv3d whose stride equals its kernel, read as the matrix
/// `[hidden, c·t·p·p]` (a view of the checkpoint's `[hidden, c, t, p, p]` kernel, no copy).
pub(crate) fn patch_embed<B: Backend>(w: &Weights<B>, cfg: &VisionConfig, bias: bool) -> Result<Linear<B>> {
    let (d, c, t, s) = (
        cfg.hidden_size,
        cfg.in_channels,
        cfg.temporal_patch_size,
        cfg.patch_size,
    );
    let conv = w.tensor("weight", &[d, c, t, s, s])?;
    Ok(Linear {
        weight: w.backend().load_weight(&conv.reshaped(&[d, cfg.patch_dim()])?)?,
        bias: if bias { Some(w.get("bias", &[d])?) } else { None },
    })
}

/// What every block of one vision forward shares.
pub(crate) struct VisionCtx<'a, B: Backend> {
    pub be: &'a B,
    /// The 2-D rotary cos/sin tables of the rows, `[rows, head_dim]`.
    pub rope: (&'a B::Tensor, &'a B::Tensor),
    /// Segments of full attention (one per frame).
    pub cu_full: &'a [usize],
    /// Segments of windowed attention (Qwen2.5-VL; the same as `cu_full` elsewhere).
    pub cu_window: &'a [usize],
}

/// Rotary self-attention within segments: the checkpoint's fused `qkv` `[3·d, d]` runs as one GEMM
/// whose output is split into q, k and v; `proj` `[d, d]` after.
pub(crate) struct VisionAttention<B: Backend> {
    qkv: Linear<B>,
    proj: Linear<B>,
    heads: usize,
    /// Attends over the whole frame rather than within windows.
    full: bool,
}

impl<B: Backend> VisionAttention<B> {
    /// Loads `qkv` and `proj` under `w` (the block's `attn`).
    pub(crate) fn load(w: &Weights<B>, cfg: &VisionConfig, full: bool) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(VisionAttention {
            qkv: Linear::load(&w.pp("qkv"), 3 * d, d, true)?,
            proj: Linear::load(&w.pp("proj"), d, d, true)?,
            heads: cfg.num_heads,
            full,
        })
    }

    /// `h`: the normed rows; returns `proj` of the attention output.
    pub(crate) fn forward(&self, h: &B::Tensor, ctx: &VisionCtx<'_, B>) -> Result<B::Tensor> {
        let be = ctx.be;
        let (cos, sin) = ctx.rope;
        let [q, k, v]: [B::Tensor; 3] =
            be.split_cols(self.qkv.forward(be, h)?, 3)?
                .try_into()
                .map_err(|parts: Vec<_>| Error::Shape {
                    op: "split_cols".into(),
                    message: format!("qkv split into {} parts, not 3", parts.len()),
                })?;
        let (q, k) = (be.rope_owned(q, cos, sin)?, be.rope_owned(k, cos, sin)?);
        let cu = if self.full { ctx.cu_full } else { ctx.cu_window };
        let a = be.attention_segments(&q, &k, &v, self.heads, cu)?;
        self.proj.forward(be, &a)
    }
}
