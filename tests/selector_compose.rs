//! Composition acceptance: paper mode is a beam over swap sequences from Recent-B.
//!
//! * declining every swap recovers Recent-B exactly;
//! * with a beam wide enough to hold every reachable set, paper mode finds the best set that an
//!   independent brute force over all admissible swap sequences finds;
//! * greedy mode is the old greedy swap loop;
//! * `max_replacements = 0` gives Recent-B in every mode;
//! * NaN marginals never enter.

use std::collections::HashMap;
use std::path::Path;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use recall::memory::selector::{
    compose_with, dedup_pool, recent_b, ActionBucket, Allocation, ComposeOptions, DecisionContext,
    EventIndexing, EventInfo, FeatureContext, MarginalModel, MarginalScorer, Mode, Negated, ScorerParams,
    NUM_FEATURES,
};

const MODES: [Mode; 3] = [Mode::Paper, Mode::Greedy, Mode::Reference];

/// The hand models below read ages as `t − s` (the mobile indexing); composition does not depend on
/// how ages are counted, so every call here counts them that way.
const INDEXING: EventIndexing = EventIndexing::Mobile;

fn options(mode: Mode) -> ComposeOptions {
    ComposeOptions {
        indexing: INDEXING,
        ..ComposeOptions::new(mode)
    }
}

fn compose<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    budget: usize,
    model: &M,
    mode: Mode,
    max_replacements: Option<usize>,
) -> recall::Result<Allocation> {
    let options = ComposeOptions {
        max_replacements,
        ..options(mode)
    };
    compose_with(ctx, budget, model, &options)
}

fn feature_context(ctx: &DecisionContext) -> FeatureContext<'_> {
    FeatureContext::with_indexing(ctx, INDEXING).unwrap()
}

struct Rng(ChaCha8Rng);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(ChaCha8Rng::seed_from_u64(seed))
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }
    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f32 {
        (self.0.next_u32() >> 8) as f32 / (1u32 << 24) as f32
    }
    /// Uniform in `[-scale, scale)`.
    fn sym(&mut self, scale: f32) -> f32 {
        (self.unit() * 2.0 - 1.0) * scale
    }
    fn chance(&mut self, p: f32) -> bool {
        self.unit() < p
    }
}

fn ev(step: usize, hash: u64, bucket: ActionBucket, point: Option<(f64, f64)>, witness: bool) -> EventInfo {
    EventInfo {
        step,
        image_hash: hash,
        next_bucket: bucket,
        next_point: point,
        witness,
    }
}

/// A random decision: `t` in `2..=max_t`, some steps missing, image hashes from `lo + below(span)`
/// values (duplicates → aliases), random witnesses, buckets and points, shuffled.
fn random_ctx(rng: &mut Rng, max_t: usize, lo: usize, span: usize) -> DecisionContext {
    let hashes = lo + rng.below(span);
    let t = 2 + rng.below(max_t - 1);
    let buckets = [
        ActionBucket::Click,
        ActionBucket::Type,
        ActionBucket::Key,
        ActionBucket::Scroll,
        ActionBucket::Other,
    ];
    let mut events = Vec::new();
    for s in 1..t {
        if rng.chance(0.15) {
            continue;
        }
        let point = if rng.chance(0.6) {
            Some(((rng.unit() * 999.0) as f64, (rng.unit() * 999.0) as f64))
        } else {
            None
        };
        events.push(ev(
            s,
            rng.below(hashes) as u64,
            buckets[rng.below(5)],
            point,
            rng.chance(0.3),
        ));
    }
    for i in (1..events.len()).rev() {
        let j = rng.below(i + 1);
        events.swap(i, j);
    }
    let reference_point = if rng.chance(0.7) {
        Some(((rng.unit() * 999.0) as f64, (rng.unit() * 999.0) as f64))
    } else {
        None
    };
    DecisionContext {
        t,
        reference_point,
        events,
    }
}

