//! The service object (`ILlmService`) and the state it shares with sessions and the worker.
//!
//! State lives in `Shared`, built once by `llmd` and passed down; there are no globals.
//! `sessions` maps ids to open sessions; its lock is held only to add, remove or list.

use crate::config::Config;
use crate::error::ServiceError;
use crate::permission::{self, Access, Caller};
use crate::residency::{hour_now, PressureSource, Residency, UsageHistory};
use crate::scheduler::{Scheduler, Worker};
use crate::session::{SessionBinder, SessionCore, SessionInner};
use llmd_aidl::ILlmAdmin::{BnLlmAdmin, ILlmAdmin};
use llmd_aidl::ILlmService::{BnLlmService, ILlmService};
use llmd_aidl::ILlmSession::{BnLlmSession, ILlmSession};
use llmd_aidl::ModelInfo::ModelInfo;
use llmd_aidl::ServiceStatus::ServiceStatus;
use llmd_aidl::SessionOptions::SessionOptions;
use llmd_engine::Model;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub struct Shared {
    pub config: Config,
    /// Which models are in memory; every model use goes through it.
    pub residency: Residency,
    /// Which app used which model at which hour (the prefetch predictor).
    pub history: Mutex<UsageHistory>,
    pressure: Box<dyn PressureSource>,
    pressure_state: Mutex<PressureState>,
    pub sessions: Mutex<BTreeMap<u64, Arc<SessionCore>>>,
    pub scheduler: Scheduler,
    /// Death recipients of running requests' callbacks, kept alive while the request runs.
    pub death_links: Mutex<HashMap<u64, Arc<dyn rsbinder::DeathRecipient>>>,
    next_session: AtomicU64,
}

/// Where the pressure response is: 0 = none, 1 = idle KV shed, 2 = evicting models.
#[derive(Default)]
struct PressureState {
    step: u8,
    /// Models evicted under pressure, to bring back when it ends.
    evicted: Vec<String>,
    last_avg10: Option<f64>,
    last_hour: Option<u32>,
    /// The pressure file was unreadable and that was logged.
    warned: bool,
}

impl Shared {
    /// Builds the shared state and starts the engine worker thread and the residency monitor
    /// (memory pressure, predicted prefetch).
    pub fn start(
        config: Config,
        residency: Residency,
        pressure: Box<dyn PressureSource>,
    ) -> std::io::Result<Arc<Self>> {
        let (scheduler, rx) = Scheduler::new();
        let chunk = config.prefill_chunk;
        let max_prompt = config.limits.max_prompt_tokens;
        let history =
            config.residency.state_dir.as_ref().map(|d| UsageHistory::load(&d.join("usage.json"))).unwrap_or_default();
        let shared = Arc::new(Self {
            config,
            residency,
            history: Mutex::new(history),
            pressure,
            pressure_state: Mutex::new(PressureState::default()),
            sessions: Mutex::new(BTreeMap::new()),
            scheduler,
            death_links: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
        });
        let policy = shared.config.scheduler.policy(chunk);
        let worker = Worker::new(rx, Arc::downgrade(&shared), chunk, max_prompt, policy)
            .with_stream_interval(std::time::Duration::from_millis(shared.config.scheduler.stream_interval_ms));
        std::thread::Builder::new().name("llmd-engine".into()).spawn(move || worker.run())?;
        let weak = Arc::downgrade(&shared);
        let poll = std::time::Duration::from_millis(shared.config.residency.pressure_poll_ms);
        std::thread::Builder::new().name("llmd-residency".into()).spawn(move || loop {
            match weak.upgrade() {
                Some(s) => s.residency_tick(),
                None => return,
            }
            std::thread::sleep(poll);
        })?;
        Ok(shared)
    }

