//! [`Mode::Reference`](super::Mode::Reference), after the authors' serving code: a beam from the
//! empty set over the deduplicated pool; the beam itself is shared with the oracle policy.

use std::collections::HashMap;

use super::allocation::nan_low;
use super::{Allocation, ComposeOptions, FeatureContext, MarginalModel};
use crate::error::{Error, Result};

/// Reference composition (see [`compose_with`](super::compose_with)); `budget` is at least 1 and
/// below the number of events.
pub(super) fn reference<M: MarginalModel + ?Sized>(
    fc: &FeatureContext<'_>,
    budget: usize,
    scorer: &M,
    recent: Vec<usize>,
    options: &ComposeOptions,
) -> Result<Allocation> {
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
