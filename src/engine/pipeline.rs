//! A model with its tokenizer: chat messages in, tokens, logits, generations and scores out. This is
//! what the CLI (and later the server) calls.

use std::path::Path;

use crate::backend::Backend;
use crate::engine::generate::{generate_timed, GenerationStats};
use crate::engine::prompt::{ImageHash, ImageRole, Prompt, Segment};
use crate::engine::sampling::Penalties;
use crate::engine::{generate, score, Engine, EngineConfig, GenerateParams, Generation, PromptInput, Score};
use crate::error::{Error, Result};
use crate::model::{rope_index, AdapterMode, Family, GridThw, LogitsFor, QwenVl, Span, VisualFeatures};
use crate::tokenize::chat::{render_chat_with_tools, ChatFamily, ChatMessage, RenderedChat};
use crate::tokenize::Tokenizer;
use crate::vision::{preprocess, preprocess_image, ImageSource, PixelValues, PreprocessConfig};
use image::RgbImage;

/// A loaded model, its tokenizer and its image preprocessing on one backend.
pub struct Pipeline<B: Backend> {
    pub backend: B,
    pub model: QwenVl<B>,
    pub tokenizer: Tokenizer,
    /// How screenshots become patches (`preprocessor_config.json`, else the family's defaults).
    pub preprocess: PreprocessConfig,
    /// Where the loaded adapter (if any) acts on prepared prompts.
    pub adapter_mode: AdapterMode,
}

/// Full-sequence logits of a prompt.
pub struct PromptLogits {
    /// The prompt's token ids (image placeholders expanded).
    pub input_ids: Vec<u32>,
    /// `[input_ids.len() · vocab]`, row-major.
    pub logits: Vec<f32>,
    pub vocab: usize,
}

