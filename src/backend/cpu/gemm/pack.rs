//! Packing a block of a row-major weight into the GEMM's f32 panels (`gemm.rs`): panel `p` of the
//! block is `[kc][16]`, its step `kk`, lane `j` being `W[16p + j][k0 + kk]` widened to f32 (zero
//! for columns past `n`). A transposed copy: exact on every path, so the instruction set only
//! changes how fast it is. AVX-512F transposes 16 × 16 tiles in registers, AVX2 8 × 8; the others
//! copy one element at a time.

use super::{Isa, Matrix, RowMajor, NR};

/// Packs panels `s0..s1`, steps `k0..k0 + kc`, of `w` into `dst` (`(s1 - s0) · kc · 16` values).
pub(super) fn panels(
    isa: Isa,
    w: &Matrix<'_>,
    (s0, s1): (usize, usize),
    (k0, kc): (usize, usize),
    dst: &mut [f32],
) {
    assert_eq!(dst.len(), (s1 - s0) * kc * NR, "a block of {} panels", s1 - s0);
    assert!(s1 * NR < w.n + NR && k0 + kc <= w.k, "a block inside the weight");
    for p in s0..s1 {
        let panel = &mut dst[(p - s0) * kc * NR..(p - s0 + 1) * kc * NR];
        let rows = NR.min(w.n - p * NR);
        // Whole tiles of steps through the vector transposes; the rest one by one.
        let done = match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `gemm_with` checked AVX-512F; rows `16p..16p + rows` and steps
            // `k0..k0 + kc` lie inside `w` (checked above), `panel` holds `kc · 16` values.
            Isa::Avx512 => unsafe { x86::panel512(w, p * NR, rows, k0, kc, panel) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `gemm_with` checked AVX2 and F16C; the bounds as above.
            Isa::Avx2 => unsafe { x86::panel256(w, p * NR, rows, k0, kc, panel) },
            _ => 0,
        };
        scalar(w, p * NR, rows, (k0 + done, kc - done), &mut panel[done * NR..]);
    }
}

/// Packs panels `s0..s1` of a bf16 weight (`k` even) as 32-bit pairs, pair steps `i0..i0 + ic`,
/// into `dst` (`(s1 - s0) · ic · 16` words) for `dot_bf16.rs`: panel `p`'s step `i`, lane `j` is
/// the word `W[16p + j][2(i0 + i)] | W[16p + j][2(i0 + i) + 1] << 16` — two neighbours as they lie in
/// the checkpoint, so the 16 × 16 transposes of 32-bit lanes move them unchanged (zero past `n`).
pub(super) fn pairs(w: &Matrix<'_>, (s0, s1): (usize, usize), (i0, ic): (usize, usize), dst: &mut [u32]) {
    let RowMajor::Bf16(b) = w.data else {
        panic!("bf16 pairs of a bf16 weight")
    };
    assert!(w.k.is_multiple_of(2), "an even k");
    assert_eq!(dst.len(), (s1 - s0) * ic * NR, "a block of {} panels", s1 - s0);
    assert!(
        s1 * NR < w.n + NR && 2 * (i0 + ic) <= w.k,
        "a block inside the weight"
    );
    for p in s0..s1 {
        let panel = &mut dst[(p - s0) * ic * NR..(p - s0 + 1) * ic * NR];
        let rows = NR.min(w.n - p * NR);
        #[cfg(target_arch = "x86_64")]
        let done = if rows == NR && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; rows `16p..16p + 16` and pair steps `i0..i0 + ic`
            // lie inside `w` (checked above); `panel` holds `ic · 16` words.
            unsafe { x86::pairs512(w, p * NR, i0, ic, panel) }
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for (j, c) in (p * NR..p * NR + NR).enumerate() {
            for i in done..ic {
                let at = 2 * (c * w.k + 2 * (i0 + i));
                panel[i * NR + j] = if j < rows {
                    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
                } else {
                    0
                };
            }
        }
    }
}

