//! The bench's random model: the config copied (with the `--layers` override), every tensor
//! `QwenVl::load` reads ([`weight_specs`]) with HF's initialisation, generated from the seed either
//! into a bf16 safetensors file (`--weights-file`) or as a synthetic [`Checkpoint`] whose tensors
//! the backend generates itself. Both give the same values ([`fill_of`]), so the same model.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::Value;

use super::report::WeightsInfo;
use crate::checkpoint::{Checkpoint, Fill};
use crate::error::{Error, Result};
use crate::model::{Family, ModelConfig, TextConfig, VisionConfig};
use crate::rng::derive;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    /// Uniform with this standard deviation.
    Random(f32),
    Ones,
    Zeros,
}

struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    /// Read once per decoded token (decoder weights and the lm_head).
    decode: bool,
}

fn spec(name: String, shape: &[usize], std: f32, decode: bool) -> Spec {
    let init = if name.ends_with(".bias") {
        Init::Zeros
    } else if name.contains("norm") || name.contains("ln_q") {
        Init::Ones
    } else {
        Init::Random(std)
    };
    Spec {
        name,
        shape: shape.to_vec(),
        init,
        decode,
    }
}

/// Specs in the order they are pushed (the order is the file layout and each tensor's seed, so it
/// must not change), all with one `std` and one `decode` flag.
struct SpecList {
    specs: Vec<Spec>,
    std: f32,
    decode: bool,
}

impl SpecList {
    fn tensor(&mut self, name: String, shape: &[usize]) {
        self.specs.push(spec(name, shape, self.std, self.decode));
    }

    /// A linear layer's `[out, inp]` weight and, with `bias`, its `[out]` bias.
    fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) {
        self.tensor(format!("{name}.weight"), &[out, inp]);
        if bias {
            self.tensor(format!("{name}.bias"), &[out]);
        }
    }
}

/// Every tensor `QwenVl::load` reads for `cfg`, with HF's initialisation (normal(0, std) linear and
/// embedding weights, zero biases, unit norm weights); uniform instead of normal.
fn weight_specs(cfg: &ModelConfig, tied: bool, std: f32) -> Vec<Spec> {
    let mut list = SpecList {
        specs: Vec::new(),
        std,
        decode: true,
    };
    text_specs(&mut list, &cfg.text, tied);
    if let Some(vc) = &cfg.vision {
        list.decode = false;
        vision_specs(&mut list, vc, cfg.family);
    }
    list.specs
}

/// The decoder: embedding, layers, final norm and (untied) lm_head.
fn text_specs(s: &mut SpecList, t: &TextConfig, tied: bool) {
    let (h, d) = (t.hidden_size, t.head_dim);
    let (qd, kvd, inter) = (
        t.num_attention_heads * d,
        t.num_key_value_heads * d,
        t.intermediate_size,
    );
    let p = "model.language_model";
    // Read per decoded token only when it doubles as the lm_head.
    s.specs.push(spec(
        format!("{p}.embed_tokens.weight"),
        &[t.vocab_size, h],
        s.std,
        tied,
    ));
    for i in 0..t.num_hidden_layers {
        let l = format!("{p}.layers.{i}");
        s.linear(&format!("{l}.self_attn.q_proj"), qd, h, t.qkv_bias);
        s.linear(&format!("{l}.self_attn.k_proj"), kvd, h, t.qkv_bias);
        s.linear(&format!("{l}.self_attn.v_proj"), kvd, h, t.qkv_bias);
        s.linear(&format!("{l}.self_attn.o_proj"), h, qd, false);
        s.linear(&format!("{l}.mlp.gate_proj"), inter, h, false);
        s.linear(&format!("{l}.mlp.up_proj"), inter, h, false);
        s.linear(&format!("{l}.mlp.down_proj"), h, inter, false);
        s.tensor(format!("{l}.input_layernorm.weight"), &[h]);
        s.tensor(format!("{l}.post_attention_layernorm.weight"), &[h]);
        if t.qk_norm {
            s.tensor(format!("{l}.self_attn.q_norm.weight"), &[d]);
            s.tensor(format!("{l}.self_attn.k_norm.weight"), &[d]);
        }
    }
    s.tensor(format!("{p}.norm.weight"), &[h]);
    if !tied {
        s.tensor("lm_head.weight".into(), &[t.vocab_size, h]);
    }
}

/// The vision tower: the patch embedding, then the family's blocks and mergers.
fn vision_specs(s: &mut SpecList, vc: &VisionConfig, family: Family) {
    let conv = [
        vc.hidden_size,
        vc.in_channels,
        vc.temporal_patch_size,
        vc.patch_size,
        vc.patch_size,
    ];
    s.tensor("model.visual.patch_embed.proj.weight".into(), &conv);
    match family {
        Family::Qwen3Vl => qwen3_vision_specs(s, vc),
        Family::Qwen25Vl => qwen25_vision_specs(s, vc),
    }
}

