//! What the two Qwen-VL vision towers share: their configuration, the patch order, the 2-D rotary
//! tables and the attention segments. The towers themselves are `vision_qwen3.rs` and
//! `vision_qwen25.rs`.
//!
//! Patches arrive in HF's order: per image, per frame, blocks of `merge × merge` neighbouring patches
//! (block rows, then block columns, then the patches inside a block row by row). Four consecutive
//! rows therefore merge into one LLM token.

use std::path::Path;

use serde_json::Value;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::config::Family;
use crate::model::loader::Checkpoint;

/// Settings of a vision tower (`vision_config` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// Width of the merged tokens (the decoder's hidden size).
    pub out_hidden_size: usize,
    pub rope_theta: f32,
    /// Qwen3-VL: side² of the learned position-embedding grid.
    pub num_position_embeddings: usize,
    /// Qwen3-VL: blocks whose output also feeds a deepstack merger.
    pub deepstack_visual_indexes: Vec<usize>,
    /// Qwen2.5-VL: window side in pixels.
    pub window_size: usize,
    /// Qwen2.5-VL: blocks with full (not windowed) attention.
    pub fullatt_block_indexes: Vec<usize>,
}

impl VisionConfig {
    /// Parses `vision_config` of the document at `path`.
    pub fn parse(v: &Value, family: Family, path: &Path) -> Result<Self> {
        let field = |k: &str| format!("vision_config.{k}");
        let get = |k: &str| v.get(k).filter(|x| !x.is_null());
        let uint = |keys: &[&str], default: Option<usize>| -> Result<usize> {
            for k in keys {
                if let Some(x) = get(k) {
                    return x.as_u64().map(|n| n as usize).ok_or_else(|| {
                        Error::json(
                            path,
                            field(k),
                            format!("expected a non-negative integer, found {x}"),
                        )
                    });
                }
            }
            default.ok_or_else(|| Error::json(path, field(keys[0]), "missing"))
        };
        let list = |k: &str| -> Result<Vec<usize>> {
            match get(k) {
                None => Ok(Vec::new()),
                Some(x) => x
                    .as_array()
                    .and_then(|a| a.iter().map(|n| n.as_u64().map(|n| n as usize)).collect())
                    .ok_or_else(|| {
                        Error::json(path, field(k), format!("expected a list of integers, found {x}"))
                    }),
            }
        };
        let rope_theta = match get("rope_parameters").and_then(|r| r.get("rope_theta")) {
            Some(t) => t
                .as_f64()
                .ok_or_else(|| Error::json(path, field("rope_parameters.rope_theta"), "not a number"))?
                as f32,
            None => 10_000.0,
        };
        let qwen3 = family == Family::Qwen3Vl;
        let cfg = VisionConfig {
            depth: uint(&["depth"], None)?,
            hidden_size: uint(&["hidden_size", "embed_dim"], None)?,
            intermediate_size: uint(&["intermediate_size"], None)?,
            num_heads: uint(&["num_heads"], None)?,
            in_channels: uint(&["in_channels", "in_chans"], Some(3))?,
            patch_size: uint(
                &["patch_size", "spatial_patch_size"],
                Some(if qwen3 { 16 } else { 14 }),
            )?,
            temporal_patch_size: uint(&["temporal_patch_size"], Some(2))?,
            spatial_merge_size: uint(&["spatial_merge_size"], Some(2))?,
            out_hidden_size: uint(&["out_hidden_size"], None)?,
            rope_theta,
            num_position_embeddings: uint(&["num_position_embeddings"], Some(if qwen3 { 2304 } else { 0 }))?,
            deepstack_visual_indexes: list("deepstack_visual_indexes")?,
            window_size: uint(&["window_size"], Some(if qwen3 { 0 } else { 112 }))?,
            fullatt_block_indexes: list("fullatt_block_indexes")?,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |k: &str, msg: String| Err(Error::json(path, format!("vision_config.{k}"), msg));
        if self.num_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_heads)
            || !(self.hidden_size / self.num_heads).is_multiple_of(4)
        {
            return bad(
                "num_heads",
                format!(
                    "{} heads do not split hidden_size {} into a multiple of 4",
                    self.num_heads, self.hidden_size
                ),
            );
        }
        if self.spatial_merge_size == 0 || self.patch_size == 0 {
            return bad(
                "spatial_merge_size",
                "patch and merge sizes must be positive".into(),
            );
        }
        if let Some(&i) = self
            .deepstack_visual_indexes
            .iter()
            .chain(&self.fullatt_block_indexes)
            .find(|&&i| i >= self.depth)
        {
            return bad(
                "deepstack_visual_indexes",
                format!("block {i} is beyond depth {}", self.depth),
            );
        }
        let side = (self.num_position_embeddings as f64).sqrt() as usize;
        if self.num_position_embeddings > 0 && side * side != self.num_position_embeddings {
            return bad(
                "num_position_embeddings",
                format!("{} is not a square", self.num_position_embeddings),
            );
        }
        Ok(())
    }

