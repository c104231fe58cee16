//! The ScopeMem encoder against its PyTorch reference (tools/scopemem_encoder.py, fixtures from
//! tools/gen_scopemem_fixtures.py): every case within 1e-5 of the float32 forward (and of the float64
//! one), with the field embeddings gathered here from the tiny actor's `embed_tokens`; the parameter
//! count; the study's other encoders (one-pass, task-only, history-only, fixed-query) against their
//! own PyTorch outputs; and clear errors for bad checkpoints, configs and inputs.

use std::fs;
use std::path::{Path, PathBuf};

use recall::model::loader::Checkpoint;
use recall::model::scopemem::{
    action_type_entropy, p0_from_slice, EncoderInputs, ScopeMemConfig, ScopeMemEncoder, Variant, CONFIG_FILE,
    FIELDS, NUM_ACTION_TYPES, WEIGHTS_FILE,
};
use recall::Error;
use serde_json::Value;

const TOL: f32 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn encoder_dir() -> PathBuf {
    fixtures().join("scopemem/encoder")
}

fn cases_doc() -> Value {
    let text = fs::read_to_string(fixtures().join("scopemem/cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Rows `ids` of the tiny actor's input embedding table, as the caller of the encoder builds a field.
fn embed(table: &[f32], hidden: usize, ids: &[u32]) -> Vec<f32> {
    ids.iter()
        .flat_map(|&i| {
            table[i as usize * hidden..(i as usize + 1) * hidden]
                .iter()
                .copied()
        })
        .collect()
}

fn inputs_of(case: &Value, cases: &Checkpoint, i: usize, table: &[f32], hidden: usize) -> EncoderInputs {
    let mut fields: Vec<Vec<f32>> = Vec::new();
    for name in FIELDS {
        let ids: Vec<u32> = case["ids"][name]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let e = embed(table, hidden, &ids);
        if ids.is_empty() {
            assert!(!cases.contains(&format!("case{i}.{name}")));
        } else {
            // The fixture's inputs are exactly those rows.
            assert_eq!(
                e,
                cases.get(&format!("case{i}.{name}")).unwrap().to_f32(),
                "case {i} {name}"
            );
        }
        fields.push(e);
    }
    let p0 = p0_from_slice(&cases.get(&format!("case{i}.p0")).unwrap().to_f32()).unwrap();
    let json_p0: Vec<f32> = case["p0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(p0.to_vec(), json_p0);
    let [first_opinion, task, summary, recent_actions]: [Vec<f32>; 4] = fields.try_into().unwrap();
    EncoderInputs {
        first_opinion,
        task,
        summary,
        recent_actions,
        p0,
    }
}

#[test]
fn matches_pytorch_on_every_case() {
    let enc = ScopeMemEncoder::load(&encoder_dir()).unwrap();
    let cfg = enc.config().clone();
    let doc = cases_doc();
    let cases = Checkpoint::open_file(&fixtures().join("scopemem/cases.safetensors")).unwrap();
    let actor = Checkpoint::open_file(&fixtures().join("tiny-qwen3-vl/model.safetensors")).unwrap();
    let table = actor.get("model.language_model.embed_tokens.weight").unwrap();
    assert_eq!(table.shape[1], cfg.hidden_size);
    let table = table.to_f32();

    let list = doc["cases"].as_array().unwrap();
    assert!(list.len() >= 5);
    for (i, case) in list.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let inputs = inputs_of(case, &cases, i, &table, cfg.hidden_size);
        let h0 = case["h0"].as_f64().unwrap() as f32;
        assert!((action_type_entropy(&inputs.p0) - h0).abs() < 1e-6, "{name}: H0");

        let out = enc.forward(&inputs).unwrap();
        assert_eq!(out.len(), cfg.num_queries * cfg.hidden_size);
        let f32_ref = cases.get(&format!("case{i}.out_f32")).unwrap().to_f32();
        let f64_ref = cases.get(&format!("case{i}.out_f64")).unwrap().to_f32();
        let (d32, d64) = (max_abs_diff(&out, &f32_ref), max_abs_diff(&out, &f64_ref));
        let scale = out.iter().fold(0f32, |m, v| m.max(v.abs()));
        println!("{name}: max|out| {scale:.3}, vs torch f32 {d32:.2e}, vs torch f64 {d64:.2e}");
        assert!(
            d32 <= TOL,
            "{name}: max abs diff {d32} from the float32 reference"
        );
        assert!(
            d64 <= TOL,
            "{name}: max abs diff {d64} from the float64 reference"
        );
        assert!(
            scale > 1.0,
            "{name}: outputs too small for the comparison to mean anything"
        );
    }
}

#[test]
fn forward_is_deterministic_and_depends_on_every_input() {
    let enc = ScopeMemEncoder::load(&encoder_dir()).unwrap();
    let hidden = enc.config().hidden_size;
    let field = |n: usize, s: f32| (0..n * hidden).map(|j| ((j as f32) * 0.37 + s).sin()).collect();
    let mut p0 = [0.05f32; NUM_ACTION_TYPES];
    p0[2] = 0.55;
    let base = EncoderInputs {
        first_opinion: field(3, 0.0),
        task: field(5, 1.0),
        summary: field(2, 2.0),
        recent_actions: field(4, 3.0),
        p0,
    };
    let out = enc.forward(&base).unwrap();
    assert_eq!(out, enc.forward(&base).unwrap(), "bitwise repeatable");
    let mut changed = Vec::new();
    for k in 0..5 {
        let mut x = base.clone();
        match k {
            0 => x.first_opinion[0] += 0.5,
            1 => x.task[hidden] -= 0.5,
            2 => x.summary.clear(),
            3 => x.recent_actions.truncate(hidden),
            _ => x.p0.swap(2, 3),
        }
        changed.push(max_abs_diff(&out, &enc.forward(&x).unwrap()) > 1e-4);
    }
    assert_eq!(changed, [true; 5]);
}

#[test]
fn entropy() {
    let mut one_hot = [0f32; NUM_ACTION_TYPES];
    one_hot[9] = 1.0;
    assert_eq!(action_type_entropy(&one_hot), 0.0);
    assert!((action_type_entropy(&[0.1; NUM_ACTION_TYPES]) - 10f32.ln()).abs() < 1e-6);
    let mut two = [0f32; NUM_ACTION_TYPES];
    two[0] = 0.5;
    two[1] = 0.5;
    assert!((action_type_entropy(&two) - 2f32.ln()).abs() < 1e-7);
}

#[test]
fn parameter_count() {
    let paper = ScopeMemConfig::paper(4096);
    assert_eq!(paper.num_parameters(), 10_508_032);
    let from_list: usize = paper
        .tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(from_list, paper.num_parameters());

    let enc = ScopeMemEncoder::load(&encoder_dir()).unwrap();
    let tiny = enc.config();
    assert_eq!(
        tiny.num_parameters() as u64,
        cases_doc()["num_parameters"].as_u64().unwrap()
    );
    let ckpt = Checkpoint::open_file(&encoder_dir().join(WEIGHTS_FILE)).unwrap();
    let in_file: usize = ckpt.names().iter().map(|n| ckpt.get(n).unwrap().numel()).sum();
    assert_eq!(in_file, tiny.num_parameters());
}

#[test]
fn every_variant_matches_pytorch_and_reads_only_its_inputs() {
    let doc = cases_doc();
    let cases = Checkpoint::open_file(&fixtures().join("scopemem/cases.safetensors")).unwrap();
    let outs = Checkpoint::open_file(&fixtures().join("scopemem/variants.safetensors")).unwrap();
    let meta: Value =
        serde_json::from_str(&fs::read_to_string(fixtures().join("scopemem/variants.json")).unwrap())
            .unwrap();
    let actor = Checkpoint::open_file(&fixtures().join("tiny-qwen3-vl/model.safetensors")).unwrap();
    let table = actor
        .get("model.language_model.embed_tokens.weight")
        .unwrap()
        .to_f32();
    for variant in Variant::ALL.into_iter().filter(|v| *v != Variant::Full) {
        let dir = fixtures().join("scopemem/variants").join(variant.name());
        let enc = ScopeMemEncoder::load(&dir).unwrap();
        let cfg = enc.config();
        assert_eq!(cfg.variant(), Some(variant));
        // Only Table 7's history ablation reads the first opinion, as the full encoder does.
        assert_eq!(
            cfg.needs_first_opinion(),
            variant == Variant::NoHistory,
            "{variant:?}"
        );
        assert_eq!(
            cfg.num_parameters() as u64,
            meta["variants"][variant.name()]["num_parameters"]
                .as_u64()
                .unwrap()
        );
        let ckpt = Checkpoint::open_file(&dir.join(WEIGHTS_FILE)).unwrap();
        let in_file: usize = ckpt.names().iter().map(|n| ckpt.get(n).unwrap().numel()).sum();
        assert_eq!(in_file, cfg.num_parameters());
        for (i, case) in doc["cases"].as_array().unwrap().iter().enumerate() {
            let inputs = inputs_of(case, &cases, i, &table, cfg.hidden_size);
            let out = enc.forward(&inputs).unwrap();
            let want = outs
                .get(&format!("{}.case{i}.out_f32", variant.name()))
                .unwrap()
                .to_f32();
            let d = max_abs_diff(&out, &want);
            println!("{} {}: vs torch f32 {d:.2e}", variant.name(), case["name"]);
            assert!(d <= TOL, "{variant:?} case {i}: max abs diff {d}");
            // What it does not read does not matter: not a0, not p0 (not even an invalid one).
            let mut other = inputs.clone();
            if !cfg.needs_first_opinion() {
                other.first_opinion = vec![9.0; 3 * cfg.hidden_size];
                other.p0 = [0.0; NUM_ACTION_TYPES];
            }
            for (f, data) in [
                (1, &mut other.task),
                (2, &mut other.summary),
                (3, &mut other.recent_actions),
            ] {
                if !cfg.fields.contains(&f) {
                    *data = vec![-4.0; 2 * cfg.hidden_size];
                }
            }
            assert_eq!(
                enc.forward(&other).unwrap(),
                out,
                "{variant:?} read an input it does not list"
            );
        }
    }
}

#[test]
fn variant_configs_are_checked() {
    let variant_dir = |v: &str| fixtures().join("scopemem/variants").join(v);
    let load_config = |dir: &Path, edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut cfg: Value =
            serde_json::from_str(&fs::read_to_string(dir.join(CONFIG_FILE)).unwrap()).unwrap();
        edit(cfg.as_object_mut().unwrap());
        ScopeMemConfig::from_json(&dir.join(CONFIG_FILE), &cfg)
    };
    let field_of = |r: recall::Result<ScopeMemConfig>| match r {
        Err(Error::Json { field, .. }) => field,
        other => panic!("expected a JSON error, got {other:?}"),
    };
    let full = encoder_dir();
    // The named variant must be what the inputs make.
    assert_eq!(
        field_of(load_config(&full, &|c| {
            c.insert("variant".into(), "task-only".into());
        })),
        "variant"
    );
    assert_eq!(
        field_of(load_config(&variant_dir("task-only"), &|c| {
            c.insert("confidence".into(), true.into());
        })),
        "variant"
    );
    // Fields: known names, each once, in FIELDS order.
    for bad in [
        serde_json::json!(["task", "first_opinion"]),
        serde_json::json!(["task", "task"]),
        serde_json::json!(["screenshot"]),
        serde_json::json!("task"),
    ] {
        assert_eq!(
            field_of(load_config(&full, &|c| {
                c.insert("fields".into(), bad.clone());
            })),
            "fields"
        );
    }
    assert_eq!(
        field_of(load_config(&full, &|c| {
            c.insert("confidence".into(), "yes".into());
        })),
        "confidence"
    );
    // Nothing to self-attend to.
    assert_eq!(
        field_of(load_config(&variant_dir("fixed-query"), &|c| {
            c.insert("num_self_layers".into(), 1.into());
        })),
        "num_self_layers"
    );
    // A config that says task-only over the full encoder's tensors: the tensors do not fit.
    let dir = edited(
        |c| {
            c.insert("fields".into(), serde_json::json!(["task"]));
            c.insert("confidence".into(), false.into());
        },
        |_| {},
    );
    let msg = load_err(dir.path()).to_string();
    assert!(
        msg.contains("segment_embed.weight") || msg.contains("conf_mlp"),
        "{msg}"
    );
}

// ---- bad checkpoints and configs ----

/// A copy of the fixture encoder whose config and tensors went through `edit_config` and
/// `edit_tensors`.
fn edited(
    edit_config: impl FnOnce(&mut serde_json::Map<String, Value>),
    edit_tensors: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text = fs::read_to_string(encoder_dir().join(CONFIG_FILE)).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    edit_config(cfg.as_object_mut().unwrap());
    fs::write(
        dir.path().join(CONFIG_FILE),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();

    let ckpt = Checkpoint::open_file(&encoder_dir().join(WEIGHTS_FILE)).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = ckpt
        .names()
        .iter()
        .map(|n| {
            let t = ckpt.get(n).unwrap();
            (n.to_string(), t.shape.clone(), t.to_f32())
        })
        .collect();
    edit_tensors(&mut tensors);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views = bytes.iter().map(|(n, s, b)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
        )
    });
    let data = safetensors::serialize(views, &None).unwrap();
    fs::write(dir.path().join(WEIGHTS_FILE), data).unwrap();
    dir
}

fn load_err(dir: &Path) -> Error {
    match ScopeMemEncoder::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn unedited_copy_loads() {
    let dir = edited(|_| {}, |_| {});
    ScopeMemEncoder::load(dir.path()).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = edited(
        |_| {},
        |t| t.retain(|(n, _, _)| n != "cross_layers.1.attn.v_proj.bias"),
    );
    let e = load_err(dir.path());
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name == "cross_layers.1.attn.v_proj.bias"));
    let msg = e.to_string();
    assert!(
        msg.contains("cross_layers.1.attn.v_proj.bias") && msg.contains(WEIGHTS_FILE),
        "{msg}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let dir = edited(
        |_| {},
        |t| {
            let pos = t.iter_mut().find(|(n, _, _)| n == "pos_embed.weight").unwrap();
            pos.1 = vec![31, 32];
            pos.2.truncate(31 * 32);
        },
    );
    let e = load_err(dir.path());
    match &e {
        Error::ShapeMismatch {
            name,
            expected,
            actual,
            ..
        } => {
            assert_eq!(name, "pos_embed.weight");
            assert_eq!(
                (expected.as_slice(), actual.as_slice()),
                (&[32, 32][..], &[31, 32][..])
            );
        }
        other => panic!("expected a shape mismatch, got {other}"),
    }
}

