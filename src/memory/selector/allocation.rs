//! What composition is asked and what it returns: the [`Mode`]s, their [`ComposeOptions`], the
//! [`Allocation`] with its [`Swap`]s. Below `compose.rs` and the modes' files, which all use them.

use super::{EventIndexing, DEFAULT_BEAM};

/// How [`compose`](super::compose) builds the set. All three are exact-`B`;
/// [`compose_with`](super::compose_with) has the details.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The paper: a small beam over sequences of swaps, initialized at Recent-B. An older event
    /// enters only by beating the predicted marginal of the recent event it evicts; declining every
    /// swap returns Recent-B exactly.
    Paper,
    /// A single greedy swap loop from Recent-B: each step evicts the weakest recent event and admits
    /// the strongest challenger if it beats it (the paper's rule without the beam).
    Greedy,
    /// The authors' code: beam search from the empty set over the deduplicated pool.
    Reference,
}

impl Mode {
    /// The name [`FromStr`](std::str::FromStr) accepts: `paper`, `greedy` or `reference`.
    ///
    /// ```
    /// use recall::memory::selector::Mode;
    /// for mode in [Mode::Paper, Mode::Greedy, Mode::Reference] {
    ///     assert_eq!(mode.as_str().parse::<Mode>()?, mode);
    /// }
    /// assert!("beam".parse::<Mode>().is_err());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Paper => "paper",
            Mode::Greedy => "greedy",
            Mode::Reference => "reference",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Mode {
    type Err = crate::Error;

    /// `paper`, `greedy` or `reference`.
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "paper" => Ok(Mode::Paper),
            "greedy" => Ok(Mode::Greedy),
            "reference" => Ok(Mode::Reference),
            other => Err(crate::Error::InvalidRequest(format!(
                "selector mode `{other}`: expected paper, greedy or reference"
            ))),
        }
    }
}

/// Options of [`compose_with`](super::compose_with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComposeOptions {
    pub mode: Mode,
    /// The most chosen events outside Recent-B (`k`), in every mode. Paper: the most beam rounds
    /// (each round adds one swap, i.e. one entered event, to every path), default `B`. Greedy: the
    /// most swaps, default `B`. Reference: children with more pool events outside Recent-B are
    /// dropped, default unlimited. `Some(0)` gives Recent-B in every mode.
    pub max_replacements: Option<usize>,
    /// Paper mode: sets kept per round. Reference mode: sets kept per level. At least 1.
    pub beam_width: usize,
    /// Reference mode only: children kept per parent (by predicted marginal). At least 1.
    pub children_per_parent: usize,
    /// How the features count ages: the scorer's own (its file's `event_indexing`).
    pub indexing: EventIndexing,
}

impl ComposeOptions {
    /// Defaults for `mode`: beam 3, 3 children per parent, the mode's default replacement cap.
    pub fn new(mode: Mode) -> Self {
        ComposeOptions {
            mode,
            max_replacements: None,
            beam_width: DEFAULT_BEAM,
            children_per_parent: DEFAULT_BEAM,
            indexing: EventIndexing::default(),
        }
    }
}

/// One accepted swap of [`Mode::Paper`] or [`Mode::Greedy`], where `S` is the set it was made from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Swap {
    /// The recent event that lost its image.
    pub evicted: usize,
    /// The older event that gained one.
    pub entered: usize,
    /// `Δ̂(evicted | S ∖ {evicted})`.
    pub evicted_marginal: f32,
    /// `Δ̂(entered | S ∖ {evicted})`.
    pub entered_marginal: f32,
}

impl Swap {
    /// `entered_marginal − evicted_marginal` in f64: what the swap adds to [`Allocation::score`].
    pub fn gain(&self) -> f64 {
        self.entered_marginal as f64 - self.evicted_marginal as f64
    }
}

/// The result of [`compose`](super::compose).
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// Chosen steps, ascending; `min(B, #events)` of them.
    pub steps: Vec<usize>,
    /// Number of chosen steps outside Recent-B (in paper and greedy mode, `swaps.len()`).
    pub k: usize,
    /// Recent-B, for reference.
    pub recent: Vec<usize>,
    /// Reference mode: the accumulated predicted marginal of the chosen beam path. Paper and greedy
    /// mode: the gains ([`Swap::gain`]) of `swaps` summed in order in f64, starting from 0. 0 on
    /// fallback.
    pub score: f64,
    /// Paper and greedy mode: the accepted swaps of the returned path, in order.
    pub swaps: Vec<Swap>,
    /// Recent-B was returned because the pool had fewer than `B` candidates (or the beam could not
    /// fill `B` slots under `max_replacements`). Reference mode only.
    pub fell_back: bool,
}

impl Allocation {
    pub(super) fn recent(recent: Vec<usize>) -> Self {
        Allocation {
            steps: recent.clone(),
            k: 0,
            recent,
            score: 0.0,
            swaps: Vec::new(),
            fell_back: true,
        }
    }
}

/// NaN ranks below every number.
pub(super) fn nan_low(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}
