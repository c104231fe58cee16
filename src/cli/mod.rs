//! The `recall` command line: one module per command group. Each parses its flags, opens the backend
//! `--backend` asks for and calls the library.

mod bench;
mod chat;
mod demo;
mod episode;
mod kernels;
mod loadgen;
mod scopemem;
mod selector;
mod serve;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use recall::backend::{Backend, BackendArgs};
use recall::engine::{EngineConfig, Pipeline};
use recall::model::AdapterMode;

#[derive(Parser)]
#[command(
    name = "recall",
    version,
    about = "An inference engine for long-horizon GUI agents on Qwen-VL models"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy answer to one user message or a chat.
    Generate(chat::GenerateArgs),
    /// Logits at every position of a chat, written as safetensors (input_ids I64 [seq], logits F32 [seq, vocab]).
    Logits(chat::LogitsArgs),
    /// Teacher-forced log-probability of TARGET as the assistant's reply to a chat.
    Score(chat::ScoreArgs),
    /// Replay, label or render recorded episodes (CausalCache).
    Episode {
        #[command(subcommand)]
        command: episode::EpisodeCommand,
    },
    /// Train CausalCache's learned selector from utility labels (docs/TRAINING.md).
    Selector {
        #[command(subcommand)]
        command: selector::SelectorCommand,
    },
    /// ScopeMem: first opinion, encoder prefix, second opinion.
    Scopemem {
        #[command(subcommand)]
        command: scopemem::ScopememCommand,
    },
    /// Evaluate the actor (and ScopeMem with --encoder) on a step-level dataset: EM, TM, repairs,
    /// harms, ΔAcc with trajectory-bootstrap intervals.
    Eval(scopemem::EvalArgs),
    /// Benchmark an agent step on random weights of a real config (docs/BENCH.md).
    #[command(args_override_self = true)]
    Bench(bench::BenchCli),
    /// The bundled CausalCache demo: a 12-step synthetic episode on the tiny model.
    Demo(demo::DemoArgs),
    /// Serve the model over HTTP: an OpenAI-compatible chat API and the episode API (docs/SERVER.md).
    Serve(serve::ServeCli),
    /// Drive an OpenAI-compatible server with concurrent agent-shaped clients and report throughput
    /// and latency (docs/SERVER.md).
    Loadgen(recall::loadgen::LoadgenArgs),
    /// Validate every kernel version against the CPU, then time it against the roofline (docs/KERNELS.md).
    Kernels(kernels::KernelsArgs),
}

/// Parses the command line (applying `recall bench --tiny`'s preset) and runs the command.
pub fn run() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if scopemem::compare_requested(&argv) {
        return scopemem::eval_compare(&argv);
    }
    match bench::parse_with_presets()?.command {
        Command::Generate(a) => chat::generate(a),
        Command::Logits(a) => chat::logits(a),
        Command::Score(a) => chat::score(a),
        Command::Episode { command } => episode::run(command),
        Command::Selector { command } => selector::run(command),
        Command::Scopemem { command } => scopemem::run(command),
        Command::Eval(a) => scopemem::eval(a),
        Command::Bench(a) => bench::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Loadgen(a) => loadgen::run(a),
        Command::Kernels(a) => kernels::run(a),
    }
}

/// Where the model and its tokenizer are, and the backend to run it on.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// tokenizer.json to use [default: MODEL/tokenizer.json].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// K/V LoRA adapter: a PEFT directory or a reference-format safetensors file.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Where the adapter acts: gated (history screenshots only), ungated (every token) or off.
    #[arg(long, default_value = "gated", value_parser = parse_mode)]
    pub adapter_mode: AdapterMode,
    /// Screenshots are resized to at least this many pixels (height x width) [default: the model's
    /// preprocessor_config.json]. GUI-Owl's CausalCache setting: min = max = 2621440.
    #[arg(long)]
    pub min_pixels: Option<usize>,
    /// Screenshots are resized to at most this many pixels [default: the model's preprocessor].
    #[arg(long)]
    pub max_pixels: Option<usize>,
    #[command(flatten)]
    pub backend: BackendArgs,
}

impl ModelArgs {
    /// The adapter mode requests use: the flag when an adapter is loaded, else off.
    pub fn request_adapter(&self) -> AdapterMode {
        if self.adapter.is_some() {
            self.adapter_mode
        } else {
            AdapterMode::Off
        }
    }

    /// The engine configuration of a command: the defaults, with the KV pool sized from device
    /// memory on a GPU.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            memory_utilization: Some(self.backend.gpu_memory_utilization),
            ..EngineConfig::default()
        }
    }
}

fn parse_mode(s: &str) -> std::result::Result<AdapterMode, String> {
    s.parse().map_err(|e: recall::Error| e.to_string())
}

/// Loads the model (and its adapter) on `be`.
pub fn load<B: Backend>(be: B, args: &ModelArgs) -> Result<Pipeline<B>> {
    let mut p = Pipeline::load(be, &args.model, args.tokenizer.as_deref())
        .with_context(|| format!("loading the model in {}", args.model.display()))?;
    if let Some(adapter) = &args.adapter {
        p.load_adapter(adapter, args.adapter_mode)
            .with_context(|| format!("loading the adapter {}", adapter.display()))?;
    }
    if args.min_pixels.is_some() || args.max_pixels.is_some() {
        let min = args.min_pixels.unwrap_or(p.preprocess.min_pixels);
        let max = args.max_pixels.unwrap_or(p.preprocess.max_pixels);
        let side = p.preprocess.factor().pow(2);
        anyhow::ensure!(
            min <= max && max >= side,
            "--min-pixels {min} and --max-pixels {max}: need min <= max and max >= {side} (one merged patch)"
        );
        p.preprocess = p.preprocess.clone().with_pixels(min, max);
        tracing::info!(min, max, "screenshot pixel budget");
    }
    Ok(p)
}

/// Writes `text` to `path` atomically ([`recall::atomic::write_atomic`]), naming the file on error.
pub fn write_file(path: &Path, text: impl AsRef<[u8]>) -> Result<()> {
    // Atomic (temporary file + rename): a killed run leaves the old file or the new one, never half.
    recall::atomic::write_atomic(path, text).with_context(|| format!("writing {}", path.display()))
}
