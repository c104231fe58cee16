//! `recall selector train`: the objective against PyTorch's autograd, learning a known scorer from
//! synthetic labels, bitwise reproducibility, and the label reader's errors.

use std::path::{Path, PathBuf};
use std::process::Command;

use recall::agent::labels::read_labels;
use recall::memory::selector::{EventIndexing, MarginalModel, MarginalScorer, FEATURE_NAMES, NUM_FEATURES};
use recall::memory::selector_train::{
    objective, train, Batch, Mlp, TrainConfig, PARAM_NAMES, RECENCY_FEATURES,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn recall(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_recall"))
        .args(args)
        .output()
        .expect("recall runs")
}

fn f64s(st: &safetensors::SafeTensors, name: &str) -> Vec<f64> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// tools/selector_objective.py computes the loss and its gradient with torch autograd in float64;
/// recall's hand-written backward pass must agree within 1e-5.
#[test]
fn objective_and_gradients_match_pytorch() {
    let bytes = std::fs::read(fixture("selector-train/objective.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let hidden = f64s(&st, "fc1.bias").len();
    let theta: Vec<f64> = PARAM_NAMES.iter().flat_map(|n| f64s(&st, n)).collect();
    let mlp = Mlp { hidden, theta };
    let z: Vec<[f64; NUM_FEATURES]> = f64s(&st, "z")
        .chunks_exact(NUM_FEATURES)
        .map(|c| c.try_into().unwrap())
        .collect();
    let pairs_t = st.tensor("pairs").unwrap();
    assert_eq!(pairs_t.dtype(), safetensors::Dtype::I64);
    let idx: Vec<usize> = pairs_t
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
        .collect();
    let batch = Batch {
        z,
        y: f64s(&st, "y"),
        pairs: idx.chunks_exact(2).map(|p| (p[0], p[1])).collect(),
    };
    let (loss, grad) = objective(&mlp, &batch, f64s(&st, "rank_weight")[0]);
    let want = f64s(&st, "loss")[0];
    assert!((loss - want).abs() <= 1e-5, "loss {loss} vs torch {want}");
    let torch_grad: Vec<f64> = PARAM_NAMES
        .iter()
        .flat_map(|n| f64s(&st, &format!("grad.{n}")))
        .collect();
    assert_eq!(grad.len(), torch_grad.len());
    let worst = grad
        .iter()
        .zip(&torch_grad)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst <= 1e-5, "largest gradient difference {worst}");
    assert!(
        torch_grad.iter().any(|g| g.abs() > 1e-3),
        "the fixture exercises the gradient"
    );
}

/// tools/gen_selector_synth.py makes labels from a known utility whose marginals are a function of
/// the features; the trained scorer must order held-out candidates as the utility does.
#[test]
fn the_trained_selector_ranks_held_out_episodes_of_a_known_scorer() {
    let set = read_labels(&[fixture("selector-train/synthetic.jsonl")], false).unwrap();
    let cfg = TrainConfig {
        hidden: 64,
        epochs: 60,
        seed: 5,
        ..TrainConfig::default()
    };
    let trained = train(&set.decisions, &cfg, |_, _| {}).unwrap();
    let r = &trained.report;
    let held = r.heldout.as_ref().expect("a held-out split");
    assert!(held.episodes >= 2 && held.pairs > 200, "{held:?}");
    assert!(
        held.ranking_accuracy >= 0.95,
        "held-out pairwise ranking accuracy {} < 0.95",
        held.ranking_accuracy
    );
    assert!(r.last_epoch_loss < r.first_epoch_loss, "{r:?}");
    assert!(held.rmse < 0.5 * held.baseline_rmse, "{held:?}");
    // The split is by episode: the held-out decisions are exactly those of the held-out episodes.
    let held_decisions = set
        .decisions
        .iter()
        .filter(|d| r.heldout_episodes.contains(&d.episode))
        .count();
    assert_eq!(held_decisions, held.decisions);
    assert_eq!(held.decisions + r.train.decisions, set.decisions.len());

    // The written file is the scorer the report measured.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scorer.safetensors");
    trained.save(&path, &Default::default()).unwrap();
    let loaded = MarginalScorer::load(&path).unwrap();
    let direct = trained.scorer().unwrap();
    let rows: Vec<[f32; NUM_FEATURES]> = (0..50)
        .map(|i| std::array::from_fn(|k| ((i * 7 + k * 3) % 11) as f32 - 5.0))
        .collect();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    loaded.score_batch(&rows, &mut a);
    direct.score_batch(&rows, &mut b);
    assert_eq!(a, b);
}

/// The paper's "retraining without the recency-membership features" control: the masked features
/// are held at 0 in training and cut from the file, so no value of them moves a score; the file
/// records the mask and the event indexing the features were counted with.
#[test]
fn masked_features_cannot_move_the_trained_scorer() {
    let set = read_labels(&[fixture("selector-train/synthetic.jsonl")], false).unwrap();
    let masked: Vec<String> = RECENCY_FEATURES.iter().map(|s| s.to_string()).collect();
    let cfg = TrainConfig {
        hidden: 16,
        epochs: 3,
        masked: masked.clone(),
        indexing: EventIndexing::Mobile,
        ..TrainConfig::default()
    };
    let trained = train(&set.decisions, &cfg, |_, _| {}).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scorer.safetensors");
    trained.save(&path, &Default::default()).unwrap();
    let loaded = MarginalScorer::load(&path).unwrap();
    assert_eq!(loaded.indexing(), EventIndexing::Mobile);
    let meta = recall::checkpoint::Checkpoint::open_file(&path).unwrap().metadata;
    assert_eq!(meta["feature_mask"], masked.join(","));
    assert_eq!(meta["event_indexing"], "mobile");
    let idx: Vec<usize> = masked
        .iter()
        .map(|m| FEATURE_NAMES.iter().position(|f| f == m).unwrap())
        .collect();
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..200 {
        let row: [f32; NUM_FEATURES] = std::array::from_fn(|_| rng.f32() * 20.0 - 5.0);
        let mut moved = row;
        idx.iter().for_each(|&k| moved[k] = rng.f32() * 100.0 - 50.0);
        assert_eq!(loaded.score(&row).to_bits(), loaded.score(&moved).to_bits());
    }
    // An unmasked feature does move it (the check above can fail).
    let base = [1.0f32; NUM_FEATURES];
    let mut aged = base;
    aged[0] = 30.0;
    assert_ne!(loaded.score(&base), loaded.score(&aged));

    let bad = TrainConfig {
        masked: vec!["in_recent_3".into()],
        ..cfg
    };
    let err = train(&set.decisions, &bad, |_, _| {}).unwrap_err().to_string();
    assert!(
        err.contains("in_recent_3") && err.contains("in_recent_4"),
        "{err}"
    );
}

/// The states paper composition visits, against the labels' (issue 28, item 5). The paper: "a small
/// beam search initialized at Recent-B: a distant event enters only by beating the predicted
/// marginal of the recent realization it evicts", so its first round asks, for every recent `e`,
/// `Δ̂(e | Recent-B ∖ {e})` and `Δ̂(o | Recent-B ∖ {e})` for every older pool event `o`. Worked at
/// t = 6, events 1..5, labels as the default teacher gives them for these sets: `∅`, every singleton
/// and the Recent-2 anchor {4, 5}; a model that prefers recent events declines every swap.
/// * B = 1 (Recent-1 = {5}): rows `(o, ∅)` for o = 1..4 and `(5, ∅)`: all five have `Q(∅)` and
///   `Q({j})` labelled.
/// * B = 2: evicting 4 gives rows `(1|{5}) (2|{5}) (3|{5}) (4|{5})`, evicting 5 gives
///   `(1|{4}) (2|{4}) (3|{4}) (5|{4})`: only `(4|{5})` and `(5|{4})` have `Q(S)` and `Q(S ∪ {j})`
///   labelled, six of eight are off the labelled states.
/// * B = 3, 4: no Recent-B anchor is labelled, no case.
#[test]
fn composition_queries_off_the_labelled_states_are_counted() {
    use recall::memory::selector::{
        compose_logged, ActionBucket, ComposeOptions, DecisionContext, EventInfo, Mode,
    };
    use recall::memory::selector_train::{compare_with_recent, ComposeOutcome, LabelledDecision};
    let ev = |step: usize| EventInfo {
        step,
        image_hash: step as u64,
        next_bucket: ActionBucket::Click,
        next_point: None,
        witness: false,
    };
    let context = DecisionContext {
        t: 6,
        reference_point: None,
        events: (1..6).map(ev).collect(),
    };
    let mut utilities = vec![(vec![], -2.0), (vec![4, 5], -1.0)];
    utilities.extend((1..6).map(|s| (vec![s], -1.5)));
    let prefers_recent = |f: &[f32; NUM_FEATURES]| -f[0];
    let options = ComposeOptions::new(Mode::Paper);
    let (a, queries) = compose_logged(&context, 2, &prefers_recent, &options).unwrap();
    assert_eq!(a.steps, vec![4, 5]);
    let want: Vec<(usize, Vec<usize>)> = vec![
        (1, vec![5]),
        (2, vec![5]),
        (3, vec![5]),
        (4, vec![5]),
        (1, vec![4]),
        (2, vec![4]),
        (3, vec![4]),
        (5, vec![4]),
    ];
    assert_eq!(queries, want);

    let d = LabelledDecision {
        episode: "e".into(),
        context,
        utilities,
    };
    let mut out = ComposeOutcome::default();
    compare_with_recent(&d, &prefers_recent, EventIndexing::Desktop, &mut out);
    assert_eq!((out.cases, out.kept_recent), (2, 2));
    assert_eq!((out.queries, out.off_label_queries), (13, 6));
}

/// The same labels and seed give the same bytes; another seed gives another file.
#[test]
fn retraining_with_the_same_seed_is_bitwise_identical() {
    let dir = tempfile::tempdir().unwrap();
    let labels = fixture("selector-train/synthetic.jsonl");
    let run = |name: &str, seed: &str| {
        let out = dir.path().join(name);
        let o = recall(&[
            "selector",
            "train",
            "--labels",
            labels.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--hidden",
            "32",
            "--epochs",
            "8",
            "--seed",
            seed,
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(stdout.contains("pairwise ranking accuracy"), "{stdout}");
        std::fs::read(out).unwrap()
    };
    let (a, b, c) = (
        run("a.safetensors", "11"),
        run("b.safetensors", "11"),
        run("c.safetensors", "12"),
    );
    assert!(a == b, "two runs with seed 11 wrote different files");
    assert!(a != c, "seeds 11 and 12 wrote the same file");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("a.report.json")).unwrap()).unwrap();
    assert!(
        report["heldout"]["ranking_accuracy"].as_f64().is_some(),
        "{report}"
    );
}

/// Bad label files are refused with the file, the line and the field.
#[test]
fn bad_label_files_name_the_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(fixture("selector-train/synthetic.jsonl")).unwrap();
    let lines: Vec<&str> = good.lines().take(12).collect();
    let case = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        read_labels(&[p], false).unwrap_err().to_string()
    };
    let e = case("notjson.jsonl", format!("{}\n{{oops\n", lines[0]));
    assert!(e.contains("notjson.jsonl:2") && e.contains("not JSON"), "{e}");
    let e = case(
        "q.jsonl",
        lines[0].to_string() + "\n" + &lines[1].replace("\"q\":", "\"q_\":"),
    );
    assert!(e.contains("q.jsonl:2") && e.contains("`q`"), "{e}");
    let e = case("nodecision.jsonl", lines[1..].join("\n"));
    assert!(e.contains("no `decision` line"), "{e}");
    let e = case("old.jsonl", lines[1].replace("\"episode\":", "\"ep\":"));
    assert!(e.contains("`episode`") && e.contains("older recall"), "{e}");
    let e = case(
        "mixed.jsonl",
        format!(
            "{}\n{}",
            lines[0],
            lines[1].replace("\"model\":\"synthetic\"", "\"model\":\"other\"")
        ),
    );
    assert!(e.contains("made_with") && e.contains("--allow-mixed"), "{e}");
    let e = case(
        "hash.jsonl",
        lines[0].replacen("\"image_hash\":\"", "\"image_hash\":\"zz", 1),
    );
    assert!(e.contains("image_hash"), "{e}");
    let e = case(
        "unsorted.jsonl",
        format!(
            "{}\n{}",
            lines[0],
            lines[1].replacen("\"set\":[", "\"set\":[9,", 1)
        ),
    );
    assert!(
        e.contains("strictly increasing") || e.contains("not an event"),
        "{e}"
    );

    let o = recall(&[
        "selector",
        "train",
        "--labels",
        "/nonexistent/l.jsonl",
        "--out",
        "/tmp/x.safetensors",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/l.jsonl"));
    let o = recall(&[
        "selector",
        "train",
        "--labels",
        fixture("selector-train/synthetic.jsonl").to_str().unwrap(),
        "--out",
        dir.path().join("s.safetensors").to_str().unwrap(),
        "--holdout",
        "1.5",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("holdout"));
}

/// `recall episode label --composition-states` labels every state the paper composition's first
/// round queries, `Δ̂(j | Recent-B ∖ {e})` and `Δ̂(e | Recent-B ∖ {e})`: with it, none of those
/// queries is off the labelled states at the labelled budgets; without it, some are (48 of 173 on
/// the demo episode).
#[test]
fn composition_teacher_paths_cover_the_first_round_queries() {
    use recall::memory::selector::{compose_logged, ComposeOptions, Mode};
    let dir = tempfile::tempdir().unwrap();
    let episode = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo/episode");
    let model = fixture("tiny-qwen3-vl");
    let label = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec![
            "episode",
            "label",
            "--backend",
            "cpu",
            "--model",
            model.to_str().unwrap(),
            "--episode",
            episode.to_str().unwrap(),
            "--budgets",
            "1,2",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = recall(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        read_labels(&[out], false).unwrap()
    };
    // A scorer that never swaps: the paper beam stops after its first round.
    let prefers_recent = |f: &[f32; NUM_FEATURES]| -f[0];
    let off_label = |set: &recall::agent::labels::LabelSet| {
        let (mut queries, mut off) = (0, 0);
        for d in &set.decisions {
            let q: std::collections::HashSet<&[usize]> =
                d.utilities.iter().map(|(s, _)| s.as_slice()).collect();
            for budget in [1, 2].into_iter().filter(|&b| b < d.context.events.len()) {
                let options = ComposeOptions::new(Mode::Paper);
                let (_, asked) = compose_logged(&d.context, budget, &prefers_recent, &options).unwrap();
                for (j, s) in asked {
                    let mut with = s.clone();
                    with.insert(with.partition_point(|&x| x < j), j);
                    queries += 1;
                    off += usize::from(!(q.contains(s.as_slice()) && q.contains(with.as_slice())));
                }
            }
        }
        (queries, off)
    };
    let plain = label("plain.jsonl", &[]);
    let covered = label("composition.jsonl", &["--composition-states"]);
    let (queries, off) = off_label(&plain);
    assert!(
        queries > 0 && off > 0,
        "{off} of {queries} off the default labels"
    );
    assert_eq!(off_label(&covered), (queries, 0));
    // The default paths are a subset, scored the same (one engine, exact prefix reuse).
    let qs = |set: &recall::agent::labels::LabelSet| -> std::collections::HashMap<(String, usize, Vec<usize>), u64> {
        set.decisions
            .iter()
            .flat_map(|d| {
                d.utilities
                    .iter()
                    .map(move |(s, q)| ((d.episode.clone(), d.context.t, s.clone()), q.to_bits()))
            })
            .collect()
    };
    let (p, c) = (qs(&plain), qs(&covered));
    assert!(c.len() > p.len());
    for (k, q) in &p {
        assert_eq!(c.get(k), Some(q), "{k:?}");
    }
}
