//! The synthetic agent-step prompts: GUI-Owl's rolling layout (system prompt, folded `StepN: action`
//! lines, earlier screenshots and responses, the current screenshot) as [`LayoutRun`]s with seeded
//! token ids, their engine [`Prompt`]s, and the screenshots' random pixels.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::args::BenchArgs;
use super::SCOPEMEM_ROWS;
use crate::engine::{ImageHash, ImageRole, Prompt, Segment};
use crate::model::{GridThw, ModelConfig, VisionConfig};
use crate::rng::{derive, Rng};
use crate::vision::PixelValues;

/// One run of a prompt layout: text ids, a screenshot (by step; `step = history + 1` is the current
/// one) or an embedding prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LayoutRun {
    Text(Vec<u32>),
    Image { step: usize, grid: [usize; 3] },
    Embeds(usize),
}

/// Token ids and layouts of the synthetic GUI-Owl-shaped prompts.
pub(super) struct Layouts {
    seed: u64,
    /// Text ids are drawn from `0..vocab_hi` (below every special id).
    vocab_hi: u32,
    vision_start: u32,
    vision_end: u32,
    grid: GridThw,
    history: usize,
    response: usize,
    system: usize,
    step: usize,
}

// Labels of the text runs (seeds).
const SYSTEM: u64 = 1;
const FIRST_HEADER: u64 = 2;
const FOLD: u64 = 3;
const RESPONSE: u64 = 4;
const CONT_HEADER: u64 = 5;
const OPEN_USER: u64 = 6;
const OPEN_ASSISTANT: u64 = 7;
const CLOSE: u64 = 8;
const NO_PREVIOUS: u64 = 9;

impl Layouts {
    pub(super) fn new(cfg: &ModelConfig, args: &BenchArgs, grid: GridThw) -> Self {
        let vocab = cfg.text.vocab_size as u32;
        let specials = [
            cfg.image_token_id,
            cfg.video_token_id,
            cfg.vision_start_token_id,
            cfg.vision_end_token_id,
        ];
        let mut hi = specials
            .iter()
            .flatten()
            .copied()
            .chain(cfg.eos_token_ids.iter().copied())
            .fold(vocab, u32::min);
        if hi < 16 {
            hi = vocab;
        }
        Layouts {
            seed: args.seed,
            vocab_hi: hi,
            vision_start: cfg.vision_start_token_id.unwrap_or(hi.saturating_sub(2)),
            vision_end: cfg.vision_end_token_id.unwrap_or(hi.saturating_sub(1)),
            grid,
            history: args.history,
            response: args.response_tokens,
            system: args.system_tokens,
            step: args.step_tokens,
        }
    }

    /// `n` seeded text ids of run `label` (`index` tells repeated runs apart).
    fn ids(&self, label: u64, index: u64, n: usize) -> Vec<u32> {
        let mut r = Rng::new(derive(self.seed, &[0x7e47, label, index]));
        (0..n).map(|_| r.below(self.vocab_hi as u64) as u32).collect()
    }

    /// GUI-Owl's rolling layout with CausalCache's gap-fold for `allocation` (ascending steps):
    /// system; user [FIRST(fold(1..s1-1)), x_s1]; per later s_i: assistant r, user [CONT(gap fold), x];
    /// assistant r_sk; user [CONT(tail fold), x_t]; assistant header. `t` is the current step.
    pub(super) fn step_prompt(&self, allocation: &[usize], t: usize) -> Vec<LayoutRun> {
        let mut runs = Vec::new();
        let mut text = Vec::new();
        text.extend(self.ids(OPEN_USER, 0, 3));
        text.extend(self.ids(SYSTEM, 0, self.system));
        text.extend(self.ids(CLOSE, 0, 2));
        text.extend(self.ids(OPEN_USER, 1, 3));
        text.extend(self.ids(FIRST_HEADER, 0, 48));
        let fold = |text: &mut Vec<u32>, lo: usize, hi: usize| {
            for s in lo..hi {
                text.extend(self.ids(FOLD, s as u64, self.step));
            }
        };
        let first = allocation.first().copied().unwrap_or(t);
        if first > 1 {
            fold(&mut text, 1, first);
        } else {
            text.extend(self.ids(NO_PREVIOUS, 0, 4));
        }
        let mut prev: Option<usize> = None;
        for &s in allocation.iter().chain(std::iter::once(&t)) {
            if let Some(p) = prev {
                text.extend(self.ids(OPEN_ASSISTANT, 0, 3));
                text.extend(self.ids(RESPONSE, p as u64, self.response));
                text.extend(self.ids(CLOSE, 0, 2));
                text.extend(self.ids(OPEN_USER, 0, 3));
                if s > p + 1 {
                    text.extend(self.ids(CONT_HEADER, 0, 6));
                    fold(&mut text, p + 1, s);
                }
            }
            text.push(self.vision_start);
            runs.push(LayoutRun::Text(std::mem::take(&mut text)));
            runs.push(LayoutRun::Image {
                step: s,
                grid: self.grid,
            });
            text.push(self.vision_end);
            prev = Some(s);
        }
        text.extend(self.ids(CLOSE, 0, 2));
        text.extend(self.ids(OPEN_ASSISTANT, 0, 3));
        runs.push(LayoutRun::Text(text));
        runs
    }
}

