//! Attention on the CPU as GEMM-shaped passes: per (sequence or image segment, KV head, tile of
//! query positions) the scores `Q·Kᵀ` of every query head of the group come from the GEMM, each row
//! is softmaxed, and `P·V` runs on the GEMM too over the keys every row of the tile sees, then as
//! FMA chains over the causal edge's keys, vectorised across the head's columns. A run of many
//! query rows packs its keys and values into the GEMM's panels once, for all its tiles.
//!
//! The arithmetic of one query row `q` of a head over its `n` visible keys (`k_j`, `v_j` in key
//! order) is fixed, whatever rows are computed with it and on every instruction set — this is what
//! keeps prefix reuse, chunked prefill and drafting bitwise exact (the causal prefill, the decode
//! rows and the vision tower's segments all run it):
//!
//! * `s_j = (Σ_c q[c]·k_j[c]) · scale`, the sum one FMA chain over `c` from 0 (the GEMM's chain);
//! * `e_j = exp(s_j − max_j s_j)` ([`exp`]); `z = Σ_j e_j` in 16 lanes, lane `l` adding the `e_j`
//!   of `j ≡ l (mod 16)` in key order, the lanes then combined pairwise (`l += l + 8`, `+4`, `+2`,
//!   `+1`); `p_j = e_j / z`;
//! * `o[c] = Σ_j p_j·v_j[c]`, one FMA chain over `j` from 0 in key order.
//!
//! The earlier kernel summed each score as 16 lanes of rounded products with a tree, and each
//! output as a rounded product then a rounded sum per key: twice the instructions of an FMA chain,
//! and a horizontal reduction per score (docs/PERFORMANCE.md, 2026-12-06).
//!
//! With `--cpu-bf16-attention` ([`set_bf16_attention`]) the same runs and tasks multiply in bf16
//! on AMX tiles instead, under a definition of their own that keeps the same guarantee (`bf16.rs`).

use std::sync::Arc;

use rayon::prelude::*;

use super::gemm::{gemm_panels, gemm_with, Isa, Matrix, Panels, RowMajor};
use super::simd::{combine_lanes, exp, multiversion};
use super::CpuTensor;
use crate::backend::{AttnShape, PagedSeq};

#[cfg(target_arch = "x86_64")]
mod bf16;
mod products;

pub(super) use products::Products;
pub use products::{bf16_attention, set_bf16_attention};

/// Query rows (positions × the group's query heads) per task: the GEMM packs each block of keys
/// once for all of them, so fewer rows would pack more often per multiply-add.
const TASK_ROWS: usize = 32;

/// Query rows from which a run's keys and values are packed (see [`KvRun`]): below it (decode),
/// each row is read once or twice, so it is read where it lies.
const PACK_ROWS: usize = 8;

/// Keys per block of `P·V`: the block's values (16 KiB at 128 floats) stay in L1 while every row
/// tile of the task passes over them.
const KEY_BLOCK: usize = 32;

