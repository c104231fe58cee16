//! The episode API: a closed-loop agent episode as a server resource.
//!
//! `POST /v1/episodes` opens one (instruction, platform or protocol, method `causalcache`, `scopemem`
//! or `single`, budget, policy and its options). Each `POST /v1/episodes/{id}/steps` brings the
//! current screenshot; the server decides the step with the method — both passes batched with every
//! other request — and returns the response, the parsed action as a tool call, and for CausalCache
//! the allocation, k, whether pass 2 ran, the proposal, per-phase timings and reused tokens. The
//! response and screenshot then become history for the next step. The server records every episode
//! as a `recall.episode/1` directory (docs/FORMATS.md), so `recall episode render` and
//! `recall episode label` work on what it served.
//!
//! Episodes expire after `--episode-ttl` without a step, and are capped in number and in bytes of
//! screenshots. One step of an episode runs at a time (a second is refused with 409).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::sync::{oneshot, watch, OwnedMutexGuard};

use crate::action::{parse_response, Platform};
use crate::agent::causalcache::{
    make_policy, two_pass_step, EpisodeMemo, PolicyChoice, StepReport, StopRule, TwoPassConfig,
};
use crate::agent::scopemem::{scopemem_step, Opinions, Placement, ScopeMemConfig};
use crate::engine::Session;
use crate::memory::episode::{Episode, StepRecord, EPISODE_FILE, EPISODE_FORMAT};
use crate::memory::policy::AllocationPolicy;
use crate::memory::protocol::{render, render_decision, Protocol};
use crate::memory::selector::Mode;
use crate::model::AdapterMode;
use crate::server::error::ApiError;
use crate::server::fields::{json_object, Fields};
use crate::server::reply::rand_id;
use crate::server::session::RemoteSession;
use crate::server::AppState;

/// How an episode decides its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Pass 1 on Recent-B, the allocation policy, pass 2 when the allocation changed.
    CausalCache,
    /// First opinion, the encoder's prefix, second opinion.
    ScopeMem,
    /// One pass on Recent-B.
    Single,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::CausalCache => "causalcache",
            Method::ScopeMem => "scopemem",
            Method::Single => "single",
        }
    }
}

/// An episode's settings, from the request that opened it.
#[derive(Debug, Clone)]
pub struct EpisodeConfig {
    pub instruction: String,
    pub platform: Platform,
    pub protocol: Protocol,
    pub method: Method,
    pub budget: usize,
    pub policy: PolicyChoice,
    pub max_tokens: usize,
    pub draft: bool,
    pub adapter: AdapterMode,
    pub placement: Placement,
    /// What ends a CausalCache pass (`stop_rule`: `tool-call`, the protocol's, or `eos-or-tool-call`).
    pub stop: StopRule,
}

impl EpisodeConfig {
    fn to_json(&self) -> Value {
        json!({
            "instruction": self.instruction,
            "platform": self.platform.as_str(),
            "protocol": protocol_name(self.protocol),
            "method": self.method.name(),
            "budget": self.budget,
            "policy": self.policy.name,
            "mode": self.policy.mode.as_str(),
            "max_replacements": self.policy.max_replacements,
            "seed": self.policy.seed,
            "max_tokens": self.max_tokens,
            "draft": self.draft,
            "adapter": format!("{:?}", self.adapter).to_lowercase(),
            "placement": match self.placement { Placement::Prepend => "prepend", Placement::Append => "append" },
            "stop_rule": match self.stop { StopRule::ToolCallOnly => "tool-call", StopRule::EosOrToolCall => "eos-or-tool-call" },
        })
    }
}

fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Mobile => "mobile",
        Protocol::Desktop => "desktop",
        Protocol::DesktopStrictEvents => "desktop-strict",
    }
}

/// What the server keeps of one decided step (returned by the step call and by `GET`).
#[derive(Debug, Clone)]
struct StepView {
    t: usize,
    screenshot: String,
    response: String,
    action: Result<Value, String>,
    action_line: String,
    /// The allocation the response was decided on (Recent-B for `single` and `scopemem`).
    allocation: Vec<usize>,
    detail: Value,
}

