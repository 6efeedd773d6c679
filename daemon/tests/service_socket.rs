//! Tier 3: the llmd daemon and its clients over Binder-over-Unix-socket, with the real model.
//! Each test starts its own daemon (its own socket and limits) and stops it at the end.

mod common;

use common::client::{self, Connection, Event};
use common::{chat, greedy, model};
use llmd_aidl::ErrorCode::ErrorCode;
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::ILlmSession::ILlmSession;
use llmd_aidl::SessionOptions::SessionOptions;
use llmd_daemon::error::error_code_of;
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
        Self::start_after(config, None)
    }

    /// [`Self::start`], with the process's umask set first (`Some("000")`).
    fn start_with_umask(config: &str, umask: Option<&str>) -> Self {
        Self::start_after(config, umask.map(|m| format!("umask {m}")).as_deref())
    }

    /// [`Self::start`], after a shell command that sets up the process (`"ulimit -n 128"`).
    /// llmd logs at `warn` (`TEST_LLMD_LOG` sets its `LLMD_LOG`) to `llmd.log` in its folder,
    /// shown when the test fails.
    fn start_after(config: &str, setup: Option<&str>) -> Self {
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir =
            std::env::temp_dir().join(format!("llmd-e2e-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("llmd.sock");
        let cfg = dir.join("llmd.toml");
        std::fs::write(&cfg, config).expect("config written");
        let mut cmd = match setup {
            Some(m) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("{m} && exec \"$@\""), "sh", env!("CARGO_BIN_EXE_llmd")]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_llmd")),
        };
        let child = cmd
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
            .env_remove("LLMD_OPENCL_LIB")
            .env("LLMD_LOG", std::env::var("TEST_LLMD_LOG").unwrap_or("warn".into()))
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(dir.join("llmd.log")).expect("log file"))
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
        client::connect(&self.socket, "llmd").expect("client connects")
    }
}

impl Daemon {
    /// What llmd wrote to its standard error so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("llmd.log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- llmd's log ---\n{}--- end of llmd's log ---", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one request produced.
#[derive(Debug, Default)]
struct Outcome {
    text: String,
    ids: Vec<i32>,
    error: Option<(ErrorCode, String)>,
    finish: String,
    /// `onTokens` callbacks received.
    token_callbacks: usize,
}

/// Sends a request and collects everything it streams until it ends.
fn run(session: &Strong<dyn ILlmSession>, req: &GenerateRequest) -> Outcome {
    let (cb, _tx, rx) = client::callback();
    let mut o = Outcome::default();
    if let Err(status) = session.generate(req, &cb) {
        o.error = Some((error_code_of(&status).unwrap_or(ErrorCode::INTERNAL), client::describe(&status)));
        return o;
    }
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("the request ends") {
            Event::Tokens(t, ids) => {
                o.text.push_str(&t);
                o.ids.extend(ids);
                o.token_callbacks += 1;
            }
            Event::Completed(s) => {
                o.finish = s.finishReason;
                return o;
            }
            Event::Error(code, m) => {
                o.error = Some((ErrorCode(code), m));
                return o;
            }
            _ => {}
        }
    }
}

fn session(conn: &Connection) -> Strong<dyn ILlmSession> {
    conn.service.openSession(MODEL_ID, &SessionOptions::default()).expect("session opens")
}

fn code_of<T: std::fmt::Debug>(r: Result<T, rsbinder::Status>) -> ErrorCode {
    error_code_of(&r.expect_err("the call fails")).expect("a service-specific error")
}

fn golden_capital_ids(n: usize) -> Vec<i32> {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden/smollm2.json")).expect("golden"),
    )
    .expect("JSON");
    let p = g["prompts"].as_array().expect("prompts").iter().find(|p| p["name"] == "capital").expect("capital");
    p["greedy_ids"].as_array().expect("ids").iter().take(n).map(|x| x.as_i64().expect("id") as i32).collect()
}

#[test]
fn four_clients_streaming_at_once_each_get_their_solo_greedy_tokens() {
    let d = Daemon::start("");
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
        "The three primary colors are",
    ];
    let solo: Vec<Vec<i32>> = prompts
        .iter()
        .map(|p| {
            let conn = d.connect();
            run(&session(&conn), &greedy(p, 16)).ids
        })
        .collect();
    assert_eq!(solo[0], golden_capital_ids(16), "the daemon's greedy tokens differ from llama.cpp's golden ones");
    let socket = d.socket.clone();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (socket, p) = (socket.clone(), p.to_string());
            std::thread::spawn(move || {
                let conn = client::connect(&socket, "llmd").expect("connects");
                let o = run(&session(&conn), &greedy(&p, 16));
                assert!(o.error.is_none(), "{o:?}");
                o.ids
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().expect("client thread"), solo[i], "client {i} got other tokens when running concurrently");
    }
}

/// After a cancel: the request's ending error code, and how many tokens arrived before it.
fn until_the_end(rx: &std::sync::mpsc::Receiver<Event>) -> (ErrorCode, usize) {
    let mut after = 0;
    loop {
        match rx.recv_timeout(Duration::from_secs(30)).expect("the request ends") {
            Event::Tokens(_, ids) => after += ids.len(),
            Event::Error(code, _) => return (ErrorCode(code), after),
            Event::Completed(s) => panic!("completed ({}) despite the cancel", s.finishReason),
            _ => {}
        }
    }
}

#[test]
fn cancel_stops_within_one_step_and_returns_kv_memory() {
    let d = Daemon::start("");
    let conn = d.connect();
    let s = session(&conn);
    let baseline = conn.service.getStatus().expect("status").kvCacheBytes;
    let (cb, _tx, rx) = client::callback();
    let id = s.generate(&greedy("The capital of France is", 400), &cb).expect("queued");
    let mut tokens = 0;
    while tokens < 5 {
        match rx.recv_timeout(Duration::from_secs(60)).expect("tokens stream") {
            Event::Tokens(_, ids) => tokens += ids.len(),
            Event::Error(c, m) => panic!("request failed: {c} {m}"),
            Event::Completed(s) => panic!("request ended early: {}", s.finishReason),
            _ => {}
        }
    }
    s.cancel(id).expect("cancel accepted");
    let (end, after) = until_the_end(&rx);
    assert_eq!(end, ErrorCode::CANCELLED);
    // At most the unit the worker was running when the cancel landed, plus one oneway
    // callback already on its way (sent before the cancel, delivered after it returned).
    assert!(after <= 2, "{after} tokens arrived after cancel returned (more than one decode step)");
    let status = conn.service.getStatus().expect("status");
    assert_eq!(status.kvCacheBytes, baseline, "the cancelled turn's KV memory was not returned");
    assert_eq!(status.requestsRunning + status.requestsQueued, 0);
    assert!(
        conn.admin().expect("admin").dumpState().expect("dump").contains("kv_tokens 0 kv_bytes 0"),
        "dump shows KV left behind"
    );
    // The session still works after a cancel.
    assert_eq!(run(&s, &greedy("The capital of France is", 4)).ids, golden_capital_ids(4));
}

/// Tokens the pacing holds when a cancel lands are dropped, not sent after `cancel` returned:
/// the turn is rolled back, and the client asked to stop. With a 60 s interval every token
/// after the first is held, so a cancel that flushed them would send them all late (at the
/// default 16 ms a fast CI machine holds ~3).
#[test]
fn a_cancel_drops_the_tokens_the_pacing_held() {
    let d = Daemon::start("[scheduler]\nstream_interval_ms = 60000\n");
    let conn = d.connect();
    let s = session(&conn);
    let (cb, _tx, rx) = client::callback();
    // Far more tokens than the 150 ms below can decode on any machine, so the cancel always
    // lands mid-request.
    let id = s.generate(&greedy("1, 2, 3, 4, 5, 6, 7, 8,", 2000), &cb).expect("queued");
    while !matches!(rx.recv_timeout(Duration::from_secs(60)).expect("the first tokens"), Event::Tokens(..)) {}
    // Decoding goes on while every new token is held.
    std::thread::sleep(Duration::from_millis(150));
    s.cancel(id).expect("cancel accepted");
    let (end, after) = until_the_end(&rx);
    assert_eq!(end, ErrorCode::CANCELLED);
    assert_eq!(after, 0, "{after} held tokens were sent after the cancel");
    assert_eq!(
        conn.service.getStatus().expect("status").kvCacheBytes,
        0,
        "the cancelled turn's KV memory was not returned"
    );
}

/// `onTokens` pacing (`scheduler.stream_interval_ms`): the first tokens go out at once, later
/// ones are held and sent together, whatever is held arrives before `onCompleted`, and no token
/// or byte of text is lost or reordered. With the interval at 0, one callback per token.
#[test]
fn paced_token_callbacks_lose_nothing_and_the_first_is_not_held() {
    let req = greedy("The capital of France is", 32);
    let every = {
        let d = Daemon::start("[scheduler]\nstream_interval_ms = 0\n");
        run(&session(&d.connect()), &req)
    };
    assert_eq!(every.ids, golden_capital_ids(32), "the daemon's greedy tokens differ from llama.cpp's golden ones");
    assert_eq!(every.token_callbacks, every.ids.len(), "interval 0: one onTokens per token");
    // An interval far longer than the request: the first callback, then everything else in one.
    let d = Daemon::start("[scheduler]\nstream_interval_ms = 600000\n");
    let conn = d.connect();
    let (cb, _tx, rx) = client::callback();
    let s = session(&conn);
    s.generate(&req, &cb).expect("submitted");
    let mut events = Vec::new();
    loop {
        let e = rx.recv_timeout(Duration::from_secs(120)).expect("the request ends");
        let end = matches!(e, Event::Completed(_) | Event::Error(..));
        events.push(e);
        if end {
            break;
        }
    }
    let tokens: Vec<(String, Vec<i32>)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Tokens(t, ids) => Some((t.clone(), ids.clone())),
            _ => None,
        })
        .collect();
    assert!(matches!(events.last(), Some(Event::Completed(_))), "{:?}", events.last());
    assert_eq!(tokens.len(), 2, "the first tokens at once, the rest held until the end");
    assert_eq!(tokens[0].1.len(), 1, "the first token is sent alone, not held");
    let ids: Vec<i32> = tokens.iter().flat_map(|(_, i)| i.clone()).collect();
    let text: String = tokens.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(ids, every.ids);
    assert_eq!(text, every.text);
    // The default paces at a frame (16 ms): the same stream (how many callbacks depends on the
    // machine's speed: a pass slower than 16 ms sends every token).
    drop(d);
    let d = Daemon::start("");
    let paced = run(&session(&d.connect()), &req);
    assert_eq!((paced.ids, paced.text), (every.ids, every.text));
    assert!(paced.token_callbacks >= 2, "{}", paced.token_callbacks);
}

