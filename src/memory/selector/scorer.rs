//! The learned marginal scorer: loading (safetensors, layout in the module docs of [`super`]),
//! validation and the batched forward pass.

use std::collections::HashMap;
use std::path::Path;

#[cfg(target_arch = "x86_64")]
use super::kernels::dense_avx2;
use super::kernels::{dense, madd, LANES, ROWS};
use super::{EventIndexing, MarginalModel, FEATURE_NAMES, NUM_FEATURES, SCORER_FORMAT};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// The learned marginal scorer: z-normalise → Linear(28,H) → GELU → Linear(H,H) → GELU → Linear(H,1).
///
/// Computation is f32 (normalisation in f64, as the reference does in Python before building the
/// tensor), with an AVX2+FMA kernel where the CPU has one; [`MarginalModel::score`] and
/// [`MarginalModel::score_batch`] give bitwise-identical results for the same row.
///
/// ```no_run
/// use recall::memory::selector::{MarginalModel, MarginalScorer};
/// let scorer = MarginalScorer::load(std::path::Path::new("selector.safetensors"))?;
/// let delta = scorer.score(&[0.0; 28]);
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MarginalScorer {
    hidden: usize,
    /// Hidden size rounded up to a multiple of `LANES` (padding units have zero weights).
    padded: usize,
    mean: [f64; NUM_FEATURES],
    std: [f64; NUM_FEATURES],
    /// fc1 in column blocks: block `b`, input `k` → `w1[b * 28 + k][lane]`.
    w1: Vec<[f32; LANES]>,
    b1: Vec<f32>,
    /// fc2 in column blocks: block `b`, input `k` → `w2[b * padded + k][lane]`.
    w2: Vec<[f32; LANES]>,
    b2: Vec<f32>,
    w3: Vec<f32>,
    b3: f32,
    /// How the features it was trained on counted ages.
    indexing: EventIndexing,
}

/// The raw parameters of a [`MarginalScorer`], row-major as in PyTorch.
#[derive(Debug, Clone, PartialEq)]
pub struct ScorerParams {
    pub feature_mean: Vec<f32>,
    pub feature_std: Vec<f32>,
    /// `[H, 28]`.
    pub fc1_weight: Vec<f32>,
    pub fc1_bias: Vec<f32>,
    /// `[H, H]`.
    pub fc2_weight: Vec<f32>,
    pub fc2_bias: Vec<f32>,
    /// `[1, H]`.
    pub fc3_weight: Vec<f32>,
    pub fc3_bias: f32,
}

/// The file's `event_indexing`. A file written before recall recorded it was trained and served with
/// `age = t − s` ([`EventIndexing::Mobile`]), so that is what it keeps, with a warning.
fn file_indexing(metadata: &HashMap<String, String>, path: &Path) -> Result<EventIndexing> {
    match metadata.get("event_indexing") {
        Some(v) => v.parse().map_err(|e: Error| Error::Safetensors {
            path: path.to_path_buf(),
            message: format!("metadata event_indexing: {e}"),
        }),
        None => {
            tracing::warn!(
                "{}: no event_indexing metadata; using `mobile` (age t-s), the indexing recall used \
                 before it was recorded (retrain, reconvert, or pass --event-indexing)",
                path.display()
            );
            Ok(EventIndexing::Mobile)
        }
    }
}

fn bad_params(what: String) -> Error {
    Error::InvalidRequest(format!("selector scorer: {what}"))
}

