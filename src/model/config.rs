//! Model configuration read from a Hugging Face `config.json` (and `generation_config.json`).
//!
//! Two layouts are accepted: `qwen3_vl` (text settings nested under `text_config`) and `qwen2_5_vl`
//! (flat, or nested under `text_config` as newer transformers write it). RoPE settings may be under
//! `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x). The config is immutable once parsed.
//!
//! Parsing runs in two steps, so that "is the document well-typed" and "do its values make a model"
//! are each answered in one place:
//!
//! 1. **Reader.** The `Raw*` structs mirror the document and are filled by serde: every field is
//!    optional (`null` reads as absent), unknown keys are ignored, and each field goes through a helper
//!    of `de` whose message says what was expected and what was found. `serde_path_to_error` names
//!    the field's path in the document (`text_config.hidden_size`). The text keys are read twice into
//!    the same `RawText`, from `text_config` and from the top level (Qwen2.5-VL's flat layout), and
//!    merged field by field with `text_config` winning. A known key is type-checked wherever it is,
//!    even where another place or spelling takes precedence over it.
//! 2. **Validation.** `RawConfig::validate` and `RawVision::validate` fill in the family's defaults
//!    (transformers' class defaults), report missing fields, and check the values against each other
//!    (key/value heads divide the heads, the M-RoPE sections sum to `head_dim / 2`, ...).
//!
//! Before either, `Family::of_document` identifies the document, so that a checkpoint of another
//! architecture is reported as unsupported whatever its other fields hold.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// The architecture family of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Qwen3-VL (and GUI-Owl-1.5): q/k RMSNorm, no biases, interleaved M-RoPE.
    Qwen3Vl,
    /// Qwen2.5-VL: q/k/v biases, chunked M-RoPE.
    Qwen25Vl,
}

/// Settings of the text decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Frequencies given to the temporal, height and width position rows.
    pub mrope_section: [usize; 3],
    /// Qwen3-VL interleaves the sections (t,h,w,t,h,w,...); Qwen2.5-VL concatenates them.
    pub mrope_interleaved: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Biases on the q/k/v projections (Qwen2.5).
    pub qkv_bias: bool,
    pub max_position_embeddings: usize,
}

/// A parsed `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub text: TextConfig,
    /// The vision tower's settings (`vision_config`).
    pub vision: Option<VisionConfig>,
    pub image_token_id: Option<u32>,
    pub video_token_id: Option<u32>,
    pub vision_start_token_id: Option<u32>,
    pub vision_end_token_id: Option<u32>,
    /// Token ids that end generation (generation_config.json, else config.json).
    pub eos_token_ids: Vec<u32>,
}

/// Settings of a vision tower (`vision_config` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// Width of the merged tokens (the decoder's hidden size).
    pub out_hidden_size: usize,
    pub rope_theta: f32,
    /// Qwen3-VL: side² of the learned position-embedding grid.
    pub num_position_embeddings: usize,
    /// Qwen3-VL: blocks whose output also feeds a deepstack merger.
    pub deepstack_visual_indexes: Vec<usize>,
    /// Qwen2.5-VL: window side in pixels.
    pub window_size: usize,
    /// Qwen2.5-VL: blocks with full (not windowed) attention.
    pub fullatt_block_indexes: Vec<usize>,
}

impl ModelConfig {
    /// Reads `dir/config.json` and, when present, `dir/generation_config.json`.
    ///
    /// ```no_run
    /// let cfg = recall::model::ModelConfig::from_dir(std::path::Path::new("models/qwen3-vl-2b-instruct"))?;
    /// assert_eq!(cfg.text.num_hidden_layers, 28);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::limits::read_capped(&path, crate::limits::MAX_CONFIG_BYTES)?;
        let mut cfg = Self::from_json(&text, &path)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let gen = crate::limits::read_capped(&gen_path, crate::limits::MAX_CONFIG_BYTES)?;
            let root: Value = serde_json::from_str(&gen).map_err(|e| Error::json(&gen_path, "", e))?;
            let gen: RawGeneration = read(&root, &gen_path)?;
            if let Some(ids) = gen.eos_token_id {
                cfg.eos_token_ids = ids;
            }
        }
        Ok(cfg)
    }

    /// Parses the text of a `config.json`; `path` is used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| Error::json(path, "", e))?;
        let family = Family::of_document(&root, path)?;
        RawConfig::read(&root, path)?.validate(family, path)
    }
}

