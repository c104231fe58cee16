//! Generation and scoring on a loaded model.
//!
//! [`Engine`] is the serving path: prompts of text, images (by content hash) and embedding runs;
//! continuous batching of chunked prefills and decodes over a paged KV pool with exact prefix reuse;
//! a vision-embedding cache. [`generate`] and [`score`] are the single-sequence reference path over a
//! contiguous cache. [`Pipeline`] bundles a model with its tokenizer and image preprocessing for
//! chat-level calls.

mod core;
pub mod generate;
pub mod input;
mod outcome;
pub mod pipeline;
mod postprocess;
pub mod prompt;
mod runner;
pub mod sampling;
mod scheduler;
pub mod score;
mod sequence;
pub mod session;
pub mod vision_cache;

pub use self::core::{
    blocks_from_memory, Engine, EngineConfig, EngineOutput, EngineStats, Progress, RequestOptions,
};
pub use generate::{generate, FinishReason, GenerateParams, Generation};
pub use input::PromptInput;
pub use outcome::Outcome;
pub use pipeline::{Pipeline, PromptLogits};
pub use prompt::{ImageHash, ImageRole, Prompt, Segment};
pub use sampling::{Sampling, TokenLogprobs};
pub use score::{score, Score};
pub use sequence::{RequestId, Task};
pub use session::{LocalSession, Session};
