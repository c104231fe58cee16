//! What vLLM-speaking front ends send, against `recall serve` on the tiny Qwen3-VL (CPU):
//! * penalties (`repetition_penalty`, `frequency_penalty`, `presence_penalty`) give HF transformers'
//!   tokens (tests/fixtures/penalties), batched or alone, and `generation_config.json`'s
//!   `repetition_penalty` / `max_new_tokens` apply unless the request overrides them;
//! * images: `data:image;base64,` works like `data:image/png;base64,`, bare base64 gets a short 400,
//!   pixel budgets per request (`mm_processor_kwargs`), per part and per server (`--max-pixels`) give
//!   exactly the tokens of `recall generate --max-pixels`, and never share a cache entry;
//! * `n > 1` shares the prompt's KV blocks; choice i is the request seeded `seed + i`;
//! * `/v1/completions` against HF's logits and greedy tokens (echo, logprobs, token-id prompts);
//! * `/tokenize`, `/detokenize`, `/version`, `skip_special_tokens`, `/v1/responses`.

mod common;
mod serving;

use std::process::Command;

use common::Reference;
use serde_json::{json, Value};
use serving::{data_url, fixture, token_ids, Server};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The penalty fixture's cases without images (their messages go over HTTP as they are).
fn penalty_cases() -> Vec<Value> {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("penalties/cases.json")).unwrap()).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["name"].as_str().unwrap().starts_with("image/"))
        .cloned()
        .collect()
}

fn penalised(c: &Value) -> Value {
    json!({
        "messages": c["messages"], "max_tokens": 24, "temperature": 0,
        "repetition_penalty": c["repetition_penalty"], "frequency_penalty": c["frequency_penalty"],
        "presence_penalty": c["presence_penalty"], "logprobs": true, "return_tokens_as_token_ids": true,
    })
}

#[tokio::test]
async fn penalties_equal_hugging_face_alone_and_batched() {
    let server = Server::start(&[]);
    let cases = penalty_cases();
    assert!(cases.len() >= 10);
    for c in &cases {
        let (status, r) = server.post("/v1/chat/completions", &penalised(c)).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(token_ids(&r), ids(&c["tokens"]), "{}", c["name"]);
    }
    // All at once: the batch changes no token.
    let replies = futures_util::future::join_all(cases.iter().map(|c| {
        let body = penalised(c);
        let server = &server;
        async move { server.post("/v1/chat/completions", &body).await.1 }
    }))
    .await;
    for (c, r) in cases.iter().zip(&replies) {
        assert_eq!(token_ids(r), ids(&c["tokens"]), "{} (batched)", c["name"]);
    }
}

/// A copy of the tiny model whose `generation_config.json` is `config`.
fn model_with_generation_config(config: Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("tiny-qwen3-vl")).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "generation_config.json" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    std::fs::write(dir.path().join("generation_config.json"), config.to_string()).unwrap();
    dir
}