/// Causal grouped-query attention over the paged pool; one task per (tile of positions, KV head).
pub(super) fn paged_attention(
    products: Products,
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    s: AttnShape,
    seqs: &[PagedSeq<'_>],
) -> CpuTensor {
    let d = s.head_dim;
    let group = s.q_heads / s.kv_heads;
    let tile = products.tile(group);
    let (mut runs, mut tasks) = (Vec::new(), Vec::new());
    let mut row0 = 0;
    for seq in seqs {
        let slots: Arc<Vec<usize>> = Arc::new(
            (0..seq.context_len)
                .map(|t| seq.block_table[t / s.block_size] as usize * s.block_size + t % s.block_size)
                .collect(),
        );
        let first = seq.context_len - seq.rows;
        for h in 0..s.kv_heads {
            let run = runs.len();
            runs.push(KvRun {
                slots: slots.clone(),
                col: h * d,
                pack: seq.rows * group >= PACK_ROWS,
            });
            // Tiles aligned to multiples of `tile` in the sequence, whatever the chunk.
            let mut t0 = 0;
            while t0 < seq.rows {
                let rows = (tile - (first + t0) % tile).min(seq.rows - t0);
                tasks.push(AttnTask {
                    row0: row0 + t0,
                    heads: (h * group, group),
                    run,
                    // Position i of the tile sees the sequence's first `first + t0 + i + 1` tokens.
                    visible: (0..rows).map(|i| first + t0 + i + 1).collect(),
                });
                t0 += rows;
            }
        }
        row0 += seq.rows;
    }
    attend_all(products, (q, k, v), d, &runs, &tasks)
}

/// Non-causal attention inside each segment of `cu` (rows `cu[i]..cu[i + 1]`, `heads` heads whose
/// K/V columns are the query's); one task per (tile of rows, head).
pub(super) fn attention_segments(
    products: Products,
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    heads: usize,
    cu: &[usize],
) -> CpuTensor {
    let d = q.cols / heads;
    let (mut runs, mut tasks) = (Vec::new(), Vec::new());
    for w in cu.windows(2) {
        let (a, b) = (w[0], w[1]);
        let slots = Arc::new((a..b).collect::<Vec<usize>>());
        for h in 0..heads {
            let run = runs.len();
            runs.push(KvRun {
                slots: slots.clone(),
                col: h * d,
                pack: b - a >= PACK_ROWS,
            });
            for r0 in (a..b).step_by(TASK_ROWS) {
                tasks.push(AttnTask {
                    row0: r0,
                    heads: (h, 1),
                    run,
                    visible: vec![b - a; TASK_ROWS.min(b - r0)],
                });
            }
        }
    }
    attend_all(products, (q, k, v), d, &runs, &tasks)
}

/// The keys and values one head attends to: rows `slots` of K and V, columns `col..col + d`.
/// With `pack`, they are packed once into the GEMM's panels ([`PackedRun`]), which every task
/// of the run shares: no task packs the keys again for its scores, and `P·V` reads the values from
/// panels, not from pool rows `kv_heads · d` floats apart (4 KiB at the 2B's shape: rows that far
/// apart share a handful of L1 sets).
struct KvRun {
    slots: Arc<Vec<usize>>,
    col: usize,
    pack: bool,
}

impl KvRun {
    /// The run's rows where they lie in the pool `x` (K or V).
    fn in_pool<'a>(&'a self, x: &'a CpuTensor) -> Rows<'a> {
        Rows {
            x: &x.data,
            slots: &self.slots,
            ld: x.cols,
            col: self.col,
        }
    }
}

/// A run's keys and values in the GEMM's panels: `K: [n, d]` for the scores `Q·Kᵀ`, and
/// `Vᵀ: [d, n]` for `P·V`. Packing copies, so the products keep the bits of the definition.
struct PackedRun {
    keys: Panels,
    values: Panels,
}

impl PackedRun {
    fn pack(isa: Isa, run: &KvRun, (k, v): (&CpuTensor, &CpuTensor), d: usize) -> PackedRun {
        let n = run.slots.len();
        let ks = run.in_pool(k).gathered(n, d);
        let keys = Panels::pack_f32(isa, &Matrix::new(n, d, RowMajor::F32(&ks)));
        let vs = run.in_pool(v);
        let values = Panels::of_transposed(n, d, |j| vs.row(j, d));
        PackedRun { keys, values }
    }
}

/// One attention task: positions `row0..row0 + visible.len()` of query heads `heads.0..heads.0 +
/// heads.1` (columns `head · d..` of `q`), position `i` attending to the first `visible[i]` keys
/// of `runs[run]`.
struct AttnTask {
    row0: usize,
    heads: (usize, usize),
    run: usize,
    visible: Vec<usize>,
}

/// Packs the runs (in f32, those that have many query rows), then runs the tasks in parallel,
/// each writing its rows of the output `[q.rows, q.cols]`.
fn attend_all(
    products: Products,
    (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
    d: usize,
    runs: &[KvRun],
    tasks: &[AttnTask],
) -> CpuTensor {
    let scale = 1.0 / (d as f32).sqrt();
    match products {
        Products::F32(isa) => {
            let packed: Vec<Option<PackedRun>> = runs
                .par_iter()
                .map(|r| r.pack.then(|| PackedRun::pack(isa, r, (k, v), d)))
                .collect();
            each_task(q, d, tasks, |t| {
                let run = &runs[t.run];
                let kv = KvRows {
                    keys: run.in_pool(k),
                    values: run.in_pool(v),
                    packed: packed[t.run].as_ref(),
                };
                attend(isa, q, kv, d, scale, t)
            })
        }
        #[cfg(target_arch = "x86_64")]
        Products::Bf16 => {
            let packed: Vec<Option<bf16::Bf16Run>> = runs
                .par_iter()
                .map(|r| r.pack.then(|| bf16::Bf16Run::pack(r, (k, v), d)))
                .collect();
            each_task(q, d, tasks, |t| {
                let run = &runs[t.run];
                let src = match &packed[t.run] {
                    Some(p) => bf16::Source::Packed(p),
                    None => bf16::Source::Pool {
                        keys: run.in_pool(k),
                        values: run.in_pool(v),
                        n: run.slots.len(),
                    },
                };
                bf16::attend(q, &src, d, scale, t)
            })
        }
    }
}

/// Runs `attend` on every task in parallel, each copying its rows into the output `[q.rows,
/// q.cols]` as soon as it has them, while they are in its cache (no task's rows wait in memory
/// for the others).
fn each_task(
    q: &CpuTensor,
    d: usize,
    tasks: &[AttnTask],
    attend: impl Fn(&AttnTask) -> Vec<f32> + Sync,
) -> CpuTensor {
    let mut out = super::ops::zeros(q.rows * q.cols);
    let out_addr = out.as_mut_ptr() as usize;
    tasks.par_iter().for_each(|t| {
        let part = attend(t);
        // Part rows are (position, head of the group), position-major.
        for (r, o) in part.chunks(d).enumerate() {
            let (i, g) = (r / t.heads.1, r % t.heads.1);
            let at = (t.row0 + i) * q.cols + (t.heads.0 + g) * d;
            assert!(
                at + d <= q.rows * q.cols && o.len() == d,
                "attention rows out of range"
            );
            // SAFETY: `out` holds `at + d` floats (asserted) and outlives the loop; the tasks'
            // (position, head) blocks are disjoint, so no two tasks write the same floats, and
            // nothing reads `out` until the loop ends.
            unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), (out_addr as *mut f32).add(at), d) };
        }
    });
    CpuTensor {
        data: out,
        rows: q.rows,
        cols: q.cols,
    }
}

