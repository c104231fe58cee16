//! The `recall` command line: parses arguments and calls the library.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use recall::agent::causalcache::{
    make_policy, run_episode, steps_table, utility_labels, PolicyChoice, TwoPassConfig,
};
use recall::agent::chart::{write_allocation_chart, AllocationRow};
use recall::agent::dataset::StepDataset;
use recall::agent::demo::{demo_footer, run_demo, DemoPaths};
use recall::agent::eval::{evaluate, BootstrapConfig, StepOutcome};
use recall::agent::scopemem::{run_dataset, DatasetResult, Placement, ScopeMemConfig};
use recall::backend::cpu::CpuBackend;
use recall::bench::{run_bench, BenchArgs};
use recall::engine::{EngineConfig, Pipeline};
use recall::memory::episode::Episode;
use recall::memory::protocol::{render_decision, Protocol};
use recall::memory::selector::Mode;
use recall::model::scopemem::ScopeMemEncoder;
use recall::model::AdapterMode;
use recall::tokenize::chat::{parse_messages, ChatMessage};

#[derive(Parser)]
#[command(
    name = "recall",
    version,
    about = "An inference engine for long-horizon GUI agents on Qwen-VL models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where the model and its tokenizer are.
#[derive(clap::Args)]
struct ModelArgs {
    /// Hugging Face model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// tokenizer.json to use [default: MODEL/tokenizer.json].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// K/V LoRA adapter: a PEFT directory or a reference-format safetensors file.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Where the adapter acts: gated (history screenshots only), ungated (every token) or off.
    #[arg(long, default_value = "gated", value_parser = parse_mode)]
    adapter_mode: AdapterMode,
}

fn parse_mode(s: &str) -> std::result::Result<AdapterMode, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

#[derive(Subcommand)]
enum Command {
    /// Greedy answer to one user message or a chat.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The user message.
        #[arg(long, required_unless_present = "messages")]
        prompt: Option<String>,
        /// A JSON array of OpenAI-style chat messages instead of --prompt (text and image parts).
        #[arg(long, conflicts_with = "prompt")]
        messages: Option<PathBuf>,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Stop once the output contains this string (repeatable).
        #[arg(long)]
        stop: Vec<String>,
        /// Print the result as JSON (tokens, text, finish reason).
        #[arg(long)]
        json: bool,
    },
    /// Logits at every position of a chat, written as safetensors (input_ids I64 [seq], logits F32 [seq, vocab]).
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        /// JSON array of OpenAI-style chat messages.
        #[arg(long)]
        messages: PathBuf,
        /// Output safetensors file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Teacher-forced log-probability of TARGET as the assistant's reply to a chat.
    Score {
        #[command(flatten)]
        model: ModelArgs,
        /// JSON array of OpenAI-style chat messages.
        #[arg(long)]
        messages: PathBuf,
        /// The reply to score.
        #[arg(long)]
        target: String,
    },
    /// Replay, label or render recorded episodes (CausalCache).
    Episode {
        #[command(subcommand)]
        command: EpisodeCommand,
    },
    /// ScopeMem: first opinion, encoder prefix, second opinion.
    Scopemem {
        #[command(subcommand)]
        command: ScopememCommand,
    },
    /// Evaluate the actor (and ScopeMem with --encoder) on a step-level dataset: EM, TM, repairs,
    /// harms, ΔAcc with trajectory-bootstrap intervals.
    Eval {
        #[command(flatten)]
        run: DatasetRunArgs,
        /// Bootstrap resamples for the 95% intervals (0: none).
        #[arg(long, default_value_t = 1000)]
        bootstrap: usize,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Write the report as Markdown.
        #[arg(long)]
        markdown: Option<PathBuf>,
    },
    /// Benchmark an agent step on random weights of a real config (docs/BENCH.md).
    Bench {
        /// Directory with the model shape's config.json (weights are random).
        #[arg(long, default_value = "models/qwen3-vl-8b-instruct")]
        config_dir: PathBuf,
        /// cpu or cuda.
        #[arg(long, default_value = "cuda")]
        backend: String,
        /// History screenshots per prompt (B).
        #[arg(long)]
        budget: Option<usize>,
        /// Screenshot size: TxHxW patches (1x80x128), HxW patches, or HxWpx pixels.
        #[arg(long)]
        grid: Option<recall::bench::GridSpec>,
        /// Completed steps before the current one (must exceed the budget).
        #[arg(long)]
        history: Option<usize>,
        /// Tokens generated per pass.
        #[arg(long)]
        response_tokens: Option<usize>,
        /// Text tokens of the system prompt.
        #[arg(long)]
        system_tokens: Option<usize>,
        /// Text tokens per folded step line.
        #[arg(long)]
        step_tokens: Option<usize>,
        /// Override the decoder depth.
        #[arg(long)]
        layers: Option<usize>,
        /// Timed repetitions (median reported).
        #[arg(long)]
        repeats: Option<usize>,
        /// Chunked-prefill size.
        #[arg(long)]
        chunk_size: Option<usize>,
        /// Most tokens per forward.
        #[arg(long)]
        max_batch_tokens: Option<usize>,
        /// Where the temporary config (and, with --weights-file, the random weights) are written.
        #[arg(long)]
        weights_dir: Option<PathBuf>,
        /// Write the random weights to a safetensors file and load it through the checkpoint loader,
        /// instead of generating them in the backend (on the GPU: in device memory).
        #[arg(long)]
        weights_file: bool,
        /// Also write the report as JSON.
        #[arg(long)]
        json_out: Option<PathBuf>,
        /// Fewer variants (for a short device call).
        #[arg(long)]
        quick: bool,
        /// Also profile one prefill and one decode per op (CPU) or kernel (CUDA).
        #[arg(long)]
        breakdown: bool,
        /// Step recording/replay (CUDA graphs) during the measurements: on or off. With on, the decode
        /// also runs once with it off and the outputs are compared.
        #[arg(long, default_value = "on", action = clap::ArgAction::Set,
              value_parser = PossibleValuesParser::new(["on", "off"]).map(|s| s == "on"))]
        step_replay: bool,
        /// A CPU-sized run (tiny shapes).
        #[arg(long)]
        tiny: bool,
    },
    /// The bundled CausalCache demo: a 12-step synthetic episode on the tiny model.
    Demo {
        /// History screenshots per prompt (B).
        #[arg(long, default_value_t = 2)]
        budget: usize,
        /// Where to write the allocation chart.
        #[arg(long, default_value = "demo-allocation.png")]
        chart: PathBuf,
    },
}

