//! Text to token ids and back: the Qwen BPE tokenizer and the chat templates of the supported families.

mod bpe;
mod cache;
pub mod chat;
mod load;
pub mod tojson;
mod tokenizer;

pub use cache::ENV_TOKENIZER_CACHE;
pub use tokenizer::Tokenizer;
