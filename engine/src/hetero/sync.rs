//! HeteroLLM's fast synchronisation (§4.2): a completion flag stored beside each output, a
//! waiter that sleeps for the operator's predicted duration and then polls the flag, and a
//! pool of a few fixed buffer slots that every layer reuses (what a phone maps once into both
//! devices; here built and tested on its own — the real path keeps each NPU graph's buffers,
//! and PoCL's results are read back).
//!
//! **Decisions where the paper is silent.** The prediction is an exponentially weighted moving
//! average of the operator's observed durations (weight [`EWMA_WEIGHT`]; every layer runs the
//! same operators, so one key per operator, not per layer); the waiter wakes
//! [`WAKE_MARGIN`] before the prediction — Linux's default timer slack is 50 µs, the phone's
//! `usleep` granularity 80–100 µs — and polls with `spin_loop` hints, giving up the core every
//! [`YIELD_EVERY_SPINS`] spins so a late producer is not starved on a small machine; a wait
//! longer than [`MAX_SPIN`] past the wake-up falls back to short sleeps. The flag is an
//! `AtomicU64` holding the sequence number of the last completed submission, stored with
//! `Release` after the output is written and loaded with `Acquire`, so the output's bytes are
//! visible once the flag is (tested by `the_flag_publishes_the_output`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Weight of the newest observation in the moving average.
pub const EWMA_WEIGHT: f64 = 0.25;
/// How long before the predicted completion the waiter wakes to poll.
pub const WAKE_MARGIN: Duration = Duration::from_micros(60);
/// Spins between yields while polling.
pub const YIELD_EVERY_SPINS: u32 = 256;
/// Polling past the wake-up longer than this falls back to sleeping in short steps.
pub const MAX_SPIN: Duration = Duration::from_millis(2);

/// A completion flag beside an output buffer.
#[derive(Debug, Default)]
pub struct Flag(AtomicU64);

impl Flag {
    pub fn new() -> Self {
        Self(AtomicU64::new(0))
    }
    /// The producer: submission `seq` is complete and its output written.
    pub fn set(&self, seq: u64) {
        self.0.store(seq, Ordering::Release);
    }
    /// Whether submission `seq` (or a later one) is complete.
    pub fn done(&self, seq: u64) -> bool {
        self.0.load(Ordering::Acquire) >= seq
    }
}

/// What a waiter polls: a [`Flag`] a producer sets, or a device's completion (an event's state).
pub trait Signal {
    /// Whether submission `seq` (or a later one) is complete.
    fn done(&self, seq: u64) -> bool;
}

impl Signal for Flag {
    fn done(&self, seq: u64) -> bool {
        Flag::done(self, seq)
    }
}

/// A completion polled through a closure (a device's event: `seq` is not used).
pub struct Polled<'a>(pub &'a dyn Fn() -> bool);

impl Signal for Polled<'_> {
    fn done(&self, _seq: u64) -> bool {
        (self.0)()
    }
}

/// What one wait cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WaitStats {
    /// Time asleep.
    pub slept: Duration,
    /// Time spent polling (the CPU the waiter burned).
    pub polled: Duration,
    /// Flag checks.
    pub polls: u64,
}

/// Per-operator predictions of how long a submission takes.
#[derive(Debug, Default)]
pub struct Predictor {
    by_op: HashMap<String, f64>,
}

impl Predictor {
    pub fn new() -> Self {
        Self::default()
    }
    /// The predicted duration of `op`, if it has been seen.
    pub fn predict(&self, op: &str) -> Option<Duration> {
        self.by_op.get(op).map(|&s| Duration::from_secs_f64(s.max(0.0)))
    }
    /// Records a duration of `op`: from its submission to the completion time its producer
    /// recorded (an OpenCL event's end, the NPU's execute returning) — not to when a waiter
    /// noticed, which would teach the predictor the waiter's own lateness.
    pub fn observe(&mut self, op: &str, took: Duration) {
        let s = took.as_secs_f64();
        match self.by_op.get_mut(op) {
            Some(v) => *v += EWMA_WEIGHT * (s - *v),
            None => {
                self.by_op.insert(op.to_owned(), s);
            }
        }
    }
}