impl StepView {
    fn to_json(&self) -> Value {
        let mut v = json!({
            "t": self.t,
            "screenshot": self.screenshot,
            "response": self.response,
            "action": self.action.as_ref().ok(),
            "action_error": self.action.as_ref().err(),
            "action_line": self.action_line,
            "allocation": self.allocation,
        });
        if let (Value::Object(m), Value::Object(d)) = (&mut v, &self.detail) {
            m.extend(d.clone());
        }
        v
    }
}

/// One live episode.
pub struct EpisodeState {
    id: String,
    config: EpisodeConfig,
    /// The completed steps, recorded under `episode.dir`.
    episode: Episode,
    policy: Box<dyn AllocationPolicy>,
    memo: EpisodeMemo,
    views: Vec<StepView>,
    bytes: u64,
    created: u64,
}

/// An episode in the store: its state (locked while a step runs) and when it was last used.
struct Entry {
    state: Arc<tokio::sync::Mutex<EpisodeState>>,
    last_used: Arc<Mutex<Instant>>,
}

/// Where episodes live and the limits on them.
pub struct EpisodeStore {
    dir: PathBuf,
    /// Whether `dir` is the server's own temporary directory (removed at shutdown).
    temporary: bool,
    ttl: Duration,
    max_episodes: usize,
    max_bytes: u64,
    bytes: AtomicU64,
    map: Mutex<HashMap<String, Entry>>,
}

impl EpisodeStore {
    /// A store recording under `dir` (created when missing); `None`: a temporary directory removed at
    /// shutdown.
    pub fn new(
        dir: Option<&Path>,
        ttl: Duration,
        max_episodes: usize,
        max_bytes: u64,
    ) -> crate::Result<Self> {
        let (dir, temporary) = match dir {
            Some(d) => (d.to_path_buf(), false),
            None => (
                std::env::temp_dir().join(format!(
                    "recall-episodes-{}-{:08x}",
                    std::process::id(),
                    rand_id() as u32
                )),
                true,
            ),
        };
        std::fs::create_dir_all(&dir).map_err(|e| crate::Error::io(&dir, e))?;
        Ok(EpisodeStore {
            dir,
            temporary,
            ttl,
            max_episodes,
            max_bytes,
            bytes: AtomicU64::new(0),
            map: Mutex::new(HashMap::new()),
        })
    }

    /// The directory episodes are recorded under.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long an episode lives without a step.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Live episodes.
    pub fn len(&self) -> usize {
        self.map.lock().map_or(0, |m| m.len())
    }

    /// Whether no episode is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, id: &str) -> Result<Arc<tokio::sync::Mutex<EpisodeState>>, ApiError> {
        let m = self
            .map
            .lock()
            .map_err(|_| ApiError::internal("episode store lock poisoned"))?;
        let e = m.get(id).ok_or_else(|| {
            ApiError::not_found(format!(
                "episode {} does not exist (or expired)",
                crate::limits::excerpt(id)
            ))
            .with_code("episode_not_found")
        })?;
        if let Ok(mut t) = e.last_used.lock() {
            *t = Instant::now();
        }
        Ok(e.state.clone())
    }

    /// Whether episode `id` is open here.
    pub fn contains(&self, id: &str) -> bool {
        self.map.lock().is_ok_and(|m| m.contains_key(id))
    }

    /// Removes episode `id` and its recording (a bridge open whose first step failed: no step, so
    /// no screenshot bytes to release).
    pub(super) fn discard(&self, id: &str) {
        self.remove(id);
    }

    fn remove(&self, id: &str) -> Option<Entry> {
        let e = self.map.lock().ok()?.remove(id)?;
        let _ = std::fs::remove_dir_all(self.dir.join(id));
        Some(e)
    }

    /// Removes episodes unused for longer than the TTL (not one whose step is running).
    pub fn expire(&self) {
        let now = Instant::now();
        let expired: Vec<String> = match self.map.lock() {
            Ok(m) => m
                .iter()
                .filter(|(_, e)| {
                    e.last_used
                        .lock()
                        .is_ok_and(|t| now.duration_since(*t) > self.ttl)
                        && e.state.try_lock().is_ok()
                })
                .map(|(id, _)| id.clone())
                .collect(),
            Err(_) => return,
        };
        for id in expired {
            if let Some(e) = self.remove(&id) {
                let bytes = e.state.try_lock().map_or(0, |s| s.bytes);
                self.bytes.fetch_sub(bytes, Ordering::SeqCst);
                tracing::info!(episode = id, "expired");
            }
        }
    }

    /// Removes the recording directory if it is the server's temporary one.
    pub fn cleanup(&self) {
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn reserve(&self, bytes: u64) -> Result<(), ApiError> {
        let before = self.bytes.fetch_add(bytes, Ordering::SeqCst);
        if before + bytes > self.max_bytes {
            self.bytes.fetch_sub(bytes, Ordering::SeqCst);
            return Err(ApiError::too_many(format!(
                "episode storage is full ({} of {} bytes of screenshots); delete finished episodes",
                before, self.max_bytes
            )));
        }
        Ok(())
    }

    fn release(&self, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::SeqCst);
    }
}

