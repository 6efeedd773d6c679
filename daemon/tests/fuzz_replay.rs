//! Every fuzz target replayed on the stable toolchain: every stored input of
//! `fuzz/corpus/<target>/` (the seeds and what libFuzzer's merge kept) and of
//! `fuzz/regressions/<target>/` (inputs that once crashed, hung or ran out of memory) goes
//! through the target's body (`llmd_engine::fuzzing`, `llmd_daemon::fuzzing`), which must return
//! without a panic and well within the fuzzing time limit. As in the fuzz binaries
//! (`llmd_engine::fuzzing::init`), model files' chat templates render in a sandbox process:
//! here the llmd binary. `scripts/fuzz.sh` runs the targets themselves.
//!
//! `write_seeds` (ignored) regenerates the `aidl` seeds: one transaction per method of each
//! interface, and each parcelable alone, encoded by rsbinder as a client encodes them.

use llmd_daemon::fuzzing;
use llmd_engine::chat::{set_sandbox, Sandbox, SANDBOX_ARG};
use llmd_engine::fuzzing as engine;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// libFuzzer's `-timeout` in `scripts/fuzz.sh` is 10 s per input (with instrumentation); a
/// replay takes a fraction of that.
const PER_INPUT: Duration = Duration::from_secs(10);

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// Runs every stored input of `target` through `body`; returns how many there were.
fn replay(target: &str, body: fn(&[u8])) -> usize {
    set_sandbox(Sandbox { program: env!("CARGO_BIN_EXE_llmd").into(), args: vec![SANDBOX_ARG.into()] });
    let mut n = 0;
    for kind in ["corpus", "regressions"] {
        for path in inputs(&fuzz_dir().join(kind).join(target)) {
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let t0 = Instant::now();
            if std::panic::catch_unwind(|| body(&data)).is_err() {
                panic!("fuzz target {target} panics on {}", path.display());
            }
            let took = t0.elapsed();
            assert!(took < PER_INPUT, "fuzz target {target} took {took:?} on {}", path.display());
            n += 1;
        }
    }
    assert!(n > 0, "no stored input for fuzz target {target} (fuzz/corpus/{target}/)");
    n
}

#[test]
fn gguf_inputs_replay_without_a_panic() {
    replay("gguf", engine::gguf);
}

#[test]
fn llmd_inputs_replay_without_a_panic() {
    replay("llmd", engine::llmd);
}

#[test]
fn hf_inputs_replay_without_a_panic() {
    replay("hf", engine::hf);
}

#[test]
fn tokenizer_inputs_replay_without_a_panic() {
    replay("tokenizer", engine::tokenizer);
}

#[test]
fn chat_template_inputs_replay_without_a_panic() {
    replay("chat_template", engine::chat_template);
}

#[test]
fn aidl_inputs_replay_without_a_panic() {
    replay("aidl", fuzzing::aidl);
}

#[test]
fn config_inputs_replay_without_a_panic() {
    replay("config", fuzzing::config);
}

