//! The permission matrix — every AIDL method × caller class, with the expected result of
//! each cell, on the socket transport (each caller's uid comes from its peer credentials: the
//! classes other than llmd's own uid are this test binary run again as that uid by `setpriv`).
//! The same table is in `docs/RELIABILITY.md` (`## Permission matrix`).
//!
//! The daemon runs as root with `allowed_uids = [10001, 10002]` and the default
//! `admin_uids = [0, 2000]`. Classes: the owning app (uid 10001, which opened the session the
//! session rows are about), another allowed app (10002), a uid without the permission
//! (10003), the shell (2000, an admin uid) and llmd's own uid (system on a device; root here).
//!
//! Session rows (`ILlmSession` methods on the owner's session): over the socket another uid
//! cannot even address the owner's session object — rsbinder keeps each connection session's
//! objects in a table of its own and refuses a connection of another uid joining a session —
//! so for the other classes these cells are decided by `permission::check_owner`, the guard
//! every `ILlmSession` method calls first, called here with each class's identity (on kernel
//! Binder an app can hand its session's Binder object to another, which is what the guard is
//! for). What another uid *can* try over the socket is tested for real: naming the owner's
//! request id in a `cancel` on a session of its own (row `cancel(guessed request id)`), and
//! reading the owner's sessions through `getStatus` or `dump`.

mod common;

use common::client::{self, Connection, Event};
use common::greedy;
use llmd_aidl::ErrorCode::ErrorCode;
use llmd_aidl::SessionOptions::SessionOptions;
use llmd_daemon::error::error_code_of;
use llmd_daemon::permission::{check_owner, Caller};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The caller classes, in the table's column order.
const CLASSES: [&str; 5] = ["owner app", "another app", "no permission", "shell", "llmd's uid"];
/// Their uids (llmd's own is root: the test and its daemon run as root).
const UIDS: [u32; 5] = [10001, 10002, 10003, 2000, 0];

