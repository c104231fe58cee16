//! Generation and scoring on a loaded model.
//!
//! This is the single-sequence path over a contiguous KV cache; the paged, batched engine builds on the
//! same model interface. [`Pipeline`] bundles a model with its tokenizer for chat-level calls.

pub mod generate;
pub mod input;
pub mod pipeline;
pub mod score;

pub use generate::{generate, FinishReason, GenerateParams, Generation};
pub use input::PromptInput;
pub use pipeline::{Pipeline, PromptLogits};
pub use score::{score, Score};
