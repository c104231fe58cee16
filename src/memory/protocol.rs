//! Prompt protocols: (instruction, completed steps `1..T`, allocation `S`, current screenshot) → chat
//! messages, exactly as `shared/protocols/gui_owl_protocol.md` section 2 specifies (the official
//! GUI-Owl-1.5 rolling layout, generalised by CausalCache's gap-fold).
//!
//! ```text
//! [0] system    SYSTEM_PROMPT(protocol)
//! S = {}:       user [FIRST(fold(1..T) or NPA), x_t]
//! S = {s_1 < … < s_k}:
//!   user        [FIRST(fold(1..s_1-1) or NPA), x_{s_1}]
//!   for i = 2..k: assistant r_{s_(i-1)};  user [CONT(fold(s_(i-1)+1 .. s_i-1)) if non-empty, x_{s_i}]
//!   assistant   r_{s_k}
//!   user        [CONT(fold(s_k+1 .. T)) if non-empty, x_t]
//! ```
//!
//! `FIRST(h)` = `Please generate the next move according to the UI screenshot, instruction and previous
//! actions.\n\nInstruction: {goal}\n\nPrevious actions:\n{h}`, `NPA` = `No previous action.`,
//! `CONT(h)` = `Previous actions (continued):\n{h}`, and `fold(lo..hi)` joins `Step{i}: {a_i}` lines with
//! `\n` (global step numbers, no trailing newline). Every completed step appears exactly once, as a fold
//! line or a retained assistant turn; a contiguous recent tail gives exactly upstream's layout.
//!
//! The system prompts are byte copies of `shared/protocols/gui_owl_{mobile,desktop}_system.txt`, kept in
//! `src/memory/prompts/` so the crate builds on its own; a test compares them with the shared files.
//!
//! ```
//! use std::path::Path;
//! use recall::memory::episode::StepRecord;
//! use recall::memory::protocol::{render, Protocol};
//! use recall::tokenize::chat::ContentPart;
//!
//! let step = |s: usize| StepRecord::new(format!("x{s}.png"), format!("Action: Do {s}.\n<tool_call>\n{{}}\n</tool_call>"));
//! let steps: Vec<StepRecord> = (1..=5).map(step).collect();
//! let messages = render(Protocol::Mobile, "Find cats.", &steps, &[1, 4], Path::new("x6.png"))?;
//! assert_eq!(messages.len(), 6);
//! assert_eq!(
//!     messages[3].content,
//!     vec![
//!         ContentPart::Text("Previous actions (continued):\nStep2: Do 2.\nStep3: Do 3.".into()),
//!         ContentPart::Image("x4.png".into()),
//!     ]
//! );
//! assert!(render(Protocol::Mobile, "Find cats.", &steps, &[4, 1], Path::new("x6.png")).is_err());
//! # Ok::<(), recall::Error>(())
//! ```

use std::ops::RangeInclusive;
use std::path::Path;

use crate::error::{Error, Result};
use crate::memory::episode::{Decision, Platform, StepRecord};
use crate::tokenize::chat::{ChatMessage, ContentPart};

/// The mobile system prompt (`mobile_use`), byte-identical to `gui_owl_mobile_system.txt`.
pub const MOBILE_SYSTEM_PROMPT: &str = include_str!("prompts/gui_owl_mobile_system.txt");
/// The desktop system prompt (`computer_use`), byte-identical to `gui_owl_desktop_system.txt`.
pub const DESKTOP_SYSTEM_PROMPT: &str = include_str!("prompts/gui_owl_desktop_system.txt");
/// sha256 of [`MOBILE_SYSTEM_PROMPT`] (as recorded in `gui_owl_protocol.json`).
pub const MOBILE_SYSTEM_PROMPT_SHA256: &str =
    "a7b494381939614cb2e463b9380631bb249c79fd712e2cac5f1327b1a3faaa99";
/// sha256 of [`DESKTOP_SYSTEM_PROMPT`].
pub const DESKTOP_SYSTEM_PROMPT_SHA256: &str =
    "3898d407debf1dedf0f42d3271a7233593d7f81263718b02641b545f32480aa4";

