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

use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::backend::{select, Backend, BackendArgs, BackendChoice};
use crate::engine::{
    Engine, EngineConfig, GenerateParams, ImageHash, ImageRole, Outcome, Prompt, RequestOptions, Segment,
    Task,
};
use crate::error::{Error, Result};
use crate::memory::policy::{AllocationPolicy, PolicyInputs, Selector};
use crate::memory::selector::{
    recent_b, ActionBucket, DecisionContext, EventInfo, MarginalScorer, Mode, ScorerParams, NUM_FEATURES,
};
use crate::model::loader::{Checkpoint, Fill};
use crate::model::{Family, GridThw, ModelConfig, QwenVl, TextConfig, VisionConfig};
use crate::vision::PixelValues;

/// Rows of the ScopeMem prefix (K = 16 prefix vectors).
pub const SCOPEMEM_ROWS: usize = 16;

/// A screenshot's size: a patch grid, or pixels rounded down to whole merge blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GridSpec {
    /// `[t, h, w]` in patches (`h`, `w` multiples of the spatial merge size).
    Patches([usize; 3]),
    /// Height and width in pixels: `h = height / patch`, `w = width / patch`, each rounded down to a
    /// multiple of the merge size (at least one merge block), `t = 1`.
    Pixels { height: usize, width: usize },
}

impl FromStr for GridSpec {
    type Err = String;

    /// `"1x80x128"` (t×h×w patches), `"80x128"` (h×w patches, t = 1) or `"1280x2048px"` (pixels, h×w).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (body, pixels) = match s.trim().strip_suffix("px") {
            Some(b) => (b, true),
            None => (s.trim(), false),
        };
        let nums: Vec<usize> = body
            .split(['x', 'X', ','])
            .map(|p| p.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| format!("grid `{s}`: {e}"))?;
        match (pixels, nums.as_slice()) {
            (true, [h, w]) => Ok(GridSpec::Pixels {
                height: *h,
                width: *w,
            }),
            (false, [h, w]) => Ok(GridSpec::Patches([1, *h, *w])),
            (false, [t, h, w]) => Ok(GridSpec::Patches([*t, *h, *w])),
            _ => Err(format!(
                "grid `{s}`: expected TxHxW or HxW in patches, or HxWpx in pixels"
            )),
        }
    }
}

impl GridSpec {
    /// The patch grid under a vision config.
    pub fn resolve(&self, v: &VisionConfig) -> Result<GridThw> {
        let m = v.spatial_merge_size.max(1);
        let grid = match *self {
            GridSpec::Patches(g) => g,
            GridSpec::Pixels { height, width } => {
                let side = |px: usize| ((px / v.patch_size.max(1)) / m).max(1) * m;
                [1, side(height), side(width)]
            }
        };
        let [t, h, w] = grid;
        if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
            return Err(Error::InvalidRequest(format!(
                "bench grid {grid:?} does not split into {m}x{m} merge blocks"
            )));
        }
        Ok(grid)
    }
}

/// Settings of [`run_bench`]: the `recall bench` flags, parsed by clap (each flag is a field name in
/// kebab-case; the defaults are the H200 configuration of [`BenchArgs::default_for`]).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Directory with the model shape's `config.json` (and optionally `generation_config.json`), e.g.
    /// `models/qwen3-vl-8b-instruct` or `tests/fixtures/tiny-qwen3-vl`. Only the config is read: the
    /// weights are random.
    #[arg(long, default_value = "models/qwen3-vl-8b-instruct")]
    pub config_dir: PathBuf,
    /// The backend (device 0 for CUDA).
    #[command(flatten)]
    pub backend: BackendArgs,
    /// History screenshots per prompt (B).
    #[arg(long, default_value_t = 4)]
    pub budget: usize,
    /// Size of every screenshot (history and current): TxHxW patches (1x80x128), HxW patches, or HxWpx
    /// pixels.
    #[arg(long, default_value = "1x80x128")]
    pub grid: GridSpec,
    /// Completed steps before the current one; must exceed `budget` so that pass 2 can differ from
    /// Recent-B.
    #[arg(long, default_value_t = 8)]
    pub history: usize,
    /// Tokens generated per pass (greedy, no end token: exactly this many), also the length of every
    /// earlier assistant turn in the prompt.
    #[arg(long, default_value_t = 64)]
    pub response_tokens: usize,
    /// Text tokens of the system prompt.
    #[arg(long, default_value_t = 1819)]
    pub system_tokens: usize,
    /// Text tokens of each folded `StepN: action` line.
    #[arg(long, default_value_t = 28)]
    pub step_tokens: usize,
    /// Override of the decoder depth (`num_hidden_layers`); the vision tower keeps its depth. Must be at
    /// least the number of deepstack layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Timed repetitions of every measurement (the median is reported); one untimed warm-up runs first.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Seed of the weights, pixels, token ids and the ScopeMem prefix.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// The engine's chunked-prefill size (tokens of one sequence per forward).
    #[arg(long, default_value_t = 4096)]
    pub chunk_size: usize,
    /// The engine's most tokens per forward.
    #[arg(long, default_value_t = 8192)]
    pub max_batch_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Directory of the temporary `config.json` and, with `weights_file`, the weights file (default:
    /// the system temp dir; on the GPU machine `/dev/shm` avoids the disk). Deleted when the bench ends.
    #[arg(long)]
    pub weights_dir: Option<PathBuf>,
    /// Write the random weights to a safetensors file and load it through the checkpoint loader (host
    /// memory map, bf16 conversion, upload). Default: a [`Checkpoint::synthetic`] checkpoint, whose
    /// tensors the backend generates itself — on the GPU directly in device memory, no file and no
    /// 17.5 GB host-to-device copy.
    #[arg(long)]
    pub weights_file: bool,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Fewer variants, for a device call with little time: the CausalCache step only plain, reuse +
    /// draft and reuse + oracle draft; ScopeMem only with reuse (its pass 2 is then compared with
    /// nothing, its pass 1 with the plain pass 1).
    #[arg(long)]
    pub quick: bool,
    /// After the measurements, profile one more prefill and decode of the pass-1 prompt per op (CPU)
    /// or per kernel (CUDA): [`BenchReport::breakdown`].
    #[arg(long)]
    pub breakdown: bool,
    /// Step recording/replay ([`Backend::set_step_replay`], CUDA graphs) during the measurements:
    /// on or off. When on, the plain pass 1 also runs once with it off and both outputs are compared:
    /// [`BenchReport::replay`].
    #[arg(long, default_value = "on", action = clap::ArgAction::Set, value_parser = parse_on_off)]
    pub step_replay: bool,
    /// Matrix-unit ceiling for the floors, TFLOP/s (H200 measured: 790).
    #[arg(long, default_value_t = 790.0)]
    pub peak_tflops: f64,
    /// Memory-bandwidth ceiling for the floors, GB/s (H200 measured copy: 4200).
    #[arg(long, default_value_t = 4200.0)]
    pub peak_gbs: f64,
}

fn parse_on_off(s: &str) -> std::result::Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("`{other}`: expected on or off")),
    }
}

/// The flags of [`BenchArgs::tiny`] (`recall bench --tiny`): B = 2, 4×4-patch screenshots, 4-token
/// responses, on the CPU. Flags given after them win.
pub const TINY_PRESET: &[&str] = &[
    "--backend",
    "cpu",
    "--budget",
    "2",
    "--grid",
    "1x4x4",
    "--history",
    "4",
    "--response-tokens",
    "4",
    "--system-tokens",
    "24",
    "--step-tokens",
    "5",
    "--repeats",
    "1",
    "--chunk-size",
    "32",
    "--max-batch-tokens",
    "64",
];

/// A command holding only [`BenchArgs`], to parse them outside the CLI.
#[derive(clap::Parser)]
#[command(args_override_self = true)]
struct BenchFlags {
    #[command(flatten)]
    args: BenchArgs,
}

impl BenchArgs {
    /// Parses bench flags (as `recall bench` takes them); later flags override earlier ones.
    ///
    /// ```
    /// let a = recall::bench::BenchArgs::from_flags(&["--budget", "3", "--budget", "5"]).unwrap();
    /// assert_eq!((a.budget, a.history), (5, 8));
    /// ```
    pub fn from_flags(flags: &[&str]) -> Result<Self> {
        use clap::Parser;
        let argv = std::iter::once("bench").chain(flags.iter().copied());
        BenchFlags::try_parse_from(argv)
            .map(|f| f.args)
            .map_err(|e| Error::InvalidRequest(format!("bench flags: {e}")))
    }

    /// The issue's H200 configuration: B = 4, 2560-token screenshots (80×128 patches), 8 completed
    /// steps, 64-token responses (15,090 tokens per pass-1 prompt with the 8B config, as the issue's step).
    pub fn default_for(config_dir: &Path, backend: BackendChoice) -> Self {
        let mut a = Self::from_flags(&[]).expect("the defaults parse");
        a.config_dir = config_dir.to_path_buf();
        a.backend.backend = backend;
        a
    }

    /// Small sizes for a CPU check on a tiny config ([`TINY_PRESET`]).
    pub fn tiny(config_dir: &Path) -> Self {
        let mut a = Self::from_flags(TINY_PRESET).expect("the tiny preset parses");
        a.config_dir = config_dir.to_path_buf();
        a
    }
}

/// One run of a prompt layout: text ids, a screenshot (by step; `step = history + 1` is the current
/// one) or an embedding prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LayoutRun {
    Text(Vec<u32>),
    Image { step: usize, grid: [usize; 3] },
    Embeds(usize),
}

