//! `recall serve`: the engine as the backend of agent front ends (docs/SERVER.md).
//!
//! * `POST /v1/chat/completions`, `GET /v1/models`: OpenAI-compatible chat with images, streaming,
//!   stop strings, seeded sampling, logprobs and prefix-cache usage.
//! * `POST /v1/episodes`, `POST /v1/episodes/{id}/steps`, `GET /v1/episodes/{id}[/steps/{t}]`,
//!   `DELETE /v1/episodes/{id}`: closed-loop episodes decided with CausalCache, ScopeMem or one pass.
//! * `GET /health`, `GET /metrics` (Prometheus).
//!
//! One engine thread owns the model ([`engine_loop`]); handlers prepare requests (parse, fetch and
//! decode images, tokenize) on the async runtime and its blocking pool, then join the engine's
//! continuous batch. Every error is an OpenAI-style JSON body naming the field at fault.

pub mod completions;
mod engine_loop;
mod episode_chat;
mod episodes;
pub mod error;
pub mod fields;
pub mod media;
pub mod metrics;
pub mod openai;
pub mod params;
pub mod policy;
pub mod prepare;
pub mod reply;
mod responses;
mod session;
mod stream;
pub mod text;
mod tokenization;
pub mod tools;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::backend::BackendArgs;
use crate::engine::EngineConfig;
use crate::error::{Error, Result};
use crate::model::scopemem::ScopeMemEncoder;
use crate::model::AdapterMode;
pub use engine_loop::{EngineHandle, EngineSpec, ModelInfo};
pub use error::ApiError;
use media::{MediaPolicy, SourceMemo};
use metrics::Metrics;
use openai::SamplingDefaults;

/// The flags of `recall serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Hugging Face model directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// tokenizer.json to use [default: MODEL/tokenizer.json].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The model name clients pass as `model` [default: the --model argument as given].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// HGKV adapter (PEFT directory or reference-format safetensors).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Where the adapter acts: gated (history screenshots only), ungated or off.
    #[arg(long, default_value = "gated")]
    pub adapter_mode: String,
    /// CausalCache's learned scorer (safetensors): episodes may use policy `selector` or `inverted`.
    #[arg(long)]
    pub selector: Option<PathBuf>,
    /// ScopeMem encoder directory: episodes may use method `scopemem`.
    #[arg(long)]
    pub encoder: Option<PathBuf>,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Address to bind (loopback by default: nothing else can reach the server).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health (also RECALL_API_KEY).
    #[arg(long, env = "RECALL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Local image paths and file:// URLs are read only inside this directory (refused without it).
    #[arg(long)]
    pub allowed_media_dir: Option<PathBuf>,
    /// Fetch http(s) image URLs (off by default).
    #[arg(long)]
    pub allow_remote_media: bool,
    /// Screenshots are resized to at least this many pixels (height x width) unless a request says
    /// otherwise [default: the model's preprocessor_config.json]. GUI-Owl's CausalCache setting:
    /// min = max = 2621440.
    #[arg(long)]
    pub min_pixels: Option<usize>,
    /// Screenshots are resized to at most this many pixels unless a request says otherwise [default:
    /// the model's preprocessor_config.json].
    #[arg(long)]
    pub max_pixels: Option<usize>,
    /// Largest encoded image, in bytes.
    #[arg(long, default_value_t = 20 << 20)]
    pub max_image_bytes: usize,
    /// Largest image, in pixels (checked from the header, before decoding).
    #[arg(long, default_value_t = 33_554_432)]
    pub max_image_pixels: u64,
    /// Timeout of a remote image fetch, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub media_timeout: f64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Most requests in flight; more get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Longest a request may take, in seconds (408 after that).
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks in the KV pool on the CPU (a GPU sizes it from --gpu-memory-utilization).
    #[arg(long, default_value_t = 4096)]
    pub kv_blocks: usize,
    /// Most prompt tokens of one request per step (chunked prefill).
    #[arg(long, default_value_t = 512)]
    pub chunk_size: usize,
    /// Most tokens in one batched forward.
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Bytes of the vision-embedding cache.
    #[arg(long, default_value_t = 1 << 30)]
    pub vision_cache_bytes: usize,
    /// Episodes are removed after this many seconds without a step.
    #[arg(long, default_value_t = 3600.0)]
    pub episode_ttl: f64,
    /// Most live episodes.
    #[arg(long, default_value_t = 256)]
    pub max_episodes: usize,
    /// Most bytes of screenshots held by all episodes together.
    #[arg(long, default_value_t = 1 << 30)]
    pub max_episode_bytes: u64,
    /// Record episodes under this directory (kept); by default a temporary one, removed at exit.
    #[arg(long)]
    pub episode_dir: Option<PathBuf>,
    /// History screenshots the server restores when it chooses them itself
    /// (`/v1/causalcache/policy` with --selector and every past screenshot sent).
    #[arg(long, default_value_t = 4)]
    pub policy_budget: usize,
    /// Seconds to let requests finish after SIGINT/SIGTERM before cancelling them.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace: f64,
    /// This replica's name, sent as the `x-recall-replica` header of every response (behind a
    /// router: which replica served a request) [default: the bound address, HOST:PORT].
    #[arg(long)]
    pub replica_id: Option<String>,
}