/// Random MLP parameters with hidden size `h`; `scale` sizes the weights.
fn random_params(rng: &mut Rng, h: usize, scale: f32) -> ScorerParams {
    let mut v = |n: usize, s: f32| (0..n).map(|_| rng.sym(s)).collect::<Vec<f32>>();
    let feature_mean = v(NUM_FEATURES, 3.0);
    let feature_std = v(NUM_FEATURES, 1.0).iter().map(|x| 1.5 + x).collect();
    ScorerParams {
        feature_mean,
        feature_std,
        fc1_weight: v(h * NUM_FEATURES, scale),
        fc1_bias: v(h, scale),
        fc2_weight: v(h * h, scale),
        fc2_bias: v(h, scale),
        fc3_weight: v(h, scale),
        fc3_bias: v(1, 1.0)[0],
    }
}

fn random_scorer(rng: &mut Rng) -> MarginalScorer {
    let h = [4, 8, 16, 24][rng.below(4)];
    let scale = [0.3, 0.7, 1.2][rng.below(3)];
    MarginalScorer::from_params(&random_params(rng, h, scale)).unwrap()
}

/// A random MLP whose readout is dominated by one hidden unit computing `−1e4 · gelu(gelu(age + 1))`
/// (strictly falling in age), so an older event never beats a recent one.
fn age_forced_scorer(rng: &mut Rng, h: usize) -> MarginalScorer {
    let mut p = random_params(rng, h, 0.05);
    p.feature_mean[0] = 0.0;
    p.feature_std[0] = 1.0;
    for k in 0..NUM_FEATURES {
        p.fc1_weight[k] = if k == 0 { 1.0 } else { 0.0 };
    }
    p.fc1_bias[0] = 1.0;
    for k in 0..h {
        p.fc2_weight[k] = if k == 0 { 1.0 } else { 0.0 };
    }
    p.fc2_bias[0] = 0.0;
    p.fc3_weight[0] = -1e4;
    MarginalScorer::from_params(&p).unwrap()
}

/// Every output equal (zero readout): a swap needs a strict win, so none happens.
fn flat_scorer(rng: &mut Rng) -> MarginalScorer {
    let mut p = random_params(rng, 8, 1.0);
    p.fc3_weight.iter_mut().for_each(|w| *w = 0.0);
    MarginalScorer::from_params(&p).unwrap()
}

fn paper_wide(max_replacements: Option<usize>) -> ComposeOptions {
    ComposeOptions {
        max_replacements,
        beam_width: 1 << 20,
        ..options(Mode::Paper)
    }
}

/// The largest `b` steps, ascending (written out independently of `recent_b`).
fn top_steps(ctx: &DecisionContext, b: usize) -> Vec<usize> {
    let mut steps: Vec<usize> = ctx.events.iter().map(|e| e.step).collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps.truncate(b);
    steps.sort_unstable();
    steps
}

/// The marginals `(Δ̂(e | S∖{e}), Δ̂(o | S∖{e}))` of swapping `e` out for `o` in `set`, one row at
/// a time through `score`.
fn swap_marginals<M: MarginalModel + ?Sized>(
    fc: &FeatureContext<'_>,
    m: &M,
    set: &[usize],
    e: usize,
    o: usize,
) -> (f32, f32) {
    let rest: Vec<usize> = set.iter().copied().filter(|&s| s != e).collect();
    (
        m.score(&fc.features(e, &rest).unwrap()),
        m.score(&fc.features(o, &rest).unwrap()),
    )
}

