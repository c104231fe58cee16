//! The learned restoration selector: which past events get their screenshots back under a budget of
//! `B` history images.
//!
//! Three parts:
//!
//! 1. **Features** ([`features`], [`FeatureContext`]): 28 numbers describing one candidate event
//!    relative to the current decision and to an already-selected set `S` (20 candidate features,
//!    then 8 set-context features; order = [`FEATURE_NAMES`]).
//! 2. **Marginal scorer** ([`MarginalScorer`]): a 28→H→H→1 MLP predicting the marginal utility
//!    `Δ(j | S)` of adding event `j` to `S`. Any [`MarginalModel`] (including a closure) can stand in.
//! 3. **Composition** ([`compose`], [`compose_with`]): an exact-`B` set, in one of three [`Mode`]s.
//!    [`Mode::Paper`]: a small beam over swap sequences initialized at Recent-B, where an older
//!    event enters only by beating the predicted marginal of the recent event it evicts, so
//!    declining every swap recovers Recent-B exactly. [`Mode::Greedy`]: the same swap rule as a
//!    single greedy loop (weakest recent event against strongest challenger). [`Mode::Reference`]:
//!    the authors' code, a beam that builds the set from empty over the deduplicated pool.
//!    `max_replacements` caps the events outside Recent-B in all three.
//!
//! # Definitions
//!
//! Notation: `t` is the current decision step (completed steps are `1..t-1`), `s` a candidate's step,
//! `age = t - s` (≥ 1). These follow the authors' deployment code (`mobileworld_selector_features.py`,
//! laid out as `selector_v4_features.py`):
//!
//! * **Pool** ([`dedup_pool`]): events deduplicated by `image_hash`, keeping the most recent event of
//!   each hash; ascending steps. An older event with the same hash is an *alias* of the kept one.
//! * **Recent-B** ([`recent_b`]): the `min(B, n)` largest steps among all events (no dedup).
//! * `age`; `log_age = ln(age)`; `recency_rank` = number of pool events with a larger step (0 = the
//!   most recent pool event); `relative_position = s / max(t-1, 1)`; `in_recent_1/2/4/8` =
//!   `age ≤ 2/3/5/9` (the window of `B` recent events ends at `t-1`, so "in Recent-B" is `age ≤ B+1`);
//!   `pool_size` = pool length; `trajectory_length = t - 1`.
//! * `witness_match` = the event's `witness` flag; `witness_count` = number of pool events that are
//!   witnesses; `witness_rank` = number of pool witnesses with a larger step (−1 if not a witness).
//! * One-hot of `next_bucket` (click, type, key, scroll, other).
//! * `coord_distance`: Euclidean distance on the 0–999 grid between `next_point` and the
//!   `reference_point`, computed only for witnesses (as the authors do); −1 if either point is missing
//!   or the event is not a witness.
//! * `dedup_multiplicity`: for a pool event, 1 + the number of its aliases; 1 for an alias.
//! * Set context for a non-empty `S`: `set_size = |S|`; `min/mean_age_gap_to_set` over `|s - s'|`;
//!   `n_recent_in_set` = members with age ≤ 5; `n_witness_in_set`; `witness_redundancy` = the
//!   candidate is a witness and `S` holds one; `event_older_than_set` = `s < min(S)`;
//!   `duplicate_of_set_member` = some member has the candidate's image hash. Empty `S` gives
//!   `[0, −1, −1, 0, 0, 0, 0, 0]`.
//!
//! # Scorer file format (safetensors, all f32/bf16/f16)
//!
//! | tensor | shape | |
//! |---|---|---|
//! | `feature_mean` | `[28]` | z-normalisation mean |
//! | `feature_std` | `[28]` | z-normalisation std (must be > 0) |
//! | `fc1.weight`, `fc1.bias` | `[H, 28]`, `[H]` | first Linear |
//! | `fc2.weight`, `fc2.bias` | `[H, H]`, `[H]` | second Linear |
//! | `fc3.weight`, `fc3.bias` | `[1, H]`, `[1]` | readout |
//!
//! Metadata (all optional, checked when present): `format` = `recall.selector.v1`, `hidden` = `H`,
//! `feature_names` = the 28 names of [`FEATURE_NAMES`] joined by `,`. The forward pass is
//! `fc3(gelu(fc2(gelu(fc1((x - mean) / std)))))` with the exact (erf) GELU, as in PyTorch's
//! `nn.GELU()`. `tools/convert_selector_pt.py` writes this file from the reference trainer's
//! `marginal_scorer.pt`.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use crate::error::{Error, Result};
use crate::model::loader::Checkpoint;

/// Number of candidate features.
pub const CANDIDATE_FEATURES: usize = 20;
/// Number of set-context features.
pub const SET_FEATURES: usize = 8;
/// Total feature count.
pub const NUM_FEATURES: usize = CANDIDATE_FEATURES + SET_FEATURES;
/// Default beam width and children kept per parent in [`Mode::Reference`] (the authors' `--selector-beam 3`).
pub const DEFAULT_BEAM: usize = 3;
/// The `format` metadata value of a scorer file.
pub const SCORER_FORMAT: &str = "recall.selector.v1";

/// Feature names in vector order (the authors' names).
pub const FEATURE_NAMES: [&str; NUM_FEATURES] = [
    "age",
    "log_age",
    "recency_rank",
    "relative_position",
    "in_recent_1",
    "in_recent_2",
    "in_recent_4",
    "in_recent_8",
    "pool_size",
    "trajectory_length",
    "witness_match",
    "witness_count",
    "witness_rank",
    "action_type_click",
    "action_type_type",
    "action_type_key",
    "action_type_scroll",
    "action_type_other",
    "coord_distance",
    "dedup_multiplicity",
    "set_size",
    "min_age_gap_to_set",
    "mean_age_gap_to_set",
    "n_recent_in_set",
    "n_witness_in_set",
    "witness_redundancy",
    "event_older_than_set",
    "duplicate_of_set_member",
];

/// Coarse type of the action taken right after a candidate event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActionBucket {
    Click,
    Type,
    Key,
    Scroll,
    Other,
}

/// What the selector knows about one past event (a completed step) of the current decision.
#[derive(Debug, Clone, PartialEq)]
pub struct EventInfo {
    /// 1-based global step number.
    pub step: usize,
    /// Content hash of its screenshot (for dedup).
    pub image_hash: u64,
    /// The action taken right after the candidate.
    pub next_bucket: ActionBucket,
    /// That action's coordinate on the 0–999 grid.
    pub next_point: Option<(f64, f64)>,
    /// That action is equivalent to the reference action (pass 1's proposal).
    pub witness: bool,
}

/// One decision: the current step and every completed event.
///
/// ```
/// use recall::memory::selector::{ActionBucket, DecisionContext, EventInfo};
/// let ctx = DecisionContext {
///     t: 3,
///     reference_point: None,
///     events: (1..3)
///         .map(|step| EventInfo {
///             step,
///             image_hash: step as u64,
///             next_bucket: ActionBucket::Click,
///             next_point: None,
///             witness: false,
///         })
///         .collect(),
/// };
/// assert_eq!(recall::memory::selector::recent_b(&ctx, 1), vec![2]);
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecisionContext {
    /// Current decision step; completed steps are `1..t-1`.
    pub t: usize,
    /// The reference action's coordinate (0–999 grid), if it has one.
    pub reference_point: Option<(f64, f64)>,
    /// The completed events, in any order (steps must be distinct and in `1..t`).
    pub events: Vec<EventInfo>,
}