#[test]
fn config_disagreeing_with_the_weights_is_caught() {
    // More positions than the file holds: the shape check names the tensor.
    let dir = edited(|c| drop(c.insert("max_positions".into(), 64.into())), |_| {});
    assert!(load_err(dir.path()).to_string().contains("pos_embed.weight"));
    // Fewer cross layers than the file holds: the leftover tensor is named.
    let dir = edited(|c| drop(c.insert("num_cross_layers".into(), 1.into())), |_| {});
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("unexpected tensor `cross_layers.1."), "{msg}");
}

fn assert_json_field(dir: &Path, field: &str) {
    match load_err(dir) {
        Error::Json { field: f, path, .. } => {
            assert_eq!(f, field);
            assert!(path.ends_with(CONFIG_FILE));
        }
        other => panic!("expected a JSON error at `{field}`, got {other}"),
    }
}

#[test]
fn malformed_config_names_the_field() {
    // (field, its new value; None removes it)
    let cases: Vec<(&str, Option<Value>)> = vec![
        ("d_model", None),
        ("hidden_size", Some("64".into())),
        ("num_queries", Some(0.into())),
        ("num_heads", Some(3.into())),
        ("num_action_types", Some(9.into())),
        ("layer_norm_eps", Some((-1.0).into())),
        ("model_type", Some("qwen3_vl".into())),
        ("fields", Some(serde_json::json!(["recent_actions", "task"]))),
        ("format_version", Some(2.into())),
    ];
    for (field, value) in cases {
        let dir = edited(
            |c| {
                match value {
                    None => c.remove(field),
                    Some(v) => c.insert(field.into(), v),
                };
            },
            |_| {},
        );
        assert_json_field(dir.path(), field);
    }
    // Not JSON at all.
    let dir = edited(|_| {}, |_| {});
    fs::write(dir.path().join(CONFIG_FILE), "{ not json").unwrap();
    assert!(matches!(load_err(dir.path()), Error::Json { .. }));
    // No config, no weights.
    let empty = tempfile::tempdir().unwrap();
    assert!(load_err(empty.path()).to_string().contains(CONFIG_FILE));
    let dir = edited(|_| {}, |_| {});
    fs::remove_file(dir.path().join(WEIGHTS_FILE)).unwrap();
    assert!(load_err(dir.path()).to_string().contains(WEIGHTS_FILE));
}

