//! The Qwen-VL text decoder (Qwen3-VL and Qwen2.5-VL language models), composed from backend ops.
//!
//! Per layer: RMSNorm → q/k/v projections (Qwen2.5: with bias) → per-head q/k RMSNorm (Qwen3) →
//! M-RoPE → KV-cache write → causal GQA attention → o_proj → residual → RMSNorm → SwiGLU MLP →
//! residual. Weight names are the checkpoint's: `{prefix}.layers.{i}.self_attn.q_proj.weight`, with
//! `{prefix}` = `model.language_model` (Qwen3-VL, and Qwen2.5-VL saved by transformers ≥ 4.52) or
//! `model` (Qwen2.5-VL as published on the hub).

use indicatif::{ProgressBar, ProgressStyle};

use crate::backend::{AttnShape, Backend};
use crate::error::{Error, Result};
use crate::model::config::TextConfig;
use crate::model::loader::Checkpoint;
use crate::model::mrope::{MRope, Positions};

/// A linear layer: weight `[out, in]` and an optional bias `[out]`.
struct Linear<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

impl<B: Backend> Linear<B> {
    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.weight, self.bias.as_ref())
    }
}

struct Attention<B: Backend> {
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3 only).
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
}

struct Mlp<B: Backend> {
    gate_proj: Linear<B>,
    up_proj: Linear<B>,
    down_proj: Linear<B>,
}

struct DecoderLayer<B: Backend> {
    input_layernorm: B::Weight,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Weight,
    mlp: Mlp<B>,
}

/// Keys and values of every layer for one sequence, stored contiguously.
pub struct KvCache<B: Backend> {
    k: Vec<B::Tensor>, // per layer [capacity, kv_heads · head_dim]
    v: Vec<B::Tensor>, // per layer [capacity, kv_heads · head_dim]
    len: usize,
    capacity: usize,
}

impl<B: Backend> KvCache<B> {
    /// Tokens whose K/V are stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every token from `len` on (rows stay allocated and are overwritten later).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// What a forward pass returns.
pub struct ForwardOutput<T> {
    /// `[rows, vocab]`: every position, or only the last (see [`LogitsFor`]).
    pub logits: T,
    /// When requested: the input embeddings, then the output of every decoder layer (before the final
    /// norm), each `[n, hidden]`.
    pub hidden_states: Vec<T>,
}

/// Image features placed into a forward's input.
pub struct VisualFeatures<T> {
    /// Rows of the input (the image-pad tokens) that take image embeddings, in order.
    pub rows: Vec<usize>,
    /// `[rows.len(), hidden]`: replace the token embeddings at `rows`.
    pub embeds: T,
    /// Qwen3-VL deepstack: tensor `j` (`[rows.len(), hidden]`) is added at `rows` to the output of
    /// decoder layer `j`.
    pub deepstack: Vec<T>,
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    All,
    Last,
}

/// The text decoder with its weights on backend `B`.
pub struct TextModel<B: Backend> {
    cfg: TextConfig,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Weight,
    /// `None` when the embeddings are tied (no `lm_head.weight` in the checkpoint).
    lm_head: Option<B::Weight>,
    mrope: MRope,
}

/// Where a family's text weights live in the checkpoint.
fn text_prefix(ckpt: &Checkpoint) -> &'static str {
    if ckpt.contains("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    }
}

/// Loads weights after checking their shapes.
struct Loader<'a, B: Backend> {
    be: &'a B,
    ckpt: &'a Checkpoint,
}

impl<B: Backend> Loader<'_, B> {
    fn weight(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        let t = self.ckpt.get(name)?;
        t.expect_shape(shape)?;
        self.be.load_weight(t)
    }

    fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear<B>> {
        Ok(Linear {
            weight: self.weight(&format!("{prefix}.weight"), &[out, inp])?,
            bias: if bias {
                Some(self.weight(&format!("{prefix}.bias"), &[out])?)
            } else {
                None
            },
        })
    }
}

