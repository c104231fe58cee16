//! The learned restoration selector: which past events get their screenshots back under a budget of
//! `B` history images.
//!
//! Three parts:
//!
//! 1. **Features** ([`features`], [`FeatureContext`]): 28 numbers describing one candidate event
//!    relative to the current decision and to an already-selected set `S` (20 candidate features,
//!    then 8 set-context features; order = [`FEATURE_NAMES`]).
//! 2. **Marginal scorer** ([`MarginalScorer`]): a 28→H→H→1 MLP predicting the marginal utility
//!    `Δ(j | S)` of adding event `j` to `S`. Any [`MarginalModel`] (including a closure) can stand in.
//! 3. **Composition** ([`compose`], [`compose_with`]): an exact-`B` set, in one of three [`Mode`]s.
//!    [`Mode::Paper`]: a small beam over swap sequences initialized at Recent-B, where an older
//!    event enters only by beating the predicted marginal of the recent event it evicts, so
//!    declining every swap recovers Recent-B exactly. [`Mode::Greedy`]: the same swap rule as a
//!    single greedy loop (weakest recent event against strongest challenger). [`Mode::Reference`]:
//!    the authors' code, a beam that builds the set from empty over the deduplicated pool.
//!    `max_replacements` caps the events outside Recent-B in all three.
//!
//! # Definitions
//!
//! Notation: `t` is the current decision step (completed steps are `1..t-1`), `s` a candidate's step.
//! These follow the authors' feature code, `selector_v4_features.py` (desktop, where their selectors
//! are trained) and `mobileworld_selector_features.py` (their MobileWorld deployment, laid out the same):
//!
//! * **Event indexing** ([`EventIndexing`]): the two count ages differently. On desktop a history
//!   entry `k` carries the action taken from the post-action frame of event `k − 1`, so recall's step
//!   `s` (screen `x_s`, action `a_s`) is their event `e = s − 1` and `age = t − e = t − s + 1`
//!   ([`EventIndexing::Desktop`], the default); the mobile deployment uses `e = s`, `age = t − s`
//!   ([`EventIndexing::Mobile`]) with the same thresholds, so a desktop-trained selector served there
//!   sees every age one smaller than in training. A scorer file records the indexing it was trained
//!   with (`event_indexing`) and is served with it.
//! * **Pool** ([`dedup_pool`]): events deduplicated by `image_hash`, keeping the most recent event of
//!   each hash; ascending steps. An older event with the same hash is an *alias* of the kept one.
//! * **Recent-B** ([`recent_b`]): the `min(B, n)` largest steps among all events (no dedup).
//! * `age`; `log_age = ln(age)`; `recency_rank` = number of pool events with a larger step (0 = the
//!   most recent pool event); `relative_position = e / max(t-1, 1)`; `in_recent_1/2/4/8` =
//!   `age ≤ 2/3/5/9` (desktop: exactly the last `B` completed steps `t-B..t-1`, i.e. Recent-B when every
//!   completed step is an event; mobile: one step more); `pool_size` = pool length;
//!   `trajectory_length = t - 1`.
//! * `witness_match` = the event's `witness` flag; `witness_count` = number of pool events that are
//!   witnesses; `witness_rank` = number of pool witnesses with a larger step (−1 if not a witness).
//! * One-hot of `next_bucket` (click, type, key, scroll, other).
//! * `coord_distance`: Euclidean distance on the 0–999 grid between `next_point` and the
//!   `reference_point`, computed only for witnesses (as the authors do); −1 if either point is missing
//!   or the event is not a witness.
//! * `dedup_multiplicity`: for a pool event, 1 + the number of its aliases; 1 for an alias.
//! * Set context for a non-empty `S`: `set_size = |S|`; `min/mean_age_gap_to_set` over `|s - s'|`;
//!   `n_recent_in_set` = members with age ≤ 5 (desktop: members in the last 4 steps);
//!   `n_witness_in_set`; `witness_redundancy` = the candidate is a witness and `S` holds one; `event_older_than_set` = `s < min(S)`;
//!   `duplicate_of_set_member` = some member has the candidate's image hash. Empty `S` gives
//!   `[0, −1, −1, 0, 0, 0, 0, 0]`.
//!
//! # Scorer file format (safetensors, all f32/bf16/f16)
//!
//! | tensor | shape | |
//! |---|---|---|
//! | `feature_mean` | `[28]` | z-normalisation mean |
//! | `feature_std` | `[28]` | z-normalisation std (must be > 0) |
//! | `fc1.weight`, `fc1.bias` | `[H, 28]`, `[H]` | first Linear |
//! | `fc2.weight`, `fc2.bias` | `[H, H]`, `[H]` | second Linear |
//! | `fc3.weight`, `fc3.bias` | `[1, H]`, `[1]` | readout |
//!
//! Metadata (all optional, checked when present): `format` = `recall.selector.v1`, `hidden` = `H`,
//! `feature_names` = the 28 names of [`FEATURE_NAMES`] joined by `,`. The forward pass is
//! `fc3(gelu(fc2(gelu(fc1((x - mean) / std)))))` with the exact (erf) GELU, as in PyTorch's
//! `nn.GELU()`. `tools/convert_selector_pt.py` writes this file from the reference trainer's
//! `marginal_scorer.pt`.
//! `event_indexing` = `desktop` or `mobile` ([`EventIndexing`]; a file without it was written before
//! recall recorded it and is served with `mobile`, the `t − s` it was used with, and a warning);
//! `feature_mask` = the features `recall selector train --mask-features` cut (their `fc1` columns
//! are zero, so serving needs nothing for them).
//!
//! # Layout
//!
//! `feature` (decisions, events, [`FeatureContext`]), `model` (the [`MarginalModel`] trait),
//! `scorer` ([`MarginalScorer`] and its file format), `kernels` (the MLP's dense/GELU kernels),
//! `allocation` ([`Mode`], [`ComposeOptions`], [`Allocation`], [`Swap`]), `compose` ([`compose`],
//! [`compose_with`]) with one file per mode: `paper`, `greedy`, `reference` (also the beam search
//! the oracle policy shares).

