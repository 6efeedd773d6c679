//! Sessions: one caller's conversation with one model — its KV cache, the tokens in it and
//! the messages so far — and the Binder object (`ILlmSession`) the caller holds.
//!
//! Locking: `SessionCore::inner` is held by the scheduler for one unit of work at a time and
//! briefly by Binder threads (reset, dump). A session runs at most one request at a time
//! (`inner.active_request`). States: open → (closed: by close(), the client's death, or the
//! last reference dropped). A closed session's KV is freed by whoever closes it, or by the
//! scheduler when its running request ends.

use crate::error::ServiceError;
use crate::permission::Caller;
use crate::scheduler::{Job, TurnInput};
use crate::service::Shared;
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::IGenerationCallback::IGenerationCallback;
use llmd_aidl::ILlmSession::ILlmSession;
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::GenerateRequest as EngineRequest;
use llmd_engine::model::kv::KvCache;
use llmd_engine::sampling::SamplingParams;
use llmd_engine::Model;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

pub struct SessionCore {
    pub id: u64,
    pub owner: Caller,
    pub model_id: String,
    /// Most positions this session's context may hold.
    pub context_limit: usize,
    pub inner: Mutex<SessionInner>,
    pub closed: AtomicBool,
}

pub struct SessionInner {
    pub kv: KvCache,
    /// The tokens whose keys and values `kv` holds, in order.
    pub tokens: Vec<u32>,
    pub messages: Vec<ChatMessage>,
    /// Tokens generated at the end of the last turn but not yet fed to the model; a raw-text
    /// turn feeds them first (a chat turn re-renders the reply instead).
    pub pending: Vec<u32>,
    pub active_request: Option<u64>,
    /// Where the KV cache was spilled under memory pressure (restored at the next turn).
    pub spilled: Option<std::path::PathBuf>,
}

/// Brings back a KV cache that memory pressure spilled to flash or dropped: read back from its
/// spill file if it has one (and the file is intact), else recomputed from the session's tokens.
/// Either way the conversation continues where it was.
pub fn restore_kv(model: &Model, inner: &mut SessionInner) {
    if let Some(path) = inner.spilled.take() {
        let c = model.config();
        let restored = std::fs::File::open(&path)
            .and_then(|f| KvCache::read_from(&mut std::io::BufReader::new(f), c.n_layers, c.kv_dim()));
        let _ = std::fs::remove_file(&path);
        match restored {
            Ok(kv) if kv.len() <= inner.tokens.len() => {
                inner.kv = kv;
                return;
            }
            Ok(_) => tracing::warn!("spilled KV cache longer than its tokens; recomputing"),
            Err(e) => tracing::warn!("spilled KV cache unusable ({e}); recomputing"),
        }
    }
    if inner.kv.len() < inner.tokens.len() {
        let mut kv = model.transformer.new_kv();
        let mut ok = true;
        for chunk in inner.tokens.chunks(llmd_engine::generate::DEFAULT_PREFILL_CHUNK) {
            if model.transformer.forward(&mut kv, chunk, llmd_engine::model::Logits::Last).is_err() {
                ok = false;
                break;
            }
        }
        if ok {
            inner.kv = kv;
        } else {
            // The context cannot be rebuilt: start over (chat turns re-render from messages).
            inner.tokens.clear();
            inner.pending.clear();
            inner.kv.clear();
        }
    }
}

impl SessionCore {
    pub fn lock(&self) -> MutexGuard<'_, SessionInner> {
        // A panic while holding the lock cannot leave the cache half-written in a way later
        // steps rely on (KvCache::append rewrites from `len`), so a poisoned lock is usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frees the KV cache and forgets the conversation.
    pub fn clear(inner: &mut SessionInner) {
        if let Some(p) = inner.spilled.take() {
            let _ = std::fs::remove_file(p);
        }
        inner.kv.clear();
        inner.tokens.clear();
        inner.messages.clear();
        inner.pending.clear();
    }
}

/// The Binder object a client holds for a session.
pub struct SessionBinder {
    core: Arc<SessionCore>,
    shared: Weak<Shared>,
}

impl SessionBinder {
    pub fn new(core: Arc<SessionCore>, shared: Weak<Shared>) -> Self {
        Self { core, shared }
    }

    fn shared(&self) -> Result<Arc<Shared>, ServiceError> {
        self.shared.upgrade().ok_or_else(|| ServiceError::Internal("the service is shutting down".into()))
    }

    /// The caller must own the session and it must be open.
    fn check_owner(&self, caller: Caller) -> Result<(), ServiceError> {
        if self.core.closed.load(Ordering::Acquire) || caller.uid != self.core.owner.uid {
            return Err(ServiceError::SessionClosed);
        }
        Ok(())
    }

