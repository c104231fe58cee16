//! Training the marginal scorer of [`crate::memory::selector`] from utility labels
//! (`recall selector train`, docs/TRAINING.md).
//!
//! # Data
//!
//! A [`LabelledDecision`] is one decision of one episode: the selector's view of it (a
//! [`DecisionContext`]) and the true utility `Q(S)` of every labelled set `S`. Whenever both `S` and
//! `S ∖ {j}` are labelled, `Δ(j | S ∖ {j}) = Q(S) − Q(S ∖ {j})` is an *implied marginal*: one
//! training sample with the 28 features of `j` given `S ∖ {j}`. Samples sharing a decision and a
//! conditioning set form a *state* (e.g. every singleton against `∅`, or every child of one beam
//! parent); the ranking term compares candidates only within a state.
//!
//! # Objective
//!
//! With `z` the z-normalised features (mean and standard deviation fitted on the training split,
//! a constant feature gets std 1), `y = Δ / σ` the targets divided by their root mean square `σ` on
//! the training split, and `p = f(z)` the MLP's output (`fc3(gelu(fc2(gelu(fc1 z))))`, exact GELU),
//! a batch of `N` samples and `P` ordered pairs `(a, b)` (same state, `Δ_a − Δ_b > TIE`) costs
//!
//! ```text
//! L = (1/N) Σ_i (p_i − y_i)²  +  λ · (1/P) Σ_(a,b) softplus(−(p_a − p_b))
//! ```
//!
//! (`λ` = `rank_weight`; the second term is absent when `P = 0`). AdamW (β = 0.9, 0.999, ε = 1e-8,
//! decoupled weight decay on every parameter) minimises it over mini-batches of whole states. The
//! exported file multiplies `fc3` by `σ`, so the scorer predicts marginals in label units. All
//! arithmetic is f64 and every reduction runs in a fixed order, so a seed gives a bitwise-identical
//! file whatever the thread count. `tools/selector_objective.py` is the same objective in PyTorch;
//! `tests/selector_train.rs` checks loss and gradients against it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::memory::selector::{
    EventIndexing, FeatureContext, MarginalModel, MarginalScorer, ScorerParams, FEATURE_NAMES, NUM_FEATURES,
    SCORER_FORMAT,
};
pub use crate::memory::selector_labels::{
    compare_with_recent, implied_marginals, ComposeOutcome, LabelledDecision, States,
};

/// The recency-membership features (`--mask-features recency`): the paper's "retraining without the
/// recency-membership features" control, read as every feature that says whether an event (or a
/// member of `S`) lies in a recent window. `age`, `log_age` and `recency_rank` stay: they order
/// events without naming a window.
pub const RECENCY_FEATURES: [&str; 5] = [
    "in_recent_1",
    "in_recent_2",
    "in_recent_4",
    "in_recent_8",
    "n_recent_in_set",
];

/// Two implied marginals closer than this (in label units) are a tie and form no ranking pair.
pub const TIE: f64 = 1e-6;

/// Settings of [`train`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainConfig {
    /// Hidden width `H` (the paper: 192).
    pub hidden: usize,
    pub epochs: usize,
    pub learning_rate: f64,
    pub weight_decay: f64,
    /// `λ`, the weight of the within-state ranking term.
    pub rank_weight: f64,
    /// Samples per mini-batch (whole states are added until it is reached).
    pub batch_samples: usize,
    /// Fraction of episodes held out (at least one when there are two or more episodes).
    pub holdout: f64,
    pub seed: u64,
    /// How features count ages (recorded in the file as `event_indexing`).
    pub indexing: EventIndexing,
    /// Features held at 0 in training and cut from the exported scorer (names of
    /// [`FEATURE_NAMES`]; recorded as `feature_mask`).
    pub masked: Vec<String>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            hidden: 192,
            epochs: 60,
            learning_rate: 1e-3,
            weight_decay: 1e-4,
            rank_weight: 1.0,
            batch_samples: 256,
            holdout: 0.2,
            seed: 0,
            indexing: EventIndexing::default(),
            masked: Vec::new(),
        }
    }
}

