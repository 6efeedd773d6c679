//! The arbitration policy: which units of engine work run in the next pass. Pure and
//! deterministic — it sees requests as [`Entry`] values and time as milliseconds passed in — so
//! every rule is tested with a fake clock; the worker (`scheduler/worker.rs`) feeds it and
//! carries out its [`Plan`] for whichever processor queue it serves.
//!
//! Rules, in order:
//! 1. **Classes**: foreground > background > batch. A request's class is its hint capped by
//!    what its uid may claim (config).
//! 2. **Aging**: a request not served for `aging_ms` ranks one class better, and one more for
//!    each further `aging_ms`; at equal rank a request's own class goes first, so an aged
//!    background request does not overtake foreground ones — until it ranks above foreground
//!    ("starving"), when it is served before anything else. So nothing starves: a request of
//!    class index `c` (foreground 0, background 1, batch 2) waits at most `(c + 1) × aging_ms`
//!    plus one pass, however much foreground work arrives. Aging buys a turn, not a bigger
//!    chunk: chunk sizes follow the request's own class.
//! 3. **Weighted fair share** between uids of a class: each uid has a virtual time that grows by
//!    `tokens / weight` when it is served; the smallest goes first. A uid that becomes active
//!    starts at the smallest active virtual time (no credit for having been idle).
//! 4. **A pass** (the unit of preemption): every decoding sequence chosen by (class, virtual
//!    time, arrival) up to `max_batch`, batched into one matmul pass, plus at most one prefill
//!    chunk — the best waiting prompt's — sized to its class's chunk and what is left of the
//!    pass's token budget. Background and batch prompts go in small chunks, so a foreground
//!    prompt that arrives waits for at most one short pass, never a long background prefill: a
//!    background pass holds at most `background_chunk` tokens, decode steps included (but at
//!    least `MIN_CHUNK` prompt tokens). A pass that carries a foreground prompt carries only
//!    foreground decode steps.

use std::collections::HashMap;

/// Smallest prefill chunk a background pass gives a prompt, however many decode steps it holds.
pub const MIN_CHUNK: usize = 4;

/// Scheduling classes, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Foreground = 0,
    Background = 1,
    Batch = 2,
}

impl Class {
    pub fn from_index(i: usize) -> Class {
        match i {
            0 => Class::Foreground,
            1 => Class::Background,
            _ => Class::Batch,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Class::Foreground => "foreground",
            Class::Background => "background",
            Class::Batch => "batch",
        }
    }
    /// The class of a request: its hint, but never better than `cap`.
    pub fn capped(hint: Class, cap: Class) -> Class {
        hint.max(cap)
    }
}

/// What the policy needs to know about a request.
#[derive(Clone, Debug)]
pub struct Entry {
    pub id: u64,
    pub uid: u32,
    pub class: Class,
    /// Arrival time (ms).
    pub arrived_ms: u64,
    /// When it last got a unit (arrival until then).
    pub last_served_ms: u64,
    /// Prompt tokens still to prefill (0 = decoding).
    pub prefill_left: usize,
}

/// The policy's parameters (from the config's `[scheduler]` section).
#[derive(Clone, Debug)]
pub struct PolicyConfig {
    /// Tokens one pass may carry (decode tokens + the prefill chunk).
    pub step_tokens: usize,
    /// Sequences one pass may carry.
    pub max_batch: usize,
    /// Prefill chunk per class (foreground, background, batch).
    pub chunk: [usize; 3],
    pub aging_ms: u64,
    /// Fair-share weight per uid (default 1).
    pub weights: HashMap<u32, u32>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self { step_tokens: 256, max_batch: 16, chunk: [256, 16, 16], aging_ms: 2000, weights: HashMap::new() }
    }
}

/// One pass of work.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Requests that decode one token each.
    pub decode: Vec<u64>,
    /// The request whose prompt advances, and by how many tokens.
    pub prefill: Option<(u64, usize)>,
    /// Further foreground prompts that fit the same pass (they arrive together, they are
    /// read together instead of one waiting a whole pass for the other).
    pub more_prefill: Vec<(u64, usize)>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.decode.is_empty() && self.prefill.is_none()
    }
}

