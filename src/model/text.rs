//! The Qwen-VL text decoder (Qwen3-VL and Qwen2.5-VL language models), composed from backend ops.
//!
//! Per layer: RMSNorm → q/k/v projections (Qwen2.5: with bias) → per-head q/k RMSNorm (Qwen3) →
//! M-RoPE → KV-cache write → causal GQA attention → o_proj → residual → RMSNorm → SwiGLU MLP →
//! residual. Weight names are the checkpoint's: `{prefix}.layers.{i}.self_attn.q_proj.weight`, with
//! `{prefix}` = `model.language_model` (Qwen3-VL, and Qwen2.5-VL saved by transformers ≥ 4.52) or
//! `model` (Qwen2.5-VL as published on the hub).

use indicatif::{ProgressBar, ProgressStyle};

use crate::backend::{AttnShape, Backend, PagedSeq};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::model::config::TextConfig;
use crate::model::hgkv::{Adapter, LayerLora};
use crate::model::layers::{linears, Linear, RmsNorm, SwiGlu};
use crate::model::mrope::{MRope, Positions};
use crate::model::weights::Weights;

/// Self-attention of one decoder layer: projections, Qwen3's per-head q/k norms, M-RoPE, the KV-pool
/// write and causal GQA attention over the pool.
struct Attention<B: Backend> {
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    /// Per-head RMSNorm weights `[head_dim]` (Qwen3 only).
    qk_norm: Option<(B::Weight, B::Weight)>,
    eps: f32,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl<B: Backend> Attention<B> {
    fn load(w: &Weights<B>, cfg: &TextConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let bias = cfg.qkv_bias;
        let qk_norm = if cfg.qk_norm {
            Some((w.get("q_norm.weight", &[d])?, w.get("k_norm.weight", &[d])?))
        } else {
            None
        };
        Ok(Attention {
            q_proj: Linear::load(&w.pp("q_proj"), qd, h, bias)?,
            k_proj: Linear::load(&w.pp("k_proj"), kvd, h, bias)?,
            v_proj: Linear::load(&w.pp("v_proj"), kvd, h, bias)?,
            o_proj: Linear::load(&w.pp("o_proj"), h, qd, false)?,
            qk_norm,
            eps: cfg.rms_norm_eps,
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
        })
    }

    /// `h`: the normed input rows; writes their K/V into this layer's pools and returns `o_proj` of
    /// the attention output.
    fn forward(
        &self,
        h: &B::Tensor,
        (k_pool, v_pool): (&mut B::Tensor, &mut B::Tensor),
        lora: Option<&LayerLora<B>>,
        ctx: &StepCtx<'_, B>,
    ) -> Result<B::Tensor> {
        let be = ctx.be;
        let [q, mut k, mut v] = linears(be, h, [&self.q_proj, &self.k_proj, &self.v_proj])?;
        // HGKV: the adapter touches only its rows; with none, its code does not run (exact bypass).
        if let (Some(l), Some((adapter, rows))) = (lora, ctx.adapter) {
            let h_rows = be.gather_rows(h, rows)?;
            if let Some(p) = &l.k {
                adapter.apply(be, p, &h_rows, &mut k, rows)?;
            }
            if let Some(p) = &l.v {
                adapter.apply(be, p, &h_rows, &mut v, rows)?;
            }
        }
        let norms = self.qk_norm.as_ref().map(|(qn, kn)| (qn, kn, self.eps));
        let q = be.qk_norm_rope_write(
            &q,
            &k,
            &v,
            norms,
            ctx.rope,
            (&mut *k_pool, &mut *v_pool),
            ctx.slots,
        )?;
        let shape = AttnShape {
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: ctx.block_size,
        };
        let a = be.paged_attention(&q, k_pool, v_pool, shape, ctx.seqs)?;
        self.o_proj.forward(be, &a)
    }
}

/// One decoder layer: RMSNorm → attention → residual, RMSNorm → SwiGLU MLP → residual.
struct DecoderLayer<B: Backend> {
    /// Its index (which of the adapter's layers applies).
    index: usize,
    input_layernorm: RmsNorm<B>,
    self_attn: Attention<B>,
    post_attention_layernorm: RmsNorm<B>,
    mlp: SwiGlu<B>,
}

impl<B: Backend> DecoderLayer<B> {
    /// Loads `layers.{index}` under `w`.
    fn load(w: &Weights<B>, cfg: &TextConfig, index: usize) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(DecoderLayer {
            index,
            input_layernorm: RmsNorm::load(&w.pp("input_layernorm"), h, eps)?,
            self_attn: Attention::load(&w.pp("self_attn"), cfg)?,
            post_attention_layernorm: RmsNorm::load(&w.pp("post_attention_layernorm"), h, eps)?,
            mlp: SwiGlu::load(&w.pp("mlp"), h, cfg.intermediate_size, false)?,
        })
    }

