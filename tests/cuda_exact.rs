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

/// Batch-invariant GEMMs at Qwen3-VL-8B's shapes (q/o 4096², gate/up 12288×4096, down 4096×12288,
/// lm_head 151936×4096; synthetic bf16 weights generated on the device): rows computed in calls of
/// 1, 7, 64 and 333 rows, and at an offset, are bitwise the same rows of one call over all of them,
/// and no shape fell back to its own (not batch-invariant) algorithm.
#[test]
fn batch_invariant_gemms_at_8b_shapes_do_not_depend_on_the_row_count() {
    use recall::backend::Backend;
    use recall::checkpoint::{Checkpoint, Fill};
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => return eprintln!("SKIP (no usable GPU): {e}"),
    };
    be.set_batch_invariant(true);
    let shapes = [(4096, 4096), (12288, 4096), (4096, 12288), (151_936, 4096)];
    let specs = shapes.iter().enumerate().map(|(i, &(out, inner))| {
        let fill = Fill::Uniform {
            seed: 0xb1 + i as u64,
            scale: 0.02 * 3f32.sqrt(),
        };
        (format!("w{i}"), vec![out, inner], fill)
    });
    let ckpt = Checkpoint::synthetic("batch-invariant GEMM test", specs).unwrap();
    let mut rng = fastrand::Rng::with_seed(21);
    for (i, &(out, inner)) in shapes.iter().enumerate() {
        let w = be.load_weight(ckpt.get(&format!("w{i}")).unwrap()).unwrap();
        let rows = if out > 100_000 { 512 } else { 1024 };
        let data: Vec<f32> = (0..rows * inner).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let x = be.upload(&data, rows, inner).unwrap();
        let full = be.download(&be.linear(&x, &w, None).unwrap()).unwrap();
        for (start, n) in [(0, 1), (0, 7), (5, 64), (100, 333), (rows - 1, 1)] {
            let index: Vec<usize> = (start..start + n).collect();
            let part = be.linear(&be.gather_rows(&x, &index).unwrap(), &w, None).unwrap();
            let part = be.download(&part).unwrap();
            let want = &full[start * out..(start + n) * out];
            let differ = part
                .iter()
                .zip(want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ,
                0,
                "[{out}, {inner}]: rows {start}..{} alone differ in {differ} values",
                start + n
            );
        }
        eprintln!("batch-invariant GEMM [{out}, {inner}]: row subsets bitwise equal to {rows} rows");
    }
    let fallbacks = be.batch_invariant_fallbacks();
    assert!(
        fallbacks.is_empty(),
        "shapes off the reference algorithm: {fallbacks:?}"
    );
}
