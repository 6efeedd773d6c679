//! The Binder object a client holds for a session (`ILlmSession`), and what a call on it does:
//! request validation, and submitting a turn (admission, the session marked busy, a death
//! recipient on the callback, the job queued for the worker). The conversation itself — KV
//! cache, tokens, messages — is `conversation::SessionCore`.
//!
//! Each Binder method guards (the caller must own the open session), calls a private method,
//! and maps its `ServiceError` to a Binder status in one place (`ServiceError::into_status`).

use crate::config::Limits;
use crate::conversation::engine::Turn;
use crate::conversation::{SessionCore, TurnInput};
use crate::error::ServiceError;
use crate::permission::Caller;
use crate::policy::Class;
use crate::scheduler::{CallbackSink, Job, Ticket};
use crate::shared::Shared;
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::IGenerationCallback::IGenerationCallback;
use llmd_aidl::ILlmSession::{BnLlmSession, ILlmSession};
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::GenerateRequest as EngineRequest;
use llmd_engine::sampling::SamplingParams;
use rsbinder::Strong;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// The Binder object a client holds for a session.
pub struct SessionBinder {
    core: Arc<SessionCore>,
    shared: Weak<Shared>,
}

impl SessionBinder {
    pub fn new_binder(core: Arc<SessionCore>, shared: Weak<Shared>) -> Strong<dyn ILlmSession> {
        BnLlmSession::new_binder(Self { core, shared })
    }

    /// Who is calling; they must own the session and it must be open.
    fn guard(&self, method: &'static str) -> Result<Caller, ServiceError> {
        let caller = Caller::current();
        tracing::debug!(session = self.core.id, uid = caller.uid, method, "session call");
        crate::permission::check_owner(self.core.owner, caller, self.core.id, method)?;
        if self.core.is_closed() {
            return Err(match self.core.expired_after() {
                Some(idle_s) => ServiceError::SessionIdle { idle_s },
                None => ServiceError::SessionClosed,
            });
        }
        self.core.touch();
        Ok(caller)
    }

    fn shared(&self) -> Result<Arc<Shared>, ServiceError> {
        self.shared.upgrade().ok_or_else(|| ServiceError::Internal("the service is shutting down".into()))
    }

    fn generate(
        &self,
        caller: Caller,
        req: &GenerateRequest,
        callback: &Strong<dyn IGenerationCallback>,
    ) -> Result<i64, ServiceError> {
        let shared = self.shared()?;
        let (input, request, hint) = check_request(req, &shared.config.limits)?;
        let class = Class::capped(hint, shared.config.scheduler.class_cap(caller.uid));
        let model = shared.acquire_model(&self.core.model_id, caller.uid)?;
        let ticket = Ticket { uid: caller.uid, session: self.core.id, class, deadline_ms: req.deadlineMs as u64 };
        let turn = Turn { session: self.core.clone(), model, input, request, death_link: None };
        submit(&shared, &self.shared, ticket, turn, callback)
    }

    fn cancel(&self, request_id: i64) -> Result<(), ServiceError> {
        tracing::debug!(session = self.core.id, request = request_id, "cancel");
        self.shared()?.scheduler.admission.cancel(self.core.id, request_id as u64);
        Ok(())
    }

    fn count_tokens(&self, caller: Caller, text: &str) -> Result<i32, ServiceError> {
        let shared = self.shared()?;
        check_count_text(text, &shared.config.limits)?;
        let model = shared.acquire_model_for(&self.core.model_id, caller.uid, false)?;
        let ids =
            model.tokenizer.encode(text, false, false).map_err(|e| ServiceError::InvalidArgument(e.to_string()))?;
        Ok(ids.len() as i32)
    }

    fn reset(&self) -> Result<(), ServiceError> {
        let mut inner = self.core.lock();
        if inner.active_request.is_some() {
            return Err(ServiceError::Busy("a request is running in this session; cancel it first".into()));
        }
        inner.clear();
        Ok(())
    }

    fn close(&self) -> Result<(), ServiceError> {
        self.shared()?.close_session(self.core.id, "closed by its owner");
        Ok(())
    }
}

/// Admits a turn and queues it (Binder thread): checks the limits, gives it an id, marks the
/// session busy, links a death recipient to the callback, and hands it to the worker.
fn submit(
    shared: &Shared,
    weak: &Weak<Shared>,
    ticket: Ticket,
    mut turn: Turn,
    callback: &Strong<dyn IGenerationCallback>,
) -> Result<i64, ServiceError> {
    let admission = &shared.scheduler.admission;
    let core = turn.session.clone();
    // Admitted and marked busy at once (lock order: the session, then the books), so a reset
    // or the pressure response never sees an admitted request's session idle.
    let admitted = {
        let mut inner = core.lock();
        let a = admission.admit(ticket)?;
        inner.active_request = Some(a.id);
        a
    };
    let id = admitted.id;
    let death = Arc::new(CallbackDeath { cancel: admitted.cancel.clone(), session: core.id, shared: weak.clone() });
    // A failure to link means the client is already gone.
    if callback.link_to_death_arc(&death).is_err() {
        admitted.cancel.store(true, Ordering::Release);
    }
    turn.death_link = Some(death);
    let job = Job::new(admitted, core.closed.clone(), Arc::new(CallbackSink(callback.clone())), turn);
    if shared.scheduler.queue(job).is_err() {
        admission.finish(id);
        core.lock().active_request = None;
        return Err(ServiceError::Internal("the engine worker has stopped".into()));
    }
    Ok(id as i64)
}

