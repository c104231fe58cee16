//! What the responses of every generation endpoint share: the request's id, model and text rule, the
//! names of tokens in log-probs, `usage`, finish reasons, and reading the outputs of requests that
//! ran without streaming.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::engine::{EngineOutput, FinishReason, Outcome};
use crate::server::engine_loop::Event;
use crate::server::error::ApiError;
use crate::server::params::Generation;
use crate::server::prepare::Submitted;
use crate::server::text::TextRule;
use crate::tokenize::Tokenizer;

/// The outputs of requests submitted without streaming (each first event is its output).
pub fn finished(submitted: Vec<Submitted>) -> Result<Vec<EngineOutput>, ApiError> {
    submitted
        .into_iter()
        .map(|s| match s.first {
            Event::Done(out) => match &out.outcome {
                Outcome::Failed(e) => Err(ApiError::from_engine(
                    &crate::Error::InvalidRequest(e.clone()),
                    "messages",
                )),
                _ => Ok(*out),
            },
            Event::Failed(e) => Err(ApiError::from_engine(&e, "messages")),
            _ => Err(ApiError::internal(
                "unexpected event for a request without streaming",
            )),
        })
        .collect()
}

/// What every response of one request shares: its id, the model, the text rule, log-prob options.
pub struct ReplyBase {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub rule: TextRule,
    pub tokenizer: Arc<Tokenizer>,
    pub token_ids_as_tokens: bool,
    pub include_usage: bool,
}

impl ReplyBase {
    pub fn new(prefix: &str, model: &str, tokenizer: &Arc<Tokenizer>, eos: &[u32], g: &Generation) -> Self {
        let mut eos = eos.to_vec();
        eos.extend(&g.stop_token_ids);
        ReplyBase {
            id: format!("{prefix}-{:032x}", crate::server::rand_u128()),
            created: crate::server::unix_now(),
            model: model.to_string(),
            rule: TextRule {
                tokenizer: tokenizer.clone(),
                stop: g.stop.clone(),
                eos,
                options: g.text,
            },
            tokenizer: tokenizer.clone(),
            token_ids_as_tokens: false,
            include_usage: g.include_usage,
        }
    }

    /// The name a log-prob entry gives `token`: its text, or `token_id:N`.
    pub fn token_name(&self, token: u32) -> String {
        if self.token_ids_as_tokens {
            format!("token_id:{token}")
        } else {
            String::from_utf8_lossy(&self.tokenizer.token_bytes(token)).into_owned()
        }
    }

    /// `usage` of the outputs of one request's choices: the prompt once, every choice's tokens, and
    /// the prompt tokens the prefix cache served (the least of any choice: the one that computed it).
    pub fn usage(outs: &[EngineOutput], completion_tokens: usize) -> Value {
        let prompt = outs.first().map_or(0, |o| o.prompt_tokens);
        let cached = outs.iter().map(|o| o.reused_tokens).min().unwrap_or(0);
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }
}

/// A handler's result as a response: the error's JSON body when it failed.
pub fn respond(r: Result<axum::response::Response, ApiError>) -> axum::response::Response {
    use axum::response::IntoResponse;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// The generation of a finished output.
pub fn generation_of(out: &EngineOutput) -> Result<&crate::engine::Generation, ApiError> {
    match &out.outcome {
        Outcome::Generation(g) => Ok(g),
        Outcome::Failed(e) => Err(ApiError::bad("messages", e.clone())),
        other => Err(ApiError::internal(format!("unexpected outcome {other:?}"))),
    }
}

/// OpenAI's name for why generation ended.
pub fn finish_reason(f: &FinishReason) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::Stop(_) => "stop",
        FinishReason::Length => "length",
    }
}

/// A random id for responses.
pub fn rand_id() -> u64 {
    crate::server::rand_u128() as u64
}
