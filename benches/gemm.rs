//! The CPU GEMM (`linear`) in GFLOP/s: a 2048³ product (prefill-shaped), the Qwen3-VL-2B MLP
//! projections at 1,278 rows, and single-row decode (memory-bound), for f32 and bf16 weights.
//! `peak` measures this machine's f32 FMA peak: independent AVX-512 FMAs in registers on every
//! thread. `cargo bench --bench gemm`; `tools/cpu_compare.py` measures PyTorch's 2048³ matmul.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use recall::backend::cpu::gemm::{gemm, Elem, Packed, RowBits};

fn packed(n: usize, k: usize, elem: Elem) -> Packed {
    let mut rng = fastrand::Rng::with_seed(3);
    let rows: Vec<Vec<f32>> = (0..n)
        .map(|_| (0..k).map(|_| rng.f32() - 0.5).collect())
        .collect();
    Packed::new(n, k, elem, |c| match elem {
        Elem::F32 => RowBits::F32(rows[c].clone()),
        _ => RowBits::Half(
            rows[c]
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect(),
        ),
    })
}

/// FMAs of 12 independent register accumulators, `iters` times: the machine's f32 FMA peak on one
/// core (no memory traffic), 2 FLOP per lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(1.0); 12];
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

fn peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let iters = 1_000_000;
        let threads = rayon::current_num_threads();
        let mut g = c.benchmark_group("peak");
        g.sample_size(10);
        // FLOPs: threads · iters · 12 registers · 16 lanes · 2.
        g.throughput(Throughput::Elements((threads * iters * 12 * 16 * 2) as u64));
        g.bench_function(format!("fma_avx512_{threads}_threads"), |b| {
            b.iter(|| {
                // SAFETY: the CPU has AVX-512F (checked above).
                rayon::broadcast(|_| unsafe { fma_loop(iters) })
            })
        });
        g.finish();
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("gemm");
    g.sample_size(10);
    for &(m, n, k, name) in &[
        (2048, 2048, 2048, "2048^3"),
        (1278, 6144, 2048, "2b_up_1278"),
        (1278, 2048, 6144, "2b_down_1278"),
        (1, 6144, 2048, "2b_up_decode"),
    ] {
        for (elem, label) in [(Elem::F32, "f32"), (Elem::Bf16, "bf16")] {
            let w = packed(n, k, elem);
            let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32) * 0.01 - 0.4).collect();
            let mut y = vec![0f32; m * n];
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            g.bench_with_input(BenchmarkId::new(name, label), &(), |b, _| {
                b.iter(|| gemm(&x, m, &w, None, &mut y))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, peak, bench);
criterion_main!(benches);
