//! Text to token ids and back: the Qwen BPE tokenizer and the chat templates of the supported families.

mod bpe;
pub mod chat;
mod load;
pub mod tojson;
mod tokenizer;

pub use tokenizer::Tokenizer;
