//! The docs against the code: docs/CONFIG.md lists exactly the parser's keys with the code's
//! defaults, and the README and docs keep the shape a reader needs (README.md at most
//! `README_MAX_LINES` lines, no line over `MAX_LINE_CHARS`, no history headings in
//! docs/BENCHMARKS.md).

mod common;

use llmd_daemon::config::Config;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The README a newcomer reads in five minutes.
const README_MAX_LINES: usize = 200;
/// The longest line README.md, ARCHITECTURE.md and docs/ may hold (a table row included).
const MAX_LINE_CHARS: usize = 300;
/// Words that make a heading a log of how things came to be rather than what they are.
const HISTORY_WORDS: &[&str] = &["session", "issue", "before", "after", "latest", "earlier", "history"];

/// `(section, key)` → the default as JSON, from `Config::default()`: a top-level key has
/// section "", a table (`[npu]`, …) its name; a map-valued key (`[scheduler] weights`) is a
/// leaf whose default is `{}`.
fn code_keys() -> BTreeMap<(String, String), Value> {
    let v = serde_json::to_value(Config::default()).expect("the config serializes");
    let mut keys = BTreeMap::new();
    for (k, val) in v.as_object().expect("an object") {
        match val {
            Value::Object(table) if !table.is_empty() => {
                for (k2, val2) in table {
                    keys.insert((k.clone(), k2.clone()), val2.clone());
                }
            }
            _ => {
                keys.insert((String::new(), k.clone()), val.clone());
            }
        }
    }
    keys
}

/// `(section, key)` → the default cell's text, from docs/CONFIG.md's tables: a `## [name]`
/// heading opens a section, `## Top level` the top level; rows are `| `key` | default | meaning |`.
fn doc_keys(text: &str) -> BTreeMap<(String, String), String> {
    let mut keys = BTreeMap::new();
    let mut section: Option<String> = None;
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = if h.trim() == "Top level" {
                Some(String::new())
            } else {
                h.trim().trim_matches('`').strip_prefix('[').and_then(|s| s.strip_suffix(']')).map(str::to_string)
            };
            continue;
        }
        let Some(row) = line.strip_prefix("| `") else { continue };
        let Some(sec) = &section else { panic!("docs/CONFIG.md: a key's row outside a `## [section]`: {line}") };
        let cells: Vec<&str> = row.split(" | ").collect();
        assert!(cells.len() >= 3, "docs/CONFIG.md: a row without key, default and meaning: {line}");
        let key = cells[0].trim_end_matches('`').to_string();
        let prev = keys.insert((sec.clone(), key.clone()), cells[1].trim().to_string());
        assert!(prev.is_none(), "docs/CONFIG.md lists [{sec}] {key} twice");
    }
    keys
}

/// A documented default as JSON: `unset` is null, anything else a TOML value in backticks.
fn doc_default(cell: &str) -> Value {
    if cell == "unset" {
        return Value::Null;
    }
    let lit = cell
        .strip_prefix('`')
        .and_then(|c| c.strip_suffix('`'))
        .unwrap_or_else(|| panic!("docs/CONFIG.md: a default is `unset` or a TOML value in backticks, not {cell:?}"));
    let t: toml::Table = toml::from_str(&format!("v = {lit}")).unwrap_or_else(|e| panic!("default {lit:?}: {e}"));
    serde_json::to_value(&t["v"]).expect("json")
}

fn name((section, key): &(String, String)) -> String {
    if section.is_empty() {
        key.clone()
    } else {
        format!("[{section}] {key}")
    }
}

#[test]
fn every_config_key_is_documented_with_the_codes_default_and_no_other() {
    let doc = std::fs::read_to_string(common::root().join("docs/CONFIG.md")).expect("docs/CONFIG.md");
    let documented = doc_keys(&doc);
    let code = code_keys();
    let missing: Vec<String> = code.keys().filter(|k| !documented.contains_key(*k)).map(name).collect();
    let unknown: Vec<String> = documented.keys().filter(|k| !code.contains_key(*k)).map(name).collect();
    assert!(missing.is_empty(), "keys the parser takes that docs/CONFIG.md does not list: {missing:?}");
    assert!(unknown.is_empty(), "keys docs/CONFIG.md lists that the parser does not take: {unknown:?}");
    let mut wrong = Vec::new();
    for (k, cell) in &documented {
        let (doc, code) = (doc_default(cell), &code[k]);
        // Floats and integers compare as numbers (`10.0` in the doc, `10.0` from serde).
        let same = match (doc.as_f64(), code.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => doc == *code,
        };
        if !same {
            wrong.push(format!("{}: docs/CONFIG.md says {cell}, the code {code}", name(k)));
        }
    }
    assert!(wrong.is_empty(), "documented defaults that are not the code's:\n{}", wrong.join("\n"));

    // And the documented defaults, written as a config file, read back as the default config.
    let mut file = String::new();
    for section in documented.keys().map(|(s, _)| s.clone()).collect::<std::collections::BTreeSet<_>>() {
        if !section.is_empty() {
            file.push_str(&format!("[{section}]\n"));
        }
        for ((s, key), cell) in &documented {
            if *s == section && cell != "unset" {
                file.push_str(&format!("{key} = {}\n", cell.trim_matches('`')));
            }
        }
    }
    let parsed = Config::from_toml(&file, Path::new("docs/CONFIG.md")).expect("the documented defaults parse");
    assert_eq!(parsed, Config::default(), "the documented defaults as a file are not the default config:\n{file}");
}

/// The Markdown files held to the line limit.
fn docs() -> Vec<std::path::PathBuf> {
    let root = common::root();
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut more: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    files.extend(more);
    files
}

#[test]
fn readme_is_short_lines_are_short_and_benchmarks_have_no_history_headings() {
    let root = common::root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let n = readme.lines().count();
    assert!(n <= README_MAX_LINES, "README.md has {n} lines; at most {README_MAX_LINES}");
    let mut long = Vec::new();
    for f in docs() {
        let text = std::fs::read_to_string(&f).expect("readable");
        for (i, line) in text.lines().enumerate() {
            let chars = line.chars().count();
            if chars > MAX_LINE_CHARS {
                long.push(format!("{}:{}: {chars} characters", f.strip_prefix(&root).unwrap_or(&f).display(), i + 1));
            }
        }
    }
    assert!(long.is_empty(), "lines over {MAX_LINE_CHARS} characters:\n{}", long.join("\n"));
    let bench = std::fs::read_to_string(root.join("docs/BENCHMARKS.md")).expect("docs/BENCHMARKS.md");
    let history: Vec<&str> = bench
        .lines()
        .filter(|l| l.starts_with('#'))
        .filter(|l| {
            let l = l.to_lowercase();
            HISTORY_WORDS.iter().any(|w| l.split(|c: char| !c.is_alphanumeric()).any(|word| word == *w))
                || l.contains('#') && l.trim_start_matches('#').contains('#')
        })
        .collect();
    assert!(history.is_empty(), "docs/BENCHMARKS.md's headings read as history: {history:?}");
}
