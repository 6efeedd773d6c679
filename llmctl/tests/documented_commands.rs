//! Every `llmctl` and `llmd` command line shown in README.md and docs/*.md, run as a reader
//! would run it, and checked to succeed.
//!
//! A line in a fenced code block (no language, or sh/bash/shell/console) whose first word is
//! `llmctl` or `llmd` (after an optional `$ ` prompt or `adb shell `; `target/release/` before
//! the name is allowed) is either:
//! - a **synopsis**, when it holds a `[` (with the indented lines under it): every `--flag` it
//!   names must be in the `--help` of the command and subcommands it names;
//! - a **command line**: run by `bash -c` in a scratch directory holding `models/` and `texts/`
//!   of the repository, with `target/release` first on `PATH` and `LLMD_SOCKET` naming a daemon
//!   this test started on the default model (it stands in for a phone's kernel Binder: `adb
//!   shell llmctl status` runs as `llmctl status` against it). It must exit 0 within
//!   `COMMAND_LIMIT`. An `llmd` line must name its `--socket`: it is started, must create that
//!   socket within `STARTUP`, and must exit 0 on SIGTERM.
//!
//! The NPU lines take llmd's emulator beside llmctl, as a reader's `cargo build -p qnn-emu-sys`
//! puts it (where cargo left it elsewhere, `LLMD_QNN_LIB` names it). A line on the GPU
//! (`gpu-info`, `--backend gpu`) needs an OpenCL runtime: without one it is reported and passed
//! over, unless `LLMD_REQUIRE_OPENCL=1` (scripts/test.sh, CI), which makes it a failure.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest one documented command may take here (a one-model benchmark, a short conversion).
const COMMAND_LIMIT: Duration = Duration::from_secs(300);
/// Longest a daemon may take to load the default model and bind its socket.
const STARTUP: Duration = Duration::from_secs(60);

#[derive(Debug)]
enum Shown {
    Synopsis { file: String, text: String },
    Command { file: String, line: String },
}

/// The Markdown files a reader is shown.
fn documents() -> Vec<PathBuf> {
    let root = common::root();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort();
    files.insert(0, root.join("README.md"));
    files
}

/// `llmctl …` or `llmd …` without prompt, `adb shell` or a `target/release/` path; None for
/// any other line.
fn command_of(line: &str) -> Option<String> {
    let l = line.trim_start();
    let l = l.strip_prefix("$ ").unwrap_or(l);
    let l = l.strip_prefix("adb shell ").unwrap_or(l);
    let l = l.strip_prefix("target/release/").unwrap_or(l);
    let first = l.split_whitespace().next()?;
    matches!(first, "llmctl" | "llmd").then(|| l.trim_end().to_string())
}

fn shown(path: &Path) -> Vec<Shown> {
    let text = std::fs::read_to_string(path).expect("readable");
    let file = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let mut out = Vec::new();
    let mut in_block: Option<bool> = None; // Some(runnable language) inside a fence
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            in_block = match in_block {
                Some(_) => None,
                None => Some(matches!(lang.trim(), "" | "sh" | "bash" | "shell" | "console")),
            };
            continue;
        }
        if in_block != Some(true) {
            continue;
        }
        let Some(mut cmd) = command_of(line) else { continue };
        if cmd.contains('[') {
            while let Some(next) = lines.peek() {
                if next.starts_with(' ') && command_of(next).is_none() && !next.trim().is_empty() {
                    cmd.push(' ');
                    cmd.push_str(next.trim());
                    lines.next();
                } else {
                    break;
                }
            }
            out.push(Shown::Synopsis { file: file.clone(), text: cmd });
        } else {
            while cmd.ends_with('\\') {
                cmd.pop();
                match lines.next() {
                    Some(next) => cmd.push_str(next.trim()),
                    None => break,
                }
            }
            out.push(Shown::Command { file: file.clone(), line: cmd });
        }
    }
    out
}

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_llmctl")).parent().expect("a directory").to_path_buf()
}

fn help(program: &str, sub: Option<&str>) -> String {
    let mut c = Command::new(bin_dir().join(program));
    if let Some(s) = sub {
        c.arg(s);
    }
    let out = c.arg("--help").stdin(Stdio::null()).output().expect("--help runs");
    assert!(out.status.success(), "{program} {sub:?} --help failed");
    // llmctl prints its help on stderr, llmd on stdout.
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// llmctl's subcommands, from its `--help`.
fn subcommands() -> BTreeSet<String> {
    let h = help("llmctl", None);
    h.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|s| s != "help")
        .collect()
}

fn flags(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect()
}

