//! Every input kept for the fuzz targets of fuzz/ — the seed corpus (fuzz/corpus/<target>/) and the
//! inputs that once crashed a target (fuzz/regressions/<target>/) — run through the same parser calls
//! as the target, under `cargo test`, without libFuzzer. A regression input must be refused with an
//! error (or accepted) and never panic again; the seeds, made from the test fixtures, must parse.
//! docs/RELIABILITY.md "Fuzzing" says how to run the fuzzers themselves.

use std::path::{Path, PathBuf};

use recall::agent::action::{parse_response, Platform};
use recall::model::scopemem::ScopeMemConfig;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// (file name, bytes) of every input kept for `target` in `dir` (corpus or regressions).
fn inputs(dir: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(root().join("fuzz").join(dir).join(target)) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Writes `data` as `name` in a fresh directory (the targets that read files).
fn in_file(name: &str, data: &[u8]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, data).unwrap();
    (dir, path)
}

/// What the fuzz target `target` does with `data`; `Ok` when the parser accepted it.
fn run(target: &str, data: &[u8]) -> Result<(), String> {
    let text = || std::str::from_utf8(data).map_err(|e| e.to_string());
    let err = |e: recall::Error| e.to_string();
    match target {
        "safetensors" => {
            let (_dir, path) = in_file("model.safetensors", data);
            let ckpt = recall::model::Checkpoint::open_file(&path).map_err(err)?;
            for name in ckpt.names() {
                let t = ckpt.get(name).map_err(err)?;
                if t.numel() <= 1 << 16 {
                    t.to_f32();
                }
            }
            Ok(())
        }
        "shard_index" => {
            let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
            let mut shard = (header.len() as u64).to_le_bytes().to_vec();
            shard.extend_from_slice(header);
            shard.extend_from_slice(&[0u8; 8]);
            let (dir, _) = in_file("model.safetensors.index.json", data);
            std::fs::write(dir.path().join("model-00001-of-00001.safetensors"), shard).unwrap();
            recall::model::Checkpoint::open(dir.path()).map(drop).map_err(err)
        }
        "model_config" => recall::model::ModelConfig::from_json(text()?, Path::new("config.json"))
            .map(drop)
            .map_err(err),
        "preprocess_config" => {
            recall::vision::PreprocessConfig::from_json_str(text()?, "preprocessor_config.json")
                .map(drop)
                .map_err(err)
        }
        "tokenizer_file" => {
            let (_dir, path) = in_file("tokenizer.json", data);
            let tok = recall::tokenize::Tokenizer::from_file(&path).map_err(err)?;
            let ids = tok.encode("Click the <tool_call> button. 你好").map_err(err)?;
            tok.decode(&ids).map(drop).map_err(err)
        }
        "tokenize" => {
            let dir = root().join("models/qwen-vl-tokenizer");
            let tok = recall::tokenize::Tokenizer::from_model_dir(&dir).unwrap();
            let round = |s: &str| tok.decode(&tok.encode(s).unwrap()).unwrap();
            let t = round(text()?);
            assert_eq!(round(&t), t, "not a fixed point");
            Ok(())
        }
        "chat_messages" => recall::tokenize::chat::parse_messages(text()?, Path::new("messages.json"))
            .map(drop)
            .map_err(err),
        "image" => recall::vision::decode_image_bytes(data, "fuzz")
            .map(drop)
            .map_err(err),
        "episode" => recall::memory::episode::Episode::from_json(
            text()?,
            &root().join("tests/fixtures/episode-sample"),
        )
        .map(drop)
        .map_err(err),
        "step_dataset" => {
            recall::agent::dataset::StepDataset::parse(text()?, Path::new("steps.jsonl"), Path::new("."))
                .map(drop)
                .map_err(err)
        }
        "labels" => {
            let (_dir, path) = in_file("labels.jsonl", data);
            recall::agent::labels::read_labels(&[path], false)
                .map(drop)
                .map_err(err)
        }
        "encoder_config" => {
            let doc: serde_json::Value = serde_json::from_str(text()?).map_err(|e| e.to_string())?;
            ScopeMemConfig::from_json(Path::new("scopemem_config.json"), &doc)
                .map(drop)
                .map_err(err)
        }
        "action" => {
            let t = text()?;
            let mobile = parse_response(t, Platform::Mobile)
                .map(drop)
                .map_err(|e| e.to_string());
            let desktop = parse_response(t, Platform::Desktop)
                .map(drop)
                .map_err(|e| e.to_string());
            mobile.or(desktop)
        }
        "chat_request" => {
            use recall::server::openai::{parse_chat_request, SamplingDefaults};
            let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(text()?) else {
                return Err("not a JSON object".into());
            };
            let defaults = SamplingDefaults::from_model_dir(Path::new("/nonexistent"));
            parse_chat_request(&obj, &defaults, "recall")
                .map(drop)
                .map_err(|e| format!("{e:?}"))
        }
        "policy_request" => {
            let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(text()?) else {
                return Err("not a JSON object".into());
            };
            recall::server::policy::parse_policy_request(&obj)
                .map(drop)
                .map_err(|e| format!("{e:?}"))
        }
        "adapter" => {
            let Some((&pick, rest)) = data.split_first() else {
                return Err("empty".into());
            };
            let cfg =
                recall::model::ModelConfig::from_dir(&root().join("tests/fixtures/tiny-qwen3-vl")).unwrap();
            let peft = root().join("tests/fixtures/hgkv-peft");
            let (config, weights) = if pick % 2 == 0 {
                (
                    rest.to_vec(),
                    std::fs::read(peft.join("adapter_model.safetensors")).unwrap(),
                )
            } else {
                (
                    std::fs::read(peft.join("adapter_config.json")).unwrap(),
                    rest.to_vec(),
                )
            };
            let (dir, _) = in_file("adapter_config.json", &config);
            std::fs::write(dir.path().join("adapter_model.safetensors"), weights).unwrap();
            let be = recall::backend::cpu::CpuBackend;
            recall::model::hgkv::Adapter::load(&be, dir.path(), &cfg.text)
                .map(drop)
                .map_err(err)
        }
        "selector_file" => {
            let (_dir, path) = in_file("selector.safetensors", data);
            recall::memory::selector::MarginalScorer::load(&path)
                .map(drop)
                .map_err(err)
        }
        other => panic!("fuzz/corpus/{other}: no such fuzz target in this test"),
    }
}

