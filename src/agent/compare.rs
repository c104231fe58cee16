//! Two systems on the same steps (`recall eval --compare A.json B.json`): what each repairs and harms
//! against the plain actor, which steps only one of them gets right, and the paired advantage of B
//! over A with an episode-bootstrap interval.
//!
//! Both inputs are `recall eval --json` reports. Steps are paired by (episode, step). Two tallies:
//!
//! * **Against the plain actor** (the paper's Table 3, [`AgainstPlain`]): every report's first
//!   opinion a0 is the plain actor's answer; each system is judged by its final answer (the second
//!   opinion) on full-action match (EM). A system **repairs** a step the plain actor gets wrong and
//!   it gets right, and **harms** one the plain actor gets right and it gets wrong; it **keeps** the
//!   plain actor's right steps it also gets right. "Only one system" (Table 3's caption: "counts
//!   correct steps only one preserves or errors only one repairs") splits the steps where the two
//!   systems disagree: keeps of only A, keeps of only B, repairs of only A, repairs of only B. A step
//!   whose a0 the two reports judge differently (the plain actor did not answer alike) has no single
//!   plain verdict and is counted apart (`plain_disagrees`), in neither tally above.
//! * **Pairwise** ([`PairCounts`]): both right, only A right, only B right, neither, over all
//!   paired steps. The paired advantage `(only B − only A) / N = EM(B) − EM(A)`; its interval
//!   resamples whole episodes with replacement (steps of one episode are not independent),
//!   percentile method, seeded.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::Serialize;

use crate::agent::eval::{
    percentile_interval, BootstrapConfig, EvalReport, Interval, SplitMix64, StepVerdict,
};
use crate::error::{Error, Result};

/// The pairwise tally of two systems' final answers (EM) over the paired steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PairCounts {
    /// Paired steps N.
    pub steps: usize,
    /// Both systems right.
    pub both_right: usize,
    /// Only A right.
    pub only_a_right: usize,
    /// Only B right.
    pub only_b_right: usize,
    /// Neither right.
    pub neither: usize,
}

impl PairCounts {
    fn add(&mut self, a: bool, b: bool) {
        self.steps += 1;
        match (a, b) {
            (true, true) => self.both_right += 1,
            (true, false) => self.only_a_right += 1,
            (false, true) => self.only_b_right += 1,
            (false, false) => self.neither += 1,
        }
    }

    fn merge(&mut self, o: &PairCounts) {
        self.steps += o.steps;
        self.both_right += o.both_right;
        self.only_a_right += o.only_a_right;
        self.only_b_right += o.only_b_right;
        self.neither += o.neither;
    }

    /// `(only B right − only A right) / steps`, i.e. `EM(B) − EM(A)`.
    pub fn advantage(&self) -> f64 {
        (self.only_b_right as f64 - self.only_a_right as f64) / self.steps.max(1) as f64
    }
}

/// One system's repairs and harms against the plain actor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RepairsHarms {
    /// Plain actor wrong, the system right.
    pub repairs: usize,
    /// Plain actor right, the system wrong.
    pub harms: usize,
}

/// The paper's "only one system" counts (Table 3): steps where exactly one of A and B is right.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OnlyOne {
    /// Plain actor right, A right, B wrong (correct steps only A preserves).
    pub keeps_a: usize,
    /// Plain actor right, B right, A wrong.
    pub keeps_b: usize,
    /// Plain actor wrong, A right, B wrong (errors only A repairs).
    pub repairs_a: usize,
    /// Plain actor wrong, B right, A wrong.
    pub repairs_b: usize,
}

/// The three-way tally against the plain actor (the reports' shared first opinion).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AgainstPlain {
    /// Steps with one plain verdict (both reports judge a0 alike).
    pub steps: usize,
    /// Of those, the plain actor right.
    pub plain_right: usize,
    /// Of those, the plain actor wrong.
    pub plain_wrong: usize,
    /// A's repairs and harms.
    pub a: RepairsHarms,
    /// B's repairs and harms.
    pub b: RepairsHarms,
    /// Steps only one system keeps or repairs.
    pub only_one: OnlyOne,
    /// Paired steps whose a0 the two reports judge differently (left out of the above).
    pub plain_disagrees: usize,
}

impl AgainstPlain {
    /// Adds one paired step: A's and B's verdicts (first opinion = the plain actor, second = the
    /// system's answer).
    pub fn add(&mut self, a: &StepVerdict, b: &StepVerdict) {
        if a.first.em != b.first.em {
            self.plain_disagrees += 1;
            return;
        }
        let (plain, ra, rb) = (a.first.em, a.second.em, b.second.em);
        self.steps += 1;
        if plain {
            self.plain_right += 1;
            self.a.harms += usize::from(!ra);
            self.b.harms += usize::from(!rb);
            self.only_one.keeps_a += usize::from(ra && !rb);
            self.only_one.keeps_b += usize::from(rb && !ra);
        } else {
            self.plain_wrong += 1;
            self.a.repairs += usize::from(ra);
            self.b.repairs += usize::from(rb);
            self.only_one.repairs_a += usize::from(ra && !rb);
            self.only_one.repairs_b += usize::from(rb && !ra);
        }
    }
}

/// The comparison of B against A.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    pub episodes: usize,
    /// Repairs, harms and the "only one system" counts against the plain actor (paper, Table 3).
    pub against_plain: AgainstPlain,
    /// Both right, only A, only B, neither, over all paired steps.
    pub pairwise: PairCounts,
    /// EM of A and of B on the paired steps.
    pub em_a: f64,
    pub em_b: f64,
    /// `EM(B) − EM(A)` with its interval (`None` without resamples).
    pub advantage: f64,
    pub interval: Option<Interval>,
    pub bootstrap: BootstrapConfig,
    /// Steps present in only one report (not compared).
    pub only_in_a: usize,
    pub only_in_b: usize,
}

