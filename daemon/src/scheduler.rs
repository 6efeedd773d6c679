//! The work queue and the engine worker: every request is a sequence of units (prefill chunks,
//! decode steps); one worker thread takes them round-robin across running requests, so several
//! sessions stream at once and a cancel takes effect within one unit.
//!
//! First come, first served: requests start in arrival order and share the worker equally
//! (the priority- and fairness-aware policy replaces `Worker::next` later).
//!
//! Locking: `Scheduler::book` (admission counts and cancel flags) is taken briefly by Binder
//! threads and the worker; a session's lock only by the worker during a unit, never while a
//! callback is sent. Every request ends in `Worker::end`, which records the outcome once.

use crate::error::ServiceError;
use crate::service::Shared;
use crate::session::{SessionCore, SessionInner};
use llmd_aidl::GenerationStats::GenerationStats as WireStats;
use llmd_aidl::IGenerationCallback::IGenerationCallback;
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::{FinishReason, GenerateRequest, Generation, GenerationStats};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

/// What a turn adds to the conversation.
#[derive(Clone, Debug)]
pub enum TurnInput {
    /// Raw text appended to the context.
    Text(String),
    /// Messages appended to the conversation, which is re-rendered with the chat template.
    Chat(Vec<ChatMessage>),
}

pub struct Job {
    pub id: u64,
    pub uid: u32,
    pub session: Arc<SessionCore>,
    pub input: TurnInput,
    pub request: GenerateRequest,
    pub callback: rsbinder::Strong<dyn IGenerationCallback>,
    pub cancel: Arc<AtomicBool>,
    pub enqueued: Instant,
}

impl Job {
    pub fn new(
        session: Arc<SessionCore>,
        uid: u32,
        input: TurnInput,
        request: GenerateRequest,
        callback: rsbinder::Strong<dyn IGenerationCallback>,
    ) -> Self {
        Self {
            id: 0,
            uid,
            session,
            input,
            request,
            callback,
            cancel: Arc::new(AtomicBool::new(false)),
            enqueued: Instant::now(),
        }
    }
}

/// A request as the books see it.
#[derive(Clone, Debug)]
pub struct JobInfo {
    pub uid: u32,
    pub session: u64,
    pub running: bool,
    pub cancel: Arc<AtomicBool>,
}

#[derive(Default)]
struct Book {
    next_id: u64,
    jobs: BTreeMap<u64, JobInfo>,
    per_uid: HashMap<u32, usize>,
}

pub struct Scheduler {
    tx: Mutex<Sender<Job>>,
    book: Mutex<Book>,
}

/// Cancels a request when the client that will receive its output dies.
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

impl Scheduler {
    /// A scheduler and the receiving end its worker runs on.
    pub fn new() -> (Self, Receiver<Job>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Self { tx: Mutex::new(tx), book: Mutex::new(Book { next_id: 1, ..Book::default() }) }, rx)
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits and queues a request (Binder thread): checks the limits, gives it an id, marks
    /// the session busy, and hands it to the worker.
    pub fn submit(&self, mut job: Job, shared: &Weak<Shared>) -> Result<i64, ServiceError> {
        let shared_arc =
            shared.upgrade().ok_or_else(|| ServiceError::Internal("the service is shutting down".into()))?;
        let limits = &shared_arc.config.limits;
        {
            let mut book = self.book();
            let mut inner = job.session.lock();
            if inner.active_request.is_some() {
                return Err(ServiceError::Busy("this session is already generating; wait for it or cancel it".into()));
            }
            let mine = book.per_uid.get(&job.uid).copied().unwrap_or(0);
            if mine >= limits.max_requests_per_uid {
                return Err(ServiceError::QuotaExceeded {
                    uid: job.uid,
                    what: "requests in flight",
                    limit: limits.max_requests_per_uid,
                });
            }
            if book.jobs.len() >= limits.max_requests {
                return Err(ServiceError::Busy(format!("{} requests in flight; retry later", book.jobs.len())));
            }
            job.id = book.next_id;
            book.next_id += 1;
            inner.active_request = Some(job.id);
            drop(inner);
            book.jobs.insert(
                job.id,
                JobInfo { uid: job.uid, session: job.session.id, running: false, cancel: job.cancel.clone() },
            );
            *book.per_uid.entry(job.uid).or_default() += 1;
        }
        let death =
            Arc::new(CallbackDeath { cancel: job.cancel.clone(), session: job.session.id, shared: shared.clone() });
        // Dropped with the job when it ends; a failure to link means the client is already gone.
        if job.callback.link_to_death_arc(&death).is_err() {
            job.cancel.store(true, Ordering::Release);
        }
        shared_arc.death_links.lock().unwrap_or_else(|p| p.into_inner()).insert(job.id, death);
        let id = job.id as i64;
        let send = self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(job);
        if let Err(e) = send {
            let job = e.0;
            self.finished(job.id);
            job.session.lock().active_request = None;
            return Err(ServiceError::Internal("the engine worker has stopped".into()));
        }
        Ok(id)
    }

