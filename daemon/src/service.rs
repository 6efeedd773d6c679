//! The service object (`ILlmService`) and the state it shares with sessions and the worker.
//!
//! State lives in `Shared`, built once by `llmd` and passed down; there are no globals.
//! `sessions` maps ids to open sessions; its lock is held only to add, remove or list.

use crate::config::Config;
use crate::error::ServiceError;
use crate::permission::{self, Access, Caller};
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
    pub models: BTreeMap<String, Arc<Model>>,
    pub sessions: Mutex<BTreeMap<u64, Arc<SessionCore>>>,
    pub scheduler: Scheduler,
    /// Death recipients of running requests' callbacks, kept alive while the request runs.
    pub death_links: Mutex<HashMap<u64, Arc<dyn rsbinder::DeathRecipient>>>,
    next_session: AtomicU64,
}

impl Shared {
    /// Builds the shared state and starts the engine worker thread.
    pub fn start(config: Config, models: BTreeMap<String, Arc<Model>>) -> std::io::Result<Arc<Self>> {
        let (scheduler, rx) = Scheduler::new();
        let chunk = config.prefill_chunk;
        let max_prompt = config.limits.max_prompt_tokens;
        let shared = Arc::new(Self {
            config,
            models,
            sessions: Mutex::new(BTreeMap::new()),
            scheduler,
            death_links: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
        });
        let policy = shared.config.scheduler.policy(chunk);
        let worker = Worker::new(rx, Arc::downgrade(&shared), chunk, max_prompt, policy);
        std::thread::Builder::new().name("llmd-engine".into()).spawn(move || worker.run())?;
        Ok(shared)
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

    fn model(&self, id: &str) -> Result<&Arc<Model>, ServiceError> {
        if id.is_empty() || id.len() > 256 {
            return Err(ServiceError::InvalidArgument("model id must be 1..=256 bytes".into()));
        }
        self.models.get(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))
    }

    fn open_session(
        self: &Arc<Self>,
        caller: Caller,
        model_id: &str,
        options: &SessionOptions,
    ) -> Result<rsbinder::Strong<dyn ILlmSession>, ServiceError> {
        let model = self.model(model_id)?.clone();
        let ctx = model.config().context_length;
        let context_limit = match options.contextTokens {
            n if n < 0 => return Err(ServiceError::InvalidArgument("contextTokens must not be negative".into())),
            0 => ctx,
            n => (n as usize).min(ctx),
        };
        let limits = &self.config.limits;
        let mut sessions = self.sessions();
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
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let kv = model.transformer.new_kv();
        let core = Arc::new(SessionCore {
            id,
            owner: caller,
            model_id: model_id.to_owned(),
            model,
            context_limit,
            inner: Mutex::new(SessionInner {
                kv,
                tokens: Vec::new(),
                messages: Vec::new(),
                pending: Vec::new(),
                active_request: None,
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
            modelsInstalled: self.models.len() as i32,
            sessionsOpen: sessions.len() as i32,
            requestsQueued: jobs.iter().filter(|(_, j)| !j.running).count() as i32,
            requestsRunning: jobs.iter().filter(|(_, j)| j.running).count() as i32,
            kvCacheBytes: sessions.values().map(|s| s.lock().kv.size_bytes() as i64).sum(),
            weightBytes: self.models.values().map(|m| m.transformer.weights.size_bytes() as i64).sum(),
        }
    }

    /// What `dump` prints: never prompt or output text.
    pub fn dump(&self) -> String {
        let mut out = String::new();
        let st = self.status();
        let _ = writeln!(out, "llmd (interface version {})", st.interfaceVersion);
        let _ = writeln!(out, "\nMODELS ({})", self.models.len());
        for (id, m) in &self.models {
            let c = m.config();
            let _ = writeln!(
                out,
                "  {id}: {:?}, {} layers, context {}, weights {} bytes",
                c.arch,
                c.n_layers,
                c.context_length,
                m.transformer.weights.size_bytes()
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
        let _ = writeln!(out, "  weights_bytes {}", st.weightBytes);
        let _ = writeln!(out, "  kv_cache_bytes {}", st.kvCacheBytes);
        let _ = writeln!(out, "  process_rss_bytes {}", process_rss_bytes().unwrap_or(0));
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

fn model_info(id: &str, m: &Model) -> ModelInfo {
    let c = m.config();
    ModelInfo {
        id: id.to_owned(),
        architecture: format!("{:?}", c.arch).to_lowercase(),
        layers: c.n_layers as i32,
        contextLength: c.context_length as i32,
        vocabSize: c.vocab_size as i32,
        weightBytes: m.transformer.weights.size_bytes() as i64,
        hasChatTemplate: m.chat_template.is_some(),
    }
}

impl rsbinder::Interface for LlmService {}

impl ILlmService for LlmService {
    fn listModels(&self) -> rsbinder::BinderResult<Vec<ModelInfo>> {
        (|| {
            self.guard(Access::Use, "listModels")?;
            Ok(self.shared.models.iter().map(|(id, m)| model_info(id, m)).collect())
        })()
        .map_err(ServiceError::into_status)
    }

    fn getModelInfo(&self, model_id: &str) -> rsbinder::BinderResult<ModelInfo> {
        (|| {
            self.guard(Access::Use, "getModelInfo")?;
            Ok(model_info(model_id, self.shared.model(model_id)?))
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
            // Every installed model is loaded (memory-mapped) at start-up today; residency
            // management makes this load on demand.
            self.shared.model(model_id).map(|_| ())
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
