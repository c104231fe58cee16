//! Action parsing, canonicalisation and matching against the rules of `gui_owl_protocol.md` section 6
//! and the "Action equivalence" notes: a table of responses with their expected canonical tool call or
//! parse error, equivalence at the tolerance boundaries, buckets, points and pixel conventions.

use recall::agent::action::{
    action_line, action_line_or_fallback, casefold, equivalent, parse_response, to_pixels, Action,
    ActionArgs, ActionBucket, Convention, ParseError, Platform, Point, Status,
};

const M: Platform = Platform::Mobile;
const D: Platform = Platform::Desktop;

fn mobile(args: &str) -> String {
    format!("Action: Do it.\n<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {args}}}\n</tool_call>")
}

fn desktop(args: &str) -> String {
    format!(
        "Action: Do it.\n<tool_call>\n{{\"name\": \"computer_use\", \"arguments\": {args}}}\n</tool_call>"
    )
}

fn canon(tool: &str, args: &str) -> String {
    format!("{{\"name\": \"{tool}\", \"arguments\": {args}}}")
}

fn ok_m(args: &str) -> Result<String, ParseError> {
    Ok(canon("mobile_use", args))
}

fn ok_d(args: &str) -> Result<String, ParseError> {
    Ok(canon("computer_use", args))
}

fn wrong_type(key: &str, expected: &'static str) -> Result<String, ParseError> {
    Err(ParseError::WrongType {
        key: key.into(),
        expected,
    })
}

const POINT: &str = "a list of two integers";

fn unsupported(action: &str, platform: Platform) -> Result<String, ParseError> {
    Err(ParseError::UnsupportedAction {
        action: action.into(),
        platform,
    })
}

fn missing(action: &str, key: &str) -> Result<String, ParseError> {
    Err(ParseError::MissingArgument {
        action: action.into(),
        key: key.into(),
    })
}

fn unexpected(action: &str, key: &str) -> Result<String, ParseError> {
    Err(ParseError::UnexpectedArgument {
        action: action.into(),
        key: key.into(),
    })
}

fn out_of_range(key: &str, value: &str) -> Result<String, ParseError> {
    Err(ParseError::CoordinateOutOfRange {
        key: key.into(),
        value: value.into(),
    })
}