impl TrainConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidRequest(format!("selector train: {m}")));
        if self.hidden == 0 || self.hidden > 4096 {
            return bad(format!("hidden {} (expected 1..=4096)", self.hidden));
        }
        if self.epochs == 0 {
            return bad("epochs must be at least 1".into());
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return bad(format!("learning rate {} (expected > 0)", self.learning_rate));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!("weight decay {} (expected >= 0)", self.weight_decay));
        }
        if !(self.rank_weight.is_finite() && self.rank_weight >= 0.0) {
            return bad(format!("rank weight {} (expected >= 0)", self.rank_weight));
        }
        if self.batch_samples == 0 {
            return bad("batch samples must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.holdout) {
            return bad(format!("holdout {} (expected 0 <= holdout < 1)", self.holdout));
        }
        self.mask_indices().map(|_| ())
    }

    /// The positions of the masked features; an unknown name is an error that lists the valid ones.
    pub fn mask_indices(&self) -> Result<Vec<usize>> {
        self.masked
            .iter()
            .map(|name| {
                FEATURE_NAMES.iter().position(|f| f == name).ok_or_else(|| {
                    Error::InvalidRequest(format!(
                        "selector train: unknown feature `{name}` to mask (features: {}; or `recency`)",
                        FEATURE_NAMES.join(", ")
                    ))
                })
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------------
// The MLP in f64 with its gradient.

/// The scorer's parameters in f64, flat: `fc1.weight [H,28]`, `fc1.bias [H]`, `fc2.weight [H,H]`,
/// `fc2.bias [H]`, `fc3.weight [1,H]`, `fc3.bias [1]` (PyTorch's row-major layout, in that order).
#[derive(Debug, Clone, PartialEq)]
pub struct Mlp {
    pub hidden: usize,
    pub theta: Vec<f64>,
}

/// Offsets of the six tensors in [`Mlp::theta`].
struct Layout {
    w1: usize,
    b1: usize,
    w2: usize,
    b2: usize,
    w3: usize,
    b3: usize,
    len: usize,
}

impl Layout {
    fn of(h: usize) -> Self {
        let w1 = 0;
        let b1 = w1 + h * NUM_FEATURES;
        let w2 = b1 + h;
        let b2 = w2 + h * h;
        let w3 = b2 + h;
        let b3 = w3 + h;
        Layout {
            w1,
            b1,
            w2,
            b2,
            w3,
            b3,
            len: b3 + 1,
        }
    }
}

/// The six tensors' names, in [`Mlp::theta`] order.
pub const PARAM_NAMES: [&str; 6] = [
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
    "fc3.weight",
    "fc3.bias",
];

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

fn gelu_grad(x: f64) -> f64 {
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)) + x * pdf
}

/// Activations of one sample kept for the backward pass.
struct Trace {
    h1: Vec<f64>,
    a1: Vec<f64>,
    h2: Vec<f64>,
    a2: Vec<f64>,
    p: f64,
}

/// Samples per parallel chunk of the forward and backward passes. Fixed, so that the partial
/// gradients are summed in the same order whatever the thread count.
const CHUNK: usize = 32;

impl Mlp {
    /// PyTorch's `nn.Linear` initialisation (`U(−1/√fan_in, 1/√fan_in)` for weights and biases)
    /// from a ChaCha8 stream seeded with `seed`.
    pub fn init(hidden: usize, seed: u64) -> Self {
        let l = Layout::of(hidden);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut theta = vec![0.0; l.len];
        let mut fill = |range: std::ops::Range<usize>, fan_in: usize| {
            let bound = 1.0 / (fan_in as f64).sqrt();
            for v in &mut theta[range] {
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                *v = (2.0 * u - 1.0) * bound;
            }
        };
        fill(l.w1..l.w2, NUM_FEATURES);
        fill(l.w2..l.w3, hidden);
        fill(l.w3..l.len, hidden);
        Mlp { hidden, theta }
    }

    fn forward(&self, z: &[f64; NUM_FEATURES]) -> Trace {
        let (h, l) = (self.hidden, Layout::of(self.hidden));
        let th = &self.theta;
        let h1: Vec<f64> = (0..h)
            .map(|j| {
                let row = &th[l.w1 + j * NUM_FEATURES..l.w1 + (j + 1) * NUM_FEATURES];
                th[l.b1 + j] + row.iter().zip(z).map(|(w, x)| w * x).sum::<f64>()
            })
            .collect();
        let a1: Vec<f64> = h1.iter().map(|&x| gelu(x)).collect();
        let h2: Vec<f64> = (0..h)
            .map(|j| {
                let row = &th[l.w2 + j * h..l.w2 + (j + 1) * h];
                th[l.b2 + j] + row.iter().zip(&a1).map(|(w, x)| w * x).sum::<f64>()
            })
            .collect();
        let a2: Vec<f64> = h2.iter().map(|&x| gelu(x)).collect();
        let p = th[l.b3]
            + th[l.w3..l.w3 + h]
                .iter()
                .zip(&a2)
                .map(|(w, x)| w * x)
                .sum::<f64>();
        Trace { h1, a1, h2, a2, p }
    }

    /// Adds `dp · ∂p/∂θ` of one sample to `grad`.
    fn backward(&self, z: &[f64; NUM_FEATURES], tr: &Trace, dp: f64, grad: &mut [f64]) {
        let (h, l) = (self.hidden, Layout::of(self.hidden));
        let th = &self.theta;
        grad[l.b3] += dp;
        let mut dh2 = vec![0.0; h];
        for j in 0..h {
            grad[l.w3 + j] += dp * tr.a2[j];
            dh2[j] = dp * th[l.w3 + j] * gelu_grad(tr.h2[j]);
        }
        let mut da1 = vec![0.0; h];
        for j in 0..h {
            let g = dh2[j];
            grad[l.b2 + j] += g;
            let row = l.w2 + j * h;
            for k in 0..h {
                grad[row + k] += g * tr.a1[k];
                da1[k] += g * th[row + k];
            }
        }
        for j in 0..h {
            let g = da1[j] * gelu_grad(tr.h1[j]);
            grad[l.b1 + j] += g;
            let row = l.w1 + j * NUM_FEATURES;
            for k in 0..NUM_FEATURES {
                grad[row + k] += g * z[k];
            }
        }
    }

    /// The predictions for `z`, in order.
    pub fn predict(&self, z: &[[f64; NUM_FEATURES]]) -> Vec<f64> {
        z.par_chunks(CHUNK)
            .flat_map_iter(|c| c.iter().map(|x| self.forward(x).p).collect::<Vec<_>>())
            .collect()
    }
}

/// One mini-batch of the objective: normalised features, scaled targets, and ordered pairs
/// `(a, b)` meaning sample `a` should score above sample `b`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    pub z: Vec<[f64; NUM_FEATURES]>,
    pub y: Vec<f64>,
    pub pairs: Vec<(usize, usize)>,
}

