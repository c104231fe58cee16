//! Offline CausalCache over recorded episodes: the beam oracle with true utilities from the engine,
//! and the evaluation of an allocation policy (full-action match and the log-likelihood margin of
//! its sets over Recent-B on the recorded response, with episode-clustered bootstrap intervals).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Serialize;

use crate::action::{equivalent, parse_response};
use crate::agent::causalcache::{prompt_for, EpisodeMemo, StepReport};
use crate::agent::chart::{write_margin_histogram, MarginPoint};
use crate::agent::eval::{percentile_interval, BootstrapConfig, Interval, SplitMix64};
use crate::agent::labels::label_context;
use crate::engine::Session;
use crate::error::{Error, Result};
use crate::memory::episode::Episode;
use crate::memory::policy::{AllocationPolicy, PolicyInputs};
use crate::memory::protocol::Protocol;
use crate::memory::selector::{beam_search, DecisionContext, FeatureContext};
use crate::model::AdapterMode;

/// What the oracle scores with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OracleConfig {
    pub protocol: Protocol,
    pub budget: usize,
    /// Where the adapter acts while scoring (the policy being served).
    pub adapter: AdapterMode,
    /// Sets kept per level and children per parent.
    pub beam_width: usize,
    /// Most chosen events outside Recent-B (`None`: unlimited).
    pub max_replacements: Option<usize>,
}

/// The oracle's choice at one decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OracleChoice {
    pub t: usize,
    /// The returned allocation.
    pub steps: Vec<usize>,
    /// The beam's best set `S*` and `Q(S*)` (absent when the pool could not fill the budget).
    pub best: Option<(Vec<usize>, f64)>,
    /// `Q(Recent-B)`.
    pub q_recent: f64,
    /// Recent-B was returned: the pool was too small, or `Q(S*) < Q(Recent-B)`.
    pub fell_back: bool,
    /// Distinct prompts scored.
    pub sets_scored: usize,
}

/// The beam oracle at decision `t` (which needs a recorded response): the reference beam of the
/// selector (from the empty set over the deduplicated pool, `beam_width` sets and children per
/// parent) ranking children by their true utility `Q(S)` — the mean log-probability of the recorded
/// response with `S` restored — then Recent-B whenever `Q(S*) < Q(Recent-B)`. The children of one
/// parent are scored in one shared-prefix call; every set is scored once.
pub fn oracle_allocation(
    s: &mut dyn Session,
    episode: &Episode,
    t: usize,
    cfg: &OracleConfig,
    memo: &mut EpisodeMemo,
) -> Result<OracleChoice> {
    let decision = episode.decision(t)?;
    let reference = decision.reference.ok_or_else(|| {
        Error::InvalidRequest(format!(
            "the oracle needs the recorded response of decision {t}, which the episode does not have"
        ))
    })?;
    let target = s.tokenizer().encode(reference)?;
    let ctx = label_context(episode, t, cfg.protocol, memo)?;
    let pool = FeatureContext::new(&ctx)?.pool().to_vec();
    let recent = cfg.protocol.recent_b(t - 1, cfg.budget);
    let mut cache: HashMap<Vec<usize>, f64> = HashMap::new();
    let mut score = |s: &mut dyn Session, sets: &[Vec<usize>]| -> Result<Vec<f64>> {
        let todo: Vec<&Vec<usize>> = sets.iter().filter(|set| !cache.contains_key(*set)).collect();
        if !todo.is_empty() {
            let pairs = todo
                .iter()
                .map(|set| Ok((prompt_for(s, cfg.protocol, &decision, set)?, target.clone())))
                .collect::<Result<Vec<_>>>()?;
            for (set, sc) in todo.iter().zip(s.score_many(&pairs, cfg.adapter)?) {
                cache.insert((*set).clone(), sc.mean_logprob);
            }
        }
        Ok(sets.iter().map(|set| cache[set]).collect())
    };
    let q_recent = score(s, std::slice::from_ref(&recent))?[0];
    let fill = cfg.budget > 0 && ctx.events.len() > cfg.budget && pool.len() >= cfg.budget;
    let best = if fill {
        let width = cfg.beam_width.max(1);
        beam_search(
            &pool,
            cfg.budget,
            &recent,
            cfg.max_replacements,
            width,
            width,
            |parent, _acc, candidates, out| {
                let children: Vec<Vec<usize>> = candidates
                    .iter()
                    .map(|&c| {
                        let mut child = parent.to_vec();
                        child.push(c);
                        child.sort_unstable();
                        child
                    })
                    .collect();
                out.clear();
                out.extend(score(s, &children)?.into_iter().map(|u| (u, u)));
                Ok(())
            },
        )?
    } else {
        None
    };
    let (steps, fell_back) = match &best {
        Some((set, q)) if *q >= q_recent => (set.clone(), false),
        _ => (recent.clone(), true),
    };
    Ok(OracleChoice {
        t,
        steps,
        best,
        q_recent,
        fell_back,
        sets_scored: cache.len(),
    })
}