/// Sizes of the bench prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shapes {
    pub budget: usize,
    pub history: usize,
    /// Screenshot grid in patches.
    pub grid: [usize; 3],
    /// Merged tokens per screenshot.
    pub image_tokens: usize,
    pub response_tokens: usize,
    /// Tokens of the pass-1 (Recent-B) prompt.
    pub pass1_tokens: usize,
    /// Tokens of the pass-2 prompt (the chosen allocation).
    pub pass2_tokens: usize,
    /// Tokens of the ScopeMem pass-2 prompt (prefix + pass-1 prompt).
    pub scopemem_tokens: usize,
    /// Recent-B steps.
    pub recent: Vec<usize>,
    /// The allocation pass 2 renders.
    pub allocation: Vec<usize>,
    /// Whether the selector chose `allocation` (else it chose Recent-B and the bench forced a swap of
    /// the oldest recent step for step 1, so that pass 2 runs).
    pub selector_chose: bool,
    /// The pass-1 prompt, for `tools/hf_bench.py --layout-json` (same shapes on HF).
    pub pass1_layout: Vec<LayoutRun>,
}

/// Weight generation and loading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsInfo {
    /// Parameters of the whole model (text + vision).
    pub params: u64,
    /// Parameters read per decoded token (decoder linear and norm weights, lm_head).
    pub decode_params: u64,
    pub file_bytes: u64,
    pub write_ms: f64,
    pub load_ms: f64,
}

/// The vision tower on one screenshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionRow {
    pub ms: f64,
    pub patches: usize,
    pub tflop: f64,
    pub tflops: f64,
    pub floor_ms: f64,
}

/// One prefill of the pass-1 prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillRow {
    pub name: String,
    /// Screenshots that went through the vision tower inside the timed region.
    pub vision_images: usize,
    pub tokens: usize,
    pub ms: f64,
    /// FLOPs counted (GEMMs + attention of the decoder, lm_head for one row, the tower on
    /// `vision_images` screenshots), in TFLOP.
    pub tflop: f64,
    pub tflops: f64,
    /// `tflop / peak_tflops`.
    pub floor_ms: f64,
    /// Every repeat's whole greedy output equals the baseline's for the pass-1 prompt (the prefill
    /// is timed to the first token; the rest of the response is generated untimed for the check).
    pub identical: bool,
    /// What `identical` compared with.
    #[serde(default)]
    pub compared_with: String,
}

/// Decode of pass 1 (plain path).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeRow {
    pub ms_per_token: f64,
    /// Decode steps measured.
    pub tokens: usize,
    /// Mean context length over those steps.
    pub context: usize,
    /// Bytes read per token: decode weights + the K/V of the context.
    pub gb_per_token: f64,
    pub gbs: f64,
    /// `gb_per_token / peak_gbs`.
    pub floor_ms: f64,
}

/// One variant of a two-pass step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    pub name: String,
    pub prefix_reuse: bool,
    /// `none`, `proposal` or `oracle`.
    pub draft: String,
    /// The current screenshot through the vision tower (history screenshots were encoded at earlier
    /// steps and are cached).
    pub vision_ms: f64,
    pub pass1_ms: f64,
    pub pass1_prefill_ms: f64,
    pub selector_ms: f64,
    pub pass2_ms: f64,
    pub pass2_prefill_ms: f64,
    /// vision + pass 1 + selector + pass 2.
    pub total_ms: f64,
    /// `pass2_ms / pass1_ms`.
    pub pass2_over_pass1: f64,
    pub reused_pass1: usize,
    pub reused_pass2: usize,
    pub accepted_draft: usize,
    /// Every repeat's tokens of both passes equal the baseline's for the same prompts.
    pub identical: bool,
    /// What `identical` compared with.
    #[serde(default)]
    pub compared_with: String,
    pub pass1_tokens: Vec<u32>,
    pub pass2_tokens: Vec<u32>,
}

/// Time of one op (CPU backend) or kernel (CUDA backend) in a profiled phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRow {
    /// Op or kernel name, as the backend reports it.
    pub op: String,
    pub calls: usize,
    /// Total seconds.
    pub seconds: f64,
}

impl From<crate::backend::OpTime> for OpRow {
    fn from(o: crate::backend::OpTime) -> Self {
        OpRow {
            op: o.op,
            calls: o.calls,
            seconds: o.seconds,
        }
    }
}

/// `--breakdown`: where the time of one prefill and one decode goes, op by op (CPU: wall time of
/// each backend op; CUDA: event time of each kernel).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// The current screenshot through the tower and the pass-1 prompt to its first token (history
    /// screenshots cached, no prefix reuse), slowest first.
    pub prefill: Vec<OpRow>,
    /// The decode steps after the first token, slowest first.
    pub decode: Vec<OpRow>,
    /// Wall time of the prefill phase, seconds. The ops' sum is at most this; the rest is host work
    /// and launch overhead.
    pub prefill_wall_s: f64,
    /// Wall time of the decode phase, seconds.
    pub decode_wall_s: f64,
    /// Prompt tokens of the prefill.
    pub prefill_tokens: usize,
    /// Decode steps profiled.
    pub decode_steps: usize,
    /// The profiled run's tokens equal the baseline's for the pass-1 prompt.
    pub identical: bool,
    /// What `identical` compared with.
    #[serde(default)]
    pub compared_with: String,
}

/// The backend's step counters ([`crate::backend::StepStats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCounts {
    pub recorded: usize,
    pub replayed: usize,
    pub direct: usize,
    /// Recordings that failed; the step then ran directly.
    #[serde(default)]
    pub failed_recordings: usize,
    /// Step keys given up on after repeated failed recordings.
    #[serde(default)]
    pub given_up: usize,
}

impl StepCounts {
    /// The counts since `earlier` (the backend's counters only grow).
    fn since(self, earlier: StepCounts) -> StepCounts {
        StepCounts {
            recorded: self.recorded.saturating_sub(earlier.recorded),
            replayed: self.replayed.saturating_sub(earlier.replayed),
            direct: self.direct.saturating_sub(earlier.direct),
            failed_recordings: self.failed_recordings.saturating_sub(earlier.failed_recordings),
            given_up: self.given_up.saturating_sub(earlier.given_up),
        }
    }
}

impl From<crate::backend::StepStats> for StepCounts {
    fn from(s: crate::backend::StepStats) -> Self {
        StepCounts {
            recorded: s.recorded,
            replayed: s.replayed,
            direct: s.direct,
            failed_recordings: s.failed_recordings,
            given_up: s.given_up,
        }
    }
}

/// `--step-replay`: the setting, the backend's step counters and the replay on/off comparison.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    /// Step replay was on during the measurements.
    pub enabled: bool,
    /// Decode ms/token of the measurements (the decode row).
    pub ms_per_token: f64,
    /// Decode ms/token of the baseline's pass-1 run, the same prompt with replay off (only when
    /// enabled).
    pub off_ms_per_token: Option<f64>,
    /// The plain variant's pass 1 with replay on equals the baseline's (replay off) (only when
    /// enabled).
    pub identical: Option<bool>,
    /// The step counters over the measurements (after the warm-up and the baseline).
    pub steps: StepCounts,
}

/// The reference of every identical flag: each prompt's greedy output from plain decoding on a fresh
/// engine (no prefix cache, no draft, step replay off), computed once before the measurements and
/// independently of every measured run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// How the baseline was computed.
    pub method: String,
    /// The pass-1 prompt's output (also the prefill rows', the decode row's, the breakdown's).
    pub pass1_tokens: Vec<u32>,
    /// The pass-2 prompt's output.
    pub pass2_tokens: Vec<u32>,
    /// The ScopeMem pass-2 prompt's output (its embedding prefix first).
    pub scopemem_tokens: Vec<u32>,
    /// The same with the prefix appended before the assistant turn (the reuse-friendly placement).
    #[serde(default)]
    pub scopemem_append_tokens: Vec<u32>,
    /// Decode ms/token of the pass-1 run.
    pub pass1_ms_per_token: f64,
}

/// Everything [`run_bench`] measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    pub backend: String,
    pub device: String,
    pub config_dir: String,
    pub family: String,
    /// Decoder layers used.
    pub layers: usize,
    pub seed: u64,
    pub repeats: usize,
    pub chunk_size: usize,
    pub peak_tflops: f64,
    pub peak_gbs: f64,
    pub shapes: Shapes,
    pub weights: WeightsInfo,
    pub vision: VisionRow,
    pub prefill: Vec<PrefillRow>,
    pub decode: DecodeRow,
    pub causalcache: Vec<StepRow>,
    pub scopemem: Vec<StepRow>,
    /// Step replay and its on/off check.
    #[serde(default)]
    pub replay: ReplayReport,
    /// What every identical flag compares with.
    #[serde(default)]
    pub baseline: Baseline,
    /// The per-op profile (`--breakdown`).
    #[serde(default)]
    pub breakdown: Option<Breakdown>,
    /// Every identical flag is true.
    pub all_identical: bool,
    /// Wall time of the whole bench, weights included.
    pub wall_s: f64,
}

