//! Helpers shared by the daemon's integration tests (each test file uses some of them).
#![allow(dead_code)]

pub mod client;

use llmd_aidl::GenerateRequest::GenerateRequest;
use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// `llmd`'s exit status once it has exited, within `limit` (after a SIGTERM, say).
pub fn exit_status_within(child: &mut Child, limit: Duration) -> ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        assert!(t.elapsed() < limit, "llmd did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

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

/// A greedy raw-text request.
pub fn greedy(prompt: &str, max_tokens: i32) -> GenerateRequest {
    GenerateRequest { prompt: prompt.into(), temperature: 0.0, maxTokens: max_tokens, ..GenerateRequest::default() }
}

/// A greedy one-message chat request.
pub fn chat(msg: &str, max_tokens: i32) -> GenerateRequest {
    GenerateRequest {
        messages: vec![llmd_aidl::ChatMessage::ChatMessage { role: "user".into(), content: msg.into() }],
        temperature: 0.0,
        maxTokens: max_tokens,
        ..GenerateRequest::default()
    }
}

/// llmd's emulator provider of the QNN HTP API, built beside the test as a dev-dependency (a
/// dependency's cdylib lands in `deps/`).
pub fn emulator_library() -> PathBuf {
    llmd_qnn_emu::built_library().unwrap_or_else(|e| panic!("{e}"))
}
