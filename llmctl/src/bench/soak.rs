//! `llmctl bench --soak MINUTES`: a long mixed workload against a running daemon (socket or
//! kernel Binder) that checks it keeps its promises over time: no crash, every request answered
//! exactly once, memory and file descriptors that do not creep.
//!
//! `--clients` clients (8 by default) run for MINUTES, each on its own connection with two
//! sessions (one for independent requests, reset before each, and one for a conversation). Each
//! picks its next action from a fixed pseudo-random sequence of its own (the same every run):
//!
//! | share | action |
//! |---|---|
//! | 30% | a short prompt (16–48 new tokens) |
//! | 20% | a chat turn: a user message added to the conversation (reset after 4 turns) |
//! | 10% | a long prompt (~1,000 tokens) |
//! | 15% | a request cancelled once its first tokens have arrived |
//! | 3%  | a request the daemon must refuse (no prompt): an `INVALID_ARGUMENT` answer |
//! | 10% | session churn: the independent session is closed and a new one opened |
//! | 4%  | reconnect: the connection and both sessions are dropped and opened again |
//! | 8%  | a client killed mid-stream: a child `llmctl run` is SIGKILLed after its first tokens |
//!
//! Before their sequences, the clients' first steps take every action once between them (a
//! tour: client `i`'s step `j` is action `i + j · clients` of the table, while that is one), so a
//! soak as short as CI's — a few steps per client on a busy machine — still exercises each.
//!
//! A request whose `generate` call was accepted must end with exactly one terminal callback
//! (`onCompleted` or `onError`): none within [`REQUEST_TIMEOUT`] is *lost*, a second one (found by
//! draining every request's callback channel at the end) is *duplicated*. A refused call is an
//! answer too (its error code is counted). A killed client's request has no one to answer: what
//! is checked for those is that the daemon lets go of them (sessions and descriptors back to the
//! start when the soak ends).
//!
//! A sampler asks the daemon (`getStatus` and the admin `dumpState`, so the soak needs an admin
//! uid) every 1–5 seconds (a six-hundredth of the run) for its pid, resident memory, open descriptors, sessions and requests.
//! The checks, each printed with its figures (the command fails if one does not hold):
//! - **no crash**: every sample answered, always by the same pid;
//! - **exactly once**: 0 lost, 0 duplicated;
//! - **RSS drift** < `--max-rss-drift` percent (5): the median RSS over the last minute against
//!   the median over the minute ending at a sixth of the run (the 5th minute of 30), so the
//!   warm-up (model pages, allocator arenas, the first long prompts) is not counted as drift;
//! - **descriptors flat**: the daemon's descriptors once every client is gone, against the
//!   count before the first client came (the sampler's own connection is open in both).

use super::{percentile, LoadArgs};
use crate::client::{self, Connection, Event};
use llmd_aidl::ChatMessage::ChatMessage;
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::ILlmSession::ILlmSession;
use rsbinder::Strong;
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an accepted request may run before it counts as lost.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Chat turns before a client resets its conversation.
const CHAT_TURNS: u32 = 4;
/// How long after the last client has gone the daemon has to let go of every session.
const SETTLE: Duration = Duration::from_secs(30);
/// How long a killed client waits for its first tokens before it is killed anyway.
const KILL_WAIT: Duration = Duration::from_secs(20);

