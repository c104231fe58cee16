//! The restoration selector: MLP parity with PyTorch, hand-computed features, and the composition
//! invariants (paper mode's Recent-B fixed point, reference mode = brute force, exact-B, dedup,
//! fallback).

use std::path::{Path, PathBuf};

use recall::memory::selector::{
    compose, compose_with, dedup_pool, features, recent_b, ActionBucket, ComposeOptions, DecisionContext,
    EventIndexing, EventInfo, FeatureContext, MarginalModel, MarginalScorer, Mode, FEATURE_NAMES,
    NUM_FEATURES,
};
use recall::Error;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/selector")
        .join(name)
}

struct Cases {
    features: Vec<[f32; NUM_FEATURES]>,
    f32: Vec<f64>,
    f64: Option<Vec<f64>>,
}

fn cases(name: &str) -> Cases {
    let text = std::fs::read_to_string(fixture(name)).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let nums = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let features = doc["features"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let v = nums(row);
            let mut out = [0f32; NUM_FEATURES];
            for (o, x) in out.iter_mut().zip(&v) {
                *o = *x as f32;
            }
            assert_eq!(v.len(), NUM_FEATURES);
            out
        })
        .collect();
    Cases {
        features,
        f32: nums(&doc["f32"]),
        f64: doc.get("f64").map(nums),
    }
}

#[test]
fn mlp_matches_pytorch() {
    let scorer = MarginalScorer::load(&fixture("scorer.safetensors")).unwrap();
    assert_eq!(scorer.hidden(), 192);
    let c = cases("scorer_cases.json");
    assert_eq!(c.features.len(), 50);
    let mut batch = Vec::new();
    scorer.score_batch(&c.features, &mut batch);
    let f64s = c.f64.unwrap();
    let mut worst = (0f64, 0f64);
    for (i, row) in c.features.iter().enumerate() {
        let y = scorer.score(row);
        assert_eq!(
            y.to_bits(),
            batch[i].to_bits(),
            "batch and single scores differ at case {i}"
        );
        let (e32, e64) = ((y as f64 - c.f32[i]).abs(), (y as f64 - f64s[i]).abs());
        worst = (worst.0.max(e32), worst.1.max(e64));
        assert!(
            e32 < 1e-6,
            "case {i}: recall {y} vs torch f32 {} (|Δ| {e32:e})",
            c.f32[i]
        );
        assert!(
            e64 < 1e-6,
            "case {i}: recall {y} vs torch f64 {} (|Δ| {e64:e})",
            f64s[i]
        );
    }
    println!("max |Δ| vs torch f32 {:e}, vs f64 {:e}", worst.0, worst.1);
}

#[test]
fn converted_bundle_matches_its_torch_outputs() {
    // tools/convert_selector_pt.py on a fake authors' bundle (concat arch, 3 readout columns fed zeros).
    let scorer = MarginalScorer::load(&fixture("converted.safetensors")).unwrap();
    assert_eq!(scorer.hidden(), 16);
    let c = cases("converted_cases.json");
    for (i, row) in c.features.iter().enumerate() {
        let y = scorer.score(row) as f64;
        assert!((y - c.f32[i]).abs() < 1e-6, "case {i}: {y} vs {}", c.f32[i]);
    }
}

fn write_st(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)], meta: Option<(&str, &str)>) {
    use safetensors::tensor::{Dtype, TensorView};
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.to_string(), TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
        .collect();
    let meta = meta.map(|(k, v)| std::collections::HashMap::from([(k.to_string(), v.to_string())]));
    safetensors::serialize_to_file(views, &meta, path).unwrap();
}

fn good_tensors(h: usize) -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
    vec![
        ("feature_mean", vec![28], vec![0.0; 28]),
        ("feature_std", vec![28], vec![1.0; 28]),
        ("fc1.weight", vec![h, 28], vec![0.01; h * 28]),
        ("fc1.bias", vec![h], vec![0.0; h]),
        ("fc2.weight", vec![h, h], vec![0.01; h * h]),
        ("fc2.bias", vec![h], vec![0.0; h]),
        ("fc3.weight", vec![1, h], vec![0.01; h]),
        ("fc3.bias", vec![1], vec![0.25]),
    ]
}

