//! Greedy generation: prefill the prompt, then decode one token at a time until an end-of-sequence id,
//! a stop string or the token limit.

use crate::backend::{Backend, OpTime};
use crate::engine::sampling::{argmax_row, Penalties, PenaltyState};
use crate::engine::PromptInput;
use crate::error::{Error, Result};
use crate::model::{LogitsFor, TextModel};
use crate::tokenize::Tokenizer;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation (kept in the output, as HF does).
    pub eos_token_ids: Vec<u32>,
    /// Strings that end generation once the decoded output contains them (needs a tokenizer).
    pub stop_strings: Vec<String>,
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced.
    Eos,
    /// The decoded output contains this stop string.
    Stop(String),
    /// `max_tokens` were produced.
    Length,
}

/// The result of [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The generated token ids (the ending eos or stop-string tokens included).
    pub tokens: Vec<u32>,
    /// The decoded text, when a tokenizer was given.
    pub text: Option<String>,
    pub finish: FinishReason,
}

/// Greedily continues `prompt`.
///
/// ```no_run
/// use recall::{backend::cpu::CpuBackend, engine::{generate, GenerateParams, PromptInput}, model::QwenVl};
/// let be = CpuBackend;
/// let model = QwenVl::load(&be, std::path::Path::new("tests/fixtures/tiny-qwen3-vl"))?;
/// let params = GenerateParams { max_tokens: 16, eos_token_ids: model.config.eos_token_ids.clone(), stop_strings: vec![] };
/// let out = generate(&be, &model.text, &PromptInput::text(&[1, 2, 3]), &params, None)?;
/// println!("{:?}", out.tokens);
/// # Ok::<(), recall::Error>(())
/// ```
pub fn generate<B: Backend>(
    be: &B,
    model: &TextModel<B>,
    prompt: &PromptInput<B::Tensor>,
    params: &GenerateParams,
    tokenizer: Option<&Tokenizer>,
) -> Result<Generation> {
    Ok(generate_timed(be, model, prompt, params, tokenizer, &Penalties::NONE, false)?.0)
}

/// Where the time of a generation went.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct GenerationStats {
    /// The forward over the prompt (to the first token), seconds.
    pub prefill_seconds: f64,
    /// The forwards after it, seconds, and how many.
    pub decode_seconds: f64,
    pub decode_steps: usize,
    /// With profiling: each phase op by op (slowest first); the vision tower's when the caller
    /// encoded images first ([`Pipeline::generate_chat_timed`](crate::engine::Pipeline::generate_chat_timed)).
    pub vision_ops: Vec<OpTime>,
    pub prefill_ops: Vec<OpTime>,
    pub decode_ops: Vec<OpTime>,
}

/// [`generate`] under `penalties` (greedy on the penalised logits), timed (and with `profile`, op by
/// op: the backend's [`Backend::set_profiling`]).
pub fn generate_timed<B: Backend>(
    be: &B,
    model: &TextModel<B>,
    prompt: &PromptInput<B::Tensor>,
    params: &GenerateParams,
    tokenizer: Option<&Tokenizer>,
    penalties: &Penalties,
    profile: bool,
) -> Result<(Generation, GenerationStats)> {
    penalties.validate()?;
    if prompt.ids.is_empty() {
        return Err(Error::InvalidRequest("the prompt is empty".into()));
    }
    if !params.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(Error::InvalidRequest("stop strings need a tokenizer".into()));
    }
    let limit = model.config().max_position_embeddings;
    let needed = prompt.ids.len() + params.max_tokens;
    if needed > limit {
        return Err(Error::PromptTooLong {
            tokens: needed,
            limit,
        });
    }
    let mut cache = model.new_cache(be, needed)?;
    let mut tokens: Vec<u32> = Vec::new();
    let mut seen = (!penalties.is_none()).then(|| PenaltyState::new(*penalties, &prompt.ids));
    let mut stats = GenerationStats::default();
    be.set_profiling(profile);
    let finish = loop {
        if params.max_tokens == 0 {
            break FinishReason::Length;
        }
        let clock = std::time::Instant::now();
        let out = match tokens.last() {
            None => {
                let (ids, pos, visual) = (&prompt.ids, &prompt.positions, prompt.visual.as_ref());
                let lora = prompt.lora_rows();
                model.forward(be, ids, pos, visual, &lora, &mut cache, LogitsFor::Last, false)?
            }
            Some(&last) => {
                let pos = prompt.continuation(tokens.len() - 1, 1);
                let lora: &[usize] = if prompt.lora_after_prompt() { &[0] } else { &[] };
                model.forward(be, &[last], &pos, None, lora, &mut cache, LogitsFor::Last, false)?
            }
        };
        let next = match &mut seen {
            None => be.argmax(&out.logits)?[0],
            Some(seen) => {
                let next = argmax_row(&seen.penalised(&be.download(&out.logits)?));
                seen.push(next);
                next
            }
        };
        tokens.push(next);
        let seconds = clock.elapsed().as_secs_f64();
        if tokens.len() == 1 {
            stats.prefill_seconds = seconds;
            stats.prefill_ops = be.take_profile()?;
        } else {
            stats.decode_seconds += seconds;
            stats.decode_steps += 1;
        }
        if let Some(finish) = finish_reason(params, &tokens, tokenizer)? {
            break finish;
        }
    };
    if profile {
        be.set_profiling(false);
        stats.decode_ops = be.take_profile()?;
    }
    let text = tokenizer.map(|t| t.decode(&tokens)).transpose()?;
    Ok((Generation { tokens, text, finish }, stats))
}

/// Why generation ends with the last of `tokens` (just produced), if it does: an end-of-sequence
/// id, then a stop string in the decoded output, then the token limit.
pub(crate) fn finish_reason(
    params: &GenerateParams,
    tokens: &[u32],
    tokenizer: Option<&Tokenizer>,
) -> Result<Option<FinishReason>> {
    if tokens.last().is_some_and(|t| params.eos_token_ids.contains(t)) {
        return Ok(Some(FinishReason::Eos));
    }
    if let Some(tok) = tokenizer.filter(|_| !params.stop_strings.is_empty()) {
        let text = tok.decode(tokens)?;
        if let Some(stop) = params.stop_strings.iter().find(|s| text.contains(s.as_str())) {
            return Ok(Some(FinishReason::Stop(stop.clone())));
        }
    }
    Ok((tokens.len() >= params.max_tokens).then_some(FinishReason::Length))
}