/// Steps `k0..k0 + kc` of rows `c0..c0 + rows` into `panel[kk][j]` (rows past `rows` zero).
fn scalar(w: &Matrix<'_>, c0: usize, rows: usize, (k0, kc): (usize, usize), panel: &mut [f32]) {
    let k = w.k;
    for j in 0..NR {
        if j >= rows {
            (0..kc).for_each(|kk| panel[kk * NR + j] = 0.0);
            continue;
        }
        let at = (c0 + j) * k + k0;
        match w.data {
            RowMajor::F32(v) => (0..kc).for_each(|kk| panel[kk * NR + j] = v[at + kk]),
            RowMajor::Bf16(b) => (0..kc).for_each(|kk| {
                let i = 2 * (at + kk);
                panel[kk * NR + j] = f32::from_bits(u32::from(u16::from_le_bytes([b[i], b[i + 1]])) << 16);
            }),
            RowMajor::F16(b) => (0..kc).for_each(|kk| {
                let i = 2 * (at + kk);
                panel[kk * NR + j] = half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
            }),
        }
    }
}

/// Whole decode panels at the stored width (`Panels::pack`).
#[cfg(target_arch = "x86_64")]
pub(super) use x86::decode_panel512;

/// The 16 × 16 register transpose, for attention's scores on the pool (`attention.rs`).
#[cfg(target_arch = "x86_64")]
pub(in crate::backend::cpu) use x86::transpose16;

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    use std::arch::x86_64::*;

    use super::{Matrix, RowMajor, NR};

    /// Storage kinds (`KIND`): f32, bf16, and anything else f16.
    const F32: u8 = 0;
    const BF16: u8 = 1;
    const F16: u8 = 2;

    /// The base pointer of `w`'s storage, its kind and its element size.
    fn storage(w: &Matrix<'_>) -> (*const u8, u8, usize) {
        match w.data {
            RowMajor::F32(v) => (v.as_ptr().cast(), F32, 4),
            RowMajor::Bf16(b) => (b.as_ptr(), BF16, 2),
            RowMajor::F16(b) => (b.as_ptr(), F16, 2),
        }
    }

    /// The first `kc - kc % 16` steps of one whole panel (rows `c0..c0 + 16`), as 16 × 16
    /// transposes; returns how many steps it packed (none for a partial panel: the last of a
    /// weight whose `n` is not a multiple of 16 goes one by one). The 16-bit words are loaded as
    /// they lie (little-endian).
    ///
    /// # Safety
    /// AVX-512F; rows `c0..c0 + rows` and steps `k0..k0 + kc` inside `w`; `panel` holds `kc · 16`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel512(
        w: &Matrix<'_>,
        c0: usize,
        rows: usize,
        k0: usize,
        kc: usize,
        panel: &mut [f32],
    ) -> usize {
        if rows < NR {
            return 0;
        }
        let (base, kind, size) = storage(w);
        let src = base.add((c0 * w.k + k0) * size);
        let out = panel.as_mut_ptr();
        match kind {
            F32 => tiles512::<F32>(src, w.k * size, kc / 16, out),
            BF16 => tiles512::<BF16>(src, w.k * size, kc / 16, out),
            _ => tiles512::<F16>(src, w.k * size, kc / 16, out),
        }
        16 * (kc / 16)
    }

    /// The first `ic - ic % 16` pair steps of one whole panel of a bf16 weight (rows
    /// `c0..c0 + 16`) as 16 × 16 transposes of 32-bit words; returns how many it packed.
    ///
    /// # Safety
    /// AVX-512F; rows `c0..c0 + 16` and pair steps `i0..i0 + ic` inside `w` (bf16, `k` even);
    /// `panel` holds `ic · 16` words.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pairs512(w: &Matrix<'_>, c0: usize, i0: usize, ic: usize, panel: &mut [u32]) -> usize {
        let (base, _, _) = storage(w);
        let src = base.add((c0 * w.k + 2 * i0) * 2);
        // A pair is 4 bytes: the f32 tiles move its bits as they are.
        tiles512::<F32>(src, w.k * 2, ic / 16, panel.as_mut_ptr().cast());
        16 * (ic / 16)
    }

    /// The first `k - k % 16` steps (f32) or `k - k % 32` steps (16-bit words) of one whole
    /// panel (rows `c0..c0 + 16`) in the decode panels' layout `[k][16]`, at the stored width, as
    /// 16 × 16 transposes; returns how many steps it packed. A 16-bit weight moves as 32-bit pairs
    /// of neighbouring steps: after the transpose, lane `j` of pair step `i` holds `W[j][2i]` in
    /// its low half and `W[j][2i + 1]` in its high half, and the two halves are narrowed apart.
    ///
    /// # Safety
    /// AVX-512F; rows `c0..c0 + 16` inside `w`; `out` holds `k · 16` elements of the stored width
    /// (4 bytes for f32, 2 otherwise).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn decode_panel512(w: &Matrix<'_>, c0: usize, out: *mut u8) -> usize {
        let (base, kind, size) = storage(w);
        let src = base.add(c0 * w.k * size);
        if kind == F32 {
            tiles512::<F32>(src, w.k * 4, w.k / 16, out.cast());
            return 16 * (w.k / 16);
        }
        let out = out.cast::<u16>();
        for t in 0..w.k / 32 {
            let c = transposed512::<F32>(src.add(64 * t), w.k * 2);
            for i in 0..16 {
                let pair = _mm512_castps_si512(c[i]);
                let step = 32 * t + 2 * i;
                let (even, odd) = (
                    _mm512_cvtepi32_epi16(pair),
                    _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(pair)),
                );
                _mm256_storeu_si256(out.add(step * NR).cast(), even);
                _mm256_storeu_si256(out.add((step + 1) * NR).cast(), odd);
            }
        }
        32 * (w.k / 32)
    }

    /// 16 values of storage `KIND` at `p`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load512<const KIND: u8>(p: *const u8) -> __m512 {
        match KIND {
            F32 => _mm512_loadu_ps(p.cast()),
            BF16 => {
                let raw = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
            }
            _ => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        }
    }

    /// `tiles` transposes of the 16 rows from `src` (`ld` bytes apart), 16 steps each, into `out`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tiles512<const KIND: u8>(src: *const u8, ld: usize, tiles: usize, out: *mut f32) {
        let size = if KIND == F32 { 4 } else { 2 };
        for t in 0..tiles {
            let c = transposed512::<KIND>(src.add(16 * t * size), ld);
            for i in 0..16 {
                _mm512_storeu_ps(out.add((16 * t + i) * NR), c[i]);
            }
        }
    }

    /// The 16 rows from `at` (`ld` bytes apart), 16 values of storage `KIND` each, widened and
    /// transposed: `c[i]` lane `j` is row `j`'s value `i`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transposed512<const KIND: u8>(at: *const u8, ld: usize) -> [__m512; 16] {
        let mut r = [_mm512_setzero_ps(); 16];
        for j in 0..16 {
            r[j] = load512::<KIND>(at.add(j * ld));
        }
        transpose16(r)
    }

    /// `c[i]` lane `j` = `r[j]` lane `i`.
    ///
    /// # Safety
    /// AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::backend::cpu) unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        // Pairs of rows interleaved within each 128-bit lane...
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // ...then fours: u[4g + q], 128-bit lane L, holds rows 4g..4g + 4 of column 4L + q...
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            u[4 * g] = _mm512_shuffle_ps::<0x44>(t[4 * g], t[4 * g + 2]);
            u[4 * g + 1] = _mm512_shuffle_ps::<0xEE>(t[4 * g], t[4 * g + 2]);
            u[4 * g + 2] = _mm512_shuffle_ps::<0x44>(t[4 * g + 1], t[4 * g + 3]);
            u[4 * g + 3] = _mm512_shuffle_ps::<0xEE>(t[4 * g + 1], t[4 * g + 3]);
        }
        // ...then the four groups' lane L of column q gathered into column 4L + q.
        let mut c = [_mm512_setzero_ps(); 16];
        for q in 0..4 {
            let x0 = _mm512_shuffle_f32x4::<0x88>(u[q], u[4 + q]);
            let x1 = _mm512_shuffle_f32x4::<0xDD>(u[q], u[4 + q]);
            let y0 = _mm512_shuffle_f32x4::<0x88>(u[8 + q], u[12 + q]);
            let y1 = _mm512_shuffle_f32x4::<0xDD>(u[8 + q], u[12 + q]);
            c[q] = _mm512_shuffle_f32x4::<0x88>(x0, y0);
            c[8 + q] = _mm512_shuffle_f32x4::<0xDD>(x0, y0);
            c[4 + q] = _mm512_shuffle_f32x4::<0x88>(x1, y1);
            c[12 + q] = _mm512_shuffle_f32x4::<0xDD>(x1, y1);
        }
        c
    }

    /// [`panel512`] with 8 × 8 transposes: each half of the panel (8 columns) in tiles of 8 steps.
    ///
    /// # Safety
    /// AVX2 and F16C; the bounds as for [`panel512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel256(
        w: &Matrix<'_>,
        c0: usize,
        rows: usize,
        k0: usize,
        kc: usize,
        panel: &mut [f32],
    ) -> usize {
        let (base, kind, size) = storage(w);
        let src = base.add((c0 * w.k + k0) * size);
        let out = panel.as_mut_ptr();
        match kind {
            F32 => tiles256::<F32>(src, w.k * size, rows, kc / 8, out),
            BF16 => tiles256::<BF16>(src, w.k * size, rows, kc / 8, out),
            _ => tiles256::<F16>(src, w.k * size, rows, kc / 8, out),
        }
        8 * (kc / 8)
    }

    /// `tiles` 8 × 8 transposes per half of the `rows` (≤ 16) rows from `src` (`ld` bytes
    /// apart), 8 steps each, into `out`; rows past `rows` are zero.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tiles256<const KIND: u8>(src: *const u8, ld: usize, rows: usize, tiles: usize, out: *mut f32) {
        let size = if KIND == F32 { 4 } else { 2 };
        for half in 0..2 {
            for t in 0..tiles {
                let mut r = [_mm256_setzero_ps(); 8];
                for j in 0..rows.saturating_sub(8 * half).min(8) {
                    r[j] = load256::<KIND>(src.add((8 * half + j) * ld + 8 * t * size));
                }
                let c = transpose8(r);
                for i in 0..8 {
                    _mm256_storeu_ps(out.add((8 * t + i) * NR + 8 * half), c[i]);
                }
            }
        }
    }

    /// Bytes ahead in each weight row that the fused decode chains prefetch. Their 8 rows stream
    /// in lockstep, 32 bytes (f32) or 16 (16-bit) per step, each row a short stream the hardware
    /// prefetcher keeps picking up anew: 256 made decode 4–6% faster on f32 weights and 10% on
    /// bf16 on an Intel Xeon (128: none; 512: 4–6% and 4%; 4,096: slower).
    const PFD: usize = 256;

    /// [`super::fused_rows`] for one whole panel `p`, in 8-column halves: 8 rows of the weight
    /// streamed at a time, 8 × 8 transposes: the f16 weights' path, and f32's on AVX2. On AVX-512,
    /// bf16 and f32 weights take [`pairs_fused512`] and [`f32_fused512`] instead: 16 × 16
    /// transposes, fewer shuffles per value, and measured 5–16% faster (docs/PERFORMANCE.md,
    /// 2026-12-07, sixth session); bf16 on AVX2 takes [`pairs_fused256`].
    ///
    /// # Safety
    /// AVX2, FMA and F16C; rows `16p..16p + 16` inside `w`; `x` holds `m` rows of `w.k`, `y` `m`
    /// of `w.n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn fused256(x: &[f32], m: usize, w: &Matrix<'_>, p: usize, y: &mut [f32]) {
        let (base, kind, size) = storage(w);
        for half in 0..2 {
            let src = base.add((p * NR + 8 * half) * w.k * size);
            let mut acc = [[0f32; 8]; 7];
            macro_rules! rows {
                ($kind:ident) => {
                    match m {
                        1 => chains256::<$kind, 1>(x, w.k, src, w.k * size, &mut acc),
                        2 => chains256::<$kind, 2>(x, w.k, src, w.k * size, &mut acc),
                        3 => chains256::<$kind, 3>(x, w.k, src, w.k * size, &mut acc),
                        4 => chains256::<$kind, 4>(x, w.k, src, w.k * size, &mut acc),
                        5 => chains256::<$kind, 5>(x, w.k, src, w.k * size, &mut acc),
                        6 => chains256::<$kind, 6>(x, w.k, src, w.k * size, &mut acc),
                        _ => chains256::<$kind, 7>(x, w.k, src, w.k * size, &mut acc),
                    }
                };
            }
            match kind {
                F32 => rows!(F32),
                BF16 => rows!(BF16),
                _ => rows!(F16),
            }
            for (r, a) in acc.iter().enumerate().take(m) {
                let at = r * w.n + p * NR + 8 * half;
                y[at..at + 8].copy_from_slice(a);
            }
        }
    }

    /// [`super::fused_rows`] for one whole panel `p` of a bf16 weight on AVX-512: each of its 16
    /// rows' next 32 steps are one 64-byte load, read as 16 pairs of neighbouring steps; a 16 × 16
    /// transpose of those 32-bit pairs gives each pair step's two words for the 16 columns, and
    /// the even step's f32 is the pair shifted up, the odd one's the pair with its low word
    /// cleared. That is a third of the 8 × 8 path's shuffles per value, which bound it. The chains
    /// are the same (one `fma` per step in order of `k`), so the bits are.
    ///
    /// # Safety
    /// AVX-512F; rows `16p..16p + 16` inside `w` (bf16); `x` holds `R` rows of `w.k`, `y` `R` of
    /// `w.n`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pairs_fused512<const R: usize>(x: &[f32], w: &Matrix<'_>, p: usize, y: &mut [f32]) {
        let (base, _, _) = storage(w);
        let (k, ld) = (w.k, 2 * w.k);
        let src = base.add(p * NR * ld);
        let xp = x.as_ptr();
        let high = _mm512_set1_epi32(-65536);
        let mut acc = [_mm512_setzero_ps(); R];
        for t in 0..k / 32 {
            let at = src.add(64 * t);
            let mut r = [_mm512_setzero_ps(); 16];
            for j in 0..16 {
                r[j] = _mm512_loadu_ps(at.add(j * ld).cast());
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(j * ld + PFD).cast());
            }
            let c = transpose16(r);
            for i in 0..16 {
                let pair = _mm512_castps_si512(c[i]);
                let even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
                let odd = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
                for q in 0..R {
                    let s = q * k + 32 * t + 2 * i;
                    acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(s)), even, acc[q]);
                    acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(s + 1)), odd, acc[q]);
                }
            }
        }
        for kk in 32 * (k / 32)..k {
            let cv = _mm512_loadu_ps(column::<BF16, NR>(src, ld, kk).as_ptr());
            for q in 0..R {
                acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(q * k + kk)), cv, acc[q]);
            }
        }
        for q in 0..R {
            _mm512_storeu_ps(y.as_mut_ptr().add(q * w.n + p * NR), acc[q]);
        }
    }

    /// [`super::fused_rows`] for one whole panel `p` of an f32 weight on AVX-512: 16 steps of its
    /// 16 rows per 16 × 16 transpose (a third fewer shuffles per value than 8 × 8), each row
    /// prefetched 512 bytes ahead (256 and 1,024 were slower).
    ///
    /// # Safety
    /// AVX-512F; rows `16p..16p + 16` inside `w` (f32); `x` holds `R` rows of `w.k`, `y` `R` of
    /// `w.n`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn f32_fused512<const R: usize>(x: &[f32], w: &Matrix<'_>, p: usize, y: &mut [f32]) {
        let (base, _, _) = storage(w);
        let (k, ld) = (w.k, 4 * w.k);
        let src = base.add(p * NR * ld);
        let xp = x.as_ptr();
        let mut acc = [_mm512_setzero_ps(); R];
        for t in 0..k / 16 {
            let at = src.add(64 * t);
            let mut r = [_mm512_setzero_ps(); 16];
            for j in 0..16 {
                r[j] = _mm512_loadu_ps(at.add(j * ld).cast());
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(j * ld + 2 * PFD).cast());
            }
            let c = transpose16(r);
            for i in 0..16 {
                for q in 0..R {
                    acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(q * k + 16 * t + i)), c[i], acc[q]);
                }
            }
        }
        for kk in 16 * (k / 16)..k {
            let cv = _mm512_loadu_ps(column::<F32, NR>(src, ld, kk).as_ptr());
            for q in 0..R {
                acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(q * k + kk)), cv, acc[q]);
            }
        }
        for q in 0..R {
            _mm512_storeu_ps(y.as_mut_ptr().add(q * w.n + p * NR), acc[q]);
        }
    }

    /// Step `kk` of `L` rows from `src` (`ld` bytes apart) in storage `KIND`, widened to f32: the
    /// decode chains' steps past their last whole transpose.
    #[inline]
    unsafe fn column<const KIND: u8, const L: usize>(src: *const u8, ld: usize, kk: usize) -> [f32; L] {
        std::array::from_fn(|j| {
            let at = src.add(j * ld);
            match KIND {
                F32 => at.cast::<f32>().add(kk).read_unaligned(),
                BF16 => f32::from_bits(u32::from(at.cast::<u16>().add(kk).read_unaligned()) << 16),
                _ => half::f16::from_bits(at.cast::<u16>().add(kk).read_unaligned()).to_f32(),
            }
        })
    }

    /// 8 values of storage `KIND` at `p`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load256<const KIND: u8>(p: *const u8) -> __m256 {
        match KIND {
            F32 => _mm256_loadu_ps(p.cast()),
            BF16 => {
                let raw = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
            }
            _ => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        }
    }

    /// The `R` rows' chains over all `k` steps of the 8 rows from `src` (`ld` bytes apart).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn chains256<const KIND: u8, const R: usize>(
        x: &[f32],
        k: usize,
        src: *const u8,
        ld: usize,
        out: &mut [[f32; 8]; 7],
    ) {
        let size = if KIND == F32 { 4 } else { 2 };
        let xp = x.as_ptr();
        let mut acc = [_mm256_setzero_ps(); R];
        let tiles = k / 8;
        for t in 0..tiles {
            let at = src.add(8 * t * size);
            let mut r = [_mm256_setzero_ps(); 8];
            for j in 0..8 {
                r[j] = load256::<KIND>(at.add(j * ld));
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(j * ld + PFD).cast());
            }
            let c = transpose8(r);
            for i in 0..8 {
                for q in 0..R {
                    let xv = _mm256_set1_ps(*xp.add(q * k + 8 * t + i));
                    acc[q] = _mm256_fmadd_ps(xv, c[i], acc[q]);
                }
            }
        }
        for kk in 8 * tiles..k {
            let cv = _mm256_loadu_ps(column::<KIND, 8>(src, ld, kk).as_ptr());
            for q in 0..R {
                acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(*xp.add(q * k + kk)), cv, acc[q]);
            }
        }
        for q in 0..R {
            _mm256_storeu_ps(out[q].as_mut_ptr(), acc[q]);
        }
    }

    /// [`pairs_fused512`] on AVX2, for one whole panel `p` of a bf16 weight: each row's next 16
    /// steps are one 32-byte load of 8 pairs, and an 8 × 8 transpose of the pairs gives each pair
    /// step's two words for 8 columns. The panel's two halves run side by side (two chains: one
    /// alone waits on its own `fma`s).
    ///
    /// # Safety
    /// AVX2 and FMA; rows `16p..16p + 16` inside `w` (bf16); `x` holds `R` rows of `w.k`, `y` `R`
    /// of `w.n`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn pairs_fused256<const R: usize>(x: &[f32], w: &Matrix<'_>, p: usize, y: &mut [f32]) {
        let (base, _, _) = storage(w);
        let (k, ld) = (w.k, 2 * w.k);
        let src = base.add(p * NR * ld);
        let xp = x.as_ptr();
        let high = _mm256_set1_epi32(-65536);
        let mut acc = [[_mm256_setzero_ps(); R]; 2];
        for t in 0..k / 16 {
            for half in 0..2 {
                let at = src.add(8 * half * ld + 32 * t);
                let mut r = [_mm256_setzero_ps(); 8];
                for j in 0..8 {
                    r[j] = _mm256_loadu_ps(at.add(j * ld).cast());
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(j * ld + PFD).cast());
                }
                let c = transpose8(r);
                for i in 0..8 {
                    let pair = _mm256_castps_si256(c[i]);
                    let even = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
                    let odd = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
                    for q in 0..R {
                        let s = q * k + 16 * t + 2 * i;
                        let a = &mut acc[half][q];
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*xp.add(s)), even, *a);
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*xp.add(s + 1)), odd, *a);
                    }
                }
            }
        }
        for half in 0..2 {
            for kk in 16 * (k / 16)..k {
                let cv = _mm256_loadu_ps(column::<BF16, 8>(src.add(8 * half * ld), ld, kk).as_ptr());
                for q in 0..R {
                    acc[half][q] = _mm256_fmadd_ps(_mm256_set1_ps(*xp.add(q * k + kk)), cv, acc[half][q]);
                }
            }
            for q in 0..R {
                _mm256_storeu_ps(y.as_mut_ptr().add(q * w.n + p * NR + 8 * half), acc[half][q]);
            }
        }
    }

    /// `c[i]` lane `j` = `r[j]` lane `i`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm256_setzero_ps(); 8];
        for g in 0..2 {
            u[4 * g] = _mm256_shuffle_ps::<0x44>(t[4 * g], t[4 * g + 2]);
            u[4 * g + 1] = _mm256_shuffle_ps::<0xEE>(t[4 * g], t[4 * g + 2]);
            u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(t[4 * g + 1], t[4 * g + 3]);
            u[4 * g + 3] = _mm256_shuffle_ps::<0xEE>(t[4 * g + 1], t[4 * g + 3]);
        }
        let mut c = [_mm256_setzero_ps(); 8];
        for q in 0..4 {
            c[q] = _mm256_permute2f128_ps::<0x20>(u[q], u[4 + q]);
            c[4 + q] = _mm256_permute2f128_ps::<0x31>(u[q], u[4 + q]);
        }
        c
    }
}