pub struct Policy {
    pub cfg: PolicyConfig,
    vtime: HashMap<u32, f64>,
}

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Self {
        Self { cfg, vtime: HashMap::new() }
    }

    fn weight(&self, uid: u32) -> f64 {
        self.cfg.weights.get(&uid).copied().unwrap_or(1).max(1) as f64
    }

    /// The class an entry competes in now, after aging (never better than foreground).
    pub fn effective_class(&self, e: &Entry, now_ms: u64) -> Class {
        Class::from_index(self.rank(e, now_ms).max(0) as usize)
    }

    /// Its rank now: its class index minus one per `aging_ms` unserved; below 0 (foreground)
    /// means starving, served before anything else.
    fn rank(&self, e: &Entry, now_ms: u64) -> i64 {
        let waited = now_ms.saturating_sub(e.last_served_ms);
        let steps = waited.checked_div(self.cfg.aging_ms).map_or(0, |s| s as i64);
        (e.class as i64 - steps).max(-1)
    }

    /// A uid's virtual time (a newly active uid joins at the smallest active one).
    fn vtime_of(&self, uid: u32, active_min: f64) -> f64 {
        self.vtime.get(&uid).copied().unwrap_or(active_min).max(active_min)
    }

    /// Chooses the next pass over `entries` (the requests ready to run).
    pub fn plan(&mut self, now_ms: u64, entries: &[Entry]) -> Plan {
        self.plan_beside(now_ms, entries, false)
    }

    /// [`Self::plan`] while a processor of the engine's (the NPU) reads a prompt of another
    /// request: when that one is
    /// foreground (`foreground_elsewhere`), the pass is planned as if it carried that prompt —
    /// only foreground decode steps and prompts — since the accelerator's chunk also needs the
    /// CPU (llm.npu's norms and attention) and a foreground prompt's time to first token is
    /// what a foreground pass protects.
    pub fn plan_beside(&mut self, now_ms: u64, entries: &[Entry], foreground_elsewhere: bool) -> Plan {
        if entries.is_empty() {
            return Plan::default();
        }
        self.join_uids(entries);
        // Rank (with aging), then the request's own class — an aged background request does
        // not overtake foreground ones until it is starving — then fair share, then arrival.
        let key = |e: &Entry| (self.rank(e, now_ms), e.class, self.vtime[&e.uid], e.arrived_ms, e.id);
        let mut decoders: Vec<&Entry> = entries.iter().filter(|e| e.prefill_left == 0).collect();
        decoders.sort_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal));
        let best_prompt = entries
            .iter()
            .filter(|e| e.prefill_left > 0)
            .filter(|e| !foreground_elsewhere || e.class == Class::Foreground)
            .min_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal));
        // A foreground prompt's pass carries only foreground decode steps: its time to first
        // token is then what it would be on an idle daemon, plus at most the pass in flight.
        let fg_prompt = best_prompt.is_some_and(|e| e.class == Class::Foreground) || foreground_elsewhere;
        if fg_prompt {
            decoders.retain(|e| self.effective_class(e, now_ms) == Class::Foreground);
        }
        let cap = self.cfg.max_batch.max(1).min(self.cfg.step_tokens.max(1));
        let decode: Vec<u64> = decoders.iter().take(cap).map(|e| e.id).collect();
        let left = self.cfg.step_tokens.saturating_sub(decode.len());
        let room = decode.len() < self.cfg.max_batch.max(1);
        let prefill = match best_prompt {
            // Aging buys a turn, not a bigger chunk: the chunk follows the request's own class.
            // A background pass stays short as a whole (decode steps included), since a
            // foreground prompt arriving now waits for it: its chunk is what the decode steps
            // leave of the background chunk, but at least MIN_CHUNK so prompts keep moving.
            Some(e) if left > 0 && room => {
                let mut n = self.cfg.chunk[e.class as usize].max(1);
                if e.class != Class::Foreground {
                    n = n.saturating_sub(decode.len()).max(MIN_CHUNK.min(n));
                }
                Some((e.id, e.prefill_left.min(n).min(left)))
            }
            _ => None,
        };
        let mut more_prefill = Vec::new();
        if let (true, Some((first, n))) = (fg_prompt, prefill) {
            let mut left = left - n;
            let mut rest: Vec<&Entry> = entries
                .iter()
                .filter(|e| e.prefill_left > 0 && e.id != first && e.class == Class::Foreground)
                .collect();
            rest.sort_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal));
            for e in rest {
                if left == 0 || decode.len() + 1 + more_prefill.len() >= self.cfg.max_batch.max(1) {
                    break;
                }
                let n = e.prefill_left.min(self.cfg.chunk[0].max(1)).min(left);
                more_prefill.push((e.id, n));
                left -= n;
            }
        }
        Plan { decode, prefill, more_prefill }
    }

    /// Brings uids that were idle up to the smallest virtual time among `entries`' uids.
    fn join_uids(&mut self, entries: &[Entry]) {
        let active_min = entries.iter().filter_map(|e| self.vtime.get(&e.uid).copied()).fold(f64::INFINITY, f64::min);
        let active_min = if active_min.is_finite() { active_min } else { 0.0 };
        for e in entries {
            let v = self.vtime_of(e.uid, active_min);
            self.vtime.insert(e.uid, v);
        }
    }

    /// The prompt among `entries` for which `eligible` holds that a pass would read first
    /// (rank, class, fair share, arrival: the order [`Self::plan`] uses) — the worker offers the
    /// engine's scheduler the waiting prompts in this order. Uids join the fair share over all
    /// of `entries`.
    pub fn best_prompt(&mut self, now_ms: u64, entries: &[Entry], eligible: impl Fn(&Entry) -> bool) -> Option<u64> {
        self.join_uids(entries);
        let key = |e: &Entry| (self.rank(e, now_ms), e.class, self.vtime[&e.uid], e.arrived_ms, e.id);
        entries
            .iter()
            .filter(|e| e.prefill_left > 0 && eligible(e))
            .min_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal))
            .map(|e| e.id)
    }

    /// Accounts `tokens` of work done for `uid`.
    pub fn charge(&mut self, uid: u32, tokens: usize) {
        let w = self.weight(uid);
        *self.vtime.entry(uid).or_insert(0.0) += tokens as f64 / w;
    }

    /// Forgets uids with no requests left (bounded state).
    pub fn retain_uids(&mut self, live: impl Fn(u32) -> bool) {
        self.vtime.retain(|uid, _| live(*uid));
    }

    /// Virtual times, for dump.
    pub fn vtimes(&self) -> Vec<(u32, f64)> {
        let mut v: Vec<(u32, f64)> = self.vtime.iter().map(|(k, v)| (*k, *v)).collect();
        v.sort_by_key(|x| x.0);
        v
    }
}