impl VisionConfig {
    /// The checks between fields that no single field's type expresses.
    fn check(&self, path: &Path) -> Result<()> {
        let bad = |k: &str, msg: String| Err(Error::json(path, format!("vision_config.{k}"), msg));
        if self.num_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_heads)
            || !(self.hidden_size / self.num_heads).is_multiple_of(4)
        {
            return bad(
                "num_heads",
                format!(
                    "{} heads do not split hidden_size {} into a multiple of 4",
                    self.num_heads, self.hidden_size
                ),
            );
        }
        if self.spatial_merge_size == 0 || self.patch_size == 0 {
            return bad(
                "spatial_merge_size",
                "patch and merge sizes must be positive".into(),
            );
        }
        if let Some(&i) = self
            .deepstack_visual_indexes
            .iter()
            .chain(&self.fullatt_block_indexes)
            .find(|&&i| i >= self.depth)
        {
            return bad(
                "deepstack_visual_indexes",
                format!("block {i} is beyond depth {}", self.depth),
            );
        }
        let side = (self.num_position_embeddings as f64).sqrt() as usize;
        if self.num_position_embeddings > 0 && side * side != self.num_position_embeddings {
            return bad(
                "num_position_embeddings",
                format!("{} is not a square", self.num_position_embeddings),
            );
        }
        Ok(())
    }

    /// Head dimension of the vision attention.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Length of one flattened patch: channels × temporal × patch × patch.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches that merge into one LLM token.
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

impl Family {
    /// The family named by the document's `model_type`. Checked before the reader runs, so that a
    /// checkpoint of another architecture (whose fields may well not type-check as ours) is reported as
    /// [`Error::UnsupportedModel`], and a Qwen3-VL document without `text_config` as such.
    fn of_document(root: &Value, path: &Path) -> Result<Family> {
        if !root.is_object() {
            return Err(Error::json(path, "", "the document is not a JSON object"));
        }
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::json(path, "model_type", "missing or not a string"))?;
        let family = match model_type {
            "qwen3_vl" => Family::Qwen3Vl,
            "qwen2_5_vl" => Family::Qwen25Vl,
            other => {
                return Err(Error::UnsupportedModel {
                    path: PathBuf::from(path),
                    model_type: other.to_string(),
                })
            }
        };
        // Any value counts as present here (a non-object reads as empty below), as it always has.
        if family == Family::Qwen3Vl && root.get("text_config").is_none() {
            return Err(Error::json(
                path,
                "text_config",
                "missing (qwen3_vl nests the decoder settings there)",
            ));
        }
        Ok(family)
    }
}

// ---------------------------------------------------------------------------------------------------
// Step 1: the reader.

/// Deserializes `T` from `v`, the top level of the document at `path`; a type error names the
/// field's full path. A `v` that is not an object reads as an empty one: a lookup in it finds
/// nothing, as it did before there was a reader.
fn read<T: DeserializeOwned + Default>(v: &Value, path: &Path) -> Result<T> {
    if !v.is_object() {
        return Ok(T::default());
    }
    serde_path_to_error::deserialize(v).map_err(|e| Error::json(path, e.path().to_string(), e.into_inner()))
}

/// The top-level keys of `config.json` other than the decoder's (those are read into a [`RawText`]).
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawTop {
    #[serde(deserialize_with = "de::scope")]
    text_config: Option<RawText>,
    #[serde(deserialize_with = "de::scope")]
    vision_config: Option<RawVision>,
    #[serde(deserialize_with = "de::uint")]
    image_token_id: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    video_token_id: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    vision_start_token_id: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    vision_end_token_id: Option<usize>,
}

