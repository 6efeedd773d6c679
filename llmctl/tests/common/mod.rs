//! Helpers shared by llmctl's integration tests (each test file uses some of them).
#![allow(dead_code)]

use llmd_aidl::GenerateRequest::GenerateRequest;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The real default model (`LLMD_MODEL` overrides), which `scripts/fetch-model.sh` installs.
pub fn model() -> PathBuf {
    let p = std::env::var_os("LLMD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.is_file(), "the default model is missing at {}: run scripts/fetch-model.sh", p.display());
    p
}

/// Runs the `llmctl` binary built with these tests, with no standard input.
pub fn llmctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_llmctl")).args(args).stdin(Stdio::null()).output().expect("llmctl runs")
}

/// The `llmd` binary, for the tests that talk to a daemon. It belongs to another package
/// (llmd-daemon), which cargo does not build for llmctl's tests: it is taken from beside the
/// `llmctl` built with them, so build it first (`cargo build --release -p llmd-daemon --bin llmd`;
/// `cargo test --workspace` and scripts/test.sh do).
pub fn llmd() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_llmctl")).with_file_name("llmd");
    assert!(
        p.is_file(),
        "no llmd binary at {}: build it first (cargo build --release -p llmd-daemon --bin llmd)",
        p.display()
    );
    p
}

/// A greedy raw-text request.
pub fn greedy(prompt: &str, max_tokens: i32) -> GenerateRequest {
    GenerateRequest { prompt: prompt.into(), temperature: 0.0, maxTokens: max_tokens, ..GenerateRequest::default() }
}

/// Qualcomm's HTP library built for x86-64: `LLMD_QNN_LIB`, else the cache
/// `scripts/fetch-qnn.sh` fills (and prints).
pub fn htp_library() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMD_QNN_LIB") {
        return p.into();
    }
    let out = Command::new(root().join("scripts/fetch-qnn.sh")).output().expect("scripts/fetch-qnn.sh runs");
    assert!(out.status.success(), "scripts/fetch-qnn.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("libQnnHtp.so")
}
