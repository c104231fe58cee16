//! recall: an inference engine for long-horizon GUI agents on Qwen-VL models.
//!
//! Layers, from the bottom: [`error`], [`limits`] and [`atomic`]; [`checkpoint`] (safetensors files
//! mapped into memory); [`backend`] (buffers and ops); [`model`] (configs, the weights loader, the
//! Qwen-VL architectures); [`tokenize`] and [`vision`] (text and images in); [`kv`] (the paged cache's
//! bookkeeping); [`engine`] (generation and scoring); [`action`]; [`memory`]; [`agent`] (the two
//! methods end to end); [`server`]; [`bench`], [`kernel_bench`] and [`loadgen`]. Imports point down
//! only; docs/ARCHITECTURE.md has the table and `tests/architecture.rs` enforces it.

pub mod action;
pub mod agent;
pub mod atomic;
pub mod backend;
pub mod bench;
pub mod cache_dir;
pub mod checkpoint;
pub mod engine;
pub mod error;
pub mod kernel_bench;
pub mod kv;
pub mod limits;
pub mod loadgen;
pub mod memory;
pub mod model;
pub(crate) mod rng;
pub mod server;
pub mod tokenize;
pub mod vision;

pub use error::{Error, Result};
