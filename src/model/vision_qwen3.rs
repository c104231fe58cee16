//! The Qwen3-VL vision tower: patch embedding (a Conv3d with stride = kernel, i.e. a matmul), a learned
//! position grid resampled bilinearly to each image, 2-D rotary attention per frame in LayerNorm
//! blocks with a gelu-tanh MLP, the patch merger (2×2 patches → one token), and the deepstack mergers
//! whose outputs are added to the first decoder layers' hidden states.
//!
//! Weights (prefix `model.visual`): `patch_embed.proj`, `pos_embed`, `blocks.{i}.{norm1,norm2,attn.qkv,
//! attn.proj,mlp.linear_fc1,mlp.linear_fc2}`, `merger.{norm,linear_fc1,linear_fc2}`,
//! `deepstack_merger_list.{j}.{norm,linear_fc1,linear_fc2}`.

use crate::backend::{Backend, Gelu};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::model::layers::{GeluMlp, LayerNorm, Linear};
use crate::model::vision::{
    check_grids, frame_seqlens, patch_embed, patch_positions, rotary_tables, vision_prefix, GridThw,
    VisionAttention, VisionConfig, VisionCtx, VisionOutput,
};
use crate::model::weights::Weights;

const LN_EPS: f32 = 1e-6;

/// LayerNorm → attention → residual, LayerNorm → gelu-tanh MLP → residual.
struct Block<B: Backend> {
    norm1: LayerNorm<B>,
    attn: VisionAttention<B>,
    norm2: LayerNorm<B>,
    mlp: GeluMlp<B>,
}

impl<B: Backend> Block<B> {
    fn load(w: &Weights<B>, cfg: &VisionConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(Block {
            norm1: LayerNorm::load(&w.pp("norm1"), d, LN_EPS)?,
            attn: VisionAttention::load(&w.pp("attn"), cfg, true)?,
            norm2: LayerNorm::load(&w.pp("norm2"), d, LN_EPS)?,
            mlp: GeluMlp::load(
                &w.pp("mlp"),
                ["linear_fc1", "linear_fc2"],
                [d, cfg.intermediate_size, d],
                Gelu::Tanh,
            )?,
        })
    }

    fn forward(&self, x: B::Tensor, ctx: &VisionCtx<'_, B>) -> Result<B::Tensor> {
        let be = ctx.be;
        let a = self.attn.forward(&self.norm1.forward(be, &x)?, ctx)?;
        let x = be.add_owned(x, &a)?;
        let h = self.mlp.forward(be, &self.norm2.forward(be, &x)?)?;
        be.add_owned(x, &h)
    }
}

/// Merges 2×2 patches into one token: LayerNorm (before the shuffle for the main merger, after it
/// for the deepstack mergers) → Linear → GELU(erf) → Linear.
struct PatchMerger<B: Backend> {
    norm: LayerNorm<B>,
    postshuffle_norm: bool,
    mlp: GeluMlp<B>,
}

impl<B: Backend> PatchMerger<B> {
    fn load(w: &Weights<B>, cfg: &VisionConfig, postshuffle: bool) -> Result<Self> {
        let merged = cfg.hidden_size * cfg.merge_unit();
        let norm_dim = if postshuffle { merged } else { cfg.hidden_size };
        Ok(PatchMerger {
            norm: LayerNorm::load(&w.pp("norm"), norm_dim, LN_EPS)?,
            postshuffle_norm: postshuffle,
            mlp: GeluMlp::load(
                w,
                ["linear_fc1", "linear_fc2"],
                [merged, merged, cfg.out_hidden_size],
                Gelu::Erf,
            )?,
        })
    }

    fn forward(&self, be: &B, x: &B::Tensor, unit: usize) -> Result<B::Tensor> {
        let (n, d) = be.dims(x);
        let x = if self.postshuffle_norm {
            self.norm
                .forward(be, &be.reshape(be.rows(x, 0, n)?, n / unit, d * unit)?)?
        } else {
            be.reshape(self.norm.forward(be, x)?, n / unit, d * unit)?
        };
        self.mlp.forward(be, &x)
    }
}