/// Regenerates the `aidl` seeds: `cargo test --release -p llmd-daemon --test fuzz_replay --
/// --ignored write_seeds`. Byte 0 chooses the reader, byte 1 the method (see
/// `llmd_daemon::fuzzing::aidl`); the rest is the arguments as rsbinder writes them.
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the AIDL changes"]
fn write_seeds() {
    use llmd_aidl::ChatMessage::ChatMessage;
    use llmd_aidl::GenerateRequest::GenerateRequest;
    use llmd_aidl::GenerationStats::GenerationStats;
    use llmd_aidl::ModelInfo::ModelInfo;
    use llmd_aidl::Priority::Priority;
    use llmd_aidl::ServiceStatus::ServiceStatus;
    use llmd_aidl::SessionOptions::SessionOptions;
    use rsbinder::to_bytes;

    let dir = fuzz_dir().join("corpus/aidl");
    std::fs::create_dir_all(&dir).expect("corpus dir");
    let chat = GenerateRequest {
        prompt: String::new(),
        messages: vec![
            ChatMessage { role: "system".into(), content: "Be brief.".into() },
            ChatMessage { role: "user".into(), content: "Hi <|im_end|>".into() },
        ],
        temperature: 0.7,
        topK: 40,
        topP: 0.9,
        minP: 0.05,
        repetitionPenalty: 1.1,
        seed: 42,
        maxTokens: 64,
        stop: vec!["\n\n".into(), "User:".into()],
        priority: Priority::BACKGROUND,
        deadlineMs: 30_000,
    };
    let text = GenerateRequest { prompt: "Once upon a time".into(), maxTokens: 16, ..GenerateRequest::default() };
    let stats = GenerationStats {
        promptTokens: 12,
        generatedTokens: 30,
        queueWaitMs: 3,
        timeToFirstTokenMs: 40,
        prefillTokensPerSecond: 300.0,
        decodeTokensPerSecond: 25.5,
        finishReason: "stop".into(),
    };
    let b = |v: Result<Vec<u8>, rsbinder::StatusCode>| v.expect("encodes");
    /// A seed's name, its two selector bytes, and its arguments in order.
    type Seed = (&'static str, [u8; 2], Vec<Vec<u8>>);
    let seeds: Vec<Seed> = vec![
        ("service-listModels", [0, 0], vec![]),
        ("service-getModelInfo", [0, 1], vec![b(to_bytes("SmolLM2-135M-Instruct"))]),
        ("service-openSession", [0, 2], vec![b(to_bytes("m")), b(to_bytes(&SessionOptions { contextTokens: 512 }))]),
        ("service-getStatus", [0, 3], vec![]),
        ("session-generate-chat", [1, 0], vec![b(to_bytes(&chat))]),
        ("session-cancel", [1, 1], vec![b(to_bytes(&7i64))]),
        ("session-countTokens", [1, 2], vec![b(to_bytes("How many tokens is this? 漢字"))]),
        ("session-reset", [1, 3], vec![]),
        ("session-close", [1, 4], vec![]),
        ("admin-prefetch", [2, 0], vec![b(to_bytes("m"))]),
        ("admin-dumpState", [2, 1], vec![]),
        ("callback-onStarted", [3, 0], vec![b(to_bytes(&1i64))]),
        ("callback-onTokens", [3, 1], vec![b(to_bytes(&1i64)), b(to_bytes("Hello")), b(to_bytes(&[15, 27, 3][..]))]),
        ("callback-onCompleted", [3, 2], vec![b(to_bytes(&1i64)), b(to_bytes(&stats))]),
        ("callback-onError", [3, 3], vec![b(to_bytes(&1i64)), b(to_bytes(&5i32)), b(to_bytes("too large"))]),
        ("generateRequest-chat", [4, 0], vec![b(to_bytes(&chat))]),
        ("generateRequest-text", [4, 0], vec![b(to_bytes(&text))]),
        ("sessionOptions", [5, 0], vec![b(to_bytes(&SessionOptions { contextTokens: -1 }))]),
        ("chatMessage", [6, 0], vec![b(to_bytes(&ChatMessage { role: "user".into(), content: "hi".into() }))]),
        (
            "modelInfo",
            [7, 0],
            vec![b(to_bytes(&ModelInfo {
                id: "m".into(),
                architecture: "llama".into(),
                layers: 30,
                contextLength: 8192,
                vocabSize: 49152,
                weightBytes: 1 << 27,
                hasChatTemplate: true,
            }))],
        ),
        (
            "serviceStatus",
            [7, 0],
            vec![b(to_bytes(&ServiceStatus { interfaceVersion: 2, ..ServiceStatus::default() }))],
        ),
        ("generationStats", [7, 0], vec![b(to_bytes(&stats))]),
    ];
    for (name, head, args) in seeds {
        let mut data = head.to_vec();
        for a in args {
            data.extend(a);
        }
        std::fs::write(dir.join(name), data).expect("written");
    }
}
