//! Engine benches on the tiny Qwen3-VL (CPU), each reported beside its no-reuse twin:
//! * `second_pass`: a CausalCache-shaped prompt (long shared system text, three history screenshots
//!   with responses, the current screenshot) and its second pass with the earliest history slot changed:
//!   pass 2 after pass 1 is cached, against the same pass 2 re-prefilled from scratch.
//! * `score_many`: 8 candidate prompts sharing a long prefix, scored in one call with and without
//!   prefix sharing.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use recall::backend::cpu::CpuBackend;
use recall::engine::{Engine, EngineConfig, GenerateParams, ImageHash, ImageRole, Pipeline, Prompt, Segment};
use recall::vision::{preprocess, ImageSource, PixelValues};

struct Setup {
    p: Pipeline<CpuBackend>,
    images: Vec<(ImageHash, PixelValues)>,
}

impl Setup {
    fn new() -> Self {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let p = Pipeline::load(CpuBackend, &dir.join("tiny-qwen3-vl"), None).expect("fixture loads");
        let images = [
            "screen.png",
            "portrait.jpg",
            "square.webp",
            "icon.png",
            "banner.png",
        ]
        .iter()
        .map(|name| {
            let src = ImageSource::parse(dir.join("vl-images").join(name).to_str().unwrap()).unwrap();
            (
                ImageHash::of_image(&src.load().unwrap()),
                preprocess(&src, &p.preprocess).unwrap(),
            )
        })
        .collect();
        Setup { p, images }
    }

    fn engine(&self, prefix_caching: bool) -> Engine<'_, CpuBackend> {
        let cfg = EngineConfig {
            block_size: 16,
            num_blocks: 256,
            prefix_caching,
            ..EngineConfig::default()
        };
        let mut e = self.p.engine(cfg).unwrap();
        for (h, px) in &self.images {
            e.add_image(*h, px).unwrap();
        }
        e
    }

    fn image(&self, i: usize, role: ImageRole) -> Vec<Segment> {
        let c = &self.p.model.config;
        let (hash, px) = &self.images[i];
        vec![
            Segment::Text(vec![c.vision_start_token_id.unwrap()]),
            Segment::Image {
                hash: *hash,
                grid: px.grid_thw,
                role,
            },
            Segment::Text(vec![c.vision_end_token_id.unwrap()]),
        ]
    }

    /// System text, history screenshots `history` with responses, the current screenshot, a question.
    fn step_prompt(&self, history: &[usize]) -> Prompt {
        let text = |seed: u32, n: u32| Segment::Text((0..n).map(|i| (seed * 131 + i * 17) % 1000).collect());
        let mut s = vec![text(1, 400)];
        for &h in history {
            s.extend(self.image(h, ImageRole::History));
            s.push(text(h as u32 + 7, 40));
        }
        s.extend(self.image(4, ImageRole::Current));
        s.push(text(99, 30));
        Prompt { segments: s }
    }
}

fn one_token() -> GenerateParams {
    GenerateParams {
        max_tokens: 1,
        eos_token_ids: vec![],
        stop_strings: vec![],
    }
}

fn second_pass(c: &mut Criterion) {
    let s = Setup::new();
    let pass1 = s.step_prompt(&[0, 1, 2]);
    let pass2 = s.step_prompt(&[3, 1, 2]); // the earliest history slot changed
    let mut g = c.benchmark_group("second_pass");
    g.bench_function("reuse", |b| {
        b.iter_batched(
            || {
                let mut e = s.engine(true);
                e.generate(&pass1, &one_token()).unwrap();
                e
            },
            |mut e| e.generate(&pass2, &one_token()).unwrap(),
            BatchSize::PerIteration,
        )
    });
    g.bench_function("full_prefill", |b| {
        b.iter_batched(
            || s.engine(false),
            |mut e| e.generate(&pass2, &one_token()).unwrap(),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn score_many(c: &mut Criterion) {
    let s = Setup::new();
    let pairs: Vec<(Prompt, Vec<u32>)> = (0..8)
        .map(|i| {
            let mut p = s.step_prompt(&[0, 1]);
            p.segments.push(Segment::Text(vec![500 + i as u32, 7, 9]));
            (p, vec![11, 12, 13, 14 + i as u32])
        })
        .collect();
    let mut g = c.benchmark_group("score_many");
    for (name, sharing) in [("shared_prefix", true), ("no_sharing", false)] {
        g.bench_function(name, |b| {
            b.iter_batched(
                || s.engine(sharing),
                |mut e| e.score_many(&pairs).unwrap(),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, second_pass, score_many);
criterion_main!(benches);
