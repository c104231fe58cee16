//! The `recall` command line: parses arguments and calls the library.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use recall::backend::cpu::CpuBackend;
use recall::engine::Pipeline;
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
    }
    Ok(())
}