// ---- bad inputs ----

fn valid_inputs(hidden: usize) -> EncoderInputs {
    EncoderInputs {
        first_opinion: vec![0.1; 2 * hidden],
        task: vec![0.2; 3 * hidden],
        p0: [0.1; NUM_ACTION_TYPES],
        ..Default::default()
    }
}

fn forward_err(enc: &ScopeMemEncoder, inputs: &EncoderInputs) -> String {
    match enc.forward(inputs) {
        Ok(_) => panic!("forward should fail"),
        Err(e @ Error::InvalidRequest(_)) => e.to_string(),
        Err(e) => panic!("expected InvalidRequest, got {e}"),
    }
}

#[test]
fn bad_p0_is_rejected() {
    let enc = ScopeMemEncoder::load(&encoder_dir()).unwrap();
    let hidden = enc.config().hidden_size;
    enc.forward(&valid_inputs(hidden)).unwrap();

    let msg = p0_from_slice(&[0.1; 9]).unwrap_err().to_string();
    assert!(msg.contains("10") && msg.contains("got 9"), "{msg}");
    assert!(p0_from_slice(&[0.1; 11]).is_err());
    assert!(p0_from_slice(&[0.1; NUM_ACTION_TYPES]).is_ok());

    let mut x = valid_inputs(hidden);
    x.p0 = [0.09; NUM_ACTION_TYPES];
    assert!(forward_err(&enc, &x).contains("sums to"));
    x.p0 = [0.0; NUM_ACTION_TYPES];
    assert!(forward_err(&enc, &x).contains("sums to"));
    x.p0 = [0.1; NUM_ACTION_TYPES];
    x.p0[0] = -0.1;
    x.p0[1] = 0.3;
    assert!(forward_err(&enc, &x).contains("p0[0]"));
    x.p0 = [0.1; NUM_ACTION_TYPES];
    x.p0[5] = f32::NAN;
    assert!(forward_err(&enc, &x).contains("p0[5]"));
    // Within the tolerance: accepted.
    x.p0 = [0.10005; NUM_ACTION_TYPES];
    enc.forward(&x).unwrap();
}

