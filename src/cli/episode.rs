//! `recall episode run|label|render`: CausalCache over recorded episodes.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use recall::agent::causalcache::{make_policy, run_episode, steps_table, PolicyChoice};
use recall::agent::causalcache::{ReferenceSource, StopRule, TwoPassConfig};
use recall::agent::chart::{write_allocation_chart, AllocationRow};
use recall::agent::eval::BootstrapConfig;
use recall::agent::labels::{
    episode_name, label_episode, plan_decisions, read_progress, resume_point, DecisionUnit, LabelSource,
};
use recall::agent::offline::{
    evaluate_steps, merge_evaluations, oracle_allocations, summarise, write_margin_chart, EvaluationShard,
    Given, OracleConfig, PolicyEvaluation,
};
use recall::atomic::{write_atomic, JsonlWriter};
use recall::backend::{Backend, BackendArgs};
use recall::engine::{Pipeline, Session};
use recall::memory::episode::Episode;
use recall::memory::policy::AllocationPolicy;
use recall::memory::protocol::{render_decision, Protocol, RestoreAs};
use recall::memory::selector::Mode;
use recall::with_backend;

use super::{load, write_file, ModelArgs};

#[derive(Subcommand)]
pub enum EpisodeCommand {
    /// Replay a recorded episode with the two-pass step (history teacher-forced from the record).
    Run(RunArgs),
    /// Evaluate an allocation policy offline over recorded episodes: full-action match and the
    /// log-likelihood margin over Recent-B, with episode-bootstrap intervals (JSON, Markdown, chart).
    Eval(EvalArgs),
    /// Merge the `eval` outputs of episode shards (tools/distributed/) into the report one `eval`
    /// over all their episodes writes: eval.json, eval.md and margins.png.
    MergeEval(MergeEvalArgs),
    /// Write utility labels Q(S) (mean log-prob of the recorded response) as JSONL.
    Label(LabelArgs),
    /// Write one step's prompt as OpenAI-style messages (images as paths) that `recall logits` accepts.
    Render(RenderArgs),
}

#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Episode directory (episode.json + screenshots; docs/FORMATS.md).
    #[arg(long)]
    episode: PathBuf,
    #[command(flatten)]
    replay: ReplayArgs,
    /// Decode pass 2 without drafting from the proposal.
    #[arg(long)]
    no_draft: bool,
    /// Also write the per-step reports as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the allocation chart (PNG).
    #[arg(long)]
    chart: Option<PathBuf>,
}

/// How an episode is replayed: budget, policy, protocol, pass length.
#[derive(clap::Args)]
pub struct ReplayArgs {
    /// History screenshots per prompt (B).
    #[arg(long, default_value_t = 4)]
    budget: usize,
    #[command(flatten)]
    policy: PolicyArgs,
    /// mobile, desktop or desktop-strict [default: the episode's platform].
    #[arg(long, value_parser = parse_protocol)]
    protocol: Option<Protocol>,
    /// Most generated tokens per pass.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// What ends a pass: tool-call (`</tool_call>` alone, the protocol's rule: the authors' runtimes
    /// suppress the end-of-sequence token) or eos-or-tool-call (also the model's eos, as GUI-Owl's
    /// own serving stops).
    #[arg(long, default_value = "tool-call", value_parser = |s: &str| s.parse::<StopRule>())]
    stop: StopRule,
    /// The selector's reference action (the paper's reference ladder): proposal (pass 1's tentative
    /// action, the method), gold (the recorded action of the step, an offline oracle), none (no
    /// action signal), last-action (the previous step's action, one pass on the chosen allocation)
    /// or instruction (instruction-only similarity: the events whose following action's history
    /// line is most similar to the task are the witnesses; recall's reading of the paper's rung).
    #[arg(long, default_value = "proposal", value_parser = |s: &str| s.parse::<ReferenceSource>())]
    reference: ReferenceSource,
    /// What a restored history slot shows in both passes: pixels (the method), or the paper's text
    /// controls: response (the turn's verbatim recorded response) or ocr (the episode's OCR transcript of
    /// the screenshot, `steps[i].ocr`). Selection and budget are unchanged.
    #[arg(long, default_value = "pixels", value_parser = |s: &str| s.parse::<RestoreAs>())]
    restore_as: RestoreAs,
}

impl ReplayArgs {
    fn config(&self, ep: &Episode, model: &ModelArgs, draft: bool) -> TwoPassConfig {
        TwoPassConfig {
            budget: self.budget,
            protocol: self.protocol.unwrap_or(Protocol::for_platform(ep.platform)),
            max_tokens: self.max_tokens,
            adapter: model.request_adapter(),
            draft,
            stop: self.stop,
            reference: self.reference,
            restore_as: self.restore_as,
        }
    }
}

