//! Batch-invariant mode on CUDA (`CudaBackend::set_batch_invariant`): the engine's exactness
//! guarantees of the CPU backend (tests/engine_exact.rs) hold on the GPU too. On the tiny Qwen3-VL, a
//! prompt with screenshots gives bitwise the same greedy tokens and decision logits whether it is
//! prefilled whole, in chunks of 7 tokens, after its prefix was cached by another request, or batched
//! with another sequence, and drafted generation gives bitwise plain generation. Skips without a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::fixture;
use recall::backend::cuda::CudaBackend;
use recall::engine::{
    EngineConfig, GenerateParams, ImageHash, ImageRole, Outcome, Pipeline, Prompt, RequestOptions, Segment,
    Task,
};
use recall::vision::{preprocess, ImageSource, PixelValues};

type Run = (Vec<u32>, Vec<Vec<f32>>);

struct Fixture {
    p: Pipeline<CudaBackend>,
    images: Vec<(ImageHash, PixelValues)>,
}

impl Fixture {
    fn prompt(&self, text: &[u32]) -> Prompt {
        let cfg = &self.p.model.config;
        let mut segments = vec![Segment::Text(text[..20].to_vec())];
        for (hash, px) in &self.images {
            segments.push(Segment::Text(vec![cfg.vision_start_token_id.unwrap()]));
            segments.push(Segment::Image {
                hash: *hash,
                grid: px.grid_thw,
                role: ImageRole::History,
            });
            segments.push(Segment::Text(vec![cfg.vision_end_token_id.unwrap()]));
        }
        segments.push(Segment::Text(text[20..].to_vec()));
        Prompt { segments }
    }

    /// Generates for each prompt (all in one engine, so they batch), returning each one's run.
    fn run(&self, cfg: EngineConfig, prompts: &[(Prompt, Vec<u32>)]) -> Vec<Run> {
        let mut e = self.p.engine(cfg).unwrap();
        for (hash, px) in &self.images {
            e.add_image(*hash, px).unwrap();
        }
        let ids: Vec<_> = prompts
            .iter()
            .map(|(prompt, draft)| {
                let params = GenerateParams {
                    max_tokens: 12,
                    eos_token_ids: vec![],
                    stop_strings: vec![],
                };
                let opts = RequestOptions {
                    return_logits: true,
                    draft: draft.clone(),
                    ..RequestOptions::default()
                };
                e.add_request_with(prompt, Task::Generate(params), opts).unwrap()
            })
            .collect();
        let outs = e.run_all().unwrap();
        ids.iter()
            .map(|id| {
                let o = outs.iter().find(|o| o.id == *id).unwrap();
                match &o.outcome {
                    Outcome::Generation(g) => (g.tokens.clone(), o.decision_logits.clone()),
                    other => panic!("{other:?}"),
                }
            })
            .collect()
    }
}

fn config(chunk: usize, caching: bool) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks: 1024,
        chunk_size: chunk,
        max_batch_tokens: 1 << 20,
        prefix_caching: caching,
        ..EngineConfig::default()
    }
}

fn assert_same(what: &str, a: &Run, b: &Run) {
    assert_eq!(a.0, b.0, "{what}: tokens");
    assert_eq!(a.1.len(), b.1.len(), "{what}: decisions");
    for (i, (x, y)) in a.1.iter().zip(&b.1).enumerate() {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: logits of decision {i} differ bitwise"
        );
    }
}

#[test]
fn batch_invariant_mode_makes_the_engine_exact_on_cuda() {
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => return eprintln!("SKIP (no usable GPU): {e}"),
    };
    be.set_batch_invariant(true);
    let p = Pipeline::load(be, &fixture("tiny-qwen3-vl"), None).unwrap();
    let images = ["screen.png", "icon.png"]
        .iter()
        .map(|name| {
            let src = ImageSource::parse(fixture("vl-images").join(name).to_str().unwrap()).unwrap();
            let hash = ImageHash::of_image(&src.load().unwrap());
            (hash, preprocess(&src, &p.preprocess).unwrap())
        })
        .collect();
    let f = Fixture { p, images };
    let mut rng = fastrand::Rng::with_seed(5);
    let text: Vec<u32> = (0..45).map(|_| rng.u32(0..1000)).collect();
    let other: Vec<u32> = (0..33).map(|_| rng.u32(0..1000)).collect();
    let prompt = f.prompt(&text);
    let reference = f
        .run(config(1 << 20, false), &[(prompt.clone(), vec![])])
        .remove(0);
    let chunked = f.run(config(7, false), &[(prompt.clone(), vec![])]).remove(0);
    assert_same("chunks of 7", &reference, &chunked);
    // Same engine: the second request reuses the first one's cached prefix (the shared screenshots).
    let mut prefix_text = text.clone();
    prefix_text[40..].iter_mut().for_each(|t| *t = (*t + 1) % 1000);
    let runs = f.run(
        config(1 << 20, true),
        &[(f.prompt(&prefix_text), vec![]), (prompt.clone(), vec![])],
    );
    assert_same("after a cached prefix, batched", &reference, &runs[1]);
    let batched = f.run(
        config(5, false),
        &[(f.prompt(&other), vec![]), (prompt.clone(), vec![])],
    );
    assert_same("batched with another sequence", &reference, &batched[1]);
    // A draft that is right for 5 tokens, then wrong.
    let mut draft = reference.0[..5].to_vec();
    draft.extend([(reference.0[5] + 1) % 1000, 3, 4]);
    let drafted = f.run(config(1 << 20, false), &[(prompt, draft)]).remove(0);
    assert_eq!(drafted.0, reference.0, "drafted generation: tokens");
}
