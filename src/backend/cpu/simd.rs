//! Wide registers for the CPU backend's loops without giving up a bit of determinism.
//!
//! [`multiversion!`] compiles one function body several times — for AVX-512F, for AVX2 and for the
//! baseline — and picks the widest the CPU has at run time. The body is ordinary scalar Rust; the
//! compiler vectorises it where it can. Every element still goes through the same IEEE operations
//! in the same order (Rust never reassociates or contracts floating-point arithmetic), so all
//! versions give the same bits: the width only changes how many elements are done at once.
//!
//! [`exp`] is a polynomial `exp` made of such operations only, so that it vectorises too (the
//! platform's `expf` is a call per element) and gives the same bits everywhere.

/// Defines `fn NAME(args) -> ret` whose body is compiled for AVX-512F, AVX2 and the baseline, and
/// dispatched at run time (see the module docs for why the results are identical).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? $body
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? $body
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2.
                    return unsafe { avx2($($arg),*) };
                }
            }
            #[inline(always)]
            fn baseline($($arg: $ty),*) $(-> $ret)? $body
            baseline($($arg),*)
        }
    };
}
pub(super) use multiversion;

/// Lanes of the dot-product accumulator: fixed, so that the order of additions never depends on
/// the machine or the batch.
const LANES: usize = 16;

/// `Σ a[i]·b[i]` (`a` and `b` of equal length): 16 partial sums, lane `l` adding the products of
/// elements `l, l + 16, l + 32, ...` in order (each product rounded, then added), then combined
/// pairwise (`s[l] += s[l + 8]`, then `+4`, `+2`, `+1`). The AVX-512 and AVX2 versions do exactly
/// these operations, 16 or 8 lanes at a time.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; both slices hold `n` elements.
            return unsafe { x86::dot_avx512(a.as_ptr(), b.as_ptr(), n) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2; both slices hold `n` elements.
            return unsafe { x86::dot_avx2(a.as_ptr(), b.as_ptr(), n) };
        }
    }
    dot_scalar(&a[..n], &b[..n])
}

/// [`dot`]'s definition, one lane at a time.
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    combine_lanes(acc)
}

/// The 16 lanes of a sum combined pairwise, `acc[l] += acc[l + 8]`, `+4`, `+2`, `+1`: the order
/// every 16-lane reduction here (the dot product, both softmaxes) shares, so their bits agree.
#[inline(always)]
pub(crate) fn combine_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    use std::arch::x86_64::*;

    /// `s[l] += s[l + 4]`, `+2`, `+1` on the 4 lanes of `v`; lane 0.
    #[inline(always)]
    unsafe fn tree4(v: __m128) -> f32 {
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v)); // l += l + 2
        let v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 0b01)); // 0 += 1
        _mm_cvtss_f32(v)
    }

    /// # Safety
    /// AVX-512F; `a` and `b` point to `n` floats.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = _mm512_setzero_ps();
        let full = n / 16 * 16;
        let mut i = 0;
        while i < full {
            acc = _mm512_add_ps(
                acc,
                _mm512_mul_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i))),
            );
            i += 16;
        }
        if full < n {
            let m: __mmask16 = (1u32 << (n - full)) as u16 - 1;
            let prod = _mm512_mul_ps(
                _mm512_maskz_loadu_ps(m, a.add(full)),
                _mm512_maskz_loadu_ps(m, b.add(full)),
            );
            acc = _mm512_mask_add_ps(acc, m, acc, prod);
        }
        tree16(acc)
    }

    /// The pairwise combination of 16 lanes: `l += l + 8`, `+4`, `+2`, `+1`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tree16(acc: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
        let v8 = _mm256_add_ps(lo, hi);
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        tree4(v4)
    }

    /// # Safety
    /// AVX2; `a` and `b` point to `n` floats.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_avx2(a: *const f32, b: *const f32, n: usize) -> f32 {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let full = n / 16 * 16;
        let mut i = 0;
        while i < full {
            lo = _mm256_add_ps(
                lo,
                _mm256_mul_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i))),
            );
            hi = _mm256_add_ps(
                hi,
                _mm256_mul_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8))),
            );
            i += 16;
        }
        let rest = n - full;
        if rest > 0 {
            // Lanes past the end stay as they are (a masked add, not an add of 0.0).
            let lanes = |base: usize| {
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                _mm256_cmpgt_epi32(_mm256_set1_epi32(rest as i32 - base as i32), idx)
            };
            let (mlo, mhi) = (lanes(0), lanes(8));
            let plo = _mm256_mul_ps(
                _mm256_maskload_ps(a.add(full), mlo),
                _mm256_maskload_ps(b.add(full), mlo),
            );
            lo = _mm256_blendv_ps(lo, _mm256_add_ps(lo, plo), _mm256_castsi256_ps(mlo));
            if rest > 8 {
                let phi = _mm256_mul_ps(
                    _mm256_maskload_ps(a.add(full + 8), mhi),
                    _mm256_maskload_ps(b.add(full + 8), mhi),
                );
                hi = _mm256_blendv_ps(hi, _mm256_add_ps(hi, phi), _mm256_castsi256_ps(mhi));
            }
        }
        let v8 = _mm256_add_ps(lo, hi); // l += l + 8
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1)); // l += l + 4
        tree4(v4)
    }
}