/// The first user turn's text up to the instruction.
pub const FIRST_USER_PREFIX: &str =
    "Please generate the next move according to the UI screenshot, instruction and previous actions.\n\nInstruction: ";
/// Between the instruction and the folded history in the first user turn.
pub const PREVIOUS_ACTIONS_HEADER: &str = "\n\nPrevious actions:\n";
/// The history of the first user turn when nothing is folded there (`NPA`).
pub const NO_PREVIOUS_ACTION: &str = "No previous action.";
/// The header of a continuation fold (CausalCache's gap-fold; `CONT`).
pub const CONTINUED_HEADER: &str = "Previous actions (continued):\n";

/// A prompt protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// The official GUI-Owl-1.5 mobile protocol (`mobile_use`).
    Mobile,
    /// CausalCache's desktop protocol (`computer_use`): the mobile layout with the desktop system prompt.
    Desktop,
    /// [`Desktop`](Self::Desktop) with CausalCache's event indexing (section 4): history images are
    /// steps `2..=T` only (the initial screen `x_1` is never a history image), and Recent-B is the tail
    /// of that pool. The rendering of an allowed allocation is the same as `Desktop`'s.
    DesktopStrictEvents,
}

impl std::str::FromStr for Protocol {
    type Err = Error;

    /// `mobile`, `desktop` or `desktop-strict`.
    ///
    /// ```
    /// use recall::memory::protocol::Protocol;
    /// assert_eq!("desktop-strict".parse::<Protocol>().unwrap(), Protocol::DesktopStrictEvents);
    /// assert!("tablet".parse::<Protocol>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mobile" => Ok(Self::Mobile),
            "desktop" => Ok(Self::Desktop),
            "desktop-strict" => Ok(Self::DesktopStrictEvents),
            other => Err(Error::InvalidRequest(format!(
                "protocol `{other}`: expected mobile, desktop or desktop-strict"
            ))),
        }
    }
}

impl Protocol {
    /// The name `--protocol` takes (`mobile`, `desktop`, `desktop-strict`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Mobile => "mobile",
            Self::Desktop => "desktop",
            Self::DesktopStrictEvents => "desktop-strict",
        }
    }

    /// The default protocol of a platform (`Mobile` / `Desktop`).
    pub fn for_platform(platform: Platform) -> Self {
        match platform {
            Platform::Mobile => Self::Mobile,
            Platform::Desktop => Self::Desktop,
        }
    }

    /// The platform whose tool this protocol uses.
    pub fn platform(self) -> Platform {
        match self {
            Self::Mobile => Platform::Mobile,
            Self::Desktop | Self::DesktopStrictEvents => Platform::Desktop,
        }
    }

    /// The system prompt text.
    ///
    /// ```
    /// use recall::memory::protocol::Protocol;
    /// assert!(Protocol::Mobile.system_prompt().starts_with("# Tools\n"));
    /// assert!(Protocol::Desktop.system_prompt().contains("\"name\": \"computer_use\""));
    /// ```
    pub fn system_prompt(self) -> &'static str {
        match self.platform() {
            Platform::Mobile => MOBILE_SYSTEM_PROMPT,
            Platform::Desktop => DESKTOP_SYSTEM_PROMPT,
        }
    }

    /// The steps that may be history images when `t_completed` steps are done: `1..=T`, or `2..=T` for
    /// [`DesktopStrictEvents`](Self::DesktopStrictEvents).
    pub fn eligible(self, t_completed: usize) -> RangeInclusive<usize> {
        match self {
            Self::DesktopStrictEvents => 2..=t_completed,
            _ => 1..=t_completed,
        }
    }

    /// Recent-B within [`eligible`](Self::eligible): the last `min(B, pool)` eligible steps, ascending.
    ///
    /// ```
    /// use recall::memory::protocol::Protocol;
    /// assert_eq!(Protocol::Mobile.recent_b(2, 4), vec![1, 2]);
    /// assert_eq!(Protocol::DesktopStrictEvents.recent_b(2, 4), vec![2]);
    /// ```
    pub fn recent_b(self, t_completed: usize, b: usize) -> Vec<usize> {
        let pool = self.eligible(t_completed);
        let (lo, hi) = (*pool.start(), *pool.end());
        if hi < lo {
            return Vec::new();
        }
        let first = (hi + 1).saturating_sub(b).max(lo);
        (first..=hi).collect()
    }
}

