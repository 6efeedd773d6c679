//! Model residency: which models live in memory, decided by the daemon, not the apps.
//!
//! Every installed model is an [`Entry`] in one of four states: `Unloaded → Loading → Resident
//! → Evicting → Unloaded`. [`Residency::acquire`] returns a resident model, loading it if needed:
//! a model is loaded by exactly one thread (single flight); any other caller waits on the
//! condition variable and sees the load's progress in `dump`. Before a load, models are evicted
//! until the budget (weights + every session's KV cache) has room for the new one.
//!
//! Eviction picks, among resident models that are not pinned and not in use (no running request
//! holds them), the one with the least *keep value* `(1 + priority) · (1 + reload_s) /
//! (1 + idle_s)`: low priority, cheap to reload and long unused goes first (MNN-LLM and EdgeFlow
//! §6.5 give the ingredients; the formula is ours). A model in use is never evicted: its memory
//! would not be freed anyway.
//!
//! Memory is accounted as measured: the process's RSS growth during each load (serialized by a
//! load lock, so loads do not overlap) is that model's cost; an estimate from the file's header
//! stands in before the first load. Pressure handling and prefetch (`pressure.rs`) and the usage
//! history (kept in `Shared`, `shared.rs`) use these primitives.

use crate::error::ServiceError;
use crate::integrity::{Change, Fingerprint};
use llmd_engine::{LoadOptions, Model, ModelProbe};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Where a model is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Unloaded,
    Loading,
    Resident,
    Evicting,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            Self::Unloaded => "unloaded",
            Self::Loading => "loading",
            Self::Resident => "resident",
            Self::Evicting => "evicting",
        }
    }
}

/// Bytes read so far / in all, while a model loads.
#[derive(Default)]
pub struct LoadProgress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

pub struct Entry {
    pub path: PathBuf,
    pub probe: ModelProbe,
    /// The model's files as registered at start (`None`: they could not be read then).
    pub print: Option<Fingerprint>,
    /// Set once its files no longer match `print`: the model is refused from then on.
    pub changed: Option<Change>,
    pub state: State,
    pub model: Option<Arc<Model>>,
    pub pinned: bool,
    pub priority: u32,
    pub last_used: Instant,
    /// Seconds the last load took (an estimate before the first).
    pub reload_s: f64,
    /// Memory this model costs while resident (measured at its last load, else estimated).
    pub bytes: u64,
    pub measured: bool,
    /// Why it is resident (or was last loaded): "pinned", "request (uid N)", "prefetch", ...
    pub reason: String,
    pub progress: Arc<LoadProgress>,
    pub loads: u64,
    pub evictions: u64,
}

/// A line of the event log shown in `dump` (loads, evictions, pressure steps).
#[derive(Clone, Debug)]
pub struct Event {
    pub at: std::time::SystemTime,
    pub what: String,
}

pub struct Residency {
    entries: Mutex<BTreeMap<String, Entry>>,
    changed: Condvar,
    /// Serializes loads (one at a time keeps RSS measurement honest; 2 cores gain nothing from
    /// two parallel loads).
    load_lock: Mutex<()>,
    budget: u64,
    opts: LoadOptions,
    events: Mutex<VecDeque<Event>>,
    /// RSS before any model was loaded (the daemon's own footprint).
    pub baseline_rss: u64,
}

/// Keeps the event log bounded.
const MAX_EVENTS: usize = 64;
/// Before a model's first load, its cost is its weights plus this (tokenizer, scratch).
const OVERHEAD_ESTIMATE: u64 = 48 << 20;

pub fn process_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A snapshot of one entry for status and dump.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EntryInfo {
    pub id: String,
    pub state: String,
    pub bytes: u64,
    pub measured: bool,
    pub pinned: bool,
    pub priority: u32,
    pub reason: String,
    pub idle_s: f64,
    pub reload_s: f64,
    pub loads: u64,
    pub evictions: u64,
    pub in_use: bool,
    pub progress: (u64, u64),
    /// How its file changed since it was registered (then it is refused).
    pub changed: Option<String>,
}

