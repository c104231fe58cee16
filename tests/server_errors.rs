//! Bad requests to `recall serve`: each gets a 4xx with an OpenAI-style error body whose message names
//! the problem (and `param` the field), and the server answers a normal request right after each.
//! Covers malformed bodies, wrong types, out-of-range values, images (missing, truncated, unsupported,
//! a decompression bomb, over the byte cap), path traversal and symlink escapes, remote URLs, an
//! over-long prompt, unknown models, routes and episodes, an oversized body, and the API key.

mod serving;

use reqwest::StatusCode;
use serde_json::{json, Value};
use serving::{fixture, Server};

/// A PNG that declares `w`×`h` pixels and holds nothing else.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    png.extend(w.to_be_bytes());
    png.extend(h.to_be_bytes());
    png.extend([8, 2, 0, 0, 0]);
    let crc = png[12..].iter().fold(!0u32, |mut c, &x| {
        c ^= x as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        c
    });
    png.extend((!crc).to_be_bytes());
    png
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn chat_with_image(url: &str) -> Value {
    json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is on the screen?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}], "max_tokens": 2})
}

fn ok_request() -> Value {
    json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0})
}

/// One bad request: what to send, the status expected, a substring of the message and the param.
struct Case {
    name: &'static str,
    method: &'static str,
    path: String,
    body: Vec<u8>,
    status: u16,
    message: &'static str,
    param: Option<&'static str>,
}

