//! Recorded episodes: the instruction, the completed steps (the screenshot the policy acted on, its
//! verbatim response, its action line) and optionally the final screen, stored as a directory holding
//! `episode.json` and the image files. The format is specified in `docs/FORMATS.md`.
//!
//! Steps are 1-based as in the protocol: step `s` is `steps[s - 1]`, its screenshot is `x_s` and its
//! response `r_s`. [`Episode::decision`] gives the inputs of decision `t` for offline replay: completed
//! steps `1..t-1`, the current screenshot `x_t` and the recorded reference response `r_t`.
//!
//! Action lines follow `gui_owl_protocol.md` section 6 (see [`StepRecord::action_line_for`]): a recorded
//! `action_line` wins; otherwise mobile extracts `r.split("Action:")[-1].split("<tool_call>")[0].strip()`
//! with CausalCache's fallback (the parsed action name, else `unknown action`), and desktop renders
//! CausalCache's template from the parsed `computer_use` arguments (fallback
//! `Wait for the screen to update.`). The parsing lives in [`crate::action`], a leaf module with
//! no engine dependencies, which also defines [`Platform`].

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use crate::action::Platform;
use crate::action::{action_line_or_fallback, parse_response, DESKTOP_FALLBACK_LINE};
use crate::error::{Error, Result};

/// The file name of an episode's description inside its directory.
pub const EPISODE_FILE: &str = "episode.json";
/// The value of the optional `format` field.
pub const EPISODE_FORMAT: &str = "recall.episode/1";

/// One completed step `s`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    /// `x_s`: the screen the policy acted on at step `s` (resolved against the episode directory).
    pub screenshot: PathBuf,
    /// `r_s`: the full response, verbatim.
    pub response: String,
    /// `a_s` when recorded; otherwise derived from the response (see [`action_line_for`](Self::action_line_for)).
    pub action_line: Option<String>,
    /// A text transcript (OCR) of `x_s`, when the episode carries one: what the OCR-similarity
    /// allocator compares and what [`RestoreAs::Ocr`](crate::memory::protocol::RestoreAs) shows in
    /// place of the pixels. recall runs no OCR itself.
    pub ocr: Option<String>,
}

impl StepRecord {
    /// A step with no recorded action line.
    pub fn new(screenshot: impl Into<PathBuf>, response: impl Into<String>) -> Self {
        Self {
            screenshot: screenshot.into(),
            response: response.into(),
            action_line: None,
            ocr: None,
        }
    }

    /// The step's action line `a_s` under `platform`'s rule: the recorded line if any; else, on mobile,
    /// the text after the last `Action:` and before the next `<tool_call>`, stripped, falling back to
    /// the parsed action's name or `unknown action` when empty; on desktop, CausalCache's template
    /// rendering of the parsed `computer_use` call, falling back to `Wait for the screen to update.`.
    ///
    /// ```
    /// use recall::memory::episode::{Platform, StepRecord};
    /// let r = "Action: Open Settings.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"open\", \"text\": \"Settings\"}}\n</tool_call>";
    /// assert_eq!(StepRecord::new("x1.png", r).action_line_for(Platform::Mobile), "Open Settings.");
    /// let d = "Action: Save.\n<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"key\", \"keys\": [\"ctrl\", \"s\"]}}\n</tool_call>";
    /// assert_eq!(StepRecord::new("x1.png", d).action_line_for(Platform::Desktop), "Press ctrl+s.");
    /// ```
    pub fn action_line_for(&self, platform: Platform) -> String {
        if let Some(line) = &self.action_line {
            return line.clone();
        }
        match platform {
            Platform::Mobile => action_line_or_fallback(&self.response, platform),
            Platform::Desktop => parse_response(&self.response, platform)
                .ok()
                .and_then(|a| a.desktop_action_line())
                .unwrap_or_else(|| DESKTOP_FALLBACK_LINE.to_string()),
        }
    }
}

/// A recorded episode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Episode {
    /// The task instruction (`{goal}` in the protocol).
    pub instruction: String,
    /// Mobile or desktop.
    pub platform: Platform,
    /// The completed steps; step `s` is `steps[s - 1]`.
    pub steps: Vec<StepRecord>,
    /// The screen after the last step, when recorded (`x_{T+1}`).
    pub final_screenshot: Option<PathBuf>,
    /// A text transcript (OCR) of the final screenshot, when recorded.
    pub final_ocr: Option<String>,
    /// The directory the episode was loaded from (relative image paths are resolved against it).
    pub dir: PathBuf,
}

