//! The socket's connections: llmd accepts them itself and counts them per uid, so that one
//! app's idle connections cannot use up the daemon's file descriptors and lock everyone else
//! out (with a 128-descriptor limit, 40 idle clients of three connections each would).
//!
//! rsbinder's own accept loop has no per-uid bound: its `max_connections` is one daemon-wide
//! count that leaves every client over it — an operator's `llmctl status` included — waiting in
//! the listen backlog, and its authorizer is told when a connection starts but not when it
//! ends. So llmd runs the accept loop ([`accept_loop`]) on its own listener and hands each
//! admitted connection to rsbinder's RPC server (`RpcServer::serve_connection`), wrapped in a
//! transport that holds the connection's place in the [`Gate`] until its socket is closed
//! (whichever of rsbinder's connection kinds it becomes: a session's first, one more of its
//! serving connections, or a callback connection, which has no thread of its own).
//!
//! The gate's caps: `limits.max_connections_per_uid` per uid (the peer's uid, SO_PEERCRED), and
//! in all `limits.max_connections` — by default the soft `RLIMIT_NOFILE` less a headroom for
//! model files, spill files, the log and the listeners ([`derived_cap`]). An admin uid (the
//! config's `admin_uids`, or llmd's own) passes both, up to the limit less a small reserve, so
//! an operator can always run `llmctl status`. A connection over a cap is closed at once: the
//! client sees its connection end before any byte, and no descriptor stays in use. Refusals are
//! logged at most once a minute per uid (and once a minute for the overall cap), with how many
//! there were since the last line — as the pressure response says "nothing left to shed" once
//! an episode rather than at every poll.
//!
//! When `accept` itself fails — out of descriptors (EMFILE, ENFILE) or memory — the loop backs
//! off ([`BACKOFF`]) and goes on, saying so once until an accept succeeds again; a connection
//! reset before it was accepted is skipped.

use crate::config::Permissions;
use crate::permission::{self, Caller};
use rsbinder::rpc::transport::UnixTransport;
use rsbinder::rpc::{PeerIdentity, RpcResult, RpcServer, RpcTransport};
use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the accept loop waits after `accept` failed for want of descriptors or memory.
pub const BACKOFF: Duration = Duration::from_millis(100);
/// How often the accept loop looks for a pending connection (and its stop flag).
const POLL: Duration = Duration::from_millis(5);
/// Least time between two log lines about refusals, per uid (and for the overall cap).
pub const LOG_EVERY: Duration = Duration::from_secs(60);
/// Descriptors kept free of connections: at least this, or an eighth of the limit.
const HEADROOM_MIN: usize = 32;
/// Descriptors kept free even of admins' connections.
const ADMIN_RESERVE: usize = 16;

/// The soft `RLIMIT_NOFILE` of this process, read from /proc (no unsafe, no libc).
pub fn fd_limit() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = s.lines().find(|l| l.starts_with("Max open files"))?;
    match line.trim_start_matches("Max open files").split_whitespace().next()? {
        "unlimited" => Some(usize::MAX),
        n => n.parse().ok(),
    }
}

/// The connections a descriptor limit leaves room for: the limit less `max(32, limit / 8)`
/// (model files, spill files, the log, the listeners); and, for admins, less 16.
pub fn derived_cap(fd_limit: usize) -> (usize, usize) {
    let overall = fd_limit.saturating_sub(HEADROOM_MIN.max(fd_limit / 8));
    let ceiling = fd_limit.saturating_sub(ADMIN_RESERVE).max(overall);
    (overall.max(1), ceiling.max(1))
}

/// Why a connection was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("uid {uid} has {open} connections open, its cap (limits.max_connections_per_uid)")]
    Uid { uid: u32, open: usize },
    #[error("{open} connections are open, the daemon's cap (limits.max_connections, RLIMIT_NOFILE)")]
    Overall { open: usize },
    #[error("the peer has no uid (not a local socket peer)")]
    NoIdentity,
}