    /// Asks a request of `session` to stop (no-op if it already ended).
    pub fn cancel(&self, session: u64, id: u64) {
        if let Some(j) = self.book().jobs.get(&id).filter(|j| j.session == session) {
            j.cancel.store(true, Ordering::Release);
        }
    }

    /// Cancels every request of a session.
    pub fn cancel_session(&self, session: u64) {
        for j in self.book().jobs.values().filter(|j| j.session == session) {
            j.cancel.store(true, Ordering::Release);
        }
    }

    fn set_running(&self, id: u64) {
        if let Some(j) = self.book().jobs.get_mut(&id) {
            j.running = true;
        }
    }

    fn finished(&self, id: u64) {
        let mut book = self.book();
        if let Some(j) = book.jobs.remove(&id) {
            if let Some(n) = book.per_uid.get_mut(&j.uid) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    book.per_uid.remove(&j.uid);
                }
            }
        }
    }

    /// Requests in flight, for status and dump.
    pub fn snapshot(&self) -> Vec<(u64, JobInfo)> {
        self.book().jobs.iter().map(|(k, v)| (*k, v.clone())).collect()
    }
}

/// A request the worker is running.
struct Running {
    job: Job,
    gen: Generation,
    /// KV length to return to if the turn does not complete.
    rewind_to: usize,
    /// Tokens of the context after this turn's prompt (the generated ones follow).
    context: Vec<u32>,
    started: Instant,
}

pub struct Worker {
    rx: Receiver<Job>,
    shared: Weak<Shared>,
    prefill_chunk: usize,
    max_prompt_tokens: usize,
    active: VecDeque<Running>,
}

impl Worker {
    pub fn new(rx: Receiver<Job>, shared: Weak<Shared>, prefill_chunk: usize, max_prompt_tokens: usize) -> Self {
        Self { rx, shared, prefill_chunk, max_prompt_tokens, active: VecDeque::new() }
    }

