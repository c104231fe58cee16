//! CUDA graphs for decode steps (src/backend/cuda/graph.rs) on the tiny Qwen3-VL: greedy generation of
//! a batch with step replay on is bitwise identical (tokens and every decision's logits) to the same
//! run with replay off, and replay actually happened (recorded and replayed steps counted). Also:
//! switching batch-invariant mode at run time makes the steps record again (the GEMM trace names the
//! mode and the algorithm), and a step whose recording keeps failing is given up on after a bounded
//! number of tries. The head_dim-64 model (tests/fixtures/tiny-qwen3-vl-d64) replays decode steps that
//! use attention v2 with contexts growing step by step. Skips without a usable GPU.
#![cfg(feature = "cuda")]

mod common;

use common::fixture;
use recall::backend::cuda::CudaBackend;
use recall::backend::{Backend, StepKey};
use recall::engine::{
    EngineConfig, GenerateParams, Outcome, Pipeline, Prompt, RequestOptions, Segment, Task,
};

type Runs = Vec<(Vec<u32>, Vec<Vec<f32>>)>;

fn generate(p: &Pipeline<CudaBackend>, prompts: &[Vec<u32>], lens: &[usize]) -> Runs {
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 256,
        ..EngineConfig::default()
    };
    let mut e = p.engine(cfg).unwrap();
    let mut ids = Vec::new();
    for (ids_in, &n) in prompts.iter().zip(lens) {
        let prompt = Prompt {
            segments: vec![Segment::Text(ids_in.clone())],
        };
        let params = GenerateParams {
            max_tokens: n,
            eos_token_ids: vec![],
            stop_strings: vec![],
        };
        let opts = RequestOptions {
            return_logits: true,
            ..RequestOptions::default()
        };
        ids.push(e.add_request_with(&prompt, Task::Generate(params), opts).unwrap());
    }
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

#[test]
fn replayed_decode_steps_are_bitwise_the_direct_ones() {
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => return eprintln!("SKIP (no usable GPU): {e}"),
    };
    let p = Pipeline::load(be, &fixture("tiny-qwen3-vl"), None).unwrap();
    let mut rng = fastrand::Rng::with_seed(9);
    let prompts: Vec<Vec<u32>> = [5, 40, 300]
        .iter()
        .map(|&n| (0..n).map(|_| rng.u32(0..1000)).collect())
        .collect();
    // Different lengths: the batch shrinks as sequences finish (three batch sizes to record), and the
    // 300-token prompt crosses the 256-key split boundary of decode attention while decoding.
    let lens = [24, 9, 17];
    p.backend.set_step_replay(false);
    let direct = generate(&p, &prompts, &lens);
    let before = p.backend.step_stats();
    p.backend.set_step_replay(true);
    let replayed = generate(&p, &prompts, &lens);
    let stats = p.backend.step_stats();
    eprintln!("step stats: before {before:?}, after {stats:?}");
    assert!(stats.recorded > before.recorded, "no step was recorded");
    assert!(stats.replayed > before.replayed, "no step was replayed");
    for (k, (d, r)) in direct.iter().zip(&replayed).enumerate() {
        assert_eq!(d.0, r.0, "tokens of sequence {k}");
        assert_eq!(d.1.len(), r.1.len());
        for (i, (a, b)) in d.1.iter().zip(&r.1).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "logits of sequence {k}, decision {i}, differ bitwise");
        }
    }
}

