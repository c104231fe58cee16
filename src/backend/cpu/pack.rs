//! Packing a block of a row-major weight into the GEMM's f32 panels (`gemm.rs`): panel `p` of the
//! block is `[kc][16]`, its step `kk`, lane `j` being `W[16p + j][k0 + kk]` widened to f32 (zero
//! for columns past `n`). A transposed copy: exact on every path, so the instruction set only
//! changes how fast it is. AVX-512F transposes 16 × 16 tiles in registers, AVX2 8 × 8; the others
//! copy one element at a time.

use super::gemm::{Isa, Matrix, RowMajor, NR};

/// Packs panels `s0..s1`, steps `k0..k0 + kc`, of `w` into `dst` (`(s1 - s0) · kc · 16` values).
pub(super) fn panels(isa: Isa, w: &Matrix<'_>, (s0, s1): (usize, usize), (k0, kc): (usize, usize), dst: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    use std::arch::x86_64::*;

    use super::{Matrix, RowMajor, NR};

    /// The first `kc - kc % 16` steps of one panel (rows `c0..c0 + rows`, zero past `rows`), as
    /// 16 × 16 transposes; returns how many steps it packed. Little-endian: the 16-bit words are
    /// loaded as they lie.
    ///
    /// # Safety
    /// AVX-512F; rows `c0..c0 + rows` and steps `k0..k0 + kc` inside `w`; `panel` holds `kc · 16`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel512(w: &Matrix<'_>, c0: usize, rows: usize, k0: usize, kc: usize, panel: &mut [f32]) -> usize {
        let tiles = kc / 16;
        let out = panel.as_mut_ptr();
        for t in 0..tiles {
            let mut r = [_mm512_setzero_ps(); 16];
            for j in 0..rows {
                let at = (c0 + j) * w.k + k0 + 16 * t;
                r[j] = match w.data {
                    RowMajor::F32(v) => _mm512_loadu_ps(v.as_ptr().add(at)),
                    RowMajor::Bf16(b) => {
                        let raw = _mm256_loadu_si256(b.as_ptr().add(2 * at).cast());
                        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
                    }
                    RowMajor::F16(b) => _mm512_cvtph_ps(_mm256_loadu_si256(b.as_ptr().add(2 * at).cast())),
                };
            }
            let c = transpose16(r);
            for i in 0..16 {
                _mm512_storeu_ps(out.add((16 * t + i) * NR), c[i]);
            }
        }
        16 * tiles
    }

    /// `c[i]` lane `j` = `r[j]` lane `i`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
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
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn panel256(w: &Matrix<'_>, c0: usize, rows: usize, k0: usize, kc: usize, panel: &mut [f32]) -> usize {
        let tiles = kc / 8;
        let out = panel.as_mut_ptr();
        for half in 0..2 {
            for t in 0..tiles {
                let mut r = [_mm256_setzero_ps(); 8];
                for j in 0..rows.saturating_sub(8 * half).min(8) {
                    let at = (c0 + 8 * half + j) * w.k + k0 + 8 * t;
                    r[j] = match w.data {
                        RowMajor::F32(v) => _mm256_loadu_ps(v.as_ptr().add(at)),
                        RowMajor::Bf16(b) => {
                            let raw = _mm_loadu_si128(b.as_ptr().add(2 * at).cast());
                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                        }
                        RowMajor::F16(b) => _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(2 * at).cast())),
                    };
                }
                let c = transpose8(r);
                for i in 0..8 {
                    _mm256_storeu_ps(out.add((8 * t + i) * NR + 8 * half), c[i]);
                }
            }
        }
        8 * tiles
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