/// Every set reachable from Recent-B by at most `r` admissible swaps, each with the best score of a
/// path reaching it: `(best score, all sets with that score)`. A swap evicts `e ∈ S ∩ Recent-B`
/// for a pool event `o ∉ S ∪ Recent-B`; it is admissible iff `Δ̂(o|S∖e) − Δ̂(e|S∖e) > 0` (in f64);
/// a path's score is its gains summed in order from 0.
fn brute_force<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    b: usize,
    r: usize,
    m: &M,
) -> (f64, Vec<Vec<usize>>) {
    let fc = feature_context(ctx);
    let recent = top_steps(ctx, b);
    let pool = dedup_pool(ctx).unwrap();
    let mut best: HashMap<Vec<usize>, f64> = HashMap::new();
    #[allow(clippy::too_many_arguments)]
    fn walk<M: MarginalModel + ?Sized>(
        fc: &FeatureContext<'_>,
        m: &M,
        recent: &[usize],
        pool: &[usize],
        set: Vec<usize>,
        acc: f64,
        left: usize,
        seen: &mut HashMap<Vec<usize>, f64>,
    ) {
        let entry = seen.entry(set.clone()).or_insert(acc);
        *entry = entry.max(acc);
        if left == 0 {
            return;
        }
        for &e in set.iter().filter(|s| recent.contains(s)) {
            for &o in pool.iter().filter(|o| !recent.contains(o) && !set.contains(o)) {
                let (em, om) = swap_marginals(fc, m, &set, e, o);
                let gain = om as f64 - em as f64;
                if gain > 0.0 {
                    let mut next: Vec<usize> = set.iter().copied().filter(|&s| s != e).collect();
                    next.push(o);
                    next.sort_unstable();
                    walk(fc, m, recent, pool, next, acc + gain, left - 1, seen);
                }
            }
        }
    }
    if ctx.events.len() <= b {
        let all = top_steps(ctx, b);
        return (0.0, vec![all]);
    }
    walk(&fc, m, &recent, &pool, recent.clone(), 0.0, r, &mut best);
    let top = best.values().copied().fold(f64::NEG_INFINITY, f64::max);
    let sets = best
        .into_iter()
        .filter(|(_, v)| *v == top)
        .map(|(s, _)| s)
        .collect();
    (top, sets)
}

/// Replays `a.swaps` from Recent-B: every swap is admissible with the recorded marginals, the set
/// and score follow, and `k` is the number of swaps.
fn check_path<M: MarginalModel + ?Sized>(ctx: &DecisionContext, b: usize, m: &M, a: &Allocation) {
    let fc = feature_context(ctx);
    let recent = top_steps(ctx, b);
    assert_eq!(a.recent, recent);
    let mut set = recent.clone();
    let mut score = 0f64;
    for s in &a.swaps {
        assert!(set.contains(&s.evicted) && recent.contains(&s.evicted), "{a:?}");
        assert!(!set.contains(&s.entered) && !recent.contains(&s.entered), "{a:?}");
        assert!(fc.in_pool(s.entered), "{a:?}");
        let (em, om) = swap_marginals(&fc, m, &set, s.evicted, s.entered);
        assert_eq!(em.to_bits(), s.evicted_marginal.to_bits());
        assert_eq!(om.to_bits(), s.entered_marginal.to_bits());
        let gain = om as f64 - em as f64;
        assert!(gain > 0.0, "inadmissible swap {s:?}");
        assert_eq!(gain, s.gain());
        score += gain;
        set.retain(|&x| x != s.evicted);
        set.push(s.entered);
        set.sort_unstable();
    }
    assert_eq!(a.steps, set);
    assert_eq!(a.score, score);
    assert_eq!(a.k, a.swaps.len());
    assert_eq!(a.k, a.steps.iter().filter(|s| !recent.contains(s)).count());
}

fn assert_recent(a: &Allocation, ctx: &DecisionContext, b: usize, what: &str) {
    assert_eq!(a.steps, recent_b(ctx, b), "{what} B={b} {ctx:?}");
    assert_eq!(a.k, 0, "{what}");
    assert!(a.swaps.is_empty(), "{what}");
    assert_eq!(a.score, 0.0, "{what}");
}

// (a) -----------------------------------------------------------------------------------------------

#[test]
fn declining_every_swap_recovers_recent_b() {
    let mut rng = Rng::new(1);
    let prefers_recent = |f: &[f32; 28]| -f[0];
    for case in 0..200 {
        let ctx = random_ctx(&mut rng, 30, 1, 30);
        let b = rng.below(7);
        let mlp = random_scorer(&mut rng);
        let recent = recent_b(&ctx, b);
        let ages: Vec<f32> = recent.iter().map(|&s| (ctx.t - s) as f32).collect();
        // The random MLP with every event outside Recent-B pushed 1e6 below.
        let forced = |f: &[f32; 28]| mlp.score(f) - if ages.contains(&f[0]) { 0.0 } else { 1e6 };
        let age_forced = age_forced_scorer(&mut rng, 16);
        let flat = flat_scorer(&mut rng);
        let models: [(&str, &dyn MarginalModel); 4] = [
            ("prefers_recent", &prefers_recent),
            ("forced", &forced),
            ("age_forced_mlp", &age_forced),
            ("flat_mlp", &flat),
        ];
        for (name, m) in models {
            for mode in [Mode::Paper, Mode::Greedy] {
                for cap in [None, Some(1), Some(b + 3)] {
                    let a = compose(&ctx, b, m, mode, cap).unwrap();
                    assert_recent(&a, &ctx, b, &format!("case {case} {name} {mode:?} cap {cap:?}"));
                }
            }
            let wide = compose_with(&ctx, b, m, &paper_wide(None)).unwrap();
            assert_recent(&wide, &ctx, b, name);
        }
    }
}

