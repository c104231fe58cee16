//! Utility labels for the learned selector: scoring `Q(S)` through the engine, the JSONL label file
//! (docs/FORMATS.md "Utility labels") and reading it back as training data
//! ([`crate::memory::selector_train`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::action::parse_response;
use crate::agent::causalcache::{context, prompt_for, EpisodeMemo};
use crate::engine::Session;
use crate::error::{Error, Result};
use crate::memory::episode::Episode;
use crate::memory::protocol::Protocol;
use crate::memory::selector::{ActionBucket, DecisionContext, EventInfo};
use crate::memory::selector_train::LabelledDecision;
use crate::model::AdapterMode;

/// One utility label: Q(S), the mean log-probability of the recorded response given the prompt
/// rendered with allocation S.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UtilityLabel {
    pub t: usize,
    /// singleton | recent | beam
    pub kind: &'static str,
    pub set: Vec<usize>,
    pub q: f64,
    pub sum_logprob: f64,
    pub tokens: usize,
}

/// What a label file was made with, written into every record (`made_with`), so that labels from
/// different policies, adapters or pixel budgets are never mixed unknowingly (docs/FORMATS.md).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LabelSource {
    /// The model directory as given.
    pub model: String,
    /// The HGKV adapter as given, if one was loaded.
    pub adapter: Option<String>,
    /// Where the adapter acted while scoring (`off` without one).
    pub adapter_mode: &'static str,
    /// The loaded adapter's rank, alpha, projections and layers ([`crate::model::hgkv::Adapter::layout`]).
    pub adapter_layout: Option<String>,
    /// The prompt protocol.
    pub protocol: &'static str,
    /// The screenshots' pixel budget (the preprocessor's bounds on resized height x width).
    pub min_pixels: usize,
    pub max_pixels: usize,
    /// The recall version that scored them.
    pub recall: &'static str,
}

/// One line of a label file: the label, its episode and what it was made with.
#[derive(Debug, Clone, Serialize)]
pub struct LabelRecord<'a> {
    /// The episode directory as given.
    pub episode: &'a str,
    #[serde(flatten)]
    pub label: &'a UtilityLabel,
    pub made_with: &'a LabelSource,
}

/// The line that precedes a decision's labels: the selector's view of the decision, so that a label
/// file alone is training data (`kind` = `decision`).
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord<'a> {
    pub episode: &'a str,
    pub t: usize,
    pub kind: &'static str,
    pub context: ContextJson,
    pub made_with: &'a LabelSource,
}

/// A [`DecisionContext`] as JSON: image hashes as 16 hex digits (JSON numbers lose u64 precision
/// in many readers), points as `[x, y]` on the 0–999 grid or `null`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextJson {
    pub reference_point: Option<[f64; 2]>,
    pub events: Vec<EventJson>,
}

/// One event of a [`ContextJson`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventJson {
    pub step: usize,
    pub image_hash: String,
    /// click | type | key | scroll | other
    pub next_bucket: String,
    pub next_point: Option<[f64; 2]>,
    pub witness: bool,
}

fn bucket_name(b: ActionBucket) -> &'static str {
    match b {
        ActionBucket::Click => "click",
        ActionBucket::Type => "type",
        ActionBucket::Key => "key",
        ActionBucket::Scroll => "scroll",
        ActionBucket::Other => "other",
    }
}

impl ContextJson {
    /// The JSON form of `ctx` (its `t` goes on the line).
    pub fn of(ctx: &DecisionContext) -> Self {
        ContextJson {
            reference_point: ctx.reference_point.map(|(x, y)| [x, y]),
            events: ctx
                .events
                .iter()
                .map(|e| EventJson {
                    step: e.step,
                    image_hash: format!("{:016x}", e.image_hash),
                    next_bucket: bucket_name(e.next_bucket).into(),
                    next_point: e.next_point.map(|(x, y)| [x, y]),
                    witness: e.witness,
                })
                .collect(),
        }
    }

