//! `POST /v1/completions`: OpenAI's legacy text completions, as vLLM serves them. A prompt is text
//! (tokenized as it is, no template) or token ids; a request may hold several prompts (`prompt` an
//! array), each with `n` choices, indexed prompt-major. `echo` puts the prompt before the output;
//! `logprobs: k` gives the legacy log-prob object (`tokens`, `token_logprobs`, `top_logprobs` with up
//! to k + 1 entries, `text_offset`), over the prompt too with `echo` (its first token `null`), which
//! is how evaluation harnesses score a text (`echo: true, max_tokens: 0`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::engine::{EngineOutput, Prompt, RequestOptions, Segment, Task, TokenLogprobs};
use crate::server::engine_loop::{Event, ModelInfo, PromptSource};
use crate::server::error::ApiError;
use crate::server::fields::{json_object, Fields};
use crate::server::params::{check_unsupported, Generation, SamplingDefaults, GENERATION_FIELDS};
use crate::server::prepare::Submitted;
use crate::server::prepare::{check_model, check_queue};
use crate::server::reply::{finish_reason, finished, generation_of, respond, ReplyBase};
use crate::server::stream::{sse, Chunks};
use crate::server::text::Detokenizer;
use crate::server::AppState;

const COMPLETION_FIELDS: &[&str] = &[
    "prompt",
    "suffix",
    "echo",
    "logprobs",
    "add_special_tokens",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
];

/// Default `max_tokens` of a completion (OpenAI's and vLLM's).
const DEFAULT_MAX_TOKENS: usize = 16;

/// Most `logprobs` alternatives.
const MAX_LOGPROBS: u64 = 20;

/// One prompt of a completions request.
#[derive(Debug, Clone, PartialEq)]
pub struct TextPrompt {
    pub ids: Vec<u32>,
    /// The prompt's text as `echo` repeats it.
    pub text: String,
}

/// A checked completions request.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompts: Vec<TextPrompt>,
    pub generation: Generation,
    pub echo: bool,
    pub logprobs: Option<usize>,
    pub token_ids_as_tokens: bool,
}

