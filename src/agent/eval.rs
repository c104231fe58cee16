//! Step-level evaluation of a two-pass agent: EM, TM, repairs, harms, ΔAcc, bootstrap intervals.
//!
//! Every step has a reference action, a first opinion a0 and a second opinion a1 (ScopeMem: the actor
//! without and with the prefix). Definitions (`docs/EVAL.md`):
//!
//! * **EM** (full action): the output parses ([`parse_response`]) and is [`equivalent`](crate::action::equivalent) to the reference,
//!   or — when the step has a `target_box` and the reference is click-like ([`is_click_like`]) — has the
//!   reference's action name and its point lies inside the box (inclusive).
//! * **TM** (action type): the output parses and its canonical action name equals the reference's
//!   (`click` ≠ `long_press`; desktop `click` is `left_click`).
//! * An output that does not parse is wrong on EM and TM and is counted as unparseable; nothing is guessed.
//!   A reference that does not parse ([`parse_reference`]) is an error.
//! * **Repairs** R: a0 wrong and a1 right (EM); **harms** H: a0 right and a1 wrong; ΔAcc = (R − H)/N, which
//!   equals EM(a1) − EM(a0). Repair rate R / #(a0 wrong), harm rate H / #(a0 right).
//! * **Macro** averages: the unweighted mean over subsets of each subset's rates; **overall** rates are
//!   micro (pooled over all steps).
//! * **Intervals**: stratified trajectory bootstrap — in each of `resamples` rounds, every subset's episodes
//!   are drawn with replacement (as many as it has) and all statistics (per subset, macro, overall) are
//!   recomputed on that draw; the interval is the percentile interval (linear interpolation between order
//!   statistics, NumPy's default). Deterministic for a seed (SplitMix64).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::action::{parse_response, Action, Platform};
use crate::agent::dataset::{is_click_like, parse_reference};
pub use crate::agent::scorers::exact_match;
use crate::agent::scorers::{ScoreContext, Scorer};
use crate::error::{Error, Result};

/// One evaluated step: the reference and both opinions, as response strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// Episode id (the bootstrap's resampling unit).
    pub episode: String,
    /// 0-based step index in the episode.
    pub step: u32,
    /// Subset name, if any.
    pub subset: Option<String>,
    /// The reference: a response, a tool-call JSON object or bare arguments ([`parse_reference`]).
    pub reference: String,
    /// The first opinion a0 (a model response).
    pub first: String,
    /// The second opinion a1 (a model response).
    pub second: String,
    /// Optional target box `[x0, y0, x1, y1]` on the 0–999 grid, inclusive.
    pub target_box: Option<[u32; 4]>,
    /// The step's `ui_annotations` for the `aitw` scorer ([`ScoreContext::ui_annotations`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ui_annotations: Vec<[f64; 4]>,
    /// The step's `candidate_boxes` for the `androidcontrol` scorer ([`ScoreContext::candidate_boxes`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidate_boxes: Vec<[f64; 4]>,
}

/// Bootstrap settings. `resamples == 0` disables the intervals.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BootstrapConfig {
    /// Number of bootstrap rounds.
    pub resamples: usize,
    /// Seed of the SplitMix64 generator.
    pub seed: u64,
    /// Coverage of the percentile interval, in (0, 1).
    pub confidence: f64,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        Self {
            resamples: 1000,
            seed: 0,
            confidence: 0.95,
        }
    }
}

/// How one output scored against the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// The output parsed.
    pub parsed: bool,
    /// Full-action match.
    pub em: bool,
    /// Action-type match.
    pub tm: bool,
}

/// Both verdicts of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepVerdict {
    /// The first opinion's.
    pub first: Verdict,
    /// The second opinion's.
    pub second: Verdict,
}

impl StepVerdict {
    /// a0 wrong, a1 right.
    pub fn repaired(&self) -> bool {
        !self.first.em && self.second.em
    }

    /// a0 right, a1 wrong.
    pub fn harmed(&self) -> bool {
        self.first.em && !self.second.em
    }
}

/// Additive step counts of a group of steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Steps N.
    pub steps: usize,
    /// a0 EM-correct.
    pub em_first: usize,
    /// a1 EM-correct.
    pub em_second: usize,
    /// a0 TM-correct.
    pub tm_first: usize,
    /// a1 TM-correct.
    pub tm_second: usize,
    /// Repairs R.
    pub repairs: usize,
    /// Harms H.
    pub harms: usize,
    /// a0 unparseable.
    pub unparseable_first: usize,
    /// a1 unparseable.
    pub unparseable_second: usize,
}

