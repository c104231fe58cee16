//! [`PreprocessConfig`]: the image processor settings of a checkpoint (`preprocessor_config.json`).

use std::path::Path;

use crate::error::{Error, Result};

/// OpenAI CLIP mean (Qwen2-VL / Qwen2.5-VL), as in HF's `OPENAI_CLIP_MEAN` (same decimal literals).
#[allow(clippy::excessive_precision)]
pub const CLIP_MEAN: [f32; 3] = [0.48145466, 0.4578275, 0.40821073];
/// OpenAI CLIP std (Qwen2-VL / Qwen2.5-VL), as in HF's `OPENAI_CLIP_STD` (same decimal literals).
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.26862954, 0.26130258, 0.27577711];

/// Image processor settings (HF `Qwen2VLImageProcessor`).
///
/// Built from a family default ([`PreprocessConfig::qwen3_vl`], [`PreprocessConfig::qwen2_5_vl`]) or read
/// from a checkpoint's `preprocessor_config.json` ([`PreprocessConfig::from_file`]); the pixel budget can be
/// overridden with [`PreprocessConfig::with_pixels`] (GUI-Owl uses `min = max = 2_621_440`).
///
/// ```
/// use recall::vision::PreprocessConfig;
///
/// let json = r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14}"#;
/// let cfg = PreprocessConfig::from_json_str(json, "preprocessor_config.json").unwrap();
/// assert_eq!((cfg.min_pixels, cfg.max_pixels, cfg.factor()), (3136, 12845056, 28));
/// let owl = PreprocessConfig::qwen3_vl().with_pixels(2_621_440, 2_621_440);
/// assert_eq!(owl.factor(), 32);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessConfig {
    /// Spatial patch size of the vision encoder (16 for Qwen3-VL, 14 for Qwen2.5-VL).
    pub patch_size: usize,
    /// Spatial merge size (2): `merge_size²` patches become one language-model token.
    pub merge_size: usize,
    /// Temporal patch size (2): an image is repeated this many times along time.
    pub temporal_patch_size: usize,
    /// Per-channel mean, in `[0, 1]` units.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation, in `[0, 1]` units.
    pub image_std: [f32; 3],
    /// Lower bound on resized `height * width` (`size.shortest_edge` / `min_pixels`).
    pub min_pixels: usize,
    /// Upper bound on resized `height * width` (`size.longest_edge` / `max_pixels`).
    pub max_pixels: usize,
    /// Rescale factor applied before normalising (HF default `1/255`).
    pub rescale_factor: f64,
}

impl Default for PreprocessConfig {
    /// HF's class defaults of `Qwen2VLImageProcessor`: [`PreprocessConfig::qwen2_5_vl`] except
    /// `max_pixels = 28 * 28 * 1280` (the shipped Qwen2.5-VL config raises it to 12,845,056).
    fn default() -> Self {
        Self::qwen2_5_vl().with_pixels(56 * 56, 28 * 28 * 1280)
    }
}

impl PreprocessConfig {
    /// Qwen3-VL (and GUI-Owl-1.5): patch 16, merge 2, temporal 2, mean/std 0.5, pixels in
    /// `[65_536, 16_777_216]` (the shipped `preprocessor_config.json`).
    ///
    /// ```
    /// assert_eq!(recall::vision::PreprocessConfig::qwen3_vl().patch_size, 16);
    /// ```
    pub fn qwen3_vl() -> Self {
        Self {
            patch_size: 16,
            merge_size: 2,
            temporal_patch_size: 2,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            rescale_factor: 1.0 / 255.0,
        }
    }

    /// Qwen2.5-VL: patch 14, merge 2, temporal 2, CLIP mean/std, pixels in `[3136, 12_845_056]` (the shipped
    /// `preprocessor_config.json`).
    ///
    /// ```
    /// assert_eq!(recall::vision::PreprocessConfig::qwen2_5_vl().factor(), 28);
    /// ```
    pub fn qwen2_5_vl() -> Self {
        Self {
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            min_pixels: 56 * 56,
            max_pixels: 12_845_056,
            rescale_factor: 1.0 / 255.0,
        }
    }

    /// Override the pixel budget (`min_pixels`, `max_pixels`).
    ///
    /// ```
    /// let cfg = recall::vision::PreprocessConfig::qwen3_vl().with_pixels(2_621_440, 2_621_440);
    /// assert_eq!(cfg.min_pixels, cfg.max_pixels);
    /// ```
    pub fn with_pixels(mut self, min_pixels: usize, max_pixels: usize) -> Self {
        self.min_pixels = min_pixels;
        self.max_pixels = max_pixels;
        self
    }

    /// `patch_size * merge_size`: both resized sides are multiples of it.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// The merged tokens an image of `height` × `width` pixels becomes (after `smart_resize`), without
    /// resizing it: what a server checks against the context before encoding anything.
    ///
    /// ```
    /// let cfg = recall::vision::PreprocessConfig::qwen3_vl();
    /// // 1080x1920 resizes to 1088x1920: 68x120 patches, 34x60 merged tokens.
    /// assert_eq!(cfg.merged_tokens(1080, 1920).unwrap(), 34 * 60);
    /// ```
    pub fn merged_tokens(&self, height: usize, width: usize) -> Result<usize> {
        let (h, w) =
            crate::vision::smart_resize(height, width, self.factor(), self.min_pixels, self.max_pixels)?;
        Ok((h / self.factor()) * (w / self.factor()))
    }