/// Checks a completions request and tokenizes its prompts.
pub fn parse_completion_request(
    obj: &Map<String, Value>,
    defaults: &SamplingDefaults,
    info: &ModelInfo,
) -> Result<CompletionRequest, ApiError> {
    let f = Fields::new(obj);
    let known: Vec<&str> = COMPLETION_FIELDS
        .iter()
        .chain(GENERATION_FIELDS)
        .copied()
        .collect();
    f.warn_unknown(&known, "request");
    check_model(&f, &info.name)?;
    check_unsupported(&f)?;
    if f.get("suffix").is_some() {
        return Err(f.bad("suffix", "`suffix` is not supported (as in vLLM)"));
    }
    if f.get("prompt_logprobs").is_some() {
        return Err(f.bad(
            "prompt_logprobs",
            "use `echo: true` with `logprobs` for the prompt's log-probs",
        ));
    }
    let echo = f.boolean("echo")?.unwrap_or(false);
    let logprobs = f.uint("logprobs")?;
    if logprobs.is_some_and(|k| k > MAX_LOGPROBS) {
        return Err(f.bad("logprobs", format!("`logprobs` must be at most {MAX_LOGPROBS}")));
    }
    // `max_tokens: 0` asks for the prompt alone (with `echo`): read it before the common check.
    let zero = f.uint("max_tokens")? == Some(0);
    if zero && !echo {
        return Err(f.bad(
            "max_tokens",
            "`max_tokens` must be at least 1 (0 only with `echo: true`)",
        ));
    }
    let mut generation = if zero {
        let mut without = obj.clone();
        without.remove("max_tokens");
        Generation::parse(&Fields::new(&without), defaults, &[])?
    } else {
        Generation::parse(&f, defaults, &["max_tokens"])?
    };
    if generation.max_tokens.is_none() {
        generation.max_tokens = Some(("max_tokens".into(), if zero { 0 } else { DEFAULT_MAX_TOKENS }));
    }
    Ok(CompletionRequest {
        prompts: parse_prompts(&f, info)?,
        generation,
        echo,
        logprobs: logprobs.map(|k| k as usize),
        token_ids_as_tokens: f.boolean("return_tokens_as_token_ids")?.unwrap_or(false),
    })
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of arrays of ids.
fn parse_prompts(f: &Fields<'_>, info: &ModelInfo) -> Result<Vec<TextPrompt>, ApiError> {
    let shape = "`prompt` must be a string, an array of strings, an array of token ids or an array of arrays of token ids";
    let v = f
        .get("prompt")
        .ok_or_else(|| f.bad("prompt", "`prompt` is required"))?;
    let prompts = match v {
        Value::String(s) => vec![text_prompt(s, "prompt", info)?],
        Value::Array(a) if a.is_empty() => return Err(f.bad("prompt", "`prompt` must not be empty")),
        Value::Array(a) if a.iter().all(Value::is_string) => a
            .iter()
            .enumerate()
            .map(|(i, s)| text_prompt(s.as_str().unwrap_or(""), &format!("prompt[{i}]"), info))
            .collect::<Result<_, _>>()?,
        Value::Array(a) if a.iter().all(Value::is_number) => vec![id_prompt(a, "prompt", info)?],
        Value::Array(a) if a.iter().all(Value::is_array) => a
            .iter()
            .enumerate()
            .map(|(i, ids)| {
                id_prompt(
                    ids.as_array().map_or(&[][..], Vec::as_slice),
                    &format!("prompt[{i}]"),
                    info,
                )
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(f.bad("prompt", shape)),
    };
    Ok(prompts)
}

fn text_prompt(text: &str, param: &str, info: &ModelInfo) -> Result<TextPrompt, ApiError> {
    let ids = info
        .tokenizer
        .encode(text)
        .map_err(|e| ApiError::bad(param, e.to_string()))?;
    checked(ids, text.to_string(), param, info)
}

fn id_prompt(ids: &[Value], param: &str, info: &ModelInfo) -> Result<TextPrompt, ApiError> {
    let ids = ids
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| {
            ApiError::bad(
                param,
                format!("`{param}` must hold token ids (non-negative integers)"),
            )
        })?;
    let text = info
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::bad(param, e.to_string()))?;
    checked(ids, text, param, info)
}

/// A prompt of at least one token, every id in the model's vocabulary and none an image placeholder.
fn checked(ids: Vec<u32>, text: String, param: &str, info: &ModelInfo) -> Result<TextPrompt, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad(param, format!("`{param}` is empty")));
    }
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= info.vocab_size) {
        return Err(ApiError::bad(
            param,
            format!(
                "token id {bad} is outside the model's vocabulary of {}",
                info.vocab_size
            ),
        ));
    }
    let pads = [info.renderer.image_pad, info.tokenizer.token_id("<|video_pad|>")];
    if ids.iter().any(|t| pads.contains(&Some(*t))) {
        return Err(ApiError::bad(
            param,
            format!("`{param}` holds an image placeholder token; completions take text only (use chat completions for images)"),
        ));
    }
    Ok(TextPrompt { ids, text })
}

/// `POST /v1/completions`.
pub async fn completions(State(app): State<Arc<AppState>>, body: Bytes) -> Response {
    respond(complete(&app, &body).await)
}

