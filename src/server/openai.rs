//! `POST /v1/chat/completions` and `GET /v1/models`, as OpenAI defines them (and vLLM extends them:
//! `top_k`, `return_tokens_as_token_ids`).
//!
//! A request is checked field by field before anything runs (a wrong type names the field; an unknown
//! field is ignored with a warning, as vLLM does); its images are fetched and decoded under the media
//! policy off the engine thread; the prompt length is checked against the context; then it joins the
//! engine's batch. Greedy decoding at temperature 0; seeded sampling otherwise.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::engine::{
    EngineOutput, FinishReason, GenerateParams, Outcome, RequestOptions, Sampling, Task, TokenLogprobs,
};
use crate::server::engine_loop::{Event, InflightGuard, PreparedChat, PreparedImage, PromptSource};
use crate::server::error::ApiError;
use crate::server::media::{image_tokens, SourceMemo};
use crate::server::AppState;
use crate::tokenize::chat::{json_kind, parse_messages_value, ChatMessage, ContentPart};
use crate::tokenize::Tokenizer;

/// The fields of a chat completion request this server reads; others are ignored with a warning.
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
    "return_tokens_as_token_ids",
    "metadata",
    "store",
    "parallel_tool_calls",
    "service_tier",
];

/// Most `top_logprobs`, as OpenAI allows.
const MAX_TOP_LOGPROBS: u64 = 20;

/// Sampling defaults when a request leaves a parameter out: the model's `generation_config.json`,
/// else OpenAI's (temperature 1, no top-p or top-k cut).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
}

impl SamplingDefaults {
    /// From a model directory's `generation_config.json`: `do_sample: false` means greedy; missing
    /// fields take OpenAI's defaults.
    pub fn from_model_dir(dir: &std::path::Path) -> Self {
        let path = dir.join("generation_config.json");
        let v: Value = crate::limits::read_capped(&path, crate::limits::MAX_CONFIG_BYTES)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        let f = |k: &str| v.get(k).and_then(Value::as_f64);
        let greedy = v.get("do_sample").and_then(Value::as_bool) == Some(false);
        SamplingDefaults {
            temperature: if greedy {
                0.0
            } else {
                f("temperature").unwrap_or(1.0) as f32
            },
            top_p: f("top_p").unwrap_or(1.0) as f32,
            top_k: f("top_k").map_or(0, |k| k.max(0.0) as usize),
        }
    }
}

/// A checked chat completion request.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Request field names of the images, in order (`messages[1].content[0].image_url.url`).
    pub image_params: Vec<String>,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub sampling: Sampling,
    /// `Some(n)`: return log-probs with `n` alternatives.
    pub logprobs: Option<usize>,
    pub token_ids_as_tokens: bool,
    pub stream: bool,
    pub include_usage: bool,
}

/// Reads `obj[key]` as an optional value of one JSON type, naming the field in errors.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// `obj[key]` through `read`, `None` when absent or null; a value `read` rejects is a 400 saying
    /// it `must be WHAT`.
    fn typed<'v, T>(
        &'v self,
        key: &str,
        what: &str,
        read: impl Fn(&'v Value) -> Option<T>,
    ) -> Result<Option<T>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => read(v)
                .map(Some)
                .ok_or_else(|| ApiError::bad(key, format!("`{key}` must be {what}, got {}", describe(v)))),
        }
    }

    fn uint(&self, key: &str) -> Result<Option<u64>, ApiError> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        self.typed(key, "an integer", Value::as_i64)
    }

    fn num(&self, key: &str) -> Result<Option<f64>, ApiError> {
        self.typed(key, "a number", Value::as_f64)
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.typed(key, "a boolean", Value::as_bool)
    }

    fn string(&self, key: &str) -> Result<Option<&str>, ApiError> {
        self.typed(key, "a string", Value::as_str)
    }
}

/// A value for an error message: numbers, booleans and short strings as they are, others by kind.
fn describe(v: &Value) -> String {
    match v {
        Value::Number(_) | Value::Bool(_) => v.to_string(),
        Value::String(s) if s.len() <= 40 => v.to_string(),
        other => json_kind(other).to_string(),
    }
}

