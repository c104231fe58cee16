//! Images a request refers to, under the server's policy: `data:` URLs always; local paths and
//! `file://` URLs only inside `--allowed-media-dir` (checked lexically, then again after resolving
//! symlinks, before anything is read); `http(s)://` only with `--allow-remote-media`, with a byte cap
//! and a timeout. Decoding refuses an image over the pixel cap from its header alone.
//!
//! A screenshot an agent sends again (its history, every step) is not fetched and decoded again: the
//! [`SourceMemo`] remembers which content hash a `data:` URL or an unchanged file had, and the engine
//! reuses the encoded image from its vision cache.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use image::RgbImage;

use crate::engine::ImageHash;
use crate::limits::excerpt;
use crate::server::error::ApiError;
use crate::vision::{decode_image_limited, ImageSource, PreprocessConfig};

/// What the server may read.
#[derive(Debug, Clone)]
pub struct MediaPolicy {
    /// Canonical directory local images must be inside (`None`: local images are refused).
    allowed_dir: Option<PathBuf>,
    allow_remote: bool,
    max_bytes: usize,
    max_pixels: u64,
    timeout: Duration,
    client: reqwest::Client,
}

/// A decoded image: its content hash and pixels (shared: the engine thread preprocesses it only when
/// its vision cache lacks the hash).
#[derive(Debug, Clone)]
pub struct DecodedImage {
    pub hash: ImageHash,
    pub image: Arc<RgbImage>,
}

impl MediaPolicy {
    /// A policy; `allowed_dir` must exist (it is canonicalised here).
    pub fn new(
        allowed_dir: Option<&Path>,
        allow_remote: bool,
        max_bytes: usize,
        max_pixels: u64,
        timeout: Duration,
    ) -> crate::Result<Self> {
        let allowed_dir = allowed_dir
            .map(|d| std::fs::canonicalize(d).map_err(|e| crate::Error::io(d, e)))
            .transpose()?;
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| crate::Error::InvalidRequest(format!("HTTP client: {e}")))?;
        Ok(MediaPolicy {
            allowed_dir,
            allow_remote,
            max_bytes,
            max_pixels,
            timeout,
            client,
        })
    }

    /// The most bytes an encoded image may have (`--max-image-bytes`).
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The most pixels an image may have (`--max-image-pixels`).
    pub fn max_pixels(&self) -> u64 {
        self.max_pixels
    }

    /// The encoded bytes of the image at `url` (a request's `image_url.url`), and a name for errors.
    pub async fn fetch(&self, url: &str, param: &str) -> Result<(Vec<u8>, String), ApiError> {
        let t = url.trim();
        let lower = t.get(..t.len().min(8)).unwrap_or("").to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            return self.fetch_remote(t, param).await;
        }
        if lower.starts_with("data:") {
            // A base64 payload decodes to 3/4 of its length: refuse an oversized one unread.
            if t.len() / 4 * 3 > self.max_bytes + 3 {
                return Err(self.oversized(param, t.len() / 4 * 3));
            }
        }
        match ImageSource::parse(t).map_err(|e| ApiError::bad(param, e.to_string()))? {
            ImageSource::Bytes { name, data } => {
                if data.len() > self.max_bytes {
                    return Err(self.oversized(param, data.len()));
                }
                Ok((data, name))
            }
            ImageSource::Path(path) => {
                let path = self.local_path(&path, param)?;
                let len = std::fs::metadata(&path)
                    .map_err(|e| ApiError::bad(param, format!("image {}: {e}", path.display())))?
                    .len();
                if len > self.max_bytes as u64 {
                    return Err(self.oversized(param, len as usize));
                }
                let data = tokio::fs::read(&path)
                    .await
                    .map_err(|e| ApiError::bad(param, format!("image {}: {e}", path.display())))?;
                Ok((data, path.display().to_string()))
            }
        }
    }

    fn oversized(&self, param: &str, bytes: usize) -> ApiError {
        ApiError::too_large(
            param,
            format!(
                "image of {bytes} bytes exceeds the limit of {} bytes (--max-image-bytes)",
                self.max_bytes
            ),
        )
    }

    /// The canonical path of a local image, refused unless it is inside the allowed directory both as
    /// written (`..` resolved lexically) and after resolving symlinks.
    pub fn local_path(&self, path: &Path, param: &str) -> Result<PathBuf, ApiError> {
        let dir = self.allowed_dir.as_ref().ok_or_else(|| {
            ApiError::bad(
                param,
                format!(
                    "local image path {} refused: this server reads local images only inside \
                     --allowed-media-dir; send the image as a data: URL",
                    excerpt(&path.to_string_lossy())
                ),
            )
        })?;
        let joined = if path.is_absolute() {
            path.to_path_buf()
        } else {
            dir.join(path)
        };
        let outside = || {
            ApiError::bad(
                param,
                format!(
                    "image path {} is outside the allowed media directory",
                    excerpt(&path.to_string_lossy())
                ),
            )
        };
        if !lexically_normal(&joined).starts_with(dir) {
            return Err(outside());
        }
        let canonical = std::fs::canonicalize(&joined).map_err(|e| {
            ApiError::bad(
                param,
                format!("image path {}: {e}", excerpt(&path.to_string_lossy())),
            )
        })?;
        if !canonical.starts_with(dir) {
            return Err(outside());
        }
        Ok(canonical)
    }

    async fn fetch_remote(&self, url: &str, param: &str) -> Result<(Vec<u8>, String), ApiError> {
        if !self.allow_remote {
            return Err(ApiError::bad(
                param,
                format!(
                    "remote image URL {} refused: this server fetches http(s) images only with \
                     --allow-remote-media; send the image as a data: URL",
                    excerpt(url)
                ),
            ));
        }
        let failed = |e: String| ApiError::bad(param, format!("fetching {}: {e}", excerpt(url)));
        let mut resp = self.client.get(url).send().await.map_err(|e| {
            failed(if e.is_timeout() {
                format!("timed out after {:?}", self.timeout)
            } else {
                e.to_string()
            })
        })?;
        if !resp.status().is_success() {
            return Err(failed(format!("HTTP {}", resp.status())));
        }
        if resp.content_length().is_some_and(|n| n > self.max_bytes as u64) {
            return Err(self.oversized(param, resp.content_length().unwrap_or(0) as usize));
        }
        let mut data = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| failed(e.to_string()))? {
            data.extend_from_slice(&chunk);
            if data.len() > self.max_bytes {
                return Err(self.oversized(param, data.len()));
            }
        }
        Ok((data, url.to_string()))
    }

    /// Decodes encoded image bytes under the pixel cap and hashes the pixels (CPU work: call it from
    /// a blocking thread).
    pub fn decode(&self, data: &[u8], name: &str, param: &str) -> Result<DecodedImage, ApiError> {
        let img = decode_image_limited(data, name, self.max_pixels)
            .map_err(|e| ApiError::bad(param, e.to_string()))?;
        Ok(DecodedImage {
            hash: ImageHash::of_image(&img),
            image: Arc::new(img),
        })
    }
}