/// Recent-B: steps `max(1, T-B+1) ..= T` (all completed steps when `B ≥ T`), ascending.
///
/// ```
/// use recall::memory::protocol::recent_b;
/// assert_eq!(recent_b(5, 2), vec![4, 5]);
/// assert_eq!(recent_b(2, 4), vec![1, 2]);
/// assert!(recent_b(5, 0).is_empty());
/// assert!(recent_b(0, 3).is_empty());
/// ```
pub fn recent_b(t_completed: usize, b: usize) -> Vec<usize> {
    Protocol::Mobile.recent_b(t_completed, b)
}

/// Checks that `allocation` is strictly increasing (sorted, no duplicates) and inside
/// [`Protocol::eligible`]`(T)`; the error names the problem.
///
/// ```
/// use recall::memory::protocol::{validate_allocation, Protocol};
/// assert!(validate_allocation(Protocol::Mobile, 5, &[1, 4]).is_ok());
/// assert!(validate_allocation(Protocol::Mobile, 5, &[4, 4]).is_err());
/// assert!(validate_allocation(Protocol::Mobile, 5, &[6]).is_err());
/// assert!(validate_allocation(Protocol::DesktopStrictEvents, 5, &[1]).is_err());
/// ```
pub fn validate_allocation(protocol: Protocol, t_completed: usize, allocation: &[usize]) -> Result<()> {
    let pool = protocol.eligible(t_completed);
    for (i, &s) in allocation.iter().enumerate() {
        if !pool.contains(&s) {
            let range = if pool.is_empty() {
                "no step is eligible".to_string()
            } else {
                format!("eligible steps are {}..={}", pool.start(), pool.end())
            };
            return Err(Error::InvalidRequest(format!(
                "allocation {allocation:?}: step {s} (position {i}) is out of range with {t_completed} completed \
                 steps under {protocol:?} ({range})"
            )));
        }
        if i > 0 {
            let prev = allocation[i - 1];
            if prev == s {
                return Err(Error::InvalidRequest(format!(
                    "allocation {allocation:?}: step {s} appears more than once"
                )));
            }
            if prev > s {
                return Err(Error::InvalidRequest(format!(
                    "allocation {allocation:?}: not sorted ({prev} before {s})"
                )));
            }
        }
    }
    Ok(())
}

/// `fold(lo..=hi)`: the lines `Step{i}: {a_i}` for `i = lo..=hi` (global, 1-based), joined with `"\n"`;
/// empty when `lo > hi`. `steps` are the completed steps (`steps[i-1]` is step `i`); `hi` must be at most
/// `steps.len()`.
///
/// ```
/// use recall::memory::episode::{Platform, StepRecord};
/// use recall::memory::protocol::fold;
/// let steps: Vec<StepRecord> = (1..=3).map(|s| StepRecord::new("x.png", format!("Action: A{s}."))).collect();
/// assert_eq!(fold(&steps, 2, 3, Platform::Mobile), "Step2: A2.\nStep3: A3.");
/// assert_eq!(fold(&steps, 3, 2, Platform::Mobile), "");
/// ```
pub fn fold(steps: &[StepRecord], lo: usize, hi: usize, platform: Platform) -> String {
    let mut out = String::new();
    for i in lo.max(1)..=hi.min(steps.len()) {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str("Step");
        out.push_str(&i.to_string());
        out.push_str(": ");
        out.push_str(&steps[i - 1].action_line_for(platform));
    }
    out
}

