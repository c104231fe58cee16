//! Bad checkpoints, configs and requests produce errors that name the tensor, file or field — never a
//! panic. Each case copies a good fixture into a temporary directory and breaks one thing.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::fixture;
use recall::backend::cpu::CpuBackend;
use recall::engine::{generate, score, GenerateParams, PromptInput};
use recall::model::{Checkpoint, ModelConfig, QwenVl};
use recall::Error;

/// A copy of a fixture model directory.
fn copy_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    fs::create_dir(&dir).unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    (tmp, dir)
}

fn load_err(dir: &Path) -> Error {
    match QwenVl::load(&CpuBackend, dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

/// Rewrites `dir/model.safetensors` without the tensor `drop`.
fn drop_tensor(dir: &Path, drop: &str) {
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| n != drop).collect();
    assert!(kept.len() + 1 == st.len(), "{drop} was in the file");
    fs::write(&path, safetensors::serialize(kept, &None).unwrap()).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn missing_tensor_names_tensor_and_checkpoint() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    let name = "model.language_model.layers.1.mlp.up_proj.weight";
    drop_tensor(&dir, name);
    let e = load_err(&dir);
    assert!(matches!(e, Error::MissingTensor { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(name) && msg.contains(&dir.display().to_string()),
        "{msg}"
    );
}

#[test]
fn missing_shard_tensor_names_the_shard() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl-sharded");
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["model.language_model.extra.weight"] = "model-00001-of-00005.safetensors".into();
    fs::write(&index_path, index.to_string()).unwrap();
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("model.language_model.extra.weight") && msg.contains("model-00001-of-00005"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_names_tensor_and_shapes() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    edit_config(&dir, |c| c["text_config"]["intermediate_size"] = 96.into());
    let e = load_err(&dir);
    let msg = e.to_string();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    assert!(
        msg.contains("mlp.gate_proj.weight") && msg.contains("[128, 64]") && msg.contains("[96, 64]"),
        "{msg}"
    );
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn unknown_model_type_is_named() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    edit_config(&dir, |c| c["model_type"] = "llama".into());
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("unsupported model_type `llama`") && msg.contains("config.json"),
        "{msg}"
    );
}

#[test]
fn truncated_safetensors_names_file() {
    let (_t, dir) = copy_fixture("tiny-qwen2.5-vl");
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    for keep in [4, 100, bytes.len() / 2, bytes.len() - 1] {
        fs::write(&path, &bytes[..keep]).unwrap();
        let e = load_err(&dir);
        assert!(matches!(e, Error::Safetensors { .. }), "{keep} bytes: {e:?}");
        assert!(e.to_string().contains("model.safetensors"), "{e}");
    }
}

#[test]
fn malformed_json_names_file_and_field() {
    let (_t, dir) = copy_fixture("tiny-qwen2.5-vl");
    fs::write(dir.join("config.json"), "{\"model_type\": \"qwen2_5_vl\", ").unwrap();
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("config.json") && msg.contains("invalid JSON"),
        "{msg}"
    );

    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    edit_config(&dir, |c| c["text_config"]["hidden_size"] = "sixty-four".into());
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("text_config.hidden_size"), "{msg}");

    edit_config(&dir, |c| {
        c["text_config"]["hidden_size"] = 64.into();
        c["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("num_hidden_layers");
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("num_hidden_layers") && msg.contains("missing"),
        "{msg}"
    );

    let (_t, dir) = copy_fixture("tiny-qwen3-vl-sharded");
    fs::write(dir.join("model.safetensors.index.json"), "{\"metadata\": {}}").unwrap();
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("weight_map") && msg.contains("index.json"), "{msg}");

    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    fs::write(dir.join("generation_config.json"), "{\"eos_token_id\": \"x\"}").unwrap();
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("generation_config.json") && msg.contains("eos_token_id"),
        "{msg}"
    );
}

#[test]
fn inconsistent_config_values_are_rejected() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    edit_config(&dir, |c| c["text_config"]["num_key_value_heads"] = 3.into());
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("num_key_value_heads"), "{msg}");
    edit_config(&dir, |c| {
        c["text_config"]["num_key_value_heads"] = 2.into();
        c["text_config"]["rope_parameters"]["mrope_section"] = serde_json::json!([6, 5, 4]);
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("mrope_section"), "{msg}");
}