/// The objective `L` of the module docs on one batch and its gradient in [`Mlp::theta`] order.
pub fn objective(mlp: &Mlp, batch: &Batch, rank_weight: f64) -> (f64, Vec<f64>) {
    let n = batch.z.len();
    let traces: Vec<Trace> = batch
        .z
        .par_chunks(CHUNK)
        .flat_map_iter(|c| c.iter().map(|x| mlp.forward(x)).collect::<Vec<_>>())
        .collect();
    let mut dp = vec![0.0; n];
    let mut loss = 0.0;
    for i in 0..n {
        let r = traces[i].p - batch.y[i];
        loss += r * r / n as f64;
        dp[i] = 2.0 * r / n as f64;
    }
    if !batch.pairs.is_empty() && rank_weight > 0.0 {
        let w = rank_weight / batch.pairs.len() as f64;
        for &(a, b) in &batch.pairs {
            let d = traces[a].p - traces[b].p;
            // softplus(−d) and its derivative −σ(−d), both stable for large |d|.
            let softplus = if d > 0.0 {
                (-d).exp().ln_1p()
            } else {
                -d + d.exp().ln_1p()
            };
            let sig = if d > 0.0 {
                let e = (-d).exp();
                e / (1.0 + e)
            } else {
                1.0 / (1.0 + d.exp())
            };
            loss += w * softplus;
            dp[a] -= w * sig;
            dp[b] += w * sig;
        }
    }
    let len = Layout::of(mlp.hidden).len;
    let partials: Vec<Vec<f64>> = (0..n)
        .collect::<Vec<_>>()
        .par_chunks(CHUNK)
        .map(|idx| {
            let mut g = vec![0.0; len];
            for &i in idx {
                mlp.backward(&batch.z[i], &traces[i], dp[i], &mut g);
            }
            g
        })
        .collect();
    let mut grad = vec![0.0; len];
    for g in &partials {
        for (acc, v) in grad.iter_mut().zip(g) {
            *acc += v;
        }
    }
    (loss, grad)
}

