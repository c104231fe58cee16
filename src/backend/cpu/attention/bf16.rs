//! Attention with bf16 products on AMX tiles (`--cpu-bf16-attention`, [`super::set_bf16_attention`]):
//! `Q·Kᵀ` and `P·V` on `TDPBF16PS`, as PyTorch's bf16 attention multiplies on such CPUs, the
//! softmax in f32 as on the exact path. Not HF's float32 result: each product's inputs are
//! rounded to bf16 (`q`, `k`, `v`, and the probabilities `p`), and its error against HF is
//! measured in docs/PERFORMANCE.md.
//!
//! One query row's arithmetic is still fixed, whatever rows are computed with it, so prefix reuse,
//! chunked prefill and decode agree bit for bit within this mode:
//!
//! * `s_j = (Σ_c bf16(q[c])·bf16(k_j[c])) · scale`, each score alone, its `d` inputs in steps of
//!   32 from 0 (zero past `d`);
//! * over the row's `n` visible keys, `e_j = exp(s_j − max_j s_j)` and `z = Σ_j e_j` as in the
//!   exact path's softmax, `e_j = 0` past them ([`exp_sum`]);
//! * `o[c] = (Σ_j bf16(e_j)·bf16(v_j[c])) / z`, the sum over the keys in steps of 32 from 0, up to
//!   `n` rounded up to 32 — the zeros past `n` add nothing (a sum that starts at +0 never becomes
//!   −0), and a row's steps are those of its own `n`: a task's positions lie within one step of
//!   keys (tiles aligned to a power of two), so every row of a task has the same steps. As in
//!   PyTorch's flash attention on the CPU, the probabilities are not normalised before `P·V`.
//!
//! How one `TDPBF16PS` adds its 32 products is the hardware's (`gemm/amx.rs`); the order of the
//! steps is fixed.

use super::{AttnTask, KvRun, Rows, LANES};
use crate::backend::cpu::gemm::{round_pairs_into, tile_products, TileOperand};
use crate::backend::cpu::simd::{combine_lanes, multiversion};
use crate::backend::cpu::CpuTensor;

/// Keys per `TDPBF16PS` step.
const STEP: usize = 32;
/// Keys per panel (columns of a tile).
const PANEL: usize = 16;

/// `d` rounded up to a whole step.
fn padded(d: usize) -> usize {
    d.div_ceil(STEP) * STEP
}

/// A run's keys and values rounded to bf16, once for all its tasks, as [`tile_products`] reads
/// them: keys in panels of 16 ([`Rounding::key_panels`]), values as pair rows
/// ([`Rounding::value_pairs`]).
pub(super) struct Bf16Run {
    keys: Vec<u32>,
    values: Vec<u32>,
}

impl Bf16Run {
    pub(super) fn pack(run: &KvRun, (k, v): (&CpuTensor, &CpuTensor), d: usize) -> Bf16Run {
        let n = run.slots.len();
        let (n32, d32) = (padded(n), padded(d));
        let mut scratch = Rounding::new(d);
        let mut keys = vec![0u32; n32 * d32 / 2];
        scratch.key_panels(run.in_pool(k), (0, n32), n, &mut keys);
        let mut values = vec![0u32; n32 / 2 * d32];
        scratch.value_pairs(run.in_pool(v), (0, n32), n, &mut values);
        Bf16Run { keys, values }
    }
}

/// The scratch that rounding keys and values to bf16 needs, allocated once per run or per task:
/// decode rounds a step of 32 keys at a time, and an allocation per step showed in its profile.
struct Rounding {
    d: usize,
    /// One key widened to `d32` (zero past `d`), when `d` is not a multiple of 32.
    row: Vec<f32>,
    /// A panel's 16 keys as rows of pairs, before they are turned.
    pairs: Vec<u32>,
    /// The missing partner of an odd run's last value.
    zeros: Vec<f32>,
}

