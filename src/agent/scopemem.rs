//! The ScopeMem step: first opinion, encoder prefix, second opinion.
//!
//! 1. The frozen actor answers alone: the first opinion a0 (greedy).
//! 2. p0, the actor's probabilities over the protocol's 10 action types, is computed exactly: every
//!    action-type continuation is scored at the decision position (the point of a0 where the tool
//!    call names its action) in one shared-prefix batch, and the sums are normalised. H0 is its
//!    entropy.
//! 3. The encoder reads a0, the task, a rolling summary of the last three steps and the recent
//!    actions (as the actor's frozen token embeddings), with p0 and H0, and writes K = 16 prefix
//!    vectors.
//! 4. The actor answers again with the prefix — prepended to its input embeddings as in the paper
//!    (positions as text tokens), or, as a variant that needs its own training, appended right before
//!    the assistant turn so that the context's K/V are reused. The second pass drafts from a0's
//!    tokens; greedy verification keeps it exactly what plain decoding gives.

use serde::Serialize;

use crate::action::{parse_response, Platform};
use crate::agent::causalcache::agent_params;
use crate::agent::dataset::EvalStep;
use crate::agent::eval::SplitMix64;
use crate::engine::{Generation, Prompt, RequestOptions, Segment, Session};
use crate::error::{Error, Result};
use crate::memory::episode::StepRecord;
use crate::memory::protocol::{render, render_paper, ContextLayout, Protocol};
use crate::model::scopemem::{action_type_entropy, EncoderInputs, ScopeMemEncoder, NUM_ACTION_TYPES};
use crate::model::AdapterMode;

/// The mobile protocol's action types, in the order of p0.
pub const MOBILE_ACTION_TYPES: [&str; NUM_ACTION_TYPES] = [
    "key",
    "click",
    "long_press",
    "swipe",
    "type",
    "system_button",
    "open",
    "wait",
    "answer",
    "terminate",
];

/// Where the prefix goes in the second pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Before the whole prompt (the paper).
    #[default]
    Prepend,
    /// Right before the assistant turn (reuses the context's K/V; needs its own training).
    Append,
}

impl Placement {
    /// The name `--placement` and the encoder's record use.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Prepend => "prepend",
            Placement::Append => "append",
        }
    }
}

impl std::str::FromStr for Placement {
    type Err = Error;

    /// `prepend` or `append`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prepend" => Ok(Placement::Prepend),
            "append" => Ok(Placement::Append),
            other => Err(Error::InvalidRequest(format!(
                "placement `{other}`: expected prepend or append"
            ))),
        }
    }
}

/// Settings of a ScopeMem step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeMemConfig {
    pub placement: Placement,
    pub max_tokens: usize,
    /// Draft the second pass from the first opinion's tokens.
    pub draft: bool,
    /// Run the plain actor's pass (a0, p0, H0) even when the encoder does not read it (a one-pass
    /// variant), so that keeps, repairs and harms can be counted; serving leaves it off.
    pub baseline: bool,
    /// How a dataset step's context is laid out for the actor (`run_dataset`, `dump_step`).
    pub layout: ContextLayout,
    /// An intervention on the encoder's inputs (the paper's Table 7), applied by [`run_dataset`]
    /// only: evaluation, never serving.
    pub intervention: Option<Intervention>,
    /// Seeds the intervention's random choices (with each step's episode and index).
    pub intervention_seed: u64,
}

impl Default for ScopeMemConfig {
    fn default() -> Self {
        ScopeMemConfig {
            placement: Placement::Prepend,
            max_tokens: 256,
            draft: true,
            baseline: false,
            layout: ContextLayout::GuiOwl,
            intervention: None,
            intervention_seed: 0,
        }
    }
}

/// Interventions on the encoder's inputs, ScopeMem's Table 7 (Appendix A.2: "Table 7 tests whether
/// the encoder uses the first opinion. Perturbing it or replacing it with one from another step
/// lowers accuracy. These interventions keep the encoder fixed"). Each changes one input of the
/// encoder and nothing else: the actor's passes, the a0 that repairs and harms are counted against,
/// p0 and H0 stay the step's own (docs/EVAL.md "Interventions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Intervention {
    /// The `first_opinion` field is a0 with the action type its tool call names replaced by another
    /// of the protocol's types, drawn uniformly from the seed ([`perturb_first_opinion`]); an a0 whose
    /// tool call names no action is left as it is. The paper does not say how it perturbs a0.
    PerturbA0,
    /// The `first_opinion` field is the a0 of another evaluated step, drawn uniformly from the seed.
    OtherA0,
    /// The `summary` and `recent_actions` fields are empty: recall's option. The paper's history
    /// row "uses a separately trained encoder" (a `no-history` variant,
    /// [`Variant::NoHistory`](crate::model::scopemem::Variant::NoHistory), evaluated as any encoder
    /// is); this keeps the trained encoder and withholds its history.
    WithholdHistory,
}