mod allocation;
mod compose;
mod feature;
mod greedy;
mod kernels;
mod model;
mod paper;
mod reference;
mod scorer;

pub use allocation::{Allocation, ComposeOptions, Mode, Swap};
pub use compose::{compose, compose_logged, compose_with};
pub use feature::{
    dedup_pool, features, recent_b, ActionBucket, DecisionContext, EventIndexing, EventInfo, FeatureContext,
    Query,
};
pub use model::{MarginalModel, Negated};
pub(crate) use reference::beam_search;
pub use scorer::{MarginalScorer, ScorerParams};

/// Number of candidate features.
pub const CANDIDATE_FEATURES: usize = 20;
/// Number of set-context features.
pub const SET_FEATURES: usize = 8;
/// Total feature count.
pub const NUM_FEATURES: usize = CANDIDATE_FEATURES + SET_FEATURES;
/// Default beam width and children kept per parent in [`Mode::Reference`] (the authors' `--selector-beam 3`).
pub const DEFAULT_BEAM: usize = 3;
/// The `format` metadata value of a scorer file.
pub const SCORER_FORMAT: &str = "recall.selector.v1";

/// Feature names in vector order (the authors' names).
pub const FEATURE_NAMES: [&str; NUM_FEATURES] = [
    "age",
    "log_age",
    "recency_rank",
    "relative_position",
    "in_recent_1",
    "in_recent_2",
    "in_recent_4",
    "in_recent_8",
    "pool_size",
    "trajectory_length",
    "witness_match",
    "witness_count",
    "witness_rank",
    "action_type_click",
    "action_type_type",
    "action_type_key",
    "action_type_scroll",
    "action_type_other",
    "coord_distance",
    "dedup_multiplicity",
    "set_size",
    "min_age_gap_to_set",
    "mean_age_gap_to_set",
    "n_recent_in_set",
    "n_witness_in_set",
    "witness_redundancy",
    "event_older_than_set",
    "duplicate_of_set_member",
];
