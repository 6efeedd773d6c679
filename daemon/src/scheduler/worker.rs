//! The engine worker: one thread that starts admitted requests and runs engine *passes*. Each
//! pass carries the units [`Policy`] chooses — the decode steps of every running sequence of a
//! model batched into one forward pass, plus prompt chunks — so many sessions stream at once,
//! a foreground prompt preempts background work at the next pass, and a cancel, a deadline or a
//! client that has left a callback untaken for the stall timeout (`stream_stall_timeout_s`)
//! takes effect within one pass. Where a unit runs is the engine's: its forward pass may send
//! the decode steps to a processor of its own (the GPU) beside the prompt chunks, and each pass
//! the worker offers the waiting prompts, best first, to the engine's scheduler, which places
//! one on a processor (the NPU) when one is free for it; that request then waits for the unit
//! to come back ([`Engine::place_prompt`], [`Engine::finished`]).
//!
//! The worker knows no model and no session. Its context is narrow: an [`Engine`] (the
//! daemon's, `conversation::engine::ModelEngine`, runs turns of sessions on `llmd_engine`
//! models; the tests below script one), the [`Admission`] books, and the jobs it receives, each
//! with its request's [`Outbox`](super::Outbox). Every job ends in `Worker::end` (or
//! `end_unstarted` if it never started), exactly once: the engine commits or rolls back the
//! turn, the books are freed, and one `onCompleted` or `onError` is queued after the request's
//! tokens.

use super::admission::{Admission, QueueReport};
use super::outbox::Delivery;
use super::Job;
use crate::error::ServiceError;
use crate::policy::{self, Entry, Policy, PolicyConfig};
use llmd_aidl::GenerationStats::GenerationStats as WireStats;
use llmd_engine::generate::{FinishReason, GenerationStats, StepOutput};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often an idle worker looks whether freed memory should go back to the system.
const IDLE_RELEASE_CHECK: Duration = Duration::from_millis(500);

/// What the worker asks of the engine for a request (a *turn* of a session). Implemented by
/// the daemon over `llmd_engine` models and sessions' KV caches (`conversation::engine`), and
/// by a scripted fake in the tests below.
pub trait Engine {
    /// What a job carries for the engine (the daemon's: the session, its model, the turn).
    type Turn: Send + 'static;
    /// A started request's generation.
    type Seq;

    /// Sets the turn up: its prompt tokens against the session's context, its generation.
    fn start(&mut self, turn: &Self::Turn) -> Result<Self::Seq, ServiceError>;
    /// Prompt tokens still to feed (0: decoding).
    fn prompt_left(&self, seq: &Self::Seq) -> usize;
    /// The next at most `n` prompt tokens to feed, if the prompt is not all fed.
    fn prompt_chunk(&self, seq: &Self::Seq, n: usize) -> Option<Vec<u32>>;

    /// Samples the next token from the last logits: what to stream, and the token to feed
    /// (none when the generation ended: then `done` is set).
    fn sample(&mut self, turn: &Self::Turn, seq: &mut Self::Seq) -> Result<(StepOutput, Option<u32>), ServiceError>;
    /// Which forward pass the turn's tokens go in (its model): turns with equal keys batch.
    fn batch_key(&self, turn: &Self::Turn) -> usize;
    /// Runs one batched forward over `batch` (all of one key) and hands each its logits.
    fn forward(&mut self, batch: &mut [Fed<'_, Self::Turn, Self::Seq>]) -> Result<(), ServiceError>;
    /// The request ended (`seq` is `None` if it never started): commit the turn to its
    /// session on success, roll it back otherwise, and free the session for its next turn.
    fn end(&mut self, turn: &Self::Turn, seq: Option<Self::Seq>, outcome: &Result<GenerationStats, ServiceError>);

    // Processors of the engine's own (the NPU) that read prompt units on threads of their own
    // while the worker runs other requests' units. The worker offers a request's prompt; the
    // engine's scheduler places it or not. An engine without processors keeps the defaults.

    /// Offers request `id`'s next prompt unit to the engine's scheduler: when a processor of
    /// its own is free for the turn's model, the unit goes there and the prompt tokens it took
    /// are returned (the request then waits for [`Self::finished`]); None leaves the prompt to
    /// the worker's own passes. Once `withdraw` is set the processor stops the unit at its next
    /// graph, and it comes back having fed nothing (the turn's cache as before it).
    fn place_prompt(
        &mut self,
        _id: u64,
        _turn: &Self::Turn,
        _seq: &Self::Seq,
        _withdraw: Arc<AtomicBool>,
    ) -> Option<usize> {
        None
    }
    /// Units the processors finished, by request id, waiting up to `wait` for the first.
    fn finished(&mut self, _wait: Duration) -> Vec<(u64, Self::Finished)> {
        Vec::new()
    }
    /// Takes a finished unit into the request's generation; returns how many prompt tokens it
    /// fed (0: withdrawn, or the processor failed and the tokens are still to feed, on the CPU).
    fn accept_finished(
        &mut self,
        _turn: &Self::Turn,
        _seq: &mut Self::Seq,
        _done: Self::Finished,
    ) -> Result<usize, ServiceError> {
        Ok(0)
    }
    /// What a finished unit hands back.
    type Finished: Send;
}

/// One sequence's share of a forward pass.
pub struct Fed<'a, T, S> {
    /// The request's id.
    pub id: u64,
    pub turn: &'a T,
    pub seq: &'a mut S,
    pub tokens: &'a [u32],
    /// Prompt tokens (else the one token `sample` returned).
    pub prefill: bool,
}

/// A request the worker is running.
struct Running<E: Engine> {
    job: Job<E::Turn>,
    seq: E::Seq,
    started: Instant,
    arrived_ms: u64,
    last_served_ms: u64,
    /// When it first got a unit (its queue wait ends there).
    first_served: Option<Instant>,
    /// A prompt unit of it is on a processor of the engine's (the request waits for it: it is
    /// neither planned nor ended until the unit comes back).
    placed: bool,
    /// Set to withdraw that unit (the request was cancelled, its session closed, its deadline
    /// passed or its client stalled): the processor stops it at its next graph.
    withdraw: Arc<AtomicBool>,
}

/// One sequence's share of an engine pass.
struct Feed {
    id: u64,
    tokens: Vec<u32>,
    prefill: bool,
}

pub struct Worker<E: Engine> {
    rx: Receiver<Job<E::Turn>>,
    admission: Arc<Admission>,
    engine: E,
    active: BTreeMap<u64, Running<E>>,
    policy: Policy,
    passes: u64,
    avg_pass_us: u64,
    /// Least time between two `onTokens` of a request (see the outbox).
    stream_interval: Duration,
    /// A request whose client has left a callback untaken this long is ended (None: never).
    stall_timeout: Option<Duration>,
}

impl<E: Engine> Worker<E> {
    /// A worker taking jobs from `rx`, keeping the books in `admission`, running `engine`.
    pub fn new(rx: Receiver<Job<E::Turn>>, admission: Arc<Admission>, engine: E, policy: PolicyConfig) -> Self {
        Self {
            rx,
            admission,
            engine,
            active: BTreeMap::new(),
            policy: Policy::new(policy),
            passes: 0,
            avg_pass_us: 0,
            stream_interval: Duration::ZERO,
            stall_timeout: None,
        }
    }