/// `POST /v1/episodes`.
pub async fn create(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    crate::server::reply::respond(create_inner(&app, &body).await)
}

async fn create_inner(app: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    let body = open_episode(app, &obj, None)?;
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// Opens an episode from a `POST /v1/episodes` body; its summary. `id`: the client's name for it
/// (the chat bridge, [`super::episode_chat`]; already checked), refused when taken; `None`: a fresh
/// one.
pub(super) fn open_episode(
    app: &Arc<AppState>,
    obj: &Map<String, Value>,
    id: Option<&str>,
) -> Result<Value, ApiError> {
    let config = parse_config(app, obj)?;
    if config.policy.name == "ocr" {
        // The API's steps carry screenshots, no transcripts: the OCR baseline is offline only.
        return Err(ApiError::bad(
            "policy",
            "policy `ocr` needs OCR transcripts, which episode steps do not carry: run it offline with \
             `recall episode run|eval --policy ocr` on episodes whose steps have `ocr`",
        ));
    }
    let policy = make_policy(&config.policy).map_err(|e| ApiError::bad("policy", e.to_string()))?;
    let store = &app.episodes;
    store.expire();
    if store.len() >= store.max_episodes {
        return Err(ApiError::too_many(format!(
            "the server holds its limit of {} episodes; delete finished ones",
            store.max_episodes
        )));
    }
    let id = match id {
        Some(id) if store.contains(id) => {
            return Err(
                ApiError::invalid(format!("episode `{id}` is already open on this replica"))
                    .with_status(StatusCode::CONFLICT, "invalid_request_error")
                    .with_code("episode_exists"),
            );
        }
        Some(id) => id.to_string(),
        None => format!("ep-{:016x}", rand_id()),
    };
    let dir = store.dir.join(&id);
    std::fs::create_dir_all(&dir)
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
    let created = crate::server::unix_now();
    let state = EpisodeState {
        id: id.clone(),
        episode: Episode {
            instruction: config.instruction.clone(),
            platform: config.platform,
            steps: Vec::new(),
            final_screenshot: None,
            final_ocr: None,
            dir,
        },
        config,
        policy,
        memo: EpisodeMemo::default(),
        views: Vec::new(),
        bytes: 0,
        created,
    };
    state.persist().map_err(|e| ApiError::internal(e.to_string()))?;
    let body = state.summary();
    let entry = Entry {
        state: Arc::new(tokio::sync::Mutex::new(state)),
        last_used: Arc::new(Mutex::new(Instant::now())),
    };
    store
        .map
        .lock()
        .map_err(|_| ApiError::internal("episode store lock poisoned"))?
        .insert(id, entry);
    Ok(body)
}

/// The fields a `POST /v1/episodes` body may hold; others are ignored with a warning.
const EPISODE_FIELDS: &[&str] = &[
    "instruction",
    "platform",
    "protocol",
    "method",
    "budget",
    "policy",
    "mode",
    "max_replacements",
    "seed",
    "max_tokens",
    "draft",
    "adapter",
    "placement",
    "stop_rule",
];

fn parse_config(app: &AppState, obj: &Map<String, Value>) -> Result<EpisodeConfig, ApiError> {
    let fields = Fields::new(obj);
    fields.warn_unknown(EPISODE_FIELDS, "episode");
    let instruction = fields
        .string("instruction")?
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| ApiError::bad("instruction", "`instruction` is required (a non-empty string)"))?
        .to_string();
    let (platform, protocol) = parse_platform_protocol(&fields)?;
    let method = parse_method(app, &fields)?;
    let policy_name = parse_policy_name(app, &fields, method)?;
    let mode = fields.parsed::<Mode>("mode")?.unwrap_or(Mode::Paper);
    let max_tokens = parse_max_tokens(app, &fields)?;
    let adapter = parse_adapter(app, &fields)?;
    let draft = match obj.get("draft") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("draft", "`draft` must be a boolean")),
    };
    Ok(EpisodeConfig {
        instruction,
        platform,
        protocol,
        method,
        budget: fields.uint("budget")?.unwrap_or(4) as usize,
        policy: PolicyChoice {
            name: policy_name,
            selector: app.selector.clone(),
            mode,
            max_replacements: fields.uint("max_replacements")?.map(|n| n as usize),
            seed: fields.uint("seed")?.unwrap_or(0),
            indexing: None,
        },
        max_tokens,
        draft,
        adapter,
        placement: fields.parsed::<Placement>("placement")?.unwrap_or_default(),
        stop: fields.parsed::<StopRule>("stop_rule")?.unwrap_or_default(),
    })
}

