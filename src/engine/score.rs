//! Teacher-forced scoring: the log-probability the model gives to target tokens after a prompt.

use crate::backend::Backend;
use crate::engine::PromptInput;
use crate::error::{Error, Result};
use crate::model::{LogitsFor, TextModel};

/// Log-probabilities of target tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// `log p(target[i] | prompt, target[..i])` for every target token.
    pub token_logprobs: Vec<f32>,
    /// Sum of `token_logprobs` (accumulated in f64).
    pub sum_logprob: f64,
    /// Mean over target tokens.
    pub mean_logprob: f64,
}

/// Scores `target` after `prompt` in one forward pass.
///
/// ```no_run
/// use recall::{backend::cpu::CpuBackend, engine::{score, PromptInput}, model::QwenVl};
/// let be = CpuBackend;
/// let model = QwenVl::load(&be, std::path::Path::new("tests/fixtures/tiny-qwen3-vl"))?;
/// let s = score(&be, &model.text, &PromptInput::text(&[1, 2, 3]), &[4, 5])?;
/// println!("mean log-prob {}", s.mean_logprob);
/// # Ok::<(), recall::Error>(())
/// ```
pub fn score<B: Backend>(
    be: &B,
    model: &TextModel<B>,
    prompt: &PromptInput<B::Tensor>,
    target: &[u32],
) -> Result<Score> {
    if prompt.ids.is_empty() || target.is_empty() {
        return Err(Error::InvalidRequest(
            "scoring needs a non-empty prompt and target".into(),
        ));
    }
    let ids: Vec<u32> = prompt.ids.iter().chain(target).copied().collect();
    let limit = model.config().max_position_embeddings;
    if ids.len() > limit {
        return Err(Error::PromptTooLong {
            tokens: ids.len(),
            limit,
        });
    }
    let mut cache = model.new_cache(be, ids.len())?;
    let mut pos = prompt.positions.clone();
    pos.extend(&prompt.continuation(0, target.len()));
    let mut lora = prompt.lora_rows();
    if prompt.lora_after_prompt() {
        lora.extend(prompt.ids.len()..ids.len());
    }
    // Logits are needed only from the last prompt position on; the final position predicts nothing.
    let out = model.forward(
        be,
        &ids,
        &pos,
        prompt.visual.as_ref(),
        &lora,
        &mut cache,
        LogitsFor::All,
        false,
    )?;
    let rows = be.rows(&out.logits, prompt.ids.len() - 1, target.len())?;
    let token_logprobs = be.log_softmax_gather(&rows, target)?;
    let sum_logprob: f64 = token_logprobs.iter().map(|&x| x as f64).sum();
    Ok(Score {
        mean_logprob: sum_logprob / target.len() as f64,
        sum_logprob,
        token_logprobs,
    })
}