impl Counts {
    fn add_verdict(&mut self, v: &StepVerdict) {
        self.steps += 1;
        self.em_first += usize::from(v.first.em);
        self.em_second += usize::from(v.second.em);
        self.tm_first += usize::from(v.first.tm);
        self.tm_second += usize::from(v.second.tm);
        self.repairs += usize::from(v.repaired());
        self.harms += usize::from(v.harmed());
        self.unparseable_first += usize::from(!v.first.parsed);
        self.unparseable_second += usize::from(!v.second.parsed);
    }

    fn add(&mut self, o: &Counts) {
        self.steps += o.steps;
        self.em_first += o.em_first;
        self.em_second += o.em_second;
        self.tm_first += o.tm_first;
        self.tm_second += o.tm_second;
        self.repairs += o.repairs;
        self.harms += o.harms;
        self.unparseable_first += o.unparseable_first;
        self.unparseable_second += o.unparseable_second;
    }
}

/// Accuracies as fractions in [0, 1] and ΔAcc in [−1, 1].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// EM of a0.
    pub em_first: f64,
    /// EM of a1.
    pub em_second: f64,
    /// TM of a0.
    pub tm_first: f64,
    /// TM of a1.
    pub tm_second: f64,
    /// (R − H) / N.
    pub delta_acc: f64,
}

impl Rates {
    /// The rates of `c` (`c.steps > 0`).
    pub fn from_counts(c: &Counts) -> Self {
        let n = c.steps as f64;
        Self {
            em_first: c.em_first as f64 / n,
            em_second: c.em_second as f64 / n,
            tm_first: c.tm_first as f64 / n,
            tm_second: c.tm_second as f64 / n,
            delta_acc: (c.repairs as f64 - c.harms as f64) / n,
        }
    }

    fn mean(all: &[Rates]) -> Self {
        let k = all.len() as f64;
        let m = |f: fn(&Rates) -> f64| all.iter().map(f).sum::<f64>() / k;
        Self {
            em_first: m(|r| r.em_first),
            em_second: m(|r| r.em_second),
            tm_first: m(|r| r.tm_first),
            tm_second: m(|r| r.tm_second),
            delta_acc: m(|r| r.delta_acc),
        }
    }

    fn to_array(self) -> [f64; 5] {
        [
            self.em_first,
            self.em_second,
            self.tm_first,
            self.tm_second,
            self.delta_acc,
        ]
    }
}

/// A percentile interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// Lower bound.
    pub lo: f64,
    /// Upper bound.
    pub hi: f64,
}

impl Interval {
    /// `lo ≤ x ≤ hi`.
    pub fn contains(&self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }
}

/// Bootstrap intervals of each rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RateIntervals {
    /// EM of a0.
    pub em_first: Interval,
    /// EM of a1.
    pub em_second: Interval,
    /// TM of a0.
    pub tm_first: Interval,
    /// TM of a1.
    pub tm_second: Interval,
    /// ΔAcc.
    pub delta_acc: Interval,
}

/// The metrics of one subset, or of all steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupReport {
    /// The subset (`None`: steps without a subset; for the overall group, always `None`).
    pub subset: Option<String>,
    /// Distinct episodes.
    pub episodes: usize,
    /// Counts.
    pub counts: Counts,
    /// Rates.
    pub rates: Rates,
    /// R / #(a0 wrong); `None` when a0 is never wrong.
    pub repair_rate: Option<f64>,
    /// H / #(a0 right); `None` when a0 is never right.
    pub harm_rate: Option<f64>,
    /// Bootstrap intervals (`None` when disabled).
    pub intervals: Option<RateIntervals>,
}

/// The unweighted mean over subsets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MacroReport {
    /// Number of subsets averaged.
    pub subsets: usize,
    /// Mean rates.
    pub rates: Rates,
    /// Bootstrap intervals (`None` when disabled).
    pub intervals: Option<RateIntervals>,
}

/// The evaluation report; serialisable to JSON, rendered by [`to_markdown`](Self::to_markdown).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// `mobile` or `desktop`.
    pub platform: String,
    /// The full-action rule of EM (`recall`, `aitw`, `androidcontrol`, `odyssey`).
    #[serde(default = "recall_scorer")]
    pub scorer: String,
    /// The bootstrap settings used.
    pub bootstrap: BootstrapConfig,
    /// Per subset, sorted by name (`None` first).
    pub subsets: Vec<GroupReport>,
    /// Macro average over `subsets`.
    pub macro_avg: MacroReport,
    /// All steps pooled (micro).
    pub overall: GroupReport,
    /// Every step's verdicts, by episode and step (what `recall eval --compare` pairs). Absent in reports
    /// written before it existed.
    #[serde(default)]
    pub steps: Vec<StepRow>,
}

