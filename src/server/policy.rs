//! `POST /v1/causalcache/policy`: the CausalCache authors' stateless MobileWorld policy protocol
//! (`causalcache.mobileworld.policy_request.v2` in, `causalcache.mobileworld.policy_response.v2`
//! out, as their harness's `HTTPMobileWorldPolicy` speaks it to `serve_mobileworld_gui_owl_policy.py`),
//! decided with recall's CausalCache step. The harness appends `/act` to its base URL, so
//! `/v1/causalcache/policy/act` is the same route.
//!
//! The request carries the task, the current screenshot (bare base64 PNG), every completed step
//! (action text, full response, and the screenshot it acted on when the client restores it) and the
//! client's selection. The step is decided on recall's GUI-Owl protocol renderer (the official
//! layout for a Recent-B suffix, gap-fold otherwise), greedily, 256 tokens at most, ending only at
//! `</tool_call>` as the authors' server decodes:
//!
//! * with a selector loaded (`recall serve --selector`) and every past screenshot sent (the
//!   harness's `memory_arm: full`), the server chooses: pass 1 on Recent-B (`--policy-budget`, 4),
//!   the selector, pass 2 when the allocation changed — the authors' `--selector-bundle` mode;
//! * otherwise the client's `selected_event_step_ids` are the allocation, answered in one pass.
//!
//! The response is the authors' (`action` a MobileWorld `JSONAction` in screen pixels,
//! `action_text`, `full_response`, `policy_parsed`, `parse_error`, `dropped_arguments`,
//! `native_output`, `selection`, `request_count`, timings, `generation`). A response that does not
//! parse is a `wait` with `policy_parsed: false`, as theirs. Bad requests are 400s naming the field
//! (the authors' server answers 500 for them).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Map, Value};
use tokio::sync::watch;

use crate::action::{action_line_or_fallback, mobileworld_action, parse_official, Platform};
use crate::agent::causalcache::{
    fixed_step, make_policy, two_pass_step, EpisodeMemo, PolicyChoice, ReferenceSource, StepReport, StopRule,
    TwoPassConfig,
};
use crate::memory::episode::{Episode, StepRecord};
use crate::memory::protocol::Protocol;
use crate::memory::selector::Mode;
use crate::server::error::ApiError;
use crate::server::fields::{json_object, Fields};
use crate::server::session::RemoteSession;
use crate::server::AppState;

/// The request schema this endpoint speaks.
pub const REQUEST_SCHEMA: &str = "causalcache.mobileworld.policy_request.v2";
/// The response schema it answers with.
pub const RESPONSE_SCHEMA: &str = "causalcache.mobileworld.policy_response.v2";
/// The prompt protocol the request must name (GUI-Owl-1.5's official mobile protocol).
pub const PROMPT_PROTOCOL: &str = "mobile_agent_v3_5_gui_owl_official_faithful";
/// The authors' `FROZEN_GUI_OWL_V2_MAX_NEW_TOKENS`.
const MAX_NEW_TOKENS: usize = 256;

/// A checked policy request.
#[derive(Debug, Clone)]
pub struct PolicyRequest {
    pub instruction: String,
    pub screen: (u32, u32),
    pub current: Vec<u8>,
    pub history: Vec<PastStep>,
    pub selected: Vec<usize>,
}

/// One completed step of a request.
#[derive(Debug, Clone)]
pub struct PastStep {
    pub action_text: String,
    pub full_response: String,
    /// The screenshot the policy acted on (PNG bytes), when the client restores it.
    pub screenshot: Option<Vec<u8>>,
}

