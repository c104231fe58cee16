//! `POST /v1/responses`: OpenAI's Responses API over the chat machinery, for clients that only speak
//! it. The `input` (a string, or message items with `input_text` / `input_image` / `output_text`
//! parts, `function_call` and `function_call_output` items) and the `instructions` become a chat;
//! function `tools` go into the template; the output is a `message` item and one `function_call`
//! item per tool call. Without a store there is no `previous_response_id`; streaming is refused
//! (use chat completions to stream).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::engine::{FinishReason, Task};
use crate::server::engine_loop::PreparedChat;
use crate::server::error::ApiError;
use crate::server::fields::{json_object, Fields};
use crate::server::params::{check_unsupported, Generation, GENERATION_FIELDS};
use crate::server::prepare::{check_model, check_queue, request_budget};
use crate::server::prepare::{submit_chat, ChatInput};
use crate::server::reply::{finished, generation_of, respond, ReplyBase};
use crate::server::tools::{extract, parse_tools};
use crate::server::AppState;
use crate::tokenize::chat::parse_messages_value;

const RESPONSE_FIELDS: &[&str] = &[
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "previous_response_id",
    "text",
    "reasoning",
    "truncation",
    "include",
    "background",
    "mm_processor_kwargs",
];

/// `POST /v1/responses`.
pub async fn responses(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    respond(answer(&app, &body).await)
}

async fn answer(app: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    let f = Fields::new(&obj);
    let known: Vec<&str> = RESPONSE_FIELDS.iter().chain(GENERATION_FIELDS).copied().collect();
    f.warn_unknown(&known, "response");
    let info = app.engine.info.clone();
    check_model(&f, &info.name)?;
    check_unsupported(&f)?;
    if f.boolean("stream")?.unwrap_or(false) {
        return Err(f.bad(
            "stream",
            "streaming is not supported on /v1/responses; stream with /v1/chat/completions",
        ));
    }
    if f.get("previous_response_id").is_some() {
        return Err(f.bad(
            "previous_response_id",
            "this server stores no responses: send the whole `input`",
        ));
    }
    if f.boolean("background")?.unwrap_or(false) {
        return Err(f.bad("background", "background responses are not supported"));
    }
    if let Some(format) = f.object("text")?.and_then(|t| t.get("format")) {
        if format.get("type").and_then(Value::as_str) != Some("text") {
            return Err(f.bad(
                "text",
                "only `text.format.type: text` is supported (no constrained decoding)",
            ));
        }
    }
    let tools_obj = chat_tools(&f)?;
    let tools = parse_tools(&Fields::new(&tools_obj))?;
    let messages = input_messages(&f)?;
    let mut chat = ChatInput {
        messages: parse_messages_value(&messages, std::path::Path::new("request"))
            .map_err(|e| ApiError::from_engine(&e, "input"))?,
        tools: tools.tools.clone(),
        budget: None,
        raw: messages,
    };
    chat.budget = request_budget(app, f.object("mm_processor_kwargs")?)?;
    let g = Generation::parse(&f, &app.sampling_defaults, &["max_output_tokens"])?;
    check_queue(app, 1)?;
    let defaults = app.sampling_defaults;
    let task = |c: &PreparedChat| -> Result<Task, ApiError> {
        Ok(Task::Generate(g.params(
            &info,
            &defaults,
            c.prompt_tokens,
            "input",
        )?))
    };
    let opts = |i: usize| g.options(i, None, &info);
    let wait = submit_chat(app, &chat, 1, task, opts, false);
    let (submitted, _) = tokio::time::timeout(app.limits.request_timeout, wait)
        .await
        .map_err(|_| ApiError::timeout(app.limits.request_timeout))??;
    let outs = finished(submitted)?;
    let base = ReplyBase::new("resp", &info.name, &info.tokenizer, &info.eos_token_ids, &g);
    Ok(Json(response_json(&f, &base, &g, &outs, tools.parse)?).into_response())
}