impl<B: Backend> Pipeline<B> {
    /// Loads the model in `model_dir` and the tokenizer at `tokenizer` (default:
    /// `model_dir/tokenizer.json`).
    ///
    /// ```no_run
    /// use recall::{backend::cpu::CpuBackend, engine::Pipeline};
    /// let p = Pipeline::load(CpuBackend, std::path::Path::new("tests/fixtures/tiny-qwen3-vl"), None)?;
    /// let out = p.generate_text("Hello", 8)?;
    /// println!("{}", out.text.unwrap_or_default());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn load(backend: B, model_dir: &Path, tokenizer: Option<&Path>) -> Result<Self> {
        let tok_path = tokenizer.map_or_else(|| model_dir.join("tokenizer.json"), Path::to_path_buf);
        // The tokenizer (a BPE vocabulary of ~150k entries to parse) loads on its own thread while
        // the weights are mapped and packed on this one. Once they are, this thread maps the
        // lm_head's pages until the tokenizer is done: it would wait anyway, and the first token
        // reads the whole head.
        let (tokenizer, model) = std::thread::scope(|s| {
            let tokenizer = s.spawn(|| Tokenizer::from_file(&tok_path));
            let model = QwenVl::load(&backend, model_dir);
            if let Ok(model) = &model {
                model.text.warm_head(&backend, &|| !tokenizer.is_finished());
            }
            let tokenizer = tokenizer.join().expect("the tokenizer thread does not panic");
            (tokenizer, model)
        });
        let (tokenizer, model) = (tokenizer?, model?);
        let pre_path = model_dir.join("preprocessor_config.json");
        let preprocess = if pre_path.exists() {
            PreprocessConfig::from_file(&pre_path)?
        } else {
            match model.config.family {
                Family::Qwen3Vl => PreprocessConfig::qwen3_vl(),
                Family::Qwen25Vl => PreprocessConfig::qwen2_5_vl(),
            }
        };
        if let Some(v) = &model.config.vision {
            let ours = (
                preprocess.patch_size,
                preprocess.merge_size,
                preprocess.temporal_patch_size,
            );
            let theirs = (v.patch_size, v.spatial_merge_size, v.temporal_patch_size);
            if ours != theirs {
                return Err(Error::json(
                    pre_path,
                    "patch_size",
                    format!("(patch, merge, temporal) {ours:?} disagree with the vision tower's {theirs:?}"),
                ));
            }
        }
        Ok(Pipeline {
            backend,
            model,
            tokenizer,
            preprocess,
            adapter_mode: AdapterMode::Off,
        })
    }

    /// Loads a K/V LoRA adapter and sets where it acts.
    pub fn load_adapter(&mut self, path: &Path, mode: AdapterMode) -> Result<()> {
        self.model.load_adapter(&self.backend, path)?;
        self.adapter_mode = mode;
        Ok(())
    }

    fn chat_family(&self) -> ChatFamily {
        match self.model.config.family {
            Family::Qwen3Vl => ChatFamily::Qwen3Vl,
            Family::Qwen25Vl => ChatFamily::Qwen25Vl,
        }
    }

    /// Renders `messages` with the family's chat template, tokenizes them, preprocesses and encodes
    /// their images, and computes M-RoPE positions: everything the decoder needs.
    pub fn prepare(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<PromptInput<B::Tensor>> {
        self.prepare_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`prepare`](Self::prepare) with function tools in the template (OpenAI's form, as the
    /// server normalises them).
    pub fn prepare_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<PromptInput<B::Tensor>> {
        let rendered = render_chat_with_tools(self.chat_family(), messages, tools, add_generation_prompt);
        let ids = self.tokenizer.encode(&rendered.text)?;
        if rendered.images.is_empty() {
            return Ok(PromptInput {
                adapter: self.adapter_mode,
                ..PromptInput::text(&ids)
            });
        }
        let images = rendered
            .images
            .iter()
            .map(|src| preprocess(&ImageSource::parse(src)?, &self.preprocess))
            .collect::<Result<Vec<_>>>()?;
        self.prepare_ids(&ids, &images)
    }

    /// Expands each image-pad token of `ids` into its image's merged tokens and encodes the images.
    pub fn prepare_ids(&self, ids: &[u32], images: &[PixelValues]) -> Result<PromptInput<B::Tensor>> {
        let (vision, cfg) = match (&self.model.vision, &self.model.config) {
            (Some(v), cfg) if cfg.image_token_id.is_some() => (v, cfg),
            _ => return Err(Error::InvalidRequest("this model has no vision tower".into())),
        };
        let pad = cfg.image_token_id.unwrap_or_default();
        let merge = self.preprocess.merge_size;
        let pads = ids.iter().filter(|&&t| t == pad).count();
        if pads != images.len() {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {pads} image placeholders for {} images",
                images.len()
            )));
        }
        let (mut expanded, mut rows, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        let mut history_rows = Vec::new();
        let mut next_image = images.iter();
        let mut text_run = 0;
        for &id in ids {
            if id != pad {
                expanded.push(id);
                text_run += 1;
                continue;
            }
            let [t, h, w] = next_image.next().map(|p| p.grid_thw).unwrap_or_default();
            spans.push(Span::Text(std::mem::take(&mut text_run)));
            spans.push(Span::Image {
                t,
                h: h / merge,
                w: w / merge,
            });
            let n = t * (h / merge) * (w / merge);
            // Every image but the last (the current screenshot) is history.
            if rows.len() + n < images.iter().map(|p| p.num_merged_tokens(merge)).sum() {
                history_rows.extend(expanded.len()..expanded.len() + n);
            }
            rows.extend(expanded.len()..expanded.len() + n);
            expanded.extend(std::iter::repeat_n(pad, n));
        }
        spans.push(Span::Text(text_run));
        let (positions, next_position) = rope_index(&spans, 0);

        let patch_dim = images[0].patch_dim;
        let data: Vec<f32> = images.iter().flat_map(|p| p.data.iter().copied()).collect();
        let grids: Vec<GridThw> = images.iter().map(|p| p.grid_thw).collect();
        let pixels = self.backend.upload(&data, data.len() / patch_dim, patch_dim)?;
        let clock = std::time::Instant::now();
        let out = vision.forward(&self.backend, &pixels, &grids)?;
        self.backend.synchronize()?;
        let vision_seconds = clock.elapsed().as_secs_f64();
        Ok(PromptInput {
            ids: expanded,
            positions,
            visual: Some(VisualFeatures {
                rows,
                embeds: out.embeds,
                deepstack: out.deepstack,
            }),
            next_position,
            history_rows,
            adapter: self.adapter_mode,
            vision_seconds,
        })
    }

    /// An engine over this pipeline's model (see [`Engine`]).
    pub fn engine(&self, cfg: EngineConfig) -> Result<Engine<'_, B>> {
        Engine::new(&self.backend, &self.model, Some(&self.tokenizer), cfg)
    }

    /// The model's input embeddings of `ids`, `[ids.len() · hidden]` row-major (empty for no ids).
    pub fn embed_tokens(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.backend.download(&self.model.text.embed(&self.backend, ids)?)
    }

    /// Renders `messages` into an engine [`Prompt`]: text runs and images by content hash. Images the
    /// engine has not seen are preprocessed and encoded once (later prompts showing the same pixels
    /// reuse the cached embeddings). The last image is the `Current` screenshot, earlier ones `History`.
    pub fn chat_prompt(
        &self,
        engine: &mut Engine<'_, B>,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Prompt> {
        let renderer = self.renderer();
        let (ids, sources) = renderer.ids(&self.tokenizer, messages, add_generation_prompt)?;
        let images = sources
            .iter()
            .map(|src| self.encode_image(engine, src))
            .collect::<Result<Vec<_>>>()?;
        renderer.prompt(ids, &images)
    }

    /// How this model's chats become token ids and prompts.
    pub fn renderer(&self) -> ChatRenderer {
        ChatRenderer {
            family: self.chat_family(),
            image_pad: self.model.config.image_token_id,
        }
    }

    /// The content hash and grid of the image at `src`, encoding it into the engine's vision cache when
    /// needed. A file whose path, size and modification time the engine has seen is not decoded again.
    fn encode_image(&self, engine: &mut Engine<'_, B>, src: &str) -> Result<(ImageHash, GridThw)> {
        let source = ImageSource::parse(src)?;
        let key = source_key(src);
        if let Some(hash) = key.and_then(|k| engine.source_hash(k)) {
            if let Some(grid) = engine.image_grid(hash) {
                return Ok((hash, grid));
            }
        }
        let img = source.load()?;
        let hash = ImageHash::of_image(&img);
        if let Some(k) = key {
            engine.remember_source(k, hash);
        }
        let grid = self
            .encode_decoded(engine, hash, &img)
            .map_err(|e| Error::InvalidRequest(format!("{source}: {e}")))?;
        Ok((hash, grid))
    }

    /// The grid of a decoded image with content hash `hash`, preprocessing it and running the vision
    /// tower only when the engine's vision cache does not hold it.
    pub fn encode_decoded(
        &self,
        engine: &mut Engine<'_, B>,
        hash: ImageHash,
        img: &RgbImage,
    ) -> Result<GridThw> {
        self.encode_decoded_with(engine, hash, img, &self.preprocess)
    }

    /// [`encode_decoded`](Self::encode_decoded) under another preprocessing (a request's own pixel
    /// budget); `hash` must say which ([`ImageHash::with_pixels`]).
    pub fn encode_decoded_with(
        &self,
        engine: &mut Engine<'_, B>,
        hash: ImageHash,
        img: &RgbImage,
        cfg: &PreprocessConfig,
    ) -> Result<GridThw> {
        if let Some(grid) = engine.image_grid(hash) {
            return Ok(grid);
        }
        let pixels = preprocess_image(img, cfg)?;
        engine.add_image(hash, &pixels)?;
        Ok(pixels.grid_thw)
    }

    /// The model's end-of-sequence ids, falling back to the tokenizer's `<|im_end|>`.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let ids = &self.model.config.eos_token_ids;
        if ids.is_empty() {
            self.tokenizer.token_id("<|im_end|>").into_iter().collect()
        } else {
            ids.clone()
        }
    }

    /// Greedy generation after a prepared prompt.
    pub fn generate_input(
        &self,
        prompt: &PromptInput<B::Tensor>,
        max_tokens: usize,
        stop_strings: &[String],
    ) -> Result<Generation> {
        let params = GenerateParams {
            max_tokens,
            eos_token_ids: self.eos_token_ids(),
            stop_strings: stop_strings.to_vec(),
        };
        generate(
            &self.backend,
            &self.model.text,
            prompt,
            &params,
            Some(&self.tokenizer),
        )
    }

    /// Greedy answer to a conversation (rendered with the chat template and a generation prompt).
    pub fn generate_chat(
        &self,
        messages: &[ChatMessage],
        max_tokens: usize,
        stop_strings: &[String],
    ) -> Result<(PromptInput<B::Tensor>, Generation)> {
        let prompt = self.prepare(messages, true)?;
        let out = self.generate_input(&prompt, max_tokens, stop_strings)?;
        Ok((prompt, out))
    }

    /// [`generate_chat`](Self::generate_chat), timed: the vision tower (in the prompt), the prefill
    /// and the decode steps, and with `profile` each phase op by op.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_chat_timed(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        max_tokens: usize,
        stop_strings: &[String],
        penalties: &Penalties,
        profile: bool,
    ) -> Result<(PromptInput<B::Tensor>, Generation, GenerationStats)> {
        self.backend.set_profiling(profile);
        let prompt = self.prepare_with_tools(messages, tools, true);
        let vision_ops = self.backend.take_profile()?;
        let prompt = prompt?;
        let params = GenerateParams {
            max_tokens,
            eos_token_ids: self.eos_token_ids(),
            stop_strings: stop_strings.to_vec(),
        };
        let (out, mut stats) = generate_timed(
            &self.backend,
            &self.model.text,
            &prompt,
            &params,
            Some(&self.tokenizer),
            penalties,
            profile,
        )?;
        stats.vision_ops = vision_ops;
        Ok((prompt, out, stats))
    }

    /// Greedy answer to one user message.
    pub fn generate_text(&self, prompt: &str, max_tokens: usize) -> Result<Generation> {
        Ok(self
            .generate_chat(&[ChatMessage::text("user", prompt)], max_tokens, &[])?
            .1)
    }

    /// Logits at every position of the rendered chat (with the generation prompt).
    pub fn prompt_logits(&self, messages: &[ChatMessage]) -> Result<PromptLogits> {
        let prompt = self.prepare(messages, true)?;
        let be = &self.backend;
        let text = &self.model.text;
        if prompt.ids.is_empty() {
            return Err(Error::InvalidRequest("the rendered prompt is empty".into()));
        }
        let limit = text.config().max_position_embeddings;
        if prompt.ids.len() > limit {
            return Err(Error::PromptTooLong {
                tokens: prompt.ids.len(),
                limit,
            });
        }
        let mut cache = text.new_cache(be, prompt.ids.len())?;
        let visual = prompt.visual.as_ref();
        let out = text.forward(
            be,
            &prompt.ids,
            &prompt.positions,
            visual,
            &prompt.lora_rows(),
            &mut cache,
            LogitsFor::All,
            false,
        )?;
        Ok(PromptLogits {
            logits: be.download(&out.logits)?,
            vocab: be.dims(&out.logits).1,
            input_ids: prompt.ids,
        })
    }

    /// Teacher-forced log-probability of `target` as the assistant's reply to `messages`.
    pub fn score_reply(&self, messages: &[ChatMessage], target: &str) -> Result<Score> {
        let prompt = self.prepare(messages, true)?;
        let target = self.tokenizer.encode(target)?;
        score(&self.backend, &self.model.text, &prompt, &target)
    }
}