#[test]
fn zero_gain_swaps_are_declined_even_when_they_would_open_a_gainful_path() {
    // Recent-2 = {8, 9}. Recent events score 0; an older event scores 1 when the rest of the set
    // holds no event of age ≤ 5, else 0. A first swap gains exactly 0 (the other recent event is
    // still there); only after it could a second swap gain 1. Admissibility needs a strict win.
    let ctx = DecisionContext {
        t: 10,
        reference_point: None,
        events: (1..10)
            .map(|s| ev(s, s as u64, ActionBucket::Click, None, false))
            .collect(),
    };
    let model = |f: &[f32; 28]| {
        if f[0] <= 2.0 || f[23] > 0.0 {
            0.0
        } else {
            1.0
        }
    };
    for mode in [Mode::Paper, Mode::Greedy] {
        assert_recent(
            &compose(&ctx, 2, &model, mode, None).unwrap(),
            &ctx,
            2,
            "zero gain",
        );
    }
    let wide = compose_with(&ctx, 2, &model, &paper_wide(None)).unwrap();
    assert_recent(&wide, &ctx, 2, "zero gain, wide");
    assert_eq!(brute_force(&ctx, 2, 2, &model), (0.0, vec![vec![8, 9]]));
}

// (b) -----------------------------------------------------------------------------------------------

#[test]
fn wide_paper_beam_equals_brute_force_over_swap_sequences() {
    let mut rng = Rng::new(2);
    let (mut checked, mut swapped, mut beat_greedy, mut ties) = (0, 0, 0, 0);
    while checked < 150 {
        let ctx = random_ctx(&mut rng, 12, 2, 10);
        if ctx.events.len() < 2 {
            continue;
        }
        let mlp = random_scorer(&mut rng);
        let holes = rng.below(4) == 0;
        // Sometimes NaN on a quarter of the rows (a hash of the features decides which).
        let model = |f: &[f32; 28]| {
            let key = f.iter().fold(0u32, |h, x| h.rotate_left(5) ^ x.to_bits());
            if holes && key.wrapping_mul(0x9e37_79b9) >> 30 == 0 {
                f32::NAN
            } else {
                mlp.score(f)
            }
        };
        for b in 1..=3 {
            for r in 1..=b {
                let (best, sets) = brute_force(&ctx, b, r, &model);
                let a = compose_with(&ctx, b, &model, &paper_wide(Some(r))).unwrap();
                check_path(&ctx, b, &model, &a);
                assert!(a.k <= r);
                assert_eq!(a.score, best, "B={b} r={r} {ctx:?}");
                assert!(
                    sets.contains(&a.steps),
                    "B={b} r={r}: {:?} not in {sets:?}",
                    a.steps
                );
                if sets.len() == 1 {
                    assert_eq!(a.steps, sets[0]);
                } else {
                    ties += 1;
                }
                swapped += usize::from(a.k > 0);
                // The default (narrow) beam and greedy are admissible paths scoring at most that.
                for mode in [Mode::Paper, Mode::Greedy] {
                    let narrow = compose(&ctx, b, &model, mode, Some(r)).unwrap();
                    if !holes || mode == Mode::Paper {
                        check_path(&ctx, b, &model, &narrow);
                    }
                    if !holes {
                        assert!(narrow.score <= best, "{mode:?} B={b} r={r}");
                    }
                    if mode == Mode::Greedy && !holes && narrow.score < best {
                        beat_greedy += 1;
                    }
                }
            }
        }
        checked += 1;
    }
    println!(
        "150 contexts × 6 (B, r): paper swapped in {swapped}, beat greedy in {beat_greedy}, \
         tied best sets in {ties}"
    );
    assert!(swapped > 100, "too few swaps exercised: {swapped}");
    assert!(beat_greedy > 0, "the beam never beat greedy");
}

