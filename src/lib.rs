//! recall: an inference engine for long-horizon GUI agents on Qwen-VL models.
//!
//! Layers, from the bottom: [`backend`] (buffers and ops), [`model`] (configs, weight loading, the
//! Qwen-VL architectures), [`tokenize`] (tokenizer and chat rendering), [`engine`] (generation and
//! scoring). Dependencies point down only.

pub mod agent;
pub mod atomic;
pub mod backend;
pub mod bench;
pub mod engine;
pub mod error;
pub mod kv;
pub mod limits;
pub mod loadgen;
pub mod memory;
pub mod model;
pub mod server;
pub mod tokenize;
pub mod vision;

pub use error::{Error, Result};
