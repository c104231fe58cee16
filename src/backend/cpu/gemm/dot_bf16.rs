//! The opt-in bf16 GEMM (`--cpu-bf16-dot`, [`super::set_bf16_dot`]): the rows of `x` rounded to
//! bf16 and multiplied by a bf16 weight with AVX512-BF16's `VDPBF16PS`, two products per lane and
//! instruction — twice the multiply-adds of the f32 kernel per cycle.
//!
//! This is how bf16 inference usually runs on a CPU (oneDNN under PyTorch, llama.cpp): each
//! product's input is rounded to bf16. It is therefore not the exact path of `gemm.rs` (whose
//! result is HF's float32 computation on the bf16 weights); its error against HF is measured in
//! docs/PERFORMANCE.md and bounded in `tests/cpu_bf16_dot.rs`. Its own order is fixed as strictly:
//!
//! ```text
//! a = bf16(x)   (round to nearest even, per element)
//! acc = 0;  for i in 0..k/2 { acc = fma(a[2i], W[c][2i], fma(a[2i+1], W[c][2i+1], acc)) };  y = acc + b
//! ```
//!
//! which is what `VDPBF16PS` does per lane (a bf16 × bf16 product is exact in f32, so each step
//! rounds once; the odd element goes first; `tests/cpu_bf16_dot.rs` checks the instruction against
//! this definition). The chains are carried through memory between blocks as in `gemm.rs`, so a row
//! decoded alone equals the same row in a prefill, and the switch turns every call on a bf16
//! weight over together — decode, prefill and vision alike.
//!
//! The weight is read from the mapping: each block of panels is packed into a per-thread buffer as
//! 32-bit pairs `[ic][16]` (`pack::pairs`), which every row then passes over.

use super::{pack, Matrix, TileBuf, MC, MR, NP, NR, WIDE_ROWS};

/// Pair steps per packed block of a many-row call: 2,048 values of `k`, so that a block of 24
/// panels is 1.5 MiB, as the f32 path's.
const WIDE_PAIRS: usize = 1024;
/// Panels per packed block of a many-row call.
const WIDE_PANELS: usize = 8 * NP;
/// Pair steps per block of a call of fewer than [`WIDE_ROWS`] rows: one micro-kernel call's
/// panels, 24 KiB, packed into L1 and read back at once.
const NARROW_PAIRS: usize = 128;

/// Whether this CPU has AVX512-BF16 (and AVX-512F).
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// `x` (`[m, k]`, `k` even) rounded to bf16, each pair of neighbours in one word: element `2i` in
/// the low half, `2i + 1` in the high half (the layout `VDPBF16PS` reads).
pub(super) fn round_pairs(x: &[f32]) -> Vec<u32> {
    let mut out = vec![0u32; x.len() / 2];
    round_pairs_into(x, &mut out);
    out
}

/// [`round_pairs`] into `out` (`x.len() / 2` words).
pub(in crate::backend::cpu) fn round_pairs_into(x: &[f32], out: &mut [u32]) {
    assert!(available(), "AVX512-BF16 is not available on this CPU");
    assert!(x.len().is_multiple_of(2), "pairs of values");
    assert_eq!(out.len(), x.len() / 2, "a word per pair");
    // SAFETY: the CPU has AVX512-BF16 (asserted); `out` holds half as many words as `x` values.
    unsafe { x86::round_pairs(x, out) };
}