/// Paper mode as documented, written plainly: materialize every child, keep each set's best path
/// (equal scores: the first generated), rank by score then generation, keep `width`.
fn plain_paper<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    b: usize,
    m: &M,
    width: usize,
    cap: usize,
) -> (Vec<usize>, f64, Vec<(usize, usize)>) {
    let recent = top_steps(ctx, b);
    if b == 0 || ctx.events.len() <= b {
        return (recent, 0.0, Vec::new());
    }
    let fc = feature_context(ctx);
    let pool = dedup_pool(ctx).unwrap();
    // (set, score, path, generation index)
    type Node = (Vec<usize>, f64, Vec<(usize, usize)>, usize);
    let mut beam: Vec<Node> = vec![(recent.clone(), 0.0, Vec::new(), 0)];
    let mut best = beam[0].clone();
    for _ in 0..cap.min(b) {
        let mut children: Vec<Node> = Vec::new();
        let mut generated = 0;
        for (set, score, path, _) in &beam {
            for &e in set.iter().filter(|s| recent.contains(s)) {
                for &o in pool
                    .iter()
                    .rev()
                    .filter(|o| !recent.contains(o) && !set.contains(o))
                {
                    let (em, om) = swap_marginals(&fc, m, set, e, o);
                    let gain = om as f64 - em as f64;
                    if gain.is_nan() || gain <= 0.0 {
                        continue;
                    }
                    let mut child: Vec<usize> = set.iter().copied().filter(|&s| s != e).collect();
                    child.push(o);
                    child.sort_unstable();
                    let mut child_path = path.clone();
                    child_path.push((e, o));
                    let node = (child, score + gain, child_path, generated);
                    generated += 1;
                    match children.iter_mut().find(|c| c.0 == node.0) {
                        Some(c) if node.1 > c.1 => *c = node,
                        Some(_) => {}
                        None => children.push(node),
                    }
                }
            }
        }
        if children.is_empty() {
            break;
        }
        children.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.3.cmp(&y.3)));
        children.truncate(width);
        if children[0].1 > best.1 {
            best = children[0].clone();
        }
        beam = children;
    }
    (best.0, best.1, best.2)
}

#[test]
fn narrow_paper_beam_follows_its_documented_tie_breaks() {
    let mut rng = Rng::new(8);
    // Integer-valued marginals tie often; the MLP almost never does.
    let age = |f: &[f32; 28]| f[0];
    let coarse = |f: &[f32; 28]| (f[0] * 0.5).floor() + 2.0 * f[10] - (f[21] * 0.25).floor();
    for _ in 0..150 {
        let ctx = random_ctx(&mut rng, 16, 2, 14);
        let mlp = random_scorer(&mut rng);
        let models: [(&str, &dyn MarginalModel); 3] = [("age", &age), ("coarse", &coarse), ("mlp", &mlp)];
        for (name, m) in models {
            for b in 1..=4 {
                for width in 1..=4 {
                    let cap = 1 + rng.below(b);
                    let options = ComposeOptions {
                        max_replacements: Some(cap),
                        beam_width: width,
                        ..options(Mode::Paper)
                    };
                    let a = compose_with(&ctx, b, m, &options).unwrap();
                    let (steps, score, path) = plain_paper(&ctx, b, m, width, cap);
                    let what = format!("{name} B={b} width={width} cap={cap} {ctx:?}");
                    assert_eq!(a.steps, steps, "{what}");
                    assert_eq!(a.score, score, "{what}");
                    assert_eq!(pairs(&a), path, "{what}");
                    check_path(&ctx, b, m, &a);
                }
            }
        }
    }
}

// (c) -----------------------------------------------------------------------------------------------

fn linear_ctx(t: usize) -> DecisionContext {
    DecisionContext {
        t,
        reference_point: Some((500.0, 500.0)),
        events: (1..t)
            .map(|s| {
                ev(
                    s,
                    s as u64 * 7919,
                    ActionBucket::Click,
                    Some((s as f64 * 10.0, 500.0)),
                    s % 4 == 1,
                )
            })
            .collect(),
    }
}