#[test]
fn bad_fields_are_named() {
    let enc = ScopeMemEncoder::load(&encoder_dir()).unwrap();
    let (hidden, max) = (enc.config().hidden_size, enc.config().max_positions);

    let mut x = valid_inputs(hidden);
    x.summary = vec![0.0; hidden + 3];
    let msg = forward_err(&enc, &x);
    assert!(
        msg.contains("`summary`") && msg.contains("multiple of hidden_size"),
        "{msg}"
    );

    let mut x = valid_inputs(hidden);
    x.recent_actions = vec![0.0; (max + 1) * hidden];
    let msg = forward_err(&enc, &x);
    assert!(
        msg.contains("`recent_actions`") && msg.contains("max_positions"),
        "{msg}"
    );
    x.recent_actions.truncate(max * hidden); // exactly max_positions is fine
    enc.forward(&x).unwrap();

    let mut x = valid_inputs(hidden);
    x.task[hidden + 1] = f32::INFINITY;
    let msg = forward_err(&enc, &x);
    assert!(msg.contains("`task`") && msg.contains("token 1"), "{msg}");
}

#[test]
fn all_fields_empty_uses_the_confidence_token_alone() {
    let enc = ScopeMemEncoder::load(&encoder_dir()).unwrap();
    let mut x = EncoderInputs {
        p0: [0.1; NUM_ACTION_TYPES],
        ..Default::default()
    };
    let a = enc.forward(&x).unwrap();
    x.p0 = [0.0; NUM_ACTION_TYPES];
    x.p0[7] = 1.0;
    let b = enc.forward(&x).unwrap();
    assert_eq!(a.len(), 16 * 64);
    assert!(a.iter().chain(&b).all(|v| v.is_finite()));
    assert!(max_abs_diff(&a, &b) > 1e-3, "the prefix depends on p0 and H0");
}