/// The allocation policy and the learned selector's options.
#[derive(clap::Args)]
pub struct PolicyArgs {
    /// recent, random, rgb, ocr (OCR-transcript similarity; the episode's `ocr` fields), selector,
    /// inverted, or oracle (the beam over true utilities from the engine on the recorded response,
    /// falling back to Recent-B when it scores higher).
    #[arg(long, default_value = "recent")]
    policy: String,
    /// The learned scorer (safetensors) for selector and inverted.
    #[arg(long)]
    selector: Option<PathBuf>,
    /// Selector composition: paper (beam over swaps from Recent-B), greedy (single swap loop) or
    /// reference (the authors' beam from the empty set).
    #[arg(long, default_value = "paper", value_parser = parse_compose_mode)]
    mode: Mode,
    /// Most older events the selector (or the oracle) may promote [default: B for paper and greedy,
    /// unlimited for reference and the oracle].
    #[arg(long)]
    max_replacements: Option<usize>,
    /// Seed of the random policy.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How the selector's features count ages: desktop (age t-s+1, the authors' training code, where
    /// in_recent_B is Recent-B) or mobile (age t-s, their MobileWorld deployment) [default: as the
    /// scorer file records; a file without the record: mobile].
    #[arg(long, value_parser = |s: &str| s.parse::<recall::memory::selector::EventIndexing>())]
    event_indexing: Option<recall::memory::selector::EventIndexing>,
    /// The oracle's beam width (sets kept per level, children per parent).
    #[arg(long, default_value_t = recall::memory::selector::DEFAULT_BEAM)]
    oracle_beam: usize,
}

impl PolicyArgs {
    fn choice(&self) -> PolicyChoice {
        PolicyChoice {
            name: self.policy.clone(),
            selector: self.selector.clone(),
            mode: self.mode,
            max_replacements: self.max_replacements,
            seed: self.seed,
            indexing: self.event_indexing,
        }
    }
}

#[derive(clap::Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Episode directories (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', required = true)]
    episode: Vec<PathBuf>,
    #[command(flatten)]
    replay: ReplayArgs,
    /// Bootstrap rounds (0: no intervals).
    #[arg(long, default_value_t = 1000)]
    resamples: usize,
    /// Seed of the bootstrap.
    #[arg(long, default_value_t = 0)]
    bootstrap_seed: u64,
    /// Output directory: eval.json, eval.md, margins.png.
    #[arg(long)]
    out: PathBuf,
}

#[derive(clap::Args)]
pub struct LabelArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Episode directories (comma-separated or repeated); their labels go into one file.
    #[arg(long, value_delimiter = ',', required = true)]
    episode: Vec<PathBuf>,
    /// Budgets of the Recent-B anchors (the empty set is always scored); the largest bounds the
    /// beam-teacher sets.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    budgets: Vec<usize>,
    #[arg(long, value_parser = parse_protocol)]
    protocol: Option<Protocol>,
    /// Output JSONL file. Labels stream to `<out>.partial`, one whole decision at a time, which is
    /// renamed to `<out>` once every decision is labelled: `<out>` is never a partial file.
    #[arg(long)]
    out: PathBuf,
    /// Continue an interrupted run: keep the complete decisions of `<out>.partial` (or of `<out>`
    /// when there is no partial file) and label only the rest. Refused when that file was made with
    /// other settings (made_with, --episode list or --budgets).
    #[arg(long)]
    resume: bool,
    /// Also label the states paper composition's first round visits: `Recent-B ∖ {e}` and
    /// `Recent-B ∖ {e} ∪ {j}` for every budget, recent `e` and older `j` (`kind: composition`), so
    /// the selector's first-round queries are on labelled states (docs/TRAINING.md). About B × pool
    /// more prompts per budget and decision.
    #[arg(long)]
    composition_states: bool,
}

#[derive(clap::Args)]
pub struct MergeEvalArgs {
    /// The shards' `--out` directories (each with its eval.json), in episode order.
    #[arg(required = true)]
    shards: Vec<PathBuf>,
    /// Where the merged eval.json, eval.md and margins.png go.
    #[arg(long)]
    out: PathBuf,
}

#[derive(clap::Args)]
pub struct RenderArgs {
    #[arg(long)]
    episode: PathBuf,
    /// Decision step t (1-based).
    #[arg(long)]
    step: usize,
    /// The allocation S, e.g. 3,7,9,10 (omit it for the empty allocation).
    #[arg(long, value_delimiter = ',')]
    allocation: Vec<usize>,
    #[arg(long, value_parser = parse_protocol)]
    protocol: Option<Protocol>,
    #[arg(long)]
    out: PathBuf,
    /// Accepted for uniformity with the other commands; rendering computes nothing.
    #[command(flatten)]
    backend: BackendArgs,
}

