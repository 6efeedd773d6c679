//! The daemon as Binder sees it: [`Daemon`] (started once by `llmd`), the service object
//! (`ILlmService`: models, sessions, status) and the admin object (`ILlmAdmin`: prefetch,
//! dump).
//!
//! Each Binder method guards (the caller's identity and permission), calls a private method,
//! and maps its `ServiceError` to a Binder status in one place (`ServiceError::into_status`),
//! as Android's keystore2 does.

use crate::conversation::SessionCore;
use crate::error::ServiceError;
use crate::permission::{self, Access, Caller};
use crate::pressure::Pressure;
use crate::residency::{PressureSource, Residency};
use crate::scheduler::outbox::undelivered;
use crate::session::SessionBinder;
use crate::shared::Shared;
use llmd_aidl::ILlmAdmin::{BnLlmAdmin, ILlmAdmin};
use llmd_aidl::ILlmService::{BnLlmService, ILlmService};
use llmd_aidl::ILlmSession::ILlmSession;
use llmd_aidl::ModelInfo::ModelInfo;
use llmd_aidl::ServiceStatus::ServiceStatus;
use llmd_aidl::SessionOptions::SessionOptions;
use rsbinder::Strong;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stopping daemon waits for cancelled requests to end.
const DRAIN_CANCEL_WAIT: Duration = Duration::from_secs(5);
/// How long it then waits for their last callbacks to reach their clients (a frozen client
/// is not waited for longer).
const DRAIN_DELIVERY_WAIT: Duration = Duration::from_secs(2);

/// What [`Daemon::drain`] did.
#[derive(Debug, Clone, Copy)]
pub struct DrainReport {
    /// Requests queued or running when the daemon began to stop.
    pub in_flight: usize,
    /// Of those, cancelled when the grace ran out.
    pub cancelled: usize,
    /// Still booked when the drain gave up waiting (0 normally).
    pub left: usize,
    /// Some callbacks were still undelivered (a client that does not read).
    pub undelivered: bool,
    pub took: Duration,
}

/// The running daemon: its shared state and its memory-pressure response.
pub struct Daemon {
    pub shared: Arc<Shared>,
    pressure: Arc<Pressure>,
}

impl Daemon {
    /// Builds the shared state and starts the engine worker thread and the residency monitor
    /// (memory pressure, predicted prefetch).
    pub fn start(
        config: crate::config::Config,
        residency: Residency,
        pressure: Box<dyn PressureSource>,
    ) -> std::io::Result<Self> {
        let shared = Shared::start(config, residency)?;
        let pressure = Arc::new(Pressure::new(pressure));
        pressure.spawn(&shared)?;
        Ok(Self { shared, pressure })
    }

    /// Loads pinned models, then the others the budget has room for (see the config).
    pub fn load_at_start(&self) {
        self.shared.load_at_start();
    }

    /// Stops taking requests and lets those in flight end: each has `grace` to finish, then
    /// is cancelled (its client gets `onError(CANCELLED)`, its turn rolled back); returns once
    /// every request has ended and its callbacks are delivered, or a bound has passed.
    /// The usage history and spilled KV caches are already on storage.
    pub fn drain(&self, grace: Duration) -> DrainReport {
        let a = &self.shared.scheduler.admission;
        a.close();
        let started = Instant::now();
        let in_flight = a.in_flight();
        let wait = |until: Instant, done: &dyn Fn() -> bool| {
            while !done() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            done()
        };
        let finished = wait(started + grace, &|| a.in_flight() == 0);
        let cancelled = if finished { 0 } else { a.in_flight() };
        if !finished {
            a.cancel_all();
            // A cancel lands at the worker's next pass boundary: well under a second.
            wait(Instant::now() + DRAIN_CANCEL_WAIT, &|| a.in_flight() == 0);
        }
        let delivered = wait(Instant::now() + DRAIN_DELIVERY_WAIT, &|| undelivered() == 0);
        DrainReport { in_flight, cancelled, left: a.in_flight(), undelivered: !delivered, took: started.elapsed() }
    }

    /// A new `ILlmService` Binder object over this daemon.
    pub fn service(&self) -> Strong<dyn ILlmService> {
        BnLlmService::new_binder(LlmService { shared: self.shared.clone() })
    }

    /// A new `ILlmAdmin` Binder object over this daemon.
    pub fn admin(&self) -> Strong<dyn ILlmAdmin> {
        BnLlmAdmin::new_binder(LlmAdmin { shared: self.shared.clone(), pressure: self.pressure.clone() })
    }
}

