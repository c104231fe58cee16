//! The ScopeMem first-opinion encoder: the actor's first answer, its confidence and its textual
//! context in, K = 16 prefix vectors for the actor's second pass out.
//!
//! ScopeMem (docs/SCOPEMEM.md, ../shared/papers/scopemem.md §4.1) runs the frozen actor twice. After the
//! first pass, this encoder reads
//!
//! * four text fields, each given as the actor's **frozen token embeddings** (rows of the decoder's
//!   `embed_tokens`, `[n_i, hidden]`): the first opinion a0, the task, the rolling summary of the last
//!   three steps and the recent actions;
//! * the actor's probabilities `p0` over the 10 action types and their entropy `H0 = −Σ p ln p`,
//!
//! and writes `[num_queries, hidden]` vectors that are prepended to the actor's input embeddings.
//!
//! Architecture (width `d = d_model`; the PyTorch reference is `tools/scopemem_encoder.py`):
//!
//! ```text
//! field i (segment s_i)   x = in_proj(e) + segment_embed[s_i] + pos_embed[0..n_i]    [n_i, d]
//! confidence token        c = conf_mlp.fc2(gelu(conf_mlp.fc1([p0, H0])))             [1, d]
//! context                 h = [c; a0; task; summary; recent_actions]  (empty fields skipped)
//! 2 self-attention blocks h = h + attn(norm1(h));  h = h + mlp(norm2(h))
//!                         ctx = context_norm(h)
//! 16 learned queries      q = queries
//! 2 cross-attention blocks q = q + attn(norm1(q) → ctx);  q = q + mlp(norm2(q))
//! prefix                  out_proj(out_norm(q))                                       [16, hidden]
//! ```
//!
//! Blocks are pre-LayerNorm with biased q/k/v/o projections, `d / num_heads` wide heads, no mask,
//! `mlp = fc2(gelu(fc1(x)))` with the erf GELU. Positions are learned and count within each field;
//! the segment embedding says which field a token belongs to. At the paper's size (hidden 4096,
//! d 384, 6 heads, ffn 1536, 256 positions) the encoder has 10,508,032 parameters
//! ([`ScopeMemConfig::num_parameters`]).
//!
//! The study's controls are the same network reading less ([`Variant`]: one-pass, task-only,
//! history-only, fixed-query); `fields` and `confidence` in the config say what it reads, and only
//! the full encoder needs the actor's first pass ([`ScopeMemConfig::needs_first_opinion`]).
//!
//! Everything is composed from [`Backend`] ops, so the encoder runs on any backend. The backend has no
//! attention whose query and key lengths differ; cross-attention is built from
//! [`Backend::attention_segments`] by repeating the context (see `cross_attention`), which is exact.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Gelu};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::model::layers::{GeluMlp, LayerNorm, Linear};
use crate::model::weights::Weights;

/// The text fields in context order; a field's index is its segment id.
pub const FIELDS: [&str; 4] = ["first_opinion", "task", "summary", "recent_actions"];
/// Length of `p0`: the action types of the mobile protocol.
pub const NUM_ACTION_TYPES: usize = 10;
/// The encoder's configuration file inside its directory.
pub const CONFIG_FILE: &str = "scopemem_config.json";
/// The encoder's weights inside its directory (named so that it can sit beside an actor checkpoint).
pub const WEIGHTS_FILE: &str = "scopemem.safetensors";
/// How far `Σ p0` may be from 1.
pub const P0_SUM_TOLERANCE: f32 = 1e-3;

/// The encoder's shape, read from `scopemem_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScopeMemConfig {
    /// The actor's hidden size: width of the input embeddings and of the prefix vectors.
    pub hidden_size: usize,
    /// The encoder's width d.
    pub d_model: usize,
    /// Attention heads of `d_model / num_heads`.
    pub num_heads: usize,
    /// Self-attention blocks over the context.
    pub num_self_layers: usize,
    /// Cross-attention blocks (the queries attend to the context).
    pub num_cross_layers: usize,
    /// K, the number of prefix vectors.
    pub num_queries: usize,
    /// MLP width of every block.
    pub ffn_size: usize,
    /// Hidden width of the confidence MLP.
    pub conf_hidden: usize,
    /// Length of `p0`; must be [`NUM_ACTION_TYPES`].
    pub num_action_types: usize,
    /// Learned positions per field: the most tokens one field may hold.
    pub max_positions: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f32,
    /// The text fields the encoder reads, as indices into [`FIELDS`] (ascending); segment `i` is
    /// the `i`-th of them.
    pub fields: Vec<usize>,
    /// Whether the confidence token from `(p0, H0)` leads the context.
    pub confidence: bool,
    /// What the encoder was trained with (`layout`, `placement` in `scopemem_config.json`);
    /// serving checks it against the step it runs (`agent::scopemem::check_trained_with`).
    pub trained_with: TrainedWith,
}

