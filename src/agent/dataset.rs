//! The step-level evaluation dataset: JSONL, one decision step per line (`docs/EVAL.md`).
//!
//! ```json
//! {"episode": "ep7", "step": 2, "subset": "general", "instruction": "Turn on Wi-Fi.",
//!  "platform": "mobile", "screenshots": ["img/ep7_1.png", "img/ep7_2.png"],
//!  "history": ["Action: Open Settings.\n<tool_call>...</tool_call>", "Tap Network."],
//!  "reference": {"action": "click", "coordinate": [500, 300]}, "target_box": [400, 270, 600, 330]}
//! ```
//!
//! * `step` is 0-based; `history` holds exactly `step` entries, the completed steps `1..=step` of the
//!   protocol in order, each a full response or an action line.
//! * `screenshots` ends with the current screen; the entries before it are the screens of the last
//!   `len − 1` completed steps, so `1 ≤ len ≤ step + 1`. Relative paths are relative to the file's directory.
//! * `reference` is a response (`Action: …\n<tool_call>…</tool_call>`), a tool-call object
//!   (`{"name": "mobile_use", "arguments": {…}}`) or the bare arguments (`{"action": …}`); it must parse
//!   under the platform's rules ([`parse_reference`]). Objects are stored as `<tool_call>\n{json}\n</tool_call>`.
//! * `target_box` `[x0, y0, x1, y1]` (inclusive, on the 0–999 grid, `x0 ≤ x1`, `y0 ≤ y1`) is allowed only
//!   when the reference is a click-like action (see [`crate::agent::eval`]).
//! * `ui_annotations` (AITW's UI annotations of the current screen, each `[y, x, height, width]` as
//!   fractions in `[0, 1]`) and `candidate_boxes` (AndroidControl's `candidate_bbox`, each `[x0, y0, x1,
//!   y1]` on the 0–999 grid, fractional values allowed; only for click-like and `open` references) feed the
//!   benchmark scorers ([`crate::agent::scorers::ScoreContext`]); both may be absent, null or empty.
//! * `subset` (optional, non-empty) groups steps for per-subset and macro averages; `meta` (optional) is
//!   free metadata. Any other field is an error, as are mixed platforms and a repeated (episode, step).
//!
//! Errors are [`Error::Json`] with the file as `path` and the field spelled `line 3: target_box[2]`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::action::{
    parse_response, parse_tool_call, Action, ParseError, Platform, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
};
use crate::error::{Error, Result};

/// The fields a step line may carry.
pub const STEP_FIELDS: [&str; 12] = [
    "episode",
    "step",
    "subset",
    "instruction",
    "platform",
    "screenshots",
    "history",
    "reference",
    "target_box",
    "ui_annotations",
    "candidate_boxes",
    "meta",
];

/// One evaluation step (one line of the JSONL file).
#[derive(Debug, Clone, PartialEq)]
pub struct EvalStep {
    /// 1-based line number in the file it was read from.
    pub line: usize,
    /// Episode id (a JSON integer id is kept as its decimal string).
    pub episode: String,
    /// 0-based step index in the episode.
    pub step: u32,
    /// Subset name, if any.
    pub subset: Option<String>,
    /// The task.
    pub instruction: String,
    /// Screenshots, oldest first, the current screen last; resolved against the file's directory.
    pub screenshots: Vec<PathBuf>,
    /// The `step` completed steps, each a full response or an action line.
    pub history: Vec<String>,
    /// The reference as a response string (objects rendered as `<tool_call>\n{json}\n</tool_call>`).
    pub reference: String,
    /// Optional target box `[x0, y0, x1, y1]` on the 0–999 grid (inclusive).
    pub target_box: Option<[u32; 4]>,
    /// AITW's UI annotations of the current screen, `[y, x, height, width]` as fractions of the screen
    /// (empty when absent).
    pub ui_annotations: Vec<[f64; 4]>,
    /// AndroidControl's candidate element boxes `[x0, y0, x1, y1]` on the 0–999 grid (empty when absent).
    pub candidate_boxes: Vec<[f64; 4]>,
    /// Free metadata (`null` when absent).
    pub meta: Value,
}

/// A loaded step dataset; all steps share one platform.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDataset {
    /// The file it was read from.
    pub path: PathBuf,
    /// The platform of every step.
    pub platform: Platform,
    /// The steps in file order.
    pub steps: Vec<EvalStep>,
}

