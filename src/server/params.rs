//! The generation parameters that chat completions, completions and responses share, read as vLLM
//! reads them: token limits, stop strings and stop token ids, sampling (temperature, top-p, top-k,
//! seed), penalties (repetition as HF transformers defines it, presence and frequency as OpenAI does),
//! `n`, how the output is detokenized, streaming. Defaults come from the model's
//! `generation_config.json` (the keys vLLM reads from it), a request value overrides them.

use serde_json::Value;

use crate::engine::sampling::Penalties;
use crate::engine::{GenerateParams, RequestOptions, Sampling};
use crate::server::engine_loop::ModelInfo;
use crate::server::error::ApiError;
use crate::server::fields::Fields;

/// Most choices one request may ask for (`n`).
pub const MAX_N: u64 = 16;

/// Generation defaults when a request leaves a parameter out: the model's `generation_config.json`,
/// else OpenAI's (temperature 1, no top-p or top-k cut, no penalty, no token cap).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub repetition_penalty: f32,
    /// `max_new_tokens`: a cap on every request's tokens (vLLM applies it as a cap, not a default).
    pub max_new_tokens: Option<usize>,
}

impl SamplingDefaults {
    /// From a model directory's `generation_config.json` (the keys vLLM reads: `temperature`,
    /// `top_p`, `top_k`, `repetition_penalty`, `max_new_tokens`). `do_sample: false` means greedy;
    /// `top_k: 50`, transformers' class default, means no cut (vLLM drops values equal to
    /// transformers' defaults); missing keys take OpenAI's defaults.
    ///
    /// ```
    /// use recall::server::openai::SamplingDefaults;
    /// let d = SamplingDefaults::from_model_dir("models/qwen2.5-vl-7b-instruct".as_ref());
    /// assert_eq!((d.top_k, d.repetition_penalty), (1, 1.05));
    /// ```
    pub fn from_model_dir(dir: &std::path::Path) -> Self {
        let path = dir.join("generation_config.json");
        let v: Value = crate::limits::read_capped(&path, crate::limits::MAX_CONFIG_BYTES)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        let f = |k: &str| v.get(k).and_then(Value::as_f64);
        let greedy = v.get("do_sample").and_then(Value::as_bool) == Some(false);
        let top_k = f("top_k").map_or(0, |k| k.max(0.0) as usize);
        SamplingDefaults {
            temperature: if greedy {
                0.0
            } else {
                f("temperature").unwrap_or(1.0) as f32
            },
            top_p: f("top_p").unwrap_or(1.0) as f32,
            top_k: if top_k == 50 { 0 } else { top_k },
            repetition_penalty: f("repetition_penalty").unwrap_or(1.0) as f32,
            max_new_tokens: f("max_new_tokens").filter(|&n| n >= 1.0).map(|n| n as usize),
        }
    }
}

/// How generated tokens become the response's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextOptions {
    /// Leave special tokens (`<|im_end|>`, `<|vision_start|>`) out of the text (default true).
    pub skip_special_tokens: bool,
    /// Keep the stop string (or the stop token) that ended generation in the text (default false).
    pub include_stop_str_in_output: bool,
}

impl Default for TextOptions {
    fn default() -> Self {
        TextOptions {
            skip_special_tokens: true,
            include_stop_str_in_output: false,
        }
    }
}

/// The generation parameters of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The token limit asked for, and the field it came from.
    pub max_tokens: Option<(String, usize)>,
    pub stop: Vec<String>,
    /// Token ids that end generation besides the model's end-of-sequence ids (vLLM's extension).
    pub stop_token_ids: Vec<u32>,
    /// Generate past end-of-sequence ids (vLLM's extension).
    pub ignore_eos: bool,
    pub sampling: Sampling,
    pub penalties: Penalties,
    /// Choices to generate.
    pub n: usize,
    pub text: TextOptions,
    pub stream: bool,
    pub include_usage: bool,
}

impl Generation {
    /// The generation parameters of a request whose token limit is one of `limit_keys` (the first
    /// present wins: `max_completion_tokens` before `max_tokens`).
    pub fn parse(f: &Fields<'_>, defaults: &SamplingDefaults, limit_keys: &[&str]) -> Result<Self, ApiError> {
        let (sampling, penalties) = parse_sampling(f, defaults)?;
        let (stream, include_usage) = parse_stream(f)?;
        let n = f.uint("n")?.unwrap_or(1);
        if n == 0 || n > MAX_N {
            return Err(f.bad("n", format!("`n` must be in 1..={MAX_N}, got {n}")));
        }
        Ok(Generation {
            max_tokens: parse_max_tokens(f, limit_keys)?,
            stop: parse_stop(f)?,
            stop_token_ids: parse_stop_token_ids(f)?,
            ignore_eos: f.boolean("ignore_eos")?.unwrap_or(false),
            sampling,
            penalties,
            n: n as usize,
            text: TextOptions {
                skip_special_tokens: f.boolean("skip_special_tokens")?.unwrap_or(true),
                include_stop_str_in_output: f.boolean("include_stop_str_in_output")?.unwrap_or(false),
            },
            stream,
            include_usage,
        })
    }

