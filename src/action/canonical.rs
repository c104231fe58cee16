//! The per-platform canonicalisation rules: aliases, exact argument key sets, typed arguments.

use serde_json::{Map, Value};
use unicode_normalization::UnicodeNormalization;

use super::{Action, ActionArgs, Button, ParseError, Platform, Point, Status, GRID_MAX};

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

pub(super) fn parse_mobile(raw_action: &str, args: &Map<String, Value>) -> Result<Action, ParseError> {
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

pub(super) fn parse_desktop(raw_action: &str, args: &Map<String, Value>) -> Result<Action, ParseError> {
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
