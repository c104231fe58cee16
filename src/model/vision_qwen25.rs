//! The Qwen2.5-VL vision tower: patch embedding (a bias-free Conv3d as a matmul), RMSNorm blocks with a
//! SwiGLU MLP and 2-D rotary attention — windowed (windows of `window_size` pixels) except in the
//! `fullatt_block_indexes` blocks, which attend over the whole frame — and the patch merger.
//!
//! Windowed attention is computed by reordering the merge blocks so that each window is a contiguous
//! run of rows (HF's `window_index`), attending within runs, and restoring the order after merging.
//!
//! Weights (prefix `visual` on the hub, `model.visual` when saved by recent transformers):
//! `patch_embed.proj`, `blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.gate_proj,mlp.up_proj,
//! mlp.down_proj}`, `merger.ln_q`, `merger.mlp.0`, `merger.mlp.2`.

use crate::backend::{Backend, Gelu};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::model::layers::{GeluMlp, Linear, RmsNorm, SwiGlu};
use crate::model::vision::{
    check_grids, frame_seqlens, patch_embed, patch_positions, rotary_tables, vision_prefix, GridThw,
    VisionAttention, VisionConfig, VisionCtx, VisionOutput,
};
use crate::model::weights::Weights;

const RMS_EPS: f32 = 1e-6;

/// RMSNorm → attention (windowed or full) → residual, RMSNorm → SwiGLU MLP → residual.
struct Block<B: Backend> {
    norm1: RmsNorm<B>,
    attn: VisionAttention<B>,
    norm2: RmsNorm<B>,
    mlp: SwiGlu<B>,
}

impl<B: Backend> Block<B> {
    fn load(w: &Weights<B>, cfg: &VisionConfig, full: bool) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(Block {
            norm1: RmsNorm::load(&w.pp("norm1"), d, RMS_EPS)?,
            attn: VisionAttention::load(&w.pp("attn"), cfg, full)?,
            norm2: RmsNorm::load(&w.pp("norm2"), d, RMS_EPS)?,
            mlp: SwiGlu::load(&w.pp("mlp"), d, cfg.intermediate_size, true)?,
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

/// The Qwen2.5-VL vision tower on backend `B`.
pub struct Qwen25VisionTower<B: Backend> {
    cfg: VisionConfig,
    patch_embed: Linear<B>,
    blocks: Vec<Block<B>>,
    ln_q: RmsNorm<B>,
    merger: GeluMlp<B>,
}

/// The window reordering of merge blocks and the window boundaries (in patches).
pub fn window_index(grids: &[GridThw], cfg: &VisionConfig) -> Result<(Vec<usize>, Vec<usize>)> {
    let merge = cfg.spatial_merge_size;
    let ws = cfg.window_size / merge / cfg.patch_size;
    if ws == 0 {
        return Err(Error::InvalidRequest(format!(
            "vision window of {} pixels is smaller than one merged patch",
            cfg.window_size
        )));
    }
    let unit = cfg.merge_unit();
    let (mut index, mut cu) = (Vec::new(), vec![0usize]);
    let mut base = 0;
    for &[t, h, w] in grids {
        let (lh, lw) = (h / merge, w / merge);
        // HF pads up to the next multiple of the window (a full extra window when already aligned);
        // padding contributes no blocks, and empty windows add no boundary.
        let (nwh, nww) = ((lh + ws - lh % ws) / ws, (lw + ws - lw % ws) / ws);
        for f in 0..t {
            for wr in 0..nwh {
                for wc in 0..nww {
                    let before = index.len();
                    for r in wr * ws..((wr + 1) * ws).min(lh) {
                        for c in wc * ws..((wc + 1) * ws).min(lw) {
                            index.push(base + f * lh * lw + r * lw + c);
                        }
                    }
                    let added = index.len() - before;
                    if added > 0 {
                        cu.push(cu.last().copied().unwrap_or(0) + added * unit);
                    }
                }
            }
        }
        base += t * lh * lw;
    }
    Ok((index, cu))
}

impl<B: Backend> Qwen25VisionTower<B> {
    /// Loads and shape-checks the tower's weights.
    pub fn load(be: &B, cfg: &VisionConfig, ckpt: &Checkpoint) -> Result<Self> {
        let w = Weights::new(be, ckpt).pp(vision_prefix(ckpt));
        let (d, merged) = (cfg.hidden_size, cfg.hidden_size * cfg.merge_unit());
        let patch_embed = patch_embed(&w.pp("patch_embed.proj"), cfg, false)?;
        let blocks = (0..cfg.depth)
            .map(|i| Block::load(&w.pp("blocks").pp(i), cfg, cfg.fullatt_block_indexes.contains(&i)))
            .collect::<Result<_>>()?;
        Ok(Qwen25VisionTower {
            patch_embed,
            blocks,
            ln_q: RmsNorm::load(&w.pp("merger.ln_q"), d, RMS_EPS)?,
            merger: GeluMlp::load(
                &w.pp("merger.mlp"),
                ["0", "2"],
                [merged, merged, cfg.out_hidden_size],
                Gelu::Erf,
            )?,
            cfg: cfg.clone(),
        })
    }

    /// Runs the tower on `pixels: [Σ patches, patch_dim]` of the images with grids `grids`.
    pub fn forward(&self, be: &B, pixels: &B::Tensor, grids: &[GridThw]) -> Result<VisionOutput<B::Tensor>> {
        let cfg = &self.cfg;
        let unit = cfg.merge_unit();
        check_grids(grids, cfg.spatial_merge_size)?;
        let (windows, cu_window) = window_index(grids, cfg)?;
        // Patch order inside each window run: the merge blocks in window order, 4 patches each.
        let order: Vec<usize> = windows
            .iter()
            .flat_map(|&b| (0..unit).map(move |i| b * unit + i))
            .collect();
        let positions: Vec<(usize, usize)> = grids
            .iter()
            .flat_map(|&g| patch_positions(g, cfg.spatial_merge_size))
            .collect();
        let positions: Vec<(usize, usize)> = order.iter().map(|&i| positions[i]).collect();
        let (cos, sin) = rotary_tables(&positions, cfg.head_dim(), cfg.rope_theta);
        let cos = be.upload(&cos, positions.len(), cfg.head_dim())?;
        let sin = be.upload(&sin, positions.len(), cfg.head_dim())?;
        let cu_full = frame_seqlens(grids);

        let ctx = VisionCtx {
            be,
            rope: (&cos, &sin),
            cu_full: &cu_full,
            cu_window: &cu_window,
        };
        let mut x = be.gather_rows(&self.patch_embed.forward(be, pixels)?, &order)?;
        for blk in &self.blocks {
            x = blk.forward(x, &ctx)?;
        }
        let n = be.dims(&x).0;
        let h = be.reshape(self.ln_q.forward(be, &x)?, n / unit, cfg.hidden_size * unit)?;
        let merged = self.merger.forward(be, &h)?;
        // Back from window order to the images' block order.
        let mut reverse = vec![0; windows.len()];
        for (pos, &b) in windows.iter().enumerate() {
            reverse[b] = pos;
        }
        Ok(VisionOutput {
            embeds: be.gather_rows(&merged, &reverse)?,
            deepstack: Vec::new(),
        })
    }
}