    /// Ends a request whose client has left a callback untaken for `timeout` (a stopped client)
    /// with `DEADLINE_EXCEEDED`, its turn rolled back; zero: never.
    pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = (!timeout.is_zero()).then_some(timeout);
        self
    }

    /// Paces each request's `onTokens` to at most one per `interval` (zero: one per pass).
    pub fn with_stream_interval(mut self, interval: Duration) -> Self {
        self.stream_interval = interval;
        self
    }

    /// Runs until every sender is gone.
    pub fn run(mut self) {
        // Whether requests ran since the allocator last gave free memory back.
        let mut worked = false;
        loop {
            if self.active.is_empty() {
                self.publish(0);
                if std::mem::take(&mut worked) {
                    // Idle again: the pass buffers of the requests that just ended are free,
                    // but the allocator keeps freed pages for reuse, so a long prompt's peak
                    // would stay resident (23–68 MB after one long prompt). One trim per
                    // return to idle, off every request's path.
                    llmd_alloc_sys::note_freed();
                }
                // While idle, sessions closed or reset by their clients (or the idle sweep)
                // free their KV caches on other threads; the pages go back at the next check
                // (without that, 88 MB stays resident after a soak's clients close every session).
                let job = loop {
                    llmd_alloc_sys::release_if_freed();
                    match self.rx.recv_timeout(IDLE_RELEASE_CHECK) {
                        Ok(job) => break job,
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                };
                self.start(job);
            }
            while let Ok(job) = self.rx.try_recv() {
                self.start(job);
            }
            worked = true;
            if !self.pass() {
                // Nothing could run (requests waiting on their clients or on the
                // engine's processors): wait a little for new work rather than spin.
                if self.active.values().any(|r| r.placed) {
                    self.take_finished(Duration::from_millis(2));
                } else if let Ok(job) = self.rx.recv_timeout(Duration::from_millis(2)) {
                    self.start(job);
                }
            }
        }
    }

    /// Sets up a job's generation and tells its client it started.
    fn start(&mut self, mut job: Job<E::Turn>) {
        let started = Instant::now();
        if job.stopped() {
            return self.end_unstarted(job, ServiceError::Cancelled);
        }
        match self.engine.start(&job.turn) {
            Ok(seq) => {
                self.admission.set_running(job.id);
                job.outbox.send(Delivery::Started(job.id as i64));
                let now = self.admission.now_ms();
                let waited = job.enqueued.elapsed().as_millis() as u64;
                let arrived_ms = now.saturating_sub(waited);
                self.active.insert(
                    job.id,
                    Running {
                        job,
                        seq,
                        started,
                        arrived_ms,
                        last_served_ms: arrived_ms,
                        first_served: None,
                        placed: false,
                        withdraw: Arc::new(AtomicBool::new(false)),
                    },
                );
            }
            Err(e) => self.end_unstarted(job, e),
        }
    }

    /// One engine pass: ends cancelled and expired requests (and those whose client stopped
    /// taking its callbacks), asks the policy for the units,
    /// samples and streams the decoding ones, then runs every fed token of a model in one
    /// batched forward. Returns whether it fed any (none: every request is waiting).
    fn pass(&mut self) -> bool {
        let t0 = Instant::now();
        self.take_finished(Duration::ZERO);
        let now_ms = self.admission.now_ms();
        let ids: Vec<u64> = self.active.keys().copied().collect();
        for id in ids {
            let Some(r) = self.active.get(&id) else { continue };
            if r.placed && r.withdraw.load(Ordering::Acquire) {
                // Withdrawn already: it ends once its chunk is back.
                continue;
            }
            let ending = if r.job.stopped() {
                Some(ServiceError::Cancelled)
            } else if policy::deadline_passed(r.job.admitted_ms, r.job.deadline_ms, now_ms) {
                Some(ServiceError::DeadlineExceeded(r.job.deadline_ms))
            } else if let Some(t) = self.stall_timeout.filter(|&t| r.job.outbox.stalled_for() >= t) {
                tracing::warn!(
                    request = id,
                    uid = r.job.uid,
                    "its client took no callback for {} s: ending it",
                    t.as_secs()
                );
                Some(ServiceError::StreamStalled { after_s: t.as_secs() })
            } else {
                None
            };
            if let Some(e) = ending {
                if r.placed {
                    // Its unit is on a processor, its session in use there: the unit is
                    // withdrawn (it stops at its next graph, its KV positions cut off) and the
                    // request ends once it is back, as whatever ends it now.
                    r.withdraw.store(true, Ordering::Release);
                    tracing::debug!(request = id, "withdrawing its unit from the processor: {e}");
                    continue;
                }
                let r = self.active.remove(&id).expect("present");
                self.end(r, Err(e));
            }
        }
        if self.active.is_empty() {
            return false;
        }
        // A request whose client is not taking its callbacks waits (see the outbox), and one
        // whose unit is on a processor.
        let mut entries: Vec<Entry> =
            self.active.values().filter(|r| !r.job.outbox.backlogged() && !r.placed).map(|r| self.entry(r)).collect();
        let placed = self.place_prompt(now_ms, &entries);
        entries.retain(|e| Some(e.id) != placed);
        let fg_on_processor = self.active.values().any(|r| r.placed && r.job.class == crate::policy::Class::Foreground);
        let plan = self.policy.plan_beside(now_ms, &entries, fg_on_processor);
        let mut feeds: Vec<Feed> = Vec::new();
        for id in plan.decode {
            let Some(r) = self.active.get_mut(&id) else { continue };
            r.last_served_ms = now_ms;
            r.first_served.get_or_insert_with(Instant::now);
            self.policy.charge(r.job.uid, 1);
            match self.engine.sample(&r.job.turn, &mut r.seq) {
                Err(e) => {
                    let r = self.active.remove(&id).expect("present");
                    self.end(r, Err(e));
                }
                Ok((out, feed)) => {
                    if !out.ids.is_empty() || !out.text.is_empty() {
                        let ids: Vec<i32> = out.ids.iter().map(|&t| t as i32).collect();
                        r.job.outbox.tokens(r.job.id as i64, out.text, ids, Instant::now(), self.stream_interval);
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
            let Some(r) = self.active.get_mut(&id) else { continue };
            if let Some(chunk) = self.engine.prompt_chunk(&r.seq, n) {
                r.last_served_ms = now_ms;
                r.first_served.get_or_insert_with(Instant::now);
                self.policy.charge(r.job.uid, chunk.len());
                feeds.push(Feed { id, tokens: chunk, prefill: true });
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
        batch > 0 || placed.is_some()
    }

    /// Offers the engine's scheduler the waiting prompts, best first (the policy's order, as
    /// for the CPU's prefill), until it places one on a processor of its own: that request's
    /// next unit goes there. Returns that request's id.
    fn place_prompt(&mut self, now_ms: u64, entries: &[Entry]) -> Option<u64> {
        let mut declined: Vec<u64> = Vec::new();
        loop {
            let id = self.policy.best_prompt(now_ms, entries, |e| !declined.contains(&e.id))?;
            let r = self.active.get_mut(&id)?;
            let withdraw = Arc::new(AtomicBool::new(false));
            match self.engine.place_prompt(id, &r.job.turn, &r.seq, withdraw.clone()) {
                Some(fed) => {
                    r.placed = true;
                    r.withdraw = withdraw;
                    r.last_served_ms = now_ms;
                    r.first_served.get_or_insert_with(Instant::now);
                    self.policy.charge(r.job.uid, fed);
                    return Some(id);
                }
                None => declined.push(id),
            }
        }
    }

    /// Takes back the units the processors finished (waiting up to `wait` for one): each goes
    /// into its request's generation, which is planned again from the next pass.
    fn take_finished(&mut self, wait: Duration) {
        for (id, done) in self.engine.finished(wait) {
            // (A unit whose request is no longer waiting for it reports too: ignored.)
            let Some(r) = self.active.get_mut(&id).filter(|r| r.placed) else { continue };
            r.placed = false;
            match self.engine.accept_finished(&r.job.turn, &mut r.seq, done) {
                Ok(n) => self.admission.charge(r.job.uid, n),
                Err(e) => {
                    let r = self.active.remove(&id).expect("present");
                    self.end(r, Err(e));
                }
            }
        }
    }

    fn entry(&self, r: &Running<E>) -> Entry {
        Entry {
            id: r.job.id,
            uid: r.job.uid,
            class: r.job.class,
            arrived_ms: r.arrived_ms,
            last_served_ms: r.last_served_ms,
            prefill_left: self.engine.prompt_left(&r.seq),
        }
    }

    /// Runs the fed tokens, one batched forward per batch key (model), in the order fed.
    fn run_feeds(&mut self, feeds: Vec<Feed>) {
        let mut groups: Vec<(usize, Vec<Feed>)> = Vec::new();
        for f in feeds {
            let Some(r) = self.active.get(&f.id) else { continue };
            let key = self.engine.batch_key(&r.job.turn);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(f),
                None => groups.push((key, vec![f])),
            }
        }
        for (_, group) in groups {
            let result = {
                // The running requests' state, in the order their tokens were fed.
                let mut slots: Vec<Option<Fed<'_, E::Turn, E::Seq>>> = group.iter().map(|_| None).collect();
                for (id, r) in self.active.iter_mut() {
                    if let Some(i) = group.iter().position(|f| f.id == *id) {
                        let f = &group[i];
                        slots[i] = Some(Fed {
                            id: *id,
                            turn: &r.job.turn,
                            seq: &mut r.seq,
                            tokens: &f.tokens,
                            prefill: f.prefill,
                        });
                    }
                }
                let mut batch: Vec<_> = slots.into_iter().flatten().collect();
                self.engine.forward(&mut batch)
            };
            match result {
                Ok(()) => {
                    for f in &group {
                        if let Some(r) = self.active.get(&f.id) {
                            self.admission.charge(r.job.uid, f.tokens.len());
                        }
                    }
                }
                Err(e) => {
                    for f in group {
                        if let Some(r) = self.active.remove(&f.id) {
                            self.end(r, Err(e.clone()));
                        }
                    }
                }
            }
        }
    }

    fn publish(&mut self, batch: usize) {
        let now_ms = self.admission.now_ms();
        let requests = self
            .active
            .values()
            .map(|r| {
                let e = self.entry(r);
                (e.id, self.policy.effective_class(&e, now_ms), e.prefill_left, now_ms.saturating_sub(e.last_served_ms))
            })
            .collect();
        let live: std::collections::HashSet<u32> = self.active.values().map(|r| r.job.uid).collect();
        self.policy.retain_uids(|u| live.contains(&u));
        self.admission.publish(QueueReport {
            requests,
            vtimes: self.policy.vtimes(),
            passes: self.passes,
            avg_pass_us: self.avg_pass_us,
            last_batch: batch,
        });
    }

    /// Every started request ends here: commit or roll back the turn, free the books, tell
    /// the client exactly once.
    fn end(&mut self, r: Running<E>, outcome: Result<GenerationStats, ServiceError>) {
        let Running { mut job, seq, started, first_served, .. } = r;
        if matches!(outcome, Err(ServiceError::Cancelled | ServiceError::StreamStalled { .. })) {
            job.outbox.drop_held();
        }
        self.engine.end(&job.turn, Some(seq), &outcome);
        self.admission.finish(job.id);
        let id = job.id as i64;
        let queue_wait = first_served.unwrap_or(started).saturating_duration_since(job.enqueued);
        let before_start = started.saturating_duration_since(job.enqueued);
        job.outbox.send(match outcome {
            Ok(stats) => Delivery::Completed(id, wire_stats(&stats, queue_wait, before_start)),
            Err(e) => Delivery::Error(id, e.code().0, e.to_string()),
        });
    }

    /// A request that ends before it started (cancelled while queued, or its set-up failed).
    fn end_unstarted(&mut self, mut job: Job<E::Turn>, e: ServiceError) {
        self.engine.end(&job.turn, None, &Err(e.clone()));
        self.admission.finish(job.id);
        job.outbox.send(Delivery::Error(job.id as i64, e.code().0, e.to_string()));
    }
}

/// `queue_wait`: submission to the first unit served; `before_start`: submission to the
/// generation's set-up (its own clock starts there).
fn wire_stats(s: &GenerationStats, queue_wait: Duration, before_start: Duration) -> WireStats {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Class, Limits};
    use crate::scheduler::admission::tests::{limits, manual_clock, ticket};
    use crate::scheduler::admission::Ticket;
    use crate::scheduler::outbox::tests::Recorder;
    use crate::scheduler::outbox::MAX_UNSENT;
    use crate::scheduler::Scheduler;
    use llmd_aidl::ErrorCode::ErrorCode;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;

    /// What a fake turn does: `prompt` tokens to read, then `tokens` sampled one per decode
    /// step (the last ends it, as `max_tokens` does), unless a step is scripted to fail.
    #[derive(Clone, Default)]
    struct Script {
        prompt: usize,
        tokens: Vec<u32>,
        /// `start` fails with this.
        fail_start: Option<ServiceError>,
        /// The decode step sampling the token at this index fails.
        fail_sample_at: Option<usize>,
        /// Every forward pass carrying this turn fails.
        fail_forward: bool,
        /// Its model (the batch key).
        model: usize,
        /// The accelerator takes its prompt in chunks of this many tokens.
        accel: Option<usize>,
    }

    fn script(prompt: usize, n: u32) -> Script {
        Script { prompt, tokens: (1..=n).collect(), ..Script::default() }
    }

    struct FakeTurn {
        name: &'static str,
        script: Script,
    }

    struct FakeSeq {
        prompt_left: usize,
        sampled: usize,
    }

    /// What the fake engine saw.
    #[derive(Default)]
    struct Log {
        started: Vec<&'static str>,
        /// (turn, whether it had started, its outcome: finish reason or error code).
        ended: Vec<(&'static str, bool, Result<FinishReason, ErrorCode>)>,
        /// Per forward pass: (turn, tokens, prefill).
        forwards: Vec<Vec<(&'static str, usize, bool)>>,
        sampled: BTreeMap<&'static str, usize>,
        /// Chunks handed to the accelerator: (turn, tokens).
        offloads: Vec<(&'static str, usize)>,
        /// Chunks on the accelerator: (request, tokens, its withdraw flag).
        on_accel: Vec<(u64, usize, Arc<AtomicBool>)>,
        /// The accelerator keeps its chunks until this is cleared.
        accel_hold: bool,
        /// Its chunks fail (then it is taken for failed, as the daemon's NPU is).
        accel_fails: bool,
        accel_failed: bool,
    }

    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<Log>>);

    impl Fake {
        fn log(&self) -> std::sync::MutexGuard<'_, Log> {
            self.0.lock().unwrap_or_else(|p| p.into_inner())
        }
    }

    fn stats(prompt: usize, generated: usize) -> GenerationStats {
        GenerationStats {
            prompt_tokens: prompt,
            generated_tokens: generated,
            time_to_first_token: Duration::ZERO,
            prefill_time: Duration::from_millis(1),
            decode_time: Duration::from_millis(1),
            finish: FinishReason::Length,
        }
    }

    impl Engine for Fake {
        type Turn = FakeTurn;
        type Seq = FakeSeq;

        fn start(&mut self, t: &FakeTurn) -> Result<FakeSeq, ServiceError> {
            if let Some(e) = &t.script.fail_start {
                return Err(e.clone());
            }
            self.log().started.push(t.name);
            Ok(FakeSeq { prompt_left: t.script.prompt, sampled: 0 })
        }

        fn prompt_left(&self, s: &FakeSeq) -> usize {
            s.prompt_left
        }

        fn prompt_chunk(&self, s: &FakeSeq, n: usize) -> Option<Vec<u32>> {
            (s.prompt_left > 0).then(|| vec![0; s.prompt_left.min(n.max(1))])
        }

        fn sample(&mut self, t: &FakeTurn, s: &mut FakeSeq) -> Result<(StepOutput, Option<u32>), ServiceError> {
            assert_eq!(s.prompt_left, 0, "{}: sampled before its prompt was read", t.name);
            if t.script.fail_sample_at == Some(s.sampled) {
                return Err(ServiceError::Internal("scripted sampling failure".into()));
            }
            *self.log().sampled.entry(t.name).or_default() += 1;
            let tok = t.script.tokens[s.sampled];
            s.sampled += 1;
            let last = s.sampled == t.script.tokens.len();
            let out = StepOutput {
                text: format!("t{tok} "),
                ids: vec![tok],
                done: last.then(|| stats(t.script.prompt, s.sampled)),
            };
            Ok((out, (!last).then_some(tok)))
        }

        fn batch_key(&self, t: &FakeTurn) -> usize {
            t.script.model
        }

        fn forward(&mut self, batch: &mut [Fed<'_, FakeTurn, FakeSeq>]) -> Result<(), ServiceError> {
            self.log().forwards.push(batch.iter().map(|f| (f.turn.name, f.tokens.len(), f.prefill)).collect());
            if batch.iter().any(|f| f.turn.script.fail_forward) {
                return Err(ServiceError::Internal("scripted backend failure".into()));
            }
            for f in batch.iter_mut() {
                if f.prefill {
                    f.seq.prompt_left -= f.tokens.len();
                }
            }
            Ok(())
        }

        fn end(&mut self, t: &FakeTurn, seq: Option<FakeSeq>, outcome: &Result<GenerationStats, ServiceError>) {
            let o = outcome.as_ref().map(|s| s.finish).map_err(ServiceError::code);
            self.log().ended.push((t.name, seq.is_some(), o));
        }

        type Finished = (usize, bool);

        fn place_prompt(&mut self, id: u64, t: &FakeTurn, s: &FakeSeq, withdraw: Arc<AtomicBool>) -> Option<usize> {
            let mut log = self.log();
            // One unit at a time on its one processor, which takes this turn's model unless it
            // failed.
            let n = t.script.accel.filter(|_| !log.accel_failed && log.on_accel.is_empty())?;
            let n = s.prompt_left.min(n);
            log.offloads.push((t.name, n));
            log.on_accel.push((id, n, withdraw));
            Some(n)
        }

        fn finished(&mut self, _wait: Duration) -> Vec<(u64, (usize, bool))> {
            let mut log = self.log();
            if log.accel_hold {
                return Vec::new();
            }
            let ok = !log.accel_fails;
            // A withdrawn unit comes back having fed nothing.
            log.on_accel
                .drain(..)
                .map(|(id, n, w)| (id, if w.load(Ordering::Acquire) { (0, true) } else { (n, ok) }))
                .collect()
        }

        fn accept_finished(
            &mut self,
            _t: &FakeTurn,
            s: &mut FakeSeq,
            (n, ok): (usize, bool),
        ) -> Result<usize, ServiceError> {
            if !ok {
                self.log().accel_failed = true;
                return Ok(0);
            }
            s.prompt_left -= n;
            Ok(n)
        }
    }

    /// A request as the test sees it.
    struct Handle {
        id: u64,
        cancel: Arc<AtomicBool>,
        closed: Arc<AtomicBool>,
        sink: Arc<Recorder>,
    }

    struct Harness {
        worker: Worker<Fake>,
        fake: Fake,
        admission: Arc<Admission>,
        clock: Arc<AtomicU64>,
    }

    fn harness(l: Limits, policy: PolicyConfig, interval: Duration) -> Harness {
        harness_with_stall(l, policy, interval, Duration::ZERO)
    }

    fn harness_with_stall(l: Limits, policy: PolicyConfig, interval: Duration, stall: Duration) -> Harness {
        let (clock_fn, clock) = manual_clock();
        let admission = Arc::new(Admission::with_clock(l, clock_fn));
        let fake = Fake::default();
        let (_, rx) = std::sync::mpsc::channel();
        let worker = Worker::new(rx, admission.clone(), fake.clone(), policy)
            .with_stream_interval(interval)
            .with_stall_timeout(stall);
        Harness { worker, fake, admission, clock }
    }

    fn default_harness() -> Harness {
        harness(limits(8, 8), PolicyConfig::default(), Duration::ZERO)
    }

    impl Harness {
        /// Admits a turn; the job is the test's to start.
        fn admit(&self, name: &'static str, s: Script, sink: Arc<Recorder>, t: Ticket) -> (Job<FakeTurn>, Handle) {
            let a = self.admission.admit(t).expect("admitted");
            let closed = Arc::new(AtomicBool::new(false));
            let h = Handle { id: a.id, cancel: a.cancel.clone(), closed: closed.clone(), sink: sink.clone() };
            (Job::new(a, closed, sink, FakeTurn { name, script: s }), h)
        }

        /// Admits and starts a turn on session `session`.
        fn start(&mut self, name: &'static str, s: Script, session: u64) -> Handle {
            let (job, h) = self.admit(name, s, Recorder::new(), ticket(1, session));
            self.worker.start(job);
            h
        }

        /// Runs passes until no request is left (at most `max`).
        fn run(&mut self, max: usize) {
            self.run_until(max, |h| h.worker.active.is_empty());
            assert!(self.worker.active.is_empty(), "requests still running after {max} passes");
        }

        /// Runs passes until `done` (at most `max`; waiting a little when nothing could run,
        /// for clients to take their callbacks).
        fn run_until(&mut self, max: usize, done: impl Fn(&Self) -> bool) {
            for _ in 0..max {
                if done(self) {
                    return;
                }
                if !self.worker.pass() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            assert!(done(self), "not done after {max} passes");
        }

        fn ended(&self, name: &str) -> Vec<(bool, Result<FinishReason, ErrorCode>)> {
            self.fake.log().ended.iter().filter(|e| e.0 == name).map(|e| (e.1, e.2)).collect()
        }
    }

    fn token_ids(got: &[Delivery]) -> Vec<i32> {
        got.iter().flat_map(|d| if let Delivery::Tokens(_, _, ids) = d { ids.clone() } else { vec![] }).collect()
    }

    /// The request ended once, as `outcome`, its books are free, and its client got exactly one
    /// final callback, last, with the request's id. Returns what the client got.
    fn assert_ended_once(
        h: &Harness,
        name: &str,
        r: &Handle,
        started: bool,
        outcome: Result<FinishReason, ErrorCode>,
    ) -> Vec<Delivery> {
        assert_eq!(h.ended(name), vec![(started, outcome)], "{name} ends exactly once");
        assert!(h.admission.snapshot().iter().all(|(id, _)| *id != r.id), "{name}'s books are freed");
        let got = r.sink.wait_final();
        std::thread::sleep(Duration::from_millis(20));
        let got_later = r.sink.got();
        assert_eq!(got, got_later, "nothing after the final callback");
        assert_eq!(got.iter().filter(|d| d.is_final()).count(), 1, "{name}: one final callback: {got:?}");
        let id = r.id as i64;
        match (outcome, got.last()) {
            (Ok(_), Some(Delivery::Completed(i, s))) => assert_eq!((*i, s.finishReason.as_str()), (id, "length")),
            (Err(code), Some(Delivery::Error(i, c, _))) => assert_eq!((*i, *c), (id, code.0)),
            (o, last) => panic!("{name}: expected {o:?}, the last callback was {last:?}"),
        }
        assert_eq!(got.first().is_some_and(|d| *d == Delivery::Started(id)), started, "{name}: onStarted iff started");
        got
    }

    #[test]
    fn a_request_is_started_reads_its_prompt_streams_its_tokens_and_completes_once() {
        let mut h = default_harness();
        let r = h.start("a", script(5, 3), 1);
        assert!(h.admission.snapshot()[0].1.running, "booked as running once started");
        h.run(20);
        let got = assert_ended_once(&h, "a", &r, true, Ok(FinishReason::Length));
        assert_eq!(token_ids(&got), vec![1, 2, 3], "every token, in order, before onCompleted");
        let Some(Delivery::Completed(_, s)) = got.last() else { unreachable!() };
        assert_eq!((s.promptTokens, s.generatedTokens), (5, 3));
        let log = h.fake.log();
        assert_eq!(log.started, vec!["a"]);
        assert_eq!(
            log.forwards,
            vec![vec![("a", 5, true)], vec![("a", 1, false)], vec![("a", 1, false)]],
            "the prompt in one chunk, then each sampled token fed but the last"
        );
    }

    /// The forwards' entries of `name`: (tokens, prefill).
    fn forwards_of(h: &Harness, name: &str) -> Vec<(usize, bool)> {
        h.fake.log().forwards.iter().flatten().filter(|f| f.0 == name).map(|f| (f.1, f.2)).collect()
    }

    #[test]
    fn a_prompt_on_the_accelerator_waits_for_it_while_others_decode_on_the_cpu() {
        let mut h = default_harness();
        let b = h.start("b", script(1, 20), 2);
        h.worker.pass();
        h.fake.log().accel_hold = true;
        let a = h.start("a", Script { accel: Some(32), ..script(70, 2) }, 1);
        for _ in 0..4 {
            h.worker.pass();
        }
        assert_eq!(h.fake.log().offloads, vec![("a", 32)], "a's first chunk went to the accelerator, once");
        assert!(forwards_of(&h, "a").is_empty(), "nothing of a on the CPU while its chunk is out");
        assert_eq!(forwards_of(&h, "b").iter().filter(|f| !f.1).count(), 4, "b decoded meanwhile, one step a pass");
        h.fake.log().accel_hold = false;
        h.run(60);
        assert_eq!(h.fake.log().offloads, vec![("a", 32), ("a", 32), ("a", 6)], "a's whole prompt on it");
        assert_eq!(forwards_of(&h, "a"), vec![(1, false)], "a decodes on the CPU");
        assert_ended_once(&h, "a", &a, true, Ok(FinishReason::Length));
        assert_ended_once(&h, "b", &b, true, Ok(FinishReason::Length));
    }

    #[test]
    fn a_request_cancelled_while_its_chunk_is_on_the_accelerator_ends_once_when_it_is_back() {
        let mut h = default_harness();
        h.fake.log().accel_hold = true;
        let a = h.start("a", Script { accel: Some(32), ..script(70, 2) }, 1);
        h.worker.pass();
        a.cancel.store(true, Ordering::Release);
        for _ in 0..3 {
            h.worker.pass();
        }
        assert!(h.ended("a").is_empty(), "not ended while the accelerator holds its session");
        assert!(withdrawn(&h), "the cancel withdrew the chunk");
        h.fake.log().accel_hold = false;
        h.run(5);
        assert_ended_once(&h, "a", &a, true, Err(ErrorCode::CANCELLED));
        assert_eq!(h.fake.log().offloads.len(), 1, "no chunk after the cancel");
    }

    /// Whether the chunk on the accelerator has been withdrawn.
    fn withdrawn(h: &Harness) -> bool {
        h.fake.log().on_accel.iter().any(|c| c.2.load(Ordering::Acquire))
    }

    #[test]
    fn a_request_past_its_deadline_withdraws_its_chunk_and_ends_when_it_is_back() {
        let mut h = default_harness();
        h.fake.log().accel_hold = true;
        let mut t = ticket(1, 1);
        t.deadline_ms = 100;
        let (job, a) = h.admit("a", Script { accel: Some(32), ..script(70, 2) }, Recorder::new(), t);
        h.worker.start(job);
        h.worker.pass();
        assert!(!withdrawn(&h));
        h.clock.store(150, Ordering::Relaxed);
        h.worker.pass();
        assert!(withdrawn(&h), "the deadline withdrew the chunk");
        assert!(h.ended("a").is_empty(), "not ended while the accelerator holds its session");
        h.fake.log().accel_hold = false;
        h.run(5);
        assert_ended_once(&h, "a", &a, true, Err(ErrorCode::DEADLINE_EXCEEDED));
        assert!(forwards_of(&h, "a").is_empty(), "nothing of it on the CPU after the withdrawal");
    }

    #[test]
    fn while_a_foreground_prompt_is_on_the_accelerator_only_foreground_work_runs_on_the_cpu() {
        let mut h = default_harness();
        let (job, bg) =
            h.admit("bg", script(1, 40), Recorder::new(), Ticket { class: Class::Background, ..ticket(2, 2) });
        h.worker.start(job);
        h.worker.pass();
        h.fake.log().accel_hold = true;
        let fg = h.start("fg", Script { accel: Some(32), ..script(70, 2) }, 1);
        let before = forwards_of(&h, "bg").len();
        for _ in 0..3 {
            h.worker.pass();
        }
        assert_eq!(forwards_of(&h, "bg").len(), before, "no background step beside a foreground prompt's chunk");
        h.fake.log().accel_hold = false;
        h.run(120);
        assert_ended_once(&h, "fg", &fg, true, Ok(FinishReason::Length));
        assert_ended_once(&h, "bg", &bg, true, Ok(FinishReason::Length));
    }

    #[test]
    fn a_chunk_the_accelerator_fails_is_read_on_the_cpu() {
        let mut h = default_harness();
        h.fake.log().accel_fails = true;
        let a = h.start("a", Script { accel: Some(32), ..script(70, 2) }, 1);
        h.run(20);
        assert_eq!(h.fake.log().offloads, vec![("a", 32)], "one try; then the accelerator is taken for failed");
        assert_eq!(forwards_of(&h, "a"), vec![(70, true), (1, false)], "the whole prompt read on the CPU");
        assert_ended_once(&h, "a", &a, true, Ok(FinishReason::Length));
    }

    #[test]
    fn a_cancelled_request_ends_once_rolled_back_and_its_held_tokens_are_dropped() {
        let mut h = harness(limits(8, 8), PolicyConfig::default(), Duration::from_secs(60));
        let r = h.start("a", script(2, 50), 1);
        for _ in 0..5 {
            h.worker.pass();
        }
        r.cancel.store(true, Ordering::Release);
        h.run(3);
        let got = assert_ended_once(&h, "a", &r, true, Err(ErrorCode::CANCELLED));
        assert_eq!(token_ids(&got), vec![1], "the first token went at once; the paced rest is dropped");
    }

    #[test]
    fn a_request_cancelled_while_queued_ends_without_starting() {
        let mut h = default_harness();
        let (job, r) = h.admit("q", script(2, 3), Recorder::new(), ticket(1, 1));
        r.cancel.store(true, Ordering::Release);
        h.worker.start(job);
        assert!(h.worker.active.is_empty());
        assert_ended_once(&h, "q", &r, false, Err(ErrorCode::CANCELLED));
        assert!(h.fake.log().started.is_empty(), "never set up");
    }

    #[test]
    fn a_dead_client_or_a_closed_session_ends_its_request_as_cancelled() {
        let mut h = default_harness();
        // The death recipient sets the cancel flag and closes the session; a close alone (the
        // owner's close(), the last reference dropped) only closes it.
        let died = h.start("died", script(2, 50), 1);
        let closed = h.start("closed", script(2, 50), 2);
        let other = h.start("other", script(2, 5), 3);
        h.worker.pass();
        died.cancel.store(true, Ordering::Release);
        died.closed.store(true, Ordering::Release);
        closed.closed.store(true, Ordering::Release);
        h.worker.pass();
        assert_ended_once(&h, "died", &died, true, Err(ErrorCode::CANCELLED));
        assert_ended_once(&h, "closed", &closed, true, Err(ErrorCode::CANCELLED));
        h.run(20);
        assert_ended_once(&h, "other", &other, true, Ok(FinishReason::Length));
    }

    #[test]
    fn a_client_whose_callbacks_fail_is_taken_for_dead() {
        let mut h = default_harness();
        let (job, r) = h.admit("gone", script(2, 50), Recorder::gone(), ticket(1, 1));
        h.worker.start(job);
        let t = Instant::now();
        while !r.cancel.load(Ordering::Acquire) {
            assert!(t.elapsed() < Duration::from_secs(10), "a failed onStarted cancels the request");
            std::thread::sleep(Duration::from_millis(1));
        }
        h.run(2);
        assert_eq!(h.ended("gone"), vec![(true, Err(ErrorCode::CANCELLED))]);
        assert!(h.admission.snapshot().is_empty());
        while r.sink.refused() < 2 {
            assert!(t.elapsed() < Duration::from_secs(10), "the final callback is tried too");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(r.sink.got().is_empty());
    }

    #[test]
    fn errors_end_a_request_once_with_their_code_after_its_tokens() {
        let mut h = default_harness();
        let bad_start = Script { fail_start: Some(ServiceError::RequestTooLarge("scripted".into())), ..script(2, 3) };
        let a = h.start("start", bad_start, 1);
        assert_ended_once(&h, "start", &a, false, Err(ErrorCode::REQUEST_TOO_LARGE));
        let b = h.start("sample", Script { fail_sample_at: Some(2), model: 1, ..script(2, 5) }, 2);
        let c = h.start("forward", Script { fail_forward: true, model: 2, ..script(2, 5) }, 3);
        h.run(10);
        let got = assert_ended_once(&h, "sample", &b, true, Err(ErrorCode::INTERNAL));
        assert_eq!(token_ids(&got), vec![1, 2], "the tokens before the failure went first");
        assert_ended_once(&h, "forward", &c, true, Err(ErrorCode::INTERNAL));
    }

    #[test]
    fn a_request_past_its_deadline_ends_at_the_next_pass() {
        let mut h = default_harness();
        let (job, r) = h.admit("late", script(2, 500), Recorder::new(), Ticket { deadline_ms: 100, ..ticket(1, 1) });
        h.worker.start(job);
        let free = h.start("free", script(2, 500), 2);
        for _ in 0..3 {
            h.worker.pass();
        }
        h.clock.store(99, Ordering::Release);
        h.worker.pass();
        assert!(h.ended("late").is_empty(), "not yet");
        h.clock.store(100, Ordering::Release);
        h.worker.pass();
        assert_ended_once(&h, "late", &r, true, Err(ErrorCode::DEADLINE_EXCEEDED));
        assert!(h.ended("free").is_empty(), "no deadline, still running");
        free.cancel.store(true, Ordering::Release);
        h.run(2);
    }

    #[test]
    fn a_client_that_stops_reading_holds_up_only_its_own_request() {
        let mut h = default_harness();
        let (job, frozen) = h.admit("frozen", script(1, 100), Recorder::stopped(), ticket(1, 1));
        h.worker.start(job);
        let live = h.start("live", script(1, 100), 2);
        h.run_until(5000, |h| !h.ended("live").is_empty());
        let got = assert_ended_once(&h, "live", &live, true, Ok(FinishReason::Length));
        assert_eq!(token_ids(&got), (1..=100).collect::<Vec<_>>());
        // onStarted and 63 onTokens wait for the frozen client: it is no longer decoded.
        assert_eq!(h.fake.log().sampled["frozen"], MAX_UNSENT - 1);
        for _ in 0..10 {
            assert!(!h.worker.pass(), "nothing to feed while its client is frozen");
        }
        assert_eq!(h.fake.log().sampled["frozen"], MAX_UNSENT - 1);
        assert!(frozen.sink.got().is_empty() && h.ended("frozen").is_empty());
        frozen.sink.set_stopped(false);
        h.run(5000);
        let got = assert_ended_once(&h, "frozen", &frozen, true, Ok(FinishReason::Length));
        assert_eq!(token_ids(&got), (1..=100).collect::<Vec<_>>(), "nothing lost while it was frozen");
    }

    #[test]
    fn a_client_that_takes_no_callback_for_the_stall_timeout_has_its_request_ended() {
        let mut h =
            harness_with_stall(limits(8, 8), PolicyConfig::default(), Duration::ZERO, Duration::from_millis(200));
        let (job, frozen) = h.admit("frozen", script(1, 1000), Recorder::stopped(), ticket(1, 1));
        let t = Instant::now();
        h.worker.start(job);
        let live = h.start("live", script(1, 100), 2);
        h.run_until(100_000, |h| !h.ended("frozen").is_empty());
        assert!(t.elapsed() >= Duration::from_millis(200), "ended before the timeout: {:?}", t.elapsed());
        assert!(h.admission.snapshot().iter().all(|(id, _)| *id != frozen.id), "its books are freed at once");
        h.run(5000);
        assert_ended_once(&h, "live", &live, true, Ok(FinishReason::Length));
        // Let go, the client gets what was sent before it stopped, then the request's end.
        frozen.sink.set_stopped(false);
        let got = assert_ended_once(&h, "frozen", &frozen, true, Err(ErrorCode::DEADLINE_EXCEEDED));
        assert!(token_ids(&got).len() < MAX_UNSENT, "it was not decoded past its backlog");
    }

    #[test]
    fn decode_steps_of_one_model_share_a_forward_and_other_models_get_their_own() {
        let mut h = default_harness();
        let a = h.start("a", script(1, 3), 1);
        let b = h.start("b", script(1, 3), 2);
        let c = h.start("c", Script { model: 9, ..script(1, 3) }, 3);
        h.run(10);
        for (n, r) in [("a", &a), ("b", &b), ("c", &c)] {
            assert_ended_once(&h, n, r, true, Ok(FinishReason::Length));
        }
        let log = h.fake.log();
        assert_eq!(log.forwards[0], vec![("a", 1, true), ("b", 1, true)], "prompts arriving together share a pass");
        assert_eq!(log.forwards[1], vec![("c", 1, true)], "another model, another forward");
        assert_eq!(log.forwards[2], vec![("a", 1, false), ("b", 1, false)], "one batched decode step per model");
        assert_eq!(log.forwards[3], vec![("c", 1, false)]);
    }

    /// The worker thread as the daemon starts it: jobs queued through [`Scheduler`].
    #[test]
    fn the_worker_thread_serves_queued_jobs() {
        let admission = Arc::new(Admission::new(limits(8, 8)));
        let sched = Scheduler::start(
            admission.clone(),
            Fake::default(),
            PolicyConfig::default(),
            Duration::ZERO,
            Duration::ZERO,
        )
        .expect("worker thread");
        let sinks: Vec<Arc<Recorder>> = (0..3).map(|_| Recorder::new()).collect();
        for (i, sink) in sinks.iter().enumerate() {
            let a = admission.admit(Ticket { class: Class::Background, ..ticket(1, i as u64) }).expect("admitted");
            let turn = FakeTurn { name: "t", script: script(3, 4) };
            assert!(sched.queue(Job::new(a, Arc::new(AtomicBool::new(false)), sink.clone(), turn)).is_ok());
        }
        for sink in &sinks {
            let got = sink.wait_final();
            assert!(matches!(got.last(), Some(Delivery::Completed(..))), "{got:?}");
            assert_eq!(token_ids(&got), vec![1, 2, 3, 4]);
        }
        let t = Instant::now();
        while !admission.snapshot().is_empty() || admission.report().passes == 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "books freed, passes reported");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
