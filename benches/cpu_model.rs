//! CPU reference timings on the tiny fixture models: the vision tower of each family on a
//! screenshot-shaped grid, a text prefill and a decode step. These are for spotting regressions in the
//! reference path, not for speed claims (the GPU numbers live in `recall bench`).

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use recall::backend::{cpu::CpuBackend, Backend};
use recall::engine::Pipeline;
use recall::model::{LogitsFor, Positions};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn vision_tower(c: &mut Criterion) {
    for name in ["tiny-qwen3-vl", "tiny-qwen2.5-vl"] {
        let p = Pipeline::load(CpuBackend, &fixture(name), None).expect("fixture loads");
        let cfg = p.model.config.vision.clone().expect("vision config");
        // A 16:9 screenshot grid of 36x64 patches (576 merged tokens).
        let grid = [1, 36, 64];
        let n = grid.iter().product::<usize>();
        let data: Vec<f32> = (0..n * cfg.patch_dim())
            .map(|i| ((i * 7919) % 255) as f32 / 127.5 - 1.0)
            .collect();
        let pixels = p.backend.upload(&data, n, cfg.patch_dim()).expect("upload");
        let tower = p.model.vision.as_ref().expect("vision tower");
        c.bench_function(&format!("vision_tower/{name}/36x64"), |b| {
            b.iter(|| tower.forward(&p.backend, &pixels, &[grid]).expect("forward"))
        });
    }
}

fn text_decoder(c: &mut Criterion) {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).expect("fixture loads");
    let text = &p.model.text;
    let be = &p.backend;
    let ids: Vec<u32> = (0..512).map(|i| (i * 37 % 1000) as u32).collect();
    c.bench_function("text/tiny-qwen3-vl/prefill_512", |b| {
        b.iter(|| {
            let mut cache = text.new_cache(be, ids.len()).expect("cache");
            text.forward(
                be,
                &ids,
                &Positions::text(0, ids.len()),
                None,
                &[],
                &mut cache,
                LogitsFor::Last,
                false,
            )
            .expect("forward")
        })
    });
    let mut cache = text.new_cache(be, ids.len() + 1).expect("cache");
    text.forward(
        be,
        &ids,
        &Positions::text(0, ids.len()),
        None,
        &[],
        &mut cache,
        LogitsFor::Last,
        false,
    )
    .expect("prefill");
    c.bench_function("text/tiny-qwen3-vl/decode_at_512", |b| {
        b.iter(|| {
            cache.truncate(ids.len());
            text.forward(
                be,
                &[7],
                &Positions::text(ids.len() as i64, 1),
                None,
                &[],
                &mut cache,
                LogitsFor::Last,
                false,
            )
            .expect("decode")
        })
    });
}

criterion_group!(benches, vision_tower, text_decoder);
criterion_main!(benches);
