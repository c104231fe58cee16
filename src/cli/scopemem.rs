//! `recall scopemem run|dump` and `recall eval`: ScopeMem and the actor over step-level datasets.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use recall::agent::compare::compare;
use recall::agent::dataset::StepDataset;
use recall::agent::eval::{evaluate_with, BootstrapConfig, EvalReport, StepOutcome};
use recall::agent::scopemem::{
    dump_step, run_dataset, DatasetResult, Intervention, Placement, ScopeMemConfig,
};
use recall::agent::scorers::Scorer;
use recall::backend::Backend;
use recall::memory::protocol::ContextLayout;
use recall::model::scopemem::ScopeMemEncoder;
use recall::with_backend;

use super::{load, write_file, ModelArgs};

#[derive(Subcommand)]
pub enum ScopememCommand {
    /// Run ScopeMem over a dataset (or some of its lines) and print both opinions, p0 and H0 per step.
    Run(DatasetRunArgs),
    /// Write, per dataset step, what serving computes before the encoder (the actor's chat, a0 and
    /// its tokens, p0, H0, the encoder's fields and token ids, the reference) as JSONL: the
    /// trainer's input (docs/SCOPEMEM.md).
    Dump(DumpArgs),
}

#[derive(clap::Args)]
pub struct DumpArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Step-level dataset (JSONL; docs/EVAL.md).
    #[arg(long)]
    dataset: PathBuf,
    /// The placement the encoder will be trained for (recorded in every line).
    #[arg(long, default_value = "prepend", value_parser = parse_placement)]
    placement: Placement,
    /// The actor's context: gui-owl (GUI-Owl-1.5's rolling layout) or paper (ScopeMem §3.1: the
    /// task, a summary of the last three steps, the latest three screenshots).
    #[arg(long, default_value = "gui-owl", value_parser = parse_layout)]
    context: ContextLayout,
    /// Encoder positions per field [default: an --encoder's max_positions, else 256].
    #[arg(long)]
    max_positions: Option<usize>,
    /// An encoder: the fields are cut to its max_positions, and each line also carries the prefix
    /// vectors it computes (`prefix`), as serving would.
    #[arg(long)]
    encoder: Option<PathBuf>,
    /// Most generated tokens of the first opinion.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Only these dataset lines (1-based).
    #[arg(long, value_delimiter = ',')]
    lines: Vec<usize>,
    /// Output JSONL.
    #[arg(long)]
    out: PathBuf,
}

/// A model, a dataset and the ScopeMem settings.
#[derive(clap::Args)]
pub struct DatasetRunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Step-level dataset (JSONL; docs/EVAL.md).
    #[arg(long)]
    dataset: PathBuf,
    /// ScopeMem encoder directory (scopemem_config.json + scopemem.safetensors); without it the
    /// actor answers once.
    #[arg(long)]
    encoder: Option<PathBuf>,
    /// prepend (the paper) or append (before the assistant turn; needs its own training).
    #[arg(long, default_value = "prepend", value_parser = parse_placement)]
    placement: Placement,
    /// The actor's context: gui-owl (GUI-Owl-1.5's rolling layout) or paper (ScopeMem §3.1: the
    /// task, a summary of the last three steps, the latest three screenshots). Serve with the
    /// layout the encoder was trained on.
    #[arg(long, default_value = "gui-owl", value_parser = parse_layout)]
    context: ContextLayout,
    /// Most generated tokens per opinion.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// An intervention on the encoder's inputs (the paper's Table 7; docs/EVAL.md
    /// "Interventions"): perturb-a0 (a0's action type replaced by another), other-a0 (another
    /// step's a0) or withhold-history (empty summary and recent actions: recall's option; the
    /// paper's history row is an encoder trained with `--variant no-history`). Needs --encoder.
    #[arg(long, value_parser = parse_intervention)]
    intervention: Option<Intervention>,
    /// Seed of the intervention's random choices.
    #[arg(long, default_value_t = 0)]
    intervention_seed: u64,
    /// Only these dataset lines (1-based), e.g. 3 or 3,7.
    #[arg(long, value_delimiter = ',')]
    lines: Vec<usize>,
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// Compare two `recall eval --json` reports instead of running a model: B against A (each one's
    /// repairs and harms against the plain actor, the steps only one keeps or repairs, the paired
    /// advantage with an episode-bootstrap interval). Takes only --bootstrap, --json and --markdown
    /// besides.
    #[arg(long, num_args = 2, value_names = ["A_JSON", "B_JSON"])]
    compare: Option<Vec<PathBuf>>,
    #[command(flatten)]
    run: DatasetRunArgs,
    /// The full-action rule of EM: recall (the protocol's equivalence), aitw, androidcontrol or
    /// odyssey (the benchmarks' authors' rules; docs/EVAL.md).
    #[arg(long, default_value = "recall")]
    scorer: Scorer,
    #[command(flatten)]
    report: ReportArgs,
}

/// Where `recall eval` writes its report.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// Bootstrap resamples for the 95% intervals (0: none).
    #[arg(long, default_value_t = 1000)]
    bootstrap: usize,
    /// Write the report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the report as Markdown.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// `recall eval --compare A.json B.json`: parsed on its own (it needs no model), see
/// [`compare_requested`].
#[derive(clap::Parser)]
#[command(name = "recall eval")]
pub struct CompareCli {
    /// The two `recall eval --json` reports: B is compared against A.
    #[arg(long, num_args = 2, value_names = ["A_JSON", "B_JSON"], required = true)]
    compare: Vec<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
}