/// How a model's chats become token ids and engine prompts; needs no model weights (a server renders
/// and tokenizes in its request handlers, off the engine's thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatRenderer {
    pub family: ChatFamily,
    /// The id of `<|image_pad|>` (`None` for a model without vision).
    pub image_pad: Option<u32>,
}

impl ChatRenderer {
    /// The token ids of `messages` rendered with the family's chat template (one image-pad id per
    /// image), and the image sources in order.
    pub fn ids(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, Vec<String>)> {
        let (ids, rendered) = self.render_ids(tokenizer, messages, &[], add_generation_prompt)?;
        Ok((ids, rendered.images))
    }

    /// [`ids`](Self::ids) with the request's tools in the template, and the whole rendering (which
    /// message part each image came from).
    pub fn render_ids(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, RenderedChat)> {
        let rendered = render_chat_with_tools(self.family, messages, tools, add_generation_prompt);
        let ids = tokenizer.encode(&rendered.text)?;
        let pad = self.image_pad.unwrap_or(u32::MAX);
        let pads = ids.iter().filter(|&&t| t == pad).count();
        if pads != rendered.images.len() {
            return Err(Error::InvalidRequest(if self.image_pad.is_none() {
                "this model has no vision tower; the chat has images".to_string()
            } else {
                format!(
                    "the prompt has {pads} image placeholders for {} images",
                    rendered.images.len()
                )
            }));
        }
        Ok((ids, rendered))
    }

