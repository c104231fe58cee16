//! The measurement phases, each a function, in the order [`Phases::measure`] runs them: the warm-up
//! and the [`baseline`] first, then the vision tower, the prefills, the two-pass steps (`steps.rs`),
//! the decode row, the step-replay report and the optional per-op breakdown.

use std::time::Instant;

use super::episode::Episode;
use super::flops::{kv_bytes_per_token, prefill_flops, vision_flops};
use super::harness::{median, ms, Gen, Harness};
use super::layouts::image_hash;
use super::report::{
    Baseline, Breakdown, DecodeRow, OpRow, PrefillRow, ReplayReport, RowAndDecode, StepCounts, StepRow,
    VisionRow,
};
use crate::backend::Backend;
use crate::engine::{Engine, Prompt};
use crate::error::{Error, Result};
use crate::model::{GridThw, VisionConfig, VisionTower};

/// How [`Baseline`] is computed.
const BASELINE_METHOD: &str =
    "plain decoding on a fresh engine, every screenshot encoded first: no prefix cache, no draft, step replay off";

/// The engine prompts of the step's layouts, built once.
pub(super) struct Prompts {
    pub(super) pass1: Prompt,
    pub(super) pass2: Prompt,
    /// The previous step's pass 1.
    pub(super) prev: Prompt,
    pub(super) scopemem: Prompt,
    pub(super) scopemem_append: Prompt,
}

impl Prompts {
    pub(super) fn new<B: Backend>(harness: &Harness<'_, B>, episode: &Episode) -> Self {
        Prompts {
            pass1: harness.prompt(&episode.pass1_layout),
            pass2: harness.prompt(&episode.pass2_layout),
            prev: harness.prompt(&episode.prev_layout),
            scopemem: harness.prompt(&episode.scopemem_layout),
            scopemem_append: harness.prompt(&episode.append_layout),
        }
    }
}

/// Warm-up (kernels, GEMM plans, allocator): one short generation of the pass-1 prompt.
pub(super) fn warm_up<B: Backend>(harness: &Harness<'_, B>, episode: &Episode, pass1: &Prompt) -> Result<()> {
    let mut e = harness.engine(false)?;
    harness.add_images(&mut e, 1..=episode.t)?;
    harness.generate(&mut e, pass1, 2, Vec::new())?;
    Ok(())
}

/// `prompt` on a fresh engine without prefix reuse or draft, every screenshot encoded first,
/// `response_tokens` tokens.
fn plain_run<B: Backend>(harness: &Harness<'_, B>, prompt: &Prompt) -> Result<Gen> {
    let mut e = harness.engine(false)?;
    harness.add_images(&mut e, 1..=harness.args.history + 1)?;
    harness.generate(&mut e, prompt, harness.args.response_tokens, Vec::new())
}

/// The baseline of the pass-1, pass-2 and ScopeMem prompts (prepended, then appended prefix), step
/// replay off whatever `--step-replay` says (its setting is restored after).
pub(super) fn baseline<B: Backend>(harness: &Harness<'_, B>, prompts: &Prompts) -> Result<Baseline> {
    let prompts = [
        &prompts.pass1,
        &prompts.pass2,
        &prompts.scopemem,
        &prompts.scopemem_append,
    ];
    harness.be.set_step_replay(false);
    let runs: Result<Vec<Gen>> = prompts.iter().map(|p| plain_run(harness, p)).collect();
    harness.be.set_step_replay(harness.args.step_replay);
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

/// What every phase reads: the harness, the step, its prompts, the baseline and the vision tower.
pub(super) struct Phases<'a, B: Backend> {
    pub(super) harness: &'a Harness<'a, B>,
    pub(super) episode: &'a Episode,
    pub(super) prompts: &'a Prompts,
    pub(super) base: &'a Baseline,
    pub(super) tower: &'a VisionTower<B>,
    pub(super) vision: &'a VisionConfig,
    pub(super) grid: GridThw,
}

/// Every phase's rows, for the report.
pub(super) struct Measured {
    pub(super) vision: VisionRow,
    pub(super) prefill: Vec<PrefillRow>,
    pub(super) decode: DecodeRow,
    pub(super) causalcache: Vec<StepRow>,
    pub(super) scopemem: Vec<StepRow>,
    pub(super) replay: ReplayReport,
    pub(super) breakdown: Option<Breakdown>,
}

