//! The daemon's tests' Binder client: a connection over the daemon's Unix socket, the admin
//! service, a callback object whose events arrive on a channel, and error descriptions. The
//! command line's client (`llmctl::client`) does the same and more (kernel Binder, streaming,
//! Ctrl-C); the service's tests keep this small one so that they do not depend on llmctl.

use llmd_aidl::GenerationStats::GenerationStats;
use llmd_aidl::IGenerationCallback::{BnGenerationCallback, IGenerationCallback};
use llmd_aidl::ILlmAdmin::ILlmAdmin;
use llmd_aidl::ILlmService::ILlmService;
use llmd_daemon::error::{code_name, error_code_of};
use rsbinder::Strong;
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

/// A connection to the daemon.
pub struct Connection {
    pub service: Strong<dyn ILlmService>,
    rpc: rsbinder::Client,
    name: String,
}

impl Connection {
    /// The admin service ("<name>.admin"): dump and prefetch.
    pub fn admin(&self) -> Result<Strong<dyn ILlmAdmin>, String> {
        let admin = format!("{}.admin", self.name);
        self.rpc.get::<dyn ILlmAdmin>(&admin).map_err(|e| format!("no service {admin:?}: {e:?}"))
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(session) = self.rpc.session() {
            session.close_session();
        }
    }
}

/// Describes a failed Binder call, with the llmd error code when there is one.
pub fn describe(status: &rsbinder::Status) -> String {
    match error_code_of(status) {
        Some(code) => format!("{} ({})", status.message().unwrap_or("service error"), code_name(code)),
        None => format!("{status}"),
    }
}

/// Connects over the Unix socket at `socket`, on the endpoint the daemon serves
/// (`llmd_daemon::socket_uri`).
pub fn connect(socket: &Path, name: &str) -> Result<Connection, String> {
    let abs = std::path::absolute(socket).map_err(|e| format!("socket path {}: {e}", socket.display()))?;
    let client = rsbinder::Client::open_with(llmd_daemon::socket_uri(&abs), |o, _| o.incoming_connections = Some(2))
        .map_err(|e| format!("cannot connect to llmd at {}: {e:?}", abs.display()))?;
    let service = client
        .get::<dyn ILlmService>(name)
        .map_err(|e| format!("llmd at {} has no service {name:?}: {e:?}", abs.display()))?;
    Ok(Connection { service, rpc: client, name: name.to_owned() })
}

/// What a request's callback reports.
#[derive(Debug)]
pub enum Event {
    Started(i64),
    Tokens(String, Vec<i32>),
    Completed(GenerationStats),
    Error(i32, String),
}

struct EventCallback {
    tx: Mutex<Sender<Event>>,
}

impl EventCallback {
    fn send(&self, e: Event) -> rsbinder::BinderResult<()> {
        let _ = self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(e);
        Ok(())
    }
}

impl rsbinder::Interface for EventCallback {}

impl IGenerationCallback for EventCallback {
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
    let cb = BnGenerationCallback::new_binder(EventCallback { tx: Mutex::new(tx.clone()) });
    (cb, tx, rx)
}
