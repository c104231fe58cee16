//! The CausalCache two-pass step.
//!
//! Pass 1 answers on the Recent-B prompt; that proposal is the selector's reference action (its
//! "witness"). The allocation policy then picks an exact-B set S. When S is Recent-B the proposal is
//! the answer — byte-identical to a single-pass run. Otherwise pass 2 renders S (gap-fold protocol),
//! reuses every cached block of the common prefix, and decodes with the proposal as a draft: greedy
//! verification keeps the output exactly what plain decoding of the pass-2 prompt gives.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::action::{equivalent, parse_response, Action};
use crate::engine::{GenerateParams, Generation, ImageHash, Prompt, RequestOptions, Session};
use crate::error::{Error, Result};
use crate::memory::episode::{Decision, Episode, Platform};
use crate::memory::policy::{thumbnail, AllocationPolicy, PolicyInputs, Thumbnail};
use crate::memory::protocol::{render_decision_with, Protocol, RestoreAs};
use crate::memory::selector::{ActionBucket, DecisionContext, EventInfo};
use crate::model::AdapterMode;
use crate::vision::ImageSource;

/// Settings of the two-pass step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwoPassConfig {
    /// History screenshots per prompt (B).
    pub budget: usize,
    pub protocol: Protocol,
    /// Most generated tokens per pass (GUI-Owl: 256).
    pub max_tokens: usize,
    /// Where the HGKV adapter acts (when one is loaded).
    pub adapter: AdapterMode,
    /// Draft pass 2 from the proposal's tokens.
    pub draft: bool,
    /// What ends a pass.
    pub stop: StopRule,
    /// The action the selector's witness features compare against.
    pub reference: ReferenceSource,
    /// What the restored history slots show in both passes: pixels (the method) or the paper's text
    /// controls (the verbatim response, the OCR transcript).
    pub restore_as: RestoreAs,
}

impl Default for TwoPassConfig {
    fn default() -> Self {
        TwoPassConfig {
            budget: 4,
            protocol: Protocol::Mobile,
            max_tokens: 256,
            adapter: AdapterMode::Off,
            draft: true,
            stop: StopRule::ToolCallOnly,
            reference: ReferenceSource::Proposal,
            restore_as: RestoreAs::Pixels,
        }
    }
}

/// Where the reference action of the selector's witness features comes from: the paper's reference
/// ladder ("Reference actions"). Only [`ReferenceSource::Proposal`] is the deployed method; the rest
/// are its controls.
///
/// ```
/// use recall::agent::causalcache::ReferenceSource;
/// assert_eq!("proposal".parse::<ReferenceSource>().unwrap(), ReferenceSource::default());
/// assert_eq!("last-action".parse::<ReferenceSource>().unwrap(), ReferenceSource::LastAction);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReferenceSource {
    /// The paper: pass 1's tentative action on the Recent-B prompt; pass 2 re-decides on the new
    /// allocation only when a recent event was displaced.
    #[default]
    Proposal,
    /// The gold teacher-forced target: the recorded action of decision `t` (offline only; an
    /// episode step without a record is an error). Two passes, as with the proposal.
    Gold,
    /// No action signal: no event is a witness and there is no reference point.
    None,
    /// The single-pass variant: the previously executed action (the recorded action of step
    /// `t − 1`; none at `t = 1`) is the reference, the allocation is chosen before any pass, and one
    /// pass answers on it.
    LastAction,
    /// Instruction-only similarity: no action reference; the witnesses are the events whose
    /// following action's history line is most similar to the task instruction
    /// ([`instruction_witnesses`]). The paper names this rung without defining it (its supplement
    /// is not public); the similarity is recall's reading. Two passes, as with the proposal.
    Instruction,
}

impl std::str::FromStr for ReferenceSource {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "proposal" => ReferenceSource::Proposal,
            "gold" => ReferenceSource::Gold,
            "none" => ReferenceSource::None,
            "last-action" => ReferenceSource::LastAction,
            "instruction" => ReferenceSource::Instruction,
            other => {
                return Err(Error::InvalidRequest(format!(
                    "reference `{other}`: expected proposal (the paper), gold, none, last-action or \
                     instruction"
                )))
            }
        })
    }
}