/// The `min(budget, n)` most recent event steps, ascending.
///
/// ```
/// # use recall::memory::selector::*;
/// let ctx = DecisionContext { t: 1, reference_point: None, events: vec![] };
/// assert!(recent_b(&ctx, 4).is_empty());
/// ```
pub fn recent_b(ctx: &DecisionContext, budget: usize) -> Vec<usize> {
    let mut steps: Vec<usize> = ctx.events.iter().map(|e| e.step).collect();
    steps.sort_unstable();
    steps.dedup();
    let start = steps.len().saturating_sub(budget);
    steps[start..].to_vec()
}

/// The candidate pool: steps deduplicated by image hash (the most recent event of each hash is kept),
/// ascending.
///
/// ```
/// # use recall::memory::selector::*;
/// let ev = |step, image_hash| EventInfo {
///     step, image_hash, next_bucket: ActionBucket::Other, next_point: None, witness: false,
/// };
/// let ctx = DecisionContext { t: 4, reference_point: None, events: vec![ev(1, 7), ev(2, 9), ev(3, 7)] };
/// assert_eq!(dedup_pool(&ctx)?, vec![2, 3]);
/// # Ok::<(), recall::Error>(())
/// ```
pub fn dedup_pool(ctx: &DecisionContext) -> Result<Vec<usize>> {
    Ok(FeatureContext::new(ctx)?.pool().to_vec())
}

/// Precomputed per-decision state for fast feature vectors (pool, aliases, candidate features).
///
/// ```
/// # use recall::memory::selector::*;
/// let ev = |step| EventInfo {
///     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None, witness: false,
/// };
/// let ctx = DecisionContext { t: 5, reference_point: None, events: (1..5).map(ev).collect() };
/// let fc = FeatureContext::new(&ctx)?;
/// let f = fc.features(2, &[4])?;
/// assert_eq!(f[0], 3.0); // age
/// assert_eq!(f[20], 1.0); // set_size
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct FeatureContext<'a> {
    ctx: &'a DecisionContext,
    /// Indices into `ctx.events`, sorted by step.
    order: Vec<usize>,
    /// Steps, ascending (parallel to `order`).
    steps: Vec<usize>,
    /// Per sorted position: the sorted position of the kept event with the same hash.
    canon: Vec<usize>,
    /// Pool steps, ascending.
    pool: Vec<usize>,
    /// Per sorted position: the 20 candidate features.
    cand: Vec<[f32; CANDIDATE_FEATURES]>,
}

fn finite_point(p: Option<(f64, f64)>) -> bool {
    p.is_none_or(|(x, y)| x.is_finite() && y.is_finite())
}

impl<'a> FeatureContext<'a> {
    /// Validates `ctx` (steps distinct and in `1..t`, points finite) and precomputes the pool and the
    /// candidate features.
    pub fn new(ctx: &'a DecisionContext) -> Result<Self> {
        if !finite_point(ctx.reference_point) {
            return Err(Error::InvalidRequest(
                "selector: reference_point is not finite".into(),
            ));
        }
        let mut order: Vec<usize> = (0..ctx.events.len()).collect();
        order.sort_by_key(|&i| ctx.events[i].step);
        let steps: Vec<usize> = order.iter().map(|&i| ctx.events[i].step).collect();
        for (pos, &i) in order.iter().enumerate() {
            let e = &ctx.events[i];
            if e.step == 0 || e.step >= ctx.t {
                return Err(Error::InvalidRequest(format!(
                    "selector: event step {} outside the completed steps 1..{} of decision t={}",
                    e.step,
                    ctx.t.saturating_sub(1),
                    ctx.t
                )));
            }
            if pos > 0 && steps[pos - 1] == e.step {
                return Err(Error::InvalidRequest(format!(
                    "selector: step {} appears twice",
                    e.step
                )));
            }
            if !finite_point(e.next_point) {
                return Err(Error::InvalidRequest(format!(
                    "selector: next_point of step {} is not finite",
                    e.step
                )));
            }
        }
        let n = order.len();
        // Dedup by hash, most recent kept.
        let mut canon = vec![0usize; n];
        let mut multiplicity = vec![1u32; n];
        let mut kept: HashMap<u64, usize> = HashMap::with_capacity(n);
        for pos in (0..n).rev() {
            let hash = ctx.events[order[pos]].image_hash;
            match kept.get(&hash) {
                Some(&k) => {
                    canon[pos] = k;
                    multiplicity[k] += 1;
                }
                None => {
                    kept.insert(hash, pos);
                    canon[pos] = pos;
                }
            }
        }
        let pool_pos: Vec<usize> = (0..n).filter(|&p| canon[p] == p).collect();
        let pool: Vec<usize> = pool_pos.iter().map(|&p| steps[p]).collect();
        let witness_pool: Vec<usize> = pool_pos
            .iter()
            .filter(|&&p| ctx.events[order[p]].witness)
            .map(|&p| steps[p])
            .collect();
        let t = ctx.t;
        let mut cand = Vec::with_capacity(n);
        for pos in 0..n {
            let e = &ctx.events[order[pos]];
            let s = e.step;
            let age = (t - s) as f64;
            let rank = pool.len() - pool.partition_point(|&p| p <= s);
            let witness_rank = if e.witness {
                (witness_pool.len() - witness_pool.partition_point(|&p| p <= s)) as f64
            } else {
                -1.0
            };
            let coord = match (e.witness, e.next_point, ctx.reference_point) {
                (true, Some((ax, ay)), Some((rx, ry))) => (ax - rx).hypot(ay - ry),
                _ => -1.0,
            };
            let mult = if canon[pos] == pos {
                multiplicity[pos] as f64
            } else {
                1.0
            };
            let b = e.next_bucket;
            let flag = |c: bool| if c { 1.0 } else { 0.0 };
            let v: [f64; CANDIDATE_FEATURES] = [
                age,
                age.ln(),
                rank as f64,
                s as f64 / (t - 1).max(1) as f64,
                flag(age <= 2.0),
                flag(age <= 3.0),
                flag(age <= 5.0),
                flag(age <= 9.0),
                pool.len() as f64,
                (t - 1) as f64,
                flag(e.witness),
                witness_pool.len() as f64,
                witness_rank,
                flag(b == ActionBucket::Click),
                flag(b == ActionBucket::Type),
                flag(b == ActionBucket::Key),
                flag(b == ActionBucket::Scroll),
                flag(b == ActionBucket::Other),
                coord,
                mult,
            ];
            cand.push(v.map(|x| x as f32));
        }
        Ok(FeatureContext {
            ctx,
            order,
            steps,
            canon,
            pool,
            cand,
        })
    }

    /// The decision this context describes.
    pub fn decision(&self) -> &DecisionContext {
        self.ctx
    }

    /// The deduplicated candidate pool (steps, ascending).
    pub fn pool(&self) -> &[usize] {
        &self.pool
    }

    /// Whether `step` is a pool member.
    pub fn in_pool(&self, step: usize) -> bool {
        self.pool.binary_search(&step).is_ok()
    }

    fn position(&self, step: usize) -> Result<usize> {
        self.steps.binary_search(&step).map_err(|_| {
            Error::InvalidRequest(format!("selector: step {step} is not an event of the decision"))
        })
    }