    /// The engine prompt of `ids` (from [`ids`](Self::ids)) with each image-pad id replaced by its
    /// image (content hash and grid, in order). The last image is the `Current` screenshot, earlier
    /// ones `History`.
    pub fn prompt(&self, ids: Vec<u32>, images: &[(ImageHash, GridThw)]) -> Result<Prompt> {
        let pad = self.image_pad.unwrap_or(u32::MAX);
        let mut segments = Vec::new();
        let mut text = Vec::new();
        let mut next = images.iter().enumerate();
        for id in ids {
            if id != pad {
                text.push(id);
                continue;
            }
            let Some((i, &(hash, grid))) = next.next() else {
                return Err(Error::InvalidRequest(
                    "more image placeholders than images".into(),
                ));
            };
            segments.push(Segment::Text(std::mem::take(&mut text)));
            let role = if i + 1 == images.len() {
                ImageRole::Current
            } else {
                ImageRole::History
            };
            segments.push(Segment::Image { hash, grid, role });
        }
        if next.next().is_some() {
            return Err(Error::InvalidRequest(
                "more images than image placeholders".into(),
            ));
        }
        segments.push(Segment::Text(text));
        segments.retain(|s| !matches!(s, Segment::Text(t) if t.is_empty()));
        Ok(Prompt { segments })
    }
}