/// What one task reads of its run: the rows in the pool, and the run's panels when it has them.
struct KvRows<'a> {
    keys: Rows<'a>,
    values: Rows<'a>,
    packed: Option<&'a PackedRun>,
}

/// One task's output rows `[positions × group, d]`: the group's query rows gathered, the scores
/// against the run's first keys ([`scores`]), the softmax per row, then `P·V`: on the run's panels
/// by the GEMM over the keys every row sees, the rest (the causal edge) by [`Pv`]; without panels
/// all by [`Pv`].
fn attend(isa: Isa, q: &CpuTensor, kv: KvRows<'_>, d: usize, scale: f32, t: &AttnTask) -> Vec<f32> {
    let (h0, group) = t.heads;
    let rows = t.visible.len() * group;
    let n = t.visible.iter().copied().max().unwrap_or(0);
    let mut qs = Vec::with_capacity(rows * d);
    for i in 0..t.visible.len() {
        for g in 0..group {
            let at = (t.row0 + i) * q.cols + (h0 + g) * d;
            qs.extend_from_slice(&q.data[at..at + d]);
        }
    }
    // Scores of every row against all `n` keys; a row past its own visible keys ignores the rest
    // (each score is its own chain, so the extra ones change nothing).
    let mut scores = vec![0f32; rows * n];
    match kv.packed {
        Some(p) => gemm_panels(isa, (&qs, d), rows, &p.keys, (n, d), &mut scores),
        None => self::scores(isa, (&qs, rows), kv.keys, (n, d), &mut scores),
    }
    let visible: Vec<usize> = (0..rows).map(|r| t.visible[r / group]).collect();
    for (row, &vis) in scores.chunks_mut(n.max(1)).zip(&visible) {
        softmax(&mut row[..vis], scale);
    }
    let mut out = vec![0f32; rows * d];
    // Keys `0..common` every row sees; past them a row's chains go on only over its own keys.
    let common = match kv.packed {
        Some(p) => {
            let common = t.visible.iter().copied().min().unwrap_or(0);
            gemm_panels(isa, (&scores, n), rows, &p.values, (d, common), &mut out);
            common
        }
        None => 0,
    };
    let pv = Pv {
        p: &scores,
        ldp: n,
        visible: &visible,
        v: kv.values,
    };
    pv.run(isa, &mut out, d, common);
    out
}

/// Lanes of the softmax's sum (see the module docs).
const LANES: usize = 16;