/// `platform` and `protocol`, either implying the other (mobile when neither is given); they must agree.
fn parse_platform_protocol(fields: &Fields<'_>) -> Result<(Platform, Protocol), ApiError> {
    let platform = match fields.string("platform")? {
        None => None,
        Some(p) => Some(Platform::from_name(p).ok_or_else(|| {
            ApiError::bad(
                "platform",
                format!("`platform` `{p}`: expected mobile or desktop"),
            )
        })?),
    };
    let protocol = fields.parsed::<Protocol>("protocol")?;
    match (platform, protocol) {
        (None, None) => Ok((Platform::Mobile, Protocol::Mobile)),
        (Some(pl), None) => Ok((pl, Protocol::for_platform(pl))),
        (None, Some(pr)) => Ok((pr.platform(), pr)),
        (Some(pl), Some(pr)) if pr.platform() == pl => Ok((pl, pr)),
        (Some(pl), Some(pr)) => Err(ApiError::bad(
            "protocol",
            format!(
                "protocol `{}` is for {}, not {pl}",
                protocol_name(pr),
                pr.platform()
            ),
        )),
    }
}

/// `method` (default `causalcache`); `scopemem` needs the server's encoder.
fn parse_method(app: &AppState, fields: &Fields<'_>) -> Result<Method, ApiError> {
    let method = match fields.string("method")?.unwrap_or("causalcache") {
        "causalcache" => Method::CausalCache,
        "scopemem" => Method::ScopeMem,
        "single" => Method::Single,
        other => {
            return Err(ApiError::bad(
                "method",
                format!("`method` `{other}`: expected causalcache, scopemem or single"),
            ))
        }
    };
    if method == Method::ScopeMem && app.encoder.is_none() {
        return Err(ApiError::bad(
            "method",
            "`method: scopemem` needs an encoder: start the server with --encoder DIR",
        ));
    }
    Ok(method)
}

/// The allocation policy's name: `policy` for CausalCache (default `selector` when the server has a
/// scorer, else `recent`), `recent` for the other methods. The scored policies need the scorer.
fn parse_policy_name(app: &AppState, fields: &Fields<'_>, method: Method) -> Result<String, ApiError> {
    let default_policy = if app.selector.is_some() {
        "selector"
    } else {
        "recent"
    };
    let policy_name = match method {
        Method::CausalCache => fields.string("policy")?.unwrap_or(default_policy).to_string(),
        Method::Single | Method::ScopeMem => "recent".to_string(),
    };
    if matches!(policy_name.as_str(), "selector" | "inverted") && app.selector.is_none() {
        return Err(ApiError::bad(
            "policy",
            format!("`policy: {policy_name}` needs a scorer: start the server with --selector FILE"),
        ));
    }
    Ok(policy_name)
}

/// `max_tokens` (default 256), in `1..max_context`.
fn parse_max_tokens(app: &AppState, fields: &Fields<'_>) -> Result<usize, ApiError> {
    let max_tokens = fields.uint("max_tokens")?.unwrap_or(256) as usize;
    if max_tokens == 0 || max_tokens >= app.engine.info.max_context {
        return Err(ApiError::bad(
            "max_tokens",
            format!("`max_tokens` must be in 1..{}", app.engine.info.max_context),
        ));
    }
    Ok(max_tokens)
}

