//! Repetition, frequency and presence penalties against Hugging Face transformers on the tiny Qwen3-VL
//! (tests/fixtures/penalties, made by tools/gen_penalty_fixtures.py: transformers' own repetition
//! penalty, vLLM's formula for frequency and presence):
//! * the engine's greedy tokens under each penalty equal HF's, alone and all requests batched together;
//! * the reference path (`recall generate`) gives the same tokens;
//! * on the CPU a penalised request is bitwise the same however it is batched: greedy with logprobs,
//!   and seeded sampling with penalties;
//! * bad penalties are refused before anything is queued.

mod common;

use common::fixture;
use recall::backend::cpu::CpuBackend;
use recall::engine::generate::generate_timed;
use recall::engine::sampling::Penalties;
use recall::engine::{
    Engine, EngineConfig, EngineOutput, GenerateParams, Outcome, Pipeline, Prompt, RequestOptions, Sampling,
    Task,
};
use recall::tokenize::chat::parse_messages_value;
use serde_json::Value;

struct Case {
    name: String,
    messages: Value,
    input_ids: Vec<u32>,
    penalties: Penalties,
    tokens: Vec<u32>,
    plain_tokens: Vec<u32>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn cases() -> (Vec<Case>, Vec<u32>) {
    let path = fixture("penalties/cases.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            messages: c["messages"].clone(),
            input_ids: ids(&c["input_ids"]),
            penalties: Penalties {
                repetition: c["repetition_penalty"].as_f64().unwrap() as f32,
                frequency: c["frequency_penalty"].as_f64().unwrap() as f32,
                presence: c["presence_penalty"].as_f64().unwrap() as f32,
            },
            tokens: ids(&c["tokens"]),
            plain_tokens: ids(&c["plain_tokens"]),
        })
        .collect();
    (cases, ids(&doc["eos_token_ids"]))
}

fn pipeline() -> Pipeline<CpuBackend> {
    Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap()
}

fn params(eos: &[u32]) -> GenerateParams {
    GenerateParams {
        max_tokens: 24,
        eos_token_ids: eos.to_vec(),
        stop_strings: vec![],
    }
}

fn tokens(out: &EngineOutput) -> Vec<u32> {
    match &out.outcome {
        Outcome::Generation(g) => g.tokens.clone(),
        other => panic!("request {}: {other:?}", out.id),
    }
}

/// The engine prompt of every case, its images encoded into `e` (checked against HF's input ids
/// through the reference path).
fn prompts(p: &Pipeline<CpuBackend>, e: &mut Engine<'_, CpuBackend>, cases: &[Case]) -> Vec<Prompt> {
    cases
        .iter()
        .map(|c| {
            let messages = parse_messages_value(&c.messages, "cases.json".as_ref()).unwrap();
            assert_eq!(p.prepare(&messages, true).unwrap().ids, c.input_ids, "{}", c.name);
            p.chat_prompt(e, &messages, true).unwrap()
        })
        .collect()
}

#[test]
fn the_fixture_can_tell_penalties_apart() {
    let (cases, _) = cases();
    let changed = cases.iter().filter(|c| c.tokens != c.plain_tokens).count();
    assert!(
        changed * 2 >= cases.len(),
        "{changed} of {} cases differ from plain greedy",
        cases.len()
    );
}

#[test]
fn engine_greedy_under_penalties_equals_hugging_face_alone_and_batched() {
    let p = pipeline();
    let (cases, eos) = cases();
    let opts = |c: &Case, logprobs| RequestOptions {
        penalties: c.penalties,
        logprobs,
        ..RequestOptions::default()
    };
    let mut alone = Vec::new();
    for c in &cases {
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let prompt = prompts(&p, &mut e, std::slice::from_ref(c)).remove(0);
        let id = e
            .add_request_with(&prompt, Task::Generate(params(&eos)), opts(c, None))
            .unwrap();
        let out = e.wait_for(id).unwrap();
        assert_eq!(tokens(&out), c.tokens, "{} (alone)", c.name);
        alone.push(out);
    }
    // Every case at once, in a small pool with short chunks: batched, chunked, preempted.
    let cfg = EngineConfig {
        num_blocks: 48,
        chunk_size: 16,
        max_batch_tokens: 64,
        ..EngineConfig::default()
    };
    let mut e = p.engine(cfg).unwrap();
    let prompts = prompts(&p, &mut e, &cases);
    let ids: Vec<_> = cases
        .iter()
        .zip(&prompts)
        .map(|(c, prompt)| {
            e.add_request_with(prompt, Task::Generate(params(&eos)), opts(c, Some(3)))
                .unwrap()
        })
        .collect();
    let outs = e.run_all().unwrap();
    for ((c, id), one) in cases.iter().zip(&ids).zip(&alone) {
        let out = outs.iter().find(|o| o.id == *id).unwrap();
        assert_eq!(tokens(out), c.tokens, "{} (batched)", c.name);
        assert_eq!(tokens(out), tokens(one), "{}", c.name);
    }
    assert_eq!(e.kv_stats().blocks_in_use, 0);
}

