//! Models: configuration, checkpoint loading and the Qwen-VL architectures.

pub mod config;
pub mod hgkv;
pub mod layers;
pub mod loader;
pub mod mrope;
pub mod scopemem;
pub mod text;
pub mod vision;
pub mod vision_qwen25;
pub mod vision_qwen3;
pub mod weights;

use std::path::Path;

pub use config::{Family, ModelConfig, TextConfig};
pub use hgkv::AdapterMode;
pub use loader::Checkpoint;
pub use mrope::{rope_index, Positions, Span};
pub use text::{
    BatchItem, BatchOutput, ForwardOutput, KvCache, KvPool, LogitsFor, TextModel, VisualFeatures,
};
pub use vision::{GridThw, VisionConfig, VisionOutput};

use crate::backend::Backend;
use crate::Result;

/// A loaded Qwen-VL model: its configuration, the text decoder and the vision tower on a backend.
pub struct QwenVl<B: Backend> {
    pub config: ModelConfig,
    pub text: TextModel<B>,
    /// `None` when the config has no `vision_config`.
    pub vision: Option<VisionTower<B>>,
}

/// The vision tower of either family.
pub enum VisionTower<B: Backend> {
    Qwen3(vision_qwen3::Qwen3VisionTower<B>),
    Qwen25(vision_qwen25::Qwen25VisionTower<B>),
}

impl<B: Backend> VisionTower<B> {
    /// Encodes images: `pixels` `[Σ patches, patch_dim]` in HF's patch order, one grid per image.
    pub fn forward(&self, be: &B, pixels: &B::Tensor, grids: &[GridThw]) -> Result<VisionOutput<B::Tensor>> {
        match self {
            VisionTower::Qwen3(t) => t.forward(be, pixels, grids),
            VisionTower::Qwen25(t) => t.forward(be, pixels, grids),
        }
    }
}

impl<B: Backend> QwenVl<B> {
    /// Loads a K/V LoRA adapter (PEFT directory or reference safetensors) into the decoder,
    /// replacing any previous one.
    pub fn load_adapter(&mut self, backend: &B, path: &Path) -> Result<()> {
        let adapter = hgkv::Adapter::load(backend, path, &self.config.text)?;
        self.text.set_adapter(Some(adapter));
        Ok(())
    }

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
        Self::from_checkpoint(backend, config, &ckpt)
    }

    /// Loads the weights of `config` from an opened checkpoint (e.g. a [`Checkpoint::synthetic`] one
    /// of random weights, for benchmarks).
    pub fn from_checkpoint(backend: &B, config: ModelConfig, ckpt: &Checkpoint) -> Result<Self> {
        let text = TextModel::load(backend, &config.text, ckpt)?;
        let vision = match (&config.vision, config.family) {
            (None, _) => None,
            (Some(v), Family::Qwen3Vl) => Some(VisionTower::Qwen3(vision_qwen3::Qwen3VisionTower::load(
                backend, v, ckpt,
            )?)),
            (Some(v), Family::Qwen25Vl) => Some(VisionTower::Qwen25(vision_qwen25::Qwen25VisionTower::load(
                backend, v, ckpt,
            )?)),
        };
        Ok(QwenVl { config, text, vision })
    }
}