impl Intervention {
    /// The name `--intervention` uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Intervention::PerturbA0 => "perturb-a0",
            Intervention::OtherA0 => "other-a0",
            Intervention::WithholdHistory => "withhold-history",
        }
    }

    /// Whether `encoder` reads the input this intervention changes (else it would change nothing).
    fn applies_to(self, encoder: &ScopeMemEncoder) -> bool {
        let reads = &encoder.config().fields;
        match self {
            Intervention::PerturbA0 | Intervention::OtherA0 => reads.contains(&0),
            Intervention::WithholdHistory => reads.contains(&2) || reads.contains(&3),
        }
    }
}

impl std::str::FromStr for Intervention {
    type Err = Error;

    /// `perturb-a0`, `other-a0` or `withhold-history`. `no-history` is refused with the way to the
    /// paper's history ablation, which is an encoder, not an intervention on one.
    ///
    /// ```
    /// use recall::agent::scopemem::Intervention;
    /// assert_eq!("other-a0".parse::<Intervention>().unwrap(), Intervention::OtherA0);
    /// let e = "no-history".parse::<Intervention>().unwrap_err().to_string();
    /// assert!(e.contains("--variant no-history") && e.contains("withhold-history"));
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        if s == "no-history" {
            return Err(Error::InvalidRequest(
                "intervention `no-history`: the paper's history ablation is a separately trained \
                 encoder (tools/scopemem_train.py --variant no-history, then --encoder THAT_DIR and \
                 --compare); `withhold-history` keeps this encoder and empties its history fields"
                    .into(),
            ));
        }
        [
            Intervention::PerturbA0,
            Intervention::OtherA0,
            Intervention::WithholdHistory,
        ]
        .into_iter()
        .find(|i| i.as_str() == s)
        .ok_or_else(|| {
            Error::InvalidRequest(format!(
                "intervention `{s}`: expected perturb-a0, other-a0 or withhold-history"
            ))
        })
    }
}

/// The per-step random stream of an intervention: the seed and the step's place, so a step's draw
/// does not depend on which other steps are evaluated or in what order.
fn step_rng(seed: u64, episode: &str, step: u32) -> SplitMix64 {
    let key = format!("{episode}\u{0}{step}");
    SplitMix64(xxhash_rust::xxh64::xxh64(key.as_bytes(), seed))
}

/// `first` with the action type its tool call names (`"action": "TYPE"`) replaced by another of
/// [`MOBILE_ACTION_TYPES`], drawn uniformly with `seed` (any of the ten when TYPE is not one of
/// them); the rest of the text is unchanged. `None` when the tool call names no action.
///
/// ```
/// use recall::agent::scopemem::perturb_first_opinion;
/// let a0 = "<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [1, 2]}}\n</tool_call>";
/// let p = perturb_first_opinion(a0, 7).unwrap();
/// assert!(!p.contains("\"click\"") && p.ends_with("\"coordinate\": [1, 2]}}\n</tool_call>"));
/// assert_eq!(perturb_first_opinion("no tool call", 7), None);
/// ```
pub fn perturb_first_opinion(first: &str, seed: u64) -> Option<String> {
    perturb_with(first, &mut SplitMix64(seed))
}

fn perturb_with(first: &str, rng: &mut SplitMix64) -> Option<String> {
    let prefix = decision_prefix(first, Platform::Mobile);
    let rest = first.strip_prefix(prefix.as_str())?;
    let end = rest.find('"')?;
    let current = &rest[..end];
    let others: Vec<&str> = MOBILE_ACTION_TYPES
        .iter()
        .copied()
        .filter(|t| *t != current)
        .collect();
    let new = others[rng.below(others.len())];
    Some(format!("{prefix}{new}{}", &rest[end..]))
}