/// Checks a policy request, field by field.
pub fn parse_policy_request(obj: &Map<String, Value>) -> Result<PolicyRequest, ApiError> {
    let f = Fields::new(obj);
    let schema = f.string("schema_version")?;
    if schema != Some(REQUEST_SCHEMA) {
        return Err(f.bad(
            "schema_version",
            format!("`schema_version` must be `{REQUEST_SCHEMA}`"),
        ));
    }
    if f.string("prompt_protocol")? != Some(PROMPT_PROTOCOL) {
        return Err(f.bad(
            "prompt_protocol",
            format!("`prompt_protocol` must be `{PROMPT_PROTOCOL}`"),
        ));
    }
    let task = f
        .object("task")?
        .ok_or_else(|| f.bad("task", "`task` is required"))?;
    let instruction = Fields::nested(task, "task")
        .string("instruction")?
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| ApiError::bad("task.instruction", "`task.instruction` must be non-empty text"))?
        .to_string();
    let screen = screen_size(&f)?;
    let current = png_base64(&f, "current_screenshot_png_base64")?.ok_or_else(|| {
        f.bad(
            "current_screenshot_png_base64",
            "`current_screenshot_png_base64` is required",
        )
    })?;
    let items = f
        .array("history")?
        .ok_or_else(|| f.bad("history", "`history` is required (a list)"))?;
    let history = items
        .iter()
        .enumerate()
        .map(|(i, item)| past_step(item, i))
        .collect::<Result<Vec<_>, _>>()?;
    let selected = selected_ids(&f, &history)?;
    Ok(PolicyRequest {
        instruction,
        screen,
        current,
        history,
        selected,
    })
}

/// `screen_size`: `[width, height]`, both positive.
fn screen_size(f: &Fields<'_>) -> Result<(u32, u32), ApiError> {
    let bad = || f.bad("screen_size", "`screen_size` must be [width, height] in pixels");
    let a = f.array("screen_size")?.ok_or_else(bad)?;
    let dims: Vec<u32> = a
        .iter()
        .filter_map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .filter(|&x| x > 0)
        .collect();
    match dims[..] {
        [w, h] if a.len() == 2 => Ok((w, h)),
        _ => Err(bad()),
    }
}

/// A bare-base64 image field (the protocol's encoding), decoded.
fn png_base64(f: &Fields<'_>, key: &str) -> Result<Option<Vec<u8>>, ApiError> {
    let Some(b64) = f.string(key)? else {
        return Ok(None);
    };
    base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map(Some)
        .map_err(|e| f.bad(key, format!("`{}` is not valid base64: {e}", f.param(key))))
}

fn past_step(item: &Value, i: usize) -> Result<PastStep, ApiError> {
    let at = format!("history[{i}]");
    let obj = item
        .as_object()
        .ok_or_else(|| ApiError::bad(&at, format!("`{at}` must be an object")))?;
    let f = Fields::nested(obj, &at);
    if let Some(id) = f.uint("step_id")? {
        if id != i as u64 + 1 {
            return Err(f.bad(
                "step_id",
                format!("`{at}.step_id` must be {} (steps are 1..T in order)", i + 1),
            ));
        }
    }
    let text = |key: &str| -> Result<String, ApiError> {
        f.string(key)?
            .filter(|s| !s.trim().is_empty())
            .map(str::to_string)
            .ok_or_else(|| f.bad(key, format!("`{}` must be non-empty text", f.param(key))))
    };
    Ok(PastStep {
        action_text: text("action_text")?,
        full_response: text("full_response")?,
        screenshot: png_base64(&f, "restored_observation_screenshot_png_base64")?,
    })
}

/// `selected_event_step_ids`: sorted, unique, known steps whose screenshots the request carries.
fn selected_ids(f: &Fields<'_>, history: &[PastStep]) -> Result<Vec<usize>, ApiError> {
    let key = "selected_event_step_ids";
    let a = f
        .array(key)?
        .ok_or_else(|| f.bad(key, format!("`{key}` is required (a list)")))?;
    let ids = a
        .iter()
        .map(|v| v.as_u64().map(|x| x as usize))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| f.bad(key, format!("`{key}` must list step ids")))?;
    if ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err(f.bad(key, format!("`{key}` must be sorted and unique")));
    }
    for &id in &ids {
        match history.get(id.wrapping_sub(1)) {
            None => {
                return Err(f.bad(
                    key,
                    format!("`{key}` names step {id}, which is not in the history"),
                ))
            }
            Some(s) if s.screenshot.is_none() => {
                return Err(f.bad(
                    key,
                    format!(
                        "step {id} is selected but its restored_observation_screenshot_png_base64 is null"
                    ),
                ))
            }
            _ => {}
        }
    }
    Ok(ids)
}