/// What a client does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Action {
    Short,
    Chat,
    Long,
    Cancel,
    Invalid,
    Churn,
    Reconnect,
    Kill,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Short => "short",
            Action::Chat => "chat",
            Action::Long => "long",
            Action::Cancel => "cancel",
            Action::Invalid => "invalid",
            Action::Churn => "churn",
            Action::Reconnect => "reconnect",
            Action::Kill => "kill",
        }
    }

    /// Every action, in the table's order (the clients' tour).
    const ALL: [Action; 8] = [
        Action::Short,
        Action::Chat,
        Action::Long,
        Action::Cancel,
        Action::Invalid,
        Action::Churn,
        Action::Reconnect,
        Action::Kill,
    ];

    /// Client `i`'s step `k` (from 1) of `clients`: its part of the tour, then its sequence's
    /// roll (`roll` is drawn either way, so the sequence is the same whatever the tour).
    fn step(i: u64, k: u64, clients: u64, roll: u64) -> Self {
        let tour = i + (k - 1) * clients.max(1);
        usize::try_from(tour).ok().and_then(|t| Self::ALL.get(t).copied()).unwrap_or_else(|| Self::pick(roll))
    }

    /// The share table of the module doc, on a roll in 0..100.
    fn pick(roll: u64) -> Self {
        match roll {
            0..30 => Action::Short,
            30..50 => Action::Chat,
            50..60 => Action::Long,
            60..75 => Action::Cancel,
            75..78 => Action::Invalid,
            78..88 => Action::Churn,
            88..92 => Action::Reconnect,
            _ => Action::Kill,
        }
    }
}

/// SplitMix64: each client's fixed sequence of actions and sizes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One request as the client saw it.
#[derive(Clone, Debug)]
struct Record {
    action: Action,
    /// Seconds from the soak's start to the request's end.
    at_s: f64,
    ttft_ms: Option<f64>,
    total_ms: f64,
    /// "OK", an error code's name, or "LOST".
    outcome: String,
}

impl Record {
    /// Whether the answer is the one its kind asks for: a cancelled request ends CANCELLED (or
    /// OK, if it finished first), a request without a prompt INVALID_ARGUMENT, the rest OK.
    fn expected(&self) -> bool {
        match self.action {
            Action::Cancel => self.outcome == "CANCELLED" || self.outcome == "OK",
            Action::Invalid => self.outcome == "INVALID_ARGUMENT",
            _ => self.outcome == "OK",
        }
    }
}

/// One look at the daemon.
#[derive(Clone, Debug, Default)]
struct Sample {
    at_s: f64,
    /// None when the daemon did not answer.
    pid: Option<u64>,
    rss: u64,
    fds: u64,
    sessions: i64,
    running: i64,
    queued: i64,
}

/// A line of `key value` from the dump.
fn dump_value(dump: &str, key: &str) -> Option<u64> {
    dump.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == key).then(|| it.next()?.parse().ok()).flatten()
    })
}

fn sample(conn: &Connection, start: Instant) -> Sample {
    let mut s = Sample { at_s: start.elapsed().as_secs_f64(), ..Sample::default() };
    let (Ok(st), Ok(dump)) =
        (conn.service.getStatus(), conn.admin().and_then(|a| a.dumpState().map_err(|e| client::describe(&e))))
    else {
        return s;
    };
    s.pid = dump_value(&dump, "process_pid");
    s.rss = dump_value(&dump, "process_rss_bytes").unwrap_or(0);
    s.fds = dump_value(&dump, "process_open_fds").unwrap_or(0);
    s.sessions = st.sessionsOpen.into();
    s.running = st.requestsRunning.into();
    s.queued = st.requestsQueued.into();
    s
}

fn median_u64(mut v: Vec<u64>) -> Option<u64> {
    v.sort_unstable();
    (!v.is_empty()).then(|| v[v.len() / 2])
}

/// Where and how to reach the daemon, for the clients and the killed children.
#[derive(Clone)]
struct Target {
    socket: Option<PathBuf>,
    service: String,
    model: Option<String>,
}

impl Target {
    fn connect(&self) -> Result<Connection, String> {
        client::connect(self.socket.as_deref(), &self.service)
    }
}

/// A soak client: its connection, its two sessions, and the callback channels of its ended
/// requests (drained at the end to find duplicates).
struct SoakClient {
    target: Target,
    conn: Connection,
    work: Strong<dyn ILlmSession>,
    chat: Strong<dyn ILlmSession>,
    chat_turns: u32,
    done: Vec<Receiver<Event>>,
}

