//! ScopeMem on the tiny Qwen3-VL against HF transformers (tools/gen_scopemem_step_fixtures.py) and
//! exact invariants: p0 sums to 1 and matches HF's scoring; the actor's logits with the 16 prepended
//! prefix vectors match HF fed `inputs_embeds`; the drafted second pass is bitwise the plain one, and
//! when the second opinion equals the first it takes at most 2 decoder forwards; a one-pass encoder
//! serves in one actor pass, with the second opinion exactly the greedy answer on its prefix.

mod common;

use std::path::Path;

use common::{fixture, max_abs_diff, Reference};
use recall::agent::action::Platform;
use recall::agent::causalcache::agent_params;
use recall::agent::scopemem::{
    action_type_distribution, encoder_prefix, scopemem_step, step_context, with_prefix, Placement,
    ScopeMemConfig,
};
use recall::backend::{cpu::CpuBackend, Backend};
use recall::engine::{EngineConfig, GenerateParams, Outcome, Pipeline, Prompt, RequestOptions, Task};
use recall::model::scopemem::ScopeMemEncoder;
use recall::model::{LogitsFor, Positions, VisualFeatures};
use recall::tokenize::chat::parse_messages;

fn setup() -> (Pipeline<CpuBackend>, Reference) {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    (p, Reference::load(&fixture("scopemem"), "step_reference"))
}

fn prompt(p: &Pipeline<CpuBackend>, r: &Reference, e: &mut recall::engine::Engine<'_, CpuBackend>) -> Prompt {
    let messages = parse_messages(&r.meta["messages"].to_string(), Path::new("fixture")).unwrap();
    p.chat_prompt(e, &messages, true).unwrap()
}

#[test]
fn p0_matches_hf_and_sums_to_one() {
    let (p, r) = setup();
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let prompt = prompt(&p, &r, &mut e);
    let first = r.meta["first_opinion"].as_str().unwrap();
    let p0 = action_type_distribution(&mut p.session(&mut e), &prompt, first, Platform::Mobile).unwrap();
    let sum: f32 = p0.iter().sum();
    assert!((sum - 1.0).abs() < 1e-5, "p0 sums to {sum}");
    let (want, _) = r.f32("p0");
    assert!(max_abs_diff(&p0, &want) < 1e-4, "{p0:?} vs {want:?}");
}

#[test]
fn prepended_prefix_matches_hf_inputs_embeds() {
    let (p, r) = setup();
    let be = &p.backend;
    let ids = r.ids("prompt_ids");
    let (prefix, shape) = r.f32("prefix");
    let rows = shape[0];
    // The decoder fed [prefix; embed(ids)] directly.
    let all: Vec<u32> = std::iter::repeat_n(0, rows).chain(ids.iter().copied()).collect();
    let visual = VisualFeatures {
        rows: (0..rows).collect(),
        embeds: be.upload(&prefix, rows, shape[1]).unwrap(),
        deepstack: vec![],
    };
    let mut cache = p.model.text.new_cache(be, all.len()).unwrap();
    let pos = Positions::text(0, all.len());
    let out = p
        .model
        .text
        .forward(
            be,
            &all,
            &pos,
            Some(&visual),
            &[],
            &mut cache,
            LogitsFor::All,
            false,
        )
        .unwrap();
    let (want, _) = r.f32("prefix_logits");
    let err = max_abs_diff(&be.download(&out.logits).unwrap(), &want);
    assert!(err <= 1e-4, "logits with the prefix: max abs error {err}");

    // Through the engine: the prefix as an embedding run, first decision's logits = HF's last row.
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let plain = prompt(&p, &r, &mut e);
    let with = with_prefix(&p.session(&mut e), &plain, prefix, Placement::Prepend).unwrap();
    let params = GenerateParams {
        max_tokens: 1,
        eos_token_ids: vec![],
        stop_strings: vec![],
    };
    let opts = RequestOptions {
        return_logits: true,
        ..Default::default()
    };
    let id = e.add_request_with(&with, Task::Generate(params), opts).unwrap();
    let o = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
    assert!(matches!(o.outcome, Outcome::Generation(_)));
    let vocab = o.decision_logits[0].len();
    let err = max_abs_diff(&o.decision_logits[0], &want[want.len() - vocab..]);
    assert!(err <= 1e-4, "engine logits with the prefix: max abs error {err}");
}

