//! The measurement harness: a fresh [`Engine`] per run over the bench's model, the screenshots
//! registered in its vision cache, and greedy generation driven step by step so that the prefill
//! (to the first token) and the decode are timed apart. Plus the statistics of the rows.

use std::time::Instant;

use super::args::BenchArgs;
use super::layouts::{image_hash, to_prompt, LayoutRun, Layouts};
use crate::backend::Backend;
use crate::engine::{Engine, EngineConfig, GenerateParams, Outcome, Prompt, RequestOptions, Task};
use crate::error::{Error, Result};
use crate::model::QwenVl;
use crate::vision::PixelValues;

/// Milliseconds since `since`.
pub(super) fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// The median (0 for no values): robust to one slow repeat.
pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// `a / b`, or 0 when `b` is not positive (nothing counted, no ratio).
pub(super) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// One generation driven step by step.
#[derive(Debug, Clone)]
pub(super) struct Gen {
    pub(super) tokens: Vec<u32>,
    /// Until the first token is decided (the last prefill chunk ends with an argmax, which syncs).
    pub(super) prefill_ms: f64,
    pub(super) total_ms: f64,
    pub(super) decode_steps: usize,
    pub(super) reused: usize,
    pub(super) accepted: usize,
}

impl Gen {
    /// Time after the first token per decode step (0 without decode steps).
    pub(super) fn decode_ms_per_token(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            (self.total_ms - self.prefill_ms) / self.decode_steps as f64
        }
    }
}

/// The model, settings and screenshots every run shares; each run makes its own engine.
pub(super) struct Harness<'a, B: Backend> {
    pub(super) be: &'a B,
    /// Waits for the device (timings end with it).
    pub(super) sync: &'a dyn Fn() -> Result<()>,
    pub(super) model: &'a QwenVl<B>,
    pub(super) args: &'a BenchArgs,
    pub(super) layouts: Layouts,
    pub(super) images: Vec<PixelValues>, // index = step - 1; the last is the current screenshot
    pub(super) merge: usize,
    /// KV blocks of every engine: room for all prompts of one step.
    pub(super) pool_blocks: usize,
}

impl<B: Backend> Harness<'_, B> {
    /// A fresh engine over the model, with or without prefix caching.
    pub(super) fn engine(&self, prefix_caching: bool) -> Result<Engine<'_, B>> {
        Engine::new(
            self.be,
            self.model,
            None,
            EngineConfig {
                block_size: self.args.block_size,
                num_blocks: self.pool_blocks,
                kv_cache_bytes: None,
                memory_utilization: None,
                chunk_size: self.args.chunk_size,
                max_batch_tokens: self.args.max_batch_tokens,
                vision_cache_bytes: usize::MAX / 2,
                prefix_caching,
            },
        )
    }

    /// Encodes the screenshots of `steps` into the engine's vision cache, then syncs.
    pub(super) fn add_images(
        &self,
        engine: &mut Engine<'_, B>,
        steps: impl IntoIterator<Item = usize>,
    ) -> Result<()> {
        for s in steps {
            engine.add_image(image_hash(self.args.seed, s), &self.images[s - 1])?;
        }
        (self.sync)()
    }

    /// The engine prompt of a layout.
    pub(super) fn prompt(&self, runs: &[LayoutRun]) -> Prompt {
        to_prompt(&self.layouts, runs, self.model.config.text.hidden_size)
    }

    /// Greedy generation of exactly `max_tokens` tokens (no end token), timed per step.
    pub(super) fn generate(
        &self,
        engine: &mut Engine<'_, B>,
        prompt: &Prompt,
        max_tokens: usize,
        draft: Vec<u32>,
    ) -> Result<Gen> {
        self.generate_with(engine, prompt, max_tokens, draft, &mut |_| Ok(()))
    }

    /// Tokens of a prompt.
    pub(super) fn prompt_len(&self, prompt: &Prompt) -> Result<usize> {
        let pad = self.model.config.image_token_id.unwrap_or(0);
        Ok(prompt.flatten(pad, self.merge)?.ids.len())
    }

    /// Engine steps of a lone request's prefill of `tokens` tokens: chunks of min(chunk, batch).
    pub(super) fn prefill_steps(&self, tokens: usize) -> usize {
        let per = self.args.chunk_size.min(self.args.max_batch_tokens).max(1);
        tokens.div_ceil(per)
    }

    /// [`generate`](Self::generate), calling `after_step(n)` after the `n`-th engine step (from 1).
    pub(super) fn generate_with(
        &self,
        engine: &mut Engine<'_, B>,
        prompt: &Prompt,
        max_tokens: usize,
        draft: Vec<u32>,
        after_step: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Gen> {
        let prompt_len = self.prompt_len(prompt)?;
        let draft_len = draft.len().min(max_tokens);
        let params = GenerateParams {
            max_tokens,
            eos_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        };
        let opts = RequestOptions {
            draft,
            ..RequestOptions::default()
        };
        let clock = Instant::now();
        let id = engine.add_request_with(prompt, Task::Generate(params), opts)?;
        let mut ends = Vec::new();
        let out = loop {
            let done = engine.step()?;
            ends.push(ms(clock));
            after_step(ends.len())?;
            if let Some(o) = done.into_iter().find(|o| o.id == id) {
                break o;
            }
            if !engine.has_work() {
                return Err(Error::InvalidRequest(format!("bench request {id} vanished")));
            }
        };
        (self.sync)()?;
        let total_ms = ms(clock);
        let tokens = match out.outcome {
            Outcome::Generation(g) => g.tokens,
            Outcome::Failed(e) => return Err(Error::InvalidRequest(format!("bench generation failed: {e}"))),
            other => {
                return Err(Error::InvalidRequest(format!(
                    "bench: unexpected outcome {other:?}"
                )))
            }
        };
        // A lone request is scheduled in chunks of min(chunk, batch) tokens until prompt and draft are
        // computed, then one token per step.
        let prefill_steps = self
            .prefill_steps((prompt_len + draft_len).saturating_sub(out.reused_tokens))
            .clamp(1, ends.len());
        Ok(Gen {
            tokens,
            prefill_ms: ends[prefill_steps - 1],
            total_ms,
            decode_steps: ends.len() - prefill_steps,
            reused: out.reused_tokens,
            accepted: out.accepted_draft,
        })
    }
}