#[tokio::test]
async fn generation_config_gives_the_defaults_and_requests_override_them() {
    let case = penalty_cases()
        .into_iter()
        .find(|c| c["name"] == "text/repetition_1.5")
        .unwrap();
    let dir = model_with_generation_config(json!({
        "do_sample": false, "repetition_penalty": 1.5, "max_new_tokens": 10, "eos_token_id": [1002, 1000],
    }));
    let server = Server::start_with(
        &[
            "--model",
            dir.path().to_str().unwrap(),
            "--served-model-name",
            "tiny",
        ],
        &[],
    );
    let ask = |extra: Value| {
        let mut body =
            json!({"messages": case["messages"], "logprobs": true, "return_tokens_as_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    // No sampling fields: greedy (do_sample false), repetition 1.5, at most 10 tokens.
    let (status, r) = server.post("/v1/chat/completions", &ask(json!({}))).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(token_ids(&r), ids(&case["tokens"])[..10].to_vec());
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    // The request's own value wins.
    let (_, r) = server
        .post("/v1/chat/completions", &ask(json!({"repetition_penalty": 1.0})))
        .await;
    assert_eq!(token_ids(&r), ids(&case["plain_tokens"])[..10].to_vec());
    // max_new_tokens caps an explicit max_tokens too (as in vLLM).
    let (_, r) = server
        .post("/v1/chat/completions", &ask(json!({"max_tokens": 20})))
        .await;
    assert_eq!(r["usage"]["completion_tokens"], 10);
}

fn image_chat(url: &str, part_extra: Value, request_extra: Value) -> Value {
    let mut part = json!({"type": "image_url", "image_url": {"url": url}});
    part.as_object_mut()
        .unwrap()
        .extend(part_extra.as_object().unwrap().clone());
    let mut body = json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What should I tap?"}, part]}],
        "max_tokens": 8, "temperature": 0, "logprobs": true, "return_tokens_as_token_ids": true,
    });
    body.as_object_mut()
        .unwrap()
        .extend(request_extra.as_object().unwrap().clone());
    body
}

/// `recall generate --json` on the chat of `url` with the given pixel flags: (prompt tokens, tokens).
fn generate_cli(url: &str, pixels: &[&str]) -> (u64, Vec<u32>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.json");
    let messages = image_chat(url, json!({}), json!({}))["messages"].clone();
    std::fs::write(&path, messages.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_recall"))
        .args([
            "generate",
            "--backend",
            "cpu",
            "--json",
            "--max-tokens",
            "8",
            "--model",
        ])
        .arg(fixture("tiny-qwen3-vl"))
        .arg("--messages")
        .arg(&path)
        .args(pixels)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    (v["prompt_tokens"].as_u64().unwrap(), ids(&v["tokens"]))
}

#[tokio::test]
async fn data_urls_without_subtype_and_bare_base64() {
    let server = Server::start(&[]);
    let png = data_url(&fixture("vl-images/screen.png"));
    let bare = png.split_once(',').unwrap().1.to_string();
    let (_, typed) = server
        .post("/v1/chat/completions", &image_chat(&png, json!({}), json!({})))
        .await;
    let untyped_url = format!("data:image;base64,{bare}");
    let (status, untyped) = server
        .post(
            "/v1/chat/completions",
            &image_chat(&untyped_url, json!({}), json!({})),
        )
        .await;
    assert_eq!(status, 200, "{untyped}");
    assert_eq!(token_ids(&typed), token_ids(&untyped));
    assert_eq!(typed["usage"]["prompt_tokens"], untyped["usage"]["prompt_tokens"]);
    // A few megabytes of bare base64: a short 400 that says what to add.
    let huge = bare.repeat(3_000_000 / bare.len() + 1);
    for url in [bare.as_str(), huge.as_str()] {
        let resp = Server::client()
            .post(format!("{}/v1/chat/completions", server.url))
            .json(&image_chat(url, json!({}), json!({})))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        let text = resp.text().await.unwrap();
        assert!(
            text.len() < 600,
            "{} bytes: {}",
            text.len(),
            &text[..600.min(text.len())]
        );
        assert!(text.contains("data:image/png;base64,"), "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], "messages[0].content[1].image_url.url");
    }
}

#[tokio::test]
async fn pixel_budgets_per_request_part_and_server_equal_recall_generate() {
    let server = Server::start(&[]);
    let png = data_url(&fixture("vl-images/screen.png"));
    let post = |part: Value, req: Value| {
        let body = image_chat(&png, part, req);
        let server = &server;
        async move {
            let (status, r) = server.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{r}");
            (r["usage"]["prompt_tokens"].as_u64().unwrap(), token_ids(&r))
        }
    };
    let default = post(json!({}), json!({})).await;
    assert_eq!(default, generate_cli(&png, &[]));
    let small = generate_cli(&png, &["--max-pixels", "8192"]);
    assert!(small.0 < default.0, "{small:?} vs {default:?}");
    let kwargs = json!({"mm_processor_kwargs": {"max_pixels": 8192}});
    assert_eq!(post(json!({}), kwargs.clone()).await, small);
    assert_eq!(post(json!({"max_pixels": 8192}), json!({})).await, small);
    let inner = image_chat(&png, json!({}), json!({}));
    let mut inner = inner;
    inner["messages"][0]["content"][1]["image_url"]["max_pixels"] = json!(8192);
    let (_, r) = server.post("/v1/chat/completions", &inner).await;
    assert_eq!(
        (r["usage"]["prompt_tokens"].as_u64().unwrap(), token_ids(&r)),
        small
    );
    // The part's budget wins over the request's; `size` spells the same budget.
    let tiny_kwargs = json!({"mm_processor_kwargs": {"max_pixels": 4096}});
    assert_eq!(post(json!({"max_pixels": 8192}), tiny_kwargs).await, small);
    let size = json!({"mm_processor_kwargs": {"size": {"shortest_edge": 4096, "longest_edge": 8192}}});
    assert_eq!(post(json!({}), size).await, small);
    // The same screenshot under the default budget again: its own cache entry, its own tokens.
    assert_eq!(post(json!({}), json!({})).await, default);
    // `serve --max-pixels` sets the server's budget.
    let small_server = Server::start(&["--max-pixels", "8192"]);
    let (_, r) = small_server
        .post("/v1/chat/completions", &image_chat(&png, json!({}), json!({})))
        .await;
    assert_eq!(
        (r["usage"]["prompt_tokens"].as_u64().unwrap(), token_ids(&r)),
        small
    );
    // Bad budgets name the field.
    for (body, param) in [
        (
            image_chat(
                &png,
                json!({}),
                json!({"mm_processor_kwargs": {"min_pixels": 9000, "max_pixels": 8192}}),
            ),
            "mm_processor_kwargs.max_pixels",
        ),
        (
            image_chat(&png, json!({"max_pixels": 1_000_000_000_000u64}), json!({})),
            "messages[0].content[1].max_pixels",
        ),
        (
            image_chat(
                &png,
                json!({}),
                json!({"mm_processor_kwargs": {"max_pixels": "big"}}),
            ),
            "mm_processor_kwargs.max_pixels",
        ),
    ] {
        let (status, r) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{r}");
        assert_eq!(r["error"]["param"], param, "{r}");
    }
}

#[tokio::test]
async fn n_choices_share_the_prompt_and_are_seeded_seed_plus_i() {
    let server = Server::start(&[]);
    let system = "You are a GUI agent. Look at the screen, then act. ".repeat(20);
    let messages = json!([{"role": "system", "content": system}, {"role": "user", "content": "Next?"}]);
    let base =
        json!({"messages": messages, "max_tokens": 6, "logprobs": true, "return_tokens_as_token_ids": true});
    let with = |extra: Value| {
        let mut b = base.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let before = server.metrics().await["recall_prefix_cache_hit_tokens_total"];
    let (status, r) = server
        .post(
            "/v1/chat/completions",
            &with(json!({"n": 4, "temperature": 1.0, "seed": 7})),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let prompt = r["usage"]["prompt_tokens"].as_f64().unwrap();
    let hits = server.metrics().await["recall_prefix_cache_hit_tokens_total"] - before;
    // Three of the four choices found the prompt's whole blocks cached (the first computed them).
    assert!(
        hits >= 3.0 * (prompt - 16.0),
        "{hits} reused for a prompt of {prompt}"
    );
    let mut completion = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let one = json!({"choices": [c]});
        let (_, alone) = server
            .post(
                "/v1/chat/completions",
                &with(json!({"temperature": 1.0, "seed": 7 + i})),
            )
            .await;
        assert_eq!(token_ids(&one), token_ids(&alone), "choice {i}");
        completion += token_ids(&one).len();
    }
    assert_eq!(r["usage"]["completion_tokens"], completion);
    assert_ne!(
        token_ids(&json!({"choices": [&choices[0]]})),
        token_ids(&json!({"choices": [&choices[1]]}))
    );
    // Streaming with n = 2: each choice's text adds up to the same request without streaming.
    let body = with(json!({"n": 2, "temperature": 0, "stream": true}));
    let text = server.post_text("/v1/chat/completions", &body).await;
    let mut streamed = [String::new(), String::new()];
    let mut finishes = 0;
    for line in text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
    {
        let chunk: Value = serde_json::from_str(line).unwrap();
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            streamed[i].push_str(c["delta"]["content"].as_str().unwrap_or(""));
            finishes += usize::from(!c["finish_reason"].is_null());
        }
    }
    let (_, whole) = server
        .post("/v1/chat/completions", &with(json!({"temperature": 0})))
        .await;
    let want = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(streamed, [want, want]);
    assert_eq!(finishes, 2);
    server.wait_idle().await;
}

/// log-softmax of a row of logits, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - z.ln()).collect()
}

#[tokio::test]
async fn completions_match_hugging_face_logits_and_greedy_tokens() {
    let server = Server::start(&[]);
    let reference = Reference::load(&fixture("tiny-qwen3-vl"), "reference");
    let prompt = reference.ids("p0.input_ids");
    let (logits, shape) = reference.f32("p0.logits");
    let vocab = shape[1];
    // echo + max_tokens 0 + logprobs: the prompt's log-probs, the first one null.
    let (status, r) = server
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "echo": true, "max_tokens": 0, "logprobs": 5,
                                          "return_tokens_as_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(lp["tokens"].as_array().unwrap().len(), prompt.len());
    for k in 1..prompt.len() {
        let hf = log_softmax(&logits[(k - 1) * vocab..k * vocab]);
        let got = lp["token_logprobs"][k].as_f64().unwrap();
        assert!(
            (got - hf[prompt[k] as usize]).abs() < 1e-4,
            "position {k}: {got} vs {}",
            hf[prompt[k] as usize]
        );
        let mut top: Vec<usize> = (0..vocab).collect();
        top.sort_by(|&a, &b| hf[b].total_cmp(&hf[a]));
        for t in &top[..3] {
            assert!(
                lp["top_logprobs"][k].get(format!("token_id:{t}")).is_some(),
                "position {k}: {t} missing"
            );
        }
    }
    assert_eq!(r["usage"]["completion_tokens"], 0);
    // Greedy continuation of the ids (HF generated 16 with end-of-sequence suppressed).
    let greedy = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true, "logprobs": 0,
                        "return_tokens_as_token_ids": true});
    let (_, r) = server.post("/v1/completions", &greedy).await;
    let got: Vec<u32> = r["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            t.as_str()
                .unwrap()
                .strip_prefix("token_id:")
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(got, reference.ids("p0.greedy"));
    // The same prompt as text: the same ids, so the same text; and it reused the cached prompt.
    let rendered = reference.meta["prompts"][0]["rendered"].as_str().unwrap();
    let (_, t) = server
        .post(
            "/v1/completions",
            &json!({"prompt": rendered, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(t["choices"][0]["text"], r["choices"][0]["text"]);
    assert_eq!(t["usage"]["prompt_tokens"], prompt.len());
    assert!(
        t["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 16
    );
    // Two prompts, two choices each: prompt-major indices; streaming adds up to the same texts.
    let two = json!({"prompt": [rendered, "Hello there"], "n": 2, "max_tokens": 5, "temperature": 0});
    let (_, both) = server.post("/v1/completions", &two).await;
    let texts: Vec<&str> = both["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 4);
    assert_eq!((texts[0], texts[2]), (texts[1], texts[3]));
    let mut stream = two.clone();
    stream["stream"] = json!(true);
    let events = server.post_text("/v1/completions", &stream).await;
    let mut streamed = vec![String::new(); 4];
    for line in events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
    {
        let chunk: Value = serde_json::from_str(line).unwrap();
        for c in chunk["choices"].as_array().unwrap() {
            streamed[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
        }
    }
    assert_eq!(streamed, texts);
    // Refusals name the field.
    for (body, param) in [
        (json!({"prompt": "x", "suffix": "y"}), "suffix"),
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": [1, 100000]}), "prompt"),
        (json!({"prompt": "<|image_pad|>"}), "prompt"),
        (json!({"prompt": {"a": 1}}), "prompt"),
        (json!({"prompt": "x", "logprobs": 50}), "logprobs"),
    ] {
        let (status, r) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {r}");
        assert_eq!(r["error"]["param"], param, "{r}");
    }
    server.wait_idle().await;
}

#[tokio::test]
async fn tokenize_detokenize_version_and_special_tokens() {
    let server = Server::start(&[]);
    let reference = Reference::load(&fixture("tiny-qwen3-vl"), "reference");
    let p0 = &reference.meta["prompts"][0];
    let (status, t) = server
        .post(
            "/tokenize",
            &json!({"messages": p0["messages"], "return_token_strs": true}),
        )
        .await;
    assert_eq!(status, 200, "{t}");
    assert_eq!(ids(&t["tokens"]), reference.ids("p0.input_ids"));
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], 4096);
    assert_eq!(t["token_strs"][0], "<|im_start|>");
    let (_, p) = server.post("/tokenize", &json!({"prompt": p0["rendered"]})).await;
    assert_eq!(p["tokens"], t["tokens"]);
    let (_, d) = server.post("/detokenize", &json!({"tokens": t["tokens"]})).await;
    assert_eq!(d["prompt"], p0["rendered"]);
    let (status, v) = server.get("/version").await;
    assert_eq!(
        (status.as_u16(), v["version"].as_str().unwrap()),
        (200, env!("CARGO_PKG_VERSION"))
    );
    let (status, e) = server.post("/detokenize", &json!({"tokens": [1, -3]})).await;
    assert_eq!(
        (status.as_u16(), e["error"]["param"].as_str().unwrap()),
        (400, "tokens[1]")
    );

    // skip_special_tokens: false keeps special tokens (not the final end-of-sequence token).
    let body = |skip: bool| {
        json!({"messages": [{"role": "user", "content": "Count the icons on the home screen."}], "max_tokens": 200,
               "temperature": 0, "logprobs": true, "return_tokens_as_token_ids": true, "skip_special_tokens": skip})
    };
    let (_, kept) = server.post("/v1/chat/completions", &body(false)).await;
    let (_, skipped) = server.post("/v1/chat/completions", &body(true)).await;
    let generated = token_ids(&kept);
    assert_eq!(generated, token_ids(&skipped));
    let body_ids: Vec<u32> = match kept["choices"][0]["finish_reason"].as_str() {
        Some("stop") => generated[..generated.len() - 1].to_vec(),
        _ => generated.clone(),
    };
    let (_, d) = server.post("/detokenize", &json!({"tokens": body_ids})).await;
    assert_eq!(kept["choices"][0]["message"]["content"], d["prompt"]);
}

#[tokio::test]
async fn responses_api_answers_as_chat_completions_do() {
    let server = Server::start(&[]);
    let png = data_url(&fixture("vl-images/screen.png"));
    let chat = json!({"messages": [{"role": "system", "content": "You are a GUI agent."},
                                    {"role": "user", "content": [{"type": "text", "text": "Where next?"},
                                                                 {"type": "image_url", "image_url": {"url": png}}]}],
                      "max_tokens": 12, "temperature": 0});
    let (_, c) = server.post("/v1/chat/completions", &chat).await;
    let resp = json!({"instructions": "You are a GUI agent.", "max_output_tokens": 12, "temperature": 0,
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Where next?"},
                                                             {"type": "input_image", "image_url": png}]}]});
    let (status, r) = server.post("/v1/responses", &resp).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "response");
    assert_eq!(
        r["output"][0]["content"][0]["text"],
        c["choices"][0]["message"]["content"]
    );
    assert_eq!(r["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
    let (status, e) = server
        .post(
            "/v1/responses",
            &json!({"input": "hi", "previous_response_id": "resp_1"}),
        )
        .await;
    assert_eq!(
        (status.as_u16(), e["error"]["param"].as_str().unwrap()),
        (400, "previous_response_id")
    );
}

/// The agent fixture's one answer (tests/fixtures/agent-qwen3-vl/agent.json).
fn agent_answer() -> String {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("agent-qwen3-vl/agent.json")).unwrap())
            .unwrap();
    v["response"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn tool_calls_are_parsed_streamed_and_fed_back() {
    let model = fixture("agent-qwen3-vl");
    let server = Server::start_with(
        &["--model", model.to_str().unwrap(), "--served-model-name", "tiny"],
        &[],
    );
    let answer = agent_answer();
    let tools = json!([{"type": "function", "function": {"name": "mobile_use", "description": "Use the phone.",
        "parameters": {"type": "object", "properties": {"action": {"type": "string"}, "coordinate": {"type": "array"}}}}}]);
    let png = data_url(&fixture("vl-images/screen.png"));
    let messages = json!([{"role": "user", "content": [{"type": "text", "text": "Search for cats."},
                                                      {"type": "image_url", "image_url": {"url": png}}]}]);
    let body = json!({"messages": messages, "tools": tools, "temperature": 0});
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["content"], answer[..answer.find("<tool_call>").unwrap()]);
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
    assert_eq!(call["function"]["name"], "mobile_use");
    // `json.dumps(arguments)` of the call in the answer.
    assert_eq!(
        call["function"]["arguments"],
        r#"{"action": "click", "coordinate": [540, 120]}"#
    );

    // Streamed: content deltas then one tool-call delta; together the same message.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let text = server.post_text("/v1/chat/completions", &stream).await;
    let (mut content, mut calls, mut finish) = (String::new(), Vec::new(), Vec::new());
    for line in text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
    {
        let chunk: Value = serde_json::from_str(line).unwrap();
        let c = &chunk["choices"][0];
        content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        calls.extend(c["delta"]["tool_calls"].as_array().cloned().unwrap_or_default());
        if let Some(f) = c["finish_reason"].as_str() {
            finish.push(f.to_string());
        }
    }
    assert_eq!(content, message["content"].as_str().unwrap());
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0]["index"].as_u64(), &calls[0]["function"]),
        (Some(0), &call["function"])
    );
    assert_eq!(finish, ["tool_calls"]);

    // The call and a tool response fed back (content null, a tool message with an image) render and
    // run; `tool_choice: none` renders the tools but leaves the text alone.
    let mut history = messages.as_array().unwrap().clone();
    history.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
    history.push(json!({"role": "tool", "tool_call_id": call["id"], "content": [{"type": "image_url", "image_url": {"url": png}}]}));
    let (status, r2) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": history, "tools": tools, "temperature": 0, "tool_choice": "none"}),
        )
        .await;
    assert_eq!(status, 200, "{r2}");
    assert_eq!(r2["choices"][0]["message"]["content"], answer);
    assert!(r2["choices"][0]["message"].get("tool_calls").is_none());
    assert!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    // The same through the Responses API: a function_call item.
    let (_, resp) = server
        .post(
            "/v1/responses",
            &json!({"input": "Search for cats.", "temperature": 0,
            "tools": [{"type": "function", "name": "mobile_use", "parameters": {"type": "object"}}]}),
        )
        .await;
    let items = resp["output"].as_array().unwrap();
    assert_eq!(items.last().unwrap()["type"], "function_call", "{resp}");
    assert_eq!(items.last().unwrap()["arguments"], call["function"]["arguments"]);
}