    fn generate_impl(
        &self,
        caller: Caller,
        req: &GenerateRequest,
        callback: &rsbinder::Strong<dyn IGenerationCallback>,
    ) -> Result<i64, ServiceError> {
        self.check_owner(caller)?;
        let shared = self.shared()?;
        let limits = &shared.config.limits;
        let input = validate_request(req, limits)?;
        let max_tokens = req.maxTokens as usize;
        let sampling = SamplingParams {
            temperature: req.temperature,
            top_k: req.topK.max(0) as usize,
            top_p: req.topP,
            min_p: req.minP,
            repetition_penalty: req.repetitionPenalty,
            seed: req.seed as u64,
            ..SamplingParams::default()
        };
        sampling.validate().map_err(|e| ServiceError::InvalidArgument(e.to_string()))?;
        let engine = EngineRequest {
            prompt: llmd_engine::generate::Prompt::Text(String::new()),
            sampling,
            max_tokens,
            stop: req.stop.clone(),
        };
        let hint = match req.priority {
            llmd_aidl::Priority::Priority::BACKGROUND => crate::policy::Class::Background,
            llmd_aidl::Priority::Priority::BATCH => crate::policy::Class::Batch,
            _ => crate::policy::Class::Foreground,
        };
        let class = crate::policy::Class::capped(hint, shared.config.scheduler.class_cap(caller.uid));
        let model = shared.acquire_model(&self.core.model_id, caller.uid)?;
        let job = Job::new(self.core.clone(), model, caller.uid, input, engine, callback.clone())
            .with_class(class, req.deadlineMs as u64);
        shared.scheduler.submit(job, &self.shared)
    }
}

/// Checks a request's shape and bounds before it is queued.
fn validate_request(req: &GenerateRequest, limits: &crate::config::Limits) -> Result<TurnInput, ServiceError> {
    let bad = |m: &str| Err(ServiceError::InvalidArgument(m.to_owned()));
    if req.maxTokens <= 0 {
        return bad("maxTokens must be at least 1");
    }
    if req.maxTokens as usize > limits.max_new_tokens {
        return Err(ServiceError::RequestTooLarge(format!(
            "maxTokens {} exceeds the limit of {}",
            req.maxTokens, limits.max_new_tokens
        )));
    }
    if req.topK < 0 {
        return bad("topK must not be negative");
    }
    if !(0..=2).contains(&req.priority.0) {
        return bad("priority must be FOREGROUND, BACKGROUND or BATCH");
    }
    if req.deadlineMs < 0 {
        return bad("deadlineMs must not be negative (0 = no deadline)");
    }
    if req.stop.len() > 16 {
        return bad("at most 16 stop sequences");
    }
    if req.stop.iter().any(|s| s.is_empty() || s.len() > llmd_engine::generate::MAX_STOP_BYTES) {
        return bad("stop sequences must be 1..=256 bytes");
    }
    let bytes = req.prompt.len() + req.messages.iter().map(|m| m.content.len() + m.role.len()).sum::<usize>();
    if bytes > limits.max_prompt_bytes {
        return Err(ServiceError::RequestTooLarge(format!(
            "prompt of {bytes} bytes exceeds the limit of {}",
            limits.max_prompt_bytes
        )));
    }
    match (req.prompt.is_empty(), req.messages.is_empty()) {
        (false, true) => Ok(TurnInput::Text(req.prompt.clone())),
        (true, false) => {
            for m in &req.messages {
                if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                    return bad("message roles must be system, user or assistant");
                }
                if m.content.is_empty() {
                    return bad("a message is empty");
                }
            }
            Ok(TurnInput::Chat(req.messages.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect()))
        }
        (true, true) => bad("the prompt is empty: set prompt or messages"),
        (false, false) => bad("set prompt or messages, not both"),
    }
}

impl rsbinder::Interface for SessionBinder {}

impl ILlmSession for SessionBinder {
    fn generate(
        &self,
        request: &GenerateRequest,
        callback: &rsbinder::Strong<dyn IGenerationCallback>,
    ) -> rsbinder::BinderResult<i64> {
        let caller = Caller::current();
        tracing::debug!(session = self.core.id, uid = caller.uid, "generate");
        self.generate_impl(caller, request, callback).map_err(ServiceError::into_status)
    }

    fn cancel(&self, request_id: i64) -> rsbinder::BinderResult<()> {
        let caller = Caller::current();
        tracing::debug!(session = self.core.id, request = request_id, "cancel");
        (|| {
            self.check_owner(caller)?;
            self.shared()?.scheduler.cancel(self.core.id, request_id as u64);
            Ok(())
        })()
        .map_err(ServiceError::into_status)
    }

    fn countTokens(&self, text: &str) -> rsbinder::BinderResult<i32> {
        let caller = Caller::current();
        (|| {
            self.check_owner(caller)?;
            let limits = &self.shared()?.config.limits;
            if text.len() > limits.max_prompt_bytes {
                return Err(ServiceError::RequestTooLarge(format!(
                    "text of {} bytes exceeds the limit of {}",
                    text.len(),
                    limits.max_prompt_bytes
                )));
            }
            let model = self.shared()?.acquire_model(&self.core.model_id, caller.uid)?;
            let ids =
                model.tokenizer.encode(text, false, false).map_err(|e| ServiceError::InvalidArgument(e.to_string()))?;
            Ok(ids.len() as i32)
        })()
        .map_err(ServiceError::into_status)
    }

    fn reset(&self) -> rsbinder::BinderResult<()> {
        let caller = Caller::current();
        (|| {
            self.check_owner(caller)?;
            let mut inner = self.core.lock();
            if inner.active_request.is_some() {
                return Err(ServiceError::Busy("a request is running in this session; cancel it first".into()));
            }
            SessionCore::clear(&mut inner);
            Ok(())
        })()
        .map_err(ServiceError::into_status)
    }

    fn close(&self) -> rsbinder::BinderResult<()> {
        let caller = Caller::current();
        (|| {
            self.check_owner(caller)?;
            self.shared()?.close_session(self.core.id, "closed by its owner");
            Ok(())
        })()
        .map_err(ServiceError::into_status)
    }
}

impl Drop for SessionBinder {
    /// The last reference is gone (the client released it or died): free the session.
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.close_session(self.core.id, "released by its client");
        }
    }
}