/// The decoder's keys, as found in `text_config` or at the top level.
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawText {
    #[serde(deserialize_with = "de::uint")]
    vocab_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    hidden_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    intermediate_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    num_hidden_layers: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    num_attention_heads: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    num_key_value_heads: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    head_dim: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    max_position_embeddings: Option<usize>,
    #[serde(deserialize_with = "de::number")]
    rms_norm_eps: Option<f32>,
    /// transformers 4.x; 5.x moved it into `rope_parameters`.
    #[serde(deserialize_with = "de::number")]
    rope_theta: Option<f32>,
    #[serde(deserialize_with = "de::boolean")]
    attention_bias: Option<bool>,
    #[serde(deserialize_with = "de::token_ids")]
    eos_token_id: Option<Vec<u32>>,
    #[serde(deserialize_with = "de::object")]
    rope_parameters: Option<RawRope>,
    #[serde(deserialize_with = "de::object")]
    rope_scaling: Option<RawRope>,
}

/// `rope_parameters` / `rope_scaling` of the decoder. Inside this object `null` is not "absent" but a
/// bad value, as it always was.
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawRope {
    #[serde(deserialize_with = "de::strict_number")]
    rope_theta: Option<f32>,
    #[serde(deserialize_with = "de::mrope_section")]
    mrope_section: Option<[usize; 3]>,
    #[serde(deserialize_with = "de::strict_boolean")]
    mrope_interleaved: Option<bool>,
}

/// `vision_config`. The `*_alt` fields are older spellings; they cannot be serde aliases because real
/// checkpoints carry both (Qwen2.5-VL has `patch_size` and `spatial_patch_size`), which serde would
/// refuse as a duplicate field.
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawVision {
    #[serde(deserialize_with = "de::uint")]
    depth: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    hidden_size: Option<usize>,
    #[serde(rename = "embed_dim", deserialize_with = "de::uint")]
    hidden_size_alt: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    intermediate_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    num_heads: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    in_channels: Option<usize>,
    #[serde(rename = "in_chans", deserialize_with = "de::uint")]
    in_channels_alt: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    patch_size: Option<usize>,
    #[serde(rename = "spatial_patch_size", deserialize_with = "de::uint")]
    patch_size_alt: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    temporal_patch_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    spatial_merge_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    out_hidden_size: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    num_position_embeddings: Option<usize>,
    #[serde(deserialize_with = "de::uint")]
    window_size: Option<usize>,
    #[serde(deserialize_with = "de::uint_list")]
    deepstack_visual_indexes: Option<Vec<usize>>,
    #[serde(deserialize_with = "de::uint_list")]
    fullatt_block_indexes: Option<Vec<usize>>,
    /// A `rope_parameters` that is not an object is ignored (the default theta applies).
    #[serde(deserialize_with = "de::scope")]
    rope_parameters: Option<RawVisionRope>,
}

/// `vision_config.rope_parameters`: only the theta is read.
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawVisionRope {
    #[serde(deserialize_with = "de::strict_number")]
    rope_theta: Option<f32>,
}

/// `generation_config.json`: only the end-of-generation ids are read.
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawGeneration {
    #[serde(deserialize_with = "de::token_ids")]
    eos_token_id: Option<Vec<u32>>,
}