/// `POST /v1/causalcache/policy` (and `.../policy/act`).
pub async fn policy(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    crate::server::reply::respond(act(&app, &body).await)
}

async fn act(app: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = parse_policy_request(&json_object(body)?)?;
    for (i, s) in req.history.iter().enumerate() {
        if let Some(png) = &s.screenshot {
            check_image(
                app,
                png,
                &format!("history[{i}].restored_observation_screenshot_png_base64"),
            )
            .await?;
        }
    }
    check_image(app, &req.current, "current_screenshot_png_base64").await?;
    let count = app.policy_requests.fetch_add(1, Ordering::SeqCst) + 1;
    let dir = ScratchDir::new(
        &app.episodes
            .dir()
            .join(format!("policy-{:016x}", crate::server::reply::rand_id())),
    )?;
    let episode = write_episode(&req, dir.path())?;
    let server_selects = app.selector.is_some() && req.history.iter().all(|s| s.screenshot.is_some());
    let decoded = arrived.elapsed().as_secs_f64();

    let (client_tx, client_rx) = watch::channel(());
    let (app2, rt) = (app.clone(), tokio::runtime::Handle::current());
    let selected = req.selected.clone();
    let started = Instant::now();
    let report = tokio::task::spawn_blocking(move || {
        let mut session = RemoteSession::new(app2.clone(), rt, client_rx);
        decide(&mut session, &app2, &episode, &selected, server_selects)
    })
    .await
    .map_err(|e| ApiError::internal(format!("the step's thread failed: {e}")))?
    .map_err(|e| ApiError::from_engine(&e, "history"))?;
    drop(client_tx);
    drop(dir);
    let latency = started.elapsed().as_secs_f64();
    Ok(Json(response_body(
        app,
        &req,
        &report,
        server_selects,
        count,
        decoded,
        latency,
    ))
    .into_response())
}

/// The step itself: the server's two-pass choice, or the client's allocation in one pass.
fn decide(
    s: &mut RemoteSession,
    app: &AppState,
    episode: &Episode,
    selected: &[usize],
    server_selects: bool,
) -> crate::Result<StepReport> {
    let t = episode.len() + 1;
    let mut cfg = TwoPassConfig {
        budget: selected.len(),
        protocol: Protocol::Mobile,
        max_tokens: MAX_NEW_TOKENS,
        adapter: app.engine.info.adapter.unwrap_or_default(),
        draft: true,
        stop: StopRule::ToolCallOnly,
        reference: ReferenceSource::Proposal,
        restore_as: crate::memory::protocol::RestoreAs::Pixels,
    };
    if !server_selects {
        return fixed_step(s, episode, t, selected, &cfg);
    }
    cfg.budget = app.limits.policy_budget;
    let choice = PolicyChoice {
        name: "selector".into(),
        selector: app.selector.clone(),
        mode: Mode::Paper,
        max_replacements: None,
        seed: 0,
        indexing: None,
    };
    let mut policy = make_policy(&choice)?;
    two_pass_step(s, episode, t, policy.as_mut(), &cfg, &mut EpisodeMemo::default())
}

/// Decodes an image under the media policy's caps (pixel count from the header), naming the field.
async fn check_image(app: &AppState, png: &[u8], param: &str) -> Result<(), ApiError> {
    if png.len() > app.media.max_bytes() {
        return Err(ApiError::too_large(
            param,
            format!(
                "image of {} bytes exceeds the limit of {} bytes (--max-image-bytes)",
                png.len(),
                app.media.max_bytes()
            ),
        ));
    }
    let (media, data, param) = (app.media.clone(), png.to_vec(), param.to_string());
    tokio::task::spawn_blocking(move || media.decode(&data, &param, &param).map(drop))
        .await
        .map_err(|e| ApiError::internal(format!("decoding an image: {e}")))?
}

