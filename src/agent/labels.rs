//! Utility labels for the learned selector: scoring `Q(S)` through the engine, the JSONL label file
//! (docs/FORMATS.md "Utility labels") and reading it back as training data
//! ([`crate::memory::selector_train`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::action::parse_response;
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
    /// The composition teacher paths were scored too (`--composition-states`, [`utility_labels`]);
    /// written only when set, so files made without them keep their old `made_with`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub composition_states: bool,
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
    /// How many label lines follow: a decision is complete when all of them are in the file (an
    /// interrupted run can leave fewer; `--resume` redoes such a decision).
    pub labels: usize,
    /// The run's `--budgets`, sorted and deduplicated: they decide the Recent-B anchors and the
    /// beam depth, so a resumed run must use the same.
    pub budgets: &'a [usize],
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

/// Labels decisions `first_t..=T` of `episode` (every one needs a recorded response) and hands each
/// decision's JSONL lines to `emit` as one string: its `decision` line (announcing how many label
/// lines follow), then its labels. Emitting a decision whole lets the caller write it in one append,
/// and the count lets a reader tell a decision cut short by a kill from a complete one. `name` is the
/// episode as the lines record it; decisions before `first_t` are taken as already labelled (a
/// resumed run). Returns the number of label lines emitted.
#[allow(clippy::too_many_arguments)]
pub fn label_episode(
    s: &mut dyn Session,
    episode: &Episode,
    name: &str,
    protocol: Protocol,
    budgets: &[usize],
    adapter: AdapterMode,
    made_with: &LabelSource,
    first_t: usize,
    emit: &mut dyn FnMut(String) -> Result<()>,
) -> Result<usize> {
    let mut memo = EpisodeMemo::default();
    let bar = indicatif::ProgressBar::new(episode.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("labelling {bar:30} {pos}/{len} decisions")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(first_t.saturating_sub(1).min(episode.len()) as u64);
    let recorded_budgets = normalized(budgets);
    let mut lines = 0;
    for t in first_t.max(1)..=episode.len() {
        let ctx = label_context(episode, t, protocol, &mut memo)?;
        let paths = TeacherPaths {
            budgets,
            composition: made_with.composition_states,
        };
        let labels = utility_labels(s, episode, t, protocol, &paths, adapter)?;
        let mut group = json_line(&DecisionRecord {
            episode: name,
            t,
            kind: "decision",
            labels: labels.len(),
            budgets: &recorded_budgets,
            context: ContextJson::of(&ctx),
            made_with,
        })?;
        for label in &labels {
            group.push_str(&json_line(&LabelRecord {
                episode: name,
                label,
                made_with,
            })?);
        }
        emit(group)?;
        lines += labels.len();
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

/// Which sets [`utility_labels`] scores besides the singletons.
#[derive(Debug, Clone, Copy)]
pub struct TeacherPaths<'a> {
    /// Recent-B anchors for `0` and each of these; the largest bounds the beam-teacher sets.
    pub budgets: &'a [usize],
    /// Also the states paper composition's first round visits, for every budget: `Recent-B ∖ {e}`
    /// for each recent `e` and `Recent-B ∖ {e} ∪ {j}` for each older `j` (`kind: composition`).
    pub composition: bool,
}

/// Utility labels of decision `t` (which must have a recorded response): singletons over the whole
/// pool, Recent-B anchors for `0` and every budget of `paths`, beam-teacher sets (shortlist the top
/// 6 singletons, beam 3, up to the largest budget), and with `paths.composition` the composition
/// states ([`TeacherPaths`]; a set already scored is not scored again). Every set is scored as a
/// complete prompt; the sets of one level are scored in one shared-prefix call, through the loaded
/// adapter as `adapter` says (the paper re-scores through the frozen HGKV policy: `Gated`).
pub fn utility_labels(
    s: &mut dyn Session,
    episode: &Episode,
    t: usize,
    protocol: Protocol,
    paths: &TeacherPaths<'_>,
    adapter: AdapterMode,
) -> Result<Vec<UtilityLabel>> {
    let budgets = paths.budgets;
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
    if paths.composition {
        let done: std::collections::HashSet<Vec<usize>> = labels.iter().map(|l| l.set.clone()).collect();
        let sets = composition_sets(protocol, t, budgets, &pool, &done);
        let qs = score_sets(s, &sets)?;
        labels.extend(sets.iter().zip(qs).map(|(s, q)| label("composition", s, q)));
    }
    Ok(labels)
}

/// The states the paper composition's first round visits at decision `t` for each budget, minus
/// `done`: `R ∖ {e}` and `R ∖ {e} ∪ {j}` for every `e` of `R` = Recent-B and every `j` of the pool
/// outside `R`; each set sorted, each once, in budget, then `e`, then `j` order.
fn composition_sets(
    protocol: Protocol,
    t: usize,
    budgets: &[usize],
    pool: &[usize],
    done: &std::collections::HashSet<Vec<usize>>,
) -> Vec<Vec<usize>> {
    let mut seen = done.clone();
    let mut out = Vec::new();
    let mut push = |set: Vec<usize>| {
        if seen.insert(set.clone()) {
            out.push(set);
        }
    };
    for &b in &normalized(budgets) {
        let recent = protocol.recent_b(t - 1, b);
        for &e in &recent {
            let rest: Vec<usize> = recent.iter().copied().filter(|&s| s != e).collect();
            push(rest.clone());
            for &j in pool.iter().filter(|j| !recent.contains(j)) {
                let mut with = rest.clone();
                with.insert(with.partition_point(|&s| s < j), j);
                push(with);
            }
        }
    }
    out
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
    let mut reader = LabelReader::new(allow_mixed);
    for path in paths {
        let text = crate::limits::read_capped(path, crate::limits::MAX_DOCUMENT_BYTES)?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = format!("{}:{}", path.display(), i + 1);
            reader.read_line(&text, i, line, &at)?;
        }
    }
    reader.finish()
}

/// What [`read_labels`] has gathered so far.
struct LabelReader {
    allow_mixed: bool,
    contexts: BTreeMap<DecisionKey, DecisionContext>,
    sets: BTreeMap<DecisionKey, Vec<(Vec<usize>, f64)>>,
    /// Decisions in file order.
    order: Vec<DecisionKey>,
    /// The first `made_with` and where it was.
    made_with: Option<(Value, String)>,
    labels: usize,
    /// Label counts announced by decision lines, and where.
    announced: BTreeMap<DecisionKey, (usize, String)>,
}

impl LabelReader {
    fn new(allow_mixed: bool) -> Self {
        LabelReader {
            allow_mixed,
            contexts: BTreeMap::new(),
            sets: BTreeMap::new(),
            order: Vec::new(),
            made_with: None,
            labels: 0,
            announced: BTreeMap::new(),
        }
    }

    /// Reads line `i` (`line`, at `at`) of the file `text`: a decision line or a label line.
    fn read_line(&mut self, text: &str, i: usize, line: &str, at: &str) -> Result<()> {
        let bad = |m: String| Error::InvalidRequest(format!("{at}: {m}"));
        let v: Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}{}", partial_hint(text, i))))?;
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
            .ok_or_else(|| bad("field `t`: expected an integer >= 1".into()))? as usize;
        self.check_made_with(field("made_with")?.clone(), at)?;
        let key = (episode, t);
        let kind = field("kind")?
            .as_str()
            .ok_or_else(|| bad("field `kind`: expected a string".into()))?;
        if kind == "decision" {
            return self.read_decision(&v, key, at);
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
        self.sets.entry(key).or_default().push((set, q));
        self.labels += 1;
        Ok(())
    }

    /// Records the first `made_with`; a later one must equal it unless mixing is allowed.
    fn check_made_with(&mut self, mw: Value, at: &str) -> Result<()> {
        match &self.made_with {
            None => self.made_with = Some((mw, at.to_string())),
            Some((first, first_at)) if *first != mw && !self.allow_mixed => {
                return Err(Error::InvalidRequest(format!(
                    "{at}: field `made_with` differs from {first_at}'s ({mw} vs {first}); labels made with \
                     different models, adapters or pixel budgets measure different policies \
                     (--allow-mixed to train on them anyway)"
                )))
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// A `decision` line (`v`, at `at`): the decision's context and its announced label count.
    fn read_decision(&mut self, v: &Value, key: DecisionKey, at: &str) -> Result<()> {
        let bad = |m: String| Error::InvalidRequest(format!("{at}: {m}"));
        let context = v
            .get("context")
            .ok_or_else(|| bad("no field `context`".to_string()))?;
        let cj: ContextJson =
            serde_json::from_value(context.clone()).map_err(|e| bad(format!("field `context`: {e}")))?;
        let ctx = cj
            .to_context(key.1)
            .map_err(|e| bad(format!("field `context`: {e}")))?;
        if self.contexts.insert(key.clone(), ctx).is_some() {
            return Err(bad(format!(
                "a second decision line for episode {} t={}",
                key.0, key.1
            )));
        }
        if let Some(n) = v.get("labels") {
            let n = n
                .as_u64()
                .ok_or_else(|| bad("field `labels`: expected a count".into()))?;
            self.announced.insert(key.clone(), (n as usize, at.to_string()));
        }
        self.order.push(key);
        Ok(())
    }

    /// Checks the announced counts and that every labelled decision has its decision line, and
    /// pairs the decisions (file order) with their labels.
    fn finish(mut self) -> Result<LabelSet> {
        check_announced(&self.announced, &self.sets)?;
        for key in self.sets.keys() {
            if !self.contexts.contains_key(key) {
                return Err(Error::InvalidRequest(format!(
                    "labels of episode {} t={} have no `decision` line (label the episode again with this recall)",
                    key.0, key.1
                )));
            }
        }
        let decisions = self
            .order
            .into_iter()
            .filter_map(|key| {
                let utilities = self.sets.remove(&key)?;
                let context = self.contexts.remove(&key)?;
                Some(LabelledDecision {
                    episode: key.0,
                    context,
                    utilities,
                })
            })
            .collect();
        Ok(LabelSet {
            decisions,
            made_with: self.made_with.map(|m| m.0).unwrap_or(Value::Null),
            labels: self.labels,
        })
    }
}

/// One decision of a label run, as a resumed run compares them: the decisions a file holds complete
/// must be the first ones the run would label, with the same `made_with` and `budgets`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionUnit {
    pub episode: String,
    pub t: usize,
    pub made_with: Value,
    /// The `--budgets`, sorted and deduplicated (as the `decision` line records them).
    pub budgets: Vec<usize>,
}

/// Budgets as the `decision` line records them: `1,2,2` and `2,1` label the same sets.
fn normalized(budgets: &[usize]) -> Vec<usize> {
    let mut b = budgets.to_vec();
    b.sort_unstable();
    b.dedup();
    b
}

/// The decisions a label run labels for one episode of `len` decisions, in order.
pub fn plan_decisions(
    name: &str,
    len: usize,
    budgets: &[usize],
    made_with: &LabelSource,
) -> Result<Vec<DecisionUnit>> {
    let made_with =
        serde_json::to_value(made_with).map_err(|e| Error::InvalidRequest(format!("label source: {e}")))?;
    Ok((1..=len)
        .map(|t| DecisionUnit {
            episode: name.to_string(),
            t,
            made_with: made_with.clone(),
            budgets: normalized(budgets),
        })
        .collect())
}

/// What a resumed label run keeps of an existing label file.
#[derive(Debug, Clone)]
pub struct LabelProgress {
    /// The complete decisions, in file order.
    pub done: Vec<DecisionUnit>,
    /// Bytes those decisions span from the start of the file; anything after them (an unfinished
    /// decision, a partial line) is to be cut.
    pub len: u64,
}

/// Reads a label file an interrupted (or finished) `recall episode label` left: a decision is
/// complete when its `decision` line is followed by as many label lines as it announces (`labels`).
/// A trailing partial line and a trailing unfinished decision are tolerated (they are what a kill
/// leaves); anything else a label run never writes (a line that is not JSON, labels outside their
/// decision, a decision line without `labels` from an older recall) is an error naming the line.
pub fn read_progress(path: &Path) -> Result<LabelProgress> {
    let bytes = crate::limits::read_capped_bytes(path, crate::limits::MAX_DOCUMENT_BYTES)?;
    let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&bytes[..whole])
        .map_err(|e| Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    let mut progress = LabelProgress {
        done: Vec::new(),
        len: 0,
    };
    // The decision being read and how many of its label lines are still to come.
    let mut open: Option<(DecisionUnit, u64)> = None;
    let mut end = 0u64;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        end += line.len() as u64;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |m: &str| {
            Error::InvalidRequest(format!(
                "{}:{}: {m} (cannot resume this file)",
                path.display(),
                i + 1
            ))
        };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(&format!("not JSON: {e}")))?;
        let (mut unit, kind) = unit_of_line(&v).ok_or_else(|| bad("not a label line"))?;
        if kind == "decision" {
            if open.is_some() {
                return Err(bad(
                    "a decision line before the previous decision's labels are complete",
                ));
            }
            let n = v.get("labels").and_then(Value::as_u64);
            let budgets = v
                .get("budgets")
                .and_then(|b| serde_json::from_value(b.clone()).ok());
            let (Some(n), Some(budgets)) = (n, budgets) else {
                return Err(bad(
                    "a decision line without `labels` and `budgets` (an older recall's file: label \
                     again without --resume)",
                ));
            };
            unit.budgets = budgets;
            open = Some((unit, n));
        } else {
            let Some((_, left)) = open
                .as_mut()
                .filter(|(c, _)| (&c.episode, c.t) == (&unit.episode, unit.t))
            else {
                return Err(bad("a label line outside its decision"));
            };
            *left = left.saturating_sub(1);
        }
        if open.as_ref().is_some_and(|(_, left)| *left == 0) {
            progress.done.extend(open.take().map(|(u, _)| u));
            progress.len = end;
        }
    }
    Ok(progress)
}

/// The decision a label line belongs to (its budgets not yet read) and its `kind`; `None` when a field
/// is missing.
fn unit_of_line(v: &Value) -> Option<(DecisionUnit, &str)> {
    let unit = DecisionUnit {
        episode: v.get("episode")?.as_str()?.to_string(),
        t: v.get("t")?.as_u64()? as usize,
        made_with: v.get("made_with")?.clone(),
        budgets: Vec::new(),
    };
    Some((unit, v.get("kind")?.as_str()?))
}

/// How many of `plan`'s decisions a resumed run skips: the complete decisions of the file, which must
/// be the plan's first ones with the same settings. Errors say what differs (`path` is the file).
pub fn resume_point(path: &Path, done: &[DecisionUnit], plan: &[DecisionUnit]) -> Result<usize> {
    let refuse = |m: String| {
        Error::InvalidRequest(format!(
            "cannot resume {}: {m}; label without --resume to start over",
            path.display()
        ))
    };
    if done.len() > plan.len() {
        return Err(refuse(format!(
            "it holds {} decisions, this run labels {} (another --episode list)",
            done.len(),
            plan.len()
        )));
    }
    for (i, (have, want)) in done.iter().zip(plan).enumerate() {
        if (&have.episode, have.t) != (&want.episode, want.t) {
            return Err(refuse(format!(
                "its decision #{} is episode {} t={}, this run's is episode {} t={} (another --episode list)",
                i + 1,
                have.episode,
                have.t,
                want.episode,
                want.t
            )));
        }
        if have.made_with != want.made_with {
            return Err(refuse(format!(
                "episode {} t={} was made with {}, this run with {}",
                have.episode, have.t, have.made_with, want.made_with
            )));
        }
        if have.budgets != want.budgets {
            return Err(refuse(format!(
                "episode {} t={} was labelled with --budgets {:?}, this run with {:?}",
                have.episode, have.t, have.budgets, want.budgets
            )));
        }
    }
    Ok(done.len())
}

/// The hint for a line that is not JSON when it is a file's unterminated last line: what an
/// interrupted writer leaves (recall's own label runs never publish one, see docs/FORMATS.md).
fn partial_hint(text: &str, line: usize) -> &'static str {
    if !text.ends_with('\n') && line + 1 == text.lines().count() {
        " (a partial last line: an interrupted write? `recall episode label --resume` finishes a label run)"
    } else {
        ""
    }
}

/// A decision of a label file: its episode and `t`.
type DecisionKey = (String, usize);

/// Refuses decisions with fewer (or more) label lines than their `decision` line announced: a file
/// cut short inside a decision must not train as if that decision were complete.
fn check_announced(
    announced: &BTreeMap<DecisionKey, (usize, String)>,
    sets: &BTreeMap<DecisionKey, Vec<(Vec<usize>, f64)>>,
) -> Result<()> {
    for (key, (n, at)) in announced {
        let found = sets.get(key).map_or(0, Vec::len);
        if found != *n {
            return Err(Error::InvalidRequest(format!(
                "{at}: the decision line of episode {} t={} announces {n} labels, the files hold {found} \
                 (an interrupted run? `recall episode label --resume` completes it)",
                key.0, key.1
            )));
        }
    }
    Ok(())
}

/// The episode name label lines record for `dir` (the directory as given).
pub fn episode_name(dir: &Path) -> String {
    dir.display().to_string()
}