fn first_user_text(instruction: &str, history: &str) -> String {
    let history = if history.is_empty() {
        NO_PREVIOUS_ACTION
    } else {
        history
    };
    format!("{FIRST_USER_PREFIX}{instruction}{PREVIOUS_ACTIONS_HEADER}{history}")
}

fn image(path: &Path) -> ContentPart {
    ContentPart::Image(path.to_string_lossy().into_owned())
}

/// A user turn `[CONT(history) if non-empty, slot]` (the slot: an image, or a restored step's text).
fn continuation_turn(history: String, slot: ContentPart) -> ChatMessage {
    let mut content = Vec::with_capacity(2);
    if !history.is_empty() {
        content.push(ContentPart::Text(format!("{CONTINUED_HEADER}{history}")));
    }
    content.push(slot);
    ChatMessage::new("user", content)
}

/// What a restored history slot shows where its screenshot would be: the pixels (the method), or one of
/// the CausalCache paper's two text controls, which "keep selection, budget, and the two-pass interface
/// intact but replace each restored frame's pixels with text: the turn's verbatim recorded response, or
/// an OCR transcription of the same screenshot". The current screen `x_t` is always an image.
///
/// A text slot is one text part, [`TEXT_SLOT_HEADER`] with the step number, a newline, then the text
/// (recall's wording: the paper does not print its own).
///
/// ```
/// use recall::memory::protocol::RestoreAs;
/// assert_eq!("pixels".parse::<RestoreAs>().unwrap(), RestoreAs::default());
/// assert_eq!("ocr".parse::<RestoreAs>().unwrap(), RestoreAs::Ocr);
/// assert!("thumbnail".parse::<RestoreAs>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum RestoreAs {
    /// The archived screenshot (CausalCache).
    #[default]
    Pixels,
    /// The turn's verbatim recorded response `r_s` as text.
    Response,
    /// The screenshot's OCR transcript (`steps[s-1].ocr` of the episode; an error when absent).
    Ocr,
}

impl std::str::FromStr for RestoreAs {
    type Err = Error;

    /// `pixels`, `response` or `ocr`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "pixels" => Ok(Self::Pixels),
            "response" => Ok(Self::Response),
            "ocr" => Ok(Self::Ocr),
            other => Err(Error::InvalidRequest(format!(
                "restore-as `{other}`: expected pixels (the method), response or ocr (the paper's text controls)"
            ))),
        }
    }
}

impl RestoreAs {
    /// The name `--restore-as` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pixels => "pixels",
            Self::Response => "response",
            Self::Ocr => "ocr",
        }
    }

    /// What step `s` (1-based; `step` is its record) shows in its slot.
    fn slot(self, s: usize, step: &StepRecord) -> Result<ContentPart> {
        let text = match self {
            Self::Pixels => return Ok(image(&step.screenshot)),
            Self::Response => step.response.as_str(),
            Self::Ocr => step.ocr.as_deref().ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "restore-as ocr: step {s} (steps[{}].ocr) has no OCR transcript of its screenshot",
                    s - 1
                ))
            })?,
        };
        Ok(ContentPart::Text(format!("{TEXT_SLOT_HEADER}{s}:\n{text}")))
    }
}

/// The start of a text slot's text ([`RestoreAs`]); the step number and `:\n` follow.
pub const TEXT_SLOT_HEADER: &str = "Screenshot of Step";

/// Renders the messages of one decision (section 2): `completed` are steps `1..=T`, `allocation` the
/// steps shown with their screenshot and verbatim response (strictly increasing, within
/// [`Protocol::eligible`]), `current` the current screenshot `x_t`. An invalid allocation is an
/// [`Error::InvalidRequest`] naming the problem.
///
/// ```
/// use std::path::Path;
/// use recall::memory::episode::StepRecord;
/// use recall::memory::protocol::{render, Protocol, NO_PREVIOUS_ACTION};
/// use recall::tokenize::chat::ContentPart;
///
/// let m = render(Protocol::Mobile, "Open the clock.", &[], &[], Path::new("x1.png"))?;
/// assert_eq!(m.len(), 2);
/// let ContentPart::Text(first) = &m[1].content[0] else { unreachable!() };
/// assert!(first.ends_with(NO_PREVIOUS_ACTION));
/// # Ok::<(), recall::Error>(())
/// ```
pub fn render(
    protocol: Protocol,
    instruction: &str,
    completed: &[StepRecord],
    allocation: &[usize],
    current: &Path,
) -> Result<Vec<ChatMessage>> {
    render_with(
        protocol,
        instruction,
        completed,
        allocation,
        current,
        RestoreAs::Pixels,
    )
}