/// Per-uid token quota over a sliding window.
#[derive(Default)]
pub struct Quota {
    /// (time ms, tokens) per uid, oldest first.
    used: HashMap<u32, std::collections::VecDeque<(u64, usize)>>,
}

impl Quota {
    /// Tokens `uid` used in the window ending at `now_ms`.
    pub fn used(&mut self, uid: u32, now_ms: u64, window_ms: u64) -> usize {
        let Some(q) = self.used.get_mut(&uid) else { return 0 };
        while q.front().is_some_and(|&(t, _)| now_ms.saturating_sub(t) >= window_ms) {
            q.pop_front();
        }
        let total = q.iter().map(|x| x.1).sum();
        if q.is_empty() {
            self.used.remove(&uid);
        }
        total
    }

    pub fn record(&mut self, uid: u32, now_ms: u64, tokens: usize) {
        if tokens > 0 {
            self.used.entry(uid).or_default().push_back((now_ms, tokens));
        }
    }

    /// When `uid` will be back under `limit` (ms from `now_ms`), if it is over.
    pub fn retry_after(&mut self, uid: u32, now_ms: u64, window_ms: u64, limit: usize) -> Option<u64> {
        let mut used = self.used(uid, now_ms, window_ms);
        if used < limit {
            return None;
        }
        let q = self.used.get(&uid)?;
        for &(t, n) in q {
            used -= n;
            if used < limit {
                return Some((t + window_ms).saturating_sub(now_ms));
            }
        }
        Some(window_ms)
    }
}

/// Admission's limits (the config's `[limits]` and `[scheduler]` quota keys).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Requests in flight in the whole daemon.
    pub max_requests: usize,
    /// Requests in flight per uid.
    pub max_requests_per_uid: usize,
    /// Tokens (prompt + generated) a uid may use per window; 0 = no quota.
    pub quota_tokens: usize,
    pub quota_window_ms: u64,
}