#[test]
fn drafted_second_pass_is_exact_and_short_when_opinions_agree() {
    let (p, r) = setup();
    let encoder = ScopeMemEncoder::load(&fixture("scopemem/encoder")).unwrap();
    let history = vec![
        "Open the Messages app.".to_string(),
        "Open the conversation with Alice.".to_string(),
    ];
    for placement in [Placement::Prepend, Placement::Append] {
        let run = |draft: bool| {
            let mut e = p.engine(EngineConfig::default()).unwrap();
            let prompt = prompt(&p, &r, &mut e);
            let cfg = ScopeMemConfig {
                placement,
                max_tokens: 10,
                draft,
                ..Default::default()
            };
            scopemem_step(
                &mut p.session(&mut e),
                &encoder,
                &prompt,
                "Send the forecast to Alice.",
                &history,
                Platform::Mobile,
                &cfg,
            )
            .unwrap()
        };
        let (drafted, plain) = (run(true), run(false));
        assert_eq!(
            drafted.second, plain.second,
            "{placement:?}: drafting changed the second opinion"
        );
        assert_eq!(drafted.first, plain.first);
        assert!((drafted.p0.unwrap().iter().sum::<f32>() - 1.0).abs() < 1e-5);
        if Some(&drafted.second) == drafted.first.as_ref() {
            assert!(drafted.second_pass_forwards <= 2, "{placement:?}: {drafted:?}");
        }
    }

    // Force agreement: draft the second pass with its own plain answer, as when a1 = a0.
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let base = prompt(&p, &r, &mut e);
    let (prefix, _) = r.f32("prefix");
    let second = with_prefix(&p.session(&mut e), &base, prefix, Placement::Prepend).unwrap();
    let params = GenerateParams {
        max_tokens: 10,
        eos_token_ids: vec![],
        stop_strings: vec![],
    };
    let plain = e.generate(&second, &params).unwrap();
    let before = e.forwards;
    let opts = RequestOptions {
        draft: plain.tokens.clone(),
        ..Default::default()
    };
    let id = e.add_request_with(&second, Task::Generate(params), opts).unwrap();
    let o = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
    let Outcome::Generation(g) = o.outcome else {
        panic!()
    };
    assert_eq!(g.tokens, plain.tokens);
    assert!(e.forwards - before <= 2, "{} forwards", e.forwards - before);
}

#[test]
fn a_one_pass_encoder_serves_in_one_pass() {
    let (p, r) = setup();
    let encoder = ScopeMemEncoder::load(&fixture("scopemem/variants/task-only")).unwrap();
    let (task, history) = (
        "Send the forecast to Alice.",
        vec!["Open the Messages app.".to_string()],
    );
    // The expected answer: greedy (the agent's stopping rules) on the prompt with the prefix of the
    // task alone.
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let base = prompt(&p, &r, &mut e);
    let params = agent_params(&p.session(&mut e), 10);
    let want = {
        let mut s = p.session(&mut e);
        let ctx = step_context(&mut s, &base, task, &history, Platform::Mobile, 10, 32, false).unwrap();
        assert!(ctx.first.is_none() && ctx.p0.is_none() && ctx.ids.first_opinion.is_empty());
        let prefix = encoder_prefix(&mut s, &encoder, &ctx).unwrap();
        with_prefix(&s, &base, prefix, Placement::Prepend).unwrap()
    };
    let want = e.generate(&want, &params).unwrap();
    let plain = e.generate(&base, &params).unwrap();

    for baseline in [false, true] {
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let base = prompt(&p, &r, &mut e);
        let before = e.forwards;
        let cfg = ScopeMemConfig {
            max_tokens: 10,
            baseline,
            ..Default::default()
        };
        let o = scopemem_step(
            &mut p.session(&mut e),
            &encoder,
            &base,
            task,
            &history,
            Platform::Mobile,
            &cfg,
        )
        .unwrap();
        assert_eq!(
            o.second,
            want.text.clone().unwrap_or_default(),
            "baseline {baseline}"
        );
        if baseline {
            assert_eq!(o.first, plain.text.clone());
            assert!((o.p0.unwrap().iter().sum::<f32>() - 1.0).abs() < 1e-5);
        } else {
            assert!(o.first.is_none() && o.p0.is_none() && o.h0.is_none());
            assert_eq!(
                e.forwards - before,
                o.second_pass_forwards,
                "without a baseline the prefixed pass is the only one"
            );
        }
    }
}