impl Residency {
    pub fn new(
        models: BTreeMap<String, (PathBuf, ModelProbe)>,
        budget: u64,
        pinned: &[String],
        priorities: &BTreeMap<String, u32>,
        opts: LoadOptions,
    ) -> Self {
        let now = Instant::now();
        let entries = models
            .into_iter()
            .map(|(id, (path, probe))| {
                let bytes = probe.weight_bytes + OVERHEAD_ESTIMATE;
                // Until measured: reading the file at a modest 500 MB/s.
                let reload_s = probe.file_bytes as f64 / 500e6;
                // Its files as they are now: what every later check compares with.
                let (print, changed) = match Fingerprint::take(&path) {
                    Ok(p) => (Some(p), None),
                    Err(e) => (
                        None,
                        Some(Change { path: path.display().to_string(), what: format!("it could not be read ({e})") }),
                    ),
                };
                let e = Entry {
                    print,
                    changed,
                    pinned: pinned.contains(&id),
                    priority: priorities.get(&id).copied().unwrap_or(0),
                    path,
                    probe,
                    state: State::Unloaded,
                    model: None,
                    last_used: now,
                    reload_s,
                    bytes,
                    measured: false,
                    reason: String::new(),
                    progress: Arc::new(LoadProgress::default()),
                    loads: 0,
                    evictions: 0,
                };
                (id, e)
            })
            .collect();
        Self {
            entries: Mutex::new(entries),
            changed: Condvar::new(),
            load_lock: Mutex::new(()),
            budget,
            opts,
            events: Mutex::new(VecDeque::new()),
            baseline_rss: process_rss_bytes(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn event(&self, what: impl Into<String>) {
        let what = what.into();
        tracing::info!("residency: {what}");
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        ev.push_back(Event { at: std::time::SystemTime::now(), what });
        while ev.len() > MAX_EVENTS {
            ev.pop_front();
        }
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }

    pub fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    pub fn probe(&self, id: &str) -> Option<ModelProbe> {
        self.lock().get(id).map(|e| e.probe.clone())
    }

    pub fn contains(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    /// The model if it is resident now (no load).
    /// A model whose file changed is not (its `acquire` says why).
    pub fn get_resident(&self, id: &str) -> Option<Arc<Model>> {
        let mut m = self.lock();
        let e = m.get_mut(id)?;
        if e.state != State::Resident || e.changed.is_some() {
            return None;
        }
        // One `stat` per request: a file written since it was registered is not served.
        if let Some(Err(c)) = e.print.as_ref().map(Fingerprint::check_stat) {
            self.mark_changed(&mut m, id, c);
            return None;
        }
        let e = m.get_mut(id)?;
        e.last_used = Instant::now();
        e.model.clone()
    }

    /// Records that `id`'s files no longer match their fingerprint (said once) and evicts it
    /// if it is resident and no request is using it (else the periodic check will).
    fn mark_changed(&self, m: &mut MutexGuard<'_, BTreeMap<String, Entry>>, id: &str, change: Change) {
        let Some(e) = m.get_mut(id) else { return };
        if e.changed.is_some() {
            return;
        }
        e.changed = Some(change.clone());
        let evict = e.state == State::Resident && e.model.as_ref().is_none_or(|x| Arc::strong_count(x) == 1);
        self.event(format!(
            "model {id} refused until llmd restarts: its file changed since it was registered: {change}"
        ));
        if evict {
            self.evict_locked(m, id, "because its file changed");
        }
    }

    /// The periodic check: every model's files against their fingerprints (`stat` and the
    /// sampled blocks, read without the lock held); a model that changed is refused and, once
    /// no request uses it, evicted. Returns how many were found changed this time.
    pub fn check_files(&self) -> usize {
        let prints: Vec<(String, Fingerprint)> = self
            .lock()
            .iter()
            .filter(|(_, e)| e.changed.is_none())
            .filter_map(|(id, e)| Some((id.clone(), e.print.clone()?)))
            .collect();
        let mut found = 0;
        for (id, print) in prints {
            if let Err(c) = print.check() {
                found += 1;
                self.mark_changed(&mut self.lock(), &id, c);
            }
        }
        let mut m = self.lock();
        let idle_changed: Vec<String> = m
            .iter()
            .filter(|(_, e)| {
                e.changed.is_some()
                    && e.state == State::Resident
                    && e.model.as_ref().is_none_or(|x| Arc::strong_count(x) == 1)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in idle_changed {
            self.evict_locked(&mut m, &id, "because its file changed");
        }
        found
    }

    /// Bytes of resident models (and models loading, at their expected cost).
    pub fn model_bytes(&self) -> u64 {
        self.lock().values().filter(|e| matches!(e.state, State::Resident | State::Loading)).map(|e| e.bytes).sum()
    }

    pub fn snapshot(&self) -> Vec<EntryInfo> {
        let now = Instant::now();
        self.lock()
            .iter()
            .map(|(id, e)| EntryInfo {
                id: id.clone(),
                state: e.state.name().into(),
                bytes: if matches!(e.state, State::Resident | State::Loading) { e.bytes } else { 0 },
                measured: e.measured,
                pinned: e.pinned,
                priority: e.priority,
                reason: e.reason.clone(),
                idle_s: now.duration_since(e.last_used).as_secs_f64(),
                reload_s: e.reload_s,
                loads: e.loads,
                evictions: e.evictions,
                in_use: e.model.as_ref().is_some_and(|m| Arc::strong_count(m) > 1),
                progress: (e.progress.done.load(Ordering::Relaxed), e.progress.total.load(Ordering::Relaxed)),
                changed: e.changed.as_ref().map(|c| c.to_string()),
            })
            .collect()
    }

    /// The resident model `id`, loading it first if needed (waiting for a load already under
    /// way instead of starting a second). `kv_bytes` is what sessions' caches hold now, which
    /// counts against the budget too.
    pub fn acquire(&self, id: &str, why: &str, kv_bytes: u64) -> Result<Arc<Model>, ServiceError> {
        let mut m = self.lock();
        let changed = |change: &Change| ServiceError::ModelChanged { id: id.to_owned(), change: change.clone() };
        loop {
            let e = m.get_mut(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))?;
            if let Some(c) = &e.changed {
                let err = changed(c);
                // Marked while a request still held it: evicted now if none does.
                if e.state == State::Resident && e.model.as_ref().is_none_or(|x| Arc::strong_count(x) == 1) {
                    self.evict_locked(&mut m, id, "because its file changed");
                }
                return Err(err);
            }
            match e.state {
                State::Resident => {
                    if let Some(Err(c)) = e.print.as_ref().map(Fingerprint::check_stat) {
                        let err = changed(&c);
                        self.mark_changed(&mut m, id, c);
                        return Err(err);
                    }
                    let e = m.get_mut(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))?;
                    e.last_used = Instant::now();
                    return e.model.clone().ok_or_else(|| ServiceError::Internal("resident model missing".into()));
                }
                State::Loading | State::Evicting => {
                    m = self.changed.wait_timeout(m, Duration::from_millis(200)).unwrap_or_else(|p| p.into_inner()).0;
                }
                State::Unloaded => break,
            }
        }
        // This thread loads it: claim it first so no other thread starts a second load.
        let need = m.get(id).map(|e| e.bytes).unwrap_or(0);
        self.make_room(&mut m, id, need, kv_bytes)?;
        let (path, progress, print) = {
            let e = m.get_mut(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))?;
            e.state = State::Loading;
            e.reason = why.to_owned();
            e.progress.done.store(0, Ordering::Relaxed);
            e.progress.total.store(e.probe.file_bytes, Ordering::Relaxed);
            (e.path.clone(), e.progress.clone(), e.print.clone())
        };
        drop(m);
        // Before a load: its files as they were registered (`stat` and the sampled blocks).
        if let Some(Err(c)) = print.as_ref().map(Fingerprint::check) {
            let err = changed(&c);
            let mut m = self.lock();
            if let Some(e) = m.get_mut(id) {
                e.state = State::Unloaded;
            }
            self.mark_changed(&mut m, id, c);
            drop(m);
            self.changed.notify_all();
            return Err(err);
        }
        self.event(format!("loading {id} ({why})"));
        let result = {
            let _one = self.load_lock.lock().unwrap_or_else(|p| p.into_inner());
            let before = process_rss_bytes();
            let t = Instant::now();
            let r = load_model(&path, &self.opts, &progress);
            (r, t.elapsed().as_secs_f64(), process_rss_bytes().saturating_sub(before))
        };
        // A file written while it loaded: what was read is not the registered model.
        // (`Err(Ok(change))`: it changed; `Err(Err(reason))`: it failed to load.)
        let result = match (result, print.as_ref().map(Fingerprint::check_stat)) {
            ((Ok(_), secs, grew), Some(Err(c))) => (Err(Ok(c)), secs, grew),
            ((r, secs, grew), _) => (r.map_err(Err), secs, grew),
        };
        let mut m = self.lock();
        let e = m.get_mut(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))?;
        let out = match result {
            (Ok(model), secs, grew) => {
                let model = Arc::new(model);
                e.state = State::Resident;
                e.model = Some(model.clone());
                e.reload_s = secs;
                // A reload can reuse heap the last eviction left behind and so look cheaper:
                // a model costs the most any of its loads measured.
                let floor = if e.measured { e.bytes } else { 0 };
                e.bytes = grew.max(model.transformer.weights.size_bytes() as u64).max(floor);
                e.measured = true;
                e.loads += 1;
                e.last_used = Instant::now();
                let bytes = e.bytes;
                drop(m);
                self.event(format!("loaded {id} in {secs:.2} s, {} MB resident", bytes >> 20));
                Ok(model)
            }
            (Err(Err(err)), _, _) => {
                e.state = State::Unloaded;
                drop(m);
                self.event(format!("loading {id} failed: {err}"));
                Err(ServiceError::ModelLoadFailed { id: id.to_owned(), reason: err })
            }
            (Err(Ok(c)), _, _) => {
                e.state = State::Unloaded;
                let err = changed(&c);
                self.mark_changed(&mut m, id, c);
                drop(m);
                Err(err)
            }
        };
        self.changed.notify_all();
        out
    }

    /// Evicts models (best candidates first) until `need` more bytes fit the budget.
    fn make_room(
        &self,
        m: &mut MutexGuard<'_, BTreeMap<String, Entry>>,
        for_id: &str,
        need: u64,
        kv_bytes: u64,
    ) -> Result<(), ServiceError> {
        if self.budget == 0 {
            return Ok(());
        }
        loop {
            let used: u64 = m
                .values()
                .filter(|e| matches!(e.state, State::Resident | State::Loading))
                .map(|e| e.bytes)
                .sum::<u64>()
                + kv_bytes;
            if used + need <= self.budget {
                return Ok(());
            }
            let Some(victim) = pick_victim(m, for_id) else {
                if m.values().all(|e| e.state == State::Unloaded) {
                    // Nothing else is loaded: a model bigger than the budget still loads alone.
                    return Ok(());
                }
                return Err(ServiceError::Busy(format!(
                    "memory budget of {} MB is held by models in use or pinned; retry later",
                    self.budget >> 20
                )));
            };
            self.evict_locked(m, &victim, &format!("to make room for {for_id}"));
        }
    }

    fn evict_locked(&self, m: &mut MutexGuard<'_, BTreeMap<String, Entry>>, id: &str, why: &str) {
        if let Some(e) = m.get_mut(id) {
            e.state = State::Evicting;
            // Dropping our reference frees the weights: nothing else holds the model (checked).
            e.model = None;
            e.state = State::Unloaded;
            e.evictions += 1;
            e.reason = format!("evicted {why}");
        }
        // The weights' large buffers went back to the OS when they were freed; the tokenizer's
        // many small allocations need the allocator asked.
        llmd_alloc_sys::release_free_memory();
        self.event(format!("evicted {id} {why}"));
        self.changed.notify_all();
    }

    /// Evicts the best candidate (not pinned, not in use); returns its id.
    pub fn evict_one(&self, why: &str) -> Option<String> {
        let mut m = self.lock();
        let victim = pick_victim(&m, "")?;
        self.evict_locked(&mut m, &victim, why);
        Some(victim)
    }

    /// Evicts `id` if it is resident and not in use.
    pub fn evict(&self, id: &str, why: &str) -> Result<bool, ServiceError> {
        let mut m = self.lock();
        let e = m.get(id).ok_or_else(|| ServiceError::ModelNotFound(id.to_owned()))?;
        if e.state != State::Resident {
            return Ok(false);
        }
        if e.model.as_ref().is_some_and(|x| Arc::strong_count(x) > 1) {
            return Err(ServiceError::Busy(format!("model {id} is in use")));
        }
        self.evict_locked(&mut m, id, why);
        Ok(true)
    }
}

/// The resident, unpinned, unused model with the least keep value.
fn pick_victim(m: &BTreeMap<String, Entry>, except: &str) -> Option<String> {
    let now = Instant::now();
    m.iter()
        .filter(|(id, e)| {
            id.as_str() != except
                && e.state == State::Resident
                && !e.pinned
                && e.model.as_ref().is_none_or(|x| Arc::strong_count(x) == 1)
        })
        .map(|(id, e)| {
            let idle = now.duration_since(e.last_used).as_secs_f64();
            let keep = (1.0 + e.priority as f64) * (1.0 + e.reload_s) / (1.0 + idle);
            (keep, id.clone())
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, id)| id)
}

fn load_model(path: &Path, opts: &LoadOptions, progress: &Arc<LoadProgress>) -> Result<Model, String> {
    if llmd_engine::format::llmd::path_is_llmd(path) {
        let p = progress.clone();
        let stream = llmd_engine::model::stream::StreamOptions {
            progress: Some(Arc::new(move |x: &llmd_engine::model::stream::Progress| {
                p.done.store(x.read_bytes, Ordering::Relaxed);
                p.total.store(x.total_bytes, Ordering::Relaxed);
            })),
            ..Default::default()
        };
        return Model::load_llmd(path, opts, &stream, None).map(|(m, _, _)| m).map_err(|e| e.to_string());
    }
    let p = progress.clone();
    let m = Model::load_with_progress(path, opts, &move |done, total| {
        p.done.store(done, Ordering::Relaxed);
        p.total.store(total, Ordering::Relaxed);
    })
    .map_err(|e| e.to_string())?;
    Ok(m)
}

/// Where memory pressure comes from: Linux PSI in production, a file the test writes, or a
/// closure (all read through the same parser).
pub trait PressureSource: Send + Sync {
    /// `some avg10` of memory pressure (percent of time some task stalled on memory, last 10 s).
    fn some_avg10(&self) -> Option<f64>;
}

/// Reads a PSI file (`/proc/pressure/memory` format).
pub struct PsiFile(pub PathBuf);

/// Parses the `some avg10=` field of a PSI file.
pub fn parse_psi_some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace().find_map(|f| f.strip_prefix("avg10=")).and_then(|v| v.parse().ok())
}

impl PressureSource for PsiFile {
    fn some_avg10(&self) -> Option<f64> {
        std::fs::read_to_string(&self.0).ok().and_then(|t| parse_psi_some_avg10(&t))
    }
}

/// Which model each app uses at which hour: the prefetch predictor, kept across restarts
/// (JSON, written atomically), bounded in size.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UsageHistory {
    /// "uid/hour" → model id → uses (decayed: halved when a key's total passes `DECAY_AT`).
    pub counts: BTreeMap<String, BTreeMap<String, u32>>,
}