/// `e^x` to within about 1 ulp (Cephes' `expf`: `x = n·ln 2 + r`, a degree-5 polynomial in `r`,
/// scaled by `2^n`); 0 below -87.3 (no subnormal results), `inf` above 88 (where `e^x` would be
/// within a factor 2 of `f32::MAX`), NaN for NaN.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * z + r + 1.0;
    // 2^n from n's bits: n is an integer in [-126, 127] (x clamped), so n + 1.5·2²³ is exact and
    // its low mantissa bits are n in two's complement. Bitwise `(n as i32 + 127) << 23`, but
    // without `as`'s saturation, which does not vectorise (a NaN's bits go to the NaN branch).
    let magic = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
    let scale = f32::from_bits(magic.wrapping_add(127) << 23);
    let e = y * scale;
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

#[cfg(test)]
mod tests {
    use super::{dot, dot_scalar, exp};

    #[test]
    fn dot_is_its_definition_on_every_path_and_length() {
        let mut rng = fastrand::Rng::with_seed(9);
        for n in (0..70).chain([128, 1000, 1001]) {
            let a: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let want = dot_scalar(&a, &b).to_bits();
            assert_eq!(dot(&a, &b).to_bits(), want, "n = {n}");
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: checked above; the slices hold n floats.
                    let got = unsafe { super::x86::dot_avx512(a.as_ptr(), b.as_ptr(), n) };
                    assert_eq!(got.to_bits(), want, "avx512, n = {n}");
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: checked above.
                    let got = unsafe { super::x86::dot_avx2(a.as_ptr(), b.as_ptr(), n) };
                    assert_eq!(got.to_bits(), want, "avx2, n = {n}");
                }
            }
        }
    }

    #[test]
    fn exp_is_within_an_ulp_or_two_and_handles_the_edges() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "max relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_scale_bits_are_the_integer_conversion() {
        // Every n the clamped input can give: the bit trick in `exp` is `(n as i32 + 127) << 23`.
        for n in -126..=127 {
            let magic = (n as f32 + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
            assert_eq!(magic.wrapping_add(127) << 23, ((n + 127) as u32) << 23, "n = {n}");
        }
        // Both ends of the clamp reach those n and no further.
        let n = |x: f32| (x.clamp(-87.3, 88.0) * std::f32::consts::LOG2_E + 0.5).floor();
        assert_eq!((n(f32::NEG_INFINITY), n(f32::INFINITY)), (-126.0, 127.0));
    }

    multiversion! {
        fn exps(xs: &mut [f32]) {
            xs.iter_mut().for_each(|x| *x = exp(*x));
        }
    }

    #[test]
    fn every_version_gives_the_same_bits() {
        let xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.0437).collect();
        let mut wide = xs.clone();
        exps(&mut wide);
        let scalar: Vec<f32> = xs.iter().map(|&x| exp(x)).collect();
        assert_eq!(
            wide.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            scalar.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}