/// The request as an episode directory: step `s`'s screenshot at `step{s}.png` when sent (a path
/// that does not exist otherwise: the renderer folds that step into text), the current one at
/// `current.png`, each step's action line as the client sent it.
fn write_episode(req: &PolicyRequest, dir: &Path) -> Result<Episode, ApiError> {
    let write = |name: &str, bytes: &[u8]| -> Result<PathBuf, ApiError> {
        let path = dir.join(name);
        std::fs::write(&path, bytes)
            .map_err(|e| ApiError::internal(format!("writing {}: {e}", path.display())))?;
        Ok(path)
    };
    let mut steps = Vec::with_capacity(req.history.len());
    for (i, s) in req.history.iter().enumerate() {
        let name = format!("step{:03}.png", i + 1);
        let path = match &s.screenshot {
            Some(png) => write(&name, png)?,
            None => dir.join(name),
        };
        steps.push(StepRecord {
            screenshot: path,
            response: s.full_response.clone(),
            action_line: Some(s.action_text.clone()),
            ocr: None,
        });
    }
    Ok(Episode {
        instruction: req.instruction.clone(),
        platform: Platform::Mobile,
        steps,
        final_screenshot: Some(write("current.png", &req.current)?),
        final_ocr: None,
        dir: dir.to_path_buf(),
    })
}

/// The authors' response fields for a decided step.
fn response_body(
    app: &AppState,
    req: &PolicyRequest,
    r: &StepReport,
    server_selects: bool,
    count: u64,
    decode_seconds: f64,
    latency: f64,
) -> Value {
    let text = &r.response;
    let parsed = parse_official(text);
    let (w, h) = req.screen;
    let (action, parse_error) = match &parsed.action {
        Ok(a) => (mobileworld_action(a, w, h), Value::Null),
        Err(e) => (json!({"action_type": "wait"}), json!(e)),
    };
    let action_text = action_line_or_fallback(text, Platform::Mobile);
    let full_response = if text.trim().is_empty() {
        format!("Action: {action_text}")
    } else {
        text.clone()
    };
    let selection = server_selects.then(|| {
        json!({
            "passes": if r.pass2 { 2 } else { 1 },
            "recent_tail": r.recent,
            "chosen": r.allocation,
            "k": r.k,
            "proposal": r.proposal,
        })
    });
    let tokens = app.engine.info.tokenizer.encode(text).map_or(0, |t| t.len());
    json!({
        "schema_version": RESPONSE_SCHEMA,
        "action": action,
        "action_text": action_text,
        "full_response": full_response,
        "policy_parsed": parsed.action.is_ok(),
        "parse_error": parse_error,
        "dropped_arguments": parsed.dropped,
        "native_output": text,
        "selection": selection,
        "request_count": count,
        "request_decode_seconds": decode_seconds,
        "queue_seconds": 0.0,
        "generation": {
            "prompt_protocol": PROMPT_PROTOCOL,
            "allocation": r.allocation,
            "generated_tokens": tokens,
            "reused_tokens": {"pass1": r.reused_tokens.0, "pass2": r.reused_tokens.1},
            "timings_ms": r.timings,
            "do_sample": false,
            "max_new_tokens": MAX_NEW_TOKENS,
            "num_beams": 1,
            "latency_seconds": latency,
            "served_by": "recall",
        },
    })
}

/// A directory removed when dropped (the request's screenshots, written for the renderer).
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(path: &Path) -> Result<Self, ApiError> {
        std::fs::create_dir_all(path)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", path.display())))?;
        Ok(ScratchDir(path.to_path_buf()))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
