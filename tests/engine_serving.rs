//! What a server needs from the engine, on the tiny Qwen3-VL (CPU, bitwise where it says so):
//! * preemption: with a pool too small for every request at once, all of them finish, with exactly
//!   the tokens and logits of running each alone, and every block is back in the pool afterwards;
//! * cancellation of queued and running requests returns their blocks, the others are unaffected;
//! * seeded sampling gives the same tokens run to run and however the request is batched;
//! * logprobs of a greedy generation match HF transformers' logits (log-softmax within 1e-4, the
//!   same top tokens), and asking for them changes no token.

mod common;

use common::{fixture, Reference};
use recall::backend::cpu::CpuBackend;
use recall::engine::{
    Engine, EngineConfig, EngineOutput, GenerateParams, Outcome, Pipeline, Prompt, RequestOptions, Sampling,
    Segment, Task,
};
use recall::tokenize::chat::{parse_messages, ChatMessage};

fn pipeline() -> Pipeline<CpuBackend> {
    Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap()
}

fn params(n: usize) -> GenerateParams {
    GenerateParams {
        max_tokens: n,
        eos_token_ids: vec![],
        stop_strings: vec![],
    }
}

/// Prompts sharing a 40-token prefix, each with its own tail.
fn prompts(n: usize) -> Vec<Prompt> {
    let mut rng = fastrand::Rng::with_seed(11);
    let shared: Vec<u32> = (0..40).map(|_| rng.u32(0..1000)).collect();
    (0..n)
        .map(|_| {
            let tail: Vec<u32> = (0..rng.usize(3..12)).map(|_| rng.u32(0..1000)).collect();
            Prompt {
                segments: vec![Segment::Text(shared.clone()), Segment::Text(tail)],
            }
        })
        .collect()
}

fn generation(out: &EngineOutput) -> &[u32] {
    match &out.outcome {
        Outcome::Generation(g) => &g.tokens,
        other => panic!("request {}: {other:?}", out.id),
    }
}

fn logits_opts() -> RequestOptions {
    RequestOptions {
        return_logits: true,
        ..RequestOptions::default()
    }
}

/// Each prompt alone in a roomy engine: (tokens, decision logits).
fn alone(p: &Pipeline<CpuBackend>, prompts: &[Prompt], n: usize) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    prompts
        .iter()
        .map(|prompt| {
            let mut e = p.engine(EngineConfig::default()).unwrap();
            let id = e
                .add_request_with(prompt, Task::Generate(params(n)), logits_opts())
                .unwrap();
            let out = e.wait_for(id).unwrap();
            (generation(&out).to_vec(), out.decision_logits)
        })
        .collect()
}

/// Steps `e` to the end, checking the block manager after every step.
fn drain(e: &mut Engine<'_, CpuBackend>) -> Vec<EngineOutput> {
    let mut outs = Vec::new();
    while e.has_work() {
        outs.extend(e.step().unwrap());
        e.check_invariants()
            .unwrap_or_else(|err| panic!("invariant broken: {err}"));
    }
    outs
}

#[test]
fn preemption_under_a_small_pool_gives_the_same_bits() {
    let p = pipeline();
    let prompts = prompts(12);
    let reference = alone(&p, &prompts, 24);
    // 20 blocks of 4 tokens: a sequence needs up to 19; twelve at once cannot all fit.
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 20,
        chunk_size: 16,
        max_batch_tokens: 64,
        ..EngineConfig::default()
    };
    let mut e = p.engine(cfg).unwrap();
    let ids: Vec<u64> = prompts
        .iter()
        .map(|pr| {
            e.add_request_with(pr, Task::Generate(params(24)), logits_opts())
                .unwrap()
        })
        .collect();
    let outs = drain(&mut e);
    let mut preemptions = 0;
    for (k, id) in ids.iter().enumerate() {
        let out = outs.iter().find(|o| o.id == *id).expect("every request finishes");
        assert_eq!(generation(out), reference[k].0.as_slice(), "request {k}");
        assert_eq!(out.decision_logits, reference[k].1, "request {k}: logits bitwise");
        preemptions += out.preemptions;
    }
    assert!(preemptions > 0, "the pool was meant to force preemption");
    assert_eq!(e.stats().preemptions, u64::from(preemptions));
    let kv = e.kv_stats();
    assert_eq!(kv.blocks_in_use, 0, "{kv:?}");
    assert_eq!(kv.blocks_free + kv.blocks_cached_free, 20);
}

#[test]
fn a_request_larger_than_the_pool_fails_alone_and_the_rest_finish() {
    let p = pipeline();
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 16,
        ..EngineConfig::default()
    };
    let mut e = p.engine(cfg).unwrap();
    let small = prompts(2); // at most 52 + 3 tokens: 14 blocks
    let big = Prompt {
        segments: vec![Segment::Text((0..20).collect())],
    };
    // 20 prompt tokens fit in 5 blocks, but 50 more generated tokens need 18 in all.
    let big_id = e.add_request(&big, Task::Generate(params(50))).unwrap();
    let small_ids: Vec<u64> = small
        .iter()
        .map(|pr| e.add_request(pr, Task::Generate(params(3))).unwrap())
        .collect();
    let outs = drain(&mut e);
    let big_out = outs.iter().find(|o| o.id == big_id).unwrap();
    assert!(
        matches!(&big_out.outcome, Outcome::Failed(m) if m.contains("KV cache full")),
        "{:?}",
        big_out.outcome
    );
    for id in small_ids {
        let out = outs.iter().find(|o| o.id == id).unwrap();
        assert_eq!(generation(out).len(), 3);
    }
    assert_eq!(e.kv_stats().blocks_in_use, 0);
}