impl BenchReport {
    /// Every "identical" check by name.
    pub fn identical_flags(&self) -> Vec<(String, bool)> {
        let flag = |what: String, with: &str, ok: bool| (format!("{what} vs {with}"), ok);
        let mut v: Vec<(String, bool)> = self
            .prefill
            .iter()
            .map(|r| flag(format!("prefill {}", r.name), &r.compared_with, r.identical))
            .collect();
        v.extend(
            self.causalcache
                .iter()
                .map(|r| flag(format!("causalcache {}", r.name), &r.compared_with, r.identical)),
        );
        v.extend(
            self.scopemem
                .iter()
                .map(|r| flag(format!("scopemem {}", r.name), &r.compared_with, r.identical)),
        );
        if let Some(same) = self.replay.identical {
            v.push(flag("decode with step replay".into(), REPLAY_COMPARED_WITH, same));
        }
        if let Some(b) = &self.breakdown {
            v.push(flag("breakdown run".into(), &b.compared_with, b.identical));
        }
        v
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| Error::InvalidRequest(format!("bench JSON: {e}")))
    }

    /// A plain-text table of the results.
    pub fn to_table(&self) -> String {
        let yes = yes_no;
        let s = &self.shapes;
        let mut o = String::new();
        let mut line = |t: String| {
            o.push_str(&t);
            o.push('\n');
        };
        line(format!(
            "recall bench: {} on {} ({}), {} layers, {}: B={} history={} grid={:?} ({} tokens/screenshot), \
             response {} tokens",
            self.config_dir,
            self.device,
            self.backend,
            self.layers,
            self.family,
            s.budget,
            s.history,
            s.grid,
            s.image_tokens,
            s.response_tokens
        ));
        line(format!(
            "prompts: pass 1 {} tokens, pass 2 {} tokens (allocation {:?} vs recent {:?}, {}), scopemem {} tokens; \
             chunk {}; repeats {} (median)",
            s.pass1_tokens,
            s.pass2_tokens,
            s.allocation,
            s.recent,
            if s.selector_chose { "selector's choice" } else { "forced swap" },
            s.scopemem_tokens,
            self.chunk_size,
            self.repeats
        ));
        let origin = if self.weights.file_bytes > 0 {
            format!(
                "{:.2} GB file written in {:.1} s",
                self.weights.file_bytes as f64 / 1e9,
                self.weights.write_ms / 1e3
            )
        } else {
            "generated by the backend, no file".to_string()
        };
        line(format!(
            "weights: {:.3} B params ({origin}), loaded in {:.1} s; floors at {:.0} TFLOP/s, {:.0} GB/s",
            self.weights.params as f64 / 1e9,
            self.weights.load_ms / 1e3,
            self.peak_tflops,
            self.peak_gbs
        ));
        line(String::new());
        line(format!(
            "{:<34} {:>10} {:>9} {:>9} {:>10} {:>8}  identical",
            "measurement", "ms", "TFLOP", "TFLOP/s", "floor ms", "x floor"
        ));
        let v = &self.vision;
        line(format!(
            "{:<34} {:>10.2} {:>9.3} {:>9.1} {:>10.2} {:>8.2}  -",
            format!("vision tower, 1 screenshot ({} p)", v.patches),
            v.ms,
            v.tflop,
            v.tflops,
            v.floor_ms,
            ratio(v.ms, v.floor_ms)
        ));
        for p in &self.prefill {
            line(format!(
                "{:<34} {:>10.2} {:>9.3} {:>9.1} {:>10.2} {:>8.2}  {}",
                format!("prefill {} ({} tok)", p.name, p.tokens),
                p.ms,
                p.tflop,
                p.tflops,
                p.floor_ms,
                ratio(p.ms, p.floor_ms),
                yes(p.identical)
            ));
        }
        let d = &self.decode;
        line(format!(
            "{:<34} {:>10.3} {:>9} {:>9} {:>10.3} {:>8.2}  -   ({:.3} GB/token, {:.0} GB/s at {} ctx)",
            "decode ms/token",
            d.ms_per_token,
            "",
            "",
            d.floor_ms,
            ratio(d.ms_per_token, d.floor_ms),
            d.gb_per_token,
            d.gbs,
            d.context
        ));
        line(self.replay.line());
        line(String::new());
        line(format!(
            "{:<24} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>6} {:>7} {:>7} {:>6}  identical",
            "two-pass step",
            "vision",
            "pass1",
            "(prefill)",
            "select",
            "pass2",
            "(prefill)",
            "total",
            "p2/p1",
            "reuse1",
            "reuse2",
            "draft"
        ));
        for r in self.causalcache.iter().chain(&self.scopemem) {
            line(format!(
                "{:<24} {:>8.2} {:>9.2} {:>9.2} {:>8.3} {:>9.2} {:>9.2} {:>9.2} {:>6.2} {:>7} {:>7} {:>6}  {}",
                r.name,
                r.vision_ms,
                r.pass1_ms,
                r.pass1_prefill_ms,
                r.selector_ms,
                r.pass2_ms,
                r.pass2_prefill_ms,
                r.total_ms,
                r.pass2_over_pass1,
                r.reused_pass1,
                r.reused_pass2,
                r.accepted_draft,
                yes(r.identical)
            ));
        }
        if let Some(b) = &self.breakdown {
            line(String::new());
            b.lines().into_iter().for_each(&mut line);
        }
        line(String::new());
        line(format!(
            "identical = the whole greedy output ({} tokens per pass, every repeat) equals the baseline's \
             for the same prompt: {}",
            s.response_tokens, self.baseline.method
        ));
        line(format!(
            "identical greedy output on every path: {}   (wall {:.1} s)",
            yes(self.all_identical),
            self.wall_s
        ));
        o
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

impl ReplayReport {
    /// One line: the setting, the step counters and, when on, both decode rates and the comparison.
    fn line(&self) -> String {
        let s = &self.steps;
        let counts = format!(
            "recorded {}, replayed {}, direct {}, failed recordings {}, keys given up {}",
            s.recorded, s.replayed, s.direct, s.failed_recordings, s.given_up
        );
        match (self.off_ms_per_token, self.identical) {
            (Some(off), Some(same)) => format!(
                "step replay on ({counts}): decode {:.3} ms/token with replay, {off:.3} without (the \
                 baseline run); replay identical: {} (vs {REPLAY_COMPARED_WITH})",
                self.ms_per_token,
                yes_no(same)
            ),
            _ => format!(
                "step replay {} ({counts})",
                if self.enabled { "on" } else { "off" }
            ),
        }
    }
}

impl Breakdown {
    /// The two phase tables.
    fn lines(&self) -> Vec<String> {
        let mut v =
            vec!["per-op breakdown (--breakdown; CPU: op wall time, CUDA: kernel event time)".to_string()];
        v.extend(phase_lines(
            &format!(
                "prefill: current screenshot + {} prompt tokens to the first token",
                self.prefill_tokens
            ),
            self.prefill_wall_s,
            &self.prefill,
        ));
        v.extend(phase_lines(
            &format!("decode: {} steps", self.decode_steps),
            self.decode_wall_s,
            &self.decode,
        ));
        v
    }
}

/// A phase's header (wall time, sum of the op times, the gap) and one row per op.
fn phase_lines(title: &str, wall_s: f64, ops: &[OpRow]) -> Vec<String> {
    let sum: f64 = ops.iter().map(|o| o.seconds).sum();
    let pct = |s: f64| 100.0 * ratio(s, wall_s);
    let w = ops.iter().map(|o| o.op.len()).max().unwrap_or(0).max(24);
    let mut v = vec![
        format!(
            "{title}: wall {:.3} ms, ops {:.3} ms ({:.1}%), gap {:.3} ms (host work, launch overhead)",
            wall_s * 1e3,
            sum * 1e3,
            pct(sum),
            (wall_s - sum) * 1e3
        ),
        format!(
            "  {:<w$} {:>8} {:>10} {:>8} {:>10}",
            "op", "calls", "total ms", "% phase", "us/call"
        ),
    ];
    v.extend(ops.iter().map(|o| {
        format!(
            "  {:<w$} {:>8} {:>10.3} {:>8.1} {:>10.1}",
            o.op,
            o.calls,
            o.seconds * 1e3,
            pct(o.seconds),
            o.seconds * 1e6 / o.calls.max(1) as f64
        )
    }));
    v
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

// ---------------------------------------------------------------------------------------------------
// Entry point.

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

// ---------------------------------------------------------------------------------------------------
// Random weights.

/// SplitMix64: small, fast, seedable, and good enough for weights and token ids.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// A seed derived from a parent seed and labels.
fn derive(seed: u64, labels: &[u64]) -> u64 {
    let mut r = Rng::new(seed ^ 0x6a09_e667_f3bc_c908);
    for &l in labels {
        r.0 ^= l.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        r.next_u64();
    }
    r.next_u64()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    /// Uniform with this standard deviation.
    Random(f32),
    Ones,
    Zeros,
}

struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    /// Read once per decoded token (decoder weights and the lm_head).
    decode: bool,
}

fn spec(name: String, shape: &[usize], std: f32, decode: bool) -> Spec {
    let init = if name.ends_with(".bias") {
        Init::Zeros
    } else if name.contains("norm") || name.contains("ln_q") {
        Init::Ones
    } else {
        Init::Random(std)
    };
    Spec {
        name,
        shape: shape.to_vec(),
        init,
        decode,
    }
}

/// Every tensor `QwenVl::load` reads for `cfg`, with HF's initialisation (normal(0, std) linear and
/// embedding weights, zero biases, unit norm weights); uniform instead of normal.
fn weight_specs(cfg: &ModelConfig, tied: bool, std: f32) -> Vec<Spec> {
    let t = &cfg.text;
    let (h, d) = (t.hidden_size, t.head_dim);
    let (qd, kvd, inter) = (
        t.num_attention_heads * d,
        t.num_key_value_heads * d,
        t.intermediate_size,
    );
    let p = "model.language_model";
    let mut v = vec![spec(
        format!("{p}.embed_tokens.weight"),
        &[t.vocab_size, h],
        std,
        tied,
    )];
    for i in 0..t.num_hidden_layers {
        let l = format!("{p}.layers.{i}");
        let mut lin = |name: &str, out: usize, inp: usize, bias: bool| {
            v.push(spec(format!("{l}.{name}.weight"), &[out, inp], std, true));
            if bias {
                v.push(spec(format!("{l}.{name}.bias"), &[out], std, true));
            }
        };
        lin("self_attn.q_proj", qd, h, t.qkv_bias);
        lin("self_attn.k_proj", kvd, h, t.qkv_bias);
        lin("self_attn.v_proj", kvd, h, t.qkv_bias);
        lin("self_attn.o_proj", h, qd, false);
        lin("mlp.gate_proj", inter, h, false);
        lin("mlp.up_proj", inter, h, false);
        lin("mlp.down_proj", h, inter, false);
        v.push(spec(format!("{l}.input_layernorm.weight"), &[h], std, true));
        v.push(spec(
            format!("{l}.post_attention_layernorm.weight"),
            &[h],
            std,
            true,
        ));
        if t.qk_norm {
            v.push(spec(format!("{l}.self_attn.q_norm.weight"), &[d], std, true));
            v.push(spec(format!("{l}.self_attn.k_norm.weight"), &[d], std, true));
        }
    }
    v.push(spec(format!("{p}.norm.weight"), &[h], std, true));
    if !tied {
        v.push(spec("lm_head.weight".into(), &[t.vocab_size, h], std, true));
    }
    let Some(vc) = &cfg.vision else {
        return v;
    };
    let q = "model.visual";
    let (vd, vi) = (vc.hidden_size, vc.intermediate_size);
    let merged = vd * vc.merge_unit();
    let lin = |v: &mut Vec<Spec>, name: String, out: usize, inp: usize, bias: bool| {
        v.push(spec(format!("{name}.weight"), &[out, inp], std, false));
        if bias {
            v.push(spec(format!("{name}.bias"), &[out], std, false));
        }
    };
    let conv = [
        vd,
        vc.in_channels,
        vc.temporal_patch_size,
        vc.patch_size,
        vc.patch_size,
    ];
    v.push(spec(format!("{q}.patch_embed.proj.weight"), &conv, std, false));
    match cfg.family {
        Family::Qwen3Vl => {
            v.push(spec(format!("{q}.patch_embed.proj.bias"), &[vd], std, false));
            v.push(spec(
                format!("{q}.pos_embed.weight"),
                &[vc.num_position_embeddings, vd],
                std,
                false,
            ));
            for i in 0..vc.depth {
                let b = format!("{q}.blocks.{i}");
                for n in ["norm1", "norm2"] {
                    v.push(spec(format!("{b}.{n}.weight"), &[vd], std, false));
                    v.push(spec(format!("{b}.{n}.bias"), &[vd], std, false));
                }
                lin(&mut v, format!("{b}.attn.qkv"), 3 * vd, vd, true);
                lin(&mut v, format!("{b}.attn.proj"), vd, vd, true);
                lin(&mut v, format!("{b}.mlp.linear_fc1"), vi, vd, true);
                lin(&mut v, format!("{b}.mlp.linear_fc2"), vd, vi, true);
            }
            let mergers = std::iter::once((format!("{q}.merger"), vd)).chain(
                (0..vc.deepstack_visual_indexes.len())
                    .map(|j| (format!("{q}.deepstack_merger_list.{j}"), merged)),
            );
            for (m, norm) in mergers {
                v.push(spec(format!("{m}.norm.weight"), &[norm], std, false));
                v.push(spec(format!("{m}.norm.bias"), &[norm], std, false));
                lin(&mut v, format!("{m}.linear_fc1"), merged, merged, true);
                lin(
                    &mut v,
                    format!("{m}.linear_fc2"),
                    vc.out_hidden_size,
                    merged,
                    true,
                );
            }
        }
        Family::Qwen25Vl => {
            for i in 0..vc.depth {
                let b = format!("{q}.blocks.{i}");
                v.push(spec(format!("{b}.norm1.weight"), &[vd], std, false));
                v.push(spec(format!("{b}.norm2.weight"), &[vd], std, false));
                lin(&mut v, format!("{b}.attn.qkv"), 3 * vd, vd, true);
                lin(&mut v, format!("{b}.attn.proj"), vd, vd, true);
                lin(&mut v, format!("{b}.mlp.gate_proj"), vi, vd, true);
                lin(&mut v, format!("{b}.mlp.up_proj"), vi, vd, true);
                lin(&mut v, format!("{b}.mlp.down_proj"), vd, vi, true);
            }
            v.push(spec(format!("{q}.merger.ln_q.weight"), &[vd], std, false));
            lin(&mut v, format!("{q}.merger.mlp.0"), merged, merged, true);
            lin(
                &mut v,
                format!("{q}.merger.mlp.2"),
                vc.out_hidden_size,
                merged,
                true,
            );
        }
    }
    v
}

/// Where the bench's model comes from: the temporary directory (config, and the weights file with
/// `--weights-file`) or a synthetic checkpoint.
#[derive(Clone, Copy)]
struct WeightSource<'a> {
    dir: &'a Path,
    synthetic: Option<&'a Checkpoint>,
}

