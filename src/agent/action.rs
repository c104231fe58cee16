//! GUI-Owl-1.5 actions: parse a model response, canonicalise its tool call, match two actions.
//!
//! The rules are those of `shared/protocols/gui_owl_protocol.md` section 6 and of the "Action
//! equivalence" notes; see `docs/FORMATS.md` for the full table. In brief:
//!
//! * A response is `Action: <line>\n<tool_call>\n{json}\n</tool_call>`. [`action_line`] extracts the line
//!   exactly as `r.split("Action:")[-1].split("<tool_call>")[0].strip()` does.
//! * [`parse_response`] extracts the tool call as
//!   `json.loads(r.split("<tool_call>")[-1].split("</tool_call>")[0].strip())`, requiring both tags (the
//!   closing one after the last opening one), a JSON object whose `name` is the platform's function
//!   (`mobile_use` or `computer_use`) and whose `arguments` member is an object with a string `action`.
//!   Whitespace and key order do not matter; types do. Any failure is a [`ParseError`]; nothing is guessed.
//! * Mobile canonicalisation (CausalCache `_canonical_action`): aliases `tap→click`, `open_app→open` (whole
//!   value, not upstream's substring replace); `time` dropped; the canonical actions are click, long_press,
//!   swipe, type, system_button, open, wait, answer, terminate, so `key` is rejected; exact argument key
//!   sets; a coordinate is two JSON integers in `[0, 999]`; `text` is NFKC-normalised; `button` is Back,
//!   Home or Enter (`Menu` is rejected); a terminate `status` other than `success` becomes `success` and
//!   the original is kept in [`Action::coerced_status`].
//! * Desktop (`computer_use`, 13 actions): the RL-bridge aliases (`click→left_click`, `drag`,
//!   `leftclick`, `doubleclick`, `rightclick`, `middleclick`); `time` dropped; exact key sets with two
//!   optional members (the drag start `coordinate`, the scroll position `coordinate`) and an optional
//!   terminate `status` (default `success`); coordinates as on mobile; `keys` a non-empty list of
//!   strings; `pixels` an integer; text kept verbatim.
//! * [`equivalent`]: mobile — same action, Euclidean distance ≤ 25 on the grid for `coordinate` and
//!   `coordinate2`, casefolded text, equal button; desktop — same action (`click` is `left_click`),
//!   Chebyshev distance ≤ 25, exact text, keys equal as casefolded lists, scroll pixels of the same sign,
//!   equal status.
//!
//! ```
//! use recall::agent::action::{equivalent, parse_response, ActionBucket, Platform};
//!
//! let r = "Action: Tap the search bar.\n<tool_call>\n\
//!          {\"name\": \"mobile_use\", \"arguments\": {\"action\": \"tap\", \"coordinate\": [540, 120]}}\n\
//!          </tool_call>";
//! let a = parse_response(r, Platform::Mobile).unwrap();
//! assert_eq!(a.name(), "click");
//! assert_eq!(a.point(), Some((540.0, 120.0)));
//! assert_eq!(a.bucket(), ActionBucket::Click);
//!
//! let b = parse_response(
//!     "<tool_call>{\"arguments\": {\"coordinate\": [555, 140], \"action\": \"click\"}, \"name\": \"mobile_use\"}</tool_call>",
//!     Platform::Mobile,
//! )
//! .unwrap();
//! assert!(equivalent(&a, &b, Platform::Mobile)); // distance 25
//! ```

use std::fmt;

use serde_json::{Map, Value};
use unicode_normalization::UnicodeNormalization;

/// The largest coordinate on the model's 1000×1000 grid.
pub const GRID_MAX: u32 = 999;
/// Distance (grid units) within which two coordinates match, Euclidean on mobile, Chebyshev on desktop.
pub const MATCH_TOLERANCE: u32 = 25;
/// The opening tag of a tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// The closing tag of a tool call (token id 151658, CausalCache's stop token).
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";
/// The action line CausalCache uses when neither the text nor the tool call yields one.
pub const UNKNOWN_ACTION_LINE: &str = "unknown action";
/// The desktop fold line when a response's action cannot be rendered from its arguments.
pub const DESKTOP_FALLBACK_LINE: &str = "Wait for the screen to update.";

/// The device family an episode runs on; selects the tool (`mobile_use` / `computer_use`) and its rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Platform {
    /// A phone, driven through the `mobile_use` tool.
    Mobile,
    /// A desktop computer, driven through the `computer_use` tool.
    Desktop,
}