/// The books as a request arrives.
#[derive(Clone, Copy, Debug, Default)]
pub struct Load {
    /// Requests in flight in the daemon (queued or running).
    pub in_flight: usize,
    /// Of those, the caller's uid's.
    pub uid_in_flight: usize,
    /// Whether the request's session already has one in flight.
    pub session_busy: bool,
    /// The worker's average pass in ms (0 before the first), for the retry hint.
    pub pass_ms: u64,
}

/// Why a request is not admitted (the scheduler turns each into a `ServiceError`, and
/// `error.rs` that into an `ErrorCode`: `TokenQuota`/`UidLimit` → QUOTA_EXCEEDED,
/// `SessionBusy`/`Full` → BUSY).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The uid used its token quota; it is back under it in `retry_ms`.
    TokenQuota { retry_ms: u64 },
    /// The session is generating already (one request per session at a time).
    SessionBusy,
    /// The uid has `limit` requests in flight.
    UidLimit { limit: usize },
    /// The daemon holds `in_flight` requests, its limit; retry in about `retry_ms`.
    Full { in_flight: usize, retry_ms: u64 },
}

/// Shortest pass assumed by the BUSY retry hint (before the worker has measured one, or when
/// passes are shorter).
pub const MIN_HINT_PASS_MS: u64 = 10;

/// Admission control for a request of `uid` arriving at `now_ms`, checked in this order: the
/// uid's token quota over the sliding window, one request per session, the uid's requests in
/// flight, the daemon's. A full daemon answers BUSY with a hint of one pass per request ahead
/// (a request leaves roughly every few passes, so this errs long rather than invite a retry
/// storm).
pub fn admit(limits: &Limits, load: &Load, quota: &mut Quota, uid: u32, now_ms: u64) -> Result<(), Refusal> {
    if limits.quota_tokens > 0 {
        if let Some(retry_ms) = quota.retry_after(uid, now_ms, limits.quota_window_ms, limits.quota_tokens) {
            return Err(Refusal::TokenQuota { retry_ms });
        }
    }
    if load.session_busy {
        return Err(Refusal::SessionBusy);
    }
    if load.uid_in_flight >= limits.max_requests_per_uid {
        return Err(Refusal::UidLimit { limit: limits.max_requests_per_uid });
    }
    if load.in_flight >= limits.max_requests {
        let retry_ms = load.pass_ms.max(MIN_HINT_PASS_MS) * load.in_flight.max(1) as u64;
        return Err(Refusal::Full { in_flight: load.in_flight, retry_ms });
    }
    Ok(())
}