/// Parses a request body as a JSON object.
pub fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            json_kind(&other)
        ))),
    }
}

/// Checks a chat completion request (everything but the images, which [`prepare_chat`] fetches).
pub fn parse_chat_request(
    obj: &Map<String, Value>,
    defaults: &SamplingDefaults,
    model_name: &str,
) -> Result<ChatRequest, ApiError> {
    for key in obj.keys().filter(|k| !KNOWN_FIELDS.contains(&k.as_str())) {
        tracing::warn!("ignoring unknown request field `{key}`");
    }
    let f = Fields(obj);
    check_model(&f, model_name)?;
    let messages = parse_request_messages(&f)?;
    let image_params = image_params(&messages);
    check_unsupported(&f)?;
    let max_tokens = parse_max_tokens(&f)?;
    let stop = parse_stop(&f)?;
    let sampling = parse_sampling(&f, defaults)?;
    let logprobs = parse_logprobs(&f)?;
    let (stream, include_usage) = parse_stream(&f)?;
    Ok(ChatRequest {
        messages,
        image_params,
        max_tokens,
        stop,
        sampling,
        logprobs,
        token_ids_as_tokens: f.boolean("return_tokens_as_token_ids")?.unwrap_or(false),
        stream,
        include_usage,
    })
}

/// `model`, when given, must name the served model.
fn check_model(f: &Fields<'_>, model_name: &str) -> Result<(), ApiError> {
    if let Some(model) = f.string("model")? {
        if model != model_name {
            return Err(ApiError::not_found(format!(
                "the model `{model}` does not exist; this server serves `{model_name}`"
            ))
            .with_code("model_not_found"));
        }
    }
    Ok(())
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

/// `max_completion_tokens`, else `max_tokens`: at least 1 when given.
fn parse_max_tokens(f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    let max_tokens = match (f.uint("max_completion_tokens")?, f.uint("max_tokens")?) {
        (Some(n), _) => Some(("max_completion_tokens", n)),
        (None, Some(n)) => Some(("max_tokens", n)),
        (None, None) => None,
    };
    if let Some((key, 0)) = max_tokens {
        return Err(ApiError::bad(key, format!("`{key}` must be at least 1")));
    }
    Ok(max_tokens.map(|(_, n)| n as usize))
}

/// `stop`: a string or an array of strings, none empty.
fn parse_stop(f: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let stop: Vec<String> = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::bad(format!("stop[{i}]"), "`stop` entries must be strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::bad(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    json_kind(other)
                ),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop", "`stop` strings must not be empty"));
    }
    Ok(stop)
}

/// `temperature` in [0, 2], `top_p` in (0, 1], `top_k` (≤ 0: no cut) and `seed`, over the defaults.
fn parse_sampling(f: &Fields<'_>, defaults: &SamplingDefaults) -> Result<Sampling, ApiError> {
    let temperature = f.num("temperature")?.map_or(defaults.temperature, |t| t as f32);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("`temperature` {temperature} is outside [0, 2]"),
        ));
    }
    let top_p = f.num("top_p")?.map_or(defaults.top_p, |p| p as f32);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("`top_p` {top_p} is outside (0, 1]"),
        ));
    }
    let top_k = match f.int("top_k")? {
        None => defaults.top_k,
        Some(k) if k <= 0 => 0, // -1 and 0 both mean no cut (vLLM uses -1)
        Some(k) => k as usize,
    };
    let seed = f.int("seed")?.map(|s| s as u64);
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        seed,
    })
}

/// `logprobs` and `top_logprobs` (at most [`MAX_TOP_LOGPROBS`], only with `logprobs: true`): the
/// number of alternatives to report, `None` without `logprobs`.
fn parse_logprobs(f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    let logprobs = f.boolean("logprobs")?.unwrap_or(false);
    let top = f.uint("top_logprobs")?;
    if top.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::bad(
            "top_logprobs",
            format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}"),
        ));
    }
    if top.is_some() && !logprobs {
        return Err(ApiError::bad(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    Ok(logprobs.then(|| top.unwrap_or(0) as usize))
}

/// `stream` and `stream_options.include_usage` (`stream_options` only with `stream: true`).
fn parse_stream(f: &Fields<'_>) -> Result<(bool, bool), ApiError> {
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::bad(
                    "stream_options",
                    "`stream_options` needs `stream: true`",
                ));
            }
            Fields(o)
                .boolean("include_usage")
                .map_err(|e| ApiError {
                    param: Some("stream_options.include_usage".into()),
                    ..e
                })?
                .unwrap_or(false)
        }
        Some(other) => {
            return Err(ApiError::bad(
                "stream_options",
                format!("`stream_options` must be an object, got {}", json_kind(other)),
            ))
        }
    };
    Ok((stream, include_usage))
}