/// [`render`] with the restored slots shown as `restore` says: the same messages, each history image
/// part replaced by [`RestoreAs`]'s text for [`RestoreAs::Response`] and [`RestoreAs::Ocr`].
///
/// ```
/// use std::path::Path;
/// use recall::memory::episode::StepRecord;
/// use recall::memory::protocol::{render_with, Protocol, RestoreAs};
/// use recall::tokenize::chat::ContentPart;
///
/// let steps = vec![StepRecord::new("x1.png", "Action: Open.\n<tool_call>\n{}\n</tool_call>")];
/// let m = render_with(Protocol::Mobile, "Go.", &steps, &[1], Path::new("x2.png"), RestoreAs::Response)?;
/// assert_eq!(m[1].content[1], ContentPart::Text(format!("Screenshot of Step1:\n{}", steps[0].response)));
/// assert!(render_with(Protocol::Mobile, "Go.", &steps, &[1], Path::new("x2.png"), RestoreAs::Ocr).is_err());
/// # Ok::<(), recall::Error>(())
/// ```
pub fn render_with(
    protocol: Protocol,
    instruction: &str,
    completed: &[StepRecord],
    allocation: &[usize],
    current: &Path,
    restore: RestoreAs,
) -> Result<Vec<ChatMessage>> {
    let t = completed.len();
    validate_allocation(protocol, t, allocation)?;
    let platform = protocol.platform();
    let mut messages = Vec::with_capacity(2 * allocation.len() + 2);
    messages.push(ChatMessage::text("system", protocol.system_prompt()));
    let Some((&s1, _)) = allocation.split_first() else {
        let text = first_user_text(instruction, &fold(completed, 1, t, platform));
        messages.push(ChatMessage::new(
            "user",
            vec![ContentPart::Text(text), image(current)],
        ));
        return Ok(messages);
    };
    let text = first_user_text(instruction, &fold(completed, 1, s1 - 1, platform));
    messages.push(ChatMessage::new(
        "user",
        vec![ContentPart::Text(text), restore.slot(s1, &completed[s1 - 1])?],
    ));
    for pair in allocation.windows(2) {
        let (prev, s) = (pair[0], pair[1]);
        messages.push(ChatMessage::text(
            "assistant",
            completed[prev - 1].response.as_str(),
        ));
        messages.push(continuation_turn(
            fold(completed, prev + 1, s - 1, platform),
            restore.slot(s, &completed[s - 1])?,
        ));
    }
    let last = allocation[allocation.len() - 1];
    messages.push(ChatMessage::text(
        "assistant",
        completed[last - 1].response.as_str(),
    ));
    messages.push(continuation_turn(
        fold(completed, last + 1, t, platform),
        image(current),
    ));
    Ok(messages)
}

/// [`render`] for a replay [`Decision`] (its instruction, completed steps and current screenshot).
///
/// ```
/// use recall::memory::episode::Episode;
/// use recall::memory::protocol::{recent_b, render_decision, Protocol};
/// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/episode-sample");
/// let episode = Episode::load(&dir)?;
/// let d = episode.decision(6)?;
/// let m = render_decision(Protocol::Mobile, &d, &recent_b(5, 2))?;
/// assert_eq!(m.len(), 6);
/// # Ok::<(), recall::Error>(())
/// ```
pub fn render_decision(
    protocol: Protocol,
    decision: &Decision<'_>,
    allocation: &[usize],
) -> Result<Vec<ChatMessage>> {
    render_decision_with(protocol, decision, allocation, RestoreAs::Pixels)
}

