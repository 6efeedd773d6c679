//! Finding and loading the installed models: every `*.gguf` and `*.llmd` file and HF directory in the
//! models directory, plus explicitly named ones; a model's id is its name without extension.

use crate::config::Config;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Model files (or HF directories) named by the configuration, by id.
pub fn discover(config: &Config) -> Result<BTreeMap<String, PathBuf>, String> {
    let mut found = BTreeMap::new();
    let mut add = |path: PathBuf| -> Result<(), String> {
        let id = model_id(&path).ok_or_else(|| format!("{}: cannot derive a model id", path.display()))?;
        if let Some(prev) = found.insert(id.clone(), path.clone()) {
            return Err(format!("two models named {id:?}: {} and {}", prev.display(), path.display()));
        }
        Ok(())
    };
    if let Some(dir) = &config.models_dir {
        let entries = std::fs::read_dir(dir).map_err(|e| format!("models directory {}: {e}", dir.display()))?;
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
            if matches!(ext, "gguf" | "llmd") && p.is_file() || llmd_engine::format::is_hf_dir(&p) {
                add(p)?;
            }
        }
    }
    for p in &config.models {
        add(p.clone())?;
    }
    if found.is_empty() {
        return Err("no models found (a models directory holds *.gguf or *.llmd files or HF directories)".into());
    }
    Ok(found)
}

pub fn model_id(path: &Path) -> Option<String> {
    let name = if path.is_dir() { path.file_name() } else { path.file_stem() };
    name.map(|n| n.to_string_lossy().into_owned()).filter(|n| !n.is_empty())
}

/// Reads every model's header (no weights, no tokenizer); one that fails is reported and left
/// out, so one bad file does not stop the daemon serving the others.
pub fn probe_all(paths: &BTreeMap<String, PathBuf>) -> BTreeMap<String, (PathBuf, llmd_engine::ModelProbe)> {
    let mut out = BTreeMap::new();
    for (id, path) in paths {
        match llmd_engine::probe(path) {
            Ok(p) => {
                out.insert(id.clone(), (path.clone(), p));
            }
            Err(e) => tracing::error!(model = %id, "model not usable: {e}"),
        }
    }
    out
}