    fn forward(&self, x: B::Tensor, pool: &mut KvPool<B>, ctx: &StepCtx<'_, B>) -> Result<B::Tensor> {
        let be = ctx.be;
        let h = self.input_layernorm.forward(be, &x)?;
        let lora = ctx.adapter.and_then(|(a, _)| a.layer(self.index));
        let kv = (&mut pool.k[self.index], &mut pool.v[self.index]);
        let o = self.self_attn.forward(&h, kv, lora, ctx)?;
        let norm = &self.post_attention_layernorm;
        let (x, h) = be.add_rms_norm_owned(x, &o, &norm.weight, norm.eps)?;
        be.add_owned(x, &self.mlp.forward(be, &h)?)
    }
}

/// What every decoder layer of one forward step shares.
struct StepCtx<'a, B: Backend> {
    be: &'a B,
    /// The M-RoPE cos/sin tables of the step's rows, `[rows, head_dim]`.
    rope: (&'a B::Tensor, &'a B::Tensor),
    /// Pool row of every new token.
    slots: &'a [usize],
    seqs: &'a [PagedSeq<'a>],
    block_size: usize,
    /// The adapter and the batch rows it updates; `None` when no row is (the exact bypass).
    adapter: Option<(&'a Adapter<B>, &'a [usize])>,
}

/// Keys and values of every layer in a pool of fixed-size blocks. Which block holds which tokens is
/// the business of the block manager (`kv/`); the pool only stores rows.
pub struct KvPool<B: Backend> {
    k: Vec<B::Tensor>, // per layer [num_blocks · block_size, kv_heads · head_dim]
    v: Vec<B::Tensor>, // per layer [num_blocks · block_size, kv_heads · head_dim]
    block_size: usize,
    num_blocks: usize,
}

impl<B: Backend> KvPool<B> {
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

/// Keys and values of one sequence, stored contiguously: a pool of a single block as long as the
/// capacity.
pub struct KvCache<B: Backend> {
    pool: KvPool<B>,
    len: usize,
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
        self.pool.block_size
    }

    /// Forgets every token from `len` on (rows stay allocated and are overwritten later).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// One sequence's new tokens in a batched forward.
pub struct BatchItem<'a, T> {
    pub ids: &'a [u32],
    /// One position triple per id.
    pub positions: &'a Positions,
    /// Image features (and other injected embedding runs) for rows of this item, row indices
    /// relative to `ids`.
    pub visual: &'a [VisualFeatures<T>],
    /// Pool blocks of the whole sequence (covering `start + ids.len()` tokens).
    pub block_table: &'a [u32],
    /// Tokens of the sequence already in the pool; `ids[0]` is token `start`.
    pub start: usize,
    /// Which of this item's rows get logits (`None`: none).
    pub logits: Option<LogitsFor>,
    /// Rows (relative to `ids`) whose K/V the adapter updates; empty for none.
    pub lora_rows: &'a [usize],
}

/// Outputs of a batched forward.
pub struct BatchOutput<T> {
    /// Per item, its logits (`[1 or rows, vocab]`) when requested.
    pub logits: Vec<Option<T>>,
    /// When requested: the input embeddings, then every decoder layer's output, each `[Σ rows, hidden]`.
    pub hidden_states: Vec<T>,
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
    /// The K/V LoRA adapter, if one is loaded.
    adapter: Option<Adapter<B>>,
}

/// Where a family's text weights live in the checkpoint.
fn text_prefix(ckpt: &Checkpoint) -> &'static str {
    if ckpt.contains("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    }
}

