//! vLLM's utility routes: `POST /tokenize` (a prompt, or chat messages rendered with the model's
//! template and the request's tools), `POST /detokenize`, `GET /version`.
//!
//! As in vLLM, a chat's images count one `<|image_pad|>` each here: the images are not fetched, so
//! their merged-token expansion is not known (chat completions report the expanded count in
//! `usage.prompt_tokens`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::server::error::ApiError;
use crate::server::fields::{json_object, Fields};
use crate::server::openai::check_model;
use crate::server::tools::parse_tools;
use crate::server::AppState;
use crate::tokenize::chat::parse_messages_value;

const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
    "tools",
    "tool_choice",
    "mm_processor_kwargs",
    "chat_template_kwargs",
];

/// `POST /tokenize`.
pub async fn tokenize(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    crate::server::reply::respond(tokenize_inner(&app, &body))
}

fn tokenize_inner(app: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    let f = Fields::new(&obj);
    f.warn_unknown(TOKENIZE_FIELDS, "tokenize");
    let info = &app.engine.info;
    check_model(&f, &info.name)?;
    let ids = match (f.get("prompt"), f.get("messages")) {
        (Some(_), Some(_)) => return Err(f.bad("messages", "send `prompt` or `messages`, not both")),
        (Some(p), None) => {
            let text = p
                .as_str()
                .ok_or_else(|| f.bad("prompt", "`prompt` must be a string"))?;
            info.tokenizer
                .encode(text)
                .map_err(|e| f.bad("prompt", e.to_string()))?
        }
        (None, Some(m)) => {
            let messages = parse_messages_value(m, std::path::Path::new("request"))
                .map_err(|e| ApiError::from_engine(&e, "messages"))?;
            let tools = parse_tools(&f)?;
            let add = f.boolean("add_generation_prompt")?.unwrap_or(true);
            if add && f.boolean("continue_final_message")?.unwrap_or(false) {
                return Err(f.bad(
                    "continue_final_message",
                    "`continue_final_message` and `add_generation_prompt` exclude each other",
                ));
            }
            info.renderer
                .render_ids(&info.tokenizer, &messages, &tools.tools, add)
                .map_err(|e| ApiError::from_engine(&e, "messages"))?
                .0
        }
        (None, None) => return Err(f.bad("prompt", "`prompt` or `messages` is required")),
    };
    let token_strs = f.boolean("return_token_strs")?.unwrap_or(false).then(|| {
        ids.iter()
            .map(|&t| info.tokenizer.token_text(t).unwrap_or_default())
            .collect::<Vec<_>>()
    });
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": info.max_context,
        "tokens": ids,
        "token_strs": token_strs,
    }))
    .into_response())
}

/// `POST /detokenize`.
pub async fn detokenize(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    crate::server::reply::respond(detokenize_inner(&app, &body))
}

fn detokenize_inner(app: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    let f = Fields::new(&obj);
    f.warn_unknown(&["model", "tokens"], "detokenize");
    let info = &app.engine.info;
    check_model(&f, &info.name)?;
    let tokens = f
        .array("tokens")?
        .ok_or_else(|| f.bad("tokens", "`tokens` is required"))?;
    let vocab = info.tokenizer.vocab_size().max(info.vocab_size);
    let ids = tokens
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    f.bad(
                        &format!("tokens[{i}]"),
                        format!("`tokens[{i}]` must be a token id below {vocab}"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let prompt = info
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}

/// `GET /version`.
pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "server": "recall"}))
}
