//! The step the bench measures: the current step `t = history + 1`, its Recent-B pass 1, the
//! allocation pass 2 renders (the selector's, on a random scorer) and the layouts and sizes of every
//! prompt of the step.

use std::time::Instant;

use super::args::BenchArgs;
use super::harness::ms;
use super::layouts::{appended_prefix, image_hash, layout_tokens, LayoutRun, Layouts};
use super::report::Shapes;
use super::SCOPEMEM_ROWS;
use crate::error::Result;
use crate::memory::policy::{AllocationPolicy, PolicyInputs, Selector};
use crate::memory::selector::{
    recent_b, ActionBucket, DecisionContext, EventInfo, MarginalScorer, Mode, ScorerParams, NUM_FEATURES,
};
use crate::model::GridThw;
use crate::rng::{derive, Rng};

/// The measured step's allocations, prompt layouts and their token counts.
pub(super) struct Episode {
    /// The current step.
    pub(super) t: usize,
    /// Recent-B: the last `budget` completed steps (pass 1).
    pub(super) recent: Vec<usize>,
    /// The allocation pass 2 renders.
    pub(super) allocation: Vec<usize>,
    /// The selector chose `allocation` (else it is a forced swap).
    pub(super) selector_chose: bool,
    pub(super) pass1_layout: Vec<LayoutRun>,
    pub(super) pass2_layout: Vec<LayoutRun>,
    /// The previous step's pass-1 prompt (computed before each measured step, as an agent would).
    pub(super) prev_layout: Vec<LayoutRun>,
    /// The ScopeMem pass 2: the prefix, then the pass-1 prompt.
    pub(super) scopemem_layout: Vec<LayoutRun>,
    /// The ScopeMem pass 2 with the prefix before the assistant turn.
    pub(super) append_layout: Vec<LayoutRun>,
    pub(super) pass1_tokens: usize,
    pub(super) pass2_tokens: usize,
    pub(super) scopemem_tokens: usize,
}

impl Episode {
    /// The allocation: the selector's (random scorer) if it differs from Recent-B, else a forced swap
    /// of the oldest recent step for step 1, so that pass 2 differs from pass 1.
    pub(super) fn plan(layouts: &Layouts, args: &BenchArgs, merge: usize) -> Result<Self> {
        let t = args.history + 1;
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
        Ok(Episode {
            t,
            pass1_tokens: layout_tokens(&pass1_layout, merge),
            pass2_tokens: layout_tokens(&pass2_layout, merge),
            scopemem_tokens: layout_tokens(&scopemem_layout, merge),
            recent,
            allocation,
            selector_chose,
            pass1_layout,
            pass2_layout,
            prev_layout,
            scopemem_layout,
            append_layout,
        })
    }

    /// KV blocks with room for every prompt of a step (pass 1, pass 2 with its draft, the previous
    /// step) at once.
    pub(super) fn pool_blocks(&self, args: &BenchArgs) -> usize {
        let longest = self.pass1_tokens.max(self.pass2_tokens).max(self.scopemem_tokens)
            + 2 * args.response_tokens
            + args.block_size;
        (3 * longest).div_ceil(args.block_size) + 8
    }

    /// The report's sizes of the bench prompts.
    pub(super) fn into_shapes(self, args: &BenchArgs, grid: GridThw, image_tokens: usize) -> Shapes {
        Shapes {
            budget: args.budget,
            history: args.history,
            grid,
            image_tokens,
            response_tokens: args.response_tokens,
            pass1_tokens: self.pass1_tokens,
            pass2_tokens: self.pass2_tokens,
            scopemem_tokens: self.scopemem_tokens,
            recent: self.recent,
            allocation: self.allocation,
            selector_chose: self.selector_chose,
            pass1_layout: self.pass1_layout,
        }
    }
}

/// The selector (reference-mode beam search over a random 64-unit scorer) on a synthetic decision
/// with `t - 1` completed steps; returns its time and allocation.
pub(super) fn run_selector(args: &BenchArgs, t: usize) -> Result<(f64, Vec<usize>)> {
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
