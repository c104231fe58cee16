//! Errors as OpenAI returns them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
//! that says whose fault it is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::Error;

/// An error response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`, `rate_limit_error`,
    /// `timeout_error` or `server_error`.
    pub kind: &'static str,
    /// The request field at fault (`messages[0].content[1].image_url.url`), when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 about the request as a whole.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            param: None,
            ..Self::bad("", message)
        }
    }

    pub fn with_status(mut self, status: StatusCode, kind: &'static str) -> Self {
        self.status = status;
        self.kind = kind;
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::invalid(message)
            .with_status(StatusCode::UNAUTHORIZED, "authentication_error")
            .with_code("invalid_api_key")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::invalid(message).with_status(StatusCode::NOT_FOUND, "not_found_error")
    }

    pub fn too_many(message: impl Into<String>) -> Self {
        Self::invalid(message).with_status(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error")
    }

    pub fn too_large(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::bad(param, message).with_status(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::invalid(message).with_status(StatusCode::INTERNAL_SERVER_ERROR, "server_error")
    }

    /// A 408: the request took longer than `d` (`--request-timeout`).
    pub fn timeout(d: std::time::Duration) -> Self {
        Self::invalid(format!(
            "the request took longer than the server's limit of {d:?}"
        ))
        .with_status(StatusCode::REQUEST_TIMEOUT, "timeout_error")
        .with_code("request_timeout")
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::invalid(message).with_status(StatusCode::SERVICE_UNAVAILABLE, "server_error")
    }

    /// An engine or library error: the client's fault (400) unless the device or the server failed.
    pub fn from_engine(e: &Error, param: &str) -> Self {
        match e {
            Error::PromptTooLong { .. } => {
                Self::bad(param, e.to_string()).with_code("context_length_exceeded")
            }
            Error::KvCacheFull { .. } => Self::bad(
                param,
                format!("{e}; the request can never fit this server's KV pool"),
            )
            .with_code("kv_cache_too_small"),
            Error::Json { field, message, .. } => {
                let field = if field.is_empty() {
                    param.to_string()
                } else {
                    field.clone()
                };
                Self::bad(field.clone(), format!("{field}: {message}"))
            }
            Error::InvalidRequest(m) | Error::Tokenizer(m) => Self::bad(param, m.clone()),
            Error::Cancelled => Self::unavailable("the request was cancelled (the server is shutting down)"),
            Error::Cuda(_) | Error::Io { .. } | Error::Shape { .. } => Self::internal(e.to_string()),
            _ => Self::bad(param, e.to_string()),
        }
    }

    /// The OpenAI-style JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param.as_deref().filter(|p| !p.is_empty()),
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = self.status.as_u16(), "{}", self.message);
        } else {
            tracing::debug!(status = self.status.as_u16(), "{}", self.message);
        }
        (self.status, axum::Json(self.body())).into_response()
    }
}
