//! HGKV against its oracles (tools/gen_hgkv_fixtures.py): ungated = PEFT's LoRA, gated = transformers
//! with forward hooks adding the LoRA delta at the history screenshots' tokens (both within 1e-4, from
//! a PEFT directory and from the reference trainer's format); bypass = the frozen model bit for bit
//! when no history image is present; the prefix cache never mixes gated and ungated K/V; bad adapters
//! get clear errors.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{fixture, hf_pixels, max_abs_diff, prompt_logits as logits, Reference};
use recall::backend::cpu::CpuBackend;
use recall::engine::{
    EngineConfig, GenerateParams, ImageHash, ImageRole, Outcome, Pipeline, Prompt, PromptInput,
    RequestOptions, Segment, Task,
};
use recall::model::AdapterMode;
use recall::tokenize::chat::{parse_messages, render_chat_with_images, ChatFamily};
use recall::vision::{preprocess, ImageSource};

fn pipeline(adapter: Option<&str>, mode: AdapterMode) -> Pipeline<CpuBackend> {
    let mut p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    if let Some(a) = adapter {
        p.load_adapter(&fixture(a), mode).unwrap();
    }
    p
}

/// Prompt `i` of the HGKV reference, prepared with HF's pixel values.
fn reference_input(
    p: &Pipeline<CpuBackend>,
    reference: &Reference,
    i: usize,
) -> PromptInput<recall::backend::cpu::CpuTensor> {
    let root = env!("CARGO_MANIFEST_DIR");
    let prompt = &reference.prompts()[i];
    let json = prompt["messages"]
        .to_string()
        .replace("\"tests/fixtures/", &format!("\"{root}/tests/fixtures/"));
    let messages = parse_messages(&json, Path::new("fixture")).unwrap();
    let rendered = render_chat_with_images(ChatFamily::Qwen3Vl, &messages, true);
    let ids = p.tokenizer.encode(&rendered.text).unwrap();
    let input = if rendered.images.is_empty() {
        PromptInput {
            adapter: p.adapter_mode,
            ..PromptInput::text(&ids)
        }
    } else {
        let patch_dim = p.model.config.vision.as_ref().unwrap().patch_dim();
        p.prepare_ids(&ids, &hf_pixels(reference, &format!("p{i}"), patch_dim))
            .unwrap()
    };
    assert_eq!(input.ids, reference.ids(&format!("p{i}.input_ids")));
    let history: Vec<usize> = reference
        .ids(&format!("p{i}.history_rows"))
        .iter()
        .map(|&r| r as usize)
        .collect();
    assert_eq!(input.history_rows, history, "history rows");
    input
}

#[test]
fn ungated_matches_peft_and_gated_matches_hooked_transformers() {
    let reference = Reference::load(&fixture("hgkv-ref"), "reference");
    for source in ["hgkv-peft", "hgkv-ref/adapter.safetensors"] {
        for (mode, key) in [(AdapterMode::Ungated, "ungated"), (AdapterMode::Gated, "gated")] {
            let p = pipeline(Some(source), mode);
            for i in 0..2 {
                let got = logits(&p, &reference_input(&p, &reference, i));
                let (want, _) = reference.f32(&format!("p{i}.logits_{key}"));
                let err = max_abs_diff(&got, &want);
                assert!(err <= 1e-4, "{source} {key} prompt {i}: max abs error {err}");
            }
        }
    }
}

#[test]
fn bypass_is_bitwise_the_frozen_model() {
    let base = pipeline(None, AdapterMode::Off);
    let gated = pipeline(Some("hgkv-peft"), AdapterMode::Gated);
    let root = env!("CARGO_MANIFEST_DIR");
    // No image, and only a current image: no history token, so the adapter must not run.
    let chats = [
        r#"[{"role": "user", "content": "Open the settings app."}]"#.to_string(),
        format!(
            r#"[{{"role": "user", "content": [{{"type": "image", "image": "{root}/tests/fixtures/vl-images/screen.png"}},
                {{"type": "text", "text": "Next?"}}]}}]"#
        ),
    ];
    for chat in &chats {
        let messages = parse_messages(chat, Path::new("chat")).unwrap();
        let (a, b) = (
            base.prepare(&messages, true).unwrap(),
            gated.prepare(&messages, true).unwrap(),
        );
        assert!(b.lora_rows().is_empty());
        assert!(
            logits(&base, &a) == logits(&gated, &b),
            "logits differ from the frozen model"
        );
        let ga = base.generate_input(&a, 8, &[]).unwrap();
        let gb = gated.generate_input(&b, 8, &[]).unwrap();
        assert_eq!(ga.tokens, gb.tokens);
    }
}

