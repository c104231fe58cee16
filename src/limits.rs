//! Resource caps that a hostile or corrupt input cannot get around.
//!
//! Every file recall reads whole into memory is size-checked before it is read, and every header that
//! declares a size (a safetensors header length, an image's dimensions) is checked before anything of
//! that size is allocated. The caps sit far above what real checkpoints, tokenizers and screenshots
//! need, so they only ever stop inputs that would otherwise exhaust memory.
//!
//! JSON nesting needs no cap of ours: every parse goes through `serde_json`, which refuses documents
//! nested deeper than [`JSON_MAX_DEPTH`] ("recursion limit exceeded"); recall never builds it with the
//! `unbounded_depth` feature, so nothing can call `disable_recursion_limit`.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// Config-like JSON files: `config.json`, `generation_config.json`, `preprocessor_config.json`,
/// `adapter_config.json`, `scopemem_config.json`, `model.safetensors.index.json`. Real ones are a few
/// KB (an index of a 70B model is ~100 KB).
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// `tokenizer.json`: Qwen's is 11 MB, the largest common ones (256k-token vocabularies) ~35 MB.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Documents that grow with use: chat messages files (which may carry base64 images), `episode.json`,
/// JSONL datasets and label dumps.
pub const MAX_DOCUMENT_BYTES: u64 = 256 << 20;

/// A safetensors JSON header: the same cap as the `safetensors` crate's (a header lists names,
/// dtypes, shapes and offsets; the largest real ones are a few MB).
pub const MAX_SAFETENSORS_HEADER_BYTES: u64 = 100_000_000;

/// An encoded image file read from a path (a 4K PNG screenshot is ~10 MB).
pub const MAX_IMAGE_FILE_BYTES: u64 = 256 << 20;

/// Decoded image pixels: PIL's decompression-bomb limit (twice `PIL.Image.MAX_IMAGE_PIXELS`, ~13400²),
/// checked against the dimensions the file declares before its pixels are allocated. 4K is 8.3 M
/// pixels.
pub const MAX_IMAGE_PIXELS: u64 = 178_956_970;

/// Nesting depth at which `serde_json` stops parsing (its built-in recursion limit; documented here,
/// enforced there).
pub const JSON_MAX_DEPTH: usize = 128;

/// The whole of `path` as UTF-8 text, refused with [`Error::LimitExceeded`] when it holds more than
/// `cap` bytes.
///
/// ```
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("config.json");
/// std::fs::write(&path, "{}").unwrap();
/// assert_eq!(recall::limits::read_capped(&path, 2).unwrap(), "{}");
/// let err = recall::limits::read_capped(&path, 1).unwrap_err().to_string();
/// assert!(err.contains("2 bytes exceeds the limit of 1 bytes"), "{err}");
/// ```
pub fn read_capped(path: &Path, cap: u64) -> Result<String> {
    let bytes = read_capped_bytes(path, cap)?;
    String::from_utf8(bytes).map_err(|_| {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidData, "file is not valid UTF-8");
        Error::io(path, e)
    })
}

/// The whole of `path` as bytes, refused with [`Error::LimitExceeded`] when it holds more than `cap`
/// bytes.
pub fn read_capped_bytes(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    check_file_size(path, len, cap)?;
    // The size can lie (a FIFO or /dev/zero reports 0; a file can grow): never read past the cap.
    let mut data = Vec::with_capacity(len as usize);
    file.take(cap + 1)
        .read_to_end(&mut data)
        .map_err(|e| Error::io(path, e))?;
    if data.len() as u64 > cap {
        return Err(Error::LimitExceeded {
            what: "contents (reading stopped there)".into(),
            path: path.to_path_buf(),
            value: data.len() as u64,
            cap,
        });
    }
    Ok(data)
}

/// Refuses a file of `len` bytes over `cap`.
pub fn check_file_size(path: &Path, len: u64, cap: u64) -> Result<()> {
    if len > cap {
        return Err(Error::LimitExceeded {
            what: "file size".into(),
            path: path.to_path_buf(),
            value: len,
            cap,
        });
    }
    Ok(())
}

/// Most bytes of a client's input an error message repeats ([`excerpt`]).
pub const ECHO_BYTES: usize = 64;

/// `s` as an error message may quote it: whole when short, else its first [`ECHO_BYTES`] bytes (on a
/// character boundary) and its length, so that an error about a multi-megabyte field stays short.
///
/// ```
/// use recall::limits::excerpt;
/// assert_eq!(excerpt("a.png"), "`a.png`");
/// let long = "iVBORw0KGgo".repeat(100_000);
/// let e = excerpt(&long);
/// assert!(e.len() < 120 && e.contains("1100000 bytes"), "{e}");
/// ```
pub fn excerpt(s: &str) -> String {
    if s.len() <= ECHO_BYTES {
        return format!("`{s}`");
    }
    let cut = (0..=ECHO_BYTES)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    format!("`{}…` ({} bytes)", &s[..cut], s.len())
}
