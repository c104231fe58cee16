//! The CausalCache authors' MobileWorld policy output (`serve_mobileworld_gui_owl_policy.py`,
//! `mobileworld.py::mobileworld_action_from_gui_owl`): a response parsed leniently (the tool's name is
//! not checked; `tap` is `click`; `time` is dropped; a terminate status other than `success` becomes
//! `success`, the dropped values reported), then mapped to a MobileWorld `JSONAction` in screen
//! pixels, `round(v / 999 · (size − 1))` with Python's ties-to-even.

use serde_json::{json, Map, Value};

use super::parse::tool_call_text;
use super::pixels::{to_pixels, Convention};
use super::{parse_arguments, Action, ActionArgs, Button, ParseError, Platform};

/// A response as the authors' server reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct OfficialParse {
    /// The canonical action, or why there is none (the authors' `parse_error` wording).
    pub action: Result<Action, String>,
    /// Arguments the canonicalisation dropped or changed: `time`, a coerced terminate `status`.
    pub dropped: Map<String, Value>,
}

/// Parses `response` as the authors' MobileWorld server does.
///
/// ```
/// use recall::action::parse_official;
/// let r = "Action: Wait.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"wait\", \"time\": 2}}\n</tool_call>";
/// let p = parse_official(r);
/// assert_eq!(p.action.unwrap().name(), "wait");
/// assert_eq!(p.dropped["time"], 2);
/// assert_eq!(parse_official("no call").action.unwrap_err(), "no tool call present");
/// ```
pub fn parse_official(response: &str) -> OfficialParse {
    let mut dropped = Map::new();
    let action = official_action(response, &mut dropped);
    OfficialParse { action, dropped }
}

fn official_action(response: &str, dropped: &mut Map<String, Value>) -> Result<Action, String> {
    let text = tool_call_text(response).map_err(|_| "no tool call present".to_string())?;
    let value: Value = serde_json::from_str(text).map_err(|e| format!("tool call is not valid JSON: {e}"))?;
    if let Some(time) = value.get("arguments").and_then(|a| a.get("time")) {
        dropped.insert("time".into(), time.clone());
    }
    let action = parse_arguments(&value, Platform::Mobile).map_err(|e| match e {
        ParseError::NotAnObject | ParseError::MissingArguments => "tool call missing arguments".to_string(),
        other => format!("uncanonical action: {other}"),
    })?;
    if let Some(status) = &action.coerced_status {
        dropped.insert("status".into(), json!(status));
    }
    Ok(action)
}

/// The MobileWorld `JSONAction` of a mobile action on a `width` × `height` screen.
///
/// ```
/// use recall::action::{mobileworld_action, parse_response, Platform};
/// let r = "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [999, 0]}}</tool_call>";
/// let a = parse_response(r, Platform::Mobile).unwrap();
/// assert_eq!(mobileworld_action(&a, 100, 200), serde_json::json!({"action_type": "click", "x": 99, "y": 0}));
/// ```
pub fn mobileworld_action(action: &Action, width: u32, height: u32) -> Value {
    let px = |v: u32, size: u32| to_pixels(v, size, Convention::MobileWorld);
    match &action.args {
        ActionArgs::Click { coordinate } | ActionArgs::LongPress { coordinate } => json!({
            "action_type": action.name(),
            "x": px(coordinate.x, width),
            "y": px(coordinate.y, height),
        }),
        ActionArgs::Swipe {
            coordinate,
            coordinate2,
        } => json!({
            "action_type": "drag",
            "start_x": px(coordinate.x, width),
            "start_y": px(coordinate.y, height),
            "end_x": px(coordinate2.x, width),
            "end_y": px(coordinate2.y, height),
        }),
        ActionArgs::Type { text } => json!({"action_type": "input_text", "text": text}),
        ActionArgs::SystemButton { button } => json!({"action_type": match button {
            Button::Back => "navigate_back",
            Button::Home => "navigate_home",
            Button::Enter => "keyboard_enter",
        }}),
        ActionArgs::Open { text } => json!({"action_type": "open_app", "app_name": text}),
        ActionArgs::Answer { text } => json!({"action_type": "answer", "text": text}),
        ActionArgs::Terminate { .. } => json!({"action_type": "finished", "text": "success"}),
        _ => json!({"action_type": "wait"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::parse_response;

    /// The authors' own cases for `mobileworld_action_from_gui_owl` (luojiaxuan/CausalCache, `code/causalcache/mobileworld.py`'s tests).
    #[test]
    fn the_authors_mapping_cases() {
        let call = |args: &str| {
            format!("<tool_call>{{\"name\": \"mobile_use\", \"arguments\": {args}}}</tool_call>")
        };
        let a = |args: &str| parse_response(&call(args), Platform::Mobile).unwrap();
        assert_eq!(
            mobileworld_action(
                &a(r#"{"action": "swipe", "coordinate": [0, 0], "coordinate2": [999, 999]}"#),
                100,
                200
            ),
            json!({"action_type": "drag", "start_x": 0, "start_y": 0, "end_x": 99, "end_y": 199})
        );
        let t = parse_official(&call(r#"{"action": "terminate", "status": "failure"}"#));
        assert_eq!(
            mobileworld_action(&t.action.unwrap(), 100, 200),
            json!({"action_type": "finished", "text": "success"})
        );
        assert_eq!(t.dropped["status"], "failure");
    }
}
