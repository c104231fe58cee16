//! `recall generate`, `recall logits` and `recall score`: one chat through the reference path.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use recall::backend::Backend;
use recall::tokenize::chat::{parse_messages, ChatMessage};
use recall::with_backend;

use super::{load, ModelArgs};

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message.
    #[arg(long, required_unless_present = "messages")]
    prompt: Option<String>,
    /// A JSON array of OpenAI-style chat messages instead of --prompt (text and image parts).
    #[arg(long, conflicts_with = "prompt")]
    messages: Option<PathBuf>,
    /// A JSON array of OpenAI function tools for the chat template (as a request's `tools`).
    #[arg(long, requires = "messages")]
    tools: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Stop once the output contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Divide (positive) or multiply (negative) the logit of every token already in the prompt or
    /// the output by this (HF transformers' repetition_penalty; 1: none).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtract this from a token's logit once per time it occurs in the output (OpenAI's
    /// frequency_penalty).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Subtract this from the logit of every token the output already has (OpenAI's
    /// presence_penalty).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Print the result as JSON (tokens, text, finish reason, timings).
    #[arg(long)]
    json: bool,
    /// Also time every op of the prefill and of the decode steps (a table on stderr; with --json,
    /// in the JSON too).
    #[arg(long)]
    profile: bool,
}

#[derive(clap::Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON array of OpenAI-style chat messages.
    #[arg(long)]
    messages: PathBuf,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
}

#[derive(clap::Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON array of OpenAI-style chat messages.
    #[arg(long)]
    messages: PathBuf,
    /// The reply to score.
    #[arg(long)]
    target: String,
}

pub fn read_messages(path: &Path) -> Result<Vec<ChatMessage>> {
    let text = recall::limits::read_capped(path, recall::limits::MAX_DOCUMENT_BYTES)?;
    Ok(parse_messages(&text, path)?)
}

/// A tools file, normalised as `recall serve` normalises a request's `tools`.
fn read_tools(path: &Path) -> Result<Vec<serde_json::Value>> {
    let text = recall::limits::read_capped(path, recall::limits::MAX_DOCUMENT_BYTES)?;
    let tools: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let mut obj = serde_json::Map::new();
    obj.insert("tools".into(), tools);
    let parsed = recall::server::tools::parse_tools(&recall::server::fields::Fields::new(&obj))
        .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.message))?;
    Ok(parsed.tools)
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    with_backend!(a.model.backend.open(false)?, be => generate_on(be, &a))
}

