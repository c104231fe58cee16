//! `recall serve`'s chat completions on the tiny Qwen3-VL (CPU):
//! * a greedy request returns exactly the tokens of `recall generate` (text and image chats);
//! * 32 requests sharing a long prefix, sent at once, return bitwise the tokens and log-probs they
//!   return one at a time, the cached-token counts show the prefix computed once, and every KV block
//!   is back in the pool afterwards — also after half the clients disconnect mid-stream;
//! * with a pool too small for all 32 at once, every request still completes (preemption), with the
//!   same tokens;
//! * seeded sampling is reproducible; streaming delivers the text of the non-streamed answer.

mod serving;

use std::process::Command;

use futures_util::StreamExt;
use recall::memory::protocol::MOBILE_SYSTEM_PROMPT;
use serde_json::{json, Value};
use serving::{data_url, fixture, token_ids, Server};

fn greedy(messages: Value, max_tokens: usize) -> Value {
    json!({
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": true,
        "return_tokens_as_token_ids": true,
    })
}

/// `recall generate --json` on `messages` (a file) with the tiny model.
fn generate_cli(messages: &Value, max_tokens: usize) -> Vec<u32> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.json");
    std::fs::write(&path, messages.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_recall"))
        .args(["generate", "--backend", "cpu", "--json", "--model"])
        .arg(fixture("tiny-qwen3-vl"))
        .arg("--messages")
        .arg(&path)
        .args(["--max-tokens", &max_tokens.to_string()])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    serde_json::from_value(v["tokens"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_chat_equals_recall_generate() {
    let server = Server::start(&[]);
    let text = json!([{"role": "user", "content": "Open the settings app and turn on Wi-Fi."}]);
    let shot = fixture("vl-images/screen.png");
    let with_image = |url: String| {
        json!([{"role": "user", "content": [
            {"type": "text", "text": "What should I tap?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}])
    };
    for (served, local) in [
        (text.clone(), text),
        (
            with_image(data_url(&shot)),
            with_image(shot.display().to_string()),
        ),
    ] {
        let (status, c) = server.post("/v1/chat/completions", &greedy(served, 24)).await;
        assert_eq!(status, 200, "{c}");
        let want = generate_cli(&local, 24);
        assert_eq!(token_ids(&c), want, "{c}");
        let usage = &c["usage"];
        assert_eq!(usage["completion_tokens"], want.len());
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(usage["prompt_tokens"].as_u64().unwrap() + want.len() as u64)
        );
    }
}

/// Requests sharing the GUI-Owl system prompt, each with its own instruction.
fn agent_requests(n: usize, max_tokens: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            greedy(
                json!([
                    {"role": "system", "content": MOBILE_SYSTEM_PROMPT},
                    {"role": "user", "content": format!("Instruction: open app number {i} and report its title.")},
                ]),
                max_tokens,
            )
        })
        .collect()
}

/// The completions of `requests`, all sent at once.
async fn concurrently(server: &Server, requests: &[Value]) -> Vec<Value> {
    let futures = requests.iter().map(|r| server.post("/v1/chat/completions", r));
    futures_util::future::join_all(futures)
        .await
        .into_iter()
        .map(|(status, c)| {
            assert_eq!(status, 200, "{c}");
            c
        })
        .collect()
}

/// Tokens and log-probs of a completion, compared bitwise (the JSON numbers are the f32 values).
fn answer(c: &Value) -> (Vec<u32>, Value) {
    (token_ids(c), c["choices"][0]["logprobs"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_one_at_a_time_and_share_the_prefix() {
    let requests = agent_requests(32, 8);
    let reference: Vec<_> = {
        let server = Server::start(&[]);
        let mut out = Vec::new();
        for r in &requests {
            let (status, c) = server.post("/v1/chat/completions", r).await;
            assert_eq!(status, 200, "{c}");
            out.push(answer(&c));
        }
        out
    };

    let server = Server::start(&[]);
    let got = concurrently(&server, &requests).await;
    let mut cached = Vec::new();
    for (k, c) in got.iter().enumerate() {
        assert_eq!(answer(c), reference[k], "request {k}");
        cached.push(
            c["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    let prompt = got[0]["usage"]["prompt_tokens"].as_u64().unwrap();
    let shared = cached.iter().filter(|&&c| c > prompt / 2).count();
    assert!(
        shared >= 31,
        "the shared prefix should be computed once: cached {cached:?} of {prompt}"
    );
    let m = server.wait_idle().await;
    assert_eq!(m["recall_kv_blocks_used"], 0.0);
    assert!(
        m["recall_prefix_cache_hit_tokens_total"] >= (31 * prompt / 2) as f64,
        "{m:?}"
    );

    // Half the clients go away mid-stream: their requests are cancelled and their blocks return.
    let long: Vec<Value> = agent_requests(32, 200)
        .into_iter()
        .map(|mut r| {
            r["stream"] = json!(true);
            r
        })
        .collect();
    let runs = long.iter().enumerate().map(|(i, r)| {
        let url = format!("{}/v1/chat/completions", server.url);
        async move {
            let resp = Server::client().post(url).json(r).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            let mut body = resp.bytes_stream();
            let mut chunks = 0;
            while let Some(bytes) = body.next().await {
                let bytes = bytes.unwrap();
                chunks += bytes.windows(6).filter(|w| w == b"data: ").count();
                if i % 2 == 0 && chunks >= 3 {
                    return (i, false); // drop the connection mid-stream
                }
            }
            (i, true)
        }
    });
    let finished = futures_util::future::join_all(runs).await;
    assert!(
        finished.iter().all(|(i, done)| *done || i % 2 == 0),
        "{finished:?}"
    );
    let m = server.wait_idle().await;
    assert_eq!(m["recall_kv_blocks_used"], 0.0, "{m:?}");
    assert!(m["recall_cancelled_requests_total"] >= 1.0, "{m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_pool_preempts_and_every_request_completes_with_the_same_tokens() {
    let requests = agent_requests(32, 24);
    let big = Server::start(&[]);
    let mut reference = Vec::new();
    for r in &requests {
        let (status, c) = big.post("/v1/chat/completions", r).await;
        assert_eq!(status, 200, "{c}");
        reference.push(token_ids(&c));
    }
    drop(big);
    // Each request needs its prompt plus 24 tokens; 260 blocks of 4 tokens hold few of them at once.
    let prompt_tokens = {
        let (_, c) = Server::start(&[])
            .post("/v1/chat/completions", &requests[0])
            .await;
        c["usage"]["prompt_tokens"].as_u64().unwrap() as usize
    };
    let blocks = (prompt_tokens + 24).div_ceil(4) + 40;
    let small = Server::start(&["--block-size", "4", "--kv-blocks", &blocks.to_string()]);
    let got = concurrently(&small, &requests).await;
    for (k, c) in got.iter().enumerate() {
        assert_eq!(token_ids(c), reference[k], "request {k}");
    }
    let m = small.wait_idle().await;
    assert!(
        m["recall_num_preemptions"] > 0.0,
        "the pool was meant to force preemption: {m:?}"
    );
    assert_eq!(m["recall_kv_blocks_used"], 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_and_streaming() {
    let server = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "Describe the screen."}]);
    let sampled = |seed: u64| json!({"messages": messages, "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": seed});
    let text = |c: &Value| {
        c["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (_, a) = server.post("/v1/chat/completions", &sampled(7)).await;
    let (_, b) = server.post("/v1/chat/completions", &sampled(7)).await;
    let (_, c) = server.post("/v1/chat/completions", &sampled(8)).await;
    assert_eq!(text(&a), text(&b), "same seed");
    assert_ne!(text(&a), text(&c), "another seed");

    // Streaming delivers the same text, then a usage chunk and [DONE].
    let mut req = greedy(messages.clone(), 16);
    let (_, whole) = server.post("/v1/chat/completions", &req).await;
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let body = server.post_text("/v1/chat/completions", &req).await;
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text(&whole));
    let usage = &chunks.last().unwrap()["usage"];
    for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[key], whole["usage"][key], "{body}");
    }
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_accepting_finishes_or_cancels_and_exits_zero() {
    let mut server = Server::start(&["--shutdown-grace", "1"]);
    let mut req = greedy(json!([{"role": "user", "content": "Tell a long story."}]), 4000);
    req["stream"] = json!(true);
    let resp = Server::client()
        .post(format!("{}/v1/chat/completions", server.url))
        .json(&req)
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let pid = server.pid().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    // The stream in flight ends properly: finished within the grace period, or cancelled after it
    // with an error event.
    let mut rest = Vec::new();
    while let Some(Ok(bytes)) = body.next().await {
        rest.extend_from_slice(&bytes);
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    assert!(
        rest.contains("finish_reason\":\"") || rest.contains("cancelled"),
        "{rest}"
    );
    let status = server.wait_exit(std::time::Duration::from_secs(30));
    assert_eq!(status, Some(0), "{}", server.log.lock().unwrap());
    // Nothing listens any more.
    assert!(Server::client()
        .get(format!("{}/health", server.url))
        .send()
        .await
        .is_err());
}