/// What ends a pass's generation (besides `max_tokens`).
///
/// ```
/// use recall::agent::causalcache::StopRule;
/// assert_eq!("tool-call".parse::<StopRule>().unwrap(), StopRule::default());
/// assert!("eos".parse::<StopRule>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StopRule {
    /// The model's end-of-sequence ids or `</tool_call>` (GUI-Owl's own serving).
    EosOrToolCall,
    /// `</tool_call>` alone, the protocol's rule and the default: the CausalCache authors' runtimes
    /// (their MobileWorld policy server passes `eos_token_id=</tool_call>` to `generate`) suppress the
    /// end-of-sequence token, so an `<|im_end|>` does not stop a pass (and is then left out of the
    /// text as a special token).
    #[default]
    ToolCallOnly,
}

impl std::str::FromStr for StopRule {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "tool-call" => Ok(StopRule::ToolCallOnly),
            "eos-or-tool-call" => Ok(StopRule::EosOrToolCall),
            other => Err(Error::InvalidRequest(format!(
                "stop rule `{other}`: expected `tool-call` (`</tool_call>` alone, the protocol's) or \
                 `eos-or-tool-call`"
            ))),
        }
    }
}

/// Milliseconds spent in each phase of a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timings {
    /// Rendering and image encoding of pass 1 (vision tower runs for new screenshots).
    pub prepare1_ms: f64,
    pub pass1_ms: f64,
    pub selector_ms: f64,
    /// Rendering of pass 2 (images are cached by then).
    pub prepare2_ms: f64,
    pub pass2_ms: f64,
}

/// What one decision step did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// Decision step t (completed steps are 1..t-1).
    pub t: usize,
    pub recent: Vec<usize>,
    /// The chosen allocation S.
    pub allocation: Vec<usize>,
    /// Events of S outside the Recent-B window.
    pub k: usize,
    /// Whether pass 2 ran (S ≠ Recent-B).
    pub pass2: bool,
    /// Pass 1's response.
    pub proposal: String,
    /// The step's final response.
    pub response: String,
    /// The final response's action, or why it did not parse.
    pub action: std::result::Result<String, String>,
    /// Whether the action is equivalent to the recorded one (offline replay with a reference).
    pub matches_record: Option<bool>,
    pub timings: Timings,
    /// Prompt tokens served from the prefix cache in pass 1 and pass 2.
    pub reused_tokens: (usize, usize),
    /// Draft tokens pass 2 accepted.
    pub accepted_draft: usize,
}

/// Per-episode memo of what the selector needs about each step: screenshot hash, thumbnail, parsed
/// action. Each screenshot is decoded at most once here.
#[derive(Default)]
pub struct EpisodeMemo {
    images: HashMap<PathBuf, (ImageHash, Thumbnail)>,
    actions: HashMap<usize, Option<Action>>,
}

impl EpisodeMemo {
    fn image(&mut self, path: &Path) -> Result<(ImageHash, Thumbnail)> {
        if let Some(v) = self.images.get(path) {
            return Ok(*v);
        }
        let img = ImageSource::parse(&path.display().to_string())?.load()?;
        let v = (ImageHash::of_image(&img), thumbnail(&img));
        self.images.insert(path.to_path_buf(), v);
        Ok(v)
    }
}

/// Runs decision `t` of `episode`: offline replay with the history from the record, or a live step
/// when `t = T + 1` (the current screenshot is the episode's final screenshot).
pub fn two_pass_step(
    s: &mut dyn Session,
    episode: &Episode,
    t: usize,
    policy: &mut dyn AllocationPolicy,
    cfg: &TwoPassConfig,
    memo: &mut EpisodeMemo,
) -> Result<StepReport> {
    let decision = episode.decision(t)?;
    let platform = episode.platform;
    let recent = cfg.protocol.recent_b(t - 1, cfg.budget);
    let mut timings = Timings::default();

    if cfg.reference == ReferenceSource::LastAction {
        return single_pass_step(s, episode, &decision, policy, cfg, memo, recent);
    }
    let clock = Instant::now();
    let prompt1 = pass_prompt(s, cfg, &decision, &recent)?;
    timings.prepare1_ms = ms(clock);
    let clock = Instant::now();
    let (proposal, reused1, _) = generate(s, &prompt1, cfg, Vec::new())?;
    timings.pass1_ms = ms(clock);

    let clock = Instant::now();
    let reference = match cfg.reference {
        ReferenceSource::Gold => Some(gold_reference(&decision, platform)?),
        ReferenceSource::None | ReferenceSource::Instruction => None,
        _ => parse_response(proposal.text.as_deref().unwrap_or_default(), platform).ok(),
    };
    let allocation = allocate(episode, &decision, reference.as_ref(), policy, cfg, memo)?;
    timings.selector_ms = ms(clock);

    let (response, reused2, accepted) = if allocation == recent {
        (proposal.clone(), 0, 0)
    } else {
        let clock = Instant::now();
        let prompt2 = pass_prompt(s, cfg, &decision, &allocation)?;
        timings.prepare2_ms = ms(clock);
        let clock = Instant::now();
        let draft = if cfg.draft {
            proposal.tokens.clone()
        } else {
            Vec::new()
        };
        let out = generate(s, &prompt2, cfg, draft)?;
        timings.pass2_ms = ms(clock);
        out
    };
    let proposal = proposal.text.unwrap_or_default();
    Ok(report(
        &decision,
        platform,
        recent,
        allocation,
        proposal,
        response,
        timings,
        (reused1, reused2),
        accepted,
    ))
}