    /// Loads pinned models, then (with `load_at_start`) every other model the budget has room
    /// for. Failures are logged; the daemon still serves the rest.
    pub fn load_at_start(&self) {
        let r = &self.config.residency;
        let mut ids = r.pinned.clone();
        if r.load_at_start {
            ids.extend(self.residency.ids().into_iter().filter(|i| !r.pinned.contains(i)));
        }
        for id in ids {
            if !self.residency.contains(&id) {
                tracing::error!(model = %id, "pinned model is not installed");
                continue;
            }
            let pinned = r.pinned.contains(&id);
            let fits = pinned
                || r.memory_budget_mb == 0
                || self.residency.model_bytes() + self.residency.probe(&id).map_or(0, |p| p.weight_bytes)
                    <= r.memory_budget_mb << 20;
            if !fits {
                continue;
            }
            if let Err(e) =
                self.residency.acquire(&id, if pinned { "pinned" } else { "loaded at start" }, self.kv_bytes())
            {
                tracing::error!(model = %id, "model not loaded: {e}");
            }
        }
    }

    /// Bytes every session's KV cache holds now.
    pub fn kv_bytes(&self) -> u64 {
        let sessions: Vec<Arc<SessionCore>> = self.sessions().values().cloned().collect();
        sessions.iter().map(|s| s.lock().kv.size_bytes() as u64).sum()
    }

    /// The model `id`, loaded if it is not resident (waiting for a load under way), for a
    /// request of `uid`; the use is recorded in the usage history.
    pub fn acquire_model(&self, id: &str, uid: u32) -> Result<Arc<Model>, ServiceError> {
        self.acquire_model_for(id, uid, true)
    }

    /// [`Self::acquire_model`]; `record`: whether this counts as a use (a token count does not).
    pub fn acquire_model_for(&self, id: &str, uid: u32, record: bool) -> Result<Arc<Model>, ServiceError> {
        if id.is_empty() || id.len() > 256 {
            return Err(ServiceError::InvalidArgument("model id must be 1..=256 bytes".into()));
        }
        let m = match self.residency.get_resident(id) {
            Some(m) => m,
            None => self.residency.acquire(id, &format!("request (uid {uid})"), self.kv_bytes())?,
        };
        if !record {
            return Ok(m);
        }
        let mut h = self.history.lock().unwrap_or_else(|p| p.into_inner());
        h.record(uid, hour_now(), id);
        if let Some(d) = &self.config.residency.state_dir {
            if let Err(e) = h.save(&d.join("usage.json")) {
                tracing::warn!("usage history not saved: {e}");
            }
        }
        Ok(m)
    }

    /// One look at memory pressure and the clock: shed a step under pressure, grow back after,
    /// and load the model predicted for a new hour.
    pub fn residency_tick(self: &Arc<Self>) {
        let r = &self.config.residency;
        let avg10 = self.pressure.some_avg10();
        let mut st = self.pressure_state.lock().unwrap_or_else(|p| p.into_inner());
        if avg10.is_none() && !st.warned {
            st.warned = true;
            tracing::warn!(file = %r.pressure_file.display(), "memory pressure unreadable (no PSI?): not watching it");
        }
        st.last_avg10 = avg10;
        match avg10 {
            Some(v) if v >= r.pressure_high => {
                if st.step == 0 {
                    st.step = 1;
                    let (n, bytes) = self.shed_idle_kv(0);
                    self.residency.event(format!(
                        "memory pressure {v:.1} (some avg10): {} KV caches of idle sessions ({} KB)",
                        if r.state_dir.is_some() { format!("spilled {n}") } else { format!("dropped {n}") },
                        bytes >> 10
                    ));
                    if n > 0 {
                        return;
                    }
                }
                st.step = 2;
                match self.residency.evict_one(&format!("under memory pressure ({v:.1})")) {
                    Some(id) => st.evicted.push(id),
                    None => self.residency.event(format!("memory pressure {v:.1}: nothing left to shed")),
                }
            }
            Some(v) if v <= r.pressure_low && st.step > 0 => {
                st.step = 0;
                let back = std::mem::take(&mut st.evicted);
                self.residency.event(format!("memory pressure ended ({v:.1}); reloading {back:?}"));
                drop(st);
                let me = self.clone();
                std::thread::spawn(move || {
                    for id in back {
                        let _ = me.residency.acquire(&id, "back after memory pressure", me.kv_bytes());
                    }
                });
                return;
            }
            _ => {}
        }
        if r.kv_spill_tokens > 0 && r.state_dir.is_some() && st.step == 0 {
            let (n, bytes) = self.shed_idle_kv(r.kv_spill_tokens);
            if n > 0 {
                self.residency.event(format!(
                    "spilled {n} long idle KV caches over {} positions ({} KB)",
                    r.kv_spill_tokens,
                    bytes >> 10
                ));
            }
        }
        let hour = hour_now();
        if r.prefetch_predicted && st.last_hour != Some(hour) && st.step == 0 {
            st.last_hour = Some(hour);
            drop(st);
            let predicted = self.history.lock().unwrap_or_else(|p| p.into_inner()).predict(hour);
            if let Some(id) = predicted.filter(|id| self.residency.contains(id)) {
                if self.residency.get_resident(&id).is_none() {
                    let me = self.clone();
                    std::thread::spawn(move || {
                        let why = format!("predicted for hour {hour}");
                        if let Err(e) = me.residency.acquire(&id, &why, me.kv_bytes()) {
                            me.residency.event(format!("prefetch of {id} failed: {e}"));
                        }
                    });
                }
            }
        }
    }