/// What [`write_random_model`] wrote.
#[derive(Debug, Clone, Copy)]
struct Written {
    params: u64,
    decode_params: u64,
    bytes: u64,
    ms: f64,
}

/// Copies `config.json` (with the depth override) and `generation_config.json` into `out` and writes
/// `model.safetensors` with seeded random bf16 weights for it.
fn write_random_model(
    config_dir: &Path,
    out: &Path,
    layers: Option<usize>,
    seed: u64,
    to_file: bool,
) -> Result<(ModelConfig, Written, Option<Checkpoint>)> {
    let clock = Instant::now();
    let src = config_dir.join("config.json");
    let text = crate::limits::read_capped(&src, crate::limits::MAX_CONFIG_BYTES)?;
    let mut root: Value = serde_json::from_str(&text).map_err(|e| Error::json(&src, "", e))?;
    if let Some(n) = layers {
        let scope = if root
            .get("text_config")
            .is_some_and(|t| t.get("num_hidden_layers").is_some())
        {
            root.get_mut("text_config")
        } else {
            Some(&mut root)
        };
        if let Some(Value::Object(o)) = scope {
            o.insert("num_hidden_layers".into(), Value::from(n));
        }
    }
    let dst = out.join("config.json");
    let doc = serde_json::to_string_pretty(&root).map_err(|e| Error::json(&src, "", e))?;
    crate::atomic::write_atomic(&dst, doc)?;
    let gen = config_dir.join("generation_config.json");
    if gen.exists() {
        let to = out.join("generation_config.json");
        std::fs::copy(&gen, &to).map_err(|e| Error::io(&to, e))?;
    }
    let cfg = ModelConfig::from_dir(out)?;
    if let Some(v) = &cfg.vision {
        if v.deepstack_visual_indexes.len() > cfg.text.num_hidden_layers {
            return Err(Error::InvalidRequest(format!(
                "bench: {} decoder layers cannot take {} deepstack features",
                cfg.text.num_hidden_layers,
                v.deepstack_visual_indexes.len()
            )));
        }
    }
    let flag = |v: Option<&Value>| {
        v.and_then(|x| x.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
    };
    let tied = flag(Some(&root))
        .or(flag(root.get("text_config")))
        .unwrap_or(false);
    let std_ = root
        .get("text_config")
        .and_then(|t| t.get("initializer_range"))
        .or(root.get("initializer_range"))
        .and_then(Value::as_f64)
        .unwrap_or(0.02) as f32;
    let specs = weight_specs(&cfg, tied, std_);
    let (bytes, synthetic) = if to_file {
        (
            write_safetensors(&out.join("model.safetensors"), &specs, seed)?,
            None,
        )
    } else {
        (0, Some(synthetic_checkpoint(&specs, seed)?))
    };
    let count = |f: &dyn Fn(&Spec) -> bool| -> u64 {
        specs
            .iter()
            .filter(|s| f(s))
            .map(|s| s.shape.iter().product::<usize>() as u64)
            .sum()
    };
    // The embedding table is only gathered during decode unless it doubles as the lm_head.
    let written = Written {
        params: count(&|_| true),
        decode_params: count(&|s| s.decode),
        bytes,
        ms: clock.elapsed().as_secs_f64() * 1e3,
    };
    Ok((cfg, written, synthetic))
}

/// How tensor `ti` of the specs is generated; the same values whether they go to a file or stay
/// synthetic, so both ways of loading give the same model.
fn fill_of(s: &Spec, ti: usize, seed: u64) -> Fill {
    match s.init {
        Init::Zeros => Fill::Zeros,
        Init::Ones => Fill::Ones,
        Init::Random(std) => Fill::Uniform {
            seed: derive(seed, &[ti as u64]),
            scale: std * 3f32.sqrt(),
        },
    }
}

/// The specs as a checkpoint of generated tensors (no file).
fn synthetic_checkpoint(specs: &[Spec], seed: u64) -> Result<Checkpoint> {
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(ti, s)| (s.name.clone(), s.shape.clone(), fill_of(s, ti, seed)));
    Checkpoint::synthetic("recall bench (random weights)", tensors)
}

/// Writes a bf16 safetensors file, streaming: the data are generated in parallel chunks, each from
/// its own seed, so the file depends only on `seed` and the specs.
fn write_safetensors(path: &Path, specs: &[Spec], seed: u64) -> Result<u64> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for s in specs {
        let n = s.shape.iter().product::<usize>() * 2;
        header.insert(
            s.name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": s.shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"format": "pt", "source": "recall bench (random)"}),
    );
    let mut head = serde_json::to_string(&Value::Object(header))
        .map_err(|e| Error::InvalidRequest(format!("safetensors header: {e}")))?
        .into_bytes();
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, file);
    let io = |e| Error::io(path, e);
    w.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&head).map_err(io)?;
    const CHUNK: usize = 1 << 16; // elements per seeded chunk
    const BATCH: usize = 1 << 26; // elements generated per write
    let mut buf = Vec::new();
    for (ti, s) in specs.iter().enumerate() {
        let n: usize = s.shape.iter().product();
        let mut done = 0;
        while done < n {
            let len = (n - done).min(BATCH);
            buf.resize(len * 2, 0u8);
            let fill = fill_of(s, ti, seed);
            buf.par_chunks_mut(CHUNK * 2).enumerate().for_each(|(ci, out)| {
                let first = (done + ci * CHUNK) as u64;
                for (j, b) in out.chunks_exact_mut(2).enumerate() {
                    b.copy_from_slice(&half::bf16::from_f32(fill.value(first + j as u64)).to_le_bytes());
                }
            });
            w.write_all(&buf).map_err(io)?;
            done += len;
        }
    }
    w.flush().map_err(io)?;
    Ok((8 + head.len() + offset) as u64)
}