#[test]
fn cancelled_requests_give_their_blocks_back_and_others_are_unaffected() {
    let p = pipeline();
    let prompts = prompts(8);
    let reference = alone(&p, &prompts, 10);
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 64,
        chunk_size: 8,
        max_batch_tokens: 24,
        ..EngineConfig::default()
    };
    let mut e = p.engine(cfg).unwrap();
    let ids: Vec<u64> = prompts
        .iter()
        .map(|pr| {
            e.add_request_with(pr, Task::Generate(params(10)), logits_opts())
                .unwrap()
        })
        .collect();
    let mut outs = Vec::new();
    for _ in 0..4 {
        outs.extend(e.step().unwrap());
    }
    // Some are decoding, some prefilling, some still queued: cancel every other one.
    for id in ids.iter().step_by(2) {
        assert!(e.cancel(*id), "request {id} was in flight");
        e.check_invariants().unwrap();
    }
    assert!(!e.cancel(ids[0]), "a request is cancelled once");
    outs.extend(drain(&mut e));
    for (k, id) in ids.iter().enumerate() {
        let out = outs.iter().find(|o| o.id == *id);
        if k % 2 == 0 {
            assert!(out.is_none(), "cancelled request {k} produced an output");
        } else {
            let out = out.unwrap();
            assert_eq!(generation(out), reference[k].0.as_slice(), "request {k}");
            assert_eq!(out.decision_logits, reference[k].1, "request {k}");
        }
    }
    assert_eq!(e.kv_stats().blocks_in_use, 0);
}

fn sampled(seed: u64) -> RequestOptions {
    RequestOptions {
        sampling: Sampling {
            temperature: 1.0,
            top_p: 0.95,
            top_k: 50,
            seed: Some(seed),
        },
        ..RequestOptions::default()
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_batch_independent() {
    let p = pipeline();
    let prompts = prompts(5);
    let run_alone = |seed| {
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let id = e
            .add_request_with(&prompts[0], Task::Generate(params(16)), sampled(seed))
            .unwrap();
        generation(&e.wait_for(id).unwrap()).to_vec()
    };
    let first = run_alone(42);
    assert_eq!(first, run_alone(42), "same seed, same tokens");
    assert_ne!(first, run_alone(43), "another seed samples other tokens");
    let greedy = alone(&p, &prompts[..1], 16).remove(0).0;
    assert_ne!(first, greedy, "temperature 1 is not greedy on this model");

    // The same request batched with others (greedy and sampled), chunked differently.
    let cfg = EngineConfig {
        block_size: 4,
        chunk_size: 7,
        max_batch_tokens: 20,
        ..EngineConfig::default()
    };
    let mut e = p.engine(cfg).unwrap();
    let mut ids = Vec::new();
    for (i, pr) in prompts.iter().enumerate().skip(1) {
        let opts = if i % 2 == 0 {
            sampled(i as u64)
        } else {
            RequestOptions::default()
        };
        ids.push(e.add_request_with(pr, Task::Generate(params(16)), opts).unwrap());
    }
    let id = e
        .add_request_with(&prompts[0], Task::Generate(params(16)), sampled(42))
        .unwrap();
    let outs = drain(&mut e);
    let out = outs.iter().find(|o| o.id == id).unwrap();
    assert_eq!(generation(out), first.as_slice());

    // A draft is verified greedily, so it cannot be combined with sampling.
    let opts = RequestOptions {
        draft: vec![1, 2],
        ..sampled(1)
    };
    assert!(e
        .add_request_with(&prompts[0], Task::Generate(params(4)), opts)
        .is_err());
}

#[test]
fn logprobs_match_hf_and_change_no_token() {
    let p = pipeline();
    let model = fixture("tiny-qwen3-vl");
    let reference = Reference::load(&model, "reference");
    for (i, case) in reference.prompts().iter().enumerate() {
        let messages: Vec<ChatMessage> =
            parse_messages(&case["messages"].to_string(), std::path::Path::new("ref")).unwrap();
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let prompt = p.chat_prompt(&mut e, &messages, true).unwrap();
        let run = |e: &mut Engine<'_, CpuBackend>, logprobs| {
            let opts = RequestOptions {
                logprobs,
                ..RequestOptions::default()
            };
            let id = e
                .add_request_with(&prompt, Task::Generate(params(8)), opts)
                .unwrap();
            e.wait_for(id).unwrap()
        };
        let plain = run(&mut e, None);
        let with = run(&mut e, Some(5));
        assert_eq!(generation(&plain), generation(&with), "prompt {i}");
        assert!(plain.logprobs.is_empty());
        assert_eq!(with.logprobs.len(), generation(&with).len());

        // HF's logits at the last prompt position give the first token's distribution.
        let (logits, shape) = reference.f32(&format!("p{i}.logits"));
        let vocab = shape[1];
        let last = &logits[logits.len() - vocab..];
        let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max + last.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        let first = &with.logprobs[0];
        let want = last[first.token as usize] as f64 - lse;
        assert!(
            (first.logprob as f64 - want).abs() < 1e-4,
            "prompt {i}: {} vs {want}",
            first.logprob
        );
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let top: Vec<u32> = first.top.iter().map(|t| t.0).collect();
        let hf_top: Vec<u32> = order[..5].iter().map(|&t| t as u32).collect();
        assert_eq!(top, hf_top, "prompt {i}");
        for (t, lp) in &first.top {
            assert!((*lp as f64 - (last[*t as usize] as f64 - lse)).abs() < 1e-4);
        }
        assert_eq!(first.token, first.top[0].0, "greedy picks the most likely token");
    }
}