/// AdamW over a flat parameter vector.
struct AdamW {
    m: Vec<f64>,
    v: Vec<f64>,
    step: i32,
    lr: f64,
    weight_decay: f64,
}

impl AdamW {
    const BETA1: f64 = 0.9;
    const BETA2: f64 = 0.999;
    const EPS: f64 = 1e-8;

    fn new(len: usize, lr: f64, weight_decay: f64) -> Self {
        AdamW {
            m: vec![0.0; len],
            v: vec![0.0; len],
            step: 0,
            lr,
            weight_decay,
        }
    }

    fn update(&mut self, theta: &mut [f64], grad: &[f64]) {
        self.step += 1;
        let c1 = 1.0 - Self::BETA1.powi(self.step);
        let c2 = 1.0 - Self::BETA2.powi(self.step);
        for i in 0..theta.len() {
            theta[i] *= 1.0 - self.lr * self.weight_decay;
            self.m[i] = Self::BETA1 * self.m[i] + (1.0 - Self::BETA1) * grad[i];
            self.v[i] = Self::BETA2 * self.v[i] + (1.0 - Self::BETA2) * grad[i] * grad[i];
            let m_hat = self.m[i] / c1;
            let v_hat = self.v[i] / c2;
            theta[i] -= self.lr * m_hat / (v_hat.sqrt() + Self::EPS);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The dataset.

/// One implied marginal with its features.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    x: [f32; NUM_FEATURES],
    delta: f64,
}

/// The samples of one state (contiguous in [`Split::samples`]).
#[derive(Debug, Clone, PartialEq)]
struct State {
    start: usize,
    len: usize,
}

/// The samples and states of one split.
#[derive(Debug, Clone, Default)]
struct Split {
    samples: Vec<Sample>,
    states: Vec<State>,
    /// Decisions of the split (indices into the caller's slice).
    decisions: Vec<usize>,
    episodes: usize,
}

impl Split {
    fn build(
        decisions: &[LabelledDecision],
        chosen: Vec<usize>,
        episodes: usize,
        cfg: &TrainConfig,
    ) -> Result<Self> {
        let masked = cfg.mask_indices()?;
        let mut split = Split {
            decisions: chosen,
            episodes,
            ..Split::default()
        };
        for &di in &split.decisions {
            let d = &decisions[di];
            let fc =
                FeatureContext::with_indexing(&d.context, cfg.indexing).map_err(|e| context_error(d, e))?;
            for (set, marginals) in implied_marginals(d) {
                let start = split.samples.len();
                for (j, delta) in marginals {
                    let mut x = fc.features(j, &set).map_err(|e| context_error(d, e))?;
                    masked.iter().for_each(|&k| x[k] = 0.0);
                    split.samples.push(Sample { x, delta });
                }
                split.states.push(State {
                    start,
                    len: split.samples.len() - start,
                });
            }
        }
        Ok(split)
    }

    /// Ordered pairs within each state, as sample indices.
    fn pairs_of(&self, state: &State, offset: usize, out: &mut Vec<(usize, usize)>) {
        for a in 0..state.len {
            for b in 0..state.len {
                let (da, db) = (
                    self.samples[state.start + a].delta,
                    self.samples[state.start + b].delta,
                );
                if da - db > TIE {
                    out.push((offset + a, offset + b));
                }
            }
        }
    }

    /// Refills `batch` with whole states `order[at..]` (features from `z`, targets divided by
    /// `scale`) until it holds at least `batch_samples` samples or the states run out; returns the
    /// position in `order` after the last state taken.
    fn fill_batch(
        &self,
        batch: &mut Batch,
        order: &[usize],
        mut at: usize,
        z: &[[f64; NUM_FEATURES]],
        scale: f64,
        batch_samples: usize,
    ) -> usize {
        batch.z.clear();
        batch.y.clear();
        batch.pairs.clear();
        while at < order.len() && batch.z.len() < batch_samples {
            let st = &self.states[order[at]];
            self.pairs_of(st, batch.z.len(), &mut batch.pairs);
            let range = st.start..st.start + st.len;
            batch.z.extend_from_slice(&z[range.clone()]);
            batch
                .y
                .extend(self.samples[range].iter().map(|s| s.delta / scale));
            at += 1;
        }
        at
    }
}

fn context_error(d: &LabelledDecision, e: Error) -> Error {
    Error::InvalidRequest(format!(
        "labels of episode {} decision t={}: {e}",
        d.episode, d.context.t
    ))
}

/// Episodes sorted, shuffled by the seed, and the first `⌈holdout · n⌉` (at least one of two or
/// more when `holdout > 0`) held out.
fn split_episodes(decisions: &[LabelledDecision], holdout: f64, seed: u64) -> BTreeSet<String> {
    let mut episodes: Vec<&str> = decisions
        .iter()
        .map(|d| d.episode.as_str())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5e1e_c70f);
    for i in (1..episodes.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        episodes.swap(i, j);
    }
    let n = episodes.len();
    let mut held = (holdout * n as f64).ceil() as usize;
    if holdout > 0.0 && n >= 2 {
        held = held.clamp(1, n - 1);
    } else {
        held = 0;
    }
    episodes[..held].iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------------------------------------------
// Training and the report.

/// Metrics of the trained scorer on one split.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SplitMetrics {
    pub episodes: usize,
    pub decisions: usize,
    pub samples: usize,
    pub states: usize,
    pub pairs: usize,
    /// Root mean square error of the predicted marginals (label units).
    pub rmse: f64,
    /// The same for predicting the training split's mean marginal.
    pub baseline_rmse: f64,
    /// Fraction of within-state pairs ordered correctly (ties in the prediction count as wrong).
    pub ranking_accuracy: f64,
    /// Paper composition against Recent-B at every budget with a labelled Recent-B anchor.
    pub compose: ComposeOutcome,
}

/// What [`train`] produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainReport {
    pub config: TrainConfig,
    /// The held-out episodes (sorted).
    pub heldout_episodes: Vec<String>,
    /// Mean training loss of the first and last epoch.
    pub first_epoch_loss: f64,
    pub last_epoch_loss: f64,
    /// The root mean square of the training marginals (`σ` of the module docs).
    pub target_scale: f64,
    pub train: SplitMetrics,
    pub heldout: Option<SplitMetrics>,
}