impl Platform {
    /// The function name the platform's tool calls carry.
    ///
    /// ```
    /// use recall::agent::action::Platform;
    /// assert_eq!(Platform::Mobile.tool_name(), "mobile_use");
    /// assert_eq!(Platform::Desktop.tool_name(), "computer_use");
    /// ```
    pub fn tool_name(self) -> &'static str {
        match self {
            Self::Mobile => "mobile_use",
            Self::Desktop => "computer_use",
        }
    }

    /// The lowercase name used in files (`mobile`, `desktop`).
    ///
    /// ```
    /// use recall::agent::action::Platform;
    /// assert_eq!(Platform::from_name("desktop"), Some(Platform::Desktop));
    /// assert_eq!(Platform::Mobile.as_str(), "mobile");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mobile => "mobile",
            Self::Desktop => "desktop",
        }
    }

    /// The platform named `mobile` or `desktop`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "mobile" => Some(Self::Mobile),
            "desktop" => Some(Self::Desktop),
            _ => None,
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a response does not hold a valid action. Reported as is: a caller maps it to its own UNKNOWN
/// step (CausalCache) or error; the parser never guesses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// No `<tool_call>` in the response.
    #[error("no <tool_call> tag in the response")]
    MissingOpenTag,
    /// No `</tool_call>` after the last `<tool_call>`.
    #[error("no </tool_call> tag after the last <tool_call>")]
    MissingCloseTag,
    /// The text between the tags is not JSON.
    #[error("the tool call is not valid JSON: {0}")]
    InvalidJson(String),
    /// The tool call is JSON but not an object.
    #[error("the tool call is not a JSON object")]
    NotAnObject,
    /// The tool call has no string `name`.
    #[error("the tool call has no string `name`")]
    MissingName,
    /// The tool call names another function than the platform's.
    #[error("the tool call names `{found}`, expected `{expected}`")]
    WrongName {
        /// The platform's function name.
        expected: &'static str,
        /// The name in the response.
        found: String,
    },
    /// The tool call has no `arguments` member or it is not an object.
    #[error("the tool call has no `arguments` object")]
    MissingArguments,
    /// `arguments.action` is missing or not a string.
    #[error("`arguments.action` is missing or not a string")]
    MissingAction,
    /// The action is not one the platform's canonical set holds (mobile `key`, a misspelling, ...).
    #[error("unsupported {platform} action `{action}`")]
    UnsupportedAction {
        /// The action as given (after aliasing).
        action: String,
        /// The platform it was parsed for.
        platform: Platform,
    },
    /// A required argument is absent.
    #[error("`{action}` requires `{key}`")]
    MissingArgument {
        /// The canonical action.
        action: String,
        /// The absent key.
        key: String,
    },
    /// An argument the action does not take.
    #[error("`{action}` does not take `{key}`")]
    UnexpectedArgument {
        /// The canonical action.
        action: String,
        /// The extra key.
        key: String,
    },
    /// An argument of the wrong JSON type.
    #[error("`{key}` must be {expected}")]
    WrongType {
        /// The argument.
        key: String,
        /// What it must be.
        expected: &'static str,
    },
    /// A coordinate component outside `[0, 999]`.
    #[error("`{key}` component {value} is outside [0, 999]")]
    CoordinateOutOfRange {
        /// `coordinate` or `coordinate2`.
        key: String,
        /// The offending value.
        value: String,
    },
    /// A `system_button` other than Back, Home, Enter.
    #[error("unsupported system button `{0}` (Back, Home, Enter)")]
    InvalidButton(String),
    /// A desktop terminate status other than success/failure.
    #[error("invalid terminate status `{0}` (success, failure)")]
    InvalidStatus(String),
}

/// A point on the model's 1000×1000 grid, both components in `[0, 999]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Point {
    /// Column, from the left edge.
    pub x: u32,
    /// Row, from the top edge.
    pub y: u32,
}

impl Point {
    /// A grid point.
    pub fn new(x: u32, y: u32) -> Self {
        Self { x, y }
    }

    fn dx_dy(self, other: Point) -> (u64, u64) {
        (
            u64::from(self.x.abs_diff(other.x)),
            u64::from(self.y.abs_diff(other.y)),
        )
    }

    /// Euclidean distance ≤ [`MATCH_TOLERANCE`] (exact, on integer squares).
    ///
    /// ```
    /// use recall::agent::action::Point;
    /// assert!(Point::new(0, 0).near_euclidean(Point::new(15, 20))); // 25
    /// assert!(!Point::new(0, 0).near_euclidean(Point::new(1, 25))); // 25.02
    /// ```
    pub fn near_euclidean(self, other: Point) -> bool {
        let (dx, dy) = self.dx_dy(other);
        let t = u64::from(MATCH_TOLERANCE);
        dx * dx + dy * dy <= t * t
    }

    /// Chebyshev distance ≤ [`MATCH_TOLERANCE`].
    ///
    /// ```
    /// use recall::agent::action::Point;
    /// assert!(Point::new(0, 0).near_chebyshev(Point::new(25, 25)));
    /// assert!(!Point::new(0, 0).near_chebyshev(Point::new(26, 0)));
    /// ```
    pub fn near_chebyshev(self, other: Point) -> bool {
        let (dx, dy) = self.dx_dy(other);
        dx.max(dy) <= u64::from(MATCH_TOLERANCE)
    }
}

/// A mobile system button (the canonical set; `Menu` is rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Button {
    /// Return to the previous interface.
    Back,
    /// Return to the home screen.
    Home,
    /// Press enter.
    Enter,
}

impl Button {
    /// The button's name as it appears in tool calls.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Back => "Back",
            Self::Home => "Home",
            Self::Enter => "Enter",
        }
    }
}

/// A terminate status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// The task is complete.
    Success,
    /// The task failed (desktop only; mobile coerces every status to success).
    Failure,
}

impl Status {
    /// `success` or `failure`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
        }
    }
}