#[test]
fn load_reports_missing_and_misshapen_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");

    // A good file with an odd hidden size (not a multiple of the kernel's block) loads and scores.
    write_st(&path, &good_tensors(5), Some(("format", "recall.selector.v1")));
    let s = MarginalScorer::load(&path).unwrap();
    assert_eq!(s.hidden(), 5);
    assert!(s.score(&[0.0; 28]).is_finite());

    let mut missing = good_tensors(8);
    missing.retain(|t| t.0 != "fc3.bias");
    write_st(&path, &missing, None);
    match MarginalScorer::load(&path) {
        Err(Error::MissingTensor { name, .. }) => assert_eq!(name, "fc3.bias"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }

    let mut bad = good_tensors(8);
    bad[4] = ("fc2.weight", vec![8, 7], vec![0.0; 56]);
    write_st(&path, &bad, None);
    match MarginalScorer::load(&path) {
        Err(Error::ShapeMismatch {
            name,
            expected,
            actual,
            ..
        }) => {
            assert_eq!(name, "fc2.weight");
            assert_eq!(expected, vec![8, 8]);
            assert_eq!(actual, vec![8, 7]);
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }

    let mut bad = good_tensors(8);
    bad[2] = ("fc1.weight", vec![8, 27], vec![0.0; 8 * 27]);
    write_st(&path, &bad, None);
    assert!(matches!(
        MarginalScorer::load(&path),
        Err(Error::ShapeMismatch { .. })
    ));

    let mut bad = good_tensors(8);
    bad[1] = ("feature_std", vec![28], vec![0.0; 28]);
    write_st(&path, &bad, None);
    let err = MarginalScorer::load(&path).unwrap_err().to_string();
    assert!(err.contains("std"), "{err}");

    write_st(&path, &good_tensors(8), Some(("format", "something.else")));
    assert!(MarginalScorer::load(&path).is_err());
    write_st(&path, &good_tensors(8), Some(("feature_names", "age,log_age")));
    assert!(MarginalScorer::load(&path).is_err());

    assert!(matches!(
        MarginalScorer::load(&dir.path().join("absent.safetensors")),
        Err(Error::Io { .. })
    ));
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

/// t = 10, reference point (130, 240); events (step, hash, next action, point, witness):
///   2 A click  (100,200) witness  — alias of step 5 (same hash, older)
///   4 B type   —         no
///   5 A key    (500,500) witness
///   7 C scroll (300,400) witness
///   9 D other  —         no
/// Pool (dedup, most recent kept) = [4, 5, 7, 9]; pool witnesses = [5, 7].
fn hand_ctx() -> DecisionContext {
    use ActionBucket::*;
    DecisionContext {
        t: 10,
        reference_point: Some((130.0, 240.0)),
        events: vec![
            ev(7, 0xC, Scroll, Some((300.0, 400.0)), true),
            ev(2, 0xA, Click, Some((100.0, 200.0)), true),
            ev(9, 0xD, Other, None, false),
            ev(4, 0xB, Type, None, false),
            ev(5, 0xA, Key, Some((500.0, 500.0)), true),
        ],
    }
}

fn assert_features(got: [f32; NUM_FEATURES], want: [f64; NUM_FEATURES]) {
    for i in 0..NUM_FEATURES {
        assert!(
            (got[i] as f64 - want[i]).abs() <= 1e-6 * want[i].abs().max(1.0),
            "{} = {}, expected {}",
            FEATURE_NAMES[i],
            got[i],
            want[i]
        );
    }
}

/// Features as the authors' MobileWorld deployment computes them (`mobileworld_selector_features.py`:
/// `age = t − s`, `relative_position = s / (t − 1)`), the indexing the hand-computed values below use.
fn mobile_features(
    ctx: &DecisionContext,
    candidate: usize,
    set: &[usize],
) -> recall::Result<[f32; NUM_FEATURES]> {
    FeatureContext::with_indexing(ctx, EventIndexing::Mobile)?.features(candidate, set)
}

#[test]
fn features_match_hand_computed_values() {
    let ctx = hand_ctx();
    assert_eq!(dedup_pool(&ctx).unwrap(), vec![4, 5, 7, 9]);

    // Candidate 7, S = {2, 9}.
    // age 3, ln 3, rank = #{pool > 7} = 1, 7/9, age≤2 no, ≤3 yes, ≤5 yes, ≤9 yes, pool 4, t-1 = 9,
    // witness 1, witnesses in pool 2, #{pool witnesses > 7} = 0, scroll, hypot(170,160) = √54500,
    // multiplicity 1. Set: |S| 2, gaps {5, 2} → min 2, mean 3.5, age≤5 members {9} → 1, witnesses {2}
    // → 1, redundancy 1 (candidate is a witness), 7 < min(S)=2 no, no shared hash.
    let f = mobile_features(&ctx, 7, &[2, 9]).unwrap();
    assert_features(
        f,
        [
            3.0,
            3f64.ln(),
            1.0,
            7.0 / 9.0,
            0.0,
            1.0,
            1.0,
            1.0,
            4.0,
            9.0,
            1.0,
            2.0,
            0.0,
            0.0,
            0.0,
            0.0,
            1.0,
            0.0,
            54500f64.sqrt(),
            1.0,
            2.0,
            2.0,
            3.5,
            1.0,
            1.0,
            1.0,
            0.0,
            0.0,
        ],
    );

    // Candidate 2 (an alias of 5), S = {5}.
    // age 8, ln 8, rank = #{pool > 2} = 4, 2/9, only age≤9, pool 4, 9, witness 1, count 2,
    // #{pool witnesses > 2} = 2, click, hypot(30,40) = 50, multiplicity 1 (aliases count 1).
    // Set: 1, gap 3, mean 3, t-5 = 5 ≤ 5 → 1, 5 is a witness → 1, redundancy 1, 2 < 5 → 1, same hash → 1.
    let f = mobile_features(&ctx, 2, &[5]).unwrap();
    assert_features(
        f,
        [
            8.0,
            8f64.ln(),
            4.0,
            2.0 / 9.0,
            0.0,
            0.0,
            0.0,
            1.0,
            4.0,
            9.0,
            1.0,
            2.0,
            2.0,
            1.0,
            0.0,
            0.0,
            0.0,
            0.0,
            50.0,
            1.0,
            1.0,
            3.0,
            3.0,
            1.0,
            1.0,
            1.0,
            1.0,
            1.0,
        ],
    );

    // Candidate 5, S = ∅: age 5, ln 5, rank 2 (7, 9), 5/9, age≤5 and ≤9, witness, rank 1 (7), key,
    // hypot(370, 260) = √204500, multiplicity 2 (itself and step 2); empty-set slots.
    let f = mobile_features(&ctx, 5, &[]).unwrap();
    assert_features(
        f,
        [
            5.0,
            5f64.ln(),
            2.0,
            5.0 / 9.0,
            0.0,
            0.0,
            1.0,
            1.0,
            4.0,
            9.0,
            1.0,
            2.0,
            1.0,
            0.0,
            0.0,
            1.0,
            0.0,
            0.0,
            204500f64.sqrt(),
            2.0,
            0.0,
            -1.0,
            -1.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ],
    );

    // Candidate 4 (not a witness, no point), S = {7, 9}: age 6, rank 3, 4/9, only ≤9, witness 0,
    // rank −1, type, distance −1, multiplicity 1. Set: gaps {3, 5} → 3, 4; both age ≤ 5 → 2;
    // witnesses {7} → 1; redundancy 0; 4 < 7 → 1; no shared hash.
    let f = mobile_features(&ctx, 4, &[7, 9]).unwrap();
    assert_features(
        f,
        [
            6.0,
            6f64.ln(),
            3.0,
            4.0 / 9.0,
            0.0,
            0.0,
            0.0,
            1.0,
            4.0,
            9.0,
            0.0,
            2.0,
            -1.0,
            0.0,
            1.0,
            0.0,
            0.0,
            0.0,
            -1.0,
            1.0,
            2.0,
            3.0,
            4.0,
            2.0,
            1.0,
            0.0,
            1.0,
            0.0,
        ],
    );

    // Without a reference point, every distance is −1.
    let mut no_ref = hand_ctx();
    no_ref.reference_point = None;
    assert_eq!(features(&no_ref, 7, &[]).unwrap()[18], -1.0);
}

/// The authors' desktop training features (luojiaxuan/CausalCache `selector_v4_features.py`): a
/// history entry with `step_id` k carries the action taken from the post-action frame of event k − 1,
/// so recall's step s (screen x_s, action a_s) is their event e = s − 1; `age = step − e`,
/// `relative_position = e / max(step − 1, 1)`, `in_recent_1` is "window {step − 2}" (their comment),
/// and `n_recent_in_set` counts members with `step − e ≤ 5`. Worked on `hand_ctx` (t = 10).
#[test]
fn desktop_indexing_counts_ages_as_the_authors_training_code() {
    let ctx = hand_ctx();
    let fc = FeatureContext::with_indexing(&ctx, EventIndexing::Desktop).unwrap();
    // Candidate 7 = event 6, S = {2, 9} = events {1, 8}: age 4, ln 4, rank 1, 6/9, age ≤ 2 no, ≤ 3 no,
    // ≤ 5 yes, ≤ 9 yes; the action-derived features as on mobile. Set: gaps {5, 2}, member ages {9, 2}
    // → one within 5.
    let f = fc.features(7, &[2, 9]).unwrap();
    let m = mobile_features(&ctx, 7, &[2, 9]).unwrap();
    let mut want: [f64; NUM_FEATURES] = m.map(f64::from);
    want[..8].copy_from_slice(&[4.0, 4f64.ln(), 1.0, 6.0 / 9.0, 0.0, 0.0, 1.0, 1.0]);
    want[23] = 1.0;
    assert_features(f, want);
    // Candidate 9 = event 8, the most recent step: age 2, so in_recent_1 (Recent-1 is {9}).
    let f = fc.features(9, &[]).unwrap();
    assert_eq!((f[0], f[3], f[4]), (2.0, 8.0 / 9.0, 1.0));
    // Candidate 4 with S = {5, 7, 9}: member ages 6, 4, 2 → two within 5, the members among the last
    // four completed steps 6..9; the mobile ages 5, 3, 1 count step 5 too.
    assert_eq!(fc.features(4, &[5, 7, 9]).unwrap()[23], 2.0);
    assert_eq!(mobile_features(&ctx, 4, &[5, 7, 9]).unwrap()[23], 3.0);
}

/// Under the desktop indexing `in_recent_B` is membership in Recent-B (the paper's "Recent-B, the B
/// most recent distinct events"; every completed step is an event here) and `n_recent_in_set` counts
/// the members of `S` in Recent-4, on every decision; the mobile indexing flags one step more.
#[test]
fn desktop_in_recent_b_is_recent_b_membership() {
    let mut rng = fastrand::Rng::with_seed(28);
    let mut mobile_differs = false;
    for _ in 0..200 {
        let t = rng.usize(2..40);
        let ctx = linear_ctx(t);
        let fc = FeatureContext::with_indexing(&ctx, EventIndexing::Desktop).unwrap();
        let mfc = FeatureContext::with_indexing(&ctx, EventIndexing::Mobile).unwrap();
        let set: Vec<usize> = (1..t).filter(|_| rng.bool()).collect();
        let recent4 = recent_b(&ctx, 4);
        for s in 1..t {
            let f = fc.features(s, &set).unwrap();
            for (k, b) in [(4, 1), (5, 2), (6, 4), (7, 8)] {
                let member = recent_b(&ctx, b).contains(&s);
                assert_eq!(f[k] == 1.0, member, "t={t} s={s} B={b}");
                mobile_differs |= (mfc.features(s, &set).unwrap()[k] == 1.0) != member;
            }
            if !set.is_empty() {
                let n = set.iter().filter(|m| recent4.contains(m)).count();
                assert_eq!(f[23], n as f32, "t={t} s={s} S={set:?}");
            }
        }
    }
    assert!(
        mobile_differs,
        "the mobile indexing flags step t - B - 1 as recent"
    );
}

/// The authors' bundle, converted (tools/convert_selector_pt.py), records the desktop indexing it was
/// trained with, and the selector policy composes with it; a file without the record (written before
/// recall kept it) keeps the `t − s` it was served with.
#[test]
fn a_converted_bundle_is_served_with_desktop_indexing() {
    use recall::agent::causalcache::{make_policy, PolicyChoice};
    use recall::memory::policy::PolicyInputs;
    let converted = MarginalScorer::load(&fixture("converted.safetensors")).unwrap();
    assert_eq!(converted.indexing(), EventIndexing::Desktop);
    let legacy = MarginalScorer::load(&fixture("scorer.safetensors")).unwrap();
    assert_eq!(legacy.indexing(), EventIndexing::Mobile);
    let choice = |indexing| PolicyChoice {
        name: "selector".into(),
        selector: Some(fixture("converted.safetensors")),
        mode: Mode::Paper,
        max_replacements: None,
        seed: 0,
        indexing,
    };
    let mut rng = fastrand::Rng::with_seed(7);
    let mut differs = 0;
    for _ in 0..100 {
        let ctx = random_ctx(&mut rng, 30, 12);
        let b = rng.usize(1..5);
        let with = |indexing| {
            let options = ComposeOptions {
                indexing,
                ..ComposeOptions::new(Mode::Paper)
            };
            compose_with(&ctx, b, &converted, &options).unwrap().steps
        };
        let served = make_policy(&choice(None))
            .unwrap()
            .allocate(&ctx, b, &PolicyInputs::default())
            .unwrap();
        assert_eq!(served, with(EventIndexing::Desktop));
        let forced = make_policy(&choice(Some(EventIndexing::Mobile)))
            .unwrap()
            .allocate(&ctx, b, &PolicyInputs::default())
            .unwrap();
        assert_eq!(forced, with(EventIndexing::Mobile));
        differs += usize::from(served != forced);
    }
    assert!(
        differs > 0,
        "the indexing changed no allocation of the converted bundle"
    );
}

#[test]
fn bad_contexts_are_errors() {
    let mut ctx = hand_ctx();
    assert!(features(&ctx, 3, &[]).is_err(), "unknown candidate");
    assert!(features(&ctx, 7, &[3]).is_err(), "unknown set member");
    ctx.events.push(ev(10, 1, ActionBucket::Other, None, false));
    assert!(features(&ctx, 7, &[]).is_err(), "step == t");
    let mut ctx = hand_ctx();
    ctx.events.push(ev(7, 1, ActionBucket::Other, None, false));
    assert!(FeatureContext::new(&ctx).is_err(), "duplicate step");
    let mut ctx = hand_ctx();
    ctx.events.push(ev(0, 1, ActionBucket::Other, None, false));
    assert!(
        compose(&ctx, 2, &|_: &[f32; 28]| 0.0, Mode::Paper, None).is_err(),
        "step 0"
    );
    let mut ctx = hand_ctx();
    ctx.reference_point = Some((f64::NAN, 0.0));
    assert!(
        compose(&ctx, 2, &|_: &[f32; 28]| 0.0, Mode::Reference, None).is_err(),
        "NaN point"
    );
}

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

#[test]
fn paper_mode_declining_every_swap_returns_recent_b() {
    let scorer = MarginalScorer::load(&fixture("scorer.safetensors")).unwrap();
    for t in [2, 3, 5, 12, 30] {
        let ctx = linear_ctx(t);
        for b in 0..6 {
            let recent = recent_b(&ctx, b);
            // Marginal falls with age: an older event never beats a recent one.
            let prefers_recent = |f: &[f32; 28]| -f[0];
            // Every marginal equal: a swap needs a strict win, so none happens.
            let flat = |_: &[f32; 28]| 0.25f32;
            // The learned MLP with every event older than the window pushed 1e6 below (a forced
            // readout bias): no older event can beat a recent one. (Desktop ages: Recent-B is
            // age ≤ B + 1.)
            let forced = |f: &[f32; 28]| scorer.score(f) - if f[0] <= b as f32 + 1.0 { 0.0 } else { 1e6 };
            for (name, a) in [
                (
                    "prefers_recent",
                    compose(&ctx, b, &prefers_recent, Mode::Paper, None).unwrap(),
                ),
                ("flat", compose(&ctx, b, &flat, Mode::Paper, None).unwrap()),
                ("forced", compose(&ctx, b, &forced, Mode::Paper, None).unwrap()),
            ] {
                assert_eq!(a.steps, recent, "{name} t={t} B={b}");
                assert_eq!(a.k, 0);
                assert!(a.swaps.is_empty());
            }
        }
    }
}

#[test]
fn paper_mode_swaps_in_a_valued_older_event() {
    let ctx = linear_ctx(12); // witnesses: 1, 5, 9
                              // Witnesses are worth a lot, recent non-witnesses a little more than old ones.
    let model = |f: &[f32; 28]| f[10] * 3.0 - f[0] * 0.01;
    let a = compose(&ctx, 3, &model, Mode::Paper, None).unwrap();
    // Recent-3 = {9, 10, 11}: 9 is a witness. Evict 10 (lowest, −0.02 vs 11's −0.01); challenger 5
    // (witness, 2.93) wins; then evict 11; challenger 1 (2.89) wins; then only 9 is left recent,
    // and no non-witness beats it.
    assert_eq!(a.recent, vec![9, 10, 11]);
    assert_eq!(a.steps, vec![1, 5, 9]);
    assert_eq!(a.k, 2);
    assert_eq!(
        a.swaps.iter().map(|s| (s.evicted, s.entered)).collect::<Vec<_>>(),
        vec![(10, 5), (11, 1)]
    );
    assert!(a.score > 5.0);
    // max_replacements caps the swaps.
    let one = compose(&ctx, 3, &model, Mode::Paper, Some(1)).unwrap();
    assert_eq!(one.steps, vec![5, 9, 11]);
    assert_eq!(one.k, 1);
    let zero = compose(&ctx, 3, &model, Mode::Paper, Some(0)).unwrap();
    assert_eq!(zero.steps, vec![9, 10, 11]);
}

/// A deterministic, non-additive marginal: depends on the candidate and on the set context.
fn wiggly(f: &[f32; 28]) -> f32 {
    (f[0] * 1.37 + f[21] * 0.71).sin() + 0.3 * (f[22] * 0.9).cos() - 0.4 * f[26] + 0.2 * f[10] - 0.1 * f[24]
        + 0.05 * f[19]
}

/// Max over all B-subsets of the max over all orders of Σ Δ(e_i | {e_1..e_{i-1}}), summed in f64 in
/// path order — the score reference mode accumulates.
fn brute_force<M: MarginalModel + ?Sized>(ctx: &DecisionContext, b: usize, m: &M) -> (Vec<usize>, f64) {
    let fc = FeatureContext::new(ctx).unwrap();
    let pool = fc.pool().to_vec();
    let mut best: Option<(Vec<usize>, f64)> = None;
    fn perms(items: &[usize], prefix: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if items.is_empty() {
            out.push(prefix.clone());
        }
        for i in 0..items.len() {
            let mut rest = items.to_vec();
            let x = rest.remove(i);
            prefix.push(x);
            perms(&rest, prefix, out);
            prefix.pop();
        }
    }
    for mask in 0u32..(1 << pool.len()) {
        if mask.count_ones() as usize != b {
            continue;
        }
        let subset: Vec<usize> = (0..pool.len())
            .filter(|i| mask >> i & 1 == 1)
            .map(|i| pool[i])
            .collect();
        let mut orders = Vec::new();
        perms(&subset, &mut Vec::new(), &mut orders);
        for order in orders {
            let mut acc = 0f64;
            let mut prefix: Vec<usize> = Vec::new();
            for &e in &order {
                let mut sorted = prefix.clone();
                sorted.sort_unstable();
                acc += m.score(&fc.features(e, &sorted).unwrap()) as f64;
                prefix.push(e);
            }
            if best.as_ref().is_none_or(|(_, v)| acc > *v) {
                best = Some((subset.clone(), acc));
            }
        }
    }
    best.unwrap()
}

fn random_ctx(rng: &mut fastrand::Rng, max_t: usize, hashes: u64) -> DecisionContext {
    let t = rng.usize(1..max_t);
    let buckets = [
        ActionBucket::Click,
        ActionBucket::Type,
        ActionBucket::Key,
        ActionBucket::Scroll,
        ActionBucket::Other,
    ];
    let mut events = Vec::new();
    for s in 1..t {
        if rng.f32() < 0.2 {
            continue;
        }
        let point = if rng.bool() {
            Some((rng.f64() * 999.0, rng.f64() * 999.0))
        } else {
            None
        };
        events.push(ev(
            s,
            rng.u64(0..hashes),
            buckets[rng.usize(0..5)],
            point,
            rng.f32() < 0.3,
        ));
    }
    rng.shuffle(&mut events);
    let reference_point = if rng.bool() {
        Some((rng.f64() * 999.0, rng.f64() * 999.0))
    } else {
        None
    };
    DecisionContext {
        t,
        reference_point,
        events,
    }
}

#[test]
fn reference_mode_equals_brute_force_when_the_beam_covers_the_pool() {
    let scorer = MarginalScorer::load(&fixture("scorer.safetensors")).unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    let mut checked = 0;
    while checked < 40 {
        let ctx = random_ctx(&mut rng, 12, 9);
        let pool = dedup_pool(&ctx).unwrap();
        let n = pool.len();
        if !(3..=7).contains(&n) || ctx.events.len() <= 3 {
            continue;
        }
        for b in [1usize, 2, 3] {
            // Every set of every level fits in the beam: width ≥ C(n, ⌊n/2⌋), all children kept.
            let options = ComposeOptions {
                beam_width: 64,
                children_per_parent: n,
                ..ComposeOptions::new(Mode::Reference)
            };
            let models: [(&str, &dyn MarginalModel); 2] = [("wiggly", &wiggly), ("mlp", &scorer)];
            for (name, m) in models {
                let a = compose_with(&ctx, b, m, &options).unwrap();
                let (want, score) = brute_force(&ctx, b, m);
                assert_eq!(a.steps, want, "{name} B={b} ctx={ctx:?}");
                assert_eq!(a.score, score, "{name} B={b}");
                assert!(!a.fell_back);
            }
            if b == 2 {
                // For B = 2 a beam as wide as the pool already covers every pair.
                let narrow = ComposeOptions {
                    beam_width: n,
                    children_per_parent: n,
                    ..options
                };
                let a = compose_with(&ctx, b, &wiggly, &narrow).unwrap();
                assert_eq!(a.steps, brute_force(&ctx, b, &wiggly).0);
            }
        }
        checked += 1;
    }
}

#[test]
fn reference_mode_respects_max_replacements() {
    let ctx = linear_ctx(12);
    let model = |f: &[f32; 28]| f[10] * 3.0 - f[0] * 0.01; // wants the witnesses 1, 5, 9
    let free = compose(&ctx, 3, &model, Mode::Reference, None).unwrap();
    assert_eq!(free.steps, vec![1, 5, 9]);
    assert_eq!(free.k, 2);
    let capped = compose(&ctx, 3, &model, Mode::Reference, Some(1)).unwrap();
    assert!(capped.k <= 1, "{capped:?}");
    assert_eq!(capped.steps.len(), 3);
    let zero = compose(&ctx, 3, &model, Mode::Reference, Some(0)).unwrap();
    assert_eq!(zero.steps, vec![9, 10, 11]);
}

#[test]
fn dedup_keeps_the_most_recent_and_reference_mode_picks_from_the_pool() {
    use ActionBucket::*;
    // Steps 1..=6 with hashes 1,2,1,3,2,1: pool keeps 4 (hash 3), 5 (hash 2), 6 (hash 1).
    let hashes = [1u64, 2, 1, 3, 2, 1];
    let ctx = DecisionContext {
        t: 7,
        reference_point: None,
        events: hashes
            .iter()
            .enumerate()
            .map(|(i, &h)| ev(i + 1, h, Click, None, false))
            .collect(),
    };
    assert_eq!(dedup_pool(&ctx).unwrap(), vec![4, 5, 6]);
    let fc = FeatureContext::new(&ctx).unwrap();
    assert_eq!(
        fc.features(6, &[]).unwrap()[19],
        3.0,
        "step 6 stands for 1, 3 and 6"
    );
    assert_eq!(fc.features(5, &[]).unwrap()[19], 2.0);
    assert_eq!(fc.features(1, &[]).unwrap()[19], 1.0, "aliases count once");
    assert_eq!(fc.features(1, &[6]).unwrap()[27], 1.0, "duplicate_of_set_member");
    // A model preferring old events still only sees pool members.
    let old = |f: &[f32; 28]| f[0];
    let a = compose(&ctx, 2, &old, Mode::Reference, None).unwrap();
    assert_eq!(a.steps, vec![4, 5]);
}

#[test]
fn fewer_candidates_than_b_falls_back_to_recent_b() {
    use ActionBucket::*;
    // Five events, two distinct screenshots: the pool has 2 < B = 3.
    let ctx = DecisionContext {
        t: 6,
        reference_point: None,
        events: (1..6)
            .map(|s| ev(s, (s % 2) as u64, Click, None, false))
            .collect(),
    };
    let a = compose(&ctx, 3, &|f: &[f32; 28]| f[0], Mode::Reference, None).unwrap();
    assert!(a.fell_back);
    assert_eq!(a.steps, vec![3, 4, 5]);
    assert_eq!(a.k, 0);
    // Fewer events than B: every event, in either mode.
    for mode in [Mode::Paper, Mode::Reference] {
        let a = compose(&ctx, 9, &|f: &[f32; 28]| f[0], mode, None).unwrap();
        assert_eq!(a.steps, vec![1, 2, 3, 4, 5]);
    }
    let empty = DecisionContext {
        t: 1,
        reference_point: None,
        events: vec![],
    };
    assert!(compose(&empty, 4, &|_: &[f32; 28]| 0.0, Mode::Reference, None)
        .unwrap()
        .steps
        .is_empty());
}

#[test]
fn exact_b_on_random_contexts() {
    let scorer = MarginalScorer::load(&fixture("scorer.safetensors")).unwrap();
    let nan = |f: &[f32; 28]| if f[0] > 3.0 { f32::NAN } else { f[0] };
    let mut rng = fastrand::Rng::with_seed(5);
    for _ in 0..300 {
        let hashes = rng.u64(1..30);
        let ctx = random_ctx(&mut rng, 40, hashes);
        let steps: Vec<usize> = {
            let mut s: Vec<usize> = ctx.events.iter().map(|e| e.step).collect();
            s.sort_unstable();
            s
        };
        let b = rng.usize(0..7);
        let cap = if rng.bool() { Some(rng.usize(0..3)) } else { None };
        let models: [&dyn MarginalModel; 3] = [&scorer, &wiggly, &nan];
        for m in models {
            for mode in [Mode::Paper, Mode::Reference] {
                let a = compose(&ctx, b, m, mode, cap).unwrap();
                assert_eq!(a.steps.len(), b.min(steps.len()), "{mode:?} B={b} {ctx:?}");
                assert!(a.steps.windows(2).all(|w| w[0] < w[1]));
                assert!(a.steps.iter().all(|s| steps.binary_search(s).is_ok()));
                assert_eq!(a.k, a.steps.iter().filter(|s| !a.recent.contains(s)).count());
                if let (Some(c), false) = (cap, a.fell_back) {
                    assert!(a.k <= c, "{mode:?} k={} cap={c}", a.k);
                }
            }
        }
    }
}
