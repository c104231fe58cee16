//! Decode attention v2 (`kernels/decode_attention.cu`): split-K paged attention for batches of decode
//! rows (one new token per sequence), tuned for long contexts.
//!
//! One block of 4 warps per (row, kv head, split) serves every q head of the GQA group on tensor cores
//! (`mma.sync` m16n8k16 bf16, f32 accumulation), so each K/V element is read from global memory once per
//! group, with 16-byte loads that use whole 32-byte sectors. Each row cuts its context into
//! `ceil(context / CHUNK)` splits (at most [`MAX_SPLITS`]) from its own context only; the block merges
//! its warps in shared memory and writes one f32 `(acc, m, l)` partial per (row, q head, split) in the
//! layout of the v1 kernels, which `attn_combine_v1` merges into the bf16 output. Inside a recorded CUDA
//! graph step the grid is always [`MAX_SPLITS`] splits wide (splits past a row's context write an empty
//! partial), so a replay stays valid as contexts grow.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use xxhash_rust::xxh64::Xxh64;

use super::graph;
use super::params::{params, CombineParams, Traced};
use super::{to_i32, CudaBackend, CudaTensor};
use crate::backend::check;
use crate::backend::{AttnShape, PagedSeq};
use crate::error::Result;

/// Target keys per split: a row uses `ceil(context / CHUNK)` splits, at most [`MAX_SPLITS`].
const CHUNK: usize = 128;
/// Most splits of one row (the grid's y extent inside a recorded step).
const MAX_SPLITS: usize = 64;
/// Threads per block (4 warps).
const THREADS: u32 = 128;
/// Keys per warp tile; the pool block size must be a multiple of it.
const TILE: usize = 16;
/// Warps per block of `attn_combine_v1` (one (row, q head) each).
const COMBINE_WARPS: usize = 4;

params! {
    /// decode_attention.cu: paged_decode_v2_d{64,128}[_g16].
    DecodeV2Params {
        q: u64, k: u64, v: u64, row_visible: u64, row_table: u64, tables: u64, part: u64,
        rows: i32, q_heads: i32, kv_heads: i32, block_size: i32, splits: i32, chunk: i32,
        scale_log2: f32,
    }
}

/// The kernel for a shape, or `None` when v2 does not cover it: head_dim 64 or 128, at most 16 q heads
/// per kv head (up to 8 on the m8 variant), a block size that is a multiple of 16.
fn kernel_for(s: AttnShape) -> Option<&'static str> {
    if s.kv_heads == 0
        || !s.q_heads.is_multiple_of(s.kv_heads)
        || s.block_size == 0
        || !s.block_size.is_multiple_of(TILE)
    {
        return None;
    }
    let group = s.q_heads / s.kv_heads;
    match (s.head_dim, group) {
        (_, 0) | (_, 17..) => None,
        (128, 1..=8) => Some("paged_decode_v2_d128"),
        (128, _) => Some("paged_decode_v2_d128_g16"),
        (64, 1..=8) => Some("paged_decode_v2_d64"),
        (64, _) => Some("paged_decode_v2_d64_g16"),
        _ => None,
    }
}

impl CudaBackend {
    /// Decode attention v2: the same semantics as
    /// [`Backend::paged_attention`](crate::backend::Backend::paged_attention) for a batch in which every
    /// sequence has exactly one new row (that row attends to all `context_len` keys of its sequence;
    /// q head `h` reads kv head `h / (q_heads / kv_heads)`).
    ///
    /// Arguments are validated as for `paged_attention` (malformed calls are errors). Returns
    /// `Ok(None)`, launching nothing, when v2 does not cover the call, and the caller then uses v1: a
    /// sequence with `rows != 1` (prefill, chunked prefill) or no sequences; head_dim other than 64 or
    /// 128; more than 16 q heads per kv head; a block size that is not a multiple of 16; a tensor not
    /// 16-byte aligned. A row's result depends only on its own q, keys and context length, never on the
    /// other rows of the batch or on whether the call runs inside a recorded step (fixed reduction order).
    pub fn paged_decode_v2(
        &self,
        q: &CudaTensor,
        k_pool: &CudaTensor,
        v_pool: &CudaTensor,
        shape: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<Option<CudaTensor>> {
        let dims = |x: &CudaTensor| (x.rows, x.cols);
        check::paged_attention(dims(q), dims(k_pool), dims(v_pool), shape, seqs)?;
        if seqs.is_empty() || seqs.iter().any(|s| s.rows != 1) {
            return Ok(None);
        }
        let Some(kernel) = kernel_for(shape) else {
            return Ok(None);
        };
        if [q.ptr(), k_pool.ptr(), v_pool.ptr()].iter().any(|p| p % 16 != 0) {
            return Ok(None);
        }
        let op = "paged_attention";
        let rows = seqs.len();
        // Every index the kernel forms in 32 bits must fit: grid.x, contexts (plus a tile), offsets.
        to_i32(op, rows * shape.kv_heads)?;
        to_i32(op, rows * shape.q_heads)?;
        let max_context = seqs.iter().map(|s| s.context_len).max().unwrap_or(1);
        to_i32(op, max_context + TILE)?;
        let (mut visible, mut table_start, mut tables) =
            (Vec::with_capacity(rows), Vec::with_capacity(rows), Vec::new());
        for s in seqs {
            visible.push(s.context_len as u32);
            table_start.push(to_i32(op, tables.len())? as u32);
            tables.extend_from_slice(s.block_table);
        }
        // Each row uses min(splits, ceil(context / CHUNK)) splits; the grid covers the largest, or all
        // MAX_SPLITS inside a recorded step (the grid must not depend on context lengths there).
        let recording = self.steps()?.mode != graph::Mode::Direct;
        let splits = if recording {
            MAX_SPLITS
        } else {
            max_context.div_ceil(CHUNK).clamp(1, MAX_SPLITS)
        };
        let d = shape.head_dim;
        let items = rows * shape.q_heads;
        let out = self.alloc_tensor(rows, shape.q_heads * d)?;
        // Every (item, split) gets its m and l written (acc too where l > 0, the only ones read).
        let part = self.alloc_bytes(4 * items * splits * (d + 2))?;
        let (visible, table_start) = (self.stage(&visible)?, self.stage(&table_start)?);
        let tables = self.stage(&tables)?;
        let p = DecodeV2Params {
            q: q.ptr(),
            k: k_pool.ptr(),
            v: v_pool.ptr(),
            row_visible: visible.ptr(),
            row_table: table_start.ptr(),
            tables: tables.ptr(),
            part: part.ptr,
            rows: rows as i32,
            q_heads: shape.q_heads as i32,
            kv_heads: shape.kv_heads as i32,
            block_size: to_i32(op, shape.block_size)?,
            splits: splits as i32,
            chunk: CHUNK as i32,
            scale_log2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
        };
        let cfg = LaunchConfig {
            grid_dim: ((rows * shape.kv_heads) as u32, splits as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(kernel, cfg, p)?;
        let c = CombineParams {
            part: part.ptr,
            out: out.ptr(),
            items: items as i32,
            splits: splits as i32,
            d: d as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (items.div_ceil(COMBINE_WARPS) as u32, 1, 1),
            block_dim: (32 * COMBINE_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("attn_combine_v1", cfg, c)?;
        Ok(Some(out))
    }
}