/// Applies `intervention` to the encoder's inputs in `ctx` (only `fields` and `ids` change; a0's
/// text and tokens, p0 and H0 stay). `donor`: the other step's `first_opinion` field (text and ids)
/// for [`Intervention::OtherA0`]; `seed` drives [`Intervention::PerturbA0`]. `max_positions`: the
/// encoder's, to cut a perturbed a0 as [`EncoderFields::ids`] does.
pub fn intervene(
    ctx: &mut StepContext,
    intervention: Intervention,
    donor: Option<(&str, &[u32])>,
    seed: u64,
    tokenizer: &crate::tokenize::Tokenizer,
    max_positions: usize,
) -> Result<()> {
    match intervention {
        Intervention::WithholdHistory => {
            ctx.fields.summary.clear();
            ctx.fields.recent_actions.clear();
            ctx.ids.summary.clear();
            ctx.ids.recent_actions.clear();
        }
        Intervention::OtherA0 => {
            let (text, ids) = donor.ok_or_else(|| {
                Error::InvalidRequest("intervention other-a0: no other step to take a0 from".into())
            })?;
            ctx.fields.first_opinion = text.to_string();
            ctx.ids.first_opinion = ids.to_vec();
        }
        Intervention::PerturbA0 => {
            if let Some(text) = perturb_first_opinion(&ctx.fields.first_opinion, seed) {
                ctx.ids.first_opinion = cut_ids(tokenizer, &text, max_positions, true)?;
                ctx.fields.first_opinion = text;
            }
        }
    }
    Ok(())
}

/// The name `--context` and the encoder's record use for `layout`.
pub fn layout_name(layout: ContextLayout) -> &'static str {
    match layout {
        ContextLayout::GuiOwl => "gui-owl",
        ContextLayout::Paper => "paper",
    }
}