struct Images {
    list: Vec<(ImageHash, recall::vision::PixelValues)>,
}

impl Images {
    fn load(p: &Pipeline<CpuBackend>) -> Self {
        let list = ["screen.png", "square.webp", "icon.png"]
            .iter()
            .map(|n| {
                let src = ImageSource::parse(fixture("vl-images").join(n).to_str().unwrap()).unwrap();
                (
                    ImageHash::of_image(&src.load().unwrap()),
                    preprocess(&src, &p.preprocess).unwrap(),
                )
            })
            .collect();
        Images { list }
    }

    fn prompt(&self, p: &Pipeline<CpuBackend>) -> Prompt {
        let c = &p.model.config;
        let mut segments = vec![Segment::Text((0..20).map(|i| 50 + i).collect())];
        for (k, (hash, px)) in self.list.iter().enumerate() {
            let role = if k + 1 == self.list.len() {
                ImageRole::Current
            } else {
                ImageRole::History
            };
            segments.push(Segment::Text(vec![c.vision_start_token_id.unwrap()]));
            segments.push(Segment::Image {
                hash: *hash,
                grid: px.grid_thw,
                role,
            });
            segments.push(Segment::Text(vec![
                c.vision_end_token_id.unwrap(),
                300 + k as u32,
                301,
            ]));
        }
        Prompt { segments }
    }
}

#[test]
fn prefix_cache_never_mixes_adapter_modes() {
    let p = pipeline(Some("hgkv-peft"), AdapterMode::Gated);
    let images = Images::load(&p);
    let prompt = images.prompt(&p);
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 400,
        ..EngineConfig::default()
    };
    let run = |e: &mut recall::engine::Engine<'_, CpuBackend>, mode: AdapterMode| {
        let opts = RequestOptions {
            return_logits: true,
            adapter: mode,
            ..RequestOptions::default()
        };
        let params = GenerateParams {
            max_tokens: 3,
            eos_token_ids: vec![],
            stop_strings: vec![],
        };
        let id = e.add_request_with(&prompt, Task::Generate(params), opts).unwrap();
        let out = e.run_all().unwrap().into_iter().find(|o| o.id == id).unwrap();
        let Outcome::Generation(g) = out.outcome else {
            panic!("{:?}", out.outcome)
        };
        (g.tokens, out.decision_logits, out.reused_tokens)
    };
    let fresh = |mode| {
        let mut e = p
            .engine(EngineConfig {
                prefix_caching: false,
                ..cfg.clone()
            })
            .unwrap();
        for (h, px) in &images.list {
            e.add_image(*h, px).unwrap();
        }
        run(&mut e, mode)
    };
    let modes = [AdapterMode::Off, AdapterMode::Gated, AdapterMode::Ungated];
    let expected: Vec<_> = modes.iter().map(|&m| fresh(m)).collect();
    assert_ne!(
        expected[0].1, expected[1].1,
        "the gated adapter changes this prompt"
    );
    // Text before the first history image: 20 tokens + vision_start = 21, block-aligned 20.
    let first_history = 20;
    for (a, b) in [(0, 1), (1, 0), (1, 2), (2, 1), (0, 2), (2, 0)] {
        let mut e = p.engine(cfg.clone()).unwrap();
        for (h, px) in &images.list {
            e.add_image(*h, px).unwrap();
        }
        run(&mut e, modes[a]);
        let got = run(&mut e, modes[b]);
        assert_eq!(
            (&got.0, &got.1),
            (&expected[b].0, &expected[b].1),
            "{:?} after {:?}",
            modes[b],
            modes[a]
        );
        let limit = if modes[a] == AdapterMode::Ungated || modes[b] == AdapterMode::Ungated {
            0
        } else {
            first_history
        };
        assert!(
            got.2 <= limit,
            "{:?} after {:?} reused {} tokens",
            modes[b],
            modes[a],
            got.2
        );
        // The same mode again shares everything but the last block.
        assert!(run(&mut e, modes[b]).2 > first_history);
    }
}

/// A copy of the PEFT fixture with `edit` applied.
fn broken_peft(edit: impl FnOnce(&Path)) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("adapter");
    fs::create_dir(&dir).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        fs::copy(fixture("hgkv-peft").join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    (tmp, dir)
}

