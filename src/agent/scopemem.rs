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
}

impl Default for ScopeMemConfig {
    fn default() -> Self {
        ScopeMemConfig {
            placement: Placement::Prepend,
            max_tokens: 256,
            draft: true,
            baseline: false,
            layout: ContextLayout::GuiOwl,
        }
    }
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
        let cut = |text: &str, keep_first: bool| -> Result<Vec<u32>> {
            let ids = tokenizer.encode(text)?;
            Ok(if ids.len() <= max {
                ids
            } else if keep_first {
                ids[..max].to_vec()
            } else {
                ids[ids.len() - max..].to_vec()
            })
        };
        Ok(EncoderIds {
            first_opinion: cut(&self.first_opinion, true)?,
            task: cut(&self.task, true)?,
            summary: cut(&self.summary, false)?,
            recent_actions: cut(&self.recent_actions, false)?,
        })
    }
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
/// repairs and harms), whatever `cfg.baseline` says.
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
    let bar = indicatif::ProgressBar::new(steps.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("evaluating {bar:30} {pos}/{len} steps")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let cfg = &ScopeMemConfig {
        baseline: true,
        ..cfg.clone()
    };
    let mut out = Vec::with_capacity(steps.len());
    for step in steps {
        let prompt = dataset_prompt(s, step, dataset.platform, cfg.layout)?;
        let (first, second, opinions) = match encoder {
            Some(enc) => {
                let o = scopemem_step(
                    s,
                    enc,
                    &prompt,
                    &step.instruction,
                    &step.history,
                    dataset.platform,
                    cfg,
                )?;
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
            },
            opinions,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
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