/// The whole of `config.json` as read: the decoder's keys merged from both places.
struct RawConfig {
    top: RawTop,
    /// `text_config`'s decoder keys, each falling back to the top level's.
    text: RawText,
    /// The RoPE object in effect and its path in the document (for error messages).
    rope: Option<(&'static str, RawRope)>,
}

impl RawConfig {
    /// Reads the document `root` (an object). The top level is read twice, once for its own keys and
    /// once for the decoder keys of the flat layout.
    fn read(root: &Value, path: &Path) -> Result<Self> {
        let mut top: RawTop = read(root, path)?;
        let mut flat: RawText = read(root, path)?;
        let mut nested = top.text_config.take().unwrap_or_default();
        // transformers 5's `rope_parameters` wins over 4.x's `rope_scaling` wherever either is.
        let rope = [
            ("text_config.rope_parameters", nested.rope_parameters.take()),
            ("rope_parameters", flat.rope_parameters.take()),
            ("text_config.rope_scaling", nested.rope_scaling.take()),
            ("rope_scaling", flat.rope_scaling.take()),
        ]
        .into_iter()
        .find_map(|(field, rope)| Some((field, rope?)));
        Ok(RawConfig {
            top,
            text: nested.or(flat),
            rope,
        })
    }
}

impl RawText {
    /// Each of `self`'s fields, else `other`'s (the RoPE objects are taken out before).
    fn or(self, other: RawText) -> RawText {
        RawText {
            vocab_size: self.vocab_size.or(other.vocab_size),
            hidden_size: self.hidden_size.or(other.hidden_size),
            intermediate_size: self.intermediate_size.or(other.intermediate_size),
            num_hidden_layers: self.num_hidden_layers.or(other.num_hidden_layers),
            num_attention_heads: self.num_attention_heads.or(other.num_attention_heads),
            num_key_value_heads: self.num_key_value_heads.or(other.num_key_value_heads),
            head_dim: self.head_dim.or(other.head_dim),
            max_position_embeddings: self.max_position_embeddings.or(other.max_position_embeddings),
            rms_norm_eps: self.rms_norm_eps.or(other.rms_norm_eps),
            rope_theta: self.rope_theta.or(other.rope_theta),
            attention_bias: self.attention_bias.or(other.attention_bias),
            eos_token_id: self.eos_token_id.or(other.eos_token_id),
            rope_parameters: None,
            rope_scaling: None,
        }
    }
}

/// The `deserialize_with` helpers of the reader. Each reads the value whole (as a [`Value`]) so that
/// its message can quote it; the messages are those of the hand-written readers before this one.
mod de {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::value::MapAccessDeserializer;
    use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};
    use serde_json::Value;

    /// `null` (or a missing key) is absent; otherwise `convert` or fail with `expected {what}, found …`.
    fn optional<'de, D: Deserializer<'de>, T>(
        d: D,
        what: &str,
        convert: impl FnOnce(&Value) -> Option<T>,
    ) -> Result<Option<T>, D::Error> {
        match Value::deserialize(d)? {
            Value::Null => Ok(None),
            v => convert(&v)
                .map(Some)
                .ok_or_else(|| D::Error::custom(format!("expected {what}, found {v}"))),
        }
    }

    /// Any value present, `null` included, must convert; otherwise fail with `message(value)`.
    fn required<'de, D: Deserializer<'de>, T>(
        d: D,
        convert: impl FnOnce(&Value) -> Option<T>,
        message: impl FnOnce(&Value) -> String,
    ) -> Result<Option<T>, D::Error> {
        let v = Value::deserialize(d)?;
        convert(&v).map(Some).ok_or_else(|| D::Error::custom(message(&v)))
    }

    fn as_usize(v: &Value) -> Option<usize> {
        v.as_u64().map(|n| n as usize)
    }

    fn as_usizes(v: &Value) -> Option<Vec<usize>> {
        v.as_array()?.iter().map(as_usize).collect()
    }

