//! A kernel-Binder check of the permission matrix, run in the VM tier
//! (`tests/kernel-binder/run.sh`), not a tool: an app hands its session's Binder object to
//! another app, which is what kernel Binder allows and the socket does not. The owner (`owner`,
//! run as one uid) opens a session and registers it with the service manager as
//! `llmd.leaked`; the other app (`other`, run as another uid) gets it from there and calls
//! every `ILlmSession` method on it: each must be refused with `SESSION_CLOSED` (the daemon's
//! `permission::check_owner`), and the owner's session must still work afterwards.
//!
//! Lines: `HANDOFF <who> <what> <result>`, where result is `ok` or an `ErrorCode` name.

use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::GenerationStats::GenerationStats;
use llmd_aidl::IGenerationCallback::{BnGenerationCallback, IGenerationCallback};
use llmd_aidl::ILlmService::ILlmService;
use llmd_aidl::ILlmSession::ILlmSession;
use llmd_aidl::SessionOptions::SessionOptions;
use std::path::Path;
use std::time::{Duration, Instant};

const LEAKED: &str = "llmd.leaked";

struct Ignore;
impl rsbinder::Interface for Ignore {}
impl IGenerationCallback for Ignore {
    fn onStarted(&self, _: i64) -> rsbinder::BinderResult<()> {
        Ok(())
    }
    fn onTokens(&self, _: i64, _: &str, _: &[i32]) -> rsbinder::BinderResult<()> {
        Ok(())
    }
    fn onCompleted(&self, _: i64, _: &GenerationStats) -> rsbinder::BinderResult<()> {
        Ok(())
    }
    fn onError(&self, _: i64, _: i32, _: &str) -> rsbinder::BinderResult<()> {
        Ok(())
    }
}

fn word<T>(r: &Result<T, rsbinder::Status>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(s) => llmd_aidl::error_code_of(s).map_or_else(|| format!("{s}"), |c| llmd_aidl::code_name(c).to_owned()),
    }
}

fn say(who: &str, what: &str, result: &str) {
    println!("HANDOFF {who} {what} {result}");
}

fn owner(done: &Path) -> Result<(), String> {
    let svc = rsbinder::connect::<dyn ILlmService>(rsbinder::Endpoint::kernel().with_service("llmd"))
        .map_err(|e| format!("llmd not found: {e:?}"))?;
    let model = svc.listModels().map_err(|e| format!("listModels: {e}"))?.first().map(|m| m.id.clone());
    let session = svc
        .openSession(&model.ok_or("no model")?, &SessionOptions::default())
        .map_err(|e| format!("openSession: {e}"))?;
    say("owner", "countTokens", &word(&session.countTokens("Hello there")));
    rsbinder::hub::add_service(LEAKED, session.as_binder()).map_err(|e| format!("add_service: {e}"))?;
    say("owner", "registered", "ok");
    let t = Instant::now();
    while !done.exists() && t.elapsed() < Duration::from_secs(300) {
        std::thread::sleep(Duration::from_millis(50));
    }
    // The other app's calls changed nothing: the session is open and the owner's.
    say("owner", "countTokens-after", &word(&session.countTokens("Hello there")));
    say("owner", "reset-after", &word(&session.reset()));
    say("owner", "close", &word(&session.close()));
    Ok(())
}

fn other() -> Result<(), String> {
    let s = rsbinder::hub::wait_for_interface::<dyn ILlmSession>(LEAKED).map_err(|e| format!("{LEAKED}: {e:?}"))?;
    let cb = BnGenerationCallback::new_binder(Ignore);
    let req = GenerateRequest { prompt: "The capital of France is".into(), maxTokens: 4, ..Default::default() };
    say("other", "generate", &word(&s.generate(&req, &cb)));
    say("other", "cancel", &word(&s.cancel(1)));
    say("other", "countTokens", &word(&s.countTokens("Hello")));
    say("other", "reset", &word(&s.reset()));
    say("other", "close", &word(&s.close()));
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Err(e) = rsbinder::ProcessState::init_default() {
        eprintln!("session_handoff: no kernel Binder: {e}");
        return std::process::ExitCode::FAILURE;
    }
    rsbinder::ProcessState::start_thread_pool();
    let r = match args.get(1).map(String::as_str) {
        Some("owner") => owner(Path::new(args.get(2).map_or("/tmp/handoff.done", String::as_str))),
        Some("other") => other(),
        _ => Err("usage: session_handoff owner [DONE_FILE] | other".into()),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("session_handoff: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
