//! Chat rendering against Hugging Face: every case of `tests/fixtures/chat/cases.json` (rendered by
//! transformers' `apply_chat_template` with the official Jinja templates, see
//! `tools/gen_chat_fixtures.py`) must be reproduced byte for byte by `render_chat`, and tokenize to the
//! same ids. Plus the errors of `parse_messages` on bad input.

use std::path::{Path, PathBuf};

use recall::tokenize::chat::{parse_messages, render_chat, ChatFamily, ContentPart};
use recall::tokenize::Tokenizer;
use recall::Error;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Case {
    name: String,
    family: ChatFamily,
    messages_json: String,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

fn load_cases() -> Vec<Case> {
    let path = root().join("tests/fixtures/chat/cases.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read cases.json"))
        .expect("cases.json is JSON");
    doc["cases"]
        .as_array()
        .expect("cases array")
        .iter()
        .map(|case| Case {
            name: case["name"].as_str().unwrap().to_owned(),
            family: ChatFamily::from_model_type(case["family"].as_str().unwrap()).expect("known family"),
            messages_json: serde_json::to_string(&case["messages"]).unwrap(),
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            text: case["text"].as_str().unwrap().to_owned(),
            ids: case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|id| u32::try_from(id.as_u64().unwrap()).unwrap())
                .collect(),
        })
        .collect()
}

#[test]
fn fixtures_cover_both_families() {
    let cases = load_cases();
    for family in [ChatFamily::Qwen3Vl, ChatFamily::Qwen25Vl] {
        let count = cases.iter().filter(|c| c.family == family).count();
        assert!(count >= 8, "{family:?}: only {count} cases");
    }
}