/// Known fields this server does not implement: refused unless they ask for nothing.
fn check_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    if let Some(n) = f.uint("n")? {
        if n != 1 {
            return Err(ApiError::bad("n", "only `n: 1` is supported"));
        }
    }
    for key in ["presence_penalty", "frequency_penalty"] {
        if f.num(key)?.is_some_and(|x| x != 0.0) {
            return Err(ApiError::bad(key, format!("`{key}` is not supported (only 0)")));
        }
    }
    if f.num("repetition_penalty")?.is_some_and(|x| x != 1.0) {
        return Err(ApiError::bad(
            "repetition_penalty",
            "`repetition_penalty` is not supported (only 1)",
        ));
    }
    if f.get("logit_bias")
        .is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty()))
    {
        return Err(ApiError::bad("logit_bias", "`logit_bias` is not supported"));
    }
    if f.get("tools")
        .is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(ApiError::bad(
            "tools",
            "`tools` is not supported: describe the tools in the system prompt (as the GUI-Owl protocol does)",
        ));
    }
    if let Some(rf) = f.get("response_format") {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::bad(
                "response_format",
                "only `{\"type\": \"text\"}` is supported",
            ));
        }
    }
    Ok(())
}

/// The request field name of every image, in order.
fn image_params(messages: &[ChatMessage]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        for (j, part) in m.content.iter().enumerate() {
            if let ContentPart::Image(_) = part {
                out.push(format!("messages[{i}].content[{j}].image_url.url"));
            }
        }
    }
    out
}

/// Renders, tokenizes and fetches the images of a chat off the engine thread. With `use_memo`, an
/// image source seen recently is sent by hash only (the engine still holds its encoding). Images of
/// a client's request go through the media policy; `trusted` images are the server's own files
/// (an episode's screenshots).
pub async fn prepare_chat(
    app: &AppState,
    messages: &[ChatMessage],
    image_params: &[String],
    use_memo: bool,
    trusted: bool,
) -> Result<PreparedChat, ApiError> {
    let info = &app.engine.info;
    let (ids, sources) = info
        .renderer
        .ids(&info.tokenizer, messages, true)
        .map_err(|e| ApiError::from_engine(&e, "messages"))?;
    let mut images = Vec::with_capacity(sources.len());
    let mut prompt_tokens = ids.len() - sources.len();
    for (k, src) in sources.iter().enumerate() {
        let param = image_params.get(k).map_or("messages", String::as_str);
        let (image, tokens) = prepare_image(app, src, param, use_memo, trusted).await?;
        prompt_tokens += tokens;
        images.push(image);
    }
    Ok(PreparedChat {
        ids,
        images,
        prompt_tokens,
    })
}

/// One image of a chat: by hash when the memo knows its source, else fetched and decoded.
async fn prepare_image(
    app: &AppState,
    src: &str,
    param: &str,
    use_memo: bool,
    trusted: bool,
) -> Result<(PreparedImage, usize), ApiError> {
    let key = if trusted {
        SourceMemo::file_key(std::path::Path::new(src))
    } else {
        SourceMemo::url_key(src)
    };
    if use_memo {
        if let Some((hash, tokens)) = key.and_then(|k| app.memo.get(k)) {
            return Ok((PreparedImage { hash, image: None }, tokens));
        }
    }
    let (data, name) = if trusted {
        let data = tokio::fs::read(src)
            .await
            .map_err(|e| ApiError::internal(format!("reading {src}: {e}")))?;
        (data, src.to_string())
    } else {
        app.media.fetch(src, param).await?
    };
    let (media, param_owned) = (app.media.clone(), param.to_string());
    let decoded = tokio::task::spawn_blocking(move || media.decode(&data, &name, &param_owned))
        .await
        .map_err(|e| ApiError::internal(format!("decoding an image: {e}")))??;
    let tokens = image_tokens(&app.engine.info.preprocess, &decoded.image, param)?;
    if let Some(k) = key {
        app.memo.insert(k, decoded.hash, tokens);
    }
    Ok((
        PreparedImage {
            hash: decoded.hash,
            image: Some(decoded.image),
        },
        tokens,
    ))
}

