//! Crash-safe output: whole files that a reader sees either old or new, never half written
//! ([`write_atomic`]), and JSON-lines files for long runs that stay valid JSONL however the writer
//! dies ([`JsonlWriter`]). docs/RELIABILITY.md "Crash safety" lists which outputs go through here.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Distinguishes the temporary files of concurrent writers within one process (the server persists
/// from several tasks); the pid distinguishes processes.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// An I/O error on `path` saying which step failed (the error type has no room for the verb).
fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::io(path, std::io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// The directory `path` lives in (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Makes a rename or a new file in `dir` durable. Best effort: some filesystems refuse to sync a
/// directory, and the data itself was already synced, so a failure here loses nothing but the
/// guarantee against power loss.
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// Writes `bytes` to `path` so that no reader (and no crash) ever sees a partial file: the bytes go to
/// a temporary file in the same directory (`.{name}.tmp.{pid}.{n}`, so the rename cannot cross
/// filesystems), which is fsynced and then renamed over `path`; the directory is fsynced after. On an
/// error the temporary file is removed and `path` keeps its old contents. A symlink at `path` is
/// followed (its target is replaced), and an existing file's permissions are kept.
///
/// ```
/// # fn main() -> recall::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("report.json");
/// recall::atomic::write_atomic(&path, b"{\"old\": true}")?;
/// recall::atomic::write_atomic(&path, "{\"new\": true}")?;
/// assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"new\": true}");
/// // Nothing but the target is left in the directory.
/// assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
/// # Ok(())
/// # }
/// ```
pub fn write_atomic(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    let target = resolve_symlink(path);
    let name = target.file_name().ok_or_else(|| {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path");
        Error::io(path, e)
    })?;
    let dir = parent_dir(&target);
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{n}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = write_synced(&tmp, &target, bytes.as_ref()).and_then(|()| {
        std::fs::rename(&tmp, &target).map_err(|e| io_err(&target, "renaming the temporary file", e))
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    sync_dir(dir);
    Ok(())
}

/// `path`, or the file a symlink at `path` points to (so that replacing it keeps the link).
fn resolve_symlink(path: &Path) -> PathBuf {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).unwrap_or(path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// Creates `tmp` with `bytes` (and `target`'s permissions, when it exists) and fsyncs it.
fn write_synced(tmp: &Path, target: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(tmp).map_err(|e| io_err(target, "creating a temporary file", e))?;
    if let Ok(meta) = std::fs::metadata(target) {
        let _ = f.set_permissions(meta.permissions());
    }
    f.write_all(bytes)
        .map_err(|e| io_err(target, "writing the temporary file", e))?;
    f.sync_all()
        .map_err(|e| io_err(target, "syncing the temporary file", e))
}

/// An append-only JSON-lines file for long runs: every [`append`](Self::append) adds whole lines
/// (one write, flushed to the OS, so a killed process leaves whole lines behind), and a failed write
/// is rolled back. [`resume`](Self::resume) reopens a file an earlier run left, cutting a trailing
/// partial line (a kill during a write, or a power loss before [`sync`](Self::sync)) so that the file
/// stays valid JSONL. Which lines form a complete *unit* of work is the caller's rule (e.g. the label
/// file's, docs/FORMATS.md).
///
/// ```
/// # fn main() -> recall::Result<()> {
/// # use std::io::Write;
/// use recall::atomic::JsonlWriter;
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("run.jsonl");
/// let mut w = JsonlWriter::create(&path)?;
/// w.append("{\"step\": 1}\n")?;
/// w.sync()?;
/// drop(w);
/// // A kill in the middle of a write leaves half a line ...
/// std::fs::OpenOptions::new().append(true).open(&path).unwrap()
///     .write_all(b"{\"step\": 2, \"q\": -0.")
///     .unwrap();
/// // ... which resuming cuts away before appending.
/// let mut w = JsonlWriter::resume(&path)?;
/// w.append("{\"step\": 2, \"q\": -0.5}\n")?;
/// assert_eq!(
///     std::fs::read_to_string(&path).unwrap(),
///     "{\"step\": 1}\n{\"step\": 2, \"q\": -0.5}\n"
/// );
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct JsonlWriter {
    file: File,
    path: PathBuf,
    /// Bytes of whole lines in the file: where a failed append is rolled back to.
    len: u64,
}

impl JsonlWriter {
    /// Creates `path`, or empties it when it exists.
    pub fn create(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(path)
            .map_err(|e| io_err(path, "creating", e))?;
        sync_dir(parent_dir(path));
        Ok(JsonlWriter {
            file,
            path: path.to_path_buf(),
            len: 0,
        })
    }

    /// Opens `path` to append to it (creating it when absent), first cutting a trailing partial line:
    /// everything after the last `\n`.
    pub fn resume(path: &Path) -> Result<Self> {
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_err(path, "opening to resume", e))?;
        let size = file.metadata().map_err(|e| io_err(path, "inspecting", e))?.len();
        let len = whole_lines_len(&mut file, size).map_err(|e| io_err(path, "reading", e))?;
        if len < size {
            tracing::warn!(path = %path.display(), bytes = size - len, "cutting a partial last line");
            file.set_len(len)
                .map_err(|e| io_err(path, "cutting the partial last line", e))?;
            file.sync_all().map_err(|e| io_err(path, "syncing", e))?;
        }
        file.seek(SeekFrom::Start(len))
            .map_err(|e| io_err(path, "seeking", e))?;
        Ok(JsonlWriter {
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    /// Appends `lines`: one or more whole lines, each ending in `\n`, in one write. When the write
    /// fails the file is cut back to what it held before, so it never keeps part of `lines`.
    pub fn append(&mut self, lines: &str) -> Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        if !lines.ends_with('\n') {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "lines must end in a newline");
            return Err(io_err(&self.path, "appending", e));
        }
        if let Err(e) = self
            .file
            .write_all(lines.as_bytes())
            .and_then(|()| self.file.flush())
        {
            // Best effort: a file we cannot cut is cut by the next resume (a partial last line) or
            // by the caller's unit rule (whole lines of an unfinished unit).
            let _ = self.file.set_len(self.len);
            let _ = self.file.seek(SeekFrom::Start(self.len));
            return Err(io_err(&self.path, "appending", e));
        }
        self.len += lines.len() as u64;
        Ok(())
    }

    /// Appends `record` as one JSON line.
    pub fn append_record<T: serde::Serialize>(&mut self, record: &T) -> Result<()> {
        let mut line = serde_json::to_string(record)
            .map_err(|e| Error::InvalidRequest(format!("{}: a record: {e}", self.path.display())))?;
        line.push('\n');
        self.append(&line)
    }

    /// Makes what was appended durable (fsync): appends survive a killed process without it, but
    /// not a power loss.
    pub fn sync(&mut self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| io_err(&self.path, "syncing", e))
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes in the file (whole lines only).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file holds no line.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Syncs the file and renames it to `target` (atomically replacing what was there), for runs that
    /// write to a side file and publish it only once complete.
    pub fn finish_into(mut self, target: &Path) -> Result<()> {
        self.sync()?;
        drop(self.file);
        std::fs::rename(&self.path, target)
            .map_err(|e| io_err(target, &format!("renaming {} over it", self.path.display()), e))?;
        sync_dir(parent_dir(target));
        Ok(())
    }
}

/// The length of `file`'s prefix of whole lines (up to and including its last `\n`), read backwards
/// in blocks so that resuming a large file does not read all of it.
fn whole_lines_len(file: &mut File, size: u64) -> std::io::Result<u64> {
    const BLOCK: u64 = 64 << 10;
    let mut end = size;
    let mut buf = vec![0u8; BLOCK as usize];
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}