    /// Runs until every sender is gone.
    pub fn run(mut self) {
        loop {
            if self.active.is_empty() {
                match self.rx.recv() {
                    Ok(job) => self.start(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = self.rx.try_recv() {
                self.start(job);
            }
            if let Some(r) = self.next() {
                self.unit(r);
            }
        }
    }

    /// The policy: round-robin over running requests, in arrival order.
    fn next(&mut self) -> Option<Running> {
        self.active.pop_front()
    }

    fn with_shared<T>(&self, f: impl FnOnce(&Shared) -> T) -> Option<T> {
        self.shared.upgrade().map(|s| f(&s))
    }

    /// Tokenizes the turn against the session's context and sets up its generation.
    fn start(&mut self, job: Job) {
        let started = Instant::now();
        if job.cancel.load(Ordering::Acquire) || job.session.closed.load(Ordering::Acquire) {
            return self.end_unstarted(job, ServiceError::Cancelled);
        }
        let prepared = {
            let mut inner = job.session.lock();
            prepare(&job, &mut inner, job.session.context_limit, self.max_prompt_tokens)
        };
        match prepared.and_then(|(prompt, context, rewind_to)| {
            let inner = job.session.lock();
            let gen = Generation::new(&job.session.model, &inner.kv, prompt, &job.request)?
                .with_prefill_chunk(self.prefill_chunk);
            Ok((gen, context, rewind_to))
        }) {
            Ok((gen, context, rewind_to)) => {
                self.with_shared(|s| s.scheduler.set_running(job.id));
                let _ = job.callback.onStarted(job.id as i64);
                self.active.push_back(Running { job, gen, rewind_to, context, started });
            }
            Err(e) => {
                {
                    let mut inner = job.session.lock();
                    let len = inner.tokens.len();
                    inner.kv.truncate(len);
                }
                self.end_unstarted(job, e)
            }
        }
    }

    /// Runs one unit of a request and streams what it produced.
    fn unit(&mut self, mut r: Running) {
        if r.job.cancel.load(Ordering::Acquire) || r.job.session.closed.load(Ordering::Acquire) {
            return self.end(r, Err(ServiceError::Cancelled));
        }
        let out = {
            let mut inner = r.job.session.lock();
            r.gen.step(&r.job.session.model, &mut inner.kv)
        };
        match out {
            Err(e) => self.end(r, Err(e.into())),
            Ok(o) => {
                if !o.ids.is_empty() || !o.text.is_empty() {
                    let ids: Vec<i32> = o.ids.iter().map(|&t| t as i32).collect();
                    if r.job.callback.onTokens(r.job.id as i64, &o.text, &ids).is_err() {
                        return self.end(r, Err(ServiceError::Cancelled));
                    }
                }
                match o.done {
                    Some(stats) => self.end(r, Ok(stats)),
                    None => self.active.push_back(r),
                }
            }
        }
    }

    /// Every started request ends here: commit or rewind the session, free the books, tell
    /// the client exactly once.
    fn end(&mut self, mut r: Running, outcome: Result<GenerationStats, ServiceError>) {
        let outcome = match outcome {
            Err(ServiceError::Cancelled) => {
                r.gen.cancel();
                Err(ServiceError::Cancelled)
            }
            other => other,
        };
        {
            let mut inner = r.job.session.lock();
            match &outcome {
                Ok(_) => commit(&r, &mut inner),
                Err(_) => {
                    inner.kv.truncate(r.rewind_to);
                    inner.tokens.truncate(r.rewind_to);
                    inner.pending.clear();
                }
            }
            inner.active_request = None;
            if r.job.session.closed.load(Ordering::Acquire) {
                SessionCore::clear(&mut inner);
            }
        }
        self.finish_books(r.job.id);
        let id = r.job.id as i64;
        let _ = match outcome {
            Ok(stats) => r.job.callback.onCompleted(id, &wire_stats(&stats, r.started.duration_since(r.job.enqueued))),
            Err(e) => r.job.callback.onError(id, e.code().0, &e.to_string()),
        };
    }

    fn end_unstarted(&mut self, job: Job, e: ServiceError) {
        {
            let mut inner = job.session.lock();
            inner.active_request = None;
            if job.session.closed.load(Ordering::Acquire) {
                SessionCore::clear(&mut inner);
            }
        }
        self.finish_books(job.id);
        let _ = job.callback.onError(job.id as i64, e.code().0, &e.to_string());
    }

    fn finish_books(&self, id: u64) {
        self.with_shared(|s| {
            s.scheduler.finished(id);
            s.death_links.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        });
    }
}

/// The prompt tokens to feed, the context they complete, and the KV length to rewind to.
fn prepare(
    job: &Job,
    inner: &mut SessionInner,
    context_limit: usize,
    max_prompt_tokens: usize,
) -> Result<(Vec<u32>, Vec<u32>, usize), ServiceError> {
    let model = &job.session.model;
    let tk = &model.tokenizer;
    let full: Vec<u32> = match &job.input {
        TurnInput::Text(t) => {
            let add_bos = inner.tokens.is_empty() && tk.add_bos;
            let mut full = inner.tokens.clone();
            full.extend_from_slice(&inner.pending);
            full.extend(tk.encode(t, false, add_bos).map_err(|e| ServiceError::InvalidArgument(e.to_string()))?);
            full
        }
        TurnInput::Chat(new) => {
            let mut messages = inner.messages.clone();
            messages.extend(new.iter().cloned());
            model.prompt_tokens(&llmd_engine::generate::Prompt::Chat(messages))?
        }
    };
    if full.len() + job.request.max_tokens > context_limit {
        return Err(ServiceError::RequestTooLarge(format!(
            "the context would hold {} prompt tokens plus up to {} new ones; this session holds {context_limit}",
            full.len(),
            job.request.max_tokens
        )));
    }
    // Reuse the longest common prefix of what the cache holds; feed the rest (at least one
    // token, so there are logits to sample from).
    let mut common = inner.tokens.iter().zip(&full).take_while(|(a, b)| a == b).count();
    if common == full.len() {
        common = common.saturating_sub(1);
    }
    let new_tokens = full.len() - common;
    if new_tokens > max_prompt_tokens {
        return Err(ServiceError::RequestTooLarge(format!(
            "prompt of {new_tokens} tokens exceeds the limit of {max_prompt_tokens}"
        )));
    }
    inner.kv.truncate(common);
    inner.tokens.truncate(common);
    inner.pending.clear();
    Ok((full[common..].to_vec(), full, common))
}

/// Makes a completed turn part of the session: its tokens, and for chat its messages.
fn commit(r: &Running, inner: &mut SessionInner) {
    let mut tokens = r.context.clone();
    tokens.extend_from_slice(r.gen.generated_ids());
    inner.pending = tokens.split_off(inner.kv.len().min(tokens.len()));
    inner.tokens = tokens;
    if let TurnInput::Chat(new) = &r.job.input {
        inner.messages.extend(new.iter().cloned());
        let reply = r.job.session.model.tokenizer.decode(r.gen.generated_ids()).unwrap_or_default();
        inner.messages.push(ChatMessage::new("assistant", &reply));
    }
}

fn wire_stats(s: &GenerationStats, queue_wait: std::time::Duration) -> WireStats {
    WireStats {
        promptTokens: s.prompt_tokens as i32,
        generatedTokens: s.generated_tokens as i32,
        queueWaitMs: queue_wait.as_millis() as i64,
        timeToFirstTokenMs: (queue_wait + s.time_to_first_token).as_millis() as i64,
        prefillTokensPerSecond: s.prefill_tokens_per_s() as f32,
        decodeTokensPerSecond: s.decode_tokens_per_s() as f32,
        finishReason: match s.finish {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
        }
        .into(),
    }
}