multiversion! {
    /// `row ← softmax(row · scale)` as the module docs define it, in passes that vectorise: scale
    /// and the maxima of 16 lanes (lane `l` takes the elements `j ≡ l (mod 16)`); exponentials;
    /// the lanes' sums; the division.
    fn softmax(row: &mut [f32], scale: f32) {
        let full = row.len() / LANES * LANES;
        let (body, tail) = row.split_at_mut(full);
        // The maximum is the same in any order (NaNs skipped, as by `f32::max`); `a > b ? a : b`
        // is one vector instruction where `f32::max` is several.
        let mut top = [f32::NEG_INFINITY; LANES];
        for c in body.chunks_exact_mut(LANES) {
            for l in 0..LANES {
                c[l] *= scale;
                top[l] = if c[l] > top[l] { c[l] } else { top[l] };
            }
        }
        for (l, x) in tail.iter_mut().enumerate() {
            *x *= scale;
            top[l] = if *x > top[l] { *x } else { top[l] };
        }
        let max = top.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // A loop of its own: the exponentials vectorise as a plain loop, not inside the lanes.
        row.iter_mut().for_each(|x| *x = exp(*x - max));
        let (body, tail) = row.split_at(full);
        let mut acc = [0f32; LANES];
        for c in body.chunks_exact(LANES) {
            for l in 0..LANES {
                acc[l] += c[l];
            }
        }
        for (l, x) in tail.iter().enumerate() {
            acc[l] += *x;
        }
        let sum = combine_lanes(acc);
        row.iter_mut().for_each(|x| *x /= sum);
    }
}

/// `scores[r·n + j] = Σ_c qs[r·d + c]·k_j[c]` for `rows` query rows and the first `n` keys in the
/// pool, one FMA chain over `c` from 0 per score (the GEMM's): for a few rows with AVX-512, by
/// 16 × 16 transposes in registers fused into the chains (decode: no copy of the keys), else by the
/// GEMM on a copy of them.
fn scores(isa: Isa, (qs, rows): (&[f32], usize), ks: Rows<'_>, (n, d): (usize, usize), scores: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && d.is_multiple_of(16) && rows <= x86::POOL_SCORE_ROWS && n > 0 {
        let Rows { x, slots, ld, col } = ks;
        assert!(
            slots[..n].iter().all(|&s| s * ld + col + d <= x.len()),
            "key rows out of range"
        );
        assert!(qs.len() == rows * d && scores.len() == rows * n);
        // SAFETY: the CPU has AVX-512F; the bounds were checked above.
        unsafe { x86::scores_pool(qs, rows, d, (x, &slots[..n], ld, col), scores) };
        return;
    }
    let ks = ks.gathered(n, d);
    gemm_with(
        isa,
        qs,
        rows,
        &Matrix::new(n, d, RowMajor::F32(&ks)),
        None,
        scores,
    );
}

/// Where the key or value rows of a run lie in the pool: row `j` is `x[slots[j]·ld + col..]`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    x: &'a [f32],
    slots: &'a [usize],
    ld: usize,
    col: usize,
}

impl Rows<'_> {
    /// The `d` floats of row `j`.
    #[inline(always)]
    fn row(&self, j: usize, d: usize) -> &[f32] {
        &self.x[self.slots[j] * self.ld + self.col..][..d]
    }

    /// Rows `0..n` copied into one contiguous `[n, d]` matrix.
    fn gathered(&self, n: usize, d: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n * d);
        for j in 0..n {
            out.extend_from_slice(self.row(j, d));
        }
        out
    }
}

/// `o[r] = Σ_j p[r·ldp + j] · v_j` for the keys `j < visible[r]` of each row `r` (rows of `d`
/// floats in `o`; `v_j` is [`Rows::row`]), one FMA chain per element in key order: from 0 when
/// `o` starts at 0, or going on from keys `0..start` whose chains `o` holds. The kernels run the
/// chains in blocks of [`KEY_BLOCK`] keys, each block for every row, the partial sums kept in `o`
/// between blocks: the same chain, stored and reloaded.
struct Pv<'a> {
    p: &'a [f32],
    ldp: usize,
    visible: &'a [usize],
    v: Rows<'a>,
}