impl MarginalScorer {
    /// Loads a scorer from a safetensors file (layout in the module docs).
    pub fn load(path: &Path) -> Result<Self> {
        let ckpt = Checkpoint::open_file(path)?;
        let meta_err = |message: String| Error::Safetensors {
            path: path.to_path_buf(),
            message,
        };
        if let Some(format) = ckpt.metadata.get("format") {
            if format != SCORER_FORMAT {
                return Err(meta_err(format!(
                    "metadata format `{format}`, expected `{SCORER_FORMAT}`"
                )));
            }
        }
        if let Some(names) = ckpt.metadata.get("feature_names") {
            let got: Vec<&str> = names.split(',').map(str::trim).collect();
            if got != FEATURE_NAMES {
                return Err(meta_err(format!(
                    "feature_names `{names}` differ from recall's layout `{}`",
                    FEATURE_NAMES.join(",")
                )));
            }
        }
        let fc1 = ckpt.get("fc1.weight")?;
        if fc1.shape.len() != 2 || fc1.shape[1] != NUM_FEATURES || fc1.shape[0] == 0 {
            return Err(Error::ShapeMismatch {
                name: "fc1.weight".into(),
                path: path.to_path_buf(),
                expected: vec![fc1.shape.first().copied().unwrap_or(0).max(1), NUM_FEATURES],
                actual: fc1.shape.clone(),
            });
        }
        let h = fc1.shape[0];
        if let Some(hidden) = ckpt.metadata.get("hidden") {
            if hidden.trim().parse::<usize>().ok() != Some(h) {
                return Err(meta_err(format!(
                    "metadata hidden `{hidden}` but fc1.weight has {h} rows"
                )));
            }
        }
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let t = ckpt.get(name)?;
            t.expect_shape(shape)?;
            Ok(t.to_f32())
        };
        let params = ScorerParams {
            feature_mean: get("feature_mean", &[NUM_FEATURES])?,
            feature_std: get("feature_std", &[NUM_FEATURES])?,
            fc1_weight: get("fc1.weight", &[h, NUM_FEATURES])?,
            fc1_bias: get("fc1.bias", &[h])?,
            fc2_weight: get("fc2.weight", &[h, h])?,
            fc2_bias: get("fc2.bias", &[h])?,
            fc3_weight: get("fc3.weight", &[1, h])?,
            fc3_bias: get("fc3.bias", &[1])?[0],
        };
        let indexing = file_indexing(&ckpt.metadata, path)?;
        let scorer = Self::from_params(&params).map_err(|e| match e {
            Error::InvalidRequest(m) => meta_err(m),
            other => other,
        })?;
        Ok(scorer.with_indexing(indexing))
    }

    /// Builds a scorer from raw parameters; the hidden size comes from `fc1_bias`.
    ///
    /// ```
    /// use recall::memory::selector::{MarginalModel, MarginalScorer, ScorerParams};
    /// let h = 4;
    /// let p = ScorerParams {
    ///     feature_mean: vec![0.0; 28],
    ///     feature_std: vec![1.0; 28],
    ///     fc1_weight: vec![0.0; h * 28],
    ///     fc1_bias: vec![0.0; h],
    ///     fc2_weight: vec![0.0; h * h],
    ///     fc2_bias: vec![0.0; h],
    ///     fc3_weight: vec![0.0; h],
    ///     fc3_bias: 0.5,
    /// };
    /// let scorer = MarginalScorer::from_params(&p)?;
    /// assert_eq!(scorer.score(&[1.0; 28]), 0.5);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn from_params(p: &ScorerParams) -> Result<Self> {
        let h = p.fc1_bias.len();
        let check = |name: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(bad_params(format!(
                    "{name} has {got} values, expected {want} (hidden {h})"
                )))
            }
        };
        if h == 0 {
            return Err(bad_params("hidden size 0".into()));
        }
        check("feature_mean", p.feature_mean.len(), NUM_FEATURES)?;
        check("feature_std", p.feature_std.len(), NUM_FEATURES)?;
        check("fc1.weight", p.fc1_weight.len(), h * NUM_FEATURES)?;
        check("fc2.weight", p.fc2_weight.len(), h * h)?;
        check("fc2.bias", p.fc2_bias.len(), h)?;
        check("fc3.weight", p.fc3_weight.len(), h)?;
        let mut mean = [0f64; NUM_FEATURES];
        let mut std = [0f64; NUM_FEATURES];
        for i in 0..NUM_FEATURES {
            mean[i] = p.feature_mean[i] as f64;
            std[i] = p.feature_std[i] as f64;
            if !(mean[i].is_finite() && std[i].is_finite() && std[i] > 0.0) {
                return Err(bad_params(format!(
                    "feature {} ({}) has mean {} / std {}; std must be finite and > 0",
                    i, FEATURE_NAMES[i], mean[i], std[i]
                )));
            }
        }
        let padded = h.div_ceil(LANES) * LANES;
        let blocks = padded / LANES;
        let mut w1 = vec![[0f32; LANES]; blocks * NUM_FEATURES];
        let mut w2 = vec![[0f32; LANES]; blocks * padded];
        for j in 0..h {
            let (b, l) = (j / LANES, j % LANES);
            for k in 0..NUM_FEATURES {
                w1[b * NUM_FEATURES + k][l] = p.fc1_weight[j * NUM_FEATURES + k];
            }
            for k in 0..h {
                w2[b * padded + k][l] = p.fc2_weight[j * h + k];
            }
        }
        let pad = |v: &[f32]| {
            let mut out = v.to_vec();
            out.resize(padded, 0.0);
            out
        };
        Ok(MarginalScorer {
            hidden: h,
            padded,
            mean,
            std,
            w1,
            b1: pad(&p.fc1_bias),
            w2,
            b2: pad(&p.fc2_bias),
            w3: pad(&p.fc3_weight),
            b3: p.fc3_bias,
            indexing: EventIndexing::default(),
        })
    }

    /// The hidden width `H`.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// How the features this scorer was trained on count ages (the file's `event_indexing`).
    pub fn indexing(&self) -> EventIndexing {
        self.indexing
    }

    /// The same scorer, told its features count ages with `indexing`.
    pub fn with_indexing(mut self, indexing: EventIndexing) -> Self {
        self.indexing = indexing;
        self
    }

    /// Scores up to `ROWS` rows (the rest of the block is padding).
    fn block(
        &self,
        rows: &[[f32; NUM_FEATURES]],
        h1: &mut [[f32; ROWS]],
        h2: &mut [[f32; ROWS]],
    ) -> [f32; ROWS] {
        let mut x = [[0f32; ROWS]; NUM_FEATURES];
        for (r, row) in rows.iter().enumerate().take(ROWS) {
            for k in 0..NUM_FEATURES {
                x[k][r] = ((row[k] as f64 - self.mean[k]) / self.std[k]) as f32;
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { self.block_avx2(&x, h1, h2) };
            }
        }
        self.block_generic::<false>(&x, h1, h2)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_avx2(
        &self,
        x: &[[f32; ROWS]; NUM_FEATURES],
        h1: &mut [[f32; ROWS]],
        h2: &mut [[f32; ROWS]],
    ) -> [f32; ROWS] {
        dense_avx2(x, &self.w1, NUM_FEATURES, &self.b1, h1);
        dense_avx2(h1, &self.w2, self.padded, &self.b2, h2);
        self.readout::<true>(h2)
    }

    #[inline(always)]
    fn block_generic<const FMA: bool>(
        &self,
        x: &[[f32; ROWS]; NUM_FEATURES],
        h1: &mut [[f32; ROWS]],
        h2: &mut [[f32; ROWS]],
    ) -> [f32; ROWS] {
        dense::<FMA>(x, &self.w1, NUM_FEATURES, &self.b1, h1);
        dense::<FMA>(h1, &self.w2, self.padded, &self.b2, h2);
        self.readout::<FMA>(h2)
    }

    #[inline(always)]
    fn readout<const FMA: bool>(&self, h2: &[[f32; ROWS]]) -> [f32; ROWS] {
        let mut out = [0f32; ROWS];
        for (hj, &wj) in h2.iter().zip(&self.w3) {
            for r in 0..ROWS {
                out[r] = madd::<FMA>(out[r], hj[r], wj);
            }
        }
        out.map(|v| v + self.b3)
    }
}