/// A trained scorer: its parameters (as the file stores them) and the report.
#[derive(Debug, Clone)]
pub struct Trained {
    pub params: ScorerParams,
    pub report: TrainReport,
}

impl Trained {
    /// The scorer these parameters define.
    pub fn scorer(&self) -> Result<MarginalScorer> {
        Ok(MarginalScorer::from_params(&self.params)?.with_indexing(self.report.config.indexing))
    }

    /// Writes the scorer file (docs of [`crate::memory::selector`]) with `extra` metadata (e.g. what
    /// the labels were made with) next to `format`, `hidden`, `feature_names` and `report`. Keys
    /// and tensors are written in a fixed order, so equal inputs give equal bytes.
    pub fn save(&self, path: &Path, extra: &BTreeMap<String, String>) -> Result<()> {
        let p = &self.params;
        let h = p.fc1_bias.len();
        let mut meta = extra.clone();
        meta.insert("format".into(), SCORER_FORMAT.into());
        meta.insert("hidden".into(), h.to_string());
        meta.insert("feature_names".into(), FEATURE_NAMES.join(","));
        meta.insert("event_indexing".into(), self.report.config.indexing.name().into());
        if !self.report.config.masked.is_empty() {
            meta.insert("feature_mask".into(), self.report.config.masked.join(","));
        }
        meta.insert(
            "report".into(),
            serde_json::to_string(&self.report).map_err(|e| Error::InvalidRequest(e.to_string()))?,
        );
        let fc3_bias = [p.fc3_bias];
        let tensors: [(&str, Vec<usize>, &[f32]); 8] = [
            ("fc1.bias", vec![h], &p.fc1_bias),
            ("fc1.weight", vec![h, NUM_FEATURES], &p.fc1_weight),
            ("fc2.bias", vec![h], &p.fc2_bias),
            ("fc2.weight", vec![h, h], &p.fc2_weight),
            ("fc3.bias", vec![1], &fc3_bias),
            ("fc3.weight", vec![1, h], &p.fc3_weight),
            ("feature_mean", vec![NUM_FEATURES], &p.feature_mean),
            ("feature_std", vec![NUM_FEATURES], &p.feature_std),
        ];
        write_f32_safetensors(path, &tensors, &meta)
    }
}