    pub fn uint<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
        optional(d, "a non-negative integer", as_usize)
    }

    pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
        optional(d, "a number", |v| v.as_f64().map(|n| n as f32))
    }

    pub fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        optional(d, "a boolean", Value::as_bool)
    }

    pub fn uint_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<usize>>, D::Error> {
        optional(d, "a list of integers", as_usizes)
    }

    /// Token ids given as an integer or a list of integers (ids above `u32::MAX` wrap, as before).
    pub fn token_ids<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
        optional(d, "a token id or a list of ids", |v| match v {
            Value::Number(n) => n.as_u64().map(|n| vec![n as u32]),
            Value::Array(a) => a.iter().map(|x| x.as_u64().map(|n| n as u32)).collect(),
            _ => None,
        })
    }

    pub fn strict_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
        required(d, |v| v.as_f64().map(|n| n as f32), |_| "not a number".into())
    }

    pub fn strict_boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        required(d, Value::as_bool, |_| "not a boolean".into())
    }

    pub fn mrope_section<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[usize; 3]>, D::Error> {
        required(
            d,
            |v| as_usizes(v)?.try_into().ok(),
            |v| format!("expected three integers, found {v}"),
        )
    }

    /// An object read into `T` (its fields' paths tracked); `null` is absent; anything else is an error.
    pub fn object<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        d.deserialize_any(ObjectVisitor::<T>(false, PhantomData))
    }

    /// A nested scope (`text_config`, `vision_config`): like [`object`], but any other value reads as
    /// an empty object, in which every lookup finds nothing.
    pub fn scope<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        d.deserialize_any(ObjectVisitor::<T>(true, PhantomData))
    }

    /// Hands a map on to `T` without buffering it, which keeps `serde_path_to_error`'s path tracking
    /// inside it; `.0` says whether a non-object reads as empty (`true`) or is refused.
    struct ObjectVisitor<T>(bool, PhantomData<T>);

    impl<T: Default> ObjectVisitor<T> {
        fn other<E: Error>(self, v: Value) -> Result<Option<T>, E> {
            if self.0 {
                Ok(Some(T::default()))
            } else {
                Err(E::custom(format!("expected an object, found {v}")))
            }
        }
    }

    impl<'de, T: Deserialize<'de> + Default> Visitor<'de> for ObjectVisitor<T> {
        type Value = Option<T>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object")
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            T::deserialize(MapAccessDeserializer::new(map)).map(Some)
        }

        fn visit_unit<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_bool<E: Error>(self, b: bool) -> Result<Self::Value, E> {
            self.other(Value::from(b))
        }

        fn visit_i64<E: Error>(self, n: i64) -> Result<Self::Value, E> {
            self.other(Value::from(n))
        }

        fn visit_u64<E: Error>(self, n: u64) -> Result<Self::Value, E> {
            self.other(Value::from(n))
        }

        fn visit_f64<E: Error>(self, n: f64) -> Result<Self::Value, E> {
            self.other(Value::from(n))
        }

        fn visit_str<E: Error>(self, s: &str) -> Result<Self::Value, E> {
            self.other(Value::from(s))
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element::<Value>()? {
                items.push(item);
            }
            self.other(Value::Array(items))
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Step 2: validation.

/// A required field's value, else a `missing` error naming `field`.
fn need<T>(v: Option<T>, path: &Path, field: &str) -> Result<T> {
    v.ok_or_else(|| Error::json(path, field, "missing"))
}

impl RawConfig {
    /// Defaults, required fields and the checks between fields; a missing decoder field is named under
    /// `text_config` whichever layout the document has.
    fn validate(self, family: Family, path: &Path) -> Result<ModelConfig> {
        let text = validate_text(&self.text, self.rope, family, path)?;
        let top = self.top;
        let vision = top.vision_config.map(|v| v.validate(family, path)).transpose()?;
        // Token ids above u32::MAX wrap, as they always have.
        let id = |v: Option<usize>| v.map(|v| v as u32);
        Ok(ModelConfig {
            family,
            text,
            vision,
            image_token_id: id(top.image_token_id),
            video_token_id: id(top.video_token_id),
            vision_start_token_id: id(top.vision_start_token_id),
            vision_end_token_id: id(top.vision_end_token_id),
            eos_token_ids: self.text.eos_token_id.unwrap_or_default(),
        })
    }
}

/// The decoder's settings. The defaults are transformers' class defaults, used only when the file
/// omits the field.
fn validate_text(
    t: &RawText,
    rope: Option<(&str, RawRope)>,
    family: Family,
    path: &Path,
) -> Result<TextConfig> {
    let qwen3 = family == Family::Qwen3Vl;
    let hidden_size = need(t.hidden_size, path, "text_config.hidden_size")?;
    let heads = need(t.num_attention_heads, path, "text_config.num_attention_heads")?;
    let kv_heads = t.num_key_value_heads.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(Error::json(
            path,
            "text_config.num_key_value_heads",
            format!("{kv_heads} key/value heads do not divide {heads} attention heads"),
        ));
    }
    let head_dim = t.head_dim.unwrap_or(hidden_size / heads);
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(Error::json(
            path,
            "text_config.head_dim",
            format!("{head_dim} is not a positive even number"),
        ));
    }
    let (rope_field, rope) = rope.unwrap_or_default();
    let rope_theta =
        rope.rope_theta
            .or(t.rope_theta)
            .unwrap_or(if qwen3 { 5_000_000.0 } else { 1_000_000.0 });
    let mrope_section = rope
        .mrope_section
        .unwrap_or(if qwen3 { [24, 20, 20] } else { [16, 24, 24] });
    // Summed without wrapping, so that huge sections cannot pass for a small sum.
    let sum = mrope_section
        .iter()
        .try_fold(0usize, |sum, &s| sum.checked_add(s));
    if sum != Some(head_dim / 2) {
        return Err(Error::json(
            path,
            format!("{rope_field}.mrope_section"),
            format!(
                "{mrope_section:?} does not sum to head_dim / 2 = {}",
                head_dim / 2
            ),
        ));
    }
    Ok(TextConfig {
        vocab_size: need(t.vocab_size, path, "text_config.vocab_size")?,
        hidden_size,
        intermediate_size: need(t.intermediate_size, path, "text_config.intermediate_size")?,
        num_hidden_layers: need(t.num_hidden_layers, path, "text_config.num_hidden_layers")?,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        rms_norm_eps: t.rms_norm_eps.unwrap_or(if qwen3 { 1e-6 } else { 1e-5 }),
        rope_theta,
        mrope_section,
        // Qwen3-VL's rotary embedding always interleaves; Qwen2.5-VL always concatenates.
        mrope_interleaved: rope.mrope_interleaved.unwrap_or(qwen3),
        qk_norm: qwen3,
        // Qwen2.5-VL always has the biases, whatever the file says.
        qkv_bias: !qwen3 || t.attention_bias.unwrap_or(false),
        max_position_embeddings: t
            .max_position_embeddings
            .unwrap_or(if qwen3 { 128_000 } else { 32_768 }),
    })
}

