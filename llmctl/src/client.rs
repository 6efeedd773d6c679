//! `llmctl`'s side of the service: connecting (Unix socket or kernel Binder), streaming a
//! request's callbacks, and the commands that talk to the daemon.

use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::GenerationStats::GenerationStats;
use llmd_aidl::IGenerationCallback::{BnGenerationCallback, IGenerationCallback};
use llmd_aidl::ILlmAdmin::ILlmAdmin;
use llmd_aidl::ILlmService::ILlmService;
use llmd_aidl::ILlmSession::ILlmSession;
use llmd_aidl::SessionOptions::SessionOptions;
use rsbinder::Strong;
use std::io::Write;
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

pub use llmd_aidl::socket_uri;

/// A connection to the daemon.
pub struct Connection {
    pub service: Strong<dyn ILlmService>,
    rpc: Option<rsbinder::Client>,
    name: String,
}

impl Connection {
    /// The admin service ("<name>.admin"): dump and prefetch.
    pub fn admin(&self) -> Result<Strong<dyn ILlmAdmin>, String> {
        let admin = format!("{}.admin", self.name);
        match &self.rpc {
            Some(c) => c
                .get::<dyn ILlmAdmin>(&admin)
                .map_err(|e| format!("no service {admin:?}: {}", crate::output::status_words(&e))),
            None => rsbinder::connect::<dyn ILlmAdmin>(rsbinder::Endpoint::kernel().with_service(&admin))
                .map_err(|e| format!("service {admin:?} not found: {}", crate::output::status_words(&e))),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(session) = self.rpc.as_ref().and_then(|c| c.session()) {
            session.close_session();
        }
    }
}

pub use llmd_aidl::{code_name, error_code_of};

/// Describes a failed Binder call, with the llmd error code when there is one.
pub fn describe(status: &rsbinder::Status) -> String {
    match error_code_of(status) {
        Some(code) => format!("{} ({})", status.message().unwrap_or("service error"), code_name(code)),
        None => format!("{status}"),
    }
}

/// Connects over the Unix socket at `socket`, or through the kernel Binder service manager.
pub fn connect(socket: Option<&Path>, name: &str) -> Result<Connection, String> {
    match socket {
        Some(path) => {
            let abs = std::path::absolute(path).map_err(|e| format!("socket path {}: {e}", path.display()))?;
            if !abs.exists() {
                return Err(format!(
                    "no socket at {} (is llmd running? the path comes from --socket or LLMD_SOCKET)",
                    abs.display()
                ));
            }
            let client = rsbinder::Client::open_with(socket_uri(&abs), |o, _| o.incoming_connections = Some(2))
                .map_err(|e| {
                    format!("cannot connect to llmd at {}: {}", abs.display(), crate::output::status_words(&e))
                })?;
            let service = client.get::<dyn ILlmService>(name).map_err(|e| {
                format!("llmd at {} has no service {name:?}: {}", abs.display(), crate::output::status_words(&e))
            })?;
            Ok(Connection { service, rpc: Some(client), name: name.to_owned() })
        }
        None => {
            rsbinder::ProcessState::init_default()
                .map_err(|e| format!("kernel Binder is not available ({e}); pass --socket PATH or set LLMD_SOCKET"))?;
            rsbinder::ProcessState::start_thread_pool();
            let service = rsbinder::connect::<dyn ILlmService>(rsbinder::Endpoint::kernel().with_service(name))
                .map_err(|e| format!("service {name:?} not found: {}", crate::output::status_words(&e)))?;
            Ok(Connection { service, rpc: None, name: name.to_owned() })
        }
    }
}

/// What a request's callback reports.
#[derive(Debug)]
pub enum Event {
    Started(i64),
    Tokens(String, Vec<i32>),
    Completed(GenerationStats),
    Error(i32, String),
    /// The user pressed Ctrl-C.
    Interrupt,
}

struct StreamCallback {
    tx: Mutex<Sender<Event>>,
}

impl StreamCallback {
    fn send(&self, e: Event) -> rsbinder::BinderResult<()> {
        let _ = self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(e);
        Ok(())
    }
}

impl rsbinder::Interface for StreamCallback {}

impl IGenerationCallback for StreamCallback {
    fn onStarted(&self, id: i64) -> rsbinder::BinderResult<()> {
        self.send(Event::Started(id))
    }
    fn onTokens(&self, _id: i64, text: &str, ids: &[i32]) -> rsbinder::BinderResult<()> {
        self.send(Event::Tokens(text.to_owned(), ids.to_vec()))
    }
    fn onCompleted(&self, _id: i64, stats: &GenerationStats) -> rsbinder::BinderResult<()> {
        self.send(Event::Completed(stats.clone()))
    }
    fn onError(&self, _id: i64, code: i32, message: &str) -> rsbinder::BinderResult<()> {
        self.send(Event::Error(code, message.to_owned()))
    }
}

/// A callback object and the channel its events arrive on.
pub fn callback() -> (Strong<dyn IGenerationCallback>, Sender<Event>, Receiver<Event>) {
    let (tx, rx) = channel();
    let cb = BnGenerationCallback::new_binder(StreamCallback { tx: Mutex::new(tx.clone()) });
    (cb, tx, rx)
}

/// Opens a session on `model` (or the first installed model).
pub fn open_session(conn: &Connection, model: Option<&str>) -> Result<Strong<dyn ILlmSession>, String> {
    let id = match model {
        Some(m) => m.to_owned(),
        None => conn
            .service
            .listModels()
            .map_err(|e| describe(&e))?
            .first()
            .map(|m| m.id.clone())
            .ok_or("llmd has no models")?,
    };
    conn.service
        .openSession(&id, &SessionOptions::default())
        .map_err(|e| format!("opening a session on {id:?}: {}", describe(&e)))
}

/// Sends one request and streams its text to `out` until it ends; Ctrl-C (an `Interrupt`
/// event on `tx`) cancels it. Returns the stats, or the error the daemon reported.
pub fn stream(
    session: &Strong<dyn ILlmSession>,
    req: &GenerateRequest,
    out: &mut dyn Write,
) -> Result<GenerationStats, String> {
    let (cb, tx, rx) = callback();
    let _ = ctrlc_sender().lock().map(|mut s| *s = Some(tx));
    let id = session.generate(req, &cb).map_err(|e| describe(&e))?;
    loop {
        match rx.recv() {
            Ok(Event::Started(_)) => {}
            Ok(Event::Tokens(text, _)) => {
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    // The reader is gone (`llmctl run ... | head -c 10`): the rest is not wanted.
                    let _ = session.cancel(id);
                    crate::output::write_failed(&e);
                }
            }
            Ok(Event::Completed(stats)) => return Ok(stats),
            Ok(Event::Error(code, message)) => {
                return Err(format!("{message} ({})", code_name(llmd_aidl::ErrorCode::ErrorCode(code))))
            }
            Ok(Event::Interrupt) => {
                session.cancel(id).map_err(|e| describe(&e))?;
            }
            Err(_) => return Err("the daemon went away".into()),
        }
    }
}

/// Where Ctrl-C sends its interrupt: the request streaming now, if any.
fn ctrlc_sender() -> &'static Mutex<Option<Sender<Event>>> {
    static SENDER: std::sync::OnceLock<Mutex<Option<Sender<Event>>>> = std::sync::OnceLock::new();
    SENDER.get_or_init(|| {
        let _ = ctrlc::set_handler(|| {
            if let Some(tx) = ctrlc_sender().lock().ok().and_then(|s| s.clone()) {
                let _ = tx.send(Event::Interrupt);
            }
        });
        Mutex::new(None)
    })
}

/// The stats line printed on stderr after a request.
pub fn stats_line(s: &GenerationStats) -> String {
    format!(
        "prompt {} tokens, {:.1} tok/s | generation {} tokens, {:.1} tok/s | queue {} ms | first token {} ms | finish {}",
        s.promptTokens, s.prefillTokensPerSecond, s.generatedTokens, s.decodeTokensPerSecond, s.queueWaitMs, s.timeToFirstTokenMs, s.finishReason
    )
}