    /// Frees the KV caches of sessions with no running request holding more than `over`
    /// positions: spilled to the state directory (restored at their next turn) or dropped
    /// (recomputed then). Returns (sessions, bytes).
    fn shed_idle_kv(&self, over: usize) -> (usize, u64) {
        let sessions: Vec<Arc<SessionCore>> = self.sessions().values().cloned().collect();
        let (mut n, mut bytes) = (0, 0u64);
        for s in sessions {
            let Ok(mut inner) = s.inner.try_lock() else { continue };
            if inner.active_request.is_some() || inner.kv.is_empty() || inner.kv.len() <= over {
                continue;
            }
            let size = inner.kv.size_bytes() as u64;
            if let Some(dir) = &self.config.residency.state_dir {
                let path = dir.join("kv").join(format!("session-{}.kv", s.id));
                let written = std::fs::create_dir_all(dir.join("kv")).and_then(|_| {
                    let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
                    inner.kv.write_to(&mut f)?;
                    std::io::Write::flush(&mut f)
                });
                match written {
                    Ok(()) => inner.spilled = Some(path),
                    Err(e) => tracing::warn!(session = s.id, "KV spill failed ({e}); dropping it instead"),
                }
            }
            inner.kv.clear();
            n += 1;
            bytes += size;
        }
        (n, bytes)
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<SessionCore>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes a session: no new work, running work cancelled, memory freed (now if idle, else
    /// when its request ends). Idempotent.
    pub fn close_session(&self, id: u64, why: &str) {
        let Some(core) = self.sessions().remove(&id) else { return };
        core.closed.store(true, Ordering::Release);
        self.scheduler.cancel_session(id);
        if let Ok(mut inner) = core.inner.try_lock() {
            if inner.active_request.is_none() {
                SessionCore::clear(&mut inner);
            }
        }
        tracing::info!(session = id, uid = core.owner.uid, "session closed: {why}");
    }

    fn probe(&self, id: &str) -> Result<llmd_engine::ModelProbe, ServiceError> {
        if id.is_empty() || id.len() > 256 {
            return Err(ServiceError::InvalidArgument("model id must be 1..=256 bytes".into()));
        }
        self.residency.probe(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))
    }

    fn open_session(
        self: &Arc<Self>,
        caller: Caller,
        model_id: &str,
        options: &SessionOptions,
    ) -> Result<rsbinder::Strong<dyn ILlmSession>, ServiceError> {
        let ctx = self.probe(model_id)?.config.context_length;
        let context_limit = match options.contextTokens {
            n if n < 0 => return Err(ServiceError::InvalidArgument("contextTokens must not be negative".into())),
            0 => ctx,
            n => (n as usize).min(ctx),
        };
        let limits = &self.config.limits;
        let sessions = self.sessions();
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
        let model = self.acquire_model_for(model_id, caller.uid, false)?;
        let kv = model.transformer.new_kv();
        drop(model);
        let mut sessions = self.sessions();
        if sessions.len() >= limits.max_sessions {
            return Err(ServiceError::Busy(format!("{} sessions open; retry later", sessions.len())));
        }
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let core = Arc::new(SessionCore {
            id,
            owner: caller,
            model_id: model_id.to_owned(),
            context_limit,
            inner: Mutex::new(SessionInner {
                kv,
                tokens: Vec::new(),
                messages: Vec::new(),
                pending: Vec::new(),
                active_request: None,
                spilled: None,
            }),
            closed: AtomicBool::new(false),
        });
        sessions.insert(id, core.clone());
        drop(sessions);
        tracing::info!(session = id, uid = caller.uid, pid = caller.pid, model = model_id, "session opened");
        Ok(BnLlmSession::new_binder(SessionBinder::new(core, Arc::downgrade(self))))
    }

    pub fn status(&self) -> ServiceStatus {
        let sessions = self.sessions();
        let jobs = self.scheduler.snapshot();
        ServiceStatus {
            interfaceVersion: llmd_aidl::ILlmService::VERSION,
            modelsInstalled: self.residency.ids().len() as i32,
            sessionsOpen: sessions.len() as i32,
            requestsQueued: jobs.iter().filter(|(_, j)| !j.running).count() as i32,
            requestsRunning: jobs.iter().filter(|(_, j)| j.running).count() as i32,
            kvCacheBytes: sessions.values().map(|s| s.lock().kv.size_bytes() as i64).sum(),
            weightBytes: self.residency.model_bytes() as i64,
        }
    }

    /// What `dump` prints: never prompt or output text.
    pub fn dump(&self) -> String {
        let mut out = String::new();
        let st = self.status();
        let _ = writeln!(out, "llmd (interface version {})", st.interfaceVersion);
        let snap = self.residency.snapshot();
        let budget = self.residency.budget();
        let _ = writeln!(
            out,
            "\nMODELS ({}; budget {})",
            snap.len(),
            if budget == 0 { "unlimited".to_string() } else { format!("{} bytes", budget) }
        );
        for e in &snap {
            let p = self.residency.probe(&e.id);
            let _ = writeln!(
                out,
                "  {}: {} bytes {}{} pinned {} priority {} in_use {} idle_s {:.0} reload_s {:.2} loads {} evictions {} layers {} context {} why {:?}{}",
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
            );
        }
        let sessions: Vec<Arc<SessionCore>> = self.sessions().values().cloned().collect();
        let _ = writeln!(out, "\nSESSIONS ({})", sessions.len());
        for s in &sessions {
            let inner = s.lock();
            let _ = writeln!(
                out,
                "  session {}: uid {} pid {} model {} kv_tokens {} kv_bytes {} messages {} active_request {}",
                s.id,
                s.owner.uid,
                s.owner.pid,
                s.model_id,
                inner.kv.len(),
                inner.kv.size_bytes(),
                inner.messages.len(),
                inner.active_request.map_or("-".to_string(), |r| r.to_string())
            );
        }
        let jobs = self.scheduler.snapshot();
        let _ = writeln!(out, "\nREQUESTS ({} queued, {} running)", st.requestsQueued, st.requestsRunning);
        let rep = self.scheduler.report();
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
        let window = self.config.scheduler.quota_window_s;
        for uid in uids {
            let _ = writeln!(
                out,
                "  uid {uid}: cap {} weight {} requests {} vtime {:.1} tokens_in_window {} (window {window} s, quota {})",
                self.config.scheduler.class_cap(uid).name(),
                self.config.scheduler.weights.get(&uid.to_string()).copied().unwrap_or(1),
                jobs.iter().filter(|(_, j)| j.uid == uid).count(),
                rep.vtimes.iter().find(|v| v.0 == uid).map_or(0.0, |v| v.1),
                self.scheduler.quota_used(uid, window),
                self.config.scheduler.quota_tokens_per_uid,
            );
        }
        let _ = writeln!(out, "\nMEMORY");
        let rss = process_rss_bytes().unwrap_or(0);
        let accounted = self.residency.baseline_rss + st.weightBytes.max(0) as u64 + st.kvCacheBytes.max(0) as u64;
        let _ = writeln!(out, "  weights_bytes {}", st.weightBytes);
        let _ = writeln!(out, "  kv_cache_bytes {}", st.kvCacheBytes);
        let _ = writeln!(out, "  daemon_baseline_bytes {}", self.residency.baseline_rss);
        let _ = writeln!(out, "  accounted_bytes {accounted}");
        let _ = writeln!(out, "  process_rss_bytes {rss}");
        {
            let ps = self.pressure_state.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(
                out,
                "\nPRESSURE\n  some_avg10 {} step {} evicted_under_pressure {:?}",
                ps.last_avg10.map_or("-".to_string(), |v| format!("{v:.2}")),
                ps.step,
                ps.evicted
            );
        }
        let _ = writeln!(out, "\nRESIDENCY EVENTS (most recent last)");
        for e in self.residency.events() {
            let secs = e.at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
            let _ = writeln!(out, "  {secs} {}", e.what);
        }
        let _ = writeln!(out, "\nCONFIG\n{}", self.config.to_toml());
        out
    }
}

fn process_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The Binder object registered as the service.
pub struct LlmService {
    shared: Arc<Shared>,
}

impl LlmService {
    pub fn new_binder(shared: Arc<Shared>) -> rsbinder::Strong<dyn ILlmService> {
        BnLlmService::new_binder(Self { shared })
    }