/// The actor context layout and prefix placement an encoder was trained with, as the trainer
/// records them. `None`: not recorded (an encoder written before the record existed); serving then
/// warns at load and does not check that value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrainedWith {
    /// The actor's context layout (`gui-owl` or `paper`), the dump's `layout`.
    pub layout: Option<String>,
    /// Where the prefix went in the second pass (`prepend` or `append`), the dump's `placement`.
    pub placement: Option<String>,
}

/// The encoders of the paper's study (§3, §6, Table 7), by what they read. [`Full`](Self::Full)
/// and [`NoHistory`](Self::NoHistory) read the first opinion (a0, p0, H0) and so need the actor's
/// first pass; the others are one-pass: their prefix is known before the actor answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// ScopeMem's first-opinion encoder: a0, the task, the summary, the recent actions, p0 and H0.
    Full,
    /// The full encoder's inputs that exist before the first pass: the task, the summary and the
    /// recent actions (the paper's "history encoder").
    OnePass,
    /// The task alone.
    TaskOnly,
    /// The summary and the recent actions, without the task.
    HistoryOnly,
    /// No inputs: 16 learned queries through the cross blocks' MLPs and the output projection (the
    /// fixed-query prefix: the same for every step).
    FixedQuery,
    /// The full encoder's inputs less the summary and the recent actions: Table 7's history
    /// ablation, which "uses a separately trained encoder" (Appendix A.2).
    NoHistory,
}

impl Variant {
    /// Every variant, in the order above.
    pub const ALL: [Variant; 6] = [
        Variant::Full,
        Variant::OnePass,
        Variant::TaskOnly,
        Variant::HistoryOnly,
        Variant::FixedQuery,
        Variant::NoHistory,
    ];

    /// The name `--variant` and `scopemem_config.json` use.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Full => "full",
            Variant::OnePass => "one-pass",
            Variant::TaskOnly => "task-only",
            Variant::HistoryOnly => "history-only",
            Variant::FixedQuery => "fixed-query",
            Variant::NoHistory => "no-history",
        }
    }

    /// The fields it reads (indices into [`FIELDS`]) and whether it reads the confidence token.
    pub fn inputs(self) -> (Vec<usize>, bool) {
        match self {
            Variant::Full => (vec![0, 1, 2, 3], true),
            Variant::OnePass => (vec![1, 2, 3], false),
            Variant::TaskOnly => (vec![1], false),
            Variant::HistoryOnly => (vec![2, 3], false),
            Variant::FixedQuery => (vec![], false),
            Variant::NoHistory => (vec![0, 1], true),
        }
    }

    /// The variant that reads exactly these inputs, if any.
    pub fn of(fields: &[usize], confidence: bool) -> Option<Variant> {
        Variant::ALL
            .into_iter()
            .find(|v| v.inputs() == (fields.to_vec(), confidence))
    }
}

impl std::str::FromStr for Variant {
    type Err = Error;

    /// `full`, `one-pass`, `task-only`, `history-only`, `fixed-query` or `no-history`.
    ///
    /// ```
    /// use recall::model::scopemem::Variant;
    /// assert_eq!("task-only".parse::<Variant>().unwrap(), Variant::TaskOnly);
    /// assert!("history".parse::<Variant>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        Variant::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| {
            Error::InvalidRequest(format!(
                "ScopeMem variant `{s}`: expected full, one-pass, task-only, history-only, fixed-query or no-history"
            ))
        })
    }
}

impl ScopeMemConfig {
    /// The paper's encoder for an actor of `hidden_size` (4096 for Qwen3-VL-8B): d 384, 6 heads of 64,
    /// 2 + 2 blocks, 16 queries, ffn 1536, confidence MLP 384 wide, 256 positions per field.
    ///
    /// ```
    /// use recall::model::scopemem::ScopeMemConfig;
    /// assert_eq!(ScopeMemConfig::paper(4096).num_parameters(), 10_508_032);
    /// ```
    pub fn paper(hidden_size: usize) -> Self {
        ScopeMemConfig {
            hidden_size,
            d_model: 384,
            num_heads: 6,
            num_self_layers: 2,
            num_cross_layers: 2,
            num_queries: 16,
            ffn_size: 1536,
            conf_hidden: 384,
            num_action_types: NUM_ACTION_TYPES,
            max_positions: 256,
            layer_norm_eps: 1e-5,
            fields: vec![0, 1, 2, 3],
            confidence: true,
            trained_with: TrainedWith::default(),
        }
    }

