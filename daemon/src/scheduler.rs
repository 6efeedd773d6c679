//! The work queue and the engine worker: every request is a sequence of units (prefill chunks,
//! decode steps). Each engine *pass* carries the units [`Policy`] chooses — the decode steps of
//! every running sequence of a model batched into one matmul pass, plus one prefill chunk — so
//! many sessions stream at once, a foreground prompt preempts background work at the next pass,
//! and a cancel or a deadline takes effect within one pass. The worker serves the CPU's queue;
//! a GPU or NPU backend adds a worker of its own over the same policy.
//!
//! Locking: `Scheduler::book` (admission counts and cancel flags) is taken briefly by Binder
//! threads and the worker; a session's lock only by the worker during a unit, never while a
//! callback is sent. Every request ends in `Worker::end`, which records the outcome once.

use crate::error::ServiceError;
use crate::policy::{self, Class, Entry, Policy, Quota, Refusal};
use crate::service::Shared;
use crate::session::{SessionCore, SessionInner};
use llmd_aidl::GenerationStats::GenerationStats as WireStats;
use llmd_aidl::IGenerationCallback::IGenerationCallback;
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::{FinishReason, GenerateRequest, Generation, GenerationStats};
use llmd_engine::model::Logits;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
    /// The session's model, resident for as long as the request runs (holding it keeps the
    /// residency manager from evicting it).
    pub model: Arc<llmd_engine::Model>,
    pub input: TurnInput,
    pub request: GenerateRequest,
    pub callback: rsbinder::Strong<dyn IGenerationCallback>,
    /// Where the worker puts the request's callbacks (see [`Outbox`]).
    outbox: Outbox,
    pub cancel: Arc<AtomicBool>,
    pub enqueued: Instant,
    /// The scheduling class (the request's hint capped by its uid's).
    pub class: Class,
    /// Milliseconds from admission by which it must finish (0 = none).
    pub deadline_ms: u64,
    /// When it was admitted, on the scheduler's clock ([`Scheduler::now_ms`]).
    pub admitted_ms: u64,
}

impl Job {
    pub fn new(
        session: Arc<SessionCore>,
        model: Arc<llmd_engine::Model>,
        uid: u32,
        input: TurnInput,
        request: GenerateRequest,
        callback: rsbinder::Strong<dyn IGenerationCallback>,
    ) -> Self {
        let cancel = Arc::new(AtomicBool::new(false));
        Self {
            id: 0,
            model,
            uid,
            session,
            input,
            request,
            outbox: Outbox::new(callback.clone(), cancel.clone()),
            callback,
            cancel,
            enqueued: Instant::now(),
            class: Class::Foreground,
            deadline_ms: 0,
            admitted_ms: 0,
        }
    }

    pub fn with_class(mut self, class: Class, deadline_ms: u64) -> Self {
        self.class = class;
        self.deadline_ms = deadline_ms;
        self
    }
}

/// Undelivered callbacks at which a request stops being decoded until its client takes them.
const MAX_UNSENT: usize = 64;

/// A request's callbacks, sent in order by a thread of its own. A client that stops reading
/// them (an app the system froze, a stuck process) then holds up only its own request: once
/// [`MAX_UNSENT`] are waiting, the request is not decoded until the client takes them, and its
/// deadline and cancellation still apply. Sent on the worker thread, one frozen client's full
/// socket had stopped every other app's generation (measured: requests behind it queued until
/// they timed out). A failed send means the client is gone: the request is cancelled.
///
/// Tokens are paced: a request's first tokens go out at once (its time to first token), later
/// ones are held and sent together once `stream_interval_ms` (config) has passed since the last
/// `onTokens`, and whatever is held goes out before `onCompleted`/`onError` — except on a
/// cancel, which drops them: the turn is rolled back, and a client that asked to stop gets at
/// most the unit that was running when its cancel landed (with the pacing, a fast machine
/// held several tokens and sent them after `cancel` had returned). No screen shows
/// text faster than a frame, and every callback costs both processes a transaction and a
/// wake-up: at 16 ms a phone app gets at most ~60 `onTokens` a second instead of one per token.
struct Outbox {
    callback: rsbinder::Strong<dyn IGenerationCallback>,
    cancel: Arc<AtomicBool>,
    /// The delivery thread's queue and the count not yet sent, once something was sent.
    line: Option<(Sender<Delivery>, Arc<AtomicUsize>)>,
    /// Tokens held back by the pacing: (request id, text, ids).
    held: Option<(i64, String, Vec<i32>)>,
    /// When the last `onTokens` was queued.
    last_tokens: Option<Instant>,
}

