//! `recall loadgen`: drives any OpenAI-compatible server with N concurrent agents over HTTP and
//! reports requests/s, output tokens/s, time to first token and inter-token latency (p50/p99), and
//! the prefix-cache hit rate.
//!
//! The workload is agent-shaped: each client plays one closed-loop GUI-Owl episode. Step `s` sends
//! the official mobile protocol's prompt (the long `mobile_use` system prompt shared by every client,
//! the instruction, the folded history, the last B screenshots with the responses that followed
//! them, and the current screenshot) as data URLs, streams a short answer, and feeds that answer back
//! as history for step `s + 1`. Screenshots are synthetic PNGs, different for every client and step,
//! generated before the clock starts.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::memory::episode::StepRecord;
use crate::memory::protocol::{render, Protocol};
use crate::tokenize::chat::messages_to_json;

/// The flags of `recall loadgen`.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadgenArgs {
    /// Base URL of the server (its /v1/chat/completions is called).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// The `model` field of every request (e.g. the served name or, for `transformers serve`, the
    /// model path).
    #[arg(long)]
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Concurrent clients (agents).
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Steps per client: every client sends this many requests, one after another.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Earlier screenshots shown in each prompt (B, the most recent ones).
    #[arg(long, default_value_t = 1)]
    pub history_images: usize,
    /// Screenshot size in pixels, WIDTHxHEIGHT.
    #[arg(long, default_value = "320x640")]
    pub image_size: String,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// A name for the report (e.g. recall, transformers).
    #[arg(long, default_value = "server")]
    pub label: String,
    /// Also write the report as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Seconds before a request is abandoned.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// The header that carries each client's episode id (`loadgen-C`) on every request: the
    /// session key a router pins an episode to one replica by (sglang-router's manual policy reads
    /// `x-smg-routing-key`); an empty name sends none.
    #[arg(long, default_value = "x-smg-routing-key")]
    pub routing_header: String,
}

/// What one request measured.
#[derive(Debug, Clone, Default)]
struct Sample {
    ttft: Option<f64>,
    /// Gaps between content chunks, seconds.
    itl: Vec<f64>,
    e2e: f64,
    prompt_tokens: u64,
    cached_tokens: Option<u64>,
    output_tokens: u64,
    text: String,
    error: Option<String>,
    /// The replica that answered (its `x-recall-replica` header), when it says.
    replica: Option<String>,
}

/// Percentiles of a set of seconds, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
}

impl Latency {
    fn of(mut xs: Vec<f64>) -> Self {
        if xs.is_empty() {
            return Latency::default();
        }
        xs.sort_by(f64::total_cmp);
        let q = |p: f64| xs[((xs.len() - 1) as f64 * p).round() as usize] * 1e3;
        Latency {
            p50_ms: q(0.5),
            p99_ms: q(0.99),
            mean_ms: xs.iter().sum::<f64>() / xs.len() as f64 * 1e3,
        }
    }
}

/// The load generator's report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadReport {
    pub label: String,
    pub url: String,
    pub clients: usize,
    pub steps: usize,
    pub requests: usize,
    pub errors: usize,
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Prompt tokens the server reported served from its prefix cache, over all prompt tokens
    /// (`None` when the server does not report `prompt_tokens_details.cached_tokens`).
    pub prefix_cache_hit_rate: Option<f64>,
    pub ttft: Latency,
    pub itl: Latency,
    pub e2e: Latency,
    /// The first error, if any.
    pub first_error: Option<String>,
    /// Answered requests per replica (the `x-recall-replica` response header; empty when the
    /// server sends none).
    pub replicas: std::collections::BTreeMap<String, usize>,
    /// Episodes (clients) all of whose answered steps came from one replica, when replicas are
    /// named: with a router's session affinity, every episode.
    pub episodes_on_one_replica: Option<usize>,
}

impl LoadReport {
    /// A one-row Markdown table (with its header).
    pub fn to_table(&self) -> String {
        let hit = self
            .prefix_cache_hit_rate
            .map_or("n/a".to_string(), |h| format!("{:.1}%", h * 100.0));
        format!(
            "| server | clients | requests | errors | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms | prefix hit |\n\
             |---|---|---|---|---|---|---|---|---|---|\n\
             | {} | {} | {} | {} | {:.2} | {:.1} | {:.0} / {:.0} | {:.1} / {:.1} | {:.0} | {} |\n",
            self.label,
            self.clients,
            self.requests,
            self.errors,
            self.requests_per_s,
            self.output_tokens_per_s,
            self.ttft.p50_ms,
            self.ttft.p99_ms,
            self.itl.p50_ms,
            self.itl.p99_ms,
            self.e2e.p50_ms,
            hit
        )
    }
}

