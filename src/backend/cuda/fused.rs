//! Fused ops (`kernels/fused.cu`): several [`Backend`] ops in one launch, with results bitwise equal
//! to the composition of the unfused kernels on this backend (tests/cuda_fused.rs).
//!
//! [`qk_norm_rope_write_fused`](CudaBackend::qk_norm_rope_write_fused) is the CUDA
//! [`Backend::qk_norm_rope_write`]: per-head q/k RMSNorm, rotary embedding and the paged-KV write in
//! one `qk_norm_rope_write_v1` launch instead of two `rms_norm_v1`, two `rope_v1` and two
//! `scatter_rows_v1`. The kernel shares its arithmetic with `rms_norm_v1` and `rope_v1`
//! (`common.cuh`'s `rms_*` and `rope_*` helpers) and runs each head's norm with the block size
//! `rms_norm_v1` gets, so every reduction sums in the same order.

use cudarc::driver::DeviceRepr;
use xxhash_rust::xxh64::Xxh64;

use super::params::{params, Traced};
use super::{grid_rows, to_i32, CudaBackend, CudaTensor, CudaWeight};
use crate::backend::check::shape_err;
use crate::backend::Backend;
use crate::error::Result;

const OP: &str = "qk_norm_rope_write";
/// Most threads per block: must equal the cap of `rms_norm_v1`'s launch (`grid_rows(groups, g, 256)`
/// in `rms_norm_impl`), as the block size fixes the order of the norm's sum of squares.
const NORM_MAX_THREADS: usize = 256;
/// Largest head dim of the fused kernel (one head of bf16 in shared memory); larger ones are composed.
const MAX_HEAD_DIM: usize = 4096;

params! {
    /// fused.cu: qk_norm_rope_write_v1.
    QkNormRopeParams {
        q: u64, k: u64, v: u64, q_w: u64, k_w: u64, cos: u64, sin: u64, slots: u64,
        q_out: u64, k_pool: u64, v_pool: u64,
        n: i64, q_heads: i32, kv_heads: i32, d: i32, eps: f32,
    }
}

/// Heads and head dim of a valid call.
struct QkShape {
    q_heads: usize,
    kv_heads: usize,
    d: usize,
}

/// Every check of the fused op, before any work: q `[n, q_heads·d]`, k and v `[n, kv_heads·d]`,
/// tables `[n, d]` with `d` even, pools `[rows, kv_heads·d]`, `n` slots inside the pools, norm
/// weights of `d` values.
fn validate(
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    norms: Option<(&CudaWeight, &CudaWeight, f32)>,
    (cos, sin): (&CudaTensor, &CudaTensor),
    (k_pool, v_pool): (&CudaTensor, &CudaTensor),
    slots: &[usize],
) -> Result<QkShape> {
    let dims = |x: &CudaTensor| (x.rows, x.cols);
    let (n, d) = dims(cos);
    if dims(sin) != (n, d) || d == 0 || d % 2 != 0 {
        return Err(shape_err(
            OP,
            format!(
                "tables cos {:?}, sin {:?} (want [n, head_dim], head_dim even)",
                dims(cos),
                dims(sin)
            ),
        ));
    }
    if q.rows != n
        || k.rows != n
        || !q.cols.is_multiple_of(d)
        || !k.cols.is_multiple_of(d)
        || dims(v) != dims(k)
    {
        return Err(shape_err(
            OP,
            format!(
                "q {:?}, k {:?}, v {:?} for tables [{n}, {d}] (want q [n, q_heads·{d}], k and v [n, kv_heads·{d}])",
                dims(q),
                dims(k),
                dims(v)
            ),
        ));
    }
    if k_pool.cols != k.cols || dims(v_pool) != dims(k_pool) {
        return Err(shape_err(
            OP,
            format!(
                "pools k {:?}, v {:?} for k and v {:?}",
                dims(k_pool),
                dims(v_pool),
                dims(k)
            ),
        ));
    }
    if slots.len() != n {
        return Err(shape_err(OP, format!("{} slots for {n} rows", slots.len())));
    }
    if let Some(&bad) = slots.iter().find(|&&s| s >= k_pool.rows) {
        return Err(shape_err(
            OP,
            format!("slot {bad} outside the pools of {} rows", k_pool.rows),
        ));
    }
    if let Some((qn, kn, _)) = norms {
        if qn.len() != d || kn.len() != d {
            return Err(shape_err(
                OP,
                format!("norm weights {:?} and {:?} for head_dim {d}", qn.shape, kn.shape),
            ));
        }
    }
    Ok(QkShape {
        q_heads: q.cols / d,
        kv_heads: k.cols / d,
        d,
    })
}

