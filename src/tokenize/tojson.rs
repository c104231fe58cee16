//! JSON text exactly as Python's `json.dumps(x, ensure_ascii=False)` writes it: what the chat templates'
//! `tojson` filter (transformers' `chat_template_utils.tojson`) puts into a prompt, and what vLLM's
//! tool parsers return as a tool call's `arguments`.
//!
//! The differences from `serde_json::to_string` that matter in a prompt: `", "` and `": "` separators,
//! and floats in Python's `repr` (`1e-05`, `1e+16`, `2.0`). Objects keep their key order (recall builds
//! `serde_json` with `preserve_order`, as Python dicts keep insertion order); strings are escaped the
//! same way by both (`\n`, `\"`, `\u001b`; non-ASCII kept).

use serde_json::Value;

/// `json.dumps(v, ensure_ascii=False)`.
///
/// ```
/// use recall::tokenize::tojson::python_json;
/// let v: serde_json::Value = serde_json::from_str(r#"{"b":[1,2.5,1e-5],"a":{"é":"x\ny"},"c":null}"#).unwrap();
/// assert_eq!(python_json(&v), r#"{"b": [1, 2.5, 1e-05], "a": {"é": "x\ny"}, "c": null}"#);
/// ```
pub fn python_json(v: &Value) -> String {
    let mut out = String::new();
    write(&mut out, v);
    out
}

fn write(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if n.is_f64() {
                out.push_str(&python_float(n.as_f64().unwrap_or(f64::NAN)));
            } else {
                out.push_str(&n.to_string());
            }
        }
        Value::String(s) => out.push_str(&Value::String(s.clone()).to_string()),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write(out, x);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write(out, x);
            }
            out.push('}');
        }
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for exponents in
/// `[-4, 16)` (with a `.0` when integral), else `d.ddde±XX`.
///
/// ```
/// use recall::tokenize::tojson::python_float;
/// assert_eq!(python_float(100.0), "100.0");
/// assert_eq!(python_float(0.0001), "0.0001");
/// assert_eq!(python_float(0.00001), "1e-05");
/// assert_eq!(python_float(1.5e16), "1.5e+16");
/// assert_eq!(python_float(1e15), "1000000000000000.0");
/// assert_eq!(python_float(-2.5e-7), "-2.5e-07");
/// ```
pub fn python_float(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "NaN".into()
        } else if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // `{:e}` gives the shortest round-trip digits in scientific form: "1.5e16", "-2.5e-7", "0e0".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let positional = format!("{x}");
    if positional.contains('.') {
        positional
    } else {
        format!("{positional}.0")
    }
}