impl Pv<'_> {
    /// Runs the chains of `o` (`[visible.len(), d]`) over keys `start..` on `isa`'s kernel; every
    /// kernel has the bits of [`Pv::portable`].
    ///
    /// # Panics
    /// When a value row is out of range or `p` is too short.
    fn run(&self, isa: Isa, o: &mut [f32], d: usize, start: usize) {
        let n = self.visible.iter().copied().max().unwrap_or(0);
        let rows = self.visible.len();
        let Rows { x, slots, ld, col } = self.v;
        assert!(
            slots[..n].iter().all(|&s| s * ld + col + d <= x.len()),
            "value rows out of range"
        );
        assert!(o.len() == rows * d && self.p.len() >= rows.saturating_sub(1) * self.ldp + n);
        if start >= n {
            return;
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX-512F (`Isa::Avx512` is only detected so); bounds checked above.
            Isa::Avx512 => unsafe { x86::pv_avx512(self, o, d, start) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 and FMA (`Isa::Avx2` requires both); bounds checked above.
            Isa::Avx2 => unsafe { x86::pv_avx2(self, o, d, start) },
            _ => self.portable(o, (d, 0), start),
        }
    }

    /// The defining loops for columns `c0..d` of every row, keys `start..`.
    fn portable(&self, o: &mut [f32], (d, c0): (usize, usize), start: usize) {
        for (r, &vis) in self.visible.iter().enumerate() {
            let orow = &mut o[r * d + c0..(r + 1) * d];
            for j in start..vis {
                let pj = self.p[r * self.ldp + j];
                let vj = &self.v.row(j, d)[c0..];
                orow.iter_mut().zip(vj).for_each(|(o, v)| *o = pj.mul_add(*v, *o));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    use std::arch::x86_64::*;

    use super::super::gemm::transpose16;
    use super::{Pv, Rows, KEY_BLOCK};

    /// Most query rows [`scores_pool`] takes (their accumulators, the 16 transposed registers and
    /// the broadcast fit in the 32 zmm registers).
    pub(super) const POOL_SCORE_ROWS: usize = 8;

    /// [`super::scores`] for `rows` ≤ [`POOL_SCORE_ROWS`] query rows on keys in the pool
    /// (`keys = (x, slots, ld, col)`: key `j` is `x[slots[j]·ld + col..]`): 16 keys at a time, each
    /// block of 16 columns of their rows transposed in registers so that one register holds one
    /// column of 16 keys, then every row's chains step over those columns in order.
    ///
    /// # Safety
    /// AVX-512F; `d` a multiple of 16; every key row holds `d` floats from `col`; `qs` holds `rows`
    /// rows of `d`, `out` `rows` rows of `slots.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_pool(
        qs: &[f32],
        rows: usize,
        d: usize,
        keys: (&[f32], &[usize], usize, usize),
        out: &mut [f32],
    ) {
        match rows {
            1 => pool_rows::<1>(qs, d, keys, out),
            2 => pool_rows::<2>(qs, d, keys, out),
            3 => pool_rows::<3>(qs, d, keys, out),
            4 => pool_rows::<4>(qs, d, keys, out),
            5 => pool_rows::<5>(qs, d, keys, out),
            6 => pool_rows::<6>(qs, d, keys, out),
            7 => pool_rows::<7>(qs, d, keys, out),
            _ => pool_rows::<8>(qs, d, keys, out),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pool_rows<const R: usize>(
        qs: &[f32],
        d: usize,
        (x, slots, ld, col): (&[f32], &[usize], usize, usize),
        out: &mut [f32],
    ) {
        let n = slots.len();
        let base = x.as_ptr().add(col);
        for j0 in (0..n).step_by(16) {
            let keys = (n - j0).min(16);
            // Lanes past the last key read the first key's row again; their sums are dropped.
            let row: [*const f32; 16] =
                std::array::from_fn(|i| base.add(slots[j0 + if i < keys { i } else { 0 }] * ld));
            let mut acc = [_mm512_setzero_ps(); R];
            for c0 in (0..d).step_by(16) {
                let t = transpose16(std::array::from_fn(|i| _mm512_loadu_ps(row[i].add(c0))));
                for c in 0..16 {
                    for r in 0..R {
                        let qv = _mm512_set1_ps(*qs.get_unchecked(r * d + c0 + c));
                        acc[r] = _mm512_fmadd_ps(qv, t[c], acc[r]);
                    }
                }
            }
            let mask: __mmask16 = ((1u32 << keys) - 1) as u16;
            for r in 0..R {
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(r * n + j0), mask, acc[r]);
            }
        }
    }

    /// Generates a `P·V` kernel for one register width: `$tile::<C, R>` keeps an `R` rows × `C`
    /// registers block of accumulators over all the keys; `$cols::<C, R>` runs it down the rows
    /// (the last ones one at a time); `$all` covers the columns in blocks of the listed register
    /// counts (more than the last listed: blocks of `$default`), those past the last whole register
    /// by [`Pv::portable`].
    macro_rules! pv_kernel {
        ($feat:literal, $all:ident, $cols:ident, $tile:ident, $step:ident, $reg:ty, $w:literal, $zero:ident, $load:ident,
         $store:ident, $set1:ident, $fma:ident, [$(($c:literal, $r:literal)),*], ($dc:literal, $dr:literal)) => {
            /// # Safety
            /// The CPU has the kernel's features; `pv`'s bounds were checked.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $all(pv: &Pv<'_>, o: &mut [f32], d: usize, start: usize) {
                let full = d / $w * $w;
                let mut c0 = 0;
                while c0 < full {
                    c0 += match (full - c0) / $w {
                        $($c => $cols::<$c, $r>(pv, o, (d, c0), start),)*
                        _ => $cols::<$dc, $dr>(pv, o, (d, c0), start),
                    };
                }
                if full < d {
                    pv.portable(o, (d, full), start);
                }
            }

            /// Columns `c0..c0 + C · width` of every row, keys `start..` block by block; returns
            /// their count.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn $cols<const C: usize, const R: usize>(
                pv: &Pv<'_>,
                o: &mut [f32],
                (d, c0): (usize, usize),
                start: usize,
            ) -> usize {
                let rows = pv.visible.len();
                let n = pv.visible.iter().copied().max().unwrap_or(0);
                for j0 in (start..n).step_by(KEY_BLOCK) {
                    let j1 = (j0 + KEY_BLOCK).min(n);
                    let mut r = 0;
                    while r + R <= rows {
                        $tile::<C, R>(pv, o, d, (r, c0), (j0, j1));
                        r += R;
                    }
                    while r < rows {
                        $tile::<C, 1>(pv, o, d, (r, c0), (j0, j1));
                        r += 1;
                    }
                }
                C * $w
            }

            /// Rows `r0..r0 + R`, columns `c0..c0 + C · width`, keys `j0..j1` (each row's visible
            /// ones), continuing the chains `o` holds.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn $tile<const C: usize, const R: usize>(
                pv: &Pv<'_>,
                o: &mut [f32],
                d: usize,
                (r0, c0): (usize, usize),
                (j0, j1): (usize, usize),
            ) {
                let vis = &pv.visible[r0..r0 + R];
                let common = vis.iter().copied().min().unwrap_or(0);
                let most = vis.iter().copied().max().unwrap_or(0).min(j1);
                if most <= j0 {
                    return;
                }
                let mut acc = [[$zero(); C]; R];
                for r in 0..R {
                    for c in 0..C {
                        acc[r][c] = $load(o.as_ptr().add((r0 + r) * d + c0 + $w * c));
                    }
                }
                // Keys every row of the tile sees, then the causal edge, where some rows stop.
                let edge = common.clamp(j0, most);
                for j in j0..edge {
                    $step::<C, R, false>(pv, &mut acc, (vis, r0, c0), j);
                }
                for j in edge..most {
                    $step::<C, R, true>(pv, &mut acc, (vis, r0, c0), j);
                }
                for r in 0..R {
                    for c in 0..C {
                        $store(o.as_mut_ptr().add((r0 + r) * d + c0 + $w * c), acc[r][c]);
                    }
                }
            }

            /// Key `j` into the tile's accumulators (`MASKED`: only for the rows that see it).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn $step<const C: usize, const R: usize, const MASKED: bool>(
                pv: &Pv<'_>,
                acc: &mut [[$reg; C]; R],
                (vis, r0, c0): (&[usize], usize, usize),
                j: usize,
            ) {
                // In range: checked by `Pv::run`.
                let Rows { x, slots, ld, col } = pv.v;
                let vj = x.as_ptr().add(*slots.get_unchecked(j) * ld + col + c0);
                let mut w = [$zero(); C];
                for c in 0..C {
                    w[c] = $load(vj.add($w * c));
                }
                for r in 0..R {
                    if MASKED && j >= vis[r] {
                        continue;
                    }
                    let pj = $set1(*pv.p.get_unchecked((r0 + r) * pv.ldp + j));
                    for c in 0..C {
                        acc[r][c] = $fma(pj, w[c], acc[r][c]);
                    }
                }
            }
        };
    }

    // Accumulators + one register of `v` per column register + the broadcast: at most 25 of 32
    // zmm, 13 of 16 ymm.
    pv_kernel!(
        "avx512f",
        pv_avx512,
        cols512,
        tile512,
        step512,
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        [(1, 4), (2, 4), (3, 4), (4, 4), (5, 3), (6, 2), (7, 2)],
        (8, 2)
    );
    pv_kernel!(
        "avx2,fma",
        pv_avx2,
        cols256,
        tile256,
        step256,
        __m256,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        [(1, 4), (2, 3), (3, 2)],
        (4, 2)
    );
}