/// The fuzz targets (fuzz/Cargo.toml's bins).
fn targets() -> Vec<String> {
    let manifest = std::fs::read_to_string(root().join("fuzz/Cargo.toml")).unwrap();
    let names: Vec<String> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .map(|n| n.trim_end_matches('"').to_string())
        .filter(|n| n != "recall-fuzz")
        .collect();
    assert!(names.len() >= 16, "{names:?}");
    names
}

#[test]
fn every_target_has_seeds_and_every_valid_seed_parses() {
    // Seeds made to be refused (near misses) say so in their name.
    let refused = ["truncated", "traversal", "missing_shards"];
    for target in targets() {
        let seeds = inputs("corpus", &target);
        assert!(!seeds.is_empty(), "fuzz/corpus/{target} is empty");
        for (name, data) in seeds {
            let result = std::panic::catch_unwind(|| run(&target, &data))
                .unwrap_or_else(|_| panic!("fuzz/corpus/{target}/{name} panicked"));
            if refused.contains(&name.as_str()) {
                assert!(result.is_err(), "fuzz/corpus/{target}/{name} should be refused");
            } else if let Err(e) = result {
                panic!("fuzz/corpus/{target}/{name} is refused: {e}");
            }
        }
    }
}

#[test]
fn inputs_that_once_crashed_a_target_no_longer_panic() {
    let mut n = 0;
    for target in targets() {
        for (name, data) in inputs("regressions", &target) {
            let outcome = std::panic::catch_unwind(|| run(&target, &data));
            assert!(outcome.is_ok(), "fuzz/regressions/{target}/{name} panics again");
            n += 1;
        }
    }
    eprintln!("{n} regression inputs");
}