    /// This shape reading `variant`'s inputs; a fixed-query encoder has no self-attention blocks
    /// (no context) and its cross blocks attend to nothing (their attention adds `o_proj`'s bias).
    ///
    /// ```
    /// use recall::model::scopemem::{ScopeMemConfig, Variant};
    /// let c = ScopeMemConfig::paper(4096).with_variant(Variant::TaskOnly);
    /// assert!(!c.needs_first_opinion());
    /// assert_eq!(c.variant(), Some(Variant::TaskOnly));
    /// ```
    pub fn with_variant(mut self, variant: Variant) -> Self {
        (self.fields, self.confidence) = variant.inputs();
        if variant == Variant::FixedQuery {
            self.num_self_layers = 0;
        }
        self
    }

    /// The study variant these inputs make, if one.
    pub fn variant(&self) -> Option<Variant> {
        Variant::of(&self.fields, self.confidence)
    }

    /// Whether the prefix depends on the actor's first pass (a0, or p0 and H0).
    pub fn needs_first_opinion(&self) -> bool {
        self.confidence || self.fields.contains(&0)
    }

    /// Whether the context holds anything (fields or the confidence token).
    pub fn has_context(&self) -> bool {
        self.confidence || !self.fields.is_empty()
    }

    /// Reads and validates a `scopemem_config.json`; errors name the file and the field.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::limits::read_capped(path, crate::limits::MAX_CONFIG_BYTES)?;
        let doc: Value = serde_json::from_str(&text).map_err(|e| Error::json(path, "", e))?;
        Self::from_json(path, &doc)
    }

    /// Parses and validates a config document; `path` is only used in errors.
    pub fn from_json(path: &Path, doc: &Value) -> Result<Self> {
        let err = |field: &str, msg: String| Error::json(path, field, msg);
        if !doc.is_object() {
            return Err(err("", "the config is not a JSON object".into()));
        }
        match doc.get("model_type").and_then(Value::as_str) {
            Some("scopemem_encoder") => {}
            other => {
                return Err(err(
                    "model_type",
                    format!("expected \"scopemem_encoder\", found {other:?}"),
                ))
            }
        }
        if let Some(v) = doc.get("format_version") {
            if v.as_u64() != Some(1) {
                return Err(err("format_version", format!("expected 1, found {v}")));
            }
        }
        let fields = match doc.get("fields") {
            None => vec![0, 1, 2, 3],
            Some(v) => parse_fields(v).map_err(|m| err("fields", m))?,
        };
        let confidence = match doc.get("confidence") {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(err("confidence", format!("expected true or false, found {v}"))),
        };
        let count = |field: &str, min: u64| -> Result<usize> {
            match doc.get(field).and_then(Value::as_u64) {
                Some(v) if v >= min => Ok(v as usize),
                _ => Err(err(
                    field,
                    format!("missing or not an integer ≥ {min} (found {:?})", doc.get(field)),
                )),
            }
        };
        let size = |field: &str| count(field, 1);
        let eps = match doc.get("layer_norm_eps").and_then(Value::as_f64) {
            Some(v) if v > 0.0 && v.is_finite() => v as f32,
            _ => {
                return Err(err(
                    "layer_norm_eps",
                    format!(
                        "missing or not a positive number (found {:?})",
                        doc.get("layer_norm_eps")
                    ),
                ))
            }
        };
        let cfg = ScopeMemConfig {
            hidden_size: size("hidden_size")?,
            d_model: size("d_model")?,
            num_heads: size("num_heads")?,
            num_self_layers: count("num_self_layers", 0)?,
            num_cross_layers: count("num_cross_layers", 0)?,
            num_queries: size("num_queries")?,
            ffn_size: size("ffn_size")?,
            conf_hidden: size("conf_hidden")?,
            num_action_types: size("num_action_types")?,
            max_positions: size("max_positions")?,
            layer_norm_eps: eps,
            fields,
            confidence,
            trained_with: TrainedWith {
                layout: recorded(doc, "layout").map_err(|m| err("layout", m))?,
                placement: recorded(doc, "placement").map_err(|m| err("placement", m))?,
            },
        };
        cfg.check(path, doc)?;
        Ok(cfg)
    }

    /// The checks across fields, after each field has been read.
    fn check(&self, path: &Path, doc: &Value) -> Result<()> {
        let err = |field: &str, msg: String| Error::json(path, field, msg);
        let cfg = self;
        if !cfg.has_context() && cfg.num_self_layers > 0 {
            return Err(err(
                "num_self_layers",
                format!(
                    "{}: an encoder that reads nothing (fixed-query) has no context to \
                     self-attend; it must be 0",
                    cfg.num_self_layers
                ),
            ));
        }
        if let Some(v) = doc.get("variant") {
            let named = v.as_str().map(str::parse::<Variant>);
            match (named, cfg.variant()) {
                (Some(Ok(n)), Some(made)) if n == made => {}
                _ => {
                    return Err(err(
                        "variant",
                        format!(
                            "{v} does not match the inputs `fields` and `confidence` describe ({})",
                            cfg.variant().map_or("no named variant", Variant::name)
                        ),
                    ))
                }
            }
        }
        if !cfg.d_model.is_multiple_of(cfg.num_heads) {
            return Err(err(
                "num_heads",
                format!("{} does not divide d_model {}", cfg.num_heads, cfg.d_model),
            ));
        }
        if cfg.num_action_types != NUM_ACTION_TYPES {
            return Err(err(
                "num_action_types",
                format!(
                    "{} (recall's p0 has {NUM_ACTION_TYPES} action types)",
                    cfg.num_action_types
                ),
            ));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.num_heads
    }

    /// Every tensor of the checkpoint with its shape, in the order of the forward pass.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, d, f, c) = (self.hidden_size, self.d_model, self.ffn_size, self.conf_hidden);
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        fn linear(t: &mut Vec<(String, Vec<usize>)>, name: &str, out: usize, inp: usize) {
            t.push((format!("{name}.weight"), vec![out, inp]));
            t.push((format!("{name}.bias"), vec![out]));
        }
        fn norm(t: &mut Vec<(String, Vec<usize>)>, name: &str, d: usize) {
            t.push((format!("{name}.weight"), vec![d]));
            t.push((format!("{name}.bias"), vec![d]));
        }
        let block = |t: &mut Vec<(String, Vec<usize>)>, p: &str| {
            norm(t, &format!("{p}.norm1"), d);
            for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                linear(t, &format!("{p}.attn.{proj}"), d, d);
            }
            norm(t, &format!("{p}.norm2"), d);
            linear(t, &format!("{p}.mlp.fc1"), f, d);
            linear(t, &format!("{p}.mlp.fc2"), d, f);
        };
        if !self.fields.is_empty() {
            linear(&mut t, "in_proj", d, h);
            t.push(("segment_embed.weight".into(), vec![self.fields.len(), d]));
            t.push(("pos_embed.weight".into(), vec![self.max_positions, d]));
        }
        if self.confidence {
            linear(&mut t, "conf_mlp.fc1", c, self.num_action_types + 1);
            linear(&mut t, "conf_mlp.fc2", d, c);
        }
        for i in 0..self.num_self_layers {
            block(&mut t, &format!("self_layers.{i}"));
        }
        if self.has_context() {
            norm(&mut t, "context_norm", d);
        }
        t.push(("queries".into(), vec![self.num_queries, d]));
        for i in 0..self.num_cross_layers {
            block(&mut t, &format!("cross_layers.{i}"));
        }
        norm(&mut t, "out_norm", d);
        linear(&mut t, "out_proj", h, d);
        t
    }

    /// The number of parameters (docs/SCOPEMEM.md has the formula), equal to the sum over
    /// [`tensors`](Self::tensors).
    pub fn num_parameters(&self) -> usize {
        let (h, d, f, c) = (self.hidden_size, self.d_model, self.ffn_size, self.conf_hidden);
        let block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d);
        let fields = if self.fields.is_empty() {
            0
        } else {
            (h * d + d) + self.fields.len() * d + self.max_positions * d
        };
        let confidence = if self.confidence {
            (self.num_action_types + 1) * c + c + c * d + d
        } else {
            0
        };
        fields
            + confidence
            + self.num_self_layers * block
            + if self.has_context() { 2 * d } else { 0 }
            + self.num_queries * d
            + self.num_cross_layers * block
            + 2 * d
            + (d * h + h)
    }
}

