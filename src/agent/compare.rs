//! Two systems on the same steps (`recall eval --compare A.json B.json`): which steps only one of
//! them gets right, and the paired advantage of B over A with an episode-bootstrap interval.
//!
//! Both inputs are `recall eval --json` reports. Steps are paired by (episode, step); each system
//! is judged by its final answer (the second opinion; for a plain actor run it equals the first) on
//! full-action match (EM). For the N paired steps: **keeps** = both right, **repairs** = B right
//! where A is wrong, **harms** = A right where B is wrong, and the **paired advantage**
//! `(repairs − harms) / N = EM(B) − EM(A)`. Its interval resamples whole episodes with replacement
//! (steps of one episode are not independent), percentile method, seeded.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::Serialize;

use crate::agent::eval::{percentile_interval, BootstrapConfig, EvalReport, Interval, SplitMix64};
use crate::error::{Error, Result};

/// Counts over paired steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PairCounts {
    pub steps: usize,
    pub keeps: usize,
    pub repairs: usize,
    pub harms: usize,
    pub neither: usize,
}

impl PairCounts {
    fn add(&mut self, a: bool, b: bool) {
        self.steps += 1;
        match (a, b) {
            (true, true) => self.keeps += 1,
            (false, true) => self.repairs += 1,
            (true, false) => self.harms += 1,
            (false, false) => self.neither += 1,
        }
    }

    fn merge(&mut self, o: &PairCounts) {
        self.steps += o.steps;
        self.keeps += o.keeps;
        self.repairs += o.repairs;
        self.harms += o.harms;
        self.neither += o.neither;
    }

    /// `(repairs − harms) / steps`.
    pub fn advantage(&self) -> f64 {
        (self.repairs as f64 - self.harms as f64) / self.steps.max(1) as f64
    }
}

/// The comparison of B against A.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    pub episodes: usize,
    pub counts: PairCounts,
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
    let b_rows: HashMap<(&str, u32), bool> = b
        .steps
        .iter()
        .map(|r| ((r.episode.as_str(), r.step), r.verdict.second.em))
        .collect();
    let mut clusters: BTreeMap<&str, PairCounts> = BTreeMap::new();
    let mut paired = 0;
    for r in &a.steps {
        if let Some(&b_right) = b_rows.get(&(r.episode.as_str(), r.step)) {
            clusters
                .entry(&r.episode)
                .or_default()
                .add(r.verdict.second.em, b_right);
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
        counts,
        em_a: (counts.keeps + counts.harms) as f64 / n,
        em_b: (counts.keeps + counts.repairs) as f64 / n,
        advantage: counts.advantage(),
        interval,
        bootstrap,
        only_in_a: a.steps.len() - paired,
        only_in_b: b.steps.len() - paired,
    })
}

impl Comparison {
    /// The comparison as a Markdown table.
    pub fn to_markdown(&self) -> String {
        let c = &self.counts;
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
        let _ = writeln!(s, "| | steps |\n|---|---:|");
        let _ = writeln!(s, "| both right (keeps) | {} |", c.keeps);
        let _ = writeln!(s, "| only B right (repairs) | {} |", c.repairs);
        let _ = writeln!(s, "| only A right (harms) | {} |", c.harms);
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
}
