//! HGKV: the history-gated K/V LoRA adapter of CausalCache.
//!
//! A LoRA on `k_proj` and `v_proj` of some decoder layers, added to the projection output (before
//! `k_norm` and RoPE): `K = W_K h + mask · scale · (h A_Kᵀ) B_Kᵀ`, likewise V. The mask is 1 exactly on
//! the merged tokens of restored history screenshots ([`AdapterMode::Gated`]), on every token
//! ([`AdapterMode::Ungated`], the paper's control), or nowhere ([`AdapterMode::Off`]). When no token
//! of a forward is masked, the adapter's code does not run at all, so the frozen model is reproduced
//! bit for bit.
//!
//! Two on-disk formats: a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`, tensors
//! `…layers.{i}.self_attn.{k,v}_proj.lora_{A,B}.weight`), and the reference trainer's tensors
//! `<module>.lora_a` `[r, in]` / `<module>.lora_b` `[out, r]` in one safetensors file whose metadata
//! carries `lora_alpha` (tools/convert_hgkv_pt.py writes it from the trainer's `.pt`). Rank, alpha
//! and layers always come from the adapter.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, TensorRef};
use crate::error::{Error, Result};
use crate::model::config::TextConfig;
use crate::model::weights::Weights;

/// Where an adapter acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum AdapterMode {
    /// The frozen model.
    #[default]
    Off,
    /// Only the merged tokens of History images (HGKV).
    Gated,
    /// Every token, generated ones included (plain LoRA).
    Ungated,
}

impl AdapterMode {
    /// The name `--adapter-mode` takes (`off`, `gated`, `ungated`).
    pub fn name(self) -> &'static str {
        match self {
            AdapterMode::Off => "off",
            AdapterMode::Gated => "gated",
            AdapterMode::Ungated => "ungated",
        }
    }
}

impl std::str::FromStr for AdapterMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(AdapterMode::Off),
            "gated" => Ok(AdapterMode::Gated),
            "ungated" => Ok(AdapterMode::Ungated),
            other => Err(Error::InvalidRequest(format!(
                "adapter mode `{other}`: expected gated, ungated or off"
            ))),
        }
    }
}

/// One low-rank update: `delta = (h Aᵀ) Bᵀ`.
pub struct LoraPair<B: Backend> {
    pub a: B::Weight, // [r, in]
    pub b: B::Weight, // [out, r]
}

/// The adapter's updates in one decoder layer.
pub struct LayerLora<B: Backend> {
    pub k: Option<LoraPair<B>>,
    pub v: Option<LoraPair<B>>,
}

/// A loaded K/V LoRA adapter.
pub struct Adapter<B: Backend> {
    /// Content hash of the adapter (rank, alpha and every tensor): part of the prefix-cache key of
    /// every token the adapter touches.
    pub id: u64,
    pub rank: usize,
    pub alpha: f32,
    /// `alpha / rank` (or `alpha / √rank` for rsLoRA).
    pub scale: f32,
    /// Per decoder layer; `None` where the adapter does not act.
    layers: Vec<Option<LayerLora<B>>>,
    pub source: PathBuf,
}

/// Ascending layer indices as ranges: `layers 20-27`, `layers 1, 3-4`, `no layer`.
fn layer_ranges(layers: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &l in layers {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == l => *end = l,
            _ => runs.push((l, l)),
        }
    }
    if runs.is_empty() {
        return "no layer".into();
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
        .collect();
    format!(
        "layer{} {}",
        if layers.len() > 1 { "s" } else { "" },
        parts.join(", ")
    )
}

/// Which layer, projection and factor a tensor name refers to.
struct LoraName {
    layer: usize,
    proj: char,   // 'k' or 'v'
    factor: char, // 'a' or 'b'
}