fn generate_on<B: Backend>(be: B, a: &GenerateArgs) -> Result<()> {
    // With --profile the load is timed too: its wall time and the backend's ops in it (packing).
    be.set_profiling(a.profile);
    let load_start = std::time::Instant::now();
    let p = load(be, &a.model)?;
    let load_seconds = load_start.elapsed().as_secs_f64();
    let load_ops = p.backend.take_profile()?;
    p.backend.set_profiling(false);
    let messages = match &a.messages {
        Some(path) => read_messages(path)?,
        None => vec![ChatMessage::text("user", a.prompt.clone().unwrap_or_default())],
    };
    let start = std::time::Instant::now();
    let penalties = recall::engine::sampling::Penalties {
        repetition: a.repetition_penalty,
        frequency: a.frequency_penalty,
        presence: a.presence_penalty,
    };
    let tools = match &a.tools {
        Some(path) => read_tools(path)?,
        None => Vec::new(),
    };
    let (input, out, stats) =
        p.generate_chat_timed(&messages, &tools, a.max_tokens, &a.stop, &penalties, a.profile)?;
    let secs = start.elapsed().as_secs_f64();
    let prompt_tokens = input.ids.len();
    tracing::info!(
        prompt_tokens,
        new_tokens = out.tokens.len(),
        secs,
        prefill_s = stats.prefill_seconds,
        vision_s = input.vision_seconds,
        "generated"
    );
    // The peak that the GEMM's GFLOP/s are relative to, measured now (it moves with turbo and neighbours).
    let fma_peak = (a.profile && p.backend.name() == "cpu")
        .then(|| recall::backend::cpu::peak::fma_peak_gflops(100))
        .flatten();
    if a.profile {
        eprintln!("load: {load_seconds:.3} s wall");
        eprint!("{}", ops_table("load", &load_ops));
        if !stats.vision_ops.is_empty() {
            eprint!("{}", ops_table("vision", &stats.vision_ops));
        }
        eprint!("{}", ops_table("prefill", &stats.prefill_ops));
        eprint!("{}", ops_table("decode", &stats.decode_ops));
        if let (Some(peak), Some(linear)) = (fma_peak, linear_gflops(&stats.prefill_ops)) {
            eprintln!(
                "linear in prefill: {linear:.1} GFLOP/s, {:.0}% of this machine's f32 FMA peak ({peak:.1} GFLOP/s, measured now)",
                100.0 * linear / peak
            );
        }
    }
    if a.json {
        let v = serde_json::json!({
            "prompt_tokens": prompt_tokens,
            "tokens": out.tokens,
            "text": out.text,
            "finish_reason": format!("{:?}", out.finish),
            "backend": p.backend.describe(),
            "timings": {
                "load_seconds": load_seconds,
                "vision_seconds": input.vision_seconds,
                "prefill_seconds": stats.prefill_seconds,
                "decode_seconds": stats.decode_seconds,
                "decode_steps": stats.decode_steps,
            },
            "load_ops": load_ops,
            "vision_ops": stats.vision_ops,
            "prefill_ops": stats.prefill_ops,
            "decode_ops": stats.decode_ops,
            "fma_peak_gflops": fma_peak,
        });
        println!("{v}");
    } else {
        println!("{}", out.text.unwrap_or_default());
    }
    Ok(())
}

/// The `linear` op's GFLOP/s in a profile, when it ran and counted FLOPs.
fn linear_gflops(ops: &[recall::backend::OpTime]) -> Option<f64> {
    let l = ops.iter().find(|o| o.op == "linear" && o.flops > 0.0)?;
    Some(l.flops / l.seconds.max(1e-12) / 1e9)
}

/// A per-op table: calls, seconds, share, and GFLOP/s where the backend counts FLOPs.
fn ops_table(phase: &str, ops: &[recall::backend::OpTime]) -> String {
    let total: f64 = ops.iter().map(|o| o.seconds).sum();
    let mut s =
        format!("{phase}: {total:.3} s in ops\n  op                     calls    seconds  share  GFLOP/s\n");
    for o in ops {
        let rate = if o.flops > 0.0 {
            format!("{:8.1}", o.flops / o.seconds.max(1e-12) / 1e9)
        } else {
            "       -".to_string()
        };
        s.push_str(&format!(
            "  {:<22} {:>5} {:>10.4} {:>5.1}% {rate}\n",
            o.op,
            o.calls,
            o.seconds,
            100.0 * o.seconds / total.max(1e-12)
        ));
    }
    s
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    with_backend!(a.model.backend.open(false)?, be => {
        let p = load(be, &a.model)?;
        let r = p.prompt_logits(&read_messages(&a.messages)?)?;
        recall::engine::pipeline::write_logits(&a.out, &r)?;
        eprintln!(
            "wrote {} positions x {} logits to {}",
            r.input_ids.len(),
            r.vocab,
            a.out.display()
        );
        Ok(())
    })
}

pub fn score(a: ScoreArgs) -> Result<()> {
    with_backend!(a.model.backend.open(false)?, be => {
        let p = load(be, &a.model)?;
        let s = p.score_reply(&read_messages(&a.messages)?, &a.target)?;
        let v = serde_json::json!({
            "tokens": s.token_logprobs.len(),
            "sum_logprob": s.sum_logprob,
            "mean_logprob": s.mean_logprob,
            "token_logprobs": s.token_logprobs,
        });
        println!("{v}");
        Ok(())
    })
}
