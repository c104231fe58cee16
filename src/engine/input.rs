//! A prompt ready for the model: token ids, their M-RoPE positions and the image features that replace
//! the image-pad tokens.

use crate::model::{AdapterMode, Positions, VisualFeatures};

/// A prepared prompt.
pub struct PromptInput<T> {
    pub ids: Vec<u32>,
    /// One position triple per id.
    pub positions: Positions,
    /// Image embeddings (and deepstack features) for the image-pad rows, when the prompt has images.
    pub visual: Option<VisualFeatures<T>>,
    /// The position of the first token after the prompt; generated tokens continue from here.
    pub next_position: i64,
    /// Rows holding the merged tokens of History images (where the gated adapter acts).
    pub history_rows: Vec<usize>,
    /// Where the loaded adapter acts for this prompt.
    pub adapter: AdapterMode,
    /// Seconds the vision tower took on the prompt's images (0 without images).
    pub vision_seconds: f64,
}

impl<T> PromptInput<T> {
    /// A text-only prompt: positions `0..ids.len()` in all three rows.
    ///
    /// ```
    /// let p = recall::engine::PromptInput::<()>::text(&[1, 2, 3]);
    /// assert_eq!(p.next_position, 3);
    /// ```
    pub fn text(ids: &[u32]) -> Self {
        PromptInput {
            ids: ids.to_vec(),
            positions: Positions::text(0, ids.len()),
            visual: None,
            next_position: ids.len() as i64,
            history_rows: Vec::new(),
            adapter: AdapterMode::Off,
            vision_seconds: 0.0,
        }
    }

    /// Prompt rows whose K/V the adapter updates.
    pub fn lora_rows(&self) -> Vec<usize> {
        match self.adapter {
            AdapterMode::Off => Vec::new(),
            AdapterMode::Gated => self.history_rows.clone(),
            AdapterMode::Ungated => (0..self.ids.len()).collect(),
        }
    }

    /// Whether the adapter also acts on tokens after the prompt (generated or scored ones).
    pub fn lora_after_prompt(&self) -> bool {
        self.adapter == AdapterMode::Ungated
    }

    /// Positions for `n` tokens that follow the prompt after `offset` generated tokens.
    pub fn continuation(&self, offset: usize, n: usize) -> Positions {
        Positions::text(self.next_position + offset as i64, n)
    }
}
