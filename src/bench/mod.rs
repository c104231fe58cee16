//! `recall bench`: agent-step benchmarks on random-initialised weights of a real model shape.
//!
//! [`run_bench`] writes seeded random bf16 weights for a `config.json` into a temporary safetensors
//! file, loads them with [`QwenVl::load`] on the chosen backend and measures, on synthetic agent-step
//! prompts (B history screenshots plus the current one, GUI-Owl's rolling layout):
//!
//! * the vision tower per screenshot;
//! * prefill of the step prompt from scratch (every screenshot through the tower), with B of the B + 1
//!   screenshots already in the vision cache, and with all of them cached; time and TFLOP/s;
//! * decode ms/token at the step's context and the effective GB/s (weights + K/V read per token);
//! * the two-pass CausalCache step (pass 1, selector, pass 2) with and without prefix reuse and with
//!   and without drafting pass 2 from pass 1's proposal (plus an oracle draft: the best case);
//! * a ScopeMem-shaped step (two passes, the second with a 16-row embedding prefix);
//! * with step replay on ([`BenchArgs::step_replay`]), the decode once more with it off;
//! * with [`BenchArgs::breakdown`], one more prefill and decode profiled per op or kernel.
//!
//! Every path's whole greedy output (every repeat) is compared with an independently computed
//! baseline, plain decoding of the same prompt on a fresh engine (no prefix cache, no draft, step
//! replay off), and the result is printed as "identical: yes/no" with what it was compared against.
//! FLOPs and bytes are counted from the config (docs/BENCH.md).
//!
//! ```no_run
//! let args = recall::bench::BenchArgs::tiny(std::path::Path::new("tests/fixtures/tiny-qwen3-vl"));
//! let report = recall::bench::run_bench(&args)?;
//! println!("{}", report.to_table());
//! # Ok::<(), recall::Error>(())
//! ```
//!
//! The module's files, by concern:
//!
//! * `args.rs`: the settings ([`BenchArgs`], [`GridSpec`], [`TINY_PRESET`]);
//! * `synthetic.rs`: the random model (config copy, tensor specs, safetensors file or synthetic
//!   checkpoint), seeded by `crate::rng`;
//! * `layouts.rs`: the synthetic agent-step prompts ([`LayoutRun`]) and screenshots; `episode.rs`:
//!   the measured step (Recent-B, the selector's allocation, every prompt's layout);
//! * `harness.rs`: engines, timed greedy generation and the row statistics;
//! * `phases.rs`: the warm-up, the baseline and each measurement phase; `steps.rs`: the two-pass
//!   step phases; `flops.rs`: the FLOP and byte counts of the floors;
//! * `report.rs`: [`BenchReport`] and its rows (the JSON); `table.rs`: the printed table;
//! * this file: [`run_bench`], which ties them together.

mod args;
mod episode;
mod flops;
mod harness;
mod layouts;
mod phases;
mod report;
mod steps;
mod synthetic;
mod table;

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use args::{BenchArgs, GridSpec, TINY_PRESET};
pub use layouts::LayoutRun;
pub use report::{
    Baseline, BenchReport, Breakdown, DecodeRow, OpRow, PrefillRow, ReplayReport, Shapes, StepCounts,
    StepRow, VisionRow, WeightsInfo,
};

use crate::backend::{select, Backend};
use crate::error::{Error, Result};
use crate::model::{ModelConfig, QwenVl};
use episode::Episode;
use harness::{ms, Harness};
use layouts::{pixels, Layouts};
use phases::{baseline, warm_up, Measured, Phases, Prompts};
use synthetic::{write_random_model, WeightSource, Written};

/// Rows of the ScopeMem prefix (K = 16 prefix vectors).
pub const SCOPEMEM_ROWS: usize = 16;

/// Runs the bench described by `args`: random weights, the measurements, the table's data; writes
/// `args.json_out` when set.
pub fn run_bench(args: &BenchArgs) -> Result<BenchReport> {
    let wall = Instant::now();
    validate(args)?;
    let base = args.weights_dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = TempDir::new(&base)?;
    let (cfg, written, synthetic) = write_random_model(
        &args.config_dir,
        &dir.path,
        args.layers,
        args.seed,
        args.weights_file,
    )?;
    let source = WeightSource {
        dir: &dir.path,
        synthetic: synthetic.as_ref(),
    };
    let mut report = crate::with_backend!(select(args.backend.backend)?, be => {
        bench_backend(&be, args, source, &cfg, written)?
    });
    drop(dir);
    report.wall_s = wall.elapsed().as_secs_f64();
    if let Some(path) = &args.json_out {
        crate::atomic::write_atomic(path, report.to_json()?)?;
    }
    Ok(report)
}

