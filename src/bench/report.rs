//! What [`run_bench`](super::run_bench) measured: [`BenchReport`] and its rows, as serialised to
//! JSON (`--json-out`; `tools/` and the tests read these field names). The plain-text table is in
//! `table.rs`.

use serde::{Deserialize, Serialize};

use super::layouts::LayoutRun;
use crate::error::{Error, Result};

/// What the step-replay flag compares with.
pub(super) const REPLAY_COMPARED_WITH: &str = "baseline pass 1, replay off";

/// Sizes of the bench prompts.
/// A step row and the plain path's pass-1 decode rate.
pub(super) struct RowAndDecode {
    pub(super) row: StepRow,
    pub(super) pass1_decode_ms_per_token: f64,
}

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
    pub(super) fn since(self, earlier: StepCounts) -> StepCounts {
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

/// Everything [`run_bench`](super::run_bench) measured.
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

    /// Every identical flag is true: the prefill rows, the step rows, the step-replay check (when it
    /// ran) and the breakdown run (when it ran).
    pub(super) fn every_path_identical(&self) -> bool {
        self.prefill.iter().all(|r| r.identical)
            && self.causalcache.iter().chain(&self.scopemem).all(|r| r.identical)
            && self.replay.identical != Some(false)
            && self.breakdown.as_ref().is_none_or(|b| b.identical)
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| Error::InvalidRequest(format!("bench JSON: {e}")))
    }
}
