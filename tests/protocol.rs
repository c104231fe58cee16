//! The GUI-Owl prompt protocol and the episode format.
//!
//! * Every contiguous recent tail (B = 0..=6, every decision of a 6-step mobile and desktop episode, T = 0
//!   included) renders to the same text, image order and token ids as the official rolling layout built by
//!   upstream's `cut_current_messages` + `convert_format` and Hugging Face's `apply_chat_template`
//!   (`tests/fixtures/protocol/cases.json`, made by `tools/gen_protocol_fixtures.py`).
//! * The gap-fold worked example of `gui_owl_protocol.md` section 3 renders byte-identical to the doc.
//! * Properties over random allocations: every completed step exactly once, alternating roles, 2k+2
//!   messages, history images then the current one; invalid allocations are errors.
//! * The embedded system prompts are the shared files (sha256), and `Episode::load` reads the sample
//!   episode and rejects bad ones naming the file and field.

use std::path::{Path, PathBuf};

use recall::memory::episode::{Episode, Platform, StepRecord};
use recall::memory::protocol::{
    fold, recent_b, render, render_decision, render_with, validate_allocation, Protocol, RestoreAs,
    CONTINUED_HEADER, DESKTOP_SYSTEM_PROMPT, DESKTOP_SYSTEM_PROMPT_SHA256, MOBILE_SYSTEM_PROMPT,
    MOBILE_SYSTEM_PROMPT_SHA256,
};
use recall::tokenize::chat::{render_chat_with_images, ChatFamily, ChatMessage, ContentPart};
use recall::tokenize::Tokenizer;
use recall::Error;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

// ---------------------------------------------------------------------------------------------------
// sha256 (FIPS 180-4), enough to check the prompt files without a dependency.