/// Cancels a request and closes its session when the client that will receive its output
/// dies. Kept alive by the request's turn while it runs.
struct CallbackDeath {
    cancel: Arc<AtomicBool>,
    session: u64,
    shared: Weak<Shared>,
}

impl rsbinder::DeathRecipient for CallbackDeath {
    fn binder_died(&self, _who: &rsbinder::WIBinder) {
        self.cancel.store(true, Ordering::Release);
        if let Some(shared) = self.shared.upgrade() {
            shared.close_session(self.session, "its client died");
        }
    }
}

/// Checks a `generate` request against `limits` and turns it into what the engine runs: the
/// turn's input, the engine request (sampling, length, stop sequences) and the class the
/// client asked for (before its cap).
pub(crate) fn check_request(
    req: &GenerateRequest,
    limits: &Limits,
) -> Result<(TurnInput, EngineRequest, Class), ServiceError> {
    let input = validate_request(req, limits)?;
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
    let request = EngineRequest {
        prompt: llmd_engine::generate::Prompt::Text(String::new()),
        sampling,
        max_tokens: req.maxTokens as usize,
        stop: req.stop.clone(),
    };
    let hint = match req.priority {
        llmd_aidl::Priority::Priority::BACKGROUND => Class::Background,
        llmd_aidl::Priority::Priority::BATCH => Class::Batch,
        _ => Class::Foreground,
    };
    Ok((input, request, hint))
}

/// Checks the text of a `countTokens` call before it is tokenized.
pub(crate) fn check_count_text(text: &str, limits: &Limits) -> Result<(), ServiceError> {
    if text.len() > limits.max_prompt_bytes {
        return Err(ServiceError::RequestTooLarge(format!(
            "text of {} bytes exceeds the limit of {}",
            text.len(),
            limits.max_prompt_bytes
        )));
    }
    Ok(())
}

/// Checks a request's shape and bounds before it is queued.
fn validate_request(req: &GenerateRequest, limits: &Limits) -> Result<TurnInput, ServiceError> {
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
        callback: &Strong<dyn IGenerationCallback>,
    ) -> rsbinder::BinderResult<i64> {
        self.guard("generate").and_then(|c| self.generate(c, request, callback)).map_err(ServiceError::into_status)
    }

    fn cancel(&self, request_id: i64) -> rsbinder::BinderResult<()> {
        self.guard("cancel").and_then(|_| self.cancel(request_id)).map_err(ServiceError::into_status)
    }

    fn countTokens(&self, text: &str) -> rsbinder::BinderResult<i32> {
        self.guard("countTokens").and_then(|c| self.count_tokens(c, text)).map_err(ServiceError::into_status)
    }

    fn reset(&self) -> rsbinder::BinderResult<()> {
        self.guard("reset").and_then(|_| self.reset()).map_err(ServiceError::into_status)
    }

    fn close(&self) -> rsbinder::BinderResult<()> {
        self.guard("close").and_then(|_| self.close()).map_err(ServiceError::into_status)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> GenerateRequest {
        GenerateRequest { prompt: "hi".into(), maxTokens: 4, ..GenerateRequest::default() }
    }

    #[test]
    fn requests_are_validated_before_they_are_queued() {
        let limits = Limits { max_new_tokens: 8, max_prompt_bytes: 16, ..Limits::default() };
        assert!(matches!(validate_request(&req(), &limits), Ok(TurnInput::Text(t)) if t == "hi"));
        let code = |r: GenerateRequest| validate_request(&r, &limits).expect_err("refused").code();
        use llmd_aidl::ErrorCode::ErrorCode as C;
        assert_eq!(code(GenerateRequest { maxTokens: 0, ..req() }), C::INVALID_ARGUMENT);
        assert_eq!(code(GenerateRequest { maxTokens: 9, ..req() }), C::REQUEST_TOO_LARGE);
        assert_eq!(code(GenerateRequest { prompt: "x".repeat(17), ..req() }), C::REQUEST_TOO_LARGE);
        assert_eq!(code(GenerateRequest { prompt: String::new(), ..req() }), C::INVALID_ARGUMENT);
        assert_eq!(code(GenerateRequest { deadlineMs: -1, ..req() }), C::INVALID_ARGUMENT);
        assert_eq!(code(GenerateRequest { stop: vec![String::new()], ..req() }), C::INVALID_ARGUMENT);
        let msg = |role: &str, content: &str| llmd_aidl::ChatMessage::ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        let chat = GenerateRequest { prompt: String::new(), messages: vec![msg("user", "hello")], ..req() };
        assert!(matches!(validate_request(&chat, &limits), Ok(TurnInput::Chat(m)) if m.len() == 1));
        assert_eq!(code(GenerateRequest { messages: vec![msg("user", "hello")], ..req() }), C::INVALID_ARGUMENT);
        assert_eq!(
            code(GenerateRequest { messages: vec![msg("robot", "hello")], ..chat.clone() }),
            C::INVALID_ARGUMENT
        );
        assert_eq!(code(GenerateRequest { messages: vec![msg("user", "")], ..chat }), C::INVALID_ARGUMENT);
    }
}
