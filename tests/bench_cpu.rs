//! `recall::bench` end to end on the CPU backend with the tiny Qwen3-VL config: random weights,
//! every measurement, and every path's whole greedy output identical to the baseline's (plain
//! decoding of the same prompt on a fresh engine, computed apart from every measured run; step replay
//! on and off included), each flag checked here against the tokens the report carries. Timings are only checked to be positive (no thresholds), except that
//! the per-op profile of `--breakdown` sums to at most its phase's wall time: the ops run inside it.

use std::path::Path;

use recall::bench::{run_bench, BenchArgs, BenchReport, GridSpec, LayoutRun};
use serde_json::Value;

fn fixture() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny-qwen3-vl"
    ))
}

/// Every flag of the report says what it compared with, and the step rows' flags agree with the
/// tokens the report carries: each pass equals the baseline's for its prompt, over the whole response.
fn check_flags(report: &BenchReport) {
    for (name, identical) in report.identical_flags() {
        assert!(
            identical && name.contains(" vs baseline"),
            "{name}: greedy output differs from the baseline\n{}",
            report.to_table()
        );
    }
    assert!(report.all_identical);
    let (b, n) = (&report.baseline, report.shapes.response_tokens);
    assert!(!b.method.is_empty() && report.to_table().contains(&b.method));
    for tokens in [&b.pass1_tokens, &b.pass2_tokens, &b.scopemem_tokens] {
        assert_eq!(tokens.len(), n, "the baseline covers the whole response");
    }
    assert!(b.pass1_ms_per_token > 0.0);
    let rows = report.causalcache.iter().map(|r| (r, &b.pass2_tokens));
    for (r, pass2) in rows.chain(report.scopemem.iter().map(|r| (r, &b.scopemem_tokens))) {
        let same = r.pass1_tokens == b.pass1_tokens && &r.pass2_tokens == pass2;
        assert!(same && r.identical, "{}: {r:?} vs {b:?}", r.name);
    }
}

