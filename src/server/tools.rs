//! Function calling as vLLM serves Qwen models (`--enable-auto-tool-choice --tool-call-parser
//! hermes`): the request's `tools` go into the chat template (normalised as vLLM's
//! `tool.model_dump()` writes them), and `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
//! blocks in the output become the message's `tool_calls`.
//!
//! * [`extract`] is the hermes parser's non-streaming rule: no `<tool_call>` means no call; else every
//!   block (the last may be unclosed) must be a JSON object with a string `name` and `arguments`, or
//!   nothing is a call and the whole output is the content. The content is the text before the first
//!   `<tool_call>` (`null` when empty); `arguments` is written as `json.dumps(..., ensure_ascii=False)`.
//! * [`ToolStream`] streams the content before the first `<tool_call>` as it comes, holds what follows,
//!   and at the end sends each call as one complete tool-call delta (or, when the blocks do not parse,
//!   the held text as content) — so a stream always adds up to the response without streaming.
//! * `tool_choice`: `auto` (the default with tools) parses, `none` renders the tools but does not
//!   parse; `required` and a named function need constrained decoding, which recall does not have:
//!   they are refused with a 400.

use serde_json::{json, Map, Value};

use crate::server::error::ApiError;
use crate::server::fields::Fields;
use crate::tokenize::tojson::python_json;

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// What a request asks of tools.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolRequest {
    /// The tools as the template receives them.
    pub tools: Vec<Value>,
    /// Whether the output is parsed for tool calls (`tool_choice: auto`).
    pub parse: bool,
}

/// `tools` and `tool_choice` (and a refusal of the legacy `functions` / `function_call`).
pub fn parse_tools(f: &Fields<'_>) -> Result<ToolRequest, ApiError> {
    for key in ["functions", "function_call"] {
        if f.get(key).is_some() {
            return Err(f.bad(
                key,
                format!("`{key}` is the legacy form of function calling; send `tools` and `tool_choice`"),
            ));
        }
    }
    let tools = match f.array("tools")? {
        None => Vec::new(),
        Some(a) => a
            .iter()
            .enumerate()
            .map(|(i, t)| normalise_tool(t, &format!("tools[{i}]")))
            .collect::<Result<_, _>>()?,
    };
    let parse =
        match f.get("tool_choice") {
            None => !tools.is_empty(),
            Some(Value::String(s)) if s == "auto" => !tools.is_empty(),
            Some(Value::String(s)) if s == "none" => false,
            Some(Value::String(s)) if s == "required" => return Err(f.bad(
                "tool_choice",
                "`tool_choice: required` needs constrained decoding, which recall does not have; use `auto`",
            )),
            Some(Value::Object(_)) => return Err(f.bad(
                "tool_choice",
                "a named `tool_choice` needs constrained decoding, which recall does not have; use `auto`",
            )),
            Some(_) => {
                return Err(f.bad(
                    "tool_choice",
                    "`tool_choice` must be `auto`, `none`, `required` or a named function",
                ))
            }
        };
    Ok(ToolRequest { tools, parse })
}

/// A tool as vLLM's `model_dump()` hands it to the template: `type`, then `function` with `name`,
/// `description` and `parameters` (null when absent) before any other member, then any other member
/// of the tool.
fn normalise_tool(v: &Value, at: &str) -> Result<Value, ApiError> {
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad(at, format!("`{at}` must be an object")))?;
    let f = Fields::nested(obj, at);
    match f.string("type")? {
        None | Some("function") => {}
        Some(other) => {
            return Err(f.bad(
                "type",
                format!(
                    "only `function` tools are supported, not {}",
                    crate::limits::excerpt(other)
                ),
            ))
        }
    }
    let function = f
        .object("function")?
        .ok_or_else(|| f.bad("function", format!("`{at}.function` is required")))?;
    let fat = format!("{at}.function");
    let ff = Fields::nested(function, &fat);
    let name = ff
        .string("name")?
        .ok_or_else(|| ff.bad("name", format!("`{fat}.name` is required")))?;
    let description = ff.string("description")?;
    let parameters = ff.object("parameters")?;
    let mut fun = Map::new();
    fun.insert("name".into(), json!(name));
    fun.insert("description".into(), json!(description));
    fun.insert(
        "parameters".into(),
        parameters.map_or(Value::Null, |p| Value::Object(p.clone())),
    );
    for (k, x) in function {
        if !fun.contains_key(k) {
            fun.insert(k.clone(), x.clone());
        }
    }
    let mut tool = Map::new();
    tool.insert("type".into(), json!("function"));
    tool.insert("function".into(), Value::Object(fun));
    for (k, x) in obj {
        if !tool.contains_key(k) {
            tool.insert(k.clone(), x.clone());
        }
    }
    Ok(Value::Object(tool))
}

/// One tool call of a response.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallOut {
    pub id: String,
    pub name: String,
    /// `json.dumps(arguments, ensure_ascii=False)`.
    pub arguments: String,
}