#[test]
fn the_reference_path_applies_the_same_penalties() {
    let p = pipeline();
    let (cases, eos) = cases();
    for c in &cases {
        let messages = parse_messages_value(&c.messages, "cases.json".as_ref()).unwrap();
        let input = p.prepare(&messages, true).unwrap();
        let (g, _) = generate_timed(
            &p.backend,
            &p.model.text,
            &input,
            &params(&eos),
            Some(&p.tokenizer),
            &c.penalties,
            false,
        )
        .unwrap();
        assert_eq!(g.tokens, c.tokens, "{}", c.name);
    }
}

#[test]
fn seeded_sampling_with_penalties_is_batch_independent() {
    let p = pipeline();
    let (cases, _) = cases();
    let opts = |i: usize| RequestOptions {
        sampling: Sampling {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 40,
            seed: Some(100 + i as u64),
        },
        penalties: cases[i].penalties,
        logprobs: Some(2),
        ..RequestOptions::default()
    };
    let no_eos = params(&[]);
    let run = |which: &[usize], cfg: EngineConfig| {
        let mut e = p.engine(cfg).unwrap();
        let prompts = prompts(&p, &mut e, &cases);
        let ids: Vec<_> = which
            .iter()
            .map(|&i| {
                e.add_request_with(&prompts[i], Task::Generate(no_eos.clone()), opts(i))
                    .unwrap()
            })
            .collect();
        let outs = e.run_all().unwrap();
        ids.iter()
            .map(|id| outs.iter().find(|o| o.id == *id).unwrap().clone())
            .map(|o| (tokens(&o), o.logprobs))
            .collect::<Vec<_>>()
    };
    let picked: Vec<usize> = (0..cases.len()).step_by(3).collect();
    let together = run(
        &picked,
        EngineConfig {
            chunk_size: 8,
            max_batch_tokens: 40,
            ..EngineConfig::default()
        },
    );
    for (k, &i) in picked.iter().enumerate() {
        let alone = run(&[i], EngineConfig::default()).remove(0);
        assert_eq!(together[k], alone, "{}", cases[i].name);
    }
}

#[test]
fn bad_penalties_are_refused_before_queuing() {
    let p = pipeline();
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let prompt = Prompt {
        segments: vec![recall::engine::Segment::Text(vec![1, 2, 3])],
    };
    for (bad, what) in [
        (
            Penalties {
                repetition: 0.0,
                ..Penalties::NONE
            },
            "repetition_penalty",
        ),
        (
            Penalties {
                repetition: f32::NAN,
                ..Penalties::NONE
            },
            "repetition_penalty",
        ),
        (
            Penalties {
                frequency: f32::INFINITY,
                ..Penalties::NONE
            },
            "frequency_penalty",
        ),
        (
            Penalties {
                presence: f32::NAN,
                ..Penalties::NONE
            },
            "presence_penalty",
        ),
    ] {
        let opts = RequestOptions {
            penalties: bad,
            ..RequestOptions::default()
        };
        let err = e
            .add_request_with(&prompt, Task::Generate(params(&[])), opts)
            .unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
    }
    // A draft is verified on raw logits: it cannot be combined with penalties.
    let opts = RequestOptions {
        penalties: Penalties {
            repetition: 1.2,
            ..Penalties::NONE
        },
        draft: vec![5, 6],
        ..RequestOptions::default()
    };
    assert!(e
        .add_request_with(&prompt, Task::Generate(params(&[])), opts)
        .is_err());
    assert!(!e.has_work());
}