/// Writes f32 tensors as safetensors with sorted metadata keys (serde_json's map is ordered).
fn write_f32_safetensors(
    path: &Path,
    tensors: &[(&str, Vec<usize>, &[f32])],
    meta: &BTreeMap<String, String>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let n = data.len() * 4;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    header.insert("__metadata__".into(), serde_json::json!(meta));
    let mut head = serde_json::to_string(&header)
        .map_err(|e| Error::InvalidRequest(format!("safetensors header: {e}")))?
        .into_bytes();
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let mut bytes = Vec::with_capacity(8 + head.len() + offset);
    bytes.extend_from_slice(&(head.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&head);
    for (_, _, data) in tensors {
        for v in data.iter() {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    crate::atomic::write_atomic(path, bytes)
}

/// Feature means and standard deviations (population) of `samples`; a constant feature gets std 1.
fn fit_normalisation(samples: &[Sample]) -> ([f64; NUM_FEATURES], [f64; NUM_FEATURES]) {
    let n = samples.len().max(1) as f64;
    let mut mean = [0.0; NUM_FEATURES];
    for s in samples {
        for (m, &x) in mean.iter_mut().zip(&s.x) {
            *m += x as f64 / n;
        }
    }
    let mut var = [0.0; NUM_FEATURES];
    for s in samples {
        for k in 0..NUM_FEATURES {
            let d = s.x[k] as f64 - mean[k];
            var[k] += d * d / n;
        }
    }
    let std = var.map(|v| if v.sqrt() > 1e-6 { v.sqrt() } else { 1.0 });
    // The file stores f32; normalise with exactly the stored values so training sees what serving does.
    (mean.map(|m| m as f32 as f64), std.map(|s| s as f32 as f64))
}

fn normalise(
    x: &[f32; NUM_FEATURES],
    mean: &[f64; NUM_FEATURES],
    std: &[f64; NUM_FEATURES],
) -> [f64; NUM_FEATURES] {
    std::array::from_fn(|k| (x[k] as f64 - mean[k]) / std[k])
}

/// Trains a scorer on `decisions` (docs: module). `progress(epoch, mean_loss)` is called after every
/// epoch.
pub fn train(
    decisions: &[LabelledDecision],
    cfg: &TrainConfig,
    mut progress: impl FnMut(usize, f64),
) -> Result<Trained> {
    cfg.validate()?;
    let (heldout_set, train_split, held_split) = split_decisions(decisions, cfg)?;
    let (mean, std) = fit_normalisation(&train_split.samples);
    let n = train_split.samples.len() as f64;
    let rms = (train_split.samples.iter().map(|s| s.delta * s.delta).sum::<f64>() / n).sqrt();
    let scale = if rms > 1e-12 { rms } else { 1.0 };
    let z: Vec<[f64; NUM_FEATURES]> = train_split
        .samples
        .iter()
        .map(|s| normalise(&s.x, &mean, &std))
        .collect();
    let (mlp, first_loss, last_loss) = fit(&train_split, &z, scale, cfg, &mut progress)?;

    let mut params = export(&mlp, &mean, &std, scale);
    cut_masked(&mut params, &cfg.mask_indices()?);
    let scorer = MarginalScorer::from_params(&params)?.with_indexing(cfg.indexing);
    let baseline = train_split.samples.iter().map(|s| s.delta).sum::<f64>() / n;
    let train_metrics = evaluate(decisions, &train_split, &scorer, baseline);
    let heldout =
        (!held_split.decisions.is_empty()).then(|| evaluate(decisions, &held_split, &scorer, baseline));
    Ok(Trained {
        params,
        report: TrainReport {
            config: cfg.clone(),
            heldout_episodes: heldout_set.into_iter().collect(),
            first_epoch_loss: first_loss,
            last_epoch_loss: last_loss,
            target_scale: scale,
            train: train_metrics,
            heldout,
        },
    })
}

/// Holds out episodes ([`split_episodes`]) and builds the held-out and training splits; the training
/// split must have samples. Returns the held-out episodes, the training split and the held-out one.
fn split_decisions(
    decisions: &[LabelledDecision],
    cfg: &TrainConfig,
) -> Result<(BTreeSet<String>, Split, Split)> {
    let heldout_set = split_episodes(decisions, cfg.holdout, cfg.seed);
    let (mut train_idx, mut held_idx) = (Vec::new(), Vec::new());
    for (i, d) in decisions.iter().enumerate() {
        if heldout_set.contains(&d.episode) {
            held_idx.push(i);
        } else {
            train_idx.push(i);
        }
    }
    let n_episodes = decisions
        .iter()
        .map(|d| &d.episode)
        .collect::<BTreeSet<_>>()
        .len();
    let train_split = Split::build(decisions, train_idx, n_episodes - heldout_set.len(), cfg)?;
    let held_split = Split::build(decisions, held_idx, heldout_set.len(), cfg)?;
    if train_split.samples.is_empty() {
        return Err(Error::InvalidRequest(
            "selector train: the training split has no implied marginals (a marginal needs Q(S) and \
             Q(S without j) both labelled; label with `recall episode label`)"
                .into(),
        ));
    }
    Ok((heldout_set, train_split, held_split))
}

/// The epoch loop: AdamW on shuffled batches of whole states (`z` the split's normalised features,
/// targets divided by `scale`). Returns the MLP and the first and last epochs' mean losses.
fn fit(
    split: &Split,
    z: &[[f64; NUM_FEATURES]],
    scale: f64,
    cfg: &TrainConfig,
    progress: &mut impl FnMut(usize, f64),
) -> Result<(Mlp, f64, f64)> {
    let mut mlp = Mlp::init(cfg.hidden, cfg.seed);
    let mut opt = AdamW::new(mlp.theta.len(), cfg.learning_rate, cfg.weight_decay);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add(1));
    let mut order: Vec<usize> = (0..split.states.len()).collect();
    let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
    let mut batch = Batch::default();
    for epoch in 0..cfg.epochs {
        for i in (1..order.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let (mut total, mut batches) = (0.0, 0usize);
        let mut at = 0;
        while at < order.len() {
            at = split.fill_batch(&mut batch, &order, at, z, scale, cfg.batch_samples);
            let (loss, grad) = objective(&mlp, &batch, cfg.rank_weight);
            if !loss.is_finite() {
                return Err(Error::InvalidRequest(format!(
                    "selector train: the loss became {loss} in epoch {}; lower --lr",
                    epoch + 1
                )));
            }
            opt.update(&mut mlp.theta, &grad);
            total += loss;
            batches += 1;
        }
        let mean_loss = total / batches.max(1) as f64;
        if epoch == 0 {
            first_loss = mean_loss;
        }
        last_loss = mean_loss;
        progress(epoch + 1, mean_loss);
    }
    Ok((mlp, first_loss, last_loss))
}

/// The file's parameters: f32, with `σ` folded into `fc3`.
fn export(mlp: &Mlp, mean: &[f64; NUM_FEATURES], std: &[f64; NUM_FEATURES], scale: f64) -> ScorerParams {
    let l = Layout::of(mlp.hidden);
    let th = &mlp.theta;
    let f = |r: std::ops::Range<usize>, k: f64| th[r].iter().map(|&v| (v * k) as f32).collect::<Vec<_>>();
    ScorerParams {
        feature_mean: mean.iter().map(|&v| v as f32).collect(),
        feature_std: std.iter().map(|&v| v as f32).collect(),
        fc1_weight: f(l.w1..l.b1, 1.0),
        fc1_bias: f(l.b1..l.w2, 1.0),
        fc2_weight: f(l.w2..l.b2, 1.0),
        fc2_bias: f(l.b2..l.w3, 1.0),
        fc3_weight: f(l.w3..l.b3, scale),
        fc3_bias: (th[l.b3] * scale) as f32,
    }
}

/// Removes the masked features from the scorer: their `fc1` columns are zeroed and their
/// normalisation made the identity, so whatever value serving computes for them has no effect, and on
/// the training inputs (where they were 0) the scorer is unchanged.
fn cut_masked(p: &mut ScorerParams, masked: &[usize]) {
    for &k in masked {
        p.feature_mean[k] = 0.0;
        p.feature_std[k] = 1.0;
        p.fc1_weight.chunks_mut(NUM_FEATURES).for_each(|row| row[k] = 0.0);
    }
}

/// Metrics of `scorer` on one split (`baseline`: the constant prediction for `baseline_rmse`).
fn evaluate(
    decisions: &[LabelledDecision],
    split: &Split,
    scorer: &MarginalScorer,
    baseline: f64,
) -> SplitMetrics {
    let rows: Vec<[f32; NUM_FEATURES]> = split.samples.iter().map(|s| s.x).collect();
    let mut pred = Vec::new();
    scorer.score_batch(&rows, &mut pred);
    let n = split.samples.len().max(1) as f64;
    let rmse = (split
        .samples
        .iter()
        .zip(&pred)
        .map(|(s, &p)| (p as f64 - s.delta).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let baseline_rmse = (split
        .samples
        .iter()
        .map(|s| (baseline - s.delta).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let mut pairs = Vec::new();
    for st in &split.states {
        split.pairs_of(st, st.start, &mut pairs);
    }
    let right = pairs.iter().filter(|&&(a, b)| pred[a] > pred[b]).count();
    let mut compose = ComposeOutcome::default();
    for &di in &split.decisions {
        compare_with_recent(&decisions[di], scorer, scorer.indexing(), &mut compose);
    }
    SplitMetrics {
        episodes: split.episodes,
        decisions: split.decisions.len(),
        samples: split.samples.len(),
        states: split.states.len(),
        pairs: pairs.len(),
        rmse,
        baseline_rmse,
        ranking_accuracy: if pairs.is_empty() {
            f64::NAN
        } else {
            right as f64 / pairs.len() as f64
        },
        compose,
    }
}

/// The report as a Markdown table (train and held-out columns).
pub fn report_table(r: &TrainReport) -> String {
    let cols: Vec<(&str, &SplitMetrics)> = std::iter::once(("train", &r.train))
        .chain(r.heldout.as_ref().map(|h| ("held-out", h)))
        .collect();
    let mut s = String::from("| metric |");
    for (name, _) in &cols {
        s.push_str(&format!(" {name} |"));
    }
    s.push_str("\n|---|");
    s.push_str(&"---:|".repeat(cols.len()));
    s.push('\n');
    let mut row = |label: &str, f: &dyn Fn(&SplitMetrics) -> String| {
        s.push_str(&format!("| {label} |"));
        for (_, m) in &cols {
            s.push_str(&format!(" {} |", f(m)));
        }
        s.push('\n');
    };
    row("episodes / decisions", &|m| {
        format!("{} / {}", m.episodes, m.decisions)
    });
    row("implied marginals (states, pairs)", &|m| {
        format!("{} ({}, {})", m.samples, m.states, m.pairs)
    });
    row("RMSE of the marginal (mean predictor)", &|m| {
        format!("{:.4} ({:.4})", m.rmse, m.baseline_rmse)
    });
    row("pairwise ranking accuracy within states", &|m| {
        format!("{:.3}", m.ranking_accuracy)
    });
    row(
        "composed set vs Recent-B: beats / loses / kept / unscored",
        &|m| {
            let c = &m.compose;
            format!("{} / {} / {} / {}", c.beats, c.loses, c.kept_recent, c.unscored)
        },
    );
    row("composition queries off the labelled states", &|m| {
        let c = &m.compose;
        format!("{} of {}", c.off_label_queries, c.queries)
    });
    if r.heldout.is_none() {
        s.push_str("\n(no held-out split: fewer than two episodes, or --holdout 0)\n");
    }
    s
}