/// The Responses API's object for a finished generation: a `message` item (when there is text or
/// no call), a `function_call` item per tool call, and `usage` in its own names.
fn response_json(
    f: &Fields<'_>,
    base: &ReplyBase,
    g: &Generation,
    outs: &[crate::engine::EngineOutput],
    parse_tools: bool,
) -> Result<Value, ApiError> {
    let gen = generation_of(&outs[0])?;
    let text = base.rule.text(&gen.tokens, &gen.finish)?;
    let mut output = Vec::new();
    let (content, calls) = match extract(&text).filter(|_| parse_tools) {
        Some(e) => (e.content.unwrap_or_default(), e.calls),
        None => (text, Vec::new()),
    };
    if !content.is_empty() || calls.is_empty() {
        output.push(json!({
            "type": "message",
            "id": format!("msg_{:032x}", crate::server::rand_u128()),
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": content, "annotations": []}],
        }));
    }
    for c in &calls {
        output.push(json!({
            "type": "function_call",
            "id": format!("fc_{:032x}", crate::server::rand_u128()),
            "call_id": c.id,
            "name": c.name,
            "arguments": c.arguments,
            "status": "completed",
        }));
    }
    let usage = ReplyBase::usage(outs, gen.tokens.len());
    let incomplete = gen.finish == FinishReason::Length;
    Ok(json!({
        "id": base.id,
        "object": "response",
        "created_at": base.created,
        "status": if incomplete { "incomplete" } else { "completed" },
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "error": null,
        "model": base.model,
        "output": output,
        "instructions": f.get("instructions"),
        "max_output_tokens": g.max_tokens.as_ref().map(|m| m.1),
        "temperature": g.sampling.temperature,
        "top_p": g.sampling.top_p,
        "tools": f.get("tools").cloned().unwrap_or(json!([])),
        "tool_choice": f.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": null,
        "store": false,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": f.get("metadata").cloned().unwrap_or(json!({})),
        "user": f.get("user"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }))
}

/// The Responses API's tools (`{"type": "function", "name", "description", "parameters"}`) as chat
/// tools, with `tool_choice`.
fn chat_tools(f: &Fields<'_>) -> Result<Map<String, Value>, ApiError> {
    let mut out = Map::new();
    if let Some(tools) = f.array("tools")? {
        let converted = tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let at = format!("tools[{i}]");
                let obj = t
                    .as_object()
                    .ok_or_else(|| ApiError::bad(&at, format!("`{at}` must be an object")))?;
                if obj.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(ApiError::bad(
                        format!("{at}.type"),
                        "only `function` tools are supported (no built-in tools)",
                    ));
                }
                let mut function = obj.clone();
                function.remove("type");
                Ok(json!({"type": "function", "function": function}))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        out.insert("tools".into(), Value::Array(converted));
    }
    if let Some(choice) = f.get("tool_choice") {
        out.insert("tool_choice".into(), choice.clone());
    }
    Ok(out)
}

/// `instructions` and `input` as chat messages (JSON, in the chat API's form).
fn input_messages(f: &Fields<'_>) -> Result<Value, ApiError> {
    let mut messages = Vec::new();
    if let Some(i) = f.string("instructions")? {
        messages.push(json!({"role": "system", "content": i}));
    }
    match f.get("input") {
        None => return Err(f.bad("input", "`input` is required")),
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                messages.push(input_item(item, &format!("input[{i}]"))?);
            }
        }
        Some(_) => return Err(f.bad("input", "`input` must be a string or an array of items")),
    }
    Ok(Value::Array(messages))
}

/// One input item as a chat message.
fn input_item(item: &Value, at: &str) -> Result<Value, ApiError> {
    let obj = item
        .as_object()
        .ok_or_else(|| ApiError::bad(at, format!("`{at}` must be an object")))?;
    let f = Fields::nested(obj, at);
    match f.string("type")?.unwrap_or("message") {
        "message" => {
            let role = match f.string("role")? {
                Some("developer") => "system",
                Some(r) => r,
                None => return Err(f.bad("role", format!("`{at}.role` is required"))),
            };
            let content = match f.get("content") {
                Some(Value::String(s)) => json!(s),
                Some(Value::Array(parts)) => Value::Array(
                    parts
                        .iter()
                        .enumerate()
                        .map(|(j, p)| input_part(p, &format!("{at}.content[{j}]")))
                        .collect::<Result<_, _>>()?,
                ),
                _ => {
                    return Err(f.bad(
                        "content",
                        format!("`{at}.content` must be a string or an array of parts"),
                    ))
                }
            };
            Ok(json!({"role": role, "content": content}))
        }
        "function_call" => Ok(json!({"role": "assistant", "content": null, "tool_calls": [{
            "type": "function",
            "function": {"name": f.string("name")?.unwrap_or_default(), "arguments": f.string("arguments")?.unwrap_or("{}")},
        }]})),
        "function_call_output" => {
            Ok(json!({"role": "tool", "content": f.string("output")?.unwrap_or_default()}))
        }
        other => Err(f.bad(
            "type",
            format!(
                "input items of type {} are not supported",
                crate::limits::excerpt(other)
            ),
        )),
    }
}

/// One content part of an input message, as a chat content part.
fn input_part(part: &Value, at: &str) -> Result<Value, ApiError> {
    let obj = part
        .as_object()
        .ok_or_else(|| ApiError::bad(at, format!("`{at}` must be an object")))?;
    let f = Fields::nested(obj, at);
    match f.string("type")? {
        Some("input_text" | "output_text" | "text") => {
            Ok(json!({"type": "text", "text": f.string("text")?.unwrap_or_default()}))
        }
        Some("input_image") => {
            let url = f.string("image_url")?.ok_or_else(|| {
                f.bad(
                    "image_url",
                    format!("`{at}.image_url` is required (file ids are not supported)"),
                )
            })?;
            Ok(json!({"type": "image_url", "image_url": {"url": url}}))
        }
        Some(other) => Err(f.bad(
            "type",
            format!(
                "content parts of type {} are not supported",
                crate::limits::excerpt(other)
            ),
        )),
        None => Err(f.bad("type", format!("`{at}.type` is required"))),
    }
}
