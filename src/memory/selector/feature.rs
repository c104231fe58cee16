//! Decisions, events and the 28 selector features (see the module docs of [`super`]).

use std::cell::RefCell;
use std::collections::HashMap;

use super::{CANDIDATE_FEATURES, NUM_FEATURES, SET_FEATURES};
use crate::error::{Error, Result};

/// Coarse type of the action taken right after a candidate event: the parser's own bucket, so the
/// selector's one-hot and [`crate::action::Action::bucket`] cannot drift apart.
pub use crate::action::ActionBucket;

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

/// How a recall step is numbered when the selector counts ages, a choice the authors' two feature
/// implementations make differently (module docs of [`super`], "Event indexing").
///
/// ```
/// use recall::memory::selector::EventIndexing;
/// // Decision t = 10, candidate step 9 (the most recent completed step).
/// assert_eq!(EventIndexing::Desktop.age(10, 9), 2); // event 8, shown with action 9
/// assert_eq!(EventIndexing::Mobile.age(10, 9), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventIndexing {
    /// The authors' desktop training code (`selector_v4_features.py`), where the selectors were
    /// trained: step `s` is event `s − 1` (its screen is the post-action frame of event `s − 1`,
    /// shown with action `s`), so `age = t − s + 1` and `in_recent_B` (`age ≤ B + 1`) is exactly
    /// membership in Recent-B.
    #[default]
    Desktop,
    /// The authors' MobileWorld deployment code (`mobileworld_selector_features.py`): `age = t − s`
    /// with the desktop thresholds unchanged, so `in_recent_B` also covers step `t − B − 1`.
    Mobile,
}

impl EventIndexing {
    /// The event number of step `s`.
    pub fn event(self, s: usize) -> usize {
        match self {
            EventIndexing::Desktop => s - 1,
            EventIndexing::Mobile => s,
        }
    }

    /// The age of step `s` at decision `t` (`s < t`).
    pub fn age(self, t: usize, s: usize) -> usize {
        t - self.event(s)
    }

    /// The name scorer files and the CLI use: `desktop` or `mobile`.
    pub fn name(self) -> &'static str {
        match self {
            EventIndexing::Desktop => "desktop",
            EventIndexing::Mobile => "mobile",
        }
    }
}

impl std::str::FromStr for EventIndexing {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "desktop" => Ok(EventIndexing::Desktop),
            "mobile" => Ok(EventIndexing::Mobile),
            other => Err(Error::InvalidRequest(format!(
                "event indexing `{other}`: expected `desktop` (age t-s+1, the authors' training code) \
                 or `mobile` (age t-s, their MobileWorld deployment)"
            ))),
        }
    }
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
/// assert_eq!(f[0], 4.0); // age: t − s + 1 in the desktop count (the default indexing)
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
    indexing: EventIndexing,
    /// When logging ([`FeatureContext::log_queries`]): every `(candidate, set)` asked for, in order.
    log: RefCell<Option<Vec<Query>>>,
}

/// One feature query: the candidate and the (sorted) conditioning set of `Δ̂(candidate | set)`.
pub type Query = (usize, Vec<usize>);

fn finite_point(p: Option<(f64, f64)>) -> bool {
    p.is_none_or(|(x, y)| x.is_finite() && y.is_finite())
}

impl<'a> FeatureContext<'a> {
    /// Validates `ctx` (steps distinct and in `1..t`, points finite) and precomputes the pool and the
    /// candidate features, with the default [`EventIndexing`].
    pub fn new(ctx: &'a DecisionContext) -> Result<Self> {
        Self::with_indexing(ctx, EventIndexing::default())
    }

    /// As [`FeatureContext::new`], counting ages with `indexing`.
    pub fn with_indexing(ctx: &'a DecisionContext, indexing: EventIndexing) -> Result<Self> {
        let (order, steps) = sorted_events(ctx)?;
        let n = order.len();
        let (canon, multiplicity) = dedup_by_hash(ctx, &order);
        let pool_pos: Vec<usize> = (0..n).filter(|&p| canon[p] == p).collect();
        let pool: Vec<usize> = pool_pos.iter().map(|&p| steps[p]).collect();
        let witness_pool: Vec<usize> = pool_pos
            .iter()
            .filter(|&&p| ctx.events[order[p]].witness)
            .map(|&p| steps[p])
            .collect();
        let mut cand = Vec::with_capacity(n);
        for pos in 0..n {
            let mult = if canon[pos] == pos {
                multiplicity[pos] as f64
            } else {
                1.0
            };
            let event = &ctx.events[order[pos]];
            cand.push(candidate_features(
                ctx,
                event,
                &pool,
                &witness_pool,
                mult,
                indexing,
            ));
        }
        Ok(FeatureContext {
            ctx,
            order,
            steps,
            canon,
            pool,
            cand,
            indexing,
            log: RefCell::new(None),
        })
    }

    /// Starts recording every query [`FeatureContext::features`] answers (for audits: which states a
    /// composition visited); [`FeatureContext::take_queries`] returns them.
    pub fn log_queries(&self) {
        *self.log.borrow_mut() = Some(Vec::new());
    }

    /// The queries recorded since [`FeatureContext::log_queries`] (empty when not logging).
    pub fn take_queries(&self) -> Vec<Query> {
        self.log.borrow_mut().take().unwrap_or_default()
    }

    /// How this context counts ages.
    pub fn indexing(&self) -> EventIndexing {
        self.indexing
    }

    /// The decision this context describes.
    pub fn decision(&self) -> &DecisionContext {
        self.ctx
    }

    /// The deduplicated candidate pool (steps, ascending).
    pub fn pool(&self) -> &[usize] {
        &self.pool
    }

    /// The pool members outside `recent` (ascending; `recent` sorted): the events that may swap in.
    pub(super) fn challengers(&self, recent: &[usize]) -> Vec<usize> {
        self.pool
            .iter()
            .copied()
            .filter(|s| recent.binary_search(s).is_err())
            .collect()
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
        if let Some(log) = self.log.borrow_mut().as_mut() {
            let mut sorted = set.to_vec();
            sorted.sort_unstable();
            log.push((candidate, sorted));
        }
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
            n_recent += usize::from(self.indexing.age(t, m) <= 5);
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

/// Validates `ctx` (reference point finite; every event's step in `1..t`, distinct, with a finite
/// `next_point`) and returns the event indices sorted by step and those steps.
fn sorted_events(ctx: &DecisionContext) -> Result<(Vec<usize>, Vec<usize>)> {
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
    Ok((order, steps))
}

/// Dedup by image hash, the most recent event kept. Per sorted position: the sorted position of the
/// kept event with the same hash, and (for kept events) how many events share its hash.
fn dedup_by_hash(ctx: &DecisionContext, order: &[usize]) -> (Vec<usize>, Vec<u32>) {
    let n = order.len();
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
    (canon, multiplicity)
}

/// The 20 candidate features of event `e` (see the module docs); `mult` is its dedup multiplicity.
fn candidate_features(
    ctx: &DecisionContext,
    e: &EventInfo,
    pool: &[usize],
    witness_pool: &[usize],
    mult: f64,
    indexing: EventIndexing,
) -> [f32; CANDIDATE_FEATURES] {
    let t = ctx.t;
    let s = e.step;
    let age = indexing.age(t, s) as f64;
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
    let b = e.next_bucket;
    let flag = |c: bool| if c { 1.0 } else { 0.0 };
    let v: [f64; CANDIDATE_FEATURES] = [
        age,
        age.ln(),
        rank as f64,
        indexing.event(s) as f64 / (t - 1).max(1) as f64,
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
    v.map(|x| x as f32)
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