    /// Head dimension of the vision attention.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Length of one flattened patch: channels × temporal × patch × patch.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches that merge into one LLM token.
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

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

/// Loads a weight after checking its shape.
pub(crate) fn weight<B: Backend>(
    be: &B,
    ckpt: &Checkpoint,
    name: &str,
    shape: &[usize],
) -> Result<B::Weight> {
    let t = ckpt.get(name)?;
    t.expect_shape(shape)?;
    be.load_weight(t)
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

/// A fused `[3·d, d]` qkv projection split into three views (no copy), with biases.
pub(crate) struct Qkv<B: Backend> {
    pub q: (B::Weight, B::Weight),
    pub k: (B::Weight, B::Weight),
    pub v: (B::Weight, B::Weight),
}

impl<B: Backend> Qkv<B> {
    pub(crate) fn load(be: &B, ckpt: &Checkpoint, prefix: &str, d: usize) -> Result<Self> {
        let w = ckpt.get(&format!("{prefix}.weight"))?;
        w.expect_shape(&[3 * d, d])?;
        let b = ckpt.get(&format!("{prefix}.bias"))?;
        b.expect_shape(&[3 * d])?;
        let part = |i: usize| -> Result<(B::Weight, B::Weight)> {
            Ok((
                be.load_weight(&w.slice_rows(i * d, d)?)?,
                be.load_weight(&b.slice_rows(i * d, d)?)?,
            ))
        };
        Ok(Qkv {
            q: part(0)?,
            k: part(1)?,
            v: part(2)?,
        })
    }

    /// Projects, rotates q and k, and attends within the segments `cu`.
    pub(crate) fn attend(
        &self,
        be: &B,
        h: &B::Tensor,
        (cos, sin): (&B::Tensor, &B::Tensor),
        heads: usize,
        cu: &[usize],
    ) -> Result<B::Tensor> {
        let q = be.rope(&be.linear(h, &self.q.0, Some(&self.q.1))?, cos, sin)?;
        let k = be.rope(&be.linear(h, &self.k.0, Some(&self.k.1))?, cos, sin)?;
        let v = be.linear(h, &self.v.0, Some(&self.v.1))?;
        be.attention_segments(&q, &k, &v, heads, cu)
    }
}

/// A linear layer with a bias.
pub(crate) struct BiasedLinear<B: Backend> {
    pub weight: B::Weight,
    pub bias: B::Weight,
}

impl<B: Backend> BiasedLinear<B> {
    pub(crate) fn load(be: &B, ckpt: &Checkpoint, prefix: &str, out: usize, inp: usize) -> Result<Self> {
        Ok(BiasedLinear {
            weight: weight(be, ckpt, &format!("{prefix}.weight"), &[out, inp])?,
            bias: weight(be, ckpt, &format!("{prefix}.bias"), &[out])?,
        })
    }

    pub(crate) fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.weight, Some(&self.bias))
    }
}