impl SoakClient {
    fn new(target: &Target) -> Result<Self, String> {
        let conn = target.connect()?;
        let work = client::open_session(&conn, target.model.as_deref())?;
        let chat = client::open_session(&conn, target.model.as_deref())?;
        Ok(Self { target: target.clone(), conn, work, chat, chat_turns: 0, done: Vec::new() })
    }

    /// Sends `req` on `session`; with `cancel`, cancels it once its first tokens are in (after
    /// `cancel_delay` more). Waits for its end.
    fn request(
        &mut self,
        action: Action,
        chat: bool,
        req: &GenerateRequest,
        cancel: Option<Duration>,
        start: Instant,
    ) -> Record {
        let t0 = Instant::now();
        let record = |ttft: Option<Duration>, outcome: String| Record {
            action,
            at_s: start.elapsed().as_secs_f64(),
            ttft_ms: ttft.map(|d| d.as_secs_f64() * 1e3),
            total_ms: t0.elapsed().as_secs_f64() * 1e3,
            outcome,
        };
        let session = if chat { self.chat.clone() } else { self.work.clone() };
        let (cb, _tx, rx) = client::callback();
        let id = match session.generate(req, &cb) {
            Ok(id) => id,
            Err(e) => return record(None, refusal(&e)),
        };
        let mut ttft = None;
        let mut cancel_at: Option<Instant> = None;
        let outcome = loop {
            let wait = match cancel_at {
                Some(at) => at.saturating_duration_since(Instant::now()).min(REQUEST_TIMEOUT),
                None => REQUEST_TIMEOUT.saturating_sub(t0.elapsed()),
            };
            match rx.recv_timeout(wait) {
                Ok(Event::Tokens(..)) => {
                    if ttft.is_none() {
                        ttft = Some(t0.elapsed());
                        cancel_at = cancel.map(|d| Instant::now() + d);
                    }
                }
                Ok(Event::Completed(_)) => break "OK".to_owned(),
                Ok(Event::Error(code, _)) => break client::code_name(llmd_aidl::ErrorCode::ErrorCode(code)).to_owned(),
                Ok(_) => {}
                Err(_) if cancel_at.is_some_and(|at| Instant::now() >= at) => {
                    cancel_at = None;
                    if let Err(e) = session.cancel(id) {
                        break refusal(&e);
                    }
                }
                Err(_) => break "LOST".to_owned(),
            }
        };
        self.done.push(rx);
        record(ttft, outcome)
    }

    fn reopen_work(&mut self) -> Result<(), String> {
        let _ = self.work.close();
        self.work = client::open_session(&self.conn, self.target.model.as_deref())?;
        Ok(())
    }

    fn reconnect(&mut self) -> Result<(), String> {
        let _ = self.work.close();
        let _ = self.chat.close();
        let conn = self.target.connect()?;
        self.work = client::open_session(&conn, self.target.model.as_deref())?;
        self.chat = client::open_session(&conn, self.target.model.as_deref())?;
        // The old connection closes here, with nothing left on it.
        self.conn = conn;
        self.chat_turns = 0;
        Ok(())
    }

    /// Terminal callbacks that arrived after a request had already ended.
    fn duplicates(&self) -> usize {
        self.done
            .iter()
            .map(|rx| rx.try_iter().filter(|e| matches!(e, Event::Completed(_) | Event::Error(..))).count())
            .sum()
    }
}

/// The error code of a refused call, or the transport's words.
fn refusal(e: &rsbinder::Status) -> String {
    match client::error_code_of(e) {
        Some(code) => client::code_name(code).to_owned(),
        None => format!("transport: {e}"),
    }
}