/// The canonical action and its typed arguments. Mobile actions come first, desktop-only ones after;
/// `Type`, `Wait`, `Answer`, `Terminate` exist on both platforms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActionArgs {
    /// Mobile `click` (alias `tap`).
    Click {
        /// Where to tap.
        coordinate: Point,
    },
    /// Mobile `long_press` (`time` dropped).
    LongPress {
        /// Where to press.
        coordinate: Point,
    },
    /// Mobile `swipe` from `coordinate` to `coordinate2`.
    Swipe {
        /// Start.
        coordinate: Point,
        /// End.
        coordinate2: Point,
    },
    /// `type` (mobile: NFKC-normalised; desktop: verbatim).
    Type {
        /// The text to enter.
        text: String,
    },
    /// Mobile `system_button`.
    SystemButton {
        /// Back, Home or Enter.
        button: Button,
    },
    /// Mobile `open` (alias `open_app`): the app name, NFKC-normalised.
    Open {
        /// The app name.
        text: String,
    },
    /// `wait` (`time` dropped).
    Wait,
    /// `answer` (mobile: NFKC-normalised; desktop: verbatim).
    Answer {
        /// The answer.
        text: String,
    },
    /// `terminate`.
    Terminate {
        /// Mobile: always `Success` (see [`Action::coerced_status`]).
        status: Status,
    },
    /// Desktop `key`: keys pressed together, in order.
    Key {
        /// The key names, as given (non-empty).
        keys: Vec<String>,
    },
    /// Desktop `mouse_move`.
    MouseMove {
        /// Target.
        coordinate: Point,
    },
    /// Desktop `left_click` (alias `click`, `leftclick`).
    LeftClick {
        /// Target.
        coordinate: Point,
    },
    /// Desktop `right_click`.
    RightClick {
        /// Target.
        coordinate: Point,
    },
    /// Desktop `middle_click`.
    MiddleClick {
        /// Target.
        coordinate: Point,
    },
    /// Desktop `double_click`.
    DoubleClick {
        /// Target.
        coordinate: Point,
    },
    /// Desktop `left_click_drag` to `coordinate2`, from `coordinate` when given.
    LeftClickDrag {
        /// Start, if given.
        coordinate: Option<Point>,
        /// End.
        coordinate2: Point,
    },
    /// Desktop `scroll` (positive: up).
    Scroll {
        /// Wheel amount.
        pixels: i64,
        /// Where the pointer is, if given.
        coordinate: Option<Point>,
    },
    /// Desktop `hscroll` (positive: right).
    HScroll {
        /// Wheel amount.
        pixels: i64,
        /// Where the pointer is, if given.
        coordinate: Option<Point>,
    },
}

/// The coarse class of an action, as the selector's one-hot feature uses it.
///
/// Click: mobile `click` and `long_press` (a press at a point: the CausalCache authors' features count
/// it as a click), desktop `left_click`, `right_click`, `middle_click`, `double_click`.
/// Type: `type`. Key: desktop `key` and mobile `system_button` (Back/Home/Enter are key events).
/// Scroll: mobile `swipe`, desktop `scroll`, `hscroll`. Other: everything else (`open`, `wait`,
/// `answer`, `terminate`, `mouse_move`, `left_click_drag`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActionBucket {
    /// A pointer click.
    Click,
    /// Text entry.
    Type,
    /// A key or system button.
    Key,
    /// A scroll or swipe.
    Scroll,
    /// Anything else.
    Other,
}

/// A parsed, canonical action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// The platform whose rules produced it.
    pub platform: Platform,
    /// The action and its arguments.
    pub args: ActionArgs,
    /// Mobile `terminate` only: the original status when it was not `success` (it was coerced).
    pub coerced_status: Option<String>,
}

impl Action {
    /// The canonical action name (`click`, `left_click`, `swipe`, ...).
    ///
    /// ```
    /// use recall::agent::action::{parse_response, Platform};
    /// let r = "<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [1, 2]}}</tool_call>";
    /// assert_eq!(parse_response(r, Platform::Desktop).unwrap().name(), "left_click");
    /// ```
    pub fn name(&self) -> &str {
        match &self.args {
            ActionArgs::Click { .. } => "click",
            ActionArgs::LongPress { .. } => "long_press",
            ActionArgs::Swipe { .. } => "swipe",
            ActionArgs::Type { .. } => "type",
            ActionArgs::SystemButton { .. } => "system_button",
            ActionArgs::Open { .. } => "open",
            ActionArgs::Wait => "wait",
            ActionArgs::Answer { .. } => "answer",
            ActionArgs::Terminate { .. } => "terminate",
            ActionArgs::Key { .. } => "key",
            ActionArgs::MouseMove { .. } => "mouse_move",
            ActionArgs::LeftClick { .. } => "left_click",
            ActionArgs::RightClick { .. } => "right_click",
            ActionArgs::MiddleClick { .. } => "middle_click",
            ActionArgs::DoubleClick { .. } => "double_click",
            ActionArgs::LeftClickDrag { .. } => "left_click_drag",
            ActionArgs::Scroll { .. } => "scroll",
            ActionArgs::HScroll { .. } => "hscroll",
        }
    }

