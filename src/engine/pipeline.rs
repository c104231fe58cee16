//! A model with its tokenizer: chat messages in, tokens, logits, generations and scores out. This is
//! what the CLI (and later the server) calls.

use std::path::Path;

use crate::backend::Backend;
use crate::engine::{generate, score, GenerateParams, Generation, Score};
use crate::error::{Error, Result};
use crate::model::{Family, LogitsFor, Positions, QwenVl};
use crate::tokenize::chat::{render_chat, ChatFamily, ChatMessage, ContentPart};
use crate::tokenize::Tokenizer;

/// A loaded model and its tokenizer on one backend.
pub struct Pipeline<B: Backend> {
    pub backend: B,
    pub model: QwenVl<B>,
    pub tokenizer: Tokenizer,
}

/// Full-sequence logits of a prompt.
pub struct PromptLogits {
    /// The prompt's token ids.
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
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        let model = QwenVl::load(&backend, model_dir)?;
        Ok(Pipeline {
            backend,
            model,
            tokenizer,
        })
    }

    fn chat_family(&self) -> ChatFamily {
        match self.model.config.family {
            Family::Qwen3Vl => ChatFamily::Qwen3Vl,
            Family::Qwen25Vl => ChatFamily::Qwen25Vl,
        }
    }

    /// Renders `messages` with the family's chat template and tokenizes the result.
    pub fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        let has_image = messages
            .iter()
            .flat_map(|m| &m.content)
            .any(|p| matches!(p, ContentPart::Image(_)));
        if has_image {
            return Err(Error::InvalidRequest(
                "image content is not supported by the text-only pipeline yet".into(),
            ));
        }
        let text = render_chat(self.chat_family(), messages, add_generation_prompt);
        self.tokenizer.encode(&text)
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

    /// Greedy generation after the given token ids.
    pub fn generate_ids(
        &self,
        prompt: &[u32],
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

    /// Greedy answer to one user message (rendered with the chat template).
    pub fn generate_text(&self, prompt: &str, max_tokens: usize) -> Result<Generation> {
        let messages = [ChatMessage::text("user", prompt)];
        let ids = self.encode_chat(&messages, true)?;
        self.generate_ids(&ids, max_tokens, &[])
    }

    /// Logits at every position of the rendered chat (with the generation prompt).
    pub fn prompt_logits(&self, messages: &[ChatMessage]) -> Result<PromptLogits> {
        let input_ids = self.encode_chat(messages, true)?;
        let be = &self.backend;
        let text = &self.model.text;
        if input_ids.is_empty() {
            return Err(Error::InvalidRequest("the rendered prompt is empty".into()));
        }
        let limit = text.config().max_position_embeddings;
        if input_ids.len() > limit {
            return Err(Error::PromptTooLong {
                tokens: input_ids.len(),
                limit,
            });
        }
        let mut cache = text.new_cache(be, input_ids.len())?;
        let pos = Positions::text(0, input_ids.len());
        let out = text.forward(be, &input_ids, &pos, &mut cache, LogitsFor::All, false)?;
        Ok(PromptLogits {
            logits: be.download(&out.logits)?,
            vocab: be.dims(&out.logits).1,
            input_ids,
        })
    }

    /// Teacher-forced log-probability of `target` as the assistant's reply to `messages`.
    pub fn score_reply(&self, messages: &[ChatMessage], target: &str) -> Result<Score> {
        let prompt = self.encode_chat(messages, true)?;
        let target = self.tokenizer.encode(target)?;
        score(&self.backend, &self.model.text, &prompt, &target)
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
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}
