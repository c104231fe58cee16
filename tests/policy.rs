//! Allocation policies: determinism, RGB similarity, oracle beam = brute force, exact-B everywhere.

use std::collections::HashMap;

use recall::memory::policy::{
    text_similarity, thumbnail, AllocationPolicy, Inverted, OcrText, OracleBeam, PolicyInputs, Random,
    Recent, Rgb, Selector, Thumbnail, THUMB_LEN,
};
use recall::memory::selector::{dedup_pool, ActionBucket, DecisionContext, EventInfo, Mode};

fn ctx(t: usize) -> DecisionContext {
    DecisionContext {
        t,
        reference_point: None,
        events: (1..t)
            .map(|s| EventInfo {
                step: s,
                image_hash: s as u64,
                next_bucket: ActionBucket::Click,
                next_point: None,
                witness: s % 3 == 0,
            })
            .collect(),
    }
}

#[test]
fn random_is_deterministic_per_seed_and_varies_across_seeds() {
    let c = ctx(40);
    let none = PolicyInputs::default();
    let a = Random { seed: 1 }.allocate(&c, 4, &none).unwrap();
    assert_eq!(a, Random { seed: 1 }.allocate(&c, 4, &none).unwrap());
    assert_eq!(a.len(), 4);
    let distinct: std::collections::HashSet<Vec<usize>> = (0..20)
        .map(|seed| Random { seed }.allocate(&c, 4, &none).unwrap())
        .collect();
    assert!(
        distinct.len() > 10,
        "seeds should give different sets: {distinct:?}"
    );
    // Mixed with t: the same seed differs across decisions.
    let other = Random { seed: 1 }.allocate(&ctx(41), 4, &none).unwrap();
    assert_ne!(a, other);
}

#[test]
fn rgb_picks_the_most_similar_thumbnails() {
    let c = ctx(10);
    let current: Thumbnail = [100; THUMB_LEN];
    // Step s has a flat thumbnail at |100 - level(s)|; steps 3 and 7 are nearly identical to the screen.
    let level = |s: usize| match s {
        3 => 101u8,
        7 => 99,
        5 => 110,
        _ => 200,
    };
    let thumbs: HashMap<usize, Thumbnail> = (1..10).map(|s| (s, [level(s); THUMB_LEN])).collect();
    let inputs = PolicyInputs {
        current_thumbnail: Some(&current),
        event_thumbnails: Some(&thumbs),
        ..PolicyInputs::default()
    };
    assert_eq!(Rgb.allocate(&c, 2, &inputs).unwrap(), vec![3, 7]);
    assert_eq!(Rgb.allocate(&c, 3, &inputs).unwrap(), vec![3, 5, 7]);
    // Missing inputs are errors, not panics.
    assert!(Rgb.allocate(&c, 2, &PolicyInputs::default()).is_err());
}

