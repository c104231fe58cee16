//! ScopeMem audit items 8 and 9:
//!
//! * an encoder directory records the context layout and placement it was trained with, and the
//!   step refuses another one, naming the field and both values; an unrecorded value is not checked;
//! * the paper's three-way counts against the plain actor (Table 3: repairs/harms of each system and
//!   the "only one system" keeps and repairs), on a hand-made set of verdicts and on the paper's own
//!   AndroidControl row;
//! * the Table 7 interventions change exactly the encoder input they name.

mod common;

use std::path::{Path, PathBuf};

use common::fixture;
use recall::action::Platform;
use recall::agent::compare::{compare, AgainstPlain, OnlyOne, RepairsHarms};
use recall::agent::dataset::StepDataset;
use recall::agent::eval::{evaluate, BootstrapConfig, StepOutcome, StepVerdict, Verdict};
use recall::agent::scopemem::{
    check_trained_with, intervene, perturb_first_opinion, run_dataset, scopemem_step, EncoderFields,
    Intervention, Placement, ScopeMemConfig, StepContext, MOBILE_ACTION_TYPES,
};
use recall::backend::cpu::CpuBackend;
use recall::engine::{EngineConfig, Pipeline};
use recall::memory::protocol::ContextLayout;
use recall::model::scopemem::ScopeMemEncoder;

// ------------------------------------------------------------------------------------ item 8

/// The fixture encoder copied to a temporary directory with `extra` merged into its config.
fn encoder_with(extra: serde_json::Value) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("scopemem/encoder");
    let dir = tmp.path().join("encoder");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(src.join("scopemem.safetensors"), dir.join("scopemem.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("scopemem_config.json")).unwrap()).unwrap();
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("scopemem_config.json"), cfg.to_string()).unwrap();
    (tmp, dir)
}

#[test]
fn a_mismatched_layout_or_placement_is_refused_naming_both_values() {
    let (_t, dir) = encoder_with(serde_json::json!({"layout": "paper", "placement": "append"}));
    let enc = ScopeMemEncoder::load(&dir).unwrap();
    let rec = &enc.config().trained_with;
    assert_eq!(
        (rec.layout.as_deref(), rec.placement.as_deref()),
        (Some("paper"), Some("append"))
    );
    check_trained_with(&enc, Placement::Append, ContextLayout::Paper).unwrap();

    let e = check_trained_with(&enc, Placement::Prepend, ContextLayout::Paper)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("placement `append`")
            && e.contains("placement `prepend`")
            && e.contains("--placement append"),
        "{e}"
    );
    let e = check_trained_with(&enc, Placement::Append, ContextLayout::GuiOwl)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layout `paper`") && e.contains("layout `gui-owl`") && e.contains("--context paper"),
        "{e}"
    );
}