/// Parses `…layers.{i}.self_attn.{k,v}_proj.{suffix}` where suffix is `lora_A.weight`/`lora_B.weight`
/// (PEFT) or `lora_a`/`lora_b` (reference); other LoRA targets are an error, other tensors `None`.
fn parse_name(name: &str) -> Result<Option<LoraName>> {
    let lower = name.to_ascii_lowercase();
    let factor = if lower.ends_with("lora_a.weight") || lower.ends_with("lora_a") {
        'a'
    } else if lower.ends_with("lora_b.weight") || lower.ends_with("lora_b") {
        'b'
    } else {
        return Ok(None);
    };
    let bad = |why: &str| Error::InvalidRequest(format!("adapter tensor `{name}`: {why}"));
    let proj = if name.contains(".self_attn.k_proj.") {
        'k'
    } else if name.contains(".self_attn.v_proj.") {
        'v'
    } else {
        return Err(bad("HGKV targets only k_proj and v_proj"));
    };
    let after = name
        .split("layers.")
        .nth(1)
        .ok_or_else(|| bad("no layer index"))?;
    let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
    let layer = digits.parse().map_err(|_| bad("no layer index"))?;
    Ok(Some(LoraName { layer, proj, factor }))
}

impl<B: Backend> Adapter<B> {
    /// Loads a PEFT directory, a reference-format safetensors file, or a directory holding
    /// `adapter.safetensors`, and checks it against the decoder `cfg`.
    ///
    /// ```no_run
    /// use recall::{backend::cpu::CpuBackend, model::{hgkv::Adapter, ModelConfig}};
    /// let cfg = ModelConfig::from_dir(std::path::Path::new("tests/fixtures/tiny-qwen3-vl"))?;
    /// let a = Adapter::load(&CpuBackend, std::path::Path::new("tests/fixtures/hgkv-peft"), &cfg.text)?;
    /// println!("rank {} alpha {}", a.rank, a.alpha);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn load(be: &B, path: &Path, cfg: &TextConfig) -> Result<Self> {
        if path.join("adapter_config.json").exists() {
            Self::load_peft(be, path, cfg)
        } else if path.is_dir() {
            Self::load_reference(be, &path.join("adapter.safetensors"), cfg)
        } else {
            Self::load_reference(be, path, cfg)
        }
    }

    fn load_peft(be: &B, dir: &Path, cfg: &TextConfig) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let text = crate::limits::read_capped(&cfg_path, crate::limits::MAX_CONFIG_BYTES)?;
        let doc: Value = serde_json::from_str(&text).map_err(|e| Error::json(&cfg_path, "", e))?;
        let field = |k: &str| doc.get(k).filter(|v| !v.is_null());
        let rank = field("r")
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::json(&cfg_path, "r", "missing or not a positive integer"))?
            as usize;
        let alpha = field("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| Error::json(&cfg_path, "lora_alpha", "missing or not a number"))?
            as f32;
        let targets: Vec<String> = match field("target_modules") {
            Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_str().map(String::from)).collect(),
            Some(Value::String(s)) => vec![s.clone()],
            _ => return Err(Error::json(&cfg_path, "target_modules", "missing")),
        };
        if let Some(t) = targets
            .iter()
            .find(|t| !["k_proj", "v_proj"].contains(&t.as_str()))
        {
            return Err(Error::json(
                &cfg_path,
                "target_modules",
                format!("`{t}`: HGKV targets only k_proj and v_proj"),
            ));
        }
        for (k, ok) in [("use_dora", false), ("fan_in_fan_out", false)] {
            if field(k).and_then(Value::as_bool).unwrap_or(ok) != ok {
                return Err(Error::json(&cfg_path, k, "not supported"));
            }
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if field(k).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
                return Err(Error::json(
                    &cfg_path,
                    k,
                    "per-module ranks and alphas are not supported",
                ));
            }
        }
        if field("bias").and_then(Value::as_str).is_some_and(|b| b != "none") {
            return Err(Error::json(&cfg_path, "bias", "LoRA biases are not supported"));
        }
        let layers: Option<Vec<usize>> = match field("layers_to_transform") {
            None => None,
            Some(Value::Number(n)) => Some(vec![n.as_u64().unwrap_or(u64::MAX) as usize]),
            Some(Value::Array(a)) => Some(
                a.iter()
                    .map(|v| v.as_u64().unwrap_or(u64::MAX) as usize)
                    .collect(),
            ),
            Some(v) => {
                return Err(Error::json(
                    &cfg_path,
                    "layers_to_transform",
                    format!("unexpected {v}"),
                ))
            }
        };
        let rslora = field("use_rslora").and_then(Value::as_bool).unwrap_or(false);
        let scale = if rslora {
            alpha / (rank as f32).sqrt()
        } else {
            alpha / rank as f32
        };
        let ckpt = Checkpoint::open_file(&dir.join("adapter_model.safetensors"))?;
        Self::build(be, &ckpt, cfg, rank, alpha, scale, layers)
    }

    fn load_reference(be: &B, file: &Path, cfg: &TextConfig) -> Result<Self> {
        let ckpt = Checkpoint::open_file(file)?;
        let alpha: f32 = ckpt
            .metadata
            .get("lora_alpha")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| Error::json(file, "__metadata__.lora_alpha", "missing or not a number"))?;
        let first_a = ckpt
            .names()
            .into_iter()
            .find(|n| n.ends_with(".lora_a"))
            .ok_or_else(|| Error::MissingTensor {
                name: "<module>.lora_a".into(),
                path: file.to_path_buf(),
            })?;
        let rank = ckpt.get(first_a)?.shape.first().copied().unwrap_or(0);
        Self::build(be, &ckpt, cfg, rank, alpha, alpha / rank.max(1) as f32, None)
    }

    /// Collects and checks the tensors: every listed layer has A and B for each projection present,
    /// shapes are `[r, hidden]` and `[kv_dim, r]`, layers are in range.
    fn build(
        be: &B,
        ckpt: &Checkpoint,
        cfg: &TextConfig,
        rank: usize,
        alpha: f32,
        scale: f32,
        layers_to_transform: Option<Vec<usize>>,
    ) -> Result<Self> {
        let path = ckpt.source.clone();
        if rank == 0 {
            return Err(Error::InvalidRequest(format!("{}: LoRA rank 0", path.display())));
        }
        let mut found: BTreeMap<(usize, char), [Option<&TensorRef>; 2]> = BTreeMap::new();
        for name in ckpt.names() {
            let Some(n) = parse_name(name)? else { continue };
            if n.layer >= cfg.num_hidden_layers {
                return Err(Error::InvalidRequest(format!(
                    "adapter tensor `{name}`: layer {} is out of range (the model has {} layers)",
                    n.layer, cfg.num_hidden_layers
                )));
            }
            found.entry((n.layer, n.proj)).or_default()[(n.factor == 'b') as usize] = Some(ckpt.get(name)?);
        }
        if let Some(list) = &layers_to_transform {
            if let Some(&l) = list.iter().find(|&&l| l >= cfg.num_hidden_layers) {
                return Err(Error::InvalidRequest(format!(
                    "{}: layers_to_transform names layer {l}, the model has {}",
                    path.display(),
                    cfg.num_hidden_layers
                )));
            }
            if let Some(&(l, _)) = found.keys().find(|(l, _)| !list.contains(l)) {
                return Err(Error::InvalidRequest(format!(
                    "{}: tensors for layer {l}, which layers_to_transform does not list",
                    path.display()
                )));
            }
            if let Some(&l) = list.iter().find(|l| !found.keys().any(|(fl, _)| fl == *l)) {
                return Err(Error::MissingTensor {
                    name: format!("layers.{l}.self_attn.k_proj / v_proj LoRA weights"),
                    path,
                });
            }
        }
        if found.is_empty() {
            return Err(Error::MissingTensor {
                name: "any k_proj / v_proj LoRA weight".into(),
                path,
            });
        }
        let (hidden, kv_dim) = (cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim);
        // Names come from the file (any PEFT prefix); the loader checks each shape.
        let weights = Weights::new(be, ckpt);
        let mut layers: Vec<Option<LayerLora<B>>> = (0..cfg.num_hidden_layers).map(|_| None).collect();
        let mut hasher = xxhash_rust::xxh64::Xxh64::new(0x6b76);
        hasher.update(&rank.to_le_bytes());
        hasher.update(&scale.to_le_bytes());
        for (&(layer, proj), [a, b]) in &found {
            let missing = |f: &str| Error::MissingTensor {
                name: format!("layers.{layer}.self_attn.{proj}_proj LoRA {f}"),
                path: path.clone(),
            };
            let (a, b) = (a.ok_or_else(|| missing("A"))?, b.ok_or_else(|| missing("B"))?);
            let a = weights.tensor(&a.name, &[rank, hidden])?;
            let b = weights.tensor(&b.name, &[kv_dim, rank])?;
            hasher.update(a.bytes());
            hasher.update(b.bytes());
            let pair = LoraPair {
                a: be.load_weight(a)?,
                b: be.load_weight(b)?,
            };
            let entry = layers[layer].get_or_insert_with(|| LayerLora { k: None, v: None });
            if proj == 'k' {
                entry.k = Some(pair);
            } else {
                entry.v = Some(pair);
            }
        }
        let adapter = Adapter {
            id: hasher.digest(),
            rank,
            alpha,
            scale,
            layers,
            source: path,
        };
        tracing::info!(layout = %adapter.layout(), source = %adapter.source.display(), "adapter loaded");
        Ok(adapter)
    }

    /// What the adapter is, in one line: rank, alpha and scale, and the projections and decoder
    /// layers it acts on, e.g. `rank 8, alpha 16 (scale 2), k_proj+v_proj on layers 20-27`.
    pub fn layout(&self) -> String {
        let acting = |pick: fn(&LayerLora<B>) -> bool| -> Vec<usize> {
            (0..self.layers.len())
                .filter(|&i| self.layer(i).is_some_and(pick))
                .collect()
        };
        let (k, v) = (acting(|l| l.k.is_some()), acting(|l| l.v.is_some()));
        let targets = if k == v {
            format!("k_proj+v_proj on {}", layer_ranges(&k))
        } else {
            format!("k_proj on {}, v_proj on {}", layer_ranges(&k), layer_ranges(&v))
        };
        format!(
            "rank {}, alpha {} (scale {}), {targets}",
            self.rank, self.alpha, self.scale
        )
    }

    /// The adapter's updates in decoder layer `i`, if any.
    pub fn layer(&self, i: usize) -> Option<&LayerLora<B>> {
        self.layers.get(i).and_then(Option::as_ref)
    }

    /// Adds `scale · (h[rows] Aᵀ) Bᵀ` to `y[rows]`.
    pub fn apply(
        &self,
        be: &B,
        pair: &LoraPair<B>,
        h_rows: &B::Tensor,
        y: &mut B::Tensor,
        rows: &[usize],
    ) -> Result<()> {
        let delta = be.linear(&be.linear(h_rows, &pair.a, None)?, &pair.b, None)?;
        be.scatter_rows(y, rows, &be.scale(&delta, self.scale)?, true)
    }
}

#[cfg(test)]
mod tests {
    use super::layer_ranges;

    #[test]
    fn layer_lists_read_as_ranges() {
        assert_eq!(layer_ranges(&[20, 21, 22, 23, 24, 25, 26, 27]), "layers 20-27");
        assert_eq!(layer_ranges(&[1, 3, 4]), "layers 1, 3-4");
        assert_eq!(layer_ranges(&[2]), "layer 2");
        assert_eq!(layer_ranges(&[]), "no layer");
    }
}