/// At most this many (uid, hour) keys are kept (the least used go first).
pub const MAX_KEYS: usize = 512;
/// Counts of a key are halved past this total, so old habits fade.
const DECAY_AT: u32 = 1000;

impl UsageHistory {
    pub fn load(path: &Path) -> Self {
        std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, path)
    }

    pub fn record(&mut self, uid: u32, hour: u32, model: &str) {
        let key = format!("{uid}/{hour}");
        let c = self.counts.entry(key).or_default();
        *c.entry(model.to_owned()).or_insert(0) += 1;
        if c.values().sum::<u32>() > DECAY_AT {
            c.values_mut().for_each(|v| *v /= 2);
            c.retain(|_, v| *v > 0);
        }
        while self.counts.len() > MAX_KEYS {
            let least = self.counts.iter().min_by_key(|(_, c)| c.values().sum::<u32>()).map(|(k, _)| k.clone());
            match least {
                Some(k) => {
                    self.counts.remove(&k);
                }
                None => break,
            }
        }
    }

    /// The model most likely used at `hour` (by any app): the sum over uids of that hour's
    /// counts, ties to the smaller id.
    pub fn predict(&self, hour: u32) -> Option<String> {
        let mut total: BTreeMap<&str, u32> = BTreeMap::new();
        for (k, c) in &self.counts {
            if k.rsplit('/').next().and_then(|h| h.parse::<u32>().ok()) == Some(hour) {
                for (m, n) in c {
                    *total.entry(m.as_str()).or_insert(0) += n;
                }
            }
        }
        total.into_iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(a.0))).map(|(m, _)| m.to_owned())
    }

    /// The model `uid` most likely uses at `hour`.
    pub fn predict_for(&self, uid: u32, hour: u32) -> Option<String> {
        let c = self.counts.get(&format!("{uid}/{hour}"))?;
        c.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))).map(|(m, _)| m.clone())
    }
}