impl<B: Backend> TextModel<B> {
    /// Loads the decoder's weights from `ckpt` onto `be`, checking every shape against `cfg`.
    pub fn load(be: &B, cfg: &TextConfig, ckpt: &Checkpoint) -> Result<Self> {
        let root = Weights::new(be, ckpt);
        let w = root.pp(text_prefix(ckpt));
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = w.get("embed_tokens.weight", &[v, h])?;
        let progress = ProgressBar::new(cfg.num_hidden_layers as u64).with_style(
            ProgressStyle::with_template("loading layers {bar:30} {pos}/{len}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            layers.push(DecoderLayer::load(&w.pp("layers").pp(i), cfg, i)?);
            progress.inc(1);
        }
        progress.finish_and_clear();
        let lm_head = if root.contains("lm_head.weight") {
            Some(root.get("lm_head.weight", &[v, h])?)
        } else {
            tracing::info!("no lm_head.weight: using tied input embeddings");
            be.prepare_linear(&embed_tokens)?;
            None
        };
        Ok(TextModel {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: w.get("norm.weight", &[h])?,
            lm_head,
            mrope: MRope::new(cfg),
            adapter: None,
        })
    }

    /// The decoder's configuration.
    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// Warms the `lm_head` (the embeddings when tied) while `more()` says ([`Backend::warm_weight`]):
    /// every request's first token reads it whole, after the layers have run.
    pub fn warm_head(&self, be: &B, more: &dyn Fn() -> bool) {
        be.warm_weight(self.lm_head.as_ref().unwrap_or(&self.embed_tokens), more);
    }

    /// The frozen input embeddings of `ids` (`[ids.len(), hidden]`), e.g. for the ScopeMem encoder.
    pub fn embed(&self, be: &B, ids: &[u32]) -> Result<B::Tensor> {
        be.embedding(&self.embed_tokens, ids)
    }

    /// Installs (or removes) the K/V LoRA adapter.
    pub fn set_adapter(&mut self, adapter: Option<Adapter<B>>) {
        self.adapter = adapter;
    }

    /// The loaded adapter.
    pub fn adapter(&self) -> Option<&Adapter<B>> {
        self.adapter.as_ref()
    }

    /// A zeroed pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new_pool(&self, be: &B, num_blocks: usize, block_size: usize) -> Result<KvPool<B>> {
        let kvd = self.cfg.num_key_value_heads * self.cfg.head_dim;
        let n = self.cfg.num_hidden_layers;
        let rows = num_blocks * block_size;
        Ok(KvPool {
            k: (0..n).map(|_| be.zeros(rows, kvd)).collect::<Result<_>>()?,
            v: (0..n).map(|_| be.zeros(rows, kvd)).collect::<Result<_>>()?,
            block_size,
            num_blocks,
        })
    }

    /// An empty contiguous cache for up to `capacity` tokens of one sequence.
    pub fn new_cache(&self, be: &B, capacity: usize) -> Result<KvCache<B>> {
        Ok(KvCache {
            pool: self.new_pool(be, 1, capacity.max(1))?,
            len: 0,
        })
    }

    /// Embeds `ids` (with image features at their rows, if any) and runs them through the decoder
    /// after the tokens already in `cache`.
    ///
    /// On success the new tokens' K/V are part of the cache; on error the cache's length is unchanged,
    /// so a failed call never leaves half-written state behind.
    ///
    /// Why eight arguments: this is the single-sequence entry point that the parity tests, the
    /// benches and `engine::generate` call positionally, kept as it was when the layers moved to
    /// their own `forward`s; everything it takes goes straight into one [`BatchItem`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        ids: &[u32],
        pos: &Positions,
        visual: Option<&VisualFeatures<B::Tensor>>,
        lora_rows: &[usize],
        cache: &mut KvCache<B>,
        logits_for: LogitsFor,
        keep_hidden: bool,
    ) -> Result<ForwardOutput<B::Tensor>> {
        if cache.len + ids.len() > cache.capacity() {
            return Err(Error::PromptTooLong {
                tokens: cache.len + ids.len(),
                limit: cache.capacity(),
            });
        }
        let item = BatchItem {
            ids,
            positions: pos,
            visual: visual.map(std::slice::from_ref).unwrap_or_default(),
            block_table: &[0],
            start: cache.len,
            logits: Some(logits_for),
            lora_rows,
        };
        let mut out = self.forward_batch(be, &[item], &mut cache.pool, keep_hidden)?;
        cache.len += ids.len();
        let logits = out
            .logits
            .pop()
            .flatten()
            .ok_or_else(|| Error::InvalidRequest("no logits".into()))?;
        Ok(ForwardOutput {
            logits,
            hidden_states: out.hidden_states,
        })
    }

    /// Runs the new tokens of several sequences through the decoder in one pass, writing their K/V
    /// into `pool`. Each row's result is the same as if its sequence ran alone (the backend contract).
    pub fn forward_batch(
        &self,
        be: &B,
        items: &[BatchItem<'_, B::Tensor>],
        pool: &mut KvPool<B>,
        keep_hidden: bool,
    ) -> Result<BatchOutput<B::Tensor>> {
        let plan = BatchPlan::new(items, pool.block_size, self.layers.len())?;
        if !plan.lora_rows.is_empty() && self.adapter.is_none() {
            return Err(Error::InvalidRequest(
                "adapter rows given but no adapter is loaded".into(),
            ));
        }
        let mut x = be.embedding(&self.embed_tokens, &plan.ids)?;
        for (item, &offset) in items.iter().zip(&plan.offsets) {
            for v in item.visual {
                let rows: Vec<usize> = v.rows.iter().map(|r| r + offset).collect();
                be.scatter_rows(&mut x, &rows, &v.embeds, false)?;
            }
        }
        let n = plan.ids.len();
        let (cos, sin) = self.mrope.tables(&plan.positions);
        let cos = be.upload(&cos, n, self.cfg.head_dim)?;
        let sin = be.upload(&sin, n, self.cfg.head_dim)?;
        let seqs: Vec<PagedSeq> = items
            .iter()
            .map(|it| PagedSeq {
                rows: it.ids.len(),
                context_len: it.start + it.ids.len(),
                block_table: it.block_table,
            })
            .collect();
        let ctx = StepCtx {
            be,
            rope: (&cos, &sin),
            slots: &plan.slots,
            seqs: &seqs,
            block_size: pool.block_size,
            adapter: self
                .adapter
                .as_ref()
                .filter(|_| !plan.lora_rows.is_empty())
                .map(|a| (a, &plan.lora_rows[..])),
        };
        let mut hidden_states = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            if keep_hidden {
                hidden_states.push(be.rows(&x, 0, n)?);
            }
            x = layer.forward(x, pool, &ctx)?;
            for (item, &offset) in items.iter().zip(&plan.offsets) {
                for (v, ds) in item
                    .visual
                    .iter()
                    .filter_map(|v| v.deepstack.get(i).map(|d| (v, d)))
                {
                    let rows: Vec<usize> = v.rows.iter().map(|r| r + offset).collect();
                    be.scatter_rows(&mut x, &rows, ds, true)?;
                }
            }
        }
        if keep_hidden {
            hidden_states.push(be.rows(&x, 0, n)?);
        }
        Ok(BatchOutput {
            logits: self.logits(be, &x, items, &plan.offsets)?,
            hidden_states,
        })
    }

    /// Final norm and lm_head on the rows that want logits, split per item.
    fn logits(
        &self,
        be: &B,
        x: &B::Tensor,
        items: &[BatchItem<'_, B::Tensor>],
        offsets: &[usize],
    ) -> Result<Vec<Option<B::Tensor>>> {
        let mut rows = Vec::new();
        let mut spans = Vec::new();
        for (item, &offset) in items.iter().zip(offsets) {
            let n = item.ids.len();
            let range = match item.logits {
                None => offset..offset,
                Some(LogitsFor::All) => offset..offset + n,
                Some(LogitsFor::Last) => offset + n - 1..offset + n,
            };
            spans.push((rows.len(), range.len()));
            rows.extend(range);
        }
        if rows.is_empty() {
            return Ok(items.iter().map(|_| None).collect());
        }
        let h = be.rms_norm(&be.gather_rows(x, &rows)?, &self.norm, self.cfg.rms_norm_eps)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let logits = be.linear(&h, head, None)?;
        spans
            .into_iter()
            .map(|(start, len)| {
                if len == 0 {
                    Ok(None)
                } else {
                    be.rows(&logits, start, len).map(Some)
                }
            })
            .collect()
    }
}