/// Reads the caller of the current transaction and checks it may use `access`.
fn guard(shared: &Shared, access: Access, method: &'static str) -> Result<Caller, ServiceError> {
    let caller = Caller::current();
    tracing::debug!(uid = caller.uid, pid = caller.pid, method, "call");
    permission::check(&shared.config.permissions, caller, access, method)?;
    Ok(caller)
}

/// The Binder object registered as the service.
pub struct LlmService {
    shared: Arc<Shared>,
}

impl LlmService {
    fn list_models(&self) -> Result<Vec<ModelInfo>, ServiceError> {
        let r = &self.shared.residency;
        Ok(r.ids().iter().filter_map(|id| r.probe(id).map(|p| model_info(id, &p))).collect())
    }

    fn model_info(&self, model_id: &str) -> Result<ModelInfo, ServiceError> {
        Ok(model_info(model_id, &self.shared.probe(model_id)?))
    }

    fn open_session(
        &self,
        caller: Caller,
        model_id: &str,
        options: &SessionOptions,
    ) -> Result<Strong<dyn ILlmSession>, ServiceError> {
        let shared = &self.shared;
        let context_limit = context_limit(options, shared.probe(model_id)?.config.context_length)?;
        let limits = &shared.config.limits;
        let sessions = shared.sessions();
        let mine = sessions.values().filter(|s| s.owner.uid == caller.uid).count();
        if mine >= limits.max_sessions_per_uid {
            return Err(ServiceError::QuotaExceeded {
                uid: caller.uid,
                what: "open sessions",
                limit: limits.max_sessions_per_uid,
            });
        }
        if sessions.len() >= limits.max_sessions {
            return Err(ServiceError::Busy(format!("{} sessions open; retry later", sessions.len())));
        }
        drop(sessions);
        // Opening a session loads its model (or waits for a load under way); the use is
        // recorded per request, not per session.
        let model = shared.acquire_model_for(model_id, caller.uid, false)?;
        let id = shared.next_session_id();
        let core = Arc::new(SessionCore::new(id, caller, model_id, context_limit, &model));
        drop(model);
        let mut sessions = shared.sessions();
        if sessions.len() >= limits.max_sessions {
            return Err(ServiceError::Busy(format!("{} sessions open; retry later", sessions.len())));
        }
        sessions.insert(id, core.clone());
        drop(sessions);
        tracing::info!(session = id, uid = caller.uid, pid = caller.pid, model = model_id, "session opened");
        Ok(SessionBinder::new_binder(core, Arc::downgrade(shared)))
    }
}

/// The context a session gets from its options and its model's context length.
pub(crate) fn context_limit(options: &SessionOptions, model_context: usize) -> Result<usize, ServiceError> {
    match options.contextTokens {
        n if n < 0 => Err(ServiceError::InvalidArgument("contextTokens must not be negative".into())),
        0 => Ok(model_context),
        n => Ok((n as usize).min(model_context)),
    }
}

fn model_info(id: &str, p: &llmd_engine::ModelProbe) -> ModelInfo {
    let c = &p.config;
    ModelInfo {
        id: id.to_owned(),
        architecture: format!("{:?}", c.arch).to_lowercase(),
        layers: c.n_layers as i32,
        contextLength: c.context_length as i32,
        vocabSize: c.vocab_size as i32,
        weightBytes: p.weight_bytes as i64,
        hasChatTemplate: p.has_chat_template,
    }
}

impl rsbinder::Interface for LlmService {}

impl ILlmService for LlmService {
    fn listModels(&self) -> rsbinder::BinderResult<Vec<ModelInfo>> {
        guard(&self.shared, Access::Use, "listModels")
            .and_then(|_| self.list_models())
            .map_err(ServiceError::into_status)
    }

    fn getModelInfo(&self, model_id: &str) -> rsbinder::BinderResult<ModelInfo> {
        guard(&self.shared, Access::Use, "getModelInfo")
            .and_then(|_| self.model_info(model_id))
            .map_err(ServiceError::into_status)
    }

    fn openSession(&self, model_id: &str, options: &SessionOptions) -> rsbinder::BinderResult<Strong<dyn ILlmSession>> {
        guard(&self.shared, Access::Use, "openSession")
            .and_then(|caller| self.open_session(caller, model_id, options))
            .map_err(ServiceError::into_status)
    }

