//! Where llmctl keeps what it caches between runs.

use std::path::PathBuf;

/// A cache directory chosen on the command line: `none` for no cache, a path, or by default
/// `$XDG_CACHE_HOME/llmd/<sub>`, else `~/.cache/llmd/<sub>` (None when neither is set).
pub fn cache_dir(choice: Option<&str>, sub: &str) -> Option<PathBuf> {
    match choice {
        Some("none") => None,
        Some(d) => Some(PathBuf::from(d)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("llmd").join(sub)),
    }
}