/// What the encoder reads for one step. Each field is row-major `[n, hidden]` f32: the actor's
/// frozen token embeddings of that text (`n` may be 0: an empty field contributes no tokens).
///
/// ```
/// use recall::model::scopemem::EncoderInputs;
/// let hidden = 64;
/// let mut p0 = [0.0f32; 10];
/// p0[1] = 1.0;
/// let inputs = EncoderInputs {
///     first_opinion: vec![0.1; 3 * hidden], // 3 tokens
///     task: vec![0.2; 5 * hidden],
///     p0,
///     ..Default::default() // no summary or recent actions yet
/// };
/// assert_eq!(inputs.fields()[2], ("summary", &[][..]));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EncoderInputs {
    /// The first opinion a0 (the actor's answer without a prefix), `[n0, hidden]`.
    pub first_opinion: Vec<f32>,
    /// The task instruction, `[n1, hidden]`.
    pub task: Vec<f32>,
    /// The rolling summary of the last three steps, `[n2, hidden]`.
    pub summary: Vec<f32>,
    /// The recent actions, `[n3, hidden]`.
    pub recent_actions: Vec<f32>,
    /// The actor's probabilities over the action types (on the simplex).
    pub p0: [f32; NUM_ACTION_TYPES],
}

impl EncoderInputs {
    /// The fields with their names, in context (segment) order.
    pub fn fields(&self) -> [(&'static str, &[f32]); 4] {
        [
            (FIELDS[0], &self.first_opinion),
            (FIELDS[1], &self.task),
            (FIELDS[2], &self.summary),
            (FIELDS[3], &self.recent_actions),
        ]
    }
}

/// `fields` of `scopemem_config.json`: names from [`FIELDS`], each at most once, in that order.
/// A recorded training setting: absent or null is `None`, a non-empty string is kept, anything
/// else is an error (the value is checked against the step when serving).
fn recorded(doc: &Value, key: &str) -> std::result::Result<Option<String>, String> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(v) => Err(format!("expected a non-empty string, found {v}")),
    }
}

