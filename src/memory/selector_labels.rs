//! Labelled decisions and what the labels say about a scorer: the implied marginals a scorer is
//! trained on ([`implied_marginals`]) and how its paper composition fares against Recent-B under the
//! labels ([`compare_with_recent`]). [`crate::memory::selector_train`] trains on these and
//! re-exports them.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::memory::selector::{
    compose_logged, recent_b, ComposeOptions, DecisionContext, EventIndexing, MarginalModel, Mode,
};

/// One labelled decision: the selector's view of it and the utility of every labelled set.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelledDecision {
    /// The episode it belongs to (the held-out split is by episode).
    pub episode: String,
    pub context: DecisionContext,
    /// `(S, Q(S))`, `S` ascending.
    pub utilities: Vec<(Vec<usize>, f64)>,
}

/// Implied marginals grouped by conditioning set: `(S, [(j, Δ(j | S))])`.
pub type States = Vec<(Vec<usize>, Vec<(usize, f64)>)>;

/// The implied marginals of one decision, grouped by conditioning set: `(S, [(j, Δ(j | S))])`, sets
/// and candidates ascending.
///
/// ```
/// use recall::memory::selector::DecisionContext;
/// use recall::memory::selector_labels::{implied_marginals, LabelledDecision};
/// let d = LabelledDecision {
///     episode: "e".into(),
///     context: DecisionContext { t: 4, ..Default::default() },
///     utilities: vec![(vec![], -2.0), (vec![1], -1.5), (vec![3], -1.0), (vec![1, 3], -0.25)],
/// };
/// let states = implied_marginals(&d);
/// assert_eq!(states[0], (vec![], vec![(1, 0.5), (3, 1.0)]));
/// assert_eq!(states[1], (vec![1], vec![(3, 1.25)]));
/// assert_eq!(states[2], (vec![3], vec![(1, 0.75)]));
/// ```
pub fn implied_marginals(d: &LabelledDecision) -> States {
    let q: BTreeMap<&[usize], f64> = d.utilities.iter().map(|(s, q)| (s.as_slice(), *q)).collect();
    let mut states: BTreeMap<Vec<usize>, Vec<(usize, f64)>> = BTreeMap::new();
    for (&set, &q_set) in &q {
        for (i, &j) in set.iter().enumerate() {
            let mut rest = set.to_vec();
            rest.remove(i);
            if let Some(&q_rest) = q.get(rest.as_slice()) {
                states.entry(rest).or_default().push((j, q_set - q_rest));
            }
        }
    }
    states
        .into_iter()
        .map(|(s, mut v)| {
            v.sort_by_key(|&(j, _)| j);
            (s, v)
        })
        .collect()
}

/// How the composed set compares with Recent-B under the labels.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ComposeOutcome {
    /// (decision, budget) cases where the selector had a choice (more events than `B`).
    pub cases: usize,
    /// The composed set is Recent-B.
    pub kept_recent: usize,
    /// The composed set is labelled and its `Q` beats Recent-B's.
    pub beats: usize,
    /// The composed set is labelled and its `Q` is below Recent-B's (or equal).
    pub loses: usize,
    /// The composed set has no label (no verdict).
    pub unscored: usize,
    /// Marginals `Δ̂(j | S)` the compositions asked the scorer for.
    pub queries: usize,
    /// Of those, the ones off the labels' states: `Q(S)` or `Q(S ∪ {j})` unlabelled, so no implied
    /// marginal of that state was ever a training target (paper mode asks `Δ̂(· | Recent-B ∖ {e})`,
    /// sets the default teacher paths rarely contain).
    pub off_label_queries: usize,
}

/// Paper composition at every budget whose Recent-B anchor is labelled, judged by the labels; also
/// counts the scorer queries the compositions made and those off the labelled states.
///
/// ```
/// use recall::memory::selector::{ActionBucket, DecisionContext, EventIndexing, EventInfo};
/// use recall::memory::selector_labels::{compare_with_recent, ComposeOutcome, LabelledDecision};
/// let ev = |step| EventInfo {
///     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None, witness: false,
/// };
/// let context = DecisionContext { t: 4, reference_point: None, events: (1..4).map(ev).collect() };
/// let d = LabelledDecision { episode: "e".into(), context, utilities: vec![(vec![3], -1.0)] };
/// let mut out = ComposeOutcome::default();
/// compare_with_recent(&d, &|f: &[f32; 28]| -f[0], EventIndexing::Desktop, &mut out);
/// assert_eq!((out.cases, out.kept_recent), (1, 1)); // B = 1: Recent-1 = {3} is labelled
/// assert!(out.off_label_queries > 0 && out.off_label_queries <= out.queries);
/// ```
pub fn compare_with_recent<M: MarginalModel + ?Sized>(
    d: &LabelledDecision,
    scorer: &M,
    indexing: EventIndexing,
    out: &mut ComposeOutcome,
) {
    let q: BTreeMap<&[usize], f64> = d.utilities.iter().map(|(s, q)| (s.as_slice(), *q)).collect();
    let n = d.context.events.len();
    for budget in 1..n {
        let recent = recent_b(&d.context, budget);
        let Some(&q_recent) = q.get(recent.as_slice()) else {
            continue;
        };
        let options = ComposeOptions {
            indexing,
            ..ComposeOptions::new(Mode::Paper)
        };
        let Ok((a, queries)) = compose_logged(&d.context, budget, scorer, &options) else {
            continue;
        };
        out.cases += 1;
        out.queries += queries.len();
        out.off_label_queries += queries
            .iter()
            .filter(|(j, set)| !labelled_state(&q, *j, set))
            .count();
        if a.steps == recent {
            out.kept_recent += 1;
        } else {
            match q.get(a.steps.as_slice()) {
                Some(&q_s) if q_s > q_recent => out.beats += 1,
                Some(_) => out.loses += 1,
                None => out.unscored += 1,
            }
        }
    }
}

/// Whether `Q(set)` and `Q(set ∪ {j})` are both labelled (`set` sorted, `j` not in it).
fn labelled_state(q: &BTreeMap<&[usize], f64>, j: usize, set: &[usize]) -> bool {
    let mut with = set.to_vec();
    with.insert(with.partition_point(|&s| s < j), j);
    q.contains_key(set) && q.contains_key(with.as_slice())
}
