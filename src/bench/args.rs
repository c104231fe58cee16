//! The bench's settings: [`BenchArgs`] (the `recall bench` flags, parsed by clap), the screenshot
//! size [`GridSpec`] and the [`TINY_PRESET`] for a quick CPU check.
//!
//! The field docs of [`BenchArgs`] are also the `--help` text, so they are kept word for word.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::backend::{BackendArgs, BackendChoice, H200_GBS, H200_TFLOPS};
use crate::error::{Error, Result};
use crate::model::{GridThw, VisionConfig};

// Only the intra-doc links of the flag docs name these.
#[cfg(doc)]
use crate::backend::Backend;
#[cfg(doc)]
use crate::checkpoint::Checkpoint;

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

/// Settings of [`run_bench`](super::run_bench): the `recall bench` flags, parsed by clap (each flag is a field name in
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
    /// or per kernel (CUDA): the report's `breakdown`.
    #[arg(long)]
    pub breakdown: bool,
    /// Step recording/replay ([`Backend::set_step_replay`], CUDA graphs) during the measurements:
    /// on or off. When on, the plain pass 1 also runs once with it off and both outputs are compared:
    /// the report's `replay`.
    #[arg(long, default_value = "on", action = clap::ArgAction::Set, value_parser = parse_on_off)]
    pub step_replay: bool,
    /// Matrix-unit ceiling for the floors, TFLOP/s (H200 measured: 790).
    #[arg(long, default_value_t = H200_TFLOPS)]
    pub peak_tflops: f64,
    /// Memory-bandwidth ceiling for the floors, GB/s (H200 measured copy: 4200).
    #[arg(long, default_value_t = H200_GBS)]
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