    fn getStatus(&self) -> rsbinder::BinderResult<ServiceStatus> {
        guard(&self.shared, Access::Use, "getStatus")
            .map(|caller| {
                // An app sees its own sessions and requests; an admin sees everyone's.
                let only = (!permission::is_admin(&self.shared.config.permissions, caller)).then_some(caller.uid);
                status(&self.shared, only)
            })
            .map_err(ServiceError::into_status)
    }
}

/// The admin Binder object, registered as "<service_name>.admin".
pub struct LlmAdmin {
    shared: Arc<Shared>,
    pressure: Arc<Pressure>,
}

impl LlmAdmin {
    fn prefetch(&self, model_id: &str) -> Result<(), ServiceError> {
        self.shared.probe(model_id)?;
        // Loads it now (or waits for a load under way); not recorded as a use.
        let m = self.shared.residency.acquire(model_id, "prefetch (admin)", self.shared.kv_bytes())?;
        self.shared.processors.prepare(&m);
        Ok(())
    }
}

impl rsbinder::Interface for LlmAdmin {}

impl ILlmAdmin for LlmAdmin {
    fn prefetch(&self, model_id: &str) -> rsbinder::BinderResult<()> {
        guard(&self.shared, Access::Admin, "prefetch")
            .and_then(|_| self.prefetch(model_id))
            .map_err(ServiceError::into_status)
    }

    fn dumpState(&self) -> rsbinder::BinderResult<String> {
        guard(&self.shared, Access::Admin, "dump")
            .map(|_| dump(&self.shared, &self.pressure))
            .map_err(ServiceError::into_status)
    }
}

/// The service's status; with `only`, the sessions, requests and KV memory of that uid alone
/// (what a caller that is not an admin may see of the daemon's other users: nothing).
fn status(shared: &Shared, only: Option<u32>) -> ServiceStatus {
    let mine = |uid: u32| only.is_none_or(|u| u == uid);
    let sessions: Vec<_> = shared.sessions().values().filter(|s| mine(s.owner.uid)).cloned().collect();
    let jobs: Vec<_> = shared.scheduler.admission.snapshot().into_iter().filter(|(_, j)| mine(j.uid)).collect();
    ServiceStatus {
        interfaceVersion: llmd_aidl::ILlmService::VERSION,
        modelsInstalled: shared.residency.ids().len() as i32,
        sessionsOpen: sessions.len() as i32,
        requestsQueued: jobs.iter().filter(|(_, j)| !j.running).count() as i32,
        requestsRunning: jobs.iter().filter(|(_, j)| j.running).count() as i32,
        kvCacheBytes: sessions.iter().map(|s| s.view().0.kv_bytes as i64).sum(),
        weightBytes: shared.residency.model_bytes() as i64,
    }
}