fn recall_scorer() -> String {
    "recall".into()
}

/// One step of a report: where it is and both opinions' verdicts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRow {
    pub episode: String,
    pub step: u32,
    pub subset: Option<String>,
    pub verdict: StepVerdict,
}

/// Action-type match: equal canonical names under the same platform.
pub fn type_match(reference: &Action, candidate: &Action) -> bool {
    reference.platform == candidate.platform && reference.name() == candidate.name()
}

fn verdict(
    reference: &Action,
    output: &str,
    ctx: &ScoreContext,
    platform: Platform,
    scorer: Scorer,
) -> Verdict {
    match parse_response(output, platform) {
        Ok(a) => Verdict {
            parsed: true,
            em: scorer.matches(&a, reference, ctx),
            tm: type_match(reference, &a),
        },
        Err(_) => Verdict {
            parsed: false,
            em: false,
            tm: false,
        },
    }
}

/// Scores every step (same order) with recall's rule. Errors: a reference that does not parse, a
/// target box on a reference that is not click-like or with `x0 > x1`, `y0 > y1` or a value above 999.
pub fn score_steps(steps: &[StepOutcome], platform: Platform) -> Result<Vec<StepVerdict>> {
    score_steps_with(steps, platform, Scorer::Recall)
}

/// [`score_steps`] with a benchmark's full-action rule for EM (`--scorer`); TM is the same for all.
pub fn score_steps_with(
    steps: &[StepOutcome],
    platform: Platform,
    scorer: Scorer,
) -> Result<Vec<StepVerdict>> {
    steps
        .iter()
        .map(|s| {
            let at = || format!("episode `{}` step {}", s.episode, s.step);
            let reference = parse_reference(&s.reference, platform)
                .map_err(|e| Error::InvalidRequest(format!("{}: the reference does not parse: {e}", at())))?;
            if let Some(b) = s.target_box {
                if b[0] > b[2] || b[1] > b[3] || b.iter().any(|&v| v > 999) {
                    return Err(Error::InvalidRequest(format!(
                        "{}: invalid target_box {b:?}",
                        at()
                    )));
                }
                if !is_click_like(&reference) {
                    return Err(Error::InvalidRequest(format!(
                        "{}: target_box given for a `{}` reference",
                        at(),
                        reference.name()
                    )));
                }
            }
            // Every scorer sees every box the step carries; each rule reads only its own.
            let ctx = ScoreContext {
                target_box: s.target_box,
                candidate_boxes: s.candidate_boxes.clone(),
                ui_annotations: s.ui_annotations.clone(),
            };
            Ok(StepVerdict {
                first: verdict(&reference, &s.first, &ctx, platform, scorer),
                second: verdict(&reference, &s.second, &ctx, platform, scorer),
            })
        })
        .collect()
}

/// Per-subset episode clusters (subset → episode → counts), in a deterministic order.
type Clusters = BTreeMap<Option<String>, BTreeMap<String, Counts>>;

/// Evaluates `steps` (see the module docs). Errors: no steps, a repeated (episode, step), a bad
/// reference or target box ([`score_steps`]), a confidence outside (0, 1).
pub fn evaluate(steps: &[StepOutcome], platform: Platform, bootstrap: BootstrapConfig) -> Result<EvalReport> {
    evaluate_with(steps, platform, bootstrap, Scorer::Recall)
}