/// Refuses to run `encoder` under a context layout or placement other than the ones it was
/// trained with (its `scopemem_config.json` record, docs/SCOPEMEM.md "Files"): the prefix was
/// learnt for one condition of the actor, and under another it is a different, untrained one.
/// A value the encoder does not record (an older export) is not checked; [`ScopeMemEncoder`]'s
/// loader warns about it. The error names the field, the trained value and the requested one.
pub fn check_trained_with(
    encoder: &ScopeMemEncoder,
    placement: Placement,
    layout: ContextLayout,
) -> Result<()> {
    let rec = &encoder.config().trained_with;
    for (field, trained, requested, flag) in [
        ("layout", &rec.layout, layout_name(layout), "--context"),
        ("placement", &rec.placement, placement.as_str(), "--placement"),
    ] {
        match trained {
            Some(t) if t != requested => {
                return Err(Error::InvalidRequest(format!(
                    "the ScopeMem encoder {} was trained with {field} `{t}`, but this step runs with \
                     {field} `{requested}`: run it with {flag} {t} (or train an encoder for {requested})",
                    encoder.source().display()
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Both opinions of one step. A one-pass encoder without `baseline` runs no plain pass: `first`,
/// `p0` and `h0` are then `None`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Opinions {
    pub first: Option<String>,
    /// The actor's probabilities over [`MOBILE_ACTION_TYPES`] at the decision position.
    pub p0: Option<[f32; NUM_ACTION_TYPES]>,
    pub h0: Option<f32>,
    /// The answer with the prefix.
    pub second: String,
    /// Decoder forwards the second pass took.
    pub second_pass_forwards: u64,
    /// Draft tokens the second pass accepted.
    pub accepted_draft: usize,
    /// What the encoder read (what `recall scopemem dump` writes for the trainer).
    pub context: StepContext,
}

/// The text of `first` up to and including the point where its tool call names the action
/// (`"action": "`); when it has none, the canonical opening of a tool call after its action line.
pub fn decision_prefix(first: &str, platform: Platform) -> String {
    if let Some(at) = first.find("\"action\"") {
        let rest = &first[at + "\"action\"".len()..];
        let colon = rest.len() - rest.trim_start().len();
        if let Some(after_colon) = rest.trim_start().strip_prefix(':') {
            let spaces = after_colon.len() - after_colon.trim_start().len();
            if after_colon.trim_start().starts_with('"') {
                let end = at + "\"action\"".len() + colon + 1 + spaces + 1;
                return first[..end].to_string();
            }
        }
    }
    let line = first.split("<tool_call>").next().unwrap_or_default().trim_end();
    format!(
        "{line}\n<tool_call>\n{{\"name\": \"{}\", \"arguments\": {{\"action\": \"",
        platform.tool_name()
    )
}

/// p0: the actor's distribution over the action types at the decision position of `first`,
/// computed exactly by scoring every continuation `TYPE"` in one shared-prefix call.
pub fn action_type_distribution(
    s: &mut dyn Session,
    prompt: &Prompt,
    first: &str,
    platform: Platform,
) -> Result<[f32; NUM_ACTION_TYPES]> {
    let prefix = decision_prefix(first, platform);
    // Tokenise each full continuation jointly with the prefix (BPE may merge across the boundary)
    // and score from the longest token prefix they all share.
    let seqs: Vec<Vec<u32>> = MOBILE_ACTION_TYPES
        .iter()
        .map(|t| s.tokenizer().encode(&format!("{prefix}{t}\"")))
        .collect::<Result<_>>()?;
    let min_len = seqs.iter().map(Vec::len).min().unwrap_or(0);
    let shared = (0..min_len.saturating_sub(1))
        .take_while(|&i| seqs.iter().all(|q| q[i] == seqs[0][i]))
        .count();
    let mut at_decision = prompt.clone();
    at_decision
        .segments
        .push(Segment::Text(seqs[0][..shared].to_vec()));
    let pairs: Vec<(Prompt, Vec<u32>)> = seqs
        .iter()
        .map(|q| (at_decision.clone(), q[shared..].to_vec()))
        .collect();
    let sums: Vec<f64> = s
        .score_many(&pairs, AdapterMode::Off)?
        .iter()
        .map(|sc| sc.sum_logprob)
        .collect();
    let max = sums.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = sums.iter().map(|s| (s - max).exp()).sum();
    let mut p0 = [0f32; NUM_ACTION_TYPES];
    for (o, sum) in p0.iter_mut().zip(&sums) {
        *o = ((sum - max).exp() / z) as f32;
    }
    Ok(p0)
}

/// One greedy generation through the engine; returns it with the forwards it took and the draft
/// tokens accepted.
fn generate(
    s: &mut dyn Session,
    prompt: &Prompt,
    max_tokens: usize,
    draft: Vec<u32>,
) -> Result<(Generation, u64, usize)> {
    let params = agent_params(s, max_tokens);
    let opts = RequestOptions {
        draft,
        ..Default::default()
    };
    let (g, out) = s.generate(prompt, params, opts)?;
    Ok((g, out.forwards, out.accepted_draft))
}

/// The encoder's four text fields at a step, built from what serving knows there: the first opinion
/// a0, the task, a rolling summary of the last three completed steps (`Step{i}: <response>` lines,
/// numbered from 1) and the action names of the last five (a step whose response does not parse
/// keeps its text).
///
/// ```
/// use recall::action::Platform;
/// use recall::agent::scopemem::EncoderFields;
/// let history = vec!["Action: open.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"open\", \"text\": \"Clock\"}}\n</tool_call>".to_string()];
/// let f = EncoderFields::build("a0", "Set an alarm", &history, Platform::Mobile);
/// assert!(f.summary.starts_with("Step1: Action: open."));
/// assert_eq!(f.recent_actions, "open");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EncoderFields {
    pub first_opinion: String,
    pub task: String,
    pub summary: String,
    pub recent_actions: String,
}

/// The fields as the actor's token ids, each cut to the encoder's positions: a0 and the task keep
/// their start, the summary and the recent actions their end (whose newest part matters most).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EncoderIds {
    pub first_opinion: Vec<u32>,
    pub task: Vec<u32>,
    pub summary: Vec<u32>,
    pub recent_actions: Vec<u32>,
}

impl EncoderFields {
    /// The fields at a step (`history`: the completed steps' responses or action lines, oldest
    /// first).
    pub fn build(first: &str, task: &str, history: &[String], platform: Platform) -> Self {
        let n = history.len();
        let recent = &history[n.saturating_sub(3)..];
        let summary: Vec<String> = recent
            .iter()
            .enumerate()
            .map(|(i, l)| format!("Step{}: {l}", n - recent.len() + i + 1))
            .collect();
        let actions: Vec<String> = history[n.saturating_sub(5)..]
            .iter()
            .map(|h| {
                parse_response(h, platform)
                    .map(|a| a.name().to_string())
                    .unwrap_or_else(|_| h.clone())
            })
            .collect();
        EncoderFields {
            first_opinion: first.to_string(),
            task: task.to_string(),
            summary: summary.join("\n"),
            recent_actions: actions.join(", "),
        }
    }

    /// The token ids the encoder reads, at most `max` per field.
    pub fn ids(&self, tokenizer: &crate::tokenize::Tokenizer, max: usize) -> Result<EncoderIds> {
        let cut = |text: &str, keep_first: bool| cut_ids(tokenizer, text, max, keep_first);
        Ok(EncoderIds {
            first_opinion: cut(&self.first_opinion, true)?,
            task: cut(&self.task, true)?,
            summary: cut(&self.summary, false)?,
            recent_actions: cut(&self.recent_actions, false)?,
        })
    }
}

/// `text`'s token ids, at most `max`: its start when `keep_first`, else its end.
fn cut_ids(
    tokenizer: &crate::tokenize::Tokenizer,
    text: &str,
    max: usize,
    keep_first: bool,
) -> Result<Vec<u32>> {
    let ids = tokenizer.encode(text)?;
    Ok(if ids.len() <= max {
        ids
    } else if keep_first {
        ids[..max].to_vec()
    } else {
        ids[ids.len() - max..].to_vec()
    })
}

/// Everything the encoder reads at a step, as serving computes it: a0 (text and tokens), p0 and
/// H0 at a0's decision position, and the encoder's fields (text and the ids it embeds).
/// `recall scopemem dump` writes exactly this per step for the trainer. Without the plain pass (a
/// one-pass encoder when serving) the first four are `None` and the `first_opinion` field is empty.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepContext {
    pub first: Option<String>,
    pub first_tokens: Option<Vec<u32>>,
    pub p0: Option<[f32; NUM_ACTION_TYPES]>,
    pub h0: Option<f32>,
    pub fields: EncoderFields,
    pub ids: EncoderIds,
}

/// The first pass (when `first_pass`) and the encoder's inputs at a step (the one builder serving
/// and `scopemem dump` share). `max_positions`: the encoder's.
#[allow(clippy::too_many_arguments)]
pub fn step_context(
    s: &mut dyn Session,
    prompt: &Prompt,
    task: &str,
    history: &[String],
    platform: Platform,
    max_tokens: usize,
    max_positions: usize,
    first_pass: bool,
) -> Result<StepContext> {
    let first = if first_pass {
        let (g, _, _) = generate(s, prompt, max_tokens, Vec::new())?;
        let text = g.text.clone().unwrap_or_default();
        let p0 = action_type_distribution(s, prompt, &text, platform)?;
        Some((text, g.tokens, p0))
    } else {
        None
    };
    let first_text = first.as_ref().map_or("", |f| f.0.as_str());
    let fields = EncoderFields::build(first_text, task, history, platform);
    let ids = fields.ids(s.tokenizer(), max_positions)?;
    let p0 = first.as_ref().map(|f| f.2);
    Ok(StepContext {
        first: first.as_ref().map(|f| f.0.clone()),
        first_tokens: first.map(|f| f.1),
        p0,
        h0: p0.map(|p| action_type_entropy(&p)),
        fields,
        ids,
    })
}

/// The encoder's prefix vectors `[K · hidden]` for a step's context: the fields it reads, as the
/// actor's frozen token embeddings, with p0 when it reads the confidence.
pub fn encoder_prefix(s: &mut dyn Session, encoder: &ScopeMemEncoder, ctx: &StepContext) -> Result<Vec<f32>> {
    let reads = &encoder.config().fields;
    let mut embed = |field: usize, ids: &[u32]| -> Result<Vec<f32>> {
        if reads.contains(&field) {
            s.embed_tokens(ids)
        } else {
            Ok(Vec::new())
        }
    };
    let p0 = match (encoder.config().confidence, ctx.p0) {
        (true, None) => {
            return Err(Error::InvalidRequest(format!(
                "the encoder {} reads p0, but the actor's first pass did not run",
                encoder.source().display()
            )))
        }
        (_, p0) => p0.unwrap_or([0.0; NUM_ACTION_TYPES]), // unread without the confidence token
    };
    let inputs = EncoderInputs {
        first_opinion: embed(0, &ctx.ids.first_opinion)?,
        task: embed(1, &ctx.ids.task)?,
        summary: embed(2, &ctx.ids.summary)?,
        recent_actions: embed(3, &ctx.ids.recent_actions)?,
        p0,
    };
    encoder.forward(&inputs)
}

/// Runs the ScopeMem step on `prompt` (the actor's prompt with its generation prompt).
///
/// `task` is the instruction, `history` the completed steps' action lines (oldest first). The
/// plain pass runs when the encoder reads its answer (the full variant) or `cfg.baseline` asks for
/// it; a one-pass variant otherwise costs one actor pass.
#[allow(clippy::too_many_arguments)]
pub fn scopemem_step(
    s: &mut dyn Session,
    encoder: &ScopeMemEncoder,
    prompt: &Prompt,
    task: &str,
    history: &[String],
    platform: Platform,
    cfg: &ScopeMemConfig,
) -> Result<Opinions> {
    check_trained_with(encoder, cfg.placement, cfg.layout)?;
    let ctx = step_context(
        s,
        prompt,
        task,
        history,
        platform,
        cfg.max_tokens,
        encoder.config().max_positions,
        cfg.baseline || encoder.config().needs_first_opinion(),
    )?;
    second_opinion(s, encoder, prompt, ctx, cfg)
}

/// The encoder's prefix from `ctx` (as [`step_context`] built it, or after [`intervene`]) and the
/// actor's second pass on `prompt` with it, drafted from a0's tokens.
pub fn second_opinion(
    s: &mut dyn Session,
    encoder: &ScopeMemEncoder,
    prompt: &Prompt,
    ctx: StepContext,
    cfg: &ScopeMemConfig,
) -> Result<Opinions> {
    let prefix = encoder_prefix(s, encoder, &ctx)?;
    let second_prompt = with_prefix(s, prompt, prefix, cfg.placement)?;
    let draft = match (&ctx.first_tokens, cfg.draft) {
        (Some(t), true) => t.clone(),
        _ => Vec::new(),
    };
    let (second, forwards, accepted) = generate(s, &second_prompt, cfg.max_tokens, draft)?;
    Ok(Opinions {
        first: ctx.first.clone(),
        p0: ctx.p0,
        h0: ctx.h0,
        second: second.text.unwrap_or_default(),
        second_pass_forwards: forwards,
        accepted_draft: accepted,
        context: ctx,
    })
}

/// `prompt` with the prefix vectors `[16 · hidden]` placed as an embedding run.
pub fn with_prefix(
    s: &dyn Session,
    prompt: &Prompt,
    prefix: Vec<f32>,
    placement: Placement,
) -> Result<Prompt> {
    let hidden = s.hidden_size();
    let rows = prefix.len() / hidden.max(1);
    let bytes: Vec<u8> = prefix.iter().flat_map(|x| x.to_le_bytes()).collect();
    let run = Segment::Embeds {
        hash: xxhash_rust::xxh64::xxh64(&bytes, 0x5c0e),
        rows,
        data: prefix,
    };
    let mut segments = prompt.segments.clone();
    match placement {
        Placement::Prepend => segments.insert(0, run),
        Placement::Append => {
            let turn = s.tokenizer().encode("<|im_start|>assistant\n")?;
            let Some(Segment::Text(last)) = segments.last_mut() else {
                return Err(Error::InvalidRequest(
                    "the prompt does not end with a text run".into(),
                ));
            };
            if !last.ends_with(&turn) {
                return Err(Error::InvalidRequest(
                    "the prompt does not end with the assistant turn".into(),
                ));
            }
            let tail = last.split_off(last.len() - turn.len());
            segments.push(run);
            segments.push(Segment::Text(tail));
        }
    }
    Ok(Prompt { segments })
}

/// The actor's prompt for a dataset step. `GuiOwl`: the GUI-Owl protocol with the step's history
/// folded, its earlier screenshots shown for the most recent steps, and the current screenshot last;
/// `Paper`: [`render_paper`] (the task, the last three steps' summary, the latest three screenshots).
pub fn dataset_prompt(
    s: &mut dyn Session,
    step: &EvalStep,
    platform: Platform,
    layout: ContextLayout,
) -> Result<Prompt> {
    s.chat_prompt(&dataset_messages(step, platform, layout)?)
}

/// The chat messages of [`dataset_prompt`] (images as paths).
pub fn dataset_messages(
    step: &EvalStep,
    platform: Platform,
    layout: ContextLayout,
) -> Result<Vec<crate::tokenize::chat::ChatMessage>> {
    let (current, earlier) = step
        .screenshots
        .split_last()
        .ok_or_else(|| Error::InvalidRequest(format!("line {}: no screenshot", step.line)))?;
    let shown = earlier.len().min(step.history.len());
    let first_shown = step.history.len() - shown;
    let completed: Vec<StepRecord> = step
        .history
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let shot = if i >= first_shown {
                earlier[earlier.len() - shown + i - first_shown].clone()
            } else {
                current.clone()
            };
            let mut r = StepRecord::new(shot, h.clone());
            if !h.contains("<tool_call>") {
                r.action_line = Some(h.clone());
            }
            r
        })
        .collect();
    let shown: Vec<usize> = (first_shown + 1..=step.history.len()).collect();
    let protocol = Protocol::for_platform(platform);
    match layout {
        ContextLayout::GuiOwl => render(protocol, &step.instruction, &completed, &shown, current),
        ContextLayout::Paper => render_paper(protocol, &step.instruction, &completed, &shown, current),
    }
}

/// One evaluated dataset step: what the metrics need, and the ScopeMem details when it ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DatasetResult {
    pub outcome: crate::agent::eval::StepOutcome,
    pub opinions: Option<Opinions>,
}

