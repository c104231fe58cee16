//! [`Mode::Paper`](super::Mode::Paper): a small beam over swap sequences initialized at Recent-B.

use std::collections::{HashMap, HashSet};

use super::{Allocation, FeatureContext, MarginalModel, Swap, NUM_FEATURES};
use crate::error::{Error, Result};

/// One path of [`Mode::Paper`](super::Mode::Paper)'s beam: the set it reached, its summed gain and its
/// swaps.
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

/// An admissible swap of one round: (child score, proposal, challenger index in its [`Rest`]).
type Candidate = (f64, usize, usize);

/// The working state of one paper round, its buffers reused across rounds.
#[derive(Default)]
struct Round {
    /// Feature rows of the round: every rest's challengers, then the evicted events.
    rows: Vec<[f32; NUM_FEATURES]>,
    /// One score per row.
    scores: Vec<f32>,
    rests: Vec<Rest>,
    rest_at: HashMap<Vec<usize>, usize>,
    evict_at: HashMap<(usize, usize), usize>,
    /// (parent, evicted, rest, row of the evicted event's marginal)
    proposals: Vec<(usize, usize, usize, usize)>,
    swaps: Vec<Candidate>,
}

/// Paper composition (see [`compose_with`](super::compose_with)).
pub(super) fn paper<M: MarginalModel + ?Sized>(
    fc: &FeatureContext<'_>,
    scorer: &M,
    recent: Vec<usize>,
    max_rounds: usize,
    width: usize,
) -> Result<Allocation> {
    let challengers = fc.challengers(&recent);
    let mut best = SwapPath {
        set: recent.clone(),
        score: 0.0,
        swaps: Vec::new(),
    };
    let mut beam = vec![best.clone()];
    let mut round = Round::default();
    for _ in 0..max_rounds.min(recent.len()) {
        round.propose(fc, &beam, &recent, &challengers)?;
        if round.proposals.is_empty() {
            break;
        }
        scorer.score_batch(&round.rows, &mut round.scores);
        if round.scores.len() != round.rows.len() {
            return Err(Error::InvalidRequest(
                "selector: scorer returned the wrong number of scores".into(),
            ));
        }
        round.collect_admissible(&beam);
        if round.swaps.is_empty() {
            break;
        }
        let children = round.best_children(&beam, width);
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

impl Round {
    /// Lists every (parent, recent member to evict) pair of the beam whose rest has challengers, and
    /// the feature rows their marginals need (each distinct rest and (evicted, rest) pair once).
    fn propose(
        &mut self,
        fc: &FeatureContext<'_>,
        beam: &[SwapPath],
        recent: &[usize],
        challengers: &[usize],
    ) -> Result<()> {
        self.rows.clear();
        self.rests.clear();
        self.rest_at.clear();
        self.evict_at.clear();
        self.proposals.clear();
        for (p, parent) in beam.iter().enumerate() {
            for &e in parent.set.iter().filter(|s| recent.binary_search(s).is_ok()) {
                let rest: Vec<usize> = parent.set.iter().copied().filter(|&s| s != e).collect();
                let r = self.rest_index(fc, rest, challengers)?;
                if self.rests[r].open.is_empty() {
                    continue;
                }
                let row = self.evicted_row(fc, e, r)?;
                self.proposals.push((p, e, r, row));
            }
        }
        Ok(())
    }

    /// The index of `rest` among the round's rests, adding it (and its challengers' rows) if new.
    fn rest_index(
        &mut self,
        fc: &FeatureContext<'_>,
        rest: Vec<usize>,
        challengers: &[usize],
    ) -> Result<usize> {
        if let Some(&r) = self.rest_at.get(&rest) {
            return Ok(r);
        }
        // Entered events stay in the set, so "outside S" also excludes them.
        let open: Vec<usize> = challengers
            .iter()
            .copied()
            .filter(|c| rest.binary_search(c).is_err())
            .collect();
        let first = self.rows.len();
        for &o in &open {
            self.rows.push(fc.features(o, &rest)?);
        }
        self.rests.push(Rest {
            set: rest.clone(),
            open,
            first,
        });
        self.rest_at.insert(rest, self.rests.len() - 1);
        Ok(self.rests.len() - 1)
    }

    /// The row of `Δ̂(e | rest r)`, adding it if new.
    fn evicted_row(&mut self, fc: &FeatureContext<'_>, e: usize, r: usize) -> Result<usize> {
        if let Some(&row) = self.evict_at.get(&(e, r)) {
            return Ok(row);
        }
        self.rows.push(fc.features(e, &self.rests[r].set)?);
        self.evict_at.insert((e, r), self.rows.len() - 1);
        Ok(self.rows.len() - 1)
    }

    /// Fills `swaps` with the admissible swaps as (child score, proposal, challenger index); generation
    /// order is proposal ascending, then challenger index descending (the more recent challenger first).
    fn collect_admissible(&mut self, beam: &[SwapPath]) {
        self.swaps.clear();
        for (q, &(p, _, r, row)) in self.proposals.iter().enumerate() {
            let evicted_marginal = self.scores[row] as f64;
            let rest = &self.rests[r];
            for i in (0..rest.open.len()).rev() {
                let gain = self.scores[rest.first + i] as f64 - evicted_marginal;
                // Declined unless > 0, including NaN (either marginal, or ∞ − ∞).
                if gain.is_nan() || gain <= 0.0 {
                    continue;
                }
                self.swaps.push((beam[p].score + gain, q, i));
            }
        }
    }

    /// The `width` best distinct sets reached by this round's admissible swaps (`swaps` non-empty),
    /// best first, each with its best path.
    fn best_children(&mut self, beam: &[SwapPath], width: usize) -> Vec<SwapPath> {
        // Score descending (never NaN: gains are > 0), ties in generation order: a total order.
        let rank = |a: &Candidate, b: &Candidate| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(b.2.cmp(&a.2));
        // A set is generated at most once per parent, so the first `width` distinct sets in rank
        // order lie within the first `width · |beam|` ranks: select those, then sort only them.
        let keep = width.saturating_mul(beam.len()).min(self.swaps.len());
        if keep < self.swaps.len() {
            self.swaps.select_nth_unstable_by(keep - 1, rank);
            self.swaps.truncate(keep);
        }
        self.swaps.sort_unstable_by(rank);
        // Walking the ranking, a set's first occurrence is its best path.
        let mut children: Vec<SwapPath> = Vec::with_capacity(width.min(keep));
        let mut taken: HashSet<Vec<usize>> = HashSet::new();
        for &(score, q, i) in self.swaps.iter() {
            let (p, evicted, r, row) = self.proposals[q];
            let rest = &self.rests[r];
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
                evicted_marginal: self.scores[row],
                entered_marginal: self.scores[rest.first + i],
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
        children
    }
}
