//! A `recall serve` process for the server tests: started on a free port of the loopback interface,
//! killed when dropped, and a few HTTP helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A running server.
pub struct Server {
    child: Child,
    pub url: String,
    /// Everything the server logged so far.
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// `recall serve --model tests/fixtures/tiny-qwen3-vl --backend cpu --port 0 ARGS...`.
    pub fn start(args: &[&str]) -> Server {
        let model = fixture("tiny-qwen3-vl");
        Self::start_with(
            &["--model", model.to_str().unwrap(), "--served-model-name", "tiny"],
            args,
        )
    }

    pub fn start_with(model_args: &[&str], args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_recall"))
            .arg("serve")
            .args(model_args)
            .args(["--backend", "cpu", "--port", "0"])
            .args(args)
            .env("RUST_LOG", "recall=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("recall serve starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("serving on http://") {
                    let rest = &line[at + "serving on ".len()..];
                    let url: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
                    let _ = tx.send(url);
                }
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("the server did not start:\n{}", log.lock().unwrap()));
        Server { child, url, log }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `limit` for the process to exit; its exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn client() -> reqwest::Client {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()
            .unwrap()
    }

    /// POSTs a JSON body; the status and the JSON reply.
    pub async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let r = Self::client()
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// POSTs a JSON body and returns the reply as text (a stream's events).
    pub async fn post_text(&self, path: &str, body: &Value) -> String {
        Self::client()
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        let r = Self::client()
            .get(format!("{}{path}", self.url))
            .send()
            .await
            .unwrap();
        let status = r.status();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// The value of every sample in `/metrics` without labels (and `name{labels}` keys with them).
    pub async fn metrics(&self) -> std::collections::HashMap<String, f64> {
        let text = Self::client()
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// Waits until the engine has no request in flight and every KV block is back in the pool.
    pub async fn wait_idle(&self) -> std::collections::HashMap<String, f64> {
        let start = Instant::now();
        loop {
            let m = self.metrics().await;
            let busy = m["recall_kv_blocks_used"]
                + m["recall_num_requests_running"]
                + m["recall_num_requests_waiting"];
            if busy == 0.0 {
                return m;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the engine never became idle: {m:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `data:` URL of a file.
pub fn data_url(path: &Path) -> String {
    use base64::Engine as _;
    let bytes = std::fs::read(path).unwrap();
    let mime = match path.extension().and_then(|e| e.to_str()) {
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("webp") => "image/webp",
        _ => "image/png",
    };
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// The generated token ids of a completion made with `logprobs` and `return_tokens_as_token_ids`.
pub fn token_ids(completion: &Value) -> Vec<u32> {
    completion["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs in {completion}"))
        .iter()
        .map(|t| {
            t["token"]
                .as_str()
                .unwrap()
                .strip_prefix("token_id:")
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}