/// The vision-cache key of step `step`'s screenshot.
pub(super) fn image_hash(seed: u64, step: usize) -> ImageHash {
    ImageHash(derive(seed, &[0x1a6e, step as u64]))
}

/// The engine prompt of a layout; `Embeds` runs get seeded rows of `hidden` values.
pub(super) fn to_prompt(l: &Layouts, runs: &[LayoutRun], hidden: usize) -> Prompt {
    let segments = runs
        .iter()
        .map(|r| match r {
            LayoutRun::Text(ids) => Segment::Text(ids.clone()),
            LayoutRun::Image { step, grid } => Segment::Image {
                hash: image_hash(l.seed, *step),
                grid: *grid,
                role: if *step <= l.history {
                    ImageRole::History
                } else {
                    ImageRole::Current
                },
            },
            LayoutRun::Embeds(rows) => {
                let mut r = Rng::new(derive(l.seed, &[0x5c0e, *rows as u64]));
                Segment::Embeds {
                    hash: derive(l.seed, &[0x5c0e]),
                    rows: *rows,
                    data: (0..rows * hidden).map(|_| r.sym() * 0.035).collect(),
                }
            }
        })
        .collect();
    Prompt { segments }
}

/// Tokens of a layout with `merge`×`merge` patches per image token.
pub(super) fn layout_tokens(runs: &[LayoutRun], merge: usize) -> usize {
    runs.iter()
        .map(|r| match r {
            LayoutRun::Text(ids) => ids.len(),
            LayoutRun::Image { grid: [t, h, w], .. } => t * h * w / (merge * merge),
            LayoutRun::Embeds(n) => *n,
        })
        .sum()
}

/// Random pixel values (uniform in [-1, 1), as normalised pixels) of one screenshot.
pub(super) fn pixels(v: &VisionConfig, grid: GridThw, seed: u64, step: usize) -> PixelValues {
    let n: usize = grid.iter().product();
    let pd = v.patch_dim();
    let mut data = vec![0f32; n * pd];
    data.par_chunks_mut(pd * 64).enumerate().for_each(|(ci, out)| {
        let mut r = Rng::new(derive(seed, &[0x9e15, step as u64, ci as u64]));
        out.iter_mut().for_each(|x| *x = r.sym());
    });
    PixelValues {
        data,
        grid_thw: grid,
        patch_dim: pd,
        resized: image::RgbImage::new(1, 1),
    }
}

/// Tokens of the assistant turn's opening (`<|im_start|>assistant\n`) that an appended prefix goes
/// before.
const ASSISTANT_TURN_TOKENS: usize = 3;

/// The pass-1 layout with the ScopeMem prefix right before the assistant turn (the last
/// [`ASSISTANT_TURN_TOKENS`] tokens), as `agent::scopemem::with_prefix` places it with
/// `Placement::Append`: everything before it is the pass-1 prompt, so its K/V can be reused.
pub(super) fn appended_prefix(pass1: &[LayoutRun]) -> Vec<LayoutRun> {
    let mut out = pass1.to_vec();
    if let Some(LayoutRun::Text(ids)) = out.last_mut() {
        let cut = ids.len().saturating_sub(ASSISTANT_TURN_TOKENS);
        let tail = ids.split_off(cut);
        if ids.is_empty() {
            out.pop();
        }
        out.push(LayoutRun::Embeds(SCOPEMEM_ROWS));
        out.push(LayoutRun::Text(tail));
    } else {
        out.push(LayoutRun::Embeds(SCOPEMEM_ROWS));
    }
    out
}