fn parse_table() -> Vec<(String, Platform, Result<String, ParseError>)> {
    let click = r#"{"action": "click", "coordinate": [540, 120]}"#;
    vec![
        // Well-formed, and the same call with other whitespace and key orders.
        (mobile(click), M, ok_m(click)),
        (
            "Action:x<tool_call>   \n\n {\"name\":\"mobile_use\",\"arguments\":{\"coordinate\":[ 540 ,120 ],\"action\":\"click\"}}\t\n</tool_call>\n"
                .into(),
            M,
            ok_m(click),
        ),
        (
            "<tool_call>{\"arguments\": {\"action\": \"click\", \"coordinate\": [540, 120]}, \"name\": \"mobile_use\"}</tool_call>"
                .into(),
            M,
            ok_m(click),
        ),
        // The last <tool_call> wins (split semantics); text after </tool_call> is ignored.
        (
            format!("<tool_call>{{\"name\": \"x\"}}</tool_call> then {} trailing", mobile(click)),
            M,
            ok_m(click),
        ),
        // Aliases (whole value only) and dropped `time`.
        (mobile(r#"{"action": "tap", "coordinate": [540, 120]}"#), M, ok_m(click)),
        (
            mobile(r#"{"action": "open_app", "text": "Clock"}"#),
            M,
            ok_m(r#"{"action": "open", "text": "Clock"}"#),
        ),
        (mobile(r#"{"action": "double_tap", "coordinate": [1, 2]}"#), M, unsupported("double_tap", M)),
        (
            mobile(r#"{"action": "long_press", "coordinate": [0, 999], "time": 2}"#),
            M,
            ok_m(r#"{"action": "long_press", "coordinate": [0, 999]}"#),
        ),
        (mobile(r#"{"action": "wait", "time": 1.5}"#), M, ok_m(r#"{"action": "wait"}"#)),
        (
            mobile(r#"{"action": "swipe", "coordinate2": [500, 200], "coordinate": [500, 800]}"#),
            M,
            ok_m(r#"{"action": "swipe", "coordinate": [500, 800], "coordinate2": [500, 200]}"#),
        ),
        (
            mobile(r#"{"action": "system_button", "button": "Enter"}"#),
            M,
            ok_m(r#"{"action": "system_button", "button": "Enter"}"#),
        ),
        (
            mobile(r#"{"action": "answer", "text": "42 \u00e9"}"#),
            M,
            ok_m(r#"{"action": "answer", "text": "42 é"}"#),
        ),
        // NFKC on mobile text.
        (
            mobile(r#"{"action": "type", "text": "ｈｅｌｌｏ ﬁle ①"}"#),
            M,
            ok_m(r#"{"action": "type", "text": "hello file 1"}"#),
        ),
        // Terminate status coercion (the original is recorded, checked below).
        (
            mobile(r#"{"action": "terminate", "status": "failure"}"#),
            M,
            ok_m(r#"{"action": "terminate", "status": "success"}"#),
        ),
        // Missing tags.
        ("Action: click\n{\"name\": \"mobile_use\"}".into(), M, Err(ParseError::MissingOpenTag)),
        (
            "Action: click\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"wait\"}}".into(),
            M,
            Err(ParseError::MissingCloseTag),
        ),
        (
            "</tool_call><tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"wait\"}}".into(),
            M,
            Err(ParseError::MissingCloseTag),
        ),
        // Bad JSON and wrong shapes.
        (
            "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"wait\"}</tool_call>".into(),
            M,
            Err(ParseError::InvalidJson(String::new())),
        ),
        (
            "<tool_call>{'name': 'mobile_use', 'arguments': {'action': 'wait'}}</tool_call>".into(),
            M,
            Err(ParseError::InvalidJson(String::new())),
        ),
        (
            "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"wait\",}}</tool_call>".into(),
            M,
            Err(ParseError::InvalidJson(String::new())),
        ),
        ("<tool_call></tool_call>".into(), M, Err(ParseError::InvalidJson(String::new()))),
        ("<tool_call>[1, 2]</tool_call>".into(), M, Err(ParseError::NotAnObject)),
        (
            "<tool_call>{\"arguments\": {\"action\": \"wait\"}}</tool_call>".into(),
            M,
            Err(ParseError::MissingName),
        ),
        (
            "<tool_call>{\"name\": 5, \"arguments\": {\"action\": \"wait\"}}</tool_call>".into(),
            M,
            Err(ParseError::MissingName),
        ),
        (
            desktop(r#"{"action": "wait"}"#),
            M,
            Err(ParseError::WrongName {
                expected: "mobile_use",
                found: "computer_use".into(),
            }),
        ),
        (
            "<tool_call>{\"name\": \"mobile_use\"}</tool_call>".into(),
            M,
            Err(ParseError::MissingArguments),
        ),
        (
            "<tool_call>{\"name\": \"mobile_use\", \"arguments\": \"{\\\"action\\\": \\\"wait\\\"}\"}</tool_call>"
                .into(),
            M,
            Err(ParseError::MissingArguments),
        ),
        (mobile(r#"{"coordinate": [1, 2]}"#), M, Err(ParseError::MissingAction)),
        (mobile(r#"{"action": 3}"#), M, Err(ParseError::MissingAction)),
        // Wrong types.
        (mobile(r#"{"action": "click", "coordinate": [1.0, 2]}"#), M, wrong_type("coordinate", POINT)),
        (mobile(r#"{"action": "click", "coordinate": [1e2, 2]}"#), M, wrong_type("coordinate", POINT)),
        (mobile(r#"{"action": "click", "coordinate": "1, 2"}"#), M, wrong_type("coordinate", POINT)),
        (mobile(r#"{"action": "click", "coordinate": [1, 2, 3]}"#), M, wrong_type("coordinate", POINT)),
        (mobile(r#"{"action": "click", "coordinate": [true, 2]}"#), M, wrong_type("coordinate", POINT)),
        (mobile(r#"{"action": "click", "coordinate": ["1", 2]}"#), M, wrong_type("coordinate", POINT)),
        (
            mobile(r#"{"action": "swipe", "coordinate": [1, 2], "coordinate2": [3]}"#),
            M,
            wrong_type("coordinate2", POINT),
        ),
        (mobile(r#"{"action": "type", "text": 5}"#), M, wrong_type("text", "a string")),
        (mobile(r#"{"action": "system_button", "button": 1}"#), M, wrong_type("button", "a string")),
        (mobile(r#"{"action": "terminate", "status": true}"#), M, wrong_type("status", "a string")),
        // Out-of-range coordinates.
        (mobile(r#"{"action": "click", "coordinate": [1000, 5]}"#), M, out_of_range("coordinate", "1000")),
        (mobile(r#"{"action": "click", "coordinate": [5, -1]}"#), M, out_of_range("coordinate", "-1")),
        (
            mobile(r#"{"action": "swipe", "coordinate": [1, 2], "coordinate2": [3, 4000]}"#),
            M,
            out_of_range("coordinate2", "4000"),
        ),
        // Unknown or rejected actions and buttons.
        (mobile(r#"{"action": "key", "text": "volume_up"}"#), M, unsupported("key", M)),
        (mobile(r#"{"action": "scroll", "coordinate": [1, 2]}"#), M, unsupported("scroll", M)),
        (mobile(r#"{"action": "Click", "coordinate": [1, 2]}"#), M, unsupported("Click", M)),
        (mobile(r#"{"action": "left_click", "coordinate": [1, 2]}"#), M, unsupported("left_click", M)),
        (
            mobile(r#"{"action": "system_button", "button": "Menu"}"#),
            M,
            Err(ParseError::InvalidButton("Menu".into())),
        ),
        (
            mobile(r#"{"action": "system_button", "button": "back"}"#),
            M,
            Err(ParseError::InvalidButton("back".into())),
        ),
        // Exact key sets.
        (mobile(r#"{"action": "click", "coordinate": [1, 2], "text": "x"}"#), M, unexpected("click", "text")),
        (mobile(r#"{"action": "wait", "coordinate": [1, 2]}"#), M, unexpected("wait", "coordinate")),
        (mobile(r#"{"action": "swipe", "coordinate": [1, 2]}"#), M, missing("swipe", "coordinate2")),
        (mobile(r#"{"action": "terminate"}"#), M, missing("terminate", "status")),
        (mobile(r#"{"action": "tap"}"#), M, missing("click", "coordinate")),
        // Desktop.
        (
            desktop(r#"{"action": "click", "coordinate": [10, 20]}"#),
            D,
            ok_d(r#"{"action": "left_click", "coordinate": [10, 20]}"#),
        ),
        (
            desktop(r#"{"action": "doubleclick", "coordinate": [10, 20]}"#),
            D,
            ok_d(r#"{"action": "double_click", "coordinate": [10, 20]}"#),
        ),
        (
            desktop(r#"{"coordinate": [999, 0], "action": "right_click"}"#),
            D,
            ok_d(r#"{"action": "right_click", "coordinate": [999, 0]}"#),
        ),
        (
            desktop(r#"{"action": "drag", "coordinate2": [30, 40], "coordinate": [10, 20]}"#),
            D,
            ok_d(r#"{"action": "left_click_drag", "coordinate": [10, 20], "coordinate2": [30, 40]}"#),
        ),
        (
            desktop(r#"{"action": "left_click_drag", "coordinate2": [30, 40]}"#),
            D,
            ok_d(r#"{"action": "left_click_drag", "coordinate2": [30, 40]}"#),
        ),
        (
            desktop(r#"{"action": "left_click_drag", "coordinate": [30, 40]}"#),
            D,
            missing("left_click_drag", "coordinate2"),
        ),
        (
            desktop(r#"{"action": "key", "keys": ["ctrl", "s"]}"#),
            D,
            ok_d(r#"{"action": "key", "keys": ["ctrl", "s"]}"#),
        ),
        (desktop(r#"{"action": "key", "keys": []}"#), D, wrong_type("keys", "a non-empty list of strings")),
        (desktop(r#"{"action": "key", "keys": "ctrl+s"}"#), D, wrong_type("keys", "a non-empty list of strings")),
        (desktop(r#"{"action": "key", "keys": ["ctrl", 1]}"#), D, wrong_type("keys", "a non-empty list of strings")),
        (
            desktop(r#"{"action": "type", "text": "ｈｉ \"q\""}"#),
            D,
            ok_d(r#"{"action": "type", "text": "ｈｉ \"q\""}"#),
        ),
        (
            desktop(r#"{"action": "scroll", "pixels": -5}"#),
            D,
            ok_d(r#"{"action": "scroll", "pixels": -5}"#),
        ),
        (
            desktop(r#"{"action": "hscroll", "pixels": 3, "coordinate": [5, 6]}"#),
            D,
            ok_d(r#"{"action": "hscroll", "coordinate": [5, 6], "pixels": 3}"#),
        ),
        (desktop(r#"{"action": "scroll", "pixels": 1.5}"#), D, wrong_type("pixels", "an integer")),
        (desktop(r#"{"action": "scroll"}"#), D, missing("scroll", "pixels")),
        (desktop(r#"{"action": "wait", "time": 2}"#), D, ok_d(r#"{"action": "wait"}"#)),
        (
            desktop(r#"{"action": "terminate", "status": "failure"}"#),
            D,
            ok_d(r#"{"action": "terminate", "status": "failure"}"#),
        ),
        (
            desktop(r#"{"action": "terminate"}"#),
            D,
            ok_d(r#"{"action": "terminate", "status": "success"}"#),
        ),
        (
            desktop(r#"{"action": "terminate", "status": "done"}"#),
            D,
            Err(ParseError::InvalidStatus("done".into())),
        ),
        (desktop(r#"{"action": "triple_click", "coordinate": [1, 2]}"#), D, unsupported("triple_click", D)),
        (desktop(r#"{"action": "swipe", "coordinate": [1, 2]}"#), D, unsupported("swipe", D)),
        (
            desktop(r#"{"action": "left_click", "coordinate": [1, 2], "button": "left"}"#),
            D,
            unexpected("left_click", "button"),
        ),
        (
            mobile(r#"{"action": "wait"}"#),
            D,
            Err(ParseError::WrongName {
                expected: "computer_use",
                found: "mobile_use".into(),
            }),
        ),
    ]
}

#[test]
fn parse_table_matches_the_protocol_rules() {
    let table = parse_table();
    let mut failures = Vec::new();
    for (response, platform, expected) in &table {
        let got = parse_response(response, *platform).map(|a| a.tool_call_json());
        let same = match (&got, expected) {
            // The serde_json message is not part of the contract; the variant is.
            (Err(ParseError::InvalidJson(_)), Err(ParseError::InvalidJson(_))) => true,
            _ => &got == expected,
        };
        if !same {
            failures.push(format!(
                "{platform} {response:?}\n  got:      {got:?}\n  expected: {expected:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {}:\n{}",
        failures.len(),
        table.len(),
        failures.join("\n")
    );
    assert!(table.len() >= 70);
}

#[test]
fn terminate_coercion_is_recorded() {
    let a = parse_response(&mobile(r#"{"action": "terminate", "status": "failure"}"#), M).unwrap();
    assert_eq!(
        a.args,
        ActionArgs::Terminate {
            status: Status::Success
        }
    );
    assert_eq!(a.coerced_status.as_deref(), Some("failure"));
    let b = parse_response(&mobile(r#"{"action": "terminate", "status": "success"}"#), M).unwrap();
    assert_eq!(b.coerced_status, None);
    assert!(equivalent(&a, &b, M));
}

#[test]
fn parse_errors_display_their_cause() {
    let err = parse_response(&mobile(r#"{"action": "click", "coordinate": [1000, 5]}"#), M).unwrap_err();
    assert_eq!(err.to_string(), "`coordinate` component 1000 is outside [0, 999]");
    let err = parse_response("no call", M).unwrap_err();
    assert_eq!(err.to_string(), "no <tool_call> tag in the response");
    let err: Box<dyn std::error::Error> =
        Box::new(parse_response(&mobile(r#"{"action": "key"}"#), M).unwrap_err());
    assert_eq!(err.to_string(), "unsupported mobile action `key`");
}

#[test]
fn action_line_extraction() {
    let cases = [
        (
            "Action: Open the menu.\n<tool_call>\n{}\n</tool_call>",
            "Open the menu.",
        ),
        (
            "Thought: x\nAction: first\nAction:   last one  \n<tool_call>{}</tool_call>",
            "last one",
        ),
        ("Action: no call at all\n", "no call at all"),
        ("plain text", "plain text"),
        ("Action:\u{3000}全角\u{3000}\n<tool_call>", "全角"),
        ("Action: a <tool_call> b <tool_call> c", "a"),
        ("<tool_call>{}</tool_call>", ""),
        ("Action:\n<tool_call>x</tool_call>", ""),
    ];
    for (response, expected) in cases {
        assert_eq!(action_line(response), expected, "{response:?}");
    }
    // CausalCache's fallback: the parsed action name, else `unknown action`.
    let tap = "Action: \n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"tap\", \"coordinate\": [1, 2]}}\n</tool_call>";
    assert_eq!(action_line_or_fallback(tap, M), "click");
    assert_eq!(
        action_line_or_fallback("Action:  <tool_call>{bad}</tool_call>", M),
        "unknown action"
    );
    assert_eq!(
        action_line_or_fallback("Action: Go.<tool_call>{bad}</tool_call>", M),
        "Go."
    );
}

fn m(args: &str) -> Action {
    parse_response(&mobile(args), M).unwrap_or_else(|e| panic!("{args}: {e}"))
}

fn d(args: &str) -> Action {
    parse_response(&desktop(args), D).unwrap_or_else(|e| panic!("{args}: {e}"))
}

fn click_m(x: u32, y: u32) -> Action {
    m(&format!(r#"{{"action": "click", "coordinate": [{x}, {y}]}}"#))
}

fn click_d(x: u32, y: u32) -> Action {
    d(&format!(
        r#"{{"action": "left_click", "coordinate": [{x}, {y}]}}"#
    ))
}

#[test]
fn mobile_equivalence_boundaries() {
    let base = click_m(100, 100);
    // Euclidean ≤ 25: (15, 20) is exactly 25; (1, 25) is 25.02; (0, 26) is 26.
    assert!(equivalent(&base, &click_m(115, 120), M));
    assert!(equivalent(&base, &click_m(85, 80), M));
    assert!(equivalent(&base, &click_m(100, 125), M));
    assert!(!equivalent(&base, &click_m(101, 125), M));
    assert!(!equivalent(&base, &click_m(100, 126), M));
    assert!(!equivalent(&base, &click_m(116, 120), M));
    // Chebyshev would accept (20, 20) (Euclidean 28.3); mobile does not.
    assert!(!equivalent(&base, &click_m(120, 120), M));
    // long_press and swipe compare their coordinates too; swipe needs both.
    let lp = |x: u32| {
        m(&format!(
            r#"{{"action": "long_press", "coordinate": [{x}, 500]}}"#
        ))
    };
    assert!(equivalent(&lp(500), &lp(525), M) && !equivalent(&lp(500), &lp(526), M));
    let swipe = |y2: u32| {
        m(&format!(
            r#"{{"action": "swipe", "coordinate": [500, 800], "coordinate2": [500, {y2}]}}"#
        ))
    };
    assert!(equivalent(&swipe(200), &swipe(225), M));
    assert!(!equivalent(&swipe(200), &swipe(226), M));
    // Different types never match.
    assert!(!equivalent(&click_m(100, 100), &lp(100), M));
    // Casefolded text, open, answer.
    let t = |a: &str, s: &str| m(&format!(r#"{{"action": "{a}", "text": "{s}"}}"#));
    assert!(equivalent(
        &t("type", "Hello World"),
        &t("type", "hELLO wORLD"),
        M
    ));
    assert!(equivalent(&t("type", "Straße"), &t("type", "STRASSE"), M));
    assert!(!equivalent(&t("type", "Hello"), &t("type", "Hello "), M));
    assert!(equivalent(&t("open", "Clock"), &t("open_app", "clock"), M));
    assert!(equivalent(&t("answer", "ÉTÉ"), &t("answer", "été"), M));
    assert!(!equivalent(&t("answer", "yes"), &t("type", "yes"), M));
    // Buttons.
    let btn = |b: &str| m(&format!(r#"{{"action": "system_button", "button": "{b}"}}"#));
    assert!(equivalent(&btn("Back"), &btn("Back"), M));
    assert!(!equivalent(&btn("Back"), &btn("Home"), M));
    // Other types match on type.
    assert!(equivalent(
        &m(r#"{"action": "wait", "time": 1}"#),
        &m(r#"{"action": "wait"}"#),
        M
    ));
    // Actions of the other platform never match.
    assert!(!equivalent(&base, &base, D));
}

#[test]
fn desktop_equivalence_boundaries() {
    let base = click_d(100, 100);
    // click ≡ left_click.
    assert!(equivalent(
        &base,
        &d(r#"{"action": "click", "coordinate": [100, 100]}"#),
        D
    ));
    // Chebyshev ≤ 25.
    assert!(equivalent(&base, &click_d(120, 120), D));
    assert!(equivalent(&base, &click_d(125, 75), D));
    assert!(!equivalent(&base, &click_d(126, 100), D));
    assert!(!equivalent(&base, &click_d(100, 74), D));
    assert!(!equivalent(
        &base,
        &d(r#"{"action": "double_click", "coordinate": [100, 100]}"#),
        D
    ));
    // Text exact.
    let ty = |s: &str| d(&format!(r#"{{"action": "type", "text": "{s}"}}"#));
    assert!(equivalent(&ty("Hello"), &ty("Hello"), D));
    assert!(!equivalent(&ty("Hello"), &ty("hello"), D));
    // Keys as casefolded lists.
    let key = |k: &str| d(&format!(r#"{{"action": "key", "keys": {k}}}"#));
    assert!(equivalent(&key(r#"["Ctrl", "S"]"#), &key(r#"["ctrl", "s"]"#), D));
    assert!(!equivalent(&key(r#"["s", "ctrl"]"#), &key(r#"["ctrl", "s"]"#), D));
    assert!(!equivalent(&key(r#"["ctrl"]"#), &key(r#"["ctrl", "s"]"#), D));
    // Scroll pixels of the same sign.
    let sc = |a: &str, p: i64| d(&format!(r#"{{"action": "{a}", "pixels": {p}}}"#));
    assert!(equivalent(&sc("scroll", -5), &sc("scroll", -1), D));
    assert!(!equivalent(&sc("scroll", -5), &sc("scroll", 3), D));
    assert!(equivalent(&sc("scroll", 0), &sc("scroll", 0), D));
    assert!(!equivalent(&sc("scroll", 0), &sc("scroll", -1), D));
    assert!(!equivalent(&sc("scroll", 5), &sc("hscroll", 5), D));
    // Status equal.
    let term = |s: &str| d(&format!(r#"{{"action": "terminate", "status": "{s}"}}"#));
    assert!(equivalent(&term("success"), &d(r#"{"action": "terminate"}"#), D));
    assert!(!equivalent(&term("success"), &term("failure"), D));
    // Drags: both ends within tolerance; a start on one side only does not match.
    let drag = |a: &str| d(&format!(r#"{{"action": "left_click_drag", {a}}}"#));
    assert!(equivalent(
        &drag(r#""coordinate": [0, 0], "coordinate2": [500, 500]"#),
        &drag(r#""coordinate": [25, 25], "coordinate2": [475, 525]"#),
        D
    ));
    assert!(!equivalent(
        &drag(r#""coordinate": [0, 0], "coordinate2": [500, 500]"#),
        &drag(r#""coordinate2": [500, 500]"#),
        D
    ));
}

/// (action, canonical name, bucket, primary point).
type BucketCase = (Action, &'static str, ActionBucket, Option<(f64, f64)>);

#[test]
fn buckets_points_and_names() {
    let cases: [BucketCase; 16] = [
        (click_m(1, 2), "click", ActionBucket::Click, Some((1.0, 2.0))),
        (
            m(r#"{"action": "long_press", "coordinate": [3, 4]}"#),
            "long_press",
            // A press at a point: the CausalCache authors' action features count it as a click.
            ActionBucket::Click,
            Some((3.0, 4.0)),
        ),
        (
            m(r#"{"action": "swipe", "coordinate": [5, 6], "coordinate2": [7, 8]}"#),
            "swipe",
            ActionBucket::Scroll,
            Some((5.0, 6.0)),
        ),
        (
            m(r#"{"action": "type", "text": "x"}"#),
            "type",
            ActionBucket::Type,
            None,
        ),
        (
            m(r#"{"action": "system_button", "button": "Home"}"#),
            "system_button",
            ActionBucket::Key,
            None,
        ),
        (
            m(r#"{"action": "open", "text": "x"}"#),
            "open",
            ActionBucket::Other,
            None,
        ),
        (
            m(r#"{"action": "answer", "text": "x"}"#),
            "answer",
            ActionBucket::Other,
            None,
        ),
        (
            m(r#"{"action": "terminate", "status": "success"}"#),
            "terminate",
            ActionBucket::Other,
            None,
        ),
        (
            click_d(9, 10),
            "left_click",
            ActionBucket::Click,
            Some((9.0, 10.0)),
        ),
        (
            d(r#"{"action": "right_click", "coordinate": [1, 1]}"#),
            "right_click",
            ActionBucket::Click,
            Some((1.0, 1.0)),
        ),
        (
            d(r#"{"action": "mouse_move", "coordinate": [2, 2]}"#),
            "mouse_move",
            ActionBucket::Other,
            Some((2.0, 2.0)),
        ),
        (
            d(r#"{"action": "left_click_drag", "coordinate2": [3, 3]}"#),
            "left_click_drag",
            ActionBucket::Other,
            Some((3.0, 3.0)),
        ),
        (
            d(r#"{"action": "key", "keys": ["enter"]}"#),
            "key",
            ActionBucket::Key,
            None,
        ),
        (
            d(r#"{"action": "scroll", "pixels": 2}"#),
            "scroll",
            ActionBucket::Scroll,
            None,
        ),
        (
            d(r#"{"action": "hscroll", "pixels": 2, "coordinate": [4, 4]}"#),
            "hscroll",
            ActionBucket::Scroll,
            Some((4.0, 4.0)),
        ),
        (d(r#"{"action": "wait"}"#), "wait", ActionBucket::Other, None),
    ];
    for (action, name, bucket, point) in cases {
        assert_eq!(action.name(), name);
        assert_eq!(action.bucket(), bucket, "{name}");
        assert_eq!(action.point(), point, "{name}");
    }
}

#[test]
fn desktop_action_line_templates() {
    let cases = [
        (
            r#"{"action": "click", "coordinate": [120, 45]}"#,
            "Click at (120, 45).",
        ),
        (
            r#"{"action": "right_click", "coordinate": [1, 2]}"#,
            "Right-click at (1, 2).",
        ),
        (
            r#"{"action": "middle_click", "coordinate": [1, 2]}"#,
            "Middle-click at (1, 2).",
        ),
        (
            r#"{"action": "double_click", "coordinate": [1, 2]}"#,
            "Double-click at (1, 2).",
        ),
        (
            r#"{"action": "mouse_move", "coordinate": [1, 2]}"#,
            "Move the cursor to (1, 2).",
        ),
        (
            r#"{"action": "left_click_drag", "coordinate": [1, 2], "coordinate2": [3, 4]}"#,
            "Drag from (1, 2) to (3, 4).",
        ),
        (
            r#"{"action": "left_click_drag", "coordinate2": [3, 4]}"#,
            "Drag to (3, 4).",
        ),
        (
            r#"{"action": "type", "text": "a \"b\"\n"}"#,
            r#"Type "a \"b\"\n"."#,
        ),
        (
            r#"{"action": "key", "keys": ["ctrl", "shift", "t"]}"#,
            "Press ctrl+shift+t.",
        ),
        (r#"{"action": "scroll", "pixels": 5}"#, "Scroll up."),
        (r#"{"action": "scroll", "pixels": 0}"#, "Scroll down."),
        (r#"{"action": "hscroll", "pixels": 5}"#, "Scroll right."),
        (r#"{"action": "hscroll", "pixels": -5}"#, "Scroll left."),
        (r#"{"action": "wait"}"#, "Wait for the screen to update."),
        (r#"{"action": "terminate"}"#, "Task completed."),
        (r#"{"action": "terminate", "status": "failure"}"#, "Task failed."),
        (r#"{"action": "answer", "text": "café"}"#, r#"Answer "café"."#),
    ];
    for (args, line) in cases {
        assert_eq!(d(args).desktop_action_line().as_deref(), Some(line), "{args}");
    }
    assert_eq!(click_m(1, 2).desktop_action_line(), None);
}

#[test]
fn pixel_conventions_match_python() {
    // (v, W, MobileWorld, CausalCache AndroidWorld, upstream AndroidWorld, upstream resized), computed
    // with the Python expressions of gui_owl_protocol.md section 6.
    let table: [(u32, u32, u32, u32, u32, u32); 7] = [
        (0, 1080, 0, 0, 0, 0),
        (1, 1080, 1, 1, 1, 1),
        (500, 1080, 540, 540, 540, 540),
        (999, 1080, 1079, 1079, 1080, 1078),
        (333, 2400, 800, 800, 800, 799),
        (777, 1344, 1045, 1045, 1045, 1044),
        (998, 720, 718, 718, 719, 718),
    ];
    for (v, w, mw, cc, up, rs) in table {
        assert_eq!(to_pixels(v, w, Convention::MobileWorld), mw, "{v} {w}");
        assert_eq!(
            to_pixels(v, w, Convention::CausalCacheAndroidWorld),
            cc,
            "{v} {w}"
        );
        assert_eq!(to_pixels(v, w, Convention::UpstreamAndroidWorld), up, "{v} {w}");
        assert_eq!(to_pixels(v, w, Convention::UpstreamResized), rs, "{v} {w}");
    }
    assert_eq!(Convention::default(), Convention::MobileWorld);
    // MobileWorld stays on screen for every grid value.
    for w in [1u32, 2, 720, 1080, 1440] {
        for v in 0..=999 {
            assert!(to_pixels(v, w, Convention::MobileWorld) < w);
            assert!(to_pixels(v, w, Convention::CausalCacheAndroidWorld) < w);
        }
    }
}

#[test]
fn casefold_and_points() {
    assert_eq!(casefold("ǅemal ΣΑΣ"), "ǆemal σασ");
    assert!(Point::new(0, 0).near_euclidean(Point::new(7, 24)));
    assert!(!Point::new(999, 999).near_euclidean(Point::new(0, 0)));
    assert!(Point::new(999, 0).near_chebyshev(Point::new(974, 25)));
}
