//! Screenshots through both vision towers, M-RoPE positions and multimodal logits against HF
//! transformers (tools/gen_fixtures.py, `vl_reference.*`), on five chats per family: one image; two
//! images with text between; a small image that min_pixels upscales; an extreme aspect ratio; a
//! multi-turn chat with images in two user turns.
//!
//! Given HF's pixel values, the vision tower and the logits match within 1e-4; end to end from the
//! image files (our decoding and resizing), the ids, grids and positions are identical and the 16
//! greedy tokens are HF's.

mod common;

use std::path::Path;

use common::{fixture, hf_pixels, max_abs_diff, Reference};
use recall::backend::{cpu::CpuBackend, Backend};
use recall::engine::{generate, GenerateParams, Pipeline, PromptInput};
use recall::model::LogitsFor;
use recall::tokenize::chat::{parse_messages, render_chat_with_images, ChatFamily, ChatMessage};
use recall::vision::{preprocess, ImageSource};

const TOL: f32 = 1e-4;

/// The fixture's messages with image paths made absolute.
fn messages(prompt: &serde_json::Value) -> Vec<ChatMessage> {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = prompt["messages"]
        .to_string()
        .replace("\"tests/fixtures/", &format!("\"{root}/tests/fixtures/"));
    parse_messages(&text, Path::new("fixture")).unwrap()
}

fn check_family(name: &str, family: ChatFamily) {
    let dir = fixture(name);
    let p = Pipeline::load(CpuBackend, &dir, None).unwrap();
    let be = &p.backend;
    let reference = Reference::load(&dir, "vl_reference");
    let cfg = p.model.config.vision.clone().unwrap();
    for (i, prompt) in reference.prompts().iter().enumerate() {
        let case = prompt["name"].as_str().unwrap();
        let msgs = messages(prompt);

        // End to end from the image files.
        let ours = p.prepare(&msgs, true).unwrap();
        assert_eq!(
            ours.ids,
            reference.ids(&format!("v{i}.input_ids")),
            "{name}/{case}: input ids"
        );
        let pos = reference.ids(&format!("v{i}.position_ids"));
        let n = ours.ids.len();
        let as_u32 = |v: &[i64]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
        assert_eq!(
            as_u32(&ours.positions.t),
            pos[..n],
            "{name}/{case}: temporal positions"
        );
        assert_eq!(
            as_u32(&ours.positions.h),
            pos[n..2 * n],
            "{name}/{case}: height positions"
        );
        assert_eq!(
            as_u32(&ours.positions.w),
            pos[2 * n..],
            "{name}/{case}: width positions"
        );
        let want = reference.ids(&format!("v{i}.greedy"));
        let params = GenerateParams {
            max_tokens: want.len(),
            eos_token_ids: vec![],
            stop_strings: vec![],
        };
        let got = generate(be, &p.model.text, &ours, &params, None).unwrap();
        // Lossless PNG and WebP decode exactly as HF decodes them, and the resize reproduces PyTorch's
        // uint8 path, so the logits from the files match too. JPEG decoders differ in IDCT rounding
        // (a pixel or two of 255), so prompts with a JPEG are held to the greedy tokens only.
        let lossless = prompt["images"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| !p.as_str().unwrap().ends_with(".jpg"));
        if lossless {
            let mut cache = p.model.text.new_cache(be, ours.ids.len()).unwrap();
            let visual = ours.visual.as_ref();
            let out = p.model.text.forward(
                be,
                &ours.ids,
                &ours.positions,
                visual,
                &[],
                &mut cache,
                LogitsFor::All,
                false,
            );
            let (want, _) = reference.f32(&format!("v{i}.logits"));
            let err = max_abs_diff(&be.download(&out.unwrap().logits).unwrap(), &want);
            assert!(
                err <= TOL,
                "{name}/{case}: logits from the image files, max abs error {err}"
            );
        }
        assert_eq!(
            got.tokens, want,
            "{name}/{case}: greedy tokens from the image files"
        );

        // Given HF's pixel values: the vision tower and the logits.
        let rendered = render_chat_with_images(family, &msgs, true);
        let ids = p.tokenizer.encode(&rendered.text).unwrap();
        let hf = p
            .prepare_ids(&ids, &hf_pixels(&reference, &format!("v{i}"), cfg.patch_dim()))
            .unwrap();
        let grids: Vec<u32> = hf_pixels(&reference, &format!("v{i}"), cfg.patch_dim())
            .iter()
            .flat_map(|px| px.grid_thw.map(|g| g as u32))
            .collect();
        let our_grids: Vec<u32> = rendered
            .images
            .iter()
            .flat_map(|src| {
                let px = preprocess(&ImageSource::parse(src).unwrap(), &p.preprocess).unwrap();
                px.grid_thw.map(|g| g as u32)
            })
            .collect();
        assert_eq!(our_grids, grids, "{name}/{case}: image grids");
        let visual = hf.visual.as_ref().unwrap();
        let (want, _) = reference.f32(&format!("v{i}.image_embeds"));
        let err = max_abs_diff(&be.download(&visual.embeds).unwrap(), &want);
        assert!(
            err <= TOL,
            "{name}/{case}: vision tower output max abs error {err}"
        );
        for (j, d) in visual.deepstack.iter().enumerate() {
            let (want, _) = reference.f32(&format!("v{i}.deepstack.{j}"));
            let err = max_abs_diff(&be.download(d).unwrap(), &want);
            assert!(
                err <= TOL,
                "{name}/{case}: deepstack feature {j} max abs error {err}"
            );
        }
        assert_eq!(visual.deepstack.len(), cfg.deepstack_visual_indexes.len());
        let mut cache = p.model.text.new_cache(be, hf.ids.len()).unwrap();
        let out = p
            .model
            .text
            .forward(
                be,
                &hf.ids,
                &hf.positions,
                Some(visual),
                &[],
                &mut cache,
                LogitsFor::All,
                false,
            )
            .unwrap();
        let (want, _) = reference.f32(&format!("v{i}.logits"));
        let err = max_abs_diff(&be.download(&out.logits).unwrap(), &want);
        assert!(err <= TOL, "{name}/{case}: logits max abs error {err}");
    }
}

#[test]
fn qwen3_vl_images_match_hf() {
    check_family("tiny-qwen3-vl", ChatFamily::Qwen3Vl);
}

#[test]
fn qwen2_5_vl_images_match_hf() {
    check_family("tiny-qwen2.5-vl", ChatFamily::Qwen25Vl);
}

#[test]
fn text_only_prompt_ignores_vision() {
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let input: PromptInput<_> = p.prepare(&[ChatMessage::text("user", "hi")], true).unwrap();
    assert!(input.visual.is_none());
}