/// The oracle's allocation at every decision of `episode` that has a recorded response, by step.
pub fn oracle_allocations(
    s: &mut dyn Session,
    episode: &Episode,
    cfg: &OracleConfig,
) -> Result<Vec<OracleChoice>> {
    let mut memo = EpisodeMemo::default();
    let bar = indicatif::ProgressBar::new(episode.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("oracle {bar:30} {pos}/{len} decisions")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut out = Vec::with_capacity(episode.len());
    for t in 1..=episode.len() {
        let c = oracle_allocation(s, episode, t, cfg, &mut memo)?;
        tracing::info!(t, steps = ?c.steps, fell_back = c.fell_back, sets = c.sets_scored, "oracle");
        out.push(c);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// Allocations decided beforehand (the oracle's), served by decision step.
#[derive(Debug, Clone, Default)]
pub struct Given {
    pub by_step: HashMap<usize, Vec<usize>>,
}

impl Given {
    /// The oracle's choices as a policy.
    pub fn from_oracle(choices: &[OracleChoice]) -> Self {
        Given {
            by_step: choices.iter().map(|c| (c.t, c.steps.clone())).collect(),
        }
    }
}

impl AllocationPolicy for Given {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        _budget: usize,
        _extra: &PolicyInputs,
    ) -> Result<Vec<usize>> {
        self.by_step
            .get(&ctx.t)
            .cloned()
            .ok_or_else(|| Error::InvalidRequest(format!("no allocation was decided for decision {}", ctx.t)))
    }
}

// ---------------------------------------------------------------------------------------------------
// Evaluation.

/// One evaluated decision.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct EvalStep {
    pub episode: String,
    pub t: usize,
    pub recent: Vec<usize>,
    pub allocation: Vec<usize>,
    pub k: usize,
    /// The step's final action is equivalent to the recorded one.
    pub matches: bool,
    /// Pass 1's (Recent-B's) action is equivalent to the recorded one.
    pub recent_matches: bool,
    /// `Q(S)` and `Q(Recent-B)` on the recorded response.
    pub q: f64,
    pub q_recent: f64,
    /// `Q(S) − Q(Recent-B)`; exactly 0 when `S` is Recent-B.
    pub margin: f64,
}

/// The evaluation steps of one replayed episode: each report with a recorded response, its match
/// against the record, and the margin of its allocation over Recent-B (both sets scored in one
/// shared-prefix call).
pub fn evaluate_steps(
    s: &mut dyn Session,
    episode: &Episode,
    name: &str,
    reports: &[StepReport],
    protocol: Protocol,
    adapter: AdapterMode,
) -> Result<Vec<EvalStep>> {
    let mut out = Vec::new();
    for r in reports {
        let decision = episode.decision(r.t)?;
        let Some(reference) = decision.reference else {
            continue;
        };
        let target = s.tokenizer().encode(reference)?;
        let sets: Vec<&Vec<usize>> = if r.allocation == r.recent {
            vec![&r.recent]
        } else {
            vec![&r.allocation, &r.recent]
        };
        let pairs = sets
            .iter()
            .map(|set| Ok((prompt_for(s, protocol, &decision, set)?, target.clone())))
            .collect::<Result<Vec<_>>>()?;
        let q: Vec<f64> = s
            .score_many(&pairs, adapter)?
            .iter()
            .map(|x| x.mean_logprob)
            .collect();
        let (q_s, q_r) = (q[0], *q.last().unwrap_or(&q[0]));
        let record = parse_response(reference, episode.platform).ok();
        let recent_matches = match (&record, parse_response(&r.proposal, episode.platform)) {
            (Some(a), Ok(b)) => equivalent(&b, a, episode.platform),
            _ => false,
        };
        out.push(EvalStep {
            episode: name.to_string(),
            t: r.t,
            recent: r.recent.clone(),
            allocation: r.allocation.clone(),
            k: r.k,
            matches: r.matches_record == Some(true),
            recent_matches,
            q: q_s,
            q_recent: q_r,
            margin: if r.allocation == r.recent { 0.0 } else { q_s - q_r },
        });
    }
    Ok(out)
}

/// A statistic with its episode-clustered bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    pub value: f64,
    pub interval: Option<Interval>,
}