    /// The engine's parameters for a prompt of `prompt_tokens`: the token limit as asked (else the
    /// rest of the context), capped by the model's `max_new_tokens`; an over-long request is a 400
    /// saying by how much.
    pub fn params(
        &self,
        info: &ModelInfo,
        defaults: &SamplingDefaults,
        prompt_tokens: usize,
        prompt_param: &str,
    ) -> Result<GenerateParams, ApiError> {
        let max_context = info.max_context;
        let room = max_context.saturating_sub(prompt_tokens);
        if room == 0 {
            return Err(ApiError::bad(
                prompt_param,
                format!(
                    "the prompt has {prompt_tokens} tokens and leaves no room to generate in the model's \
                     context of {max_context} tokens (over by {})",
                    prompt_tokens + 1 - max_context
                ),
            )
            .with_code("context_length_exceeded"));
        }
        let max_tokens = match &self.max_tokens {
            Some((key, n)) if *n > room => {
                return Err(ApiError::bad(
                    key,
                    format!(
                        "{key} {n} with a prompt of {prompt_tokens} tokens exceeds the model's context of \
                         {max_context} by {}",
                        n - room
                    ),
                )
                .with_code("context_length_exceeded"))
            }
            Some((_, n)) => *n,
            None => room,
        };
        let max_tokens = defaults
            .max_new_tokens
            .map_or(max_tokens, |cap| max_tokens.min(cap));
        let mut eos_token_ids = if self.ignore_eos {
            Vec::new()
        } else {
            info.eos_token_ids.clone()
        };
        for &t in &self.stop_token_ids {
            if !eos_token_ids.contains(&t) {
                eos_token_ids.push(t);
            }
        }
        Ok(GenerateParams {
            max_tokens,
            eos_token_ids,
            stop_strings: self.stop.clone(),
        })
    }

    /// The seed of choice `i`: the request's seed plus `i`, as vLLM seeds the choices of `n > 1`.
    pub fn sampling_for(&self, i: usize) -> Sampling {
        Sampling {
            seed: self.sampling.seed.map(|s| s.wrapping_add(i as u64)),
            ..self.sampling
        }
    }

    /// The engine options of choice `i`: its sampling, the penalties, `logprobs` alternatives, and
    /// the server's adapter where it acts.
    pub fn options(&self, i: usize, logprobs: Option<usize>, info: &ModelInfo) -> RequestOptions {
        RequestOptions {
            sampling: self.sampling_for(i),
            penalties: self.penalties,
            logprobs,
            adapter: info.adapter.unwrap_or_default(),
            ..RequestOptions::default()
        }
    }
}

/// The first of `keys` present: at least 1.
fn parse_max_tokens(f: &Fields<'_>, keys: &[&str]) -> Result<Option<(String, usize)>, ApiError> {
    for key in keys {
        if let Some(n) = f.uint(key)? {
            if n == 0 {
                return Err(f.bad(key, format!("`{key}` must be at least 1")));
            }
            return Ok(Some((f.param(key), n as usize)));
        }
    }
    Ok(None)
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
                    .ok_or_else(|| f.bad(&format!("stop[{i}]"), "`stop` entries must be strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(f.bad(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    crate::tokenize::chat::json_kind(other)
                ),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(f.bad("stop", "`stop` strings must not be empty"));
    }
    Ok(stop)
}

/// `stop_token_ids`: an array of token ids.
fn parse_stop_token_ids(f: &Fields<'_>) -> Result<Vec<u32>, ApiError> {
    let Some(ids) = f.array("stop_token_ids")? else {
        return Ok(Vec::new());
    };
    ids.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| {
                f.bad(
                    &format!("stop_token_ids[{i}]"),
                    "`stop_token_ids` entries must be token ids",
                )
            })
        })
        .collect()
}

