//! The v1 attention kernels (`kernels/attention.cu`): one warp per (row, head), online softmax over
//! paged keys (causal, GQA; split-K for pure decode calls, merged by `attn_combine_v1`) and over
//! contiguous segments (non-causal, the vision towers).
//!
//! They are the fallback of [`Backend::paged_attention`](crate::backend::Backend::paged_attention)
//! and [`Backend::attention_segments`](crate::backend::Backend::attention_segments) wherever the
//! tensor-core kernels decline (unaligned operands, head dims they do not instantiate, a GPU that
//! cannot give the flash kernels their shared memory) and the only kernels under `RECALL_ATTN=v1`.
//! Because the trait ops reach the newer kernels for every common shape, tests call
//! [`CudaBackend::paged_attention_v1`] and [`CudaBackend::attention_segments_v1`] directly: otherwise
//! the fallback would run in no test at all.

use std::sync::atomic::Ordering;

use cudarc::driver::LaunchConfig;

use super::graph::Mode;
use super::params::{CombineParams, PagedAttnParams, SegAttnParams};
use super::{to_i32, CudaBackend, CudaTensor};
use crate::backend::check::{self, shape_err};
use crate::backend::{AttnShape, PagedSeq};
use crate::error::Result;

/// Keys per split of split-K decode attention.
const DECODE_CHUNK: usize = 256;
/// Most splits of one decode row.
const MAX_SPLITS: usize = 64;
/// Largest head dimension the v1 attention kernels hold in registers (4 per lane).
pub(super) const MAX_HEAD_DIM: usize = 128;
/// Warps per block of the attention kernels (one (row, head) each).
const ATTN_WARPS: u32 = 4;