// ---------------------------------------------------------------------------------------------------
// FLOP and byte counts.

/// Decoder GEMM FLOPs per token (q, k, v, o, gate, up, down in every layer).
fn decoder_gemm_flops(t: &TextConfig) -> f64 {
    let (h, d) = (t.hidden_size as f64, t.head_dim as f64);
    let qd = t.num_attention_heads as f64 * d;
    let kvd = t.num_key_value_heads as f64 * d;
    let i = t.intermediate_size as f64;
    2.0 * (h * qd + 2.0 * h * kvd + qd * h + 3.0 * h * i) * t.num_hidden_layers as f64
}

/// Causal attention FLOPs (QKᵀ and PV) of `n` new tokens after `start` cached ones.
fn attention_flops(t: &TextConfig, start: usize, n: usize) -> f64 {
    let qd = (t.num_attention_heads * t.head_dim) as f64;
    let (s, n) = (start as f64, n as f64);
    let keys = n * s + n * (n + 1.0) / 2.0;
    4.0 * qd * keys * t.num_hidden_layers as f64
}

/// FLOPs of a prefill of `n` tokens after `start` cached ones, with logits for one row.
fn prefill_flops(t: &TextConfig, start: usize, n: usize) -> f64 {
    decoder_gemm_flops(t) * n as f64
        + attention_flops(t, start, n)
        + 2.0 * (t.hidden_size * t.vocab_size) as f64
}

/// FLOPs of the vision tower on one image (GEMMs, attention, mergers). Qwen2.5-VL's windowed blocks
/// are counted with windows of `window_size / patch_size` patches a side.
fn vision_flops(v: &VisionConfig, family: Family, grid: GridThw) -> f64 {
    let [t, h, w] = grid;
    let n = (t * h * w) as f64;
    let (d, i) = (v.hidden_size as f64, v.intermediate_size as f64);
    let m = (v.hidden_size * v.merge_unit()) as f64;
    let frame = (h * w) as f64;
    let full_attn = 4.0 * d * t as f64 * frame * frame;
    let mut f = 2.0 * n * v.patch_dim() as f64 * d;
    let mlp = if family == Family::Qwen3Vl { 2.0 } else { 3.0 };
    for b in 0..v.depth {
        f += 2.0 * n * (4.0 * d * d + mlp * d * i);
        f += if family == Family::Qwen25Vl && !v.fullatt_block_indexes.contains(&b) {
            let side = (v.window_size / v.patch_size.max(1)).max(1) as f64;
            4.0 * d * n * (side * side).min(frame)
        } else {
            full_attn
        };
    }
    let mergers = 1 + if family == Family::Qwen3Vl {
        v.deepstack_visual_indexes.len()
    } else {
        0
    };
    let tokens = n / v.merge_unit() as f64;
    f + mergers as f64 * 2.0 * tokens * (m * m + m * v.out_hidden_size as f64)
}

/// K/V bytes of one token of context, all layers.
fn kv_bytes_per_token(t: &TextConfig, elem: usize) -> f64 {
    (2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * elem) as f64
}

// ---------------------------------------------------------------------------------------------------
// Prompts.

/// Token ids and layouts of the synthetic GUI-Owl-shaped prompts.
struct Layouts {
    seed: u64,
    /// Text ids are drawn from `0..vocab_hi` (below every special id).
    vocab_hi: u32,
    vision_start: u32,
    vision_end: u32,
    grid: GridThw,
    history: usize,
    response: usize,
    system: usize,
    step: usize,
}

// Labels of the text runs (seeds).
const SYSTEM: u64 = 1;
const FIRST_HEADER: u64 = 2;
const FOLD: u64 = 3;
const RESPONSE: u64 = 4;
const CONT_HEADER: u64 = 5;
const OPEN_USER: u64 = 6;
const OPEN_ASSISTANT: u64 = 7;
const CLOSE: u64 = 8;
const NO_PREVIOUS: u64 = 9;

impl Layouts {
    fn new(cfg: &ModelConfig, args: &BenchArgs, grid: GridThw) -> Self {
        let vocab = cfg.text.vocab_size as u32;
        let specials = [
            cfg.image_token_id,
            cfg.video_token_id,
            cfg.vision_start_token_id,
            cfg.vision_end_token_id,
        ];
        let mut hi = specials
            .iter()
            .flatten()
            .copied()
            .chain(cfg.eos_token_ids.iter().copied())
            .fold(vocab, u32::min);
        if hi < 16 {
            hi = vocab;
        }
        Layouts {
            seed: args.seed,
            vocab_hi: hi,
            vision_start: cfg.vision_start_token_id.unwrap_or(hi.saturating_sub(2)),
            vision_end: cfg.vision_end_token_id.unwrap_or(hi.saturating_sub(1)),
            grid,
            history: args.history,
            response: args.response_tokens,
            system: args.system_tokens,
            step: args.step_tokens,
        }
    }

    fn ids(&self, label: u64, index: u64, n: usize) -> Vec<u32> {
        let mut r = Rng::new(derive(self.seed, &[0x7e47, label, index]));
        (0..n).map(|_| r.below(self.vocab_hi as u64) as u32).collect()
    }

    /// GUI-Owl's rolling layout with CausalCache's gap-fold for `allocation` (ascending steps):
    /// system; user [FIRST(fold(1..s1-1)), x_s1]; per later s_i: assistant r, user [CONT(gap fold), x];
    /// assistant r_sk; user [CONT(tail fold), x_t]; assistant header. `t` is the current step.
    fn step_prompt(&self, allocation: &[usize], t: usize) -> Vec<LayoutRun> {
        let mut runs = Vec::new();
        let mut text = Vec::new();
        text.extend(self.ids(OPEN_USER, 0, 3));
        text.extend(self.ids(SYSTEM, 0, self.system));
        text.extend(self.ids(CLOSE, 0, 2));
        text.extend(self.ids(OPEN_USER, 1, 3));
        text.extend(self.ids(FIRST_HEADER, 0, 48));
        let fold = |text: &mut Vec<u32>, lo: usize, hi: usize| {
            for s in lo..hi {
                text.extend(self.ids(FOLD, s as u64, self.step));
            }
        };
        let first = allocation.first().copied().unwrap_or(t);
        if first > 1 {
            fold(&mut text, 1, first);
        } else {
            text.extend(self.ids(NO_PREVIOUS, 0, 4));
        }
        let mut prev: Option<usize> = None;
        for &s in allocation.iter().chain(std::iter::once(&t)) {
            if let Some(p) = prev {
                text.extend(self.ids(OPEN_ASSISTANT, 0, 3));
                text.extend(self.ids(RESPONSE, p as u64, self.response));
                text.extend(self.ids(CLOSE, 0, 2));
                text.extend(self.ids(OPEN_USER, 0, 3));
                if s > p + 1 {
                    text.extend(self.ids(CONT_HEADER, 0, 6));
                    fold(&mut text, p + 1, s);
                }
            }
            text.push(self.vision_start);
            runs.push(LayoutRun::Text(std::mem::take(&mut text)));
            runs.push(LayoutRun::Image {
                step: s,
                grid: self.grid,
            });
            text.push(self.vision_end);
            prev = Some(s);
        }
        text.extend(self.ids(CLOSE, 0, 2));
        text.extend(self.ids(OPEN_ASSISTANT, 0, 3));
        runs.push(LayoutRun::Text(text));
        runs
    }
}

fn image_hash(seed: u64, step: usize) -> ImageHash {
    ImageHash(derive(seed, &[0x1a6e, step as u64]))
}

/// The engine prompt of a layout; `embeds` fills `Embeds` runs.
fn to_prompt(l: &Layouts, runs: &[LayoutRun], hidden: usize) -> Prompt {
    let segments = runs
        .iter()
        .map(|r| match r {
            LayoutRun::Text(ids) => Segment::Text(ids.clone()),
            LayoutRun::Image { step, grid } => Segment::Image {
                hash: image_hash(l.seed, *step),
                grid: *grid,
                role: if *step <= l.history {
                    ImageRole::History
                } else {
                    ImageRole::Current
                },
            },
            LayoutRun::Embeds(rows) => {
                let mut r = Rng::new(derive(l.seed, &[0x5c0e, *rows as u64]));
                Segment::Embeds {
                    hash: derive(l.seed, &[0x5c0e]),
                    rows: *rows,
                    data: (0..rows * hidden).map(|_| r.sym() * 0.035).collect(),
                }
            }
        })
        .collect();
    Prompt { segments }
}

fn layout_tokens(runs: &[LayoutRun], merge: usize) -> usize {
    runs.iter()
        .map(|r| match r {
            LayoutRun::Text(ids) => ids.len(),
            LayoutRun::Image { grid: [t, h, w], .. } => t * h * w / (merge * merge),
            LayoutRun::Embeds(n) => *n,
        })
        .sum()
}

/// Random pixel values (uniform in [-1, 1), as normalised pixels) of one screenshot.
fn pixels(v: &VisionConfig, grid: GridThw, seed: u64, step: usize) -> PixelValues {
    let n: usize = grid.iter().product();
    let pd = v.patch_dim();
    let mut data = vec![0f32; n * pd];
    data.par_chunks_mut(pd * 64).enumerate().for_each(|(ci, out)| {
        let mut r = Rng::new(derive(seed, &[0x9e15, step as u64, ci as u64]));
        out.iter_mut().for_each(|x| *x = r.sym());
    });
    PixelValues {
        data,
        grid_thw: grid,
        patch_dim: pd,
        resized: image::RgbImage::new(1, 1),
    }
}

// ---------------------------------------------------------------------------------------------------
// Measurement.

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// One generation driven step by step.
#[derive(Debug, Clone)]
struct Gen {
    tokens: Vec<u32>,
    /// Until the first token is decided (the last prefill chunk ends with an argmax, which syncs).
    prefill_ms: f64,
    total_ms: f64,
    decode_steps: usize,
    reused: usize,
    accepted: usize,
}

