//! From response text to a canonical action: the action line, the tool-call text and its JSON;
//! every failure is a [`ParseError`].

use serde_json::Value;

use super::canonical::{parse_desktop, parse_mobile};
use super::{Action, ParseError, Platform, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, UNKNOWN_ACTION_LINE};

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
    parse_arguments(value, platform)
}

/// Canonicalises a tool call's `arguments` whatever its `name` (the CausalCache authors' MobileWorld
/// server does not check the name).
///
/// ```
/// use recall::action::{parse_arguments, Platform};
/// let v = serde_json::json!({"name": "other", "arguments": {"action": "tap", "coordinate": [1, 2]}});
/// assert_eq!(parse_arguments(&v, Platform::Mobile).unwrap().name(), "click");
/// ```
pub fn parse_arguments(value: &Value, platform: Platform) -> Result<Action, ParseError> {
    let obj = value.as_object().ok_or(ParseError::NotAnObject)?;
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