/// Whether no slot repeats.
fn distinct(slots: &[usize]) -> bool {
    let mut s = slots.to_vec();
    s.sort_unstable();
    s.windows(2).all(|w| w[0] != w[1])
}

impl CudaBackend {
    /// [`Backend::qk_norm_rope_write`] in one launch: per-head RMSNorm of `q` and `k` (with `norms`),
    /// rotary embedding with `cos, sin: [n, head_dim]`, rotated `k` and `v` written to rows `slots` of
    /// the pools; returns the rotated `q`. Bitwise equal to the composition of
    /// [`rms_norm`](Backend::rms_norm), [`rope`](Backend::rope) and
    /// [`scatter_rows`](Backend::scatter_rows) on this backend. Repeated slots (ordered writes) and head
    /// dims over 4096 take that composition.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qk_norm_rope_write_fused(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        norms: Option<(&CudaWeight, &CudaWeight, f32)>,
        (cos, sin): (&CudaTensor, &CudaTensor),
        (k_pool, v_pool): (&mut CudaTensor, &mut CudaTensor),
        slots: &[usize],
    ) -> Result<CudaTensor> {
        let s = validate(q, k, v, norms, (cos, sin), (k_pool, v_pool), slots)?;
        if s.d > MAX_HEAD_DIM || !distinct(slots) {
            return self.qk_norm_rope_write_composed(q, k, v, norms, (cos, sin), (k_pool, v_pool), slots);
        }
        let n = q.rows;
        let q_out = self.alloc_tensor(n, q.cols)?;
        let items = n * (s.q_heads + s.kv_heads);
        if items == 0 {
            return Ok(q_out);
        }
        to_i32(OP, items)?;
        let staged = self.index_u32(OP, slots, k_pool.rows)?;
        let (q_w, k_w, eps) = match norms {
            Some((qn, kn, eps)) => (self.ptr(&qn.buf), self.ptr(&kn.buf), eps),
            None => (0, 0, 0.0),
        };
        let p = QkNormRopeParams {
            q: q.ptr(),
            k: k.ptr(),
            v: v.ptr(),
            q_w,
            k_w,
            cos: cos.ptr(),
            sin: sin.ptr(),
            slots: staged.ptr(),
            q_out: q_out.ptr(),
            k_pool: k_pool.ptr(),
            v_pool: v_pool.ptr(),
            n: n as i64,
            q_heads: to_i32(OP, s.q_heads)?,
            kv_heads: to_i32(OP, s.kv_heads)?,
            d: to_i32(OP, s.d)?,
            eps,
        };
        // rms_norm_v1's block for a group of d (the sum's order), one block per (row, head).
        let mut cfg = grid_rows(items, s.d, NORM_MAX_THREADS);
        cfg.shared_mem_bytes = (2 * s.d) as u32;
        self.launch("qk_norm_rope_write_v1", cfg, p)?;
        Ok(q_out)
    }

    /// The unfused composition (the trait's default), for the calls the kernel does not take.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_write_composed(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        norms: Option<(&CudaWeight, &CudaWeight, f32)>,
        (cos, sin): (&CudaTensor, &CudaTensor),
        (k_pool, v_pool): (&mut CudaTensor, &mut CudaTensor),
        slots: &[usize],
    ) -> Result<CudaTensor> {
        let rotate = |x: &CudaTensor, norm: Option<(&CudaWeight, f32)>| match norm {
            Some((w, eps)) => self.rope(&self.rms_norm(x, w, eps)?, cos, sin),
            None => self.rope(x, cos, sin),
        };
        let q = rotate(q, norms.map(|(qn, _, eps)| (qn, eps)))?;
        let k = rotate(k, norms.map(|(_, kn, eps)| (kn, eps)))?;
        self.scatter_rows(k_pool, slots, &k, false)?;
        self.scatter_rows(v_pool, slots, v, false)?;
        Ok(q)
    }
}