/// Whether the command line is `recall eval --compare ...` (clap cannot make the flattened model
/// arguments optional, so this form is parsed by [`CompareCli`]).
pub fn compare_requested(argv: &[String]) -> bool {
    argv.get(1).is_some_and(|c| c == "eval")
        && argv
            .iter()
            .any(|a| a == "--compare" || a.starts_with("--compare="))
}

/// Runs `recall eval --compare`.
pub fn eval_compare(argv: &[String]) -> Result<()> {
    use clap::Parser;
    let a = CompareCli::parse_from(argv[1..].iter());
    let read = |p: &PathBuf| -> Result<EvalReport> {
        let text = recall::limits::read_capped(p, recall::limits::MAX_DOCUMENT_BYTES)?;
        serde_json::from_str(&text)
            .with_context(|| format!("{}: not a `recall eval --json` report", p.display()))
    };
    let (ra, rb) = (read(&a.compare[0])?, read(&a.compare[1])?);
    let names = (
        a.compare[0].display().to_string(),
        a.compare[1].display().to_string(),
    );
    let c = compare(&ra, &rb, (&names.0, &names.1), a.report.bootstrap_config())?;
    a.report
        .write(&serde_json::to_string_pretty(&c)?, &c.to_markdown())
}

impl ReportArgs {
    fn bootstrap_config(&self) -> BootstrapConfig {
        BootstrapConfig {
            resamples: self.bootstrap,
            ..BootstrapConfig::default()
        }
    }

    fn write(&self, json: &str, md: &str) -> Result<()> {
        if let Some(path) = &self.json {
            write_file(path, json)?;
        }
        if let Some(path) = &self.markdown {
            write_file(path, md)?;
        }
        print!("{md}");
        Ok(())
    }
}

pub fn parse_placement(s: &str) -> std::result::Result<Placement, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

fn parse_intervention(s: &str) -> std::result::Result<Intervention, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

fn parse_layout(s: &str) -> std::result::Result<ContextLayout, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

/// Loads the model, dataset and encoder and runs them.
fn run_dataset_args(a: &DatasetRunArgs) -> Result<(StepDataset, Vec<DatasetResult>)> {
    with_backend!(a.model.backend.open(false)?, be => run_on(be, a))
}

fn run_on<B: Backend>(be: B, a: &DatasetRunArgs) -> Result<(StepDataset, Vec<DatasetResult>)> {
    let p = load(be, &a.model)?;
    let dataset = StepDataset::load(&a.dataset)?;
    let encoder = a.encoder.as_deref().map(ScopeMemEncoder::load).transpose()?;
    let cfg = ScopeMemConfig {
        placement: a.placement,
        max_tokens: a.max_tokens,
        layout: a.context,
        intervention: a.intervention,
        intervention_seed: a.intervention_seed,
        ..ScopeMemConfig::default()
    };
    let mut engine = p.engine(a.model.engine_config())?;
    let lines = (!a.lines.is_empty()).then_some(a.lines.as_slice());
    let mut s = p.session(&mut engine);
    let results = run_dataset(&mut s, encoder.as_ref(), &dataset, lines, &cfg)?;
    Ok((dataset, results))
}

fn dump<B: Backend>(be: B, a: &DumpArgs) -> Result<()> {
    let p = load(be, &a.model)?;
    let dataset = StepDataset::load(&a.dataset)?;
    let encoder = a.encoder.as_deref().map(ScopeMemEncoder::load).transpose()?;
    let max_positions = match (a.max_positions, &encoder) {
        (Some(n), _) => n,
        (None, Some(e)) => e.config().max_positions,
        (None, None) => 256,
    };
    let steps: Vec<_> = dataset
        .steps
        .iter()
        .filter(|s| a.lines.is_empty() || a.lines.contains(&s.line))
        .collect();
    anyhow::ensure!(!steps.is_empty(), "{}: no step selected", a.dataset.display());
    let mut engine = p.engine(a.model.engine_config())?;
    let mut s = p.session(&mut engine);
    let bar = indicatif::ProgressBar::new(steps.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("dumping {bar:30} {pos}/{len} steps")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let cfg = ScopeMemConfig {
        placement: a.placement,
        max_tokens: a.max_tokens,
        layout: a.context,
        ..ScopeMemConfig::default()
    };
    let mut out = String::new();
    for step in steps {
        let record = dump_step(
            &mut s,
            step,
            dataset.platform,
            &cfg,
            max_positions,
            encoder.as_ref(),
        )?;
        out.push_str(&serde_json::to_string(&record)?);
        out.push('\n');
        bar.inc(1);
    }
    bar.finish_and_clear();
    write_file(&a.out, out)
}

pub fn run(command: ScopememCommand) -> Result<()> {
    match command {
        ScopememCommand::Dump(a) => with_backend!(a.model.backend.open(false)?, be => dump(be, &a)),
        ScopememCommand::Run(a) => {
            let (_, results) = run_dataset_args(&a)?;
            for r in &results {
                println!("{}", serde_json::to_string(r)?);
            }
            Ok(())
        }
    }
}

pub fn eval(a: EvalArgs) -> Result<()> {
    anyhow::ensure!(a.compare.is_none(), "--compare takes no model arguments");
    let (dataset, results) = run_dataset_args(&a.run)?;
    let outcomes: Vec<StepOutcome> = results.into_iter().map(|r| r.outcome).collect();
    let report = evaluate_with(&outcomes, dataset.platform, a.report.bootstrap_config(), a.scorer)?;
    a.report.write(&report.to_json(), &report.to_markdown())
}