/// `y[r][16p..16p + 16] = x[r] · W[16p..16p + 16]ᵀ` for rows `0..m` (fewer than 8) and every
/// whole panel `p` of `p0..p1`, with the transpose and the chains fused (no packed block: decode
/// is bound by streaming the weight, and a pass through a buffer measured slower). Each output
/// is the one chain over `k` from 0.0, so its bits are the packed path's. Returns the first panel
/// it did not do (`p0` off x86; the caller packs those, and a partial last panel).
pub(super) fn fused_rows(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &Matrix<'_>,
    (p0, p1): (usize, usize),
    y: &mut [f32],
) -> usize {
    assert!(
        m < 8 && x.len() >= m * w.k && y.len() >= m * w.n,
        "rows of x and y"
    );
    let whole = (w.n / NR).min(p1);
    if !matches!(isa, Isa::Avx512 | Isa::Avx2) || p0 >= whole {
        return p0;
    }
    #[cfg(target_arch = "x86_64")]
    for p in p0..whole {
        match (isa, w.data) {
            (Isa::Avx512, RowMajor::Bf16(_) | RowMajor::F32(_)) => fused512(x, m, w, p, y),
            (Isa::Avx2, RowMajor::Bf16(_)) => pairs256(x, m, w, p, y),
            // SAFETY: `gemm_with` checked AVX2, FMA and F16C (AVX-512F CPUs have them); panel
            // `p` is whole (rows `16p..16p + 16` < n), `x` and `y` hold `m` rows (asserted above).
            _ => unsafe { x86::fused256(x, m, w, p, y) },
        }
    }
    whole
}