    /// Read a `preprocessor_config.json`. Missing fields take HF's class defaults (Qwen2-VL values).
    ///
    /// ```no_run
    /// let cfg = recall::vision::PreprocessConfig::from_file("models/qwen3-vl-2b-instruct/preprocessor_config.json")?;
    /// assert_eq!(cfg.patch_size, 16);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = crate::limits::read_capped(path, crate::limits::MAX_CONFIG_BYTES)?;
        Self::from_json_str(&text, path)
    }

    /// Parse the JSON text of a `preprocessor_config.json`; `path` is only used in error messages.
    ///
    /// Resolution follows HF's `Qwen2VLImageProcessor.__init__`: `size.shortest_edge` /
    /// `size.longest_edge` give the pixel bounds, and top-level `min_pixels` / `max_pixels` (Qwen2.5-VL's
    /// layout), when present, win over `size`.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<Self> {
        Self::from_json_str_with_defaults(text, path, Self::default())
    }

    /// Like [`PreprocessConfig::from_json_str`] but missing fields come from `base` (e.g. a family default).
    ///
    /// ```
    /// use recall::vision::PreprocessConfig;
    ///
    /// let cfg = PreprocessConfig::from_json_str_with_defaults("{}", "x.json", PreprocessConfig::qwen3_vl())
    ///     .unwrap();
    /// assert_eq!(cfg, PreprocessConfig::qwen3_vl());
    /// ```
    pub fn from_json_str_with_defaults(text: &str, path: impl AsRef<Path>, base: Self) -> Result<Self> {
        let path = path.as_ref();
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::json(path, "<root>", e))?;
        let obj = v
            .as_object()
            .ok_or_else(|| Error::json(path, "<root>", "expected a JSON object"))?;
        let mut cfg = base;
        let uint = |field: &str, val: &serde_json::Value| -> Result<usize> {
            val.as_u64().map(|x| x as usize).ok_or_else(|| {
                Error::json(path, field, format!("expected a non-negative integer, got {val}"))
            })
        };
        let triple = |field: &str, val: &serde_json::Value| -> Result<[f32; 3]> {
            let arr = val.as_array().filter(|a| a.len() == 3).ok_or_else(|| {
                Error::json(path, field, format!("expected an array of 3 numbers, got {val}"))
            })?;
            let mut out = [0f32; 3];
            for (o, x) in out.iter_mut().zip(arr) {
                *o = x
                    .as_f64()
                    .ok_or_else(|| Error::json(path, field, format!("expected a number, got {x}")))?
                    as f32;
            }
            Ok(out)
        };
        if let Some(x) = obj.get("patch_size") {
            cfg.patch_size = uint("patch_size", x)?;
        }
        if let Some(x) = obj.get("merge_size") {
            cfg.merge_size = uint("merge_size", x)?;
        }
        if let Some(x) = obj.get("temporal_patch_size") {
            cfg.temporal_patch_size = uint("temporal_patch_size", x)?;
        }
        if let Some(x) = obj.get("image_mean") {
            cfg.image_mean = triple("image_mean", x)?;
        }
        if let Some(x) = obj.get("image_std") {
            cfg.image_std = triple("image_std", x)?;
        }
        if let Some(x) = obj.get("rescale_factor") {
            cfg.rescale_factor = x
                .as_f64()
                .ok_or_else(|| Error::json(path, "rescale_factor", format!("expected a number, got {x}")))?;
        }
        if let Some(size) = obj.get("size") {
            let size = size
                .as_object()
                .ok_or_else(|| Error::json(path, "size", format!("expected an object, got {size}")))?;
            if let Some(x) = size.get("shortest_edge") {
                cfg.min_pixels = uint("size.shortest_edge", x)?;
            }
            if let Some(x) = size.get("longest_edge") {
                cfg.max_pixels = uint("size.longest_edge", x)?;
            }
        }
        if let Some(x) = obj.get("min_pixels").filter(|x| !x.is_null()) {
            cfg.min_pixels = uint("min_pixels", x)?;
        }
        if let Some(x) = obj.get("max_pixels").filter(|x| !x.is_null()) {
            cfg.max_pixels = uint("max_pixels", x)?;
        }
        for (field, on) in [("do_resize", true), ("do_rescale", true), ("do_normalize", true)] {
            if obj.get(field).and_then(|x| x.as_bool()) == Some(!on) {
                return Err(Error::json(
                    path,
                    field,
                    "recall only supports the Qwen-VL default `true`",
                ));
            }
        }
        cfg.validate().map_err(|e| Error::json(path, "<root>", e))?;
        Ok(cfg)
    }

    /// Check the settings are usable (non-zero sizes, positive std, `min_pixels <= max_pixels`).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| {
            Err(Error::InvalidRequest(format!(
                "invalid preprocessing config: {m}"
            )))
        };
        if self.patch_size == 0 || self.merge_size == 0 || self.temporal_patch_size == 0 {
            return bad(format!(
                "patch_size {}, merge_size {}, temporal_patch_size {} must all be positive",
                self.patch_size, self.merge_size, self.temporal_patch_size
            ));
        }
        if self.min_pixels == 0 || self.min_pixels > self.max_pixels {
            return bad(format!(
                "need 0 < min_pixels <= max_pixels, got min_pixels {} and max_pixels {}",
                self.min_pixels, self.max_pixels
            ));
        }
        let not_positive = |x: f64| x.is_nan() || x <= 0.0;
        if self.image_std.iter().any(|&s| not_positive(s as f64)) || not_positive(self.rescale_factor) {
            return bad(format!(
                "image_std {:?} and rescale_factor {} must be positive",
                self.image_std, self.rescale_factor
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for PreprocessConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "patch {} merge {} temporal {} pixels [{}, {}]",
            self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels, self.max_pixels
        )
    }
}