    /// The 28 features of `candidate` given the selected `set` (steps of events of the decision).
    pub fn features(&self, candidate: usize, set: &[usize]) -> Result<[f32; NUM_FEATURES]> {
        let pos = self.position(candidate)?;
        let mut out = [0f32; NUM_FEATURES];
        out[..CANDIDATE_FEATURES].copy_from_slice(&self.cand[pos]);
        out[CANDIDATE_FEATURES..].copy_from_slice(&self.set_features(pos, set)?);
        Ok(out)
    }

    fn set_features(&self, pos: usize, set: &[usize]) -> Result<[f32; SET_FEATURES]> {
        if set.is_empty() {
            return Ok([0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        }
        let t = self.ctx.t;
        let s = self.steps[pos];
        let cand_witness = self.ctx.events[self.order[pos]].witness;
        let (mut min_gap, mut sum_gap, mut n_recent, mut n_witness) = (usize::MAX, 0usize, 0usize, 0usize);
        let (mut min_step, mut duplicate) = (usize::MAX, false);
        for &m in set {
            let mp = self.position(m)?;
            let gap = s.abs_diff(m);
            min_gap = min_gap.min(gap);
            sum_gap += gap;
            n_recent += usize::from(t - m <= 5);
            n_witness += usize::from(self.ctx.events[self.order[mp]].witness);
            min_step = min_step.min(m);
            duplicate |= self.canon[mp] == self.canon[pos];
        }
        let flag = |c: bool| if c { 1.0 } else { 0.0 };
        Ok([
            set.len() as f32,
            min_gap as f32,
            (sum_gap as f64 / set.len() as f64) as f32,
            n_recent as f32,
            n_witness as f32,
            flag(cand_witness && n_witness > 0),
            flag(s < min_step),
            flag(duplicate),
        ])
    }
}

/// The 28 features of `candidate` given the already-selected `set` (see the module docs).
/// For many calls on one decision, build a [`FeatureContext`] once instead.
///
/// ```
/// # use recall::memory::selector::*;
/// let ev = |step| EventInfo {
///     step, image_hash: step as u64, next_bucket: ActionBucket::Type, next_point: None, witness: false,
/// };
/// let ctx = DecisionContext { t: 4, reference_point: None, events: (1..4).map(ev).collect() };
/// let f = features(&ctx, 1, &[])?;
/// assert_eq!(&f[20..], &[0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
/// assert!(features(&ctx, 9, &[]).is_err());
/// # Ok::<(), recall::Error>(())
/// ```
pub fn features(ctx: &DecisionContext, candidate: usize, set: &[usize]) -> Result<[f32; NUM_FEATURES]> {
    FeatureContext::new(ctx)?.features(candidate, set)
}

/// A model of the marginal utility `Δ(j | S)` from the 28 features. Closures implement it.
///
/// ```
/// use recall::memory::selector::MarginalModel;
/// let model = |f: &[f32; 28]| -f[0]; // prefer recent events
/// assert_eq!(model.score(&[2.0; 28]), -2.0);
/// ```
pub trait MarginalModel {
    /// The predicted marginal of one feature vector.
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32;

    /// Scores many vectors; `out` is cleared and receives one score per row.
    fn score_batch(&self, rows: &[[f32; NUM_FEATURES]], out: &mut Vec<f32>) {
        out.clear();
        out.extend(rows.iter().map(|r| self.score(r)));
    }
}

impl<F> MarginalModel for F
where
    F: Fn(&[f32; NUM_FEATURES]) -> f32,
{
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32 {
        self(features)
    }
}

/// A model whose scores are the negation of another's (the "inverted" control).
///
/// ```
/// use recall::memory::selector::{MarginalModel, Negated};
/// let base = |f: &[f32; 28]| f[0];
/// assert_eq!(Negated(&base).score(&[3.0; 28]), -3.0);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Negated<'a, M: ?Sized>(pub &'a M);

impl<M: MarginalModel + ?Sized> MarginalModel for Negated<'_, M> {
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32 {
        -self.0.score(features)
    }
    fn score_batch(&self, rows: &[[f32; NUM_FEATURES]], out: &mut Vec<f32>) {
        self.0.score_batch(rows, out);
        out.iter_mut().for_each(|v| *v = -*v);
    }
}

// ---------------------------------------------------------------------------------------------------
// The MLP.

/// Output columns per register block of the dense kernel.
const LANES: usize = 16;
/// Rows per block of the dense kernel.
const ROWS: usize = 4;

/// The learned marginal scorer: z-normalise → Linear(28,H) → GELU → Linear(H,H) → GELU → Linear(H,1).
///
/// Computation is f32 (normalisation in f64, as the reference does in Python before building the
/// tensor), with an AVX2+FMA kernel where the CPU has one; [`MarginalModel::score`] and
/// [`MarginalModel::score_batch`] give bitwise-identical results for the same row.
///
/// ```no_run
/// use recall::memory::selector::{MarginalModel, MarginalScorer};
/// let scorer = MarginalScorer::load(std::path::Path::new("selector.safetensors"))?;
/// let delta = scorer.score(&[0.0; 28]);
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MarginalScorer {
    hidden: usize,
    /// Hidden size rounded up to a multiple of `LANES` (padding units have zero weights).
    padded: usize,
    mean: [f64; NUM_FEATURES],
    std: [f64; NUM_FEATURES],
    /// fc1 in column blocks: block `b`, input `k` → `w1[b * 28 + k][lane]`.
    w1: Vec<[f32; LANES]>,
    b1: Vec<f32>,
    /// fc2 in column blocks: block `b`, input `k` → `w2[b * padded + k][lane]`.
    w2: Vec<[f32; LANES]>,
    b2: Vec<f32>,
    w3: Vec<f32>,
    b3: f32,
}

/// The raw parameters of a [`MarginalScorer`], row-major as in PyTorch.
#[derive(Debug, Clone, PartialEq)]
pub struct ScorerParams {
    pub feature_mean: Vec<f32>,
    pub feature_std: Vec<f32>,
    /// `[H, 28]`.
    pub fc1_weight: Vec<f32>,
    pub fc1_bias: Vec<f32>,
    /// `[H, H]`.
    pub fc2_weight: Vec<f32>,
    pub fc2_bias: Vec<f32>,
    /// `[1, H]`.
    pub fc3_weight: Vec<f32>,
    pub fc3_bias: f32,
}

fn bad_params(what: String) -> Error {
    Error::InvalidRequest(format!("selector scorer: {what}"))
}

impl MarginalScorer {
    /// Loads a scorer from a safetensors file (layout in the module docs).
    pub fn load(path: &Path) -> Result<Self> {
        let ckpt = Checkpoint::open_file(path)?;
        let meta_err = |message: String| Error::Safetensors {
            path: path.to_path_buf(),
            message,
        };
        if let Some(format) = ckpt.metadata.get("format") {
            if format != SCORER_FORMAT {
                return Err(meta_err(format!(
                    "metadata format `{format}`, expected `{SCORER_FORMAT}`"
                )));
            }
        }
        if let Some(names) = ckpt.metadata.get("feature_names") {
            let got: Vec<&str> = names.split(',').map(str::trim).collect();
            if got != FEATURE_NAMES {
                return Err(meta_err(format!(
                    "feature_names `{names}` differ from recall's layout `{}`",
                    FEATURE_NAMES.join(",")
                )));
            }
        }
        let fc1 = ckpt.get("fc1.weight")?;
        if fc1.shape.len() != 2 || fc1.shape[1] != NUM_FEATURES || fc1.shape[0] == 0 {
            return Err(Error::ShapeMismatch {
                name: "fc1.weight".into(),
                path: path.to_path_buf(),
                expected: vec![fc1.shape.first().copied().unwrap_or(0).max(1), NUM_FEATURES],
                actual: fc1.shape.clone(),
            });
        }
        let h = fc1.shape[0];
        if let Some(hidden) = ckpt.metadata.get("hidden") {
            if hidden.trim().parse::<usize>().ok() != Some(h) {
                return Err(meta_err(format!(
                    "metadata hidden `{hidden}` but fc1.weight has {h} rows"
                )));
            }
        }
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let t = ckpt.get(name)?;
            t.expect_shape(shape)?;
            Ok(t.to_f32())
        };
        let params = ScorerParams {
            feature_mean: get("feature_mean", &[NUM_FEATURES])?,
            feature_std: get("feature_std", &[NUM_FEATURES])?,
            fc1_weight: get("fc1.weight", &[h, NUM_FEATURES])?,
            fc1_bias: get("fc1.bias", &[h])?,
            fc2_weight: get("fc2.weight", &[h, h])?,
            fc2_bias: get("fc2.bias", &[h])?,
            fc3_weight: get("fc3.weight", &[1, h])?,
            fc3_bias: get("fc3.bias", &[1])?[0],
        };
        Self::from_params(&params).map_err(|e| match e {
            Error::InvalidRequest(m) => meta_err(m),
            other => other,
        })
    }