/// The paper's OCR-similarity baseline ranks archived screens by how much their transcript shares with
/// the current screen's. Worked by hand with the cosine of word counts: current = {settings: 1, wi: 1,
/// fi: 1, network: 1} (norm 2); step 2 "Wi-Fi settings" shares 3 of its 3 words: 3 / (2·√3) ≈ 0.866;
/// step 4 "Network settings, network" = {network: 2, settings: 1}: (2 + 1) / (2·√5) ≈ 0.671; step 6
/// "Alarm" shares nothing: 0; step 7 "settings" 1 / 2 = 0.5; the others are empty (0).
#[test]
fn ocr_picks_the_transcripts_most_like_the_current_screen() {
    let c = ctx(9);
    let texts: HashMap<usize, &str> = [
        (1, ""),
        (2, "Wi-Fi settings"),
        (3, ""),
        (4, "Network settings, network"),
        (5, ""),
        (6, "Alarm"),
        (7, "settings"),
        (8, ""),
    ]
    .into_iter()
    .collect();
    let current = "Settings / Wi-Fi network";
    assert!((text_similarity(current, texts[&2]) - 3.0 / (2.0 * 3f64.sqrt())).abs() < 1e-12);
    assert!((text_similarity(current, texts[&4]) - 3.0 / (2.0 * 5f64.sqrt())).abs() < 1e-12);
    let inputs = PolicyInputs {
        current_text: Some(current),
        event_texts: Some(&texts),
        ..PolicyInputs::default()
    };
    assert_eq!(OcrText.allocate(&c, 1, &inputs).unwrap(), vec![2]);
    assert_eq!(OcrText.allocate(&c, 3, &inputs).unwrap(), vec![2, 4, 7]);
    // Four: step 6 and the empty ones tie at 0; the most recent of them (8) wins.
    assert_eq!(OcrText.allocate(&c, 4, &inputs).unwrap(), vec![2, 4, 7, 8]);
    // A missing transcript is an error naming the step and the field, not a panic.
    let mut gap = texts.clone();
    gap.remove(&6);
    let err = OcrText
        .allocate(
            &c,
            2,
            &PolicyInputs {
                event_texts: Some(&gap),
                ..inputs
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("step 6 (steps[5].ocr)"), "{err}");
    let err = OcrText
        .allocate(
            &c,
            2,
            &PolicyInputs {
                current_text: None,
                ..inputs
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("decision 9 has no OCR transcript"), "{err}");
}

#[test]
fn thumbnail_box_filter() {
    // 64x64: left half black, right half white → left 16 columns 0, right 16 columns 255.
    let img = image::RgbImage::from_fn(64, 64, |x, _| {
        if x < 32 {
            image::Rgb([0, 0, 0])
        } else {
            image::Rgb([255, 255, 255])
        }
    });
    let t = thumbnail(&img);
    assert_eq!(t[0], 0);
    assert_eq!(t[(15 * 32 + 15) * 3], 0);
    assert_eq!(t[(15 * 32 + 16) * 3], 255);
    // 2x2 averages: a 64x32 checker of 0/255 columns averages to 128 (half up).
    let img = image::RgbImage::from_fn(64, 32, |x, _| image::Rgb([if x % 2 == 0 { 0 } else { 255 }; 3]));
    assert!(thumbnail(&img).iter().all(|&v| v == 128));
    // Tiny and empty images do not panic.
    let _ = thumbnail(&image::RgbImage::new(3, 5));
    assert!(thumbnail(&image::RgbImage::new(0, 0)).iter().all(|&v| v == 0));
}

fn brute_force_additive(pool: &[usize], b: usize, w: &dyn Fn(usize) -> f64) -> Vec<usize> {
    let mut best: Option<(f64, Vec<usize>)> = None;
    for mask in 0u32..(1 << pool.len()) {
        if mask.count_ones() as usize != b {
            continue;
        }
        let set: Vec<usize> = (0..pool.len())
            .filter(|i| mask >> i & 1 == 1)
            .map(|i| pool[i])
            .collect();
        let u: f64 = set.iter().map(|&s| w(s)).sum();
        if best.as_ref().is_none_or(|(v, _)| u > *v) {
            best = Some((u, set));
        }
    }
    best.unwrap().1
}

#[test]
fn oracle_beam_with_an_additive_oracle_equals_brute_force() {
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..30 {
        let t = rng.usize(6..14);
        let mut c = ctx(t);
        for e in &mut c.events {
            e.image_hash = rng.u64(0..8); // duplicates: the oracle sees only the pool
        }
        let pool = dedup_pool(&c).unwrap();
        let weights: HashMap<usize, f64> = (1..t).map(|s| (s, rng.f64() * 2.0 - 0.5)).collect();
        let w = |s: usize| weights[&s];
        for b in 1..4 {
            if pool.len() < b || c.events.len() <= b {
                continue;
            }
            let mut calls = 0usize;
            let mut policy = OracleBeam::new(|s: &[usize]| {
                calls += 1;
                Ok(s.iter().map(|&x| weights[&x]).sum::<f64>())
            });
            let got = policy.allocate(&c, b, &PolicyInputs::default()).unwrap();
            assert_eq!(got, brute_force_additive(&pool, b, &w), "B={b} pool={pool:?}");
        }
    }
}

#[test]
fn every_policy_is_exact_b_and_deterministic() {
    let mut rng = fastrand::Rng::with_seed(9);
    let model = |f: &[f32; 28]| (f[0] * 0.7).sin() + f[10] - 0.2 * f[26];
    for _ in 0..200 {
        let t = rng.usize(1..30);
        let mut c = ctx(t);
        c.events.retain(|_| rng.f32() < 0.8);
        for e in &mut c.events {
            e.image_hash = rng.u64(0..12);
        }
        let steps: Vec<usize> = c.events.iter().map(|e| e.step).collect();
        let current: Thumbnail = [rng.u8(..); THUMB_LEN];
        let thumbs: HashMap<usize, Thumbnail> = steps.iter().map(|&s| (s, [rng.u8(..); THUMB_LEN])).collect();
        let words = ["wifi", "clock", "alarm", "settings", "save"];
        let mut transcript = || {
            (0..rng.usize(0..4))
                .map(|_| words[rng.usize(0..5)])
                .collect::<Vec<_>>()
                .join(" ")
        };
        let current_text = transcript();
        let texts: HashMap<usize, String> = steps.iter().map(|&s| (s, transcript())).collect();
        let text_refs: HashMap<usize, &str> = texts.iter().map(|(&s, t)| (s, t.as_str())).collect();
        let inputs = PolicyInputs {
            current_thumbnail: Some(&current),
            event_thumbnails: Some(&thumbs),
            current_text: Some(&current_text),
            event_texts: Some(&text_refs),
        };
        let b = rng.usize(0..6);
        let oracle =
            |s: &[usize]| Ok(s.iter().map(|&x| ((x * 37) % 11) as f64).sum::<f64>() - s.len() as f64 * 0.1);
        let mut policies: Vec<Box<dyn AllocationPolicy>> = vec![
            Box::new(Recent),
            Box::new(Random { seed: 4 }),
            Box::new(Rgb),
            Box::new(OcrText),
            Box::new(Selector::new(model, Mode::Paper)),
            Box::new(Selector::new(model, Mode::Reference)),
            Box::new(Inverted::new(model, Mode::Paper)),
            Box::new(Inverted::new(model, Mode::Reference)),
            Box::new(OracleBeam::new(oracle)),
        ];
        for p in policies.iter_mut() {
            let a = p.allocate(&c, b, &inputs).unwrap();
            assert_eq!(a.len(), b.min(steps.len()), "{} B={b}", p.name());
            assert!(a.windows(2).all(|w| w[0] < w[1]), "{}", p.name());
            assert!(a.iter().all(|s| steps.contains(s)), "{}", p.name());
            assert_eq!(
                a,
                p.allocate(&c, b, &inputs).unwrap(),
                "{} is not deterministic",
                p.name()
            );
        }
    }
}

#[test]
fn inverted_prefers_what_the_selector_avoids() {
    let c = ctx(20);
    let model = |f: &[f32; 28]| -f[0]; // recent first
    let none = PolicyInputs::default();
    assert_eq!(
        Selector::new(model, Mode::Reference)
            .allocate(&c, 3, &none)
            .unwrap(),
        vec![17, 18, 19]
    );
    assert_eq!(
        Inverted::new(model, Mode::Reference)
            .allocate(&c, 3, &none)
            .unwrap(),
        vec![1, 2, 3]
    );
}