/// Every method (and the attacks a caller can make on the socket) × class: the expected result.
/// `ok` — served; `ok, own only` — status counts the caller's own sessions alone; `ok, all` —
/// everyone's; `PERMISSION_DENIED` / `SESSION_CLOSED` — refused with that code; `no effect` —
/// accepted and nothing happens to the owner's request.
pub const MATRIX: &[(&str, [&str; 5])] = &[
    ("ILlmService.listModels", ["ok", "ok", "PERMISSION_DENIED", "ok", "ok"]),
    ("ILlmService.getModelInfo", ["ok", "ok", "PERMISSION_DENIED", "ok", "ok"]),
    ("ILlmService.openSession", ["ok", "ok", "PERMISSION_DENIED", "ok", "ok"]),
    ("ILlmService.getStatus", ["ok, own only", "ok, own only", "PERMISSION_DENIED", "ok, all", "ok, all"]),
    (
        "ILlmSession.generate (owner's session)",
        ["ok", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED"],
    ),
    (
        "ILlmSession.cancel (owner's session)",
        ["ok", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED"],
    ),
    (
        "ILlmSession.countTokens (owner's session)",
        ["ok", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED"],
    ),
    (
        "ILlmSession.reset (owner's session)",
        ["ok", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED"],
    ),
    (
        "ILlmSession.close (owner's session)",
        ["ok", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED"],
    ),
    (
        "ILlmSession, any method, after close",
        ["SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED", "SESSION_CLOSED"],
    ),
    (
        "cancel(the owner's request id) on the caller's own session",
        ["ok", "no effect", "PERMISSION_DENIED", "no effect", "no effect"],
    ),
    ("ILlmAdmin.prefetch", ["PERMISSION_DENIED", "PERMISSION_DENIED", "PERMISSION_DENIED", "ok", "ok"]),
    ("ILlmAdmin.dumpState", ["PERMISSION_DENIED", "PERMISSION_DENIED", "PERMISSION_DENIED", "ok", "ok"]),
];

/// A call's result as the table words it.
fn word<T>(r: &Result<T, rsbinder::Status>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(s) => match error_code_of(s) {
            Some(c) => llmd_daemon::error::code_name(c).to_owned(),
            None => format!("transport error {s}"),
        },
    }
}

fn say(row: &str, result: &str) {
    println!("MATRIX {row}\t{result}");
}

/// A caller that is not the owner: the service and admin methods, its own session, the
/// attacks it can make on the socket with what it knows of the owner (the id of a request
/// the owner has running), and what status shows it of the others' sessions. `held`: sessions
/// this caller already holds (the in-process caller's bystander session). Returns (row, result).
fn as_another_caller(conn: &Connection, guessed_request: i64, held: i32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut push = |row: &str, r: String| out.push((row.to_owned(), r));
    push("ILlmService.listModels", word(&conn.service.listModels()));
    push("ILlmService.getModelInfo", word(&conn.service.getModelInfo(MODEL_ID)));
    let own = conn.service.openSession(MODEL_ID, &SessionOptions::default());
    push("ILlmService.openSession", word(&own));
    push("ILlmService.getStatus", status_word(conn, held + own.is_ok() as i32, 0));
    // Accepted or not, whether it reached the owner's request is the owner's to see.
    let cancel = match &own {
        Ok(s) => word(&s.cancel(guessed_request)).replace("ok", "no effect"),
        Err(_) => word(&own),
    };
    push("cancel(the owner's request id) on the caller's own session", cancel);
    let admin = conn.admin().expect("the admin service is found (its methods check the caller)");
    push("ILlmAdmin.prefetch", word(&admin.prefetch(MODEL_ID)));
    push("ILlmAdmin.dumpState", word(&admin.dumpState()));
    out
}

/// `getStatus` in the table's words, for a caller that holds `sessions` sessions with
/// `running` requests running, while others hold sessions too (the test's bystander session,
/// the owner's): `own only` when it counts exactly the caller's, `all` when it counts more.
fn status_word(conn: &Connection, sessions: i32, running: i32) -> String {
    match conn.service.getStatus() {
        Ok(st) if st.sessionsOpen == sessions && st.requestsRunning == running => "ok, own only".into(),
        Ok(st) if st.sessionsOpen > sessions => "ok, all".into(),
        Ok(st) => format!("ok, unexpected {st:?}"),
        Err(e) => word::<()>(&Err(e)),
    }
}

/// The owner: everything on its own session, a long request the others try to cancel, its
/// own cancel of it, then close.
fn as_owner(conn: &Connection) {
    say("ILlmService.listModels", &word(&conn.service.listModels()));
    say("ILlmService.getModelInfo", &word(&conn.service.getModelInfo(MODEL_ID)));
    let s = conn.service.openSession(MODEL_ID, &SessionOptions::default());
    say("ILlmService.openSession", &word(&s));
    let s = s.expect("the owner's session");
    say("ILlmSession.countTokens (owner's session)", &word(&s.countTokens("How many tokens is this?")));
    let (cb, _tx, rx) = client::callback();
    let r = s.generate(&greedy("The capital of France is", 4), &cb);
    say("ILlmSession.generate (owner's session)", &word(&r));
    wait_end(&rx);
    say("ILlmSession.reset (owner's session)", &word(&s.reset()));
    // The long request the others will name: still running while they try.
    let (cb, _tx2, rx) = client::callback();
    let id = s.generate(&greedy("1, 2, 3, 4, 5, 6, 7, 8,", 4000), &cb).expect("the long request");
    while !matches!(rx.recv_timeout(Duration::from_secs(60)).expect("tokens"), Event::Tokens(..)) {}
    say("ILlmService.getStatus", &status_word(conn, 1, 1));
    let admin = conn.admin().expect("admin service");
    say("ILlmAdmin.prefetch", &word(&admin.prefetch(MODEL_ID)));
    say("ILlmAdmin.dumpState", &word(&admin.dumpState()));
    println!("MATRIX-LONG {id}");
    // The others have tried when the test says so.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    let mut ended_by_others = None;
    while let Ok(e) = rx.try_recv() {
        if let Event::Error(c, m) = e {
            ended_by_others = Some(format!("{} {m}", llmd_daemon::error::code_name(ErrorCode(c))));
        }
    }
    // Still streaming: nobody else's cancel reached it.
    let still = ended_by_others.is_none() && {
        let t = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(Event::Tokens(..)) => break true,
                Ok(Event::Error(..)) | Ok(Event::Completed(_)) | Err(_) => break false,
                Ok(_) if t.elapsed() > Duration::from_secs(30) => break false,
                Ok(_) => {}
            }
        }
    };
    println!("MATRIX-UNTOUCHED {}", if still { "yes".to_owned() } else { format!("no: {ended_by_others:?}") });
    let r = s.cancel(id);
    // (Its end already came if someone else's cancel reached it.)
    let end = if still { wait_end(&rx) } else { Some("CANCELLED".to_owned()) };
    say(
        "ILlmSession.cancel (owner's session)",
        &if end.as_deref() == Some("CANCELLED") { word(&r) } else { format!("{} then {end:?}", word(&r)) },
    );
    say("cancel(the owner's request id) on the caller's own session", &word(&r));
    say("ILlmSession.close (owner's session)", &word(&s.close()));
    let after = [
        word(&s.generate(&greedy("Hello", 2), &cb)),
        word(&s.cancel(id)),
        word(&s.countTokens("Hello")),
        word(&s.reset()),
        word(&s.close()),
    ];
    let same = after.iter().all(|w| *w == after[0]);
    say("ILlmSession, any method, after close", if same { &after[0] } else { "mixed" });
}

/// Waits for a request's end: `None` when it completed, else its error code's name.
fn wait_end(rx: &std::sync::mpsc::Receiver<Event>) -> Option<String> {
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("the request ends") {
            Event::Completed(_) => return None,
            Event::Error(c, _) => return Some(llmd_daemon::error::code_name(ErrorCode(c)).to_owned()),
            _ => {}
        }
    }
}

/// Not a test of its own: a caller of the matrix, run by [`the_permission_matrix_holds`] as
/// another uid through setpriv (`LLMD_MATRIX_SOCKET` set; without it, it does nothing).
#[test]
#[ignore = "a helper that the matrix test runs as another uid"]
fn matrix_caller() {
    let Some(socket) = std::env::var_os("LLMD_MATRIX_SOCKET").map(PathBuf::from) else { return };
    let conn = client::connect(&socket, "llmd").expect("connects");
    if std::env::var_os("LLMD_MATRIX_PROBE").is_some() {
        say("ILlmService.listModels", &word(&conn.service.listModels()));
        say("ILlmService.openSession", &word(&conn.service.openSession(MODEL_ID, &SessionOptions::default())));
        println!("MATRIX-DONE");
        return;
    }
    match std::env::var("LLMD_MATRIX_GUESS").ok().and_then(|g| g.parse().ok()) {
        Some(guess) => as_another_caller(&conn, guess, 0).iter().for_each(|(row, r)| say(row, r)),
        None => as_owner(&conn),
    }
    println!("MATRIX-DONE");
}

/// This test binary as `uid`, running [`matrix_caller`].
fn spawn_as(uid: u32, socket: &Path, guess: Option<i64>) -> Child {
    spawn_with(uid, socket, guess.map(|g| ("LLMD_MATRIX_GUESS", g.to_string())))
}

fn spawn_with(uid: u32, socket: &Path, env: Option<(&str, String)>) -> Child {
    let mut c = Command::new("setpriv");
    c.args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups"])
        .arg(std::env::current_exe().expect("the test binary"))
        .args(["--ignored", "--exact", "matrix_caller", "--nocapture", "--test-threads", "1"])
        .env("LLMD_MATRIX_SOCKET", socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some((k, v)) = env {
        c.env(k, v);
    }
    c.spawn().expect("setpriv runs the caller")
}

/// Reads a caller's `MATRIX` lines into `cells` (column `col`) until `until` (a line prefix).
fn read_lines(
    out: &mut impl BufRead,
    col: usize,
    cells: &mut BTreeMap<String, [String; 5]>,
    until: &str,
) -> Option<String> {
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).ok()? == 0 {
            return None;
        }
        // libtest may have begun the line ("test matrix_caller ... ").
        let Some(i) = line.find("MATRIX") else { continue };
        let l = line[i..].trim_end();
        if let Some(rest) = l.strip_prefix("MATRIX ") {
            if let Some((row, result)) = rest.split_once('\t') {
                cells.entry(row.to_owned()).or_default()[col] = result.to_owned();
            }
        } else if l.starts_with(until) {
            return Some(l.to_owned());
        }
    }
}