/// A model, a dataset and the ScopeMem settings.
#[derive(clap::Args)]
struct DatasetRunArgs {
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
    /// Most generated tokens per opinion.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Only these dataset lines (1-based), e.g. 3 or 3,7.
    #[arg(long, value_delimiter = ',')]
    lines: Vec<usize>,
}

#[derive(Subcommand)]
enum ScopememCommand {
    /// Run ScopeMem over a dataset (or some of its lines) and print both opinions, p0 and H0 per step.
    Run {
        #[command(flatten)]
        run: DatasetRunArgs,
    },
}

fn parse_placement(s: &str) -> std::result::Result<Placement, String> {
    match s {
        "prepend" => Ok(Placement::Prepend),
        "append" => Ok(Placement::Append),
        other => Err(format!("placement `{other}`: expected prepend or append")),
    }
}

/// Loads the model, dataset and encoder and runs them.
fn run_dataset_args(a: &DatasetRunArgs) -> Result<(StepDataset, Vec<DatasetResult>)> {
    let p = load(&a.model)?;
    let dataset = StepDataset::load(&a.dataset)?;
    let encoder = a.encoder.as_deref().map(ScopeMemEncoder::load).transpose()?;
    let cfg = ScopeMemConfig {
        placement: a.placement,
        max_tokens: a.max_tokens,
        draft: true,
    };
    let mut engine = p.engine(EngineConfig::default())?;
    let lines = (!a.lines.is_empty()).then_some(a.lines.as_slice());
    let results = run_dataset(&p, &mut engine, encoder.as_ref(), &dataset, lines, &cfg)?;
    Ok((dataset, results))
}