fn rewrite_tensors(path: &Path, f: impl Fn(&str, &[usize]) -> Option<(String, Vec<usize>)>) {
    let bytes = fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        if let Some((n, shape)) = f(&name, t.shape()) {
            let len = shape.iter().product::<usize>() * 4;
            let mut data = t.data().to_vec();
            data.resize(len, 0);
            owned.push((n, shape, data));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap(),
            )
        })
        .collect();
    fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("adapter_config.json");
    let mut v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    fs::write(path, v.to_string()).unwrap();
}

fn load_err(dir: &Path) -> String {
    let mut p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    match p.load_adapter(dir, AdapterMode::Gated) {
        Ok(()) => panic!("{} should not load", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_adapters_get_clear_errors() {
    let weights = |d: &Path| d.join("adapter_model.safetensors");
    // Wrong shape: a rank-4 B for a rank-8 A.
    let (_t, d) = broken_peft(|d| {
        rewrite_tensors(&weights(d), |n, s| {
            Some((
                n.to_string(),
                if n.contains("layers.2.self_attn.v_proj.lora_B") {
                    vec![s[0], 4]
                } else {
                    s.to_vec()
                },
            ))
        })
    });
    let e = load_err(&d);
    assert!(
        e.contains("layers.2.self_attn.v_proj.lora_B") && e.contains("[64, 4]"),
        "{e}"
    );
    // A target other than k_proj / v_proj, in the config or in the tensors.
    let (_t, d) = broken_peft(|d| {
        edit_config(d, |c| {
            c["target_modules"] = serde_json::json!(["k_proj", "q_proj"])
        })
    });
    assert!(load_err(&d).contains("q_proj"));
    let (_t, d) = broken_peft(|d| {
        rewrite_tensors(&weights(d), |n, s| {
            Some((
                n.replace("layers.1.self_attn.k_proj", "layers.1.self_attn.q_proj"),
                s.to_vec(),
            ))
        })
    });
    let e = load_err(&d);
    assert!(
        e.contains("q_proj") && e.contains("only k_proj and v_proj"),
        "{e}"
    );
    // Layers out of range, in the config or in the tensors.
    let (_t, d) =
        broken_peft(|d| edit_config(d, |c| c["layers_to_transform"] = serde_json::json!([1, 2, 9])));
    assert!(load_err(&d).contains("layer 9"));
    let (_t, d) = broken_peft(|d| {
        edit_config(d, |c| c["layers_to_transform"] = serde_json::Value::Null);
        rewrite_tensors(&weights(d), |n, s| {
            Some((n.replace("layers.2.", "layers.7."), s.to_vec()))
        })
    });
    let e = load_err(&d);
    assert!(e.contains("layer 7") && e.contains("out of range"), "{e}");
    // A missing B.
    let (_t, d) = broken_peft(|d| {
        rewrite_tensors(&weights(d), |n, s| {
            (!n.contains("layers.1.self_attn.v_proj.lora_B")).then(|| (n.to_string(), s.to_vec()))
        })
    });
    let e = load_err(&d);
    assert!(e.contains("layers.1.self_attn.v_proj") && e.contains("B"), "{e}");
    // Missing config fields and files.
    let (_t, d) = broken_peft(|d| edit_config(d, |c| c["r"] = serde_json::Value::Null));
    assert!(load_err(&d).contains("`r`"));
    let (_t, d) = broken_peft(|d| fs::remove_file(weights(d)).unwrap());
    assert!(load_err(&d).contains("adapter_model.safetensors"));
    // The reference format without its alpha.
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("adapter.safetensors");
    fs::copy(fixture("hgkv-ref/adapter.safetensors"), &file).unwrap();
    rewrite_tensors(&file, |n, s| Some((n.to_string(), s.to_vec())));
    let e = load_err(&file);
    assert!(e.contains("lora_alpha"), "{e}");
    // A mode without an adapter.
    let p = pipeline(None, AdapterMode::Off);
    let mut e = p.engine(EngineConfig::default()).unwrap();
    let prompt = Prompt {
        segments: vec![Segment::Text(vec![1, 2, 3])],
    };
    let opts = RequestOptions {
        adapter: AdapterMode::Gated,
        ..RequestOptions::default()
    };
    let params = GenerateParams {
        max_tokens: 1,
        eos_token_ids: vec![],
        stop_strings: vec![],
    };
    let err = e
        .add_request_with(&prompt, Task::Generate(params), opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no adapter is loaded"), "{err}");
}
