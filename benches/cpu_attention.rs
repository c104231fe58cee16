//! CPU attention at Qwen3-VL-2B's shape (16 query heads, 8 KV heads, head_dim 128): a causal
//! prefill of 1,206 tokens over the paged pool, one decode row at 1,206 tokens of context, and the
//! vision tower's non-causal segments; each exact (`cpu_attention`) and, where the CPU has AMX, with
//! bf16 products (`cpu_attention_bf16`, `--cpu-bf16-attention`). `cargo bench --bench cpu_attention`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use recall::backend::cpu::CpuBackend;
use recall::backend::{AttnShape, Backend, PagedSeq};

fn random(be: &CpuBackend, rows: usize, cols: usize, seed: u64) -> recall::backend::cpu::CpuTensor {
    let mut rng = fastrand::Rng::with_seed(seed);
    let data: Vec<f32> = (0..rows * cols).map(|_| rng.f32() - 0.5).collect();
    be.upload(&data, rows, cols).unwrap()
}

fn bench(c: &mut Criterion) {
    recall::backend::cpu::set_bf16_attention(false).unwrap();
    group(c, "cpu_attention");
    if recall::backend::cpu::set_bf16_attention(true).is_ok() {
        group(c, "cpu_attention_bf16");
        recall::backend::cpu::set_bf16_attention(false).unwrap();
    }
}

/// One group of the four cases, on what the switch says.
fn group(c: &mut Criterion, name: &str) {
    let be = CpuBackend;
    let (qh, kvh, d, bs, n): (usize, usize, usize, usize, usize) = (16, 8, 128, 16, 1206);
    let shape = AttnShape {
        q_heads: qh,
        kv_heads: kvh,
        head_dim: d,
        block_size: bs,
    };
    let blocks: Vec<u32> = (0..n.div_ceil(bs) as u32).collect();
    let k = random(&be, blocks.len() * bs, kvh * d, 1);
    let v = random(&be, blocks.len() * bs, kvh * d, 2);
    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    let q = random(&be, n, qh * d, 3);
    let seqs = [PagedSeq {
        rows: n,
        context_len: n,
        block_table: &blocks,
    }];
    g.throughput(Throughput::Elements((4 * qh * d * n * (n + 1) / 2) as u64));
    g.bench_function("prefill_1206", |b| {
        b.iter(|| be.paged_attention(&q, &k, &v, shape, &seqs).unwrap())
    });
    // The same prompt as the engine prefills it: chunks of 512 positions (`EngineConfig::chunk_size`),
    // each attending to everything before it.
    let chunks: Vec<[PagedSeq<'_>; 1]> = [(0, 512), (512, 512), (1024, n - 1024)]
        .iter()
        .map(|&(first, rows)| {
            [PagedSeq {
                rows,
                context_len: first + rows,
                block_table: &blocks,
            }]
        })
        .collect();
    let qs: Vec<_> = chunks.iter().map(|c| random(&be, c[0].rows, qh * d, 8)).collect();
    g.bench_function("prefill_1206_chunks_of_512", |b| {
        b.iter(|| {
            for (q, c) in qs.iter().zip(&chunks) {
                be.paged_attention(q, &k, &v, shape, c).unwrap();
            }
        })
    });
    let q1 = random(&be, 1, qh * d, 4);
    let one = [PagedSeq {
        rows: 1,
        context_len: n,
        block_table: &blocks,
    }];
    g.throughput(Throughput::Elements((4 * qh * d * n) as u64));
    g.bench_function("decode_at_1206", |b| {
        b.iter(|| be.paged_attention(&q1, &k, &v, shape, &one).unwrap())
    });
    // Vision: 16 heads of 64 over 4 segments of 256 patches.
    let (vh, vd, seg) = (16, 64, 256);
    let vq = random(&be, 4 * seg, vh * vd, 5);
    let (vk, vv) = (random(&be, 4 * seg, vh * vd, 6), random(&be, 4 * seg, vh * vd, 7));
    let cu: Vec<usize> = (0..=4).map(|i| i * seg).collect();
    g.throughput(Throughput::Elements((4 * vh * vd * seg * seg * 4) as u64));
    g.bench_function("vision_4x256", |b| {
        b.iter(|| be.attention_segments(&vq, &vk, &vv, vh, &cu).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