    /// Builds a scorer from raw parameters; the hidden size comes from `fc1_bias`.
    ///
    /// ```
    /// use recall::memory::selector::{MarginalModel, MarginalScorer, ScorerParams};
    /// let h = 4;
    /// let p = ScorerParams {
    ///     feature_mean: vec![0.0; 28],
    ///     feature_std: vec![1.0; 28],
    ///     fc1_weight: vec![0.0; h * 28],
    ///     fc1_bias: vec![0.0; h],
    ///     fc2_weight: vec![0.0; h * h],
    ///     fc2_bias: vec![0.0; h],
    ///     fc3_weight: vec![0.0; h],
    ///     fc3_bias: 0.5,
    /// };
    /// let scorer = MarginalScorer::from_params(&p)?;
    /// assert_eq!(scorer.score(&[1.0; 28]), 0.5);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn from_params(p: &ScorerParams) -> Result<Self> {
        let h = p.fc1_bias.len();
        let check = |name: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(bad_params(format!(
                    "{name} has {got} values, expected {want} (hidden {h})"
                )))
            }
        };
        if h == 0 {
            return Err(bad_params("hidden size 0".into()));
        }
        check("feature_mean", p.feature_mean.len(), NUM_FEATURES)?;
        check("feature_std", p.feature_std.len(), NUM_FEATURES)?;
        check("fc1.weight", p.fc1_weight.len(), h * NUM_FEATURES)?;
        check("fc2.weight", p.fc2_weight.len(), h * h)?;
        check("fc2.bias", p.fc2_bias.len(), h)?;
        check("fc3.weight", p.fc3_weight.len(), h)?;
        let mut mean = [0f64; NUM_FEATURES];
        let mut std = [0f64; NUM_FEATURES];
        for i in 0..NUM_FEATURES {
            mean[i] = p.feature_mean[i] as f64;
            std[i] = p.feature_std[i] as f64;
            if !(mean[i].is_finite() && std[i].is_finite() && std[i] > 0.0) {
                return Err(bad_params(format!(
                    "feature {} ({}) has mean {} / std {}; std must be finite and > 0",
                    i, FEATURE_NAMES[i], mean[i], std[i]
                )));
            }
        }
        let padded = h.div_ceil(LANES) * LANES;
        let blocks = padded / LANES;
        let mut w1 = vec![[0f32; LANES]; blocks * NUM_FEATURES];
        let mut w2 = vec![[0f32; LANES]; blocks * padded];
        for j in 0..h {
            let (b, l) = (j / LANES, j % LANES);
            for k in 0..NUM_FEATURES {
                w1[b * NUM_FEATURES + k][l] = p.fc1_weight[j * NUM_FEATURES + k];
            }
            for k in 0..h {
                w2[b * padded + k][l] = p.fc2_weight[j * h + k];
            }
        }
        let pad = |v: &[f32]| {
            let mut out = v.to_vec();
            out.resize(padded, 0.0);
            out
        };
        Ok(MarginalScorer {
            hidden: h,
            padded,
            mean,
            std,
            w1,
            b1: pad(&p.fc1_bias),
            w2,
            b2: pad(&p.fc2_bias),
            w3: pad(&p.fc3_weight),
            b3: p.fc3_bias,
        })
    }

    /// The hidden width `H`.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Scores up to `ROWS` rows (the rest of the block is padding).
    fn block(
        &self,
        rows: &[[f32; NUM_FEATURES]],
        h1: &mut [[f32; ROWS]],
        h2: &mut [[f32; ROWS]],
    ) -> [f32; ROWS] {
        let mut x = [[0f32; ROWS]; NUM_FEATURES];
        for (r, row) in rows.iter().enumerate().take(ROWS) {
            for k in 0..NUM_FEATURES {
                x[k][r] = ((row[k] as f64 - self.mean[k]) / self.std[k]) as f32;
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { self.block_avx2(&x, h1, h2) };
            }
        }
        self.block_generic::<false>(&x, h1, h2)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_avx2(
        &self,
        x: &[[f32; ROWS]; NUM_FEATURES],
        h1: &mut [[f32; ROWS]],
        h2: &mut [[f32; ROWS]],
    ) -> [f32; ROWS] {
        dense_avx2(x, &self.w1, NUM_FEATURES, &self.b1, h1);
        dense_avx2(h1, &self.w2, self.padded, &self.b2, h2);
        self.readout::<true>(h2)
    }

    #[inline(always)]
    fn block_generic<const FMA: bool>(
        &self,
        x: &[[f32; ROWS]; NUM_FEATURES],
        h1: &mut [[f32; ROWS]],
        h2: &mut [[f32; ROWS]],
    ) -> [f32; ROWS] {
        dense::<FMA>(x, &self.w1, NUM_FEATURES, &self.b1, h1);
        dense::<FMA>(h1, &self.w2, self.padded, &self.b2, h2);
        self.readout::<FMA>(h2)
    }

    #[inline(always)]
    fn readout<const FMA: bool>(&self, h2: &[[f32; ROWS]]) -> [f32; ROWS] {
        let mut out = [0f32; ROWS];
        for (hj, &wj) in h2.iter().zip(&self.w3) {
            for r in 0..ROWS {
                out[r] = madd::<FMA>(out[r], hj[r], wj);
            }
        }
        out.map(|v| v + self.b3)
    }
}