/// `path` with `.` and `..` resolved without touching the file system.
fn lexically_normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Content hashes (and merged-token counts) of image sources seen recently, so that a screenshot
/// sent again is neither fetched nor decoded again. Keys: the whole `data:` URL, or a file's
/// canonical path with its size and modification time. Bounded; the oldest half is dropped when full.
#[derive(Default)]
pub struct SourceMemo {
    entries: Mutex<HashMap<u64, (ImageHash, usize, u64)>>,
    tick: std::sync::atomic::AtomicU64,
}

/// Most remembered sources.
const MEMO_CAPACITY: usize = 4096;

impl SourceMemo {
    /// The memo key of a `data:` URL (files are keyed by the caller with [`SourceMemo::file_key`]).
    pub fn url_key(url: &str) -> Option<u64> {
        url.trim()
            .get(..5)
            .is_some_and(|p| p.eq_ignore_ascii_case("data:"))
            .then(|| xxhash_rust::xxh64::xxh64(url.trim().as_bytes(), 0xda7a))
    }

    /// The memo key of a local file: its canonical path, size and modification time.
    pub fn file_key(path: &Path) -> Option<u64> {
        let meta = std::fs::metadata(path).ok()?;
        let mtime = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
        let mut h = xxhash_rust::xxh64::Xxh64::new(0xf11e);
        h.update(path.as_os_str().as_encoded_bytes());
        h.update(&meta.len().to_le_bytes());
        h.update(&mtime.as_nanos().to_le_bytes());
        Some(h.digest())
    }

    pub fn get(&self, key: u64) -> Option<(ImageHash, usize)> {
        let tick = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut m = self.entries.lock().ok()?;
        let e = m.get_mut(&key)?;
        e.2 = tick;
        Some((e.0, e.1))
    }

    pub fn insert(&self, key: u64, hash: ImageHash, tokens: usize) {
        let tick = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Ok(mut m) = self.entries.lock() else { return };
        if m.len() >= MEMO_CAPACITY {
            let mut ticks: Vec<u64> = m.values().map(|e| e.2).collect();
            ticks.sort_unstable();
            let cut = ticks[ticks.len() / 2];
            m.retain(|_, e| e.2 >= cut);
        }
        m.insert(key, (hash, tokens, tick));
    }

    /// Forgets `hash` (the engine evicted it: its pixels are needed again).
    pub fn forget(&self, hash: ImageHash) {
        if let Ok(mut m) = self.entries.lock() {
            m.retain(|_, e| e.0 != hash);
        }
    }
}

/// Merged tokens of a decoded image under `cfg` (the prompt-length check before encoding).
pub fn image_tokens(cfg: &PreprocessConfig, img: &RgbImage, param: &str) -> Result<usize, ApiError> {
    cfg.merged_tokens(img.height() as usize, img.width() as usize)
        .map_err(|e| ApiError::bad(param, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_normalisation_resolves_parent_components() {
        assert_eq!(
            lexically_normal(Path::new("/a/b/../c/./d")),
            PathBuf::from("/a/c/d")
        );
        assert_eq!(lexically_normal(Path::new("/a/../../etc")), PathBuf::from("/etc"));
    }
}