/// The inputs of decision `t` (1-based) in an offline replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'a> {
    /// The decision step `t`.
    pub t: usize,
    /// The task instruction.
    pub instruction: &'a str,
    /// The platform.
    pub platform: Platform,
    /// Completed steps `1..t-1`.
    pub completed: &'a [StepRecord],
    /// `x_t`: the current screenshot.
    pub current_screenshot: &'a Path,
    /// The OCR transcript of `x_t`, when the episode records one.
    pub current_ocr: Option<&'a str>,
    /// `r_t`, the recorded response at step `t`, when `t ≤ T`.
    pub reference: Option<&'a str>,
}

impl Episode {
    /// Number of recorded steps `T`.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether the episode has no steps.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Loads `dir/episode.json` and checks that every image it names exists. Errors name the file and the
    /// field (`steps[3].screenshot`).
    ///
    /// ```
    /// use recall::memory::episode::{Episode, Platform};
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/episode-sample");
    /// let episode = Episode::load(&dir)?;
    /// assert_eq!(episode.platform, Platform::Mobile);
    /// assert_eq!(episode.len(), 6);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn load(dir: &Path) -> Result<Episode> {
        let path = dir.join(EPISODE_FILE);
        let text = crate::limits::read_capped(&path, crate::limits::MAX_DOCUMENT_BYTES)?;
        Self::from_json(&text, dir)
    }

    /// Parses the contents of an `episode.json` whose images live under `dir` (they must exist).
    pub fn from_json(text: &str, dir: &Path) -> Result<Episode> {
        let path = dir.join(EPISODE_FILE);
        let value: Value = serde_json::from_str(text).map_err(|e| Error::json(&path, "", e))?;
        let obj = value
            .as_object()
            .ok_or_else(|| Error::json(&path, "", "the document must be a JSON object"))?;
        check_fields(
            &path,
            "",
            obj,
            &[
                "format",
                "instruction",
                "platform",
                "steps",
                "final_screenshot",
                "final_ocr",
                "meta",
            ],
        )?;
        if let Some(format) = obj.get("format") {
            if format.as_str() != Some(EPISODE_FORMAT) {
                return Err(Error::json(
                    &path,
                    "format",
                    format!("must be \"{EPISODE_FORMAT}\""),
                ));
            }
        }
        let instruction = req_str(&path, obj, "", "instruction")?.to_string();
        let platform_name = req_str(&path, obj, "", "platform")?;
        let platform = Platform::from_name(platform_name)
            .ok_or_else(|| Error::json(&path, "platform", "must be \"mobile\" or \"desktop\""))?;
        let steps_json = obj
            .get("steps")
            .ok_or_else(|| Error::json(&path, "steps", "missing"))?
            .as_array()
            .ok_or_else(|| Error::json(&path, "steps", "must be a list"))?;
        let mut steps = Vec::with_capacity(steps_json.len());
        for (i, step) in steps_json.iter().enumerate() {
            let prefix = format!("steps[{i}]");
            let step = step
                .as_object()
                .ok_or_else(|| Error::json(&path, &prefix, "must be an object"))?;
            check_fields(
                &path,
                &prefix,
                step,
                &["screenshot", "response", "action_line", "ocr", "meta"],
            )?;
            let screenshot = image_path(&path, dir, step, &prefix, "screenshot")?;
            let response = req_str(&path, step, &prefix, "response")?.to_string();
            let action_line = opt_str(&path, step, &prefix, "action_line")?;
            let ocr = opt_str(&path, step, &prefix, "ocr")?;
            steps.push(StepRecord {
                screenshot,
                response,
                action_line,
                ocr,
            });
        }
        let final_ocr = opt_str(&path, obj, "", "final_ocr")?;
        let final_screenshot = match obj.get("final_screenshot") {
            None | Some(Value::Null) => None,
            Some(_) => Some(image_path(&path, dir, obj, "", "final_screenshot")?),
        };
        if let Some(meta) = obj.get("meta") {
            if !meta.is_object() {
                return Err(Error::json(&path, "meta", "must be an object"));
            }
        }
        Ok(Episode {
            instruction,
            platform,
            steps,
            final_screenshot,
            final_ocr,
            dir: dir.to_path_buf(),
        })
    }

    /// Step `s` (1-based), or an error when `s` is not in `1..=T`.
    pub fn step(&self, s: usize) -> Result<&StepRecord> {
        if s == 0 || s > self.steps.len() {
            return Err(Error::InvalidRequest(format!(
                "step {s} is out of range: the episode has steps 1..={}",
                self.steps.len()
            )));
        }
        Ok(&self.steps[s - 1])
    }

    /// The action line `a_s` of step `s` (1-based) under the episode's platform
    /// (see [`StepRecord::action_line_for`]).
    pub fn action_line(&self, s: usize) -> Result<String> {
        Ok(self.step(s)?.action_line_for(self.platform))
    }

    /// The inputs of decision `t` (1-based): completed steps `1..t-1`, current screenshot `x_t`
    /// (`steps[t-1].screenshot`, or `final_screenshot` for `t = T + 1`) and the reference response `r_t`
    /// (`None` for `t = T + 1`). `t = 0`, `t > T + 1`, and `t = T + 1` without a final screenshot are
    /// errors.
    ///
    /// ```
    /// use recall::memory::episode::Episode;
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/episode-sample");
    /// let episode = Episode::load(&dir)?;
    /// let d = episode.decision(3)?;
    /// assert_eq!(d.completed.len(), 2);
    /// assert_eq!(d.current_screenshot, episode.steps[2].screenshot.as_path());
    /// assert!(d.reference.is_some());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn decision(&self, t: usize) -> Result<Decision<'_>> {
        let n = self.steps.len();
        if t == 0 || t > n + 1 {
            return Err(Error::InvalidRequest(format!(
                "decision {t} is out of range: the episode has decisions 1..={}",
                n + 1
            )));
        }
        let (current_screenshot, current_ocr, reference) = if t <= n {
            let step = &self.steps[t - 1];
            (
                step.screenshot.as_path(),
                step.ocr.as_deref(),
                Some(step.response.as_str()),
            )
        } else {
            let last = self.final_screenshot.as_deref().ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "decision {t} needs the final screenshot, which {} does not record",
                    self.dir.join(EPISODE_FILE).display()
                ))
            })?;
            (last, self.final_ocr.as_deref(), None)
        };
        Ok(Decision {
            t,
            instruction: &self.instruction,
            platform: self.platform,
            completed: &self.steps[..t - 1],
            current_screenshot,
            current_ocr,
            reference,
        })
    }

    /// Number of decisions a replay can make: `T`, plus one when the final screenshot is recorded.
    pub fn decisions(&self) -> usize {
        self.steps.len() + usize::from(self.final_screenshot.is_some())
    }
}