/// The predicted-sleep-then-poll waiter. It also learns how late its own sleeps wake (timer
/// slack and scheduling: 50–70 µs on this Linux machine, 80–100 µs for `usleep` on the phones
/// HeteroLLM measured) and wakes that much earlier, so oversleeping does not add to the wait.
#[derive(Debug, Default)]
pub struct Waiter {
    /// Moving average of how far past its target a sleep woke, seconds.
    oversleep: f64,
}

impl Waiter {
    pub fn new() -> Self {
        Self::default()
    }

    /// The learned oversleep.
    pub fn oversleep(&self) -> Duration {
        Duration::from_secs_f64(self.oversleep.max(0.0))
    }

    /// Waits for `flag` to reach `seq` for a submission made at `submitted`: sleeps until
    /// `predicted − WAKE_MARGIN − oversleep` after it (if that is still ahead), then polls.
    pub fn wait(&mut self, flag: &dyn Signal, seq: u64, submitted: Instant, predicted: Option<Duration>) -> WaitStats {
        let mut st = WaitStats::default();
        if let Some(p) = predicted {
            let wake = submitted + p.saturating_sub(WAKE_MARGIN + self.oversleep());
            let now = Instant::now();
            if wake > now && !flag.done(seq) {
                std::thread::sleep(wake - now);
                let woke = Instant::now();
                st.slept = woke - now;
                let late = woke.saturating_duration_since(wake).as_secs_f64();
                self.oversleep += EWMA_WEIGHT * (late - self.oversleep);
            }
        }
        poll(flag, seq, &mut st);
        st
    }
}

/// One wait by a fresh [`Waiter`] (no learned oversleep).
pub fn wait_predicted(flag: &dyn Signal, seq: u64, submitted: Instant, predicted: Option<Duration>) -> WaitStats {
    Waiter::new().wait(flag, seq, submitted, predicted)
}

/// Sleep-only: sleeps the predicted duration, then in steps of `step` until the flag is set.
pub fn wait_sleeping(
    flag: &Flag,
    seq: u64,
    submitted: Instant,
    predicted: Option<Duration>,
    step: Duration,
) -> WaitStats {
    let mut st = WaitStats::default();
    let t0 = Instant::now();
    if let Some(p) = predicted {
        let wake = submitted + p;
        if wake > t0 {
            std::thread::sleep(wake - t0);
        }
    }
    loop {
        st.polls += 1;
        if flag.done(seq) {
            break;
        }
        std::thread::sleep(step);
    }
    st.slept = t0.elapsed();
    st
}