#[derive(Subcommand)]
enum EpisodeCommand {
    /// Replay a recorded episode with the two-pass step (history teacher-forced from the record).
    Run {
        #[command(flatten)]
        model: ModelArgs,
        /// Episode directory (episode.json + screenshots; docs/FORMATS.md).
        #[arg(long)]
        episode: PathBuf,
        /// History screenshots per prompt (B).
        #[arg(long, default_value_t = 4)]
        budget: usize,
        /// recent, random, rgb, selector or inverted.
        #[arg(long, default_value = "recent")]
        policy: String,
        /// The learned scorer (safetensors) for selector and inverted.
        #[arg(long)]
        selector: Option<PathBuf>,
        /// Selector composition: paper or reference.
        #[arg(long, default_value = "paper", value_parser = parse_compose_mode)]
        mode: Mode,
        /// Most older events the selector may promote [default: B].
        #[arg(long)]
        max_replacements: Option<usize>,
        /// Seed of the random policy.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// mobile, desktop or desktop-strict [default: the episode's platform].
        #[arg(long, value_parser = parse_protocol)]
        protocol: Option<Protocol>,
        /// Most generated tokens per pass.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// Decode pass 2 without drafting from the proposal.
        #[arg(long)]
        no_draft: bool,
        /// Also write the per-step reports as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also draw the allocation chart (PNG).
        #[arg(long)]
        chart: Option<PathBuf>,
    },
    /// Write utility labels Q(S) (mean log-prob of the recorded response) as JSONL.
    Label {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        episode: PathBuf,
        /// Budgets of the Recent-B anchors; the largest bounds the beam-teacher sets.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        budgets: Vec<usize>,
        #[arg(long, value_parser = parse_protocol)]
        protocol: Option<Protocol>,
        /// Output JSONL file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Write one step's prompt as OpenAI-style messages (images as paths) that `recall logits` accepts.
    Render {
        #[arg(long)]
        episode: PathBuf,
        /// Decision step t (1-based).
        #[arg(long)]
        step: usize,
        /// The allocation S, e.g. 3,7,9,10 (empty for B = 0).
        #[arg(long, value_delimiter = ',')]
        allocation: Vec<usize>,
        #[arg(long, value_parser = parse_protocol)]
        protocol: Option<Protocol>,
        #[arg(long)]
        out: PathBuf,
    },
}

fn parse_protocol(s: &str) -> std::result::Result<Protocol, String> {
    match s {
        "mobile" => Ok(Protocol::Mobile),
        "desktop" => Ok(Protocol::Desktop),
        "desktop-strict" => Ok(Protocol::DesktopStrictEvents),
        other => Err(format!(
            "protocol `{other}`: expected mobile, desktop or desktop-strict"
        )),
    }
}

fn parse_compose_mode(s: &str) -> std::result::Result<Mode, String> {
    match s {
        "paper" => Ok(Mode::Paper),
        "reference" => Ok(Mode::Reference),
        other => Err(format!("mode `{other}`: expected paper or reference")),
    }
}

fn load(args: &ModelArgs) -> Result<Pipeline<CpuBackend>> {
    let mut p = Pipeline::load(CpuBackend, &args.model, args.tokenizer.as_deref())
        .with_context(|| format!("loading the model in {}", args.model.display()))?;
    if let Some(adapter) = &args.adapter {
        p.load_adapter(adapter, args.adapter_mode)
            .with_context(|| format!("loading the adapter {}", adapter.display()))?;
    }
    Ok(p)
}

fn read_messages(path: &PathBuf) -> Result<Vec<ChatMessage>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(parse_messages(&text, path)?)
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "recall=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Generate {
            model,
            prompt,
            messages,
            max_tokens,
            stop,
            json,
        } => {
            let p = load(&model)?;
            let messages = match &messages {
                Some(path) => read_messages(path)?,
                None => vec![ChatMessage::text("user", prompt.unwrap_or_default())],
            };
            let start = std::time::Instant::now();
            let (input, out) = p.generate_chat(&messages, max_tokens, &stop)?;
            let secs = start.elapsed().as_secs_f64();
            let prompt_tokens = input.ids.len();
            tracing::info!(prompt_tokens, new_tokens = out.tokens.len(), secs, "generated");
            if json {
                let v = serde_json::json!({
                    "prompt_tokens": prompt_tokens,
                    "tokens": out.tokens,
                    "text": out.text,
                    "finish_reason": format!("{:?}", out.finish),
                });
                println!("{v}");
            } else {
                println!("{}", out.text.unwrap_or_default());
            }
        }
        Command::Logits { model, messages, out } => {
            let p = load(&model)?;
            let r = p.prompt_logits(&read_messages(&messages)?)?;
            recall::engine::pipeline::write_logits(&out, &r)?;
            eprintln!(
                "wrote {} positions x {} logits to {}",
                r.input_ids.len(),
                r.vocab,
                out.display()
            );
        }
        Command::Score {
            model,
            messages,
            target,
        } => {
            let p = load(&model)?;
            let s = p.score_reply(&read_messages(&messages)?, &target)?;
            let v = serde_json::json!({
                "tokens": s.token_logprobs.len(),
                "sum_logprob": s.sum_logprob,
                "mean_logprob": s.mean_logprob,
                "token_logprobs": s.token_logprobs,
            });
            println!("{v}");
        }
        Command::Episode { command } => episode(command)?,
        Command::Bench {
            config_dir,
            backend,
            budget,
            grid,
            history,
            response_tokens,
            system_tokens,
            step_tokens,
            layers,
            repeats,
            chunk_size,
            max_batch_tokens,
            weights_dir,
            weights_file,
            json_out,
            quick,
            breakdown,
            step_replay,
            tiny,
        } => {
            let mut a = if tiny {
                BenchArgs {
                    backend,
                    ..BenchArgs::tiny(&config_dir)
                }
            } else {
                BenchArgs::default_for(&config_dir, &backend)
            };
            a.budget = budget.unwrap_or(a.budget);
            a.grid = grid.unwrap_or(a.grid);
            a.history = history.unwrap_or(a.history);
            a.response_tokens = response_tokens.unwrap_or(a.response_tokens);
            a.system_tokens = system_tokens.unwrap_or(a.system_tokens);
            a.step_tokens = step_tokens.unwrap_or(a.step_tokens);
            a.layers = layers.or(a.layers);
            a.repeats = repeats.unwrap_or(a.repeats);
            a.chunk_size = chunk_size.unwrap_or(a.chunk_size);
            a.max_batch_tokens = max_batch_tokens.unwrap_or(a.max_batch_tokens);
            a.weights_dir = weights_dir.or(a.weights_dir);
            a.weights_file |= weights_file;
            a.json_out = json_out.or(a.json_out);
            a.quick |= quick;
            a.breakdown = breakdown;
            a.step_replay = step_replay;
            let report = run_bench(&a)?;
            print!("{}", report.to_table());
        }
        Command::Scopemem {
            command: ScopememCommand::Run { run },
        } => {
            let (_, results) = run_dataset_args(&run)?;
            for r in &results {
                println!("{}", serde_json::to_string(r)?);
            }
        }
        Command::Eval {
            run,
            bootstrap,
            json,
            markdown,
        } => {
            let (dataset, results) = run_dataset_args(&run)?;
            let outcomes: Vec<StepOutcome> = results.into_iter().map(|r| r.outcome).collect();
            let boot = BootstrapConfig {
                resamples: bootstrap,
                ..BootstrapConfig::default()
            };
            let report = evaluate(&outcomes, dataset.platform, boot)?;
            if let Some(path) = json {
                std::fs::write(&path, report.to_json())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let md = report.to_markdown();
            if let Some(path) = markdown {
                std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
            }
            print!("{md}");
        }
        Command::Demo { budget, chart } => {
            let root = std::env::current_dir()?;
            let root = if root.join("models/demo").exists() {
                root
            } else {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            };
            let reports = run_demo(&DemoPaths::bundled(&root), budget, &chart)?;
            print!("{}", steps_table(&reports));
            print!("{}", demo_footer(&reports, &chart));
        }
    }
    Ok(())
}