impl Rounding {
    fn new(d: usize) -> Rounding {
        let d32 = padded(d);
        Rounding {
            d,
            row: vec![0f32; d32],
            pairs: vec![0u32; PANEL * d32 / 2],
            zeros: vec![0f32; d],
        }
    }

    /// Keys `j0..j1` (whole panels) in panels of 16: `[panels][d32 / 2][16]` words, lane `j % 16`
    /// of pair step `i` holding key `j`'s pair `i`; zero past the run's `n` keys and past `d`.
    /// Each panel's 16 keys are rounded as rows of pairs, then turned in 16 × 16 blocks in
    /// registers.
    fn key_panels(&mut self, keys: Rows<'_>, (j0, j1): (usize, usize), n: usize, out: &mut [u32]) {
        let (d, d32) = (self.d, padded(self.d));
        let (kp, panel_words) = (d32 / 2, d32 / 2 * PANEL);
        for (p, panel) in out[..(j1 - j0) * kp].chunks_mut(panel_words).enumerate() {
            for (l, lane) in self.pairs.chunks_mut(kp).enumerate() {
                let j = j0 + p * PANEL + l;
                if j >= n {
                    lane.fill(0);
                } else if d == d32 {
                    round_pairs_into(keys.row(j, d), lane);
                } else {
                    self.row[..d].copy_from_slice(keys.row(j, d));
                    round_pairs_into(&self.row, lane);
                }
            }
            // SAFETY: AMX-BF16 CPUs have AVX-512F (the bf16 path runs only there); `pairs` holds
            // 16 lanes of `kp` words and `panel` `kp` steps of 16, `kp` a multiple of 16.
            unsafe { x86::turn(&self.pairs, kp, panel) };
        }
    }

    /// Values `j0..j1` (`j0` even) as pair rows: `[(j1 - j0) / 2][d32]` words, word `c` of row
    /// `i` the pair `(v_{j0+2i}[c], v_{j0+2i+1}[c])` rounded as `round_pairs` rounds; zero past
    /// the run's `n` keys and past `d`.
    fn value_pairs(&self, values: Rows<'_>, (j0, j1): (usize, usize), n: usize, out: &mut [u32]) {
        let (d, d32) = (self.d, padded(self.d));
        for (i, out) in out[..(j1 - j0) / 2 * d32].chunks_mut(d32).enumerate() {
            let (a, b) = (j0 + 2 * i, j0 + 2 * i + 1);
            if a >= n {
                out.fill(0);
                continue;
            }
            let v0 = values.row(a, d);
            let v1 = if b < n { values.row(b, d) } else { &self.zeros[..] };
            // SAFETY: as in `key_panels` (AVX512-BW and -BF16 come with AMX-BF16); `v0` and `v1`
            // hold `d` floats and `out` `d32` words.
            unsafe { x86::pair_rows(v0, v1, out) };
        }
    }
}

/// Keys from [`Rounding::key_panels`] as [`tile_products`]' second operand: `d32 / 2` pair steps per panel.
fn key_operand(words: &[u32], d32: usize) -> TileOperand<'_> {
    TileOperand {
        words,
        icp: d32 / 2,
        row: PANEL,
        next: d32 / 2 * PANEL,
    }
}

/// `icp` pair rows from [`Rounding::value_pairs`] as [`tile_products`]' second operand.
fn value_operand(words: &[u32], icp: usize, d32: usize) -> TileOperand<'_> {
    TileOperand {
        words,
        icp,
        row: d32,
        next: PANEL,
    }
}

/// Where a task's keys and values come from: its run, packed once for all the run's tasks; or,
/// for a run of few query rows (decode), the pool itself, rounded a step of 32 keys at a time
/// into blocks that stay in L1 — each key and value is read once either way, and the products
/// and their order are the same, so both give the same bits.
pub(super) enum Source<'a> {
    Packed(&'a Bf16Run),
    Pool {
        keys: Rows<'a>,
        values: Rows<'a>,
        n: usize,
    },
}