struct Daemon {
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- llmd's log ---\n{}", std::fs::read_to_string(self.dir.join("llmd.log")).unwrap_or_default());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_daemon(config: &str) -> Daemon {
    let dir = std::env::temp_dir().join(format!("llmd-matrix-{}-{}", std::process::id(), config.len()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let socket = dir.join("llmd.sock");
    let cfg = dir.join("llmd.toml");
    std::fs::write(&cfg, format!("socket_mode = \"0666\"\n{config}")).expect("config");
    let child = Command::new(env!("CARGO_BIN_EXE_llmd"))
        .args(["--config", cfg.to_str().expect("path"), "--model", common::model().to_str().expect("path")])
        .args(["--socket", socket.to_str().expect("path"), "--kernel-binder", "off", "--threads", "2"])
        .env("LLMD_LOG", "warn")
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(dir.join("llmd.log")).expect("log"))
        .spawn()
        .expect("llmd starts");
    let d = Daemon { child, socket, dir };
    let t = Instant::now();
    while !d.socket.exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "llmd did not create its socket");
        std::thread::sleep(Duration::from_millis(50));
    }
    d
}

/// The table as markdown, as `docs/RELIABILITY.md` has it.
fn markdown(rows: &[(String, [String; 5])]) -> String {
    let mut s = format!("| method | {} |\n|---|{}\n", CLASSES.join(" | "), "---|".repeat(CLASSES.len()));
    for (m, cells) in rows {
        s += &format!("| {m} | {} |\n", cells.join(" | "));
    }
    s
}

