//! The engine's exactness and cache invariants on the tiny Qwen3-VL (CPU, bitwise):
//! * a prompt's decision logits and greedy tokens are bitwise identical whether it is prefilled whole,
//!   in chunks of any size, after a cached prefix (also one ending right before or right after an
//!   image), or batched with other sequences of other lengths — the reference being a fresh engine
//!   with prefix caching off and no chunking;
//! * cache keys: a different image at the same place shares no block from the image on; a different
//!   salt (adapter / gate state) shares no block at all;
//! * under a small pool, a long random run keeps the block manager's invariants after every step and
//!   still produces the reference outputs;
//! * the vision tower runs once per distinct screenshot over a multi-step episode.

mod common;

use common::fixture;
use recall::backend::cpu::CpuBackend;
use recall::engine::{
    Engine, EngineConfig, GenerateParams, ImageHash, ImageRole, Outcome, Pipeline, Prompt, RequestOptions,
    Segment, Task,
};
use recall::model::GridThw;
use recall::tokenize::chat::{ChatMessage, ContentPart};
use recall::vision::{preprocess, ImageSource, PixelValues};

struct Fixture {
    p: Pipeline<CpuBackend>,
    images: Vec<(ImageHash, PixelValues)>,
}

fn setup() -> Fixture {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let images = ["screen.png", "icon.png", "square.webp"]
        .iter()
        .map(|name| {
            let src = ImageSource::parse(fixture("vl-images").join(name).to_str().unwrap()).unwrap();
            let hash = ImageHash::of_image(&src.load().unwrap());
            (hash, preprocess(&src, &p.preprocess).unwrap())
        })
        .collect();
    Fixture { p, images }
}

impl Fixture {
    fn engine(&self, cfg: EngineConfig) -> Engine<'_, CpuBackend> {
        let mut e = self.p.engine(cfg).unwrap();
        for (hash, px) in &self.images {
            e.add_image(*hash, px).unwrap();
        }
        e
    }

    fn image(&self, i: usize, role: ImageRole) -> Vec<Segment> {
        let cfg = &self.p.model.config;
        let (hash, px) = &self.images[i];
        let grid: GridThw = px.grid_thw;
        vec![
            Segment::Text(vec![cfg.vision_start_token_id.unwrap()]),
            Segment::Image {
                hash: *hash,
                grid,
                role,
            },
            Segment::Text(vec![cfg.vision_end_token_id.unwrap()]),
        ]
    }

    /// A random prompt of text runs and images.
    fn random_prompt(&self, rng: &mut fastrand::Rng) -> Prompt {
        let mut segments = vec![Segment::Text(random_text(rng, 1, 30))];
        for _ in 0..rng.usize(1..4) {
            segments.extend(self.image(rng.usize(0..self.images.len()), ImageRole::History));
            segments.push(Segment::Text(random_text(rng, 1, 25)));
        }
        Prompt { segments }
    }
}

fn random_text(rng: &mut fastrand::Rng, lo: usize, hi: usize) -> Vec<u32> {
    (0..rng.usize(lo..=hi)).map(|_| rng.u32(0..1000)).collect()
}

fn unchunked() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks: 512,
        chunk_size: 1 << 20,
        max_batch_tokens: 1 << 20,
        prefix_caching: false,
        ..EngineConfig::default()
    }
}

fn params(n: usize) -> GenerateParams {
    GenerateParams {
        max_tokens: n,
        eos_token_ids: vec![],
        stop_strings: vec![],
    }
}

/// (greedy tokens, decision logits, prompt tokens reused) of one generation.
type Run = (Vec<u32>, Vec<Vec<f32>>, usize);

fn run_one(engine: &mut Engine<'_, CpuBackend>, prompt: &Prompt, n: usize) -> Run {
    let opts = RequestOptions {
        return_logits: true,
        salt: 0,
        ..RequestOptions::default()
    };
    let id = engine
        .add_request_with(prompt, Task::Generate(params(n)), opts)
        .unwrap();
    let out = engine
        .run_all()
        .unwrap()
        .into_iter()
        .find(|o| o.id == id)
        .unwrap();
    match out.outcome {
        Outcome::Generation(g) => (g.tokens, out.decision_logits, out.reused_tokens),
        other => panic!("{other:?}"),
    }
}

