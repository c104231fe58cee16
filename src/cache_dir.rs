//! Where recall keeps what it can rebuild but would rather not: compiled kernels, parsed tokenizers.

use std::path::PathBuf;

/// The directory for one kind of cached file: `$env` when set (`off` or `0` disables the cache),
/// else `$XDG_CACHE_HOME/recall/{sub}`, else `~/.cache/recall/{sub}`; `None` when disabled or no
/// home is known.
///
/// ```
/// std::env::set_var("RECALL_EXAMPLE_CACHE", "off");
/// assert_eq!(recall::cache_dir::under("RECALL_EXAMPLE_CACHE", "examples"), None);
/// std::env::set_var("RECALL_EXAMPLE_CACHE", "/tmp/somewhere");
/// assert_eq!(
///     recall::cache_dir::under("RECALL_EXAMPLE_CACHE", "examples"),
///     Some("/tmp/somewhere".into())
/// );
/// ```
pub fn under(env: &str, sub: &str) -> Option<PathBuf> {
    match std::env::var_os(env) {
        Some(v) if v == "off" || v == "0" => return None,
        Some(v) if !v.is_empty() => return Some(PathBuf::from(v)),
        _ => {}
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("recall").join(sub));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/recall").join(sub))
}