/// Limits that apply to every request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_queue: usize,
    pub request_timeout: Duration,
    /// The budget B of server-chosen allocations on `/v1/causalcache/policy`.
    pub policy_budget: usize,
}

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub media: MediaPolicy,
    pub memo: SourceMemo,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    pub sampling_defaults: SamplingDefaults,
    pub api_key: Option<String>,
    pub episodes: episodes::EpisodeStore,
    pub selector: Option<PathBuf>,
    pub encoder: Option<ScopeMemEncoder>,
    /// Unix time the server started.
    pub started: u64,
    /// Requests `/v1/causalcache/policy` has taken (its responses' `request_count`).
    pub policy_requests: std::sync::atomic::AtomicU64,
    /// This replica's name (`--replica-id`), the `x-recall-replica` header of every response.
    pub replica: String,
}

/// The response header naming the replica that served a request.
pub const REPLICA_HEADER: &str = "x-recall-replica";

/// 128 random bits (ids of responses and tool calls).
pub fn rand_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    let half = |salt: u64| {
        let mut h = state.build_hasher();
        h.write_u64(salt);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn seconds(name: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            Error::InvalidRequest(format!("--{name} must be a positive number of seconds, got {s}"))
        })
}

impl AppState {
    /// Loads everything `args` names and starts the engine thread.
    pub fn new(args: &ServeArgs) -> Result<Self> {
        let adapter_mode: AdapterMode = args.adapter_mode.parse()?;
        let metrics = Arc::new(Metrics::new());
        let encoder = args.encoder.as_deref().map(ScopeMemEncoder::load).transpose()?;
        if let Some(sel) = &args.selector {
            // Fail at start-up, not at the first episode.
            crate::memory::selector::MarginalScorer::load(sel)?;
        }
        let media = MediaPolicy::new(
            args.allowed_media_dir.as_deref(),
            args.allow_remote_media,
            args.max_image_bytes,
            args.max_image_pixels,
            seconds("media-timeout", args.media_timeout)?,
        )?;
        let episodes = episodes::EpisodeStore::new(
            args.episode_dir.as_deref(),
            seconds("episode-ttl", args.episode_ttl)?,
            args.max_episodes,
            args.max_episode_bytes,
        )?;
        // A server decodes for long: decode panels on unless --cpu-decode-panels false.
        args.backend.apply_cpu(true)?;
        let spec = EngineSpec {
            model: args.model.clone(),
            tokenizer: args.tokenizer.clone(),
            adapter: args.adapter.clone().map(|a| (a, adapter_mode)),
            backend: args.backend.backend,
            pixels: (args.min_pixels, args.max_pixels),
            engine: EngineConfig {
                block_size: args.block_size,
                num_blocks: args.kv_blocks,
                kv_cache_bytes: None,
                memory_utilization: Some(args.backend.gpu_memory_utilization),
                chunk_size: args.chunk_size,
                max_batch_tokens: args.max_batch_tokens,
                vision_cache_bytes: args.vision_cache_bytes,
                prefix_caching: true,
            },
            name: args
                .served_model_name
                .clone()
                .unwrap_or_else(|| args.model.display().to_string()),
        };
        let engine = EngineHandle::spawn(spec, metrics.clone())?;
        Ok(AppState {
            engine,
            media,
            memo: SourceMemo::default(),
            metrics,
            limits: Limits {
                max_queue: args.max_queue,
                request_timeout: seconds("request-timeout", args.request_timeout)?,
                policy_budget: args.policy_budget,
            },
            sampling_defaults: SamplingDefaults::from_model_dir(&args.model),
            api_key: args.api_key.clone().filter(|k| !k.is_empty()),
            episodes,
            selector: args.selector.clone(),
            encoder,
            started: unix_now(),
            policy_requests: Default::default(),
            replica: args
                .replica_id
                .clone()
                .unwrap_or_else(|| format!("{}:{}", args.host, args.port)),
        })
    }
}

/// The HTTP routes over `app`.
pub fn router(app: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/causalcache/policy", post(policy::policy))
        .route("/v1/causalcache/policy/act", post(policy::policy))
        .route("/tokenize", post(tokenization::tokenize))
        .route("/detokenize", post(tokenization::detokenize))
        .route("/version", get(tokenization::version))
        .route("/v1/episodes", post(episodes::create))
        .route("/v1/episodes/{id}", get(episodes::get).delete(episodes::delete))
        .route("/v1/episodes/{id}/steps", post(episodes::step))
        .route("/v1/episodes/{id}/steps/{t}", get(episodes::get_step))
        .route("/metrics", get(metrics_text))
        .route("/health", get(health))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(app.clone(), authorize))
        .layer(axum::middleware::from_fn_with_state(app.clone(), count_and_shape))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(app)
}