    /// Back to a [`DecisionContext`] of decision `t`; errors name the bad field.
    pub fn to_context(&self, t: usize) -> Result<DecisionContext> {
        let events = self
            .events
            .iter()
            .map(|e| {
                let image_hash = u64::from_str_radix(&e.image_hash, 16).map_err(|_| {
                    Error::InvalidRequest(format!(
                        "event {}: image_hash `{}` is not 16 hex digits",
                        e.step, e.image_hash
                    ))
                })?;
                let next_bucket = match e.next_bucket.as_str() {
                    "click" => ActionBucket::Click,
                    "type" => ActionBucket::Type,
                    "key" => ActionBucket::Key,
                    "scroll" => ActionBucket::Scroll,
                    "other" => ActionBucket::Other,
                    other => {
                        return Err(Error::InvalidRequest(format!(
                            "event {}: next_bucket `{other}` (expected click, type, key, scroll or other)",
                            e.step
                        )))
                    }
                };
                Ok(EventInfo {
                    step: e.step,
                    image_hash,
                    next_bucket,
                    next_point: e.next_point.map(|[x, y]| (x, y)),
                    witness: e.witness,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ctx = DecisionContext {
            t,
            reference_point: self.reference_point.map(|[x, y]| (x, y)),
            events,
        };
        crate::memory::selector::FeatureContext::new(&ctx)?; // validation
        Ok(ctx)
    }
}

/// The selector's view of decision `t` for training: the events of the protocol's eligible steps,
/// with `witness` judged against the *recorded* action of decision `t` (at deployment the reference
/// is pass 1's proposal; offline the record is the teacher).
pub fn label_context(
    episode: &Episode,
    t: usize,
    protocol: Protocol,
    memo: &mut EpisodeMemo,
) -> Result<DecisionContext> {
    let decision = episode.decision(t)?;
    let reference = decision
        .reference
        .and_then(|r| parse_response(r, episode.platform).ok());
    let mut ctx = context(episode, &decision, reference.as_ref(), memo)?;
    let pool = protocol.eligible(t - 1);
    ctx.events.retain(|e| pool.contains(&e.step));
    Ok(ctx)
}

/// Labels every decision of `episode` that has a recorded response and appends the JSONL lines (a
/// `decision` line, then its labels) to `out`. `name` is the episode as the lines record it.
#[allow(clippy::too_many_arguments)]
pub fn label_episode(
    s: &mut dyn Session,
    episode: &Episode,
    name: &str,
    protocol: Protocol,
    budgets: &[usize],
    adapter: AdapterMode,
    made_with: &LabelSource,
    out: &mut String,
) -> Result<usize> {
    let mut memo = EpisodeMemo::default();
    let bar = indicatif::ProgressBar::new(episode.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("labelling {bar:30} {pos}/{len} decisions")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut lines = 0;
    for t in 1..=episode.len() {
        let ctx = label_context(episode, t, protocol, &mut memo)?;
        out.push_str(&json_line(&DecisionRecord {
            episode: name,
            t,
            kind: "decision",
            context: ContextJson::of(&ctx),
            made_with,
        })?);
        for label in utility_labels(s, episode, t, protocol, budgets, adapter)? {
            out.push_str(&json_line(&LabelRecord {
                episode: name,
                label: &label,
                made_with,
            })?);
            lines += 1;
        }
        tracing::info!(t, "labelled");
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(lines)
}

/// One JSON line of a record.
fn json_line<T: Serialize>(record: &T) -> Result<String> {
    let mut s =
        serde_json::to_string(record).map_err(|e| Error::InvalidRequest(format!("label line: {e}")))?;
    s.push('\n');
    Ok(s)
}

/// Utility labels of decision `t` (which must have a recorded response): singletons over the whole
/// pool, Recent-B anchors for `0` and every budget in `budgets`, and beam-teacher sets (shortlist the top 6
/// singletons, beam 3, up to the largest budget). Every set is scored as a complete prompt; the
/// sets of one level are scored in one shared-prefix call, through the loaded adapter as `adapter`
/// says (the paper re-scores through the frozen HGKV policy: `Gated`).
pub fn utility_labels(
    s: &mut dyn Session,
    episode: &Episode,
    t: usize,
    protocol: Protocol,
    budgets: &[usize],
    adapter: AdapterMode,
) -> Result<Vec<UtilityLabel>> {
    let decision = episode.decision(t)?;
    let reference = decision
        .reference
        .ok_or_else(|| Error::InvalidRequest(format!("decision {t} has no recorded response to label")))?;
    let target = s.tokenizer().encode(reference)?;
    let pool: Vec<usize> = protocol.eligible(t - 1).collect();
    let score_sets = |s: &mut dyn Session, sets: &[Vec<usize>]| -> Result<Vec<(f64, f64)>> {
        let pairs = sets
            .iter()
            .map(|set| Ok((prompt_for(s, protocol, &decision, set)?, target.clone())))
            .collect::<Result<Vec<_>>>()?;
        Ok(s.score_many(&pairs, adapter)?
            .into_iter()
            .map(|score| (score.mean_logprob, score.sum_logprob))
            .collect())
    };
    let label = |kind, set: &Vec<usize>, (q, sum): (f64, f64)| UtilityLabel {
        t,
        kind,
        set: set.clone(),
        q,
        sum_logprob: sum,
        tokens: target.len(),
    };
    let mut labels = Vec::new();
    let singles: Vec<Vec<usize>> = pool.iter().map(|&j| vec![j]).collect();
    let single_q = score_sets(s, &singles)?;
    labels.extend(
        singles
            .iter()
            .zip(&single_q)
            .map(|(s, q)| label("singleton", s, *q)),
    );
    // The empty set is always scored: every singleton's marginal is taken against it.
    let mut anchor_budgets: Vec<usize> = std::iter::once(0).chain(budgets.iter().copied()).collect();
    anchor_budgets.sort_unstable();
    anchor_budgets.dedup();
    let mut anchors: Vec<Vec<usize>> = Vec::new();
    for b in anchor_budgets {
        let set = protocol.recent_b(t - 1, b);
        if !anchors.contains(&set) {
            anchors.push(set); // early decisions: several budgets give the same window
        }
    }
    let anchor_q = score_sets(s, &anchors)?;
    labels.extend(anchors.iter().zip(&anchor_q).map(|(s, q)| label("recent", s, *q)));

    // Beam teacher: grow sets from the best singletons.
    let mut ranked: Vec<(usize, f64)> = pool.iter().copied().zip(single_q.iter().map(|q| q.0)).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    let shortlist: Vec<usize> = ranked.iter().take(6).map(|r| r.0).collect();
    let max_size = budgets.iter().copied().max().unwrap_or(0).min(shortlist.len());
    let mut beam: Vec<Vec<usize>> = shortlist.iter().take(3).map(|&j| vec![j]).collect();
    for _ in 1..max_size {
        let mut children: Vec<Vec<usize>> = Vec::new();
        for parent in &beam {
            for &c in shortlist.iter().filter(|c| !parent.contains(c)) {
                let mut s = parent.clone();
                s.push(c);
                s.sort_unstable();
                if !children.contains(&s) {
                    children.push(s);
                }
            }
        }
        if children.is_empty() {
            break;
        }
        let qs = score_sets(s, &children)?;
        let mut scored: Vec<(Vec<usize>, (f64, f64))> = children.into_iter().zip(qs).collect();
        labels.extend(scored.iter().map(|(s, q)| label("beam", s, *q)));
        scored.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        beam = scored.into_iter().take(3).map(|(s, _)| s).collect();
    }
    Ok(labels)
}

/// Label files read back as training data.
#[derive(Debug, Clone)]
pub struct LabelSet {
    /// Every decision with its labels, in file order.
    pub decisions: Vec<LabelledDecision>,
    /// The `made_with` of the first line (all lines agree unless mixing was allowed).
    pub made_with: Value,
    /// Label lines read (decision lines not counted).
    pub labels: usize,
}

/// Reads label files written by `recall episode label`. Every line must carry `episode` and
/// `made_with`; each decision needs its `decision` line; lines whose `made_with` differs from the
/// first file's are an error unless `allow_mixed` (labels of different policies measure different
/// things). Errors name the file, the line and the field.
pub fn read_labels(paths: &[PathBuf], allow_mixed: bool) -> Result<LabelSet> {
    let mut contexts: BTreeMap<(String, usize), DecisionContext> = BTreeMap::new();
    type Key = (String, usize);
    let mut sets: BTreeMap<Key, Vec<(Vec<usize>, f64)>> = BTreeMap::new();
    let mut order: Vec<(String, usize)> = Vec::new();
    let mut made_with: Option<(Value, String)> = None;
    let mut labels = 0;
    for path in paths {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = format!("{}:{}", path.display(), i + 1);
            let bad = |m: String| Error::InvalidRequest(format!("{at}: {m}"));
            let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
            let field = |name: &str| v.get(name).ok_or_else(|| bad(format!("no field `{name}`")));
            let episode = field("episode")
                .map_err(|e| {
                    Error::InvalidRequest(format!(
                        "{e} (a label file from an older recall: label the episode again with `recall episode label`)"
                    ))
                })?
                .as_str()
                .ok_or_else(|| bad("field `episode`: expected a string".into()))?
                .to_string();
            let t = field("t")?
                .as_u64()
                .filter(|&t| t >= 1)
                .ok_or_else(|| bad("field `t`: expected an integer >= 1".into()))?
                as usize;
            let mw = field("made_with")?.clone();
            match &made_with {
                None => made_with = Some((mw, at.clone())),
                Some((first, first_at)) if *first != mw && !allow_mixed => {
                    return Err(bad(format!(
                        "field `made_with` differs from {first_at}'s ({mw} vs {first}); labels made with \
                         different models, adapters or pixel budgets measure different policies \
                         (--allow-mixed to train on them anyway)"
                    )))
                }
                Some(_) => {}
            }
            let key = (episode, t);
            let kind = field("kind")?
                .as_str()
                .ok_or_else(|| bad("field `kind`: expected a string".into()))?;
            if kind == "decision" {
                let cj: ContextJson = serde_json::from_value(field("context")?.clone())
                    .map_err(|e| bad(format!("field `context`: {e}")))?;
                let ctx = cj
                    .to_context(t)
                    .map_err(|e| bad(format!("field `context`: {e}")))?;
                if contexts.insert(key.clone(), ctx).is_some() {
                    return Err(bad(format!("a second decision line for episode {} t={t}", key.0)));
                }
                order.push(key);
                continue;
            }
            let set: Vec<usize> = serde_json::from_value(field("set")?.clone())
                .map_err(|e| bad(format!("field `set`: expected an array of steps ({e})")))?;
            if set.windows(2).any(|w| w[0] >= w[1]) {
                return Err(bad(format!("field `set`: {set:?} is not strictly increasing")));
            }
            let q = field("q")?
                .as_f64()
                .filter(|q| q.is_finite())
                .ok_or_else(|| bad("field `q`: expected a finite number".into()))?;
            sets.entry(key).or_default().push((set, q));
            labels += 1;
        }
    }
    for key in sets.keys() {
        if !contexts.contains_key(key) {
            return Err(Error::InvalidRequest(format!(
                "labels of episode {} t={} have no `decision` line (label the episode again with this recall)",
                key.0, key.1
            )));
        }
    }
    let decisions = order
        .into_iter()
        .filter_map(|key| {
            let utilities = sets.remove(&key)?;
            let context = contexts.remove(&key)?;
            Some(LabelledDecision {
                episode: key.0,
                context,
                utilities,
            })
        })
        .collect();
    Ok(LabelSet {
        decisions,
        made_with: made_with.map(|m| m.0).unwrap_or(Value::Null),
        labels,
    })
}

/// The episode name label lines record for `dir` (the directory as given).
pub fn episode_name(dir: &Path) -> String {
    dir.display().to_string()
}