/// `adapter` (default: the server's mode, else off); only `off` on a server without an adapter.
fn parse_adapter(app: &AppState, fields: &Fields<'_>) -> Result<AdapterMode, ApiError> {
    Ok(match fields.string("adapter")? {
        None => app.engine.info.adapter.unwrap_or(AdapterMode::Off),
        Some(a) => {
            let mode: AdapterMode = a
                .parse()
                .map_err(|e: crate::Error| ApiError::bad("adapter", e.to_string()))?;
            if mode != AdapterMode::Off && app.engine.info.adapter.is_none() {
                return Err(ApiError::bad(
                    "adapter",
                    "this server has no adapter (start it with --adapter DIR)",
                ));
            }
            mode
        }
    })
}

/// `GET /v1/episodes/{id}`.
pub async fn get(State(app): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Response {
    crate::server::reply::respond(
        async {
            let state = app.episodes.get(&id)?;
            let st = state.lock().await;
            let mut body = st.summary();
            body["steps"] = st.views.iter().map(StepView::to_json).collect();
            body["allocations"] = st.views.iter().map(|v| json!(v.allocation)).collect();
            Ok(Json(body).into_response())
        }
        .await,
    )
}

/// `GET /v1/episodes/{id}/steps/{t}`: one step, with the messages it was decided on (images as the
/// paths of the recorded screenshots, as `recall episode render` writes them).
pub async fn get_step(
    State(app): State<Arc<AppState>>,
    UrlPath((id, t)): UrlPath<(String, usize)>,
) -> Response {
    crate::server::reply::respond(
        async {
            let state = app.episodes.get(&id)?;
            let st = state.lock().await;
            let view = st.views.get(t.wrapping_sub(1)).ok_or_else(|| {
                ApiError::not_found(format!(
                    "episode {} has steps 1..={}",
                    crate::limits::excerpt(&id),
                    st.views.len()
                ))
            })?;
            let messages = render_decision(
                st.config.protocol,
                &st.episode
                    .decision(t)
                    .map_err(|e| ApiError::internal(e.to_string()))?,
                &view.allocation,
            )
            .map_err(|e| ApiError::internal(e.to_string()))?;
            let mut body = view.to_json();
            body["messages"] = crate::tokenize::chat::messages_to_json(&messages);
            Ok(Json(body).into_response())
        }
        .await,
    )
}

/// `DELETE /v1/episodes/{id}`.
pub async fn delete(State(app): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Response {
    crate::server::reply::respond(
        async {
            let state = app.episodes.get(&id)?;
            let st = state.try_lock().map_err(|_| conflict(&id))?;
            let bytes = st.bytes;
            drop(st);
            app.episodes.remove(&id);
            app.episodes.release(bytes);
            Ok(Json(json!({"id": id, "object": "episode.deleted", "deleted": true})).into_response())
        }
        .await,
    )
}

fn conflict(id: &str) -> ApiError {
    ApiError::invalid(format!("a step of episode `{id}` is running; one step at a time"))
        .with_status(StatusCode::CONFLICT, "invalid_request_error")
        .with_code("step_in_progress")
}

/// `POST /v1/episodes/{id}/steps`: `{"image_url": {"url": ...}}` (or `"image_url": "..."`).
pub async fn step(State(app): State<Arc<AppState>>, UrlPath(id): UrlPath<String>, body: Bytes) -> Response {
    crate::server::reply::respond(step_inner(&app, &id, &body).await)
}

async fn step_inner(app: &Arc<AppState>, id: &str, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    for key in obj.keys().filter(|k| k.as_str() != "image_url") {
        tracing::warn!("ignoring unknown step field `{key}`");
    }
    let url = match obj.get("image_url") {
        Some(Value::String(u)) => u.clone(),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(u)) => u.clone(),
            _ => return Err(ApiError::bad("image_url.url", "`image_url.url` must be a string")),
        },
        None | Some(Value::Null) => {
            return Err(ApiError::bad(
                "image_url",
                "`image_url` (the current screenshot) is required",
            ))
        }
        Some(_) => {
            return Err(ApiError::bad(
                "image_url",
                "`image_url` must be an object with `url` or a string",
            ))
        }
    };
    Ok(Json(run_step(app, id, &url).await?).into_response())
}

