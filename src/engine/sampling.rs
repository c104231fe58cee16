//! Choosing the next token: greedy (argmax, the reference every exactness guarantee is stated for) or
//! sampling with temperature, top-k and top-p from a per-request seeded generator; and the
//! log-probabilities an OpenAI client asks for (`logprobs`, `top_logprobs`).
//!
//! Everything here runs on the host over one row of logits. Given the same logits (bitwise, which the
//! CPU backend guarantees whatever the batch) and the same seed, a request samples the same tokens on
//! every run, however it is batched or preempted: each request owns its generator and draws exactly
//! one number per sampled token.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// How a generation picks its tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Divides the logits; 0 means greedy.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Seed of the request's generator; `None` draws one from the clock (not reproducible).
    pub seed: Option<u64>,
}

impl Default for Sampling {
    /// Greedy.
    fn default() -> Self {
        Sampling::greedy()
    }
}

impl Sampling {
    /// Argmax decoding (the first maximum on ties, as `torch.argmax`).
    pub const fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
        }
    }

    /// Whether this picks the argmax: temperature 0 or top-k 1.
    ///
    /// ```
    /// use recall::engine::Sampling;
    /// assert!(Sampling::greedy().is_greedy());
    /// assert!(!Sampling { temperature: 0.7, ..Sampling::greedy() }.is_greedy());
    /// assert!(Sampling { temperature: 0.7, top_k: 1, ..Sampling::greedy() }.is_greedy());
    /// ```
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks the ranges (temperature in `[0, 100]`, top-p in `(0, 1]`), naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return Err(Error::InvalidRequest(format!(
                "temperature {} is outside [0, 100]",
                self.temperature
            )));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidRequest(format!(
                "top_p {} is outside (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Penalties on tokens the sequence has already seen, applied to the logits before anything chooses
/// from them (greedy or sampled), in vLLM's order:
///
/// 1. `repetition` (HF transformers' `RepetitionPenaltyLogitsProcessor`, CTRL's penalty): every token of
///    the prompt or of the output so far has its logit divided by it when positive and multiplied by it
///    otherwise;
/// 2. `frequency` (OpenAI): subtracted once per occurrence of the token in the output so far;
/// 3. `presence` (OpenAI): subtracted once from every token that occurs in the output so far.
///
/// The neutral values are 1, 0 and 0 ([`Penalties::NONE`]). Reported log-probabilities stay those of
/// the raw logits, as vLLM reports them by default.
///
/// ```
/// use recall::engine::sampling::Penalties;
/// let p = Penalties { repetition: 2.0, frequency: 0.5, presence: 0.25 };
/// let mut logits = vec![4.0, -1.0, 3.0];
/// // Token 0 is in the prompt; token 1 was generated twice.
/// p.apply(&mut logits, &[0], &[(1, 2)]);
/// assert_eq!(logits, vec![2.0, -2.0 - 1.0 - 0.25, 3.0]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties::NONE
    }
}

impl Penalties {
    /// No penalty.
    pub const NONE: Penalties = Penalties {
        repetition: 1.0,
        frequency: 0.0,
        presence: 0.0,
    };

    /// Whether these change no logit.
    pub fn is_none(&self) -> bool {
        *self == Penalties::NONE
    }

    /// Checks that the penalties are usable: `repetition` positive, all finite.
    pub fn validate(&self) -> Result<()> {
        if !(self.repetition.is_finite() && self.repetition > 0.0) {
            return Err(Error::InvalidRequest(format!(
                "repetition_penalty {} must be a positive number",
                self.repetition
            )));
        }
        for (name, x) in [
            ("frequency_penalty", self.frequency),
            ("presence_penalty", self.presence),
        ] {
            if !x.is_finite() {
                return Err(Error::InvalidRequest(format!("{name} {x} is not finite")));
            }
        }
        Ok(())
    }

    /// Penalises `logits` in place: `prompt` lists the distinct prompt tokens, `output` each distinct
    /// output token with its count. Ids outside the row are ignored. Each logit changes through the
    /// same float operations as in vLLM's `apply_penalties` (and, for the repetition penalty, HF's
    /// processor), so the results agree bit for bit.
    pub fn apply(&self, logits: &mut [f32], prompt: &[u32], output: &[(u32, u32)]) {
        if self.repetition != 1.0 {
            let r = self.repetition;
            let mut seen: Vec<u32> = prompt.iter().copied().chain(output.iter().map(|o| o.0)).collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x = if *x > 0.0 { *x / r } else { *x * r };
                }
            }
        }
        for &(t, count) in output {
            if let Some(x) = logits.get_mut(t as usize) {
                *x -= self.frequency * count as f32;
                *x -= self.presence;
            }
        }
    }
}

