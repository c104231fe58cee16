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