/// [`evaluate`] with `scorer`'s full-action rule for EM.
pub fn evaluate_with(
    steps: &[StepOutcome],
    platform: Platform,
    bootstrap: BootstrapConfig,
    scorer: Scorer,
) -> Result<EvalReport> {
    if steps.is_empty() {
        return Err(Error::InvalidRequest("evaluate: no steps".into()));
    }
    if !(bootstrap.confidence > 0.0 && bootstrap.confidence < 1.0) {
        return Err(Error::InvalidRequest(format!(
            "bootstrap confidence {} is not in (0, 1)",
            bootstrap.confidence
        )));
    }
    let mut seen = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        if let Some(j) = seen.insert((s.episode.as_str(), s.step), i) {
            return Err(Error::InvalidRequest(format!(
                "episode `{}` step {} appears twice (outcomes {j} and {i})",
                s.episode, s.step
            )));
        }
    }
    let verdicts = score_steps_with(steps, platform, scorer)?;
    let mut clusters: Clusters = BTreeMap::new();
    for (s, v) in steps.iter().zip(&verdicts) {
        clusters
            .entry(s.subset.clone())
            .or_default()
            .entry(s.episode.clone())
            .or_default()
            .add_verdict(v);
    }

    let mut overall = Counts::default();
    let mut subsets = Vec::with_capacity(clusters.len());
    for (name, eps) in &clusters {
        let mut c = Counts::default();
        eps.values().for_each(|e| c.add(e));
        overall.add(&c);
        subsets.push(group(name.clone(), eps.len(), c));
    }
    let mut episode_ids: Vec<&str> = steps.iter().map(|s| s.episode.as_str()).collect();
    episode_ids.sort_unstable();
    episode_ids.dedup();
    let mut overall = group(None, episode_ids.len(), overall);
    let per_subset: Vec<Rates> = subsets.iter().map(|g| g.rates).collect();
    let mut macro_avg = MacroReport {
        subsets: subsets.len(),
        rates: Rates::mean(&per_subset),
        intervals: None,
    };

    if bootstrap.resamples > 0 {
        let (sub_ci, macro_ci, overall_ci) = bootstrap_intervals(&clusters, bootstrap);
        for (g, ci) in subsets.iter_mut().zip(sub_ci) {
            g.intervals = Some(ci);
        }
        macro_avg.intervals = Some(macro_ci);
        overall.intervals = Some(overall_ci);
    }
    let mut rows: Vec<StepRow> = steps
        .iter()
        .zip(&verdicts)
        .map(|(s, v)| StepRow {
            episode: s.episode.clone(),
            step: s.step,
            subset: s.subset.clone(),
            verdict: *v,
        })
        .collect();
    // The report does not depend on the order of the outcomes.
    rows.sort_by(|a, b| (&a.episode, a.step).cmp(&(&b.episode, b.step)));
    Ok(EvalReport {
        platform: platform.as_str().to_string(),
        scorer: scorer.to_string(),
        bootstrap,
        subsets,
        macro_avg,
        overall,
        steps: rows,
    })
}