fn episode(command: EpisodeCommand) -> Result<()> {
    match command {
        EpisodeCommand::Run {
            model,
            episode,
            budget,
            policy,
            selector,
            mode,
            max_replacements,
            seed,
            protocol,
            max_tokens,
            no_draft,
            json,
            chart,
        } => {
            let p = load(&model)?;
            let ep = Episode::load(&episode)?;
            let choice = PolicyChoice {
                name: policy,
                selector,
                mode,
                max_replacements,
                seed,
            };
            let mut policy = make_policy(&choice)?;
            let cfg = TwoPassConfig {
                budget,
                protocol: protocol.unwrap_or(Protocol::for_platform(ep.platform)),
                max_tokens,
                adapter: if model.adapter.is_some() {
                    model.adapter_mode
                } else {
                    AdapterMode::Off
                },
                draft: !no_draft,
            };
            let mut engine = p.engine(EngineConfig::default())?;
            let reports = run_episode(&p, &mut engine, &ep, policy.as_mut(), &cfg)?;
            print!("{}", steps_table(&reports));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&reports)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = chart {
                let rows: Vec<AllocationRow> = reports
                    .iter()
                    .map(|r| AllocationRow {
                        step: r.t,
                        allocation: r.allocation.clone(),
                        recent: r.recent.clone(),
                    })
                    .collect();
                write_allocation_chart(&rows, &path)?;
            }
        }
        EpisodeCommand::Label {
            model,
            episode,
            budgets,
            protocol,
            out,
        } => {
            let p = load(&model)?;
            let ep = Episode::load(&episode)?;
            let protocol = protocol.unwrap_or(Protocol::for_platform(ep.platform));
            let mut engine = p.engine(EngineConfig::default())?;
            let mut lines = String::new();
            for t in 1..=ep.len() {
                for label in utility_labels(&p, &mut engine, &ep, t, protocol, &budgets)? {
                    lines.push_str(&serde_json::to_string(&label)?);
                    lines.push('\n');
                }
            }
            std::fs::write(&out, lines).with_context(|| format!("writing {}", out.display()))?;
            let stats = engine.kv_stats();
            eprintln!(
                "wrote {} ({} tokens reused from the prefix cache, {} computed)",
                out.display(),
                stats.tokens_reused,
                stats.tokens_computed
            );
        }
        EpisodeCommand::Render {
            episode,
            step,
            allocation,
            protocol,
            out,
        } => {
            let ep = Episode::load(&episode)?;
            let protocol = protocol.unwrap_or(Protocol::for_platform(ep.platform));
            let messages = render_decision(protocol, &ep.decision(step)?, &allocation)?;
            let json = recall::tokenize::chat::messages_to_json(&messages);
            std::fs::write(&out, serde_json::to_string_pretty(&json)?)
                .with_context(|| format!("writing {}", out.display()))?;
        }
    }
    Ok(())
}