/// The concatenated inputs of a batch and where each token's K/V go.
struct BatchPlan {
    ids: Vec<u32>,
    positions: Positions,
    /// Pool row of every new token.
    slots: Vec<usize>,
    /// First row of each item.
    offsets: Vec<usize>,
    /// Batch rows whose K/V the adapter updates.
    lora_rows: Vec<usize>,
}

impl BatchPlan {
    fn new<T>(items: &[BatchItem<'_, T>], block_size: usize, layers: usize) -> Result<Self> {
        let mut plan = BatchPlan {
            ids: Vec::new(),
            positions: Positions::default(),
            slots: Vec::new(),
            offsets: Vec::new(),
            lora_rows: Vec::new(),
        };
        for (k, it) in items.iter().enumerate() {
            let n = it.ids.len();
            let bad = |msg: String| Err(Error::InvalidRequest(format!("batch item {k}: {msg}")));
            if n == 0 || it.positions.len() != n {
                return bad(format!("{n} ids with {} positions", it.positions.len()));
            }
            if it.block_table.len() * block_size < it.start + n {
                return bad(format!(
                    "{} blocks of {block_size} cannot hold {} tokens",
                    it.block_table.len(),
                    it.start + n
                ));
            }
            for v in it.visual {
                if v.rows.iter().any(|&r| r >= n) || v.deepstack.len() > layers {
                    return bad("image rows or deepstack features out of range".into());
                }
            }
            if it.lora_rows.iter().any(|&r| r >= n) {
                return bad("adapter rows out of range".into());
            }
            plan.lora_rows
                .extend(it.lora_rows.iter().map(|r| r + plan.ids.len()));
            plan.offsets.push(plan.ids.len());
            plan.ids.extend_from_slice(it.ids);
            plan.positions.extend(it.positions);
            plan.slots.extend(
                (it.start..it.start + n)
                    .map(|t| it.block_table[t / block_size] as usize * block_size + t % block_size),
            );
        }
        if plan.ids.is_empty() {
            return Err(Error::InvalidRequest("empty batch".into()));
        }
        Ok(plan)
    }
}