/// Compares report `b` against report `a` (names are for the table).
pub fn compare(
    a: &EvalReport,
    b: &EvalReport,
    names: (&str, &str),
    bootstrap: BootstrapConfig,
) -> Result<Comparison> {
    for (r, name) in [(a, names.0), (b, names.1)] {
        if r.steps.is_empty() {
            return Err(Error::InvalidRequest(format!(
                "{name}: the report has no per-step verdicts (`steps`); write it again with this recall's `eval --json`"
            )));
        }
    }
    if a.scorer != b.scorer {
        return Err(Error::InvalidRequest(format!(
            "{} was scored with `{}` and {} with `{}`: rerun one of them with the other's --scorer",
            names.0, a.scorer, names.1, b.scorer
        )));
    }
    if a.platform != b.platform {
        return Err(Error::InvalidRequest(format!(
            "{} is a {} report and {} a {} one",
            names.0, a.platform, names.1, b.platform
        )));
    }
    let b_rows: HashMap<(&str, u32), &StepVerdict> = b
        .steps
        .iter()
        .map(|r| ((r.episode.as_str(), r.step), &r.verdict))
        .collect();
    let mut clusters: BTreeMap<&str, PairCounts> = BTreeMap::new();
    let mut against_plain = AgainstPlain::default();
    let mut paired = 0;
    for r in &a.steps {
        if let Some(&bv) = b_rows.get(&(r.episode.as_str(), r.step)) {
            clusters
                .entry(&r.episode)
                .or_default()
                .add(r.verdict.second.em, bv.second.em);
            against_plain.add(&r.verdict, bv);
            paired += 1;
        }
    }
    if paired == 0 {
        return Err(Error::InvalidRequest(format!(
            "{} and {} share no (episode, step)",
            names.0, names.1
        )));
    }
    let mut counts = PairCounts::default();
    clusters.values().for_each(|c| counts.merge(c));
    let eps: Vec<&PairCounts> = clusters.values().collect();
    let interval = (bootstrap.resamples > 0).then(|| {
        let mut rng = SplitMix64(bootstrap.seed);
        let mut samples = Vec::with_capacity(bootstrap.resamples);
        for _ in 0..bootstrap.resamples {
            let mut c = PairCounts::default();
            for _ in 0..eps.len() {
                c.merge(eps[rng.below(eps.len())]);
            }
            samples.push(c.advantage());
        }
        percentile_interval(&mut samples, bootstrap.confidence)
    });
    let n = counts.steps as f64;
    Ok(Comparison {
        a: names.0.to_string(),
        b: names.1.to_string(),
        episodes: eps.len(),
        against_plain,
        pairwise: counts,
        em_a: (counts.both_right + counts.only_a_right) as f64 / n,
        em_b: (counts.both_right + counts.only_b_right) as f64 / n,
        advantage: counts.advantage(),
        interval,
        bootstrap,
        only_in_a: a.steps.len() - paired,
        only_in_b: b.steps.len() - paired,
    })
}

impl Comparison {
    /// The comparison as Markdown: the tally against the plain actor (the paper's Table 3 columns),
    /// the pairwise tally and the paired advantage.
    pub fn to_markdown(&self) -> String {
        let c = &self.pairwise;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "B = `{}` against A = `{}`: {} paired steps of {} episodes{}.\n",
            self.b,
            self.a,
            c.steps,
            self.episodes,
            if self.only_in_a + self.only_in_b > 0 {
                format!(
                    " ({} steps only in A, {} only in B, not compared)",
                    self.only_in_a, self.only_in_b
                )
            } else {
                String::new()
            }
        );
        self.plain_markdown(&mut s);
        let _ = writeln!(s, "\n| pairwise | steps |\n|---|---:|");
        let _ = writeln!(s, "| both right | {} |", c.both_right);
        let _ = writeln!(s, "| only A right | {} |", c.only_a_right);
        let _ = writeln!(s, "| only B right | {} |", c.only_b_right);
        let _ = writeln!(s, "| neither | {} |", c.neither);
        let ci = match self.interval {
            Some(i) => format!(
                " ({:.0}% CI [{:+.4}, {:+.4}], episode bootstrap)",
                self.bootstrap.confidence * 100.0,
                i.lo,
                i.hi
            ),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "\nEM: A {:.4}, B {:.4}; paired advantage of B {:+.4}{ci}",
            self.em_a, self.em_b, self.advantage
        );
        s
    }

    fn plain_markdown(&self, s: &mut String) {
        let p = &self.against_plain;
        let o = &p.only_one;
        let _ = writeln!(
            s,
            "Against the plain actor (a0; {} steps, {} right, {} wrong):\n",
            p.steps, p.plain_right, p.plain_wrong
        );
        let _ = writeln!(
            s,
            "| repairs / harms B | repairs / harms A | only one keeps (B/A) | only one repairs (B/A) |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|");
        let _ = writeln!(
            s,
            "| {}/{} | {}/{} | {}/{} | {}/{} |",
            p.b.repairs, p.b.harms, p.a.repairs, p.a.harms, o.keeps_b, o.keeps_a, o.repairs_b, o.repairs_a
        );
        if p.plain_disagrees > 0 {
            let _ = writeln!(
                s,
                "\n{} paired steps have a0 judged differently by the two reports (not counted above).",
                p.plain_disagrees
            );
        }
    }
}