async fn complete(app: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let obj = json_object(body)?;
    let info = app.engine.info.clone();
    let req = parse_completion_request(&obj, &app.sampling_defaults, &info)?;
    let g = &req.generation;
    let n = g.n;
    check_queue(
        app,
        req.prompts.len() * (n + usize::from(req.echo && req.logprobs.is_some())),
    )?;
    let run = async {
        let mut runs = Vec::with_capacity(req.prompts.len());
        for (p, prompt) in req.prompts.iter().enumerate() {
            runs.push(submit_prompt(app, &req, prompt, &format!("prompt[{p}]")).await?);
        }
        Ok::<_, ApiError>(runs)
    };
    let runs = tokio::time::timeout(app.limits.request_timeout, run)
        .await
        .map_err(|_| ApiError::timeout(app.limits.request_timeout))??;
    let mut base = ReplyBase::new("cmpl", &info.name, &info.tokenizer, &info.eos_token_ids, g);
    base.token_ids_as_tokens = req.token_ids_as_tokens;
    let reply = CompletionReply {
        base,
        req: req.clone(),
    };
    if g.stream {
        let mut submitted = Vec::new();
        let mut prompt_lps = Vec::new();
        for run in runs {
            prompt_lps.extend(std::iter::repeat_n(run.prompt_logprobs, n));
            submitted.extend(run.choices);
        }
        let chunks = CompletionChunks::new(reply, prompt_lps);
        return Ok(sse(app, submitted, chunks));
    }
    let mut choices = Vec::new();
    let mut all = Vec::new();
    for (p, run) in runs.into_iter().enumerate() {
        let outs = finished(run.choices)?;
        for (i, out) in outs.iter().enumerate() {
            choices.push(reply.choice(p * n + i, &req.prompts[p], out, run.prompt_logprobs.as_deref())?);
        }
        all.push(outs);
    }
    Ok(Json(reply.response(choices, &all)?).into_response())
}

/// One prompt's choices, and its prompt log-probs when `echo` and `logprobs` ask for them.
struct PromptRun {
    choices: Vec<Submitted>,
    prompt_logprobs: Option<Vec<TokenLogprobs>>,
}

/// Submits the choices of one prompt (the prompt log-probs first, so that the choices reuse its
/// K/V): `max_tokens: 0` runs a one-token generation whose output is dropped.
async fn submit_prompt(
    app: &AppState,
    req: &CompletionRequest,
    p: &TextPrompt,
    param: &str,
) -> Result<PromptRun, ApiError> {
    let info = &app.engine.info;
    let g = &req.generation;
    let prompt_logprobs = match req.logprobs.filter(|_| req.echo) {
        Some(k) if p.ids.len() > 1 => Some(score_prompt(app, &p.ids, k).await?),
        Some(_) => Some(Vec::new()),
        None => None,
    };
    let mut params = g.params(info, &app.sampling_defaults, p.ids.len(), param)?;
    let zero = params.max_tokens == 0;
    params.max_tokens = params.max_tokens.max(1);
    let mut choices = Vec::with_capacity(g.n);
    for i in 0..g.n {
        let opts = g.options(i, req.logprobs, info);
        let prompt = Prompt {
            segments: vec![Segment::Text(p.ids.clone())],
        };
        let (rx, guard) = app
            .engine
            .submit(
                PromptSource::Prompt(prompt),
                Task::Generate(params.clone()),
                opts,
                g.stream && !zero,
            )
            .map_err(|_| ApiError::unavailable("the engine is not running"))?;
        choices.push((rx, guard));
    }
    let mut out = Vec::with_capacity(choices.len());
    for (mut rx, guard) in choices {
        let first = rx
            .recv()
            .await
            .ok_or_else(|| ApiError::unavailable("the engine stopped"))?;
        let first = match first {
            Event::Failed(e) => return Err(ApiError::from_engine(&e, param)),
            Event::Done(mut done) if zero => {
                // The prompt alone: the generated token is not part of the answer.
                if let crate::engine::Outcome::Generation(gen) = &mut done.outcome {
                    gen.tokens.clear();
                    gen.finish = crate::engine::FinishReason::Length;
                }
                done.logprobs.clear();
                Event::Done(done)
            }
            other => other,
        };
        out.push(Submitted { first, rx, guard });
    }
    Ok(PromptRun {
        choices: out,
        prompt_logprobs,
    })
}