#[test]
fn chunked_cached_and_batched_runs_are_bitwise_identical() {
    let f = setup();
    let mut rng = fastrand::Rng::with_seed(7);
    for case in 0..8 {
        let prompt = f.random_prompt(&mut rng);
        let reference = run_one(&mut f.engine(unchunked()), &prompt, 4);

        // Chunked prefill, chunk sizes 1..=23.
        let chunk = rng.usize(1..24);
        let mut e = f.engine(EngineConfig {
            chunk_size: chunk,
            max_batch_tokens: chunk + 5,
            ..unchunked()
        });
        let got = run_one(&mut e, &prompt, 4);
        assert_eq!(
            (&got.0, &got.1),
            (&reference.0, &reference.1),
            "case {case}: chunk size {chunk}"
        );

        // After a cached prefix ending right before an image, right after it, or anywhere.
        let first_image = prompt
            .segments
            .iter()
            .position(|s| matches!(s, Segment::Image { .. }))
            .unwrap();
        for cut in [first_image, first_image + 1, rng.usize(1..prompt.segments.len())] {
            let prefix = Prompt {
                segments: prompt.segments[..cut].to_vec(),
            };
            let mut e = f.engine(EngineConfig {
                prefix_caching: true,
                chunk_size: rng.usize(3..40),
                ..unchunked()
            });
            run_one(&mut e, &prefix, 1);
            let got = run_one(&mut e, &prompt, 4);
            assert_eq!(
                (&got.0, &got.1),
                (&reference.0, &reference.1),
                "case {case}: after a prefix of {cut} segments"
            );
            e.check_invariants().unwrap();
        }

        // Batched with other sequences of other lengths (and chunked).
        let mut e = f.engine(EngineConfig {
            chunk_size: rng.usize(5..64),
            max_batch_tokens: 96,
            ..unchunked()
        });
        let others: Vec<Prompt> = (0..3).map(|_| f.random_prompt(&mut rng)).collect();
        for o in &others[..2] {
            e.add_request(o, Task::Generate(params(rng.usize(1..6)))).unwrap();
        }
        let opts = RequestOptions {
            return_logits: true,
            salt: 0,
            ..RequestOptions::default()
        };
        let id = e
            .add_request_with(&prompt, Task::Generate(params(4)), opts)
            .unwrap();
        e.add_request(
            &others[2],
            Task::Score {
                target: random_text(&mut rng, 1, 5),
            },
        )
        .unwrap();
        let out = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
        let Outcome::Generation(g) = out.outcome else {
            panic!("{:?}", out.outcome)
        };
        assert_eq!(
            (&g.tokens, &out.decision_logits),
            (&reference.0, &reference.1),
            "case {case}: batched"
        );
    }
}

#[test]
fn prefix_reuse_is_counted_and_second_pass_reuses() {
    let f = setup();
    let mut rng = fastrand::Rng::with_seed(3);
    let prompt = f.random_prompt(&mut rng);
    let mut e = f.engine(EngineConfig {
        prefix_caching: true,
        ..unchunked()
    });
    let first = run_one(&mut e, &prompt, 3);
    assert_eq!(first.2, 0);
    let again = run_one(&mut e, &prompt, 3);
    assert_eq!((&again.0, &again.1), (&first.0, &first.1));
    let n: usize = recall::engine::Prompt::flatten(&prompt, 1012, 2)
        .unwrap()
        .ids
        .len();
    assert_eq!(
        again.2,
        (n - 1) / 4 * 4,
        "all but the last block of the prompt is reused"
    );
    let stats = e.kv_stats();
    assert_eq!(stats.tokens_reused as usize, again.2);
}

#[test]
fn different_image_or_salt_shares_no_block_from_there_on() {
    let f = setup();
    let text = |n: usize| Segment::Text((0..n as u32).map(|i| 100 + i).collect());
    let with_image = |i: usize| {
        let mut s = vec![text(10)];
        s.extend(f.image(i, ImageRole::History));
        s.push(text(9));
        Prompt { segments: s }
    };
    let mut e = f.engine(EngineConfig {
        prefix_caching: true,
        ..unchunked()
    });
    run_one(&mut e, &with_image(0), 1);
    // Same ids (the image tokens are all <|image_pad|>), another image: only the text before the
    // image (10 tokens + vision_start = 11, block-aligned 8) is shared.
    let b = run_one(&mut e, &with_image(2), 1);
    assert_eq!(b.2, 8);
    // The same prompt again under another salt: nothing is shared.
    let opts = RequestOptions {
        return_logits: false,
        salt: 0xada9,
        ..RequestOptions::default()
    };
    let id = e
        .add_request_with(&with_image(0), Task::Generate(params(1)), opts)
        .unwrap();
    let out = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
    assert_eq!(out.reused_tokens, 0);
    // And under the original salt it is shared up to the last block.
    let c = run_one(&mut e, &with_image(0), 1);
    assert!(c.2 > 11, "{}", c.2);
}

