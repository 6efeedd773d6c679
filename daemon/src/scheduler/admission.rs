//! Admission: the books of requests in flight (queued or running), the per-uid token quota,
//! and the calls into [`policy::admit`]; its refusals become `ServiceError`s here. The books
//! also hold each request's cancel flag, so Binder threads (cancel, close, a client's death)
//! reach a request without going through the worker.
//!
//! Locking: `books`, `quota` and `report` are each held only for a few map operations, by
//! Binder threads and the worker; never while a session's lock is wanted (a caller may hold a
//! session's lock while it calls in).

use crate::error::ServiceError;
use crate::policy::{self, Class, Quota, Refusal};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// What admission needs to know about a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub uid: u32,
    /// The session it continues (one request per session at a time).
    pub session: u64,
    /// The scheduling class (the request's hint capped by its uid's).
    pub class: Class,
    /// Milliseconds from admission by which it must finish (0 = none).
    pub deadline_ms: u64,
}

/// An admitted request: its id and the books' handles on it.
#[derive(Clone, Debug)]
pub struct Admitted {
    pub id: u64,
    pub ticket: Ticket,
    /// Set to stop it (cancel, close, the client's death, a failed callback).
    pub cancel: Arc<AtomicBool>,
    /// When it was admitted, on the admission clock ([`Admission::now_ms`]).
    pub admitted_ms: u64,
    pub enqueued: Instant,
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

/// What the worker last reported about its queue, for dump (and the BUSY retry hint).
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
struct Books {
    next_id: u64,
    jobs: BTreeMap<u64, JobInfo>,
    per_uid: HashMap<u32, usize>,
}

/// The admission clock: milliseconds since some fixed start.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

pub struct Admission {
    limits: policy::Limits,
    books: Mutex<Books>,
    /// Tokens each uid used recently (for `limits.quota_tokens`).
    quota: Mutex<Quota>,
    report: Mutex<QueueReport>,
    clock: Clock,
    /// The daemon is stopping: no request is admitted any more.
    closing: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Admission {
    /// Books under `limits`, on a clock that starts now.
    pub fn new(limits: policy::Limits) -> Self {
        let epoch = Instant::now();
        Self::with_clock(limits, Arc::new(move || epoch.elapsed().as_millis() as u64))
    }

    pub fn with_clock(limits: policy::Limits, clock: Clock) -> Self {
        Self {
            limits,
            books: Mutex::new(Books { next_id: 1, ..Books::default() }),
            quota: Mutex::new(Quota::default()),
            report: Mutex::new(QueueReport::default()),
            clock,
            closing: AtomicBool::new(false),
        }
    }

    /// Milliseconds on the admission clock (the policy's clock: admission times, deadlines,
    /// aging, the quota window).
    pub fn now_ms(&self) -> u64 {
        (self.clock)()
    }

    /// Admits a request or says why not (checked in [`policy::admit`]'s order: the uid's token
    /// quota, one request per session, the uid's requests in flight, the daemon's): gives it
    /// an id and books it as queued.
    pub fn admit(&self, t: Ticket) -> Result<Admitted, ServiceError> {
        if self.closing.load(Ordering::Acquire) {
            return Err(ServiceError::Busy("llmd is shutting down".into()));
        }
        let now = self.now_ms();
        let pass_ms = lock(&self.report).avg_pass_us / 1000;
        let mut books = lock(&self.books);
        let load = policy::Load {
            in_flight: books.jobs.len(),
            uid_in_flight: books.per_uid.get(&t.uid).copied().unwrap_or(0),
            session_busy: books.jobs.values().any(|j| j.session == t.session),
            pass_ms,
        };
        policy::admit(&self.limits, &load, &mut lock(&self.quota), t.uid, now).map_err(|r| self.refused(t.uid, r))?;
        let id = books.next_id;
        books.next_id += 1;
        let a = Admitted {
            id,
            ticket: t,
            cancel: Arc::new(AtomicBool::new(false)),
            admitted_ms: now,
            enqueued: Instant::now(),
        };
        books.jobs.insert(
            id,
            JobInfo {
                uid: t.uid,
                session: t.session,
                running: false,
                cancel: a.cancel.clone(),
                class: t.class,
                deadline_ms: t.deadline_ms,
                enqueued: a.enqueued,
            },
        );
        *books.per_uid.entry(t.uid).or_default() += 1;
        Ok(a)
    }

    fn refused(&self, uid: u32, r: Refusal) -> ServiceError {
        match r {
            Refusal::TokenQuota { retry_ms } => ServiceError::TokenQuota {
                uid,
                limit: self.limits.quota_tokens,
                window_s: self.limits.quota_window_ms / 1000,
                retry_ms,
            },
            Refusal::SessionBusy => {
                ServiceError::Busy("this session is already generating; wait for it or cancel it".into())
            }
            Refusal::UidLimit { limit } => ServiceError::QuotaExceeded { uid, what: "requests in flight", limit },
            Refusal::Full { in_flight, retry_ms } => {
                ServiceError::Busy(format!("{in_flight} requests in flight; retry in ~{retry_ms} ms"))
            }
        }
    }

    /// Admits nothing from now on (the daemon is stopping).
    pub fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        lock(&self.books).jobs.len()
    }

