//! Property tests (proptest): invariants that random input can break, each over a few hundred
//! generated cases, shrunk to a minimal counterexample when one fails.
//!
//! * the Qwen tokenizer round-trips any UTF-8 string (up to the NFC normalisation it applies);
//! * rendering any allocation of any episode, under every protocol, keeps every completed step exactly
//!   once (a `Step{i}:` fold line or a retained assistant turn with its screenshot), in order, with the
//!   current screen last;
//! * greedy argmax is the first maximum with NaN never winning (numpy's `nanargmax`; CUDA's
//!   `argmax_v1` reads the same, checked on a device in tests/cuda_ops.rs);
//! * chunked and batched prefill of random prompts give the same greedy tokens and the same logits,
//!   bit for bit, as one unbatched pass.
//!
//! The KV block manager's random interleavings are in tests/kv_invariants.rs.

mod common;

use std::path::{Path, PathBuf};

use common::fixture;
use proptest::prelude::*;
use recall::backend::cpu::CpuBackend;
use recall::engine::{
    EngineConfig, GenerateParams, Outcome, Pipeline, Prompt, RequestOptions, Segment, Task,
};
use recall::memory::episode::StepRecord;
use recall::memory::protocol::{render, Protocol};
use recall::tokenize::chat::{ChatMessage, ContentPart};
use recall::tokenize::Tokenizer;
use unicode_normalization::UnicodeNormalization;

fn qwen_tokenizer() -> &'static Tokenizer {
    static T: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/qwen-vl-tokenizer");
        Tokenizer::from_model_dir(&dir).unwrap()
    })
}

/// `cases` cases, no failure files written into the source tree (a failure prints its minimal input).
fn cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases(1024))]

    /// Any string comes back as the tokenizer's NFC of it, and that is a fixed point. A string already
    /// in NFC comes back unchanged. (The tokenizer's Unicode tables are older than the test's: for a
    /// non-NFC string with marks they do not know, e.g. U+08CF, the two NFCs may order marks
    /// differently, so only NFC input is compared with the test's NFC.)
    #[test]
    fn the_tokenizer_round_trips_any_utf8(text in any::<String>(), ascii in "[ -~\n\t]{0,64}") {
        let tok = qwen_tokenizer();
        let round = |s: &str| tok.decode(&tok.encode(s).unwrap()).unwrap();
        let t = round(&text);
        prop_assert_eq!(&round(&t), &t);
        if text.nfc().eq(text.chars()) {
            prop_assert_eq!(&t, &text);
        }
        prop_assert_eq!(round(&ascii), ascii);
    }
}

// ---- greedy choice ----

/// A logit that is often tied, sometimes NaN or infinite.
fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => (-3i32..4).prop_map(|v| v as f32),
        1 => Just(f32::NAN),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::INFINITY),
    ]
}

proptest! {
    #![proptest_config(cases(1024))]

    /// `argmax_row` is the first index of the maximum over the non-NaN entries (numpy's `nanargmax`),
    /// 0 when every entry is NaN, so a NaN anywhere — index 0 included — never changes the token.
    #[test]
    fn argmax_is_the_first_maximum_and_nan_never_wins(row in prop::collection::vec(logit(), 1..40)) {
        let got = recall::backend::cpu::argmax_row(&row) as usize;
        let finite_or_inf: Vec<(usize, f32)> = row.iter().copied().enumerate().filter(|(_, x)| !x.is_nan()).collect();
        let want = match finite_or_inf.iter().map(|&(_, x)| x).reduce(f32::max) {
            Some(m) => finite_or_inf.iter().find(|&&(_, x)| x == m).map_or(0, |&(i, _)| i),
            None => 0,
        };
        prop_assert_eq!(got, want, "row {:?}", row);
        prop_assert!(!row[got].is_nan() || row.iter().all(|x| x.is_nan()));
    }
}

// ---- rendering ----

fn response(i: usize) -> String {
    format!(
        "Action: Do {i}.\n<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"wait\", \"time\": {i}}}}}\n</tool_call>"
    )
}

/// An episode of `t` completed steps and an allocation drawn from `pick` over the protocol's pool.
fn episode_and_allocation(protocol: Protocol, t: usize, pick: &[bool]) -> (Vec<StepRecord>, Vec<usize>) {
    let steps = (1..=t)
        .map(|i| StepRecord::new(format!("x{i}.png"), response(i)))
        .collect();
    let allocation = protocol
        .eligible(t)
        .filter(|&s| pick.get(s - 1).copied().unwrap_or(false))
        .collect();
    (steps, allocation)
}