#[cfg(test)]
mod tests {
    //! Every instruction set against the module docs' definition, written out here as plain
    //! loops (`f32::mul_add` chains, the 16-lane sum), bitwise, on random inputs: prefill whole,
    //! in chunks and as decode rows, several sequences in one call, shuffled pool slots, GQA, head
    //! sizes that are not a multiple of the register width, and the vision tower's segments.

    use super::*;
    use crate::backend::cpu::simd::exp;

    pub(super) fn random(rng: &mut fastrand::Rng, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor {
            data: (0..rows * cols).map(|_| rng.f32() * 4.0 - 2.0).collect(),
            rows,
            cols,
        }
    }

    /// The definition for one query row over keys `k_j`, `v_j` (each `d` floats).
    fn reference_row(qr: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f32) -> Vec<f32> {
        let mut s: Vec<f32> = keys
            .iter()
            .map(|k| qr.iter().zip(*k).fold(0f32, |acc, (a, b)| a.mul_add(*b, acc)) * scale)
            .collect();
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        s.iter_mut().for_each(|x| *x = exp(*x - max));
        let mut lanes = [0f32; 16];
        for (j, e) in s.iter().enumerate() {
            lanes[j % 16] += e;
        }
        for width in [8, 4, 2, 1] {
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
        }
        let z = lanes[0];
        let d = qr.len();
        let mut o = vec![0f32; d];
        for (e, vj) in s.iter().zip(vals) {
            let p = e / z;
            for c in 0..d {
                o[c] = p.mul_add(vj[c], o[c]);
            }
        }
        o
    }

