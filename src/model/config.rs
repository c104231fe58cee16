//! Model configuration read from a Hugging Face `config.json` (and `generation_config.json`).
//!
//! Two layouts are accepted: `qwen3_vl` (text settings nested under `text_config`) and `qwen2_5_vl`
//! (flat, or nested under `text_config` as newer transformers write it). RoPE settings may be under
//! `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x). The config is immutable once parsed.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::vision::VisionConfig;

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

/// Field lookup with errors that name the field's path in the document.
struct Doc<'a> {
    path: &'a Path,
    root: &'a Value,
}

impl<'a> Doc<'a> {
    /// Looks `key` up in `scopes` in order (e.g. `text_config`, then the top level).
    fn find(&self, scopes: &[&str], key: &str) -> Option<(String, &'a Value)> {
        scopes.iter().find_map(|scope| {
            let obj = if scope.is_empty() {
                Some(self.root)
            } else {
                self.root.get(*scope)
            };
            let v = obj?.get(key)?;
            let name = if scope.is_empty() {
                key.to_string()
            } else {
                format!("{scope}.{key}")
            };
            (!v.is_null()).then_some((name, v))
        })
    }

    fn err(&self, field: &str, msg: impl ToString) -> Error {
        Error::json(self.path, field, msg)
    }

    fn usize_opt(&self, scopes: &[&str], key: &str) -> Result<Option<usize>> {
        match self.find(scopes, key) {
            None => Ok(None),
            Some((name, v)) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.err(&name, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn usize(&self, scopes: &[&str], key: &str) -> Result<usize> {
        self.usize_opt(scopes, key)?
            .ok_or_else(|| self.err(format!("{}.{key}", scopes[0]).trim_start_matches('.'), "missing"))
    }

    fn f32_opt(&self, scopes: &[&str], key: &str) -> Result<Option<f32>> {
        match self.find(scopes, key) {
            None => Ok(None),
            Some((name, v)) => v
                .as_f64()
                .map(|n| Some(n as f32))
                .ok_or_else(|| self.err(&name, format!("expected a number, found {v}"))),
        }
    }

    fn bool_opt(&self, scopes: &[&str], key: &str) -> Result<Option<bool>> {
        match self.find(scopes, key) {
            None => Ok(None),
            Some((name, v)) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(&name, format!("expected a boolean, found {v}"))),
        }
    }

    /// Token ids given as an integer or a list of integers.
    fn ids_opt(&self, scopes: &[&str], key: &str) -> Result<Option<Vec<u32>>> {
        let Some((name, v)) = self.find(scopes, key) else {
            return Ok(None);
        };
        let bad = || self.err(&name, format!("expected a token id or a list of ids, found {v}"));
        match v {
            Value::Number(n) => n.as_u64().map(|n| Some(vec![n as u32])).ok_or_else(bad),
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_u64().map(|n| n as u32))
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }
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
            let doc = Doc {
                path: &gen_path,
                root: &root,
            };
            if let Some(ids) = doc.ids_opt(&[""], "eos_token_id")? {
                cfg.eos_token_ids = ids;
            }
        }
        Ok(cfg)
    }

    /// Parses the text of a `config.json`; `path` is used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| Error::json(path, "", e))?;
        if !root.is_object() {
            return Err(Error::json(path, "", "the document is not a JSON object"));
        }
        let doc = Doc { path, root: &root };
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| doc.err("model_type", "missing or not a string"))?;
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
        if family == Family::Qwen3Vl && root.get("text_config").is_none() {
            return Err(doc.err(
                "text_config",
                "missing (qwen3_vl nests the decoder settings there)",
            ));
        }
        let text = parse_text(&doc, family)?;
        let top = &[""];
        let eos = doc
            .ids_opt(&["text_config", ""], "eos_token_id")?
            .unwrap_or_default();
        Ok(ModelConfig {
            family,
            text,
            vision: root
                .get("vision_config")
                .filter(|v| !v.is_null())
                .map(|v| VisionConfig::parse(v, family, path))
                .transpose()?,
            image_token_id: doc.usize_opt(top, "image_token_id")?.map(|v| v as u32),
            video_token_id: doc.usize_opt(top, "video_token_id")?.map(|v| v as u32),
            vision_start_token_id: doc.usize_opt(top, "vision_start_token_id")?.map(|v| v as u32),
            vision_end_token_id: doc.usize_opt(top, "vision_end_token_id")?.map(|v| v as u32),
            eos_token_ids: eos,
        })
    }
}

