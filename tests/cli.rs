//! The `recall` binary end to end on the tiny fixture model: `logits` writes HF's logits, `score`
//! prints HF's log-probs, `generate` runs, and bad input fails with a message instead of a panic.

mod common;

use std::process::{Command, Output};

use common::{fixture, max_abs_diff, Reference};

fn recall(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_recall"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env("RECALL_BACKEND", "cpu")
        .output()
        .expect("the recall binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn logits_and_score_match_hf() {
    let model = fixture("tiny-qwen2.5-vl");
    let reference = Reference::load(&model, "reference");
    let tmp = tempfile::tempdir().unwrap();
    let prompt = &reference.prompts()[1];
    let messages = tmp.path().join("messages.json");
    std::fs::write(&messages, prompt["messages"].to_string()).unwrap();
    let out = tmp.path().join("logits.safetensors");
    let o = recall(&[
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--messages",
        messages.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    let written = Reference::from_file(&out);
    assert_eq!(written.ids("input_ids"), reference.ids("p1.input_ids"));
    let (got, got_shape) = written.f32("logits");
    let (want, shape) = reference.f32("p1.logits");
    assert_eq!(got_shape, shape);
    assert!(max_abs_diff(&got, &want) <= 1e-4);

    let o = recall(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--messages",
        messages.to_str().unwrap(),
        "--target",
        prompt["target"].as_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = prompt["target_logprob_sum"].as_f64().unwrap();
    assert!(
        (v["sum_logprob"].as_f64().unwrap() - want).abs() < 1e-3,
        "{v} vs {want}"
    );
}

#[test]
fn generate_runs_and_reports() {
    let model = fixture("tiny-qwen3-vl");
    let o = recall(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "5",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let n = v["tokens"].as_array().unwrap().len();
    assert!((1..=5).contains(&n), "{v}");
    assert_eq!(
        v["load_ops"],
        serde_json::json!([]),
        "no profile without --profile"
    );
    assert!(v["timings"]["load_seconds"].as_f64().unwrap() > 0.0, "{v}");

    // --profile times the load too: packing the decode panels is an op inside the load's wall
    // time, and neither profiling nor the panels change a token (the mapping and the panels give
    // the same bits).
    let o = recall(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "5",
        "--json",
        "--profile",
        "--cpu-decode-panels",
        "true",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("load: "), "{}", stderr(&o));
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(p["tokens"], v["tokens"]);
    let ops = p["load_ops"].as_array().unwrap();
    let pack = ops.iter().find(|o| o["op"] == "pack").expect("a pack op");
    // Panels for exactly the matrices a decode multiplies by, as the checkpoint lists them: every
    // 2-D weight but the embedding tables and the vision tower's (which never runs a decode's few
    // rows), plus the tied lm_head (the embedding, packed once more as a product).
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let ckpt = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    let decoder = ckpt
        .tensors()
        .into_iter()
        .filter(|(name, t)| {
            t.shape().len() == 2 && !name.contains("visual.") && !name.ends_with("embed_tokens.weight")
        })
        .count();
    let tied = config["tie_word_embeddings"] == true && ckpt.tensor("lm_head.weight").is_err();
    assert_eq!(
        pack["calls"].as_u64().unwrap() as usize,
        decoder + usize::from(tied),
        "{pack}"
    );
    let sum: f64 = ops.iter().map(|o| o["seconds"].as_f64().unwrap()).sum();
    assert!(sum <= p["timings"]["load_seconds"].as_f64().unwrap(), "{p}");
}

#[test]
fn bad_input_fails_cleanly() {
    let model = fixture("tiny-qwen3-vl");
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, r#"[{"role": "user", "content": [{"type": "text"}]}]"#).unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["generate", "--model", "/nonexistent/model", "--prompt", "x"],
            "/nonexistent/model",
        ),
        (
            vec![
                "score",
                "--model",
                model.to_str().unwrap(),
                "--messages",
                bad.to_str().unwrap(),
                "--target",
                "x",
            ],
            "messages[0].content[0].text",
        ),
        (
            vec![
                "logits",
                "--model",
                model.to_str().unwrap(),
                "--messages",
                "/nonexistent.json",
                "--out",
                "/tmp/x",
            ],
            "/nonexistent.json",
        ),
    ];
    for (args, needle) in cases {
        let o = recall(&args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: stderr lacks {needle:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

#[test]
fn image_parts_by_data_url_and_file_url() {
    use base64::Engine;
    let model = fixture("tiny-qwen3-vl");
    let reference = Reference::load(&model, "vl_reference");
    let png = fixture("vl-images/screen.png");
    let b64 = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&png).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    // The fixture's `one_image` chat, with the screenshot given as a data: URL and as a file:// URL.
    for url in [
        format!("data:image/png;base64,{b64}"),
        format!("file://{}", png.display()),
    ] {
        let messages = serde_json::json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is on the screen?"}
        ]}]);
        let path = tmp.path().join("messages.json");
        std::fs::write(&path, messages.to_string()).unwrap();
        let out = tmp.path().join("logits.safetensors");
        let o = recall(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--messages",
            path.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let (got, _) = Reference::from_file(&out).f32("logits");
        let (want, _) = reference.f32("v0.logits");
        assert!(max_abs_diff(&got, &want) <= 1e-4, "{}", &url[..20]);
    }
}

#[test]
fn bad_image_fails_cleanly() {
    let model = fixture("tiny-qwen3-vl");
    let tmp = tempfile::tempdir().unwrap();
    let corrupt = tmp.path().join("corrupt.png");
    std::fs::write(&corrupt, b"\x89PNG\r\n\x1a\nnot really").unwrap();
    for (url, needle) in [
        ("/nonexistent/screen.png".to_string(), "/nonexistent/screen.png"),
        (corrupt.display().to_string(), "corrupt.png"),
        (
            "https://example.com/a.png".to_string(),
            "https://example.com/a.png",
        ),
    ] {
        let messages = serde_json::json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}
        ]}]);
        let path = tmp.path().join("messages.json");
        std::fs::write(&path, messages.to_string()).unwrap();
        let o = recall(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--messages",
            path.to_str().unwrap(),
        ]);
        let err = stderr(&o);
        assert!(!o.status.success(), "{url} should fail");
        assert!(err.contains(needle), "{url}: stderr lacks {needle:?}: {err}");
        assert!(!err.contains("panicked"), "{url} panicked: {err}");
    }
}