#[test]
fn the_step_itself_refuses_before_running_the_actor() {
    let (_t, dir) = encoder_with(serde_json::json!({"layout": "gui-owl", "placement": "append"}));
    let enc = ScopeMemEncoder::load(&dir).unwrap();
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let messages =
        recall::tokenize::chat::parse_messages(r#"[{"role": "user", "content": "hello"}]"#, Path::new("."))
            .unwrap();
    let prompt = p.chat_prompt(&mut e, &messages, true).unwrap();
    let before = e.forwards;
    let cfg = ScopeMemConfig {
        max_tokens: 4,
        ..Default::default()
    };
    let err = scopemem_step(
        &mut p.session(&mut e),
        &enc,
        &prompt,
        "t",
        &[],
        Platform::Mobile,
        &cfg,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`append`") && err.contains("`prepend`"), "{err}");
    assert_eq!(e.forwards, before, "refused before any actor pass");
}

#[test]
fn an_unrecorded_encoder_is_served_unchecked_and_a_bad_record_is_a_load_error() {
    // The fixture predates the record: no layout, no placement.
    let enc = ScopeMemEncoder::load(&fixture("scopemem/encoder")).unwrap();
    assert_eq!(enc.config().trained_with, Default::default());
    for placement in [Placement::Prepend, Placement::Append] {
        for layout in [ContextLayout::GuiOwl, ContextLayout::Paper] {
            check_trained_with(&enc, placement, layout).unwrap();
        }
    }
    // Only the recorded one is checked.
    let (_t, dir) = encoder_with(serde_json::json!({"placement": "prepend"}));
    let enc = ScopeMemEncoder::load(&dir).unwrap();
    check_trained_with(&enc, Placement::Prepend, ContextLayout::Paper).unwrap();
    assert!(check_trained_with(&enc, Placement::Append, ContextLayout::GuiOwl).is_err());

    let (_t, dir) = encoder_with(serde_json::json!({"layout": 3}));
    let e = ScopeMemEncoder::load(&dir).err().unwrap().to_string();
    assert!(e.contains("layout") && e.contains("scopemem_config.json"), "{e}");
}

// ------------------------------------------------------------------------------------ item 9

fn v(plain: bool, system: bool) -> StepVerdict {
    let x = |em| Verdict {
        parsed: true,
        em,
        tm: em,
    };
    StepVerdict {
        first: x(plain),
        second: x(system),
    }
}

/// A hand-made set of verdicts, each count derived by hand from the paper. Table 3's caption:
/// "Counts on the main test sets are relative to the plain actor. 'Only one system' counts correct
/// steps only one preserves or errors only one repairs"; §3.3: a change that turns a correct
/// decision into an incorrect one is a harm; Figure 1: a prefix "repairs 196 errors but harms 115
/// correct decisions".
#[test]
fn three_way_counts_follow_the_papers_definitions() {
    // (plain, A, B) per step.
    let steps = [
        (true, true, true),    // kept by both: in no "only one" count
        (true, true, false),   // B harms; only A keeps
        (true, false, true),   // A harms; only B keeps
        (true, false, true),   // again
        (true, false, false),  // both harm: in no "only one" count
        (false, true, true),   // both repair
        (false, true, false),  // A repairs; only A repairs
        (false, false, true),  // B repairs; only B repairs
        (false, false, false), // neither repairs
    ];
    let mut c = AgainstPlain::default();
    for (p, a, b) in steps {
        c.add(&v(p, a), &v(p, b));
    }
    assert_eq!(
        (c.steps, c.plain_right, c.plain_wrong, c.plain_disagrees),
        (9, 5, 4, 0)
    );
    // A: repairs steps 6 and 7 (2), harms steps 3, 4 and 5 (3).
    assert_eq!(c.a, RepairsHarms { repairs: 2, harms: 3 });
    // B: repairs steps 6 and 8 (2), harms steps 2 and 5 (2).
    assert_eq!(c.b, RepairsHarms { repairs: 2, harms: 2 });
    assert_eq!(
        c.only_one,
        OnlyOne {
            keeps_a: 1,
            keeps_b: 2,
            repairs_a: 1,
            repairs_b: 1
        }
    );
    // A step whose a0 the reports judge differently has no single plain verdict.
    c.add(&v(true, true), &v(false, true));
    assert_eq!((c.steps, c.plain_disagrees), (9, 1));
}

/// Table 3's AndroidControl row, rebuilt: 564 steps, the plain actor at 62.59% EM (353 right, 211
/// wrong; Table 2), ScopeMem (B) 57 repairs / 27 harms, Mem-W (A) 55 / 36, only one keeps 16/7,
/// only one repairs 13/11, advantage +1.95 pp. Harms of B = both harm + only A keeps, so both harm
/// 27 − 7 = 20 (and 20 + 16 = 36 harms of A); repairs of B = both repair + only B repairs, so both
/// repair 57 − 13 = 44 (and 44 + 11 = 55 repairs of A). The counts come back exactly, and the
/// advantage is the paper's.
#[test]
fn the_papers_androidcontrol_row_is_reproduced() {
    let blocks: [(usize, bool, bool, bool); 8] = [
        (20, true, false, false),                  // both harm
        (16, true, false, true),                   // only ScopeMem keeps
        (7, true, true, false),                    // only Mem-W keeps
        (353 - 20 - 16 - 7, true, true, true),     // both keep
        (44, false, true, true),                   // both repair
        (13, false, false, true),                  // only ScopeMem repairs
        (11, false, true, false),                  // only Mem-W repairs
        (211 - 44 - 13 - 11, false, false, false), // neither
    ];
    let click = |x: u32| {
        format!(
            "<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"click\", \"coordinate\": [{x}, 500]}}}}\n</tool_call>"
        )
    };
    let (mut mem_w, mut scopemem) = (Vec::new(), Vec::new());
    let mut i = 0u32;
    for (n, plain, a, b) in blocks {
        for _ in 0..n {
            let out = |right: bool| click(if right { 100 } else { 900 });
            let row = |second: bool| {
                serde_json::from_value::<StepOutcome>(serde_json::json!({
                    "episode": format!("ep{}", i / 8), "step": i % 8, "subset": null,
                    "reference": click(100), "first": out(plain), "second": out(second),
                    "target_box": null,
                }))
                .unwrap()
            };
            mem_w.push(row(a));
            scopemem.push(row(b));
            i += 1;
        }
    }
    assert_eq!(i, 564);
    let boot = BootstrapConfig {
        resamples: 0,
        ..BootstrapConfig::default()
    };
    let (ra, rb) = (
        evaluate(&mem_w, Platform::Mobile, boot).unwrap(),
        evaluate(&scopemem, Platform::Mobile, boot).unwrap(),
    );
    let c = compare(&ra, &rb, ("Mem-W", "ScopeMem"), boot).unwrap();
    let p = c.against_plain;
    assert_eq!((p.steps, p.plain_right, p.plain_wrong), (564, 353, 211));
    assert_eq!(
        p.b,
        RepairsHarms {
            repairs: 57,
            harms: 27
        }
    );
    assert_eq!(
        p.a,
        RepairsHarms {
            repairs: 55,
            harms: 36
        }
    );
    assert_eq!(
        p.only_one,
        OnlyOne {
            keeps_b: 16,
            keeps_a: 7,
            repairs_b: 13,
            repairs_a: 11
        }
    );
    assert_eq!(format!("{:.2}", 100.0 * c.advantage), "1.95");
    assert_eq!(format!("{:.2}", 100.0 * c.em_b), "67.91"); // Table 2: ScopeMem 67.91
    assert_eq!(format!("{:.2}", 100.0 * c.em_a), "65.96"); // Table 2: Mem-W 65.96
                                                           // The single-system report counts the same repairs and harms against a0.
    assert_eq!((rb.overall.counts.repairs, rb.overall.counts.harms), (57, 27));
    let md = c.to_markdown();
    assert!(md.contains("| 57/27 | 55/36 | 16/7 | 13/11 |"), "{md}");
}

// ------------------------------------------------------------------------------------ interventions

fn context(first: &str, history: &[String], s: &recall::tokenize::Tokenizer) -> StepContext {
    let fields = EncoderFields::build(first, "Set an alarm", history, Platform::Mobile);
    let ids = fields.ids(s, 32).unwrap();
    StepContext {
        first: Some(first.to_string()),
        first_tokens: Some(s.encode(first).unwrap()),
        p0: Some([0.1; 10]),
        h0: Some(2.3),
        fields,
        ids,
    }
}

fn tool_call(action: &str) -> String {
    format!(
        "Action: Tap.\n<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"{action}\", \"coordinate\": [3, 4]}}}}\n</tool_call>"
    )
}

#[test]
fn each_intervention_changes_exactly_its_input() {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let tok = &p.tokenizer;
    let history = vec![tool_call("open"), tool_call("swipe")];
    let base = context(&tool_call("click"), &history, tok);

    let mut c = base.clone();
    intervene(&mut c, Intervention::WithholdHistory, None, 0, tok, 32).unwrap();
    assert!(c.fields.summary.is_empty() && c.fields.recent_actions.is_empty());
    assert!(c.ids.summary.is_empty() && c.ids.recent_actions.is_empty());
    let mut back = c.clone();
    back.fields.summary = base.fields.summary.clone();
    back.fields.recent_actions = base.fields.recent_actions.clone();
    back.ids.summary = base.ids.summary.clone();
    back.ids.recent_actions = base.ids.recent_actions.clone();
    assert_eq!(back, base, "withhold-history changes nothing else");

    let donor = context(&tool_call("type"), &[], tok);
    let mut c = base.clone();
    let d = (
        donor.fields.first_opinion.as_str(),
        donor.ids.first_opinion.as_slice(),
    );
    intervene(&mut c, Intervention::OtherA0, Some(d), 0, tok, 32).unwrap();
    assert_eq!(c.fields.first_opinion, donor.fields.first_opinion);
    assert_eq!(c.ids.first_opinion, donor.ids.first_opinion);
    let mut back = c.clone();
    back.fields.first_opinion = base.fields.first_opinion.clone();
    back.ids.first_opinion = base.ids.first_opinion.clone();
    assert_eq!(
        back, base,
        "other-a0 changes nothing else (a0 itself, p0, H0 stay)"
    );

    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..40 {
        let mut c = base.clone();
        intervene(&mut c, Intervention::PerturbA0, None, seed, tok, 32).unwrap();
        let named = c.fields.first_opinion.split("\"action\": \"").nth(1).unwrap();
        let t = named.split('"').next().unwrap().to_string();
        assert_ne!(t, "click");
        assert!(MOBILE_ACTION_TYPES.contains(&t.as_str()), "{t}");
        seen.insert(t.clone());
        // Only the action type's text moved; the ids are the new text's, cut as serving cuts.
        let t = t.as_str();
        assert_eq!(c.fields.first_opinion, tool_call(t));
        let want = EncoderFields::build(&tool_call(t), "", &[], Platform::Mobile);
        assert_eq!(c.ids.first_opinion, want.ids(tok, 32).unwrap().first_opinion);
        let mut back = c.clone();
        back.fields.first_opinion = base.fields.first_opinion.clone();
        back.ids.first_opinion = base.ids.first_opinion.clone();
        assert_eq!(back, base);
        // Deterministic for a seed.
        assert_eq!(
            perturb_first_opinion(&tool_call("click"), seed),
            Some(tool_call(t))
        );
    }
    assert!(seen.len() >= 5, "draws spread over the other types: {seen:?}");
    assert_eq!(perturb_first_opinion("I will click it.", 1), None);
}

/// Through `run_dataset` (what `recall eval --intervention` runs): the encoder's recorded inputs
/// (`opinions.context`) differ from the unmodified run only where the intervention says, and the
/// a0 the metrics count against is the step's own.
#[test]
fn run_dataset_applies_the_intervention_and_keeps_the_plain_pass() {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let enc = ScopeMemEncoder::load(&fixture("scopemem/encoder")).unwrap();
    let data = StepDataset::load(&fixture("eval/aitw_steps.jsonl")).unwrap();
    let lines = [1usize, 2, 3, 4];
    let run = |iv: Option<Intervention>, seed: u64| {
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let cfg = ScopeMemConfig {
            max_tokens: 8,
            intervention: iv,
            intervention_seed: seed,
            ..Default::default()
        };
        run_dataset(&mut p.session(&mut e), Some(&enc), &data, Some(&lines), &cfg).unwrap()
    };
    let base = run(None, 0);
    let ctx = |r: &recall::agent::scopemem::DatasetResult| r.opinions.as_ref().unwrap().context.clone();
    let no_hist = run(Some(Intervention::WithholdHistory), 0);
    for (b, n) in base.iter().zip(&no_hist) {
        assert_eq!(b.outcome.first, n.outcome.first);
        let (cb, mut cn) = (ctx(b), ctx(n));
        assert!(cn.ids.summary.is_empty() && cn.ids.recent_actions.is_empty());
        cn.fields.summary = cb.fields.summary.clone();
        cn.fields.recent_actions = cb.fields.recent_actions.clone();
        cn.ids.summary = cb.ids.summary.clone();
        cn.ids.recent_actions = cb.ids.recent_actions.clone();
        assert_eq!(cn, cb);
    }
    let originals: Vec<Vec<u32>> = base.iter().map(|r| ctx(r).ids.first_opinion).collect();
    let other = run(Some(Intervention::OtherA0), 5);
    assert_eq!(
        other.iter().map(|r| ctx(r).ids.first_opinion).collect::<Vec<_>>(),
        run(Some(Intervention::OtherA0), 5)
            .iter()
            .map(|r| ctx(r).ids.first_opinion)
            .collect::<Vec<_>>(),
        "deterministic for a seed"
    );
    for (i, (b, o)) in base.iter().zip(&other).enumerate() {
        assert_eq!(
            b.outcome.first, o.outcome.first,
            "a0 counted against is the step's own"
        );
        let (cb, mut co) = (ctx(b), ctx(o));
        // Another step's a0: one of the other steps' (distinct steps may share a text).
        let donors: Vec<&Vec<u32>> = (0..4).filter(|j| *j != i).map(|j| &originals[j]).collect();
        assert!(donors.contains(&&co.ids.first_opinion));
        co.fields.first_opinion = cb.fields.first_opinion.clone();
        co.ids.first_opinion = cb.ids.first_opinion.clone();
        assert_eq!(co, cb);
    }
    // An intervention on an input the encoder does not read is refused.
    let one_pass = ScopeMemEncoder::load(&fixture("scopemem/variants/one-pass")).unwrap();
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let cfg = ScopeMemConfig {
        intervention: Some(Intervention::PerturbA0),
        ..Default::default()
    };
    let err = run_dataset(&mut p.session(&mut e), Some(&one_pass), &data, Some(&lines), &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("perturb-a0") && err.contains("does not read"),
        "{err}"
    );
    // The paper's history row is its own encoder: withholding history from it would change nothing.
    let no_history = ScopeMemEncoder::load(&fixture("scopemem/variants/no-history")).unwrap();
    let cfg = ScopeMemConfig {
        intervention: Some(Intervention::WithholdHistory),
        ..Default::default()
    };
    let err = run_dataset(
        &mut p.session(&mut e),
        Some(&no_history),
        &data,
        Some(&lines),
        &cfg,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("withhold-history") && err.contains("does not read"),
        "{err}"
    );
}