fn poll(flag: &dyn Signal, seq: u64, st: &mut WaitStats) {
    let t0 = Instant::now();
    let mut spins = 0u32;
    loop {
        st.polls += 1;
        if flag.done(seq) {
            break;
        }
        spins += 1;
        if spins.is_multiple_of(YIELD_EVERY_SPINS) {
            if t0.elapsed() > MAX_SPIN {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        } else {
            std::hint::spin_loop();
        }
    }
    st.polled = t0.elapsed();
}

/// A control plane's fast synchronisation: per-operator predictions and one waiter, shared by
/// every matmul of a model (every layer runs the same operators).
#[derive(Debug, Default)]
pub struct FastSync {
    predictor: std::sync::Mutex<Predictor>,
    waiter: std::sync::Mutex<Waiter>,
    /// Waits done, and time spent polling in them (nanoseconds).
    pub waits: std::sync::atomic::AtomicU64,
    pub polled_ns: std::sync::atomic::AtomicU64,
    /// Per operator kind: its waits' wake latencies after the producer finished (the last
    /// [`WAKES_KEPT`], µs) and their polling.
    wakes: std::sync::Mutex<std::collections::BTreeMap<String, Wakes>>,
}

/// Wake latencies kept per operator kind.
pub const WAKES_KEPT: usize = 1024;

#[derive(Debug, Default)]
struct Wakes {
    waits: u64,
    polled_ns: u64,
    latency_us: std::collections::VecDeque<f64>,
}

/// One operator kind's waits (see [`FastSync::wake_stats`]).
#[derive(Clone, Debug, PartialEq)]
pub struct WakeStats {
    pub key: String,
    pub waits: u64,
    /// Wake latency after the producer finished, µs: median and 99th percentile of the kept.
    pub p50_us: f64,
    pub p99_us: f64,
    /// CPU time spent polling in them, ms.
    pub polled_ms: f64,
}

impl FastSync {
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for `flag` to reach `seq` for operator `key` submitted at `submitted`; when the
    /// wait ended (the waiter saw the flag).
    pub fn wait(&self, key: &str, flag: &dyn Signal, seq: u64, submitted: Instant) -> (Instant, Duration) {
        let predicted = self.predictor.lock().ok().and_then(|p| p.predict(key));
        let st = match self.waiter.lock() {
            Ok(mut w) => w.wait(flag, seq, submitted, predicted),
            Err(_) => wait_predicted(flag, seq, submitted, predicted),
        };
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.polled_ns.fetch_add(st.polled.as_nanos() as u64, Ordering::Relaxed);
        (Instant::now(), st.polled)
    }

    /// Records a wait of operator `key` that ended at `woke`, its producers having finished at
    /// `finished` (their completion as the runtime signalled it), `polled` of it polling.
    pub fn record_wake(&self, key: &str, finished: Instant, woke: Instant, polled: Duration) {
        if let Ok(mut w) = self.wakes.lock() {
            let e = w.entry(key.to_owned()).or_default();
            e.waits += 1;
            e.polled_ns += polled.as_nanos() as u64;
            if e.latency_us.len() == WAKES_KEPT {
                e.latency_us.pop_front();
            }
            e.latency_us.push_back(woke.saturating_duration_since(finished).as_secs_f64() * 1e6);
        }
    }

    /// Per operator kind, the waits recorded with [`Self::record_wake`].
    pub fn wake_stats(&self) -> Vec<WakeStats> {
        let Ok(w) = self.wakes.lock() else { return Vec::new() };
        w.iter()
            .map(|(key, e)| {
                let mut v: Vec<f64> = e.latency_us.iter().copied().collect();
                v.sort_by(f64::total_cmp);
                let at = |q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
                WakeStats {
                    key: key.clone(),
                    waits: e.waits,
                    p50_us: at(0.5),
                    p99_us: at(0.99),
                    polled_ms: e.polled_ns as f64 / 1e6,
                }
            })
            .collect()
    }

    /// Records how long operator `key` took (submission to the producer's completion).
    pub fn observe(&self, key: &str, took: Duration) {
        if let Ok(mut p) = self.predictor.lock() {
            p.observe(key, took);
        }
    }
}

/// The conventional waiter: a mutex-guarded sequence number and a condition variable.
#[derive(Debug, Default)]
pub struct CondFlag {
    seq: Mutex<u64>,
    cv: Condvar,
}

impl CondFlag {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn set(&self, seq: u64) {
        let mut g = self.seq.lock().unwrap_or_else(|e| e.into_inner());
        *g = seq;
        self.cv.notify_all();
    }
    pub fn wait(&self, seq: u64) {
        let mut g = self.seq.lock().unwrap_or_else(|e| e.into_inner());
        while *g < seq {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Page size the pool aligns slots to (a GPU maps host memory in place from a page:
/// `CL_MEM_USE_HOST_PTR`; QNN registers shared memory by page).
pub const SLOT_ALIGN: usize = 4096;

/// One slot: an f32 buffer starting on a page, and the completion flag beside it.
pub struct Slot {
    buf: Vec<f32>,
    off: usize,
    len: usize,
    pub flag: Flag,
}

impl Slot {
    fn new(len: usize) -> Self {
        let pad = SLOT_ALIGN / 4;
        let buf = vec![0f32; len + pad];
        let off = buf.as_ptr().align_offset(SLOT_ALIGN).min(pad);
        Self { buf, off, len, flag: Flag::new() }
    }
    pub fn data(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// HeteroLLM's buffer pool: a few slots per tensor role, allocated once and reused by every
/// layer (layer `l`'s role-`r` tensor is slot `(l mod depth)` of role `r`), never freed while
/// the model runs, so the devices' mappings of them stay valid.
pub struct Pool {
    roles: Vec<Vec<Slot>>,
}

impl Pool {
    /// `depth` slots (≥ 1) for each role's length in `role_lens`.
    pub fn new(role_lens: &[usize], depth: usize) -> Self {
        let depth = depth.max(1);
        Self { roles: role_lens.iter().map(|&n| (0..depth).map(|_| Slot::new(n)).collect()).collect() }
    }
    pub fn slot(&self, layer: usize, role: usize) -> Option<&Slot> {
        let r = self.roles.get(role)?;
        r.get(layer % r.len())
    }
    pub fn slot_mut(&mut self, layer: usize, role: usize) -> Option<&mut Slot> {
        let r = self.roles.get_mut(role)?;
        let d = r.len();
        r.get_mut(layer % d)
    }
    /// Slots in all.
    pub fn slots(&self) -> usize {
        self.roles.iter().map(Vec::len).sum()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_flag_publishes_the_output() {
        // The producer writes a buffer then sets the flag; the consumer, once it sees the flag,
        // must see every value written — over many rounds on two threads.
        let data: Arc<Vec<AtomicU64>> = Arc::new((0..64).map(|_| AtomicU64::new(0)).collect());
        let flag = Arc::new(Flag::new());
        let ack = Arc::new(AtomicU64::new(0));
        let (d2, f2, a2) = (data.clone(), flag.clone(), ack.clone());
        let producer = std::thread::spawn(move || {
            for seq in 1..=5_000u64 {
                for v in d2.iter() {
                    v.store(seq, Ordering::Relaxed);
                }
                f2.set(seq);
                while a2.load(Ordering::Acquire) != seq {
                    std::thread::yield_now();
                }
            }
        });
        for seq in 1..=5_000u64 {
            let _ = wait_predicted(&*flag, seq, Instant::now(), None);
            for v in data.iter() {
                assert_eq!(v.load(Ordering::Relaxed), seq);
            }
            ack.store(seq, Ordering::Release);
        }
        producer.join().unwrap();
    }

    #[test]
    fn the_predictor_follows_the_durations() {
        let mut p = Predictor::new();
        assert!(p.predict("q").is_none());
        p.observe("q", Duration::from_micros(400));
        assert_eq!(p.predict("q"), Some(Duration::from_micros(400)));
        for _ in 0..40 {
            p.observe("q", Duration::from_micros(200));
        }
        let v = p.predict("q").unwrap().as_secs_f64() * 1e6;
        assert!((v - 200.0).abs() < 1.0, "{v}");
    }

    #[test]
    fn a_wait_on_a_set_flag_does_not_sleep_and_a_late_one_returns_once_set() {
        // No timing is asserted (tests share the machine, and run under qemu-user).
        let flag = Flag::new();
        flag.set(1);
        let st = wait_predicted(&flag, 1, Instant::now(), Some(Duration::from_secs(10)));
        assert_eq!(st.slept, Duration::ZERO);
        assert_eq!(st.polls, 1);
        let flag = Arc::new(Flag::new());
        let f2 = flag.clone();
        let t0 = Instant::now();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_micros(800));
            f2.set(1);
        });
        let mut w = Waiter::new();
        w.wait(&*flag, 1, t0, Some(Duration::from_micros(800)));
        assert!(flag.done(1));
        h.join().unwrap();
        let fs = FastSync::new();
        fs.observe("k", Duration::from_micros(300));
        fs.wait("k", &*flag, 1, Instant::now());
        assert_eq!(fs.waits.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_pool_reuses_its_slots_for_every_layer() {
        let mut pool = Pool::new(&[576, 1536], 2);
        assert_eq!(pool.slots(), 4);
        let first = pool.slot(0, 1).unwrap().data().as_ptr();
        for l in 0..32 {
            let s = pool.slot_mut(l, 1).unwrap();
            assert_eq!(s.data().as_ptr() as usize % SLOT_ALIGN, 0);
            s.data_mut()[0] = l as f32;
        }
        assert_eq!(pool.slot(30, 1).unwrap().data().as_ptr(), first);
        assert_eq!(pool.slots(), 4, "no slot made after the start");
        assert!(pool.slot(0, 2).is_none());
    }

    #[test]
    fn condvar_and_sleep_waiters_return_once_set() {
        let c = Arc::new(CondFlag::new());
        let c2 = c.clone();
        let h = std::thread::spawn(move || c2.set(3));
        c.wait(3);
        h.join().unwrap();
        let f = Flag::new();
        f.set(2);
        let st = wait_sleeping(&f, 2, Instant::now(), None, Duration::from_micros(50));
        assert_eq!(st.polls, 1);
    }
}
