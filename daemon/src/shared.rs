//! The state the daemon's Binder objects, death recipients and the pressure response share:
//! built once by `service::Daemon::start` and passed down as `Arc<Shared>`; there are no
//! globals. `sessions` maps ids to open sessions; its lock is held only to add, remove or list.
//! What reacts to memory pressure is `pressure.rs`, outside this state.

use crate::config::Config;
use crate::conversation::engine::{ModelEngine, Turn};
use crate::conversation::SessionCore;
use crate::error::ServiceError;
use crate::residency::{hour_now, Residency, UsageHistory};
use crate::scheduler::{Admission, Scheduler};
use llmd_engine::Model;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub struct Shared {
    pub config: Config,
    /// Which models are in memory; every model use goes through it.
    pub residency: Residency,
    /// Which app used which model at which hour (the prefetch predictor).
    pub history: Mutex<UsageHistory>,
    sessions: Mutex<BTreeMap<u64, Arc<SessionCore>>>,
    next_session: AtomicU64,
    /// Admission and the engine worker's queue.
    pub scheduler: Scheduler<Turn>,
    /// The socket's open connections per uid and their caps (the accept loop's gate).
    pub connections: Arc<crate::connections::Gate>,
    /// The NPU and the GPU (each on its thread, or off).
    pub processors: crate::processor::Processors,
    /// Each resident model's prompt attention (`[attention]`).
    pub attention: crate::attention::Attention,
}

impl Shared {
    /// Builds the shared state and starts the engine worker thread.
    pub fn start(config: Config, residency: Residency) -> std::io::Result<Arc<Self>> {
        let sc = &config.scheduler;
        let admission = Arc::new(Admission::new(crate::policy::Limits {
            max_requests: config.limits.max_requests,
            max_requests_per_uid: config.limits.max_requests_per_uid,
            quota_tokens: sc.quota_tokens_per_uid,
            quota_window_ms: sc.quota_window_s * 1000,
        }));
        let processors = crate::processor::Processors::from_config(&config);
        let engine = ModelEngine::new(config.prefill_chunk, config.limits.max_prompt_tokens, processors.clone());
        let scheduler = Scheduler::start(
            admission,
            engine,
            sc.policy(config.prefill_chunk),
            Duration::from_millis(sc.stream_interval_ms),
            Duration::from_secs(sc.stream_stall_timeout_s),
        )?;
        let history =
            config.residency.state_dir.as_ref().map(|d| UsageHistory::load(&d.join("usage.json"))).unwrap_or_default();
        if let Some(d) = &config.residency.state_dir {
            let n = crate::conversation::remove_stale_spills(d);
            if n > 0 {
                residency.event(format!("removed {n} KV spill files a previous run left"));
            }
        }
        let connections = Arc::new(crate::connections::Gate::from_config(&config));
        let attention =
            crate::attention::Attention::new(config.attention.clone(), config.residency.state_dir.as_deref());
        let shared = Arc::new(Self {
            attention,
            connections,
            config,
            residency,
            history: Mutex::new(history),
            sessions: Mutex::new(BTreeMap::new()),
            next_session: AtomicU64::new(1),
            scheduler,
            processors,
        });
        shared.spawn_idle_sweep()?;
        shared.spawn_model_check()?;
        Ok(shared)
    }

    /// With `residency.model_check_s`, starts the `llmd-files` thread: at that interval it
    /// checks every model's files against their fingerprints (`Residency::check_files`), until
    /// the shared state is gone.
    fn spawn_model_check(self: &Arc<Self>) -> std::io::Result<()> {
        let every = Duration::from_secs(self.config.residency.model_check_s);
        if every.is_zero() {
            return Ok(());
        }
        let weak = Arc::downgrade(self);
        std::thread::Builder::new().name("llmd-files".into()).spawn(move || loop {
            std::thread::sleep(every);
            match weak.upgrade() {
                Some(s) => {
                    s.residency.check_files();
                }
                None => return,
            }
        })?;
        Ok(())
    }

    /// With `session_idle_timeout_s`, starts the `llmd-idle` thread: every quarter of the
    /// timeout (at least 100 ms, at most 10 s) it closes the sessions gone unused that long
    /// ([`Self::close_idle_sessions`]), until the shared state is gone.
    fn spawn_idle_sweep(self: &Arc<Self>) -> std::io::Result<()> {
        let timeout = Duration::from_secs(self.config.limits.session_idle_timeout_s);
        if timeout.is_zero() {
            return Ok(());
        }
        let every = (timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(10));
        let weak = Arc::downgrade(self);
        std::thread::Builder::new().name("llmd-idle".into()).spawn(move || loop {
            std::thread::sleep(every);
            match weak.upgrade() {
                Some(s) => {
                    s.close_idle_sessions(timeout);
                }
                None => return,
            }
        })?;
        Ok(())
    }

    /// Closes every session unused for `timeout` with no request running, its KV memory
    /// freed (its owner's next call gets `SESSION_CLOSED`, saying why). Returns how many.
    pub fn close_idle_sessions(&self, timeout: Duration) -> usize {
        let mut n = 0;
        for s in self.session_list() {
            if s.idle_for() < timeout {
                continue;
            }
            if let Some(bytes) = s.expire(timeout) {
                n += 1;
                self.close_session(s.id, &format!("unused for {} s ({bytes} bytes of KV freed)", timeout.as_secs()));
            }
        }
        n
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
                    <= r.memory_budget_bytes();
            if !fits {
                continue;
            }
            match self.residency.acquire(&id, if pinned { "pinned" } else { "loaded at start" }, self.kv_bytes()) {
                Ok(m) => self.processors.prepare(&m),
                Err(e) => tracing::error!(model = %id, "model not loaded: {e}"),
            }
        }
    }

    /// The open sessions (the map's lock: hold it only to add, remove or list).
    pub fn sessions(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<SessionCore>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open sessions, listed (no lock held after).
    pub fn session_list(&self) -> Vec<Arc<SessionCore>> {
        self.sessions().values().cloned().collect()
    }

    /// A new session id.
    pub fn next_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Bytes every session's KV cache holds now.
    pub fn kv_bytes(&self) -> u64 {
        // Without waiting for a session a pass or an NPU chunk holds (its bytes as of its last
        // unlock: at most one chunk's positions behind).
        self.session_list().iter().map(|s| s.view().0.kv_bytes as u64).sum()
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
        self.processors.prepare(&m);
        self.attention.prepare(id, &m);
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

    /// A model's header (no weights), by id.
    pub fn probe(&self, id: &str) -> Result<llmd_engine::ModelProbe, ServiceError> {
        if id.is_empty() || id.len() > 256 {
            return Err(ServiceError::InvalidArgument("model id must be 1..=256 bytes".into()));
        }
        self.residency.probe(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))
    }

    /// Closes a session: no new work, running work cancelled, memory freed (now if idle, else
    /// when its request ends). Idempotent.
    pub fn close_session(&self, id: u64, why: &str) {
        let Some(core) = self.sessions().remove(&id) else { return };
        core.closed.store(true, Ordering::Release);
        self.scheduler.admission.cancel_session(id);
        core.free_if_idle();
        tracing::info!(session = id, uid = core.owner.uid, "session closed: {why}");
    }
}