/// Runs the load and returns the report.
pub fn run_loadgen(args: &LoadgenArgs) -> Result<LoadReport> {
    if args.clients == 0 || args.steps == 0 || args.max_tokens == 0 {
        return Err(Error::InvalidRequest(
            "loadgen: --clients, --steps and --max-tokens must be positive".into(),
        ));
    }
    let (w, h) = args
        .image_size
        .split_once('x')
        .and_then(|(w, h)| Some((w.parse::<u32>().ok()?, h.parse::<u32>().ok()?)))
        .filter(|&(w, h)| w > 0 && h > 0)
        .ok_or_else(|| {
            Error::InvalidRequest(format!("--image-size {}: expected WIDTHxHEIGHT", args.image_size))
        })?;
    let dir = tempfile_dir()?;
    let shots = write_screenshots(&dir, args.clients, args.steps, w, h)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(1)
        .build()
        .map_err(|e| Error::InvalidRequest(format!("loadgen runtime: {e}")))?;
    let result = rt.block_on(drive(args, &shots));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("recall-loadgen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    Ok(dir)
}

/// A synthetic screenshot per client and step: a status bar, a grid of tiles whose colours depend
/// on (client, step), and a bottom bar — distinct pixels, so every step is a new image.
fn write_screenshots(dir: &Path, clients: usize, steps: usize, w: u32, h: u32) -> Result<Vec<Vec<PathBuf>>> {
    let bar = indicatif::ProgressBar::new((clients * steps) as u64).with_style(
        indicatif::ProgressStyle::with_template("screenshots {bar:30} {pos}/{len}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut out = Vec::with_capacity(clients);
    for c in 0..clients {
        let mut row = Vec::with_capacity(steps);
        for s in 0..steps {
            let seed = (c as u32).wrapping_mul(2654435761) ^ (s as u32).wrapping_mul(40503);
            let img = image::RgbImage::from_fn(w, h, |x, y| {
                if y < h / 20 || y > h - h / 12 {
                    return image::Rgb([30, 30, 40]);
                }
                let tile = (x / (w / 4).max(1)) + 4 * (y / (h / 8).max(1));
                let v = seed.wrapping_add(tile.wrapping_mul(2246822519));
                image::Rgb([(v >> 24) as u8, (v >> 16) as u8, (v >> 8) as u8])
            });
            let path = dir.join(format!("c{c}-s{s}.png"));
            img.save(&path)
                .map_err(|e| Error::InvalidRequest(format!("writing {}: {e}", path.display())))?;
            row.push(path);
            bar.inc(1);
        }
        out.push(row);
    }
    bar.finish_and_clear();
    Ok(out)
}

async fn drive(args: &LoadgenArgs, shots: &[Vec<PathBuf>]) -> Result<LoadReport> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.timeout))
        .pool_max_idle_per_host(args.clients)
        .build()
        .map_err(|e| Error::InvalidRequest(format!("HTTP client: {e}")))?;
    let urls = Arc::new(data_urls(shots)?);
    let bar = indicatif::ProgressBar::new((args.clients * args.steps) as u64).with_style(
        indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} requests")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(args.label.clone());
    let start = Instant::now();
    let agents = (0..args.clients).map(|c| {
        let (client, urls, bar) = (client.clone(), urls.clone(), bar.clone());
        async move { agent(args, &client, c, &shots[c], &urls[c], &bar).await }
    });
    let samples: Vec<Sample> = futures_util::future::join_all(agents)
        .await
        .into_iter()
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let wall = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(report(args, &samples, wall))
}

/// The `data:` URL of every screenshot, keyed like `shots`.
fn data_urls(shots: &[Vec<PathBuf>]) -> Result<Vec<std::collections::HashMap<PathBuf, String>>> {
    use base64::Engine as _;
    shots
        .iter()
        .map(|row| {
            row.iter()
                .map(|p| {
                    let bytes = std::fs::read(p).map_err(|e| Error::io(p, e))?;
                    let url = format!(
                        "data:image/png;base64,{}",
                        base64::engine::general_purpose::STANDARD.encode(bytes)
                    );
                    Ok((p.clone(), url))
                })
                .collect()
        })
        .collect()
}