/// Qwen3-VL's tower after the patch projection: bias, learned position embedding, LayerNorm blocks
/// with a GELU MLP, the merger and one deepstack merger per deepstack layer.
fn qwen3_vision_specs(s: &mut SpecList, vc: &VisionConfig) {
    let q = "model.visual";
    let (vd, vi) = (vc.hidden_size, vc.intermediate_size);
    let merged = vd * vc.merge_unit();
    s.tensor(format!("{q}.patch_embed.proj.bias"), &[vd]);
    s.tensor(format!("{q}.pos_embed.weight"), &[vc.num_position_embeddings, vd]);
    for i in 0..vc.depth {
        let b = format!("{q}.blocks.{i}");
        for n in ["norm1", "norm2"] {
            s.tensor(format!("{b}.{n}.weight"), &[vd]);
            s.tensor(format!("{b}.{n}.bias"), &[vd]);
        }
        s.linear(&format!("{b}.attn.qkv"), 3 * vd, vd, true);
        s.linear(&format!("{b}.attn.proj"), vd, vd, true);
        s.linear(&format!("{b}.mlp.linear_fc1"), vi, vd, true);
        s.linear(&format!("{b}.mlp.linear_fc2"), vd, vi, true);
    }
    let mergers = std::iter::once((format!("{q}.merger"), vd)).chain(
        (0..vc.deepstack_visual_indexes.len()).map(|j| (format!("{q}.deepstack_merger_list.{j}"), merged)),
    );
    for (m, norm) in mergers {
        s.tensor(format!("{m}.norm.weight"), &[norm]);
        s.tensor(format!("{m}.norm.bias"), &[norm]);
        s.linear(&format!("{m}.linear_fc1"), merged, merged, true);
        s.linear(&format!("{m}.linear_fc2"), vc.out_hidden_size, merged, true);
    }
}

/// Qwen2.5-VL's tower after the patch projection: RMSNorm blocks with a gated MLP and the merger.
fn qwen25_vision_specs(s: &mut SpecList, vc: &VisionConfig) {
    let q = "model.visual";
    let (vd, vi) = (vc.hidden_size, vc.intermediate_size);
    let merged = vd * vc.merge_unit();
    for i in 0..vc.depth {
        let b = format!("{q}.blocks.{i}");
        s.tensor(format!("{b}.norm1.weight"), &[vd]);
        s.tensor(format!("{b}.norm2.weight"), &[vd]);
        s.linear(&format!("{b}.attn.qkv"), 3 * vd, vd, true);
        s.linear(&format!("{b}.attn.proj"), vd, vd, true);
        s.linear(&format!("{b}.mlp.gate_proj"), vi, vd, true);
        s.linear(&format!("{b}.mlp.up_proj"), vi, vd, true);
        s.linear(&format!("{b}.mlp.down_proj"), vd, vi, true);
    }
    s.tensor(format!("{q}.merger.ln_q.weight"), &[vd]);
    s.linear(&format!("{q}.merger.mlp.0"), merged, merged, true);
    s.linear(&format!("{q}.merger.mlp.2"), vc.out_hidden_size, merged, true);
}

/// Where the bench's model comes from: the temporary directory (config, and the weights file with
/// `--weights-file`) or a synthetic checkpoint.
#[derive(Clone, Copy)]
pub(super) struct WeightSource<'a> {
    pub(super) dir: &'a Path,
    pub(super) synthetic: Option<&'a Checkpoint>,
}

/// What [`write_random_model`] wrote.
#[derive(Debug, Clone, Copy)]
pub(super) struct Written {
    pub(super) params: u64,
    pub(super) decode_params: u64,
    pub(super) bytes: u64,
    pub(super) ms: f64,
}

impl Written {
    /// The report's weights section, with the model's load time.
    pub(super) fn info(self, load_ms: f64) -> WeightsInfo {
        WeightsInfo {
            params: self.params,
            decode_params: self.decode_params,
            file_bytes: self.bytes,
            write_ms: self.ms,
            load_ms,
        }
    }
}