/// The log-probs (with `k` alternatives) of `ids[1..]`, each after the ids before it.
async fn score_prompt(app: &AppState, ids: &[u32], k: usize) -> Result<Vec<TokenLogprobs>, ApiError> {
    let prompt = Prompt {
        segments: vec![Segment::Text(ids[..1].to_vec())],
    };
    let task = Task::Score {
        target: ids[1..].to_vec(),
    };
    let opts = RequestOptions {
        logprobs: Some(k),
        ..RequestOptions::default()
    };
    let (mut rx, _guard) = app
        .engine
        .submit(PromptSource::Prompt(prompt), task, opts, false)
        .map_err(|_| ApiError::unavailable("the engine is not running"))?;
    match rx.recv().await {
        Some(Event::Done(out)) => match out.outcome {
            crate::engine::Outcome::Score(_) => Ok(out.logprobs),
            crate::engine::Outcome::Failed(e) => Err(ApiError::bad("prompt", e)),
            other => Err(ApiError::internal(format!("unexpected outcome {other:?}"))),
        },
        Some(Event::Failed(e)) => Err(ApiError::from_engine(&e, "prompt")),
        _ => Err(ApiError::unavailable("the engine stopped")),
    }
}

struct CompletionReply {
    base: ReplyBase,
    req: CompletionRequest,
}

impl CompletionReply {
    /// The legacy log-prob object of `entries` (`None`: the first prompt token, which has none),
    /// `offset` the text offset of the first.
    fn logprobs(&self, entries: &[Option<&TokenLogprobs>], offset: usize) -> Value {
        let (mut tokens, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut at = offset;
        for e in entries {
            let (name, lp, top) = match e {
                None => (String::new(), Value::Null, Value::Null),
                Some(e) => {
                    let mut top = Map::new();
                    top.insert(self.base.token_name(e.token), json!(e.logprob.max(-9999.0)));
                    for (t, l) in &e.top {
                        top.entry(self.base.token_name(*t))
                            .or_insert(json!(l.max(-9999.0)));
                    }
                    (
                        self.base.token_name(e.token),
                        json!(e.logprob.max(-9999.0)),
                        Value::Object(top),
                    )
                }
            };
            offsets.push(at);
            at += name.len();
            tokens.push(json!(name));
            lps.push(lp);
            tops.push(top);
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// The log-prob entries of a choice: the prompt's (with `echo`) then the output's.
    fn entries<'a>(
        &self,
        prompt: &TextPrompt,
        prompt_lps: Option<&'a [TokenLogprobs]>,
        out: &'a [TokenLogprobs],
    ) -> Vec<Option<&'a TokenLogprobs>> {
        let mut e = Vec::new();
        if let Some(p) = prompt_lps.filter(|_| self.req.echo) {
            e.push(None);
            e.extend(p.iter().map(Some));
            e.truncate(prompt.ids.len());
        }
        e.extend(out.iter().map(Some));
        e
    }

    fn choice(
        &self,
        index: usize,
        prompt: &TextPrompt,
        out: &EngineOutput,
        prompt_lps: Option<&[TokenLogprobs]>,
    ) -> Result<Value, ApiError> {
        let g = generation_of(out)?;
        let mut text = self.base.rule.text(&g.tokens, &g.finish)?;
        if self.req.echo {
            text.insert_str(0, &prompt.text);
        }
        let logprobs = match self.req.logprobs {
            Some(_) => {
                let first = self.entries(prompt, prompt_lps, &out.logprobs);
                let mut v = self.logprobs(&first, 0);
                if first.first().is_some_and(Option::is_none) {
                    // The first prompt token has no log-prob, and its text is its token's text.
                    v["tokens"][0] = json!(self.base.token_name(prompt.ids[0]));
                }
                v
            }
            None => Value::Null,
        };
        Ok(json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&g.finish),
            "stop_reason": null,
        }))
    }

    fn response(&self, choices: Vec<Value>, outs: &[Vec<EngineOutput>]) -> Result<Value, ApiError> {
        let (mut prompt, mut completion, mut cached) = (0, 0, 0);
        for per_prompt in outs {
            let u = ReplyBase::usage(per_prompt, 0);
            prompt += u["prompt_tokens"].as_u64().unwrap_or(0);
            cached += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            for o in per_prompt {
                completion += generation_of(o)?.tokens.len() as u64;
            }
        }
        let b = &self.base;
        Ok(json!({
            "id": b.id,
            "object": "text_completion",
            "created": b.created,
            "model": b.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
        }))
    }

    fn chunk(&self, index: usize, text: String, logprobs: Value, finish: Option<&str>) -> Value {
        let b = &self.base;
        json!({
            "id": b.id, "object": "text_completion", "created": b.created, "model": b.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": null}],
            "usage": null,
        })
    }
}