fn pairs(a: &Allocation) -> Vec<(usize, usize)> {
    a.swaps.iter().map(|s| (s.evicted, s.entered)).collect()
}

#[test]
fn greedy_mode_is_the_old_swap_loop_on_hand_cases() {
    // The `compose` doc example: witness 2 displaces 7, the weakest recent event.
    let ctx = DecisionContext {
        t: 10,
        reference_point: None,
        events: (1..10)
            .map(|s| ev(s, s as u64, ActionBucket::Click, None, s == 2))
            .collect(),
    };
    let model = |f: &[f32; 28]| f[10] * 5.0 - f[0] * 0.01;
    let a = compose(&ctx, 3, &model, Mode::Greedy, None).unwrap();
    assert_eq!(a.steps, vec![2, 8, 9]);
    assert_eq!(pairs(&a), vec![(7, 2)]);
    assert_eq!(a.k, 1);

    // Witnesses 1, 5, 9; Recent-3 = {9, 10, 11}. Evict 10 (−0.02 < 11's −0.01) for 5 (2.93),
    // then 11 for 1 (2.89); then only 9 is recent and no non-witness beats it.
    let ctx = linear_ctx(12);
    let model = |f: &[f32; 28]| f[10] * 3.0 - f[0] * 0.01;
    let a = compose(&ctx, 3, &model, Mode::Greedy, None).unwrap();
    assert_eq!(a.steps, vec![1, 5, 9]);
    assert_eq!(pairs(&a), vec![(10, 5), (11, 1)]);
    assert_eq!(a.k, 2);
    let gains = (2.93f32 as f64 + 0.02f32 as f64) + (2.89f32 as f64 + 0.01f32 as f64);
    assert!((a.score - gains).abs() < 1e-5, "{}", a.score);
    let one = compose(&ctx, 3, &model, Mode::Greedy, Some(1)).unwrap();
    assert_eq!((pairs(&one), one.steps), (vec![(10, 5)], vec![5, 9, 11]));
    let zero = compose(&ctx, 3, &model, Mode::Greedy, Some(0)).unwrap();
    assert_eq!(zero.steps, vec![9, 10, 11]);
    // Paper mode reaches the same set on this additive model.
    let paper = compose(&ctx, 3, &model, Mode::Paper, None).unwrap();
    assert_eq!(paper.steps, vec![1, 5, 9]);
    assert!((paper.score - a.score).abs() < 1e-5);

    // A NaN-scored recent event ranks lowest in greedy mode, so a finite challenger evicts it
    // (with an infinite gain); paper mode declines any swap with a NaN marginal.
    let ctx = linear_ctx(8); // Recent-2 = {6, 7}
    let model = |f: &[f32; 28]| if f[0] == 1.0 { f32::NAN } else { -f[0] };
    let g = compose(&ctx, 2, &model, Mode::Greedy, None).unwrap();
    assert_eq!(pairs(&g), vec![(7, 5)]);
    assert_eq!(g.steps, vec![5, 6]);
    assert_eq!(g.score, f64::INFINITY);
    let p = compose(&ctx, 2, &model, Mode::Paper, None).unwrap();
    assert_eq!(p.steps, vec![6, 7]);
    assert!(p.swaps.is_empty());
}