impl MarginalModel for MarginalScorer {
    fn score(&self, features: &[f32; NUM_FEATURES]) -> f32 {
        let mut h1 = vec![[0f32; ROWS]; self.padded];
        let mut h2 = vec![[0f32; ROWS]; self.padded];
        self.block(std::slice::from_ref(features), &mut h1, &mut h2)[0]
    }

    /// Rows are independent, so large batches are split over rayon's threads (in chunks of 16 rows)
    /// without changing any result.
    fn score_batch(&self, rows: &[[f32; NUM_FEATURES]], out: &mut Vec<f32>) {
        use rayon::prelude::*;
        const PAR_CHUNK: usize = 4 * ROWS;
        out.clear();
        out.resize(rows.len(), 0.0);
        let run = |rows: &[[f32; NUM_FEATURES]], out: &mut [f32]| {
            let mut h1 = vec![[0f32; ROWS]; self.padded];
            let mut h2 = vec![[0f32; ROWS]; self.padded];
            for (chunk, dst) in rows.chunks(ROWS).zip(out.chunks_mut(ROWS)) {
                let scores = self.block(chunk, &mut h1, &mut h2);
                dst.copy_from_slice(&scores[..chunk.len()]);
            }
        };
        if rows.len() >= 2 * PAR_CHUNK && rayon::current_num_threads() > 1 {
            rows.par_chunks(PAR_CHUNK)
                .zip(out.par_chunks_mut(PAR_CHUNK))
                .for_each(|(r, o)| run(r, o));
        } else {
            run(rows, out);
        }
    }
}