thread_local! {
    /// Each thread's packed block of pairs, reused across calls.
    static PAIRS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Columns of panels `p0..p1` of `y` (`[m, w.n]`) for every row of `a` (`[m, w.k / 2]`, from
/// [`round_pairs`]): runs of panels, each block of pair steps packed, the micro-kernel over it for
/// every row. Each output is the one chain over `k` from 0.0, whatever `m`.
pub(super) fn panel_range(a: &[u32], m: usize, w: &Matrix<'_>, p0: usize, p1: usize, y: &mut [f32]) {
    let kp = w.k / 2;
    assert!(a.len() >= m * kp && y.len() >= m * w.n, "rows of a and y");
    let (block_panels, block_pairs) = if m >= WIDE_ROWS {
        (WIDE_PANELS, WIDE_PAIRS)
    } else {
        (NP, NARROW_PAIRS)
    };
    PAIRS.with_borrow_mut(|buf| {
        buf.resize(block_panels * block_pairs * NR, 0);
        let mut tile: TileBuf = [[0f32; NP * NR]; MR];
        for s0 in (p0..p1).step_by(block_panels) {
            let s1 = (s0 + block_panels).min(p1);
            for i0 in (0..kp).step_by(block_pairs) {
                let ic = block_pairs.min(kp - i0);
                let len = (s1 - s0) * ic * NR;
                pack::pairs(w, (s0, s1), (i0, ic), &mut buf[..len]);
                let block = PairBlock {
                    a,
                    kp,
                    i0,
                    ic,
                    panels: &buf[..len],
                    s0,
                };
                block_pass(&block, (m, w.n), (s0, s1), &mut tile, y);
            }
        }
    });
}

/// One packed block: pair steps `i0..i0 + ic` of the rows of `a` (`kp` words each), and panels
/// from `s0` on, `ic · 16` words apart.
struct PairBlock<'a> {
    a: &'a [u32],
    kp: usize,
    i0: usize,
    ic: usize,
    panels: &'a [u32],
    s0: usize,
}

/// A [`PairBlock`] over rows `0..m` and panels `p0..p1`: chunks of `MC` rows, groups of `NP`
/// panels, tiles of `MR` rows; the tile carries the partial sums of the earlier blocks (in `y`).
fn block_pass(
    b: &PairBlock<'_>,
    (m, n): (usize, usize),
    (p0, p1): (usize, usize),
    tile: &mut TileBuf,
    y: &mut [f32],
) {
    for m0 in (0..m).step_by(MC) {
        let m1 = (m0 + MC).min(m);
        for p in (p0..p1).step_by(NP) {
            let np = (p1 - p).min(NP);
            let c0 = p * NR;
            let cols = (np * NR).min(n - c0);
            for r0 in (m0..m1).step_by(MR) {
                let mr = MR.min(m1 - r0);
                let rows = |i: usize| (r0 + i) * n + c0..(r0 + i) * n + c0 + cols;
                for (i, t) in tile.iter_mut().enumerate().take(mr) {
                    t.fill(0.0);
                    if b.i0 > 0 {
                        t[..cols].copy_from_slice(&y[rows(i)]);
                    }
                }
                let at = (p - b.s0) * b.ic * NR;
                let panels = &b.panels[at..];
                let x = &b.a[r0 * b.kp + b.i0..];
                assert!(
                    panels.len() >= (np - 1) * b.ic * NR + b.ic * NR,
                    "panels out of range"
                );
                assert!(x.len() >= (mr - 1) * b.kp + b.ic, "rows out of range");
                let t = x86::PairTile {
                    x: x.as_ptr(),
                    ldx: b.kp,
                    ic: b.ic,
                    w: panels.as_ptr(),
                    stride: b.ic * NR,
                };
                // SAFETY: the callers checked AVX512-BF16 (`round_pairs` asserts it); the bounds of
                // the rows and panels the tile reads are asserted above.
                unsafe { x86::kernel(&t, mr, np, tile) };
                for (i, t) in tile.iter().enumerate().take(mr) {
                    y[rows(i)].copy_from_slice(&t[..cols]);
                }
            }
        }
    }
}

#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    use std::arch::x86_64::*;

    use super::{TileBuf, NR};

    /// One micro-kernel call's operands: `ic` pair steps of rows `x` (`ldx` words apart) and of
    /// panels `w` (`stride` words apart).
    pub struct PairTile {
        pub x: *const u32,
        pub ldx: usize,
        pub ic: usize,
        pub w: *const u32,
        pub stride: usize,
    }

    /// # Safety
    /// AVX512-BF16; `out` holds `x.len() / 2` words.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn round_pairs(x: &[f32], out: &mut [u32]) {
        let n = x.len();
        let (src, dst) = (x.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i + 32 <= n {
            let (lo, hi) = (_mm512_loadu_ps(src.add(i)), _mm512_loadu_ps(src.add(i + 16)));
            // Lanes 0..16 of the result round `lo`, 16..32 `hi`: word t holds elements 2t, 2t + 1.
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.add(i / 2).cast(), v);
            i += 32;
        }
        if i < n {
            let rest = n - i;
            let mask = |len: usize| ((1u32 << len.min(16)) - 1) as u16;
            let lo = _mm512_maskz_loadu_ps(mask(rest), src.add(i));
            let hi = _mm512_maskz_loadu_ps(mask(rest.saturating_sub(16)), src.add(i + 16.min(rest)));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_mask_storeu_epi32(dst.add(i / 2).cast(), mask(rest / 2), v);
        }
    }

    /// `tile[i][p·16 + j]` ← the chain of `VDPBF16PS` over the call's pair steps, for rows
    /// `0..mr` (1..=8) and panels `0..np` (1..=3).
    ///
    /// # Safety
    /// AVX512-BF16; `t.x` holds `mr` rows of `t.ic` words (`t.ldx` apart), `t.w` `np` panels of
    /// `t.ic · 16` (`t.stride` apart).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn kernel(t: &PairTile, mr: usize, np: usize, tile: &mut TileBuf) {
        macro_rules! by_rows {
            ($p:literal) => {
                match mr {
                    1 => tile512::<1, $p>(t, tile),
                    2 => tile512::<2, $p>(t, tile),
                    3 => tile512::<3, $p>(t, tile),
                    4 => tile512::<4, $p>(t, tile),
                    5 => tile512::<5, $p>(t, tile),
                    6 => tile512::<6, $p>(t, tile),
                    7 => tile512::<7, $p>(t, tile),
                    _ => tile512::<8, $p>(t, tile),
                }
            };
        }
        match np {
            1 => by_rows!(1),
            2 => by_rows!(2),
            _ => by_rows!(3),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile512<const R: usize, const P: usize>(t: &PairTile, tile: &mut TileBuf) {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for i in 0..R {
            for p in 0..P {
                acc[i][p] = _mm512_loadu_ps(tile[i].as_ptr().add(p * NR));
            }
        }
        for s in 0..t.ic {
            let mut w: [__m512bh; P] = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); P];
            for p in 0..P {
                w[p] = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    t.w.add(p * t.stride + s * NR).cast(),
                ));
            }
            for i in 0..R {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*t.x.add(i * t.ldx + s) as i32));
                for p in 0..P {
                    acc[i][p] = _mm512_dpbf16_ps(acc[i][p], a, w[p]);
                }
            }
        }
        for i in 0..R {
            for p in 0..P {
                _mm512_storeu_ps(tile[i].as_mut_ptr().add(p * NR), acc[i][p]);
            }
        }
    }
}