#[test]
fn the_permission_matrix_holds() {
    let d = start_daemon("[permissions]\nallowed_uids = [10001, 10002]\n");
    // llmd's own uid (in-process) holds a session throughout: a status that counts it is
    // not the caller's own.
    let bystander = client::connect(&d.socket, "llmd").expect("connects");
    let _held = bystander.service.openSession(MODEL_ID, &SessionOptions::default()).expect("a session");
    let mut seen: BTreeMap<String, [String; 5]> = BTreeMap::new();
    // The owner first: it stops with its long request running and says its id.
    let mut owner = spawn_as(UIDS[0], &d.socket, None);
    let mut owner_out = std::io::BufReader::new(owner.stdout.take().expect("stdout"));
    let long = read_lines(&mut owner_out, 0, &mut seen, "MATRIX-LONG").expect("the owner's long request");
    let guess: i64 = long.trim_start_matches("MATRIX-LONG ").parse().expect("an id");
    // The other classes while it runs: three other uids, then llmd's own in-process.
    for col in 1..4 {
        let mut c = spawn_as(UIDS[col], &d.socket, Some(guess));
        let mut out = std::io::BufReader::new(c.stdout.take().expect("stdout"));
        read_lines(&mut out, col, &mut seen, "MATRIX-DONE")
            .unwrap_or_else(|| panic!("{} did not finish", CLASSES[col]));
        assert!(c.wait().expect("ends").success(), "{}", CLASSES[col]);
    }
    for (row, result) in as_another_caller(&bystander, guess, 1) {
        seen.entry(row).or_default()[4] = result;
    }
    // Now the owner looks at its request, cancels it itself, and closes.
    owner.stdin.as_mut().expect("stdin").write_all(b"go\n").expect("told");
    let untouched = read_lines(&mut owner_out, 0, &mut seen, "MATRIX-UNTOUCHED").expect("the owner's verdict");
    read_lines(&mut owner_out, 0, &mut seen, "MATRIX-DONE").expect("the owner finished");
    assert!(owner.wait().expect("ends").success());
    // The owner's request survived every other caller's cancel of its id.
    if untouched != "MATRIX-UNTOUCHED yes" {
        for col in 1..5 {
            let cell =
                &mut seen.get_mut("cancel(the owner's request id) on the caller's own session").expect("row")[col];
            if cell == "no effect" {
                *cell = format!("cancelled the owner's request ({untouched})");
            }
        }
    }
    // Session rows for the other classes: the guard every ILlmSession method calls first,
    // open session or closed.
    let owner_caller = Caller { uid: UIDS[0], pid: 1 };
    for method in ["generate", "cancel", "countTokens", "reset", "close", "any method, after close"] {
        let row = if method.starts_with("any") {
            format!("ILlmSession, {method}")
        } else {
            format!("ILlmSession.{method} (owner's session)")
        };
        for (col, &uid) in UIDS.iter().enumerate().skip(1).take(4) {
            seen.entry(row.clone()).or_default()[col] =
                match check_owner(owner_caller, Caller { uid, pid: 1 }, 1, "matrix") {
                    Ok(()) => "ok".into(),
                    Err(e) => llmd_daemon::error::code_name(e.code()).to_owned(),
                };
        }
    }
    let expected: Vec<(String, [String; 5])> =
        MATRIX.iter().map(|(m, cells)| (m.to_string(), cells.map(str::to_owned))).collect();
    let observed: Vec<(String, [String; 5])> =
        MATRIX.iter().map(|(m, _)| (m.to_string(), seen.get(*m).cloned().unwrap_or_default())).collect();
    assert_eq!(
        markdown(&observed),
        markdown(&expected),
        "the permission matrix differs (observed, then expected):\n{}\n{}",
        markdown(&observed),
        markdown(&expected)
    );
    // The doc's table is this one.
    let doc = std::fs::read_to_string(common::root().join("docs/RELIABILITY.md")).expect("docs/RELIABILITY.md");
    assert!(
        doc.contains(&markdown(&expected)),
        "docs/RELIABILITY.md's matrix is not the test's:\n{}",
        markdown(&expected)
    );
}