#[test]
fn small_pool_random_run_keeps_invariants_and_outputs() {
    let f = setup();
    let mut rng = fastrand::Rng::with_seed(11);
    let prefixes: Vec<Prompt> = (0..3).map(|_| f.random_prompt(&mut rng)).collect();
    // Expected outputs from a roomy engine without caching.
    let mut requests = Vec::new();
    for _ in 0..24 {
        let mut p = prefixes[rng.usize(0..prefixes.len())].clone();
        p.segments.push(Segment::Text(random_text(&mut rng, 1, 12)));
        if rng.bool() {
            p.segments.extend(f.image(rng.usize(0..3), ImageRole::Current));
        }
        requests.push((p, rng.usize(1..5)));
    }
    let expected: Vec<Vec<u32>> = requests
        .iter()
        .map(|(p, n)| run_one(&mut f.engine(unchunked()), p, *n).0)
        .collect();

    // A byte capacity of 120 blocks: 3 layers · K and V · 4 tokens · 2 kv heads · 32 dims · 4 bytes.
    let cfg = EngineConfig {
        block_size: 4,
        kv_cache_bytes: Some(120 * 3 * 2 * 4 * 2 * 32 * 4),
        chunk_size: 16,
        max_batch_tokens: 40,
        prefix_caching: true,
        ..EngineConfig::default()
    };
    let mut e = f.engine(cfg);
    assert_eq!(e.num_blocks(), 120);
    assert_eq!(
        e.config().num_blocks,
        EngineConfig::default().num_blocks,
        "the config is kept as given"
    );
    let mut ids = Vec::new();
    let mut outputs = Vec::new();
    let mut next = 0;
    while next < requests.len() || e.has_work() {
        // Requests arrive a few at a time while others run.
        for _ in 0..rng.usize(0..3) {
            if next < requests.len() {
                let (p, n) = &requests[next];
                ids.push(e.add_request(p, Task::Generate(params(*n))).unwrap());
                next += 1;
            }
        }
        outputs.extend(e.step().unwrap());
        e.check_invariants()
            .unwrap_or_else(|err| panic!("invariant broken: {err}"));
    }
    for (k, id) in ids.iter().enumerate() {
        let out = outputs.iter().find(|o| o.id == *id).unwrap();
        match &out.outcome {
            Outcome::Generation(g) => assert_eq!(g.tokens, expected[k], "request {k}"),
            other => panic!("request {k}: {other:?}"),
        }
    }
    let stats = e.kv_stats();
    assert!(stats.tokens_reused > 0 && stats.evictions > 0, "{stats:?}");
}

#[test]
fn vision_tower_runs_once_per_distinct_screenshot() {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let mut e = p
        .engine(EngineConfig {
            block_size: 4,
            num_blocks: 256,
            ..EngineConfig::default()
        })
        .unwrap();
    let shots = ["screen.png", "icon.png", "square.webp", "banner.png"];
    let path = |i: usize| {
        fixture("vl-images")
            .join(shots[i % shots.len()])
            .display()
            .to_string()
    };
    // Six steps; each shows the last three screenshots (the current one last).
    for step in 0..6usize {
        let mut content = Vec::new();
        for s in step.saturating_sub(2)..=step {
            content.push(ContentPart::Image(path(s)));
            content.push(ContentPart::Text(format!("Step {s}")));
        }
        let messages = [ChatMessage::new("user", content)];
        let prompt = p.chat_prompt(&mut e, &messages, true).unwrap();
        let roles: Vec<ImageRole> = prompt
            .segments
            .iter()
            .filter_map(|s| match s {
                Segment::Image { role, .. } => Some(*role),
                _ => None,
            })
            .collect();
        assert_eq!(roles.last(), Some(&ImageRole::Current));
        e.generate(&prompt, &params(2)).unwrap();
    }
    assert_eq!(
        e.vision_cache().tower_runs,
        4,
        "one tower run per distinct screenshot"
    );
}

#[test]
fn score_many_shares_the_common_prefix_and_matches_single_scores() {
    let f = setup();
    let mut rng = fastrand::Rng::with_seed(5);
    let base = f.random_prompt(&mut rng);
    let pairs: Vec<(Prompt, Vec<u32>)> = (0..4)
        .map(|i| {
            let mut p = base.clone();
            p.segments.extend(f.image(i % 3, ImageRole::History));
            p.segments.push(Segment::Text(random_text(&mut rng, 2, 6)));
            (p, random_text(&mut rng, 1, 4))
        })
        .collect();
    let singles: Vec<_> = pairs
        .iter()
        .map(|(p, t)| f.engine(unchunked()).score(p, t).unwrap())
        .collect();
    let mut e = f.engine(EngineConfig {
        prefix_caching: true,
        ..unchunked()
    });
    let shared = e.score_many(&pairs).unwrap();
    assert_eq!(
        shared, singles,
        "shared-prefix scores are bitwise the single scores"
    );
    assert!(e.kv_stats().tokens_reused >= 3 * 16, "{:?}", e.kv_stats());
}