#[test]
fn a_two_turn_session_keeps_its_context() {
    let d = Daemon::start("");
    let conn = d.connect();
    let s = session(&conn);
    let first = run(&s, &chat("My name is Ada and I live in Paris.", 24));
    assert!(first.error.is_none(), "{first:?}");
    let second = run(&s, &chat("Where do I live?", 24));
    assert!(second.error.is_none(), "{second:?}");
    // The same conversation computed from scratch in-process gives the same second answer...
    let m = llmd_engine::Model::load(&model(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
        .expect("model");
    let conv = vec![
        llmd_engine::chat::ChatMessage::new("user", "My name is Ada and I live in Paris."),
        llmd_engine::chat::ChatMessage::new("assistant", &first.text),
        llmd_engine::chat::ChatMessage::new("user", "Where do I live?"),
    ];
    let req = llmd_engine::generate::GenerateRequest {
        prompt: llmd_engine::generate::Prompt::Chat(conv),
        sampling: llmd_engine::sampling::SamplingParams::greedy(),
        max_tokens: 24,
        stop: vec![],
    };
    let mut ids = Vec::new();
    m.generate(&req, |_, i| {
        ids.extend(i.iter().map(|&t| t as i32));
        llmd_engine::generate::Flow::Continue
    })
    .expect("local generation");
    assert_eq!(second.ids, ids, "turn two differs from the whole conversation run at once");
    // ...and a fresh session asked only the second question answers differently.
    let fresh = run(&session(&conn), &chat("Where do I live?", 24));
    assert_ne!(fresh.ids, second.ids, "turn two did not depend on turn one");
    // Raw-text turns continue the context too.
    // Raw-text turns continue the context too: turn two equals one run over the first prompt,
    // the first reply's tokens and the second prompt.
    let s2 = session(&conn);
    let a = run(&s2, &greedy("The capital of France is", 3));
    let b = run(&s2, &greedy(" The capital of Italy is", 3));
    let mut context = m.tokenizer.encode("The capital of France is", false, m.tokenizer.add_bos).expect("encode");
    context.extend(a.ids.iter().map(|&t| t as u32));
    context.extend(m.tokenizer.encode(" The capital of Italy is", false, false).expect("encode"));
    let mut kv = m.transformer.new_kv();
    let raw = llmd_engine::generate::GenerateRequest {
        prompt: llmd_engine::generate::Prompt::Text(String::new()),
        sampling: llmd_engine::sampling::SamplingParams::greedy(),
        max_tokens: 3,
        stop: vec![],
    };
    let mut whole = Vec::new();
    m.generate_in(&mut kv, &context, &raw, |_, i| {
        whole.extend(i.iter().map(|&t| t as i32));
        llmd_engine::generate::Flow::Continue
    })
    .expect("local generation");
    assert_eq!(b.ids, whole);
}

#[test]
fn over_limit_requests_get_their_error_code_while_others_are_served() {
    let d = Daemon::start(
        "[limits]\nmax_sessions_per_uid = 2\nmax_requests_per_uid = 1\nmax_new_tokens = 64\nmax_prompt_tokens = 32\n",
    );
    let conn = d.connect();
    let a = session(&conn);
    let b = session(&conn);
    assert_eq!(code_of(conn.service.openSession(MODEL_ID, &SessionOptions::default())), ErrorCode::QUOTA_EXCEEDED);
    let (cb, _tx, rx) = client::callback();
    a.generate(&greedy("The capital of France is", 48), &cb).expect("first request queued");
    let (cb2, _tx2, _rx2) = client::callback();
    assert_eq!(
        code_of(b.generate(&greedy("Hello", 8), &cb2)),
        ErrorCode::QUOTA_EXCEEDED,
        "a second request in flight for the uid"
    );
    assert_eq!(code_of(a.generate(&greedy("Hello", 8), &cb2)), ErrorCode::BUSY, "a second request on a busy session");
    // The first request is unaffected.
    let mut ids = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).expect("events") {
            Event::Tokens(_, i) => ids.extend(i),
            Event::Completed(_) => break,
            Event::Error(c, m) => panic!("first request failed: {c} {m}"),
            _ => {}
        }
    }
    assert_eq!(ids[..32], golden_capital_ids(32)[..], "the first request's tokens changed under the refused ones");
    assert_eq!(code_of(b.generate(&greedy("Hello", 65), &cb2)), ErrorCode::REQUEST_TOO_LARGE);
    let long = "word ".repeat(100);
    let o = run(&b, &greedy(&long, 8));
    assert_eq!(o.error.map(|e| e.0), Some(ErrorCode::REQUEST_TOO_LARGE), "a prompt over max_prompt_tokens");
    assert!(run(&b, &greedy("Hello", 4)).error.is_none(), "the daemon keeps serving");
}

#[test]
fn a_full_daemon_answers_busy_with_a_retry_hint_and_admits_once_a_request_ends() {
    // The daemon-wide limit: with its one request in flight, a request of another session is
    // refused BUSY with a retry hint, and admitted once the first ends.
    let d = Daemon::start("[limits]\nmax_requests = 1\nmax_requests_per_uid = 4\n");
    let conn = d.connect();
    let (a, b) = (session(&conn), session(&conn));
    let (cb, _tx, rx) = client::callback();
    a.generate(&greedy("The capital of France is", 48), &cb).expect("first request queued");
    let refused = b.generate(&greedy("Hello", 8), &client::callback().0).expect_err("the daemon is full");
    assert_eq!(error_code_of(&refused), Some(ErrorCode::BUSY), "{refused:?}");
    let why = client::describe(&refused);
    assert!(why.contains("retry in"), "BUSY says when to retry: {why}");
    while !matches!(rx.recv_timeout(Duration::from_secs(60)).expect("events"), Event::Completed(_) | Event::Error(..)) {
    }
    // The first request's books close just after its last callback is queued.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let o = loop {
        let o = run(&b, &greedy("Hello", 4));
        match &o.error {
            Some((code, _)) if *code == ErrorCode::BUSY && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            _ => break o,
        }
    };
    assert!(o.error.is_none(), "admitted once the daemon has room: {o:?}");
}

#[test]
fn malformed_requests_get_clear_errors() {
    let d = Daemon::start("");
    let conn = d.connect();
    let s = session(&conn);
    let (cb, _tx, _rx) = client::callback();
    let err = |r: GenerateRequest| code_of(s.generate(&r, &cb));
    assert_eq!(err(greedy("", 8)), ErrorCode::INVALID_ARGUMENT, "empty prompt");
    assert_eq!(
        code_of(conn.service.openSession("no-such-model", &SessionOptions::default())),
        ErrorCode::MODEL_NOT_FOUND
    );
    assert_eq!(code_of(conn.service.getModelInfo("")), ErrorCode::INVALID_ARGUMENT);
    assert_eq!(
        err(GenerateRequest { temperature: -1.0, ..greedy("hi", 8) }),
        ErrorCode::INVALID_ARGUMENT,
        "negative temperature"
    );
    assert_eq!(
        err(GenerateRequest { temperature: f32::NAN, ..greedy("hi", 8) }),
        ErrorCode::INVALID_ARGUMENT,
        "NaN temperature"
    );
    assert_eq!(
        err(GenerateRequest { topP: 0.0, temperature: 0.7, ..greedy("hi", 8) }),
        ErrorCode::INVALID_ARGUMENT,
        "topP 0"
    );
    assert_eq!(err(GenerateRequest { topK: -3, ..greedy("hi", 8) }), ErrorCode::INVALID_ARGUMENT, "negative topK");
    assert_eq!(err(greedy("hi", i32::MAX)), ErrorCode::REQUEST_TOO_LARGE, "absurd max tokens");
    assert_eq!(err(greedy("hi", 0)), ErrorCode::INVALID_ARGUMENT, "zero max tokens");
    assert_eq!(
        err(GenerateRequest { messages: chat("x", 4).messages, ..greedy("hi", 4) }),
        ErrorCode::INVALID_ARGUMENT,
        "prompt and messages"
    );
    let bad_role = GenerateRequest {
        messages: vec![llmd_aidl::ChatMessage::ChatMessage { role: "root".into(), content: "x".into() }],
        ..greedy("", 4)
    };
    assert_eq!(err(bad_role), ErrorCode::INVALID_ARGUMENT, "unknown role");
    assert_eq!(
        err(GenerateRequest { stop: vec![String::new()], ..greedy("hi", 4) }).0,
        ErrorCode::INVALID_ARGUMENT.0,
        "empty stop sequence"
    );
    assert_eq!(
        code_of(conn.service.openSession(MODEL_ID, &SessionOptions { contextTokens: -1 })),
        ErrorCode::INVALID_ARGUMENT
    );
    // Invalid text on the wire (an unpaired UTF-16 surrogate where a string belongs) is refused
    // by the parcel layer before it reaches the service; the daemon keeps serving.
    let binder = conn.service.as_binder();
    let remote = binder.as_remote().expect("a remote binder");
    let mut data = remote.prepare_transact(true).expect("parcel");
    data.write(&1i32).expect("length");
    data.write(&0xD800i32).expect("lone surrogate + terminator");
    let get_model_info = rsbinder::FIRST_CALL_TRANSACTION + 1;
    let reply = remote.submit_transact(get_model_info, &data, rsbinder::FLAG_CLEAR_BUF);
    let refused = match reply {
        Err(_) => true,
        Ok(Some(mut r)) => !r.read::<rsbinder::Status>().expect("status").is_ok(),
        Ok(None) => false,
    };
    assert!(refused, "a string with invalid UTF-16 was accepted");
    assert!(run(&s, &greedy("The capital of France is", 2)).error.is_none(), "the daemon keeps serving");
}

#[test]
fn a_request_past_its_deadline_ends_with_deadline_exceeded_and_rolls_back() {
    let d = Daemon::start("");
    let conn = d.connect();
    let s = session(&conn);
    // 1 ms cannot cover a 300-token prompt: the deadline passes at the first pass boundary.
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let o = run(&s, &GenerateRequest { deadlineMs: 1, ..greedy(&long, 8) });
    assert_eq!(o.error.as_ref().map(|e| e.0), Some(ErrorCode::DEADLINE_EXCEEDED), "{o:?}");
    assert_eq!(
        code_of(s.generate(&GenerateRequest { deadlineMs: -1, ..greedy("Hi", 4) }, &client::callback().0)),
        ErrorCode::INVALID_ARGUMENT
    );
    // The session was rolled back and still works; a generous deadline is met.
    let o = run(&s, &GenerateRequest { deadlineMs: 60_000, ..greedy("The capital of France is", 8) });
    assert!(o.error.is_none(), "{o:?}");
    assert_eq!(o.ids, golden_capital_ids(8), "the expired turn left nothing in the session");
}

#[test]
fn a_uid_over_its_token_quota_is_refused_with_a_retry_time() {
    let d = Daemon::start("[scheduler]\nquota_tokens_per_uid = 40\nquota_window_s = 3600\n");
    let conn = d.connect();
    let s = session(&conn);
    // 6 prompt tokens + 32 generated = 38 of 40: admitted.
    let o = run(&s, &greedy("The capital of France is", 32));
    assert!(o.error.is_none(), "{o:?}");
    let o = run(&s, &greedy("Hello", 4));
    assert!(o.error.is_none(), "still under the quota at submission: {o:?}");
    let o = run(&s, &greedy("Hello", 4));
    let (code, msg) = o.error.expect("over the quota");
    assert_eq!(code, ErrorCode::QUOTA_EXCEEDED);
    assert!(msg.contains("retry in"), "the error says when to retry: {msg}");
}

#[test]
fn priorities_are_validated_and_capped_and_dump_shows_the_queue() {
    let d = Daemon::start("[scheduler]\ndefault_class_cap = \"background\"\n");
    let conn = d.connect();
    let s = session(&conn);
    let (cb, _tx, _rx) = client::callback();
    let bad = GenerateRequest { priority: llmd_aidl::Priority::Priority(7), ..greedy("Hi", 4) };
    assert_eq!(code_of(s.generate(&bad, &cb)), ErrorCode::INVALID_ARGUMENT);
    // A foreground hint from a uid capped at background runs as background.
    let (cb, _tx, rx) = client::callback();
    s.generate(&greedy(&"word ".repeat(400), 16), &cb).expect("queued");
    // Polled while the request is in flight: a fixed sleep can outlast the whole request on a
    // fast machine (416 tokens done in under 300 ms).
    let admin = conn.admin().expect("admin");
    let mut seen = None;
    let stats = loop {
        if seen.is_none() {
            let dump = admin.dumpState().expect("dump");
            if dump.contains("class background") {
                seen = Some(dump);
            }
        }
        match rx.recv_timeout(Duration::from_millis(if seen.is_none() { 1 } else { 120_000 })) {
            Ok(Event::Completed(s)) => break s,
            Ok(Event::Error(c, m)) => panic!("{c} {m}"),
            Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("events: {e}"),
        }
    };
    let dump = seen.expect("the dump never showed the request as background while it ran");
    assert!(dump.contains("SCHEDULER") && dump.contains("vtime"), "{dump}");
    assert!(stats.queueWaitMs >= 0 && stats.timeToFirstTokenMs >= stats.queueWaitMs, "{stats:?}");
}

#[test]
fn the_socket_has_its_configured_mode_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |d: &Daemon| std::fs::metadata(&d.socket).expect("socket").permissions().mode() & 0o777;
    {
        let d = Daemon::start_with_umask("", Some("000"));
        assert_eq!(mode(&d), 0o660, "default socket_mode under umask 000");
        drop(d.connect());
    }
    let d = Daemon::start_with_umask("socket_mode = \"0600\"\n", Some("077"));
    assert_eq!(mode(&d), 0o600);
}

#[test]
fn sigterm_drains_live_requests_with_a_final_error_and_exits_zero() {
    let mut d = Daemon::start("shutdown_grace_ms = 300\n");
    let conn = d.connect();
    let s = session(&conn);
    let (cb, _tx, rx) = client::callback();
    // Long enough not to end within the grace (greedy counting does not stop early).
    let req = greedy("1, 2, 3, 4, 5, 6, 7, 8,", 3000);
    s.generate(&req, &cb).expect("generate");
    // Running: its first tokens arrived.
    loop {
        if let Event::Tokens(..) = rx.recv_timeout(Duration::from_secs(30)).expect("tokens") {
            break;
        }
    }
    let ok = Command::new("kill").args(["-TERM", &d.child.id().to_string()]).status().expect("kill").success();
    assert!(ok);
    // The client gets its one final callback: CANCELLED after the grace.
    let (code, _) = until_the_end(&rx);
    assert_eq!(code, ErrorCode::CANCELLED);
    // The daemon exits 0 and removes its socket.
    let status = common::exit_status_within(&mut d.child, Duration::from_secs(20));
    assert!(status.success(), "llmd exited with {status:?}");
    assert!(!d.socket.exists(), "the socket was left behind");
}

