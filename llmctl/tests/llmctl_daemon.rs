//! llmctl as a client of a running llmd over Binder-over-Unix-socket, with the real model: a
//! killed client's session is freed, a stopped (frozen) client holds up only its own request,
//! and a short `bench --load` run accounts for every request. Each test starts its own daemon
//! (`common::llmd()`: build it first) and stops it at the end.

mod common;

use common::{greedy, model};
use llmctl::client::{self, Connection, Event};
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::ILlmSession::ILlmSession;
use llmd_aidl::SessionOptions::SessionOptions;
use rsbinder::Strong;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";
/// Longest a daemon may take to start (load the model, bind the socket).
const STARTUP: Duration = Duration::from_secs(60);

/// Tests share the machine's two cores: one daemon at a time keeps their timing meaningful.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Daemon {
    _turn: std::sync::MutexGuard<'static, ()>,
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    /// Starts llmd on the default model with extra TOML `config` lines.
    fn start(config: &str) -> Self {
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir =
            std::env::temp_dir().join(format!("llmd-e2e-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("llmd.sock");
        let cfg = dir.join("llmd.toml");
        std::fs::write(&cfg, config).expect("config written");
        let child = Command::new(common::llmd())
            .args([
                "--config",
                cfg.to_str().expect("path"),
                "--model",
                model().to_str().expect("path"),
                "--socket",
                socket.to_str().expect("path"),
            ])
            .args(["--kernel-binder", "off", "--threads", "2"])
            .env_remove("LLMD_QNN_LIB")
            .env("LLMD_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("llmd starts");
        let d = Daemon { _turn: turn, child, socket, dir };
        let t = Instant::now();
        while !d.socket.exists() {
            assert!(t.elapsed() < STARTUP, "llmd did not create its socket");
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn connect(&self) -> Connection {
        client::connect(Some(&self.socket), "llmd").expect("client connects")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends a request and returns the token ids it streamed until it completed.
fn run_ids(session: &Strong<dyn ILlmSession>, req: &GenerateRequest) -> Vec<i32> {
    let (cb, _tx, rx) = client::callback();
    session.generate(req, &cb).unwrap_or_else(|s| panic!("generate: {}", client::describe(&s)));
    let mut ids = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("the request ends") {
            Event::Tokens(_, i) => ids.extend(i),
            Event::Completed(_) => return ids,
            Event::Error(code, m) => panic!("request failed: {code} {m}"),
            _ => {}
        }
    }
}

fn session(conn: &Connection) -> Strong<dyn ILlmSession> {
    conn.service.openSession(MODEL_ID, &SessionOptions::default()).expect("session opens")
}

fn golden_capital_ids(n: usize) -> Vec<i32> {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden/smollm2.json")).expect("golden"),
    )
    .expect("JSON");
    let p = g["prompts"].as_array().expect("prompts").iter().find(|p| p["name"] == "capital").expect("capital");
    p["greedy_ids"].as_array().expect("ids").iter().take(n).map(|x| x.as_i64().expect("id") as i32).collect()
}

/// `llmctl run --max-tokens N PROMPT` against `d`, once its request is running.
fn llmctl_run_started(d: &Daemon, conn: &Connection, max_tokens: &str, prompt: &str, stdout: Stdio) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_llmctl"))
        .args(["--socket", d.socket.to_str().expect("path"), "run", "--max-tokens", max_tokens, prompt])
        .stdout(stdout)
        .stderr(Stdio::null())
        .spawn()
        .expect("llmctl starts");
    let t = Instant::now();
    while conn.service.getStatus().expect("status").requestsRunning == 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the client's request never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn a_killed_client_is_detected_and_its_session_freed() {
    let d = Daemon::start("");
    let conn = d.connect();
    let mut child = llmctl_run_started(&d, &conn, "1000", "Write a long essay about rivers.", Stdio::null());
    child.kill().expect("kill");
    let _ = child.wait();
    let t = Instant::now();
    loop {
        let s = conn.service.getStatus().expect("status");
        if s.sessionsOpen == 0 && s.requestsRunning == 0 && s.kvCacheBytes == 0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "the dead client's session is still there: {s:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The daemon keeps serving.
    assert_eq!(run_ids(&session(&conn), &greedy("The capital of France is", 4)), golden_capital_ids(4));
}

/// A client that stops reading its callbacks (here a stopped `llmctl`, as the system freezes a
/// cached app) holds up only its own request: other clients keep being served, the frozen
/// request waits without spinning, and it finishes once its client reads again (within
/// `stream_stall_timeout_s`, set long here: past it the request would be ended). Its full
/// socket blocks neither the worker thread nor any other request.
#[test]
fn a_frozen_client_holds_up_only_its_own_request() {
    // One `onTokens` per token, so the stopped client's socket fills as fast as it can.
    let d = Daemon::start("[scheduler]\nstream_interval_ms = 0\nstream_stall_timeout_s = 300\n");
    let conn = d.connect();
    // A long generation that does not stop early (greedy counting), streamed to a client.
    let frozen = llmctl_run_started(&d, &conn, "3000", "1, 2, 3, 4, 5, 6, 7, 8,", Stdio::piped());
    let pid = frozen.id().to_string();
    let signal = |sig: &str| {
        let ok = Command::new("kill").args([sig, &pid]).status().expect("kill runs").success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    // Long enough for the stopped client's socket to fill at full decoding speed (~200
    // tokens/s here; it is full within ~3 s).
    std::thread::sleep(Duration::from_secs(8));
    // Another client is served, within a bound far below the 120 s `run` would wait.
    let (tx, rx) = std::sync::mpsc::channel();
    let socket = d.socket.clone();
    std::thread::spawn(move || {
        let conn = client::connect(Some(&socket), "llmd").expect("client connects");
        let _ = tx.send(run_ids(&session(&conn), &greedy("The capital of France is", 4)));
    });
    let served = rx.recv_timeout(Duration::from_secs(20));
    signal("-CONT");
    assert_eq!(served.expect("served while another client is frozen"), golden_capital_ids(4));
    // The frozen request is still there, and completes once its client reads again.
    let out = frozen.wait_with_output().expect("llmctl ends");
    assert!(out.status.success(), "the thawed client's request failed");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(", 300,"),
        "the thawed client got its whole reply: {}",
        &text[text.len().saturating_sub(200)..]
    );
}

#[test]
fn the_load_benchmark_accounts_for_every_request() {
    let d = Daemon::start("[limits]\nmax_requests_per_uid = 8\nmax_sessions_per_uid = 8\n");
    let o = Command::new(env!("CARGO_BIN_EXE_llmctl"))
        .args(["--socket", d.socket.to_str().expect("path"), "bench", "--load", "--json"])
        .args([
            "--clients",
            "3",
            "--foreground",
            "1",
            "--duration-s",
            "2",
            "--idle-requests",
            "2",
            "--decode-tokens",
            "8",
            "--decode-rounds",
            "2",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("llmctl runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    for key in ["fg_p99_ttft_ratio", "batch_decode_gain", "idle_ttft_ms_p99", "single_decode_tok_s"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {v}");
    }
    assert_eq!(
        (v["lost"].as_u64(), v["duplicated"].as_u64(), v["bg_failed"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{v}"
    );
    assert!(v["bg_requests"].as_u64().is_some_and(|n| n >= 1), "{v}");
    // The slowest foreground prompt, split with the daemon's own figures: its queue wait is
    // part of its time to first token, which the client sees no sooner than the daemon.
    for key in ["fg_alone_slowest_ms", "fg_slowest_ms"] {
        let s = &v[key];
        let (client, wait, ttft) =
            (s["client_ttft"].as_f64(), s["server_queue_wait"].as_i64(), s["server_ttft"].as_i64());
        let (Some(client), Some(wait), Some(ttft)) = (client, wait, ttft) else { panic!("{key} in {v}") };
        assert!(0 <= wait && wait <= ttft && ttft as f64 <= client + 1.0, "{key}: {s}");
    }
}

/// A soak this short is mostly warm-up (the first long prompts, sessions' KV caches, allocator
/// arenas), so its RSS drift says nothing; the 30-minute soak (`docs/RELIABILITY.md`) checks it
/// with the default 5%.
const SHORT_SOAK_RSS_DRIFT_PCT: &str = "1000";

#[test]
fn a_short_soak_answers_every_request_exactly_once_and_lets_go_of_everything() {
    let d = Daemon::start("[limits]\nmax_requests_per_uid = 16\nmax_sessions_per_uid = 24\n");
    let o = Command::new(env!("CARGO_BIN_EXE_llmctl"))
        .args(["--socket", d.socket.to_str().expect("path"), "bench", "--json", "--clients", "4"])
        .args(["--soak", "0.5", "--max-rss-drift", SHORT_SOAK_RSS_DRIFT_PCT])
        .stdin(Stdio::null())
        .output()
        .expect("llmctl runs");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("one JSON object ({e}); stderr: {}", String::from_utf8_lossy(&o.stderr)));
    assert!(o.status.success() && v["passed"] == true, "{v}");
    assert_eq!((v["lost"].as_u64(), v["duplicated"].as_u64(), v["crashed"].as_bool()), (Some(0), Some(0), Some(false)));
    // Every kind of step happened, and the answers were the ones each asks for.
    for action in ["short", "chat", "long", "cancel", "invalid", "churn", "reconnect", "kill"] {
        assert!(v["actions"][action].as_u64().is_some_and(|n| n > 0), "no {action} step: {v}");
    }
    let codes = v["by_code"].as_object().expect("answers by code");
    assert!(codes.keys().all(|c| ["OK", "CANCELLED", "INVALID_ARGUMENT"].contains(&c.as_str())), "{codes:?}");
    assert_eq!(codes.get("INVALID_ARGUMENT").and_then(|n| n.as_u64()), v["actions"]["invalid"].as_u64());
    assert_eq!(v["unexpected"].as_u64(), Some(0), "{v}");
    assert!(v["killed_mid_stream"].as_u64().is_some_and(|n| n > 0), "{v}");
    // Everything the clients held is let go: sessions and descriptors back to the start.
    assert_eq!(v["sessions_after"], v["sessions_before"], "{v}");
    assert!(v["fds_after"].as_u64() <= v["fds_before"].as_u64(), "{v}");
}

#[test]
fn status_models_and_run_into_a_closed_pipe_end_quietly_as_sigpipe_would() {
    // `llmctl status | head -1`: the reader goes away before llmctl writes.
    let d = Daemon::start("");
    let sock = d.socket.to_str().expect("path").to_owned();
    for args in [vec!["status"], vec!["models"], vec!["dump"], vec!["run", "--max-tokens", "32", "Count to ten."]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_llmctl"))
            .args(["--socket", &sock])
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("llmctl starts");
        drop(child.stdout.take());
        let o = child.wait_with_output().expect("llmctl ends");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!e.contains("panicked"), "{args:?}: llmctl panicked on a broken pipe: {e}");
        assert_eq!(o.status.code(), Some(llmctl::output::BROKEN_PIPE_STATUS), "{args:?}: {:?} {e}", o.status);
    }
}

#[test]
fn an_app_sees_only_its_own_sessions_in_status() {
    // The socket open to every uid (the daemon decides per call); root's two sessions.
    let d = Daemon::start("socket_mode = \"0666\"\n[permissions]\nallowed_uids = [65534]\n");
    let conn = d.connect();
    let (_a, _b) = (session(&conn), session(&conn));
    let status_as = |who: Option<&str>| {
        let mut c = match who {
            Some(uid) => {
                let mut c = Command::new("setpriv");
                c.args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups"]);
                c.arg(env!("CARGO_BIN_EXE_llmctl"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_llmctl")),
        };
        let o = c.args(["--socket", d.socket.to_str().expect("path"), "status"]).output().expect("llmctl runs");
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{who:?}: {out} {}", String::from_utf8_lossy(&o.stderr));
        out
    };
    // root is llmd's own uid (an admin): it sees both.
    assert!(status_as(None).contains("sessions_open 2"), "{}", status_as(None));
    // Another app (uid 65534) sees none of them, nor their memory.
    let other = status_as(Some("65534"));
    assert!(other.contains("sessions_open 0") && other.contains("kv_cache_bytes 0"), "{other}");
}

#[test]
fn status_says_why_the_npu_is_not_used_and_the_daemon_serves_on_the_cpu() {
    let missing = std::env::temp_dir().join(format!("llmd-no-qnn-{}/libQnnHtp.so", std::process::id()));
    let d = Daemon::start(&format!("backend = \"npu\"\n[npu]\nlibrary = {:?}\n", missing.display().to_string()));
    let out = Command::new(env!("CARGO_BIN_EXE_llmctl"))
        .args(["--socket", d.socket.to_str().expect("path"), "status"])
        .output()
        .expect("llmctl status runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let npu = text.lines().skip_while(|l| *l != "NPU").take(2).collect::<Vec<_>>().join("\n");
    assert!(
        npu.contains("state unavailable: prompts run on the CPU")
            && npu.contains(&missing.display().to_string())
            && npu.contains("did not load")
            && npu.contains("No such file"),
        "llmctl status names the NPU's state and why:\n{text}"
    );
    let conn = d.connect();
    assert_eq!(run_ids(&session(&conn), &greedy("The capital of France is", 4)), golden_capital_ids(4));
}

#[test]
fn status_says_why_the_gpu_is_not_used_and_the_daemon_serves_on_the_cpu() {
    let d = Daemon::start("backend = \"gpu\"\n[gpu]\nlibrary = \"/nonexistent/libOpenCL.so\"\n");
    let t = std::time::Instant::now();
    let text = loop {
        let out = Command::new(env!("CARGO_BIN_EXE_llmctl"))
            .args(["--socket", d.socket.to_str().expect("path"), "status"])
            .output()
            .expect("llmctl status runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        // The GPU thread gives up on the library at once; allow it a moment to say so.
        if text.contains("state unavailable") || t.elapsed() > std::time::Duration::from_secs(30) {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let gpu = text.lines().skip_while(|l| *l != "GPU").take(2).collect::<Vec<_>>().join("\n");
    assert!(
        gpu.contains("state unavailable: decode runs on the CPU")
            && gpu.contains("cannot load the OpenCL library /nonexistent/libOpenCL.so"),
        "llmctl status names the GPU's state and why:\n{text}"
    );
    let conn = d.connect();
    assert_eq!(run_ids(&session(&conn), &greedy("The capital of France is", 4)), golden_capital_ids(4));
}

#[test]
fn dump_json_lists_a_requests_jobs_per_processor_and_the_timeline_draws_them() {
    // The NPU path over llmd's emulator (as cargo built it for these tests), chunks of 32
    // rows: a prompt of ~100 tokens is several NPU prefill jobs, then decode on the CPU.
    let emulator = llmd_qnn_emu::built_library().unwrap_or_else(|e| panic!("{e}"));
    let d = Daemon::start(&format!(
        "backend = \"npu\"\n[npu]\nlibrary = {:?}\nchunk = 32\nooe_chunks = 1\n",
        emulator.display().to_string()
    ));
    let conn = d.connect();
    let socket = d.socket.to_str().expect("path").to_owned();
    let llmctl = |args: &[&str]| {
        let out =
            Command::new(env!("CARGO_BIN_EXE_llmctl")).arg("--socket").arg(&socket).args(args).output().expect("runs");
        assert!(out.status.success(), "llmctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let t = Instant::now();
    while !llmctl(&["status"]).contains(" ready:") {
        assert!(t.elapsed() < Duration::from_secs(180), "the NPU never got ready:\n{}", llmctl(&["status"]));
        std::thread::sleep(Duration::from_millis(200));
    }
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(7);
    let ids = run_ids(&session(&conn), &greedy(&prompt, 4));
    assert_eq!(ids.len(), 4);
    let doc: serde_json::Value = serde_json::from_str(&llmctl(&["dump", "--json"])).expect("dump --json is JSON");
    assert!(doc["sections"]["DEVICES"].is_array(), "{doc}");
    let config = doc["sections"]["CONFIG"].as_array().expect("the config's lines");
    assert!(config.iter().any(|l| l.as_str().is_some_and(|l| l.starts_with("backend = "))), "{doc}");
    assert!(doc["sections"].get("[npu]").is_none(), "the config's TOML is not taken for sections: {doc}");
    let jobs = doc["jobs"].as_array().expect("jobs");
    let request = jobs.iter().find(|j| j["kind"] == "prefill").expect("a prefill job")["request"].as_u64().expect("id");
    let mine: Vec<&serde_json::Value> = jobs.iter().filter(|j| j["request"] == request).collect();
    let of = |p: &str, k: &str| mine.iter().filter(|j| j["processor"] == p && j["kind"] == k).count();
    assert!(of("npu", "prefill") >= 3, "the prompt ran as NPU chunks: {mine:?}");
    assert_eq!(of("cpu", "decode"), 3, "three decode steps after the first token, on the CPU: {mine:?}");
    let chunks: Vec<u64> =
        mine.iter().filter(|j| j["kind"] == "prefill").map(|j| j["chunk"].as_u64().expect("chunk")).collect();
    assert_eq!(chunks, (0..chunks.len() as u64).collect::<Vec<_>>(), "chunks in order, one job each");
    for j in &mine {
        assert!(j["start_ms"].as_u64() <= j["end_ms"].as_u64() && j["ok"] == true, "{j}");
        for k in ["request", "processor", "kind", "chunk", "start_ms", "end_ms"] {
            assert!(j.get(k).is_some(), "{k} in {j}");
        }
    }
    let only: serde_json::Value =
        serde_json::from_str(&llmctl(&["dump", "--json", "--request", &request.to_string()])).expect("JSON");
    let only = only["jobs"].as_array().expect("jobs");
    assert!(!only.is_empty() && only.iter().all(|j| j["request"] == request), "--request filters: {only:?}");
    // The timeline of that request: one lane per processor, a bar per job, in time order.
    let svg_file = d.dir.join("timeline.svg");
    llmctl(&["dump", "--timeline", svg_file.to_str().expect("path"), "--request", &request.to_string()]);
    let svg = std::fs::read_to_string(&svg_file).expect("the timeline was written");
    let lanes: Vec<&str> = svg
        .match_indices("class=\"lane\" data-lane=\"")
        .map(|(i, m)| svg[i + m.len()..].split('"').next().unwrap_or(""))
        .collect();
    assert_eq!(lanes, ["npu", "gpu", "cpu"], "one lane per processor");
    let starts: Vec<f64> = svg
        .match_indices("data-start-ms=\"")
        .map(|(i, m)| svg[i + m.len()..].split('"').next().unwrap_or("").parse().expect("a number"))
        .collect();
    assert_eq!(starts.len(), mine.len(), "a bar per job");
    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "bars in time order: {starts:?}");
    assert!(svg.contains("class=\"handoff\""), "the hand-off from the NPU to the CPU is drawn");
}