/// Where each step appears: `Step{i}:` lines of user texts and assistant turns holding `r_i`.
fn appearances(messages: &[ChatMessage], t: usize) -> (Vec<usize>, Vec<usize>, Vec<String>) {
    let (mut folded, mut retained, mut images) = (Vec::new(), Vec::new(), Vec::new());
    for m in messages.iter().filter(|m| m.role != "system") {
        for part in &m.content {
            match part {
                ContentPart::Text(text) if m.role == "assistant" => {
                    retained.extend((1..=t).filter(|&i| *text == response(i)));
                }
                ContentPart::Text(text) => {
                    for line in text.lines() {
                        let n = line.strip_prefix("Step").and_then(|r| r.split(':').next());
                        folded.extend(n.and_then(|n| n.parse::<usize>().ok()));
                    }
                }
                ContentPart::Image(path) => images.push(path.clone()),
            }
        }
    }
    (folded, retained, images)
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn rendering_any_allocation_keeps_every_step_once(
        t in 0usize..14,
        pick in proptest::collection::vec(any::<bool>(), 14),
        p in 0usize..3,
    ) {
        let protocol = [Protocol::Mobile, Protocol::Desktop, Protocol::DesktopStrictEvents][p];
        let (steps, allocation) = episode_and_allocation(protocol, t, &pick);
        let messages = render(protocol, "Find cats.", &steps, &allocation, Path::new("now.png")).unwrap();
        let (folded, retained, images) = appearances(&messages, t);
        let mut all: Vec<usize> = folded.iter().chain(&retained).copied().collect();
        all.sort_unstable();
        prop_assert_eq!(all, (1..=t).collect::<Vec<_>>(), "{:?} under {:?}", allocation, protocol);
        prop_assert_eq!(&retained, &allocation);
        // Each step appears in order: folds and retained turns interleave by step number.
        let mut seen: Vec<usize> = Vec::new();
        for m in &messages[1..] {
            let (f, r, _) = appearances(std::slice::from_ref(m), t);
            seen.extend(f);
            seen.extend(r);
        }
        prop_assert_eq!(seen, (1..=t).collect::<Vec<_>>());
        let mut want: Vec<String> = allocation.iter().map(|s| format!("x{s}.png")).collect();
        want.push("now.png".into());
        prop_assert_eq!(images, want);
    }
}

// ---- chunked and batched prefill ----

fn engine_config(chunk: usize, max_batch: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks: 256,
        chunk_size: chunk,
        max_batch_tokens: max_batch,
        prefix_caching: false,
        ..EngineConfig::default()
    }
}

/// (tokens, decision logits as bits) of a 3-token greedy generation of `prompt`, alone or beside
/// `others`.
fn generate(
    p: &Pipeline<CpuBackend>,
    cfg: EngineConfig,
    prompt: &[u32],
    others: &[Vec<u32>],
) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut e = p.engine(cfg).unwrap();
    let params = |n| GenerateParams {
        max_tokens: n,
        eos_token_ids: vec![],
        stop_strings: vec![],
    };
    let text = |ids: &[u32]| Prompt {
        segments: vec![Segment::Text(ids.to_vec())],
    };
    for (i, o) in others.iter().enumerate() {
        e.add_request(&text(o), Task::Generate(params(1 + i % 4)))
            .unwrap();
    }
    let opts = RequestOptions {
        return_logits: true,
        ..RequestOptions::default()
    };
    let id = e
        .add_request_with(&text(prompt), Task::Generate(params(3)), opts)
        .unwrap();
    let out = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
    e.check_invariants().unwrap();
    match out.outcome {
        Outcome::Generation(g) => {
            let bits = out
                .decision_logits
                .iter()
                .map(|row| row.iter().map(|x| x.to_bits()).collect())
                .collect();
            (g.tokens, bits)
        }
        other => panic!("{other:?}"),
    }
}

fn pipeline() -> &'static Pipeline<CpuBackend> {
    static P: std::sync::OnceLock<Pipeline<CpuBackend>> = std::sync::OnceLock::new();
    P.get_or_init(|| Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap())
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn chunked_and_batched_prefill_equal_one_pass(
        prompt in proptest::collection::vec(0u32..1000, 1..90),
        others in proptest::collection::vec(proptest::collection::vec(0u32..1000, 1..40), 0..4),
        chunk in 1usize..48,
        slack in 0usize..40,
    ) {
        let p = pipeline();
        let one_pass = generate(p, engine_config(1 << 20, 1 << 20), &prompt, &[]);
        let chunked = generate(p, engine_config(chunk, chunk + slack), &prompt, &[]);
        prop_assert!(chunked == one_pass, "chunk {}: {:?} vs {:?}", chunk, chunked.0, one_pass.0);
        let batched = generate(p, engine_config(chunk, chunk + slack), &prompt, &others);
        prop_assert!(batched == one_pass, "batched with {} others, chunk {}", others.len(), chunk);
    }
}