/// One task's output rows `[positions × group, d]` (see [`super::attend`]): scores on the run's
/// keys up to the task's last visible one (rounded up to a step), the softmax, `P·V`.
pub(super) fn attend(q: &CpuTensor, src: &Source<'_>, d: usize, scale: f32, t: &AttnTask) -> Vec<f32> {
    let (h0, group) = t.heads;
    let rows = t.visible.len() * group;
    let n = t.visible.iter().copied().max().unwrap_or(0);
    let (nk, d32) = (padded(n), padded(d));
    let mut qs = vec![0f32; rows * d32];
    for (r, row) in qs.chunks_mut(d32).enumerate() {
        let at = (t.row0 + r / group) * q.cols + (h0 + r % group) * d;
        row[..d].copy_from_slice(&q.data[at..at + d]);
    }
    let rows32 = rows.div_ceil(STEP) * STEP;
    // Used by a pool source only; as small as the task's other buffers.
    let mut scratch = Rounding::new(d);
    let mut scores = vec![0f32; rows32 * nk];
    match src {
        Source::Packed(run) => {
            tile_products(&qs, rows, &key_operand(&run.keys, d32), (nk, true), &mut scores)
        }
        Source::Pool {
            keys: pool, n: all, ..
        } => {
            let (mut block, mut sums) = (vec![0u32; STEP * d32 / 2], vec![0f32; rows32 * STEP]);
            for j0 in (0..nk).step_by(STEP) {
                scratch.key_panels(*pool, (j0, j0 + STEP), *all, &mut block);
                tile_products(&qs, rows, &key_operand(&block, d32), (STEP, true), &mut sums);
                for (r, s) in sums.chunks(STEP).take(rows).enumerate() {
                    scores[r * nk + j0..][..STEP].copy_from_slice(s);
                }
            }
        }
    }
    let mut sums = Vec::with_capacity(rows);
    for (r, row) in scores.chunks_mut(nk.max(1)).take(rows).enumerate() {
        let vis = t.visible[r / group];
        debug_assert_eq!(padded(vis), nk, "a task's rows share their steps of keys");
        sums.push(exp_sum(&mut row[..vis], scale));
        row[vis..].fill(0.0);
    }
    let mut out = vec![0f32; rows32 * d32];
    match src {
        Source::Packed(run) => tile_products(
            &scores[..rows * nk],
            rows,
            &value_operand(&run.values, nk / 2, d32),
            (d32, true),
            &mut out,
        ),
        Source::Pool {
            values: pool, n: all, ..
        } => {
            let (mut block, mut e) = (vec![0u32; STEP / 2 * d32], vec![0f32; rows * STEP]);
            // The sums stay in `out` between steps: the same chains, stored and reloaded.
            for j0 in (0..nk).step_by(STEP) {
                scratch.value_pairs(*pool, (j0, j0 + STEP), *all, &mut block);
                for (r, e) in e.chunks_mut(STEP).enumerate() {
                    e.copy_from_slice(&scores[r * nk + j0..][..STEP]);
                }
                tile_products(
                    &e,
                    rows,
                    &value_operand(&block, STEP / 2, d32),
                    (d32, j0 == 0),
                    &mut out,
                );
            }
        }
    }
    for (o, z) in out.chunks_mut(d32).zip(&sums) {
        o.iter_mut().for_each(|x| *x /= z);
    }
    if d32 == d {
        out.truncate(rows * d);
        return out;
    }
    out.chunks(d32)
        .take(rows)
        .flat_map(|r| &r[..d])
        .copied()
        .collect()
}