/// The Qwen3-VL vision tower on backend `B`.
pub struct Qwen3VisionTower<B: Backend> {
    cfg: VisionConfig,
    patch_embed: Linear<B>,
    pos_embed: B::Weight,
    blocks: Vec<Block<B>>,
    merger: PatchMerger<B>,
    deepstack_mergers: Vec<PatchMerger<B>>,
}

impl<B: Backend> Qwen3VisionTower<B> {
    /// Loads and shape-checks the tower's weights.
    pub fn load(be: &B, cfg: &VisionConfig, ckpt: &Checkpoint) -> Result<Self> {
        let w = Weights::new(be, ckpt).pp(vision_prefix(ckpt));
        let patch_embed = patch_embed(&w.pp("patch_embed.proj"), cfg, true)?;
        let blocks = (0..cfg.depth)
            .map(|i| Block::load(&w.pp("blocks").pp(i), cfg))
            .collect::<Result<_>>()?;
        let deepstack_mergers = (0..cfg.deepstack_visual_indexes.len())
            .map(|j| PatchMerger::load(&w.pp("deepstack_merger_list").pp(j), cfg, true))
            .collect::<Result<_>>()?;
        Ok(Qwen3VisionTower {
            pos_embed: w.get(
                "pos_embed.weight",
                &[cfg.num_position_embeddings, cfg.hidden_size],
            )?,
            merger: PatchMerger::load(&w.pp("merger"), cfg, false)?,
            cfg: cfg.clone(),
            patch_embed,
            blocks,
            deepstack_mergers,
        })
    }

    /// Runs the tower on `pixels: [Σ patches, patch_dim]` of the images with grids `grids`.
    pub fn forward(&self, be: &B, pixels: &B::Tensor, grids: &[GridThw]) -> Result<VisionOutput<B::Tensor>> {
        let cfg = &self.cfg;
        let merge = cfg.spatial_merge_size;
        check_grids(grids, merge)?;
        let positions: Vec<(usize, usize)> = grids.iter().flat_map(|&g| patch_positions(g, merge)).collect();
        let (indices, weights) = self.pos_interpolation(grids);
        let pos = be.weighted_embedding(&self.pos_embed, &indices, &weights, 4)?;
        let mut x = be.add_owned(self.patch_embed.forward(be, pixels)?, &pos)?;
        let (cos, sin) = rotary_tables(&positions, cfg.head_dim(), cfg.rope_theta);
        let cos = be.upload(&cos, positions.len(), cfg.head_dim())?;
        let sin = be.upload(&sin, positions.len(), cfg.head_dim())?;
        let cu = frame_seqlens(grids);
        let ctx = VisionCtx {
            be,
            rope: (&cos, &sin),
            cu_full: &cu,
            cu_window: &cu,
        };
        let mut deepstack = Vec::new();
        for (i, blk) in self.blocks.iter().enumerate() {
            x = blk.forward(x, &ctx)?;
            if let Some(j) = cfg.deepstack_visual_indexes.iter().position(|&k| k == i) {
                deepstack.push(self.deepstack_mergers[j].forward(be, &x, cfg.merge_unit())?);
            }
        }
        Ok(VisionOutput {
            embeds: self.merger.forward(be, &x, cfg.merge_unit())?,
            deepstack,
        })
    }

    /// Bilinear (align_corners) taps into the square learned position grid for every patch, in
    /// merge-block order: 4 indices and weights per patch.
    fn pos_interpolation(&self, grids: &[GridThw]) -> (Vec<u32>, Vec<f32>) {
        let side = (self.cfg.num_position_embeddings as f64).sqrt() as usize;
        let axis = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            let f = floor as usize;
            let w1 = (1.0 - (src - floor - 1.0).abs()).max(0.0);
            let w0 = (1.0 - (src - floor).abs()).max(0.0);
            [(f.min(side - 1), w0), ((f + 1).min(side - 1), w1)]
        };
        let (mut indices, mut weights) = (Vec::new(), Vec::new());
        for &[t, h, w] in grids {
            for (r, c) in patch_positions([t, h, w], self.cfg.spatial_merge_size) {
                for (hi, hw) in axis(r, h) {
                    for (wi, ww) in axis(c, w) {
                        indices.push((hi * side + wi) as u32);
                        weights.push(hw * ww);
                    }
                }
            }
        }
        (indices, weights)
    }
}