impl Gen {
    /// Time after the first token per decode step (0 without decode steps).
    fn decode_ms_per_token(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            (self.total_ms - self.prefill_ms) / self.decode_steps as f64
        }
    }
}

struct Ctx<'a, B: Backend> {
    be: &'a B,
    sync: &'a dyn Fn() -> Result<()>,
    model: &'a QwenVl<B>,
    args: &'a BenchArgs,
    layouts: Layouts,
    images: Vec<PixelValues>, // index = step - 1; the last is the current screenshot
    merge: usize,
    pool_blocks: usize,
}

impl<B: Backend> Ctx<'_, B> {
    fn engine(&self, prefix_caching: bool) -> Result<Engine<'_, B>> {
        Engine::new(
            self.be,
            self.model,
            None,
            EngineConfig {
                block_size: self.args.block_size,
                num_blocks: self.pool_blocks,
                kv_cache_bytes: None,
                memory_utilization: None,
                chunk_size: self.args.chunk_size,
                max_batch_tokens: self.args.max_batch_tokens,
                vision_cache_bytes: usize::MAX / 2,
                prefix_caching,
            },
        )
    }

    fn add_images(&self, engine: &mut Engine<'_, B>, steps: impl IntoIterator<Item = usize>) -> Result<()> {
        for s in steps {
            engine.add_image(image_hash(self.args.seed, s), &self.images[s - 1])?;
        }
        (self.sync)()
    }

    fn prompt(&self, runs: &[LayoutRun]) -> Prompt {
        to_prompt(&self.layouts, runs, self.model.config.text.hidden_size)
    }

    /// Greedy generation of exactly `max_tokens` tokens (no end token), timed per step.
    fn generate(
        &self,
        engine: &mut Engine<'_, B>,
        prompt: &Prompt,
        max_tokens: usize,
        draft: Vec<u32>,
    ) -> Result<Gen> {
        self.generate_with(engine, prompt, max_tokens, draft, &mut |_| Ok(()))
    }

    /// Tokens of a prompt.
    fn prompt_len(&self, prompt: &Prompt) -> Result<usize> {
        let pad = self.model.config.image_token_id.unwrap_or(0);
        Ok(prompt.flatten(pad, self.merge)?.ids.len())
    }

    /// Engine steps of a lone request's prefill of `tokens` tokens: chunks of min(chunk, batch).
    fn prefill_steps(&self, tokens: usize) -> usize {
        let per = self.args.chunk_size.min(self.args.max_batch_tokens).max(1);
        tokens.div_ceil(per)
    }

    /// [`generate`](Self::generate), calling `after_step(n)` after the `n`-th engine step (from 1).
    fn generate_with(
        &self,
        engine: &mut Engine<'_, B>,
        prompt: &Prompt,
        max_tokens: usize,
        draft: Vec<u32>,
        after_step: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Gen> {
        let prompt_len = self.prompt_len(prompt)?;
        let draft_len = draft.len().min(max_tokens);
        let params = GenerateParams {
            max_tokens,
            eos_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        };
        let opts = RequestOptions {
            draft,
            ..RequestOptions::default()
        };
        let clock = Instant::now();
        let id = engine.add_request_with(prompt, Task::Generate(params), opts)?;
        let mut ends = Vec::new();
        let out = loop {
            let done = engine.step()?;
            ends.push(ms(clock));
            after_step(ends.len())?;
            if let Some(o) = done.into_iter().find(|o| o.id == id) {
                break o;
            }
            if !engine.has_work() {
                return Err(Error::InvalidRequest(format!("bench request {id} vanished")));
            }
        };
        (self.sync)()?;
        let total_ms = ms(clock);
        let tokens = match out.outcome {
            Outcome::Generation(g) => g.tokens,
            Outcome::Failed(e) => return Err(Error::InvalidRequest(format!("bench generation failed: {e}"))),
            other => {
                return Err(Error::InvalidRequest(format!(
                    "bench: unexpected outcome {other:?}"
                )))
            }
        };
        // A lone request is scheduled in chunks of min(chunk, batch) tokens until prompt and draft are
        // computed, then one token per step.
        let prefill_steps = self
            .prefill_steps((prompt_len + draft_len).saturating_sub(out.reused_tokens))
            .clamp(1, ends.len());
        Ok(Gen {
            tokens,
            prefill_ms: ends[prefill_steps - 1],
            total_ms,
            decode_steps: ends.len() - prefill_steps,
            reused: out.reused_tokens,
            accepted: out.accepted_draft,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Draft {
    None,
    Proposal,
    Oracle,
}

impl Draft {
    fn name(self) -> &'static str {
        match self {
            Draft::None => "none",
            Draft::Proposal => "proposal",
            Draft::Oracle => "oracle",
        }
    }
}

/// Timings and tokens of one run of a two-pass step.
struct StepRun {
    vision_ms: f64,
    selector_ms: f64,
    pass1: Gen,
    pass2: Gen,
}

#[allow(clippy::too_many_arguments)]
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
    let clock = Instant::now();
    let model = match source.synthetic {
        Some(ckpt) => QwenVl::from_checkpoint(be, cfg.clone(), ckpt)?,
        None => QwenVl::load(be, source.dir)?,
    };
    sync()?;
    let load_ms = ms(clock);
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
    let images: Vec<PixelValues> = (1..=t).map(|s| pixels(&vision, grid, args.seed, s)).collect();

    // The allocation: the selector's (random scorer) if it differs from Recent-B, else a forced swap.
    let recent: Vec<usize> = (t - args.budget..t).collect();
    let (_, chosen) = run_selector(args, t)?;
    let selector_chose = chosen != recent;
    let allocation = if selector_chose {
        chosen
    } else {
        let mut a = recent.clone();
        a[0] = 1;
        a.sort_unstable();
        a
    };
    let pass1_layout = layouts.step_prompt(&recent, t);
    let pass2_layout = layouts.step_prompt(&allocation, t);
    let prev_layout = layouts.step_prompt(&(t - 1 - args.budget..t - 1).collect::<Vec<_>>(), t - 1);
    let mut scopemem_layout = vec![LayoutRun::Embeds(SCOPEMEM_ROWS)];
    scopemem_layout.extend(pass1_layout.iter().cloned());
    let append_layout = appended_prefix(&pass1_layout);
    let (n1, n2, n3) = (
        layout_tokens(&pass1_layout, merge),
        layout_tokens(&pass2_layout, merge),
        layout_tokens(&scopemem_layout, merge),
    );
    let r = args.response_tokens;
    // Room for every prompt of a step (pass 1, pass 2 with its draft, the previous step) at once.
    let longest = n1.max(n2).max(n3) + 2 * r + args.block_size;
    let pool_blocks = (3 * longest).div_ceil(args.block_size) + 8;
    let ctx = Ctx {
        be,
        sync,
        model: &model,
        args,
        layouts,
        images,
        merge,
        pool_blocks,
    };
    let text = &model.config.text;
    let reps = args.repeats;
    be.set_step_replay(args.step_replay);

    // Warm-up (kernels, GEMM plans, allocator): one short generation of the pass-1 prompt.
    {
        let mut e = ctx.engine(false)?;
        ctx.add_images(&mut e, 1..=t)?;
        ctx.generate(&mut e, &ctx.prompt(&pass1_layout), 2, Vec::new())?;
    }
    let prompt1 = ctx.prompt(&pass1_layout);
    let prompt2 = ctx.prompt(&pass2_layout);
    let prompt_sm = ctx.prompt(&scopemem_layout);
    let prompt_sm_append = ctx.prompt(&append_layout);
    let base = baseline(&ctx, [&prompt1, &prompt2, &prompt_sm, &prompt_sm_append])?;
    let steps_before = StepCounts::from(be.step_stats());

    // Vision tower on one screenshot.
    let x = be.upload(
        &ctx.images[t - 1].data,
        ctx.images[t - 1].num_patches(),
        vision.patch_dim(),
    )?;
    let mut times = Vec::new();
    for _ in 0..reps {
        sync()?;
        let c = Instant::now();
        let out = tower.forward(be, &x, &[grid])?;
        sync()?;
        times.push(ms(c));
        drop(out);
    }
    drop(x);
    let v_flops = vision_flops(&vision, model.config.family, grid);
    let v_ms = median(times);
    let vision_row = VisionRow {
        ms: v_ms,
        patches: grid.iter().product(),
        tflop: v_flops / 1e12,
        tflops: v_flops / 1e9 / v_ms.max(1e-9),
        floor_ms: v_flops / 1e9 / args.peak_tflops,
    };

    // Prefills of the pass-1 prompt with 5, 1 and 0 screenshots through the tower.
    let mut prefill = Vec::new();
    let shown: Vec<usize> = recent.iter().copied().chain(std::iter::once(t)).collect();
    for (name, cached) in [
        ("from scratch", Vec::new()),
        ("vision warm", recent.clone()),
        ("text only", (1..=t).collect::<Vec<_>>()),
    ] {
        let runs = (0..reps)
            .map(|_| timed_prefill(&ctx, &prompt1, &cached, &shown))
            .collect::<Result<Vec<_>>>()?;
        let times = runs.iter().map(|r| r.0).collect();
        let vision_images = args.budget + 1
            - cached.iter().filter(|s| **s != t && recent.contains(s)).count()
            - usize::from(cached.contains(&t));
        let flops = prefill_flops(text, 0, n1) + vision_images as f64 * v_flops;
        let ms_ = median(times);
        prefill.push(PrefillRow {
            name: name.to_string(),
            vision_images,
            tokens: n1,
            ms: ms_,
            tflop: flops / 1e12,
            tflops: flops / 1e9 / ms_.max(1e-9),
            floor_ms: flops / 1e9 / args.peak_tflops,
            identical: runs.iter().all(|r| r.1 == base.pass1_tokens),
            compared_with: format!("baseline pass 1 ({r} tokens)"),
        });
    }

    // CausalCache two-pass step variants.
    let prev_prompt = ctx.prompt(&prev_layout);
    let step = |reuse: bool, draft: Draft| -> Result<StepRun> {
        let mut e = ctx.engine(reuse)?;
        // Earlier steps: history screenshots encoded, the previous step's prompt computed.
        ctx.add_images(&mut e, 1..t)?;
        ctx.generate(&mut e, &prev_prompt, 1, Vec::new())?;
        let c = Instant::now();
        e.add_image(image_hash(args.seed, t), &ctx.images[t - 1])?;
        sync()?;
        let vision_ms = ms(c);
        let pass1 = ctx.generate(&mut e, &prompt1, r, Vec::new())?;
        let (selector_ms, alloc) = run_selector(args, t)?;
        debug_assert_eq!(alloc == recent, !selector_chose);
        let draft = match draft {
            Draft::None => Vec::new(),
            Draft::Proposal => pass1.tokens.clone(),
            Draft::Oracle => base.pass2_tokens.clone(),
        };
        let pass2 = ctx.generate(&mut e, &prompt2, r, draft)?;
        Ok(StepRun {
            vision_ms,
            selector_ms,
            pass1,
            pass2,
        })
    };
    let variants = [
        ("plain", false, Draft::None),
        ("prefix reuse", true, Draft::None),
        ("draft", false, Draft::Proposal),
        ("reuse + draft", true, Draft::Proposal),
        ("reuse + oracle draft", true, Draft::Oracle),
    ];
    let mut causal = Vec::new();
    let quick_skip =
        |name: &str| args.quick && (name == "prefix reuse" || name == "draft" || name == "scopemem");
    let causal_base = Expected {
        pass1: &base.pass1_tokens,
        pass2: &base.pass2_tokens,
        compared_with: "baseline pass 1 + pass 2",
    };
    for (name, reuse, draft) in variants.into_iter().filter(|v| !quick_skip(v.0)) {
        let runs = (0..reps)
            .map(|_| step(reuse, draft))
            .collect::<Result<Vec<_>>>()?;
        causal.push(step_row(name, reuse, draft, &runs, &causal_base));
    }

    // ScopeMem-shaped step: pass 1 plain, pass 2 with a 16-row embedding prefix.
    let mut scopemem = Vec::new();
    let sm_base = Expected {
        pass1: &base.pass1_tokens,
        pass2: &base.scopemem_tokens,
        compared_with: "baseline pass 1 + ScopeMem pass 2",
    };
    let sm_append_base = Expected {
        pass1: &base.pass1_tokens,
        pass2: &base.scopemem_append_tokens,
        compared_with: "baseline pass 1 + ScopeMem pass 2 (appended prefix)",
    };
    for (name, reuse, append) in [
        ("scopemem", false, false),
        ("scopemem + reuse", true, false),
        ("scopemem append + reuse", true, true),
    ]
    .into_iter()
    .filter(|v| !quick_skip(v.0))
    {
        let (prompt_sm, expected) = if append {
            (&prompt_sm_append, &sm_append_base)
        } else {
            (&prompt_sm, &sm_base)
        };
        let runs = (0..reps)
            .map(|_| -> Result<StepRun> {
                let mut e = ctx.engine(reuse)?;
                ctx.add_images(&mut e, 1..t)?;
                ctx.generate(&mut e, &prev_prompt, 1, Vec::new())?;
                let c = Instant::now();
                e.add_image(image_hash(args.seed, t), &ctx.images[t - 1])?;
                sync()?;
                let vision_ms = ms(c);
                let pass1 = ctx.generate(&mut e, &prompt1, r, Vec::new())?;
                let pass2 = ctx.generate(&mut e, prompt_sm, r, Vec::new())?;
                Ok(StepRun {
                    vision_ms,
                    selector_ms: 0.0,
                    pass1,
                    pass2,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        scopemem.push(step_row(name, reuse, Draft::None, &runs, expected));
    }

    // Decode: pass 1 of the plain variant.
    let plain = &causal[0];
    let decode_ms = plain.pass1_decode_ms_per_token;
    let plain_pass1 = plain.row.pass1_tokens.clone();
    let context = n1 + r / 2;
    let bytes = written.decode_params as f64 * 2.0 + context as f64 * kv_bytes_per_token(text, kv_elem_bytes);
    let decode = DecodeRow {
        ms_per_token: decode_ms,
        tokens: r - 1,
        context,
        gb_per_token: bytes / 1e9,
        gbs: bytes / 1e6 / decode_ms.max(1e-9),
        floor_ms: bytes / 1e6 / args.peak_gbs,
    };

    let steps = StepCounts::from(be.step_stats()).since(steps_before);
    let replay = replay_report(args, &base, &plain_pass1, decode_ms, steps);
    let breakdown = if args.breakdown {
        Some(breakdown_run(&ctx, &prompt1, &base.pass1_tokens)?)
    } else {
        None
    };

    let causalcache: Vec<StepRow> = causal.into_iter().map(|r| r.row).collect();
    let scopemem: Vec<StepRow> = scopemem.into_iter().map(|r| r.row).collect();
    let all_identical = prefill.iter().all(|r| r.identical)
        && causalcache.iter().chain(&scopemem).all(|r| r.identical)
        && replay.identical != Some(false)
        && breakdown.as_ref().is_none_or(|b| b.identical);
    Ok(BenchReport {
        backend: be.name().to_string(),
        device,
        config_dir: args.config_dir.display().to_string(),
        family: format!("{:?}", model.config.family),
        layers: text.num_hidden_layers,
        seed: args.seed,
        repeats: reps,
        chunk_size: args.chunk_size,
        peak_tflops: args.peak_tflops,
        peak_gbs: args.peak_gbs,
        shapes: Shapes {
            budget: args.budget,
            history: args.history,
            grid,
            image_tokens,
            response_tokens: r,
            pass1_tokens: n1,
            pass2_tokens: n2,
            scopemem_tokens: n3,
            recent,
            allocation,
            selector_chose,
            pass1_layout,
        },
        weights: WeightsInfo {
            params: written.params,
            decode_params: written.decode_params,
            file_bytes: written.bytes,
            write_ms: written.ms,
            load_ms,
        },
        vision: vision_row,
        prefill,
        decode,
        causalcache,
        scopemem,
        replay,
        baseline: base,
        breakdown,
        all_identical,
        wall_s: 0.0,
    })
}

/// A step row and the plain path's pass-1 decode rate.
struct RowAndDecode {
    row: StepRow,
    pass1_decode_ms_per_token: f64,
}

/// The baseline outputs a step row's passes must equal.
struct Expected<'a> {
    pass1: &'a [u32],
    pass2: &'a [u32],
    compared_with: &'static str,
}

impl Expected<'_> {
    /// Every run's both passes equal the baseline's, token for token.
    fn matched_by(&self, runs: &[StepRun]) -> bool {
        runs.iter()
            .all(|r| r.pass1.tokens == self.pass1 && r.pass2.tokens == self.pass2)
    }
}

fn step_row(
    name: &str,
    reuse: bool,
    draft: Draft,
    runs: &[StepRun],
    expected: &Expected<'_>,
) -> RowAndDecode {
    let m = |f: &dyn Fn(&StepRun) -> f64| median(runs.iter().map(f).collect());
    let first = &runs[0];
    let pass1_ms = m(&|r| r.pass1.total_ms);
    let pass2_ms = m(&|r| r.pass2.total_ms);
    let decode = m(&|r| r.pass1.decode_ms_per_token());
    RowAndDecode {
        row: StepRow {
            name: name.to_string(),
            prefix_reuse: reuse,
            draft: draft.name().to_string(),
            vision_ms: m(&|r| r.vision_ms),
            pass1_ms,
            pass1_prefill_ms: m(&|r| r.pass1.prefill_ms),
            selector_ms: m(&|r| r.selector_ms),
            pass2_ms,
            pass2_prefill_ms: m(&|r| r.pass2.prefill_ms),
            total_ms: m(&|r| r.vision_ms + r.pass1.total_ms + r.selector_ms + r.pass2.total_ms),
            pass2_over_pass1: ratio(pass2_ms, pass1_ms),
            reused_pass1: first.pass1.reused,
            reused_pass2: first.pass2.reused,
            accepted_draft: first.pass2.accepted,
            identical: expected.matched_by(runs),
            compared_with: expected.compared_with.to_string(),
            pass1_tokens: first.pass1.tokens.clone(),
            pass2_tokens: first.pass2.tokens.clone(),
        },
        pass1_decode_ms_per_token: decode,
    }
}

/// How [`Baseline`] is computed.
const BASELINE_METHOD: &str =
    "plain decoding on a fresh engine, every screenshot encoded first: no prefix cache, no draft, step replay off";
/// What the step-replay flag compares with.
const REPLAY_COMPARED_WITH: &str = "baseline pass 1, replay off";

/// `prompt` on a fresh engine without prefix reuse or draft, every screenshot encoded first,
/// `response_tokens` tokens.
fn plain_run<B: Backend>(ctx: &Ctx<'_, B>, prompt: &Prompt) -> Result<Gen> {
    let mut e = ctx.engine(false)?;
    ctx.add_images(&mut e, 1..=ctx.args.history + 1)?;
    ctx.generate(&mut e, prompt, ctx.args.response_tokens, Vec::new())
}

/// The baseline of the pass-1, pass-2 and ScopeMem prompts (prepended, then appended prefix), step
/// replay off whatever `--step-replay` says (its setting is restored after).
fn baseline<B: Backend>(ctx: &Ctx<'_, B>, prompts: [&Prompt; 4]) -> Result<Baseline> {
    ctx.be.set_step_replay(false);
    let runs: Result<Vec<Gen>> = prompts.iter().map(|p| plain_run(ctx, p)).collect();
    ctx.be.set_step_replay(ctx.args.step_replay);
    let [p1, p2, sm, sm_append]: [Gen; 4] = runs?
        .try_into()
        .map_err(|_| Error::InvalidRequest("bench baseline: four runs expected".into()))?;
    Ok(Baseline {
        method: BASELINE_METHOD.to_string(),
        pass1_ms_per_token: p1.decode_ms_per_token(),
        pass1_tokens: p1.tokens,
        pass2_tokens: p2.tokens,
        scopemem_tokens: sm.tokens,
        scopemem_append_tokens: sm_append.tokens,
    })
}

/// Tokens of the assistant turn's opening (`<|im_start|>assistant\n`) that an appended prefix goes
/// before.
const ASSISTANT_TURN_TOKENS: usize = 3;

/// The pass-1 layout with the ScopeMem prefix right before the assistant turn (the last
/// [`ASSISTANT_TURN_TOKENS`] tokens), as `agent::scopemem::with_prefix` places it with
/// `Placement::Append`: everything before it is the pass-1 prompt, so its K/V can be reused.
fn appended_prefix(pass1: &[LayoutRun]) -> Vec<LayoutRun> {
    let mut out = pass1.to_vec();
    if let Some(LayoutRun::Text(ids)) = out.last_mut() {
        let cut = ids.len().saturating_sub(ASSISTANT_TURN_TOKENS);
        let tail = ids.split_off(cut);
        if ids.is_empty() {
            out.pop();
        }
        out.push(LayoutRun::Embeds(SCOPEMEM_ROWS));
        out.push(LayoutRun::Text(tail));
    } else {
        out.push(LayoutRun::Embeds(SCOPEMEM_ROWS));
    }
    out
}

/// One prefill row's run on a fresh engine with prefix caching and the `cached` screenshots already
/// encoded: the screenshots in `shown` registered (the uncached ones go through the tower) and the
/// prompt prefilled, timed to the first token; the rest of the response is generated untimed, for
/// the identical check. Returns (ms to the first token, the whole output).
fn timed_prefill<B: Backend>(
    ctx: &Ctx<'_, B>,
    prompt: &Prompt,
    cached: &[usize],
    shown: &[usize],
) -> Result<(f64, Vec<u32>)> {
    let mut e = ctx.engine(true)?;
    ctx.add_images(&mut e, cached.iter().copied())?;
    let prefill_steps = ctx.prefill_steps(ctx.prompt_len(prompt)?);
    let c = Instant::now();
    for &s in shown {
        e.add_image(image_hash(ctx.args.seed, s), &ctx.images[s - 1])?;
    }
    let mut first = None;
    // The last prefill step ends with the first token's argmax read back: the device is synchronised.
    let g = ctx.generate_with(
        &mut e,
        prompt,
        ctx.args.response_tokens,
        Vec::new(),
        &mut |step| {
            if step == prefill_steps {
                first = Some(ms(c));
            }
            Ok(())
        },
    )?;
    let first = first.ok_or_else(|| {
        Error::InvalidRequest(format!(
            "bench prefill: the generation ended before its {prefill_steps} prefill steps"
        ))
    })?;
    Ok((first, g.tokens))
}

/// `--step-replay`: the backend's step counters over the measurements and, when replay is on, the
/// plain variant's pass 1 (replay on) against the baseline's (replay off) and both decode rates.
fn replay_report(
    args: &BenchArgs,
    base: &Baseline,
    plain_pass1: &[u32],
    ms_per_token: f64,
    steps: StepCounts,
) -> ReplayReport {
    let on = args.step_replay;
    ReplayReport {
        enabled: on,
        ms_per_token,
        off_ms_per_token: on.then_some(base.pass1_ms_per_token),
        identical: on.then(|| plain_pass1 == base.pass1_tokens),
        steps,
    }
}

/// `--breakdown`: the plain pass 1 once more with profiling on, the history screenshots cached.
/// Phase 1 (prefill): the current screenshot through the tower and the prompt to its first token;
/// phase 2 (decode): the remaining tokens. Each phase ends with a sync before its profile is taken.
fn breakdown_run<B: Backend>(ctx: &Ctx<'_, B>, prompt: &Prompt, baseline: &[u32]) -> Result<Breakdown> {
    let mut e = ctx.engine(false)?;
    ctx.add_images(&mut e, 1..=ctx.args.history)?;
    let prefill_tokens = ctx.prompt_len(prompt)?;
    ctx.be.set_profiling(true);
    let run = profiled_phases(ctx, &mut e, prompt, ctx.prefill_steps(prefill_tokens).max(1));
    ctx.be.set_profiling(false);
    let (prefill, decode, gen) = run?;
    Ok(Breakdown {
        prefill_wall_s: prefill.0,
        prefill: prefill.1,
        decode_wall_s: decode.0,
        decode: decode.1,
        prefill_tokens,
        decode_steps: gen.decode_steps,
        identical: gen.tokens == baseline,
        compared_with: "baseline pass 1".to_string(),
    })
}

/// A phase's wall seconds and op times.
type Phase = (f64, Vec<OpRow>);

/// The profiled generation of [`breakdown_run`], split after `prefill_steps` engine steps.
fn profiled_phases<B: Backend>(
    ctx: &Ctx<'_, B>,
    e: &mut Engine<'_, B>,
    prompt: &Prompt,
    prefill_steps: usize,
) -> Result<(Phase, Phase, Gen)> {
    // Synchronised wall time since `start`, then the profile (which may wait for device events).
    let end_phase = |start: Instant| -> Result<Phase> {
        (ctx.sync)()?;
        let wall = start.elapsed().as_secs_f64();
        let ops = ctx.be.take_profile()?.into_iter().map(OpRow::from).collect();
        Ok((wall, ops))
    };
    end_phase(Instant::now())?; // drops anything from before the phase
    let t = ctx.args.history + 1;
    let clock = Instant::now();
    e.add_image(image_hash(ctx.args.seed, t), &ctx.images[t - 1])?;
    let mut prefill = None;
    let mut decode_start = clock;
    let gen = ctx.generate_with(e, prompt, ctx.args.response_tokens, Vec::new(), &mut |step| {
        if step == prefill_steps {
            prefill = Some(end_phase(clock)?);
            decode_start = Instant::now();
        }
        Ok(())
    })?;
    let decode = end_phase(decode_start)?;
    let prefill = prefill.ok_or_else(|| {
        Error::InvalidRequest(format!(
            "bench breakdown: the generation ended before its {prefill_steps} prefill steps"
        ))
    })?;
    Ok((prefill, decode, gen))
}

/// The selector (reference-mode beam search over a random 64-unit scorer) on a synthetic decision
/// with `t - 1` completed steps; returns its time and allocation.
fn run_selector(args: &BenchArgs, t: usize) -> Result<(f64, Vec<usize>)> {
    let h = 64;
    let mut r = Rng::new(derive(args.seed, &[0x5e1e]));
    let mut vals = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| r.sym() * s).collect() };
    let params = ScorerParams {
        feature_mean: vec![0.0; NUM_FEATURES],
        feature_std: vec![1.0; NUM_FEATURES],
        fc1_weight: vals(h * NUM_FEATURES, 0.3),
        fc1_bias: vals(h, 0.1),
        fc2_weight: vals(h * h, 0.2),
        fc2_bias: vals(h, 0.1),
        fc3_weight: vals(h, 0.2),
        fc3_bias: 0.0,
    };
    let scorer = MarginalScorer::from_params(&params)?;
    let mut r = Rng::new(derive(args.seed, &[0xe7e7]));
    let buckets = [
        ActionBucket::Click,
        ActionBucket::Type,
        ActionBucket::Key,
        ActionBucket::Scroll,
        ActionBucket::Other,
    ];
    let ctx = DecisionContext {
        t,
        reference_point: Some((500.0, 500.0)),
        events: (1..t)
            .map(|step| EventInfo {
                step,
                image_hash: image_hash(args.seed, step).0,
                next_bucket: buckets[r.below(5) as usize],
                next_point: Some((r.below(1000) as f64, r.below(1000) as f64)),
                witness: r.below(4) == 0,
            })
            .collect(),
    };
    let c = Instant::now();
    let mut policy = Selector::new(scorer, Mode::Reference);
    let mut alloc = policy.allocate(&ctx, args.budget, &PolicyInputs::default())?;
    let elapsed = ms(c);
    alloc.sort_unstable();
    if alloc.len() != args.budget {
        alloc = recent_b(&ctx, args.budget);
    }
    Ok((elapsed, alloc))
}

#[cfg(test)]
mod tests {
    use super::{Expected, Gen, StepRun};

    fn run(pass1: &[u32], pass2: &[u32]) -> StepRun {
        let gen = |tokens: &[u32]| Gen {
            tokens: tokens.to_vec(),
            prefill_ms: 1.0,
            total_ms: 2.0,
            decode_steps: 1,
            reused: 0,
            accepted: 0,
        };
        StepRun {
            vision_ms: 0.0,
            selector_ms: 0.0,
            pass1: gen(pass1),
            pass2: gen(pass2),
        }
    }

    #[test]
    fn a_row_is_identical_only_when_every_repeat_matches_the_baseline() {
        let base = Expected {
            pass1: &[1, 2, 3],
            pass2: &[4, 5, 6],
            compared_with: "baseline",
        };
        assert!(base.matched_by(&[run(&[1, 2, 3], &[4, 5, 6]), run(&[1, 2, 3], &[4, 5, 6])]));
        // Runs that agree with each other but not with the baseline are not identical.
        assert!(!base.matched_by(&[run(&[1, 2, 3], &[4, 5, 7]), run(&[1, 2, 3], &[4, 5, 7])]));
        // A later token of pass 1 differs (not only the first token counts).
        assert!(!base.matched_by(&[run(&[1, 2, 9], &[4, 5, 6])]));
        // One repeat off.
        assert!(!base.matched_by(&[run(&[1, 2, 3], &[4, 5, 6]), run(&[1, 2, 3], &[4, 6, 6])]));
    }
}