impl ToolCallOut {
    /// The call as a message's `tool_calls` entry; with `index`, as a stream delta's.
    pub fn to_json(&self, index: Option<usize>) -> Value {
        let mut v = json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// The tool calls of an output, when it has any: the content before the first call (`None` when
/// empty) and the calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Extracted {
    pub content: Option<String>,
    pub calls: Vec<ToolCallOut>,
}

/// The hermes parser's reading of `text`; `None` when it calls no tool (the content is then the
/// whole text).
///
/// ```
/// use recall::server::tools::extract;
/// let out = "Action: tap\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\":\"click\"}}\n</tool_call>";
/// let e = extract(out).unwrap();
/// assert_eq!(e.content.as_deref(), Some("Action: tap\n"));
/// assert_eq!(e.calls[0].name, "mobile_use");
/// assert_eq!(e.calls[0].arguments, "{\"action\": \"click\"}");
/// assert!(extract("<tool_call>{not json}</tool_call>").is_none());
/// ```
pub fn extract(text: &str) -> Option<Extracted> {
    let first = text.find(START)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(START) {
        let body_start = at + START.len();
        let (body, next) = match rest[body_start..].find(END) {
            Some(end) => (&rest[body_start..body_start + end], body_start + end + END.len()),
            None => (&rest[body_start..], rest.len()),
        };
        calls.push(parse_call(body)?);
        rest = &rest[next..];
    }
    Some(Extracted {
        content: (first > 0).then(|| text[..first].to_string()),
        calls,
    })
}

/// One `<tool_call>` body: a JSON object with a string `name` and `arguments`.
fn parse_call(body: &str) -> Option<ToolCallOut> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = python_json(v.get("arguments")?);
    Some(ToolCallOut {
        id: format!("chatcmpl-tool-{:032x}", crate::server::rand_u128()),
        name,
        arguments,
    })
}

/// What a streamed output adds to its choice: content, or a finished tool call (its index among the
/// choice's calls).
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Call(usize, ToolCallOut),
}

/// The tool-call side of one streamed choice.
#[derive(Debug, Default)]
pub struct ToolStream {
    /// The whole text so far.
    text: String,
    /// Bytes of `text` sent as content.
    sent: usize,
    /// Whether a `<tool_call>` has begun (nothing more is sent until the end).
    held: bool,
    called: bool,
}

impl ToolStream {
    /// The deltas `new_text` allows now: content up to the first `<tool_call>` (less a tail that may
    /// still become one).
    pub fn push(&mut self, new_text: &str) -> Vec<Delta> {
        self.text.push_str(new_text);
        if self.held {
            return Vec::new();
        }
        let end = match self.text.find(START) {
            Some(at) => {
                self.held = true;
                at
            }
            None => self.text.len() - partial_suffix(&self.text, START),
        };
        self.content_up_to(end)
    }

    /// The deltas at the end of the output: each tool call, or the held text as content when the
    /// output calls no tool.
    pub fn finish(&mut self) -> Vec<Delta> {
        match extract(&self.text) {
            Some(e) => {
                self.called = true;
                let mut out = self.content_up_to(self.text.find(START).unwrap_or(0));
                out.extend(e.calls.into_iter().enumerate().map(|(i, c)| Delta::Call(i, c)));
                out
            }
            None => self.content_up_to(self.text.len()),
        }
    }

    /// Whether the output called a tool (known once finished).
    pub fn called(&self) -> bool {
        self.called
    }

    fn content_up_to(&mut self, end: usize) -> Vec<Delta> {
        if end <= self.sent {
            return Vec::new();
        }
        let d = self.text[self.sent..end].to_string();
        self.sent = end;
        vec![Delta::Content(d)]
    }
}

/// The length of the longest proper prefix of `pat` that `s` ends with.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len())
        .rev()
        .find(|&k| s.ends_with(&pat[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(pieces: &[&str]) -> (String, Vec<ToolCallOut>) {
        let mut s = ToolStream::default();
        let mut deltas: Vec<Delta> = pieces.iter().flat_map(|p| s.push(p)).collect();
        deltas.extend(s.finish());
        let mut content = String::new();
        let mut calls = Vec::new();
        for d in deltas {
            match d {
                Delta::Content(c) => content.push_str(&c),
                Delta::Call(_, c) => calls.push(c),
            }
        }
        (content, calls)
    }

    #[test]
    fn a_stream_adds_up_to_the_response_without_streaming() {
        let text = "Action: tap.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call> trailing";
        for split in [1, 3, 7, 12, 20] {
            let pieces: Vec<&str> = text
                .as_bytes()
                .chunks(split)
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect();
            let (content, calls) = streamed(&pieces);
            let e = extract(text).unwrap();
            assert_eq!(content, e.content.unwrap());
            assert_eq!(calls.len(), 1);
            assert_eq!(
                (calls[0].name.as_str(), calls[0].arguments.as_str()),
                ("f", "{\"a\": [1, 2]}")
            );
        }
        // An output whose block does not parse is content, whole.
        let bad = "x <tool_call>{oops</tool_call>";
        let (content, calls) = streamed(&["x <tool", "_call>{oops</tool_call>"]);
        assert_eq!((content.as_str(), calls.len()), (bad, 0));
        assert!(extract(bad).is_none());
    }

    #[test]
    fn an_unclosed_last_block_is_still_a_call_and_every_block_must_parse() {
        let e = extract("<tool_call>{\"name\": \"a\", \"arguments\": {}}").unwrap();
        assert_eq!((e.content, e.calls.len()), (None, 1));
        let two = "<tool_call>{\"name\": \"a\", \"arguments\": 1}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": \"s\"}</tool_call>";
        let e = extract(two).unwrap();
        assert_eq!(
            e.calls.iter().map(|c| c.arguments.as_str()).collect::<Vec<_>>(),
            ["1", "\"s\""]
        );
        assert!(
            extract("<tool_call>{\"name\": \"a\"}</tool_call>").is_none(),
            "no arguments"
        );
        assert!(extract("<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>").is_none());
    }
}