multiversion! {
    /// `row[j] ← e_j = exp(row[j] · scale − max)` (`max` of the scaled row, the difference one
    /// fused multiply-add, the exponential [`exp_fma`]), returning their sum
    /// `z` in 16 lanes (lane `l` adding the `e_j` of `j ≡ l (mod 16)` in order) combined pairwise:
    /// two passes, where the exact path's softmax makes four (`P·V` divides by `z` at the end).
    fn exp_sum(row: &mut [f32], scale: f32) -> f32 {
        let full = row.len() / LANES * LANES;
        let mut top = [f32::NEG_INFINITY; LANES];
        for c in row[..full].chunks_exact(LANES) {
            for l in 0..LANES {
                let x = c[l] * scale;
                top[l] = if x > top[l] { x } else { top[l] };
            }
        }
        for (l, x) in row[full..].iter().enumerate() {
            let x = x * scale;
            top[l] = if x > top[l] { x } else { top[l] };
        }
        let max = top.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut acc = [0f32; LANES];
        for c in row[..full].chunks_exact_mut(LANES) {
            for l in 0..LANES {
                c[l] = exp_fma(c[l].mul_add(scale, -max));
                acc[l] += c[l];
            }
        }
        for (l, x) in row[full..].iter_mut().enumerate() {
            *x = exp_fma(x.mul_add(scale, -max));
            acc[l] += *x;
        }
        combine_lanes(acc)
    }
}

/// `e^x` as the exact path's `simd::exp` computes it (Cephes' reduction and polynomial), with its
/// steps fused into multiply-adds: half the dependent instructions, within an ulp or two, and
/// feeding a bf16 product anyway. The softmax calls it with `x ≤ 0` (or NaN).
#[inline(always)]
fn exp_fma(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.0);
    let n = xc.mul_add(LOG2E, 0.5).floor();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r + 1.0);
    // 2^n from n's bits, as in `simd::exp`.
    let magic = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
    let e = y * f32::from_bits(magic.wrapping_add(127) << 23);
    if x < -87.3 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        e
    }
}

mod x86 {
    use std::arch::x86_64::*;

    use crate::backend::cpu::gemm::transpose16;

