//! Each request's callbacks, sent in order by a thread of the request's own.
//!
//! A client that stops reading its callbacks (an app the system froze, a stuck process) then
//! holds up only its own request: once [`MAX_UNSENT`] are waiting, the worker leaves the request
//! out of its passes until the client takes them, and its deadline and cancellation still
//! apply. Sent on the worker thread, one frozen client's full socket would stop every other
//! app's generation (measured: requests behind it queue until they time out). A failed send
//! means the client is gone: the request is cancelled.
//!
//! Tokens are paced: a request's first tokens go out at once (its time to first token), later
//! ones are held and sent together once `stream_interval_ms` (config) has passed since the last
//! `onTokens`, and whatever is held goes out before `onCompleted`/`onError` — except on a
//! cancel, which drops them: the turn is rolled back, and a client that asked to stop gets at
//! most the unit that was running when its cancel landed (with the pacing, a fast machine holds
//! several tokens, which a flush would send after `cancel` returned). No screen shows text faster than
//! a frame, and every callback costs both processes a transaction and a wake-up: at 16 ms a
//! phone app gets at most ~60 `onTokens` a second instead of one per token.
//!
//! A send the client has not taken for `stream_stall_timeout_s` ([`Outbox::stalled_for`]) ends
//! the request (the worker's check, at every pass): a stopped client does not hold its
//! request slot and its KV memory for as long as it is stopped. The send itself stays with the
//! delivery thread, never the worker; on the socket, rsbinder ends a connection whose client
//! takes nothing of a send for that long, which frees the thread and closes the client's
//! sessions.
//!
//! With no thread to be had, nothing is sent from the caller's (the worker's) thread: the
//! request is cancelled (sent from there, a client that does not read would stop every other
//! client's requests).
//!
//! The outbox sends to a [`Sink`]: the request's `IGenerationCallback` Binder object in the
//! daemon, a recorder in tests.

use llmd_aidl::GenerationStats::GenerationStats as WireStats;
use llmd_aidl::IGenerationCallback::IGenerationCallback;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The clock of [`Outbox::stalled_for`]: microseconds since the first use.
fn micros_now() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64 + 1
}

/// Callbacks queued by every outbox of the process and not yet delivered (a stopping daemon
/// waits for them: [`undelivered`]).
static UNDELIVERED: AtomicUsize = AtomicUsize::new(0);

/// Callbacks queued for clients and not yet handed to them, process-wide.
pub fn undelivered() -> usize {
    UNDELIVERED.load(Ordering::Acquire)
}

/// Undelivered callbacks at which a request stops being decoded until its client takes them.
pub const MAX_UNSENT: usize = 64;

/// One callback to a request's client.
#[derive(Clone, Debug, PartialEq)]
pub enum Delivery {
    Started(i64),
    Tokens(i64, String, Vec<i32>),
    Completed(i64, WireStats),
    Error(i64, i32, String),
}

impl Delivery {
    /// Whether this is the request's last callback (`onCompleted` or `onError`).
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Completed(..) | Self::Error(..))
    }
}

/// Where a request's callbacks go. `deliver` may block (a client not reading); it returns
/// whether the client took the callback (false: the client is gone).
pub trait Sink: Send + Sync + 'static {
    fn deliver(&self, d: &Delivery) -> bool;
}

/// The daemon's sink: the client's callback object (`oneway`: a send returns once the
/// transaction is written, and blocks while the client's side is full).
pub struct CallbackSink(pub rsbinder::Strong<dyn IGenerationCallback>);

impl Sink for CallbackSink {
    fn deliver(&self, d: &Delivery) -> bool {
        let cb = &self.0;
        match d {
            Delivery::Started(id) => cb.onStarted(*id),
            Delivery::Tokens(id, text, ids) => cb.onTokens(*id, text, ids),
            Delivery::Completed(id, stats) => cb.onCompleted(*id, stats),
            Delivery::Error(id, code, message) => cb.onError(*id, *code, message),
        }
        .is_ok()
    }
}