    fn isas() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    pub(super) fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Sequences as (new rows, context) over one shuffled pool; returns (q, k, v, block tables).
    pub(super) fn paged_case(
        rng: &mut fastrand::Rng,
        s: AttnShape,
        seqs: &[(usize, usize)],
    ) -> (CpuTensor, CpuTensor, CpuTensor, Vec<Vec<u32>>) {
        let blocks: usize = seqs.iter().map(|&(_, c)| c.div_ceil(s.block_size)).sum();
        let mut pool: Vec<u32> = (0..blocks as u32 + 3).collect();
        rng.shuffle(&mut pool);
        let mut tables = Vec::new();
        let mut at = 0;
        for &(_, c) in seqs {
            let nb = c.div_ceil(s.block_size);
            tables.push(pool[at..at + nb].to_vec());
            at += nb;
        }
        let slots = (blocks + 3) * s.block_size;
        let rows: usize = seqs.iter().map(|&(r, _)| r).sum();
        let q = random(rng, rows, s.q_heads * s.head_dim);
        let k = random(rng, slots, s.kv_heads * s.head_dim);
        let v = random(rng, slots, s.kv_heads * s.head_dim);
        (q, k, v, tables)
    }

    fn paged_reference(
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        s: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Vec<f32> {
        let d = s.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0f32; q.rows * q.cols];
        let mut row = 0;
        for seq in seqs {
            let slot =
                |t: usize| seq.block_table[t / s.block_size] as usize * s.block_size + t % s.block_size;
            for i in 0..seq.rows {
                let vis = seq.context_len - seq.rows + i + 1;
                for h in 0..s.q_heads {
                    let kc = h / (s.q_heads / s.kv_heads) * d;
                    let keys: Vec<&[f32]> = (0..vis).map(|t| &k.data[slot(t) * k.cols + kc..][..d]).collect();
                    let vals: Vec<&[f32]> = (0..vis).map(|t| &v.data[slot(t) * v.cols + kc..][..d]).collect();
                    let qr = &q.data[row * q.cols + h * d..][..d];
                    let o = reference_row(qr, &keys, &vals, scale);
                    out[row * q.cols + h * d..][..d].copy_from_slice(&o);
                }
                row += 1;
            }
        }
        out
    }

