//! Composition: [`compose`] and [`compose_with`], which dispatch to each [`Mode`]'s file.

use super::greedy::greedy;
use super::paper::paper;
use super::reference::reference;
use super::{
    recent_b, Allocation, ComposeOptions, DecisionContext, FeatureContext, MarginalModel, Mode, Query,
};
use crate::error::Result;

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
    compose_in(
        &FeatureContext::with_indexing(ctx, options.indexing)?,
        budget,
        scorer,
        options,
    )
}

/// [`compose_with`], also returning every `Δ̂(j | S)` the scorer was asked for (in order): the states
/// the composition visited, to audit against the states the labels cover.
pub fn compose_logged<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    budget: usize,
    scorer: &M,
    options: &ComposeOptions,
) -> Result<(Allocation, Vec<Query>)> {
    let fc = FeatureContext::with_indexing(ctx, options.indexing)?;
    fc.log_queries();
    let a = compose_in(&fc, budget, scorer, options)?;
    Ok((a, fc.take_queries()))
}

fn compose_in<M: MarginalModel + ?Sized>(
    fc: &FeatureContext<'_>,
    budget: usize,
    scorer: &M,
    options: &ComposeOptions,
) -> Result<Allocation> {
    let ctx = fc.decision();
    let recent = recent_b(ctx, budget);
    if budget == 0 || ctx.events.len() <= budget {
        let mut a = Allocation::recent(recent);
        a.fell_back = false;
        return Ok(a);
    }
    match options.mode {
        Mode::Paper => paper(
            fc,
            scorer,
            recent,
            options.max_replacements.unwrap_or(budget),
            options.beam_width.max(1),
        ),
        Mode::Greedy => greedy(
            fc,
            budget,
            scorer,
            recent,
            options.max_replacements.unwrap_or(budget),
        ),
        Mode::Reference => reference(fc, budget, scorer, recent, options),
    }
}
