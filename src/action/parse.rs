//! From response text to a canonical action: the action line, the tool-call text, its JSON, and the
//! [`ParseError`] every failure is reported as.

use serde_json::Value;

use super::canonical::{parse_desktop, parse_mobile};
use super::{Action, Platform, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, UNKNOWN_ACTION_LINE};

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
/// use recall::action::action_line;
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
/// use recall::action::{action_line_or_fallback, Platform};
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
/// use recall::action::{tool_call_text, ParseError};
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
/// use recall::action::{parse_response, ParseError, Platform};
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
/// use recall::action::{parse_tool_call, Platform};
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