    #[test]
    fn paged_attention_is_the_definition_on_every_isa() {
        let mut rng = fastrand::Rng::with_seed(29);
        let cases: [(AttnShape, &[(usize, usize)]); 4] = [
            // GQA at the text decoder's head size: a prefill, a chunk after a prefix, two decode rows.
            (
                AttnShape {
                    q_heads: 4,
                    kv_heads: 2,
                    head_dim: 128,
                    block_size: 16,
                },
                &[(70, 70), (9, 40), (1, 33), (1, 1)],
            ),
            // One KV head for 6 query heads (tiles of 5 positions), a head size of 3 registers + tail.
            (
                AttnShape {
                    q_heads: 6,
                    kv_heads: 1,
                    head_dim: 56,
                    block_size: 4,
                },
                &[(23, 30), (1, 17)],
            ),
            // Multi-head, a head narrower than one register, long keys.
            (
                AttnShape {
                    q_heads: 2,
                    kv_heads: 2,
                    head_dim: 12,
                    block_size: 8,
                },
                &[(3, 130)],
            ),
            // A head wider than the kernels' widest block; a decode row on it.
            (
                AttnShape {
                    q_heads: 2,
                    kv_heads: 1,
                    head_dim: 160,
                    block_size: 16,
                },
                &[(5, 21), (1, 40)],
            ),
        ];
        for (s, shape) in cases {
            let (q, k, v, tables) = paged_case(&mut rng, s, shape);
            let seqs: Vec<PagedSeq<'_>> = shape
                .iter()
                .zip(&tables)
                .map(|(&(rows, context_len), t)| PagedSeq {
                    rows,
                    context_len,
                    block_table: t,
                })
                .collect();
            let want = bits(&paged_reference(&q, &k, &v, s, &seqs));
            for isa in isas() {
                let got = paged_attention(Products::F32(isa), &q, &k, &v, s, &seqs);
                assert_eq!(bits(&got.data), want, "{isa:?}, {s:?}, {shape:?}");
            }
        }
    }

    /// The GEMM on packed panels (keys as `pack_f32`, values as `of_transposed`) over a prefix of
    /// the outputs and of the steps is the plain `mul_add` chain from 0, bitwise, on every
    /// instruction set: partial panels, rows of `x` wider than the steps, and more steps than one
    /// block of the GEMM (its carry through `y`).
    #[test]
    fn products_on_panels_over_a_prefix_are_the_chains() {
        let mut rng = fastrand::Rng::with_seed(31);
        for (m, n, k) in [(1, 5, 3), (9, 37, 70), (19, 48, 1100)] {
            let ldx = k + 3;
            let x = random(&mut rng, m, ldx);
            let w = random(&mut rng, n, k);
            let wt: Vec<f32> = (0..k * n).map(|i| w.data[(i % n) * k + i / n]).collect();
            for (n2, k2) in [(n, k), (n - 1, k / 2 + 1), (n.min(16), 0)] {
                let mut want = vec![0f32; m * n2];
                for r in 0..m {
                    for c in 0..n2 {
                        want[r * n2 + c] =
                            (0..k2).fold(0f32, |acc, i| x.data[r * ldx + i].mul_add(w.data[c * k + i], acc));
                    }
                }
                for isa in isas() {
                    let keys = Panels::pack_f32(isa, &Matrix::new(n, k, RowMajor::F32(&w.data)));
                    let values = Panels::of_transposed(k, n, |i| &wt[i * n..][..n]);
                    for (name, panels) in [("pack_f32", &keys), ("of_transposed", &values)] {
                        let mut y = vec![f32::NAN; m * n2];
                        gemm_panels(isa, (&x.data, ldx), m, panels, (n2, k2), &mut y);
                        assert_eq!(
                            bits(&y),
                            bits(&want),
                            "{isa:?} {name} [{m}, {n}, {k}] prefix {n2} x {k2}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn segments_are_the_definition_on_every_isa() {
        let mut rng = fastrand::Rng::with_seed(30);
        for (heads, d, cu) in [(4, 64, vec![0, 37, 37, 100, 101]), (3, 40, vec![0, 70])] {
            let rows = *cu.last().unwrap();
            let (q, k, v) = (
                random(&mut rng, rows, heads * d),
                random(&mut rng, rows, heads * d),
                random(&mut rng, rows, heads * d),
            );
            let scale = 1.0 / (d as f32).sqrt();
            let mut want = vec![0f32; rows * heads * d];
            for w in cu.windows(2) {
                for r in w[0]..w[1] {
                    for h in 0..heads {
                        fn at(x: &CpuTensor, t: usize, h: usize, d: usize) -> &[f32] {
                            &x.data[t * x.cols + h * d..][..d]
                        }
                        let keys: Vec<&[f32]> = (w[0]..w[1]).map(|t| at(&k, t, h, d)).collect();
                        let vals: Vec<&[f32]> = (w[0]..w[1]).map(|t| at(&v, t, h, d)).collect();
                        let o = reference_row(at(&q, r, h, d), &keys, &vals, scale);
                        want[r * heads * d + h * d..][..d].copy_from_slice(&o);
                    }
                }
            }
            for isa in isas() {
                let got = attention_segments(Products::F32(isa), &q, &k, &v, heads, &cu);
                assert_eq!(
                    bits(&got.data),
                    bits(&want),
                    "{isa:?}, heads {heads}, d {d}, {cu:?}"
                );
            }
        }
    }
}