fn group(subset: Option<String>, episodes: usize, counts: Counts) -> GroupReport {
    let wrong0 = counts.steps - counts.em_first;
    GroupReport {
        subset,
        episodes,
        counts,
        rates: Rates::from_counts(&counts),
        repair_rate: (wrong0 > 0).then(|| counts.repairs as f64 / wrong0 as f64),
        harm_rate: (counts.em_first > 0).then(|| counts.harms as f64 / counts.em_first as f64),
        intervals: None,
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a small, seedable, portable generator.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift; bias below n / 2⁶⁴).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// Percentile interval of `samples` (sorted in place) at `confidence`, NumPy-style linear interpolation.
pub(crate) fn percentile_interval(samples: &mut [f64], confidence: f64) -> Interval {
    samples.sort_by(f64::total_cmp);
    let q = |p: f64| {
        let h = (samples.len() - 1) as f64 * p;
        let (i, f) = (h.floor() as usize, h - h.floor());
        let j = (i + 1).min(samples.len() - 1);
        samples[i] + f * (samples[j] - samples[i])
    };
    let alpha = 1.0 - confidence;
    Interval {
        lo: q(alpha / 2.0),
        hi: q(1.0 - alpha / 2.0),
    }
}

fn intervals(stats: &mut [Vec<f64>; 5], confidence: f64) -> RateIntervals {
    let [a, b, c, d, e] = stats;
    RateIntervals {
        em_first: percentile_interval(a, confidence),
        em_second: percentile_interval(b, confidence),
        tm_first: percentile_interval(c, confidence),
        tm_second: percentile_interval(d, confidence),
        delta_acc: percentile_interval(e, confidence),
    }
}

/// Stratified trajectory bootstrap: (per-subset, macro, overall) intervals.
fn bootstrap_intervals(
    clusters: &Clusters,
    cfg: BootstrapConfig,
) -> (Vec<RateIntervals>, RateIntervals, RateIntervals) {
    let strata: Vec<Vec<Counts>> = clusters.values().map(|m| m.values().copied().collect()).collect();
    let b = cfg.resamples;
    let empty = || -> [Vec<f64>; 5] { std::array::from_fn(|_| Vec::with_capacity(b)) };
    let mut per: Vec<[Vec<f64>; 5]> = strata.iter().map(|_| empty()).collect();
    let mut macro_s = empty();
    let mut overall_s = empty();
    let mut rng = SplitMix64(cfg.seed);
    let mut rates = Vec::with_capacity(strata.len());
    for _ in 0..b {
        rates.clear();
        let mut all = Counts::default();
        for (stratum, out) in strata.iter().zip(per.iter_mut()) {
            let mut c = Counts::default();
            for _ in 0..stratum.len() {
                c.add(&stratum[rng.below(stratum.len())]);
            }
            all.add(&c);
            let r = Rates::from_counts(&c);
            push(out, r);
            rates.push(r);
        }
        push(&mut macro_s, Rates::mean(&rates));
        push(&mut overall_s, Rates::from_counts(&all));
    }
    let per = per.iter_mut().map(|s| intervals(s, cfg.confidence)).collect();
    (
        per,
        intervals(&mut macro_s, cfg.confidence),
        intervals(&mut overall_s, cfg.confidence),
    )
}

fn push(out: &mut [Vec<f64>; 5], r: Rates) {
    for (v, x) in out.iter_mut().zip(r.to_array()) {
        v.push(x);
    }
}

impl EvalReport {
    /// Pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("EvalReport serialises")
    }

    /// A Markdown table: one row per subset, the macro average and the pooled total. Rates in percent
    /// (ΔAcc in percentage points) with the bootstrap interval in brackets.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let b = &self.bootstrap;
        let _ = writeln!(s, "# Step-level evaluation ({})\n", self.platform);
        let _ = writeln!(
            s,
            "EM: full action; TM: action type; a0: first opinion; a1: second opinion; R: repairs (a0 wrong, \
             a1 right); H: harms (a0 right, a1 wrong); ΔAcc = (R − H)/N in pp."
        );
        if b.resamples > 0 {
            let _ = writeln!(
                s,
                "Brackets: {:.0}% trajectory-bootstrap percentile intervals ({} resamples, seed {}).",
                b.confidence * 100.0,
                b.resamples,
                b.seed
            );
        }
        s.push('\n');
        s.push_str(
            "| Subset | Episodes | N | EM a0 | EM a1 | TM a0 | TM a1 | R | H | ΔAcc (pp) | Unparsed a0/a1 |\n",
        );
        s.push_str("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for g in &self.subsets {
            let name = g
                .subset
                .as_deref()
                .map(escape)
                .unwrap_or_else(|| "(none)".to_string());
            row(&mut s, &name, g);
        }
        let m = &self.macro_avg;
        let ci = m
            .intervals
            .map(|c| [c.em_first, c.em_second, c.tm_first, c.tm_second, c.delta_acc]);
        let cell = |i: usize, v: f64| fmt_rate(v, ci.map(|c| c[i]));
        let r = m.rates;
        let _ = writeln!(
            s,
            "| **Macro** ({} subsets) | | | {} | {} | {} | {} | | | {} | |",
            m.subsets,
            cell(0, r.em_first),
            cell(1, r.em_second),
            cell(2, r.tm_first),
            cell(3, r.tm_second),
            cell(4, r.delta_acc)
        );
        row(&mut s, "**All**", &self.overall);
        s
    }
}

fn row(s: &mut String, name: &str, g: &GroupReport) {
    let ci = g
        .intervals
        .map(|c| [c.em_first, c.em_second, c.tm_first, c.tm_second, c.delta_acc]);
    let cell = |i: usize, v: f64| fmt_rate(v, ci.map(|c| c[i]));
    let (r, c) = (g.rates, g.counts);
    let _ = writeln!(
        s,
        "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{} |",
        g.episodes,
        c.steps,
        cell(0, r.em_first),
        cell(1, r.em_second),
        cell(2, r.tm_first),
        cell(3, r.tm_second),
        c.repairs,
        c.harms,
        cell(4, r.delta_acc),
        c.unparseable_first,
        c.unparseable_second
    );
}

fn fmt_rate(v: f64, ci: Option<Interval>) -> String {
    match ci {
        Some(i) => format!("{:.2} [{:.2}, {:.2}]", 100.0 * v, 100.0 * i.lo, 100.0 * i.hi),
        None => format!("{:.2}", 100.0 * v),
    }
}

fn escape(name: &str) -> String {
    name.replace('|', "\\|")
}