fn parse_text(doc: &Doc, family: Family) -> Result<TextConfig> {
    let s: &[&str] = &["text_config", ""];
    let hidden_size = doc.usize(s, "hidden_size")?;
    let heads = doc.usize(s, "num_attention_heads")?;
    let kv_heads = doc.usize_opt(s, "num_key_value_heads")?.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(doc.err(
            "text_config.num_key_value_heads",
            format!("{kv_heads} key/value heads do not divide {heads} attention heads"),
        ));
    }
    let head_dim = doc.usize_opt(s, "head_dim")?.unwrap_or(hidden_size / heads);
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(doc.err(
            "text_config.head_dim",
            format!("{head_dim} is not a positive even number"),
        ));
    }
    let (rope_theta, mrope_section, interleaved) = parse_rope(doc, family, head_dim)?;
    Ok(TextConfig {
        vocab_size: doc.usize(s, "vocab_size")?,
        hidden_size,
        intermediate_size: doc.usize(s, "intermediate_size")?,
        num_hidden_layers: doc.usize(s, "num_hidden_layers")?,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        // Defaults are transformers' class defaults, used only when the file omits the field.
        rms_norm_eps: doc.f32_opt(s, "rms_norm_eps")?.unwrap_or(match family {
            Family::Qwen3Vl => 1e-6,
            Family::Qwen25Vl => 1e-5,
        }),
        rope_theta,
        mrope_section,
        mrope_interleaved: interleaved,
        qk_norm: family == Family::Qwen3Vl,
        qkv_bias: match family {
            Family::Qwen25Vl => true,
            Family::Qwen3Vl => doc.bool_opt(s, "attention_bias")?.unwrap_or(false),
        },
        max_position_embeddings: doc
            .usize_opt(s, "max_position_embeddings")?
            .unwrap_or(match family {
                Family::Qwen3Vl => 128_000,
                Family::Qwen25Vl => 32_768,
            }),
    })
}

/// RoPE settings from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4.x).
fn parse_rope(doc: &Doc, family: Family, head_dim: usize) -> Result<(f32, [usize; 3], bool)> {
    let s: &[&str] = &["text_config", ""];
    let (field, params) = match doc
        .find(s, "rope_parameters")
        .or_else(|| doc.find(s, "rope_scaling"))
    {
        Some((name, v)) if v.is_object() => (name, Some(v)),
        Some((name, v)) => return Err(doc.err(&name, format!("expected an object, found {v}"))),
        None => (String::new(), None),
    };
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => {
            v.as_f64()
                .ok_or_else(|| doc.err(&format!("{field}.rope_theta"), "not a number"))? as f32
        }
        None => doc.f32_opt(s, "rope_theta")?.unwrap_or(match family {
            Family::Qwen3Vl => 5_000_000.0,
            Family::Qwen25Vl => 1_000_000.0,
        }),
    };
    let section = match params.and_then(|p| p.get("mrope_section")) {
        Some(v) => {
            let bad = || {
                doc.err(
                    &format!("{field}.mrope_section"),
                    format!("expected three integers, found {v}"),
                )
            };
            let a = v.as_array().ok_or_else(bad)?;
            let n: Vec<usize> = a
                .iter()
                .map(|x| x.as_u64().map(|x| x as usize))
                .collect::<Option<_>>()
                .ok_or_else(bad)?;
            <[usize; 3]>::try_from(n).map_err(|_| bad())?
        }
        None => match family {
            Family::Qwen3Vl => [24, 20, 20],
            Family::Qwen25Vl => [16, 24, 24],
        },
    };
    if section.iter().sum::<usize>() != head_dim / 2 {
        return Err(doc.err(
            &format!("{field}.mrope_section"),
            format!("{section:?} does not sum to head_dim / 2 = {}", head_dim / 2),
        ));
    }
    let interleaved = match params.and_then(|p| p.get("mrope_interleaved")) {
        Some(v) => v
            .as_bool()
            .ok_or_else(|| doc.err(&format!("{field}.mrope_interleaved"), "not a boolean"))?,
        // Qwen3-VL's rotary embedding always interleaves; Qwen2.5-VL always concatenates.
        None => family == Family::Qwen3Vl,
    };
    Ok((theta, section, interleaved))
}
