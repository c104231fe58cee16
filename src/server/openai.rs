//! `POST /v1/chat/completions` and `GET /v1/models`, as OpenAI defines them and vLLM extends them
//! (`top_k`, `repetition_penalty`, `stop_token_ids`, `skip_special_tokens`, `mm_processor_kwargs`,
//! `return_tokens_as_token_ids`, ...).
//!
//! A request is checked field by field before anything runs (a wrong type names the field; an unknown
//! field is ignored with a warning, as vLLM does); its images are fetched and decoded under the media
//! policy off the engine thread; the prompt length is checked against the context; then its `n`
//! choices join the engine's batch together and share the prompt's KV blocks. Greedy decoding at
//! temperature 0; seeded sampling otherwise; tool calls parsed as vLLM's hermes parser does.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::engine::{EngineOutput, Task, TokenLogprobs};
use crate::server::engine_loop::PreparedChat;
use crate::server::error::ApiError;
use crate::server::fields::{json_object, Fields};
pub use crate::server::params::SamplingDefaults;
use crate::server::params::{check_unsupported, Generation, GENERATION_FIELDS};
pub use crate::server::prepare::check_model;
use crate::server::prepare::{check_queue, request_budget, submit_chat, ChatInput};
use crate::server::reply::{finish_reason, finished, generation_of, respond, ReplyBase};
use crate::server::stream::{sse, Chunks};
use crate::server::text::Detokenizer;
use crate::server::tools::{extract, parse_tools, Delta, ToolRequest, ToolStream};
use crate::server::AppState;
use crate::tokenize::chat::{parse_messages_value, ChatMessage};
use crate::tokenize::Tokenizer;

/// The fields of a chat completion request this endpoint reads besides the generation parameters;
/// others are ignored with a warning.
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "logprobs",
    "top_logprobs",
    "return_tokens_as_token_ids",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "mm_processor_kwargs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "echo",
    "chat_template",
    "prompt_logprobs",
];

/// Most `top_logprobs`, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// A checked chat completion request.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub chat: ChatInput,
    pub generation: Generation,
    pub tools: ToolRequest,
    /// `Some(n)`: return log-probs with `n` alternatives.
    pub logprobs: Option<usize>,
    pub token_ids_as_tokens: bool,
    /// `mm_processor_kwargs`, resolved against the server's pixel budget by the handler.
    pub mm_processor_kwargs: Option<Map<String, Value>>,
}

/// Checks a chat completion request (everything but the images, which [`submit_chat`] fetches, and
/// the pixel budgets, which need the server's).
pub fn parse_chat_request(
    obj: &Map<String, Value>,
    defaults: &SamplingDefaults,
    model_name: &str,
) -> Result<ChatRequest, ApiError> {
    let f = Fields::new(obj);
    let known: Vec<&str> = CHAT_FIELDS.iter().chain(GENERATION_FIELDS).copied().collect();
    f.warn_unknown(&known, "request");
    check_model(&f, model_name)?;
    let messages = parse_request_messages(&f)?;
    check_unsupported(&f)?;
    check_chat_unsupported(&f)?;
    let tools = parse_tools(&f)?;
    let generation = Generation::parse(&f, defaults, &["max_completion_tokens", "max_tokens"])?;
    Ok(ChatRequest {
        chat: ChatInput {
            messages,
            tools: tools.tools.clone(),
            budget: None,
            raw: f.get("messages").cloned().unwrap_or(Value::Null),
        },
        generation,
        tools,
        logprobs: parse_logprobs(&f)?,
        token_ids_as_tokens: f.boolean("return_tokens_as_token_ids")?.unwrap_or(false),
        mm_processor_kwargs: f.object("mm_processor_kwargs")?.cloned(),
    })
}

/// `messages`: required and non-empty.
fn parse_request_messages(f: &Fields<'_>) -> Result<Vec<ChatMessage>, ApiError> {
    let messages_value = f
        .get("messages")
        .ok_or_else(|| ApiError::bad("messages", "`messages` is required"))?;
    let messages = parse_messages_value(messages_value, std::path::Path::new("request"))
        .map_err(|e| ApiError::from_engine(&e, "messages"))?;
    if messages.is_empty() {
        return Err(ApiError::bad("messages", "`messages` must not be empty"));
    }
    Ok(messages)
}

/// The chat-only fields recall reads but does not implement, refused unless neutral.
fn check_chat_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    if f.boolean("add_generation_prompt")? == Some(false) {
        return Err(f.bad(
            "add_generation_prompt",
            "`add_generation_prompt: false` is not supported (the prompt always ends with the assistant turn)",
        ));
    }
    for key in ["continue_final_message", "echo"] {
        if f.boolean(key)?.unwrap_or(false) {
            return Err(f.bad(key, format!("`{key}` is not supported for chat completions")));
        }
    }
    if f.get("chat_template").is_some() {
        return Err(f.bad(
            "chat_template",
            "a request's own `chat_template` is not supported: recall renders the model's template natively",
        ));
    }
    if f.get("prompt_logprobs").is_some() {
        return Err(f.bad(
            "prompt_logprobs",
            "`prompt_logprobs` is not supported for chat; use /v1/completions with `echo` and `logprobs`",
        ));
    }
    Ok(())
}