/// What `dump` prints: never prompt or output text.
fn dump(shared: &Shared, pressure: &Pressure) -> String {
    let mut out = String::new();
    let st = status(shared, None);
    let _ = writeln!(out, "llmd (interface version {})", st.interfaceVersion);
    let snap = shared.residency.snapshot();
    let budget = shared.residency.budget();
    let _ = writeln!(
        out,
        "\nMODELS ({}; budget {})",
        snap.len(),
        if budget == 0 { "unlimited".to_string() } else { format!("{} bytes", budget) }
    );
    for e in &snap {
        let p = shared.residency.probe(&e.id);
        let _ = writeln!(
            out,
            "  {}: {} bytes {}{} pinned {} priority {} in_use {} idle_s {:.0} reload_s {:.2} loads {} evictions {} layers {} context {} why {:?}{}{}",
            e.id,
            e.state,
            e.bytes,
            if e.measured { "" } else { " (estimated)" },
            e.pinned,
            e.priority,
            e.in_use,
            e.idle_s,
            e.reload_s,
            e.loads,
            e.evictions,
            p.as_ref().map_or(0, |p| p.config.n_layers),
            p.as_ref().map_or(0, |p| p.config.context_length),
            e.reason,
            if e.state == "loading" { format!(" progress {}/{}", e.progress.0, e.progress.1) } else { String::new() },
            e.changed.as_ref().map_or(String::new(), |c| format!(" REFUSED file_changed {c:?}")),
        );
    }
    let sessions = shared.session_list();
    let _ = writeln!(out, "\nSESSIONS ({})", sessions.len());
    for s in &sessions {
        // Never waits for a pass or an NPU chunk: a busy session shows its last figures.
        let (v, now) = s.view();
        let _ = writeln!(
            out,
            "  session {}: uid {} pid {} model {} kv_tokens {} kv_bytes {} messages {} active_request {}{}",
            s.id,
            s.owner.uid,
            s.owner.pid,
            s.model_id,
            v.kv_len,
            v.kv_bytes,
            v.messages,
            v.active_request.map_or("-".to_string(), |r| r.to_string()),
            if now { "" } else { " (in use: as of its last unlock)" }
        );
    }
    let admission = &shared.scheduler.admission;
    let jobs = admission.snapshot();
    let _ = writeln!(out, "\nREQUESTS ({} queued, {} running)", st.requestsQueued, st.requestsRunning);
    let rep = admission.report();
    for (id, j) in &jobs {
        let q = rep.requests.iter().find(|r| r.0 == *id);
        let _ = writeln!(
            out,
            "  request {id}: uid {} session {} {} class {} now_as {} prompt_left {} unserved_ms {} age_ms {} deadline_ms {}",
            j.uid,
            j.session,
            if j.running { "running" } else { "queued" },
            j.class.name(),
            q.map_or("-", |q| q.1.name()),
            q.map_or(0, |q| q.2),
            q.map_or(0, |q| q.3),
            j.enqueued.elapsed().as_millis(),
            j.deadline_ms,
        );
    }
    let _ = writeln!(out, "\nSCHEDULER");
    let _ = writeln!(out, "  passes {} avg_pass_us {} last_batch {}", rep.passes, rep.avg_pass_us, rep.last_batch);
    let mut uids: Vec<u32> = jobs.iter().map(|(_, j)| j.uid).collect();
    uids.extend(rep.vtimes.iter().map(|v| v.0));
    uids.sort_unstable();
    uids.dedup();
    let sc = &shared.config.scheduler;
    let window = sc.quota_window_s;
    for uid in uids {
        let _ = writeln!(
            out,
            "  uid {uid}: cap {} weight {} requests {} vtime {:.1} tokens_in_window {} (window {window} s, quota {})",
            sc.class_cap(uid).name(),
            sc.weights.get(&uid.to_string()).copied().unwrap_or(1),
            jobs.iter().filter(|(_, j)| j.uid == uid).count(),
            rep.vtimes.iter().find(|v| v.0 == uid).map_or(0.0, |v| v.1),
            admission.quota_used(uid, window),
            sc.quota_tokens_per_uid,
        );
    }
    let (open, per_uid) = shared.connections.snapshot();
    let (cap_uid, cap_all, ceiling) = shared.connections.caps();
    let _ = writeln!(
        out,
        "\nCONNECTIONS (socket)\n  open {open} cap {cap_all} admins_up_to {ceiling} per_uid_cap {cap_uid}"
    );
    for (uid, n) in per_uid {
        let _ = writeln!(out, "  uid {uid}: {n}");
    }
    let _ = writeln!(out, "\nMEMORY");
    let rss = crate::residency::process_rss_bytes();
    let accounted = shared.residency.baseline_rss + st.weightBytes.max(0) as u64 + st.kvCacheBytes.max(0) as u64;
    let _ = writeln!(out, "  weights_bytes {}", st.weightBytes);
    let _ = writeln!(out, "  kv_cache_bytes {}", st.kvCacheBytes);
    let _ = writeln!(out, "  daemon_baseline_bytes {}", shared.residency.baseline_rss);
    let _ = writeln!(out, "  accounted_bytes {accounted}");
    let _ = writeln!(out, "  process_rss_bytes {rss}");
    // For long-running checks from outside (`llmctl bench --soak`): which process answered,
    // and its open file descriptors (connections, model maps, spill files, logs).
    let _ = writeln!(out, "  process_pid {}", std::process::id());
    let _ = writeln!(out, "  process_open_fds {}", open_fds().map_or("-".to_string(), |n| n.to_string()));
    let ps = pressure.state();
    let _ = writeln!(
        out,
        "\nPRESSURE\n  some_avg10 {} step {} evicted_under_pressure {:?}",
        ps.last_avg10.map_or("-".to_string(), |v| format!("{v:.2}")),
        ps.step,
        ps.evicted
    );
    out.push_str(&shared.processors.dump());
    out.push_str(&shared.attention.dump());
    let _ = writeln!(out, "\nRESIDENCY EVENTS (most recent last)");
    for e in shared.residency.events() {
        let secs = e.at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let _ = writeln!(out, "  {secs} {}", e.what);
    }
    let _ = writeln!(out, "\nCONFIG\n{}", shared.config.to_toml());
    out
}

/// The process's open file descriptors, less the one that reading the directory holds.
fn open_fds() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count().saturating_sub(1))
}