enum Delivery {
    Started(i64),
    Tokens(i64, String, Vec<i32>),
    Completed(i64, WireStats),
    Error(i64, i32, String),
}

impl Delivery {
    fn deliver(&self, cb: &rsbinder::Strong<dyn IGenerationCallback>) -> rsbinder::BinderResult<()> {
        match self {
            Self::Started(id) => cb.onStarted(*id),
            Self::Tokens(id, text, ids) => cb.onTokens(*id, text, ids),
            Self::Completed(id, stats) => cb.onCompleted(*id, stats),
            Self::Error(id, code, message) => cb.onError(*id, *code, message),
        }
    }
}

impl Outbox {
    fn new(callback: rsbinder::Strong<dyn IGenerationCallback>, cancel: Arc<AtomicBool>) -> Self {
        Self { callback, cancel, line: None, held: None, last_tokens: None }
    }

    /// Streams tokens: sent now if `interval` has passed since the last `onTokens` (or there
    /// was none), else held and sent with later ones (see [`Outbox::flush_due`]).
    fn tokens(&mut self, id: i64, text: String, ids: Vec<i32>, now: Instant, interval: std::time::Duration) {
        match &mut self.held {
            Some((_, t, i)) => {
                t.push_str(&text);
                i.extend(ids);
            }
            None => self.held = Some((id, text, ids)),
        }
        self.flush_due(now, interval);
    }

    /// Sends the held tokens if `interval` has passed since the last `onTokens`.
    fn flush_due(&mut self, now: Instant, interval: std::time::Duration) {
        if self.held.is_some() && self.last_tokens.is_none_or(|l| now.saturating_duration_since(l) >= interval) {
            self.flush(now);
        }
    }

    fn flush(&mut self, now: Instant) {
        if let Some((id, text, ids)) = self.held.take() {
            self.last_tokens = Some(now);
            self.queue(Delivery::Tokens(id, text, ids));
        }
    }

    /// Queues `d` after any held tokens.
    fn send(&mut self, d: Delivery) {
        self.flush(Instant::now());
        self.queue(d);
    }

    /// Drops the held tokens unsent (see the type's comment on cancels).
    fn drop_held(&mut self) {
        self.held = None;
    }