    /// The action's bucket (see [`ActionBucket`]).
    ///
    /// ```
    /// use recall::agent::action::{parse_response, ActionBucket, Platform};
    /// let r = "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"swipe\", \"coordinate\": [5, 900], \"coordinate2\": [5, 100]}}</tool_call>";
    /// assert_eq!(parse_response(r, Platform::Mobile).unwrap().bucket(), ActionBucket::Scroll);
    /// let r = "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"long_press\", \"coordinate\": [5, 900]}}</tool_call>";
    /// assert_eq!(parse_response(r, Platform::Mobile).unwrap().bucket(), ActionBucket::Click);
    /// ```
    pub fn bucket(&self) -> ActionBucket {
        match &self.args {
            ActionArgs::Click { .. }
            | ActionArgs::LeftClick { .. }
            | ActionArgs::RightClick { .. }
            | ActionArgs::MiddleClick { .. }
            | ActionArgs::DoubleClick { .. }
            | ActionArgs::LongPress { .. } => ActionBucket::Click,
            ActionArgs::Type { .. } => ActionBucket::Type,
            ActionArgs::Key { .. } | ActionArgs::SystemButton { .. } => ActionBucket::Key,
            ActionArgs::Swipe { .. } | ActionArgs::Scroll { .. } | ActionArgs::HScroll { .. } => {
                ActionBucket::Scroll
            }
            ActionArgs::Open { .. }
            | ActionArgs::Wait
            | ActionArgs::Answer { .. }
            | ActionArgs::Terminate { .. }
            | ActionArgs::MouseMove { .. }
            | ActionArgs::LeftClickDrag { .. } => ActionBucket::Other,
        }
    }

    /// The primary grid coordinate: `coordinate` when the action has one, else the drag target
    /// (`left_click_drag` without a start); `None` for actions without a position.
    ///
    /// ```
    /// use recall::agent::action::{parse_response, Platform};
    /// let r = "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"wait\", \"time\": 2}}</tool_call>";
    /// assert_eq!(parse_response(r, Platform::Mobile).unwrap().point(), None);
    /// ```
    pub fn point(&self) -> Option<(f64, f64)> {
        self.grid_point().map(|p| (f64::from(p.x), f64::from(p.y)))
    }

    /// Like [`point`](Self::point), as a grid [`Point`].
    pub fn grid_point(&self) -> Option<Point> {
        match &self.args {
            ActionArgs::Click { coordinate }
            | ActionArgs::LongPress { coordinate }
            | ActionArgs::Swipe { coordinate, .. }
            | ActionArgs::MouseMove { coordinate }
            | ActionArgs::LeftClick { coordinate }
            | ActionArgs::RightClick { coordinate }
            | ActionArgs::MiddleClick { coordinate }
            | ActionArgs::DoubleClick { coordinate } => Some(*coordinate),
            ActionArgs::LeftClickDrag {
                coordinate,
                coordinate2,
            } => Some(coordinate.unwrap_or(*coordinate2)),
            ActionArgs::Scroll { coordinate, .. } | ActionArgs::HScroll { coordinate, .. } => *coordinate,
            _ => None,
        }
    }

    /// The desktop fold line CausalCache renders from the parsed arguments
    /// (`gui_owl_protocol.json › desktop_action_line_templates_causalcache`); `None` for mobile actions.
    ///
    /// ```
    /// use recall::agent::action::{parse_response, Platform};
    /// let r = "<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"key\", \"keys\": [\"ctrl\", \"s\"]}}</tool_call>";
    /// let a = parse_response(r, Platform::Desktop).unwrap();
    /// assert_eq!(a.desktop_action_line().as_deref(), Some("Press ctrl+s."));
    /// ```
    pub fn desktop_action_line(&self) -> Option<String> {
        if self.platform != Platform::Desktop {
            return None;
        }
        let line = match &self.args {
            ActionArgs::LeftClick { coordinate: p } => format!("Click at ({}, {}).", p.x, p.y),
            ActionArgs::RightClick { coordinate: p } => format!("Right-click at ({}, {}).", p.x, p.y),
            ActionArgs::MiddleClick { coordinate: p } => format!("Middle-click at ({}, {}).", p.x, p.y),
            ActionArgs::DoubleClick { coordinate: p } => format!("Double-click at ({}, {}).", p.x, p.y),
            ActionArgs::MouseMove { coordinate: p } => format!("Move the cursor to ({}, {}).", p.x, p.y),
            ActionArgs::LeftClickDrag {
                coordinate: Some(p),
                coordinate2: q,
            } => format!("Drag from ({}, {}) to ({}, {}).", p.x, p.y, q.x, q.y),
            ActionArgs::LeftClickDrag {
                coordinate: None,
                coordinate2: q,
            } => format!("Drag to ({}, {}).", q.x, q.y),
            ActionArgs::Type { text } => format!("Type {}.", json_string(text)),
            ActionArgs::Key { keys } => format!("Press {}.", keys.join("+")),
            ActionArgs::Scroll { pixels, .. } => {
                (if *pixels > 0 { "Scroll up." } else { "Scroll down." }).to_string()
            }
            ActionArgs::HScroll { pixels, .. } => (if *pixels > 0 {
                "Scroll right."
            } else {
                "Scroll left."
            })
            .to_string(),
            ActionArgs::Wait => DESKTOP_FALLBACK_LINE.to_string(),
            ActionArgs::Terminate { status } => match status {
                Status::Success => "Task completed.".to_string(),
                Status::Failure => "Task failed.".to_string(),
            },
            ActionArgs::Answer { text } => format!("Answer {}.", json_string(text)),
            _ => return None,
        };
        Some(line)
    }

