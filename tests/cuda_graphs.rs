//! CUDA graphs for decode steps (src/backend/cuda/graph.rs) on the tiny Qwen3-VL: greedy generation of
//! a batch with step replay on is bitwise identical (tokens and every decision's logits) to the same
//! run with replay off, and replay actually happened (recorded and replayed steps counted). Skips
//! without a usable GPU.
#![cfg(feature = "cuda")]

mod common;

use common::fixture;
use recall::backend::cuda::CudaBackend;
use recall::backend::Backend;
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