fn prompt_of(action: Action, client: u64, k: u64, rng: &mut Rng) -> GenerateRequest {
    let base = super::BENCH_TEXT;
    let req = |prompt: String, max_tokens: u64| GenerateRequest {
        prompt,
        maxTokens: max_tokens as i32,
        ..GenerateRequest::default()
    };
    match action {
        Action::Short => {
            let from = rng.below(400) as usize;
            let from = (from..).find(|&i| base.is_char_boundary(i)).unwrap_or(0);
            let to = (from + 160..).find(|&i| base.is_char_boundary(i)).unwrap_or(base.len()).min(base.len());
            req(format!("Note {client}.{k}: {}", &base[from..to]), 16 + rng.below(33))
        }
        // About 1,000 tokens of prose.
        Action::Long => req(format!("Report {client}.{k}. {}", base.repeat(6)), 24),
        Action::Cancel => req(format!("Story {client}.{k}: {}", &base[..300]), 256),
        Action::Invalid => req(String::new(), 16),
        _ => req(String::new(), 0),
    }
}

fn chat_turn(client: u64, k: u64, rng: &mut Rng) -> GenerateRequest {
    const ASKS: [&str; 6] = [
        "What did the old woman sell?",
        "Describe the harbour in one sentence.",
        "When did the fog lift?",
        "Name something the visitors did.",
        "Why was the museum there?",
        "Give the story a title.",
    ];
    let ask = ASKS[rng.below(ASKS.len() as u64) as usize];
    GenerateRequest {
        messages: vec![ChatMessage { role: "user".into(), content: format!("({client}.{k}) {ask}") }],
        maxTokens: 16 + rng.below(25) as i32,
        ..GenerateRequest::default()
    }
}

/// A child `llmctl run` killed once its first bytes have arrived (or after [`KILL_WAIT`]).
/// Returns whether it had streamed anything.
fn killed_client(target: &Target, client: u64, k: u64) -> Result<bool, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding llmctl itself: {e}"))?;
    let mut cmd = Command::new(exe);
    if let Some(s) = &target.socket {
        cmd.arg("--socket").arg(s);
    }
    cmd.args(["--service", &target.service, "run", "--max-tokens", "400"]);
    if let Some(m) = &target.model {
        cmd.args(["--model", m]);
    }
    let mut child = cmd
        .arg(format!("Letter {client}.{k}: {}", super::BENCH_TEXT))
        .env_remove("LLMD_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting a client to kill: {e}"))?;
    let streamed = Arc::new(AtomicBool::new(false));
    let mut out = child.stdout.take().ok_or("no stdout for the client to kill")?;
    let flag = streamed.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            flag.store(true, Ordering::Relaxed);
        }
    });
    let t = Instant::now();
    while !streamed.load(Ordering::Relaxed) && t.elapsed() < KILL_WAIT {
        if child.try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mid_stream = streamed.load(Ordering::Relaxed);
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    Ok(mid_stream)
}

/// What one client did.
#[derive(Default)]
struct ClientReport {
    records: Vec<Record>,
    /// Actions without a request of their own: churn, reconnect, kill.
    counts: BTreeMap<Action, usize>,
    killed_mid_stream: usize,
    duplicated: usize,
    /// Failures of the client's own steps (connecting, opening a session, starting a child).
    failures: Vec<String>,
}

