//! `recall kernels`: the kernel benchmark harness (docs/KERNELS.md): every op case and kernel version
//! validated against the CPU twin, then timed with a cache flush before each run.

use std::path::PathBuf;

use anyhow::{bail, Result};
use recall::backend::{select, BackendChoice};
use recall::kernel_bench::{run as run_harness, CaseSet, Op, Options};
use recall::with_backend;

use super::write_file;

#[derive(clap::Args)]
pub struct KernelsArgs {
    /// auto (CUDA when a usable GPU is found, else CPU), cpu or cuda.
    #[arg(long, value_enum, env = "RECALL_BACKEND", default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
    /// Case table: parity (the op-parity tests' shapes), perf (Qwen3-VL-8B shapes) or all.
    #[arg(long, default_value = "parity", value_parser = parse_set)]
    cases: CaseSet,
    /// Only these ops, comma-separated (e.g. linear,paged_attention); all by default.
    #[arg(long, value_delimiter = ',', value_parser = parse_op)]
    ops: Vec<Op>,
    /// Validate every version against the CPU twin; time nothing.
    #[arg(long)]
    validate_only: bool,
    /// Timed runs per (case, version), each after a cache flush.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Untimed runs before them.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// MiB written to flush the cache before each timed run [default: 256 on a GPU; on the CPU
    /// twice the last-level cache, at least 64].
    #[arg(long)]
    flush_mib: Option<usize>,
    /// Roofline bandwidth in GB/s [default: 4200 on CUDA (the H200's measured copy rate); on the CPU
    /// measured by a parallel copy].
    #[arg(long)]
    peak_gbs: Option<f64>,
    /// Roofline matrix rate in TFLOP/s [default: 790 on CUDA (the H200's measured bf16 GEMM rate); on
    /// the CPU the measured f32 FMA peak].
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_set(s: &str) -> std::result::Result<CaseSet, String> {
    match s {
        "parity" => Ok(CaseSet::Parity),
        "perf" => Ok(CaseSet::Perf),
        "all" => Ok(CaseSet::All),
        _ => Err(format!("`{s}`: want parity, perf or all")),
    }
}

fn parse_op(s: &str) -> std::result::Result<Op, String> {
    Op::parse(s).ok_or_else(|| {
        let names: Vec<&str> = Op::ALL.iter().map(|o| o.name()).collect();
        format!("`{s}`: want one of {}", names.join(", "))
    })
}

pub fn run(a: KernelsArgs) -> Result<()> {
    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let opts = Options {
        set: a.cases,
        ops: a.ops.clone(),
        validate_only: a.validate_only,
        warmup: a.warmup,
        iters: a.iters,
        flush_bytes: a.flush_mib.map(|m| m << 20),
        peak_gbs: a.peak_gbs,
        peak_tflops: a.peak_tflops,
        seed: a.seed,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    let report = with_backend!(select(a.backend)?, be => run_harness(&be, &opts))?;
    print!("{}", report.to_table());
    if let Some(path) = &a.json {
        write_file(path, report.to_json()?)?;
    }
    report.ensure_valid()?;
    Ok(())
}
