//! The CPU GEMM (`linear`) in GFLOP/s: a 2048³ product (prefill-shaped), the Qwen3-VL-2B MLP
//! projections at 1,278 rows, and single-row decode (memory-bound), for f32 and bf16 weights.
//! `peak` measures this machine's f32 FMA peak (`recall::backend::cpu::peak`): independent FMAs in
//! registers on every thread. `read` measures the memory read bandwidth decode is bound by: every
//! thread sums its share of a 2 GiB buffer (larger than any cache; about the 2B shape's f32 weights
//! at 4 layers, `lm_head` included). `cargo bench --bench gemm`; `tools/cpu_compare.py` measures
//! PyTorch's 2048³ matmul. `gemm_bf16_dot_*` times the opt-in bf16 products where the CPU has them.
//! `gated` times a SwiGLU MLP's gate and up with their product, fused (`gemm_gated`) and as two
//! products then an elementwise pass, on each path. `decode_shared` times a decode step's products
//! that share an input (q, k and v; gate and up) over 8 layers' distinct weights (more than the
//! caches hold), as one `gemm_shared` pass each and as one `gemm` per weight. `pack` times packing
//! the 2B MLP's up projection into decode panels (`Panels::pack`, what `recall serve` does to each
//! decoder weight at load), fresh memory included.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use recall::backend::cpu::gemm::{
    gemm, gemm_bf16_dot, gemm_gated, gemm_shared, set_bf16_dot, Bf16Kernel, Matrix, Panels, RowMajor,
};

/// A random weight `[n, k]` as a checkpoint stores it: f32 values or bf16 little-endian bytes.
enum Stored {
    F32(Vec<f32>),
    Bf16(Vec<u8>),
}

fn stored(n: usize, k: usize, bf16: bool) -> Stored {
    let mut rng = fastrand::Rng::with_seed(3);
    let v: Vec<f32> = (0..n * k).map(|_| rng.f32() - 0.5).collect();
    if bf16 {
        Stored::Bf16(
            v.iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        )
    } else {
        Stored::F32(v)
    }
}

fn matrix(s: &Stored, n: usize, k: usize) -> Matrix<'_> {
    match s {
        Stored::F32(v) => Matrix::new(n, k, RowMajor::F32(v)),
        Stored::Bf16(b) => Matrix::new(n, k, RowMajor::Bf16(b)),
    }
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

fn read(c: &mut Criterion) {
    use rayon::prelude::*;
    let words: Vec<u64> = (0..(2usize << 30) / 8).map(|i| i as u64).collect();
    let mut g = c.benchmark_group("read");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((words.len() * 8) as u64));
    let threads = rayon::current_num_threads();
    g.bench_function(format!("2GiB_{threads}_threads"), |b| {
        b.iter(|| {
            // Integer sums vectorize (no rounding order to keep), so the loop is load-bound.
            let chunk = words.len().div_ceil(threads);
            words
                .par_chunks(chunk)
                .map(|c| c.iter().fold(0u64, |a, &w| a.wrapping_add(w)))
                .reduce(|| 0, u64::wrapping_add)
        })
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
        (1, 151936, 2048, "2b_lm_head_decode"),
    ] {
        for (bf16, label) in [(false, "f32"), (true, "bf16")] {
            let s = stored(n, k, bf16);
            let w = matrix(&s, n, k);
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

/// The opt-in bf16 products (`--cpu-bf16-dot`) on the kernel this CPU picks (AMX where it has
/// it), at the prefill shapes: the GEMM whose speed `--cpu-bf16-dot` prefills at.
fn bench_bf16_dot(c: &mut Criterion) {
    let Some(kernel) = Bf16Kernel::detect() else {
        return; // no AVX512-BF16 on this CPU
    };
    let mut g = c.benchmark_group(format!("gemm_bf16_dot_{kernel:?}"));
    g.sample_size(10);
    for &(m, n, k, name) in &[
        (2048, 2048, 2048, "2048^3"),
        (1278, 6144, 2048, "2b_up_1278"),
        (1278, 2048, 6144, "2b_down_1278"),
        (1278, 1024, 2048, "2b_kv_1278"),
        (8, 6144, 2048, "2b_up_8_rows"),
    ] {
        let s = stored(n, k, true);
        let w = matrix(&s, n, k);
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32) * 0.01 - 0.4).collect();
        let mut y = vec![0f32; m * n];
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        g.bench_function(name, |b| b.iter(|| gemm_bf16_dot(&x, m, &w, None, &mut y)));
    }
    g.finish();
}

/// The 2B MLP's gate and up at 1,278 rows with `silu(g) · u`: `gemm_gated` against the two
/// products (`gemm_shared`) and a pass over their outputs, in f32 and bf16 (exact), and on the
/// bf16 kernel (`--cpu-bf16-dot`) where the CPU has one.
fn bench_gated(c: &mut Criterion) {
    use rayon::prelude::*;
    let silu_mul = |g: &mut [f32], u: &[f32]| {
        g.iter_mut()
            .zip(u)
            .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u)
    };
    let (m, n, k) = (1278, 6144, 2048);
    let mut g = c.benchmark_group("gated");
    g.sample_size(10);
    g.throughput(Throughput::Elements((4 * m * n * k) as u64));
    let modes = [
        ("f32", false, false),
        ("bf16", true, false),
        ("bf16_dot", true, true),
    ];
    for (label, bf16, dot) in modes {
        if dot && set_bf16_dot(true).is_err() {
            continue; // no AVX512-BF16 on this CPU
        }
        let (sg, su) = (stored(n, k, bf16), stored(n, k, bf16));
        let (wg, wu) = (matrix(&sg, n, k), matrix(&su, n, k));
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32) * 0.01 - 0.4).collect();
        let (mut yg, mut yu) = (vec![0f32; m * n], vec![0f32; m * n]);
        g.bench_function(BenchmarkId::new("separate", label), |b| {
            b.iter(|| {
                gemm_shared(&x, m, &mut [(&wg, None, &mut yg), (&wu, None, &mut yu)]);
                yg.par_chunks_mut(4096)
                    .zip(yu.par_chunks(4096))
                    .for_each(|(g, u)| silu_mul(g, u));
            })
        });
        g.bench_function(BenchmarkId::new("fused", label), |b| {
            b.iter(|| gemm_gated(&x, m, (&wg, None), (&wu, None), &mut yg, silu_mul))
        });
        set_bf16_dot(false).expect("turning it off always works");
    }
    g.finish();
}

