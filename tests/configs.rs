//! The bundled hub configs parse into the values of ../shared/REFERENCE_NOTES.md's model table, and the
//! RoPE layouts of both transformers generations (`rope_scaling` and `rope_parameters`) are read alike.

use std::path::Path;

use recall::model::{Family, ModelConfig};

fn load(name: &str) -> ModelConfig {
    ModelConfig::from_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)).unwrap()
}

#[test]
fn qwen3_vl_8b_and_gui_owl() {
    for name in ["qwen3-vl-8b-instruct", "gui-owl-1.5-8b-instruct"] {
        let c = load(name);
        let t = &c.text;
        assert_eq!(c.family, Family::Qwen3Vl);
        assert_eq!(
            (t.hidden_size, t.intermediate_size, t.num_hidden_layers),
            (4096, 12288, 36),
            "{name}"
        );
        assert_eq!(
            (t.num_attention_heads, t.num_key_value_heads, t.head_dim),
            (32, 8, 128),
            "{name}"
        );
        assert!(t.qk_norm && !t.qkv_bias, "{name}");
        assert_eq!(
            (t.rope_theta, t.mrope_section, t.mrope_interleaved),
            (5e6, [24, 20, 20], true),
            "{name}"
        );
        assert_eq!(t.vocab_size, 151936);
        assert_eq!(c.image_token_id, Some(151655));
        assert_eq!(
            (c.vision_start_token_id, c.vision_end_token_id),
            (Some(151652), Some(151653))
        );
        assert_eq!(
            c.eos_token_ids,
            vec![151645, 151643],
            "{name}: generation_config eos"
        );
        let v = c.vision.as_ref().unwrap();
        assert_eq!(
            (v.depth, v.hidden_size, v.intermediate_size, v.num_heads),
            (27, 1152, 4304, 16)
        );
        assert_eq!(
            (v.patch_size, v.spatial_merge_size, v.temporal_patch_size),
            (16, 2, 2)
        );
        assert_eq!((v.num_position_embeddings, v.out_hidden_size), (2304, 4096));
        assert_eq!(v.deepstack_visual_indexes, vec![8, 16, 24]);
    }
}

#[test]
fn qwen3_vl_2b() {
    let c = load("qwen3-vl-2b-instruct");
    let t = &c.text;
    assert_eq!(
        (t.hidden_size, t.intermediate_size, t.num_hidden_layers),
        (2048, 6144, 28)
    );
    assert_eq!(
        (t.num_attention_heads, t.num_key_value_heads, t.head_dim),
        (16, 8, 128)
    );
    let v = c.vision.as_ref().unwrap();
    assert_eq!(
        (v.depth, v.hidden_size, v.intermediate_size, v.num_heads),
        (24, 1024, 4096, 16)
    );
    assert_eq!(v.deepstack_visual_indexes, vec![5, 11, 17]);
}

#[test]
fn qwen2_5_vl_7b() {
    let c = load("qwen2.5-vl-7b-instruct");
    let t = &c.text;
    assert_eq!(c.family, Family::Qwen25Vl);
    assert_eq!(
        (t.hidden_size, t.intermediate_size, t.num_hidden_layers),
        (3584, 18944, 28)
    );
    assert_eq!(
        (t.num_attention_heads, t.num_key_value_heads, t.head_dim),
        (28, 4, 128)
    );
    assert!(!t.qk_norm && t.qkv_bias);
    assert_eq!(
        (t.rope_theta, t.mrope_section, t.mrope_interleaved),
        (1e6, [16, 24, 24], false)
    );
    let v = c.vision.as_ref().unwrap();
    assert_eq!(
        (v.depth, v.hidden_size, v.intermediate_size, v.num_heads),
        (32, 1280, 3420, 16)
    );
    assert_eq!((v.patch_size, v.window_size, v.out_hidden_size), (14, 112, 3584));
    assert_eq!(v.fullatt_block_indexes, vec![7, 15, 23, 31]);
}