/// The AVX2+FMA version of [`dense`]: a 4-row × 16-column register tile, GELU on the vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dense_avx2(
    input: &[[f32; ROWS]],
    weights: &[[f32; LANES]],
    n_in: usize,
    bias: &[f32],
    out: &mut [[f32; ROWS]],
) {
    use std::arch::x86_64::*;
    let input = &input[..n_in.min(input.len())];
    for ((blk, out_blk), bias_blk) in weights
        .chunks_exact(n_in)
        .zip(out.chunks_exact_mut(LANES))
        .zip(bias.chunks_exact(LANES))
    {
        let mut acc = [_mm256_setzero_ps(); 2 * ROWS];
        for (wk, ak) in blk.iter().zip(input) {
            // SAFETY: `wk` is a [f32; 16]; both 8-float loads stay inside it.
            let (w0, w1) = unsafe { (_mm256_loadu_ps(wk.as_ptr()), _mm256_loadu_ps(wk.as_ptr().add(8))) };
            for r in 0..ROWS {
                let a = _mm256_set1_ps(ak[r]);
                acc[2 * r] = _mm256_fmadd_ps(a, w0, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(a, w1, acc[2 * r + 1]);
            }
        }
        // SAFETY: `bias_blk` has 16 floats.
        let (b0, b1) = unsafe {
            (
                _mm256_loadu_ps(bias_blk.as_ptr()),
                _mm256_loadu_ps(bias_blk.as_ptr().add(8)),
            )
        };
        let mut tile = [[0f32; LANES]; ROWS];
        for r in 0..ROWS {
            let lo = gelu_avx2(_mm256_add_ps(acc[2 * r], b0));
            let hi = gelu_avx2(_mm256_add_ps(acc[2 * r + 1], b1));
            // SAFETY: `tile[r]` has 16 floats.
            unsafe {
                _mm256_storeu_ps(tile[r].as_mut_ptr(), lo);
                _mm256_storeu_ps(tile[r].as_mut_ptr().add(8), hi);
            }
        }
        for (l, o) in out_blk.iter_mut().enumerate() {
            for r in 0..ROWS {
                o[r] = tile[r][l];
            }
        }
    }
}

/// [`gelu`] on 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn gelu_avx2(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = _mm256_set1_ps;
    let z = _mm256_mul_ps(v, c(std::f32::consts::FRAC_1_SQRT_2));
    let x = _mm256_min_ps(_mm256_max_ps(z, c(-4.0)), c(4.0));
    let x2 = _mm256_mul_ps(x, x);
    let mut p = _mm256_fmadd_ps(x2, c(ERF_P[0]), c(ERF_P[1]));
    for &k in &ERF_P[2..] {
        p = _mm256_fmadd_ps(x2, p, c(k));
    }
    p = _mm256_mul_ps(p, x);
    let mut q = _mm256_fmadd_ps(x2, c(ERF_Q[0]), c(ERF_Q[1]));
    for &k in &ERF_Q[2..] {
        q = _mm256_fmadd_ps(x2, q, c(k));
    }
    let erf = _mm256_div_ps(p, q);
    _mm256_mul_ps(_mm256_mul_ps(c(0.5), v), _mm256_add_ps(c(1.0), erf))
}

/// Numerator coefficients of the rational erf, highest power first (odd polynomial / x).
const ERF_P: [f32; 7] = [
    -2.726_142_3e-10,
    2.770_681_4e-8,
    -2.101_024e-6,
    -5.692_506_4e-5,
    -7.349_906_3e-4,
    -2.954_600_1e-3,
    -1.609_603_3e-2,
];
/// Denominator coefficients (even polynomial), highest power first.
const ERF_Q: [f32; 5] = [
    -1.456_607_2e-5,
    -2.133_740_6e-4,
    -1.682_827e-3,
    -7.373_329_2e-3,
    -1.426_474e-2,
];

#[inline(always)]
fn madd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
    if FMA {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

/// `out[j][r] = gelu(bias[j] + Σ_k input[k][r] · W[j][k])` for a block of `ROWS` rows; `weights` holds
/// `LANES`-wide column blocks of `n_in` inputs each.
#[inline(always)]
fn dense<const FMA: bool>(
    input: &[[f32; ROWS]],
    weights: &[[f32; LANES]],
    n_in: usize,
    bias: &[f32],
    out: &mut [[f32; ROWS]],
) {
    let input = &input[..n_in.min(input.len())];
    for ((blk, out_blk), bias_blk) in weights
        .chunks_exact(n_in)
        .zip(out.chunks_exact_mut(LANES))
        .zip(bias.chunks_exact(LANES))
    {
        let mut acc = [[0f32; LANES]; ROWS];
        for (wk, ak) in blk.iter().zip(input) {
            for r in 0..ROWS {
                for l in 0..LANES {
                    acc[r][l] = madd::<FMA>(acc[r][l], ak[r], wk[l]);
                }
            }
        }
        for (l, (o, &b)) in out_blk.iter_mut().zip(bias_blk).enumerate() {
            for r in 0..ROWS {
                o[r] = gelu(acc[r][l] + b);
            }
        }
    }
}

/// Exact GELU `x · Φ(x)` with a rational erf (max abs error ≈ 4e-7 in f32, the Eigen/XLA form).
#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

#[inline(always)]
fn erf(a: f32) -> f32 {
    let x = a.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * ERF_P[0] + ERF_P[1];
    for &k in &ERF_P[2..] {
        p = x2 * p + k;
    }
    p *= x;
    let mut q = x2 * ERF_Q[0] + ERF_Q[1];
    for &k in &ERF_Q[2..] {
        q = x2 * q + k;
    }
    p / q
}

impl MarginalModel for MarginalScorer {
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32 {
        let mut h1 = vec![[0f32; ROWS]; self.padded];
        let mut h2 = vec![[0f32; ROWS]; self.padded];
        self.block(std::slice::from_ref(features), &mut h1, &mut h2)[0]
    }

    /// Rows are independent, so large batches are split over rayon's threads (in chunks of 16 rows)
    /// without changing any result.
    fn score_batch(&self, rows: &[[f32; NUM_FEATURES]], out: &mut Vec<f32>) {
        use rayon::prelude::*;
        const PAR_CHUNK: usize = 4 * ROWS;
        out.clear();
        out.resize(rows.len(), 0.0);
        let run = |rows: &[[f32; NUM_FEATURES]], out: &mut [f32]| {
            let mut h1 = vec![[0f32; ROWS]; self.padded];
            let mut h2 = vec![[0f32; ROWS]; self.padded];
            for (chunk, dst) in rows.chunks(ROWS).zip(out.chunks_mut(ROWS)) {
                let scores = self.block(chunk, &mut h1, &mut h2);
                dst.copy_from_slice(&scores[..chunk.len()]);
            }
        };
        if rows.len() >= 2 * PAR_CHUNK && rayon::current_num_threads() > 1 {
            rows.par_chunks(PAR_CHUNK)
                .zip(out.par_chunks_mut(PAR_CHUNK))
                .for_each(|(r, o)| run(r, o));
        } else {
            run(rows, out);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Composition.

/// How [`compose`] builds the set. All three are exact-`B`; [`compose_with`] has the details.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The paper: a small beam over sequences of swaps, initialized at Recent-B. An older event
    /// enters only by beating the predicted marginal of the recent event it evicts; declining every
    /// swap returns Recent-B exactly.
    Paper,
    /// A single greedy swap loop from Recent-B: each step evicts the weakest recent event and admits
    /// the strongest challenger if it beats it (the paper's rule without the beam).
    Greedy,
    /// The authors' code: beam search from the empty set over the deduplicated pool.
    Reference,
}

impl Mode {
    /// The name [`FromStr`](std::str::FromStr) accepts: `paper`, `greedy` or `reference`.
    ///
    /// ```
    /// use recall::memory::selector::Mode;
    /// for mode in [Mode::Paper, Mode::Greedy, Mode::Reference] {
    ///     assert_eq!(mode.as_str().parse::<Mode>()?, mode);
    /// }
    /// assert!("beam".parse::<Mode>().is_err());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Paper => "paper",
            Mode::Greedy => "greedy",
            Mode::Reference => "reference",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Mode {
    type Err = crate::Error;

    /// `paper`, `greedy` or `reference`.
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "paper" => Ok(Mode::Paper),
            "greedy" => Ok(Mode::Greedy),
            "reference" => Ok(Mode::Reference),
            other => Err(crate::Error::InvalidRequest(format!(
                "selector mode `{other}`: expected paper, greedy or reference"
            ))),
        }
    }
}

/// Options of [`compose_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComposeOptions {
    pub mode: Mode,
    /// The most chosen events outside Recent-B (`k`), in every mode. Paper: the most beam rounds
    /// (each round adds one swap, i.e. one entered event, to every path), default `B`. Greedy: the
    /// most swaps, default `B`. Reference: children with more pool events outside Recent-B are
    /// dropped, default unlimited. `Some(0)` gives Recent-B in every mode.
    pub max_replacements: Option<usize>,
    /// Paper mode: sets kept per round. Reference mode: sets kept per level. At least 1.
    pub beam_width: usize,
    /// Reference mode only: children kept per parent (by predicted marginal). At least 1.
    pub children_per_parent: usize,
}

impl ComposeOptions {
    /// Defaults for `mode`: beam 3, 3 children per parent, the mode's default replacement cap.
    pub fn new(mode: Mode) -> Self {
        ComposeOptions {
            mode,
            max_replacements: None,
            beam_width: DEFAULT_BEAM,
            children_per_parent: DEFAULT_BEAM,
        }
    }
}

/// One accepted swap of [`Mode::Paper`] or [`Mode::Greedy`], where `S` is the set it was made from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Swap {
    /// The recent event that lost its image.
    pub evicted: usize,
    /// The older event that gained one.
    pub entered: usize,
    /// `Δ̂(evicted | S ∖ {evicted})`.
    pub evicted_marginal: f32,
    /// `Δ̂(entered | S ∖ {evicted})`.
    pub entered_marginal: f32,
}