/// Submits a prepared chat and waits for its first event; re-prepares it with pixels once if the
/// engine no longer holds an image sent by hash.
pub async fn submit_chat(
    app: &AppState,
    messages: &[ChatMessage],
    image_params: &[String],
    task: impl Fn(&PreparedChat) -> Result<Task, ApiError>,
    opts: RequestOptions,
    stream: bool,
) -> Result<(Event, mpsc::UnboundedReceiver<Event>, InflightGuard, usize), ApiError> {
    for use_memo in [true, false] {
        let chat = prepare_chat(app, messages, image_params, use_memo, false).await?;
        let prompt_tokens = chat.prompt_tokens;
        let task = task(&chat)?;
        let (mut rx, guard) = app
            .engine
            .submit(PromptSource::Chat(chat), task, opts.clone(), stream)
            .map_err(|_| ApiError::unavailable("the engine is not running"))?;
        match rx.recv().await {
            Some(Event::MissingImages(hashes)) if use_memo => {
                hashes.iter().for_each(|h| app.memo.forget(*h));
            }
            Some(Event::Failed(e)) => return Err(ApiError::from_engine(&e, "messages")),
            Some(first) => return Ok((first, rx, guard, prompt_tokens)),
            None => return Err(ApiError::unavailable("the engine stopped")),
        }
    }
    Err(ApiError::internal(
        "images left the vision cache twice while preparing the request",
    ))
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    match chat(&app, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat(app: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    let info = app.engine.info.clone();
    let req = parse_chat_request(&obj, &app.sampling_defaults, &info.name)?;
    if app.engine.inflight() >= app.limits.max_queue {
        return Err(ApiError::too_many(format!(
            "the server's queue is full ({} requests in flight); retry later",
            app.limits.max_queue
        )));
    }
    let max_context = info.max_context;
    let requested = req.max_tokens;
    let task = |chat: &PreparedChat| -> Result<Task, ApiError> {
        let room = max_context.saturating_sub(chat.prompt_tokens);
        if room == 0 {
            return Err(ApiError::bad(
                "messages",
                format!(
                    "the prompt has {} tokens and leaves no room to generate in the model's context of \
                     {max_context} tokens (over by {})",
                    chat.prompt_tokens,
                    chat.prompt_tokens + 1 - max_context
                ),
            )
            .with_code("context_length_exceeded"));
        }
        let max_tokens = requested.unwrap_or(room);
        if max_tokens > room {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "max_tokens {max_tokens} with a prompt of {} tokens exceeds the model's context of \
                     {max_context} by {}",
                    chat.prompt_tokens,
                    max_tokens - room
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Ok(Task::Generate(GenerateParams {
            max_tokens,
            eos_token_ids: info.eos_token_ids.clone(),
            stop_strings: req.stop.clone(),
        }))
    };
    let opts = RequestOptions {
        sampling: req.sampling,
        logprobs: req.logprobs,
        adapter: info.adapter.unwrap_or_default(),
        ..RequestOptions::default()
    };
    let wait = submit_chat(app, &req.messages, &req.image_params, task, opts, req.stream);
    let (first, rx, guard, _) = tokio::time::timeout(app.limits.request_timeout, wait)
        .await
        .map_err(|_| timeout(app.limits.request_timeout))??;
    let reply = Reply::new(&info.name, &info.tokenizer, &req);
    if req.stream {
        return Ok(stream_response(app.clone(), reply, first, rx, guard));
    }
    let out = match first {
        Event::Done(out) => *out,
        Event::Failed(e) => return Err(ApiError::from_engine(&e, "messages")),
        _ => {
            return Err(ApiError::internal(
                "unexpected event for a request without streaming",
            ));
        }
    };
    drop(guard);
    Ok(Json(reply.completion(&out)?).into_response())
}

fn timeout(d: Duration) -> ApiError {
    ApiError::invalid(format!(
        "the request took longer than the server's limit of {d:?}"
    ))
    .with_status(axum::http::StatusCode::REQUEST_TIMEOUT, "timeout_error")
    .with_code("request_timeout")
}

/// Builds response bodies and stream chunks for one request.
struct Reply {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    stop: Vec<String>,
    logprobs: bool,
    token_ids_as_tokens: bool,
    include_usage: bool,
}

impl Reply {
    fn new(model: &str, tokenizer: &Arc<Tokenizer>, req: &ChatRequest) -> Self {
        Reply {
            id: format!("chatcmpl-{:016x}", rand_id()),
            created: unix_now(),
            model: model.to_string(),
            tokenizer: tokenizer.clone(),
            stop: req.stop.clone(),
            logprobs: req.logprobs.is_some(),
            token_ids_as_tokens: req.token_ids_as_tokens,
            include_usage: req.include_usage,
        }
    }

    /// The output text of `tokens`: special tokens left out, cut before the stop string that ended
    /// generation.
    fn text(&self, tokens: &[u32], finish: Option<&FinishReason>) -> Result<String, ApiError> {
        let mut text = self
            .tokenizer
            .decode_text(tokens)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if let Some(FinishReason::Stop(s)) = finish {
            if let Some(at) = text.find(s.as_str()) {
                text.truncate(at);
            }
        }
        Ok(text)
    }

    fn logprob_entry(&self, token: u32, logprob: f32) -> Value {
        let bytes = self.tokenizer.token_bytes(token);
        let text = if self.token_ids_as_tokens {
            format!("token_id:{token}")
        } else {
            String::from_utf8_lossy(&bytes).into_owned()
        };
        json!({"token": text, "logprob": logprob, "bytes": bytes})
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

    fn usage(out: &EngineOutput, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": out.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.reused_tokens},
        })
    }

    /// The whole response of a request without streaming.
    fn completion(&self, out: &EngineOutput) -> Result<Value, ApiError> {
        let g = match &out.outcome {
            Outcome::Generation(g) => g,
            Outcome::Failed(e) => {
                return Err(ApiError::from_engine(
                    &crate::Error::InvalidRequest(e.clone()),
                    "messages",
                ))
            }
            other => return Err(ApiError::internal(format!("unexpected outcome {other:?}"))),
        };
        Ok(json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": self.text(&g.tokens, Some(&g.finish))?},
                "logprobs": self.logprobs_json(&out.logprobs),
                "finish_reason": finish_reason(&g.finish),
            }],
            "usage": Self::usage(out, g.tokens.len()),
        }))
    }

    fn chunk(&self, delta: Value, logprobs: Value, finish: Option<&str>) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