fn check(report: &BenchReport) {
    check_flags(report);
    let s = &report.shapes;
    assert!(s.pass1_tokens > 0 && s.pass2_tokens > 0 && s.scopemem_tokens == s.pass1_tokens + 16);
    assert_ne!(s.allocation, s.recent, "pass 2 must render another allocation");
    assert!(report.weights.params > 0);
    assert!(report.vision.ms > 0.0 && report.vision.tflop > 0.0 && report.vision.tflops > 0.0);
    assert_eq!(report.prefill.len(), 3);
    for p in &report.prefill {
        assert!(
            p.ms > 0.0 && p.tflop > 0.0 && p.tflops > 0.0 && p.floor_ms > 0.0,
            "{p:?}"
        );
    }
    assert_eq!(report.prefill[0].vision_images, s.budget + 1);
    assert_eq!(report.prefill[1].vision_images, 1);
    assert_eq!(report.prefill[2].vision_images, 0);
    assert!(report.prefill[0].tflop > report.prefill[2].tflop);
    let d = &report.decode;
    assert!(d.ms_per_token > 0.0 && d.gb_per_token > 0.0 && d.gbs > 0.0 && d.context > s.pass1_tokens);
    let quick = report.causalcache.len() == 3;
    assert_eq!(report.causalcache.len(), if quick { 3 } else { 5 });
    assert_eq!(report.scopemem.len(), if quick { 2 } else { 3 });
    for r in report.causalcache.iter().chain(&report.scopemem) {
        assert!(r.pass1_ms > 0.0 && r.pass2_ms > 0.0 && r.total_ms > 0.0, "{r:?}");
        assert!(
            r.pass1_prefill_ms > 0.0 && r.pass1_prefill_ms <= r.pass1_ms,
            "{r:?}"
        );
        assert_eq!(r.pass1_tokens.len(), s.response_tokens);
        assert_eq!(r.pass2_tokens.len(), s.response_tokens);
    }
    let row = |name: &str| report.causalcache.iter().find(|r| r.name == name).unwrap();
    let plain = row("plain");
    assert_eq!((plain.reused_pass1, plain.reused_pass2), (0, 0));
    // With reuse, pass 2 shares the system prompt and the first folded lines with pass 1 (and pass 1
    // those of the previous step).
    let reuse = row("reuse + draft");
    assert!(reuse.reused_pass1 > 0 && reuse.reused_pass2 > 0, "{reuse:?}");
    // The oracle draft is the baseline's pass 2 output: every draft token is accepted.
    let oracle = row("reuse + oracle draft");
    assert_eq!(oracle.accepted_draft, s.response_tokens);
    // ScopeMem: a prepended prefix shares nothing with pass 1; appended before the assistant turn,
    // pass 2 starts from pass 1's cached context.
    let sm = |name: &str| report.scopemem.iter().find(|r| r.name == name).unwrap();
    assert_eq!(sm("scopemem + reuse").reused_pass2, 0);
    assert!(sm("scopemem append + reuse").reused_pass2 > 0);
    // The layout for tools/hf_bench.py: B + 1 screenshots.
    let images = s
        .pass1_layout
        .iter()
        .filter(|r| matches!(r, LayoutRun::Image { .. }))
        .count();
    assert_eq!(images, s.budget + 1);
    let table = report.to_table();
    assert!(table.contains("identical") && !table.contains(" NO"), "{table}");
    let json: Value = serde_json::from_str(&report.to_json().unwrap()).unwrap();
    assert_eq!(json["all_identical"], Value::Bool(true));
    // Step replay (a no-op on the CPU): with it on, the decode also ran with it off, same tokens.
    let replay = &json["replay"];
    assert_eq!(replay["enabled"], Value::Bool(report.replay.enabled));
    if report.replay.enabled {
        assert_eq!(replay["identical"], Value::Bool(true), "{replay}");
        assert!(replay["off_ms_per_token"].as_f64().unwrap() > 0.0, "{replay}");
        assert!(table.contains("replay identical: yes"), "{table}");
    } else {
        assert!(
            replay["identical"].is_null() && table.contains("step replay off"),
            "{table}"
        );
    }
}

/// The `--breakdown` JSON: per phase, ops that include `linear` (or `linear_gemv`) and `paged_attention`, positive
/// counts and times, and a sum of op times within the phase's wall time.
fn check_breakdown(json: &Value) {
    let b = &json["breakdown"];
    for phase in ["prefill", "decode"] {
        let ops = b[phase]
            .as_array()
            .unwrap_or_else(|| panic!("no {phase} breakdown: {b}"));
        let name = |o: &Value| o["op"].as_str().unwrap().to_string();
        let names: Vec<String> = ops.iter().map(name).collect();
        // `linear` under 8 rows (decode) is profiled as `linear_gemv`.
        for op in ["linear", "paged_attention"] {
            assert!(
                names.iter().any(|n| n.split("_gemv").next() == Some(op)),
                "{phase}: no {op} in {names:?}"
            );
        }
        for o in ops {
            assert!(
                o["calls"].as_u64().unwrap() > 0 && o["seconds"].as_f64().unwrap() >= 0.0,
                "{o}"
            );
        }
        let sum: f64 = ops.iter().map(|o| o["seconds"].as_f64().unwrap()).sum();
        let wall = b[format!("{phase}_wall_s")].as_f64().unwrap();
        assert!(sum > 0.0 && sum <= wall, "{phase}: ops {sum} s vs wall {wall} s");
    }
    assert!(b["decode_steps"].as_u64().unwrap() > 0);
    assert_eq!(b["identical"], Value::Bool(true));
}

