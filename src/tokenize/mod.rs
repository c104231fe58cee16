//! Text to token ids and back: the Qwen BPE tokenizer and the chat templates of the supported families.

pub mod chat;
mod load;
pub mod tojson;
mod tokenizer;

pub use tokenizer::Tokenizer;