/// The hour of day (UTC; a phone would use local time) now.
pub fn hour_now() -> u32 {
    let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    ((s / 3600) % 24) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_parser_reads_some_avg10() {
        let t = "some avg10=12.50 avg60=3.00 avg300=0.40 total=123\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=5\n";
        assert_eq!(parse_psi_some_avg10(t), Some(12.5));
        assert_eq!(parse_psi_some_avg10("garbage"), None);
        assert_eq!(parse_psi_some_avg10("some avg10=x"), None);
    }

    #[test]
    fn history_predicts_by_hour_and_stays_bounded() {
        let mut h = UsageHistory::default();
        for _ in 0..3 {
            h.record(10001, 9, "b");
        }
        h.record(10002, 9, "a");
        h.record(10001, 20, "a");
        assert_eq!(h.predict(9).as_deref(), Some("b"));
        assert_eq!(h.predict(20).as_deref(), Some("a"));
        assert_eq!(h.predict(3), None);
        assert_eq!(h.predict_for(10002, 9).as_deref(), Some("a"));
        for uid in 0..(MAX_KEYS as u32 + 50) {
            h.record(uid, 1, "x");
        }
        assert!(h.counts.len() <= MAX_KEYS);
        for _ in 0..3000 {
            h.record(7, 7, "y");
        }
        assert!(h.counts["7/7"]["y"] <= DECAY_AT);
        let dir = std::env::temp_dir().join(format!("llmd-hist-{}", std::process::id()));
        let p = dir.join("usage.json");
        h.save(&p).expect("save");
        assert_eq!(UsageHistory::load(&p).counts, h.counts);
        let _ = std::fs::remove_dir_all(dir);
    }
}