    /// Queues `d` for the client; the delivery thread starts with the first.
    fn queue(&mut self, d: Delivery) {
        if self.line.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Delivery>();
            let unsent = Arc::new(AtomicUsize::new(0));
            let (cb, cancel, left) = (self.callback.clone(), self.cancel.clone(), unsent.clone());
            let spawned = std::thread::Builder::new().name("llmd-deliver".into()).spawn(move || {
                for d in rx {
                    if d.deliver(&cb).is_err() {
                        cancel.store(true, Ordering::Release);
                    }
                    left.fetch_sub(1, Ordering::AcqRel);
                }
            });
            if spawned.is_err() {
                // No thread to be had: deliver here, as before.
                if d.deliver(&self.callback).is_err() {
                    self.cancel.store(true, Ordering::Release);
                }
                return;
            }
            self.line = Some((tx, unsent));
        }
        if let Some((tx, unsent)) = &self.line {
            unsent.fetch_add(1, Ordering::AcqRel);
            if tx.send(d).is_err() {
                unsent.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Callbacks queued and not yet taken by the client.
    fn unsent(&self) -> usize {
        self.line.as_ref().map_or(0, |(_, n)| n.load(Ordering::Acquire))
    }
}

/// A request as the books see it.
#[derive(Clone, Debug)]
pub struct JobInfo {
    pub uid: u32,
    pub session: u64,
    pub running: bool,
    pub cancel: Arc<AtomicBool>,
    pub class: Class,
    pub deadline_ms: u64,
    pub enqueued: Instant,
}

/// What the worker last reported about its queue, for dump.
#[derive(Clone, Debug, Default)]
pub struct QueueReport {
    /// (request id, class now after aging, prompt tokens left, waited since last served ms).
    pub requests: Vec<(u64, Class, usize, u64)>,
    /// Fair-share virtual time per uid.
    pub vtimes: Vec<(u32, f64)>,
    pub passes: u64,
    /// Moving average of a pass, in microseconds.
    pub avg_pass_us: u64,
    pub last_batch: usize,
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
    /// Tokens each uid used recently (for `quota_tokens_per_uid`).
    quota: Mutex<Quota>,
    report: Mutex<QueueReport>,
    epoch: Instant,
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
        (
            Self {
                tx: Mutex::new(tx),
                book: Mutex::new(Book { next_id: 1, ..Book::default() }),
                quota: Mutex::new(Quota::default()),
                report: Mutex::new(QueueReport::default()),
                epoch: Instant::now(),
            },
            rx,
        )
    }

    /// Milliseconds since the scheduler started (the policy's clock).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn quota(&self) -> std::sync::MutexGuard<'_, Quota> {
        self.quota.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records tokens a uid used.
    pub fn charge_quota(&self, uid: u32, tokens: usize) {
        let now = self.now_ms();
        self.quota().record(uid, now, tokens);
    }

    /// Tokens `uid` used in the current window.
    pub fn quota_used(&self, uid: u32, window_s: u64) -> usize {
        let now = self.now_ms();
        self.quota().used(uid, now, window_s * 1000)
    }

    pub fn publish(&self, r: QueueReport) {
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }

    pub fn report(&self) -> QueueReport {
        self.report.lock().unwrap_or_else(|p| p.into_inner()).clone()
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
        let sc = &shared_arc.config.scheduler;
        let rules = policy::Limits {
            max_requests: limits.max_requests,
            max_requests_per_uid: limits.max_requests_per_uid,
            quota_tokens: sc.quota_tokens_per_uid,
            quota_window_ms: sc.quota_window_s * 1000,
        };
        {
            let now = self.now_ms();
            let mut book = self.book();
            let mut inner = job.session.lock();
            let load = policy::Load {
                in_flight: book.jobs.len(),
                uid_in_flight: book.per_uid.get(&job.uid).copied().unwrap_or(0),
                session_busy: inner.active_request.is_some(),
                pass_ms: self.report().avg_pass_us / 1000,
            };
            policy::admit(&rules, &load, &mut self.quota(), job.uid, now).map_err(|r| match r {
                Refusal::TokenQuota { retry_ms } => ServiceError::TokenQuota {
                    uid: job.uid,
                    limit: sc.quota_tokens_per_uid,
                    window_s: sc.quota_window_s,
                    retry_ms,
                },
                Refusal::SessionBusy => {
                    ServiceError::Busy("this session is already generating; wait for it or cancel it".into())
                }
                Refusal::UidLimit { limit } => {
                    ServiceError::QuotaExceeded { uid: job.uid, what: "requests in flight", limit }
                }
                Refusal::Full { in_flight, retry_ms } => {
                    ServiceError::Busy(format!("{in_flight} requests in flight; retry in ~{retry_ms} ms"))
                }
            })?;
            job.admitted_ms = now;
            job.id = book.next_id;
            book.next_id += 1;
            inner.active_request = Some(job.id);
            drop(inner);
            book.jobs.insert(
                job.id,
                JobInfo {
                    uid: job.uid,
                    session: job.session.id,
                    running: false,
                    cancel: job.cancel.clone(),
                    class: job.class,
                    deadline_ms: job.deadline_ms,
                    enqueued: job.enqueued,
                },
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
    arrived_ms: u64,
    last_served_ms: u64,
    /// When it first got a unit (its queue wait ends there).
    first_served: Option<Instant>,
}

/// One sequence's share of an engine pass.
struct Feed {
    id: u64,
    tokens: Vec<u32>,
    prefill: bool,
}

pub struct Worker {
    rx: Receiver<Job>,
    shared: Weak<Shared>,
    prefill_chunk: usize,
    max_prompt_tokens: usize,
    active: BTreeMap<u64, Running>,
    policy: Policy,
    passes: u64,
    avg_pass_us: u64,
    /// Least time between two `onTokens` of a request (see [`Outbox`]).
    stream_interval: std::time::Duration,
}

impl Worker {
    pub fn new(
        rx: Receiver<Job>,
        shared: Weak<Shared>,
        prefill_chunk: usize,
        max_prompt_tokens: usize,
        policy: crate::policy::PolicyConfig,
    ) -> Self {
        Self {
            rx,
            shared,
            prefill_chunk,
            max_prompt_tokens,
            active: BTreeMap::new(),
            policy: Policy::new(policy),
            passes: 0,
            avg_pass_us: 0,
            stream_interval: std::time::Duration::ZERO,
        }
    }

    /// Paces each request's `onTokens` to at most one per `interval` (zero: one per pass).
    pub fn with_stream_interval(mut self, interval: std::time::Duration) -> Self {
        self.stream_interval = interval;
        self
    }

    /// Runs until every sender is gone.
    pub fn run(mut self) {
        loop {
            if self.active.is_empty() {
                self.publish(0);
                match self.rx.recv() {
                    Ok(job) => self.start(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = self.rx.try_recv() {
                self.start(job);
            }
            if !self.pass() {
                // Nothing could run (requests waiting on their clients): wait a little for
                // new work rather than spin.
                if let Ok(job) = self.rx.recv_timeout(std::time::Duration::from_millis(2)) {
                    self.start(job);
                }
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.with_shared(|s| s.scheduler.now_ms()).unwrap_or(0)
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
            // A cache spilled or dropped under memory pressure comes back first.
            crate::session::restore_kv(&job.model, &mut inner);
            prepare(&job, &mut inner, job.session.context_limit, self.max_prompt_tokens)
        };
        match prepared.and_then(|(prompt, context, rewind_to)| {
            let inner = job.session.lock();
            let gen =
                Generation::new(&job.model, &inner.kv, prompt, &job.request)?.with_prefill_chunk(self.prefill_chunk);
            Ok((gen, context, rewind_to))
        }) {
            Ok((gen, context, rewind_to)) => {
                self.with_shared(|s| s.scheduler.set_running(job.id));
                let mut job = job;
                job.outbox.send(Delivery::Started(job.id as i64));
                let now = self.now_ms();
                let waited = job.enqueued.elapsed().as_millis() as u64;
                let arrived_ms = now.saturating_sub(waited);
                self.active.insert(
                    job.id,
                    Running {
                        job,
                        gen,
                        rewind_to,
                        context,
                        started,
                        arrived_ms,
                        last_served_ms: arrived_ms,
                        first_served: None,
                    },
                );
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

    /// One engine pass: ends cancelled and expired requests, asks the policy for the units,
    /// samples and streams the decoding ones, then runs every fed token of a model in one
    /// batched forward. Returns whether it fed any (none: every request is waiting).
    fn pass(&mut self) -> bool {
        let t0 = Instant::now();
        let now_ms = self.now_ms();
        let ids: Vec<u64> = self.active.keys().copied().collect();
        for id in ids {
            let Some(r) = self.active.get(&id) else { continue };
            if r.job.cancel.load(Ordering::Acquire) || r.job.session.closed.load(Ordering::Acquire) {
                let r = self.active.remove(&id).expect("present");
                self.end(r, Err(ServiceError::Cancelled));
            } else if policy::deadline_passed(r.job.admitted_ms, r.job.deadline_ms, now_ms) {
                let r = self.active.remove(&id).expect("present");
                let d = r.job.deadline_ms;
                self.end(r, Err(ServiceError::DeadlineExceeded(d)));
            }
        }
        if self.active.is_empty() {
            return false;
        }
        // A request whose client is not taking its callbacks waits (see `Outbox`).
        let entries: Vec<Entry> = self
            .active
            .values()
            .filter(|r| r.job.outbox.unsent() < MAX_UNSENT)
            .map(|r| Entry {
                id: r.job.id,
                uid: r.job.uid,
                class: r.job.class,
                arrived_ms: r.arrived_ms,
                last_served_ms: r.last_served_ms,
                prefill_left: r.gen.prefill_chunk_tokens().map_or(0, |_| r.gen.prefill_left()),
            })
            .collect();
        let plan = self.policy.plan(now_ms, &entries);
        let mut feeds: Vec<Feed> = Vec::new();
        for id in plan.decode {
            let Some(r) = self.active.get_mut(&id) else { continue };
            let kv_len = r.job.session.lock().kv.len();
            r.last_served_ms = now_ms;
            r.first_served.get_or_insert_with(Instant::now);
            self.policy.charge(r.job.uid, 1);
            match r.gen.sample(&r.job.model, kv_len) {
                Err(e) => {
                    let r = self.active.remove(&id).expect("present");
                    self.end(r, Err(e.into()));
                }
                Ok((out, feed)) => {
                    if !out.ids.is_empty() || !out.text.is_empty() {
                        let ids: Vec<i32> = out.ids.iter().map(|&t| t as i32).collect();
                        let interval = self.stream_interval;
                        r.job.outbox.tokens(r.job.id as i64, out.text, ids, Instant::now(), interval);
                    }
                    if let Some(stats) = out.done {
                        let r = self.active.remove(&id).expect("present");
                        self.end(r, Ok(stats));
                    } else if let Some(t) = feed {
                        feeds.push(Feed { id, tokens: vec![t], prefill: false });
                    }
                }
            }
        }
        for (id, n) in plan.prefill.into_iter().chain(plan.more_prefill) {
            if let Some(r) = self.active.get_mut(&id) {
                if let Some(chunk) = r.gen.prefill_chunk_at_most(n) {
                    feeds.push(Feed { id, tokens: chunk.to_vec(), prefill: true });
                    r.last_served_ms = now_ms;
                    r.first_served.get_or_insert_with(Instant::now);
                    self.policy.charge(r.job.uid, chunk.len());
                }
            }
        }
        let batch = feeds.len();
        let fed: usize = feeds.iter().map(|f| f.tokens.len()).sum();
        let t_sampled = t0.elapsed();
        self.run_feeds(feeds);
        let us = t0.elapsed().as_micros() as u64;
        tracing::debug!(
            sequences = batch,
            tokens = fed,
            sample_us = t_sampled.as_micros() as u64,
            pass_us = us,
            active = self.active.len(),
            "pass"
        );
        // Tokens held by the pacing go out once due, whether or not their request ran.
        let now = Instant::now();
        for r in self.active.values_mut() {
            r.job.outbox.flush_due(now, self.stream_interval);
        }
        self.passes += 1;
        self.avg_pass_us = if self.avg_pass_us == 0 { us } else { (self.avg_pass_us * 7 + us) / 8 };
        self.publish(batch);
        batch > 0
    }

    /// Runs the fed tokens, one batched forward per model, and hands each sequence its logits.
    fn run_feeds(&mut self, feeds: Vec<Feed>) {
        let mut by_model: Vec<(Arc<llmd_engine::Model>, Vec<Feed>)> = Vec::new();
        for f in feeds {
            let Some(r) = self.active.get(&f.id) else { continue };
            let m = r.job.model.clone();
            match by_model.iter_mut().find(|(mm, _)| Arc::ptr_eq(mm, &m)) {
                Some((_, v)) => v.push(f),
                None => by_model.push((m, vec![f])),
            }
        }
        for (model, group) in by_model {
            let sessions: Vec<Arc<SessionCore>> =
                group.iter().filter_map(|f| self.active.get(&f.id).map(|r| r.job.session.clone())).collect();
            if sessions.len() != group.len() {
                continue;
            }
            let result = {
                let mut guards: Vec<_> = sessions.iter().map(|s| s.lock()).collect();
                let mut batch: Vec<(&mut llmd_engine::model::kv::KvCache, &[u32])> =
                    guards.iter_mut().zip(&group).map(|(g, f)| (&mut g.kv, f.tokens.as_slice())).collect();
                model.transformer.forward_batch(&mut batch, Logits::Last)
            };
            match result {
                Ok(logits) => {
                    for (f, l) in group.into_iter().zip(logits) {
                        let Some(r) = self.active.get_mut(&f.id) else { continue };
                        let uid = r.job.uid;
                        if f.prefill {
                            r.gen.accept_prefill(f.tokens.len(), l);
                        } else {
                            r.gen.accept_logits(l);
                        }
                        self.with_shared(|s| {
                            if s.config.scheduler.quota_tokens_per_uid > 0 {
                                s.scheduler.charge_quota(uid, f.tokens.len());
                            }
                        });
                    }
                }
                Err(e) => {
                    for f in group {
                        if let Some(r) = self.active.remove(&f.id) {
                            self.end(r, Err(ServiceError::Internal(e.to_string())));
                        }
                    }
                }
            }
        }
    }

    fn publish(&mut self, batch: usize) {
        let now_ms = self.now_ms();
        let requests = self
            .active
            .values()
            .map(|r| {
                let e = Entry {
                    id: r.job.id,
                    uid: r.job.uid,
                    class: r.job.class,
                    arrived_ms: r.arrived_ms,
                    last_served_ms: r.last_served_ms,
                    prefill_left: r.gen.prefill_left(),
                };
                (e.id, self.policy.effective_class(&e, now_ms), e.prefill_left, now_ms.saturating_sub(e.last_served_ms))
            })
            .collect();
        let live: std::collections::HashSet<u32> = self.active.values().map(|r| r.job.uid).collect();
        self.policy.retain_uids(|u| live.contains(&u));
        let report = QueueReport {
            requests,
            vtimes: self.policy.vtimes(),
            passes: self.passes,
            avg_pass_us: self.avg_pass_us,
            last_batch: batch,
        };
        self.with_shared(|s| s.scheduler.publish(report));
    }

    /// Every started request ends here: commit or rewind the session, free the books, tell
    /// the client exactly once.
    fn end(&mut self, mut r: Running, outcome: Result<GenerationStats, ServiceError>) {
        let outcome = match outcome {
            Err(ServiceError::Cancelled) => {
                r.gen.cancel();
                r.job.outbox.drop_held();
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
        let queue_wait = r.first_served.unwrap_or(r.started).saturating_duration_since(r.job.enqueued);
        let before_start = r.started.saturating_duration_since(r.job.enqueued);
        r.job.outbox.send(match outcome {
            Ok(stats) => Delivery::Completed(id, wire_stats(&stats, queue_wait, before_start)),
            Err(e) => Delivery::Error(id, e.code().0, e.to_string()),
        });
    }

    fn end_unstarted(&mut self, mut job: Job, e: ServiceError) {
        {
            let mut inner = job.session.lock();
            inner.active_request = None;
            if job.session.closed.load(Ordering::Acquire) {
                SessionCore::clear(&mut inner);
            }
        }
        self.finish_books(job.id);
        job.outbox.send(Delivery::Error(job.id as i64, e.code().0, e.to_string()));
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
    let model = &job.model;
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
        let reply = r.job.model.tokenizer.decode(r.gen.generated_ids()).unwrap_or_default();
        inner.messages.push(ChatMessage::new("assistant", &reply));
    }
}

/// `queue_wait`: submission to the first unit served; `before_start`: submission to the
/// generation's set-up (its own clock starts there).
fn wire_stats(s: &GenerationStats, queue_wait: std::time::Duration, before_start: std::time::Duration) -> WireStats {
    WireStats {
        promptTokens: s.prompt_tokens as i32,
        generatedTokens: s.generated_tokens as i32,
        queueWaitMs: queue_wait.as_millis() as i64,
        timeToFirstTokenMs: (before_start + s.time_to_first_token).as_millis() as i64,
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