#[test]
fn bad_requests_fail_cleanly() {
    let f = setup();
    let mut e = f.engine(EngineConfig {
        num_blocks: 8,
        block_size: 4,
        ..unchunked()
    });
    let unknown = Prompt {
        segments: vec![Segment::Image {
            hash: ImageHash(42),
            grid: [1, 4, 4],
            role: ImageRole::Current,
        }],
    };
    let err = e
        .add_request(&unknown, Task::Generate(params(1)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not in the vision cache"), "{err}");
    assert!(e
        .add_request(&Prompt::default(), Task::Generate(params(1)))
        .is_err());
    // A prompt larger than the whole pool fails without disturbing the engine.
    let long = Prompt {
        segments: vec![Segment::Text((0..100).collect())],
    };
    let id = e.add_request(&long, Task::Generate(params(1))).unwrap();
    let out = e.run_all().unwrap();
    assert!(
        matches!(&out[0].outcome, Outcome::Failed(m) if m.contains("KV cache full")),
        "{out:?}"
    );
    assert_eq!(out[0].id, id);
    e.check_invariants().unwrap();
    let short = Prompt {
        segments: vec![Segment::Text(vec![1, 2, 3])],
    };
    assert!(e.generate(&short, &params(2)).is_ok());
}

#[test]
fn drafted_generation_is_exactly_plain_generation() {
    let f = setup();
    let mut rng = fastrand::Rng::with_seed(21);
    for case in 0..6 {
        let prompt = f.random_prompt(&mut rng);
        let n = 6;
        let reference = run_one(&mut f.engine(unchunked()), &prompt, n);
        let mut wrong = reference.0.clone();
        let at = rng.usize(0..n);
        wrong[at] = (wrong[at] + 1) % 1000;
        let drafts = [
            reference.0.clone(),
            wrong,
            random_text(&mut rng, 1, 9),
            reference.0[..2].to_vec(),
        ];
        for (d, draft) in drafts.iter().enumerate() {
            let chunk = if d == 3 { rng.usize(2..9) } else { 1 << 20 };
            let mut e = f.engine(EngineConfig {
                chunk_size: chunk,
                max_batch_tokens: 1 << 20,
                ..unchunked()
            });
            let opts = RequestOptions {
                return_logits: true,
                draft: draft.clone(),
                ..RequestOptions::default()
            };
            let id = e
                .add_request_with(&prompt, Task::Generate(params(n)), opts)
                .unwrap();
            let out = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
            let Outcome::Generation(g) = &out.outcome else {
                panic!("{:?}", out.outcome)
            };
            assert_eq!(
                (&g.tokens, &out.decision_logits),
                (&reference.0, &reference.1),
                "case {case}, draft {d}"
            );
            e.check_invariants().unwrap();
            if d == 0 {
                // The right draft: all accepted, one forward for prompt and draft together.
                assert_eq!(out.accepted_draft, n);
                assert_eq!(e.forwards, 1, "case {case}");
            }
        }
    }
}

#[test]
fn stop_strings_end_generation_in_both_paths() {
    let f = setup();
    let mut rng = fastrand::Rng::with_seed(9);
    let prompt = Prompt {
        segments: vec![Segment::Text(random_text(&mut rng, 20, 30))],
    };
    let reference = run_one(&mut f.engine(unchunked()), &prompt, 8).0;
    let stop = f.p.tokenizer.decode(&reference[..3]).unwrap();
    let params = GenerateParams {
        max_tokens: 8,
        eos_token_ids: vec![],
        stop_strings: vec![stop.clone()],
    };
    let mut e = f.engine(unchunked());
    let got = e.generate(&prompt, &params).unwrap();
    assert_eq!(got.finish, recall::engine::FinishReason::Stop(stop.clone()));
    assert!(
        got.tokens.len() <= 3 && reference.starts_with(&got.tokens),
        "{:?} vs {reference:?}",
        got.tokens
    );
    // The single-sequence reference path stops at the same token.
    let Segment::Text(ids) = &prompt.segments[0] else {
        unreachable!()
    };
    let plain = recall::engine::generate(
        &f.p.backend,
        &f.p.model.text,
        &recall::engine::PromptInput::text(ids),
        &params,
        Some(&f.p.tokenizer),
    )
    .unwrap();
    assert_eq!((plain.tokens, plain.finish), (got.tokens, got.finish));
}
