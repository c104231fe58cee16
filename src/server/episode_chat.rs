//! The episode API over `POST /v1/chat/completions`, for routers and gateways that forward only the
//! OpenAI routes (sglang-router drops every other path, and it re-serialises request bodies, keeping
//! the OpenAI `metadata` field but not unknown ones). A chat completion whose `metadata` names
//! `recall_episode` is one step of that episode, decided by the server as `POST
//! /v1/episodes/{id}/steps` decides it (docs/SERVER.md "The episode API through a router"):
//!
//! * `metadata.recall_episode`: the episode's id, chosen by the client (also its routing key:
//!   `x-smg-routing-key`, so every step lands on the replica that holds the episode);
//! * `metadata.recall_open` (first step only): the `POST /v1/episodes` body as a JSON string; the
//!   replica opens the episode under that id, then runs the step;
//! * the last message: a user turn whose one image is the current screenshot (its text, if any, is
//!   not read: the server renders the prompt from the episode).
//!
//! The answer is a `chat.completion` whose message is the step's response, with the step's JSON (the
//! episode API's answer) under `recall_episode_step`. A step for an episode this replica does not
//! hold is a 404 naming the replica: after a failover the episode's history stayed where it was
//! served, and the step is refused rather than decided without it.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::episodes::{open_episode, run_step};
use super::error::ApiError;
use super::AppState;

/// The `metadata` key naming the episode.
pub const EPISODE_KEY: &str = "recall_episode";
/// The `metadata` key holding the `POST /v1/episodes` body on the first step.
pub const OPEN_KEY: &str = "recall_open";

/// The episode a chat request is a step of, if its `metadata` names one.
pub fn requested_episode(obj: &Map<String, Value>) -> Option<&Value> {
    obj.get("metadata")?.as_object()?.get(EPISODE_KEY)
}

/// One episode step asked as a chat completion (see the module docs).
pub async fn chat_step(app: &Arc<AppState>, obj: &Map<String, Value>) -> Result<Response, ApiError> {
    let meta = obj
        .get("metadata")
        .and_then(Value::as_object)
        .ok_or_else(|| ApiError::bad("metadata", "`metadata` must be an object"))?;
    let id = episode_id(meta.get(EPISODE_KEY))?;
    if obj.get("stream").is_some_and(|s| s.as_bool() == Some(true)) {
        return Err(ApiError::bad(
            "stream",
            "an episode step (metadata.recall_episode) does not stream: send `stream: false`",
        ));
    }
    let url = screenshot_url(obj)?;
    let open = meta.get(OPEN_KEY);
    if let Some(open) = open {
        let body = open_body(open)?;
        open_episode(app, &body, Some(id))?;
    } else if !app.episodes.contains(id) {
        return Err(ApiError::not_found(format!(
            "episode `{id}` is not open on this replica ({}): open it with metadata.{OPEN_KEY} on its \
             first step; an episode lives on the replica that opened it, so after a failover its \
             steps are refused rather than decided without their history",
            app.replica
        ))
        .with_code("episode_not_found"));
    }
    let step = match run_step(app, id, &url).await {
        Ok(step) => step,
        Err(e) => {
            // A first step that failed opens nothing: the client retries it as it was.
            if open.is_some() {
                app.episodes.discard(id);
            }
            return Err(e);
        }
    };
    let t = step["t"].as_u64().unwrap_or(0);
    let body = json!({
        "id": format!("chatcmpl-{id}-{t}"),
        "object": "chat.completion",
        "created": super::unix_now(),
        "model": app.engine.info.name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": step["response"]},
            "logprobs": null,
            "finish_reason": "stop",
        }],
        "recall_episode_step": step,
    });
    Ok((StatusCode::OK, Json(body)).into_response())
}

/// A client-chosen episode id: 1 to 64 of `A-Z a-z 0-9 . _ -`, not starting with a dot (it names
/// the episode's recording directory).
fn episode_id(v: Option<&Value>) -> Result<&str, ApiError> {
    let param = "metadata.recall_episode";
    let id = v
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(param, "`metadata.recall_episode` must be a string"))?;
    let ok = (1..=64).contains(&id.len())
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !ok {
        return Err(ApiError::bad(
            param,
            format!(
                "episode id {}: expected 1 to 64 of A-Z a-z 0-9 . _ - (not starting with a dot)",
                crate::limits::excerpt(id)
            ),
        ));
    }
    Ok(id)
}

/// `metadata.recall_open`: a JSON object, or a string holding one (OpenAI's `metadata` values are
/// strings).
fn open_body(v: &Value) -> Result<Map<String, Value>, ApiError> {
    let param = "metadata.recall_open";
    let parsed;
    let v = match v {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|e| ApiError::bad(param, format!("`{param}` is not valid JSON: {e}")))?;
            &parsed
        }
        other => other,
    };
    v.as_object().cloned().ok_or_else(|| {
        ApiError::bad(
            param,
            format!("`{param}` must be the POST /v1/episodes body, a JSON object"),
        )
    })
}

/// The URL of the one image of the last message, which must be the user's.
fn screenshot_url(obj: &Map<String, Value>) -> Result<String, ApiError> {
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::bad("messages", "`messages` must be a non-empty array"))?;
    let i = messages.len() - 1;
    let last = &messages[i];
    if last.get("role").and_then(Value::as_str) != Some("user") {
        return Err(ApiError::bad(
            format!("messages[{i}].role"),
            "an episode step's last message must be the user's, with the current screenshot",
        ));
    }
    let urls: Vec<&str> = last
        .get("content")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p.get("image_url"))
                .filter_map(|u| u.get("url").and_then(Value::as_str).or(u.as_str()))
                .collect()
        })
        .unwrap_or_default();
    match urls.as_slice() {
        [url] => Ok(url.to_string()),
        _ => Err(ApiError::bad(
            format!("messages[{i}].content"),
            format!(
                "an episode step's last message must hold exactly one image (the current \
                 screenshot), found {}",
                urls.len()
            ),
        )),
    }
}