fn finish_reason(f: &FinishReason) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::Stop(_) => "stop",
        FinishReason::Length => "length",
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A random id for responses.
pub fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// The incremental text of a stream: what has been sent, and how much must be held back.
struct Detokenizer {
    tokens: Vec<u32>,
    /// Bytes of the text already sent.
    sent: usize,
    /// Longest stop string, in bytes: that much minus one is held back until generation ends.
    hold: usize,
}

impl Detokenizer {
    /// The new text after `tokens`: everything decoded so far past what was sent, except a trailing
    /// incomplete character and a tail that could still become a stop string.
    fn push(&mut self, reply: &Reply, tokens: &[u32]) -> Result<String, ApiError> {
        self.tokens.extend_from_slice(tokens);
        let text = reply.text(&self.tokens, None)?;
        let mut end = text.trim_end_matches('\u{FFFD}').len();
        end = end.saturating_sub(self.hold.saturating_sub(1));
        Ok(self.take(&text, end))
    }

    /// The rest of the text once generation ended.
    fn finish(&mut self, reply: &Reply, finish: &FinishReason) -> Result<String, ApiError> {
        let text = reply.text(&self.tokens, Some(finish))?;
        let end = text.len();
        Ok(self.take(&text, end))
    }

    fn take(&mut self, text: &str, end: usize) -> String {
        let mut end = end.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut start = self.sent.min(end);
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        if end <= self.sent {
            return String::new();
        }
        self.sent = end;
        text[start..end].to_string()
    }
}

