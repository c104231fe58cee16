//! Reading request bodies: the body as a JSON object, and typed access to its members that names the
//! field at fault (`stream_options.include_usage`) and quotes at most a short excerpt of what the
//! client sent. `null` reads as absent, as in OpenAI's API.

use std::str::FromStr;

use serde_json::{Map, Value};

use crate::limits::excerpt;
use crate::server::error::ApiError;
use crate::tokenize::chat::json_kind;

/// The members of one JSON object of a request, `at` its path (`""` for the body).
#[derive(Clone, Copy)]
pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
    at: &'a str,
}

impl<'a> Fields<'a> {
    /// The members of the request body.
    pub fn new(obj: &'a Map<String, Value>) -> Self {
        Fields { obj, at: "" }
    }

    /// The members of a nested object found at `at` (`"stream_options"`).
    pub fn nested(obj: &'a Map<String, Value>, at: &'a str) -> Self {
        Fields { obj, at }
    }

    /// The request field name of member `key`.
    pub fn param(&self, key: &str) -> String {
        if self.at.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.at)
        }
    }

    /// The object itself.
    pub fn map(&self) -> &'a Map<String, Value> {
        self.obj
    }

    /// `obj[key]`, `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A 400 about member `key`.
    pub fn bad(&self, key: &str, message: impl Into<String>) -> ApiError {
        ApiError::bad(self.param(key), message)
    }

    /// `obj[key]` through `read`, `None` when absent or null; a value `read` rejects is a 400 saying
    /// it `must be WHAT`.
    pub fn typed<T>(
        &self,
        key: &str,
        what: &str,
        read: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| {
                let param = self.param(key);
                ApiError::bad(&param, format!("`{param}` must be {what}, got {}", describe(v)))
            }),
        }
    }

    pub fn uint(&self, key: &str) -> Result<Option<u64>, ApiError> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    pub fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        self.typed(key, "an integer", Value::as_i64)
    }

    pub fn num(&self, key: &str) -> Result<Option<f64>, ApiError> {
        self.typed(key, "a number", Value::as_f64)
    }

    pub fn boolean(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.typed(key, "a boolean", Value::as_bool)
    }

    pub fn string(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        self.typed(key, "a string", Value::as_str)
    }

    pub fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        self.typed(key, "an object", Value::as_object)
    }

    pub fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        self.typed(key, "an array", Value::as_array)
    }

    /// The string member `key` parsed with [`FromStr`], if present.
    pub fn parsed<T: FromStr<Err = crate::Error>>(&self, key: &str) -> Result<Option<T>, ApiError> {
        self.string(key)?
            .map(|v| v.parse::<T>().map_err(|e| self.bad(key, e.to_string())))
            .transpose()
    }

    /// Logs a warning for every member not in `known` (ignored, as vLLM does).
    pub fn warn_unknown(&self, known: &[&str], what: &str) {
        for key in self.obj.keys().filter(|k| !known.contains(&k.as_str())) {
            tracing::warn!("ignoring unknown {what} field {}", excerpt(&self.param(key)));
        }
    }
}

/// A value for an error message: numbers, booleans and short strings as they are, others by kind.
pub fn describe(v: &Value) -> String {
    match v {
        Value::Number(_) | Value::Bool(_) => v.to_string(),
        Value::String(s) if s.len() <= 40 => v.to_string(),
        other => json_kind(other).to_string(),
    }
}

/// Parses a request body as a JSON object.
pub fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            json_kind(&other)
        ))),
    }
}
