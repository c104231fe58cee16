//! [`Mode::Greedy`](super::Mode::Greedy): a single greedy swap loop from Recent-B.

use super::allocation::nan_low;
use super::{Allocation, FeatureContext, MarginalModel, Swap};
use crate::error::Result;

/// Greedy composition (see [`compose_with`](super::compose_with)).
pub(super) fn greedy<M: MarginalModel + ?Sized>(
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
    let challengers = fc.challengers(&recent);
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
    let score = swaps.iter().map(Swap::gain).sum();
    Ok(Allocation {
        k: swaps.len(),
        steps: set,
        recent,
        score,
        swaps,
        fell_back: false,
    })
}