fn has_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag)
        .any(|(i, _)| !help[i + flag.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-'))
}

#[test]
fn every_synopsis_names_only_flags_the_commands_take() {
    let subs = subcommands();
    let mut bad = Vec::new();
    let mut n = 0;
    for doc in documents() {
        for s in shown(&doc) {
            let Shown::Synopsis { file, text } = s else { continue };
            n += 1;
            let program = text.split_whitespace().next().expect("a word").to_string();
            let mut helps = vec![help(&program, None)];
            if program == "llmctl" {
                let named: BTreeSet<&str> = text
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .filter(|w| subs.contains(*w))
                    .collect();
                helps.extend(named.into_iter().map(|s| help("llmctl", Some(s))));
            }
            for f in flags(&text) {
                if !helps.iter().any(|h| has_flag(h, &f)) {
                    bad.push(format!("{file}: {f} in `{text}`"));
                }
            }
        }
    }
    assert!(n > 0, "no synopsis found in the docs");
    assert!(bad.is_empty(), "flags the docs show that the commands do not take:\n{}", bad.join("\n"));
}

/// A running daemon on the default model, stopped and cleaned up on drop.
struct Daemon {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn wait_for(path: &Path, child: &mut Child, limit: Duration) -> Result<(), String> {
    let t = Instant::now();
    while !path.exists() {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!("exited ({st}) before creating {}", path.display()));
        }
        if t.elapsed() > limit {
            return Err(format!("no {} within {limit:?}", path.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Waits for `child` up to `limit`, killing it past that.
fn finish(child: &mut Child, limit: Duration) -> Result<std::process::ExitStatus, String> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            return Ok(st);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

#[test]
fn every_command_line_in_the_docs_runs_and_succeeds() {
    let root = common::root().canonicalize().expect("root");
    let model = common::model();
    let llmd = common::llmd();
    let dir = std::env::temp_dir().join(format!("llmd-doc-commands-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let work = dir.join("work");
    std::fs::create_dir_all(&work).expect("scratch directory");
    for d in ["models", "texts"] {
        if root.join(d).exists() {
            std::os::unix::fs::symlink(root.join(d), work.join(d)).expect("symlink");
        }
    }
    let socket = dir.join("llmd.sock");
    let child = Command::new(&llmd)
        .args(["--model", model.to_str().expect("path"), "--socket", socket.to_str().expect("path")])
        .args(["--kernel-binder", "off", "--threads", "2", "--state-dir", dir.join("state").to_str().expect("path")])
        .env("LLMD_LOG", "warn")
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(dir.join("llmd.log")).expect("log file"))
        .spawn()
        .expect("llmd starts");
    let mut daemon = Daemon { child, dir: dir.clone(), socket };
    wait_for(&daemon.socket.clone(), &mut daemon.child, STARTUP).expect("the daemon starts");

    let path = format!("{}:{}", bin_dir().display(), std::env::var("PATH").unwrap_or_default());
    let beside = bin_dir().join(llmd_qnn_emu::LIBRARY_FILE);
    let emulator = if beside.exists() { None } else { Some(llmd_qnn_emu::built_library().expect("the emulator")) };
    let require_opencl = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
    let mut passed_over = Vec::new();
    let mut failed = Vec::new();
    let mut ran = 0;
    for doc in documents() {
        for s in shown(&doc) {
            let Shown::Command { file, line } = s else { continue };
            ran += 1;
            let log = dir.join(format!("command-{ran}.log"));
            let started = Instant::now();
            let mut cmd = Command::new("bash");
            if let Some(e) = &emulator {
                cmd.env("LLMD_QNN_LIB", e);
            }
            cmd.arg("-c")
                .arg(format!("exec {line}"))
                .current_dir(&work)
                .env("PATH", &path)
                .env("LLMD_SOCKET", &daemon.socket)
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(&log).expect("log"))
                .stderr(std::fs::File::create(dir.join(format!("command-{ran}.err"))).expect("log"));
            let result = if line.starts_with("llmd ") {
                run_daemon_line(&mut cmd, &line, &work)
            } else {
                let mut child = cmd.spawn().expect("bash runs");
                match finish(&mut child, COMMAND_LIMIT) {
                    Ok(st) if st.success() => Ok(()),
                    Ok(st) => Err(format!("{st}")),
                    Err(e) => Err(e),
                }
            };
            eprintln!("{file}: `{line}`: {:?} in {:.1} s", result, started.elapsed().as_secs_f64());
            if let Err(e) = result {
                let err = tail(&dir.join(format!("command-{ran}.err")));
                let on_gpu = line.contains("gpu-info") || line.contains("--backend gpu");
                if on_gpu && !require_opencl && err.contains("OpenCL") {
                    passed_over.push(format!("{file}: `{line}`: {err}"));
                } else {
                    failed.push(format!("{file}: `{line}`: {e}\n{err}"));
                }
            }
        }
    }
    assert!(ran > 0, "no command line found in the docs");
    for p in &passed_over {
        eprintln!("passed over, no OpenCL runtime (LLMD_REQUIRE_OPENCL=1 makes it a failure): {p}");
    }
    assert!(failed.is_empty(), "documented command lines that fail:\n{}", failed.join("\n\n"));
    assert!(daemon.child.try_wait().expect("wait").is_none(), "the daemon died: {}", tail(&dir.join("llmd.log")));
}

/// Starts a documented `llmd` line, waits for its `--socket`, and stops it with SIGTERM.
fn run_daemon_line(cmd: &mut Command, line: &str, work: &Path) -> Result<(), String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let socket = words
        .iter()
        .position(|w| *w == "--socket")
        .and_then(|i| words.get(i + 1))
        .ok_or("a documented llmd line names its --socket")?;
    let socket = work.join(socket);
    // A daemon the reader started by hand may serve that path: never take its socket away.
    if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        return Err(format!("a daemon already serves {}: stop it to run this test", socket.display()));
    }
    let _ = std::fs::remove_file(&socket);
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    wait_for(&socket, &mut child, STARTUP)?;
    nix_kill(child.id());
    match finish(&mut child, Duration::from_secs(30))? {
        st if st.success() => Ok(()),
        st => Err(format!("on SIGTERM: {st}")),
    }
}

fn nix_kill(pid: u32) {
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
}
