//! The two-pass step phases: the CausalCache step (pass 1, selector, pass 2) with and without prefix
//! reuse and drafting, and the ScopeMem-shaped step (pass 2 with an embedding prefix), each variant
//! repeated and reduced to a [`StepRow`] checked against the baseline.

use std::time::Instant;

use super::episode::run_selector;
use super::harness::{median, ms, ratio, Gen};
use super::layouts::image_hash;
use super::phases::Phases;
use super::report::{RowAndDecode, StepRow};
use crate::backend::Backend;
use crate::engine::{Engine, Prompt};
use crate::error::Result;

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

/// One variant of a step: its row name, prefix reuse, and the draft of pass 2.
struct Variant {
    name: &'static str,
    reuse: bool,
    draft: Draft,
}

/// `--quick` leaves these variants out.
fn skipped_when_quick(quick: bool, name: &str) -> bool {
    quick && (name == "prefix reuse" || name == "draft" || name == "scopemem")
}

impl<B: Backend> Phases<'_, B> {
    /// The CausalCache two-pass step variants.
    pub(super) fn causalcache(&self) -> Result<Vec<RowAndDecode>> {
        let variants = [
            ("plain", false, Draft::None),
            ("prefix reuse", true, Draft::None),
            ("draft", false, Draft::Proposal),
            ("reuse + draft", true, Draft::Proposal),
            ("reuse + oracle draft", true, Draft::Oracle),
        ];
        let expected = Expected {
            pass1: &self.base.pass1_tokens,
            pass2: &self.base.pass2_tokens,
            compared_with: "baseline pass 1 + pass 2",
        };
        let mut rows = Vec::new();
        for (name, reuse, draft) in variants
            .into_iter()
            .filter(|v| !skipped_when_quick(self.harness.args.quick, v.0))
        {
            let runs = (0..self.harness.args.repeats)
                .map(|_| self.causalcache_run(reuse, draft))
                .collect::<Result<Vec<_>>>()?;
            rows.push(step_row(&Variant { name, reuse, draft }, &runs, &expected));
        }
        Ok(rows)
    }

    /// One CausalCache step: pass 1 on Recent-B, the selector, pass 2 on the allocation, drafted
    /// from pass 1's proposal, from the baseline's pass 2 (the oracle) or not at all.
    fn causalcache_run(&self, reuse: bool, draft: Draft) -> Result<StepRun> {
        let (harness, r) = (self.harness, self.harness.args.response_tokens);
        let (mut e, vision_ms) = self.begin_step(reuse)?;
        let pass1 = harness.generate(&mut e, &self.prompts.pass1, r, Vec::new())?;
        let (selector_ms, alloc) = run_selector(harness.args, self.episode.t)?;
        debug_assert_eq!(alloc == self.episode.recent, !self.episode.selector_chose);
        let draft = match draft {
            Draft::None => Vec::new(),
            Draft::Proposal => pass1.tokens.clone(),
            Draft::Oracle => self.base.pass2_tokens.clone(),
        };
        let pass2 = harness.generate(&mut e, &self.prompts.pass2, r, draft)?;
        Ok(StepRun {
            vision_ms,
            selector_ms,
            pass1,
            pass2,
        })
    }

    /// The ScopeMem-shaped step variants: pass 1 plain, pass 2 with a 16-row embedding prefix
    /// (before the prompt, or appended before the assistant turn).
    pub(super) fn scopemem(&self) -> Result<Vec<RowAndDecode>> {
        let base = self.base;
        let prepended = Expected {
            pass1: &base.pass1_tokens,
            pass2: &base.scopemem_tokens,
            compared_with: "baseline pass 1 + ScopeMem pass 2",
        };
        let appended = Expected {
            pass1: &base.pass1_tokens,
            pass2: &base.scopemem_append_tokens,
            compared_with: "baseline pass 1 + ScopeMem pass 2 (appended prefix)",
        };
        let mut rows = Vec::new();
        for (name, reuse, append) in [
            ("scopemem", false, false),
            ("scopemem + reuse", true, false),
            ("scopemem append + reuse", true, true),
        ]
        .into_iter()
        .filter(|v| !skipped_when_quick(self.harness.args.quick, v.0))
        {
            let (pass2, expected) = if append {
                (&self.prompts.scopemem_append, &appended)
            } else {
                (&self.prompts.scopemem, &prepended)
            };
            let runs = (0..self.harness.args.repeats)
                .map(|_| self.scopemem_run(reuse, pass2))
                .collect::<Result<Vec<_>>>()?;
            let variant = Variant {
                name,
                reuse,
                draft: Draft::None,
            };
            rows.push(step_row(&variant, &runs, expected));
        }
        Ok(rows)
    }

    /// One ScopeMem step: pass 1 on Recent-B, then `pass2` (no selector).
    fn scopemem_run(&self, reuse: bool, pass2: &Prompt) -> Result<StepRun> {
        let (harness, r) = (self.harness, self.harness.args.response_tokens);
        let (mut e, vision_ms) = self.begin_step(reuse)?;
        let pass1 = harness.generate(&mut e, &self.prompts.pass1, r, Vec::new())?;
        let pass2 = harness.generate(&mut e, pass2, r, Vec::new())?;
        Ok(StepRun {
            vision_ms,
            selector_ms: 0.0,
            pass1,
            pass2,
        })
    }

    /// A fresh engine in the state of an agent at the current step: the history screenshots encoded
    /// and the previous step's prompt computed (untimed); then the current screenshot through the
    /// tower, timed. Returns the engine and that time.
    fn begin_step(&self, reuse: bool) -> Result<(Engine<'_, B>, f64)> {
        let (harness, t) = (self.harness, self.episode.t);
        let mut e = harness.engine(reuse)?;
        harness.add_images(&mut e, 1..t)?;
        harness.generate(&mut e, &self.prompts.prev, 1, Vec::new())?;
        let c = Instant::now();
        e.add_image(image_hash(harness.args.seed, t), &harness.images[t - 1])?;
        (harness.sync)()?;
        Ok((e, ms(c)))
    }
}

/// The medians of a variant's runs, the first run's counts and tokens, and the baseline check.
fn step_row(variant: &Variant, runs: &[StepRun], expected: &Expected<'_>) -> RowAndDecode {
    let m = |f: &dyn Fn(&StepRun) -> f64| median(runs.iter().map(f).collect());
    let first = &runs[0];
    let pass1_ms = m(&|r| r.pass1.total_ms);
    let pass2_ms = m(&|r| r.pass2.total_ms);
    let decode = m(&|r| r.pass1.decode_ms_per_token());
    RowAndDecode {
        row: StepRow {
            name: variant.name.to_string(),
            prefix_reuse: variant.reuse,
            draft: variant.draft.name().to_string(),
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