/// Runs one step of episode `id` on the screenshot at `url` and commits it; the step's JSON (what
/// `POST /v1/episodes/{id}/steps` answers).
pub(super) async fn run_step(app: &Arc<AppState>, id: &str, url: &str) -> Result<Value, ApiError> {
    let state = app.episodes.get(id)?;
    let guard = state.try_lock_owned().map_err(|_| conflict(id))?;
    let (data, name) = app.media.fetch(url, "image_url").await?;
    let media = app.media.clone();
    let checked = data.clone();
    let decoded = tokio::task::spawn_blocking(move || media.decode(&checked, &name, "image_url"))
        .await
        .map_err(|e| ApiError::internal(format!("decoding the screenshot: {e}")))??;
    let ext = extension(&data);
    let t = guard.episode.len() + 1;
    let shot = guard.episode.dir.join(format!("step{t:03}.{ext}"));
    app.episodes.reserve(data.len() as u64)?;
    if let Err(e) = tokio::fs::write(&shot, &data).await {
        app.episodes.release(data.len() as u64);
        return Err(ApiError::internal(format!("writing {}: {e}", shot.display())));
    }
    if let Some(key) = crate::server::media::SourceMemo::file_key(&shot) {
        let tokens =
            crate::server::media::image_tokens(&app.engine.info.preprocess, &decoded.image, "image_url")?;
        app.memo.insert(key, decoded.hash, tokens);
    }

    // The step runs on a blocking thread; its result comes back here, where it is committed. A client
    // that went away drops the receiver: the step is then rolled back, as if never sent.
    let (client_tx, client_rx) = watch::channel(());
    let (done_tx, done_rx) = oneshot::channel::<(OwnedMutexGuard<EpisodeState>, crate::Result<StepView>)>();
    let (app2, shot2, rt) = (app.clone(), shot.clone(), tokio::runtime::Handle::current());
    let bytes = data.len() as u64;
    tokio::task::spawn_blocking(move || {
        let mut st = guard;
        let mut session = RemoteSession::new(app2.clone(), rt, client_rx);
        let result = st.decide(&mut session, &app2, &shot2);
        if let Err((_, result)) = done_tx.send((st, result)) {
            let _ = std::fs::remove_file(&shot2);
            app2.episodes.release(bytes);
            tracing::info!("episode step abandoned by its client: {:?}", result.err());
        }
    });
    let (mut st, result) = done_rx
        .await
        .map_err(|_| ApiError::internal("the step's thread ended without a result"))?;
    drop(client_tx);
    let view = match result {
        Ok(view) => view,
        Err(e) => {
            let _ = std::fs::remove_file(&shot);
            app.episodes.release(bytes);
            return Err(ApiError::from_engine(&e, "image_url"));
        }
    };
    st.commit(shot, view.clone(), bytes)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let mut body = view.to_json();
    body["id"] = json!(st.id);
    body["object"] = json!("episode.step");
    Ok(body)
}

/// The file extension of encoded image bytes (PNG, JPEG or WebP; the decoder accepted them).
fn extension(data: &[u8]) -> &'static str {
    if data.starts_with(&[0xFF, 0xD8, 0xFF]) {
        "jpg"
    } else if data.len() >= 12 && &data[..4] == b"RIFF" && &data[8..12] == b"WEBP" {
        "webp"
    } else {
        "png"
    }
}

impl EpisodeState {
    fn summary(&self) -> Value {
        let mut v = self.config.to_json();
        v["id"] = json!(self.id);
        v["object"] = json!("episode");
        v["created"] = json!(self.created);
        v["num_steps"] = json!(self.episode.len());
        v["dir"] = json!(self.episode.dir.display().to_string());
        v
    }

    /// Decides step `T + 1` on the screenshot at `shot` (not yet part of the history).
    fn decide(&mut self, s: &mut RemoteSession, app: &AppState, shot: &Path) -> crate::Result<StepView> {
        self.episode.final_screenshot = Some(shot.to_path_buf());
        let result = self.decide_current(s, app);
        self.episode.final_screenshot = None;
        let t = self.episode.len() + 1;
        let (response, allocation, detail) = result?;
        let platform = self.config.platform;
        let action = parse_response(&response, platform)
            .map(|a| serde_json::from_str(&a.tool_call_json()).unwrap_or(Value::Null))
            .map_err(|e| e.to_string());
        let record = StepRecord::new(shot, response.clone());
        Ok(StepView {
            t,
            screenshot: file_name(shot),
            action_line: record.action_line_for(platform),
            response,
            action,
            allocation,
            detail,
        })
    }