/// Runs the actor (and, with an encoder, ScopeMem's second opinion) on every step of `dataset` —
/// or only on the steps whose 1-based file line is in `lines` — with progress shown. Without an
/// encoder the second opinion is the first. The plain pass always runs (it is the baseline of keeps,
/// repairs and harms), whatever `cfg.baseline` says. `cfg.intervention` changes the encoder's
/// inputs ([`intervene`]); `other-a0` first runs the plain pass on every selected step, so that each
/// step can take another's a0.
///
/// Errors: no step selected; an encoder trained for another layout or placement
/// ([`check_trained_with`]); an intervention without an encoder, on an input the encoder does not
/// read, or `other-a0` on fewer than two steps.
pub fn run_dataset(
    s: &mut dyn Session,
    encoder: Option<&ScopeMemEncoder>,
    dataset: &crate::agent::dataset::StepDataset,
    lines: Option<&[usize]>,
    cfg: &ScopeMemConfig,
) -> Result<Vec<DatasetResult>> {
    let steps: Vec<&EvalStep> = dataset
        .steps
        .iter()
        .filter(|s| lines.is_none_or(|l| l.contains(&s.line)))
        .collect();
    if steps.is_empty() {
        return Err(Error::InvalidRequest(format!(
            "{}: no step selected",
            dataset.path.display()
        )));
    }
    let cfg = &ScopeMemConfig {
        baseline: true,
        ..cfg.clone()
    };
    if let Some(enc) = encoder {
        check_trained_with(enc, cfg.placement, cfg.layout)?;
    }
    check_intervention(encoder, cfg.intervention, steps.len())?;
    let donors = match (encoder, cfg.intervention) {
        (Some(enc), Some(Intervention::OtherA0)) => {
            Some(first_opinion_fields(s, enc, &steps, dataset.platform, cfg)?)
        }
        _ => None,
    };
    let bar = progress(steps.len(), "evaluating");
    let mut out = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let prompt = dataset_prompt(s, step, dataset.platform, cfg.layout)?;
        let (first, second, opinions) = match encoder {
            Some(enc) => {
                let o = evaluated_step(s, enc, &prompt, step, i, donors.as_deref(), dataset.platform, cfg)?;
                (o.first.clone().unwrap_or_default(), o.second.clone(), Some(o))
            }
            None => {
                let (g, _, _) = generate(s, &prompt, cfg.max_tokens, Vec::new())?;
                let text = g.text.unwrap_or_default();
                (text.clone(), text, None)
            }
        };
        out.push(DatasetResult {
            outcome: crate::agent::eval::StepOutcome {
                episode: step.episode.clone(),
                step: step.step,
                subset: step.subset.clone(),
                reference: step.reference.clone(),
                first,
                second,
                target_box: step.target_box,
                ui_annotations: step.ui_annotations.clone(),
                candidate_boxes: step.candidate_boxes.clone(),
            },
            opinions,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

fn progress(len: usize, what: &str) -> indicatif::ProgressBar {
    indicatif::ProgressBar::new(len as u64).with_style(
        indicatif::ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} steps"))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

/// An intervention needs an encoder that reads what it changes, and `other-a0` a second step.
fn check_intervention(
    encoder: Option<&ScopeMemEncoder>,
    intervention: Option<Intervention>,
    steps: usize,
) -> Result<()> {
    let Some(iv) = intervention else {
        return Ok(());
    };
    let enc = encoder.ok_or_else(|| {
        Error::InvalidRequest(format!(
            "intervention {}: it changes the encoder's inputs, and no encoder is given",
            iv.as_str()
        ))
    })?;
    if !iv.applies_to(enc) {
        return Err(Error::InvalidRequest(format!(
            "intervention {}: the encoder {} ({}) does not read the input it changes",
            iv.as_str(),
            enc.source().display(),
            enc.config().variant().map_or("custom", |v| v.name())
        )));
    }
    if iv == Intervention::OtherA0 && steps < 2 {
        return Err(Error::InvalidRequest(
            "intervention other-a0: needs at least two steps (one step's a0 goes to another)".into(),
        ));
    }
    Ok(())
}

/// Every selected step's unmodified `first_opinion` field (text, ids), from the plain pass.
fn first_opinion_fields(
    s: &mut dyn Session,
    enc: &ScopeMemEncoder,
    steps: &[&EvalStep],
    platform: Platform,
    cfg: &ScopeMemConfig,
) -> Result<Vec<(String, Vec<u32>)>> {
    let bar = progress(steps.len(), "first opinions");
    let mut out = Vec::with_capacity(steps.len());
    for step in steps {
        let prompt = dataset_prompt(s, step, platform, cfg.layout)?;
        let ctx = step_context(
            s,
            &prompt,
            &step.instruction,
            &step.history,
            platform,
            cfg.max_tokens,
            enc.config().max_positions,
            true,
        )?;
        out.push((ctx.fields.first_opinion, ctx.ids.first_opinion));
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// The ScopeMem step on dataset step `index` of the selection, with `cfg.intervention` applied to
/// the encoder's inputs (`donors`: every step's a0 field, for `other-a0`).
#[allow(clippy::too_many_arguments)]
fn evaluated_step(
    s: &mut dyn Session,
    enc: &ScopeMemEncoder,
    prompt: &Prompt,
    step: &EvalStep,
    index: usize,
    donors: Option<&[(String, Vec<u32>)]>,
    platform: Platform,
    cfg: &ScopeMemConfig,
) -> Result<Opinions> {
    let mut ctx = step_context(
        s,
        prompt,
        &step.instruction,
        &step.history,
        platform,
        cfg.max_tokens,
        enc.config().max_positions,
        true,
    )?;
    if let Some(iv) = cfg.intervention {
        let mut rng = step_rng(cfg.intervention_seed, &step.episode, step.step);
        let donor = donors.map(|d| {
            // Uniform over the other steps of the selection.
            let j = rng.below(d.len() - 1);
            let (text, ids) = &d[if j >= index { j + 1 } else { j }];
            (text.as_str(), ids.as_slice())
        });
        let seed = rng.next_u64();
        intervene(
            &mut ctx,
            iv,
            donor,
            seed,
            s.tokenizer(),
            enc.config().max_positions,
        )?;
    }
    second_opinion(s, enc, prompt, ctx, cfg)
}

/// One line of `recall scopemem dump`: a dataset step and what serving computes for it before the
/// encoder (docs/SCOPEMEM.md "Training from the dump"). The trainer reads only these lines.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DumpRecord {
    pub episode: String,
    pub step: u32,
    /// 1-based line of the dataset.
    pub line: usize,
    pub subset: Option<String>,
    /// The reference action (a response string).
    pub reference: String,
    pub target_box: Option<[u32; 4]>,
    /// The actor's chat (OpenAI-style messages, images as paths) that renders the prompt.
    pub messages: serde_json::Value,
    /// Where the prefix goes in the second pass this data is for.
    pub placement: Placement,
    /// How `messages` lays out the step's context.
    pub layout: ContextLayout,
    /// The action types of p0, in order.
    pub action_types: [&'static str; NUM_ACTION_TYPES],
    pub max_positions: usize,
    #[serde(flatten)]
    pub context: StepContext,
    /// With an encoder: the prefix vectors serving computes for this step (`[K · hidden]`, row-major)
    /// — the reference a trainer's export is checked against.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<Vec<f32>>,
}

/// The dump line of one dataset step ([`step_context`] on [`dataset_prompt`], with the plain
/// pass: the trainer's scope needs a0 whatever the encoder reads). `cfg` gives the placement, the
/// layout and the first opinion's token limit.
pub fn dump_step(
    s: &mut dyn Session,
    step: &EvalStep,
    platform: Platform,
    cfg: &ScopeMemConfig,
    max_positions: usize,
    encoder: Option<&ScopeMemEncoder>,
) -> Result<DumpRecord> {
    let messages = dataset_messages(step, platform, cfg.layout)?;
    let prompt = s.chat_prompt(&messages)?;
    let context = step_context(
        s,
        &prompt,
        &step.instruction,
        &step.history,
        platform,
        cfg.max_tokens,
        max_positions,
        true,
    )?;
    let prefix = encoder.map(|e| encoder_prefix(s, e, &context)).transpose()?;
    Ok(DumpRecord {
        episode: step.episode.clone(),
        step: step.step,
        line: step.line,
        subset: step.subset.clone(),
        reference: step.reference.clone(),
        target_box: step.target_box,
        messages: crate::tokenize::chat::messages_to_json(&messages),
        placement: cfg.placement,
        layout: cfg.layout,
        action_types: MOBILE_ACTION_TYPES,
        max_positions,
        context,
        prefix,
    })
}