impl RawVision {
    /// The vision tower's settings: defaults (family-dependent where the families differ), the older
    /// spellings as fallbacks, then [`VisionConfig::check`].
    fn validate(self, family: Family, path: &Path) -> Result<VisionConfig> {
        let qwen3 = family == Family::Qwen3Vl;
        let need = |v: Option<usize>, k: &str| need(v, path, &format!("vision_config.{k}"));
        let cfg = VisionConfig {
            depth: need(self.depth, "depth")?,
            hidden_size: need(self.hidden_size.or(self.hidden_size_alt), "hidden_size")?,
            intermediate_size: need(self.intermediate_size, "intermediate_size")?,
            num_heads: need(self.num_heads, "num_heads")?,
            in_channels: self.in_channels.or(self.in_channels_alt).unwrap_or(3),
            patch_size: (self.patch_size.or(self.patch_size_alt)).unwrap_or(if qwen3 { 16 } else { 14 }),
            temporal_patch_size: self.temporal_patch_size.unwrap_or(2),
            spatial_merge_size: self.spatial_merge_size.unwrap_or(2),
            out_hidden_size: need(self.out_hidden_size, "out_hidden_size")?,
            rope_theta: self
                .rope_parameters
                .and_then(|r| r.rope_theta)
                .unwrap_or(10_000.0),
            num_position_embeddings: self
                .num_position_embeddings
                .unwrap_or(if qwen3 { 2304 } else { 0 }),
            deepstack_visual_indexes: self.deepstack_visual_indexes.unwrap_or_default(),
            window_size: self.window_size.unwrap_or(if qwen3 { 0 } else { 112 }),
            fullatt_block_indexes: self.fullatt_block_indexes.unwrap_or_default(),
        };
        cfg.check(path)?;
        Ok(cfg)
    }
}