    /// The response, the allocation it was decided on and the method's details.
    fn decide_current(
        &mut self,
        s: &mut RemoteSession,
        app: &AppState,
    ) -> crate::Result<(String, Vec<usize>, Value)> {
        let t = self.episode.len() + 1;
        let cfg = &self.config;
        match cfg.method {
            Method::CausalCache | Method::Single => {
                let two_pass = TwoPassConfig {
                    budget: cfg.budget,
                    protocol: cfg.protocol,
                    max_tokens: cfg.max_tokens,
                    adapter: cfg.adapter,
                    draft: cfg.draft,
                    stop: cfg.stop,
                    ..TwoPassConfig::default()
                };
                let r = two_pass_step(
                    s,
                    &self.episode,
                    t,
                    self.policy.as_mut(),
                    &two_pass,
                    &mut self.memo,
                )?;
                Ok((r.response.clone(), r.allocation.clone(), causalcache_detail(&r)))
            }
            Method::ScopeMem => {
                let encoder = app
                    .encoder
                    .as_ref()
                    .ok_or_else(|| crate::Error::InvalidRequest("no encoder loaded".into()))?;
                let recent = cfg.protocol.recent_b(t - 1, cfg.budget);
                let current = self.episode.final_screenshot.clone().unwrap_or_default();
                let messages = render(
                    cfg.protocol,
                    &cfg.instruction,
                    &self.episode.steps,
                    &recent,
                    &current,
                )?;
                let clock = Instant::now();
                let prompt = s.chat_prompt(&messages)?;
                let history: Vec<String> = self.episode.steps.iter().map(|st| st.response.clone()).collect();
                let sm = ScopeMemConfig {
                    placement: cfg.placement,
                    max_tokens: cfg.max_tokens,
                    draft: cfg.draft,
                    ..ScopeMemConfig::default()
                };
                let o = scopemem_step(s, encoder, &prompt, &cfg.instruction, &history, cfg.platform, &sm)?;
                let ms = clock.elapsed().as_secs_f64() * 1e3;
                Ok((o.second.clone(), recent, scopemem_detail(&o, ms)))
            }
        }
    }

    /// Appends a decided step to the history and records the episode.
    fn commit(&mut self, shot: PathBuf, view: StepView, bytes: u64) -> crate::Result<()> {
        self.episode
            .steps
            .push(StepRecord::new(shot, view.response.clone()));
        self.views.push(view);
        self.bytes += bytes;
        self.persist()
    }

    /// Writes `episode.json` atomically (temporary file, fsync, rename), so a reader never sees half of it.
    fn persist(&self) -> crate::Result<()> {
        let steps: Vec<Value> = self
            .episode
            .steps
            .iter()
            .zip(&self.views)
            .map(|(s, v)| {
                json!({
                    "screenshot": file_name(&s.screenshot),
                    "response": s.response,
                    "meta": {"allocation": v.allocation, "detail": v.detail},
                })
            })
            .collect();
        let doc = json!({
            "format": EPISODE_FORMAT,
            "instruction": self.episode.instruction,
            "platform": self.episode.platform.as_str(),
            "steps": steps,
            "meta": {"served_by": "recall serve", "id": self.id, "config": self.config.to_json()},
        });
        let path = self.episode.dir.join(EPISODE_FILE);
        let text =
            serde_json::to_string_pretty(&doc).map_err(|e| crate::Error::InvalidRequest(e.to_string()))?;
        crate::atomic::write_atomic(&path, text)
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn causalcache_detail(r: &StepReport) -> Value {
    json!({
        "recent": r.recent,
        "k": r.k,
        "pass2": r.pass2,
        "proposal": r.proposal,
        "timings_ms": r.timings,
        "reused_tokens": {"pass1": r.reused_tokens.0, "pass2": r.reused_tokens.1},
        "accepted_draft": r.accepted_draft,
    })
}

fn scopemem_detail(o: &Opinions, ms: f64) -> Value {
    json!({
        "first": o.first,
        "p0": o.p0,
        "h0": o.h0,
        "second": o.second,
        "second_pass_forwards": o.second_pass_forwards,
        "accepted_draft": o.accepted_draft,
        "timings_ms": {"step_ms": ms},
    })
}