    /// The canonical tool call as Python's `json.dumps(..., ensure_ascii=False)` writes it:
    /// `{"name": "<tool>", "arguments": {...}}` with the arguments in the protocol's key order
    /// (`action`, `keys`, `coordinate`, `coordinate2`, `text`, `button`, `pixels`, `status`). A coerced
    /// mobile status is written as `success`.
    ///
    /// ```
    /// use recall::agent::action::{parse_response, Platform};
    /// let r = "<tool_call>{\"arguments\": {\"text\": \"ﬁle\", \"action\": \"type\"}, \"name\": \"mobile_use\"}</tool_call>";
    /// assert_eq!(
    ///     parse_response(r, Platform::Mobile).unwrap().tool_call_json(),
    ///     "{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"type\", \"text\": \"file\"}}"
    /// );
    /// ```
    pub fn tool_call_json(&self) -> String {
        let mut parts: Vec<(&str, String)> = vec![("action", json_string(self.name()))];
        let point = |p: &Point| format!("[{}, {}]", p.x, p.y);
        match &self.args {
            ActionArgs::Click { coordinate }
            | ActionArgs::LongPress { coordinate }
            | ActionArgs::MouseMove { coordinate }
            | ActionArgs::LeftClick { coordinate }
            | ActionArgs::RightClick { coordinate }
            | ActionArgs::MiddleClick { coordinate }
            | ActionArgs::DoubleClick { coordinate } => parts.push(("coordinate", point(coordinate))),
            ActionArgs::Swipe {
                coordinate,
                coordinate2,
            } => {
                parts.push(("coordinate", point(coordinate)));
                parts.push(("coordinate2", point(coordinate2)));
            }
            ActionArgs::LeftClickDrag {
                coordinate,
                coordinate2,
            } => {
                if let Some(c) = coordinate {
                    parts.push(("coordinate", point(c)));
                }
                parts.push(("coordinate2", point(coordinate2)));
            }
            ActionArgs::Type { text } | ActionArgs::Open { text } | ActionArgs::Answer { text } => {
                parts.push(("text", json_string(text)))
            }
            ActionArgs::SystemButton { button } => parts.push(("button", json_string(button.as_str()))),
            ActionArgs::Wait => {}
            ActionArgs::Terminate { status } => parts.push(("status", json_string(status.as_str()))),
            ActionArgs::Key { keys } => {
                let list: Vec<String> = keys.iter().map(|k| json_string(k)).collect();
                parts.insert(1, ("keys", format!("[{}]", list.join(", "))));
            }
            ActionArgs::Scroll { pixels, coordinate } | ActionArgs::HScroll { pixels, coordinate } => {
                if let Some(c) = coordinate {
                    parts.push(("coordinate", point(c)));
                }
                parts.push(("pixels", pixels.to_string()));
            }
        }
        let args: Vec<String> = parts.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        format!(
            "{{\"name\": \"{}\", \"arguments\": {{{}}}}}",
            self.platform.tool_name(),
            args.join(", ")
        )
    }
}

/// Python's `str.strip()` whitespace: Unicode White_Space plus the separators U+001C–U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s.strip()` as Python does it.
pub(crate) fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// The action line of a response: `r.split("Action:")[-1].split("<tool_call>")[0].strip()`, the text
/// after the last `Action:` and before the first `<tool_call>` that follows it, stripped. Empty when the
/// response has none (see [`action_line_or_fallback`] for CausalCache's fallback).
///
/// ```
/// use recall::agent::action::action_line;
/// let r = "Thought.\nAction: Open the menu.\n<tool_call>\n{}\n</tool_call>";
/// assert_eq!(action_line(r), "Open the menu.");
/// assert_eq!(action_line("no marker here"), "no marker here");
/// ```
pub fn action_line(response: &str) -> &str {
    let after = match response.rfind("Action:") {
        Some(i) => &response[i + "Action:".len()..],
        None => response,
    };
    let before = match after.find(TOOL_CALL_OPEN) {
        Some(i) => &after[..i],
        None => after,
    };
    py_strip(before)
}

/// The action line with CausalCache's fallback for mobile: when [`action_line`] is empty, the canonical
/// name of the parsed action (e.g. `click`), or [`UNKNOWN_ACTION_LINE`] when the response does not parse.
///
/// ```
/// use recall::agent::action::{action_line_or_fallback, Platform};
/// let r = "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"tap\", \"coordinate\": [1, 2]}}</tool_call>";
/// assert_eq!(action_line_or_fallback(r, Platform::Mobile), "click");
/// assert_eq!(action_line_or_fallback("Action:  \n<tool_call>oops</tool_call>", Platform::Mobile), "unknown action");
/// ```
pub fn action_line_or_fallback(response: &str, platform: Platform) -> String {
    let line = action_line(response);
    if !line.is_empty() {
        return line.to_string();
    }
    match parse_response(response, platform) {
        Ok(action) => action.name().to_string(),
        Err(_) => UNKNOWN_ACTION_LINE.to_string(),
    }
}

/// The tool-call JSON text of a response, `r.split("<tool_call>")[-1].split("</tool_call>")[0].strip()`,
/// with both tags required.
///
/// ```
/// use recall::agent::action::{tool_call_text, ParseError};
/// assert_eq!(tool_call_text("a<tool_call> {} </tool_call>b"), Ok("{}"));
/// assert_eq!(tool_call_text("a</tool_call><tool_call>{}"), Err(ParseError::MissingCloseTag));
/// ```
pub fn tool_call_text(response: &str) -> Result<&str, ParseError> {
    let open = response.rfind(TOOL_CALL_OPEN).ok_or(ParseError::MissingOpenTag)?;
    let after = &response[open + TOOL_CALL_OPEN.len()..];
    let close = after.find(TOOL_CALL_CLOSE).ok_or(ParseError::MissingCloseTag)?;
    Ok(py_strip(&after[..close]))
}