/// The evaluation of one policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyEvaluation {
    pub policy: String,
    pub budget: usize,
    pub episodes: usize,
    pub steps: usize,
    /// Steps whose allocation differs from Recent-B (pass 2 ran).
    pub reallocated: usize,
    pub mean_k: f64,
    /// Full-action match rate of the policy's final actions.
    pub action_match: Estimate,
    /// The same for Recent-B (pass 1).
    pub recent_action_match: Estimate,
    /// `action_match − recent_action_match`, paired.
    pub match_gain: Estimate,
    /// Mean `Q(S) − Q(Recent-B)` over steps.
    pub mean_margin: Estimate,
    pub bootstrap: BootstrapConfig,
    pub rows: Vec<EvalStep>,
}

fn stats(rows: &[&EvalStep]) -> [f64; 4] {
    let n = rows.len().max(1) as f64;
    let m = rows.iter().filter(|r| r.matches).count() as f64 / n;
    let r = rows.iter().filter(|r| r.recent_matches).count() as f64 / n;
    let margin = rows.iter().map(|r| r.margin).sum::<f64>() / n;
    [m, r, m - r, margin]
}

/// Aggregates `rows` with a bootstrap that resamples whole episodes (steps of one episode are not
/// independent).
pub fn summarise(
    policy: &str,
    budget: usize,
    rows: Vec<EvalStep>,
    bootstrap: BootstrapConfig,
) -> PolicyEvaluation {
    let mut by_episode: BTreeMap<&str, Vec<&EvalStep>> = BTreeMap::new();
    for r in &rows {
        by_episode.entry(&r.episode).or_default().push(r);
    }
    let clusters: Vec<&Vec<&EvalStep>> = by_episode.values().collect();
    let all: Vec<&EvalStep> = rows.iter().collect();
    let point = stats(&all);
    let intervals: [Option<Interval>; 4] = if bootstrap.resamples > 0 && !clusters.is_empty() {
        let mut rng = SplitMix64(bootstrap.seed);
        let mut samples: [Vec<f64>; 4] = std::array::from_fn(|_| Vec::with_capacity(bootstrap.resamples));
        let mut pick: Vec<&EvalStep> = Vec::new();
        for _ in 0..bootstrap.resamples {
            pick.clear();
            for _ in 0..clusters.len() {
                pick.extend(clusters[rng.below(clusters.len())].iter().copied());
            }
            for (v, x) in samples.iter_mut().zip(stats(&pick)) {
                v.push(x);
            }
        }
        samples.map(|mut v| Some(percentile_interval(&mut v, bootstrap.confidence)))
    } else {
        [None; 4]
    };
    let est = |i: usize| Estimate {
        value: point[i],
        interval: intervals[i],
    };
    let reallocated = rows.iter().filter(|r| r.allocation != r.recent).count();
    PolicyEvaluation {
        policy: policy.to_string(),
        budget,
        episodes: clusters.len(),
        steps: rows.len(),
        reallocated,
        mean_k: rows.iter().map(|r| r.k as f64).sum::<f64>() / rows.len().max(1) as f64,
        action_match: est(0),
        recent_action_match: est(1),
        match_gain: est(2),
        mean_margin: est(3),
        bootstrap,
        rows,
    }
}

/// What [`merge_evaluations`] reads of one shard's `eval.json`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct EvaluationShard {
    pub policy: String,
    pub budget: usize,
    pub bootstrap: BootstrapConfig,
    pub rows: Vec<EvalStep>,
}

