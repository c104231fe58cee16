//! This machine's f32 FMA peak, measured: what "GEMM at N% of peak" is relative to.
//!
//! Every rayon thread runs independent fused multiply-adds on 12 register accumulators (no memory
//! traffic, no dependency stalls) with the widest FMA the CPU has, and the FLOPs of all threads over
//! the wall time are the peak. Turbo and neighbours on a shared machine move it, so tools measure it
//! in the same run as the GEMM they compare with it (`recall generate --profile` does).

use std::time::Instant;

/// Independent accumulators per thread: enough to cover the FMA latency of two pipes.
const ACCUMULATORS: usize = 12;

/// GFLOP/s of f32 FMAs on all rayon threads (2 FLOP per lane), the best of a few short runs of
/// about `millis` each; `None` without a vector FMA (AVX-512F or AVX2+FMA on x86-64).
///
/// ```
/// if let Some(peak) = recall::backend::cpu::peak::fma_peak_gflops(20) {
///     assert!(peak > 0.0);
/// }
/// ```
pub fn fma_peak_gflops(millis: u64) -> Option<f64> {
    let lanes = lanes()?;
    // Calibrate the iteration count to about `millis` per run on one thread.
    let mut iters = 100_000usize;
    loop {
        let t = Instant::now();
        std::hint::black_box(run(lanes, iters));
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if ms >= millis as f64 / 4.0 || iters > 1 << 32 {
            iters = (iters as f64 * millis as f64 / ms.max(1e-3)).max(1.0) as usize;
            break;
        }
        iters *= 4;
    }
    let best = (0..3)
        .map(|_| {
            let t = Instant::now();
            let flops = fma_burst(iters).unwrap_or(0);
            flops as f64 / t.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max);
    Some(best / 1e9)
}

/// One burst: `iters` steps of the FMA loop on every rayon thread at once; the FLOPs done, or `None`
/// without a vector FMA. (`cargo bench --bench gemm -- peak` times it.)
pub fn fma_burst(iters: usize) -> Option<u64> {
    let lanes = lanes()?;
    let threads = rayon::broadcast(|_| std::hint::black_box(run(lanes, iters))).len();
    Some((threads * iters * ACCUMULATORS * lanes * 2) as u64)
}

/// f32 lanes of the widest vector FMA, if any.
fn lanes() -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(16);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Some(8);
        }
    }
    None
}

fn run(lanes: usize, iters: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `lanes()` detected the instruction set of the loop it picked.
        unsafe {
            if lanes == 16 {
                return x86::fma_avx512(iters);
            }
            return x86::fma_avx2(iters);
        }
    }
    #[allow(unreachable_code)]
    {
        let _ = (lanes, iters);
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::ACCUMULATORS;

    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(iters: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(1.0); ACCUMULATORS];
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let s = acc.iter().fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        // The sum is returned so that the loop is not optimised away.
        _mm512_reduce_add_ps(s)
    }

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(iters: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); ACCUMULATORS];
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let s = acc.iter().fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x));
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }
}
