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
use crate::error::{Error, Result};
use crate::model::loader::Checkpoint;
use crate::model::vision::{
    check_grids, frame_seqlens, patch_positions, rotary_tables, vision_prefix, weight, BiasedLinear, GridThw,
    Qkv, VisionConfig, VisionOutput,
};

const RMS_EPS: f32 = 1e-6;

struct Block<B: Backend> {
    norm1: B::Weight,
    qkv: Qkv<B>,
    proj: BiasedLinear<B>,
    norm2: B::Weight,
    gate_proj: BiasedLinear<B>,
    up_proj: BiasedLinear<B>,
    down_proj: BiasedLinear<B>,
}

/// The Qwen2.5-VL vision tower on backend `B`.
pub struct Qwen25VisionTower<B: Backend> {
    cfg: VisionConfig,
    patch_embed: B::Weight,
    blocks: Vec<Block<B>>,
    ln_q: B::Weight,
    merger_fc1: BiasedLinear<B>,
    merger_fc2: BiasedLinear<B>,
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
        let p = vision_prefix(ckpt);
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let conv = ckpt.get(&format!("{p}.patch_embed.proj.weight"))?;
        let (c, t, s) = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size);
        conv.expect_shape(&[d, c, t, s, s])?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let b = format!("{p}.blocks.{i}");
                Ok(Block {
                    norm1: weight(be, ckpt, &format!("{b}.norm1.weight"), &[d])?,
                    qkv: Qkv::load(be, ckpt, &format!("{b}.attn.qkv"), d)?,
                    proj: BiasedLinear::load(be, ckpt, &format!("{b}.attn.proj"), d, d)?,
                    norm2: weight(be, ckpt, &format!("{b}.norm2.weight"), &[d])?,
                    gate_proj: BiasedLinear::load(be, ckpt, &format!("{b}.mlp.gate_proj"), inter, d)?,
                    up_proj: BiasedLinear::load(be, ckpt, &format!("{b}.mlp.up_proj"), inter, d)?,
                    down_proj: BiasedLinear::load(be, ckpt, &format!("{b}.mlp.down_proj"), d, inter)?,
                })
            })
            .collect::<Result<_>>()?;
        let merged = d * cfg.merge_unit();
        Ok(Qwen25VisionTower {
            patch_embed: be.load_weight(&conv.reshaped(&[d, cfg.patch_dim()])?)?,
            blocks,
            ln_q: weight(be, ckpt, &format!("{p}.merger.ln_q.weight"), &[d])?,
            merger_fc1: BiasedLinear::load(be, ckpt, &format!("{p}.merger.mlp.0"), merged, merged)?,
            merger_fc2: BiasedLinear::load(
                be,
                ckpt,
                &format!("{p}.merger.mlp.2"),
                cfg.out_hidden_size,
                merged,
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

        let mut x = be.gather_rows(&be.linear(pixels, &self.patch_embed, None)?, &order)?;
        for (i, blk) in self.blocks.iter().enumerate() {
            let cu = if cfg.fullatt_block_indexes.contains(&i) {
                &cu_full
            } else {
                &cu_window
            };
            let h = be.rms_norm(&x, &blk.norm1, RMS_EPS)?;
            let a = blk.qkv.attend(be, &h, (&cos, &sin), cfg.num_heads, cu)?;
            x = be.add(&x, &blk.proj.forward(be, &a)?)?;
            let h = be.rms_norm(&x, &blk.norm2, RMS_EPS)?;
            let g = be.silu_mul(&blk.gate_proj.forward(be, &h)?, &blk.up_proj.forward(be, &h)?)?;
            x = be.add(&x, &blk.down_proj.forward(be, &g)?)?;
        }
        let n = be.dims(&x).0;
        let h = be.reshape(
            be.rms_norm(&x, &self.ln_q, RMS_EPS)?,
            n / unit,
            cfg.hidden_size * unit,
        )?;
        let merged = self
            .merger_fc2
            .forward(be, &be.gelu(&self.merger_fc1.forward(be, &h)?, Gelu::Erf)?)?;
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
