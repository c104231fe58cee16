//! Generated tokens to response text, as vLLM's detokenizer writes it: special tokens left out unless
//! `skip_special_tokens: false`; the end-of-sequence (or stop) token that ended generation, and the
//! text from the stop string on, left out unless `include_stop_str_in_output: true`. While streaming,
//! a tail that could still become a stop string, a cut character, or a final end token is held back,
//! so that the streamed pieces always add up to the text of the whole response.

use std::sync::Arc;

use crate::engine::FinishReason;
use crate::server::error::ApiError;
use crate::server::params::TextOptions;
use crate::tokenize::Tokenizer;

/// How one request's tokens become text.
#[derive(Clone)]
pub struct TextRule {
    pub tokenizer: Arc<Tokenizer>,
    pub stop: Vec<String>,
    /// Ids that end generation (their last occurrence is cut unless the options keep it).
    pub eos: Vec<u32>,
    pub options: TextOptions,
}

impl TextRule {
    fn decode(&self, tokens: &[u32]) -> Result<String, ApiError> {
        let t = &self.tokenizer;
        let text = if self.options.skip_special_tokens {
            t.decode_text(tokens)
        } else {
            t.decode(tokens)
        };
        text.map_err(|e| ApiError::internal(e.to_string()))
    }

    /// `tokens` without a final end token that generation stopped on.
    fn body<'t>(&self, tokens: &'t [u32]) -> &'t [u32] {
        match tokens.split_last() {
            Some((last, rest)) if !self.options.include_stop_str_in_output && self.eos.contains(last) => rest,
            _ => tokens,
        }
    }

    /// The text of a finished generation.
    pub fn text(&self, tokens: &[u32], finish: &FinishReason) -> Result<String, ApiError> {
        let body = match finish {
            FinishReason::Eos => self.body(tokens),
            _ => tokens,
        };
        let mut text = self.decode(body)?;
        if let FinishReason::Stop(s) = finish {
            if let Some(at) = text.find(s.as_str()) {
                let keep = if self.options.include_stop_str_in_output {
                    at + s.len()
                } else {
                    at
                };
                text.truncate(keep);
            }
        }
        Ok(text)
    }
}

/// The incremental text of a stream: what has been sent, and how much must be held back.
pub struct Detokenizer {
    rule: TextRule,
    tokens: Vec<u32>,
    /// Bytes of the text already sent.
    sent: usize,
    /// Longest stop string, in bytes: that much minus one is held back until generation ends.
    hold: usize,
}

impl Detokenizer {
    pub fn new(rule: TextRule) -> Self {
        let hold = rule.stop.iter().map(String::len).max().unwrap_or(0);
        Detokenizer {
            rule,
            tokens: Vec::new(),
            sent: 0,
            hold,
        }
    }

    /// The new text after `tokens`: everything decoded so far past what was sent, except a trailing
    /// incomplete character, a final end token and a tail that could still become a stop string.
    pub fn push(&mut self, tokens: &[u32]) -> Result<String, ApiError> {
        self.tokens.extend_from_slice(tokens);
        let text = self.rule.decode(self.rule.body(&self.tokens))?;
        let mut end = text.trim_end_matches('\u{FFFD}').len();
        end = end.saturating_sub(self.hold.saturating_sub(1));
        Ok(self.take(&text, end))
    }

    /// The rest of the text once generation ended.
    pub fn finish(&mut self, finish: &FinishReason) -> Result<String, ApiError> {
        let text = self.rule.text(&self.tokens, finish)?;
        let end = text.len();
        Ok(self.take(&text, end))
    }

    fn take(&mut self, text: &str, end: usize) -> String {
        let mut end = end.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut start = self.sent.min(end);
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        if end <= self.sent {
            return String::new();
        }
        self.sent = end;
        text[start..end].to_string()
    }
}