fn client_loop(
    target: &Target,
    (i, clients): (u64, u64),
    start: Instant,
    stop_at: Instant,
    answered: &AtomicUsize,
) -> ClientReport {
    let mut rep = ClientReport::default();
    let mut rng = Rng(0x11D_50A4 ^ (i + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
    let mut c = match SoakClient::new(target) {
        Ok(c) => c,
        Err(e) => {
            rep.failures.push(format!("client {i}: {e}"));
            return rep;
        }
    };
    let mut k = 0u64;
    while Instant::now() < stop_at {
        k += 1;
        let action = Action::step(i, k, clients, rng.below(100));
        *rep.counts.entry(action).or_default() += 1;
        let step = match action {
            Action::Short | Action::Long | Action::Invalid | Action::Cancel => {
                if let Err(e) = c.work.reset() {
                    Err(format!("reset: {}", client::describe(&e)))
                } else {
                    let req = prompt_of(action, i, k, &mut rng);
                    let cancel = (action == Action::Cancel).then(|| Duration::from_millis(rng.below(200)));
                    rep.records.push(c.request(action, false, &req, cancel, start));
                    answered.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
            }
            Action::Chat => {
                if c.chat_turns >= CHAT_TURNS {
                    c.chat_turns = 0;
                    if let Err(e) = c.chat.reset() {
                        rep.failures.push(format!("client {i}: chat reset: {}", client::describe(&e)));
                    }
                }
                let req = chat_turn(i, k, &mut rng);
                let r = c.request(action, true, &req, None, start);
                if r.outcome == "OK" {
                    c.chat_turns += 1;
                } else {
                    // A failed turn may leave the conversation anywhere: start again.
                    c.chat_turns = CHAT_TURNS;
                }
                rep.records.push(r);
                answered.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Action::Churn => c.reopen_work(),
            Action::Reconnect => {
                rep.duplicated += c.duplicates();
                c.done.clear();
                c.reconnect()
            }
            Action::Kill => killed_client(target, i, k).map(|mid| rep.killed_mid_stream += usize::from(mid)),
        };
        if let Err(e) = step {
            rep.failures.push(format!("client {i}: {} failed: {e}", action.name()));
            // Start afresh rather than stop: the soak goes on, and the failure is reported.
            match SoakClient::new(target) {
                Ok(n) => {
                    rep.duplicated += c.duplicates();
                    c = n;
                }
                Err(e) => {
                    rep.failures.push(format!("client {i}: reconnecting: {e}"));
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    }
    // Late terminal callbacks have a moment to arrive before they are counted.
    std::thread::sleep(Duration::from_millis(500));
    rep.duplicated += c.duplicates();
    rep
}

/// The options of `--soak` that `LoadArgs` does not hold.
pub struct SoakArgs {
    pub minutes: f64,
    pub max_rss_drift_pct: f64,
}

pub fn run(
    socket: Option<&Path>,
    service: &str,
    load: &LoadArgs,
    soak: &SoakArgs,
    json_out: bool,
) -> Result<(), String> {
    if !(soak.minutes.is_finite() && soak.minutes > 0.0) {
        return Err(format!("--soak takes a positive number of minutes, not {}", soak.minutes));
    }
    let target =
        Target { socket: socket.map(Path::to_path_buf), service: service.to_owned(), model: load.model.clone() };
    let duration = Duration::from_secs_f64(soak.minutes * 60.0);
    // About 20 samples a minute in a 30-minute soak, so each minute's median RSS is steady.
    let every = Duration::from_secs_f64((duration.as_secs_f64() / 600.0).clamp(1.0, 5.0));
    let say = |m: &str| {
        if !json_out {
            eprintln!("{m}");
        }
    };
    // The sampler's connection is open from before the first client until after the last.
    let probe = target.connect()?;
    let start = Instant::now();
    let before = sample(&probe, start);
    let Some(pid) = before.pid else {
        return Err("the daemon's state is not readable (dumpState): run the soak as an admin uid".into());
    };
    say(&format!(
        "soak: {} clients for {:.1} min against llmd pid {pid} (RSS {:.1} MB, {} descriptors, {} sessions)",
        load.clients,
        soak.minutes,
        before.rss as f64 / 1e6,
        before.fds,
        before.sessions
    ));
    let stop_at = start + duration;
    let answered = AtomicUsize::new(0);
    let samples = Mutex::new(vec![before.clone()]);
    let clients_done = AtomicBool::new(false);
    let reports: Vec<ClientReport> = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut next_minute = 1u64;
            while !clients_done.load(Ordering::Relaxed) {
                std::thread::sleep(every);
                let smp = sample(&probe, start);
                let minute = (smp.at_s / 60.0) as u64;
                if minute >= next_minute && smp.at_s <= duration.as_secs_f64() + 1.0 {
                    next_minute = minute + 1;
                    say(&format!(
                        "minute {minute}: {} requests answered, RSS {:.1} MB, {} descriptors, {} sessions",
                        answered.load(Ordering::Relaxed),
                        smp.rss as f64 / 1e6,
                        smp.fds,
                        smp.sessions
                    ));
                }
                samples.lock().unwrap_or_else(|p| p.into_inner()).push(smp);
            }
        });
        let hs: Vec<_> = (0..load.clients)
            .map(|i| {
                let (target, answered) = (&target, &answered);
                let clients = load.clients;
                s.spawn(move || client_loop(target, (i, clients), start, stop_at, answered))
            })
            .collect();
        let reps = hs
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| ClientReport {
                    failures: vec!["a client thread panicked".into()],
                    ..ClientReport::default()
                })
            })
            .collect();
        clients_done.store(true, Ordering::Relaxed);
        let _ = sampler.join();
        reps
    });
    let ran_s = start.elapsed().as_secs_f64();
    // Every client is gone: the daemon must let go of their sessions and connections.
    say("soak: clients done; waiting for the daemon to let go of their sessions");
    let settle = Instant::now();
    let after = loop {
        let smp = sample(&probe, start);
        let settled = smp.pid.is_some()
            && smp.sessions <= before.sessions
            && smp.running == 0
            && smp.queued == 0
            && smp.fds <= before.fds;
        if settled || settle.elapsed() >= SETTLE {
            break smp;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let samples = samples.into_inner().unwrap_or_else(|p| p.into_inner());

    // The checks.
    let unanswered_samples = samples.iter().chain([&after]).filter(|s| s.pid.is_none()).count();
    let pids: std::collections::BTreeSet<u64> = samples.iter().chain([&after]).filter_map(|s| s.pid).collect();
    let crashed = unanswered_samples > 0 || pids.len() != 1;
    let records: Vec<&Record> = reports.iter().flat_map(|r| &r.records).collect();
    let lost = records.iter().filter(|r| r.outcome == "LOST").count();
    let duplicated: usize = reports.iter().map(|r| r.duplicated).sum();
    let failures: Vec<&String> = reports.iter().flat_map(|r| &r.failures).collect();
    let total_s = duration.as_secs_f64();
    let width = (total_s / 6.0).min(60.0);
    let window = |from: f64, to: f64| -> Vec<&Sample> {
        samples.iter().filter(|s| s.pid.is_some() && s.at_s > from && s.at_s <= to).collect()
    };
    let early = window(total_s / 6.0 - width, total_s / 6.0);
    let late = window(total_s - width, total_s + 1.0);
    let rss_early = median_u64(early.iter().map(|s| s.rss).collect());
    let rss_late = median_u64(late.iter().map(|s| s.rss).collect());
    let drift_pct = match (rss_early, rss_late) {
        (Some(a), Some(b)) if a > 0 => Some((b as f64 - a as f64) / a as f64 * 100.0),
        _ => None,
    };
    let fds_early = early.iter().map(|s| s.fds).max();
    let fds_late = late.iter().map(|s| s.fds).max();
    let drift_ok = drift_pct.is_some_and(|d| d < soak.max_rss_drift_pct);
    let fds_ok = after.pid.is_some() && after.fds <= before.fds;
    let sessions_ok = after.pid.is_some() && after.sessions <= before.sessions;

    let mut counts: BTreeMap<Action, usize> = BTreeMap::new();
    let mut killed_mid_stream = 0;
    for r in &reports {
        for (a, n) in &r.counts {
            *counts.entry(*a).or_default() += n;
        }
        killed_mid_stream += r.killed_mid_stream;
    }
    let unexpected = records.iter().filter(|r| !r.expected()).count();
    let mut by_code: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &records {
        *by_code.entry(r.outcome.as_str()).or_default() += 1;
    }
    // Latencies of the requests that ran to their end, per kind.
    let kinds = [Action::Short, Action::Chat, Action::Long, Action::Cancel, Action::Invalid];
    let lat = |a: Action| -> (Vec<f64>, Vec<f64>) {
        let of: Vec<&&Record> = records.iter().filter(|r| r.action == a && r.outcome == "OK").collect();
        (of.iter().filter_map(|r| r.ttft_ms).collect(), of.iter().map(|r| r.total_ms).collect())
    };
    // Per minute: requests that ended in it, the median RSS and the most descriptors and
    // sessions of its samples.
    let minutes = (total_s / 60.0).ceil().max(1.0) as usize;
    let per_minute: Vec<_> = (0..minutes)
        .map(|m| {
            // The last minute also holds the requests that ended after the clients' time was up.
            let (a, b) = (m as f64 * 60.0, if m + 1 == minutes { f64::INFINITY } else { (m + 1) as f64 * 60.0 });
            let ss = window(a, b);
            let ended = records.iter().filter(|r| r.at_s > a && r.at_s <= b).count();
            let errors = records.iter().filter(|r| r.at_s > a && r.at_s <= b && !r.expected()).count();
            (
                m + 1,
                ended,
                errors,
                median_u64(ss.iter().map(|s| s.rss).collect()),
                ss.iter().map(|s| s.fds).max(),
                ss.iter().map(|s| s.sessions).max(),
            )
        })
        .collect();
    let passed = !crashed && lost == 0 && duplicated == 0 && drift_ok && fds_ok && sessions_ok && failures.is_empty();

    if json_out {
        crate::out!(
            "{}",
            json!({
                "minutes": soak.minutes, "ran_s": ran_s, "clients": load.clients, "pid": pid,
                "requests": records.len(), "lost": lost, "duplicated": duplicated,
                "crashed": crashed, "unanswered_samples": unanswered_samples, "pids": pids,
                "by_code": by_code, "unexpected": unexpected,
                "actions": counts.iter().map(|(a, n)| (a.name(), *n)).collect::<BTreeMap<_, _>>(),
                "killed_mid_stream": killed_mid_stream,
                "latency_ms": kinds.iter().map(|&a| {
                    let (t, d) = lat(a);
                    (a.name(), json!({"n": d.len(), "ttft_p50": percentile(&t, 50.0), "ttft_p99": percentile(&t, 99.0),
                        "total_p50": percentile(&d, 50.0), "total_p99": percentile(&d, 99.0)}))
                }).collect::<BTreeMap<_, _>>(),
                "rss_early": rss_early, "rss_late": rss_late, "rss_drift_pct": drift_pct,
                "max_rss_drift_pct": soak.max_rss_drift_pct,
                "fds_before": before.fds, "fds_after": after.fds, "fds_early_max": fds_early, "fds_late_max": fds_late,
                "sessions_before": before.sessions, "sessions_after": after.sessions,
                "rss_after": after.rss,
                "samples": samples.iter().map(|s| json!([s.at_s, s.rss, s.fds, s.sessions, s.running, s.queued])).collect::<Vec<_>>(),
                "client_failures": failures,
                "passed": passed,
            })
        );
    } else {
        crate::out!(
            "{:>6} {:>9} {:>10} {:>9} {:>6} {:>9}",
            "minute",
            "requests",
            "unexpected",
            "RSS MB",
            "fds",
            "sessions"
        );
        for (m, n, e, rss, fds, ses) in &per_minute {
            crate::out!(
                "{m:>6} {n:>9} {e:>10} {:>9} {:>6} {:>9}",
                rss.map_or("-".into(), |r| format!("{:.1}", r as f64 / 1e6)),
                fds.map_or("-".into(), |f| f.to_string()),
                ses.map_or("-".into(), |s| s.to_string())
            );
        }
        crate::out!();
        crate::out!(
            "{:<10} {:>7} {:>10} {:>10} {:>10} {:>10}",
            "kind",
            "ended",
            "TTFT p50",
            "TTFT p99",
            "total p50",
            "total p99"
        );
        for a in kinds {
            let (t, d) = lat(a);
            let n = records.iter().filter(|r| r.action == a).count();
            crate::out!(
                "{:<10} {n:>7} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
                a.name(),
                percentile(&t, 50.0),
                percentile(&t, 99.0),
                percentile(&d, 50.0),
                percentile(&d, 99.0)
            );
        }
        crate::out!("(latencies in ms, of requests that completed; a cancelled request ends CANCELLED)");
        crate::out!(
            "answers by code: {}; {unexpected} not the kind's own (a cancel ends CANCELLED or OK, a request without a prompt INVALID_ARGUMENT, the rest OK)",
            by_code.iter().map(|(c, n)| format!("{c} {n}")).collect::<Vec<_>>().join(", ")
        );
        crate::out!(
            "other actions: session churn {}, reconnects {}, clients killed {} ({killed_mid_stream} mid-stream)",
            counts.get(&Action::Churn).unwrap_or(&0),
            counts.get(&Action::Reconnect).unwrap_or(&0),
            counts.get(&Action::Kill).unwrap_or(&0)
        );
        let mark = |ok: bool| if ok { "ok  " } else { "FAIL" };
        crate::out!(
            "{} no crash: {} samples, pid(s) {:?}, {unanswered_samples} unanswered",
            mark(!crashed),
            samples.len() + 1,
            pids
        );
        crate::out!(
            "{} exactly once: {} requests answered, {lost} lost, {duplicated} duplicated",
            mark(lost == 0 && duplicated == 0),
            records.len()
        );
        crate::out!(
            "{} RSS drift {} (median {} over the minute to {:.1} min, {} over the last; limit {}%)",
            mark(drift_ok),
            drift_pct.map_or("-".into(), |d| format!("{d:+.2}%")),
            rss_early.map_or("-".into(), |r| format!("{:.1} MB", r as f64 / 1e6)),
            total_s / 360.0,
            rss_late.map_or("-".into(), |r| format!("{:.1} MB", r as f64 / 1e6)),
            soak.max_rss_drift_pct
        );
        crate::out!(
            "{} descriptors flat: {} before the clients, {} after (most in those minutes: {} and {})",
            mark(fds_ok),
            before.fds,
            after.fds,
            fds_early.map_or("-".into(), |f| f.to_string()),
            fds_late.map_or("-".into(), |f| f.to_string())
        );
        crate::out!(
            "{} sessions released: {} before, {} after; RSS after {:.1} MB",
            mark(sessions_ok),
            before.sessions,
            after.sessions,
            after.rss as f64 / 1e6
        );
        if !failures.is_empty() {
            crate::out!("FAIL client steps that failed ({}):", failures.len());
            for f in failures.iter().take(10) {
                crate::out!("  {f}");
            }
        }
    }
    if passed {
        Ok(())
    } else {
        Err("the soak failed a check (see above)".into())
    }
}

#[cfg(test)]
mod tests {
    use super::Action;

    #[test]
    fn the_clients_first_steps_take_every_action_once_whatever_their_number() {
        for clients in 1..=10u64 {
            let steps = 8u64.div_ceil(clients);
            let mut seen: Vec<Action> =
                (0..clients).flat_map(|i| (1..=steps).map(move |k| Action::step(i, k, clients, 0))).collect();
            seen.sort();
            seen.dedup();
            assert_eq!(seen, Action::ALL, "{clients} clients");
            // After the tour, the roll decides (0 is a short prompt).
            assert_eq!(Action::step(0, steps + 1, clients, 95), Action::Kill);
        }
    }
}
