//! Rendering a canonical action: the desktop fold line and the canonical tool-call JSON.

use serde_json::Value;

use super::{Action, ActionArgs, Platform, Point, Status, DESKTOP_FALLBACK_LINE};

impl Action {
    /// The desktop fold line CausalCache renders from the parsed arguments
    /// (`gui_owl_protocol.json › desktop_action_line_templates_causalcache`); `None` for mobile actions.
    ///
    /// ```
    /// use recall::action::{parse_response, Platform};
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
    /// use recall::action::{parse_response, Platform};
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

/// `json.dumps(s, ensure_ascii=False)`: serde_json escapes exactly the characters Python does
/// (`"`, `\`, and control characters below U+0020).
fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}