fn parse_fields(v: &Value) -> std::result::Result<Vec<usize>, String> {
    let names = v
        .as_array()
        .ok_or_else(|| format!("expected a list of field names, found {v}"))?;
    let mut out: Vec<usize> = Vec::new();
    for n in names {
        let i = n
            .as_str()
            .and_then(|n| FIELDS.iter().position(|f| *f == n))
            .ok_or_else(|| format!("{n} is not one of {FIELDS:?}"))?;
        if out.last().is_some_and(|&last| last >= i) {
            return Err(format!("{v}: each of {FIELDS:?} at most once, in that order"));
        }
        out.push(i);
    }
    Ok(out)
}

/// The entropy `H0 = −Σ p ln p` of the action-type distribution (natural log, `0 · ln 0 = 0`), summed
/// in f64.
///
/// ```
/// use recall::model::scopemem::action_type_entropy;
/// let mut one_hot = [0.0f32; 10];
/// one_hot[4] = 1.0;
/// assert_eq!(action_type_entropy(&one_hot), 0.0);
/// assert!((action_type_entropy(&[0.1; 10]) - 10f32.ln()).abs() < 1e-6);
/// ```
pub fn action_type_entropy(p0: &[f32]) -> f32 {
    let h: f64 = p0
        .iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| {
            let p = p as f64;
            -p * p.ln()
        })
        .sum();
    h as f32
}

/// Checks that `p` is a distribution over the [`NUM_ACTION_TYPES`] action types (finite, `≥ 0`, sum
/// within [`P0_SUM_TOLERANCE`] of 1) and returns it as the array [`EncoderInputs::p0`] holds.
///
/// ```
/// use recall::model::scopemem::p0_from_slice;
/// assert!(p0_from_slice(&[0.1; 10]).is_ok());
/// assert!(p0_from_slice(&[0.1; 9]).is_err()); // wrong length
/// assert!(p0_from_slice(&[0.2; 10]).is_err()); // sums to 2
/// ```
pub fn p0_from_slice(p: &[f32]) -> Result<[f32; NUM_ACTION_TYPES]> {
    let arr: [f32; NUM_ACTION_TYPES] = p.try_into().map_err(|_| {
        Error::InvalidRequest(format!(
            "ScopeMem p0 must have {NUM_ACTION_TYPES} action-type probabilities, got {}",
            p.len()
        ))
    })?;
    check_p0(&arr)?;
    Ok(arr)
}

fn check_p0(p: &[f32]) -> Result<()> {
    if let Some((i, v)) = p.iter().enumerate().find(|(_, v)| !v.is_finite() || **v < 0.0) {
        return Err(Error::InvalidRequest(format!(
            "ScopeMem p0[{i}] = {v} is not a probability (p0 = {p:?})"
        )));
    }
    let sum: f32 = p.iter().sum();
    if (sum - 1.0).abs() > P0_SUM_TOLERANCE {
        return Err(Error::InvalidRequest(format!(
            "ScopeMem p0 sums to {sum}, not 1 (tolerance {P0_SUM_TOLERANCE}; p0 = {p:?})"
        )));
    }
    Ok(())
}

/// A pre-LayerNorm block; self-attention, or cross-attention onto a context.
struct Block<B: Backend> {
    norm1: LayerNorm<B>,
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    norm2: LayerNorm<B>,
    mlp: GeluMlp<B>,
    heads: usize,
}