/// Runs this test binary's [`helper_clients_as_another_uid`] as `uid` (through setpriv), with
/// the socket and `env` in its environment; its output is piped, and it lives until its
/// standard input closes (or it is killed: on drop).
struct Helper(Child);

impl Helper {
    fn start(uid: u32, socket: &std::path::Path, env: &[(&str, &str)]) -> Self {
        let exe = std::env::current_exe().expect("the test binary");
        let mut c = Command::new("setpriv");
        c.args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups"])
            .arg(exe)
            .args(["--ignored", "--exact", "helper_clients_as_another_uid", "--nocapture", "--test-threads", "1"])
            .env("LLMD_HELPER_SOCKET", socket)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        Helper(c.spawn().expect("setpriv runs the helper"))
    }

    /// The helper's report lines (`HELPER ...`), until it prints one starting with `last`, or
    /// `within` has passed (then what it printed so far).
    fn report(&mut self, last: &str, within: Duration) -> Vec<String> {
        use std::io::BufRead;
        let out = self.0.stdout.take().expect("stdout piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                // libtest may have begun the line ("test helper_... ... ").
                if let Some((_, l)) = line.split_once("HELPER ") {
                    if tx.send(l.to_owned()).is_err() {
                        return;
                    }
                }
            }
        });
        let until = Instant::now() + within;
        let mut lines = Vec::new();
        while let Ok(l) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            let done = l.starts_with(last);
            lines.push(l);
            if done {
                break;
            }
        }
        lines
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Calls `f` on a thread and gives up after `within` (a call to a daemon that no longer
/// answers would block the test for good).
fn within<T: Send + 'static>(within: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(within).ok()
}