impl<B: Backend> TextModel<B> {
    /// Loads the decoder's weights from `ckpt` onto `be`, checking every shape against `cfg`.
    pub fn load(be: &B, cfg: &TextConfig, ckpt: &Checkpoint) -> Result<Self> {
        let ld = Loader { be, ckpt };
        let p = text_prefix(ckpt);
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = ld.weight(&format!("{p}.embed_tokens.weight"), &[v, h])?;
        let progress = ProgressBar::new(cfg.num_hidden_layers as u64).with_style(
            ProgressStyle::with_template("loading layers {bar:30} {pos}/{len}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            layers.push(Self::load_layer(&ld, cfg, &format!("{p}.layers.{i}"))?);
            progress.inc(1);
        }
        progress.finish_and_clear();
        let lm_head = if ckpt.contains("lm_head.weight") {
            Some(ld.weight("lm_head.weight", &[v, h])?)
        } else {
            tracing::info!("no lm_head.weight: using tied input embeddings");
            None
        };
        Ok(TextModel {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: ld.weight(&format!("{p}.norm.weight"), &[h])?,
            lm_head,
            mrope: MRope::new(cfg),
        })
    }

    fn load_layer(ld: &Loader<B>, cfg: &TextConfig, p: &str) -> Result<DecoderLayer<B>> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let bias = cfg.qkv_bias;
        let norm = |name: &str| ld.weight(&format!("{p}.self_attn.{name}.weight"), &[d]);
        Ok(DecoderLayer {
            input_layernorm: ld.weight(&format!("{p}.input_layernorm.weight"), &[h])?,
            self_attn: Attention {
                q_proj: ld.linear(&format!("{p}.self_attn.q_proj"), qd, h, bias)?,
                k_proj: ld.linear(&format!("{p}.self_attn.k_proj"), kvd, h, bias)?,
                v_proj: ld.linear(&format!("{p}.self_attn.v_proj"), kvd, h, bias)?,
                o_proj: ld.linear(&format!("{p}.self_attn.o_proj"), h, qd, false)?,
                q_norm: if cfg.qk_norm { Some(norm("q_norm")?) } else { None },
                k_norm: if cfg.qk_norm { Some(norm("k_norm")?) } else { None },
            },
            post_attention_layernorm: ld.weight(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            mlp: Mlp {
                gate_proj: ld.linear(&format!("{p}.mlp.gate_proj"), cfg.intermediate_size, h, false)?,
                up_proj: ld.linear(&format!("{p}.mlp.up_proj"), cfg.intermediate_size, h, false)?,
                down_proj: ld.linear(&format!("{p}.mlp.down_proj"), h, cfg.intermediate_size, false)?,
            },
        })
    }

    /// The decoder's configuration.
    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// An empty cache for up to `capacity` tokens.
    pub fn new_cache(&self, be: &B, capacity: usize) -> Result<KvCache<B>> {
        let kvd = self.cfg.num_key_value_heads * self.cfg.head_dim;
        let n = self.cfg.num_hidden_layers;
        Ok(KvCache {
            k: (0..n).map(|_| be.zeros(capacity, kvd)).collect::<Result<_>>()?,
            v: (0..n).map(|_| be.zeros(capacity, kvd)).collect::<Result<_>>()?,
            len: 0,
            capacity,
        })
    }

    /// Embeds `ids` (with image features at their rows, if any) and runs them through the decoder
    /// after the tokens already in `cache`.
    ///
    /// On success the new tokens' K/V are part of the cache; on error the cache's length is unchanged,
    /// so a failed call never leaves half-written state behind.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        ids: &[u32],
        pos: &Positions,
        visual: Option<&VisualFeatures<B::Tensor>>,
        cache: &mut KvCache<B>,
        logits_for: LogitsFor,
        keep_hidden: bool,
    ) -> Result<ForwardOutput<B::Tensor>> {
        if ids.is_empty() || pos.len() != ids.len() {
            return Err(Error::InvalidRequest(format!(
                "forward needs at least one token and one position per token ({} ids, {} positions)",
                ids.len(),
                pos.len()
            )));
        }
        if cache.len + ids.len() > cache.capacity {
            return Err(Error::PromptTooLong {
                tokens: cache.len + ids.len(),
                limit: cache.capacity,
            });
        }
        let mut x = be.embedding(&self.embed_tokens, ids)?;
        if let Some(v) = visual {
            if v.deepstack.len() > self.layers.len() {
                return Err(Error::InvalidRequest(format!(
                    "{} deepstack features for {} decoder layers",
                    v.deepstack.len(),
                    self.layers.len()
                )));
            }
            be.scatter_rows(&mut x, &v.rows, &v.embeds, false)?;
        }
        self.forward_embeds(be, x, pos, visual, cache, logits_for, keep_hidden)
    }