/// One client's closed-loop episode.
async fn agent(
    args: &LoadgenArgs,
    client: &reqwest::Client,
    c: usize,
    shots: &[PathBuf],
    urls: &std::collections::HashMap<PathBuf, String>,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<Sample>> {
    let instruction = format!(
        "Open the Settings app, find the entry number {c} under Network and turn it on, then go back to the home screen."
    );
    let mut completed: Vec<StepRecord> = Vec::new();
    let mut samples = Vec::with_capacity(shots.len());
    for (s, current) in shots.iter().enumerate() {
        let b = args.history_images.min(s);
        let allocation: Vec<usize> = (s + 1 - b..=s).filter(|&x| x >= 1).collect();
        let messages = render(Protocol::Mobile, &instruction, &completed, &allocation, current)?;
        let mut body = json!({
            "messages": messages_to_json(&messages),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        replace_images(&mut body, urls);
        if let Some(m) = &args.model {
            body["model"] = json!(m);
        }
        let sample = request(args, client, &body, c).await;
        let answer = if sample.text.trim().is_empty() {
            "Action: Wait for the screen to load.".to_string()
        } else {
            sample.text.clone()
        };
        completed.push(StepRecord::new(current.clone(), answer));
        samples.push(sample);
        bar.inc(1);
    }
    Ok(samples)
}

/// Replaces every image path of a request with its data URL.
fn replace_images(body: &mut Value, urls: &std::collections::HashMap<PathBuf, String>) {
    let Some(messages) = body["messages"].as_array_mut() else {
        return;
    };
    for m in messages {
        let Some(parts) = m["content"].as_array_mut() else {
            continue;
        };
        for part in parts {
            if let Some(url) = part["image_url"]["url"].as_str() {
                if let Some(data) = urls.get(Path::new(url)) {
                    part["image_url"]["url"] = json!(data);
                }
            }
        }
    }
}

/// One streamed request, timed.
async fn request(args: &LoadgenArgs, client: &reqwest::Client, body: &Value, c: usize) -> Sample {
    let mut sample = Sample::default();
    let start = Instant::now();
    let mut req = client
        .post(format!("{}/v1/chat/completions", args.url.trim_end_matches('/')))
        .json(body);
    if let Some(k) = &args.api_key {
        req = req.bearer_auth(k);
    }
    if !args.routing_header.is_empty() {
        req = req.header(args.routing_header.as_str(), episode_key(c));
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            sample.error = Some(e.to_string());
            return sample;
        }
    };
    sample.replica = resp
        .headers()
        .get(crate::server::REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if !resp.status().is_success() {
        let status = resp.status();
        sample.error = Some(format!(
            "HTTP {status}: {}",
            resp.text().await.unwrap_or_default()
        ));
        return sample;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut last: Option<Instant> = None;
    let mut chunks = 0u64;
    while let Some(piece) = stream.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                sample.error = Some(e.to_string());
                break;
            }
        };
        buf.extend_from_slice(&piece);
        while let Some(end) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end.1).collect();
            let text = String::from_utf8_lossy(&event[..end.0]).into_owned();
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(err) = v.get("error") {
                    sample.error = Some(err.to_string());
                }
                let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
                if !content.is_empty() {
                    let now = Instant::now();
                    match last {
                        None => sample.ttft = Some(now.duration_since(start).as_secs_f64()),
                        Some(t) => sample.itl.push(now.duration_since(t).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                    sample.text.push_str(content);
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    sample.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                    sample.output_tokens = u["completion_tokens"].as_u64().unwrap_or(chunks);
                    sample.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
                }
            }
        }
    }
    if sample.output_tokens == 0 {
        sample.output_tokens = chunks;
    }
    sample.e2e = start.elapsed().as_secs_f64();
    sample
}

/// Client `c`'s episode id, its routing key.
pub fn episode_key(c: usize) -> String {
    format!("loadgen-{c}")
}

/// The end of the first server-sent event in `buf`: (end of its text, end including the blank line).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, i + 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, i + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 < b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Answered requests per replica, and how many episodes were answered by one replica only
/// (`None` when no answer named its replica). `samples` are in client order, `steps` per client.
fn replica_counts(
    samples: &[Sample],
    steps: usize,
) -> (std::collections::BTreeMap<String, usize>, Option<usize>) {
    let mut per = std::collections::BTreeMap::new();
    for r in samples
        .iter()
        .filter(|s| s.error.is_none())
        .filter_map(|s| s.replica.as_ref())
    {
        *per.entry(r.clone()).or_insert(0) += 1;
    }
    if per.is_empty() {
        return (per, None);
    }
    let one = samples
        .chunks(steps.max(1))
        .filter(|ep| {
            let mut seen = ep.iter().filter(|s| s.error.is_none()).map(|s| &s.replica);
            let first = seen.next();
            first.is_some_and(|f| f.is_some() && seen.all(|r| r == f))
        })
        .count();
    (per, Some(one))
}

fn report(args: &LoadgenArgs, samples: &[Sample], wall: f64) -> LoadReport {
    let (replicas, episodes_on_one_replica) = replica_counts(samples, args.steps);
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    let prompt_tokens: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let output_tokens: u64 = ok.iter().map(|s| s.output_tokens).sum();
    let cached: Option<u64> = ok.iter().map(|s| s.cached_tokens).sum();
    LoadReport {
        label: args.label.clone(),
        url: args.url.clone(),
        clients: args.clients,
        steps: args.steps,
        requests: samples.len(),
        errors: samples.len() - ok.len(),
        wall_s: wall,
        requests_per_s: ok.len() as f64 / wall,
        output_tokens_per_s: output_tokens as f64 / wall,
        prompt_tokens,
        output_tokens,
        prefix_cache_hit_rate: cached
            .filter(|_| prompt_tokens > 0)
            .map(|c| c as f64 / prompt_tokens as f64),
        ttft: Latency::of(ok.iter().filter_map(|s| s.ttft).collect()),
        itl: Latency::of(ok.iter().flat_map(|s| s.itl.iter().copied()).collect()),
        e2e: Latency::of(ok.iter().map(|s| s.e2e).collect()),
        first_error: samples.iter().find_map(|s| s.error.clone()),
        replicas,
        episodes_on_one_replica,
    }
}
