//! The library's one error type. Every variant carries enough context (a file, a tensor, a field) for a
//! user to find what is wrong without a debugger.

use std::path::PathBuf;

/// Errors returned by the `recall` library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read, mapped or written (the message says which step, where it matters).
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON document (config, messages, index) is malformed or lacks a field.
    #[error("{path}: invalid JSON at field `{field}`: {message}")]
    Json {
        path: PathBuf,
        field: String,
        message: String,
    },

    /// The checkpoint's `model_type` is not one recall implements.
    #[error("{path}: unsupported model_type `{model_type}` (supported: qwen3_vl, qwen2_5_vl)")]
    UnsupportedModel { path: PathBuf, model_type: String },

    /// A safetensors file is truncated or otherwise unreadable.
    #[error("{path}: malformed safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },

    /// A tensor the model needs is in none of the checkpoint's files.
    #[error("tensor `{name}` not found in {path}")]
    MissingTensor { name: String, path: PathBuf },

    /// A tensor has a shape other than the config implies.
    #[error("tensor `{name}` in {path} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        path: PathBuf,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },

    /// A tensor has a dtype recall cannot compute with.
    #[error("tensor `{name}` in {path} has unsupported dtype {dtype}")]
    UnsupportedDtype {
        name: String,
        path: PathBuf,
        dtype: String,
    },

    /// The tokenizer could not be loaded or failed on an input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A prompt does not fit into the model's context or the cache.
    #[error("prompt of {tokens} tokens exceeds the limit of {limit} tokens by {}", tokens - limit)]
    PromptTooLong { tokens: usize, limit: usize },

    /// The CUDA environment is unusable: a library, symbol, header or device is missing, or a driver
    /// call failed.
    #[error("CUDA: {0}")]
    Cuda(String),

    /// The KV pool has too few free blocks for an operation (`what`). Admission waits and decode
    /// preempts on this error; it reaches a caller only when a request can never fit.
    #[error("KV cache full: {what} needs {needed} blocks, {available} available of {total}")]
    KvCacheFull {
        what: String,
        needed: usize,
        available: usize,
        total: usize,
    },

    /// The request was cancelled (its client went away, or it was aborted) before it finished.
    #[error("request cancelled")]
    Cancelled,

    /// An input is larger than one of the caps in [`crate::limits`] (a corrupt or hostile file, e.g. a
    /// safetensors header claiming 2^60 bytes): refused before memory of that size is allocated.
    #[error("{path}: {what} of {value} bytes exceeds the limit of {cap} bytes")]
    LimitExceeded {
        what: String,
        path: PathBuf,
        value: u64,
        cap: u64,
    },

    /// An op was called with operands whose shapes do not fit together (`[3, 4] · [5, 4]ᵀ`, a row
    /// index past the end). User input is checked before it reaches an op, so this is a bug in the
    /// caller (a model or the engine), not a bad request: the server answers 500.
    #[error("shape mismatch in {op}: {message}")]
    Shape { op: String, message: String },

    /// A request is invalid (empty prompt, token id out of range, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// An option asks for an instruction set this CPU lacks (`--cpu-bf16-dot` without AVX512-BF16).
    #[error("{option} needs {feature} ({flag} in /proc/cpuinfo), which this CPU lacks")]
    CpuFeatureMissing {
        option: &'static str,
        feature: &'static str,
        flag: &'static str,
    },
}

/// Result alias used throughout the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A JSON error at `field` of the document at `path`.
    pub fn json(path: impl Into<PathBuf>, field: impl Into<String>, message: impl ToString) -> Self {
        Error::Json {
            path: path.into(),
            field: field.into(),
            message: message.to_string(),
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
