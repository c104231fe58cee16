//! The episode API on the tiny Qwen3-VL: 6-step closed-loop episodes with CausalCache (the bundled
//! selector) and ScopeMem (the fixture encoder) return every field per step; with policy `recent`
//! every step is exactly a single-pass chat completion of the same rendered prompt; the history the
//! server records is what the client sent and received, and `recall episode render` on the recorded
//! episode gives the messages the server decided each step on.

mod serving;

use std::path::Path;
use std::process::Command;

use recall::tokenize::Tokenizer;
use serde_json::{json, Value};
use serving::{data_url, fixture, token_ids, Server};

fn screenshot(t: usize) -> std::path::PathBuf {
    fixture(&format!("episode-sample/step{t:03}.png"))
}

/// Opens an episode and runs 6 steps; returns its id and the step replies.
async fn run_episode(server: &Server, config: Value) -> (String, Vec<Value>) {
    let (status, ep) = server.post("/v1/episodes", &config).await;
    assert_eq!(status, 201, "{ep}");
    let id = ep["id"].as_str().unwrap().to_string();
    let mut steps = Vec::new();
    for t in 1..=6 {
        let body = json!({"image_url": {"url": data_url(&screenshot(t))}});
        let (status, r) = server.post(&format!("/v1/episodes/{id}/steps"), &body).await;
        assert_eq!(status, 200, "step {t}: {r}");
        assert_eq!(r["t"], t);
        assert!(r["response"].is_string());
        assert!(r["action"].is_object() || r["action_error"].is_string(), "{r}");
        steps.push(r);
    }
    (id, steps)
}

