//! The CPU GEMM (`linear`) in GFLOP/s: a 2048³ product (prefill-shaped), the Qwen3-VL-2B MLP
//! projections at 1,278 rows, and single-row decode (memory-bound), for f32 and bf16 weights.
//! `peak` measures this machine's f32 FMA peak (`recall::backend::cpu::peak`): independent FMAs in
//! registers on every thread. `cargo bench --bench gemm`; `tools/cpu_compare.py` measures PyTorch's 2048³ matmul.

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

fn peak(c: &mut Criterion) {
    let iters = 1_000_000;
    let Some(flops) = recall::backend::cpu::peak::fma_burst(1) else {
        return; // no vector FMA on this CPU
    };
    let mut g = c.benchmark_group("peak");
    g.sample_size(10);
    g.throughput(Throughput::Elements(flops * iters as u64));
    let threads = rayon::current_num_threads();
    g.bench_function(format!("fma_{threads}_threads"), |b| {
        b.iter(|| recall::backend::cpu::peak::fma_burst(iters))
    });
    g.finish();
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