fn case(
    name: &'static str,
    body: Value,
    status: u16,
    message: &'static str,
    param: Option<&'static str>,
) -> Case {
    Case {
        name,
        method: "POST",
        path: "/v1/chat/completions".into(),
        body: body.to_string().into_bytes(),
        status,
        message,
        param,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_gets_a_4xx_naming_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let media = tmp.path().join("media");
    std::fs::create_dir(&media).unwrap();
    std::fs::copy(fixture("vl-images/screen.png"), media.join("screen.png")).unwrap();
    std::fs::copy(fixture("vl-images/icon.png"), tmp.path().join("secret.png")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("secret.png"), media.join("link.png")).unwrap();
    let server = Server::start(&[
        "--allowed-media-dir",
        media.to_str().unwrap(),
        "--max-body-bytes",
        "1000000",
        "--max-image-bytes",
        "200000",
    ]);
    let long_prompt = "word ".repeat(6000);
    let mut cases = vec![
        Case {
            body: b"{\"messages\": [".to_vec(),
            ..case("malformed JSON", json!(null), 400, "not valid JSON", None)
        },
        case("not an object", json!([1, 2]), 400, "must be a JSON object", None),
        case(
            "no messages",
            json!({"max_tokens": 2}),
            400,
            "`messages` is required",
            Some("messages"),
        ),
        case(
            "messages of the wrong type",
            json!({"messages": "hi"}),
            400,
            "expected",
            Some("messages"),
        ),
        case(
            "unknown role",
            json!({"messages": [{"role": "robot", "content": "hi"}]}),
            400,
            "unknown role `robot`",
            Some("messages[0].role"),
        ),
        case(
            "unknown content part",
            json!({"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}),
            400,
            "unknown content part type",
            Some("messages[0].content[0].type"),
        ),
        case(
            "max_tokens of the wrong type",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}),
            400,
            "`max_tokens` must be a non-negative integer",
            Some("max_tokens"),
        ),
        case(
            "max_tokens 0",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
            400,
            "at least 1",
            Some("max_tokens"),
        ),
        case(
            "max_tokens beyond the context",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000_000}),
            400,
            "exceeds the model's context",
            Some("max_tokens"),
        ),
        case(
            "temperature out of range",
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}),
            400,
            "outside [0, 2]",
            Some("temperature"),
        ),
        case(
            "temperature of the wrong type",
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
            400,
            "must be a number",
            Some("temperature"),
        ),
        case(
            "stop of the wrong type",
            json!({"messages": [{"role": "user", "content": "hi"}], "stop": 5}),
            400,
            "`stop` must be a string or an array",
            Some("stop"),
        ),
        case(
            "top_logprobs without logprobs",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}),
            400,
            "needs `logprobs: true`",
            Some("top_logprobs"),
        ),
        case(
            "stream_options without stream",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}),
            400,
            "needs `stream: true`",
            Some("stream_options"),
        ),
        case(
            "n beyond the limit",
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 100}),
            400,
            "`n` must be in 1..=16",
            Some("n"),
        ),
        case(
            "min_p",
            json!({"messages": [{"role": "user", "content": "hi"}], "min_p": 0.1}),
            400,
            "`min_p` is not supported",
            Some("min_p"),
        ),
        case(
            "logit_bias",
            json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 10}}),
            400,
            "`logit_bias` is not supported",
            Some("logit_bias"),
        ),
        case(
            "presence_penalty out of range",
            json!({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}),
            400,
            "must be in [-2, 2]",
            Some("presence_penalty"),
        ),
        case(
            "repetition_penalty 0",
            json!({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}),
            400,
            "greater than 0",
            Some("repetition_penalty"),
        ),
        case(
            "tool_choice required",
            json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                   "tools": [{"type": "function", "function": {"name": "f"}}]}),
            400,
            "constrained decoding",
            Some("tool_choice"),
        ),
        case(
            "a named tool_choice",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            400,
            "constrained decoding",
            Some("tool_choice"),
        ),
        case(
            "a tool without a name",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]}),
            400,
            "`tools[0].function.name` is required",
            Some("tools[0].function.name"),
        ),
        case(
            "legacy functions",
            json!({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}),
            400,
            "legacy",
            Some("functions"),
        ),
        case(
            "response_format json_object",
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}),
            400,
            "no constrained decoding",
            Some("response_format"),
        ),
        case(
            "guided_json",
            json!({"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}}),
            400,
            "constrained decoding",
            Some("guided_json"),
        ),
        case(
            "add_generation_prompt false",
            json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}),
            400,
            "not supported",
            Some("add_generation_prompt"),
        ),
        case(
            "a request's chat_template",
            json!({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"}),
            400,
            "natively",
            Some("chat_template"),
        ),
        case(
            "tool calls with invalid JSON arguments",
            json!({"messages": [{"role": "assistant", "content": null,
                                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]}),
            400,
            "not valid JSON",
            Some("messages[0].tool_calls[0].function.arguments"),
        ),
        case(
            "a data URL of another media type",
            chat_with_image("data:text/plain;base64,aGVsbG8="),
            400,
            "is not an image type",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "missing image URL",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            400,
            "missing",
            Some("messages[0].content[0].image_url.url"),
        ),
        case(
            "truncated base64",
            chat_with_image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB="),
            400,
            "base64",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "truncated PNG",
            chat_with_image(&format!(
                "data:image/png;base64,{}",
                b64(&std::fs::read(fixture("images/bad_truncated.png")).unwrap())
            )),
            400,
            "cannot decode",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "unsupported image format",
            chat_with_image(&format!(
                "data:image/gif;base64,{}",
                b64(b"GIF89a\x01\0\x01\0\0\0\0;")
            )),
            400,
            "unsupported image format GIF",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "a 20000x20000 PNG header",
            chat_with_image(&format!(
                "data:image/png;base64,{}",
                b64(&png_header(20000, 20000))
            )),
            400,
            "20000x20000 pixels exceeds the limit",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "an image over the byte cap",
            chat_with_image(&format!("data:image/png;base64,{}", b64(&vec![0u8; 300_000]))),
            413,
            "exceeds the limit of 200000 bytes",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "path traversal",
            chat_with_image(&format!("{}/../secret.png", media.display())),
            400,
            "outside the allowed media directory",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "a symlink that leaves the media directory",
            chat_with_image(&format!("file://{}/link.png", media.display())),
            400,
            "outside the allowed media directory",
            Some("messages[0].content[1].image_url.url"),
        ),
        case(
            "an absolute path elsewhere",
            chat_with_image("/etc/passwd"),
            400,
            "outside the allowed media directory",
            None,
        ),
        case(
            "a relative file URL",
            chat_with_image("file://screen.png"),
            400,
            "must be absolute",
            None,
        ),
        case(
            "an unsupported scheme",
            chat_with_image("ftp://host/a.png"),
            400,
            "unsupported scheme",
            None,
        ),
        case(
            "a remote URL without --allow-remote-media",
            chat_with_image("http://127.0.0.1:9/a.png"),
            400,
            "--allow-remote-media",
            None,
        ),
        case(
            "an over-long prompt",
            json!({"messages": [{"role": "user", "content": long_prompt}]}),
            400,
            "context",
            Some("messages"),
        ),
        case(
            "an unknown model",
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
            404,
            "`gpt-9` does not exist",
            None,
        ),
        Case {
            body: vec![b' '; 1_100_000],
            ..case("an oversized body", json!(null), 413, "limit", None)
        },
        Case {
            method: "GET",
            ..case("the wrong method", json!(null), 405, "method not allowed", None)
        },
        Case {
            method: "GET",
            path: "/v1/nothing".into(),
            ..case(
                "an unknown route",
                json!(null),
                404,
                "no route GET /v1/nothing",
                None,
            )
        },
        Case {
            method: "GET",
            path: "/v1/episodes/ep-0000".into(),
            ..case(
                "an unknown episode",
                json!(null),
                404,
                "episode `ep-0000` does not exist",
                None,
            )
        },
        Case {
            path: "/v1/episodes/ep-0000/steps".into(),
            ..case(
                "a step of an unknown episode",
                json!({"image_url": "data:image/png;base64,AAAA"}),
                404,
                "does not exist",
                None,
            )
        },
        Case {
            path: "/v1/episodes".into(),
            ..case(
                "an episode without instruction",
                json!({"method": "single"}),
                400,
                "`instruction` is required",
                Some("instruction"),
            )
        },
        Case {
            path: "/v1/episodes".into(),
            ..case(
                "an unknown method",
                json!({"instruction": "x", "method": "magic"}),
                400,
                "expected causalcache, scopemem or single",
                Some("method"),
            )
        },
        Case {
            path: "/v1/episodes".into(),
            ..case(
                "the OCR policy, which needs transcripts the API does not carry",
                json!({"instruction": "x", "policy": "ocr"}),
                400,
                "needs OCR transcripts",
                Some("policy"),
            )
        },
        Case {
            path: "/v1/episodes".into(),
            ..case(
                "an unknown stop rule",
                json!({"instruction": "x", "stop_rule": "eos"}),
                400,
                "expected `tool-call`",
                Some("stop_rule"),
            )
        },
        Case {
            path: "/v1/episodes".into(),
            ..case(
                "a selector policy without --selector",
                json!({"instruction": "x", "policy": "selector"}),
                400,
                "--selector",
                Some("policy"),
            )
        },
        Case {
            path: "/v1/episodes".into(),
            ..case(
                "scopemem without --encoder",
                json!({"instruction": "x", "method": "scopemem"}),
                400,
                "--encoder",
                Some("method"),
            )
        },
    ];
    // A step without a screenshot, on a real episode.
    let (status, ep) = server
        .post("/v1/episodes", &json!({"instruction": "x", "method": "single"}))
        .await;
    assert_eq!(status, 201, "{ep}");
    cases.push(Case {
        path: format!("/v1/episodes/{}/steps", ep["id"].as_str().unwrap()),
        ..case(
            "a step without image_url",
            json!({}),
            400,
            "`image_url`",
            Some("image_url"),
        )
    });
    assert!(cases.len() >= 20);

    let client = Server::client();
    for c in &cases {
        let url = format!("{}{}", server.url, c.path);
        let req = match c.method {
            "GET" => client.get(url),
            _ => client
                .post(url)
                .header("content-type", "application/json")
                .body(c.body.clone()),
        };
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status.as_u16(), c.status, "{}: {body}", c.name);
        let err = &body["error"];
        let message = err["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{}: no error message in {body}", c.name));
        assert!(
            message.contains(c.message),
            "{}: `{message}` lacks `{}`",
            c.name,
            c.message
        );
        assert!(err["type"].is_string(), "{}: {body}", c.name);
        if let Some(p) = c.param {
            assert_eq!(err["param"], json!(p), "{}: {body}", c.name);
        }
        // The server is still up and consistent.
        let (status, ok) = server.post("/v1/chat/completions", &ok_request()).await;
        assert_eq!(status, StatusCode::OK, "after {}: {ok}", c.name);
    }
    // The image inside the media directory is served.
    let inside = chat_with_image(&format!("{}/screen.png", media.display()));
    let (status, body) = server.post("/v1/chat/completions", &inside).await;
    assert_eq!(status, 200, "{body}");
    let m = server.wait_idle().await;
    assert_eq!(m["recall_kv_blocks_used"], 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_every_route_but_health() {
    let server = Server::start(&["--api-key", "s3cret"]);
    let client = Server::client();
    let chat = |key: Option<&str>| {
        let mut r = client
            .post(format!("{}/v1/chat/completions", server.url))
            .json(&ok_request());
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    for key in [None, Some("wrong")] {
        let resp = chat(key).await.unwrap();
        assert_eq!(resp.status(), 401);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    }
    assert_eq!(chat(Some("s3cret")).await.unwrap().status(), 200);
    for path in ["/v1/models", "/metrics", "/v1/episodes/x"] {
        let resp = client.get(format!("{}{path}", server.url)).send().await.unwrap();
        assert_eq!(resp.status(), 401, "{path}");
    }
    let health = client.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

/// A one-shot HTTP server on the loopback interface: answers every connection with `reply`, or
/// never answers when `reply` is `None`.
async fn http_stub(reply: Option<Vec<u8>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let reply = reply.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 4096];
                let _ = sock.read(&mut buf).await;
                match reply {
                    Some(r) => {
                        let _ = sock.write_all(&r).await;
                    }
                    None => tokio::time::sleep(std::time::Duration::from_secs(30)).await,
                }
            });
        }
    });
    format!("http://{addr}")
}

fn http_ok(body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_images_are_fetched_only_when_allowed_with_a_cap_and_a_timeout() {
    let png = std::fs::read(fixture("vl-images/screen.png")).unwrap();
    let good = http_stub(Some(http_ok(&png))).await;
    let big = http_stub(Some(http_ok(&vec![0u8; 300_000]))).await;
    let missing = http_stub(Some(
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
    ))
    .await;
    let silent = http_stub(None).await;
    let server = Server::start(&[
        "--allow-remote-media",
        "--max-image-bytes",
        "200000",
        "--media-timeout",
        "1",
    ]);
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            &chat_with_image(&format!("{good}/screen.png")),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    for (url, code, needle) in [
        (format!("{big}/big.png"), 413, "exceeds the limit of 200000 bytes"),
        (format!("{missing}/gone.png"), 400, "HTTP 404"),
        (format!("{silent}/slow.png"), 400, "timed out"),
    ] {
        let (status, body) = server.post("/v1/chat/completions", &chat_with_image(&url)).await;
        assert_eq!(status.as_u16(), code, "{url}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{url}: {message}");
    }
}