    /// `panel[i·16 + l] = pairs[l·kp + i]`: 16 lanes of `kp` words turned into `kp` steps of 16.
    ///
    /// # Safety
    /// AVX-512F; `pairs` holds `16 · kp` words and `panel` as many, `kp` a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn turn(pairs: &[u32], kp: usize, panel: &mut [u32]) {
        assert!(pairs.len() >= 16 * kp && panel.len() >= 16 * kp && kp.is_multiple_of(16));
        for i0 in (0..kp).step_by(16) {
            let rows = std::array::from_fn(|l| _mm512_loadu_ps(pairs.as_ptr().add(l * kp + i0).cast()));
            for (i, step) in transpose16(rows).into_iter().enumerate() {
                _mm512_storeu_ps(panel.as_mut_ptr().add((i0 + i) * 16).cast(), step);
            }
        }
    }

    /// `out[c] = bf16(v0[c]) | bf16(v1[c]) << 16` (round to nearest even by `VCVTNE2PS2BF16`, as
    /// `round_pairs`), zero past `v0.len()`.
    ///
    /// # Safety
    /// AVX-512F, -BW and -BF16; `v1` as long as `v0`, `out` at least as long, in whole 16s.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pair_rows(v0: &[f32], v1: &[f32], out: &mut [u32]) {
        let d = v0.len();
        assert!(v1.len() == d && out.len() >= d && out.len().is_multiple_of(16));
        // Word lanes 2c and 2c + 1 of the result take the two rounded halves' lane c.
        let order: [u16; 32] = std::array::from_fn(|w| (w / 2 + 16 * (w % 2)) as u16);
        let order = _mm512_loadu_si512(order.as_ptr().cast());
        for c0 in (0..out.len()).step_by(16) {
            let mask = ((1u32 << d.saturating_sub(c0).min(16)) - 1) as u16;
            let a = _mm512_maskz_loadu_ps(mask, v0.as_ptr().wrapping_add(c0));
            let b = _mm512_maskz_loadu_ps(mask, v1.as_ptr().wrapping_add(c0));
            // Lanes 0..16 round `a`, 16..32 `b`.
            let halves: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
            _mm512_storeu_si512(
                out.as_mut_ptr().add(c0).cast(),
                _mm512_permutexvar_epi16(order, halves),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! The bf16 path (skipped, with a line on stderr, on CPUs without AMX): a query row's bits
    //! alone, in chunks after a prefix, as a decode row and in a whole prefill, with several
    //! sequences in one call; segments alone and together; and every output within the rounding
    //! of its definition (module docs), computed in f64 from the same bf16 inputs — GQA, head
    //! sizes that are not a multiple of 32, and tiles of 1 to 16 positions.

    use super::super::tests::{bits, paged_case, random};
    use super::super::{attention_segments, paged_attention, Products};
    use crate::backend::cpu::gemm::Bf16Kernel;
    use crate::backend::cpu::CpuTensor;
    use crate::backend::{AttnShape, PagedSeq};

    fn skip() -> bool {
        let skip = !Bf16Kernel::Amx.available();
        if skip {
            eprintln!("skipped: this CPU lacks AMX-BF16");
        }
        skip
    }

    fn bf16(x: f32) -> f64 {
        half::bf16::from_f32(x).to_f64()
    }

    /// The definition for one row in f64 on the bf16 inputs, and the bound on this mode's error:
    /// a score's f32 sums and the exponential move `e_j` by about 1e-6, which can move `bf16(e_j)`
    /// by one bf16 step (2⁻⁷ of it at most), and the f32 sums of `P·V` add their own rounding.
    fn reference_row(qr: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f32) -> (Vec<f64>, Vec<f64>) {
        let s: Vec<f64> = keys
            .iter()
            .map(|k| qr.iter().zip(*k).map(|(a, b)| bf16(*a) * bf16(*b)).sum::<f64>() * scale as f64)
            .collect();
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let z: f64 = e.iter().sum();
        let d = qr.len();
        let (mut o, mut bound) = (vec![0f64; d], vec![1e-6; d]);
        for (ej, vj) in e.iter().zip(vals) {
            let eb = half::bf16::from_f64(*ej).to_f64();
            for c in 0..d {
                o[c] += eb * bf16(vj[c]) / z;
                bound[c] += (2f64.powi(-7) + 1e-5) * ej * bf16(vj[c]).abs() / z;
            }
        }
        (o, bound)
    }

    fn assert_within(got: &[f32], (want, bound): (&[f64], &[f64]), what: &str) {
        for (c, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= *b,
                "{what}: column {c}: {g} against {w} (bound {b})"
            );
        }
    }

    fn seq(rows: usize, context_len: usize, table: &[u32]) -> PagedSeq<'_> {
        PagedSeq {
            rows,
            context_len,
            block_table: table,
        }
    }

    fn rows_of(x: &CpuTensor, r0: usize, rows: usize) -> CpuTensor {
        CpuTensor {
            data: x.data[r0 * x.cols..(r0 + rows) * x.cols].to_vec(),
            rows,
            cols: x.cols,
        }
    }

    #[test]
    fn a_row_has_the_same_bits_alone_in_chunks_and_in_a_prefill_within_its_rounding() {
        if skip() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(41);
        // (q heads, kv heads, head size, block size, context): GQA at the decoder's head size; a
        // group of 6 (tiles of 4 positions) on a head padded from 56 to 64; one head per group at
        // 80 (padded to 96) over several steps of keys; a group of 16 (tiles of 2 positions).
        for (qh, kvh, d, bs, n) in [
            (4, 2, 128, 16, 75),
            (6, 1, 56, 4, 40),
            (2, 2, 80, 8, 130),
            (16, 1, 32, 16, 35),
        ] {
            let s = AttnShape {
                q_heads: qh,
                kv_heads: kvh,
                head_dim: d,
                block_size: bs,
            };
            // Two sequences: the one under test, and another sharing the pool and the call.
            let (mut q, k, v, tables) = paged_case(&mut rng, s, &[(n, n), (9, 20)]);
            q.data.iter_mut().for_each(|x| *x *= 3.0); // peakier softmaxes
            let both = [seq(n, n, &tables[0]), seq(9, 20, &tables[1])];
            let whole = paged_attention(Products::Bf16, &q, &k, &v, s, &both);
            let alone = paged_attention(Products::Bf16, &rows_of(&q, 0, n), &k, &v, s, &both[..1]);
            assert_eq!(bits(&alone.data), bits(&whole.data[..n * q.cols]), "{s:?} alone");
            let other = paged_attention(Products::Bf16, &rows_of(&q, n, 9), &k, &v, s, &both[1..]);
            assert_eq!(bits(&other.data), bits(&whole.data[n * q.cols..]), "{s:?} other");
            // Chunks after a prefix, then decode rows.
            for (r0, rows) in [(0, 7), (7, 21), (28, n - 30), (n - 2, 1), (n - 1, 1)] {
                let part = paged_attention(
                    Products::Bf16,
                    &rows_of(&q, r0, rows),
                    &k,
                    &v,
                    s,
                    &[seq(rows, r0 + rows, &tables[0])],
                );
                let want = &whole.data[r0 * q.cols..(r0 + rows) * q.cols];
                assert_eq!(bits(&part.data), bits(want), "{s:?} rows {r0}..{}", r0 + rows);
            }
            let slot = |t: usize| tables[0][t / bs] as usize * bs + t % bs;
            let scale = 1.0 / (d as f32).sqrt();
            for i in 0..n {
                for h in 0..qh {
                    let kc = h / (qh / kvh) * d;
                    let keys: Vec<&[f32]> = (0..=i).map(|t| &k.data[slot(t) * k.cols + kc..][..d]).collect();
                    let vals: Vec<&[f32]> = (0..=i).map(|t| &v.data[slot(t) * v.cols + kc..][..d]).collect();
                    let (want, bound) =
                        reference_row(&q.data[i * q.cols + h * d..][..d], &keys, &vals, scale);
                    let got = &whole.data[i * q.cols + h * d..][..d];
                    assert_within(got, (&want, &bound), &format!("{s:?} position {i} head {h}"));
                }
            }
        }
    }

    #[test]
    fn segments_have_the_same_bits_alone_and_together_within_their_rounding() {
        if skip() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(42);
        for (heads, d, cu) in [(4, 64, vec![0, 37, 37, 100, 101]), (3, 40, vec![0, 70])] {
            let rows = *cu.last().unwrap();
            let (mut q, k, v) = (
                random(&mut rng, rows, heads * d),
                random(&mut rng, rows, heads * d),
                random(&mut rng, rows, heads * d),
            );
            q.data.iter_mut().for_each(|x| *x *= 3.0);
            let together = attention_segments(Products::Bf16, &q, &k, &v, heads, &cu);
            let scale = 1.0 / (d as f32).sqrt();
            for w in cu.windows(2) {
                let (a, b) = (w[0], w[1]);
                let alone = attention_segments(
                    Products::Bf16,
                    &rows_of(&q, a, b - a),
                    &rows_of(&k, a, b - a),
                    &rows_of(&v, a, b - a),
                    heads,
                    &[0, b - a],
                );
                let want = &together.data[a * q.cols..b * q.cols];
                assert_eq!(
                    bits(&alone.data),
                    bits(want),
                    "heads {heads}, d {d}, segment {a}..{b}"
                );
                for r in a..b {
                    for h in 0..heads {
                        let at = |x: &'_ CpuTensor, t: usize| x.data[t * x.cols + h * d..][..d].to_vec();
                        let keys: Vec<Vec<f32>> = (a..b).map(|t| at(&k, t)).collect();
                        let vals: Vec<Vec<f32>> = (a..b).map(|t| at(&v, t)).collect();
                        let keys: Vec<&[f32]> = keys.iter().map(|x| &x[..]).collect();
                        let vals: Vec<&[f32]> = vals.iter().map(|x| &x[..]).collect();
                        let (want, bound) = reference_row(&at(&q, r), &keys, &vals, scale);
                        let got = &together.data[r * q.cols + h * d..][..d];
                        assert_within(
                            got,
                            (&want, &bound),
                            &format!("segment {a}..{b} row {r} head {h}"),
                        );
                    }
                }
            }
        }
    }
}