/// `Panels::pack` of the 2B MLP's up projection, f32 and bf16: a fresh buffer each time, as a
/// load packs each weight once.
fn bench_pack(c: &mut Criterion) {
    let (n, k) = (6144, 2048);
    let mut g = c.benchmark_group("pack");
    g.sample_size(10);
    for (bf16, label) in [(false, "f32"), (true, "bf16")] {
        let s = stored(n, k, bf16);
        let w = matrix(&s, n, k);
        g.throughput(Throughput::Bytes((n * k * if bf16 { 2 } else { 4 }) as u64));
        g.bench_function(BenchmarkId::new("2b_up", label), |b| b.iter(|| Panels::pack(&w)));
    }
    g.finish();
}

/// One decode row by the 2B shape's q, k, v, gate and up of 8 layers (1.07 GB in f32): each
/// layer's products on one input as one `gemm_shared` pass (`shared`) and as a `gemm` per weight
/// (`separate`), exact in f32 and bf16, and on the bf16 kernel where the CPU has one.
fn bench_decode_shared(c: &mut Criterion) {
    let (k, layers) = (2048, 8);
    let shapes = [
        (2048, "q"),
        (1024, "k"),
        (1024, "v"),
        (6144, "gate"),
        (6144, "up"),
    ];
    let mut g = c.benchmark_group("decode_shared");
    g.sample_size(10);
    for (label, bf16, dot) in [
        ("f32", false, false),
        ("bf16", true, false),
        ("bf16_dot", true, true),
    ] {
        if dot && set_bf16_dot(true).is_err() {
            continue; // no AVX512-BF16 on this CPU
        }
        let stores: Vec<Vec<Stored>> = (0..layers)
            .map(|_| shapes.iter().map(|&(n, _)| stored(n, k, bf16)).collect())
            .collect();
        let mats: Vec<Vec<Matrix<'_>>> = stores
            .iter()
            .map(|l| {
                l.iter()
                    .zip(&shapes)
                    .map(|(s, &(n, _))| matrix(s, n, k))
                    .collect()
            })
            .collect();
        let x: Vec<f32> = (0..k).map(|i| ((i % 97) as f32) * 0.01 - 0.4).collect();
        let mut ys: Vec<Vec<f32>> = shapes.iter().map(|&(n, _)| vec![0f32; n]).collect();
        let bytes: usize = shapes
            .iter()
            .map(|&(n, _)| n * k * if bf16 { 2 } else { 4 })
            .sum();
        g.throughput(Throughput::Bytes((bytes * layers) as u64));
        for shared in [false, true] {
            let name = if shared { "shared" } else { "separate" };
            g.bench_function(BenchmarkId::new(name, label), |b| {
                b.iter(|| {
                    for w in &mats {
                        let [q, kk, v, gate, up] = &mut ys[..] else {
                            unreachable!("five outputs")
                        };
                        let mut qkv = [
                            (&w[0], None, &mut q[..]),
                            (&w[1], None, &mut kk[..]),
                            (&w[2], None, &mut v[..]),
                        ];
                        let mut mlp = [(&w[3], None, &mut gate[..]), (&w[4], None, &mut up[..])];
                        for jobs in [&mut qkv[..], &mut mlp[..]] {
                            if shared {
                                gemm_shared(&x, 1, jobs);
                            } else {
                                for (w, _, y) in jobs.iter_mut() {
                                    gemm(&x, 1, w, None, y);
                                }
                            }
                        }
                    }
                })
            });
        }
        set_bf16_dot(false).expect("turning it off always works");
    }
    g.finish();
}

criterion_group!(
    benches,
    peak,
    read,
    bench,
    bench_bf16_dot,
    bench_gated,
    bench_decode_shared,
    bench_pack
);
criterion_main!(benches);