    /// Like [`TextModel::forward`], from input embeddings `[n, hidden]` (image embeddings already in
    /// place; `visual` then only supplies deepstack features).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_embeds(
        &self,
        be: &B,
        mut x: B::Tensor,
        pos: &Positions,
        visual: Option<&VisualFeatures<B::Tensor>>,
        cache: &mut KvCache<B>,
        logits_for: LogitsFor,
        keep_hidden: bool,
    ) -> Result<ForwardOutput<B::Tensor>> {
        let n = be.dims(&x).0;
        if pos.len() != n || cache.len + n > cache.capacity {
            return Err(Error::InvalidRequest(format!(
                "{n} input rows with {} positions into a cache holding {} of {}",
                pos.len(),
                cache.len,
                cache.capacity
            )));
        }
        let (cos, sin) = self.mrope.tables(pos);
        let cos = be.upload(&cos, n, self.cfg.head_dim)?;
        let sin = be.upload(&sin, n, self.cfg.head_dim)?;
        let mut hidden_states = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            if keep_hidden {
                hidden_states.push(be.rows(&x, 0, n)?);
            }
            x = self.layer_forward(be, layer, i, x, (&cos, &sin), cache)?;
            if let Some(ds) = visual.and_then(|v| v.deepstack.get(i).map(|d| (&v.rows, d))) {
                be.scatter_rows(&mut x, ds.0, ds.1, true)?;
            }
        }
        if keep_hidden {
            hidden_states.push(be.rows(&x, 0, n)?);
        }
        cache.len += n;
        let x = match logits_for {
            LogitsFor::All => x,
            LogitsFor::Last => be.rows(&x, n - 1, 1)?,
        };
        let x = be.rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(ForwardOutput {
            logits: be.linear(&x, head, None)?,
            hidden_states,
        })
    }

    fn layer_forward(
        &self,
        be: &B,
        layer: &DecoderLayer<B>,
        index: usize,
        x: B::Tensor,
        (cos, sin): (&B::Tensor, &B::Tensor),
        cache: &mut KvCache<B>,
    ) -> Result<B::Tensor> {
        let eps = self.cfg.rms_norm_eps;
        let attn = &layer.self_attn;
        let h = be.rms_norm(&x, &layer.input_layernorm, eps)?;
        let mut q = attn.q_proj.forward(be, &h)?;
        let mut k = attn.k_proj.forward(be, &h)?;
        let v = attn.v_proj.forward(be, &h)?;
        if let (Some(qn), Some(kn)) = (&attn.q_norm, &attn.k_norm) {
            q = be.rms_norm(&q, qn, eps)?;
            k = be.rms_norm(&k, kn, eps)?;
        }
        let q = be.rope(&q, cos, sin)?;
        let k = be.rope(&k, cos, sin)?;
        be.write_rows(&mut cache.k[index], cache.len, &k)?;
        be.write_rows(&mut cache.v[index], cache.len, &v)?;
        let shape = AttnShape {
            q_heads: self.cfg.num_attention_heads,
            kv_heads: self.cfg.num_key_value_heads,
            head_dim: self.cfg.head_dim,
            kv_len: cache.len + be.dims(&x).0,
        };
        let a = be.attention(&q, &cache.k[index], &cache.v[index], shape)?;
        let x = be.add(&x, &attn.o_proj.forward(be, &a)?)?;
        let h = be.rms_norm(&x, &layer.post_attention_layernorm, eps)?;
        let mlp = &layer.mlp;
        let g = be.silu_mul(&mlp.gate_proj.forward(be, &h)?, &mlp.up_proj.forward(be, &h)?)?;
        be.add(&x, &mlp.down_proj.forward(be, &g)?)
    }
}