/// The greedy loop as it stood before the beam, written out again.
fn old_greedy<M: MarginalModel + ?Sized>(
    ctx: &DecisionContext,
    b: usize,
    m: &M,
    cap: Option<usize>,
) -> (Vec<usize>, Vec<(usize, usize)>) {
    let recent = recent_b(ctx, b);
    if b == 0 || ctx.events.len() <= b {
        return (recent, Vec::new());
    }
    let low = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let fc = feature_context(ctx);
    let challengers: Vec<usize> = fc
        .pool()
        .iter()
        .copied()
        .filter(|s| !recent.contains(s))
        .collect();
    let mut set = recent.clone();
    let mut swaps = Vec::new();
    while swaps.len() < cap.unwrap_or(b).min(b) {
        let evictable: Vec<usize> = set.iter().copied().filter(|s| recent.contains(s)).collect();
        if evictable.is_empty() {
            break;
        }
        let mut worst: Option<(usize, f32)> = None;
        for &e in &evictable {
            let rest: Vec<usize> = set.iter().copied().filter(|&s| s != e).collect();
            let v = low(m.score(&fc.features(e, &rest).unwrap()));
            if worst.is_none_or(|(_, w)| v < w) {
                worst = Some((e, v));
            }
        }
        let (evicted, ev) = worst.unwrap();
        let rest: Vec<usize> = set.iter().copied().filter(|&s| s != evicted).collect();
        let mut best: Option<(usize, f32)> = None;
        for &o in challengers.iter().filter(|o| !set.contains(o)) {
            let v = low(m.score(&fc.features(o, &rest).unwrap()));
            if best.is_none_or(|(_, w)| v >= w) {
                best = Some((o, v));
            }
        }
        match best {
            Some((o, v)) if v > ev => {
                set = rest;
                set.push(o);
                set.sort_unstable();
                swaps.push((evicted, o));
            }
            _ => break,
        }
    }
    (set, swaps)
}

#[test]
fn greedy_mode_matches_the_old_loop_on_random_contexts() {
    let mut rng = Rng::new(3);
    for _ in 0..300 {
        let ctx = random_ctx(&mut rng, 25, 1, 25);
        let mlp = random_scorer(&mut rng);
        let b = rng.below(6);
        let cap = if rng.chance(0.5) { Some(rng.below(4)) } else { None };
        let a = compose(&ctx, b, &mlp, Mode::Greedy, cap).unwrap();
        let (steps, swaps) = old_greedy(&ctx, b, &mlp, cap);
        assert_eq!(a.steps, steps, "B={b} cap={cap:?} {ctx:?}");
        assert_eq!(pairs(&a), swaps);
        check_path(&ctx, b, &mlp, &a);
    }
}

// (d) -----------------------------------------------------------------------------------------------

#[test]
fn zero_replacements_gives_recent_b_in_every_mode() {
    let mut rng = Rng::new(4);
    let old = |f: &[f32; 28]| f[0]; // wants the oldest events
    for case in 0..200 {
        let ctx = random_ctx(&mut rng, 30, 1, 30);
        let b = rng.below(7);
        let mlp = random_scorer(&mut rng);
        let models: [&dyn MarginalModel; 2] = [&old, &mlp];
        for m in models {
            for mode in MODES {
                let a = compose(&ctx, b, m, mode, Some(0)).unwrap();
                assert_eq!(a.steps, recent_b(&ctx, b), "case {case} {mode:?}");
                assert_eq!(a.k, 0);
                assert!(a.swaps.is_empty());
            }
            let a = compose_with(&ctx, b, m, &paper_wide(Some(0))).unwrap();
            assert_recent(&a, &ctx, b, "wide paper");
        }
    }
}

#[test]
fn max_replacements_caps_k_in_every_mode() {
    let mut rng = Rng::new(5);
    let old = |f: &[f32; 28]| f[0];
    for _ in 0..200 {
        let ctx = random_ctx(&mut rng, 30, 30, 1);
        let b = 1 + rng.below(6);
        let cap = rng.below(b + 2);
        for mode in MODES {
            let a = compose(&ctx, b, &old, mode, Some(cap)).unwrap();
            assert!(a.k <= cap, "{mode:?} k={} cap={cap}", a.k);
            assert_eq!(a.steps.len(), b.min(ctx.events.len()));
            if mode != Mode::Reference {
                check_path(&ctx, b, &old, &a);
                // An older event always wins here, so every allowed swap is taken (as long as there
                // are challengers).
                let challengers = dedup_pool(&ctx)
                    .unwrap()
                    .into_iter()
                    .filter(|s| !a.recent.contains(s))
                    .count();
                if ctx.events.len() > b {
                    assert_eq!(a.k, cap.min(b).min(challengers), "{mode:?}");
                }
            }
        }
    }
}

// (e) -----------------------------------------------------------------------------------------------

