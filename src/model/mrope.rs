//! Multimodal rotary position embedding (M-RoPE).
//!
//! Each token has three positions (temporal, height, width). The `head_dim / 2` rotary frequencies are
//! split among the three rows by `mrope_section`: Qwen2.5-VL gives each row a contiguous chunk
//! (`[t…t h…h w…w]`), Qwen3-VL interleaves them (`t h w t h w … t t`). Text tokens carry three equal
//! positions, which makes M-RoPE coincide with plain RoPE — but text runs through this same code.

use crate::model::config::TextConfig;

/// Three position rows, one entry per token.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Positions {
    pub t: Vec<i64>,
    pub h: Vec<i64>,
    pub w: Vec<i64>,
}

impl Positions {
    /// Text positions `start..start + n` in all three rows.
    pub fn text(start: i64, n: usize) -> Self {
        let row: Vec<i64> = (start..start + n as i64).collect();
        Positions {
            t: row.clone(),
            h: row.clone(),
            w: row,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.t.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.t.is_empty()
    }
}

/// Precomputed inverse frequencies and the position row each frequency reads.
#[derive(Debug, Clone)]
pub struct MRope {
    inv_freq: Vec<f32>, // [head_dim / 2]
    row_of: Vec<u8>,    // [head_dim / 2]: 0 = t, 1 = h, 2 = w
    head_dim: usize,
}

impl MRope {
    /// Frequencies as HF computes them: `1 / theta^(2i / d)` in f32.
    pub fn new(cfg: &TextConfig) -> Self {
        let d = cfg.head_dim;
        let inv_freq = (0..d / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f32 / d as f32))
            .collect();
        let [t, h, w] = cfg.mrope_section;
        let row_of = (0..d / 2)
            .map(|j| {
                if cfg.mrope_interleaved {
                    // Qwen3-VL: index j goes to h when j % 3 == 1 and j < 3·h, to w when
                    // j % 3 == 2 and j < 3·w, and to t otherwise.
                    match j % 3 {
                        1 if j < 3 * h => 1,
                        2 if j < 3 * w => 2,
                        _ => 0,
                    }
                } else if j < t {
                    0
                } else if j < t + h {
                    1
                } else {
                    2
                }
            })
            .collect();
        MRope {
            inv_freq,
            row_of,
            head_dim: d,
        }
    }

    /// `cos` and `sin` tables, each `[n, head_dim]` row-major, for the given positions.
    pub fn tables(&self, pos: &Positions) -> (Vec<f32>, Vec<f32>) {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        let mut cos = vec![0f32; pos.len() * d];
        let mut sin = vec![0f32; pos.len() * d];
        for i in 0..pos.len() {
            let rows = [pos.t[i], pos.h[i], pos.w[i]];
            for j in 0..half {
                let f = rows[self.row_of[j] as usize] as f32 * self.inv_freq[j];
                let (s, c) = f.sin_cos();
                cos[i * d + j] = c;
                cos[i * d + j + half] = c;
                sin[i * d + j] = s;
                sin[i * d + j + half] = s;
            }
        }
        (cos, sin)
    }
}

/// A run of prompt tokens, for computing positions: text tokens, or the merged tokens of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Span {
    /// `n` text tokens (including `<|vision_start|>` / `<|vision_end|>`).
    Text(usize),
    /// One image of `t × h × w` merged tokens (the patch grid divided by the merge size).
    Image { t: usize, h: usize, w: usize },
}

impl Span {
    /// Tokens in the span.
    pub fn len(&self) -> usize {
        match *self {
            Span::Text(n) => n,
            Span::Image { t, h, w } => t * h * w,
        }
    }

    /// Whether the span holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// M-RoPE positions of a prompt (HF's `get_rope_index` for images), starting at `start`.
///
/// Text advances all three rows together; an image's tokens get `(start + t, start + row, start +
/// col)` and the text after it resumes at `start + max(h, w)`. Returns the positions and the next
/// free position, from which decoding continues (`next - len` is HF's rope delta).
pub fn rope_index(spans: &[Span], start: i64) -> (Positions, i64) {
    let mut pos = Positions::default();
    let mut cur = start;
    for span in spans {
        match *span {
            Span::Text(n) => {
                for i in 0..n as i64 {
                    pos.t.push(cur + i);
                    pos.h.push(cur + i);
                    pos.w.push(cur + i);
                }
                cur += n as i64;
            }
            Span::Image { t, h, w } => {
                for ti in 0..t as i64 {
                    for r in 0..h as i64 {
                        for c in 0..w as i64 {
                            pos.t.push(cur + ti);
                            pos.h.push(cur + r);
                            pos.w.push(cur + c);
                        }
                    }
                }
                cur += h.max(w) as i64;
            }
        }
    }
    (pos, cur)
}

impl Positions {
    /// Appends `other` after these positions.
    pub fn extend(&mut self, other: &Positions) {
        self.t.extend_from_slice(&other.t);
        self.h.extend_from_slice(&other.h);
        self.w.extend_from_slice(&other.w);
    }
}