/// The chunks of a streamed completions request: per choice the echo first, then its text.
struct CompletionChunks {
    reply: CompletionReply,
    detok: Vec<Detokenizer>,
    prompt_lps: Vec<Option<Vec<TokenLogprobs>>>,
    /// Bytes of each choice's text sent so far (for `text_offset`).
    offset: Vec<usize>,
    outs: Vec<Option<EngineOutput>>,
}

impl CompletionChunks {
    fn new(reply: CompletionReply, prompt_lps: Vec<Option<Vec<TokenLogprobs>>>) -> Self {
        let n = prompt_lps.len();
        CompletionChunks {
            detok: (0..n)
                .map(|_| Detokenizer::new(reply.base.rule.clone()))
                .collect(),
            prompt_lps,
            offset: vec![0; n],
            outs: vec![None; n],
            reply,
        }
    }

    fn prompt_of(&self, i: usize) -> &TextPrompt {
        &self.reply.req.prompts[i / self.reply.req.generation.n]
    }
}

impl Chunks for CompletionChunks {
    fn start(&mut self) -> Vec<Value> {
        if !self.reply.req.echo {
            return Vec::new();
        }
        (0..self.detok.len())
            .map(|i| {
                let p = self.prompt_of(i).clone();
                let lp = match self.reply.req.logprobs {
                    Some(_) => {
                        let e = self.reply.entries(&p, self.prompt_lps[i].as_deref(), &[]);
                        let mut v = self.reply.logprobs(&e, 0);
                        v["tokens"][0] = json!(self.reply.base.token_name(p.ids[0]));
                        v
                    }
                    None => Value::Null,
                };
                self.offset[i] = p.text.len();
                self.reply.chunk(i, p.text, lp, None)
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
        let lp = match self.reply.req.logprobs {
            Some(_) => {
                let e: Vec<Option<&TokenLogprobs>> = logprobs.iter().map(Some).collect();
                self.reply.logprobs(&e, self.offset[i])
            }
            None => Value::Null,
        };
        self.offset[i] += text.len();
        if text.is_empty() && lp.is_null() {
            return Ok(Vec::new());
        }
        Ok(vec![self.reply.chunk(i, text, lp, None)])
    }

    fn done(&mut self, i: usize, out: &EngineOutput) -> Result<Vec<Value>, ApiError> {
        let g = generation_of(out)?;
        let rest = self.detok[i].finish(&g.finish)?;
        self.outs[i] = Some(out.clone());
        Ok(vec![self.reply.chunk(
            i,
            rest,
            Value::Null,
            Some(finish_reason(&g.finish)),
        )])
    }

    fn end(&mut self) -> Vec<Value> {
        let b = &self.reply.base;
        if !b.include_usage {
            return Vec::new();
        }
        let outs: Vec<EngineOutput> = self.outs.iter().flatten().cloned().collect();
        let n = self.reply.req.generation.n;
        let per_prompt: Vec<Vec<EngineOutput>> = outs.chunks(n).map(<[EngineOutput]>::to_vec).collect();
        let usage = self
            .reply
            .response(Vec::new(), &per_prompt)
            .map(|r| r["usage"].clone())
            .unwrap_or(Value::Null);
        vec![
            json!({"id": b.id, "object": "text_completion", "created": b.created, "model": b.model,
                    "choices": [], "usage": usage}),
        ]
    }
}