/// The recorded action of decision `t`, parsed: the gold reference.
fn gold_reference(decision: &Decision<'_>, platform: Platform) -> Result<Action> {
    let record = decision.reference.ok_or_else(|| {
        Error::InvalidRequest(format!(
            "reference gold: decision {} has no recorded response (gold needs an offline replay)",
            decision.t
        ))
    })?;
    parse_response(record, platform).map_err(|e| {
        Error::InvalidRequest(format!(
            "reference gold: the recorded response of decision {} does not parse: {e}",
            decision.t
        ))
    })
}

/// The policy's allocation at `decision` given the reference action: the selector sees the protocol's
/// eligible steps only (desktop-strict never restores the initial screen), as Recent-B does.
fn allocate(
    episode: &Episode,
    decision: &Decision<'_>,
    reference: Option<&Action>,
    policy: &mut dyn AllocationPolicy,
    cfg: &TwoPassConfig,
    memo: &mut EpisodeMemo,
) -> Result<Vec<usize>> {
    let t = decision.t;
    let mut ctx = context(episode, decision, reference, memo)?;
    if cfg.reference == ReferenceSource::Instruction {
        let lines: Vec<String> = decision
            .completed
            .iter()
            .map(|step| step.action_line_for(episode.platform))
            .collect();
        let marks = instruction_witnesses(decision.instruction, &lines);
        for (e, witness) in ctx.events.iter_mut().zip(marks) {
            e.witness = witness;
        }
    }
    let pool = cfg.protocol.eligible(t - 1);
    ctx.events.retain(|e| pool.contains(&e.step));
    let current = memo.image(decision.current_screenshot)?.1;
    let thumbs: HashMap<usize, Thumbnail> = ctx
        .events
        .iter()
        .filter_map(|e| {
            Some((
                e.step,
                memo.image(&episode.steps.get(e.step - 1)?.screenshot).ok()?.1,
            ))
        })
        .collect();
    let texts: HashMap<usize, &str> = ctx
        .events
        .iter()
        .filter_map(|e| Some((e.step, episode.steps.get(e.step - 1)?.ocr.as_deref()?)))
        .collect();
    let extra = PolicyInputs {
        current_thumbnail: Some(&current),
        event_thumbnails: Some(&thumbs),
        current_text: decision.current_ocr,
        event_texts: Some(&texts),
    };
    policy.allocate(&ctx, cfg.budget, &extra)
}

/// [`ReferenceSource::LastAction`]: the allocation from the previously executed action, then one
/// pass on it (the report's proposal is that pass's answer).
fn single_pass_step(
    s: &mut dyn Session,
    episode: &Episode,
    decision: &Decision<'_>,
    policy: &mut dyn AllocationPolicy,
    cfg: &TwoPassConfig,
    memo: &mut EpisodeMemo,
    recent: Vec<usize>,
) -> Result<StepReport> {
    let platform = episode.platform;
    let mut timings = Timings::default();
    let clock = Instant::now();
    let last = decision
        .completed
        .last()
        .and_then(|step| parse_response(&step.response, platform).ok());
    let allocation = allocate(episode, decision, last.as_ref(), policy, cfg, memo)?;
    timings.selector_ms = ms(clock);
    let clock = Instant::now();
    let prompt = pass_prompt(s, cfg, decision, &allocation)?;
    timings.prepare1_ms = ms(clock);
    let clock = Instant::now();
    let (response, reused, _) = generate(s, &prompt, cfg, Vec::new())?;
    timings.pass1_ms = ms(clock);
    let proposal = response.text.clone().unwrap_or_default();
    let mut r = report(
        decision,
        platform,
        recent,
        allocation,
        proposal,
        response,
        timings,
        (reused, 0),
        0,
    );
    r.pass2 = false;
    Ok(r)
}