/// [`render_with`] for a replay [`Decision`].
pub fn render_decision_with(
    protocol: Protocol,
    decision: &Decision<'_>,
    allocation: &[usize],
    restore: RestoreAs,
) -> Result<Vec<ChatMessage>> {
    render_with(
        protocol,
        decision.instruction,
        decision.completed,
        allocation,
        decision.current_screenshot,
        restore,
    )
}

/// How a step's context is laid out for the actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContextLayout {
    /// GUI-Owl-1.5's rolling layout ([`render`]): every completed step folded or retained.
    #[default]
    GuiOwl,
    /// ScopeMem's controlled study (§3.1): the task, a rolling summary of the last
    /// [`PAPER_SUMMARY_STEPS`] steps and the latest [`PAPER_SCREENSHOTS`] screenshots ([`render_paper`]).
    Paper,
}

impl std::str::FromStr for ContextLayout {
    type Err = Error;

    /// `gui-owl` or `paper`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gui-owl" => Ok(Self::GuiOwl),
            "paper" => Ok(Self::Paper),
            other => Err(Error::InvalidRequest(format!(
                "context layout `{other}`: expected gui-owl or paper"
            ))),
        }
    }
}

/// Steps in the paper layout's rolling summary.
pub const PAPER_SUMMARY_STEPS: usize = 3;
/// Screenshots in the paper layout, the current one included.
pub const PAPER_SCREENSHOTS: usize = 3;

/// The paper's actor context (ScopeMem §3.1): one user turn holding the task and the rolling summary
/// of the last three completed steps (`Step{i}: {a_i}` lines, global numbers, in [`render`]'s first
/// user text), then the latest three screenshots oldest first, the current screen last: those of
/// steps `T−1` and `T` among `shown`, the completed steps whose screenshot exists (a dataset may not
/// hold them all). The system prompt is the protocol's.
///
/// ```
/// use std::path::Path;
/// use recall::memory::episode::StepRecord;
/// use recall::memory::protocol::{render_paper, Protocol};
/// use recall::tokenize::chat::ContentPart;
///
/// let steps: Vec<StepRecord> = (1..=5)
///     .map(|s| StepRecord::new(format!("x{s}.png"), format!("Action: Do {s}.\n<tool_call>\n{{}}\n</tool_call>")))
///     .collect();
/// let m = render_paper(Protocol::Mobile, "Find cats.", &steps, &[1, 2, 3, 4, 5], Path::new("x6.png"))?;
/// assert_eq!(m.len(), 2);
/// let ContentPart::Text(text) = &m[1].content[0] else { unreachable!() };
/// assert!(text.ends_with("Previous actions:\nStep3: Do 3.\nStep4: Do 4.\nStep5: Do 5."));
/// assert_eq!(m[1].content[1..], [ContentPart::Image("x4.png".into()), ContentPart::Image("x5.png".into()),
///                                ContentPart::Image("x6.png".into())]);
/// # Ok::<(), recall::Error>(())
/// ```
pub fn render_paper(
    protocol: Protocol,
    instruction: &str,
    completed: &[StepRecord],
    shown: &[usize],
    current: &Path,
) -> Result<Vec<ChatMessage>> {
    let t = completed.len();
    validate_allocation(protocol, t, shown)?;
    let summary = fold(
        completed,
        (t + 1).saturating_sub(PAPER_SUMMARY_STEPS),
        t,
        protocol.platform(),
    );
    let mut content = vec![ContentPart::Text(first_user_text(instruction, &summary))];
    let oldest = (t + 1).saturating_sub(PAPER_SCREENSHOTS - 1);
    content.extend(
        shown
            .iter()
            .filter(|&&s| s >= oldest)
            .map(|&s| image(&completed[s - 1].screenshot)),
    );
    content.push(image(current));
    Ok(vec![
        ChatMessage::text("system", protocol.system_prompt()),
        ChatMessage::new("user", content),
    ])
}