/// Parses a response into its canonical action under `platform`'s rules (see the module docs).
///
/// ```
/// use recall::agent::action::{parse_response, ParseError, Platform};
/// let r = "Action: Press Menu.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"system_button\", \"button\": \"Menu\"}}\n</tool_call>";
/// assert_eq!(parse_response(r, Platform::Mobile), Err(ParseError::InvalidButton("Menu".into())));
/// ```
pub fn parse_response(response: &str, platform: Platform) -> Result<Action, ParseError> {
    let text = tool_call_text(response)?;
    let value: Value = serde_json::from_str(text).map_err(|e| ParseError::InvalidJson(e.to_string()))?;
    parse_tool_call(&value, platform)
}

/// Canonicalises an already-decoded tool call `{"name": ..., "arguments": {...}}`.
///
/// ```
/// use recall::agent::action::{parse_tool_call, Platform};
/// let v = serde_json::json!({"name": "mobile_use", "arguments": {"action": "open_app", "text": "Clock"}});
/// assert_eq!(parse_tool_call(&v, Platform::Mobile).unwrap().name(), "open");
/// ```
pub fn parse_tool_call(value: &Value, platform: Platform) -> Result<Action, ParseError> {
    let obj = value.as_object().ok_or(ParseError::NotAnObject)?;
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .ok_or(ParseError::MissingName)?;
    if name != platform.tool_name() {
        return Err(ParseError::WrongName {
            expected: platform.tool_name(),
            found: name.to_string(),
        });
    }
    let args = obj
        .get("arguments")
        .and_then(Value::as_object)
        .ok_or(ParseError::MissingArguments)?;
    let raw_action = args
        .get("action")
        .and_then(Value::as_str)
        .ok_or(ParseError::MissingAction)?;
    match platform {
        Platform::Mobile => parse_mobile(raw_action, args),
        Platform::Desktop => parse_desktop(raw_action, args),
    }
}

/// Checks the key set of `args` (with `action`; `time` already ignored): every `required` key present,
/// nothing outside `required ∪ optional`.
fn check_keys(
    action: &str,
    args: &Map<String, Value>,
    required: &[&str],
    optional: &[&str],
) -> Result<(), ParseError> {
    for key in required {
        if !args.contains_key(*key) {
            return Err(ParseError::MissingArgument {
                action: action.to_string(),
                key: (*key).to_string(),
            });
        }
    }
    let mut extra: Vec<&String> = args
        .keys()
        .filter(|k| {
            let k = k.as_str();
            k != "action" && k != "time" && !required.contains(&k) && !optional.contains(&k)
        })
        .collect();
    extra.sort();
    if let Some(key) = extra.first() {
        return Err(ParseError::UnexpectedArgument {
            action: action.to_string(),
            key: (*key).clone(),
        });
    }
    Ok(())
}

fn get_point(args: &Map<String, Value>, key: &str) -> Result<Point, ParseError> {
    let wrong = || ParseError::WrongType {
        key: key.to_string(),
        expected: "a list of two integers",
    };
    let list = args.get(key).and_then(Value::as_array).ok_or_else(wrong)?;
    if list.len() != 2 {
        return Err(wrong());
    }
    let mut out = [0u32; 2];
    for (slot, v) in out.iter_mut().zip(list) {
        let Value::Number(n) = v else {
            return Err(wrong());
        };
        if !(n.is_i64() || n.is_u64()) {
            return Err(wrong());
        }
        match n.as_u64() {
            Some(u) if u <= u64::from(GRID_MAX) => *slot = u as u32,
            _ => {
                return Err(ParseError::CoordinateOutOfRange {
                    key: key.to_string(),
                    value: n.to_string(),
                })
            }
        }
    }
    Ok(Point::new(out[0], out[1]))
}

fn get_opt_point(args: &Map<String, Value>, key: &str) -> Result<Option<Point>, ParseError> {
    if args.contains_key(key) {
        get_point(args, key).map(Some)
    } else {
        Ok(None)
    }
}

fn get_str<'a>(args: &'a Map<String, Value>, key: &str) -> Result<&'a str, ParseError> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ParseError::WrongType {
            key: key.to_string(),
            expected: "a string",
        })
}

fn nfkc(s: &str) -> String {
    s.nfkc().collect()
}

fn parse_mobile(raw_action: &str, args: &Map<String, Value>) -> Result<Action, ParseError> {
    let action = match raw_action {
        "tap" => "click",
        "open_app" => "open",
        other => other,
    };
    let keys = |required: &[&str]| check_keys(action, args, required, &[]);
    let mut coerced_status = None;
    let parsed = match action {
        "click" | "long_press" => {
            keys(&["coordinate"])?;
            let coordinate = get_point(args, "coordinate")?;
            if action == "click" {
                ActionArgs::Click { coordinate }
            } else {
                ActionArgs::LongPress { coordinate }
            }
        }
        "swipe" => {
            keys(&["coordinate", "coordinate2"])?;
            ActionArgs::Swipe {
                coordinate: get_point(args, "coordinate")?,
                coordinate2: get_point(args, "coordinate2")?,
            }
        }
        "type" | "open" | "answer" => {
            keys(&["text"])?;
            let text = nfkc(get_str(args, "text")?);
            match action {
                "type" => ActionArgs::Type { text },
                "open" => ActionArgs::Open { text },
                _ => ActionArgs::Answer { text },
            }
        }
        "system_button" => {
            keys(&["button"])?;
            let button = match get_str(args, "button")? {
                "Back" => Button::Back,
                "Home" => Button::Home,
                "Enter" => Button::Enter,
                other => return Err(ParseError::InvalidButton(other.to_string())),
            };
            ActionArgs::SystemButton { button }
        }
        "wait" => {
            keys(&[])?;
            ActionArgs::Wait
        }
        "terminate" => {
            keys(&["status"])?;
            let status = get_str(args, "status")?;
            if status != "success" {
                coerced_status = Some(status.to_string());
            }
            ActionArgs::Terminate {
                status: Status::Success,
            }
        }
        other => {
            return Err(ParseError::UnsupportedAction {
                action: other.to_string(),
                platform: Platform::Mobile,
            })
        }
    };
    Ok(Action {
        platform: Platform::Mobile,
        args: parsed,
        coerced_status,
    })
}