impl<B: Backend> Block<B> {
    fn load(w: &Weights<B>, c: &ScopeMemConfig) -> Result<Self> {
        let (d, eps) = (c.d_model, c.layer_norm_eps);
        let proj = |name: &str| Linear::load(&w.pp("attn").pp(name), d, d, true);
        Ok(Block {
            norm1: LayerNorm::load(&w.pp("norm1"), d, eps)?,
            q_proj: proj("q_proj")?,
            k_proj: proj("k_proj")?,
            v_proj: proj("v_proj")?,
            o_proj: proj("o_proj")?,
            norm2: LayerNorm::load(&w.pp("norm2"), d, eps)?,
            mlp: GeluMlp::load(&w.pp("mlp"), ["fc1", "fc2"], [d, c.ffn_size, d], Gelu::Erf)?,
            heads: c.num_heads,
        })
    }

    /// `x: [m, d]`; `ctx: [n, d]` for cross-attention (already normalised), `None` for self-attention.
    fn forward(&self, be: &B, x: &B::Tensor, ctx: Option<&B::Tensor>) -> Result<B::Tensor> {
        let y = self.norm1.forward(be, x)?;
        let kv = ctx.unwrap_or(&y);
        let q = self.q_proj.forward(be, &y)?;
        let k = self.k_proj.forward(be, kv)?;
        let v = self.v_proj.forward(be, kv)?;
        let a = match ctx {
            None => {
                let n = be.dims(&q).0;
                be.attention_segments(&q, &k, &v, self.heads, &[0, n])?
            }
            Some(_) => cross_attention(be, &q, &k, &v, self.heads)?,
        };
        let x = be.add(x, &self.o_proj.forward(be, &a)?)?;
        let m = self.mlp.forward(be, &self.norm2.forward(be, &x)?)?;
        be.add(&x, &m)
    }

    /// Cross-attention onto an empty context: the attention output is the empty sum, zero, so
    /// the block adds `o_proj(0)` (its bias) and then its MLP — what PyTorch computes for zero keys.
    fn forward_onto_nothing(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let (m, d) = be.dims(x);
        let x = be.add(x, &self.o_proj.forward(be, &be.zeros(m, d)?)?)?;
        let mlp = self.mlp.forward(be, &self.norm2.forward(be, &x)?)?;
        be.add(&x, &mlp)
    }
}

/// Unmasked attention of `q: [m, heads·hd]` onto `k, v: [n, heads·hd]` (`n ≥ 1`) from
/// [`Backend::attention_segments`], which needs as many query rows as key rows: the context is
/// repeated `s = ⌈m/n⌉` times as `s` segments of `n` rows, query `i` is placed at row `i` (so in
/// segment `⌊i/n⌋`, which holds the whole context) and the other `s·n − m` query rows are zero, their
/// outputs discarded. Each row's result depends only on its own segment, so this is exactly
/// `softmax(q kᵀ/√hd) v`. Cost: `s·n ≤ max(m, n) + n` rows of attention, like one self-attention
/// layer over the context when `n ≥ m`.
fn cross_attention<B: Backend>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    heads: usize,
) -> Result<B::Tensor> {
    let (m, width) = be.dims(q);
    let n = be.dims(k).0;
    let segments = m.div_ceil(n);
    let rows = segments * n;
    let mut qp = be.zeros(rows, width)?;
    be.scatter_rows(&mut qp, &(0..m).collect::<Vec<_>>(), q, false)?;
    let repeat: Vec<usize> = (0..rows).map(|r| r % n).collect();
    let (kr, vr) = (be.gather_rows(k, &repeat)?, be.gather_rows(v, &repeat)?);
    let cu: Vec<usize> = (0..=segments).map(|s| s * n).collect();
    let out = be.attention_segments(&qp, &kr, &vr, heads, &cu)?;
    be.rows(&out, 0, m)
}

/// How field tokens enter the context: `in_proj(e) + segment_embed[s] + pos_embed[position]`.
struct FieldEmbedding<B: Backend> {
    in_proj: Linear<B>,       // [d, hidden]
    segment_embed: B::Weight, // [fields, d]
    pos_embed: B::Weight,     // [max_positions, d]
}

