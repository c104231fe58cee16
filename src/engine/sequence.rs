//! One request inside the engine: its tokens, their cache keys and positions, the embeddings injected
//! at image and embedding-run rows, and how far its K/V have been computed.

use std::sync::Arc;

use crate::engine::prompt::FlatPrompt;
use crate::engine::sampling::{PenaltyState, Sampler, Sampling, TokenLogprobs};
use crate::engine::vision_cache::VisionEntry;
use crate::engine::GenerateParams;
use crate::kv::{SeqId, TokenKey};
use crate::model::Positions;

/// Identifies a request across [`super::Engine::step`] calls.
pub type RequestId = u64;

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Task {
    /// Greedy generation.
    Generate(GenerateParams),
    /// Teacher-forced log-probabilities of `target` after the prompt.
    Score { target: Vec<u32> },
    /// Compute and cache the K/V of the prompt's first `len` tokens, nothing else (shared-prefix
    /// warm-up for [`super::Engine::score_many`]).
    Warm { len: usize },
}

/// Embeddings that replace the token embeddings of a run of rows.
pub(crate) struct Injected<T> {
    /// First token of the run in the sequence.
    pub start: usize,
    pub len: usize,
    pub entry: Arc<VisionEntry<T>>,
}

/// The engine's view of a request.
pub(crate) struct Sequence<T> {
    pub id: RequestId,
    pub task: Task,
    /// Token ids: the prompt, then (scoring) the target or (generation) the generated tokens.
    pub tokens: Vec<u32>,
    /// Cache key of every token in `tokens`.
    pub keys: Vec<TokenKey>,
    /// Whether the adapter acts on each token of `tokens`.
    pub gate: Vec<bool>,
    /// The adapter's id and whether it acts on tokens after the prompt (ungated mode).
    pub adapter: Option<(u64, bool)>,
    /// Positions of the prompt's tokens; later tokens continue from `next_position`.
    pub positions: Positions,
    pub next_position: i64,
    /// Tokens of the prompt proper.
    pub prompt_len: usize,
    pub injected: Vec<Injected<T>>,
    /// Request-wide cache salt (adapter id and gate mode).
    pub salt: u64,
    /// The sequence's handle in the block manager, once admitted.
    pub kv: Option<SeqId>,
    /// Tokens whose K/V are in the pool.
    pub computed: usize,
    /// Of those, tokens reused from the prefix cache.
    pub reused: usize,
    /// Generated tokens (generation).
    pub generated: Vec<u32>,
    /// Logits of every generation decision, when requested.
    pub decision_logits: Vec<Vec<f32>>,
    pub return_logits: bool,
    /// Target log-probabilities collected so far (scoring).
    pub logprobs: Vec<f32>,
    /// Draft tokens after the prompt awaiting verification (0 when none).
    pub draft_len: usize,
    /// Greedy predictions (and their logits, when requested) from the last prompt token on.
    pub draft_preds: Vec<u32>,
    pub draft_logits: Vec<Vec<f32>>,
    /// Draft tokens accepted by verification.
    pub accepted_draft: usize,
    /// How the next token is chosen, and the generator when it is sampled.
    pub sampling: Sampling,
    pub sampler: Option<Sampler>,
    /// Repetition, frequency and presence penalties, with the tokens they count (`None`: none).
    pub penalties: Option<PenaltyState>,
    /// Log-probabilities to return per generated token: `Some(n)` with the `n` most likely
    /// alternatives.
    pub want_logprobs: Option<usize>,
    /// The log-probabilities of the generated tokens so far (when `logprobs` is set).
    pub token_logprobs: Vec<TokenLogprobs>,
    /// Forwards this sequence took part in.
    pub forwards: u64,
    /// Times it gave its blocks back to let others decode (it is then recomputed).
    pub preemptions: u32,
}