impl Swap {
    /// `entered_marginal − evicted_marginal` in f64: what the swap adds to [`Allocation::score`].
    pub fn gain(&self) -> f64 {
        self.entered_marginal as f64 - self.evicted_marginal as f64
    }
}

/// The result of [`compose`].
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// Chosen steps, ascending; `min(B, #events)` of them.
    pub steps: Vec<usize>,
    /// Number of chosen steps outside Recent-B (in paper and greedy mode, `swaps.len()`).
    pub k: usize,
    /// Recent-B, for reference.
    pub recent: Vec<usize>,
    /// Reference mode: the accumulated predicted marginal of the chosen beam path. Paper and greedy
    /// mode: the gains ([`Swap::gain`]) of `swaps` summed in order in f64, starting from 0. 0 on
    /// fallback.
    pub score: f64,
    /// Paper and greedy mode: the accepted swaps of the returned path, in order.
    pub swaps: Vec<Swap>,
    /// Recent-B was returned because the pool had fewer than `B` candidates (or the beam could not
    /// fill `B` slots under `max_replacements`). Reference mode only.
    pub fell_back: bool,
}

impl Allocation {
    fn recent(recent: Vec<usize>) -> Self {
        Allocation {
            steps: recent.clone(),
            k: 0,
            recent,
            score: 0.0,
            swaps: Vec::new(),
            fell_back: true,
        }
    }
}

/// Composes an exact-`B` allocation with default beam settings. See [`compose_with`].
///
/// ```
/// # use recall::memory::selector::*;
/// let ev = |step| EventInfo {
///     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None,
///     witness: step == 2,
/// };
/// let ctx = DecisionContext { t: 10, reference_point: None, events: (1..10).map(ev).collect() };
/// // A model that values witnesses, then recency: step 2 displaces the recent event with the
/// // lowest marginal (step 7), and no other older event beats a recent one.
/// let model = |f: &[f32; 28]| f[10] * 5.0 - f[0] * 0.01;
/// for mode in [Mode::Paper, Mode::Greedy] {
///     let a = compose(&ctx, 3, &model, mode, None)?;
///     assert_eq!(a.steps, vec![2, 8, 9]);
///     assert_eq!(a.k, 1);
///     assert_eq!((a.swaps[0].evicted, a.swaps[0].entered), (7, 2));
/// }
/// // Declining every swap (no older event can win) recovers Recent-B exactly.
/// let a = compose(&ctx, 3, &|f: &[f32; 28]| -f[0], Mode::Paper, None)?;
/// assert_eq!((a.steps, a.k), (vec![7, 8, 9], 0));
/// # Ok::<(), recall::Error>(())
/// ```
pub fn compose<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    budget: usize,
    scorer: &M,
    mode: Mode,
    max_replacements: Option<usize>,
) -> Result<Allocation> {
    let options = ComposeOptions {
        max_replacements,
        ..ComposeOptions::new(mode)
    };
    compose_with(ctx, budget, scorer, &options)
}