/// `logprobs` and `top_logprobs` (at most [`MAX_TOP_LOGPROBS`], only with `logprobs: true`): the
/// number of alternatives to report, `None` without `logprobs`.
fn parse_logprobs(f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    let logprobs = f.boolean("logprobs")?.unwrap_or(false);
    let top = f.uint("top_logprobs")?;
    if top.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(f.bad(
            "top_logprobs",
            format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}"),
        ));
    }
    if top.is_some_and(|n| n > 0) && !logprobs {
        return Err(f.bad("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
    }
    Ok(logprobs.then(|| top.unwrap_or(0) as usize))
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    respond(chat(&app, &body).await)
}

async fn chat(app: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    if super::episode_chat::requested_episode(&obj).is_some() {
        return super::episode_chat::chat_step(app, &obj).await;
    }
    let info = app.engine.info.clone();
    let mut req = parse_chat_request(&obj, &app.sampling_defaults, &info.name)?;
    req.chat.budget = request_budget(app, req.mm_processor_kwargs.as_ref())?;
    let g = &req.generation;
    check_queue(app, g.n)?;
    let defaults = app.sampling_defaults;
    let task = |chat: &PreparedChat| -> Result<Task, ApiError> {
        Ok(Task::Generate(g.params(
            &info,
            &defaults,
            chat.prompt_tokens,
            "messages",
        )?))
    };
    let opts = |i: usize| g.options(i, req.logprobs, &info);
    let wait = submit_chat(app, &req.chat, g.n, task, opts, g.stream);
    let (submitted, _) = tokio::time::timeout(app.limits.request_timeout, wait)
        .await
        .map_err(|_| ApiError::timeout(app.limits.request_timeout))??;
    let reply = ChatReply::new(&info.name, &info.tokenizer, &info.eos_token_ids, &req);
    if g.stream {
        let chunks = ChatChunks::new(reply, submitted.len());
        return Ok(sse(app, submitted, chunks));
    }
    let outs = finished(submitted)?;
    Ok(Json(reply.completion(&outs)?).into_response())
}

/// Builds a chat request's response bodies and stream chunks.
struct ChatReply {
    base: ReplyBase,
    logprobs: bool,
    parse_tools: bool,
}

impl ChatReply {
    fn new(model: &str, tokenizer: &Arc<Tokenizer>, eos: &[u32], req: &ChatRequest) -> Self {
        let mut base = ReplyBase::new("chatcmpl", model, tokenizer, eos, &req.generation);
        base.token_ids_as_tokens = req.token_ids_as_tokens;
        ChatReply {
            base,
            logprobs: req.logprobs.is_some(),
            parse_tools: req.tools.parse,
        }
    }

    fn logprob_entry(&self, token: u32, logprob: f32) -> Value {
        let bytes = self.base.tokenizer.token_bytes(token);
        json!({"token": self.base.token_name(token), "logprob": logprob, "bytes": bytes})
    }

    fn logprobs_json(&self, lps: &[TokenLogprobs]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let content: Vec<Value> = lps
            .iter()
            .map(|lp| {
                let mut e = self.logprob_entry(lp.token, lp.logprob);
                e["top_logprobs"] = lp.top.iter().map(|(t, l)| self.logprob_entry(*t, *l)).collect();
                e
            })
            .collect();
        json!({ "content": content })
    }

    /// One choice of a response without streaming: the message (with its tool calls), log-probs and
    /// finish reason.
    fn choice(&self, i: usize, out: &EngineOutput) -> Result<Value, ApiError> {
        let g = generation_of(out)?;
        let text = self.base.rule.text(&g.tokens, &g.finish)?;
        let mut message = json!({"role": "assistant", "content": text});
        let mut finish = finish_reason(&g.finish);
        if let Some(e) = extract(&text).filter(|_| self.parse_tools) {
            message["content"] = json!(e.content);
            message["tool_calls"] = e.calls.iter().map(|c| c.to_json(None)).collect();
            finish = "tool_calls";
        }
        Ok(json!({
            "index": i,
            "message": message,
            "logprobs": self.logprobs_json(&out.logprobs),
            "finish_reason": finish,
        }))
    }

    /// The whole response of a request without streaming.
    fn completion(&self, outs: &[EngineOutput]) -> Result<Value, ApiError> {
        let choices = outs
            .iter()
            .enumerate()
            .map(|(i, o)| self.choice(i, o))
            .collect::<Result<Vec<_>, _>>()?;
        let tokens: usize = outs
            .iter()
            .map(|o| generation_of(o).map(|g| g.tokens.len()))
            .sum::<Result<_, _>>()?;
        let b = &self.base;
        Ok(json!({
            "id": b.id,
            "object": "chat.completion",
            "created": b.created,
            "model": b.model,
            "choices": choices,
            "usage": ReplyBase::usage(outs, tokens),
        }))
    }

    fn chunk(&self, i: usize, delta: Value, logprobs: Value, finish: Option<&str>) -> Value {
        let b = &self.base;
        let mut c = json!({
            "id": b.id,
            "object": "chat.completion.chunk",
            "created": b.created,
            "model": b.model,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if b.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

/// The chunks of a streamed chat request: per choice, its text as it is detokenized, its content
/// and tool calls as [`ToolStream`] allows them, then a finish chunk.
struct ChatChunks {
    reply: ChatReply,
    detok: Vec<Detokenizer>,
    tools: Vec<ToolStream>,
    outs: Vec<Option<EngineOutput>>,
}

impl ChatChunks {
    fn new(reply: ChatReply, n: usize) -> Self {
        ChatChunks {
            detok: (0..n)
                .map(|_| Detokenizer::new(reply.base.rule.clone()))
                .collect(),
            tools: (0..n).map(|_| ToolStream::default()).collect(),
            outs: vec![None; n],
            reply,
        }
    }

    /// Chunks for new text of choice `i` (and the log-probs of its tokens).
    fn text_chunks(&mut self, i: usize, text: &str, logprobs: Value, last: bool) -> Vec<Value> {
        let deltas = if self.reply.parse_tools {
            let mut d = self.tools[i].push(text);
            if last {
                d.extend(self.tools[i].finish());
            }
            d
        } else if text.is_empty() {
            Vec::new()
        } else {
            vec![Delta::Content(text.to_string())]
        };
        let mut out = Vec::new();
        let mut logprobs = Some(logprobs).filter(|l| !l.is_null());
        for d in deltas {
            let delta = match d {
                Delta::Content(c) => json!({"content": c}),
                Delta::Call(k, call) => json!({"tool_calls": [call.to_json(Some(k))]}),
            };
            out.push(
                self.reply
                    .chunk(i, delta, logprobs.take().unwrap_or(Value::Null), None),
            );
        }
        if let Some(lp) = logprobs {
            out.push(self.reply.chunk(i, json!({"content": ""}), lp, None));
        }
        out
    }
}

impl Chunks for ChatChunks {
    fn start(&mut self) -> Vec<Value> {
        (0..self.detok.len())
            .map(|i| {
                self.reply
                    .chunk(i, json!({"role": "assistant", "content": ""}), Value::Null, None)
            })
            .collect()
    }

    fn tokens(
        &mut self,
        i: usize,
        tokens: &[u32],
        logprobs: &[TokenLogprobs],
    ) -> Result<Vec<Value>, ApiError> {
        let text = self.detok[i].push(tokens)?;
        let lp = self.reply.logprobs_json(logprobs);
        Ok(self.text_chunks(i, &text, lp, false))
    }

    fn done(&mut self, i: usize, out: &EngineOutput) -> Result<Vec<Value>, ApiError> {
        let g = generation_of(out)?;
        let rest = self.detok[i].finish(&g.finish)?;
        let mut chunks = self.text_chunks(i, &rest, Value::Null, true);
        let finish = if self.tools[i].called() {
            "tool_calls"
        } else {
            finish_reason(&g.finish)
        };
        chunks.push(self.reply.chunk(i, json!({}), Value::Null, Some(finish)));
        self.outs[i] = Some(out.clone());
        Ok(chunks)
    }

    fn end(&mut self) -> Vec<Value> {
        let b = &self.reply.base;
        if !b.include_usage {
            return Vec::new();
        }
        let outs: Vec<EngineOutput> = self.outs.iter().flatten().cloned().collect();
        let tokens = outs
            .iter()
            .filter_map(|o| generation_of(o).ok())
            .map(|g| g.tokens.len())
            .sum();
        vec![json!({
            "id": b.id, "object": "chat.completion.chunk", "created": b.created,
            "model": b.model, "choices": [],
            "usage": ReplyBase::usage(&outs, tokens),
        })]
    }
}

/// `GET /v1/models`.
pub async fn models(State(app): State<Arc<AppState>>) -> Json<Value> {
    let info = &app.engine.info;
    Json(json!({
        "object": "list",
        "data": [{
            "id": info.name,
            "object": "model",
            "created": app.started,
            "owned_by": "recall",
            "root": info.name,
            "parent": null,
            "max_model_len": info.max_context,
        }]
    }))
}