/// Whether a request admitted at `admitted_ms` with a deadline of `deadline_ms` (0 = none) has
/// run out at `now_ms`. The worker asks at every pass boundary, for waiting and running
/// requests alike, so a request ends within one pass of its deadline, wherever it is.
pub fn deadline_passed(admitted_ms: u64, deadline_ms: u64, now_ms: u64) -> bool {
    deadline_ms > 0 && now_ms.saturating_sub(admitted_ms) >= deadline_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, uid: u32, class: Class, at: u64, prefill_left: usize) -> Entry {
        Entry { id, uid, class, arrived_ms: at, last_served_ms: at, prefill_left }
    }

    #[test]
    fn a_prompt_chosen_for_an_accelerator_joins_the_fair_share_at_the_active_minimum() {
        let mut p = Policy::new(PolicyConfig::default());
        let decoding = entry(1, 10, Class::Foreground, 0, 0);
        p.plan(0, std::slice::from_ref(&decoding));
        p.charge(10, 100);
        let prompt = entry(2, 20, Class::Foreground, 5, 50);
        assert_eq!(p.best_prompt(5, &[decoding, prompt], |e| e.id == 2), Some(2));
        assert_eq!(
            p.vtimes(),
            vec![(10, 100.0), (20, 100.0)],
            "the new uid starts where the active ones are, not at 0"
        );
    }

    /// Runs passes of `ms_per_pass` simulated milliseconds, serving and charging as the worker
    /// does; returns tokens served per request id.
    fn simulate(
        p: &mut Policy,
        entries: &mut [Entry],
        passes: usize,
        ms_per_pass: u64,
        mut now: u64,
    ) -> HashMap<u64, usize> {
        let mut served = HashMap::new();
        for _ in 0..passes {
            let plan = p.plan(now, entries);
            for id in &plan.decode {
                let e = entries.iter_mut().find(|e| e.id == *id).expect("entry");
                e.last_served_ms = now;
                p.charge(e.uid, 1);
                *served.entry(*id).or_default() += 1;
            }
            if let Some((id, n)) = plan.prefill {
                let e = entries.iter_mut().find(|e| e.id == id).expect("entry");
                e.last_served_ms = now;
                p.charge(e.uid, n);
                *served.entry(id).or_default() += n;
            }
            now += ms_per_pass;
        }
        served
    }

    #[test]
    fn a_foreground_prompt_preempts_background_prefill_at_the_next_pass() {
        let mut p = Policy::new(PolicyConfig::default());
        let bg = entry(1, 100, Class::Background, 0, 10_000);
        let plan = p.plan(0, std::slice::from_ref(&bg));
        assert_eq!(plan.prefill, Some((1, 16)), "background prompts go in small chunks");
        p.charge(100, 16);
        // A foreground prompt arrives while the background one has 9968 tokens to go.
        let fg = entry(2, 200, Class::Foreground, 10, 300);
        let plan = p.plan(10, &[bg.clone(), fg.clone()]);
        assert_eq!(plan.prefill, Some((2, 256)), "the very next pass is the foreground prompt's");
        // Two foreground prompts arriving together share the pass.
        let fg2 = entry(3, 201, Class::Foreground, 12, 60);
        let plan = p.plan(12, &[bg, fg, fg2]);
        assert_eq!((plan.prefill, plan.more_prefill), (Some((2, 256)), vec![]), "no room left after 256");
        let mut p = Policy::new(PolicyConfig::default());
        let plan = p.plan(0, &[entry(5, 1, Class::Foreground, 0, 50), entry(6, 2, Class::Foreground, 1, 60)]);
        assert_eq!((plan.prefill, plan.more_prefill), (Some((5, 50)), vec![(6, 60)]));
    }

    #[test]
    fn decoding_sequences_share_one_pass_and_leave_room_for_a_prompt() {
        let mut p = Policy::new(PolicyConfig { max_batch: 8, ..PolicyConfig::default() });
        let mut es: Vec<Entry> = (0..6).map(|i| entry(i, 100 + i as u32, Class::Foreground, 0, 0)).collect();
        es.push(entry(10, 7, Class::Foreground, 5, 1000));
        let plan = p.plan(5, &es);
        assert_eq!(plan.decode.len(), 6);
        assert_eq!(plan.prefill, Some((10, 250)), "the prompt gets what the decodes leave of 256");
        // Background decodes ride along with a background prompt, not with a foreground one.
        let mut es: Vec<Entry> = (0..6).map(|i| entry(i, 100 + i as u32, Class::Background, 0, 0)).collect();
        es.push(entry(20, 8, Class::Background, 0, 1000));
        let plan = p.plan(5, &es);
        assert_eq!((plan.decode.len(), plan.prefill), (6, Some((20, 10))), "16 tokens in all");
        let mut wide = Policy::new(PolicyConfig { max_batch: 32, ..PolicyConfig::default() });
        let many: Vec<Entry> = (0..20)
            .map(|i| entry(i, 100, Class::Background, 0, 0))
            .chain([entry(99, 8, Class::Background, 0, 500)])
            .collect();
        assert_eq!(wide.plan(5, &many).prefill, Some((99, MIN_CHUNK)), "prompts keep moving");
        es.push(entry(10, 7, Class::Foreground, 5, 1000));
        let plan = p.plan(5, &es);
        assert_eq!((plan.decode.len(), plan.prefill), (0, Some((10, 256))));
        // More decoders than the batch holds: the best classes first.
        let mut many: Vec<Entry> = (0..10).map(|i| entry(i, 100, Class::Batch, 0, 0)).collect();
        many.push(entry(50, 9, Class::Foreground, 0, 0));
        let plan = p.plan(0, &many);
        assert_eq!(plan.decode.len(), 8);
        assert_eq!(plan.decode[0], 50);
        assert_eq!(plan.prefill, None);
    }

    #[test]
    fn fair_share_between_uids_follows_their_weights_within_ten_percent() {
        let weights = HashMap::from([(1, 1), (2, 3), (3, 2)]);
        let mut p = Policy::new(PolicyConfig { weights, chunk: [64, 16, 16], ..PolicyConfig::default() });
        let mut es = vec![
            entry(11, 1, Class::Background, 0, 1_000_000),
            entry(12, 2, Class::Background, 0, 1_000_000),
            entry(13, 3, Class::Background, 0, 1_000_000),
        ];
        let served = simulate(&mut p, &mut es, 600, 10, 0);
        let (a, b, c) = (served[&11] as f64, served[&12] as f64, served[&13] as f64);
        let total = a + b + c;
        for (got, w) in [(a, 1.0), (b, 3.0), (c, 2.0)] {
            let want = total * w / 6.0;
            assert!((got - want).abs() <= 0.1 * want, "share {got} vs {want} of {total}");
        }
    }

    #[test]
    fn aging_bounds_the_wait_of_a_batch_request_under_constant_foreground_load() {
        let cfg = PolicyConfig { aging_ms: 1000, ..PolicyConfig::default() };
        let mut p = Policy::new(cfg);
        let mut es = vec![entry(1, 10, Class::Foreground, 0, usize::MAX / 2), entry(2, 20, Class::Batch, 0, 500)];
        // 100 ms passes, always a foreground prompt waiting: batch must still get served.
        let mut first_served = None;
        let mut served_chunks = Vec::new();
        let mut now = 0;
        for _ in 0..100 {
            let plan = p.plan(now, &es);
            if let Some((id, n)) = plan.prefill {
                let e = es.iter_mut().find(|e| e.id == id).expect("entry");
                e.last_served_ms = now;
                p.charge(e.uid, n);
                if id == 2 {
                    first_served.get_or_insert(now);
                    served_chunks.push(n);
                }
            }
            now += 100;
        }
        let t = first_served.expect("the batch request was served");
        assert!(
            served_chunks.iter().all(|&n| n <= 16),
            "an aged batch prompt still goes in batch-sized chunks: {served_chunks:?}"
        );
        // Batch (2) → background (1) → foreground rank (0, but behind the foreground request)
        // → starving (-1): served within (2 + 1) aging periods plus one pass, not before.
        assert!(t <= 3 * 1000 + 100, "served after {t} ms");
        assert!(t >= 3 * 1000, "not before it was starving ({t} ms)");
    }

    #[test]
    fn a_uid_returning_from_idle_gets_no_banked_credit() {
        let mut p = Policy::new(PolicyConfig::default());
        p.charge(1, 10_000);
        let es = vec![entry(1, 1, Class::Background, 0, 1000), entry(2, 2, Class::Background, 0, 1000)];
        let _ = p.plan(0, &es);
        // uid 2 joined at uid 1's virtual time, not at 0: they now alternate.
        let vt: HashMap<u32, f64> = p.vtimes().into_iter().collect();
        assert_eq!(vt[&1], vt[&2]);
    }

    #[test]
    fn classes_are_capped_by_what_the_uid_may_claim() {
        assert_eq!(Class::capped(Class::Foreground, Class::Background), Class::Background);
        assert_eq!(Class::capped(Class::Batch, Class::Foreground), Class::Batch);
    }

    #[test]
    fn the_quota_window_slides() {
        let mut q = Quota::default();
        q.record(7, 0, 600);
        q.record(7, 30_000, 500);
        assert_eq!(q.used(7, 59_999, 60_000), 1100);
        assert_eq!(q.retry_after(7, 59_999, 60_000, 1000), Some(1));
        assert_eq!(q.used(7, 60_000, 60_000), 500, "the first record left the window");
        assert_eq!(q.retry_after(7, 60_000, 60_000, 1000), None);
        assert_eq!(q.used(7, 90_000, 60_000), 0);
        assert_eq!(q.used(8, 0, 60_000), 0);
    }

    #[test]
    fn admission_refuses_for_the_first_limit_reached_and_hints_when_to_retry() {
        let limits = Limits { max_requests: 4, max_requests_per_uid: 2, quota_tokens: 100, quota_window_ms: 60_000 };
        let mut q = Quota::default();
        let load = Load { in_flight: 3, uid_in_flight: 1, session_busy: false, pass_ms: 12 };
        assert_eq!(admit(&limits, &load, &mut q, 7, 0), Ok(()), "room everywhere");
        // BUSY when full: one pass per request ahead, at least MIN_HINT_PASS_MS a pass.
        let full = Load { in_flight: 4, ..load };
        assert_eq!(admit(&limits, &full, &mut q, 7, 0), Err(Refusal::Full { in_flight: 4, retry_ms: 48 }));
        let unmeasured = Load { pass_ms: 0, ..full };
        assert_eq!(
            admit(&limits, &unmeasured, &mut q, 7, 0),
            Err(Refusal::Full { in_flight: 4, retry_ms: 4 * MIN_HINT_PASS_MS })
        );
        // One request leaves: admitted again.
        assert_eq!(admit(&limits, &Load { in_flight: 3, ..full }, &mut q, 7, 5), Ok(()));
        // The uid's own limit comes before the daemon's, the session's before both.
        let uid_full = Load { uid_in_flight: 2, ..full };
        assert_eq!(admit(&limits, &uid_full, &mut q, 7, 0), Err(Refusal::UidLimit { limit: 2 }));
        let busy = Load { session_busy: true, ..uid_full };
        assert_eq!(admit(&limits, &busy, &mut q, 7, 0), Err(Refusal::SessionBusy));
        // Over the token quota: refused first, with the time until the window lets it back in.
        q.record(7, 1_000, 60);
        q.record(7, 2_000, 40);
        assert_eq!(admit(&limits, &busy, &mut q, 7, 30_000), Err(Refusal::TokenQuota { retry_ms: 31_000 }));
        assert_eq!(admit(&limits, &load, &mut q, 8, 30_000), Ok(()), "another uid is not charged");
        assert_eq!(admit(&limits, &load, &mut q, 7, 61_000), Ok(()), "the first record left the window");
        let no_quota = Limits { quota_tokens: 0, ..limits };
        q.record(7, 61_000, 1_000_000);
        assert_eq!(admit(&no_quota, &load, &mut q, 7, 61_000), Ok(()), "0 = no quota");
    }

    #[test]
    fn a_deadline_ends_a_request_at_the_first_pass_boundary_past_it_waiting_or_running() {
        assert!(!deadline_passed(1_000, 250, 1_249));
        assert!(deadline_passed(1_000, 250, 1_250));
        assert!(!deadline_passed(0, 0, u64::MAX), "0 = no deadline");
        // The worker's loop with a fake clock: 100 ms passes; at each boundary, expired
        // requests end, then the policy plans over the rest.
        let mut p = Policy::new(PolicyConfig::default());
        // (entry, admitted ms, deadline ms): a long foreground prompt without a deadline, a
        // background prompt that waits behind it, a foreground request decoding every pass.
        let mut live = vec![
            (entry(1, 10, Class::Foreground, 0, 1_000_000), 0, 0),
            (entry(2, 20, Class::Background, 0, 100), 0, 450),
            (entry(3, 30, Class::Foreground, 0, 0), 0, 320),
        ];
        let mut ended = HashMap::new();
        let mut served = HashMap::<u64, usize>::new();
        let mut now = 0;
        while now <= 1_000 {
            live.retain(|(e, admitted, deadline)| {
                let gone = deadline_passed(*admitted, *deadline, now);
                if gone {
                    ended.insert(e.id, now);
                }
                !gone
            });
            let entries: Vec<Entry> = live.iter().map(|x| x.0.clone()).collect();
            let plan = p.plan(now, &entries);
            for id in plan.decode.iter().chain(plan.prefill.iter().map(|x| &x.0)) {
                *served.entry(*id).or_default() += 1;
                let e = &mut live.iter_mut().find(|x| x.0.id == *id).expect("planned entries are live").0;
                e.last_served_ms = now;
                p.charge(e.uid, 1);
            }
            now += 100;
        }
        assert_eq!(ended.get(&3), Some(&400), "running: ends at the first boundary past 320 ms");
        assert_eq!(served.get(&3), Some(&4), "served at 0, 100, 200 and 300 ms, then never");
        assert_eq!(ended.get(&2), Some(&500), "waiting: ends at the first boundary past 450 ms");
        assert_eq!(served.get(&2), None, "it never got a turn behind the foreground prompt");
        assert!(!ended.contains_key(&1), "no deadline, never ended");
    }
}