/// The head_dim-64 model, whose decode steps take attention v2 (head_dim 32 declines it): replayed
/// steps with contexts growing every step across the 16-key tile and block boundaries and the 128-key
/// split chunks are bitwise the direct run, replays happened, and the direct run did use v2.
#[test]
fn replayed_v2_decode_steps_are_bitwise_the_direct_ones() {
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => return eprintln!("SKIP (no usable GPU): {e}"),
    };
    let p = Pipeline::load(be, &fixture("tiny-qwen3-vl-d64"), None).unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    // Contexts start just below a tile (14), a split chunk (126) and a 2-split boundary (254), and
    // grow by one key per decoded token past each.
    let prompts: Vec<Vec<u32>> = [14, 126, 254]
        .iter()
        .map(|&n| (0..n).map(|_| rng.u32(0..1000)).collect())
        .collect();
    let lens = [40, 24, 33];
    p.backend.set_step_replay(false);
    p.backend.set_profiling(true);
    let direct = generate(&p, &prompts, &lens);
    let ops = p.backend.take_profile().unwrap();
    p.backend.set_profiling(false);
    assert!(
        ops.iter().any(|o| o.op == "paged_decode_v2_d64"),
        "the direct run did not use decode attention v2: {:?}",
        ops.iter().map(|o| &o.op).collect::<Vec<_>>()
    );
    let before = p.backend.step_stats();
    p.backend.set_step_replay(true);
    let replayed = generate(&p, &prompts, &lens);
    let stats = p.backend.step_stats();
    p.backend.set_step_replay(false);
    eprintln!("step stats: before {before:?}, after {stats:?}");
    assert!(stats.recorded > before.recorded, "no step was recorded");
    assert!(
        stats.replayed - before.replayed >= 20,
        "only {} steps replayed: growing contexts should replay, not re-record",
        stats.replayed - before.replayed
    );
    assert!(
        same_bits(&direct, &replayed),
        "replayed steps differ from the direct run"
    );
}

fn same_bits(a: &Runs, b: &Runs) -> bool {
    a.iter().zip(b).all(|(x, y)| {
        x.0 == y.0
            && x.1.len() == y.1.len()
            && x.1
                .iter()
                .zip(&y.1)
                .all(|(p, q)| p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits()))
    })
}

#[test]
fn switching_batch_invariant_mode_records_the_steps_again() {
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => return eprintln!("SKIP (no usable GPU): {e}"),
    };
    let p = Pipeline::load(be, &fixture("tiny-qwen3-vl"), None).unwrap();
    // v1 attention in both modes: only the GEMMs' algorithms change with the mode, so only the GEMM
    // trace can tell the recordings of one mode from the other's.
    p.backend.set_attention_v1_only(true);
    let mut rng = fastrand::Rng::with_seed(10);
    let prompts: Vec<Vec<u32>> = [12, 70]
        .iter()
        .map(|&n| (0..n).map(|_| rng.u32(0..1000)).collect())
        .collect();
    let lens = [10, 6];
    p.backend.set_step_replay(true);
    generate(&p, &prompts, &lens);
    p.backend.set_batch_invariant(true);
    let before = p.backend.step_stats();
    let replayed = generate(&p, &prompts, &lens);
    let after = p.backend.step_stats();
    p.backend.set_step_replay(false);
    let direct = generate(&p, &prompts, &lens);
    eprintln!("step stats: before the switch {before:?}, after {after:?}");
    assert!(
        after.recorded > before.recorded,
        "no step recorded after the switch: the other mode's graphs were replayed"
    );
    assert!(
        after.replayed > before.replayed,
        "nothing replayed in the new mode"
    );
    assert!(
        same_bits(&replayed, &direct),
        "replay in the new mode differs from its direct run"
    );
}

#[test]
fn a_step_whose_recording_keeps_failing_is_given_up() {
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(e) => return eprintln!("SKIP (no usable GPU): {e}"),
    };
    be.set_step_replay(true);
    let key = StepKey { rows: 3, tag: 0xfa11 };
    let before = be.step_stats();
    let mut calls = 0;
    // A host read inside a step cannot be recorded: every capture of this step fails.
    let mut step = || {
        calls += 1;
        let t = be.upload(&[1.0, 2.0], 1, 2)?;
        be.download(&t)
    };
    for i in 0..8 {
        let out = be.run_step(key, &mut step).unwrap();
        assert_eq!(out, vec![1.0, 2.0], "step {i}");
    }
    let s = be.step_stats();
    eprintln!("step stats: before {before:?}, after {s:?}");
    // One warm-up, three failed captures each followed by a direct run, then four direct runs.
    assert_eq!(calls, 1 + 3 * 2 + 4);
    assert_eq!(s.failed_recordings - before.failed_recordings, 3);
    assert_eq!(s.given_up - before.given_up, 1);
    assert_eq!(s.direct - before.direct, 8);
    assert_eq!((s.recorded, s.replayed), (before.recorded, before.replayed));
}