fn validate(a: &BenchArgs) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidRequest(format!("bench: {m}")));
    if a.budget == 0 || a.history <= a.budget {
        return bad(format!(
            "history ({}) must exceed the budget ({} > 0) so that pass 2 differs from Recent-B",
            a.history, a.budget
        ));
    }
    if a.response_tokens < 2 {
        return bad("response_tokens must be at least 2 (decode is measured)".into());
    }
    if a.repeats == 0 || a.chunk_size == 0 || a.max_batch_tokens == 0 || a.block_size == 0 {
        return bad("repeats, chunk_size, max_batch_tokens and block_size must be positive".into());
    }
    if a.system_tokens == 0 || a.step_tokens == 0 {
        return bad("system_tokens and step_tokens must be positive".into());
    }
    Ok(())
}

/// A directory deleted on drop.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn new(base: &Path) -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = base.join(format!("recall-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The bench on one backend: load the model, plan the step, warm up, compute the baseline, run the
/// phases and assemble the report (its `wall_s` is left to the caller).
fn bench_backend<B: Backend>(
    be: &B,
    args: &BenchArgs,
    source: WeightSource<'_>,
    cfg: &ModelConfig,
    written: Written,
) -> Result<BenchReport> {
    let sync = &|| be.synchronize();
    let device = be.describe();
    let kv_elem_bytes = be.element_bytes();
    let (model, load_ms) = load_model(be, source, cfg)?;
    let vision = model
        .config
        .vision
        .clone()
        .ok_or_else(|| Error::InvalidRequest("bench: the config has no vision tower".into()))?;
    let tower = model
        .vision
        .as_ref()
        .ok_or_else(|| Error::InvalidRequest("bench: the model has no vision tower".into()))?;
    let grid = args.grid.resolve(&vision)?;
    let merge = vision.spatial_merge_size;
    let image_tokens = grid.iter().product::<usize>() / (merge * merge);
    let layouts = Layouts::new(cfg, args, grid);
    let t = args.history + 1;
    let images = (1..=t).map(|s| pixels(&vision, grid, args.seed, s)).collect();
    let episode = Episode::plan(&layouts, args, merge)?;
    let harness = Harness {
        be,
        sync,
        model: &model,
        args,
        layouts,
        images,
        merge,
        pool_blocks: episode.pool_blocks(args),
    };
    be.set_step_replay(args.step_replay);
    let prompts = Prompts::new(&harness, &episode);
    warm_up(&harness, &episode, &prompts.pass1)?;
    let base = baseline(&harness, &prompts)?;
    let phases = Phases {
        harness: &harness,
        episode: &episode,
        prompts: &prompts,
        base: &base,
        tower,
        vision: &vision,
        grid,
    };
    let m: Measured = phases.measure(written.decode_params, kv_elem_bytes)?;
    let mut report = BenchReport {
        backend: be.name().to_string(),
        device,
        config_dir: args.config_dir.display().to_string(),
        family: format!("{:?}", model.config.family),
        layers: model.config.text.num_hidden_layers,
        seed: args.seed,
        repeats: args.repeats,
        chunk_size: args.chunk_size,
        peak_tflops: args.peak_tflops,
        peak_gbs: args.peak_gbs,
        shapes: episode.into_shapes(args, grid, image_tokens),
        weights: written.info(load_ms),
        vision: m.vision,
        prefill: m.prefill,
        decode: m.decode,
        causalcache: m.causalcache,
        scopemem: m.scopemem,
        replay: m.replay,
        baseline: base,
        breakdown: m.breakdown,
        all_identical: false,
        wall_s: 0.0,
    };
    report.all_identical = report.every_path_identical();
    Ok(report)
}

/// The model from the synthetic checkpoint or the weights file, and the load time (ms, synced).
fn load_model<B: Backend>(be: &B, source: WeightSource<'_>, cfg: &ModelConfig) -> Result<(QwenVl<B>, f64)> {
    let clock = Instant::now();
    let model = match source.synthetic {
        Some(ckpt) => QwenVl::from_checkpoint(be, cfg.clone(), ckpt)?,
        None => QwenVl::load(be, source.dir)?,
    };
    be.synchronize()?;
    Ok((model, ms(clock)))
}