/// What a sequence's penalties need to know: its distinct prompt tokens and the counts of what it has
/// generated so far.
#[derive(Debug, Clone)]
pub(crate) struct PenaltyState {
    pub penalties: Penalties,
    prompt: Vec<u32>,
    output: std::collections::BTreeMap<u32, u32>,
}

impl PenaltyState {
    pub fn new(penalties: Penalties, prompt: &[u32]) -> Self {
        let mut prompt = prompt.to_vec();
        prompt.sort_unstable();
        prompt.dedup();
        PenaltyState {
            penalties,
            prompt,
            output: Default::default(),
        }
    }

    /// Counts a generated token.
    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }

    /// The penalised copy of a logits row.
    pub fn penalised(&self, row: &[f32]) -> Vec<f32> {
        let mut out = row.to_vec();
        let output: Vec<(u32, u32)> = self.output.iter().map(|(&t, &c)| (t, c)).collect();
        self.penalties.apply(&mut out, &self.prompt, &output);
        out
    }
}

/// Greedy choice on a host row: the CPU backend's argmax, so a host decision picks what the device's
/// argmax would.
pub use crate::backend::cpu::argmax_row;

/// A request's random generator: ChaCha8 (a specified stream, so a seed means the same numbers on
/// every platform and version of this crate).
pub(crate) struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Self {
        let seed = seed.unwrap_or_else(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            now.as_nanos() as u64 ^ (std::process::id() as u64).rotate_left(32)
        });
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniform number in `[0, 1)` with 53 random bits.
    fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Samples a token from `logits` under `s` (which must not be greedy).
    pub fn sample(&mut self, logits: &[f32], s: &Sampling) -> u32 {
        let t = f64::from(s.temperature);
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| !x.is_nan())
            .map(|(i, &x)| (i as u32, f64::from(x) / t))
            .collect();
        if cand.is_empty() {
            return 0;
        }
        // Most likely first; ties by token id, so the order is a function of the logits alone.
        let by_logit = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if s.top_k > 0 && s.top_k < cand.len() {
            cand.select_nth_unstable_by(s.top_k - 1, by_logit);
            cand.truncate(s.top_k);
        }
        if s.top_p < 1.0 || s.top_k > 0 {
            cand.sort_unstable_by(by_logit);
        }
        let max = cand.iter().map(|c| c.1).fold(f64::NEG_INFINITY, f64::max);
        let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        let mut keep = probs.len();
        if s.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= f64::from(s.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut u = self.uniform() * mass;
        for (c, p) in cand[..keep].iter().zip(&probs[..keep]) {
            if u < *p {
                return c.0;
            }
            u -= p;
        }
        cand[keep - 1].0
    }
}

/// The log-probability of a chosen token and the most likely alternatives at its position, from the
/// model's raw logits (before temperature, as vLLM reports them by default).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `n` most likely tokens with their log-probabilities, most likely first (ties by id).
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` at `token`, and the `top` most likely entries.
///
/// ```
/// use recall::engine::sampling::token_logprobs;
/// let lp = token_logprobs(&[0.0, (2.0f32).ln(), f32::NEG_INFINITY], 0, 2);
/// assert!((lp.logprob - (1.0f32 / 3.0).ln()).abs() < 1e-6);
/// assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
/// ```
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = f64::from(max) + z.ln();
    let lp = |i: usize| (f64::from(logits[i]) - lse) as f32;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let n = top.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
    }
    idx.truncate(n);
    idx.sort_unstable_by(by_logit);
    TokenLogprobs {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |_| lp(token as usize)),
        top: idx.into_iter().map(|i| (i as u32, lp(i))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_argmax() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 20,
            seed: Some(7),
        };
        let draw = |seed| {
            let mut sm = Sampler::new(Some(seed));
            (0..64).map(|_| sm.sample(&logits, &s)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let mut sm = Sampler::new(Some(1));
        let k1 = Sampling { top_k: 1, ..s };
        let argmax = (0..50).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)));
        assert_eq!(Some(sm.sample(&logits, &k1) as usize), argmax);
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // p = [0.7, 0.2, 0.1]: top_p 0.6 keeps token 0 only.
        let logits = [0.7f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.6,
            top_k: 0,
            seed: None,
        };
        let mut sm = Sampler::new(Some(3));
        assert!((0..200).all(|_| sm.sample(&logits, &s) == 0));
        // Without a cut, all three appear with roughly their probabilities.
        let all = Sampling { top_p: 1.0, ..s };
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            counts[sm.sample(&logits, &all) as usize] += 1;
        }
        assert!((1900..2300).contains(&counts[0]) && counts[2] > 200, "{counts:?}");
    }
}