/// Counts open connections per uid and in all, and refuses those over a cap.
pub struct Gate {
    per_uid: usize,
    overall: usize,
    /// Admins may go past `overall`, up to this.
    ceiling: usize,
    permissions: Permissions,
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    open: usize,
    uids: HashMap<u32, UidState>,
    /// Refusals at the overall cap not yet said, and when it was last said.
    overall_refused: u64,
    overall_said: Option<Instant>,
}

#[derive(Default)]
struct UidState {
    open: usize,
    /// Refusals not yet said, and when a refusal was last said.
    refused: u64,
    said: Option<Instant>,
}

/// A connection's place in the [`Gate`]: given back when dropped (its socket closed).
pub struct Admitted {
    gate: Arc<Gate>,
    uid: u32,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gate.release(self.uid);
    }
}

impl Gate {
    /// A gate with `per_uid` connections per uid and `overall` in all, admins up to `ceiling`.
    pub fn new(per_uid: usize, overall: usize, ceiling: usize, permissions: Permissions) -> Self {
        Self {
            per_uid: per_uid.max(1),
            overall: overall.max(1),
            ceiling: ceiling.max(overall).max(1),
            permissions,
            state: Mutex::new(GateState::default()),
        }
    }

    /// The gate the config asks for, under this process's descriptor limit: `max_connections`
    /// (0: derived from the limit) is held to what the limit leaves room for.
    pub fn from_config(config: &crate::config::Config) -> Self {
        let l = &config.limits;
        let (derived, ceiling) = derived_cap(fd_limit().unwrap_or(usize::MAX));
        let overall = match l.max_connections {
            0 => derived,
            n if n > derived => {
                tracing::warn!(
                    "limits.max_connections = {n} is more than RLIMIT_NOFILE leaves room for; using {derived}"
                );
                derived
            }
            n => n,
        };
        Self::new(l.max_connections_per_uid, overall, ceiling, config.permissions.clone())
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a connection of `uid` or says why not (and logs the refusal, at most once a
    /// [`LOG_EVERY`] per uid and for the overall cap).
    pub fn admit(self: &Arc<Self>, uid: u32) -> Result<Admitted, Refused> {
        let admin = permission::is_admin(&self.permissions, Caller { uid, pid: -1 });
        let now = Instant::now();
        let mut st = self.lock();
        let mine = st.uids.get(&uid).map_or(0, |u| u.open);
        let refused = if admin {
            (st.open >= self.ceiling).then_some(Refused::Overall { open: st.open })
        } else if mine >= self.per_uid {
            Some(Refused::Uid { uid, open: mine })
        } else if st.open >= self.overall {
            Some(Refused::Overall { open: st.open })
        } else {
            None
        };
        match refused {
            None => {
                st.open += 1;
                st.uids.entry(uid).or_default().open += 1;
                Ok(Admitted { gate: self.clone(), uid })
            }
            Some(r) => {
                let due = |said: Option<Instant>| said.is_none_or(|t| now.duration_since(t) >= LOG_EVERY);
                match &r {
                    Refused::Uid { .. } => {
                        let u = st.uids.entry(uid).or_default();
                        u.refused += 1;
                        if due(u.said) {
                            tracing::warn!(
                                uid,
                                "connection refused: {r}; {} refused since the last such line (said at most once a minute)",
                                u.refused
                            );
                            u.refused = 0;
                            u.said = Some(now);
                        }
                    }
                    _ => {
                        st.overall_refused += 1;
                        if due(st.overall_said) {
                            tracing::warn!(
                                uid,
                                "connection refused: {r}; {} refused since the last such line (said at most once a minute)",
                                st.overall_refused
                            );
                            st.overall_refused = 0;
                            st.overall_said = Some(now);
                        }
                    }
                }
                Err(r)
            }
        }
    }

    fn release(&self, uid: u32) {
        let mut st = self.lock();
        st.open = st.open.saturating_sub(1);
        if let Some(u) = st.uids.get_mut(&uid) {
            u.open = u.open.saturating_sub(1);
            // Kept while a refusal was said recently, so the once-a-minute bound holds.
            if u.open == 0 && u.said.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
                st.uids.remove(&uid);
            }
        }
    }

    /// Connections open in all, and per uid (those with any), for dump.
    pub fn snapshot(&self) -> (usize, Vec<(u32, usize)>) {
        let st = self.lock();
        let mut uids: Vec<(u32, usize)> =
            st.uids.iter().filter(|(_, u)| u.open > 0).map(|(k, u)| (*k, u.open)).collect();
        uids.sort_unstable();
        (st.open, uids)
    }

    /// The caps: (per uid, overall, admins' ceiling).
    pub fn caps(&self) -> (usize, usize, usize) {
        (self.per_uid, self.overall, self.ceiling)
    }
}

/// A connection's transport (rsbinder's Unix transport) and its place in the gate, given back
/// when rsbinder drops the transport, which closes the socket.
struct Counted {
    inner: UnixTransport,
    _place: Admitted,
}

impl RpcTransport for Counted {
    fn send_frame(&self, buf: &[u8]) -> RpcResult<()> {
        self.inner.send_frame(buf)
    }
    fn recv_frame(&self) -> RpcResult<Vec<u8>> {
        self.inner.recv_frame()
    }
    fn peer_identity(&self) -> PeerIdentity {
        self.inner.peer_identity()
    }
    fn describe(&self) -> &str {
        self.inner.describe()
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> RpcResult<()> {
        self.inner.set_read_timeout(t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> RpcResult<()> {
        self.inner.set_write_timeout(t)
    }
    fn set_liveness(&self, t: Option<Duration>) -> RpcResult<()> {
        self.inner.set_liveness(t)
    }
    fn peer_closed(&self) -> Option<bool> {
        self.inner.peer_closed()
    }
    fn shutdown_handle(&self) -> Option<Box<dyn FnOnce() + Send>> {
        self.inner.shutdown_handle()
    }
    fn shutdown(&self) -> RpcResult<()> {
        self.inner.shutdown()
    }
    fn supports_fd_passing(&self) -> bool {
        self.inner.supports_fd_passing()
    }
    fn send_frame_with_fds(&self, buf: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> RpcResult<()> {
        self.inner.send_frame_with_fds(buf, fds)
    }
    fn recv_frame_with_fds(&self) -> RpcResult<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> {
        self.inner.recv_frame_with_fds()
    }
    fn send_raw(&self, buf: &[u8]) -> RpcResult<()> {
        self.inner.send_raw(buf)
    }
    fn recv_raw(&self, buf: &mut [u8]) -> RpcResult<usize> {
        self.inner.recv_raw(buf)
    }
    fn send_raw_with_fds(&self, buf: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> RpcResult<()> {
        self.inner.send_raw_with_fds(buf, fds)
    }
    fn recv_raw_with_fds(&self, buf: &mut [u8]) -> RpcResult<(usize, Vec<std::os::fd::OwnedFd>)> {
        self.inner.recv_raw_with_fds(buf)
    }
    fn send_raw_draining(
        &self,
        buf: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
        drain: &mut dyn FnMut() -> RpcResult<()>,
    ) -> RpcResult<()> {
        self.inner.send_raw_draining(buf, fds, drain)
    }
}

/// Where the accept loop takes connections from (a listener; a script in the tests).
pub trait Accept {
    fn accept(&self) -> std::io::Result<UnixStream>;
}

impl Accept for UnixListener {
    fn accept(&self) -> std::io::Result<UnixStream> {
        UnixListener::accept(self).map(|(s, _)| s)
    }
}

/// Accepts connections until `stop`, handing each to `serve`. Never ends on an error: a
/// connection reset before it was accepted is skipped; anything else (out of descriptors or
/// memory: EMFILE, ENFILE, ENOMEM, ENOBUFS) backs off [`BACKOFF`] and tries again, said once
/// until an accept succeeds. `listener` is non-blocking: nothing pending waits [`POLL`].
pub fn accept_loop(listener: &impl Accept, stop: &AtomicBool, mut serve: impl FnMut(UnixStream)) {
    let mut failing = false;
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok(stream) => {
                if failing {
                    failing = false;
                    tracing::info!("accepting connections again");
                }
                serve(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::Interrupted
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                ) => {}
            Err(e) => {
                if !failing {
                    failing = true;
                    tracing::warn!(
                        "accepting a connection failed ({e}); backing off {} ms at a time (said once until it succeeds)",
                        BACKOFF.as_millis()
                    );
                }
                std::thread::sleep(BACKOFF);
            }
        }
    }
}

/// Hands an accepted connection to `rpc` if the gate admits its peer's uid; else closes it.
fn admit_and_serve(gate: &Arc<Gate>, rpc: &Arc<RpcServer>, stream: UnixStream) {
    // Accepted sockets do not inherit the listener's O_NONBLOCK on Linux; made sure of here.
    if let Err(e) = stream.set_nonblocking(false) {
        tracing::debug!("accepted socket unusable ({e}); closed");
        return;
    }
    let transport = match UnixTransport::from_stream(stream) {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!("accepted socket unusable ({e:?}); closed");
            return;
        }
    };
    let place = match transport.peer_identity().uid() {
        Some(uid) => gate.admit(uid),
        None => Err(Refused::NoIdentity),
    };
    match place {
        Ok(place) => rpc.serve_connection(Box::new(Counted { inner: transport, _place: place })),
        // Dropping the transport closes the socket: the client sees its connection end.
        Err(Refused::NoIdentity) => tracing::warn!("connection refused: {}", Refused::NoIdentity),
        Err(_) => {}
    }
}

/// llmd's Binder-over-socket server: its listener, rsbinder's RPC server (whose own accept loop
/// never runs) and the accept loop's thread. [`SocketServer::stop`] ends it.
pub struct SocketServer {
    rpc: Arc<RpcServer>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What the socket serves and how.
pub struct SocketOptions {
    pub path: PathBuf,
    /// The socket file's mode, set before its path appears.
    pub mode: u32,
    /// (name, Binder object) pairs published on the socket.
    pub services: Vec<(String, rsbinder::SIBinder)>,
    /// Binder threads per client session (rsbinder's `max_threads`).
    pub threads: u32,
    /// Bounds every send to a client that takes nothing for this long (a stopped client):
    /// rsbinder ends that client's connection (`RpcServer::set_reply_timeout`). None: unbounded.
    pub send_timeout: Option<Duration>,
}

impl SocketServer {
    /// Binds the socket and starts the accept loop. The socket is bound and listening under a
    /// temporary name in the same directory, its mode set whatever the umask, then renamed
    /// into place: a client that sees the path can connect at once (a connect between the bind
    /// and the listen would be refused; seen on a loaded machine).
    pub fn start(o: SocketOptions, gate: Arc<Gate>) -> Result<Self, String> {
        let path = &o.path;
        let dir = path.parent().unwrap_or(Path::new("."));
        if path.exists() {
            std::fs::remove_file(path).map_err(|e| format!("removing stale socket {}: {e}", path.display()))?;
        }
        let tmp = dir.join(format!(".llmd-{}", std::process::id()));
        let unused = dir.join(format!(".llmd-{}.rpc", std::process::id()));
        for p in [&tmp, &unused] {
            if p.exists() {
                std::fs::remove_file(p).map_err(|e| format!("removing stale socket {}: {e}", p.display()))?;
            }
        }
        // rsbinder's server binds a listener of its own, which llmd never accepts on: its path
        // is removed at once, so nothing can reach it.
        let rpc = RpcServer::setup_unix_server(&unused).map_err(|e| format!("setting up the RPC server: {e:?}"))?;
        let _ = std::fs::remove_file(&unused);
        if let rsbinder::entry::WireProfile::Android13Plus(v) = crate::socket_uri(path).wire() {
            rpc.set_android13plus(v.get());
        }
        rpc.set_max_threads(o.threads);
        rpc.set_reply_timeout(o.send_timeout);
        for (name, binder) in o.services {
            rpc.add_service(&name, binder).map_err(|e| format!("publishing {name:?}: {e:?}"))?;
        }
        let listener = UnixListener::bind(&tmp).map_err(|e| format!("binding {}: {e}", tmp.display()))?;
        listener.set_nonblocking(true).map_err(|e| format!("socket {}: {e}", tmp.display()))?;
        let mode = std::os::unix::fs::PermissionsExt::from_mode(o.mode);
        std::fs::set_permissions(&tmp, mode).map_err(|e| format!("setting the socket's mode: {e}"))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("moving the socket into place at {}: {e}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, server) = (stop.clone(), rpc.clone());
        let thread = std::thread::Builder::new()
            .name("llmd-accept".into())
            .spawn(move || accept_loop(&listener, &flag, |s| admit_and_serve(&gate, &server, s)))
            .map_err(|e| format!("starting the accept thread: {e}"))?;
        Ok(Self { rpc, stop, thread: Some(thread) })
    }

    /// Stops accepting, ends every client's connection and joins the threads.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.rpc.stop_accepting();
        self.rpc.terminate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn gate(per_uid: usize, overall: usize, ceiling: usize) -> Arc<Gate> {
        Arc::new(Gate::new(per_uid, overall, ceiling, Permissions { admin_uids: vec![2000], ..Permissions::default() }))
    }

    #[test]
    fn a_uid_at_its_cap_is_refused_while_others_and_admins_are_admitted() {
        let g = gate(3, 5, 7);
        let mine: Vec<Admitted> = (0..3).map(|_| g.admit(10001).expect("under the cap")).collect();
        assert_eq!(g.admit(10001).err(), Some(Refused::Uid { uid: 10001, open: 3 }));
        let other = g.admit(10002).expect("another uid has its own count");
        let _b = g.admit(10003).expect("five in all");
        assert_eq!(g.admit(10004).err(), Some(Refused::Overall { open: 5 }), "the overall cap");
        // An admin passes both caps, up to the ceiling.
        let admins: Vec<Admitted> = (0..2).map(|_| g.admit(2000).expect("admin")).collect();
        assert_eq!(g.admit(2000).err(), Some(Refused::Overall { open: 7 }), "not past the ceiling");
        assert_eq!(g.snapshot(), (7, vec![(2000, 2), (10001, 3), (10002, 1), (10003, 1)]));
        // A closed connection gives its place back.
        drop(mine);
        drop(other);
        drop(admins);
        assert_eq!(g.snapshot(), (1, vec![(10003, 1)]));
        assert!(g.admit(10001).is_ok());
    }

    #[test]
    fn the_cap_left_by_a_descriptor_limit_keeps_headroom() {
        assert_eq!(derived_cap(128), (96, 112));
        assert_eq!(derived_cap(1024), (896, 1008));
        assert_eq!(derived_cap(20), (1, 4));
        assert!(fd_limit().is_some_and(|n| n > 0), "RLIMIT_NOFILE readable from /proc");
    }

    /// A listener whose `accept` fails as scripted, then has nothing pending.
    struct Failing {
        errors: Mutex<Vec<std::io::Error>>,
        calls: AtomicUsize,
    }

    impl Accept for Failing {
        fn accept(&self) -> std::io::Result<UnixStream> {
            self.calls.fetch_add(1, Ordering::AcqRel);
            match self.errors.lock().unwrap_or_else(|p| p.into_inner()).pop() {
                Some(e) => Err(e),
                None => Err(std::io::ErrorKind::WouldBlock.into()),
            }
        }
    }

    #[test]
    fn out_of_descriptors_the_accept_loop_backs_off_and_goes_on() {
        const EMFILE: i32 = 24;
        let l = Arc::new(Failing {
            errors: Mutex::new((0..5).map(|_| std::io::Error::from_raw_os_error(EMFILE)).collect()),
            calls: AtomicUsize::new(0),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (l2, s2) = (l.clone(), stop.clone());
        let t = std::thread::spawn(move || accept_loop(&*l2, &s2, |_| panic!("nothing to serve")));
        let started = Instant::now();
        while l.calls.load(Ordering::Acquire) < 6 {
            assert!(started.elapsed() < Duration::from_secs(10), "the loop stopped trying");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Five failures cost five back-offs: no spinning on EMFILE.
        assert!(started.elapsed() >= BACKOFF * 5 - Duration::from_millis(20), "{:?}", started.elapsed());
        stop.store(true, Ordering::Release);
        t.join().expect("the loop ends when asked, not on an error");
    }
}