/// The recorded episode equals what was sent and received, and `recall episode render` on it gives
/// the messages the server reports for every step.
async fn check_history(server: &Server, id: &str, steps: &[Value]) {
    let (status, ep) = server.get(&format!("/v1/episodes/{id}")).await;
    assert_eq!(status, 200, "{ep}");
    assert_eq!(ep["num_steps"], 6);
    let dir = Path::new(ep["dir"].as_str().unwrap()).to_path_buf();
    let history = ep["steps"].as_array().unwrap();
    let allocations = ep["allocations"].as_array().unwrap();
    for (t, (kept, replied)) in (1..).zip(history.iter().zip(steps)) {
        assert_eq!(kept["response"], replied["response"], "step {t}");
        assert_eq!(kept["allocation"], replied["allocation"], "step {t}");
        assert_eq!(allocations[t - 1], replied["allocation"]);
        let recorded = std::fs::read(dir.join(kept["screenshot"].as_str().unwrap())).unwrap();
        assert_eq!(recorded, std::fs::read(screenshot(t)).unwrap(), "screenshot {t}");
    }
    let recorded = recall::memory::episode::Episode::load(&dir).unwrap();
    assert_eq!(recorded.len(), 6);
    for (t, replied) in (1..).zip(steps) {
        assert_eq!(
            recorded.steps[t - 1].response,
            replied["response"].as_str().unwrap()
        );
        let (status, step) = server.get(&format!("/v1/episodes/{id}/steps/{t}")).await;
        assert_eq!(status, 200, "{step}");
        let allocation: Vec<String> = step["allocation"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = dir.join(format!("render{t}.json"));
        let mut render = Command::new(env!("CARGO_BIN_EXE_recall"));
        render
            .args(["episode", "render", "--episode"])
            .arg(&dir)
            .args(["--step", &t.to_string(), "--out"])
            .arg(&out);
        if !allocation.is_empty() {
            render.args(["--allocation", &allocation.join(",")]);
        }
        let o = render.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let rendered: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        std::fs::remove_file(&out).unwrap();
        assert_eq!(rendered, step["messages"], "step {t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn causalcache_episode_closed_loop() {
    let selector = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo/selector.safetensors");
    let server = Server::start(&["--selector", selector.to_str().unwrap()]);
    let config = json!({"instruction": "Send the forecast to Alice.", "method": "causalcache",
                        "budget": 2, "policy": "selector", "max_tokens": 24});
    let (id, steps) = run_episode(&server, config).await;
    for (t, r) in (1..).zip(&steps) {
        let recent: Vec<u64> = serde_json::from_value(r["recent"].clone()).unwrap();
        let allocation: Vec<u64> = serde_json::from_value(r["allocation"].clone()).unwrap();
        assert_eq!(allocation.len(), (t - 1).min(2), "step {t}: exact-B allocation");
        let k = allocation.iter().filter(|s| !recent.contains(s)).count();
        assert_eq!(r["k"], k);
        assert_eq!(r["pass2"], json!(allocation != recent), "{r}");
        assert!(r["proposal"].is_string());
        for phase in [
            "prepare1_ms",
            "pass1_ms",
            "selector_ms",
            "prepare2_ms",
            "pass2_ms",
        ] {
            assert!(r["timings_ms"][phase].as_f64().is_some(), "{phase}: {r}");
        }
        assert!(r["reused_tokens"]["pass1"].is_u64() && r["reused_tokens"]["pass2"].is_u64());
        if t > 1 {
            assert!(
                r["reused_tokens"]["pass1"].as_u64().unwrap() > 0,
                "the next step reuses the prefix: {r}"
            );
        }
    }
    check_history(&server, &id, &steps).await;
    let (status, del) = reqwest_delete(&server, &id).await;
    assert_eq!(status, 200, "{del}");
    assert_eq!(server.get(&format!("/v1/episodes/{id}")).await.0, 404);
}

async fn reqwest_delete(server: &Server, id: &str) -> (u16, Value) {
    let r = Server::client()
        .delete(format!("{}/v1/episodes/{id}", server.url))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recent_policy_steps_equal_single_pass_completions() {
    let server = Server::start(&[]);
    let config = json!({"instruction": "Open the settings.", "method": "causalcache",
                        "budget": 2, "policy": "recent", "max_tokens": 24});
    let (id, steps) = run_episode(&server, config).await;
    let tokenizer = Tokenizer::from_model_dir(&fixture("tiny-qwen3-vl")).unwrap();
    for (t, r) in (1..).zip(&steps) {
        assert_eq!(r["pass2"], false, "Recent-B never runs pass 2");
        assert_eq!(r["k"], 0);
        let (_, step) = server.get(&format!("/v1/episodes/{id}/steps/{t}")).await;
        // The same rendered prompt, its screenshots sent as data URLs, through the chat API.
        let mut messages = step["messages"].clone();
        for m in messages.as_array_mut().unwrap() {
            for part in m["content"].as_array_mut().unwrap() {
                if let Some(url) = part["image_url"]["url"].as_str() {
                    part["image_url"]["url"] = json!(data_url(Path::new(url)));
                }
            }
        }
        let req = json!({"messages": messages, "max_tokens": 24, "temperature": 0, "stop": ["</tool_call>"],
                         "logprobs": true, "return_tokens_as_token_ids": true});
        let (status, c) = server.post("/v1/chat/completions", &req).await;
        assert_eq!(status, 200, "{c}");
        let text = tokenizer.decode(&token_ids(&c)).unwrap();
        assert_eq!(text, r["response"].as_str().unwrap(), "step {t}");
    }
    check_history(&server, &id, &steps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopemem_episode_closed_loop() {
    let encoder = fixture("scopemem/encoder");
    let server = Server::start(&["--encoder", encoder.to_str().unwrap()]);
    let config = json!({"instruction": "Send the forecast to Alice.", "method": "scopemem",
                        "budget": 2, "max_tokens": 24});
    let (id, steps) = run_episode(&server, config).await;
    for r in &steps {
        assert_eq!(
            r["response"], r["second"],
            "the second opinion is the action: {r}"
        );
        let p0: Vec<f64> = serde_json::from_value(r["p0"].clone()).unwrap();
        assert_eq!(p0.len(), 10);
        assert!((p0.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{p0:?}");
        assert!(r["h0"].as_f64().unwrap() >= 0.0);
        assert!(r["first"].is_string());
    }
    check_history(&server, &id, &steps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_expire_and_are_capped_in_number_and_bytes() {
    let shot = std::fs::metadata(screenshot(1)).unwrap().len();
    let server = Server::start(&[
        "--episode-ttl",
        "1",
        "--max-episodes",
        "2",
        "--max-episode-bytes",
        &(shot + shot / 2).to_string(),
    ]);
    let open_body = json!({"instruction": "x", "method": "single", "max_tokens": 2});
    let open = || server.post("/v1/episodes", &open_body);
    let (_, a) = open().await;
    let (_, b) = open().await;
    let (status, c) = open().await;
    assert_eq!(status, 429, "{c}");
    assert!(
        c["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit of 2 episodes"),
        "{c}"
    );
    // One screenshot fits the byte cap, a second does not.
    let shot_url = data_url(&screenshot(1));
    let step = |id: String| {
        let (server, body) = (&server, json!({"image_url": {"url": shot_url.clone()}}));
        async move { server.post(&format!("/v1/episodes/{id}/steps"), &body).await }
    };
    let (status, r) = step(a["id"].as_str().unwrap().to_string()).await;
    assert_eq!(status, 200, "{r}");
    let (status, r) = step(b["id"].as_str().unwrap().to_string()).await;
    assert_eq!(status, 429, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("storage is full"),
        "{r}"
    );
    // The refused step left episode b as it was.
    let (_, got) = server
        .get(&format!("/v1/episodes/{}", b["id"].as_str().unwrap()))
        .await;
    assert_eq!(got["num_steps"], 0);
    // After the TTL both are gone, their bytes released, and new ones can be opened.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let (status, _) = server
        .get(&format!("/v1/episodes/{}", a["id"].as_str().unwrap()))
        .await;
    assert_eq!(status, 404);
    let (status, d) = open().await;
    assert_eq!(status, 201, "{d}");
    let (status, r) = step(d["id"].as_str().unwrap().to_string()).await;
    assert_eq!(status, 200, "{r}");
}

/// The episode API over chat completions (the route a router forwards): bad requests name their
/// field, an unknown episode is a 404 naming the replica, a second open is a 409, and the bridge's
/// steps are the episode API's bitwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episode_steps_over_chat_completions_check_their_input() {
    let server = Server::start(&["--replica-id", "replica-x"]);
    let open = json!({"instruction": "Turn on Wi-Fi", "max_tokens": 8});
    let step = |meta: Value, content: Value| json!({"model": "tiny", "metadata": meta, "messages": [{"role": "user", "content": content}]});
    let shot = |t| json!([{"type": "image_url", "image_url": {"url": data_url(&screenshot(t))}}]);
    let open_meta = |id: &str| json!({"recall_episode": id, "recall_open": open.to_string()});
    let bad = [
        (
            step(json!({"recall_episode": "../up"}), shot(1)),
            "metadata.recall_episode",
        ),
        (
            step(json!({"recall_episode": 7}), shot(1)),
            "metadata.recall_episode",
        ),
        (
            step(json!({"recall_episode": "e", "recall_open": "{"}), shot(1)),
            "metadata.recall_open",
        ),
        (
            step(json!({"recall_episode": "e", "recall_open": "[1]"}), shot(1)),
            "metadata.recall_open",
        ),
        (step(open_meta("e"), json!("no image")), "messages[0].content"),
        (step(open_meta("e"), json!([])), "messages[0].content"),
    ];
    for (body, param) in bad {
        let (status, r) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{body}: {r}");
        assert_eq!(r["error"]["param"], param, "{r}");
    }
    let mut streamed = step(open_meta("e"), shot(1));
    streamed["stream"] = json!(true);
    let (status, r) = server.post("/v1/chat/completions", &streamed).await;
    assert_eq!(
        (status.as_u16(), r["error"]["param"].as_str()),
        (400, Some("stream")),
        "{r}"
    );
    // Nothing above opened an episode.
    let (status, r) = server
        .post(
            "/v1/chat/completions",
            &step(json!({"recall_episode": "e"}), shot(1)),
        )
        .await;
    assert_eq!(status, 404, "{r}");
    let message = r["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("not open on this replica (replica-x)"),
        "{message}"
    );

    // A first step that fails (an image that does not decode) opens nothing: the same first step
    // with a good screenshot then succeeds.
    let broken = json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]);
    let (status, r) = server
        .post("/v1/chat/completions", &step(open_meta("e"), broken))
        .await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(
        server.get("/v1/episodes/e").await.0,
        404,
        "a failed open left an episode"
    );

    // Three steps over chat, three over the episode API: the same answers.
    let mut bridged = Vec::new();
    for t in 1..=3 {
        let meta = if t == 1 {
            open_meta("e")
        } else {
            json!({"recall_episode": "e"})
        };
        let (status, r) = server.post("/v1/chat/completions", &step(meta, shot(t))).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["recall_episode_step"]["t"], t);
        bridged.push(r["choices"][0]["message"]["content"].clone());
    }
    let (status, r) = server
        .post("/v1/chat/completions", &step(open_meta("e"), shot(4)))
        .await;
    assert_eq!(status, 409, "a second open of a live id: {r}");
    let (_, ep) = server.post("/v1/episodes", &open).await;
    let id = ep["id"].as_str().unwrap();
    for (t, want) in (1..=3).zip(&bridged) {
        let body = json!({"image_url": {"url": data_url(&screenshot(t))}});
        let (_, r) = server.post(&format!("/v1/episodes/{id}/steps"), &body).await;
        assert_eq!(&r["response"], want, "step {t}");
    }
    let (_, kept) = server.get("/v1/episodes/e").await;
    assert_eq!(
        kept["num_steps"], 3,
        "the refused second open added no step: {kept}"
    );
}