#[test]
fn tiny_bench_on_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let args = BenchArgs {
        weights_dir: Some(dir.path().to_path_buf()),
        json_out: Some(json.clone()),
        breakdown: true,
        ..BenchArgs::tiny(fixture())
    };
    let report = run_bench(&args).unwrap();
    println!("{}", report.to_table());
    check(&report);
    let text = std::fs::read_to_string(&json).unwrap();
    check_breakdown(&serde_json::from_str(&text).unwrap());
    assert!(report.to_table().contains("per-op breakdown"));
    let back: BenchReport = serde_json::from_str(&text).unwrap();
    // For checking tools/hf_bench.py --layout-json by hand.
    if let Ok(keep) = std::env::var("RECALL_BENCH_JSON") {
        std::fs::copy(&json, keep).unwrap();
    }
    assert_eq!(back.shapes, report.shapes);
    assert_eq!(back.breakdown, report.breakdown);
    // Only the JSON is left behind: the random weights are deleted.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("bench.json")]);
}

#[test]
fn depth_override_chunking_and_pixel_grid() {
    let dir = tempfile::tempdir().unwrap();
    // Through a real weights file and the checkpoint loader (the other tests use synthetic weights).
    let args = BenchArgs {
        weights_dir: Some(dir.path().to_path_buf()),
        weights_file: true,
        layers: Some(2),
        grid: "64x96px".parse().unwrap(),
        budget: 1,
        history: 3,
        response_tokens: 3,
        repeats: 2,
        chunk_size: 7,
        max_batch_tokens: 7,
        quick: true,
        step_replay: false,
        ..BenchArgs::tiny(fixture())
    };
    let report = run_bench(&args).unwrap();
    assert!(report.breakdown.is_none() && !report.replay.enabled);
    assert_eq!(report.layers, 2);
    assert_eq!(report.shapes.grid, [1, 4, 6]);
    check(&report);
    // The same weights generated by the backend (no file): the same model, so the same greedy tokens
    // on every path of the step.
    let synthetic = run_bench(&BenchArgs {
        weights_file: false,
        ..args
    })
    .unwrap();
    assert_eq!(synthetic.weights.params, report.weights.params);
    assert_eq!(synthetic.weights.file_bytes, 0);
    assert!(report.weights.file_bytes > 0);
    for (a, b) in report
        .causalcache
        .iter()
        .chain(&report.scopemem)
        .zip(synthetic.causalcache.iter().chain(&synthetic.scopemem))
    {
        assert_eq!(a.pass1_tokens, b.pass1_tokens, "{}", a.name);
        assert_eq!(a.pass2_tokens, b.pass2_tokens, "{}", a.name);
    }
}

#[test]
fn grid_specs_and_bad_args() {
    assert_eq!(
        "1x80x128".parse::<GridSpec>(),
        Ok(GridSpec::Patches([1, 80, 128]))
    );
    assert_eq!("80x128".parse::<GridSpec>(), Ok(GridSpec::Patches([1, 80, 128])));
    assert_eq!(
        "1280x2048px".parse::<GridSpec>(),
        Ok(GridSpec::Pixels {
            height: 1280,
            width: 2048
        })
    );
    assert!("12".parse::<GridSpec>().is_err());
    let bad = BenchArgs {
        history: 2,
        ..BenchArgs::tiny(fixture())
    };
    assert!(run_bench(&bad).is_err(), "history must exceed the budget");
    assert!(
        BenchArgs::from_flags(&["--backend", "tpu"]).is_err(),
        "unknown backend"
    );
    let tiny = BenchArgs::tiny(fixture());
    assert_eq!(tiny.backend.backend, recall::backend::BackendChoice::Cpu);
    // Flags after the preset win.
    let mut flags = recall::bench::TINY_PRESET.to_vec();
    flags.extend(["--budget", "3"]);
    assert_eq!(BenchArgs::from_flags(&flags).unwrap().budget, 3);
    let bad = BenchArgs {
        grid: GridSpec::Patches([1, 3, 4]),
        ..BenchArgs::tiny(fixture())
    };
    assert!(run_bench(&bad).is_err(), "odd grid");
}