/// Composes an exact-`B` allocation: `|steps| = min(B, #events)`. With `B = 0` or at most `B`
/// events, every event (Recent-B), in every mode.
///
/// Paper and greedy mode share one move, the **swap** from a set `S`: evict a recent event
/// `e ∈ S ∩ Recent-B` and bring in a challenger `o`, a pool event outside `S` and outside
/// Recent-B. Its gain is `Δ̂(o | S∖{e}) − Δ̂(e | S∖{e})` (f32 marginals, difference in f64), and it
/// is *admissible* only if the gain is `> 0`: the entering event beats the predicted marginal of
/// the recent event it evicts (a NaN marginal on either side, or `+∞` against `+∞`, is never
/// admissible). Entered events are never evicted and evicted events never return, so every swap
/// adds one to `k`, no path has more than `B` swaps, and declining every swap returns Recent-B
/// exactly.
///
/// **Paper** ([`Mode::Paper`]): a beam over swap sequences. The beam starts as `{Recent-B}` with
/// score 0. Each round (at most `max_replacements`, default `B`, rounds, so `k ≤
/// max_replacements`), every set in the beam proposes every admissible swap; a child's score is
/// its parent's plus the gain. Children are generated in beam order, then by evicted step
/// ascending (the older recent event first), then by entered step descending (the more recent
/// challenger first). A set reached by several paths keeps its highest score and that path (equal
/// scores: the path generated first). The `beam_width` best sets survive, ranked by that score
/// (equal scores: by when that path was generated). Composition stops when no set in the beam
/// has an admissible swap, or after the last round. The result is the best set seen over all
/// rounds, Recent-B included with score 0 (a later round's best replaces it only with a strictly
/// higher score), with its path's swaps. All of a round's marginals go through one
/// [`MarginalModel::score_batch`] call, and a (candidate, `S∖{e}`) pair shared by several parents
/// is scored once. With `beam_width` at least the number of distinct sets any round generates,
/// this is exact: the result is the best-scoring set over all admissible swap sequences of at most
/// `max_replacements` swaps (each set scored by its best path). Cost: about `|beam| · |S ∩
/// Recent-B| · #challengers` rows per round, roughly twice reference mode's at `B = 4`.
///
/// **Greedy** ([`Mode::Greedy`]): `S` = Recent-B. Repeat at most `max_replacements` (default `B`)
/// times: among the recent events still in `S`, the one to evict is the one with the lowest
/// `Δ̂(e | S∖{e})` (NaN ranks lowest; ties: the older); the challenger is the pool event outside
/// `S` and outside Recent-B with the highest `Δ̂(o | S∖{e})` (NaN ranks lowest; ties: the more
/// recent). The swap happens only when `Δ̂(o | S∖{e}) > Δ̂(e | S∖{e})` with a non-NaN `Δ̂(o | ·)`;
/// otherwise composition stops. (Unlike paper mode, a recent event with a NaN marginal counts as
/// `−∞`, so any finite challenger evicts it, with an infinite gain.)
///
/// **Reference** ([`Mode::Reference`]), after the authors' serving code: if the deduplicated pool
/// has fewer than `B` events, Recent-B. Otherwise a beam over `B` levels from the empty set: each
/// parent ranks the remaining pool events by `Δ̂(j | parent)` (stable, ties to the older) and keeps
/// the top `children_per_parent`; a child's score is the parent's plus that marginal; children
/// exceeding `max_replacements` (default unlimited) pool events outside Recent-B are dropped; a
/// set reached by two paths keeps the higher score (the authors keep the first generated — the
/// two agree whenever the better path comes from the better parent); the `beam_width` best
/// (stable) sets survive. The best final set is returned; if none reached size `B`, Recent-B
/// (`fell_back`). Scores that are NaN rank below every number.
pub fn compose_with<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    budget: usize,
    scorer: &M,
    options: &ComposeOptions,
) -> Result<Allocation> {
    let fc = FeatureContext::new(ctx)?;
    let recent = recent_b(ctx, budget);
    if budget == 0 || ctx.events.len() <= budget {
        let mut a = Allocation::recent(recent);
        a.fell_back = false;
        return Ok(a);
    }
    match options.mode {
        Mode::Paper => paper(
            &fc,
            scorer,
            recent,
            options.max_replacements.unwrap_or(budget),
            options.beam_width.max(1),
        ),
        Mode::Greedy => greedy(
            &fc,
            budget,
            scorer,
            recent,
            options.max_replacements.unwrap_or(budget),
        ),
        Mode::Reference => {
            if fc.pool().len() < budget {
                return Ok(Allocation::recent(recent));
            }
            let mut rows = Vec::new();
            let mut scores = Vec::new();
            let found = beam_search(
                fc.pool(),
                budget,
                &recent,
                options.max_replacements,
                options.beam_width.max(1),
                options.children_per_parent.max(1),
                |parent, acc, candidates, out| {
                    rows.clear();
                    for &c in candidates {
                        rows.push(fc.features(c, parent)?);
                    }
                    scorer.score_batch(&rows, &mut scores);
                    out.clear();
                    out.extend(scores.iter().map(|&m| {
                        let m = nan_low(m) as f64;
                        (m, acc + m)
                    }));
                    Ok(())
                },
            )?;
            Ok(match found {
                Some((steps, score)) => {
                    let k = steps.iter().filter(|s| recent.binary_search(s).is_err()).count();
                    Allocation {
                        steps,
                        k,
                        recent,
                        score,
                        swaps: Vec::new(),
                        fell_back: false,
                    }
                }
                None => Allocation::recent(recent),
            })
        }
    }
}