impl<T> Sequence<T> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: RequestId,
        task: Task,
        flat: FlatPrompt,
        keys: Vec<TokenKey>,
        injected: Vec<Injected<T>>,
        gate: Vec<bool>,
        adapter: Option<(u64, bool)>,
    ) -> Self {
        let prompt_len = flat.ids.len();
        let mut s = Sequence {
            id,
            task,
            tokens: flat.ids,
            keys,
            gate,
            adapter,
            positions: flat.positions,
            next_position: flat.next_position,
            prompt_len,
            injected,
            salt: 0,
            kv: None,
            computed: 0,
            reused: 0,
            generated: Vec::new(),
            decision_logits: Vec::new(),
            return_logits: false,
            logprobs: Vec::new(),
            draft_len: 0,
            draft_preds: Vec::new(),
            draft_logits: Vec::new(),
            accepted_draft: 0,
            sampling: Sampling::greedy(),
            sampler: None,
            penalties: None,
            want_logprobs: None,
            token_logprobs: Vec::new(),
            forwards: 0,
            preemptions: 0,
        };
        match &s.task {
            Task::Score { target } => {
                for t in target.clone() {
                    s.push_token(t);
                }
            }
            Task::Warm { len } => {
                let len = (*len).min(s.tokens.len());
                s.tokens.truncate(len);
                s.keys.truncate(len);
                s.gate.truncate(len);
                s.prompt_len = len;
            }
            Task::Generate(_) => {}
        }
        s
    }

    /// Appends a token after the prompt (a scoring target or a generated token), gated when the
    /// adapter acts on every token.
    pub fn push_token(&mut self, t: u32) {
        let (key, gate) = match self.adapter {
            Some((id, true)) => (TokenKey::text(t).with_adapter(id), true),
            _ => (TokenKey::text(t), false),
        };
        self.tokens.push(t);
        self.keys.push(key);
        self.gate.push(gate);
    }

    /// Rows of `a..b` (relative to `a`) the adapter acts on.
    pub fn lora_rows(&self, a: usize, b: usize) -> Vec<usize> {
        (a..b).filter(|&i| self.gate[i]).map(|i| i - a).collect()
    }

    /// Tokens whose K/V this sequence needs before it can produce its next output.
    pub fn target_len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether every known token has been computed (a generation then decodes its last token
    /// next step; scoring and warm-up are done).
    pub fn is_prefilled(&self) -> bool {
        self.computed >= self.target_len()
    }

    /// Position triples of tokens `a..b`.
    pub fn positions(&self, a: usize, b: usize) -> Positions {
        let mut p = Positions::default();
        for i in a..b {
            if i < self.prompt_len.min(self.positions.len()) {
                p.t.push(self.positions.t[i]);
                p.h.push(self.positions.h[i]);
                p.w.push(self.positions.w[i]);
            } else {
                let x = self.next_position + (i - self.positions.len()) as i64;
                p.t.push(x);
                p.h.push(x);
                p.w.push(x);
            }
        }
        p
    }

    /// The most prompt tokens that may come from the prefix cache: at least one token must be
    /// computed for generation (its logits give the next token; after a preemption the generated
    /// tokens are reusable too), and for scoring the last prompt token (its logits score the first
    /// target token).
    pub fn reuse_limit(&self) -> usize {
        match self.task {
            // Drafting needs the logits of the last prompt token, so it is always computed.
            Task::Generate(_) if self.draft_len > 0 => self.prompt_len.saturating_sub(1),
            Task::Generate(_) => self.tokens.len().saturating_sub(1),
            Task::Score { .. } => self.prompt_len.saturating_sub(1),
            Task::Warm { .. } => self.tokens.len(),
        }
    }

    /// Whether a generation step needs the logits row on the host (logprobs, sampling, penalties or
    /// returned logits), not just the device argmax.
    pub fn needs_rows(&self) -> bool {
        self.return_logits
            || self.want_logprobs.is_some()
            || !self.sampling.is_greedy()
            || self.penalties.is_some()
    }

    /// Forgets everything computed (the sequence's blocks were given back): it is prefilled again
    /// from its tokens, which keep the prompt, any draft and what was generated so far. Partial
    /// per-row results (draft predictions, target log-probs) are recollected then.
    pub fn reset_for_recompute(&mut self) {
        self.kv = None;
        self.computed = 0;
        self.draft_preds.clear();
        self.draft_logits.clear();
        self.logprobs.clear();
        if matches!(self.task, Task::Score { .. }) {
            self.token_logprobs.clear();
        }
        self.preemptions += 1;
    }

    /// The largest reuse length `≤ limit` that does not end inside an image or embedding run (the
    /// block manager rounds it to a block boundary and asks again).
    pub fn clamp_reuse(&self, limit: usize) -> usize {
        match self
            .injected
            .iter()
            .find(|r| r.start < limit && limit < r.start + r.len)
        {
            Some(run) => run.start,
            None => limit,
        }
    }
}