fn grid_warps(items: usize, splits: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(ATTN_WARPS as usize) as u32, splits as u32, 1),
        block_dim: (32 * ATTN_WARPS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The trait op's argument checks plus the v1 kernels' head-dim limit (every attention path applies
/// them, so a call is accepted or refused whichever kernel would run it).
pub(super) fn check_paged(
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    s: AttnShape,
    seqs: &[PagedSeq<'_>],
) -> Result<()> {
    check::paged_attention((q.rows, q.cols), (k.rows, k.cols), (v.rows, v.cols), s, seqs)?;
    if s.head_dim == 0 || s.head_dim > MAX_HEAD_DIM {
        return Err(shape_err(
            "paged_attention",
            format!("head_dim {} (at most {MAX_HEAD_DIM})", s.head_dim),
        ));
    }
    Ok(())
}

/// As [`check_paged`] for `attention_segments`.
pub(super) fn check_segments(
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    heads: usize,
    cu_seqlens: &[usize],
) -> Result<()> {
    let dims = |x: &CudaTensor| (x.rows, x.cols);
    check::attention_segments(dims(q), dims(k), dims(v), heads, cu_seqlens)?;
    if q.cols / heads > MAX_HEAD_DIM {
        return Err(shape_err(
            "attention_segments",
            format!("head_dim {} (at most {MAX_HEAD_DIM})", q.cols / heads),
        ));
    }
    Ok(())
}

/// Per-row metadata of a paged call: each row's sequence and visible keys, each sequence's offset
/// into the concatenated block tables.
struct RowMeta {
    row_seq: Vec<u32>,
    row_visible: Vec<u32>,
    table_start: Vec<u32>,
    tables: Vec<u32>,
}

fn row_meta(seqs: &[PagedSeq<'_>]) -> RowMeta {
    let mut m = RowMeta {
        row_seq: vec![],
        row_visible: vec![],
        table_start: vec![],
        tables: vec![],
    };
    for (i, seq) in seqs.iter().enumerate() {
        m.table_start.push(m.tables.len() as u32);
        m.tables.extend_from_slice(seq.block_table);
        let first = seq.context_len - seq.rows;
        for r in 0..seq.rows {
            m.row_seq.push(i as u32);
            m.row_visible.push((first + r + 1) as u32);
        }
    }
    m
}

impl CudaBackend {
    /// `RECALL_ATTN=v1` at run time: when on, the trait's attention ops use only the v1 kernels (a
    /// mixed prefill + decode call is still split so that its decode rows get split-K, as in a pure
    /// decode step). Lets a test, or a bisection on a device, compare the fallback end to end.
    pub fn set_attention_v1_only(&self, on: bool) {
        self.attn_v1_only.store(on, Ordering::Relaxed);
    }

    /// Whether the attention ops use only the v1 kernels.
    pub fn attention_v1_only(&self) -> bool {
        self.attn_v1_only.load(Ordering::Relaxed)
    }

    /// [`Backend::paged_attention`](crate::backend::Backend::paged_attention) on the v1 kernel,
    /// whatever the shape: split-K (then `attn_combine_v1`) when every sequence has one new row,
    /// one pass per row otherwise. The same checks and errors as the trait op.
    pub fn paged_attention_v1(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        s: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<CudaTensor> {
        check_paged(q, k, v, s, seqs)?;
        self.launch_paged_v1(q, k, v, s, seqs)
    }

    /// [`Backend::attention_segments`](crate::backend::Backend::attention_segments) on the v1 kernel,
    /// whatever the shape. The same checks and errors as the trait op.
    pub fn attention_segments_v1(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<CudaTensor> {
        check_segments(q, k, v, heads, cu_seqlens)?;
        self.launch_segments_v1(q, k, v, heads, cu_seqlens)
    }

    /// Splits of each decode row's keys: 1 for prefill rows; in a decode call each row picks its own
    /// count from its own context (ceil(visible / DECODE_CHUNK), at most MAX_SPLITS), so its result
    /// never depends on the other rows, and the grid only has to cover the largest. Inside a recorded
    /// step the grid is always MAX_SPLITS wide, so a replay stays valid as contexts grow (idle splits
    /// exit at once).
    fn v1_splits(&self, decode: bool, max_visible: usize) -> Result<usize> {
        let recording = self.steps()?.mode != Mode::Direct;
        Ok(match (decode, recording) {
            (false, _) => 1,
            (true, true) => MAX_SPLITS,
            (true, false) => max_visible.div_ceil(DECODE_CHUNK).clamp(1, MAX_SPLITS),
        })
    }

    /// The v1 paged kernel on checked arguments.
    pub(super) fn launch_paged_v1(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        s: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<CudaTensor> {
        let out = self.alloc_tensor(q.rows, q.cols)?;
        if q.rows == 0 {
            return Ok(out);
        }
        let m = row_meta(seqs);
        let max_visible = m.row_visible.iter().copied().max().unwrap_or(1) as usize;
        let splits = self.v1_splits(seqs.iter().all(|x| x.rows <= 1), max_visible)?;
        let (row_seq, row_visible) = (self.stage(&m.row_seq)?, self.stage(&m.row_visible)?);
        let (table_start, tables) = (self.stage(&m.table_start)?, self.stage(&m.tables)?);
        let (items, d) = (q.rows * s.q_heads, s.head_dim);
        // Every (item, split) slot is written by paged_attention_v1 before the combine reads it.
        let part = if splits > 1 {
            Some(self.alloc_bytes(4 * items * splits * (d + 2))?)
        } else {
            None
        };
        let op = "paged_attention";
        let p = PagedAttnParams {
            q: q.ptr(),
            k: k.ptr(),
            v: v.ptr(),
            row_seq: row_seq.ptr(),
            row_visible: row_visible.ptr(),
            seq_table_start: table_start.ptr(),
            tables: tables.ptr(),
            out: out.ptr(),
            part: part.as_ref().map_or(0, |b| b.ptr),
            rows: to_i32(op, q.rows)?,
            q_heads: to_i32(op, s.q_heads)?,
            kv_heads: to_i32(op, s.kv_heads)?,
            d: to_i32(op, d)?,
            block_size: to_i32(op, s.block_size)?,
            splits: splits as i32,
            chunk: to_i32(op, DECODE_CHUNK)?,
            scale: 1.0 / (d as f32).sqrt(),
        };
        self.launch("paged_attention_v1", grid_warps(items, splits), p)?;
        if let Some(part) = &part {
            let c = CombineParams {
                part: part.ptr,
                out: out.ptr(),
                items: to_i32(op, items)?,
                splits: splits as i32,
                d: d as i32,
            };
            self.launch("attn_combine_v1", grid_warps(items, 1), c)?;
        }
        Ok(out)
    }

    /// The v1 segments kernel on checked arguments.
    pub(super) fn launch_segments_v1(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<CudaTensor> {
        let out = self.alloc_tensor(q.rows, q.cols)?;
        if q.rows == 0 || q.cols == 0 {
            return Ok(out);
        }
        let (mut lo, mut hi) = (vec![0u32; q.rows], vec![0u32; q.rows]);
        for w in cu_seqlens.windows(2) {
            for r in w[0]..w[1] {
                (lo[r], hi[r]) = (w[0] as u32, w[1] as u32);
            }
        }
        let (lo, hi) = (self.stage(&lo)?, self.stage(&hi)?);
        let d = q.cols / heads;
        let op = "attention_segments";
        let p = SegAttnParams {
            q: q.ptr(),
            k: k.ptr(),
            v: v.ptr(),
            row_lo: lo.ptr(),
            row_hi: hi.ptr(),
            out: out.ptr(),
            rows: to_i32(op, q.rows)?,
            heads: to_i32(op, heads)?,
            d: d as i32,
            scale: 1.0 / (d as f32).sqrt(),
        };
        self.launch("attention_segments_v1", grid_warps(q.rows * heads, 1), p)?;
        Ok(out)
    }
}
