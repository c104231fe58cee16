//! The scorer MLP's kernels: dense layers with a fused exact GELU, portable and AVX2+FMA.

/// Output columns per register block of the dense kernel.
pub(super) const LANES: usize = 16;
/// Rows per block of the dense kernel.
pub(super) const ROWS: usize = 4;

/// The AVX2+FMA version of [`dense`]: a 4-row × 16-column register tile, GELU on the vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dense_avx2(
    input: &[[f32; ROWS]],
    weights: &[[f32; LANES]],
    n_in: usize,
    bias: &[f32],
    out: &mut [[f32; ROWS]],
) {
    use std::arch::x86_64::*;
    let input = &input[..n_in.min(input.len())];
    for ((blk, out_blk), bias_blk) in weights
        .chunks_exact(n_in)
        .zip(out.chunks_exact_mut(LANES))
        .zip(bias.chunks_exact(LANES))
    {
        let mut acc = [_mm256_setzero_ps(); 2 * ROWS];
        for (wk, ak) in blk.iter().zip(input) {
            // SAFETY: `wk` is a [f32; 16]; both 8-float loads stay inside it.
            let (w0, w1) = unsafe { (_mm256_loadu_ps(wk.as_ptr()), _mm256_loadu_ps(wk.as_ptr().add(8))) };
            for r in 0..ROWS {
                let a = _mm256_set1_ps(ak[r]);
                acc[2 * r] = _mm256_fmadd_ps(a, w0, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(a, w1, acc[2 * r + 1]);
            }
        }
        // SAFETY: `bias_blk` has 16 floats.
        let (b0, b1) = unsafe {
            (
                _mm256_loadu_ps(bias_blk.as_ptr()),
                _mm256_loadu_ps(bias_blk.as_ptr().add(8)),
            )
        };
        let mut tile = [[0f32; LANES]; ROWS];
        for r in 0..ROWS {
            let lo = gelu_avx2(_mm256_add_ps(acc[2 * r], b0));
            let hi = gelu_avx2(_mm256_add_ps(acc[2 * r + 1], b1));
            // SAFETY: `tile[r]` has 16 floats.
            unsafe {
                _mm256_storeu_ps(tile[r].as_mut_ptr(), lo);
                _mm256_storeu_ps(tile[r].as_mut_ptr().add(8), hi);
            }
        }
        for (l, o) in out_blk.iter_mut().enumerate() {
            for r in 0..ROWS {
                o[r] = tile[r][l];
            }
        }
    }
}

/// [`gelu`] on 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) fn gelu_avx2(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = _mm256_set1_ps;
    let z = _mm256_mul_ps(v, c(std::f32::consts::FRAC_1_SQRT_2));
    let x = _mm256_min_ps(_mm256_max_ps(z, c(-4.0)), c(4.0));
    let x2 = _mm256_mul_ps(x, x);
    let mut p = _mm256_fmadd_ps(x2, c(ERF_P[0]), c(ERF_P[1]));
    for &k in &ERF_P[2..] {
        p = _mm256_fmadd_ps(x2, p, c(k));
    }
    p = _mm256_mul_ps(p, x);
    let mut q = _mm256_fmadd_ps(x2, c(ERF_Q[0]), c(ERF_Q[1]));
    for &k in &ERF_Q[2..] {
        q = _mm256_fmadd_ps(x2, q, c(k));
    }
    let erf = _mm256_div_ps(p, q);
    _mm256_mul_ps(_mm256_mul_ps(c(0.5), v), _mm256_add_ps(c(1.0), erf))
}

/// Numerator coefficients of the rational erf, highest power first (odd polynomial / x).
const ERF_P: [f32; 7] = [
    -2.726_142_3e-10,
    2.770_681_4e-8,
    -2.101_024e-6,
    -5.692_506_4e-5,
    -7.349_906_3e-4,
    -2.954_600_1e-3,
    -1.609_603_3e-2,
];
/// Denominator coefficients (even polynomial), highest power first.
const ERF_Q: [f32; 5] = [
    -1.456_607_2e-5,
    -2.133_740_6e-4,
    -1.682_827e-3,
    -7.373_329_2e-3,
    -1.426_474e-2,
];

#[inline(always)]
pub(super) fn madd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
    if FMA {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

/// `out[j][r] = gelu(bias[j] + Σ_k input[k][r] · W[j][k])` for a block of `ROWS` rows; `weights` holds
/// `LANES`-wide column blocks of `n_in` inputs each.
#[inline(always)]
pub(super) fn dense<const FMA: bool>(
    input: &[[f32; ROWS]],
    weights: &[[f32; LANES]],
    n_in: usize,
    bias: &[f32],
    out: &mut [[f32; ROWS]],
) {
    let input = &input[..n_in.min(input.len())];
    for ((blk, out_blk), bias_blk) in weights
        .chunks_exact(n_in)
        .zip(out.chunks_exact_mut(LANES))
        .zip(bias.chunks_exact(LANES))
    {
        let mut acc = [[0f32; LANES]; ROWS];
        for (wk, ak) in blk.iter().zip(input) {
            for r in 0..ROWS {
                for l in 0..LANES {
                    acc[r][l] = madd::<FMA>(acc[r][l], ak[r], wk[l]);
                }
            }
        }
        for (l, (o, &b)) in out_blk.iter_mut().zip(bias_blk).enumerate() {
            for r in 0..ROWS {
                o[r] = gelu(acc[r][l] + b);
            }
        }
    }
}

/// Exact GELU `x · Φ(x)` with a rational erf (max abs error ≈ 4e-7 in f32, the Eigen/XLA form).
#[inline(always)]
pub(super) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

#[inline(always)]
pub(super) fn erf(a: f32) -> f32 {
    let x = a.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * ERF_P[0] + ERF_P[1];
    for &k in &ERF_P[2..] {
        p = x2 * p + k;
    }
    p *= x;
    let mut q = x2 * ERF_Q[0] + ERF_Q[1];
    for &k in &ERF_Q[2..] {
        q = x2 * q + k;
    }
    p / q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_accurate() {
        let mut worst = 0f64;
        for i in -60000..=60000 {
            let x = i as f64 / 10000.0;
            worst = worst.max((erf(x as f32) as f64 - libm::erf(x)).abs());
        }
        assert!(worst < 5e-7, "max erf error {worst}");
    }
}