/// The server-sent events of a streamed request: a role chunk, content chunks, a finish chunk, the
/// usage chunk when asked for, then `[DONE]`.
fn stream_response(
    app: Arc<AppState>,
    reply: Reply,
    first: Event,
    rx: mpsc::UnboundedReceiver<Event>,
    guard: InflightGuard,
) -> Response {
    let hold = reply.stop.iter().map(String::len).max().unwrap_or(0);
    let state = StreamState {
        reply,
        detok: Detokenizer {
            tokens: Vec::new(),
            sent: 0,
            hold,
        },
        first: Some(first),
        rx,
        queue: std::collections::VecDeque::new(),
        done: false,
        deadline: tokio::time::Instant::now() + app.limits.request_timeout,
        limit: app.limits.request_timeout,
        _guard: guard,
    };
    let role = state
        .reply
        .chunk(json!({"role": "assistant", "content": ""}), Value::Null, None);
    let mut state = state;
    state.queue.push_back(role.to_string());
    let s = events(state);
    Sse::new(s)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

struct StreamState {
    reply: Reply,
    detok: Detokenizer,
    first: Option<Event>,
    rx: mpsc::UnboundedReceiver<Event>,
    /// Chunks ready to send.
    queue: std::collections::VecDeque<String>,
    done: bool,
    deadline: tokio::time::Instant,
    limit: Duration,
    _guard: InflightGuard,
}

impl StreamState {
    /// Turns one engine event into chunks; `false` when the stream is over.
    fn absorb(&mut self, ev: Event) -> bool {
        let r = &self.reply;
        match ev {
            Event::Tokens { tokens, logprobs } => match self.detok.push(r, &tokens) {
                Ok(text) => {
                    let lp = r.logprobs_json(&logprobs);
                    if !text.is_empty() || !lp.is_null() {
                        self.queue
                            .push_back(r.chunk(json!({"content": text}), lp, None).to_string());
                    }
                    true
                }
                Err(e) => self.error(e),
            },
            Event::Done(out) => {
                let Outcome::Generation(g) = &out.outcome else {
                    let msg = match &out.outcome {
                        Outcome::Failed(m) => m.clone(),
                        other => format!("unexpected outcome {other:?}"),
                    };
                    return self.error(ApiError::bad("messages", msg));
                };
                match self.detok.finish(r, &g.finish) {
                    Ok(rest) => {
                        if !rest.is_empty() {
                            self.queue
                                .push_back(r.chunk(json!({"content": rest}), Value::Null, None).to_string());
                        }
                    }
                    Err(e) => return self.error(e),
                }
                self.queue.push_back(
                    r.chunk(json!({}), Value::Null, Some(finish_reason(&g.finish)))
                        .to_string(),
                );
                if r.include_usage {
                    let usage = json!({
                        "id": r.id, "object": "chat.completion.chunk", "created": r.created,
                        "model": r.model, "choices": [],
                        "usage": Reply::usage(&out, g.tokens.len()),
                    });
                    self.queue.push_back(usage.to_string());
                }
                self.queue.push_back("[DONE]".to_string());
                false
            }
            Event::Failed(e) => self.error(ApiError::from_engine(&e, "messages")),
            Event::MissingImages(_) => self.error(ApiError::internal("an image left the vision cache")),
        }
    }

    fn error(&mut self, e: ApiError) -> bool {
        self.queue.push_back(e.body().to_string());
        self.queue.push_back("[DONE]".to_string());
        false
    }
}

fn events(state: StreamState) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queue.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            let ev = match st.first.take() {
                Some(ev) => Some(ev),
                None => match tokio::time::timeout_at(st.deadline, st.rx.recv()).await {
                    Ok(ev) => ev,
                    Err(_) => {
                        st.done = !st.error(timeout(st.limit));
                        continue;
                    }
                },
            };
            st.done = match ev {
                Some(ev) => !st.absorb(ev),
                None => !st.error(ApiError::unavailable("the engine stopped")),
            };
        }
    })
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
            "max_model_len": info.max_context,
        }]
    }))
}