fn parse_desktop(raw_action: &str, args: &Map<String, Value>) -> Result<Action, ParseError> {
    let action = match raw_action {
        "click" | "leftclick" => "left_click",
        "drag" => "left_click_drag",
        "doubleclick" => "double_click",
        "rightclick" => "right_click",
        "middleclick" => "middle_click",
        other => other,
    };
    let parsed = match action {
        "mouse_move" | "left_click" | "right_click" | "middle_click" | "double_click" => {
            check_keys(action, args, &["coordinate"], &[])?;
            let coordinate = get_point(args, "coordinate")?;
            match action {
                "mouse_move" => ActionArgs::MouseMove { coordinate },
                "left_click" => ActionArgs::LeftClick { coordinate },
                "right_click" => ActionArgs::RightClick { coordinate },
                "middle_click" => ActionArgs::MiddleClick { coordinate },
                _ => ActionArgs::DoubleClick { coordinate },
            }
        }
        "left_click_drag" => {
            check_keys(action, args, &["coordinate2"], &["coordinate"])?;
            ActionArgs::LeftClickDrag {
                coordinate: get_opt_point(args, "coordinate")?,
                coordinate2: get_point(args, "coordinate2")?,
            }
        }
        "type" | "answer" => {
            check_keys(action, args, &["text"], &[])?;
            let text = get_str(args, "text")?.to_string();
            if action == "type" {
                ActionArgs::Type { text }
            } else {
                ActionArgs::Answer { text }
            }
        }
        "key" => {
            check_keys(action, args, &["keys"], &[])?;
            let wrong = || ParseError::WrongType {
                key: "keys".to_string(),
                expected: "a non-empty list of strings",
            };
            let list = args.get("keys").and_then(Value::as_array).ok_or_else(wrong)?;
            if list.is_empty() {
                return Err(wrong());
            }
            let keys = list
                .iter()
                .map(|k| k.as_str().map(str::to_string).ok_or_else(wrong))
                .collect::<Result<Vec<_>, _>>()?;
            ActionArgs::Key { keys }
        }
        "scroll" | "hscroll" => {
            check_keys(action, args, &["pixels"], &["coordinate"])?;
            let pixels = args
                .get("pixels")
                .and_then(Value::as_i64)
                .ok_or_else(|| ParseError::WrongType {
                    key: "pixels".to_string(),
                    expected: "an integer",
                })?;
            let coordinate = get_opt_point(args, "coordinate")?;
            if action == "scroll" {
                ActionArgs::Scroll { pixels, coordinate }
            } else {
                ActionArgs::HScroll { pixels, coordinate }
            }
        }
        "wait" => {
            check_keys(action, args, &[], &[])?;
            ActionArgs::Wait
        }
        "terminate" => {
            check_keys(action, args, &[], &["status"])?;
            let status = match args.get("status") {
                None => Status::Success,
                Some(_) => match get_str(args, "status")? {
                    "success" => Status::Success,
                    "failure" => Status::Failure,
                    other => return Err(ParseError::InvalidStatus(other.to_string())),
                },
            };
            ActionArgs::Terminate { status }
        }
        other => {
            return Err(ParseError::UnsupportedAction {
                action: other.to_string(),
                platform: Platform::Desktop,
            })
        }
    };
    Ok(Action {
        platform: Platform::Desktop,
        args: parsed,
        coerced_status: None,
    })
}

/// Python's `str.casefold()` for the characters where it differs from `to_lowercase` in practice
/// (`ß`/`ẞ` → `ss`, final sigma → `σ`, `ﬁ`-style ligatures via their lowercase), else `to_lowercase`.
///
/// ```
/// use recall::agent::action::casefold;
/// assert_eq!(casefold("Straße"), "strasse");
/// assert_eq!(casefold("ΣΊΣΥΦΟΣ"), casefold("σίσυφος"));
/// ```
pub fn casefold(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            'ß' | 'ẞ' => out.push_str("ss"),
            'ς' => out.push('σ'),
            'ſ' => out.push('s'),
            'ﬀ' => out.push_str("ff"),
            'ﬁ' => out.push_str("fi"),
            'ﬂ' => out.push_str("fl"),
            'ﬃ' => out.push_str("ffi"),
            'ﬄ' => out.push_str("ffl"),
            'ﬅ' | 'ﬆ' => out.push_str("st"),
            _ => out.extend(c.to_lowercase().map(|l| if l == 'ς' { 'σ' } else { l })),
        }
    }
    out
}

