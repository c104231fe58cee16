//! [`Session`]: what the agent layer asks of a served model — chat prompts, generations, scores and
//! token embeddings — whether the engine runs in this thread ([`LocalSession`], the CLI) or behind a
//! server's engine loop, where every call joins the continuous batch of all clients' requests.

use crate::backend::Backend;
use crate::engine::{Engine, EngineOutput, GenerateParams, Generation, Outcome, Pipeline, Prompt, Score};
use crate::engine::{RequestOptions, Task};
use crate::error::{Error, Result};
use crate::model::AdapterMode;
use crate::tokenize::chat::ChatMessage;
use crate::tokenize::Tokenizer;

/// A model and an engine as the two-pass methods use them.
pub trait Session {
    /// The model's tokenizer.
    fn tokenizer(&self) -> &Tokenizer;
    /// The model's end-of-sequence ids.
    fn eos_token_ids(&self) -> Vec<u32>;
    /// Width of the model's input embeddings.
    fn hidden_size(&self) -> usize;
    /// The engine prompt of a conversation, with the generation prompt; its images are encoded
    /// into the engine's vision cache when new (the last image is the current screenshot).
    fn chat_prompt(&mut self, messages: &[ChatMessage]) -> Result<Prompt>;
    /// Runs one request to its end.
    fn run(&mut self, prompt: &Prompt, task: Task, opts: RequestOptions) -> Result<EngineOutput>;
    /// Scores (prompt, target) pairs, computing their common prefix once, with the loaded adapter
    /// acting as `adapter` says.
    fn score_many(&mut self, pairs: &[(Prompt, Vec<u32>)], adapter: AdapterMode) -> Result<Vec<Score>>;
    /// The model's input embeddings of `ids`, `[ids.len() · hidden]` row-major.
    fn embed_tokens(&mut self, ids: &[u32]) -> Result<Vec<f32>>;

    /// Runs a generation to its end: the generation and the request's output (reuse, drafts).
    fn generate(
        &mut self,
        prompt: &Prompt,
        params: GenerateParams,
        opts: RequestOptions,
    ) -> Result<(Generation, EngineOutput)> {
        let out = self.run(prompt, Task::Generate(params), opts)?;
        match &out.outcome {
            Outcome::Generation(g) => Ok((g.clone(), out)),
            Outcome::Failed(e) => Err(Error::InvalidRequest(e.clone())),
            other => Err(Error::InvalidRequest(format!("unexpected outcome {other:?}"))),
        }
    }
}

/// A [`Session`] over a pipeline and an engine in this thread.
///
/// ```no_run
/// use recall::{backend::cpu::CpuBackend, engine::{EngineConfig, Pipeline, Session}};
/// use recall::tokenize::chat::ChatMessage;
/// let p = Pipeline::load(CpuBackend, std::path::Path::new("tests/fixtures/tiny-qwen3-vl"), None)?;
/// let mut engine = p.engine(EngineConfig::default())?;
/// let mut s = p.session(&mut engine);
/// let prompt = s.chat_prompt(&[ChatMessage::text("user", "Hello")])?;
/// let params = recall::engine::GenerateParams { max_tokens: 8, eos_token_ids: s.eos_token_ids(), stop_strings: vec![] };
/// let (g, _) = s.generate(&prompt, params, Default::default())?;
/// println!("{:?}", g.text);
/// # Ok::<(), recall::Error>(())
/// ```
pub struct LocalSession<'a, 'm, B: Backend> {
    pub pipeline: &'a Pipeline<B>,
    pub engine: &'a mut Engine<'m, B>,
}

impl<B: Backend> Pipeline<B> {
    /// A [`Session`] over this pipeline and `engine`, for the agent layer. (It lives here, beside
    /// [`LocalSession`], so that the pipeline does not import the sessions built on it.)
    pub fn session<'a, 'm>(&'a self, engine: &'a mut Engine<'m, B>) -> LocalSession<'a, 'm, B> {
        LocalSession {
            pipeline: self,
            engine,
        }
    }
}

impl<B: Backend> Session for LocalSession<'_, '_, B> {
    fn tokenizer(&self) -> &Tokenizer {
        &self.pipeline.tokenizer
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.pipeline.eos_token_ids()
    }

    fn hidden_size(&self) -> usize {
        self.pipeline.model.text.config().hidden_size
    }

    fn chat_prompt(&mut self, messages: &[ChatMessage]) -> Result<Prompt> {
        self.pipeline.chat_prompt(self.engine, messages, true)
    }

    fn run(&mut self, prompt: &Prompt, task: Task, opts: RequestOptions) -> Result<EngineOutput> {
        let id = self.engine.add_request_with(prompt, task, opts)?;
        self.engine.wait_for(id)
    }

    fn score_many(&mut self, pairs: &[(Prompt, Vec<u32>)], adapter: AdapterMode) -> Result<Vec<Score>> {
        self.engine.score_many_with(pairs, adapter)
    }

    fn embed_tokens(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        self.pipeline.embed_tokens(ids)
    }
}