/// `temperature` in [0, 2], `top_p` in (0, 1], `top_k` (≤ 0: no cut), `seed`; the penalties
/// (`repetition_penalty` > 0, `presence_penalty` and `frequency_penalty` in [-2, 2], vLLM's ranges);
/// each over the defaults.
fn parse_sampling(f: &Fields<'_>, d: &SamplingDefaults) -> Result<(Sampling, Penalties), ApiError> {
    let temperature = f.num("temperature")?.map_or(d.temperature, |t| t as f32);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(f.bad(
            "temperature",
            format!("`temperature` {temperature} is outside [0, 2]"),
        ));
    }
    let top_p = f.num("top_p")?.map_or(d.top_p, |p| p as f32);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(f.bad("top_p", format!("`top_p` {top_p} is outside (0, 1]")));
    }
    let top_k = match f.int("top_k")? {
        None => d.top_k,
        Some(k) if k <= 0 => 0, // -1 and 0 both mean no cut (vLLM uses -1)
        Some(k) => k as usize,
    };
    let seed = f.int("seed")?.filter(|&s| s != -1).map(|s| s as u64);
    let repetition = f
        .num("repetition_penalty")?
        .map_or(d.repetition_penalty, |r| r as f32);
    if !(repetition.is_finite() && repetition > 0.0) {
        return Err(f.bad(
            "repetition_penalty",
            format!("`repetition_penalty` must be greater than 0, got {repetition}"),
        ));
    }
    let mut openai = [0.0f32; 2];
    for (slot, key) in openai.iter_mut().zip(["frequency_penalty", "presence_penalty"]) {
        let x = f.num(key)?.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&x) {
            return Err(f.bad(key, format!("`{key}` must be in [-2, 2], got {x}")));
        }
        *slot = x as f32;
    }
    let sampling = Sampling {
        temperature,
        top_p,
        top_k,
        seed,
    };
    let penalties = Penalties {
        repetition,
        frequency: openai[0],
        presence: openai[1],
    };
    Ok((sampling, penalties))
}

/// `stream` and `stream_options.include_usage` (`stream_options` only with `stream: true`).
fn parse_stream(f: &Fields<'_>) -> Result<(bool, bool), ApiError> {
    let stream = f.boolean("stream")?.unwrap_or(false);
    let Some(options) = f.object("stream_options")? else {
        return Ok((stream, false));
    };
    if !stream {
        return Err(f.bad("stream_options", "`stream_options` needs `stream: true`"));
    }
    let include_usage = Fields::nested(options, "stream_options")
        .boolean("include_usage")?
        .unwrap_or(false);
    Ok((stream, include_usage))
}

/// Fields recall reads but does not implement: refused with a 400 that says why, unless they ask
/// for nothing (so that clients sending the neutral value work unchanged).
pub fn check_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    if f.num("min_p")?.is_some_and(|x| x != 0.0) {
        return Err(f.bad("min_p", "`min_p` is not supported (only 0)"));
    }
    if f.uint("min_tokens")?.is_some_and(|n| n != 0) {
        return Err(f.bad("min_tokens", "`min_tokens` is not supported (only 0)"));
    }
    if f.get("logit_bias")
        .is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty()))
    {
        return Err(f.bad("logit_bias", "`logit_bias` is not supported"));
    }
    if f.uint("best_of")?.is_some_and(|n| n > 1) {
        return Err(f.bad(
            "best_of",
            "`best_of` > 1 is not supported (as in vLLM's V1 engine)",
        ));
    }
    if f.boolean("use_beam_search")?.unwrap_or(false) {
        return Err(f.bad("use_beam_search", "beam search is not supported"));
    }
    for key in [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ] {
        if f.get(key).is_some() {
            return Err(f.bad(
                key,
                format!("`{key}` needs constrained decoding, which recall does not have"),
            ));
        }
    }
    for key in ["allowed_token_ids", "bad_words"] {
        if f.array(key)?.is_some_and(|a| !a.is_empty()) {
            return Err(f.bad(key, format!("`{key}` is not supported")));
        }
    }
    if let Some(rf) = f.get("response_format") {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(f.bad(
                "response_format",
                "only `{\"type\": \"text\"}` is supported (no constrained decoding)",
            ));
        }
    }
    Ok(())
}

/// The request fields [`Generation::parse`] and [`check_unsupported`] read.
pub const GENERATION_FIELDS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "stream",
    "stream_options",
    "min_p",
    "min_tokens",
    "logit_bias",
    "best_of",
    "use_beam_search",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "allowed_token_ids",
    "bad_words",
    "response_format",
    "user",
    "metadata",
    "store",
    "service_tier",
    "request_id",
    "priority",
    "model",
];