/// The ScopeMem encoder's weights on a backend (the CPU reference unless stated).
///
/// ```
/// use recall::model::scopemem::{EncoderInputs, ScopeMemEncoder};
/// let enc = ScopeMemEncoder::load(std::path::Path::new("tests/fixtures/scopemem/encoder"))?;
/// let hidden = enc.config().hidden_size;
/// let mut p0 = [0.05f32; 10];
/// p0[0] = 0.55;
/// let inputs = EncoderInputs { task: vec![0.1; 4 * hidden], p0, ..Default::default() };
/// let prefix = enc.forward(&inputs)?; // [16 * hidden]
/// assert_eq!(prefix.len(), enc.config().num_queries * hidden);
/// # Ok::<(), recall::Error>(())
/// ```
pub struct ScopeMemEncoder<B: Backend = CpuBackend> {
    config: ScopeMemConfig,
    /// The directory it was loaded from (for errors and logs).
    source: PathBuf,
    /// Present when the encoder reads text fields.
    fields: Option<FieldEmbedding<B>>,
    conf_mlp: Option<GeluMlp<B>>, // [11] -> [conf_hidden] -> [d]
    self_layers: Vec<Block<B>>,
    /// Present when the context holds anything.
    context_norm: Option<LayerNorm<B>>,
    queries: B::Weight, // [num_queries, d]
    cross_layers: Vec<Block<B>>,
    out_norm: LayerNorm<B>,
    out_proj: Linear<B>, // [hidden, d]
}

impl ScopeMemEncoder<CpuBackend> {
    /// Loads `dir/scopemem_config.json` and `dir/scopemem.safetensors` onto the CPU backend. Every
    /// tensor is shape-checked against the config; a missing, misshapen or unexpected tensor is an
    /// error naming it and the file.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_on(&CpuBackend, dir)
    }

    /// The prefix `[num_queries · hidden]` (row-major `[num_queries, hidden]`) for one step, on the CPU.
    pub fn forward(&self, inputs: &EncoderInputs) -> Result<Vec<f32>> {
        self.forward_on(&CpuBackend, inputs)
    }
}

impl<B: Backend> ScopeMemEncoder<B> {
    /// [`ScopeMemEncoder::load`] onto any backend.
    pub fn load_on(backend: &B, dir: &Path) -> Result<Self> {
        let config = ScopeMemConfig::from_file(&dir.join(CONFIG_FILE))?;
        let file = dir.join(WEIGHTS_FILE);
        let ckpt = Checkpoint::open_file(&file)?;
        let expected = config.tensors();
        let known: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = ckpt.names().into_iter().find(|n| !known.contains(n)) {
            return Err(Error::Safetensors {
                path: file,
                message: format!(
                    "unexpected tensor `{extra}` (not part of the encoder described by {CONFIG_FILE}: \
                     {} self and {} cross layers)",
                    config.num_self_layers, config.num_cross_layers
                ),
            });
        }
        // Every tensor is shape-checked as it loads, in forward order (that of `config.tensors()`).
        let w = Weights::new(backend, &ckpt);
        let (c, d) = (&config, config.d_model);
        let norm = |name: &str| LayerNorm::load(&w.pp(name), d, c.layer_norm_eps);
        let fields = if c.fields.is_empty() {
            None
        } else {
            Some(FieldEmbedding {
                in_proj: Linear::load(&w.pp("in_proj"), d, c.hidden_size, true)?,
                segment_embed: w.get("segment_embed.weight", &[c.fields.len(), d])?,
                pos_embed: w.get("pos_embed.weight", &[c.max_positions, d])?,
            })
        };
        let conf_in = [c.num_action_types + 1, c.conf_hidden, d];
        let conf_mlp = c
            .confidence
            .then(|| GeluMlp::load(&w.pp("conf_mlp"), ["fc1", "fc2"], conf_in, Gelu::Erf))
            .transpose()?;
        let self_layers = (0..c.num_self_layers)
            .map(|i| Block::load(&w.pp("self_layers").pp(i), c))
            .collect::<Result<_>>()?;
        let context_norm = c.has_context().then(|| norm("context_norm")).transpose()?;
        let queries = w.get("queries", &[c.num_queries, d])?;
        let cross_layers = (0..c.num_cross_layers)
            .map(|i| Block::load(&w.pp("cross_layers").pp(i), c))
            .collect::<Result<_>>()?;
        let enc = ScopeMemEncoder {
            fields,
            conf_mlp,
            self_layers,
            context_norm,
            queries,
            cross_layers,
            out_norm: norm("out_norm")?,
            out_proj: Linear::load(&w.pp("out_proj"), c.hidden_size, d, true)?,
            source: dir.to_path_buf(),
            config,
        };
        for (key, value) in [
            ("layout", &enc.config.trained_with.layout),
            ("placement", &enc.config.trained_with.placement),
        ] {
            if value.is_none() {
                // An encoder exported before the trainer recorded it: served unchecked.
                tracing::warn!(
                    dir = %dir.display(),
                    "{CONFIG_FILE} records no `{key}` (an older export): it is not checked against the \
                     step; add `\"{key}\": ...` with the value it was trained with to have it checked"
                );
            }
        }
        tracing::info!(
            dir = %dir.display(),
            parameters = enc.config.num_parameters(),
            backend = backend.name(),
            "loaded ScopeMem encoder"
        );
        Ok(enc)
    }