/// Copies `config.json` (with the depth override) and `generation_config.json` into `out` and writes
/// `model.safetensors` with seeded random bf16 weights for it.
pub(super) fn write_random_model(
    config_dir: &Path,
    out: &Path,
    layers: Option<usize>,
    seed: u64,
    to_file: bool,
) -> Result<(ModelConfig, Written, Option<Checkpoint>)> {
    let clock = Instant::now();
    let root = copy_config(config_dir, out, layers)?;
    let cfg = ModelConfig::from_dir(out)?;
    if let Some(v) = &cfg.vision {
        if v.deepstack_visual_indexes.len() > cfg.text.num_hidden_layers {
            return Err(Error::InvalidRequest(format!(
                "bench: {} decoder layers cannot take {} deepstack features",
                cfg.text.num_hidden_layers,
                v.deepstack_visual_indexes.len()
            )));
        }
    }
    let flag = |v: Option<&Value>| {
        v.and_then(|x| x.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
    };
    let tied = flag(Some(&root))
        .or(flag(root.get("text_config")))
        .unwrap_or(false);
    let std_ = root
        .get("text_config")
        .and_then(|t| t.get("initializer_range"))
        .or(root.get("initializer_range"))
        .and_then(Value::as_f64)
        .unwrap_or(0.02) as f32;
    let specs = weight_specs(&cfg, tied, std_);
    let (bytes, synthetic) = if to_file {
        (
            write_safetensors(&out.join("model.safetensors"), &specs, seed)?,
            None,
        )
    } else {
        (0, Some(synthetic_checkpoint(&specs, seed)?))
    };
    let count = |f: &dyn Fn(&Spec) -> bool| -> u64 {
        specs
            .iter()
            .filter(|s| f(s))
            .map(|s| s.shape.iter().product::<usize>() as u64)
            .sum()
    };
    // The embedding table is only gathered during decode unless it doubles as the lm_head.
    let written = Written {
        params: count(&|_| true),
        decode_params: count(&|s| s.decode),
        bytes,
        ms: clock.elapsed().as_secs_f64() * 1e3,
    };
    Ok((cfg, written, synthetic))
}

/// Writes `config_dir`'s `config.json` into `out` with `num_hidden_layers` set to `layers` (in
/// `text_config` when it has one), copies `generation_config.json` if present, and returns the
/// written config document.
fn copy_config(config_dir: &Path, out: &Path, layers: Option<usize>) -> Result<Value> {
    let src = config_dir.join("config.json");
    let text = crate::limits::read_capped(&src, crate::limits::MAX_CONFIG_BYTES)?;
    let mut root: Value = serde_json::from_str(&text).map_err(|e| Error::json(&src, "", e))?;
    if let Some(n) = layers {
        let scope = if root
            .get("text_config")
            .is_some_and(|t| t.get("num_hidden_layers").is_some())
        {
            root.get_mut("text_config")
        } else {
            Some(&mut root)
        };
        if let Some(Value::Object(o)) = scope {
            o.insert("num_hidden_layers".into(), Value::from(n));
        }
    }
    let dst = out.join("config.json");
    let doc = serde_json::to_string_pretty(&root).map_err(|e| Error::json(&src, "", e))?;
    crate::atomic::write_atomic(&dst, doc)?;
    let gen = config_dir.join("generation_config.json");
    if gen.exists() {
        let to = out.join("generation_config.json");
        std::fs::copy(&gen, &to).map_err(|e| Error::io(&to, e))?;
    }
    Ok(root)
}

/// How tensor `ti` of the specs is generated; the same values whether they go to a file or stay
/// synthetic, so both ways of loading give the same model.
fn fill_of(s: &Spec, ti: usize, seed: u64) -> Fill {
    match s.init {
        Init::Zeros => Fill::Zeros,
        Init::Ones => Fill::Ones,
        Init::Random(std) => Fill::Uniform {
            seed: derive(seed, &[ti as u64]),
            scale: std * 3f32.sqrt(),
        },
    }
}

/// The specs as a checkpoint of generated tensors (no file).
fn synthetic_checkpoint(specs: &[Spec], seed: u64) -> Result<Checkpoint> {
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(ti, s)| (s.name.clone(), s.shape.clone(), fill_of(s, ti, seed)));
    Checkpoint::synthetic("recall bench (random weights)", tensors)
}

/// Writes a bf16 safetensors file, streaming: the data are generated in parallel chunks, each from
/// its own seed, so the file depends only on `seed` and the specs.
fn write_safetensors(path: &Path, specs: &[Spec], seed: u64) -> Result<u64> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for s in specs {
        let n = s.shape.iter().product::<usize>() * 2;
        header.insert(
            s.name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": s.shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"format": "pt", "source": "recall bench (random)"}),
    );
    let mut head = serde_json::to_string(&Value::Object(header))
        .map_err(|e| Error::InvalidRequest(format!("safetensors header: {e}")))?
        .into_bytes();
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, file);
    let io = |e| Error::io(path, e);
    w.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&head).map_err(io)?;
    const CHUNK: usize = 1 << 16; // elements per seeded chunk
    const BATCH: usize = 1 << 26; // elements generated per write
    let mut buf = Vec::new();
    for (ti, s) in specs.iter().enumerate() {
        let n: usize = s.shape.iter().product();
        let mut done = 0;
        while done < n {
            let len = (n - done).min(BATCH);
            buf.resize(len * 2, 0u8);
            let fill = fill_of(s, ti, seed);
            buf.par_chunks_mut(CHUNK * 2).enumerate().for_each(|(ci, out)| {
                let first = (done + ci * CHUNK) as u64;
                for (j, b) in out.chunks_exact_mut(2).enumerate() {
                    b.copy_from_slice(&half::bf16::from_f32(fill.value(first + j as u64)).to_le_bytes());
                }
            });
            w.write_all(&buf).map_err(io)?;
            done += len;
        }
    }
    w.flush().map_err(io)?;
    Ok((8 + head.len() + offset) as u64)
}