#[test]
fn adapter_flags_load_and_apply_the_adapter() {
    let model = fixture("tiny-qwen3-vl");
    let reference = Reference::load(&fixture("hgkv-ref"), "reference");
    let tmp = tempfile::tempdir().unwrap();
    let messages = tmp.path().join("messages.json");
    std::fs::write(&messages, reference.prompts()[0]["messages"].to_string()).unwrap();
    let out = tmp.path().join("logits.safetensors");
    let adapter = fixture("hgkv-peft");
    let o = recall(&[
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--adapter-mode",
        "ungated",
        "--messages",
        messages.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (got, _) = Reference::from_file(&out).f32("logits");
    let (want, _) = reference.f32("p0.logits_ungated");
    assert!(max_abs_diff(&got, &want) <= 1e-4);

    let o = recall(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--adapter-mode",
        "sideways",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("sideways"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn episode_render_run_and_label() {
    let model = fixture("tiny-qwen3-vl");
    let episode = fixture("episode-sample");
    let tmp = tempfile::tempdir().unwrap();
    let (m, e) = (model.to_str().unwrap(), episode.to_str().unwrap());

    // render → logits accepts it.
    let rendered = tmp.path().join("step5.json");
    let o = recall(&[
        "episode",
        "render",
        "--episode",
        e,
        "--step",
        "5",
        "--allocation",
        "1,3",
        "--out",
        rendered.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let logits = tmp.path().join("logits.safetensors");
    let o = recall(&[
        "logits",
        "--model",
        m,
        "--messages",
        rendered.to_str().unwrap(),
        "--out",
        logits.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (values, shape) = Reference::from_file(&logits).f32("logits");
    assert!(shape[0] > 100 && values.iter().all(|v| v.is_finite()));
    // An invalid allocation is an error that says why.
    let o = recall(&[
        "episode",
        "render",
        "--episode",
        e,
        "--step",
        "3",
        "--allocation",
        "2,1",
        "--out",
        "/tmp/x.json",
    ]);
    assert!(
        !o.status.success() && !stderr(&o).contains("panicked"),
        "{}",
        stderr(&o)
    );

    // run with Recent-B: no second pass anywhere.
    let json = tmp.path().join("run.json");
    let o = recall(&[
        "episode",
        "run",
        "--model",
        m,
        "--episode",
        e,
        "--budget",
        "2",
        "--policy",
        "recent",
        "--max-tokens",
        "6",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let reports: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let reports = reports.as_array().unwrap();
    assert!(!reports.is_empty());
    assert!(reports.iter().all(|r| r["pass2"] == false && r["k"] == 0));
    let o = recall(&[
        "episode",
        "run",
        "--model",
        m,
        "--episode",
        e,
        "--policy",
        "selector",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("--selector"),
        "{}",
        stderr(&o)
    );

    // label: the Recent-1 anchor is the singleton {T}; scored in different calls, Q is bitwise equal.
    let out = tmp.path().join("labels.jsonl");
    let o = recall(&[
        "episode",
        "label",
        "--model",
        m,
        "--episode",
        e,
        "--budgets",
        "1,2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let labels: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for t in 2..=6 {
        let of = |kind: &str, set: serde_json::Value| {
            labels
                .iter()
                .find(|l| l["t"] == t && l["kind"] == kind && l["set"] == set)
                .map(|l| l["q"].as_f64().unwrap())
        };
        let single = of("singleton", serde_json::json!([t - 1])).unwrap();
        assert_eq!(of("recent", serde_json::json!([t - 1])), Some(single), "t={t}");
        assert!(single < 0.0);
    }
    assert!(labels.iter().any(|l| l["kind"] == "beam"));
}

/// Labels through the HGKV policy: with the gated adapter every set holding a history screenshot
/// scores differently from the frozen model, and the empty set (B = 0) bit for bit the same (the
/// gate bypasses the adapter without history images); every record says what made it.
#[test]
fn episode_labels_through_the_gated_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let labels = |adapter: Option<&str>| {
        let out = tmp.path().join(format!("labels-{}.jsonl", adapter.is_some()));
        let (m, e) = (fixture("tiny-qwen3-vl"), fixture("episode-sample"));
        let mut args = vec![
            "episode".to_string(),
            "label".into(),
            "--model".into(),
            m.to_str().unwrap().into(),
            "--episode".into(),
            e.to_str().unwrap().into(),
            "--budgets".into(),
            "0,1".into(),
            "--out".into(),
            out.to_str().unwrap().into(),
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter".into(), a.into()]);
        }
        let o = recall(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::read_to_string(&out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let adapter = fixture("hgkv-peft");
    // What the labels must say of the adapter, from PEFT's own config (its layers are consecutive).
    let peft: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap()).unwrap();
    let (r, alpha) = (peft["r"].as_f64().unwrap(), peft["lora_alpha"].as_f64().unwrap());
    let layers: Vec<u64> = serde_json::from_value(peft["layers_to_transform"].clone()).unwrap();
    let peft_layout = format!(
        "rank {r}, alpha {alpha} (scale {}), k_proj+v_proj on layers {}-{}",
        alpha / r,
        layers[0],
        layers[layers.len() - 1]
    );
    let (off, gated) = (labels(None), labels(Some(adapter.to_str().unwrap())));
    assert_eq!(off.len(), gated.len());
    let (mut empty, mut with_images) = (0, 0);
    for (a, b) in off.iter().zip(&gated) {
        if a["kind"] == "decision" {
            // The selector's view of the decision does not depend on the adapter.
            assert_eq!((&a["t"], &a["context"]), (&b["t"], &b["context"]));
            continue;
        }
        assert_eq!((&a["t"], &a["kind"], &a["set"]), (&b["t"], &b["kind"], &b["set"]));
        if a["set"].as_array().unwrap().is_empty() {
            empty += 1;
            assert_eq!(
                a["q"].as_f64().unwrap().to_bits(),
                b["q"].as_f64().unwrap().to_bits(),
                "{a} {b}"
            );
        } else {
            with_images += 1;
            assert_ne!(a["q"], b["q"], "{a} {b}");
        }
        assert_eq!(a["made_with"]["adapter_mode"], "off");
        assert!(a["made_with"]["adapter"].is_null());
        assert_eq!(b["made_with"]["adapter_mode"], "gated");
        assert_eq!(b["made_with"]["adapter"], adapter.to_str().unwrap());
        assert!(a["made_with"]["adapter_layout"].is_null());
        let layout = b["made_with"]["adapter_layout"].as_str().unwrap();
        assert!(
            layout.starts_with(&peft_layout),
            "{layout} vs PEFT's {peft_layout}"
        );
        for m in [&a["made_with"], &b["made_with"]] {
            assert_eq!(m["protocol"], "mobile");
            assert!(m["model"].as_str().unwrap().ends_with("tiny-qwen3-vl"));
            assert!(m["min_pixels"].as_u64().unwrap() > 0);
            assert!(m["max_pixels"].as_u64().unwrap() >= m["min_pixels"].as_u64().unwrap());
        }
    }
    assert!(
        empty > 0 && with_images > 0,
        "{empty} empty sets, {with_images} with images"
    );

    // The loop closes: the gated labels train a scorer that `episode run --policy selector` loads.
    let scorer = tmp.path().join("scorer.safetensors");
    let o = recall(&[
        "selector",
        "train",
        "--labels",
        tmp.path().join("labels-true.jsonl").to_str().unwrap(),
        "--out",
        scorer.to_str().unwrap(),
        "--hidden",
        "16",
        "--epochs",
        "5",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let meta = recall::model::loader::Checkpoint::open_file(&scorer)
        .unwrap()
        .metadata;
    let made_with: serde_json::Value = serde_json::from_str(&meta["labels_made_with"]).unwrap();
    assert_eq!(
        made_with, gated[0]["made_with"],
        "the scorer records what its labels were made with"
    );
    let json = tmp.path().join("run.json");
    let o = recall(&[
        "episode",
        "run",
        "--model",
        fixture("tiny-qwen3-vl").to_str().unwrap(),
        "--episode",
        fixture("episode-sample").to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--budget",
        "1",
        "--policy",
        "selector",
        "--selector",
        scorer.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let steps: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(steps.len(), 6, "every decision of the episode ran");
    for s in &steps {
        let t = s["t"].as_u64().unwrap() as usize;
        let alloc: Vec<usize> = serde_json::from_value(s["allocation"].clone()).unwrap();
        assert_eq!(alloc.len(), 1.min(t - 1), "exact-B at t={t}: {alloc:?}");
    }
}

/// desktop-strict never restores the initial screen: a whole episode runs (it failed at t = 2 when
/// the selector's pool held step 1), every allocation stays within steps 2..t-1, and pass 1 is the
/// tail of that pool.
#[test]
fn desktop_strict_runs_a_whole_episode() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("steps.json");
    let (m, e, sel) = (
        fixture("tiny-qwen3-vl"),
        fixture("episode-sample"),
        fixture("selector/scorer.safetensors"),
    );
    for policy in ["recent", "selector"] {
        let o = recall(&[
            "episode",
            "run",
            "--model",
            m.to_str().unwrap(),
            "--episode",
            e.to_str().unwrap(),
            "--budget",
            "2",
            "--protocol",
            "desktop-strict",
            "--max-tokens",
            "8",
            "--policy",
            policy,
            "--selector",
            sel.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{policy}: {}", stderr(&o));
        let steps: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(steps.len(), 6, "{policy}");
        for s in &steps {
            let t = s["t"].as_u64().unwrap();
            let alloc: Vec<u64> = serde_json::from_value(s["allocation"].clone()).unwrap();
            assert!(
                alloc.iter().all(|&j| (2..t).contains(&j)),
                "{policy}: t={t} {alloc:?}"
            );
            assert!(alloc.len() <= 2, "{policy}: t={t} {alloc:?}");
            if policy == "recent" {
                let want: Vec<u64> = (2.max(t.saturating_sub(2))..t).collect();
                assert_eq!(alloc, want, "t={t}");
            }
        }
    }
}

/// `--min-pixels/--max-pixels` set the screenshot pixel budget: a 1920x1080 screenshot at the
/// default budget and at GUI-Owl's CausalCache setting (min = max = 2,621,440) differs in image tokens
/// by what HF's `smart_resize` gives at those budgets (fixture); a budget that cannot hold one merged
/// patch, or min > max, is refused naming both flags.
#[test]
fn pixel_budget_flags_follow_hf_smart_resize() {
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture("preprocess/smart_resize.json")).unwrap())
            .unwrap();
    let at = |min: u64, max: u64| {
        let c = cases
            .iter()
            .find(|c| {
                c["height"] == 1080
                    && c["width"] == 1920
                    && c["factor"] == 32
                    && c["min_pixels"] == min
                    && c["max_pixels"] == max
            })
            .unwrap();
        let (h, w) = (c["out"][0].as_u64().unwrap(), c["out"][1].as_u64().unwrap());
        h / 32 * (w / 32)
    };
    let tmp = tempfile::tempdir().unwrap();
    let png = tmp.path().join("screen.png");
    image::RgbImage::from_pixel(1920, 1080, image::Rgb([200, 100, 50]))
        .save(&png)
        .unwrap();
    let messages = tmp.path().join("messages.json");
    let chat = serde_json::json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png.to_str().unwrap()}},
        {"type": "text", "text": "hi"}]}]);
    std::fs::write(&messages, chat.to_string()).unwrap();
    let model = fixture("tiny-qwen3-vl");
    let run = |min: &str, max: &str| {
        recall(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--messages",
            messages.to_str().unwrap(),
            "--max-tokens",
            "1",
            "--json",
            "--min-pixels",
            min,
            "--max-pixels",
            max,
        ])
    };
    let tokens = |min: u64, max: u64| {
        let o = run(&min.to_string(), &max.to_string());
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["prompt_tokens"].as_u64().unwrap()
    };
    let (default, gui_owl) = ((65_536, 16_777_216), (2_621_440, 2_621_440));
    assert_eq!(
        tokens(gui_owl.0, gui_owl.1) - tokens(default.0, default.1),
        at(gui_owl.0, gui_owl.1) - at(default.0, default.1)
    );
    for (min, max) in [("5000", "4000"), ("16", "16")] {
        let o = run(min, max);
        let err = stderr(&o);
        assert!(
            !o.status.success() && err.contains("--min-pixels") && err.contains("--max-pixels"),
            "{err}"
        );
    }
}

#[test]
fn scopemem_run_and_eval_on_bundled_data() {
    let model = fixture("tiny-qwen3-vl");
    let dataset = fixture("eval/aitw_steps.jsonl");
    let encoder = fixture("scopemem/encoder");
    let (m, d, enc) = (
        model.to_str().unwrap(),
        dataset.to_str().unwrap(),
        encoder.to_str().unwrap(),
    );
    let o = recall(&[
        "scopemem",
        "run",
        "--model",
        m,
        "--dataset",
        d,
        "--encoder",
        enc,
        "--lines",
        "1,2",
        "--max-tokens",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        let p0: Vec<f64> = serde_json::from_value(r["opinions"]["p0"].clone()).unwrap();
        assert_eq!(p0.len(), 10);
        assert!((p0.iter().sum::<f64>() - 1.0).abs() < 1e-4);
    }
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("report.json");
    let o = recall(&[
        "eval",
        "--model",
        m,
        "--dataset",
        d,
        "--encoder",
        enc,
        "--lines",
        "1,2,3",
        "--max-tokens",
        "4",
        "--bootstrap",
        "50",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ΔAcc"));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["overall"]["counts"]["steps"], 3);
}

#[test]
fn every_command_takes_a_backend_and_cuda_without_a_gpu_fails_in_one_line() {
    if recall::backend::select(recall::backend::BackendChoice::Cuda).is_ok() {
        eprintln!("SKIP: this machine has a usable GPU");
        return;
    }
    let model = fixture("tiny-qwen3-vl");
    let m = model.to_str().unwrap();
    let episode = fixture("episode-sample");
    let e = episode.to_str().unwrap();
    let dataset = fixture("eval/aitw_steps.jsonl");
    let d = dataset.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = out.to_str().unwrap();
    let commands: Vec<Vec<&str>> = vec![
        vec!["generate", "--model", m, "--prompt", "x"],
        vec!["logits", "--model", m, "--messages", "m.json", "--out", o],
        vec!["score", "--model", m, "--messages", "m.json", "--target", "x"],
        vec!["episode", "run", "--model", m, "--episode", e],
        vec!["episode", "label", "--model", m, "--episode", e, "--out", o],
        vec!["episode", "render", "--episode", e, "--step", "2", "--out", o],
        vec!["scopemem", "run", "--model", m, "--dataset", d],
        vec!["eval", "--model", m, "--dataset", d],
        vec!["demo", "--chart", o],
        vec!["serve", "--model", m, "--port", "0"],
        vec!["bench", "--tiny", "--config-dir", m],
    ];
    for args in commands {
        let mut with_cuda = args.clone();
        with_cuda.extend(["--backend", "cuda"]);
        let out = recall(&with_cuda);
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} --backend cuda should fail here");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {err}");
        assert!(errors[0].contains("no usable GPU"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // auto falls back to the CPU and says so.
    let o = Command::new(env!("CARGO_BIN_EXE_recall"))
        .args([
            "generate",
            "--model",
            m,
            "--prompt",
            "x",
            "--max-tokens",
            "2",
            "--backend",
            "auto",
        ])
        .env("RUST_LOG", "recall=info")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("backend: cpu"), "{}", stderr(&o));
}

/// `recall episode merge-eval` refuses what it cannot merge, naming the file or the shard, and
/// writes nothing: a missing shard, a shard that is not an eval.json, shards of another policy or
/// budget, an episode in two shards.
#[test]
fn merge_eval_refuses_shards_it_cannot_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let shard = |name: &str, policy: &str, budget: usize, episode: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let doc = serde_json::json!({
            "policy": policy, "budget": budget,
            "bootstrap": {"resamples": 10, "seed": 0, "confidence": 0.95},
            "rows": [{"episode": episode, "t": 1, "recent": [], "allocation": [], "k": 0, "matches": true,
                      "recent_matches": false, "q": -1.0, "q_recent": -1.0, "margin": 0.0}],
        });
        std::fs::write(dir.join("eval.json"), doc.to_string()).unwrap();
        dir.to_str().unwrap().to_string()
    };
    let a = shard("a", "recent", 2, "ep-a");
    let other_budget = shard("b", "recent", 4, "ep-b");
    let same_episode = shard("c", "recent", 2, "ep-a");
    let broken = tmp.path().join("d");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("eval.json"), "{\"policy\": 3}").unwrap();
    let missing = tmp.path().join("nowhere").to_str().unwrap().to_string();
    let out = tmp.path().join("out");
    let merge = |shards: &[&str]| {
        let mut args = vec!["episode", "merge-eval", "--out", out.to_str().unwrap()];
        args.extend(shards);
        recall(&args)
    };
    for (shards, want) in [
        (vec![a.as_str(), missing.as_str()], "nowhere/eval.json"),
        (vec![a.as_str(), broken.to_str().unwrap()], "d/eval.json"),
        (
            vec![a.as_str(), other_budget.as_str()],
            "shard 1 evaluated policy `recent` at B = 4",
        ),
        (
            vec![a.as_str(), same_episode.as_str()],
            "episode `ep-a` of shard 1",
        ),
    ] {
        let o = merge(&shards);
        assert!(!o.status.success(), "{shards:?}");
        assert!(stderr(&o).contains(want), "{shards:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
        assert!(!out.exists(), "a refused merge wrote {}", out.display());
    }
    let o = merge(&[a.as_str(), other_budget.as_str()][..1]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("eval.json").exists() && out.join("eval.md").exists());
}