fn field_name(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn check_fields(path: &Path, prefix: &str, obj: &Map<String, Value>, allowed: &[&str]) -> Result<()> {
    let mut unknown: Vec<&String> = obj.keys().filter(|k| !allowed.contains(&k.as_str())).collect();
    unknown.sort();
    match unknown.first() {
        Some(key) => Err(Error::json(
            path,
            field_name(prefix, key),
            format!("unknown field (allowed: {})", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

fn req_str<'a>(path: &Path, obj: &'a Map<String, Value>, prefix: &str, key: &str) -> Result<&'a str> {
    match obj.get(key) {
        None => Err(Error::json(path, field_name(prefix, key), "missing")),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(Error::json(path, field_name(prefix, key), "must be a string")),
    }
}

/// An optional string field (absent or null is `None`).
fn opt_str(path: &Path, obj: &Map<String, Value>, prefix: &str, key: &str) -> Result<Option<String>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Error::json(path, field_name(prefix, key), "must be a string")),
    }
}

fn image_path(path: &Path, dir: &Path, obj: &Map<String, Value>, prefix: &str, key: &str) -> Result<PathBuf> {
    let field = field_name(prefix, key);
    let rel = req_str(path, obj, prefix, key)?;
    if rel.is_empty() {
        return Err(Error::json(path, field, "must not be empty"));
    }
    let full = dir.join(rel);
    if !full.is_file() {
        return Err(Error::json(
            path,
            field,
            format!("image file {} does not exist", full.display()),
        ));
    }
    Ok(full)
}