    /// The encoder's configuration.
    pub fn config(&self) -> &ScopeMemConfig {
        &self.config
    }

    /// The directory the encoder was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// [`ScopeMemEncoder::forward`] on any backend (the one the weights were loaded onto). Only the
    /// fields the config lists are read (and checked), and `p0` only when it reads the confidence.
    ///
    /// Errors (before any computation): `p0` not a distribution; a field whose length is not a
    /// multiple of `hidden_size`, that holds more than `max_positions` tokens or non-finite values.
    pub fn forward_on(&self, be: &B, inputs: &EncoderInputs) -> Result<Vec<f32>> {
        let c = &self.config;
        if c.confidence {
            check_p0(&inputs.p0)?;
        }
        let mut q = be.embedding(&self.queries, &(0..c.num_queries as u32).collect::<Vec<_>>())?;
        let ctx = self.context(be, inputs)?;
        for layer in &self.cross_layers {
            q = match &ctx {
                Some(ctx) => layer.forward(be, &q, Some(ctx))?,
                None => layer.forward_onto_nothing(be, &q)?,
            };
        }
        let out = self.out_proj.forward(be, &self.out_norm.forward(be, &q)?)?;
        be.download(&out)
    }

    /// The normalised context `[L, d]` after the self-attention blocks: the confidence token (when
    /// read), then the read fields' tokens in segment order. `None` when it holds nothing (an
    /// encoder that reads nothing, or only fields that are all empty, as history on a first step).
    fn context(&self, be: &B, inputs: &EncoderInputs) -> Result<Option<B::Tensor>> {
        let c = &self.config;
        let (hidden, d) = (c.hidden_size, c.d_model);
        let Some(norm) = &self.context_norm else {
            return Ok(None);
        };
        let all = inputs.fields();
        let (rows, segment, position) = self.field_tokens(&all)?;
        let tokens = segment.len();
        let lead = usize::from(c.confidence);
        let len = lead + tokens;
        if len == 0 {
            return Ok(None);
        }
        let mut h = be.zeros(len, d)?; // [len, d]
        if let Some(conf_mlp) = &self.conf_mlp {
            let mut features = inputs.p0.to_vec();
            features.push(action_type_entropy(&inputs.p0));
            let conf = conf_mlp.forward(be, &be.upload(&features, 1, features.len())?)?;
            be.scatter_rows(&mut h, &[0], &conf, false)?;
        }
        if let (Some(f), true) = (&self.fields, tokens > 0) {
            let x = f.in_proj.forward(be, &be.upload(&rows, tokens, hidden)?)?;
            let x = be.add(&x, &be.embedding(&f.segment_embed, &segment)?)?;
            let x = be.add(&x, &be.embedding(&f.pos_embed, &position)?)?;
            be.scatter_rows(&mut h, &(lead..len).collect::<Vec<_>>(), &x, false)?;
        }
        for layer in &self.self_layers {
            h = layer.forward(be, &h, None)?;
        }
        Ok(Some(norm.forward(be, &h)?))
    }

    /// The read fields' embeddings concatenated in segment order, with their segment and position
    /// ids; every read field is checked.
    #[allow(clippy::type_complexity)]
    fn field_tokens(&self, all: &[(&'static str, &[f32]); 4]) -> Result<(Vec<f32>, Vec<u32>, Vec<u32>)> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let mut rows: Vec<f32> = Vec::new();
        let (mut segment, mut position) = (Vec::new(), Vec::new());
        for (s, &field) in c.fields.iter().enumerate() {
            let (name, data) = all[field];
            if data.len() % hidden != 0 {
                return Err(Error::InvalidRequest(format!(
                    "ScopeMem field `{name}` has {} values, not a multiple of hidden_size {hidden} \
                     (expected [n, {hidden}] token embeddings)",
                    data.len()
                )));
            }
            let n = data.len() / hidden;
            if n > c.max_positions {
                return Err(Error::InvalidRequest(format!(
                    "ScopeMem field `{name}` has {n} tokens, more than max_positions {} of {}; \
                     truncate it",
                    c.max_positions,
                    self.source.display()
                )));
            }
            if let Some(i) = data.iter().position(|v| !v.is_finite()) {
                return Err(Error::InvalidRequest(format!(
                    "ScopeMem field `{name}`: token {} holds a non-finite value",
                    i / hidden
                )));
            }
            rows.extend_from_slice(data);
            segment.extend(std::iter::repeat_n(s as u32, n));
            position.extend(0..n as u32);
        }
        Ok((rows, segment, position))
    }
}
