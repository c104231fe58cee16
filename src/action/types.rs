//! The action vocabulary: platforms, grid points, buttons, statuses, the canonical [`Action`] and its
//! queries (name, bucket, position), and the [`ParseError`] a response that holds none is reported as.

use std::fmt;

use super::MATCH_TOLERANCE;

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
    /// use recall::action::Platform;
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
    /// use recall::action::Platform;
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
    /// use recall::action::Point;
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
    /// use recall::action::Point;
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
    /// use recall::action::{parse_response, Platform};
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
    /// use recall::action::{parse_response, ActionBucket, Platform};
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
    /// use recall::action::{parse_response, Platform};
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
