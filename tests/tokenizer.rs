//! Tokenizer parity: the shipped Qwen `tokenizer.json` (and the tiny test tokenizer) must give exactly the
//! ids tiktoken gives with the Qwen BPE ranks, on thousands of varied strings, and decode back to the NFC
//! text. Fixtures are made by `tools/gen_tokenizer_cases.py`; see `docs/TOKENIZER.md`.

use std::path::{Path, PathBuf};

use recall::tokenize::Tokenizer;
use recall::Error;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Case {
    line: usize,
    text: String,
    ids: Vec<u32>,
    /// The expected decoded text (the NFC form of `text`).
    expected_text: String,
}

fn load_cases(path: &Path) -> Vec<Case> {
    let data =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    data.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{}:{}: {e}", path.display(), i + 1));
            let text = v["text"].as_str().expect("text").to_string();
            let ids = v["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
                .collect();
            let expected_text = v
                .get("nfc")
                .and_then(|x| x.as_str())
                .map_or_else(|| text.clone(), str::to_string);
            Case {
                line: i + 1,
                text,
                ids,
                expected_text,
            }
        })
        .collect()
}

/// Checks every case; panics with the first few failures (text and both id lists) and the counts.
fn check_parity(tokenizer_dir: &str, cases_file: &str, min_cases: usize) {
    let tok = Tokenizer::from_model_dir(&root().join(tokenizer_dir)).expect("load tokenizer");
    let cases = load_cases(&root().join(cases_file));
    assert!(
        cases.len() >= min_cases,
        "{cases_file}: only {} cases, expected at least {min_cases}",
        cases.len()
    );

    let mut encode_failures = 0;
    let mut decode_failures = 0;
    let mut report = String::new();
    for case in &cases {
        let ids = tok.encode(&case.text).expect("encode");
        if ids != case.ids {
            encode_failures += 1;
            if encode_failures <= 10 {
                report.push_str(&format!(
                    "encode mismatch (line {}): text {:?}\n  expected {:?}\n  got      {:?}\n",
                    case.line, case.text, case.ids, ids
                ));
            }
        }
        let decoded = tok.decode(&case.ids).expect("decode");
        if decoded != case.expected_text {
            decode_failures += 1;
            if decode_failures <= 10 {
                report.push_str(&format!(
                    "decode mismatch (line {}): ids {:?}\n  expected {:?}\n  got      {:?}\n",
                    case.line, case.ids, case.expected_text, decoded
                ));
            }
        }
    }
    assert!(
        encode_failures == 0 && decode_failures == 0,
        "{cases_file}: {encode_failures} encode and {decode_failures} decode failures out of {} cases\n{report}",
        cases.len()
    );
}

#[test]
fn qwen_tokenizer_matches_tiktoken_reference() {
    check_parity(
        "models/qwen-vl-tokenizer",
        "tests/fixtures/tokenizer/cases.jsonl",
        2200,
    );
}

#[test]
fn tiny_tokenizer_matches_tiktoken_reference() {
    check_parity(
        "tests/fixtures/tiny-tokenizer",
        "tests/fixtures/tiny-tokenizer/cases.jsonl",
        250,
    );
}

const ADDED_TOKENS: [&str; 26] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

fn check_added_tokens(tok: &Tokenizer, first_id: u32) {
    for (i, token) in ADDED_TOKENS.iter().enumerate() {
        let id = first_id + i as u32;
        assert_eq!(tok.token_id(token), Some(id), "{token}");
        assert_eq!(tok.token_text(id).as_deref(), Some(*token), "{id}");
        assert_eq!(tok.encode(token).unwrap(), vec![id], "{token}");
        assert_eq!(tok.decode(&[id]).unwrap(), *token, "{token}");
    }
    assert_eq!(tok.vocab_size(), first_id as usize + ADDED_TOKENS.len());
}

