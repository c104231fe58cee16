//! `recall bench`: the agent-step benchmark on random weights (docs/BENCH.md).

use anyhow::Result;
use clap::Parser;
use recall::bench::{run_bench, BenchArgs, TINY_PRESET};

use super::Cli;

#[derive(clap::Args)]
pub struct BenchCli {
    #[command(flatten)]
    args: BenchArgs,
    /// A CPU-sized run: the tiny preset's sizes (B = 2, 4x4-patch screenshots, 4-token responses),
    /// under any flag given explicitly.
    #[arg(long)]
    tiny: bool,
}

/// Parses the command line; `recall bench --tiny` parses again with the tiny preset's flags placed
/// before the user's, so that flags given explicitly still win.
pub fn parse_with_presets() -> Result<Cli> {
    let argv: Vec<String> = std::env::args().collect();
    let cli = Cli::parse_from(&argv);
    let is_tiny_bench = argv.get(1).is_some_and(|c| c == "bench") && argv.iter().any(|a| a == "--tiny");
    if !is_tiny_bench {
        return Ok(cli);
    }
    let mut with_preset: Vec<String> = argv[..2].to_vec();
    with_preset.extend(TINY_PRESET.iter().map(|s| s.to_string()));
    with_preset.extend(argv[2..].iter().cloned());
    Ok(Cli::parse_from(with_preset))
}

pub fn run(a: BenchCli) -> Result<()> {
    let _ = a.tiny; // applied while parsing
    let report = run_bench(&a.args)?;
    print!("{}", report.to_table());
    Ok(())
}