impl StepDataset {
    /// Reads and validates a JSONL step file (see the module docs). Screenshot files are not opened; see
    /// [`check_screenshots`](Self::check_screenshots).
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::limits::read_capped(path, crate::limits::MAX_DOCUMENT_BYTES)?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, path, base)
    }

    /// Parses JSONL `text`; errors name `path`; relative screenshot paths are joined to `base`.
    pub fn parse(text: &str, path: &Path, base: &Path) -> Result<Self> {
        let mut steps = Vec::new();
        let mut platform: Option<(Platform, usize)> = None;
        let mut seen: HashMap<(String, u32), usize> = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let err =
                |field: &str, message: String| Error::json(path, format!("line {line}: {field}"), message);
            let value: Value =
                serde_json::from_str(raw).map_err(|e| Error::json(path, format!("line {line}"), e))?;
            let obj = value
                .as_object()
                .ok_or_else(|| err("(line)", "expected a JSON object".to_string()))?;
            let (step, p) = parse_step(obj, line, base).map_err(|(field, message)| err(&field, message))?;
            match platform {
                None => platform = Some((p, line)),
                Some((first, first_line)) if first != p => {
                    return Err(err(
                        "platform",
                        format!(
                            "`{p}` differs from `{first}` on line {first_line}; a dataset has one platform"
                        ),
                    ))
                }
                Some(_) => {}
            }
            if let Some(prev) = seen.insert((step.episode.clone(), step.step), line) {
                return Err(err(
                    "step",
                    format!(
                        "episode `{}` step {} already appears on line {prev}",
                        step.episode, step.step
                    ),
                ));
            }
            steps.push(step);
        }
        let Some((platform, _)) = platform else {
            return Err(Error::json(path, "(file)", "no steps"));
        };
        Ok(Self {
            path: path.to_path_buf(),
            platform,
            steps,
        })
    }

    /// Checks that every screenshot exists as a file; the error names the line and `screenshots[i]`.
    pub fn check_screenshots(&self) -> Result<()> {
        for s in &self.steps {
            for (i, p) in s.screenshots.iter().enumerate() {
                if !p.is_file() {
                    return Err(Error::json(
                        &self.path,
                        format!("line {}: screenshots[{i}]", s.line),
                        format!("{} does not exist", p.display()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The number of distinct episodes.
    pub fn episodes(&self) -> usize {
        let mut ids: Vec<&str> = self.steps.iter().map(|s| s.episode.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

/// Parses a reference: a response with `<tool_call>` tags ([`parse_response`]), or JSON text holding a
/// tool-call object or the bare arguments object (`{"action": …}`, given the platform's tool name).
///
/// ```
/// use recall::action::Platform;
/// use recall::agent::dataset::parse_reference;
/// let a = parse_reference(r#"{"action": "click", "coordinate": [1, 2]}"#, Platform::Mobile).unwrap();
/// assert_eq!(a.name(), "click");
/// ```
pub fn parse_reference(text: &str, platform: Platform) -> std::result::Result<Action, ParseError> {
    if text.contains(TOOL_CALL_OPEN) {
        return parse_response(text, platform);
    }
    let value: Value =
        serde_json::from_str(text.trim()).map_err(|e| ParseError::InvalidJson(e.to_string()))?;
    parse_tool_call(&wrap_arguments(value, platform), platform)
}

/// A bare arguments object (no `name`, has `action`) wrapped as the platform's tool call.
fn wrap_arguments(value: Value, platform: Platform) -> Value {
    match value {
        Value::Object(obj) if !obj.contains_key("name") && obj.contains_key("action") => {
            serde_json::json!({"name": platform.tool_name(), "arguments": Value::Object(obj)})
        }
        other => other,
    }
}

/// Whether `action` takes a target box: a single-point click (`click`, `long_press`, desktop
/// `left_click`, `right_click`, `middle_click`, `double_click`).
pub fn is_click_like(action: &Action) -> bool {
    use crate::action::ActionArgs as A;
    matches!(
        action.args,
        A::Click { .. }
            | A::LongPress { .. }
            | A::LeftClick { .. }
            | A::RightClick { .. }
            | A::MiddleClick { .. }
            | A::DoubleClick { .. }
    )
}

type FieldError = (String, String);

fn field_err(field: &str, message: impl Into<String>) -> FieldError {
    (field.to_string(), message.into())
}

fn parse_step(
    obj: &Map<String, Value>,
    line: usize,
    base: &Path,
) -> std::result::Result<(EvalStep, Platform), FieldError> {
    check_step_fields(obj)?;
    let episode = match required(obj, "episode")? {
        Value::String(s) if !s.is_empty() => s.clone(),
        Value::Number(n) if n.is_u64() => n.to_string(),
        _ => {
            return Err(field_err(
                "episode",
                "must be a non-empty string or a non-negative integer",
            ))
        }
    };
    let step = required(obj, "step")?
        .as_u64()
        .and_then(|s| u32::try_from(s).ok())
        .ok_or_else(|| field_err("step", "must be a non-negative integer (0-based)"))?;
    let subset = match obj.get("subset") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(field_err("subset", "must be a non-empty string or null")),
    };
    let instruction = string_field(obj, "instruction")?;
    let platform_name = string_field(obj, "platform")?;
    let platform = Platform::from_name(&platform_name).ok_or_else(|| {
        field_err(
            "platform",
            format!("`{platform_name}` is not `mobile` or `desktop`"),
        )
    })?;
    let screenshots = parse_screenshots(obj, step, base)?;
    let history = parse_history(obj, step)?;
    let reference = reference_response(obj, platform)?;
    let action = parse_reference(&reference, platform)
        .map_err(|e| field_err("reference", format!("does not parse as a {platform} action: {e}")))?;

    let target_box = match obj.get("target_box") {
        None | Some(Value::Null) => None,
        Some(v) => Some(parse_box(v, &action)?),
    };
    let ui_annotations = parse_box_list(obj, "ui_annotations", 1.0)?;
    let candidate_boxes = parse_candidate_boxes(obj, &action)?;
    let step = EvalStep {
        line,
        episode,
        step,
        subset,
        instruction,
        screenshots,
        history,
        reference,
        target_box,
        ui_annotations,
        candidate_boxes,
        meta: obj.get("meta").cloned().unwrap_or(Value::Null),
    };
    Ok((step, platform))
}

/// Refuses the first (in sorted order) field outside [`STEP_FIELDS`].
fn check_step_fields(obj: &Map<String, Value>) -> std::result::Result<(), FieldError> {
    let mut unknown: Vec<&String> = obj
        .keys()
        .filter(|k| !STEP_FIELDS.contains(&k.as_str()))
        .collect();
    unknown.sort();
    if let Some(k) = unknown.first() {
        return Err(field_err(
            k,
            format!("unknown field (expected one of {})", STEP_FIELDS.join(", ")),
        ));
    }
    Ok(())
}

fn required<'a>(obj: &'a Map<String, Value>, name: &str) -> std::result::Result<&'a Value, FieldError> {
    obj.get(name).ok_or_else(|| field_err(name, "missing"))
}

fn string_field(obj: &Map<String, Value>, name: &str) -> std::result::Result<String, FieldError> {
    required(obj, name)?
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| field_err(name, "must be a string"))
}

/// `screenshots`: 1 to `step + 1` non-empty paths, relative to `base`; the current screenshot last.
fn parse_screenshots(
    obj: &Map<String, Value>,
    step: u32,
    base: &Path,
) -> std::result::Result<Vec<PathBuf>, FieldError> {
    let shots = required(obj, "screenshots")?
        .as_array()
        .ok_or_else(|| field_err("screenshots", "must be a list of paths"))?;
    if shots.is_empty() {
        return Err(field_err(
            "screenshots",
            "is empty; the current screenshot comes last",
        ));
    }
    if shots.len() > step as usize + 1 {
        return Err(field_err(
            "screenshots",
            format!(
                "{} screenshots at step {step}; at most step + 1 = {}",
                shots.len(),
                step + 1
            ),
        ));
    }
    let mut screenshots = Vec::with_capacity(shots.len());
    for (i, s) in shots.iter().enumerate() {
        let s = s
            .as_str()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| field_err(&format!("screenshots[{i}]"), "must be a non-empty string"))?;
        screenshots.push(base.join(s));
    }
    Ok(screenshots)
}

/// `history`: exactly `step` strings, one per completed step.
fn parse_history(obj: &Map<String, Value>, step: u32) -> std::result::Result<Vec<String>, FieldError> {
    let hist = required(obj, "history")?
        .as_array()
        .ok_or_else(|| field_err("history", "must be a list of strings"))?;
    if hist.len() != step as usize {
        return Err(field_err(
            "history",
            format!(
                "{} entries at step {step}; must hold exactly the {step} completed steps",
                hist.len()
            ),
        ));
    }
    hist.iter()
        .enumerate()
        .map(|(i, h)| {
            h.as_str()
                .map(str::to_string)
                .ok_or_else(|| field_err(&format!("history[{i}]"), "must be a string"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
}

/// `reference` as a response: a string as is, a tool-call object wrapped in its tags.
fn reference_response(
    obj: &Map<String, Value>,
    platform: Platform,
) -> std::result::Result<String, FieldError> {
    match required(obj, "reference")? {
        Value::String(s) => Ok(s.clone()),
        v @ Value::Object(_) => {
            let call = wrap_arguments(v.clone(), platform);
            Ok(format!("{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"))
        }
        _ => Err(field_err(
            "reference",
            "must be a response string or a tool-call object",
        )),
    }
}

fn parse_box(v: &Value, reference: &Action) -> std::result::Result<[u32; 4], FieldError> {
    let list = v
        .as_array()
        .filter(|l| l.len() == 4)
        .ok_or_else(|| field_err("target_box", "must be [x0, y0, x1, y1]"))?;
    let mut b = [0u32; 4];
    for (i, (slot, x)) in b.iter_mut().zip(list).enumerate() {
        *slot = x
            .as_u64()
            .filter(|&x| x <= 999)
            .ok_or_else(|| field_err(&format!("target_box[{i}]"), "must be an integer in [0, 999]"))?
            as u32;
    }
    if b[0] > b[2] || b[1] > b[3] {
        return Err(field_err(
            "target_box",
            format!("{b:?} needs x0 <= x1 and y0 <= y1"),
        ));
    }
    if !is_click_like(reference) {
        return Err(field_err(
            "target_box",
            format!(
                "given for a `{}` reference; only click-like references take a box",
                reference.name()
            ),
        ));
    }
    Ok(b)
}

/// An optional list of 4-number boxes named `field`, each value a JSON number in `[0, max]`; absent or
/// null is empty. Errors name the box (`field[2]`) or the value (`field[2][1]`).
fn parse_box_list(
    obj: &Map<String, Value>,
    field: &str,
    max: f64,
) -> std::result::Result<Vec<[f64; 4]>, FieldError> {
    let list = match obj.get(field) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .ok_or_else(|| field_err(field, "must be a list of 4-number boxes"))?,
    };
    let mut boxes = Vec::with_capacity(list.len());
    for (i, b) in list.iter().enumerate() {
        let values = b
            .as_array()
            .filter(|v| v.len() == 4)
            .ok_or_else(|| field_err(&format!("{field}[{i}]"), "must be a list of 4 numbers"))?;
        let mut out = [0.0; 4];
        for (j, (slot, x)) in out.iter_mut().zip(values).enumerate() {
            *slot = x.as_f64().filter(|x| (0.0..=max).contains(x)).ok_or_else(|| {
                field_err(
                    &format!("{field}[{i}][{j}]"),
                    format!("must be a number in [0, {max}]"),
                )
            })?;
        }
        boxes.push(out);
    }
    Ok(boxes)
}

/// `candidate_boxes`: grid boxes `[x0, y0, x1, y1]` with `x0 ≤ x1`, `y0 ≤ y1`, given only for a reference
/// the AndroidControl scorer tests against them (a click-like action or `open`).
fn parse_candidate_boxes(
    obj: &Map<String, Value>,
    reference: &Action,
) -> std::result::Result<Vec<[f64; 4]>, FieldError> {
    let boxes = parse_box_list(obj, "candidate_boxes", f64::from(crate::action::GRID_MAX))?;
    if let Some(i) = boxes.iter().position(|b| b[0] > b[2] || b[1] > b[3]) {
        return Err(field_err(
            &format!("candidate_boxes[{i}]"),
            format!("{:?} needs x0 <= x1 and y0 <= y1", boxes[i]),
        ));
    }
    let takes_boxes =
        is_click_like(reference) || matches!(reference.args, crate::action::ActionArgs::Open { .. });
    if !boxes.is_empty() && !takes_boxes {
        return Err(field_err(
            "candidate_boxes",
            format!(
                "given for a `{}` reference; only click-like and `open` references take candidate boxes",
                reference.name()
            ),
        ));
    }
    Ok(boxes)
}