/// With no `[permissions]` at all the service is closed: an app's uid is refused every
/// call, the shell and llmd's own uid are served. An empty `allowed_uids` (the default)
/// admits no app's uid.
#[test]
fn with_no_permissions_configured_only_admins_are_served() {
    let d = start_daemon("");
    let mut got: BTreeMap<String, [String; 5]> = BTreeMap::new();
    for col in [0, 2, 3] {
        let mut c = spawn_with(UIDS[col], &d.socket, Some(("LLMD_MATRIX_PROBE", "1".into())));
        let mut out = std::io::BufReader::new(c.stdout.take().expect("stdout"));
        read_lines(&mut out, col, &mut got, "MATRIX-DONE").unwrap_or_else(|| panic!("{} did not finish", CLASSES[col]));
        assert!(c.wait().expect("ends").success());
    }
    let conn = client::connect(&d.socket, "llmd").expect("connects");
    got.entry("ILlmService.listModels".into()).or_default()[4] = word(&conn.service.listModels());
    got.entry("ILlmService.openSession".into()).or_default()[4] =
        word(&conn.service.openSession(MODEL_ID, &SessionOptions::default()));
    for row in ["ILlmService.listModels", "ILlmService.openSession"] {
        let cells = &got[row];
        assert_eq!(
            [&cells[0], &cells[2], &cells[3], &cells[4]],
            ["PERMISSION_DENIED", "PERMISSION_DENIED", "ok", "ok"],
            "{row}: owner app (10001, not listed), no permission (10003), shell, llmd's uid"
        );
    }
}
