//! `recall selector train`: the objective against PyTorch's autograd, learning a known scorer from
//! synthetic labels, bitwise reproducibility, and the label reader's errors.

use std::path::{Path, PathBuf};
use std::process::Command;

use recall::agent::labels::read_labels;
use recall::memory::selector::{MarginalModel, MarginalScorer, NUM_FEATURES};
use recall::memory::selector_train::{objective, train, Batch, Mlp, TrainConfig, PARAM_NAMES};

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