fn nan_low(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// One path of [`Mode::Paper`]'s beam: the set it reached, its summed gain and its swaps.
#[derive(Debug, Clone)]
struct SwapPath {
    set: Vec<usize>,
    score: f64,
    swaps: Vec<Swap>,
}

/// A distinct `S ∖ {e}` of one paper round: its challengers and where their rows start.
struct Rest {
    set: Vec<usize>,
    open: Vec<usize>,
    first: usize,
}

fn paper<M: MarginalModel + ?Sized>(
    fc: &FeatureContext<'_>,
    scorer: &M,
    recent: Vec<usize>,
    max_rounds: usize,
    width: usize,
) -> Result<Allocation> {
    let challengers: Vec<usize> = fc
        .pool()
        .iter()
        .copied()
        .filter(|s| recent.binary_search(s).is_err())
        .collect();
    let mut best = SwapPath {
        set: recent.clone(),
        score: 0.0,
        swaps: Vec::new(),
    };
    let mut beam = vec![best.clone()];
    let mut rows: Vec<[f32; NUM_FEATURES]> = Vec::new();
    let mut scores: Vec<f32> = Vec::new();
    let mut rests: Vec<Rest> = Vec::new();
    let mut rest_at: HashMap<Vec<usize>, usize> = HashMap::new();
    let mut evict_at: HashMap<(usize, usize), usize> = HashMap::new();
    // (parent, evicted, rest, row of the evicted event's marginal)
    let mut proposals: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut swaps: Vec<(f64, usize, usize)> = Vec::new();
    for _ in 0..max_rounds.min(recent.len()) {
        rows.clear();
        rests.clear();
        rest_at.clear();
        evict_at.clear();
        proposals.clear();
        for (p, parent) in beam.iter().enumerate() {
            for &e in parent.set.iter().filter(|s| recent.binary_search(s).is_ok()) {
                let rest: Vec<usize> = parent.set.iter().copied().filter(|&s| s != e).collect();
                let r = match rest_at.get(&rest) {
                    Some(&r) => r,
                    None => {
                        // Entered events stay in the set, so "outside S" also excludes them.
                        let open: Vec<usize> = challengers
                            .iter()
                            .copied()
                            .filter(|c| rest.binary_search(c).is_err())
                            .collect();
                        let first = rows.len();
                        for &o in &open {
                            rows.push(fc.features(o, &rest)?);
                        }
                        rests.push(Rest {
                            set: rest.clone(),
                            open,
                            first,
                        });
                        rest_at.insert(rest, rests.len() - 1);
                        rests.len() - 1
                    }
                };
                if rests[r].open.is_empty() {
                    continue;
                }
                let row = match evict_at.get(&(e, r)) {
                    Some(&row) => row,
                    None => {
                        rows.push(fc.features(e, &rests[r].set)?);
                        evict_at.insert((e, r), rows.len() - 1);
                        rows.len() - 1
                    }
                };
                proposals.push((p, e, r, row));
            }
        }
        if proposals.is_empty() {
            break;
        }
        scorer.score_batch(&rows, &mut scores);
        if scores.len() != rows.len() {
            return Err(Error::InvalidRequest(
                "selector: scorer returned the wrong number of scores".into(),
            ));
        }
        // Admissible swaps as (child score, proposal, challenger index); generation order is
        // proposal ascending, then challenger index descending (the more recent challenger first).
        swaps.clear();
        for (q, &(p, _, r, row)) in proposals.iter().enumerate() {
            let evicted_marginal = scores[row] as f64;
            let rest = &rests[r];
            for i in (0..rest.open.len()).rev() {
                let gain = scores[rest.first + i] as f64 - evicted_marginal;
                // Declined unless > 0, including NaN (either marginal, or ∞ − ∞).
                if gain.is_nan() || gain <= 0.0 {
                    continue;
                }
                swaps.push((beam[p].score + gain, q, i));
            }
        }
        if swaps.is_empty() {
            break;
        }
        // Score descending (never NaN: gains are > 0), ties in generation order: a total order.
        let rank = |a: &(f64, usize, usize), b: &(f64, usize, usize)| {
            b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(b.2.cmp(&a.2))
        };
        // A set is generated at most once per parent, so the first `width` distinct sets in rank
        // order lie within the first `width · |beam|` ranks: select those, then sort only them.
        let keep = width.saturating_mul(beam.len()).min(swaps.len());
        if keep < swaps.len() {
            swaps.select_nth_unstable_by(keep - 1, rank);
            swaps.truncate(keep);
        }
        swaps.sort_unstable_by(rank);
        // Walking the ranking, a set's first occurrence is its best path.
        let mut children: Vec<SwapPath> = Vec::with_capacity(width.min(keep));
        let mut taken: HashSet<Vec<usize>> = HashSet::new();
        for &(score, q, i) in swaps.iter() {
            let (p, evicted, r, row) = proposals[q];
            let rest = &rests[r];
            let entered = rest.open[i];
            let mut set = rest.set.clone();
            set.insert(set.partition_point(|&s| s < entered), entered);
            if !taken.insert(set.clone()) {
                continue;
            }
            let mut path = Vec::with_capacity(beam[p].swaps.len() + 1);
            path.extend_from_slice(&beam[p].swaps);
            path.push(Swap {
                evicted,
                entered,
                evicted_marginal: scores[row],
                entered_marginal: scores[rest.first + i],
            });
            children.push(SwapPath {
                set,
                score,
                swaps: path,
            });
            if children.len() == width {
                break;
            }
        }
        if children[0].score > best.score {
            best = children[0].clone();
        }
        beam = children;
    }
    Ok(Allocation {
        k: best.swaps.len(),
        steps: best.set,
        recent,
        score: best.score,
        swaps: best.swaps,
        fell_back: false,
    })
}

fn greedy<M: MarginalModel + ?Sized>(
    fc: &FeatureContext<'_>,
    budget: usize,
    scorer: &M,
    recent: Vec<usize>,
    max_swaps: usize,
) -> Result<Allocation> {
    let mut set = recent.clone();
    let mut swaps = Vec::new();
    let mut rows = Vec::new();
    let mut scores = Vec::new();
    let challengers: Vec<usize> = fc
        .pool()
        .iter()
        .copied()
        .filter(|s| recent.binary_search(s).is_err())
        .collect();
    let mut entered: Vec<usize> = Vec::new();
    while swaps.len() < max_swaps.min(budget) {
        // Eviction candidate: the recent member with the lowest marginal given the rest.
        let evictable: Vec<usize> = set
            .iter()
            .copied()
            .filter(|s| recent.binary_search(s).is_ok())
            .collect();
        if evictable.is_empty() {
            break;
        }
        rows.clear();
        for &e in &evictable {
            let rest: Vec<usize> = set.iter().copied().filter(|&s| s != e).collect();
            rows.push(fc.features(e, &rest)?);
        }
        scorer.score_batch(&rows, &mut scores);
        let mut worst = 0;
        for i in 1..evictable.len() {
            if nan_low(scores[i]) < nan_low(scores[worst]) {
                worst = i;
            }
        }
        let evicted = evictable[worst];
        let evicted_marginal = nan_low(scores[worst]);
        let rest: Vec<usize> = set.iter().copied().filter(|&s| s != evicted).collect();
        let open: Vec<usize> = challengers
            .iter()
            .copied()
            .filter(|c| !entered.contains(c))
            .collect();
        if open.is_empty() {
            break;
        }
        rows.clear();
        for &o in &open {
            rows.push(fc.features(o, &rest)?);
        }
        scorer.score_batch(&rows, &mut scores);
        let mut best = 0;
        for i in 1..open.len() {
            if nan_low(scores[i]) >= nan_low(scores[best]) {
                best = i;
            }
        }
        let entered_marginal = nan_low(scores[best]);
        if entered_marginal <= evicted_marginal || entered_marginal.is_nan() {
            break;
        }
        let newcomer = open[best];
        entered.push(newcomer);
        set = rest;
        set.push(newcomer);
        set.sort_unstable();
        swaps.push(Swap {
            evicted,
            entered: newcomer,
            evicted_marginal,
            entered_marginal,
        });
    }
    let score = swaps
        .iter()
        .map(|s| s.entered_marginal as f64 - s.evicted_marginal as f64)
        .sum();
    Ok(Allocation {
        k: swaps.len(),
        steps: set,
        recent,
        score,
        swaps,
        fell_back: false,
    })
}

/// Scores of one parent's candidates: `(rank key, child's accumulated score)`.
pub(crate) type ChildScores = Vec<(f64, f64)>;

/// The beam shared by [`Mode::Reference`] and the oracle policy. `eval(parent, parent_score,
/// candidates, out)` fills one `(rank key, child score)` per candidate. Returns the best size-`budget`
/// set and its score, or `None` if no set reached that size.
pub(crate) fn beam_search<F>(
    pool: &[usize],
    budget: usize,
    recent: &[usize],
    max_replacements: Option<usize>,
    width: usize,
    children: usize,
    mut eval: F,
) -> Result<Option<(Vec<usize>, f64)>>
where
    F: FnMut(&[usize], f64, &[usize], &mut ChildScores) -> Result<()>,
{
    let desc = |a: f64, b: f64| b.total_cmp(&a);
    let mut level: Vec<(Vec<usize>, f64)> = vec![(Vec::new(), 0.0)];
    let mut scored: ChildScores = Vec::new();
    for _ in 0..budget {
        let mut expanded: Vec<(Vec<usize>, f64)> = Vec::new();
        let mut index: HashMap<Vec<usize>, usize> = HashMap::new();
        for (parent, acc) in &level {
            let remaining: Vec<usize> = pool.iter().copied().filter(|s| !parent.contains(s)).collect();
            if remaining.is_empty() {
                continue;
            }
            eval(parent, *acc, &remaining, &mut scored)?;
            if scored.len() != remaining.len() {
                return Err(Error::InvalidRequest(
                    "selector: scorer returned the wrong number of scores".into(),
                ));
            }
            let mut ranked: Vec<usize> = (0..remaining.len()).collect();
            ranked.sort_by(|&a, &b| desc(nan_to_low(scored[a].0), nan_to_low(scored[b].0)));
            for &i in ranked.iter().take(children) {
                let mut child = parent.clone();
                child.push(remaining[i]);
                child.sort_unstable();
                if let Some(cap) = max_replacements {
                    if child.iter().filter(|s| recent.binary_search(s).is_err()).count() > cap {
                        continue;
                    }
                }
                let value = nan_to_low(scored[i].1);
                match index.get(&child) {
                    Some(&at) => {
                        if value > expanded[at].1 {
                            expanded[at].1 = value;
                        }
                    }
                    None => {
                        index.insert(child.clone(), expanded.len());
                        expanded.push((child, value));
                    }
                }
            }
        }
        if expanded.is_empty() {
            break;
        }
        expanded.sort_by(|a, b| desc(a.1, b.1));
        expanded.truncate(width);
        level = expanded;
    }
    Ok(level.into_iter().next().filter(|(set, _)| set.len() == budget))
}

fn nan_to_low(x: f64) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_accurate() {
        let mut worst = 0f64;
        for i in -60000..=60000 {
            let x = i as f64 / 10000.0;
            worst = worst.max((erf(x as f32) as f64 - libm::erf(x)).abs());
        }
        assert!(worst < 5e-7, "max erf error {worst}");
    }
}