pub fn parse_protocol(s: &str) -> std::result::Result<Protocol, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

fn parse_compose_mode(s: &str) -> std::result::Result<Mode, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

pub fn run(command: EpisodeCommand) -> Result<()> {
    match command {
        EpisodeCommand::Run(a) => with_backend!(a.model.backend.open(false)?, be => replay(be, &a)),
        EpisodeCommand::Eval(a) => with_backend!(a.model.backend.open(false)?, be => evaluate(be, &a)),
        EpisodeCommand::MergeEval(a) => merge_eval(&a),
        EpisodeCommand::Label(a) => with_backend!(a.model.backend.open(false)?, be => label(be, &a)),
        EpisodeCommand::Render(a) => render(&a),
    }
}

fn replay<B: Backend>(be: B, a: &RunArgs) -> Result<()> {
    let p = load(be, &a.model)?;
    let ep = Episode::load(&a.episode)?;
    let cfg = a.replay.config(&ep, &a.model, !a.no_draft);
    let mut engine = p.engine(a.model.engine_config())?;
    let mut session = p.session(&mut engine);
    let mut policy = episode_policy(&mut session, &ep, &a.replay.policy, &cfg)?;
    let reports = run_episode(&mut session, &ep, policy.as_mut(), &cfg)?;
    print!("{}", steps_table(&reports));
    if let Some(path) = &a.json {
        write_file(path, serde_json::to_string_pretty(&reports)?)?;
    }
    if let Some(path) = &a.chart {
        let rows: Vec<AllocationRow> = reports.iter().map(AllocationRow::from).collect();
        write_allocation_chart(&rows, path)?;
    }
    Ok(())
}

/// The policy of one episode: the oracle's allocations are computed first (they need the engine).
fn episode_policy(
    s: &mut dyn Session,
    ep: &Episode,
    args: &PolicyArgs,
    cfg: &TwoPassConfig,
) -> Result<Box<dyn AllocationPolicy>> {
    if args.policy != "oracle" {
        return Ok(make_policy(&args.choice())?);
    }
    let oracle = OracleConfig {
        protocol: cfg.protocol,
        budget: cfg.budget,
        adapter: cfg.adapter,
        beam_width: args.oracle_beam,
        max_replacements: args.max_replacements,
    };
    let choices = oracle_allocations(s, ep, &oracle)?;
    Ok(Box::new(Given::from_oracle(&choices)))
}

fn evaluate<B: Backend>(be: B, a: &EvalArgs) -> Result<()> {
    let p = load(be, &a.model)?;
    let mut engine = p.engine(a.model.engine_config())?;
    let mut session = p.session(&mut engine);
    let mut rows = Vec::new();
    for dir in &a.episode {
        let ep = Episode::load(dir)?;
        let cfg = a.replay.config(&ep, &a.model, true);
        let mut policy = episode_policy(&mut session, &ep, &a.replay.policy, &cfg)?;
        let reports = run_episode(&mut session, &ep, policy.as_mut(), &cfg)?;
        rows.extend(evaluate_steps(
            &mut session,
            &ep,
            &episode_name(dir),
            &reports,
            cfg.protocol,
            cfg.adapter,
        )?);
    }
    let bootstrap = BootstrapConfig {
        resamples: a.resamples,
        seed: a.bootstrap_seed,
        ..BootstrapConfig::default()
    };
    let report = summarise(&a.replay.policy.policy, a.replay.budget, rows, bootstrap);
    write_eval(&report, &a.out)
}

/// eval.json, eval.md and margins.png of `report` under `out`.
fn write_eval(report: &PolicyEvaluation, out: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_file(&out.join("eval.json"), serde_json::to_string_pretty(report)?)?;
    let md = report.to_markdown();
    write_file(&out.join("eval.md"), &md)?;
    write_margin_chart(&report.rows, &out.join("margins.png"))?;
    print!("{md}");
    println!("\nwrote eval.json, eval.md and margins.png to {}", out.display());
    Ok(())
}

