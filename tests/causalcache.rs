//! The two-pass step on the bundled demo episode and the tiny Qwen3-VL (CPU, bitwise):
//! * with S = Recent-B (the Recent policy) pass 2 never runs and the answer is byte-identical to a
//!   single-pass run of the Recent-B prompt;
//! * when the policy swaps an older event in, pass 2 runs, and its answer — computed after pass 1
//!   filled the caches, and drafted from the proposal — equals a fresh run of the S prompt with no
//!   caches and no draft.

mod common;

use std::path::Path;

use common::fixture;
use recall::agent::causalcache::{two_pass_step, EpisodeMemo, TwoPassConfig};
use recall::backend::cpu::CpuBackend;
use recall::engine::{EngineConfig, GenerateParams, Pipeline};
use recall::memory::episode::Episode;
use recall::memory::policy::{AllocationPolicy, PolicyInputs, Recent};
use recall::memory::protocol::{render_decision, Protocol};
use recall::memory::selector::DecisionContext;

/// Always shows the oldest event plus the most recent ones (a promotion whenever t > B + 1).
struct OldestFirst;

impl AllocationPolicy for OldestFirst {
    fn name(&self) -> &'static str {
        "oldest-first"
    }

    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        budget: usize,
        _: &PolicyInputs,
    ) -> recall::Result<Vec<usize>> {
        let n = ctx.events.len();
        if n <= budget || budget == 0 {
            return Ok((n + 1 - n.min(budget)..=n).filter(|&s| s >= 1).collect());
        }
        let mut s = vec![1];
        s.extend(n + 2 - budget..=n);
        Ok(s)
    }
}

fn demo() -> (Pipeline<CpuBackend>, Episode) {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo/episode");
    (p, Episode::load(&dir).unwrap())
}

fn cfg() -> TwoPassConfig {
    TwoPassConfig {
        budget: 2,
        max_tokens: 12,
        ..TwoPassConfig::default()
    }
}

/// The answer of a fresh engine (no prefix caching, no draft) to decision t rendered with `allocation`.
fn fresh_answer(p: &Pipeline<CpuBackend>, episode: &Episode, t: usize, allocation: &[usize]) -> Vec<u32> {
    let mut e = p
        .engine(EngineConfig {
            prefix_caching: false,
            ..EngineConfig::default()
        })
        .unwrap();
    let messages = render_decision(Protocol::Mobile, &episode.decision(t).unwrap(), allocation).unwrap();
    let prompt = p.chat_prompt(&mut e, &messages, true).unwrap();
    let mut eos = p.eos_token_ids();
    eos.extend(p.tokenizer.token_id("</tool_call>"));
    let params = GenerateParams {
        max_tokens: cfg().max_tokens,
        eos_token_ids: eos,
        stop_strings: vec![],
    };
    e.generate(&prompt, &params).unwrap().tokens
}

#[test]
fn recent_allocation_is_a_single_pass() {
    let (p, episode) = demo();
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let mut memo = EpisodeMemo::default();
    for t in 1..=episode.decisions() {
        let r = two_pass_step(
            &mut p.session(&mut e),
            &episode,
            t,
            &mut Recent,
            &cfg(),
            &mut memo,
        )
        .unwrap();
        assert!(!r.pass2 && r.k == 0 && r.allocation == r.recent, "t={t}: {r:?}");
        assert_eq!(r.response, r.proposal);
        let single = p
            .tokenizer
            .decode(&fresh_answer(&p, &episode, t, &r.recent))
            .unwrap();
        assert_eq!(
            r.response, single,
            "t={t}: the two-pass answer differs from a single pass"
        );
    }
}

#[test]
fn second_pass_equals_a_fresh_run_of_its_prompt() {
    let (p, episode) = demo();
    let mut e = p
        .engine(EngineConfig {
            block_size: 8,
            ..EngineConfig::default()
        })
        .unwrap();
    let mut memo = EpisodeMemo::default();
    let mut ran = 0;
    for t in 1..=episode.decisions() {
        let r = two_pass_step(
            &mut p.session(&mut e),
            &episode,
            t,
            &mut OldestFirst,
            &cfg(),
            &mut memo,
        )
        .unwrap();
        assert_eq!(r.pass2, r.allocation != r.recent, "t={t}");
        if r.pass2 {
            ran += 1;
            assert_eq!(r.k, 1, "t={t}: {r:?}");
            let fresh = p
                .tokenizer
                .decode(&fresh_answer(&p, &episode, t, &r.allocation))
                .unwrap();
            assert_eq!(
                r.response, fresh,
                "t={t}: pass 2 differs from a fresh run of its prompt"
            );
            assert!(r.reused_tokens.1 > 0, "t={t}: pass 2 reused nothing");
        }
    }
    assert!(ran >= 5, "pass 2 ran only {ran} times");
    // Each screenshot went through the vision tower once over the whole episode.
    assert_eq!(e.vision_cache().tower_runs as usize, episode.len() + 1);
}