#[test]
fn nan_marginals_never_enter() {
    let mut rng = Rng::new(6);
    for _ in 0..200 {
        let ctx = random_ctx(&mut rng, 30, 1, 30);
        let b = rng.below(7);
        let mlp = random_scorer(&mut rng);
        let recent = recent_b(&ctx, b);
        let ages: Vec<f32> = recent.iter().map(|&s| (ctx.t - s) as f32).collect();
        // NaN for every event outside Recent-B: nothing can enter.
        let old_nan = |f: &[f32; 28]| {
            if ages.contains(&f[0]) {
                mlp.score(f)
            } else {
                f32::NAN
            }
        };
        for mode in [Mode::Paper, Mode::Greedy] {
            let a = compose(&ctx, b, &old_nan, mode, None).unwrap();
            assert_recent(&a, &ctx, b, &format!("{mode:?} old_nan"));
        }
        assert_recent(
            &compose_with(&ctx, b, &old_nan, &paper_wide(None)).unwrap(),
            &ctx,
            b,
            "wide old_nan",
        );
        // NaN for every recent event and the oldest-first model elsewhere: paper mode declines
        // every swap (a NaN marginal on either side is not a win).
        let recent_nan = |f: &[f32; 28]| if ages.contains(&f[0]) { f32::NAN } else { f[0] };
        assert_recent(
            &compose(&ctx, b, &recent_nan, Mode::Paper, None).unwrap(),
            &ctx,
            b,
            "paper recent_nan",
        );
        // NaN on random rows: every accepted swap has finite marginals on both sides in paper
        // mode, a non-NaN entered marginal in greedy mode.
        let holes = |f: &[f32; 28]| {
            let key = f.iter().fold(0u32, |h, x| h.rotate_left(7) ^ x.to_bits());
            if key.wrapping_mul(0x9e37_79b9) >> 31 == 0 {
                f32::NAN
            } else {
                mlp.score(f)
            }
        };
        for mode in [Mode::Paper, Mode::Greedy] {
            for options in [options(mode), paper_wide(None)] {
                let options = ComposeOptions { mode, ..options };
                let a = compose_with(&ctx, b, &holes, &options).unwrap();
                assert_eq!(a.steps.len(), b.min(ctx.events.len()));
                for s in &a.swaps {
                    assert!(!s.entered_marginal.is_nan(), "{mode:?} {s:?}");
                    if mode == Mode::Paper {
                        assert!(!s.evicted_marginal.is_nan() && s.gain() > 0.0, "{s:?}");
                    }
                }
                if mode == Mode::Paper {
                    assert!(!a.score.is_nan());
                    check_path(&ctx, b, &holes, &a);
                }
            }
        }
    }
}

// Parsing and timing ---------------------------------------------------------------------------------

#[test]
fn modes_parse_and_print() {
    for mode in MODES {
        assert_eq!(mode.to_string().parse::<Mode>().unwrap(), mode);
    }
    assert_eq!("greedy".parse::<Mode>().unwrap(), Mode::Greedy);
    let err = "beam".parse::<Mode>().unwrap_err().to_string();
    for name in ["paper", "greedy", "reference"] {
        assert!(err.contains(name), "{err}");
    }
}

/// Every mode fills B = 4 from a 50-event pool with the H = 192 fixture scorer and its negation (the
/// cost is measured by `cargo bench --bench selector`).
#[test]
fn every_mode_fills_the_budget_from_a_50_event_pool() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/selector/scorer.safetensors");
    let trained = MarginalScorer::load(&fixture).unwrap();
    assert_eq!(trained.hidden(), 192);
    let ctx = DecisionContext {
        t: 51,
        reference_point: Some((400.0, 300.0)),
        events: (1..51)
            .map(|s| {
                ev(
                    s,
                    s as u64,
                    ActionBucket::Click,
                    Some(((s * 17 % 999) as f64, 250.0)),
                    s % 7 == 0,
                )
            })
            .collect(),
    };
    assert_eq!(dedup_pool(&ctx).unwrap().len(), 50);
    let negated = Negated(&trained);
    let models: [&dyn MarginalModel; 2] = [&trained, &negated];
    for m in models {
        for mode in MODES {
            let a = compose(&ctx, 4, m, mode, None).unwrap();
            assert_eq!(a.steps.len(), 4, "{mode:?}");
            assert!(
                a.k <= 4 && a.steps.windows(2).all(|w| w[0] < w[1]),
                "{mode:?}: {a:?}"
            );
        }
    }
}