impl<B: Backend> Phases<'_, B> {
    /// Runs the phases after the warm-up and the baseline; `decode_params` and `kv_elem_bytes` give
    /// the bytes a decoded token reads.
    pub(super) fn measure(&self, decode_params: u64, kv_elem_bytes: usize) -> Result<Measured> {
        let be = self.harness.be;
        let steps_before = StepCounts::from(be.step_stats());
        let v_flops = vision_flops(self.vision, self.harness.model.config.family, self.grid);
        let vision = self.vision_tower(v_flops)?;
        let prefill = self.prefills(v_flops)?;
        let causal = self.causalcache()?;
        let scopemem = self.scopemem()?;
        // Decode: pass 1 of the plain variant.
        let plain = &causal[0];
        let decode = self.decode(plain, decode_params, kv_elem_bytes);
        let steps = StepCounts::from(be.step_stats()).since(steps_before);
        let replay = self.replay(&plain.row.pass1_tokens, decode.ms_per_token, steps);
        let breakdown = if self.harness.args.breakdown {
            Some(self.breakdown()?)
        } else {
            None
        };
        Ok(Measured {
            vision,
            prefill,
            decode,
            causalcache: causal.into_iter().map(|r| r.row).collect(),
            scopemem: scopemem.into_iter().map(|r| r.row).collect(),
            replay,
            breakdown,
        })
    }

    /// The vision tower on the current screenshot.
    fn vision_tower(&self, v_flops: f64) -> Result<VisionRow> {
        let (harness, be, sync) = (self.harness, self.harness.be, self.harness.sync);
        let image = &harness.images[self.episode.t - 1];
        let x = be.upload(&image.data, image.num_patches(), self.vision.patch_dim())?;
        let mut times = Vec::new();
        for _ in 0..harness.args.repeats {
            sync()?;
            let c = Instant::now();
            let out = self.tower.forward(be, &x, &[self.grid])?;
            sync()?;
            times.push(ms(c));
            drop(out);
        }
        drop(x);
        let v_ms = median(times);
        Ok(VisionRow {
            ms: v_ms,
            patches: self.grid.iter().product(),
            tflop: v_flops / 1e12,
            tflops: v_flops / 1e9 / v_ms.max(1e-9),
            floor_ms: v_flops / 1e9 / harness.args.peak_tflops,
        })
    }

    /// Prefills of the pass-1 prompt with B + 1, 1 and 0 screenshots through the tower.
    fn prefills(&self, v_flops: f64) -> Result<Vec<PrefillRow>> {
        let (args, ep) = (self.harness.args, self.episode);
        let (t, recent, n1) = (ep.t, &ep.recent, ep.pass1_tokens);
        let text = &self.harness.model.config.text;
        let mut prefill = Vec::new();
        let shown: Vec<usize> = recent.iter().copied().chain(std::iter::once(t)).collect();
        for (name, cached) in [
            ("from scratch", Vec::new()),
            ("vision warm", recent.clone()),
            ("text only", (1..=t).collect::<Vec<_>>()),
        ] {
            let runs = (0..args.repeats)
                .map(|_| self.timed_prefill(&cached, &shown))
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
                identical: runs.iter().all(|r| r.1 == self.base.pass1_tokens),
                compared_with: format!("baseline pass 1 ({} tokens)", args.response_tokens),
            });
        }
        Ok(prefill)
    }

    /// One prefill row's run of the pass-1 prompt on a fresh engine with prefix caching and the
    /// `cached` screenshots already encoded: the screenshots in `shown` registered (the uncached ones
    /// go through the tower) and the prompt prefilled, timed to the first token; the rest of the
    /// response is generated untimed, for the identical check. Returns (ms to the first token, the
    /// whole output).
    fn timed_prefill(&self, cached: &[usize], shown: &[usize]) -> Result<(f64, Vec<u32>)> {
        let (harness, prompt) = (self.harness, &self.prompts.pass1);
        let mut e = harness.engine(true)?;
        harness.add_images(&mut e, cached.iter().copied())?;
        let prefill_steps = harness.prefill_steps(harness.prompt_len(prompt)?);
        let c = Instant::now();
        for &s in shown {
            e.add_image(image_hash(harness.args.seed, s), &harness.images[s - 1])?;
        }
        let mut first = None;
        // The last prefill step ends with the first token's argmax read back: the device is synchronised.
        let g = harness.generate_with(
            &mut e,
            prompt,
            harness.args.response_tokens,
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

    /// The decode row from the plain variant's pass 1: ms/token against the bytes a token reads
    /// (decode weights in bf16 and the K/V of the mean context).
    fn decode(&self, plain: &RowAndDecode, decode_params: u64, kv_elem_bytes: usize) -> DecodeRow {
        let args = self.harness.args;
        let r = args.response_tokens;
        let decode_ms = plain.pass1_decode_ms_per_token;
        let context = self.episode.pass1_tokens + r / 2;
        let text = &self.harness.model.config.text;
        let bytes = decode_params as f64 * 2.0 + context as f64 * kv_bytes_per_token(text, kv_elem_bytes);
        DecodeRow {
            ms_per_token: decode_ms,
            tokens: r - 1,
            context,
            gb_per_token: bytes / 1e9,
            gbs: bytes / 1e6 / decode_ms.max(1e-9),
            floor_ms: bytes / 1e6 / args.peak_gbs,
        }
    }

    /// `--step-replay`: the backend's step counters over the measurements and, when replay is on, the
    /// plain variant's pass 1 (replay on) against the baseline's (replay off) and both decode rates.
    fn replay(&self, plain_pass1: &[u32], ms_per_token: f64, steps: StepCounts) -> ReplayReport {
        let on = self.harness.args.step_replay;
        ReplayReport {
            enabled: on,
            ms_per_token,
            off_ms_per_token: on.then_some(self.base.pass1_ms_per_token),
            identical: on.then(|| plain_pass1 == self.base.pass1_tokens),
            steps,
        }
    }

    /// `--breakdown`: the plain pass 1 once more with profiling on, the history screenshots cached.
    /// Phase 1 (prefill): the current screenshot through the tower and the prompt to its first token;
    /// phase 2 (decode): the remaining tokens. Each phase ends with a sync before its profile is taken.
    fn breakdown(&self) -> Result<Breakdown> {
        let (harness, prompt) = (self.harness, &self.prompts.pass1);
        let mut e = harness.engine(false)?;
        harness.add_images(&mut e, 1..=harness.args.history)?;
        let prefill_tokens = harness.prompt_len(prompt)?;
        harness.be.set_profiling(true);
        let run = self.profiled_phases(&mut e, harness.prefill_steps(prefill_tokens).max(1));
        harness.be.set_profiling(false);
        let (prefill, decode, gen) = run?;
        Ok(Breakdown {
            prefill_wall_s: prefill.0,
            prefill: prefill.1,
            decode_wall_s: decode.0,
            decode: decode.1,
            prefill_tokens,
            decode_steps: gen.decode_steps,
            identical: gen.tokens == self.base.pass1_tokens,
            compared_with: "baseline pass 1".to_string(),
        })
    }

    /// The profiled generation of [`breakdown`](Self::breakdown), split after `prefill_steps` engine
    /// steps.
    fn profiled_phases(
        &self,
        e: &mut Engine<'_, B>,
        prefill_steps: usize,
    ) -> Result<(ProfiledPhase, ProfiledPhase, Gen)> {
        let harness = self.harness;
        // Synchronised wall time since `start`, then the profile (which may wait for device events).
        let end_phase = |start: Instant| -> Result<ProfiledPhase> {
            (harness.sync)()?;
            let wall = start.elapsed().as_secs_f64();
            let ops = harness.be.take_profile()?.into_iter().map(OpRow::from).collect();
            Ok((wall, ops))
        };
        end_phase(Instant::now())?; // drops anything from before the phase
        let t = harness.args.history + 1;
        let clock = Instant::now();
        e.add_image(image_hash(harness.args.seed, t), &harness.images[t - 1])?;
        let mut prefill = None;
        let mut decode_start = clock;
        let response = harness.args.response_tokens;
        let gen = harness.generate_with(e, &self.prompts.pass1, response, Vec::new(), &mut |step| {
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
}

/// A profiled phase's wall seconds and op times.
type ProfiledPhase = (f64, Vec<OpRow>);