#[test]
fn missing_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let msg = ModelConfig::from_dir(tmp.path()).unwrap_err().to_string();
    assert!(msg.contains("config.json"), "{msg}");
    let msg = Checkpoint::open(tmp.path()).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn unsupported_dtype_is_named() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let data = vec![0u8; 64 * 8];
    tensors.push((
        "model.language_model.norm.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![64], &data).unwrap(),
    ));
    tensors.retain(|(n, t)| n != "model.language_model.norm.weight" || t.dtype() == safetensors::Dtype::F64);
    fs::write(&path, safetensors::serialize(tensors, &None).unwrap()).unwrap();
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("model.language_model.norm.weight") && msg.contains("F64"),
        "{msg}"
    );
}

#[test]
fn bad_requests_are_errors() {
    let be = CpuBackend;
    let model = QwenVl::load(&be, &fixture("tiny-qwen3-vl")).unwrap();
    let vocab = model.config.text.vocab_size as u32;
    let params = GenerateParams {
        max_tokens: 4,
        eos_token_ids: vec![],
        stop_strings: vec![],
    };
    let e = generate(
        &be,
        &model.text,
        &PromptInput::text(&[1, vocab + 5]),
        &params,
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains(&format!("token id {}", vocab + 5)), "{e}");
    assert!(generate(&be, &model.text, &PromptInput::text(&[]), &params, None).is_err());
    let stop = GenerateParams {
        stop_strings: vec!["x".into()],
        ..params.clone()
    };
    assert!(generate(&be, &model.text, &PromptInput::text(&[1]), &stop, None)
        .unwrap_err()
        .to_string()
        .contains("tokenizer"));
    assert!(score(&be, &model.text, &PromptInput::text(&[1]), &[]).is_err());

    // Over the context limit: the error says by how much.
    let limit = model.config.text.max_position_embeddings;
    let long = GenerateParams {
        max_tokens: limit,
        ..params
    };
    let e = generate(&be, &model.text, &PromptInput::text(&[1, 2, 3]), &long, None).unwrap_err();
    assert!(
        matches!(e, Error::PromptTooLong { tokens, .. } if tokens == limit + 3),
        "{e:?}"
    );
    assert!(e.to_string().contains("by 3"), "{e}");
}

#[test]
fn image_placeholder_without_image_is_an_error() {
    use recall::engine::Pipeline;
    use recall::tokenize::chat::ChatMessage;
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let m = ChatMessage::new(
        "user",
        vec![
            recall::tokenize::chat::ContentPart::Image(fixture("vl-images/icon.png").display().to_string()),
            recall::tokenize::chat::ContentPart::Text("and a stray <|image_pad|>".into()),
        ],
    );
    let e = p
        .prepare(&[m], true)
        .err()
        .expect("mismatched placeholders must fail");
    assert!(e.to_string().contains("2 image placeholders for 1 images"), "{e}");
}

#[test]
fn bad_vision_config_names_the_field() {
    let (_t, dir) = copy_fixture("tiny-qwen3-vl");
    edit_config(&dir, |c| {
        c["vision_config"]["deepstack_visual_indexes"] = serde_json::json!([0, 7])
    });
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("vision_config.deepstack_visual_indexes") && msg.contains("depth"),
        "{msg}"
    );
    edit_config(&dir, |c| {
        c["vision_config"]["deepstack_visual_indexes"] = serde_json::json!([0, 2]);
        c["vision_config"]["num_heads"] = "two".into();
    });
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("vision_config.num_heads"), "{msg}");
}

#[test]
fn missing_vision_tensor_is_named() {
    let (_t, dir) = copy_fixture("tiny-qwen2.5-vl");
    drop_tensor(&dir, "visual.blocks.1.attn.qkv.weight");
    let msg = load_err(&dir).to_string();
    assert!(msg.contains("visual.blocks.1.attn.qkv.weight"), "{msg}");
}
