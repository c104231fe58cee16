//! Models: configuration, checkpoint loading and the Qwen-VL architectures.

pub mod config;
pub mod loader;
pub mod mrope;
pub mod text;

use std::path::Path;

pub use config::{Family, ModelConfig, TextConfig};
pub use loader::Checkpoint;
pub use mrope::Positions;
pub use text::{ForwardOutput, KvCache, LogitsFor, TextModel};

use crate::backend::Backend;
use crate::Result;

/// A loaded Qwen-VL model: its configuration and the text decoder on a backend.
pub struct QwenVl<B: Backend> {
    pub config: ModelConfig,
    pub text: TextModel<B>,
}

impl<B: Backend> QwenVl<B> {
    /// Reads `dir/config.json` and maps the checkpoint's weights onto `backend`.
    ///
    /// ```no_run
    /// use recall::backend::cpu::CpuBackend;
    /// let model = recall::model::QwenVl::load(&CpuBackend, std::path::Path::new("tests/fixtures/tiny-qwen3-vl"))?;
    /// println!("{} layers", model.config.text.num_hidden_layers);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn load(backend: &B, dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        tracing::info!(dir = %dir.display(), family = ?config.family, backend = backend.name(), "loading model");
        let text = TextModel::load(backend, &config.text, &ckpt)?;
        Ok(QwenVl { config, text })
    }
}