#[test]
fn qwen_added_tokens_have_official_ids() {
    let tok = Tokenizer::from_model_dir(&root().join("models/qwen-vl-tokenizer")).unwrap();
    check_added_tokens(&tok, 151_643);
    assert_eq!(tok.token_id("<|endoftext|>"), Some(151_643));
    assert_eq!(tok.token_id("<|im_start|>"), Some(151_644));
    assert_eq!(tok.token_id("<|im_end|>"), Some(151_645));
    assert_eq!(tok.token_id("<|vision_start|>"), Some(151_652));
    assert_eq!(tok.token_id("<|vision_end|>"), Some(151_653));
    assert_eq!(tok.token_id("<|image_pad|>"), Some(151_655));
    assert_eq!(tok.token_id("<|video_pad|>"), Some(151_656));
    assert_eq!(tok.token_id("<tool_call>"), Some(151_657));
    assert_eq!(tok.token_id("</think>"), Some(151_668));
    assert_eq!(tok.vocab_size(), 151_669);
    // A few well-known ids of the official vocabulary.
    assert_eq!(tok.token_id("Ġthe"), Some(279));
    assert_eq!(tok.encode("Hello world").unwrap(), vec![9707, 1879]);
    assert_eq!(tok.encode("你好").unwrap(), vec![108_386]);
    assert_eq!(tok.token_text(279).as_deref(), Some("Ġthe"));
    assert_eq!(tok.token_text(151_669), None);
}

#[test]
fn tiny_added_tokens_match_the_tiny_models() {
    let tok = Tokenizer::from_model_dir(&root().join("tests/fixtures/tiny-tokenizer")).unwrap();
    check_added_tokens(&tok, 1000);
    assert_eq!(tok.token_id("<|endoftext|>"), Some(1000));
    assert_eq!(tok.token_id("<|im_start|>"), Some(1001));
    assert_eq!(tok.token_id("<|im_end|>"), Some(1002));
    assert_eq!(tok.token_id("<|vision_start|>"), Some(1009));
    assert_eq!(tok.token_id("<|vision_end|>"), Some(1010));
    assert_eq!(tok.token_id("<|image_pad|>"), Some(1012));
    assert_eq!(tok.vocab_size(), 1026);
}

#[test]
fn chat_text_encodes_special_tokens_without_bos() {
    let tok = Tokenizer::from_model_dir(&root().join("models/qwen-vl-tokenizer")).unwrap();
    let text = "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|vision_end|>hi<|im_end|>\n";
    let ids = tok.encode(text).unwrap();
    assert_eq!(
        ids,
        vec![151_644, 872, 198, 151_652, 151_655, 151_655, 151_653, 6023, 151_645, 198]
    );
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert!(tok.encode("").unwrap().is_empty());
    assert_eq!(tok.decode(&[]).unwrap(), "");
}

#[test]
fn encode_applies_nfc() {
    let tok = Tokenizer::from_model_dir(&root().join("models/qwen-vl-tokenizer")).unwrap();
    // "e" + COMBINING ACUTE ACCENT is NFC "é".
    assert_eq!(tok.encode("cafe\u{301}").unwrap(), tok.encode("café").unwrap());
    assert_eq!(tok.decode(&tok.encode("cafe\u{301}").unwrap()).unwrap(), "café");
}

#[test]
fn missing_tokenizer_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
    let expected = dir.path().join("tokenizer.json");
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(
        err.to_string().contains(&expected.display().to_string()),
        "error does not name {}: {err}",
        expected.display()
    );
}

#[test]
fn malformed_tokenizer_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    for content in [
        "",
        "not json",
        "{}",
        "{\"model\": {\"type\": \"BPE\"}}",
        "{\"version\": \"1.0\", \"added_tokens\": [], \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}",
        "[1, 2, 3]",
    ] {
        std::fs::write(&path, content).unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, Error::Tokenizer(_)), "{content:?}: {err}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{content:?}: error does not name the path: {err}"
        );
    }
    // A truncated copy of the real file.
    let real = std::fs::read(root().join("tests/fixtures/tiny-tokenizer/tokenizer.json")).unwrap();
    std::fs::write(&path, &real[..real.len() / 2]).unwrap();
    assert!(matches!(Tokenizer::from_file(&path), Err(Error::Tokenizer(_))));
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    let tok = std::sync::Arc::new(
        Tokenizer::from_model_dir(&root().join("tests/fixtures/tiny-tokenizer")).unwrap(),
    );
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let tok = tok.clone();
            std::thread::spawn(move || tok.encode(&format!("thread {i} says hello")).unwrap())
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let ids = h.join().unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), format!("thread {i} says hello"));
    }
}