/// `x86::$kernel::<m>(x, w, p, y)` for the call's `m` (1..8) rows.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($kernel:ident, $x:expr, $m:expr, $w:expr, $p:expr, $y:expr) => {
        match $m {
            1 => x86::$kernel::<1>($x, $w, $p, $y),
            2 => x86::$kernel::<2>($x, $w, $p, $y),
            3 => x86::$kernel::<3>($x, $w, $p, $y),
            4 => x86::$kernel::<4>($x, $w, $p, $y),
            5 => x86::$kernel::<5>($x, $w, $p, $y),
            6 => x86::$kernel::<6>($x, $w, $p, $y),
            _ => x86::$kernel::<7>($x, $w, $p, $y),
        }
    };
}

/// Whole panel `p` of a bf16 ([`x86::pairs_fused512`]) or f32 ([`x86::f32_fused512`]) weight on
/// AVX-512, for `m` (1..8) rows.
#[cfg(target_arch = "x86_64")]
fn fused512(x: &[f32], m: usize, w: &Matrix<'_>, p: usize, y: &mut [f32]) {
    // SAFETY: `gemm_with` checked AVX-512F; panel `p` is whole (below `w.n / 16`), the weight's
    // kind is the kernel's, and `x` and `y` hold `m` rows (asserted by `fused_rows`).
    unsafe {
        match w.data {
            RowMajor::Bf16(_) => by_rows!(pairs_fused512, x, m, w, p, y),
            RowMajor::F32(_) => by_rows!(f32_fused512, x, m, w, p, y),
            RowMajor::F16(_) => unreachable!("f16 weights take the 8 × 8 path"),
        }
    }
}

/// Whole panel `p` of a bf16 weight on AVX2 ([`x86::pairs_fused256`]), for `m` (1..8) rows.
#[cfg(target_arch = "x86_64")]
fn pairs256(x: &[f32], m: usize, w: &Matrix<'_>, p: usize, y: &mut [f32]) {
    // SAFETY: `gemm_with` checked AVX2 and FMA; panel `p` is whole (below `w.n / 16`), the weight
    // is bf16, and `x` and `y` hold `m` rows (asserted by `fused_rows`).
    unsafe { by_rows!(pairs_fused256, x, m, w, p, y) }
}