/// A request's callbacks on their way to its client (see the module comment).
pub struct Outbox {
    sink: Arc<dyn Sink>,
    /// The request's cancel flag, set when a send fails.
    cancel: Arc<AtomicBool>,
    /// The delivery thread's queue and the count not yet sent, once something was sent.
    line: Option<(Sender<Delivery>, Arc<AtomicUsize>)>,
    /// When the delivery thread's send under way began ([`micros_now`]; 0: none under way).
    sending_since: Arc<AtomicU64>,
    /// No delivery thread could be started: the request was cancelled, nothing more is sent.
    dead: bool,
    /// Tokens held back by the pacing: (request id, text, ids).
    held: Option<(i64, String, Vec<i32>)>,
    /// When the last `onTokens` was queued.
    last_tokens: Option<Instant>,
}

impl Outbox {
    pub fn new(sink: Arc<dyn Sink>, cancel: Arc<AtomicBool>) -> Self {
        Self {
            sink,
            cancel,
            line: None,
            sending_since: Arc::new(AtomicU64::new(0)),
            dead: false,
            held: None,
            last_tokens: None,
        }
    }

    /// Streams tokens: sent now if `interval` has passed since the last `onTokens` (or there
    /// was none), else held and sent with later ones (see [`Outbox::flush_due`]).
    pub fn tokens(&mut self, id: i64, text: String, ids: Vec<i32>, now: Instant, interval: Duration) {
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
    pub fn flush_due(&mut self, now: Instant, interval: Duration) {
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
    pub fn send(&mut self, d: Delivery) {
        self.flush(Instant::now());
        self.queue(d);
    }

    /// Drops the held tokens unsent (see the module comment on cancels).
    pub fn drop_held(&mut self) {
        self.held = None;
    }

    /// Queues `d` for the client; the delivery thread starts with the first.
    fn queue(&mut self, d: Delivery) {
        if self.dead {
            return;
        }
        if self.line.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Delivery>();
            let unsent = Arc::new(AtomicUsize::new(0));
            let (sink, cancel, left) = (self.sink.clone(), self.cancel.clone(), unsent.clone());
            let since = self.sending_since.clone();
            let spawned = spawn_delivery(move || {
                for d in rx {
                    since.store(micros_now(), Ordering::Release);
                    let taken = sink.deliver(&d);
                    since.store(0, Ordering::Release);
                    if !taken {
                        cancel.store(true, Ordering::Release);
                    }
                    left.fetch_sub(1, Ordering::AcqRel);
                    UNDELIVERED.fetch_sub(1, Ordering::AcqRel);
                }
            });
            if let Err(e) = spawned {
                // No thread to be had. Sent from here, a client that does not read would stop
                // the worker — every other client's requests — so the request is cancelled
                // and its client told nothing more.
                tracing::warn!("no thread for a request's callbacks ({e}): cancelling it");
                self.dead = true;
                self.cancel.store(true, Ordering::Release);
                return;
            }
            self.line = Some((tx, unsent));
        }
        if let Some((tx, unsent)) = &self.line {
            unsent.fetch_add(1, Ordering::AcqRel);
            UNDELIVERED.fetch_add(1, Ordering::AcqRel);
            if tx.send(d).is_err() {
                unsent.fetch_sub(1, Ordering::AcqRel);
                UNDELIVERED.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Callbacks queued and not yet taken by the client.
    pub fn unsent(&self) -> usize {
        self.line.as_ref().map_or(0, |(_, n)| n.load(Ordering::Acquire))
    }

    /// Whether the client is [`MAX_UNSENT`] callbacks behind: the request waits for it.
    pub fn backlogged(&self) -> bool {
        self.unsent() >= MAX_UNSENT
    }

    /// How long the send under way has been waiting for the client to take it (zero when none
    /// is under way): a client that stopped reading holds its send for as long as it is stopped.
    pub fn stalled_for(&self) -> Duration {
        match self.sending_since.load(Ordering::Acquire) {
            0 => Duration::ZERO,
            since => Duration::from_micros(micros_now().saturating_sub(since)),
        }
    }
}

/// Starts a delivery thread (in the tests, can be made to fail as a process out of threads).
fn spawn_delivery(f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    #[cfg(test)]
    if tests::NO_THREADS.with(|n| n.get()) {
        return Err(std::io::Error::from(std::io::ErrorKind::OutOfMemory));
    }
    std::thread::Builder::new().name("llmd-deliver".into()).spawn(f).map(drop)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::{Condvar, Mutex};

    thread_local! {
        /// Set on a test's thread: no delivery thread can be started from it.
        pub(crate) static NO_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A fake client: records what it takes; can be stopped (a frozen app: `deliver` blocks
    /// until it is let go) or gone (every send fails).
    #[derive(Default)]
    pub(crate) struct Recorder {
        state: Mutex<RecState>,
        changed: Condvar,
    }

    #[derive(Default)]
    struct RecState {
        got: Vec<Delivery>,
        stopped: bool,
        gone: bool,
        /// Sends attempted while gone.
        refused: usize,
    }

    impl Recorder {
        pub(crate) fn new() -> Arc<Self> {
            Arc::new(Self::default())
        }
        pub(crate) fn stopped() -> Arc<Self> {
            let r = Self::new();
            r.set_stopped(true);
            r
        }
        pub(crate) fn gone() -> Arc<Self> {
            let r = Self::new();
            r.lock().gone = true;
            r
        }
        fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
            self.state.lock().unwrap_or_else(|p| p.into_inner())
        }
        pub(crate) fn set_stopped(&self, stopped: bool) {
            self.lock().stopped = stopped;
            self.changed.notify_all();
        }
        pub(crate) fn got(&self) -> Vec<Delivery> {
            self.lock().got.clone()
        }
        pub(crate) fn refused(&self) -> usize {
            self.lock().refused
        }
        /// Waits (up to 10 s) until what was taken satisfies `done`; returns it.
        fn wait(&self, what: &str, done: impl Fn(&[Delivery]) -> bool) -> Vec<Delivery> {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut st = self.lock();
            while !done(&st.got) {
                let left = deadline.saturating_duration_since(Instant::now());
                assert!(!left.is_zero(), "timed out waiting for {what}: {:?}", st.got);
                st = self.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
            }
            st.got.clone()
        }
        /// Waits until `n` callbacks were taken; returns them.
        pub(crate) fn wait_for(&self, n: usize) -> Vec<Delivery> {
            self.wait(&format!("{n} callbacks"), |got| got.len() >= n)
        }
        /// Waits for the final callback; returns everything taken.
        pub(crate) fn wait_final(&self) -> Vec<Delivery> {
            self.wait("the final callback", |got| got.last().is_some_and(Delivery::is_final))
        }
    }

    impl Sink for Recorder {
        fn deliver(&self, d: &Delivery) -> bool {
            let mut st = self.lock();
            while st.stopped {
                st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            if st.gone {
                st.refused += 1;
                return false;
            }
            st.got.push(d.clone());
            drop(st);
            self.changed.notify_all();
            true
        }
    }

    /// Waits (up to 10 s) for `f`.
    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn outbox(sink: &Arc<Recorder>) -> (Outbox, Arc<AtomicBool>) {
        let cancel = Arc::new(AtomicBool::new(false));
        (Outbox::new(sink.clone(), cancel.clone()), cancel)
    }

    fn tokens(d: &[Delivery]) -> Vec<i32> {
        d.iter().flat_map(|d| if let Delivery::Tokens(_, _, ids) = d { ids.clone() } else { vec![] }).collect()
    }

    #[test]
    fn callbacks_arrive_in_the_order_they_were_queued() {
        let sink = Recorder::new();
        let (mut o, cancel) = outbox(&sink);
        let t0 = Instant::now();
        o.send(Delivery::Started(7));
        for i in 0..200 {
            o.tokens(7, format!("{i} "), vec![i], t0, Duration::ZERO);
        }
        o.send(Delivery::Error(7, 3, "done".into()));
        let got = sink.wait_final();
        assert_eq!(got.first(), Some(&Delivery::Started(7)));
        assert_eq!(tokens(&got), (0..200).collect::<Vec<_>>(), "every token, in order");
        assert_eq!(got.len(), 202, "one onTokens per token when nothing is paced");
        assert_eq!(got.iter().filter(|d| d.is_final()).count(), 1);
        assert!(!cancel.load(Ordering::Acquire));
        until("the count to drain", || o.unsent() == 0);
    }

    #[test]
    fn a_stopped_client_holds_only_its_own_outbox() {
        let frozen = Recorder::stopped();
        let live = Recorder::new();
        let (mut a, _) = outbox(&frozen);
        let (mut b, _) = outbox(&live);
        let t0 = Instant::now();
        for i in 0..10 {
            a.tokens(1, "a".into(), vec![i], t0, Duration::ZERO);
            b.tokens(2, "b".into(), vec![i], t0, Duration::ZERO);
        }
        a.send(Delivery::Error(1, 7, "x".into()));
        b.send(Delivery::Error(2, 7, "x".into()));
        // The worker's side never blocks: both were queued, and the live client got all of its.
        assert_eq!(tokens(&live.wait_final()), (0..10).collect::<Vec<_>>());
        assert!(frozen.got().is_empty());
        until("the frozen client's backlog to be counted", || a.unsent() >= 10);
        frozen.set_stopped(false);
        assert_eq!(tokens(&frozen.wait_final()), (0..10).collect::<Vec<_>>(), "nothing lost while frozen");
    }

    #[test]
    fn a_send_the_client_does_not_take_is_measured_as_a_stall() {
        let sink = Recorder::stopped();
        let (mut o, _) = outbox(&sink);
        assert_eq!(o.stalled_for(), Duration::ZERO, "nothing sent yet");
        o.send(Delivery::Started(1));
        until("the send to block", || o.stalled_for() >= Duration::from_millis(50));
        sink.set_stopped(false);
        sink.wait_for(1);
        until("the stall to end with the send", || o.stalled_for() == Duration::ZERO);
    }

    /// Without a thread of its own, the outbox cancels the request and sends nothing from the
    /// caller's thread — the worker's, where a client that does not read would stop every other
    /// client's requests.
    #[test]
    fn without_a_delivery_thread_the_caller_never_waits_on_the_client() {
        let sink = Recorder::stopped();
        let (mut o, cancel) = outbox(&sink);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            NO_THREADS.with(|n| n.set(true));
            o.send(Delivery::Started(1));
            o.tokens(1, "x".into(), vec![1], Instant::now(), Duration::ZERO);
            let _ = tx.send(o.unsent());
        });
        let unsent =
            rx.recv_timeout(Duration::from_secs(5)).expect("the caller was held by a client that does not read");
        assert_eq!(unsent, 0, "nothing queued");
        assert!(cancel.load(Ordering::Acquire), "the request is cancelled");
        sink.set_stopped(false);
        std::thread::sleep(Duration::from_millis(20));
        assert!(sink.got().is_empty(), "nothing was sent");
    }

    #[test]
    fn a_failed_send_cancels_the_request() {
        let sink = Recorder::gone();
        let (mut o, cancel) = outbox(&sink);
        o.send(Delivery::Started(3));
        until("the cancel flag", || cancel.load(Ordering::Acquire));
        assert_eq!(sink.refused(), 1);
    }

    #[test]
    fn a_backlog_of_64_marks_the_request_until_the_client_reads() {
        let sink = Recorder::stopped();
        let (mut o, _) = outbox(&sink);
        let t0 = Instant::now();
        for i in 0..MAX_UNSENT as i32 - 1 {
            o.tokens(1, "x".into(), vec![i], t0, Duration::ZERO);
        }
        // One callback may be in the delivery thread's hands (blocked in `deliver`): still unsent.
        until("63 waiting", || o.unsent() == MAX_UNSENT - 1);
        assert!(!o.backlogged(), "63 waiting is not yet a backlog");
        o.tokens(1, "x".into(), vec![63], t0, Duration::ZERO);
        assert!(o.backlogged(), "64 waiting is");
        sink.set_stopped(false);
        until("the backlog to drain", || !o.backlogged() && o.unsent() == 0);
        assert_eq!(sink.got().len(), MAX_UNSENT);
    }

    #[test]
    fn pacing_sends_the_first_tokens_at_once_holds_the_rest_and_flushes_them_before_the_end() {
        let sink = Recorder::new();
        let (mut o, _) = outbox(&sink);
        let t0 = Instant::now();
        let iv = Duration::from_millis(16);
        o.tokens(1, "a".into(), vec![1], t0, iv);
        assert_eq!(sink.wait_for(1), vec![Delivery::Tokens(1, "a".into(), vec![1])], "the first goes at once");
        o.tokens(1, "b".into(), vec![2], t0 + Duration::from_millis(5), iv);
        o.tokens(1, "c".into(), vec![3], t0 + Duration::from_millis(10), iv);
        o.flush_due(t0 + Duration::from_millis(15), iv);
        assert_eq!(o.held.as_ref().map(|h| h.2.clone()), Some(vec![2, 3]), "held inside the interval");
        o.flush_due(t0 + Duration::from_millis(16), iv);
        assert_eq!(sink.wait_for(2)[1], Delivery::Tokens(1, "bc".into(), vec![2, 3]), "sent together once due");
        o.tokens(1, "d".into(), vec![4], t0 + Duration::from_millis(20), iv);
        o.send(Delivery::Completed(1, WireStats::default()));
        let got = sink.wait_final();
        assert_eq!(got[2], Delivery::Tokens(1, "d".into(), vec![4]), "what is held goes before the end");
        assert_eq!(got.len(), 4);
    }

    #[test]
    fn a_cancel_drops_what_the_pacing_held() {
        let sink = Recorder::new();
        let (mut o, _) = outbox(&sink);
        let t0 = Instant::now();
        let iv = Duration::from_secs(60);
        o.tokens(1, "a".into(), vec![1], t0, iv);
        o.tokens(1, "b".into(), vec![2], t0, iv);
        o.drop_held();
        o.send(Delivery::Error(1, 7, "request cancelled".into()));
        let got = sink.wait_final();
        assert_eq!(tokens(&got), vec![1], "the held token is not sent after the cancel");
    }

    /// The daemon's sink over a real (local) Binder callback object.
    #[test]
    fn the_binder_sink_calls_the_callback_object() {
        use llmd_aidl::IGenerationCallback::BnGenerationCallback;
        struct Cb {
            log: Arc<Mutex<Vec<String>>>,
            fail: bool,
        }
        impl Cb {
            fn note(&self, s: String) -> rsbinder::BinderResult<()> {
                if self.fail {
                    return Err(rsbinder::ExceptionCode::TransactionFailed.into());
                }
                self.log.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                Ok(())
            }
        }
        impl rsbinder::Interface for Cb {}
        impl IGenerationCallback for Cb {
            fn onStarted(&self, id: i64) -> rsbinder::BinderResult<()> {
                self.note(format!("started {id}"))
            }
            fn onTokens(&self, id: i64, text: &str, ids: &[i32]) -> rsbinder::BinderResult<()> {
                self.note(format!("tokens {id} {text} {ids:?}"))
            }
            fn onCompleted(&self, id: i64, s: &WireStats) -> rsbinder::BinderResult<()> {
                self.note(format!("completed {id} {}", s.finishReason))
            }
            fn onError(&self, id: i64, code: i32, m: &str) -> rsbinder::BinderResult<()> {
                self.note(format!("error {id} {code} {m}"))
            }
        }
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = CallbackSink(BnGenerationCallback::new_binder(Cb { log: log.clone(), fail: false }));
        assert!(sink.deliver(&Delivery::Started(4)));
        assert!(sink.deliver(&Delivery::Tokens(4, "hi".into(), vec![5, 6])));
        let stats = WireStats { finishReason: "eos".into(), ..WireStats::default() };
        assert!(sink.deliver(&Delivery::Completed(4, stats)));
        assert!(sink.deliver(&Delivery::Error(5, 7, "no".into())));
        assert_eq!(
            *log.lock().unwrap_or_else(|p| p.into_inner()),
            ["started 4", "tokens 4 hi [5, 6]", "completed 4 eos", "error 5 7 no"]
        );
        let failing = CallbackSink(BnGenerationCallback::new_binder(Cb { log: log.clone(), fail: true }));
        assert!(!failing.deliver(&Delivery::Started(6)), "a failed call is a failed send");
    }
}