#[test]
fn render_matches_hugging_face_text() {
    let path = Path::new("cases.json");
    let mut failures = Vec::new();
    for case in load_cases() {
        let messages = parse_messages(&case.messages_json, path)
            .unwrap_or_else(|e| panic!("{}: parse failed: {e}", case.name));
        let rendered = render_chat(case.family, &messages, case.add_generation_prompt);
        if rendered != case.text {
            failures.push(format!(
                "{}:\n  got:      {rendered:?}\n  expected: {:?}",
                case.name, case.text
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn render_tokenizes_to_hugging_face_ids() {
    let tokenizer_path = root().join("models/qwen-vl-tokenizer/tokenizer.json");
    if !tokenizer_path.exists() {
        eprintln!("skipping id check: {} is missing", tokenizer_path.display());
        return;
    }
    let tokenizer = Tokenizer::from_file(&tokenizer_path).expect("load tokenizer");
    let path = Path::new("cases.json");
    for case in load_cases() {
        let messages = parse_messages(&case.messages_json, path).unwrap();
        let rendered = render_chat(case.family, &messages, case.add_generation_prompt);
        let ids = tokenizer.encode(&rendered).expect("encode");
        assert_eq!(ids, case.ids, "{}: token ids differ", case.name);
    }
}

#[test]
fn images_render_as_one_pad_token_each() {
    let json = r#"[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///a.png"}},
        {"type": "text", "text": "and"},
        {"type": "image", "image": "b.png"}]}]"#;
    let messages = parse_messages(json, Path::new("m.json")).unwrap();
    assert_eq!(
        messages[0].content,
        [
            ContentPart::Image("file:///a.png".into()),
            ContentPart::Text("and".into()),
            ContentPart::Image("b.png".into()),
        ]
    );
    for family in [ChatFamily::Qwen3Vl, ChatFamily::Qwen25Vl] {
        let text = render_chat(family, &messages, true);
        assert_eq!(text.matches("<|image_pad|>").count(), 2, "{family:?}");
        assert!(text.contains("<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|>"));
    }
}

/// The field an error names; panics unless it is a JSON error about `file`.
fn error_field(result: recall::Result<Vec<recall::tokenize::chat::ChatMessage>>, file: &Path) -> String {
    match result {
        Err(Error::Json { path, field, message }) => {
            assert_eq!(path, file);
            assert!(!message.is_empty());
            field
        }
        Err(other) => panic!("expected a JSON error, got {other}"),
        Ok(messages) => panic!("expected an error, parsed {messages:?}"),
    }
}

#[test]
fn bad_input_errors_name_the_field() {
    let file = Path::new("request.json");
    let cases = [
        (r#"[{"role": "user", "content": "hi"}"#, "messages"),
        (r#"{"model": "x"}"#, "messages"),
        (r#"{"messages": {"role": "user"}}"#, "messages"),
        (r#"42"#, "messages"),
        (r#"[{"role": "user", "content": "a"}, "oops"]"#, "messages[1]"),
        (r#"[{"content": "hi"}]"#, "messages[0].role"),
        (r#"[{"role": 7, "content": "hi"}]"#, "messages[0].role"),
        (r#"[{"role": "robot", "content": "hi"}]"#, "messages[0].role"),
        (r#"[{"role": "user"}]"#, "messages[0].content"),
        (r#"[{"role": "user", "content": 5}]"#, "messages[0].content"),
        (r#"[{"role": "user", "content": null}]"#, "messages[0].content"),
        (
            r#"[{"role": "user", "content": {"text": "hi"}}]"#,
            "messages[0].content",
        ),
        (
            r#"[{"role": "user", "content": ["hi"]}]"#,
            "messages[0].content[0]",
        ),
        (
            r#"[{"role": "user", "content": [{"text": "hi"}]}]"#,
            "messages[0].content[0].type",
        ),
        (
            r#"[{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]"#,
            "messages[0].content[0].type",
        ),
        (
            r#"[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": 3}]}]"#,
            "messages[2].content[1].text",
        ),
        (
            r#"[{"role": "user", "content": [{"type": "text"}]}]"#,
            "messages[0].content[0].text",
        ),
        (
            r#"[{"role": "user", "content": [{"type": "image"}]}]"#,
            "messages[0].content[0].image",
        ),
        (
            r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]"#,
            "messages[0].content[0].image_url.url",
        ),
        (
            r#"[{"role": "user", "content": [{"type": "image_url", "image_url": 1}]}]"#,
            "messages[0].content[0].image_url",
        ),
        (
            r#"[{"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": 3}}]}]"#,
            "messages[0].tool_calls[0].function.name",
        ),
        (
            r#"[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]"#,
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            r#"[{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}]"#,
            "messages[0].tool_calls",
        ),
        (
            r#"[{"role": "assistant", "content": null}]"#,
            "messages[0].content",
        ),
    ];
    for (json, field) in cases {
        assert_eq!(
            error_field(parse_messages(json, file), file),
            field,
            "input: {json}"
        );
    }
}

#[test]
fn error_messages_are_readable() {
    let file = Path::new("request.json");
    let err = parse_messages(r#"[{"role": "robot", "content": "hi"}]"#, file).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("request.json"), "{text}");
    assert!(text.contains("messages[0].role"), "{text}");
    assert!(text.contains("robot"), "{text}");
    let err = parse_messages(r#"[{"role": "user", "content": [{"type": "audio"}]}]"#, file).unwrap_err();
    assert!(
        err.to_string().contains("unknown content part type `audio`"),
        "{err}"
    );
}

/// Function calling against Hugging Face: each case of `tests/fixtures/chat/tool_cases.json` is an
/// OpenAI request (client-form `tools`, `content: null`, JSON-string `arguments`) that
/// tools/gen_chat_fixtures.py normalised as vLLM does and rendered with the official template. recall
/// parses the request (`parse_messages_value`, the server's `parse_tools`) and renders it natively:
/// the same text, and the same ids.
#[test]
fn tools_and_tool_calls_render_as_hugging_face_does_after_vllms_normalisation() {
    use recall::server::fields::Fields;
    use recall::server::tools::parse_tools;
    use recall::tokenize::chat::{parse_messages_value, render_chat_with_tools};
    let path = root().join("tests/fixtures/chat/tool_cases.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let tokenizer = Tokenizer::from_file(&root().join("models/qwen-vl-tokenizer/tokenizer.json")).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let family = ChatFamily::from_model_type(case["family"].as_str().unwrap()).unwrap();
        let request = case["request"].as_object().unwrap();
        let messages = parse_messages_value(&request["messages"], Path::new("request")).unwrap();
        let tools = parse_tools(&Fields::new(request)).unwrap();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let text = render_chat_with_tools(family, &messages, &tools.tools, add).text;
        assert_eq!(text, case["text"].as_str().unwrap(), "{name}");
        let ids: Vec<u64> = tokenizer
            .encode(&text)
            .unwrap()
            .into_iter()
            .map(u64::from)
            .collect();
        let want: Vec<u64> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(ids, want, "{name}");
    }
}