fn merge_eval(a: &MergeEvalArgs) -> Result<()> {
    let shards = a
        .shards
        .iter()
        .map(|dir| {
            let path = dir.join("eval.json");
            let text =
                std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<EvaluationShard>(&text).with_context(|| format!("{}", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    write_eval(&merge_evaluations(shards)?, &a.out)
}

fn label<B: Backend>(be: B, a: &LabelArgs) -> Result<()> {
    let p = load(be, &a.model)?;
    let episodes = a
        .episode
        .iter()
        .map(|dir| Ok((episode_name(dir), Episode::load(dir)?)))
        .collect::<Result<Vec<_>>>()?;
    let sources: Vec<(Protocol, LabelSource)> =
        episodes.iter().map(|(_, ep)| label_source(a, &p, ep)).collect();
    let mut plan = Vec::new();
    for ((name, ep), (_, source)) in episodes.iter().zip(&sources) {
        plan.extend(plan_decisions(name, ep.len(), &a.budgets, source)?);
    }
    let (mut out, mut skip) = open_label_output(a, &plan)?;
    let resumed = skip;
    let mut engine = p.engine(a.model.engine_config())?;
    let mut count = 0;
    for ((name, ep), (protocol, made_with)) in episodes.iter().zip(&sources) {
        let done_here = skip.min(ep.len());
        skip -= done_here;
        // Each decision is one append, synced before the next is scored: a kill loses at most the
        // decision being labelled.
        let mut emit = |group: String| out.append(&group).and_then(|()| out.sync());
        count += label_episode(
            &mut p.session(&mut engine),
            ep,
            name,
            *protocol,
            &a.budgets,
            a.model.request_adapter(),
            made_with,
            done_here + 1,
            &mut emit,
        )?;
    }
    let partial = out.path().to_path_buf();
    out.finish_into(&a.out)
        .with_context(|| format!("publishing {} as {}", partial.display(), a.out.display()))?;
    let stats = engine.kv_stats();
    let kept = if a.resume {
        format!("{resumed} of {} decisions were already labelled; ", plan.len())
    } else {
        String::new()
    };
    eprintln!(
        "wrote {count} labels of {} episode(s) to {} ({kept}{} tokens reused from the prefix cache, {} computed)",
        episodes.len(),
        a.out.display(),
        stats.tokens_reused,
        stats.tokens_computed
    );
    Ok(())
}

/// The protocol of `ep` and what its labels are made with.
fn label_source<B: Backend>(a: &LabelArgs, p: &Pipeline<B>, ep: &Episode) -> (Protocol, LabelSource) {
    let protocol = a.protocol.unwrap_or(Protocol::for_platform(ep.platform));
    let source = LabelSource {
        model: a.model.model.display().to_string(),
        adapter: a.model.adapter.as_ref().map(|d| d.display().to_string()),
        adapter_mode: a.model.request_adapter().name(),
        adapter_layout: p.model.text.adapter().map(|ad| ad.layout()),
        protocol: protocol.name(),
        min_pixels: p.preprocess.min_pixels,
        max_pixels: p.preprocess.max_pixels,
        recall: env!("CARGO_PKG_VERSION"),
        composition_states: a.composition_states,
    };
    (protocol, source)
}

/// `<out>.partial`: where a label run streams before its output is complete.
fn partial_path(out: &std::path::Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

/// Opens the partial file the run appends to and says how many of `plan`'s decisions it already
/// holds. Without --resume it starts empty. With --resume it continues `<out>.partial`, else a copy
/// of `<out>`'s complete decisions; a trailing unfinished decision is cut first. Every check runs
/// before any file is changed, so a refused resume leaves both files as they were.
fn open_label_output(a: &LabelArgs, plan: &[DecisionUnit]) -> Result<(JsonlWriter, usize)> {
    let partial = partial_path(&a.out);
    if !a.resume {
        if partial.exists() {
            tracing::warn!(
                "starting over: discarding {} (pass --resume to continue it)",
                partial.display()
            );
        }
        return Ok((JsonlWriter::create(&partial)?, 0));
    }
    let from = [&partial, &a.out].into_iter().find(|p| p.exists());
    let Some(from) = from else {
        tracing::warn!(
            "--resume: neither {} nor {} exists; starting from the first decision",
            partial.display(),
            a.out.display()
        );
        return Ok((JsonlWriter::create(&partial)?, 0));
    };
    let progress = read_progress(from)?;
    let done = resume_point(from, &progress.done, plan)?;
    let size = std::fs::metadata(from)
        .with_context(|| format!("inspecting {}", from.display()))?
        .len();
    if from != &partial || progress.len < size {
        // Keep exactly the complete decisions; written atomically so that a kill now loses nothing.
        let mut kept = Vec::new();
        std::fs::File::open(from)
            .and_then(|f| f.take(progress.len).read_to_end(&mut kept))
            .with_context(|| format!("reading {}", from.display()))?;
        write_atomic(&partial, &kept)?;
    }
    eprintln!(
        "resuming from {}: {done} of {} decisions already labelled",
        from.display(),
        plan.len()
    );
    Ok((JsonlWriter::resume(&partial)?, done))
}

fn render(a: &RenderArgs) -> Result<()> {
    a.backend.open(false)?;
    let ep = Episode::load(&a.episode)?;
    let protocol = a.protocol.unwrap_or(Protocol::for_platform(ep.platform));
    let messages = render_decision(protocol, &ep.decision(a.step)?, &a.allocation)?;
    let json = recall::tokenize::chat::messages_to_json(&messages);
    write_file(&a.out, serde_json::to_string_pretty(&json)?)
}
