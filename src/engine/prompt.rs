//! A prompt as the engine sees it: runs of text tokens, images referenced by content hash, and raw
//! embedding runs (ScopeMem's prefix). From a prompt the engine derives every token's id, M-RoPE
//! position and cache key.

use crate::error::{Error, Result};
use crate::model::{rope_index, GridThw, Positions, Span};

/// Content hash of a decoded image (xxh64 of its dimensions and RGB bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageHash(pub u64);

impl ImageHash {
    /// Hashes a decoded RGB image: two screenshots with identical pixels get the same hash.
    pub fn of_image(img: &image::RgbImage) -> Self {
        let mut h = xxhash_rust::xxh64::Xxh64::new(0x1ea5_11a6);
        h.update(&img.width().to_le_bytes());
        h.update(&img.height().to_le_bytes());
        h.update(img.as_raw());
        ImageHash(h.digest())
    }

    /// The key of these pixels resized under another pixel budget than the engine's default: the
    /// vision cache (and every KV block after the image) must tell the two encodings apart.
    ///
    /// ```
    /// use recall::engine::ImageHash;
    /// let h = ImageHash(7);
    /// assert_ne!(h.with_pixels(3136, 12845056), h);
    /// assert_ne!(h.with_pixels(3136, 12845056), h.with_pixels(3136, 1003520));
    /// ```
    pub fn with_pixels(self, min_pixels: usize, max_pixels: usize) -> Self {
        let mut h = xxhash_rust::xxh64::Xxh64::new(0x00b0_d6e7);
        h.update(&self.0.to_le_bytes());
        h.update(&(min_pixels as u64).to_le_bytes());
        h.update(&(max_pixels as u64).to_le_bytes());
        ImageHash(h.digest())
    }
}

/// What an image is in an agent's prompt. Only restored history screenshots are gated by HGKV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageRole {
    /// A screenshot of an earlier step.
    History,
    /// The screenshot the policy acts on now.
    Current,
}

/// One run of a prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    /// Token ids (including `<|vision_start|>` / `<|vision_end|>` around images).
    Text(Vec<u32>),
    /// An image already known to the engine; `grid` is its patch grid.
    Image {
        hash: ImageHash,
        grid: GridThw,
        role: ImageRole,
    },
    /// Raw input embeddings `[rows, hidden]`, positioned as text tokens.
    Embeds { hash: u64, rows: usize, data: Vec<f32> },
}

/// A prompt: segments in order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Prompt {
    pub segments: Vec<Segment>,
}

/// Where the tokens of one image or embedding run sit in the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedRun {
    /// Index of the segment in the prompt.
    pub segment: usize,
    /// First token of the run.
    pub start: usize,
    /// Tokens in the run.
    pub len: usize,
}

/// A prompt flattened into tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatPrompt {
    /// Token ids; image tokens carry the image-pad id, embedding rows a placeholder id.
    pub ids: Vec<u32>,
    pub positions: Positions,
    /// The position of the first token after the prompt.
    pub next_position: i64,
    /// Images and embedding runs with their token ranges, in order.
    pub runs: Vec<PlacedRun>,
}

impl Prompt {
    /// Token ids, positions and the placement of images and embedding runs.
    ///
    /// ```
    /// use recall::engine::prompt::{Prompt, Segment};
    /// let p = Prompt { segments: vec![Segment::Text(vec![1, 2, 3])] };
    /// let flat = p.flatten(7, 2).unwrap();
    /// assert_eq!(flat.ids, vec![1, 2, 3]);
    /// assert_eq!(flat.next_position, 3);
    /// ```
    pub fn flatten(&self, image_pad: u32, merge: usize) -> Result<FlatPrompt> {
        let (mut ids, mut spans, mut runs) = (Vec::new(), Vec::new(), Vec::new());
        for (i, seg) in self.segments.iter().enumerate() {
            match seg {
                Segment::Text(t) => {
                    ids.extend_from_slice(t);
                    spans.push(Span::Text(t.len()));
                }
                Segment::Image { grid: [t, h, w], .. } => {
                    if *t == 0 || h % merge != 0 || w % merge != 0 || *h == 0 || *w == 0 {
                        return Err(Error::InvalidRequest(format!(
                            "segment {i}: grid [{t}, {h}, {w}] does not split into {merge}x{merge} blocks"
                        )));
                    }
                    let span = Span::Image {
                        t: *t,
                        h: h / merge,
                        w: w / merge,
                    };
                    runs.push(PlacedRun {
                        segment: i,
                        start: ids.len(),
                        len: span.len(),
                    });
                    ids.extend(std::iter::repeat_n(image_pad, span.len()));
                    spans.push(span);
                }
                Segment::Embeds { rows, data, .. } => {
                    if *rows == 0 || data.len() % rows != 0 {
                        return Err(Error::InvalidRequest(format!(
                            "segment {i}: {} values do not form {rows} embedding rows",
                            data.len()
                        )));
                    }
                    runs.push(PlacedRun {
                        segment: i,
                        start: ids.len(),
                        len: *rows,
                    });
                    ids.extend(std::iter::repeat_n(0, *rows));
                    spans.push(Span::Text(*rows));
                }
            }
        }
        if ids.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        let (positions, next_position) = rope_index(&spans, 0);
        Ok(FlatPrompt {
            ids,
            positions,
            next_position,
            runs,
        })
    }
}