/// Whether `a` and `b` are the same action under `platform`'s matching rules (see the module docs). Two
/// actions parsed for another platform than `platform` never match.
///
/// ```
/// use recall::agent::action::{equivalent, parse_response, Platform};
/// let p = |r: &str| parse_response(r, Platform::Desktop).unwrap();
/// let a = p("<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [100, 100]}}</tool_call>");
/// let b = p("<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_click\", \"coordinate\": [120, 120]}}</tool_call>");
/// assert!(equivalent(&a, &b, Platform::Desktop)); // Chebyshev 20
/// ```
pub fn equivalent(a: &Action, b: &Action, platform: Platform) -> bool {
    if a.platform != platform || b.platform != platform {
        return false;
    }
    let near = |p: Point, q: Point| match platform {
        Platform::Mobile => p.near_euclidean(q),
        Platform::Desktop => p.near_chebyshev(q),
    };
    let near_opt = |p: &Option<Point>, q: &Option<Point>| match (p, q) {
        (Some(p), Some(q)) => near(*p, *q),
        (None, None) => true,
        _ => false,
    };
    let text_eq = |x: &str, y: &str| match platform {
        Platform::Mobile => casefold(x) == casefold(y),
        Platform::Desktop => x == y,
    };
    use ActionArgs as A;
    match (&a.args, &b.args) {
        (A::Click { coordinate: p }, A::Click { coordinate: q })
        | (A::LongPress { coordinate: p }, A::LongPress { coordinate: q })
        | (A::MouseMove { coordinate: p }, A::MouseMove { coordinate: q })
        | (A::LeftClick { coordinate: p }, A::LeftClick { coordinate: q })
        | (A::RightClick { coordinate: p }, A::RightClick { coordinate: q })
        | (A::MiddleClick { coordinate: p }, A::MiddleClick { coordinate: q })
        | (A::DoubleClick { coordinate: p }, A::DoubleClick { coordinate: q }) => near(*p, *q),
        (
            A::Swipe {
                coordinate: p,
                coordinate2: p2,
            },
            A::Swipe {
                coordinate: q,
                coordinate2: q2,
            },
        ) => near(*p, *q) && near(*p2, *q2),
        (
            A::LeftClickDrag {
                coordinate: p,
                coordinate2: p2,
            },
            A::LeftClickDrag {
                coordinate: q,
                coordinate2: q2,
            },
        ) => near_opt(p, q) && near(*p2, *q2),
        (A::Type { text: x }, A::Type { text: y })
        | (A::Open { text: x }, A::Open { text: y })
        | (A::Answer { text: x }, A::Answer { text: y }) => text_eq(x, y),
        (A::SystemButton { button: x }, A::SystemButton { button: y }) => x == y,
        (A::Key { keys: x }, A::Key { keys: y }) => {
            x.len() == y.len() && x.iter().zip(y).all(|(k, l)| casefold(k) == casefold(l))
        }
        (A::Scroll { pixels: x, .. }, A::Scroll { pixels: y, .. })
        | (A::HScroll { pixels: x, .. }, A::HScroll { pixels: y, .. }) => x.signum() == y.signum(),
        (A::Terminate { status: x }, A::Terminate { status: y }) => match platform {
            Platform::Mobile => true,
            Platform::Desktop => x == y,
        },
        (A::Wait, A::Wait) => true,
        _ => false,
    }
}

/// How a grid coordinate becomes a pixel (protocol section 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Convention {
    /// CausalCache MobileWorld: `round(v / 999 * (W - 1))` (Python `round`, ties to even). The default.
    #[default]
    MobileWorld,
    /// CausalCache AndroidWorld: `(2 * v * (W - 1) + 999) // 1998`.
    CausalCacheAndroidWorld,
    /// Upstream AndroidWorld (`qwen-vl` source format): `int(v / 999 * W)`.
    UpstreamAndroidWorld,
    /// Upstream `mobile_use` / `computer_use` scripts: `int(v / 1000 * W)`, `W` the smart-resized size.
    UpstreamResized,
}

/// The pixel of grid value `v` along an axis of `size` pixels (width for x, height for y).
///
/// ```
/// use recall::agent::action::{to_pixels, Convention};
/// assert_eq!(to_pixels(999, 1080, Convention::MobileWorld), 1079);
/// assert_eq!(to_pixels(500, 1080, Convention::MobileWorld), 540);
/// assert_eq!(to_pixels(500, 1080, Convention::CausalCacheAndroidWorld), 540);
/// assert_eq!(to_pixels(500, 1080, Convention::UpstreamAndroidWorld), 540);
/// assert_eq!(to_pixels(500, 1092, Convention::UpstreamResized), 546);
/// ```
pub fn to_pixels(v: u32, size: u32, convention: Convention) -> u32 {
    let (v64, w) = (f64::from(v), f64::from(size));
    match convention {
        Convention::MobileWorld => (v64 / 999.0 * (w - 1.0)).round_ties_even().max(0.0) as u32,
        Convention::CausalCacheAndroidWorld => {
            let num = 2 * u64::from(v) * u64::from(size.saturating_sub(1)) + 999;
            (num / 1998) as u32
        }
        Convention::UpstreamAndroidWorld => (v64 / 999.0 * w).trunc() as u32,
        Convention::UpstreamResized => (v64 / 1000.0 * w).trunc() as u32,
    }
}

/// `json.dumps(s, ensure_ascii=False)`: serde_json escapes exactly the characters Python does
/// (`"`, `\`, and control characters below U+0020).
fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}