fn sha256_hex(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for chunk in msg.chunks(64) {
        let mut w = [0u32; 64];
        for i in 0..16 {
            w[i] = u32::from_be_bytes([chunk[4 * i], chunk[4 * i + 1], chunk[4 * i + 2], chunk[4 * i + 3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for (a, b) in h.iter_mut().zip(v) {
            *a = a.wrapping_add(b);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

#[test]
fn sha256_known_answer() {
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn system_prompts_are_the_shared_files() {
    assert_eq!(
        sha256_hex(MOBILE_SYSTEM_PROMPT.as_bytes()),
        MOBILE_SYSTEM_PROMPT_SHA256
    );
    assert_eq!(
        sha256_hex(DESKTOP_SYSTEM_PROMPT.as_bytes()),
        DESKTOP_SYSTEM_PROMPT_SHA256
    );
    assert!(!MOBILE_SYSTEM_PROMPT.ends_with('\n') && !DESKTOP_SYSTEM_PROMPT.ends_with('\n'));
    let shared = root().join("../shared/protocols");
    if !shared.is_dir() {
        eprintln!("skipping the comparison with {}: not present", shared.display());
        return;
    }
    for (file, embedded) in [
        ("gui_owl_mobile_system.txt", MOBILE_SYSTEM_PROMPT),
        ("gui_owl_desktop_system.txt", DESKTOP_SYSTEM_PROMPT),
    ] {
        let bytes = std::fs::read(shared.join(file)).expect("read shared prompt");
        assert_eq!(
            bytes,
            embedded.as_bytes(),
            "{file} differs from src/memory/prompts/{file}"
        );
    }
}

// ---------------------------------------------------------------------------------------------------
// Hugging Face fixtures: contiguous recent tails.

struct FixtureEpisode {
    instruction: String,
    steps: Vec<StepRecord>,
    final_screenshot: PathBuf,
    action_lines: Vec<String>,
}

fn load_fixture() -> Value {
    let path = root().join("tests/fixtures/protocol/cases.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("read cases.json"))
        .expect("cases.json is JSON")
}

fn fixture_episode(doc: &Value, platform: &str) -> FixtureEpisode {
    let e = &doc["episodes"][platform];
    FixtureEpisode {
        instruction: e["instruction"].as_str().unwrap().to_string(),
        steps: e["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| StepRecord::new(s["screenshot"].as_str().unwrap(), s["response"].as_str().unwrap()))
            .collect(),
        final_screenshot: PathBuf::from(e["final_screenshot"].as_str().unwrap()),
        action_lines: e["action_lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap().to_string())
            .collect(),
    }
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

#[test]
fn action_lines_match_the_oracle() {
    let doc = load_fixture();
    for (name, platform) in [("mobile", Platform::Mobile), ("desktop", Platform::Desktop)] {
        let e = fixture_episode(&doc, name);
        let ours: Vec<String> = e.steps.iter().map(|s| s.action_line_for(platform)).collect();
        assert_eq!(ours, e.action_lines, "{name}");
    }
}

#[test]
fn contiguous_tails_match_hugging_face() {
    let doc = load_fixture();
    let tokenizer = Tokenizer::from_file(&root().join("models/qwen-vl-tokenizer/tokenizer.json")).unwrap();
    let episodes = [
        ("mobile", Protocol::Mobile, fixture_episode(&doc, "mobile")),
        ("desktop", Protocol::Desktop, fixture_episode(&doc, "desktop")),
    ];
    let cases = doc["cases"].as_array().unwrap();
    let mut checked = [0usize; 2];
    let mut failures = Vec::new();
    for case in cases {
        let platform = case["platform"].as_str().unwrap();
        let k = usize::from(platform == "desktop");
        let (_, protocol, e) = &episodes[k];
        let t = case["t"].as_u64().unwrap() as usize;
        let b = case["B"].as_u64().unwrap() as usize;
        let t_completed = t - 1;
        let allocation = recent_b(t_completed, b);
        assert_eq!(
            allocation,
            usizes(&case["allocation"]),
            "{platform} t={t} B={b}: Recent-B"
        );
        let current = if t <= e.steps.len() {
            e.steps[t - 1].screenshot.clone()
        } else {
            e.final_screenshot.clone()
        };
        let messages = render(
            *protocol,
            &e.instruction,
            &e.steps[..t_completed],
            &allocation,
            &current,
        )
        .unwrap_or_else(|err| panic!("{platform} t={t} B={b}: {err}"));
        let rendered = render_chat_with_images(ChatFamily::Qwen3Vl, &messages, true);
        let label = format!("{platform} t={t} B={b}");
        if messages.len() != case["n_messages"].as_u64().unwrap() as usize {
            failures.push(format!("{label}: {} messages", messages.len()));
        }
        if rendered.text != case["text"].as_str().unwrap() {
            failures.push(format!(
                "{label}: text\n  got:      {:?}\n  expected: {:?}",
                rendered.text, case["text"]
            ));
            continue;
        }
        let images: Vec<String> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        if rendered.images != images {
            failures.push(format!("{label}: images {:?} vs {images:?}", rendered.images));
        }
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if tokenizer.encode(&rendered.text).unwrap() != ids {
            failures.push(format!("{label}: token ids differ"));
        }
        checked[k] += 1;
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(checked, [49, 49], "7 decisions x 7 budgets per platform");
}

// ---------------------------------------------------------------------------------------------------
// The worked example (gui_owl_protocol.md section 3), with the doc's placeholders.

const WORKED_EXAMPLE: &str = "<|im_start|>system
<SYSTEM_PROMPT><|im_end|>
<|im_start|>user
Please generate the next move according to the UI screenshot, instruction and previous actions.

Instruction: <goal>

Previous actions:
No previous action.<|vision_start|><|image_pad|><|vision_end|><|im_end|>
<|im_start|>assistant
<r1><|im_end|>
<|im_start|>user
Previous actions (continued):
Step2: <a2>
Step3: <a3><|vision_start|><|image_pad|><|vision_end|><|im_end|>
<|im_start|>assistant
<r4><|im_end|>
<|im_start|>user
Previous actions (continued):
Step5: <a5><|vision_start|><|image_pad|><|vision_end|><|im_end|>
<|im_start|>assistant
";

fn placeholder_steps(n: usize) -> Vec<StepRecord> {
    (1..=n)
        .map(|s| StepRecord {
            screenshot: PathBuf::from(format!("x{s}")),
            response: format!("<r{s}>"),
            action_line: Some(format!("<a{s}>")),
            ocr: None,
        })
        .collect()
}

#[test]
fn worked_example_gap_fold_is_byte_identical() {
    let shared = root().join("../shared/protocols/gui_owl_protocol.md");
    if let Ok(doc) = std::fs::read_to_string(&shared) {
        assert!(
            doc.contains(WORKED_EXAMPLE.trim_end()),
            "the literal above is not the doc's text"
        );
    }
    let steps = placeholder_steps(5);
    let messages = render(Protocol::Mobile, "<goal>", &steps, &[1, 4], Path::new("x6")).unwrap();
    let rendered = render_chat_with_images(ChatFamily::Qwen3Vl, &messages, true);
    let expected = WORKED_EXAMPLE.replace("<SYSTEM_PROMPT>", MOBILE_SYSTEM_PROMPT);
    assert_eq!(rendered.text, expected);
    assert_eq!(rendered.images, vec!["x1", "x4", "x6"]);

    // Recent-2 (the official layout): the image-only user turns begin directly with <|vision_start|>.
    let messages = render(
        Protocol::Mobile,
        "<goal>",
        &steps,
        &recent_b(5, 2),
        Path::new("x6"),
    )
    .unwrap();
    let text = render_chat_with_images(ChatFamily::Qwen3Vl, &messages, true).text;
    assert!(text.contains(
        "Step3: <a3><|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n<r4><|im_end|>\n\
         <|im_start|>user\n<|vision_start|>"
    ));
    assert_eq!(messages[3].content, vec![ContentPart::Image("x5".into())]);
}

#[test]
fn desktop_uses_the_desktop_prompt_with_the_same_layout() {
    let steps = placeholder_steps(5);
    let mobile = render(Protocol::Mobile, "<goal>", &steps, &[1, 4], Path::new("x6")).unwrap();
    let desktop = render(Protocol::Desktop, "<goal>", &steps, &[1, 4], Path::new("x6")).unwrap();
    assert_eq!(desktop[0], ChatMessage::text("system", DESKTOP_SYSTEM_PROMPT));
    assert_eq!(mobile[1..], desktop[1..]);
    // Strict desktop events: same rendering, but step 1 is never a history image.
    let strict = render(
        Protocol::DesktopStrictEvents,
        "<goal>",
        &steps,
        &[2, 4],
        Path::new("x6"),
    )
    .unwrap();
    assert_eq!(
        strict,
        render(Protocol::Desktop, "<goal>", &steps, &[2, 4], Path::new("x6")).unwrap()
    );
    let err = render(
        Protocol::DesktopStrictEvents,
        "<goal>",
        &steps,
        &[1, 4],
        Path::new("x6"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("step 1"), "{err}");
    assert_eq!(Protocol::DesktopStrictEvents.recent_b(1, 4), Vec::<usize>::new());
    assert_eq!(Protocol::DesktopStrictEvents.recent_b(5, 2), vec![4, 5]);
    assert_eq!(Protocol::DesktopStrictEvents.recent_b(3, 9), vec![2, 3]);
}

// ---------------------------------------------------------------------------------------------------
// Properties over random allocations.

fn text_of(part: &ContentPart) -> Option<&str> {
    match part {
        ContentPart::Text(t) => Some(t),
        ContentPart::Image(_) => None,
    }
}

/// Checks every structural rule of section 2 for one (T, S); returns the number of fold lines.
fn check_structure(t_completed: usize, allocation: &[usize], messages: &[ChatMessage]) {
    let k = allocation.len();
    let ctx = format!("T={t_completed} S={allocation:?}");
    assert_eq!(messages.len(), 2 * k + 2, "{ctx}: message count");
    assert_eq!(messages[0].role, "system");
    for (i, m) in messages.iter().enumerate().skip(1) {
        let expected = if i % 2 == 1 { "user" } else { "assistant" };
        assert_eq!(m.role, expected, "{ctx}: role of message {i}");
        if m.role == "user" {
            let images = m.images().count();
            assert_eq!(images, 1, "{ctx}: message {i} has {images} images");
            assert!(
                matches!(m.content.last(), Some(ContentPart::Image(_))),
                "{ctx}: image last"
            );
            assert!(m.content.len() <= 2, "{ctx}: at most text + image");
        } else {
            assert_eq!(m.content.len(), 1);
        }
    }
    // Images: x_{s_1} .. x_{s_k}, then the current one.
    let images: Vec<String> = messages
        .iter()
        .flat_map(|m| m.images().map(str::to_string))
        .collect();
    let mut expected: Vec<String> = allocation.iter().map(|s| format!("x{s}")).collect();
    expected.push("current".into());
    assert_eq!(images, expected, "{ctx}: image order");
    // Every completed step exactly once: as a fold line `Step{i}: <a{i}>` or a retained `<r{i}>`.
    let mut seen = vec![0usize; t_completed + 1];
    for (i, m) in messages.iter().enumerate().skip(1) {
        let text = m.content.iter().filter_map(text_of).collect::<String>();
        if m.role == "assistant" {
            let s: usize = text
                .trim_start_matches("<r")
                .trim_end_matches('>')
                .parse()
                .unwrap();
            seen[s] += 1;
            continue;
        }
        if text.is_empty() {
            continue;
        }
        let history = if i == 1 {
            assert!(text.starts_with("Please generate the next move"), "{ctx}: FIRST");
            let h = text.split("\n\nPrevious actions:\n").nth(1).unwrap().to_string();
            if h == "No previous action." {
                continue;
            }
            h
        } else {
            assert!(text.starts_with(CONTINUED_HEADER), "{ctx}: CONT header");
            let h = text[CONTINUED_HEADER.len()..].to_string();
            assert!(!h.is_empty(), "{ctx}: CONT with an empty range");
            h
        };
        assert!(!history.ends_with('\n'));
        for line in history.split('\n') {
            let rest = line.strip_prefix("Step").unwrap();
            let (num, action) = rest.split_once(": ").unwrap();
            let s: usize = num.parse().unwrap();
            assert_eq!(action, format!("<a{s}>"), "{ctx}: global step numbering");
            seen[s] += 1;
        }
    }
    assert_eq!(seen[0], 0);
    assert!(seen[1..].iter().all(|&c| c == 1), "{ctx}: step counts {seen:?}");
    // Fold lines between shown steps are in step order (they were parsed in message order).
}

#[test]
fn random_allocations_keep_every_step_exactly_once() {
    let mut rng = fastrand::Rng::with_seed(0x5eed_2026);
    let mut cases = 0;
    for _ in 0..600 {
        let t_completed = rng.usize(0..=30);
        let steps = placeholder_steps(t_completed);
        let density = rng.f64();
        let allocation: Vec<usize> = (1..=t_completed).filter(|_| rng.f64() < density).collect();
        let messages = render(
            Protocol::Mobile,
            "<goal>",
            &steps,
            &allocation,
            Path::new("current"),
        )
        .unwrap();
        check_structure(t_completed, &allocation, &messages);
        if allocation.is_empty() {
            // B = 0: the single-turn prompt with every step folded.
            assert_eq!(messages.len(), 2);
            let text = text_of(&messages[1].content[0]).unwrap();
            let history = fold(&steps, 1, t_completed, Platform::Mobile);
            let expected = if history.is_empty() {
                "No previous action.".to_string()
            } else {
                history
            };
            assert!(text.ends_with(&format!("Previous actions:\n{expected}")));
        }
        cases += 1;
    }
    // Exhaustive for small T.
    for t_completed in 0..=7usize {
        let steps = placeholder_steps(t_completed);
        for mask in 0u32..(1 << t_completed) {
            let allocation: Vec<usize> = (1..=t_completed).filter(|s| mask & (1 << (s - 1)) != 0).collect();
            let messages = render(
                Protocol::Desktop,
                "<goal>",
                &steps,
                &allocation,
                Path::new("current"),
            )
            .unwrap();
            check_structure(t_completed, &allocation, &messages);
            cases += 1;
        }
    }
    assert!(cases > 800);
}

/// The paper's text controls "keep selection, budget, and the two-pass interface intact but replace
/// each restored frame's pixels with text: the turn's verbatim recorded response, or an OCR
/// transcription of the same screenshot". So the text rendering is the pixel rendering with each
/// history image part, and nothing else, replaced by that step's text; the current screen stays an
/// image. Checked on random allocations against `render` itself.
#[test]
fn text_slots_replace_each_restored_frame_and_nothing_else() {
    let mut rng = fastrand::Rng::with_seed(0x7e47);
    for _ in 0..300 {
        let n = rng.usize(0..=12);
        let mut steps = placeholder_steps(n);
        for (i, s) in steps.iter_mut().enumerate() {
            s.ocr = Some(format!("<ocr of x{}>", i + 1));
        }
        let allocation: Vec<usize> = (1..=n).filter(|_| rng.bool()).collect();
        let current = Path::new("current");
        let pixels = render(Protocol::Mobile, "<goal>", &steps, &allocation, current).unwrap();
        for (restore, text) in [
            (
                RestoreAs::Response,
                Box::new(|s: &StepRecord| s.response.clone()) as Box<dyn Fn(&StepRecord) -> String>,
            ),
            (RestoreAs::Ocr, Box::new(|s: &StepRecord| s.ocr.clone().unwrap())),
        ] {
            let texts =
                render_with(Protocol::Mobile, "<goal>", &steps, &allocation, current, restore).unwrap();
            assert_eq!(texts.len(), pixels.len());
            let mut replaced = Vec::new();
            for (a, b) in pixels.iter().zip(&texts) {
                assert_eq!(a.role, b.role);
                assert_eq!(a.content.len(), b.content.len());
                for (x, y) in a.content.iter().zip(&b.content) {
                    match x {
                        ContentPart::Image(path) if path != "current" => {
                            let s: usize = path.trim_start_matches('x').parse().unwrap();
                            let expected = format!("Screenshot of Step{s}:\n{}", text(&steps[s - 1]));
                            assert_eq!(y, &ContentPart::Text(expected), "{restore:?} {allocation:?}");
                            replaced.push(s);
                        }
                        _ => assert_eq!(x, y, "{restore:?} {allocation:?}"),
                    }
                }
            }
            assert_eq!(replaced, allocation, "every restored frame, once, in order");
        }
        // The pixels rendering is `render` itself.
        assert_eq!(
            render_with(
                Protocol::Mobile,
                "<goal>",
                &steps,
                &allocation,
                current,
                RestoreAs::Pixels
            )
            .unwrap(),
            pixels
        );
    }
    // OCR needs a transcript of every restored screenshot: a missing one names the step and field.
    let steps = placeholder_steps(4);
    let err = render_with(
        Protocol::Mobile,
        "g",
        &steps,
        &[3],
        Path::new("c"),
        RestoreAs::Ocr,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("step 3 (steps[2].ocr)"), "{err}");
}

#[test]
fn episode_ocr_transcripts_load_and_reach_the_decision() {
    let dir = temp_episode(
        r#"{"instruction": "Do it.", "platform": "mobile",
            "steps": [{"screenshot": "a.png", "response": "r1", "ocr": "Settings Wi-Fi"},
                      {"screenshot": "b.png", "response": "r2"}],
            "final_screenshot": "b.png", "final_ocr": "Network"}"#,
    );
    let episode = Episode::load(dir.path()).unwrap();
    assert_eq!(episode.steps[0].ocr.as_deref(), Some("Settings Wi-Fi"));
    assert_eq!(episode.steps[1].ocr, None);
    assert_eq!(episode.decision(1).unwrap().current_ocr, Some("Settings Wi-Fi"));
    assert_eq!(episode.decision(2).unwrap().current_ocr, None);
    assert_eq!(episode.decision(3).unwrap().current_ocr, Some("Network"));
}

#[test]
fn invalid_allocations_are_errors() {
    let steps = placeholder_steps(5);
    let cur = Path::new("x6");
    let cases: [(&[usize], &str); 6] = [
        (&[0], "out of range"),
        (&[6], "out of range"),
        (&[2, 9], "out of range"),
        (&[3, 2], "not sorted"),
        (&[2, 2], "more than once"),
        (&[1, 4, 4, 5], "more than once"),
    ];
    for (allocation, needle) in cases {
        let err = render(Protocol::Mobile, "g", &steps, allocation, cur).unwrap_err();
        assert!(matches!(err, Error::InvalidRequest(_)), "{allocation:?}: {err}");
        assert!(err.to_string().contains(needle), "{allocation:?}: {err}");
        assert!(validate_allocation(Protocol::Mobile, 5, allocation).is_err());
    }
    assert!(render(Protocol::Mobile, "g", &[], &[1], cur).is_err());
    assert!(render(Protocol::Mobile, "g", &[], &[], cur).is_ok());
}

#[test]
fn recent_b_is_the_tail() {
    assert_eq!(recent_b(5, 2), vec![4, 5]);
    assert_eq!(recent_b(5, 5), vec![1, 2, 3, 4, 5]);
    assert_eq!(recent_b(5, 9), vec![1, 2, 3, 4, 5]);
    assert_eq!(recent_b(0, 4), Vec::<usize>::new());
    assert_eq!(recent_b(30, 4), vec![27, 28, 29, 30]);
    for t in 0..12 {
        for b in 0..14 {
            let r = recent_b(t, b);
            assert_eq!(r.len(), b.min(t));
            assert!(r.iter().all(|&s| (1..=t).contains(&s)));
            assert!(validate_allocation(Protocol::Mobile, t, &r).is_ok());
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Episodes.

fn sample_dir() -> PathBuf {
    root().join("tests/fixtures/episode-sample")
}

#[test]
fn sample_episode_loads_and_replays() {
    let episode = Episode::load(&sample_dir()).unwrap();
    assert_eq!(episode.platform, Platform::Mobile);
    assert_eq!(episode.len(), 6);
    assert!(episode.final_screenshot.is_none());
    assert_eq!(episode.decisions(), 6);
    assert_eq!(episode.action_line(1).unwrap(), "Click at (500, 100).");
    assert_eq!(episode.action_line(2).unwrap(), "Type \"café ☕\".");
    assert_eq!(episode.action_line(4).unwrap(), "Long press at (250, 999).");
    assert!(episode.action_line(0).is_err() && episode.action_line(7).is_err());
    for s in 1..=6 {
        let step = episode.step(s).unwrap();
        assert!(step.screenshot.is_file());
        recall::agent::action::parse_response(&step.response, Platform::Mobile)
            .unwrap_or_else(|e| panic!("step {s}: {e}"));
    }
    let d1 = episode.decision(1).unwrap();
    assert!(d1.completed.is_empty());
    assert_eq!(d1.current_screenshot, episode.steps[0].screenshot);
    assert_eq!(d1.reference, Some(episode.steps[0].response.as_str()));
    let d6 = episode.decision(6).unwrap();
    assert_eq!(d6.completed.len(), 5);
    let m = render_decision(Protocol::Mobile, &d6, &[2, 5]).unwrap();
    assert_eq!(m.len(), 6);
    let err = episode.decision(7).unwrap_err();
    assert!(err.to_string().contains("final screenshot"), "{err}");
    assert!(episode.decision(0).is_err() && episode.decision(8).is_err());
}

/// Writes an episode directory with images `a.png`, `b.png` and the given episode.json.
fn temp_episode(json: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let png = std::fs::read(sample_dir().join("step001.png")).unwrap();
    std::fs::write(dir.path().join("a.png"), &png).unwrap();
    std::fs::write(dir.path().join("b.png"), &png).unwrap();
    std::fs::write(dir.path().join("episode.json"), json).unwrap();
    dir
}

fn load_err(json: &str) -> (String, String) {
    let dir = temp_episode(json);
    match Episode::load(dir.path()).unwrap_err() {
        Error::Json { path, field, message } => {
            assert!(path.ends_with("episode.json"), "{path:?}");
            (field, message)
        }
        other => panic!("expected a JSON error, got {other}"),
    }
}

#[test]
fn episode_with_final_screenshot_and_action_lines() {
    let dir = temp_episode(
        r#"{"instruction": "Do it.", "platform": "desktop",
            "steps": [{"screenshot": "a.png", "response": "Action: x\n<tool_call>{}</tool_call>", "action_line": "Click at (1, 2)."},
                      {"screenshot": "b.png", "response": "no call"}],
            "final_screenshot": "b.png", "meta": {"anything": [1, 2]}}"#,
    );
    let episode = Episode::load(dir.path()).unwrap();
    assert_eq!(episode.platform, Platform::Desktop);
    assert_eq!(episode.action_line(1).unwrap(), "Click at (1, 2).");
    assert_eq!(episode.action_line(2).unwrap(), "Wait for the screen to update.");
    assert_eq!(episode.decisions(), 3);
    let d = episode.decision(3).unwrap();
    assert_eq!(d.completed.len(), 2);
    assert_eq!(d.current_screenshot, dir.path().join("b.png"));
    assert_eq!(d.reference, None);
}

#[test]
fn episode_errors_name_the_file_and_field() {
    let step = r#"{"screenshot": "a.png", "response": "r"}"#;
    let cases: Vec<(String, &str, &str)> = vec![
        (
            format!(r#"{{"instruction": "i", "platform": "mobile", "steps": [{step}, {step}, {step}, {{"screenshot": "missing.png", "response": "r"}}]}}"#),
            "steps[3].screenshot",
            "does not exist",
        ),
        (r#"{"platform": "mobile", "steps": []}"#.into(), "instruction", "missing"),
        (r#"{"instruction": 3, "platform": "mobile", "steps": []}"#.into(), "instruction", "string"),
        (r#"{"instruction": "i", "platform": "tv", "steps": []}"#.into(), "platform", "mobile"),
        (r#"{"instruction": "i", "platform": "mobile"}"#.into(), "steps", "missing"),
        (r#"{"instruction": "i", "platform": "mobile", "steps": {}}"#.into(), "steps", "list"),
        (
            r#"{"instruction": "i", "platform": "mobile", "steps": [{"screenshot": "a.png"}]}"#.into(),
            "steps[0].response",
            "missing",
        ),
        (
            r#"{"instruction": "i", "platform": "mobile", "steps": [{"screenshot": "a.png", "response": "r", "action_line": 1}]}"#.into(),
            "steps[0].action_line",
            "string",
        ),
        (
            r#"{"instruction": "i", "platform": "mobile", "steps": [{"screenshot": "a.png", "response": "r", "ocr": ["x"]}]}"#.into(),
            "steps[0].ocr",
            "string",
        ),
        (
            r#"{"instruction": "i", "platform": "mobile", "steps": [], "final_ocr": 7}"#.into(),
            "final_ocr",
            "string",
        ),
        (
            r#"{"instruction": "i", "platform": "mobile", "steps": [{"screenshot": "a.png", "response": "r", "shot": 1}]}"#.into(),
            "steps[0].shot",
            "unknown field",
        ),
        (
            r#"{"instruction": "i", "platform": "mobile", "steps": [], "final_screenshot": "nope.png"}"#.into(),
            "final_screenshot",
            "does not exist",
        ),
        (r#"{"instruction": "i", "platform": "mobile", "steps": [], "format": "v0"}"#.into(), "format", "recall.episode/1"),
        (r#"{"instruction": "i", "platform": "mobile", "steps": [3]}"#.into(), "steps[0]", "object"),
        (r#"[1, 2]"#.into(), "", "object"),
    ];
    for (json, field, needle) in cases {
        let (got_field, message) = load_err(&json);
        assert_eq!(got_field, field, "{json}");
        assert!(message.contains(needle), "{json}: {message}");
    }
    // Not JSON at all, and a missing directory.
    let (field, _) = load_err("{not json");
    assert_eq!(field, "");
    let err = Episode::load(Path::new("/nonexistent/episode-dir")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
}

#[test]
fn bundled_demo_episode_loads_when_present() {
    let dir = root().join("models/demo/episode");
    if !dir.join("episode.json").is_file() {
        eprintln!("skipping: {} not present", dir.display());
        return;
    }
    let episode = Episode::load(&dir).unwrap();
    assert!(!episode.is_empty());
    for t in 1..=episode.decisions() {
        let d = episode.decision(t).unwrap();
        let b = recent_b(d.completed.len(), 4);
        render_decision(Protocol::for_platform(episode.platform), &d, &b).unwrap();
    }
}