/// Runs the server until SIGINT or SIGTERM; returns once it has shut down cleanly.
pub fn serve(args: ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("recall-http")
        .build()
        .map_err(|e| Error::InvalidRequest(format!("cannot start the async runtime: {e}")))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| Error::InvalidRequest(format!("cannot listen on {addr}: {e}")))?;
        let mut load = args.clone();
        if load.replica_id.is_none() {
            load.replica_id = listener.local_addr().ok().map(|a| a.to_string());
        }
        let app = Arc::new(
            tokio::task::spawn_blocking(move || AppState::new(&load))
                .await
                .map_err(|e| Error::InvalidRequest(format!("loading the model: {e}")))??,
        );
        let info = &app.engine.info;
        tracing::info!(
            model = %info.name,
            backend = %info.device,
            kv_blocks = info.num_blocks,
            context = info.max_context,
            "serving on http://{}",
            listener.local_addr().map(|a| a.to_string()).unwrap_or(addr),
        );
        let expiry = tokio::spawn(expire_episodes(app.clone()));
        let grace = seconds("shutdown-grace", args.shutdown_grace)?;
        let shutdown_app = app.clone();
        let server = axum::serve(listener, router(app.clone(), args.max_body_bytes)).with_graceful_shutdown(
            async move {
                shutdown_signal().await;
                tracing::info!("shutting down: no new connections; {grace:?} for requests in flight");
                let app = shutdown_app;
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    tracing::info!("cancelling the requests still in flight");
                    tokio::task::spawn_blocking(move || app.engine.shutdown());
                });
            },
        );
        let result = server.await;
        expiry.abort();
        let app2 = app.clone();
        let _ = tokio::task::spawn_blocking(move || app2.engine.shutdown()).await;
        app.episodes.cleanup();
        result.map_err(|e| Error::InvalidRequest(format!("server error: {e}")))
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

async fn expire_episodes(app: Arc<AppState>) {
    let period = (app.episodes.ttl() / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
    loop {
        tokio::time::sleep(period).await;
        app.episodes.expire();
    }
}

/// `GET /health`: 200 while the engine runs.
async fn health(State(app): State<Arc<AppState>>) -> Response {
    if app.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::unavailable("the engine thread has stopped").into_response()
    }
}

/// `GET /metrics`: OpenMetrics when the scraper's `Accept` asks for it, else Prometheus text 0.0.4.
async fn metrics_text(State(app): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    let text = app.metrics.render(&app.engine.stats(), app.episodes.len());
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    if metrics::wants_openmetrics(accept) {
        ([(header::CONTENT_TYPE, metrics::OPENMETRICS_CONTENT_TYPE)], text).into_response()
    } else {
        let text = metrics::to_prometheus_text(&text);
        ([(header::CONTENT_TYPE, metrics::PROMETHEUS_CONTENT_TYPE)], text).into_response()
    }
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path())).into_response()
}

/// Bearer authentication on every route but /health.
async fn authorize(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
                return ApiError::unauthorized(if given.is_some() {
                    "invalid API key"
                } else {
                    "missing API key: send `Authorization: Bearer KEY`"
                })
                .into_response();
            }
        }
    }
    next.run(req).await
}

/// Compares two secrets in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts every response by route and status, and turns the framework's plain-text rejections
/// (body too large, method not allowed, ...) into OpenAI-style JSON errors.
async fn count_and_shape(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let resp = next.run(req).await;
    let mut resp = shape(resp).await;
    if let Ok(v) = header::HeaderValue::from_str(&app.replica) {
        resp.headers_mut().insert(REPLICA_HEADER, v);
    }
    app.metrics.count_request(&route, resp.status().as_u16());
    resp
}

/// Turns the framework's plain-text rejections into OpenAI-style JSON errors (the status kept).
async fn shape(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| {
            c.starts_with("application/json")
                || c.starts_with("text/event-stream")
                || c.starts_with("application/openmetrics")
                || c.starts_with("text/plain; version=0.0.4")
        });
    if status.is_success() || is_json {
        return resp;
    }
    let text = axum::body::to_bytes(resp.into_body(), 64 << 10)
        .await
        .unwrap_or_else(|_| Bytes::new());
    let message = String::from_utf8_lossy(&text).trim().to_string();
    let err = match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(
            "",
            format!("the request body exceeds the server's limit (--max-body-bytes): {message}"),
        ),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::invalid(format!("method not allowed: {message}"))
            .with_status(status, "invalid_request_error"),
        s if s.is_client_error() => ApiError::invalid(message).with_status(s, "invalid_request_error"),
        s => ApiError::internal(message).with_status(s, "server_error"),
    };
    let mut out = err.into_response();
    *out.status_mut() = status;
    out
}