/// Writes `input_ids` (I64, `[seq]`) and `logits` (F32, `[seq, vocab]`) to a safetensors file.
pub fn write_logits(path: &Path, r: &PromptLogits) -> Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    let ids: Vec<u8> = r
        .input_ids
        .iter()
        .flat_map(|&i| (i as i64).to_le_bytes())
        .collect();
    let logits: Vec<u8> = r.logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let seq = r.input_ids.len();
    let bad = |e: safetensors::SafeTensorError| Error::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let tensors = [
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![seq], &ids).map_err(bad)?,
        ),
        (
            "logits",
            TensorView::new(Dtype::F32, vec![seq, r.vocab], &logits).map_err(bad)?,
        ),
    ];
    let bytes = safetensors::serialize(tensors, &None).map_err(bad)?;
    crate::atomic::write_atomic(path, bytes)
}

/// A key for an image source that changes when the file does: the path with its size and
/// modification time, or the whole URL for `data:` URLs. `None` when the file cannot be inspected.
fn source_key(src: &str) -> Option<u64> {
    let mut h = xxhash_rust::xxh64::Xxh64::new(0x5ce);
    h.update(src.as_bytes());
    if !src.starts_with("data:") {
        let path = src.strip_prefix("file://").unwrap_or(src);
        let meta = std::fs::metadata(path).ok()?;
        h.update(&meta.len().to_le_bytes());
        let mtime = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
        h.update(&mtime.as_nanos().to_le_bytes());
    }
    Some(h.digest())
}