#[test]
fn rope_parameters_and_rope_scaling_agree() {
    let path = Path::new("config.json");
    let old = r#"{"model_type": "qwen3_vl", "text_config": {"vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rope_theta": 1000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": true}}}"#;
    let new = r#"{"model_type": "qwen3_vl", "text_config": {"vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [6, 5, 5],
        "mrope_interleaved": true}}}"#;
    let a = ModelConfig::from_json(old, path).unwrap();
    let b = ModelConfig::from_json(new, path).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.text.rope_theta, 1000.0);
}

#[test]
fn qwen2_5_vl_flat_and_nested_agree() {
    let path = Path::new("config.json");
    let flat = r#"{"model_type": "qwen2_5_vl", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 1e6,
        "rms_norm_eps": 1e-6, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}"#;
    let nested = r#"{"model_type": "qwen2_5_vl", "text_config": {"vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}}}"#;
    assert_eq!(
        ModelConfig::from_json(flat, path).unwrap(),
        ModelConfig::from_json(nested, path).unwrap()
    );
}

/// A synthetic checkpoint (bench weights without a file): views of its tensors generate exactly the
/// elements they cover (a row slice equals the rows of the whole tensor, a reshape the same values),
/// the CPU backend loads the same values, and uniform fills stay within their bound.
#[test]
fn synthetic_checkpoint_views_are_consistent() {
    use recall::backend::cpu::CpuBackend;
    use recall::backend::Backend;
    use recall::model::loader::{Checkpoint, Fill};
    let fill = Fill::Uniform {
        seed: 11,
        scale: 0.25,
    };
    let ckpt = Checkpoint::synthetic(
        "test",
        [
            ("w".to_string(), vec![6, 5], fill),
            ("ones".to_string(), vec![3], Fill::Ones),
        ],
    )
    .unwrap();
    let w = ckpt.get("w").unwrap();
    let all = w.to_f32();
    assert!(w.bytes().is_empty());
    assert!(all.iter().all(|v| v.abs() <= 0.25));
    assert!(all.windows(2).any(|p| p[0] != p[1]), "values vary");
    let slice = w.slice_rows(2, 3).unwrap();
    assert_eq!(slice.to_f32(), all[10..25].to_vec());
    assert_eq!(w.reshaped(&[30]).unwrap().to_f32(), all);
    let be = CpuBackend;
    let loaded = be.load_weight(&slice).unwrap();
    let x = be.upload(&[1.0, 0.0, 0.0, 0.0, 0.0], 1, 5).unwrap();
    // Row 0 of `x · Wᵀ` picks column 0 of each of the slice's rows.
    let y = be.download(&be.linear(&x, &loaded, None).unwrap()).unwrap();
    assert_eq!(y, vec![all[10], all[15], all[20]]);
    assert_eq!(ckpt.get("ones").unwrap().to_f32(), vec![1.0; 3]);
    assert!(ckpt.get("missing").is_err());
}

/// `MappedFile::populate` (how the CPU backend warms the `lm_head` while the tokenizer loads)
/// changes no byte, does nothing when told to stop at once, stops part of the way when told, and
/// covers the whole tensor when let run (where the kernel has `MADV_POPULATE_READ`, Linux 5.14+;
/// elsewhere it declines and reports 0 bytes).
#[test]
fn populating_a_mapped_tensor_changes_nothing_and_stops_when_told() {
    use recall::model::loader::Checkpoint;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let values: Vec<f32> = (0..(3 << 20) / 4).map(|i| i as f32 * 0.5).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![values.len()], &bytes).unwrap();
    std::fs::write(&path, safetensors::serialize([("w", view)], &None).unwrap()).unwrap();
    let ckpt = Checkpoint::open_file(&path).unwrap();
    let (file, range) = ckpt.get("w").unwrap().mapping();
    let len = range.len();
    assert_eq!(file.populate(range.clone(), || false), 0, "told to stop at once");
    let mut asked = 0;
    let once = file.populate(range.clone(), || {
        asked += 1;
        asked == 1
    });
    let all = file.populate(range.clone(), || true);
    if all == 0 {
        eprintln!("skipped the coverage checks: this kernel declines MADV_POPULATE_READ");
    } else {
        assert!(
            once > 0 && once < len,
            "one chunk of a 3 MiB tensor: {once} of {len}"
        );
        assert_eq!(all, len, "the whole tensor");
    }
    assert_eq!(&file.data()[range], &bytes[..], "no byte changed");
}