/// The evaluation of the shards' episodes together, as one `recall episode eval` over all of them
/// in shard order computes it: the rows concatenated, then [`summarise`] (bitwise the same report,
/// the bootstrap clusters by episode name whatever the order). The shards must agree on policy,
/// budget and bootstrap settings and share no episode; an error names the shard that does not.
///
/// ```
/// use recall::agent::eval::BootstrapConfig;
/// use recall::agent::offline::{merge_evaluations, EvalStep, EvaluationShard};
/// let row = |ep: &str| EvalStep { episode: ep.into(), t: 1, recent: vec![], allocation: vec![], k: 0,
///     matches: true, recent_matches: false, q: -1.0, q_recent: -1.0, margin: 0.0 };
/// let shard = |ep: &str| EvaluationShard { policy: "recent".into(), budget: 2,
///     bootstrap: BootstrapConfig::default(), rows: vec![row(ep)] };
/// let merged = merge_evaluations(vec![shard("a"), shard("b")]).unwrap();
/// assert_eq!((merged.episodes, merged.steps), (2, 2));
/// assert!(merge_evaluations(vec![shard("a"), shard("a")]).is_err());
/// ```
pub fn merge_evaluations(shards: Vec<EvaluationShard>) -> Result<PolicyEvaluation> {
    let first = shards
        .first()
        .ok_or_else(|| Error::InvalidRequest("merge: no shard given".into()))?;
    let (policy, budget, bootstrap) = (first.policy.clone(), first.budget, first.bootstrap);
    let mut seen = std::collections::HashSet::new();
    let mut rows = Vec::new();
    for (i, shard) in shards.into_iter().enumerate() {
        if (shard.policy.as_str(), shard.budget, shard.bootstrap) != (policy.as_str(), budget, bootstrap) {
            return Err(Error::InvalidRequest(format!(
                "merge: shard {i} evaluated policy `{}` at B = {} with {:?}, shard 0 `{policy}` at B = \
                 {budget} with {bootstrap:?}",
                shard.policy, shard.budget, shard.bootstrap
            )));
        }
        let episodes: std::collections::BTreeSet<&str> =
            shard.rows.iter().map(|r| r.episode.as_str()).collect();
        if let Some(dup) = episodes.iter().find(|e| seen.contains(**e)) {
            return Err(Error::InvalidRequest(format!(
                "merge: episode `{dup}` of shard {i} is in an earlier shard too"
            )));
        }
        seen.extend(episodes.into_iter().map(str::to_string));
        rows.extend(shard.rows);
    }
    Ok(summarise(&policy, budget, rows, bootstrap))
}

impl PolicyEvaluation {
    /// The summary as a Markdown table.
    pub fn to_markdown(&self) -> String {
        let ci = |e: &Estimate, digits: usize| match e.interval {
            Some(i) => format!("[{:.*}, {:.*}]", digits, i.lo, digits, i.hi),
            None => "-".into(),
        };
        let pct = (self.bootstrap.confidence * 100.0).round();
        let mut s = format!(
            "Policy `{}` at B = {}: {} steps of {} episodes; {} reallocated (mean k {:.2}).\n\n",
            self.policy, self.budget, self.steps, self.episodes, self.reallocated, self.mean_k
        );
        s.push_str(&format!(
            "| metric | value | {pct}% CI (episode bootstrap) |\n|---|---:|---|\n"
        ));
        for (name, e, d) in [
            ("full-action match", &self.action_match, 3),
            ("Recent-B full-action match", &self.recent_action_match, 3),
            ("match gain over Recent-B", &self.match_gain, 3),
            ("mean log-likelihood margin over Recent-B", &self.mean_margin, 4),
        ] {
            s.push_str(&format!("| {name} | {:.*} | {} |\n", d, e.value, ci(e, d)));
        }
        s
    }
}

/// A histogram of the per-step margins `Q(S) − Q(Recent-B)` as a PNG
/// ([`write_margin_histogram`]: 24 bins, kept steps grey, reallocated green or red, zero marked).
pub fn write_margin_chart(rows: &[EvalStep], path: &Path) -> Result<()> {
    let points: Vec<MarginPoint> = rows
        .iter()
        .map(|r| MarginPoint {
            margin: r.margin,
            reallocated: r.allocation != r.recent,
        })
        .collect();
    write_margin_histogram(&points, path)
}