    fn guard(&self, access: Access, method: &'static str) -> Result<Caller, ServiceError> {
        let caller = Caller::current();
        tracing::debug!(uid = caller.uid, pid = caller.pid, method, "call");
        permission::check(&self.shared.config.permissions, caller, access, method)?;
        Ok(caller)
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
        (|| {
            self.guard(Access::Use, "listModels")?;
            let r = &self.shared.residency;
            Ok(r.ids().iter().filter_map(|id| r.probe(id).map(|p| model_info(id, &p))).collect())
        })()
        .map_err(ServiceError::into_status)
    }

    fn getModelInfo(&self, model_id: &str) -> rsbinder::BinderResult<ModelInfo> {
        (|| {
            self.guard(Access::Use, "getModelInfo")?;
            Ok(model_info(model_id, &self.shared.probe(model_id)?))
        })()
        .map_err(ServiceError::into_status)
    }

    fn openSession(
        &self,
        model_id: &str,
        options: &SessionOptions,
    ) -> rsbinder::BinderResult<rsbinder::Strong<dyn ILlmSession>> {
        (|| {
            let caller = self.guard(Access::Use, "openSession")?;
            self.shared.open_session(caller, model_id, options)
        })()
        .map_err(ServiceError::into_status)
    }

    fn getStatus(&self) -> rsbinder::BinderResult<ServiceStatus> {
        (|| {
            self.guard(Access::Use, "getStatus")?;
            Ok(self.shared.status())
        })()
        .map_err(ServiceError::into_status)
    }
}

/// The admin Binder object, registered as "<service_name>.admin".
pub struct LlmAdmin {
    shared: Arc<Shared>,
}

impl LlmAdmin {
    pub fn new_binder(shared: Arc<Shared>) -> rsbinder::Strong<dyn ILlmAdmin> {
        BnLlmAdmin::new_binder(Self { shared })
    }

    fn guard(&self, method: &'static str) -> Result<Caller, ServiceError> {
        let caller = Caller::current();
        tracing::debug!(uid = caller.uid, pid = caller.pid, method, "admin call");
        permission::check(&self.shared.config.permissions, caller, Access::Admin, method)?;
        Ok(caller)
    }
}

impl rsbinder::Interface for LlmAdmin {}

impl ILlmAdmin for LlmAdmin {
    fn prefetch(&self, model_id: &str) -> rsbinder::BinderResult<()> {
        (|| {
            self.guard("prefetch")?;
            self.shared.probe(model_id)?;
            // Loads it now (or waits for a load under way); not recorded as a use.
            self.shared.residency.acquire(model_id, "prefetch (admin)", self.shared.kv_bytes()).map(|_| ())
        })()
        .map_err(ServiceError::into_status)
    }

    fn dumpState(&self) -> rsbinder::BinderResult<String> {
        (|| {
            self.guard("dump")?;
            Ok(self.shared.dump())
        })()
        .map_err(ServiceError::into_status)
    }
}