/// The step's report from its allocation and final generation.
#[allow(clippy::too_many_arguments)]
fn report(
    decision: &Decision<'_>,
    platform: Platform,
    recent: Vec<usize>,
    allocation: Vec<usize>,
    proposal: String,
    response: Generation,
    timings: Timings,
    reused_tokens: (usize, usize),
    accepted_draft: usize,
) -> StepReport {
    let text = response.text.clone().unwrap_or_default();
    let action = parse_response(&text, platform);
    let matches_record = match (&action, decision.reference) {
        (Ok(a), Some(r)) => Some(parse_response(r, platform).is_ok_and(|b| equivalent(a, &b, platform))),
        (Err(_), Some(_)) => Some(false),
        _ => None,
    };
    StepReport {
        t: decision.t,
        pass2: allocation != recent,
        k: allocation.iter().filter(|s| !recent.contains(s)).count(),
        recent,
        allocation,
        proposal,
        response: text,
        action: action.map(|a| a.tool_call_json()).map_err(|e| e.to_string()),
        matches_record,
        timings,
        reused_tokens,
        accepted_draft,
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// The engine prompt of `decision` rendered with `allocation` (pixels in every slot: what labels and
/// utilities score).
pub(crate) fn prompt_for(
    s: &mut dyn Session,
    protocol: Protocol,
    decision: &Decision<'_>,
    allocation: &[usize],
) -> Result<Prompt> {
    let messages = render_decision_with(protocol, decision, allocation, RestoreAs::Pixels)?;
    s.chat_prompt(&messages)
}

/// A pass's prompt: `decision` rendered with `allocation`, its slots as `cfg.restore_as` says.
fn pass_prompt(
    s: &mut dyn Session,
    cfg: &TwoPassConfig,
    decision: &Decision<'_>,
    allocation: &[usize],
) -> Result<Prompt> {
    let messages = render_decision_with(cfg.protocol, decision, allocation, cfg.restore_as)?;
    s.chat_prompt(&messages)
}

/// One greedy pass; stops at `</tool_call>` as GUI-Owl's serving does. Returns the generation, the
/// prompt tokens reused from the cache and the draft tokens accepted.
fn generate(
    s: &mut dyn Session,
    prompt: &Prompt,
    cfg: &TwoPassConfig,
    draft: Vec<u32>,
) -> Result<(Generation, usize, usize)> {
    let params = pass_params(s, cfg.max_tokens, cfg.stop);
    let opts = RequestOptions {
        adapter: cfg.adapter,
        draft,
        ..RequestOptions::default()
    };
    let (mut g, out) = s.generate(prompt, params, opts)?;
    if cfg.stop == StopRule::ToolCallOnly {
        // Generation went on past any `<|im_end|>`: the text leaves special tokens out, as the
        // authors' `batch_decode(..., skip_special_tokens=True)` does.
        g.text = Some(s.tokenizer().decode_text(&g.tokens)?);
    }
    Ok((g, out.reused_tokens, out.accepted_draft))
}

/// Greedy generation of at most `max_tokens` that ends at the model's eos or at `</tool_call>`, as
/// GUI-Owl's serving does.
pub fn agent_params(s: &dyn Session, max_tokens: usize) -> GenerateParams {
    pass_params(s, max_tokens, StopRule::EosOrToolCall)
}

/// Greedy generation of at most `max_tokens` that ends as `stop` says.
pub fn pass_params(s: &dyn Session, max_tokens: usize, stop: StopRule) -> GenerateParams {
    let mut eos = match stop {
        StopRule::EosOrToolCall => s.eos_token_ids(),
        StopRule::ToolCallOnly => Vec::new(),
    };
    eos.extend(s.tokenizer().token_id("</tool_call>"));
    GenerateParams {
        max_tokens,
        eos_token_ids: eos,
        stop_strings: Vec::new(),
    }
}

/// Decision `t` answered in one pass on a given allocation (a client that chose its own restored
/// events): no policy, no second pass.
pub fn fixed_step(
    s: &mut dyn Session,
    episode: &Episode,
    t: usize,
    allocation: &[usize],
    cfg: &TwoPassConfig,
) -> Result<StepReport> {
    let decision = episode.decision(t)?;
    let recent = cfg.protocol.recent_b(t - 1, allocation.len());
    let mut timings = Timings::default();
    let clock = Instant::now();
    let prompt = pass_prompt(s, cfg, &decision, allocation)?;
    timings.prepare1_ms = ms(clock);
    let clock = Instant::now();
    let (out, reused, _) = generate(s, &prompt, cfg, Vec::new())?;
    timings.pass1_ms = ms(clock);
    let text = out.text.unwrap_or_default();
    let action = parse_response(&text, episode.platform);
    Ok(StepReport {
        t,
        k: allocation.iter().filter(|s| !recent.contains(s)).count(),
        pass2: false,
        recent,
        allocation: allocation.to_vec(),
        proposal: text.clone(),
        response: text,
        action: action.map(|a| a.tool_call_json()).map_err(|e| e.to_string()),
        matches_record: None,
        timings,
        reused_tokens: (reused, 0),
        accepted_draft: 0,
    })
}

/// The selector's view of decision `t`: every completed step with its screenshot hash, the action
/// taken at it, and whether that action is equivalent to the reference (pass 1's proposal).
pub(crate) fn context(
    episode: &Episode,
    decision: &Decision<'_>,
    reference: Option<&Action>,
    memo: &mut EpisodeMemo,
) -> Result<DecisionContext> {
    let platform = episode.platform;
    let mut events = Vec::with_capacity(decision.completed.len());
    for (i, step) in decision.completed.iter().enumerate() {
        let s = i + 1;
        let action = memo
            .actions
            .entry(s)
            .or_insert_with(|| parse_response(&step.response, platform).ok())
            .clone();
        events.push(EventInfo {
            step: s,
            image_hash: memo.image(&step.screenshot)?.0 .0,
            next_bucket: action.as_ref().map_or(ActionBucket::Other, |a| a.bucket()),
            next_point: action.as_ref().and_then(Action::point),
            witness: match (&action, reference) {
                (Some(a), Some(r)) => equivalent(a, r, platform),
                _ => false,
            },
        });
    }
    Ok(DecisionContext {
        t: decision.t,
        reference_point: reference.and_then(Action::point),
        events,
    })
}

/// [`ReferenceSource::Instruction`]'s witnesses: `lines[i]` is the history line of step `i + 1`
/// (the action taken right after that event's screenshot); the witnesses are the lines whose
/// [`text_similarity`](crate::memory::policy::text_similarity) to `instruction` is the largest, when
/// it is above zero (ties are all witnesses; no line shares a word: none is).
///
/// ```
/// use recall::agent::causalcache::instruction_witnesses;
/// let task = "Set an alarm for 7 am in the Clock app";
/// // Shared words with the task: {the, clock, app} -> 3 / (2 * sqrt 10) = 0.47;
/// // {the, alarm} -> 2 / (2 * sqrt 10) = 0.32; {7, am} -> 2 / (sqrt 3 * sqrt 10) = 0.37.
/// let lines = ["Open the Clock app.", "Tap the alarm tab.", "Type 7 am."].map(String::from);
/// assert_eq!(instruction_witnesses(task, &lines), [true, false, false]);
/// assert_eq!(instruction_witnesses("Reply to Bob", &lines), [false, false, false]);
/// ```
pub fn instruction_witnesses(instruction: &str, lines: &[String]) -> Vec<bool> {
    use crate::memory::policy::text_similarity;
    let sims: Vec<f64> = lines.iter().map(|l| text_similarity(instruction, l)).collect();
    let best = sims.iter().copied().fold(0.0, f64::max);
    sims.iter().map(|&x| best > 0.0 && x == best).collect()
}

/// The allocation policies the CLI offers, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyChoice {
    /// recent | random | rgb | ocr | selector | inverted
    pub name: String,
    /// The scorer (safetensors) for `selector` and `inverted`.
    pub selector: Option<PathBuf>,
    /// Composition mode for the learned scorer.
    pub mode: crate::memory::selector::Mode,
    /// Most older events the scorer may promote (default: B).
    pub max_replacements: Option<usize>,
    /// Seed of `random`.
    pub seed: u64,
    /// How the scorer's features count ages; `None`: as its file records
    /// ([`MarginalScorer::indexing`](crate::memory::selector::MarginalScorer::indexing)).
    pub indexing: Option<crate::memory::selector::EventIndexing>,
}

/// Builds the named policy.
///
/// ```
/// use recall::agent::causalcache::{make_policy, PolicyChoice};
/// use recall::memory::selector::Mode;
/// let c = PolicyChoice {
///     name: "recent".into(), selector: None, mode: Mode::Paper, max_replacements: None, seed: 0,
///     indexing: None,
/// };
/// assert_eq!(make_policy(&c).unwrap().name(), "recent");
/// ```
pub fn make_policy(c: &PolicyChoice) -> Result<Box<dyn AllocationPolicy>> {
    use crate::memory::policy::{Inverted, OcrText, Random, Recent, Rgb, Selector};
    use crate::memory::selector::{ComposeOptions, MarginalScorer};
    let scorer = || -> Result<(MarginalScorer, ComposeOptions)> {
        let path = c.selector.as_ref().ok_or_else(|| {
            Error::InvalidRequest(format!(
                "policy `{}` needs --selector FILE (a scorer safetensors)",
                c.name
            ))
        })?;
        let scorer = MarginalScorer::load(path)?;
        let mut options = ComposeOptions::new(c.mode);
        options.max_replacements = c.max_replacements;
        options.indexing = c.indexing.unwrap_or(scorer.indexing());
        Ok((scorer, options))
    };
    Ok(match c.name.as_str() {
        "recent" => Box::new(Recent),
        "random" => Box::new(Random { seed: c.seed }),
        "rgb" => Box::new(Rgb),
        "ocr" => Box::new(OcrText),
        "selector" => {
            let (scorer, options) = scorer()?;
            Box::new(Selector { scorer, options })
        }
        "inverted" => {
            let (scorer, options) = scorer()?;
            Box::new(Inverted { scorer, options })
        }
        "oracle" => {
            return Err(Error::InvalidRequest(
                "the oracle scores sets through the engine: `recall episode run|eval --policy oracle` \
                 builds it (agent::offline::oracle_allocations)"
                    .into(),
            ))
        }
        other => {
            return Err(Error::InvalidRequest(format!(
                "unknown policy `{other}` (recent, random, rgb, ocr, selector, inverted, oracle)"
            )))
        }
    })
}

/// Replays every decision of `episode` with the two-pass step, showing progress.
pub fn run_episode(
    s: &mut dyn Session,
    episode: &Episode,
    policy: &mut dyn AllocationPolicy,
    cfg: &TwoPassConfig,
) -> Result<Vec<StepReport>> {
    let n = episode.decisions();
    let bar = indicatif::ProgressBar::new(n as u64).with_style(
        indicatif::ProgressStyle::with_template("replaying {bar:30} {pos}/{len} steps")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut memo = EpisodeMemo::default();
    let mut out = Vec::with_capacity(n);
    for t in 1..=n {
        let r = two_pass_step(s, episode, t, policy, cfg, &mut memo)?;
        tracing::info!(t, allocation = ?r.allocation, k = r.k, pass2 = r.pass2, "step");
        out.push(r);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// A plain-text table of an episode's steps.
pub fn steps_table(reports: &[StepReport]) -> String {
    let mut s = String::from(
        " t | Recent-B     | S            | k | pass 2 | pass 1 ms | select ms | pass 2 ms | reused 1/2 | draft | match\n",
    );
    s.push_str(&"-".repeat(108));
    s.push('\n');
    let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    for r in reports {
        s.push_str(&format!(
            "{:>2} | {:<12} | {:<12} | {} | {:<6} | {:>9.1} | {:>9.3} | {:>9.1} | {:>10} | {:>5} | {}\n",
            r.t,
            list(&r.recent),
            list(&r.allocation),
            r.k,
            if r.pass2 { "yes" } else { "no" },
            r.timings.pass1_ms,
            r.timings.selector_ms,
            r.timings.pass2_ms,
            format!("{}/{}", r.reused_tokens.0, r.reused_tokens.1),
            r.accepted_draft,
            match r.matches_record {
                Some(true) => "yes",
                Some(false) => "no",
                None => "-",
            },
        ));
    }
    s
}