    /// Asks every request to stop.
    pub fn cancel_all(&self) {
        for j in lock(&self.books).jobs.values() {
            j.cancel.store(true, Ordering::Release);
        }
    }

    /// Asks a request of `session` to stop (no-op if it already ended).
    pub fn cancel(&self, session: u64, id: u64) {
        if let Some(j) = lock(&self.books).jobs.get(&id).filter(|j| j.session == session) {
            j.cancel.store(true, Ordering::Release);
        }
    }

    /// Cancels every request of a session.
    pub fn cancel_session(&self, session: u64) {
        for j in lock(&self.books).jobs.values().filter(|j| j.session == session) {
            j.cancel.store(true, Ordering::Release);
        }
    }

    /// The worker started the request.
    pub fn set_running(&self, id: u64) {
        if let Some(j) = lock(&self.books).jobs.get_mut(&id) {
            j.running = true;
        }
    }

    /// The request ended (or never reached the worker): its place is free.
    pub fn finish(&self, id: u64) {
        let mut books = lock(&self.books);
        if let Some(j) = books.jobs.remove(&id) {
            if let Some(n) = books.per_uid.get_mut(&j.uid) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    books.per_uid.remove(&j.uid);
                }
            }
        }
    }

    /// Requests in flight, for status and dump.
    pub fn snapshot(&self) -> Vec<(u64, JobInfo)> {
        lock(&self.books).jobs.iter().map(|(k, v)| (*k, v.clone())).collect()
    }

    /// Records `tokens` a uid's request fed to the model (when there is a token quota).
    pub fn charge(&self, uid: u32, tokens: usize) {
        if self.limits.quota_tokens > 0 {
            let now = self.now_ms();
            lock(&self.quota).record(uid, now, tokens);
        }
    }

    /// Tokens `uid` used in the current window of `window_s` seconds.
    pub fn quota_used(&self, uid: u32, window_s: u64) -> usize {
        let now = self.now_ms();
        lock(&self.quota).used(uid, now, window_s * 1000)
    }

    pub fn publish(&self, r: QueueReport) {
        *lock(&self.report) = r;
    }

    pub fn report(&self) -> QueueReport {
        lock(&self.report).clone()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::error::ServiceError as E;
    use std::sync::atomic::AtomicU64;

    /// A clock the test moves by hand.
    pub(crate) fn manual_clock() -> (Clock, Arc<AtomicU64>) {
        let t = Arc::new(AtomicU64::new(0));
        let c = t.clone();
        (Arc::new(move || c.load(Ordering::Acquire)), t)
    }

    pub(crate) fn limits(max_requests: usize, per_uid: usize) -> policy::Limits {
        policy::Limits { max_requests, max_requests_per_uid: per_uid, quota_tokens: 0, quota_window_ms: 60_000 }
    }

    pub(crate) fn ticket(uid: u32, session: u64) -> Ticket {
        Ticket { uid, session, class: Class::Foreground, deadline_ms: 0 }
    }

    fn code(r: Result<Admitted, ServiceError>) -> (llmd_aidl::ErrorCode::ErrorCode, String) {
        let e = r.expect_err("refused");
        (e.code(), e.to_string())
    }

    #[test]
    fn requests_are_limited_per_uid_and_daemon_wide() {
        let (clock, _) = manual_clock();
        let a = Admission::with_clock(limits(3, 2), clock);
        let r1 = a.admit(ticket(10, 1)).expect("first");
        let r2 = a.admit(ticket(10, 2)).expect("second of the uid");
        assert_eq!((r1.id, r2.id), (1, 2), "ids count up from 1");
        let (c, m) = code(a.admit(ticket(10, 3)));
        assert_eq!(c, llmd_aidl::ErrorCode::ErrorCode::QUOTA_EXCEEDED, "{m}");
        assert!(m.contains("limit of 2 requests in flight"), "{m}");
        a.admit(ticket(11, 4)).expect("another uid still gets in");
        let (c, _) = code(a.admit(ticket(12, 5)));
        assert_eq!(c, llmd_aidl::ErrorCode::ErrorCode::BUSY, "the daemon is full");
        assert_eq!(a.snapshot().len(), 3, "refusals book nothing");
        a.finish(r1.id);
        a.admit(ticket(10, 3)).expect("a place freed by an end is taken");
        a.finish(r1.id);
        assert_eq!(a.snapshot().len(), 3, "finishing twice frees once");
    }

    #[test]
    fn a_full_daemon_answers_busy_with_a_hint_of_one_pass_per_request() {
        let (clock, _) = manual_clock();
        let a = Admission::with_clock(limits(2, 8), clock);
        a.admit(ticket(1, 1)).expect("1");
        a.admit(ticket(2, 2)).expect("2");
        let (c, m) = code(a.admit(ticket(3, 3)));
        assert_eq!(c, llmd_aidl::ErrorCode::ErrorCode::BUSY);
        assert!(m.contains("2 requests in flight; retry in ~20 ms"), "no pass measured: 10 ms each: {m}");
        a.publish(QueueReport { avg_pass_us: 35_000, ..QueueReport::default() });
        let (_, m) = code(a.admit(ticket(3, 3)));
        assert!(m.contains("retry in ~70 ms"), "the worker's average pass, per request: {m}");
    }

    #[test]
    fn a_uid_over_its_token_quota_is_refused_until_the_window_moves_on() {
        let (clock, now) = manual_clock();
        let l = policy::Limits { quota_tokens: 100, quota_window_ms: 10_000, ..limits(8, 8) };
        let a = Admission::with_clock(l, clock);
        let r = a.admit(ticket(7, 1)).expect("under quota");
        now.store(1_000, Ordering::Release);
        a.charge(7, 60);
        now.store(2_000, Ordering::Release);
        a.charge(7, 40);
        a.finish(r.id);
        assert_eq!(a.quota_used(7, 10), 100);
        let e = a.admit(ticket(7, 1)).expect_err("at quota");
        assert_eq!(e.code(), llmd_aidl::ErrorCode::ErrorCode::QUOTA_EXCEEDED);
        assert!(
            matches!(e, E::TokenQuota { uid: 7, limit: 100, window_s: 10, retry_ms: 9_000 }),
            "back under once the first 60 leave the window at 11 s: {e:?}"
        );
        a.admit(ticket(8, 2)).expect("other uids are not charged");
        now.store(11_000, Ordering::Release);
        a.admit(ticket(7, 1)).expect("the window moved on");
        let no_quota = Admission::with_clock(limits(8, 8), manual_clock().0);
        no_quota.charge(7, 1_000_000);
        assert_eq!(no_quota.quota_used(7, 60), 0, "nothing is recorded without a quota");
    }

    #[test]
    fn a_session_runs_one_request_at_a_time() {
        let (clock, _) = manual_clock();
        let a = Admission::with_clock(limits(8, 8), clock);
        let r = a.admit(ticket(5, 42)).expect("first");
        let (c, m) = code(a.admit(ticket(5, 42)));
        assert_eq!(c, llmd_aidl::ErrorCode::ErrorCode::BUSY);
        assert!(m.contains("already generating"), "{m}");
        a.admit(ticket(5, 43)).expect("another session of the uid");
        a.finish(r.id);
        a.admit(ticket(5, 42)).expect("free again once its request ended");
    }

    #[test]
    fn a_closing_daemon_admits_nothing_and_can_cancel_everything() {
        let (clock, _) = manual_clock();
        let a = Admission::with_clock(limits(8, 8), clock);
        let r1 = a.admit(ticket(1, 1)).expect("1");
        let r2 = a.admit(ticket(2, 2)).expect("2");
        a.close();
        let (c, m) = code(a.admit(ticket(3, 3)));
        assert_eq!(c, llmd_aidl::ErrorCode::ErrorCode::BUSY);
        assert!(m.contains("shutting down"), "{m}");
        assert_eq!(a.in_flight(), 2);
        a.cancel_all();
        assert!(r1.cancel.load(Ordering::Acquire) && r2.cancel.load(Ordering::Acquire));
        a.finish(r1.id);
        a.finish(r2.id);
        assert_eq!(a.in_flight(), 0);
    }

    #[test]
    fn cancel_reaches_only_the_named_request_of_its_own_session() {
        let (clock, _) = manual_clock();
        let a = Admission::with_clock(limits(8, 8), clock);
        let r1 = a.admit(ticket(1, 1)).expect("1");
        let r2 = a.admit(ticket(1, 2)).expect("2");
        a.cancel(2, r1.id);
        assert!(!r1.cancel.load(Ordering::Acquire), "another session cannot cancel it");
        a.cancel(1, r1.id);
        assert!(r1.cancel.load(Ordering::Acquire));
        assert!(!r2.cancel.load(Ordering::Acquire));
        a.cancel_session(2);
        assert!(r2.cancel.load(Ordering::Acquire));
        a.set_running(r2.id);
        let snap = a.snapshot();
        assert_eq!(snap.iter().map(|(id, j)| (*id, j.running)).collect::<Vec<_>>(), vec![(1, false), (2, true)]);
    }
}