/// Not a test of its own: the client side of
/// `idle_connections_of_one_uid_lock_out_neither_another_uid_nor_an_admin`, run as another uid
/// by setpriv with `LLMD_HELPER_SOCKET` set (without it, it does nothing). With
/// `LLMD_HELPER_CLIENTS=N` it opens up to N idle clients one after another, each given 3 s,
/// stops at the first that fails, prints how many it holds and how that one failed, and holds
/// them until its standard input closes; with `LLMD_HELPER_STATUS`, it connects once and
/// prints what `getStatus` says; with `LLMD_HELPER_STREAM`, it streams one long request,
/// saying when its first tokens arrived (to be stopped then).
#[test]
#[ignore = "a helper that another test runs as another uid"]
fn helper_clients_as_another_uid() {
    let Some(socket) = std::env::var_os("LLMD_HELPER_SOCKET").map(PathBuf::from) else { return };
    if std::env::var_os("LLMD_HELPER_STATUS").is_some() {
        let conn = client::connect(&socket, "llmd").expect("connects");
        let st = conn.service.getStatus().expect("status");
        println!("HELPER status sessions_open {}", st.sessionsOpen);
        return;
    }
    if std::env::var_os("LLMD_HELPER_STREAM").is_some() {
        // One long request, its tokens taken as they come, until the process is stopped.
        let conn = client::connect(&socket, "llmd").expect("connects");
        let s = session(&conn);
        let (cb, _tx, rx) = client::callback();
        s.generate(&greedy("1, 2, 3, 4, 5, 6, 7, 8,", 3000), &cb).expect("queued");
        let mut said = false;
        while let Ok(e) = rx.recv() {
            match e {
                Event::Tokens(..) if !said => {
                    said = true;
                    println!("HELPER streaming");
                }
                Event::Completed(_) | Event::Error(..) => break,
                _ => {}
            }
        }
        return;
    }
    let n: usize = std::env::var("LLMD_HELPER_CLIENTS").ok().and_then(|n| n.parse().ok()).unwrap_or(1);
    let mut held = Vec::new();
    let mut failure = String::from("none");
    for _ in 0..n {
        let (socket, t) = (socket.clone(), Instant::now());
        match within(Duration::from_secs(3), move || {
            client::connect(&socket, "llmd").and_then(|c| c.service.listModels().map(|_| c).map_err(|e| e.to_string()))
        }) {
            Some(Ok(c)) => held.push(c),
            Some(Err(e)) => {
                failure = format!("refused in {} ms: {e}", t.elapsed().as_millis());
                break;
            }
            None => {
                failure = "no answer in 3 s".into();
                break;
            }
        }
    }
    println!("HELPER failure {failure}");
    println!("HELPER held {}", held.len());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Idle clients of one uid hold at most `limits.max_connections_per_uid` connections (32 by
/// default; each client holds three): with llmd's descriptors limited to 128, uncapped idle
/// clients (~40) would take every descriptor, after which no one's connection would be
/// answered — not another app's, not an operator's `status`. The flooding uid's client over
/// its cap is refused at once, and another uid and an admin are served.
#[test]
fn idle_connections_of_one_uid_lock_out_neither_another_uid_nor_an_admin() {
    // The socket open to every uid (the daemon decides per connection and call).
    let d = Daemon::start_after(
        "socket_mode = \"0666\"\n[permissions]\nallowed_uids = [65533, 65534]\n",
        Some("ulimit -n 128"),
    );
    let mut flood = Helper::start(65534, &d.socket, &[("LLMD_HELPER_CLIENTS", "60")]);
    let report = flood.report("held", Duration::from_secs(240));
    let held: usize = report
        .iter()
        .find_map(|l| l.strip_prefix("held "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the flooding helper did not report: {report:?}"));
    let failure = report.iter().find_map(|l| l.strip_prefix("failure ")).unwrap_or("-").to_owned();
    // Another app is served while the flood holds its connections.
    let mut other = Helper::start(65533, &d.socket, &[("LLMD_HELPER_STATUS", "1")]);
    let other_said = other.report("status", Duration::from_secs(20));
    // So is an admin (root: llmd's own uid), in-process.
    let socket = d.socket.clone();
    let admin = within(Duration::from_secs(20), move || {
        let conn = client::connect(&socket, "llmd")?;
        let dump = conn.admin()?.dumpState().map_err(|e| client::describe(&e))?;
        conn.service.getStatus().map_err(|e| client::describe(&e))?;
        Ok::<String, String>(dump)
    });
    assert!(
        other_said.iter().any(|l| l.starts_with("status sessions_open 0")),
        "uid 65533 was not served while uid 65534 held {held} idle clients (its first failure: {failure}): {other_said:?}"
    );
    let dump = match admin {
        Some(Ok(dump)) => dump,
        Some(Err(e)) => panic!("an admin's status failed while uid 65534 held {held} idle clients: {e}"),
        None => panic!("an admin's status got no answer while uid 65534 held {held} idle clients ({failure})"),
    };
    // The flood was refused promptly at its cap, not left hanging on a daemon out of descriptors.
    assert!(failure.starts_with("refused in"), "the client over the cap: {failure}");
    assert_eq!(held, 10, "32 connections make 10 whole clients of 3");
    assert!(dump.contains("\n  uid 65534: 30\n"), "{dump}");
    assert!(d.log().contains("connection refused: uid 65534 has 32 connections open"), "{}", d.log());
    // Once the flood ends, its uid connects again.
    drop(flood);
    let socket = d.socket.clone();
    let back = within(Duration::from_secs(20), move || {
        let t = Instant::now();
        loop {
            let conn = client::connect(&socket, "llmd").expect("connects");
            let dump = conn.admin().expect("admin").dumpState().expect("dump");
            if !dump.contains("uid 65534") || t.elapsed() > Duration::from_secs(10) {
                return dump;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .expect("dump answers");
    assert!(!back.contains("uid 65534"), "the flood's connections were not given back: {back}");
}

/// A session its client holds but no longer uses (a stopped app) is closed after
/// `limits.session_idle_timeout_s` and its KV memory freed, while a session in use stays; the
/// owner of the closed one is told why when it comes back. Before, nothing closed it: a
/// stopped client held its session slots and KV memory for as long as it lived.
#[test]
fn a_session_left_unused_is_closed_and_its_kv_freed_while_one_in_use_stays() {
    let d = Daemon::start("[limits]\nsession_idle_timeout_s = 2\n");
    let conn = d.connect();
    let idle = session(&conn);
    assert!(run(&idle, &greedy("The capital of France is", 8)).error.is_none());
    let busy = session(&conn);
    let st = conn.service.getStatus().expect("status");
    assert_eq!(st.sessionsOpen, 2);
    assert!(st.kvCacheBytes > 0);
    // The other session is used throughout, past the idle one's timeout (at most 2 s + a
    // quarter of it).
    let t = Instant::now();
    let mut turns = 0;
    while t.elapsed() < Duration::from_secs(4) {
        let o = run(&busy, &greedy(" and", 2));
        assert!(o.error.is_none(), "the session in use was refused: {o:?}");
        turns += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let st = conn.service.getStatus().expect("status");
    let dump = conn.admin().expect("admin").dumpState().expect("dump");
    assert_eq!(st.sessionsOpen, 1, "the unused session is still open after 4 s:\n{dump}");
    assert!(dump.contains("SESSIONS (1)"), "{dump}");
    assert!(dump.contains(&format!("kv_bytes {}", st.kvCacheBytes)), "only the session in use holds KV:\n{dump}");
    // Its owner is told why.
    let (cb, _tx, _rx) = client::callback();
    let refused = idle.generate(&greedy("Hello", 4), &cb).expect_err("the unused session is closed");
    assert_eq!(error_code_of(&refused), Some(ErrorCode::SESSION_CLOSED));
    assert!(client::describe(&refused).contains("2 s unused"), "{}", client::describe(&refused));
    assert!(turns >= 10, "{turns} turns in 4 s");
    // Left unused too, the other one goes the same way: nothing open, no KV held.
    let t = Instant::now();
    loop {
        let st = conn.service.getStatus().expect("status");
        if st.sessionsOpen == 0 {
            assert_eq!(st.kvCacheBytes, 0, "a closed session's KV memory was not freed");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the second session was never closed: {st:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A client that stops reading while its request streams — an app the system stopped
/// (SIGSTOP), here a helper process of this test: once a send to it has waited
/// `scheduler.stream_stall_timeout_s` with nothing taken, its request is ended (rolled back, its
/// memory freed) and its connection is ended, which closes its session; another client is
/// served throughout. Before, the request stayed running for as long as the client stayed
/// stopped, holding its session, its request slot and its KV memory.
#[test]
fn a_stopped_client_loses_its_request_and_session_while_others_are_served() {
    let d = Daemon::start(
        "socket_mode = \"0666\"\n[scheduler]\nstream_interval_ms = 0\nstream_stall_timeout_s = 2\n\
         [permissions]\nallowed_uids = [65534]\n",
    );
    let watch = d.connect();
    let mut stopped = Helper::start(65534, &d.socket, &[("LLMD_HELPER_STREAM", "1")]);
    let said = stopped.report("streaming", Duration::from_secs(60));
    assert!(said.iter().any(|l| l == "streaming"), "the helper's request never streamed: {said:?}");
    let pid = stopped.0.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    let stopped_at = Instant::now();
    let st = watch.service.getStatus().expect("status");
    assert_eq!((st.sessionsOpen, st.requestsRunning), (1, 1), "{st:?}");
    // Another client is served meanwhile, with its solo tokens.
    let other = d.connect();
    let o = run(&session(&other), &greedy("The capital of France is", 16));
    assert_eq!(o.ids, golden_capital_ids(16), "{o:?}");
    // The kernel takes what the client's socket holds (a few hundred callbacks) before a send
    // waits; then the timeout runs. On a loaded machine decoding those took up to ~30 s.
    wait_all_ended(&watch, stopped_at, Duration::from_secs(120), "stopped");
    eprintln!(
        "the stopped client's request and session were gone {} ms after it stopped",
        stopped_at.elapsed().as_millis()
    );
    // Its connections are gone too, and the scheduler's books of its uid (the worker publishes
    // them at its next turn, a moment after the request's end shows in the status: on a loaded
    // machine that moment can come after the dump).
    let t = Instant::now();
    loop {
        let dump = watch.admin().expect("admin").dumpState().expect("dump");
        if !dump.contains("uid 65534") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{dump}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The daemon goes on serving.
    let o = run(&session(&other), &greedy("The capital of France is", 4));
    assert_eq!(o.ids, golden_capital_ids(4), "{o:?}");
}

/// Waits until no request runs or waits and no session is open (the `how` client's gone),
/// then checks its KV memory was freed; panics after `within` from `since`.
fn wait_all_ended(watch: &Connection, since: Instant, within: Duration, how: &str) {
    loop {
        let st = watch.service.getStatus().expect("status");
        if st.requestsRunning + st.requestsQueued == 0 && st.sessionsOpen == 0 {
            assert_eq!(st.kvCacheBytes, 0, "the {how} client's KV memory was not freed");
            return;
        }
        assert!(
            since.elapsed() < within,
            "{within:?} after its client was {how}, its request or session remains: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A client killed in the middle of its stream (SIGKILL: its sockets close with
/// no goodbye) loses its request and session at once, its KV memory is freed, and the daemon
/// goes on serving others.
#[test]
fn a_client_killed_mid_stream_loses_its_request_and_session_while_others_are_served() {
    let d = Daemon::start(
        "socket_mode = \"0666\"\n[scheduler]\nstream_interval_ms = 0\n[permissions]\nallowed_uids = [65534]\n",
    );
    let watch = d.connect();
    let mut killed = Helper::start(65534, &d.socket, &[("LLMD_HELPER_STREAM", "1")]);
    let said = killed.report("streaming", Duration::from_secs(60));
    assert!(said.iter().any(|l| l == "streaming"), "the helper's request never streamed: {said:?}");
    let st = watch.service.getStatus().expect("status");
    assert_eq!((st.sessionsOpen, st.requestsRunning), (1, 1), "{st:?}");
    killed.0.kill().expect("kill");
    let _ = killed.0.wait();
    let killed_at = Instant::now();
    wait_all_ended(&watch, killed_at, Duration::from_secs(30), "killed");
    eprintln!("the killed client's request and session were gone {} ms after it died", killed_at.elapsed().as_millis());
    // Its connections go too (the scheduler may keep the uid's fair-share account).
    let connected = || {
        let dump = watch.admin().expect("admin").dumpState().expect("dump");
        let section = dump.split("CONNECTIONS").nth(1).and_then(|s| s.split("\n\n").next()).unwrap_or_default();
        section.contains("uid 65534").then_some(dump)
    };
    let t = Instant::now();
    while let Some(dump) = connected() {
        assert!(t.elapsed() < Duration::from_secs(10), "the killed client's connections remain:\n{dump}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let other = d.connect();
    let o = run(&session(&other), &greedy("The capital of France is", 16));
    assert_eq!(o.ids, golden_capital_ids(16), "{o:?}");
}

/// The daemon's resident memory in kB (`VmRSS`).
fn rss_kb(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the daemon's status");
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// What a big request may leave behind once it is over and the daemon idle, above what a small
/// one left: the worker threads' reusable buffers, sized for the largest chunk. Measured on the
/// default model with a ~1,500-token prompt: 1.4–1.5 MB kept with the trim on return to idle
/// (three runs); 9.0, 9.0 and 19.7 MB without it (42–68 MB on another machine). On a
/// loaded machine (CI runs these tests side by side) about one run in ten keeps 6.2 MB (with
/// two busy loops beside the test: 6,160 kB once in ten runs, 6,208 kB once in eight runs,
/// still there after 3 s more of idle checks; 6,296 kB in one CI run): memory still held,
/// most likely another thread's chunk buffers, not the idle trim's
/// timing. The bound sits above that and below the untrimmed figures.
const RSS_KEPT_AFTER_BURST_KB: u64 = 8 * 1024;

/// Memory a big request takes is given back to the system when the daemon goes idle.
#[test]
fn memory_a_big_request_takes_is_given_back_once_idle() {
    let d = Daemon::start("");
    let conn = d.connect();
    let pid = d.child.id();
    let once = |prompt: &str| {
        let s = session(&conn);
        let o = run(&s, &greedy(prompt, 8));
        assert!(o.error.is_none(), "{:?}", o.error);
        s.close().expect("session closes");
        std::thread::sleep(Duration::from_millis(800));
    };
    // The same short request twice: the second's RSS is the baseline (first-use growth done).
    once("Hello there");
    once("Hello there");
    let base = rss_kb(pid);
    let long = "The printing press changed how books were made and how ideas spread across Europe. ".repeat(90);
    once(&long);
    let peak_gone = rss_kb(pid);
    eprintln!("RSS: {base} kB after a short request, {peak_gone} kB after a long one, both idle");
    assert!(
        peak_gone <= base + RSS_KEPT_AFTER_BURST_KB,
        "{} kB kept after the long request (baseline {base} kB)",
        peak_gone.saturating_sub(base)
    );
}

/// What closed sessions' KV caches may leave resident once they are all closed and the daemon
/// idle, as a share of the KV bytes they held. Measured on the default model, six sessions of
/// 600–900 tokens (115 MB of KV): without the idle worker's release 79% of it stayed (90.8 MB);
/// with it, 9% (10.7 MB).
const KV_KEPT_AFTER_CLOSE_SHARE: f64 = 0.25;

/// Sessions closed while the daemon is idle free their KV caches on the clients' threads,
/// after the worker's trim on going idle; those pages must go back too (without that, 88 MB
/// stays resident after a 30-second soak's clients close every session).
#[test]
fn closed_sessions_kv_is_given_back_while_idle() {
    let d = Daemon::start("[limits]\nmax_sessions_per_uid = 16\n");
    let conn = d.connect();
    let pid = d.child.id();
    let text = "The printing press changed how books were made and how ideas spread across Europe. ";
    // Warm-up: a long request in a session closed at once (the allocator's first big frees).
    let w = session(&conn);
    assert!(run(&w, &greedy(&text.repeat(40), 4)).error.is_none());
    w.close().expect("session closes");
    std::thread::sleep(Duration::from_millis(1500));
    // Six sessions hold their conversations' KV caches, the daemon idle.
    let sessions: Vec<_> = (0..6).map(|_| session(&conn)).collect();
    for (i, s) in sessions.iter().enumerate() {
        let o = run(s, &greedy(&format!("Part {i}. {}", text.repeat(30 + 3 * i)), 8));
        assert!(o.error.is_none(), "{:?}", o.error);
    }
    std::thread::sleep(Duration::from_millis(1500));
    let kv_kb = (conn.service.getStatus().expect("status").kvCacheBytes / 1024) as u64;
    let held = rss_kb(pid);
    for s in &sessions {
        s.close().expect("session closes");
    }
    std::thread::sleep(Duration::from_millis(2000));
    assert_eq!(conn.service.getStatus().expect("status").kvCacheBytes, 0);
    let after = rss_kb(pid);
    let kept = held.saturating_sub(kv_kb) as f64;
    eprintln!("RSS {held} kB with {kv_kb} kB of KV held; {after} kB once closed and idle");
    assert!(
        after as f64 <= kept + KV_KEPT_AFTER_CLOSE_SHARE * kv_kb as f64,
        "{} of {kv_kb} kB of closed sessions' KV stayed resident",
        (after as f64 - kept).max(0.0)
    );
}

// ---- The NPU as a processor of the daemon (`backend = "npu"`, the emulator provider) ----

/// Rows of the NPU graphs in these tests: a prompt of ~100 tokens runs as several chunks.
const NPU_CHUNK: usize = 32;
/// The QNN SoC model the daemon builds for by default (SM8650, Snapdragon 8 Gen 3).
const SM8650: u32 = 57;
/// Longest the daemon may take to calibrate the model and build its graphs.
const NPU_READY: Duration = Duration::from_secs(120);
/// A prompt a greedy reply keeps counting after, for 1,500 tokens and more (measured).
const COUNTING: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,";

/// The NPU path over `library`, one chunk per NPU job (`ooe_chunks = 1`: the tests that count
/// a job per chunk).
fn npu_config(library: &std::path::Path) -> String {
    npu_config_ooe(library, 1)
}

/// The NPU path over `library`, up to `ooe_chunks` chunks per job prefilled out of order.
fn npu_config_ooe(library: &std::path::Path, ooe_chunks: usize) -> String {
    format!(
        "backend = \"npu\"\n[npu]\nlibrary = {:?}\nchunk = {NPU_CHUNK}\nooe_chunks = {ooe_chunks}\n",
        library.display().to_string()
    )
}

/// The `NPU` section of the daemon's dump.
fn npu_dump(conn: &Connection) -> String {
    let d = conn.admin().expect("admin").dumpState().expect("dump");
    let start = d.find("\nNPU\n").expect("dump has an NPU section");
    let rest = &d[start + 1..];
    rest[..rest.find("\n\n").unwrap_or(rest.len())].to_owned()
}

/// Waits until the NPU section says `what` (or the bound passes).
fn wait_npu(conn: &Connection, what: &str) -> String {
    let t = Instant::now();
    loop {
        let s = npu_dump(conn);
        if s.contains(what) {
            return s;
        }
        assert!(t.elapsed() < NPU_READY, "the NPU section never said {what:?}:\n{s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64
}

/// A request's events, each with the wall-clock millisecond it arrived.
struct Timed {
    id: i64,
    events: Vec<(u64, Event)>,
}

impl Timed {
    fn ids(&self) -> Vec<i32> {
        self.events.iter().flat_map(|(_, e)| if let Event::Tokens(_, i) = e { i.clone() } else { vec![] }).collect()
    }
    fn stats(&self) -> &llmd_aidl::GenerationStats::GenerationStats {
        match self.events.last() {
            Some((_, Event::Completed(s))) => s,
            other => panic!("the request did not complete: {other:?}"),
        }
    }
}

/// Collects a request's events until it ends; `first_tokens` is told when its first tokens come.
fn collect_timed(rx: std::sync::mpsc::Receiver<Event>, first_tokens: Option<std::sync::mpsc::Sender<()>>) -> Timed {
    let mut t = Timed { id: -1, events: Vec::new() };
    let mut first_tokens = first_tokens;
    loop {
        let e = rx.recv_timeout(Duration::from_secs(180)).expect("the request ends");
        let end = matches!(e, Event::Completed(_) | Event::Error(..));
        match &e {
            Event::Started(id) => t.id = *id,
            Event::Tokens(..) => {
                if let Some(tx) = first_tokens.take() {
                    let _ = tx.send(());
                }
            }
            _ => {}
        }
        t.events.push((unix_ms(), e));
        if end {
            return t;
        }
    }
}

/// The greedy tokens llmd_engine gives in-process with the NPU prefill on the emulator, as the
/// daemon configures it (default calibration text and quantization — 16-bit outputs, folded
/// weights, shadow execution — SM8650, `NPU_CHUNK` rows).
fn npu_reference(prompt: &str, max_tokens: usize) -> Vec<i32> {
    use llmd_engine::prefill::{self, NpuLinears, CALIBRATION_TEXT};
    let m = llmd_engine::Model::load(&model(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
        .expect("model loads");
    let device = std::sync::Arc::new(
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("emulator opens"),
    );
    let cal = m.tokenizer.encode(CALIBRATION_TEXT, false, false).expect("calibration tokens");
    let q = prefill::NpuQuant::default();
    let p = prefill::prepare(&device, &m.transformer, &cal, NPU_CHUNK, &q, None).expect("graphs");
    let mut npu = NpuLinears::from_context(&p.context, p.groups, &p.ids, NPU_CHUNK).expect("linears");
    npu.set_shadow(p.shadow).expect("shadow sites");
    let devs = prefill::devices(device, &std::sync::Arc::new(npu));
    greedy_ids(&m, prompt, max_tokens, Some((&devs, NPU_CHUNK)))
}

/// The greedy ids of `prompt` from `m` in-process, its prefill's linear groups on `prefill`'s
/// devices (in chunks of its rows) or on the CPU.
fn greedy_ids(
    m: &llmd_engine::Model,
    prompt: &str,
    max_tokens: usize,
    prefill: Option<(&llmd_engine::model::Devices, usize)>,
) -> Vec<i32> {
    use llmd_engine::generate::{Flow, GenerateRequest, Prompt};
    let p = Prompt::Text(prompt.into());
    let tokens = m.prompt_tokens(&p).expect("tokens");
    let req = GenerateRequest {
        prompt: p,
        sampling: llmd_engine::sampling::SamplingParams::greedy(),
        max_tokens,
        stop: Vec::new(),
    };
    let mut kv = m.transformer.new_kv();
    let mut out = Vec::new();
    m.generate_in_with(&mut kv, &tokens, &req, prefill, |_, ids| {
        out.extend(ids.iter().map(|&i| i as i32));
        Flow::Continue
    })
    .expect("generates");
    out
}

/// llm.npu's out-of-order prefill on the daemon's product path: with `[npu] ooe_chunks = 4` a
/// prompt of several chunks goes to the NPU thread four chunks per job, their subgraphs run out
/// of order across the chunks (the NPU's linear groups on the NPU thread, attention on a CPU
/// thread), and the reply is the engine's in-order NPU prefill's, token for token (the order
/// changes no bit: `engine/tests/npu_ooe.rs`).
#[test]
fn the_npu_prefills_several_chunks_per_job_out_of_order_with_the_in_order_tokens() {
    let d = Daemon::start(&npu_config_ooe(&common::emulator_library(), 4));
    let conn = d.connect();
    wait_npu(&conn, "ready:");
    let long_prompt = "The history of computing is long and varied, and it began with counting. ".repeat(12);
    let s = session(&conn);
    let (cb, _keep, rx) = client::callback();
    s.generate(&greedy(&long_prompt, 8), &cb).expect("submitted");
    let a = collect_timed(rx, None);
    let npu = npu_dump(&conn);
    let jobs: Vec<usize> = npu
        .lines()
        .filter(|l| l.contains(&format!("npu_job request={} ", a.id)))
        .map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("tokens="))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("tokens= in {l:?}"))
        })
        .collect();
    let prompt_tokens = a.stats().promptTokens as usize;
    eprintln!("{prompt_tokens} prompt tokens in NPU jobs of {jobs:?} tokens");
    assert!(prompt_tokens > 4 * NPU_CHUNK, "the prompt spans more than one job of four chunks");
    assert_eq!(jobs.iter().sum::<usize>(), prompt_tokens, "all of the prompt on the NPU:\n{npu}");
    assert_eq!(jobs.len(), prompt_tokens.div_ceil(4 * NPU_CHUNK), "four chunks a job:\n{npu}");
    assert!(jobs.iter().all(|&n| n <= 4 * NPU_CHUNK) && jobs[0] == 4 * NPU_CHUNK, "{jobs:?}");
    assert_eq!(a.ids(), npu_reference(&long_prompt, 8), "the in-order NPU prefill's reply");
}

#[test]
fn one_client_prefills_on_the_npu_while_another_decodes_on_the_cpu() {
    let d = Daemon::start(&npu_config(&common::emulator_library()));
    let (conn_a, conn_b) = (d.connect(), d.connect());
    let ready = wait_npu(&conn_a, "ready:");
    assert!(ready.contains("state serving") && ready.contains("LLMD_HTP_EMULATOR"), "{ready}");
    // B decodes a long reply; once its first tokens arrive, A sends a prompt of several chunks.
    let (sa, sb) = (session(&conn_a), session(&conn_b));
    let (cb_b, _keep_b, rx_b) = client::callback();
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    sb.generate(&greedy(COUNTING, 1200), &cb_b).expect("b submitted");
    let b_thread = std::thread::spawn(move || collect_timed(rx_b, Some(first_tx)));
    first_rx.recv_timeout(Duration::from_secs(60)).expect("b streams");
    let long_prompt = "The history of computing is long and varied, and it began with counting. ".repeat(7);
    let (cb_a, _keep_a, rx_a) = client::callback();
    sa.generate(&greedy(&long_prompt, 8), &cb_a).expect("a submitted");
    let a = collect_timed(rx_a, None);
    let b = b_thread.join().expect("b's collector");
    let npu = npu_dump(&conn_a);
    // A's prompt went to the NPU, chunk by chunk.
    let spans: Vec<(u64, u64, usize, f64)> = npu
        .lines()
        .filter(|l| l.contains(&format!("npu_job request={} ", a.id)))
        .map(|l| {
            let field = |k: &str| -> u64 {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{k} in {l:?}"))
            };
            let modelled: f64 = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("modelled_ms="))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("modelled_ms in {l:?}"));
            (field("start_ms="), field("end_ms="), field("tokens=") as usize, modelled)
        })
        .collect();
    // The emulator charges each chunk its modelled NPU time: 120 graphs of 32 rows.
    assert!(spans.iter().all(|s| s.3 > 0.0), "every chunk has a modelled NPU time:\n{npu}");
    let prompt_tokens = a.stats().promptTokens as usize;
    assert_eq!(spans.iter().map(|s| s.2).sum::<usize>(), prompt_tokens, "all of a's prompt on the NPU:\n{npu}");
    assert_eq!(spans.len(), prompt_tokens.div_ceil(NPU_CHUNK), "in chunks of {NPU_CHUNK}:\n{npu}");
    // B's tokens kept coming while A's chunks were on the NPU.
    let b_tokens: Vec<u64> = b.events.iter().filter(|(_, e)| matches!(e, Event::Tokens(..))).map(|(t, _)| *t).collect();
    let inside = |t: u64| spans.iter().any(|&(s, e, _, _)| s <= t && t <= e);
    let during = b_tokens.iter().filter(|&&t| inside(t)).count();
    let (first, last) = (spans.iter().map(|s| s.0).min().unwrap_or(0), spans.iter().map(|s| s.1).max().unwrap_or(0));
    eprintln!(
        "a: {prompt_tokens} prompt tokens in {} NPU chunks from {first} to {last} ms ({} ms); b: {} token callbacks, {during} of them inside a's NPU chunks",
        spans.len(),
        last - first,
        b_tokens.len()
    );
    for (s, e, n, m) in &spans {
        let k = b_tokens.iter().filter(|&&t| *s <= t && t <= *e).count();
        eprintln!("  npu chunk {n} tokens {s}..{e} ({} ms; modelled NPU {m:.1} ms): b streamed {k} callbacks", e - s);
    }
    // B's decode rate while A's chunks were on the NPU and while they were not (on this host
    // the emulator computes on the same two cores; on a phone the NPU's share would not).
    let b_ids: Vec<(u64, usize)> = b
        .events
        .iter()
        .filter_map(|(t, e)| if let Event::Tokens(_, i) = e { Some((*t, i.len())) } else { None })
        .collect();
    let (b0, b1) = (b_ids.first().map_or(0, |x| x.0), b_ids.last().map_or(0, |x| x.0));
    let in_spans: u64 = spans.iter().map(|&(s, e, _, _)| e - s).sum();
    let tok_in: usize = b_ids.iter().filter(|x| inside(x.0)).map(|x| x.1).sum();
    let tok_out: usize = b_ids.iter().filter(|x| !inside(x.0)).map(|x| x.1).sum();
    eprintln!(
        "  b decoded {:.0} tok/s during a's NPU chunks, {:.0} tok/s the rest of its reply",
        tok_in as f64 * 1e3 / in_spans.max(1) as f64,
        tok_out as f64 * 1e3 / (b1 - b0).saturating_sub(in_spans).max(1) as f64
    );
    assert!(during >= 10, "b streamed only {during} token callbacks while a's prompt was on the NPU");
    assert!(b_tokens.last().is_some_and(|&t| t > last), "b was still decoding after a's prefill");
    // Both replies are what the engine gives in-process with the same NPU path.
    assert_eq!(a.ids(), npu_reference(&long_prompt, 8), "a's reply");
    assert_eq!(b.ids(), npu_reference(COUNTING, 1200), "b's reply");
}

#[test]
fn without_a_usable_qnn_library_the_daemon_serves_on_the_cpu_and_status_says_why() {
    let dir = std::env::temp_dir().join(format!("llmd-npu-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let not_elf = dir.join("libQnnHtp.so");
    std::fs::write(&not_elf, b"not a shared library").expect("written");
    // (config, set-up, what the NPU section says, the reason, the line logged once)
    let cases: [(String, Option<&str>, &str, &str, &str); 4] = [
        (npu_config(&dir.join("missing/libQnnHtp.so")), None, "state unavailable", "No such file", "NPU unavailable"),
        (npu_config(&not_elf), None, "state unavailable", "did not load", "NPU unavailable"),
        // The emulator announcing the core API of an SDK older than qnn-sys's table.
        (
            npu_config(&common::emulator_library()),
            Some("export LLMD_QNN_EMU_CORE_API=2.20"),
            "state unavailable",
            "core API 2.20.0",
            "NPU unavailable",
        ),
        // The emulator with a 1 MB memory cap: the graphs cannot be finalized (MEM_ALLOC).
        (
            npu_config(&common::emulator_library()),
            Some("export LLMD_QNN_EMU_MEMORY_MB=1"),
            "failed, on the CPU",
            "held already (LLMD_QNN_EMU_MEMORY_MB)",
            "NPU graphs not prepared",
        ),
    ];
    let golden = golden_capital_ids(8);
    for (config, setup, says, reason, logged) in cases {
        let d = Daemon::start_after(&config, setup);
        let conn = d.connect();
        let npu = wait_npu(&conn, says);
        eprintln!("{npu}");
        assert!(npu.contains(reason), "the reason ({reason:?}) is shown:\n{npu}");
        let o = run(&session(&conn), &greedy("The capital of France is", 8));
        assert_eq!(o.error, None);
        assert_eq!(o.ids, golden, "served on the CPU: the CPU's greedy tokens");
        assert_eq!(npu_dump(&conn).matches("npu_job").count(), 0, "no NPU job");
        assert_eq!(d.log().matches(logged).count(), 1, "the reason is logged once:\n{}", d.log());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Longest a cancel may take to land while the request's chunk is on the NPU: the chunk stops
/// before its next graph (a 256-row chunk's 120 graphs take ~3.4 s on the emulator here, ~28 ms
/// each on average; cancels measured 5–19 ms), against the whole chunk; the bound leaves room
/// for a loaded machine.
const NPU_CANCEL_BOUND: Duration = Duration::from_millis(1500);

#[test]
fn a_cancel_withdraws_a_chunk_from_the_npu_and_the_session_goes_on() {
    let d = Daemon::start(&format!(
        "backend = \"npu\"\n[npu]\nlibrary = {:?}\nchunk = 256\n",
        common::emulator_library().display().to_string()
    ));
    let conn = d.connect();
    wait_npu(&conn, "ready:");
    let s = session(&conn);
    let (cb, _tx, rx) = client::callback();
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(12);
    let id = s.generate(&greedy(&prompt, 8), &cb).expect("queued");
    // Let the chunk get under way on the NPU (it takes seconds on the emulator).
    std::thread::sleep(Duration::from_millis(800));
    // Status and dump do not wait for the chunk: the session shows its figures as of its last
    // unlock.
    let t = Instant::now();
    conn.service.getStatus().expect("status");
    let dump = conn.admin().expect("admin").dumpState().expect("dump");
    let status_took = t.elapsed();
    assert!(status_took < NPU_CANCEL_BOUND, "status and dump waited {status_took:?} for the NPU chunk");
    assert!(dump.contains("(in use: as of its last unlock)"), "the session is shown as in use:\n{dump}");
    let t = Instant::now();
    s.cancel(id).expect("cancel accepted");
    let (end, after) = until_the_end(&rx);
    let took = t.elapsed();
    eprintln!(
        "status and dump answered in {} ms during the chunk; the cancel landed {} ms after it was sent",
        status_took.as_millis(),
        took.as_millis()
    );
    assert_eq!((end, after), (ErrorCode::CANCELLED, 0));
    assert!(took < NPU_CANCEL_BOUND, "the cancel took {took:?}: it waited for the whole chunk");
    let npu = npu_dump(&conn);
    assert!(npu.contains(&format!("npu_job request={id} ")), "the chunk was on the NPU:\n{npu}");
    assert!(npu.contains("ready:"), "a withdrawn chunk does not fail the model's graphs:\n{npu}");
    let status = conn.service.getStatus().expect("status");
    assert_eq!(status.requestsRunning + status.requestsQueued, 0);
    // The session's cache was cut back: the next turn (on the NPU too) is the model's reply
    // to it alone, as the engine gives it in-process.
    assert_eq!(
        run(&s, &greedy("The capital of France is", 4)).ids,
        npu_reference("The capital of France is", 4),
        "the next turn after the withdrawn chunk"
    );
}

/// Longest the GPU thread may take to open the device and build (or load) the kernels: PoCL
/// builds them in about 0.6 s and compiles each at its first launch (~6 s all told, cold).
const GPU_READY: Duration = Duration::from_secs(60);

/// The `GPU` section of the daemon's dump.
fn gpu_dump(conn: &Connection) -> String {
    let d = conn.admin().expect("admin").dumpState().expect("dump");
    let start = d.find("\nGPU\n").expect("dump has a GPU section");
    let rest = &d[start + 1..];
    rest[..rest.find("\n\n").unwrap_or(rest.len())].to_owned()
}

/// Waits until the GPU has started or failed to; None (the test passes, saying why) when it
/// cannot be used and `LLMD_REQUIRE_OPENCL` is not 1.
fn gpu_serving(conn: &Connection) -> Option<String> {
    let s = gpu_settled(conn);
    if s.contains("state serving") {
        return Some(s);
    }
    assert!(s.contains("state unavailable"), "the GPU never started:\n{s}");
    let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
    assert!(!required, "LLMD_REQUIRE_OPENCL=1 and the daemon's GPU is unavailable:\n{s}");
    eprintln!("skipped: the GPU is unavailable here:\n{s}");
    None
}

/// The `GPU` section once the GPU thread is past starting (or after [`GPU_READY`]).
fn gpu_settled(conn: &Connection) -> String {
    let t = Instant::now();
    loop {
        let s = gpu_dump(conn);
        if !s.contains("state starting") || t.elapsed() > GPU_READY {
            return s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Greedy ids of `prompt` from the engine in-process, on the CPU.
fn cpu_reference(prompt: &str, max_tokens: usize) -> Vec<i32> {
    let m = llmd_engine::Model::load(&model(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
        .expect("model loads");
    greedy_ids(&m, prompt, max_tokens, None)
}

/// `key=value` fields of a dump line.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)).and_then(|v| v.parse().ok())
}

#[test]
fn one_client_decodes_on_the_gpu_while_another_prefills_on_the_cpu() {
    let d = Daemon::start("backend = \"gpu\"\n");
    let (conn_a, conn_b) = (d.connect(), d.connect());
    let Some(ready) = gpu_serving(&conn_a) else { return };
    eprintln!("{ready}");
    // A decodes a reply; once its first tokens arrive, B sends a prompt of several chunks.
    let (sa, sb) = (session(&conn_a), session(&conn_b));
    let (cb_a, _keep_a, rx_a) = client::callback();
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    sa.generate(&greedy("The capital of France is", 48), &cb_a).expect("a submitted");
    let a_thread = std::thread::spawn(move || collect_timed(rx_a, Some(first_tx)));
    first_rx.recv_timeout(Duration::from_secs(60)).expect("a streams");
    let long_prompt = "The history of computing is long and varied, and it began with counting. ".repeat(40);
    let (cb_b, _keep_b, rx_b) = client::callback();
    sb.generate(&greedy(&long_prompt, 8), &cb_b).expect("b submitted");
    let b = collect_timed(rx_b, None);
    let a = a_thread.join().expect("a's collector");
    let gpu = gpu_dump(&conn_a);
    let jobs: Vec<&str> = gpu.lines().filter(|l| l.trim_start().starts_with("gpu_job")).collect();
    // Every decode step ran on the GPU (A's first token comes from its prompt pass).
    let steps: u64 = jobs.iter().filter_map(|l| field(l, "sequences=")).sum();
    let decoded = (a.stats().generatedTokens + b.stats().generatedTokens) as u64;
    assert!(steps >= decoded - 2, "{steps} decode steps on the GPU for {decoded} tokens:\n{gpu}");
    // B's prompt chunks ran on the CPU while the GPU ran A's steps: their spans overlap.
    let beside: Vec<(u64, u64, u64, u64)> = jobs
        .iter()
        .filter_map(|l| {
            Some((field(l, "start_ms=")?, field(l, "end_ms=")?, field(l, "cpu_start_ms=")?, field(l, "cpu_end_ms=")?))
        })
        .collect();
    let overlapping = beside.iter().filter(|&&(gs, ge, cs, ce)| gs.max(cs) < ge.min(ce)).count();
    let cpu_tokens: u64 = jobs.iter().filter_map(|l| field(l, "cpu_prefill_tokens=")).sum();
    for (gs, ge, cs, ce) in &beside {
        eprintln!("gpu decode {gs}..{ge} ({} ms) beside cpu prefill {cs}..{ce} ({} ms)", ge - gs, ce - cs);
    }
    assert!(overlapping >= 2, "B's chunks did not run beside A's GPU steps:\n{gpu}");
    assert!(cpu_tokens >= 2 * 256, "B's prompt was read beside the GPU ({cpu_tokens} tokens):\n{gpu}");
    // A's reply begins with llama.cpp's greedy tokens; B's is the CPU's.
    assert_eq!(a.ids()[..8], golden_capital_ids(8)[..], "a's reply");
    assert_eq!(b.ids(), cpu_reference(&long_prompt, 8), "b's reply");
    // PoCL shares the host's memory: the GPU reads the CPU's own weights, none copied.
    let weights = gpu.lines().find(|l| l.trim_start().starts_with("weights ")).expect("a weights line");
    let in_place: u64 = weights.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("bytes in place");
    assert!(in_place > 90_000_000 && weights.contains(", 0 B copied"), "{weights}");
    // SIGTERM still drains and exits 0 with the OpenCL runtime loaded (PoCL's LLVM installs
    // SIGTERM handlers of its own that re-raise with the default action: llmd exited 143).
    let mut d = d;
    assert!(Command::new("kill").args(["-TERM", &d.child.id().to_string()]).status().expect("kill").success());
    let status = common::exit_status_within(&mut d.child, Duration::from_secs(20));
    assert!(status.success(), "llmd exited with {status:?}:\n{}", d.log());
}

#[test]
fn without_opencl_the_daemon_serves_on_the_cpu_and_status_says_why() {
    let d = Daemon::start("backend = \"gpu\"\n[gpu]\nlibrary = \"/nonexistent/libOpenCL.so\"\n");
    let conn = d.connect();
    let gpu = gpu_settled(&conn);
    assert!(gpu.contains("state unavailable: decode runs on the CPU"), "{gpu}");
    assert!(gpu.contains("cannot load the OpenCL library /nonexistent/libOpenCL.so"), "the reason:\n{gpu}");
    let o = run(&session(&conn), &greedy("The capital of France is", 8));
    assert_eq!(o.error, None);
    assert_eq!(o.ids, golden_capital_ids(8), "served on the CPU");
    assert_eq!(gpu_dump(&conn).matches("gpu_job").count(), 0, "no GPU job");
    assert_eq!(d.log().matches("GPU unavailable").count(), 1, "logged once:\n{}", d.log());
}

/// The daemon's `DEVICES` section (what `llmctl status` shows of it), once neither processor
/// is starting.
fn devices_settled(conn: &Connection) -> String {
    let t = Instant::now();
    loop {
        let d = conn.admin().expect("admin").dumpState().expect("dump");
        let start = d.find("\nDEVICES\n").expect("dump has a DEVICES section");
        let rest = &d[start + 1..];
        let s = rest[..rest.find("\n\n").unwrap_or(rest.len())].to_owned();
        if !s.contains(" starting") || t.elapsed() > NPU_READY {
            return s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn by_default_work_goes_to_the_accelerators_this_system_has_and_here_that_is_the_cpu() {
    // backend = "auto" (the default): a phone's NPU library and an OpenCL GPU. This host is not
    // a phone: llmd's emulator is not taken, and OpenCL is not even probed (PoCL, a CPU device,
    // would only add its runtime's memory).
    let d = Daemon::start("");
    let conn = d.connect();
    let devices = devices_settled(&conn);
    assert!(devices.contains("npu not taken: backend \"auto\" takes a phone's NPU"), "{devices}");
    assert!(devices.contains("gpu not taken: backend \"auto\" looks for a GPU on Android"), "{devices}");
    assert!(devices.contains("cpu taken"), "{devices}");
    let gpu = gpu_settled(&conn);
    assert!(gpu.contains("state unavailable: decode runs on the CPU"), "{gpu}");
    let o = run(&session(&conn), &greedy("The capital of France is", 8));
    assert_eq!(o.ids, golden_capital_ids(8), "served on the CPU");
    assert_eq!(gpu_dump(&conn).matches("gpu_job").count(), 0, "no GPU job");
    assert_eq!(npu_dump(&conn).matches("npu_job").count(), 0, "no NPU job");
    // Expected absences are said at info, not as warnings.
    let log = d.log();
    assert!(!log.contains("GPU unavailable") && !log.contains("NPU unavailable"), "{log}");
}

#[test]
fn auto_takes_the_emulator_and_a_cpu_opencl_device_only_when_emulated_devices_are_allowed() {
    if opencl_missing() {
        return;
    }
    let emulator = common::emulator_library().display().to_string();
    // Named, but not allowed: the emulator is opened and refused, and an OpenCL device on the
    // host's CPU too, even one `[gpu] device` picks.
    let d = Daemon::start(&format!("[npu]\nlibrary = {emulator:?}\nchunk = {NPU_CHUNK}\n[gpu]\ndevice = 0\n"));
    let conn = d.connect();
    let devices = devices_settled(&conn);
    assert!(
        devices.contains("npu not taken: backend \"auto\" does not take llmd's QNN emulator")
            && devices.contains("set [devices] allow_emulated = true"),
        "{devices}"
    );
    assert!(devices.contains("gpu not taken: backend \"auto\" does not take"), "{devices}");
    let o = run(&session(&conn), &greedy("The capital of France is", 8));
    assert_eq!(o.ids, golden_capital_ids(8), "served on the CPU");
    assert_eq!(npu_dump(&conn).matches("npu_job").count() + gpu_dump(&conn).matches("gpu_job").count(), 0);
    assert!(!d.log().contains("NPU unavailable") && !d.log().contains("GPU unavailable"), "said at info");
    drop(conn);
    drop(d);
    // Allowed: both taken, labelled as what they are.
    let d = Daemon::start(&format!(
        "[devices]\nallow_emulated = true\n[npu]\nlibrary = {emulator:?}\nchunk = {NPU_CHUNK}\n"
    ));
    let conn = d.connect();
    let devices = devices_settled(&conn);
    assert!(devices.contains("npu taken: provider LLMD_HTP_EMULATOR (llmd's QNN emulator)"), "{devices}");
    assert!(devices.contains("gpu taken: device") && devices.contains("(on the host's CPU)"), "{devices}");
    wait_npu(&conn, "ready:");
    let o = run(&session(&conn), &greedy(&COUNTING.repeat(4), 4));
    assert_eq!(o.error, None);
    let npu = npu_dump(&conn);
    assert!(npu.contains("npu_job"), "the prompt went to the NPU:\n{npu}");
    eprintln!("{npu}");
}

/// A token the daemon gave (on the NPU's W8A8 or fp16 graphs, or the GPU) may differ from the
/// CPU's only where the CPU's top two logits are this close. **Decision** (ours): half a logit,
/// a near tie; these tests' runs gave margins of 0.0 (both NPU plans) and 0.16 (the GPU's step
/// before it failed).
const NEAR_TIE_LOGITS: f32 = 0.5;

/// For each of `ids` after `prompt` (teacher-forced, on the CPU in-process): how far the CPU's
/// best logit is above the logit of the id given (0 where the CPU agrees).
fn cpu_margins(prompt: &str, ids: &[i32]) -> Vec<f32> {
    let m = llmd_engine::Model::load(&model(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
        .expect("model loads");
    let mut tokens = m.prompt_tokens(&llmd_engine::generate::Prompt::Text(prompt.into())).expect("tokens");
    let n = tokens.len();
    tokens.extend(ids[..ids.len().saturating_sub(1)].iter().map(|&i| i as u32));
    let mut kv = m.transformer.new_kv();
    let logits = m.transformer.forward(&mut kv, &tokens, llmd_engine::model::Logits::All).expect("forward");
    let vocab = m.config().vocab_size;
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            let row = &logits[(n - 1 + i) * vocab..(n + i) * vocab];
            let best = row.iter().copied().fold(f32::MIN, f32::max);
            best - row[id as usize]
        })
        .collect()
}

/// A SoC profile file: the built-in 8 Gen 3's as `name`, with a CPU side fast enough for the
/// planner to choose llm.npu's INT8 chunked prefill if `fast_cpu` (on the 8 Gen 3's figures its
/// CPU attention bounds it).
fn profile_file(dir: &std::path::Path, name: &str, fast_cpu: bool) -> std::path::PathBuf {
    let builtin = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../engine/data/socs.toml"))
        .expect("the built-in profiles");
    let gen3 = &builtin
        [builtin.find("[snapdragon_8gen3]").expect("8 Gen 3")..builtin.find("[snapdragon_8gen2]").expect("8 Gen 2")];
    let text: Vec<String> = gen3
        .replace("snapdragon_8gen3", name)
        .lines()
        .map(|l| match l.split_whitespace().next() {
            Some("attention_gflops") if fast_cpu => "attention_gflops = 2000.0".to_owned(),
            Some("elementwise_gelems_per_s") if fast_cpu => "elementwise_gelems_per_s = 200.0".to_owned(),
            _ => l.to_owned(),
        })
        .collect();
    let file = dir.join("socs.toml");
    std::fs::write(&file, text.join("\n")).expect("profile written");
    file
}

/// `backend = "auto"` with emulated devices allowed (the emulator as NPU, chunks of
/// [`NPU_CHUNK`]), the SoC profile `phone` of `dir/socs.toml` ([`profile_file`]) and the state
/// directory `dir/state`.
fn auto_config(dir: &std::path::Path) -> String {
    format!(
        "[devices]\nallow_emulated = true\nsoc = \"phone\"\nsoc_file = {:?}\n[npu]\nlibrary = {:?}\nchunk = {NPU_CHUNK}\n[residency]\nstate_dir = {:?}\n",
        dir.join("socs.toml").display().to_string(),
        common::emulator_library().display().to_string(),
        dir.join("state").display().to_string()
    )
}

/// The prefill records of the dump's `JOBS` lines: (processor, chunk, start ms, end ms).
fn prefill_spans(jobs: &[&str]) -> Vec<(String, u64, u64, u64)> {
    jobs.iter()
        .filter(|l| l.contains("kind=prefill"))
        .filter_map(|l| {
            let p = l.split_whitespace().find_map(|w| w.strip_prefix("processor="))?.to_owned();
            Some((p, field(l, "chunk=")?, field(l, "start_ms=")?, field(l, "end_ms=")?))
        })
        .collect()
}

/// Whether two prefill records of the dump's `JOBS` lines overlap in time on different
/// processors for different chunks: out-of-order work (a chunk's own records on two processors
/// always overlap, as its CPU and device steps take turns layer by layer).
fn cross_chunk_overlap(jobs: &[&str]) -> bool {
    let spans = prefill_spans(jobs);
    spans.iter().any(|a| spans.iter().any(|b| a.0 != b.0 && a.1 != b.1 && a.2 < b.3 && b.2 < a.3))
}

/// Waits until the GPU has `conn`'s model ready.
fn wait_gpu_ready(conn: &Connection) {
    let t = Instant::now();
    while !gpu_dump(conn).contains(" ready:") {
        assert!(t.elapsed() < GPU_READY, "the GPU never got the model ready:\n{}", gpu_dump(conn));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Once the GPU has the model, 8 greedy tokens after `prompt` in a new session; the ids and
/// the daemon's dump after them.
fn long_prompt_reply(conn: &Connection, prompt: &str) -> (Vec<i32>, String) {
    wait_gpu_ready(conn);
    let s = session(conn);
    let (cb, _keep, rx) = client::callback();
    s.generate(&greedy(prompt, 8), &cb).expect("submitted");
    let got = collect_timed(rx, None);
    let ids = got.ids();
    assert_eq!(ids.len(), 8, "{:?}", got.events.last());
    (ids, conn.admin().expect("admin").dumpState().expect("dump"))
}

/// `backend = "auto"` with emulated devices allowed (llmd's emulator as the NPU, PoCL or
/// Intel's CPU runtime as the GPU) follows each model's plan: under a profile that makes INT8
/// chunked prefill the faster, a 520-token prompt goes to the NPU as W8A8 chunks, decode to
/// the GPU, and each token is the CPU's (teacher-forced) or a near tie there; the plan is
/// stored, loaded at the next start, and made again when the profile changes (the built-in 8
/// Gen 3's: HeteroLLM's partitioned prefill for this model).
#[test]
fn auto_follows_each_models_plan_and_makes_it_again_when_the_profile_changes() {
    if opencl_missing() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("llmd-plans-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    profile_file(&dir, "phone", true);
    let config = auto_config(&dir);
    let d = Daemon::start(&config);
    let conn = d.connect();
    let npu = wait_npu(&conn, "ready:");
    assert!(npu.contains("plan Int8Chunked prefill, Gpu decode (made: none stored"), "{npu}");
    let plans = dir.join("state/plans/smollm2-135m-instruct.q4_1.phone.json");
    assert!(plans.is_file(), "the plan is stored: {npu}");
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(35);
    let (ids, dump) = long_prompt_reply(&conn, &prompt);
    let jobs: Vec<&str> = dump.lines().filter(|l| l.trim_start().starts_with("job request=")).collect();
    let mine = |p: &str, k: &str| jobs.iter().filter(|l| l.contains(&format!("processor={p} kind={k}"))).count();
    let chunks: usize = jobs
        .iter()
        .filter(|l| l.contains("processor=npu kind=prefill"))
        .filter_map(|l| field(l, "tokens="))
        .map(|t| (t as usize).div_ceil(NPU_CHUNK))
        .sum();
    assert!(chunks >= 3, "the prompt ran as NPU chunks ({chunks}):\n{dump}");
    assert!(mine("gpu", "decode") >= 1, "decode on the GPU:\n{dump}");
    // Out of order: the NPU's groups of one chunk beside the CPU's attention of another.
    assert!(cross_chunk_overlap(&jobs), "two of the request's jobs overlap on different processors:\n{dump}");
    // No thread per operator: a second prompt of as many groups spawns at most its jobs' lanes.
    let spawned = |d: &str| {
        d.lines()
            .find_map(|l| l.trim().strip_prefix("threads spawned=")?.split_whitespace().next()?.parse::<u64>().ok())
    };
    let before = spawned(&dump).expect("the DEVICES section counts threads");
    let (cb, _keep, rx) = client::callback();
    let s2 = session(&conn);
    s2.generate(&greedy(&prompt, 2), &cb).expect("submitted");
    let second = collect_timed(rx, None);
    assert_eq!(second.ids().len(), 2, "{:?}", second.events.last());
    let after = spawned(&conn.admin().expect("admin").dumpState().expect("dump")).expect("counted");
    let npu_jobs = 520usize.div_ceil(NPU_CHUNK * 4) as u64 + 1;
    assert!(after - before <= npu_jobs, "{} threads spawned for one prompt of {npu_jobs} NPU jobs", after - before);
    eprintln!("threads spawned by a second prompt: {} ({npu_jobs} NPU jobs)", after - before);
    let margins = cpu_margins(&prompt, &ids);
    eprintln!("the CPU's margin over each token the daemon gave (0: the CPU's own): {margins:?}");
    for (i, m) in margins.iter().enumerate() {
        assert!(*m <= NEAR_TIE_LOGITS, "token {i} is {m} below the CPU's best: {margins:?}");
    }
    drop(conn);
    drop(d);
    // The next start loads it; the profile changed (the 8 Gen 3's CPU figures) makes it again:
    // HeteroLLM's partitioned prefill for this model.
    let d = Daemon::start(&config);
    let npu = wait_npu(&d.connect(), "ready:");
    assert!(npu.contains("plan Int8Chunked prefill, Gpu decode (loaded from"), "{npu}");
    drop(d);
    profile_file(&dir, "phone", false);
    let d = Daemon::start(&config);
    let npu = wait_npu(&d.connect(), "ready:");
    assert!(npu.contains("plan Fp16Partitioned prefill, Gpu decode (made: the profile changed"), "{npu}");
    drop(d);
    // A plan another version of the planner stored is made again, not followed.
    let mut stored: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plans).expect("the plan")).expect("the plan reads");
    stored["key"]["planner"] = serde_json::json!(0);
    std::fs::write(&plans, stored.to_string()).expect("written");
    let d = Daemon::start(&config);
    let npu = wait_npu(&d.connect(), "ready:");
    assert!(npu.contains("plan Fp16Partitioned prefill, Gpu decode (made: the planner changed"), "{npu}");
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- HeteroLLM (`backend = "hetero"`: the emulator provider as NPU, OpenCL as GPU) ----

#[test]
fn the_hetero_backend_serves_the_default_model_on_a_partitioned_plan_with_the_cpus_tokens() {
    if opencl_missing() {
        return;
    }
    let cache = std::env::temp_dir().join(format!("llmd-hetero-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let config = format!("{}cache_dir = {:?}\n", hetero_config(), cache.display().to_string());
    let d = Daemon::start(&config);
    let conn = d.connect();
    let ready = wait_npu(&conn, "ready:");
    assert!(ready.contains("planned (Even"), "{ready}");
    assert!(ready.contains("fp16 graphs built and finalized"), "a first start builds its graphs: {ready}");
    let (got, want) = hetero_reply(&conn);
    let npu = npu_dump(&conn);
    eprintln!("{npu}");
    assert_eq!(got, want, "the hetero plan's reply against the CPU's");
    // Prompt chunks and decode steps both ran cut between the NPU and the GPU.
    let line = npu.lines().find(|l| l.contains("hetero ")).unwrap_or_else(|| panic!("no hetero counters:\n{npu}"));
    let nums: Vec<u64> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    assert!(nums.len() >= 4 && nums[nums.len() - 4] > 0, "{line}");
    let [matmuls, split, npu_pieces, gpu_pieces] =
        [nums[nums.len() - 4], nums[nums.len() - 3], nums[nums.len() - 2], nums[nums.len() - 1]];
    assert_eq!(matmuls, split, "every matmul cut: {line}");
    assert!(npu_pieces >= matmuls && gpu_pieces >= matmuls, "{line}");
    let fast = npu.lines().find(|l| l.contains("fast sync ")).unwrap_or_else(|| panic!("no fast-sync line:\n{npu}"));
    assert!(fast.contains(&format!(": {split} waits for the GPU")), "a fast-sync wait per cut matmul: {fast}");
    // Per operator kind: how soon after the GPU's part finished the waiter woke.
    let kinds: Vec<&str> = npu.lines().filter(|l| l.contains("fast sync ") && l.contains(" wake_p50_us=")).collect();
    assert!(kinds.len() >= 7 && kinds.iter().all(|l| field(l, "waits=").is_some_and(|w| w > 0)), "{npu}");
    assert!(
        npu.lines().filter(|l| l.contains("npu_job request=") && l.contains(" tokens=1 sequences=1 ")).count() >= 10,
        "decode steps on the plan:\n{npu}"
    );
    // The second start loads the plan's fp16 graphs from the cache, and replies the same.
    let first = ready.lines().find(|l| l.contains("ready:")).unwrap_or_default().trim().to_owned();
    drop(conn);
    drop(d);
    let d = Daemon::start(&config);
    let conn = d.connect();
    let ready = wait_npu(&conn, "ready:");
    let second = ready.lines().find(|l| l.contains("ready:")).unwrap_or_default().trim().to_owned();
    eprintln!("first start:  {first}\nsecond start: {second}");
    assert!(ready.contains("fp16 graphs loaded from the cache"), "{ready}");
    let (got, want) = hetero_reply(&conn);
    assert_eq!(got, want, "the cached plan's reply against the CPU's");
    let _ = std::fs::remove_dir_all(&cache);
}

/// `backend = "hetero"` on the emulator provider, every matmul cut in two, 32-token graphs;
/// ends inside `[npu]` (a caller may add its keys).
fn hetero_config() -> String {
    format!(
        "backend = \"hetero\"\n[hetero]\nplan = \"even\"\nsizes = [32]\n[npu]\nlibrary = {:?}\n",
        common::emulator_library().display().to_string()
    )
}

/// The daemon's 16 greedy tokens after a 3-sentence prompt (a 32-token chunk and a rest),
/// and the CPU's in-process.
fn hetero_reply(conn: &Connection) -> (Vec<i32>, Vec<i32>) {
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(3);
    let s = session(conn);
    let (cb, _keep, rx) = client::callback();
    s.generate(&greedy(&prompt, 16), &cb).expect("submitted");
    let got = collect_timed(rx, None).ids();
    let m = llmd_engine::Model::load(&model(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
        .expect("model loads");
    (got, greedy_ids(&m, &prompt, 16, None))
}

/// Whether no OpenCL device can be opened (the test is then skipped, unless
/// `LLMD_REQUIRE_OPENCL=1`).
fn opencl_missing() -> bool {
    match llmd_engine::backend::gpu::GpuDevice::open(&Default::default()) {
        Ok(_) => false,
        Err(e) => {
            assert!(std::env::var("LLMD_REQUIRE_OPENCL").is_err(), "LLMD_REQUIRE_OPENCL=1 and no OpenCL device: {e}");
            eprintln!("skipped: no OpenCL device ({e})");
            true
        }
    }
}

#[test]
fn an_npu_that_fails_mid_reply_leaves_the_request_to_the_cpu_with_the_same_tokens() {
    if opencl_missing() {
        return;
    }
    let config = hetero_config();
    // The prompt's 32-token chunk runs 30 layers × 7 projections = 210 graphs, each decode step
    // as many: the emulated NPU fails within the first few decode steps.
    let d = Daemon::start_after(&config, Some("export LLMD_QNN_EMU_FAIL_AFTER=800"));
    let conn = d.connect();
    wait_npu(&conn, "ready:");
    let (got, want) = hetero_reply(&conn);
    assert_eq!(got, want, "the reply, finished on the CPU");
    let npu = npu_dump(&conn);
    assert!(npu.contains("failed, on the CPU") && npu.contains("LLMD_QNN_EMU_FAIL_AFTER"), "{npu}");
    assert!(npu.contains("ok=false"), "the failed step is listed:\n{npu}");
}

/// A small deterministic generator for the SIGTERM storm's moments (xorshift64*).
struct Moments(u64);

impl Moments {
    fn next_ms(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % below.max(1)
    }
}

/// Shutdown under load, every backend: SIGTERM at a random moment after the socket appears —
/// while the processors open their libraries, calibrate and build NPU graphs, build OpenCL
/// kernels, plan, or while a client's request is being prefilled or decoded. Each time llmd
/// exits 0 (no crash, no signal) and a request it accepted gets its final callback.
/// `LLMD_SIGTERM_ROUNDS` rounds per backend (CI: 3; the 200 of docs/RELIABILITY.md: 40),
/// `LLMD_SIGTERM_SEED` repeats a run's moments.
#[test]
fn sigterm_at_random_moments_on_every_backend_exits_zero_and_every_client_hears_the_end() {
    let rounds: usize = std::env::var("LLMD_SIGTERM_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let seed: u64 = std::env::var("LLMD_SIGTERM_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    eprintln!("LLMD_SIGTERM_SEED={seed}, {rounds} rounds per backend");
    let mut moments = Moments(seed);
    let emulator = common::emulator_library().display().to_string();
    let mut backends =
        vec![("cpu", "backend = \"cpu\"\n".to_owned()), ("npu", npu_config(&common::emulator_library()))];
    if !opencl_missing() {
        backends.push(("gpu", "backend = \"gpu\"\n".to_owned()));
        backends.push(("hetero", hetero_config()));
        backends.push((
            "auto",
            format!("[devices]\nallow_emulated = true\n[npu]\nlibrary = {emulator:?}\nchunk = {NPU_CHUNK}\n"),
        ));
    }
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(4);
    let mut tally = Vec::new();
    for (name, config) in &backends {
        let (mut finals, mut refused) = (0, 0);
        for round in 0..rounds {
            let mut d = Daemon::start(&format!("shutdown_grace_ms = 200\n{config}"));
            let delay = moments.next_ms(3000);
            let pid = d.child.id().to_string();
            let killer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(delay));
                Command::new("kill").args(["-TERM", &pid]).status().map(|s| s.success()).unwrap_or(false)
            });
            // A client's request, accepted or refused depending on the moment.
            let accepted = client::connect(&d.socket, "llmd").ok().and_then(|conn| {
                let s = conn.service.openSession(MODEL_ID, &SessionOptions::default()).ok()?;
                let (cb, _keep, rx) = client::callback();
                s.generate(&greedy(&prompt, 48), &cb).ok()?;
                let end = loop {
                    match rx.recv_timeout(Duration::from_secs(60)) {
                        Ok(Event::Completed(_)) | Ok(Event::Error(..)) => break true,
                        Ok(_) => {}
                        Err(_) => break false,
                    }
                };
                Some((end, conn, s))
            });
            assert!(killer.join().unwrap_or(false), "{name} round {round}: kill -TERM failed");
            let status = common::exit_status_within(&mut d.child, Duration::from_secs(60));
            assert!(
                status.success(),
                "{name} round {round} (SIGTERM after {delay} ms, seed {seed}): llmd exited with {status:?}\n{}",
                d.log()
            );
            match accepted {
                Some((end, _, _)) => {
                    assert!(end, "{name} round {round} (after {delay} ms, seed {seed}): no final callback");
                    finals += 1;
                }
                None => refused += 1,
            }
        }
        tally.push(format!("{name}: {rounds} SIGTERMs, exit 0 each; {finals} requests ended with their final callback, {refused} not accepted"));
    }
    eprintln!("{}", tally.join("\n"));
}

/// A device failing mid-request under `backend = "auto"`: the emulated NPU fails its 4th
/// graph (`LLMD_QNN_EMU_FAIL_AFTER=3`) while an INT8 plan reads a 520-token prompt. The chunk
/// is read again on the CPU, the request completes with the CPU's tokens (teacher-forced: each
/// the CPU's own or a near tie), the model is taken off the NPU, and its plan is made again
/// without the NPU (prompts on the CPU, decode on the GPU) and stored.
#[test]
fn an_npu_failing_at_its_4th_graph_under_auto_leaves_the_request_to_the_cpu_and_the_plan_is_made_again() {
    if opencl_missing() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("llmd-npu-fault-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    profile_file(&dir, "phone", true);
    let config = auto_config(&dir);
    let d = Daemon::start_after(&config, Some("export LLMD_QNN_EMU_FAIL_AFTER=3"));
    let conn = d.connect();
    let npu = wait_npu(&conn, "ready:");
    assert!(npu.contains("plan Int8Chunked prefill"), "{npu}");
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(35);
    let s = session(&conn);
    let (cb, _keep, rx) = client::callback();
    s.generate(&greedy(&prompt, 8), &cb).expect("submitted");
    let got = collect_timed(rx, None);
    let ids = got.ids();
    assert_eq!(ids.len(), 8, "the request completed: {:?}", got.events.last());
    let npu = npu_dump(&conn);
    assert!(npu.contains("failed, on the CPU") && npu.contains("LLMD_QNN_EMU_FAIL_AFTER"), "{npu}");
    assert!(
        npu.contains("plan made again without the NPU: Cpu prefill, Gpu decode (made: the devices present changed"),
        "{npu}"
    );
    let margins = cpu_margins(&prompt, &ids);
    eprintln!("the CPU's margin over each token the daemon gave: {margins:?}");
    assert!(margins.iter().all(|m| *m <= NEAR_TIE_LOGITS), "{margins:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `backend = "auto"` under the built-in Snapdragon 8 Gen 3 profile (emulated devices
/// allowed): the plan for the default model is HeteroLLM's fp16 partitioned prefill, so a
/// 520-token prompt is read in three 256-token chunks out of order — one chunk's projections
/// on the NPU's fp16 graphs (or, where the solver gives a layer part wholly to the GPU, that
/// part on the GPU) while the CPU runs another's attention — decode runs on the GPU, and every
/// token is the CPU's (teacher-forced) or a near tie there.
#[test]
fn under_the_8gen3_profile_auto_reads_a_prompt_across_processors_out_of_order_and_decodes_on_the_gpu() {
    if opencl_missing() {
        return;
    }
    let config = format!(
        "[devices]\nallow_emulated = true\n[npu]\nlibrary = {:?}\n",
        common::emulator_library().display().to_string()
    );
    let d = Daemon::start(&config);
    let conn = d.connect();
    let npu = wait_npu(&conn, "ready:");
    assert!(npu.contains("plan Fp16Partitioned prefill, Gpu decode"), "{npu}");
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(35);
    let (ids, dump) = long_prompt_reply(&conn, &prompt);
    let jobs: Vec<&str> = dump.lines().filter(|l| l.trim_start().starts_with("job request=")).collect();
    let prefill = prefill_spans(&jobs);
    let mut chunks: Vec<u64> = prefill.iter().map(|p| p.1).collect();
    chunks.sort_unstable();
    chunks.dedup();
    assert!(chunks.len() >= 3, "three chunks or more: {chunks:?}\n{dump}");
    assert!(prefill.iter().any(|p| p.0 == "cpu") && prefill.iter().any(|p| p.0 != "cpu"), "{dump}");
    assert!(cross_chunk_overlap(&jobs), "two of the request's jobs overlap on different processors:\n{dump}");
    assert!(jobs.iter().any(|l| l.contains("processor=gpu kind=decode")), "decode on the GPU:\n{dump}");
    let margins = cpu_margins(&prompt, &ids);
    eprintln!("the CPU's margin over each token the daemon gave: {margins:?}");
    assert!(margins.iter().all(|m| *m <= NEAR_TIE_LOGITS), "{margins:?}");
}

/// A GPU failing at its 2nd decode step (an OpenCL error: `LLMD_OPENCL_FAIL_AFTER` set to the
/// kernels of one decode step, measured on a first daemon): the step is rolled back and run on
/// the CPU, the request completes with the CPU's tokens (teacher-forced: each the CPU's own or
/// a near tie), and the model decodes on the CPU from then on while `dump` says why.
#[test]
fn a_gpu_failing_at_its_2nd_decode_step_leaves_the_request_to_the_cpu_with_the_cpus_tokens() {
    if opencl_missing() {
        return;
    }
    let prompt = "The capital of France is";
    let kernels = |conn: &Connection| {
        let g = gpu_dump(conn);
        g.lines().find_map(|l| l.trim().split_once(" kernels,").and_then(|(n, _)| n.parse::<u64>().ok()))
    };
    // One decode step's kernels (the first token comes from the prompt's logits, on the CPU).
    let d = Daemon::start("backend = \"gpu\"\n");
    let conn = d.connect();
    wait_gpu_ready(&conn);
    let before = kernels(&conn).unwrap_or(0);
    let one = run(&session(&conn), &greedy(prompt, 2));
    assert_eq!(one.ids.len(), 2);
    let per_step = kernels(&conn).expect("the GPU counts its kernels") - before;
    assert!(per_step > 0, "{}", gpu_dump(&conn));
    drop(conn);
    drop(d);
    let d = Daemon::start_after("backend = \"gpu\"\n", Some(&format!("export LLMD_OPENCL_FAIL_AFTER={per_step}")));
    let conn = d.connect();
    wait_gpu_ready(&conn);
    let o = run(&session(&conn), &greedy(prompt, 8));
    assert_eq!(o.error, None);
    assert_eq!(o.ids.len(), 8, "the request completed");
    let gpu = gpu_dump(&conn);
    assert!(gpu.contains("failed, on the CPU") && gpu.contains("LLMD_OPENCL_FAIL_AFTER"), "{gpu}");
    assert_eq!(gpu.matches("gpu_job").count(), 2, "one step done, the second failed:\n{gpu}");
    let margins = cpu_margins(prompt, &o.ids);
    eprintln!("{per_step} kernels per decode step; the CPU's margin over each token: {margins:?}");
    assert!(margins.iter().all(|m| *m <= NEAR_TIE_LOGITS), "{margins:?}");
}

/// Longest a model's shadowAttn profile may take to be made after it loads (uniform ratios: one
/// pass over 256 calibration tokens, well under a second here).
const ATTENTION_READY: Duration = Duration::from_secs(60);

/// The `ATTENTION` section of the daemon's dump, once its model line matches `what`.
fn wait_attention(conn: &Connection, what: &str) -> String {
    let t = Instant::now();
    loop {
        let dump = conn.admin().expect("admin").dumpState().expect("dump");
        let after = dump.split("\nATTENTION\n").nth(1).unwrap_or_default();
        let section = after.split("\n\n").next().unwrap_or_default().to_owned();
        if section.contains(what) {
            return section;
        }
        assert!(t.elapsed() < ATTENTION_READY, "attention never showed {what:?}:\n{section}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `[attention] mode = "shadow"` on the product path: the profile is made after the model loads
/// while the first prompt is served; then a prompt of several chunks runs sparse and its reply is
/// the engine's in-process reply under the same settings; a second turn goes on from the
/// session's cache; a cancel mid-prefill ends the request and the session goes on.
#[test]
fn shadow_attention_is_made_at_load_then_serves_long_prompts_turns_and_cancels() {
    let d = Daemon::start("[attention]\nmode = \"shadow\"\n");
    let conn = d.connect();
    let s = session(&conn);
    // The model loads with this session; its profile is made beside the first prompt.
    let first = run(&s, &greedy("The capital of France is", 4));
    assert!(first.error.is_none(), "{first:?}");
    let section = wait_attention(&conn, "sparse: profile made");
    assert!(section.contains("mode=shadow ratio=0.2 buckets=9 ratios=uniform"), "{section}");
    // A prompt of three chunks, in a fresh session.
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(40);
    let s2 = session(&conn);
    let before = field(&section, "sparse_rows=").expect("sparse rows");
    let long = run(&s2, &greedy(&prompt, 8));
    assert!(long.error.is_none(), "{long:?}");
    let section = wait_attention(&conn, "sparse_rows=");
    let after = field(&section, "sparse_rows=").expect("sparse rows");
    let m = llmd_engine::Model::load(&model(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
        .expect("model");
    let n = m.tokenizer.encode(&prompt, false, m.tokenizer.add_bos).expect("encode").len();
    assert!(n > llmd_engine::generate::DEFAULT_PREFILL_CHUNK, "{n} tokens: more than one chunk");
    assert!(after - before >= (n as u64 - 1) * m.config().n_layers as u64, "{before} -> {after} sparse rows for {n}");
    let cal = m.tokenizer.encode(llmd_engine::prefill::CALIBRATION_TEXT, false, false).expect("encode");
    let (profile, _) = llmd_engine::shadowattn::Profile::load_or_build(None, &m.transformer, &cal, false, &|_, _| true)
        .expect("profile");
    m.transformer.set_sparse_attention(Some(std::sync::Arc::new(profile.settings(0.2, true, 9)))).expect("fits");
    let req = llmd_engine::generate::GenerateRequest {
        prompt: llmd_engine::generate::Prompt::Text(prompt.clone()),
        sampling: llmd_engine::sampling::SamplingParams::greedy(),
        max_tokens: 8,
        stop: vec![],
    };
    let mut ids = Vec::new();
    m.generate(&req, |_, i| {
        ids.extend(i.iter().map(|&t| t as i32));
        llmd_engine::generate::Flow::Continue
    })
    .expect("local generation");
    assert_eq!(long.ids, ids, "the daemon's shadow reply is the engine's in-process one");
    // A second turn on the same session reads its prompt over the kept cache.
    let second = run(&s2, &greedy(" What came after counting?", 6));
    assert!(second.error.is_none(), "{second:?}");
    let grown = field(&wait_attention(&conn, "sparse_rows="), "sparse_rows=").expect("sparse rows");
    assert!(grown > after, "the second turn's prompt ran sparse too ({after} -> {grown})");
    // A cancel while a long prompt is read: cancelled, nothing emitted, the session goes on.
    let (cb, _tx, rx) = client::callback();
    let id = s2.generate(&greedy(&prompt.repeat(3), 8), &cb).expect("queued");
    std::thread::sleep(Duration::from_millis(300));
    s2.cancel(id).expect("cancel accepted");
    assert_eq!(until_the_end(&rx), (ErrorCode::CANCELLED, 0));
    let after_cancel = run(&s2, &greedy(" And then?", 4));
    assert!(after_cancel.error.is_none(), "{after_cancel:?}");
}
