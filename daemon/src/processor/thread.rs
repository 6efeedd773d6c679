//! [`Processor`]: the thread, its status and `dump`, and the [`Backend`] it runs (see the
//! module above).

use llmd_engine::model::Devices;
use llmd_engine::Model;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Jobs whose spans `dump` lists.
pub const RECENT_JOBS: usize = 64;

/// How often an idle processor thread lets go of dropped (evicted) models' device sets.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Work for a processor's thread: called with the model's device set, or with why there is
/// none (the model was dropped, its preparation failed, the processor is unavailable).
pub type Job = Box<dyn FnOnce(Result<&Devices, String>) -> Result<(), String> + Send>;

/// Which processor a thread is: its name in `dump`, its thread's and its job lines' names, and
/// what runs on the CPU without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Label {
    Npu,
    Gpu,
}

impl Label {
    pub fn name(self) -> &'static str {
        match self {
            Label::Npu => "NPU",
            Label::Gpu => "GPU",
        }
    }

    fn thread(self) -> &'static str {
        match self {
            Label::Npu => "llmd-npu",
            Label::Gpu => "llmd-gpu",
        }
    }

    fn job_line(self) -> &'static str {
        match self {
            Label::Npu => "npu_job",
            Label::Gpu => "gpu_job",
        }
    }

    /// What the CPU does instead.
    fn fallback(self) -> &'static str {
        match self {
            Label::Npu => "prompts run on the CPU",
            Label::Gpu => "decode runs on the CPU",
        }
    }
}

/// What a processor is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// The backend does not use it.
    Off,
    /// The library is being opened (and kernels built).
    Starting,
    /// Open: what `dump` says of its devices.
    Serving { what: String },
    /// It cannot be used: the daemon serves on the CPU.
    Unavailable { reason: String },
}

/// A model's device set on a processor.
#[derive(Clone, Debug, PartialEq)]
enum Prep {
    Preparing,
    Ready { graphs: usize, how: String, seconds: f64, takes: Option<Takes> },
    Failed { reason: String },
}

/// Why a processor did not open: said at info when it is expected (automatic placement off a
/// phone), else as a warning.
pub struct Refusal {
    pub reason: String,
    pub expected: bool,
}

impl Refusal {
    pub fn unexpected(reason: impl Into<String>) -> Self {
        Self { reason: reason.into(), expected: false }
    }
}

/// The device's modelled time so far, nanoseconds (a library's model of the chip: the
/// emulator's), read before and after each job.
pub type ModelledFn = Box<dyn Fn() -> u64 + Send>;

/// `dump`'s lines of a backend's own counters of a device set (given the model's name), read
/// after each job.
pub type LinesFn = Box<dyn Fn(&Devices, &str) -> Vec<String> + Send>;

/// A model's device set, prepared by a [`Backend`].
pub struct Prepared {
    pub devs: Devices,
    /// Graphs it prepared (0: the device builds them at first use).
    pub graphs: usize,
    /// How (loaded from a cache, built, planned …), for `dump`.
    pub how: String,
    /// Its devices' modelled time, where they model one.
    pub modelled: Option<ModelledFn>,
    /// The backend's counters of this device set.
    pub lines: LinesFn,
    /// What work the processor takes for this model, when the backend decides per model (a
    /// plan); None: the processor's own.
    pub takes: Option<Takes>,
}

/// What one processor opens and prepares; run on its thread.
pub trait Backend: Send + 'static {
    /// Opens the devices; what `dump` says of them.
    fn open(&mut self) -> Result<String, Refusal>;
    /// `model`'s device set.
    fn prepare(&mut self, model: &Arc<Model>) -> Result<Prepared, String>;
    /// A job of `model` failed (`reason`): the model's work now runs without this processor.
    /// What the backend did about it, for `dump` (a plan made again without it).
    fn failed(&mut self, _model: &Arc<Model>, _reason: &str) -> Option<String> {
        None
    }
}

/// What a job is, for `dump`: its requests, tokens and sequences, and which phase of them.
#[derive(Clone, Debug, Default)]
pub struct JobKind {
    /// The requests it serves (a batched decode pass serves several).
    pub requests: Vec<u64>,
    pub tokens: usize,
    pub sequences: usize,
    /// A prompt's tokens from this offset in chunks of `rows` (`Some((offset, rows))`), else
    /// decode steps.
    pub prefill: Option<(usize, usize)>,
}

/// One job of `dump`'s `JOBS` section (and `llmctl dump --json`'s `"jobs"`): which request,
/// where, what and when (wall-clock milliseconds since the Unix epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRecord {
    pub request: u64,
    /// "npu", "gpu" or "cpu".
    pub processor: &'static str,
    /// "prefill" or "decode".
    pub kind: &'static str,
    /// A prefill job's first chunk in its prompt (counted in the processor's own chunk size).
    pub chunk: Option<usize>,
    pub tokens: usize,
    pub start_ms: u64,
    pub end_ms: u64,
    pub ok: bool,
}

impl JobRecord {
    /// The records of one job: one per request it served.
    pub fn of(processor: &'static str, kind: &JobKind, start_ms: u64, end_ms: u64, ok: bool) -> Vec<JobRecord> {
        let (what, chunk) = match kind.prefill {
            Some((offset, rows)) => ("prefill", Some(offset / rows.max(1))),
            None => ("decode", None),
        };
        let per = if kind.prefill.is_some() { kind.tokens } else { 1 };
        kind.requests
            .iter()
            .map(|&request| JobRecord { request, processor, kind: what, chunk, tokens: per, start_ms, end_ms, ok })
            .collect()
    }

    /// Its line in `dump`'s `JOBS` section.
    pub fn line(&self) -> String {
        let chunk = self.chunk.map_or("-".to_owned(), |c| c.to_string());
        format!(
            "job request={} processor={} kind={} chunk={chunk} tokens={} start_ms={} end_ms={} ok={}",
            self.request, self.processor, self.kind, self.tokens, self.start_ms, self.end_ms, self.ok
        )
    }
}

/// One job a processor ran (wall-clock milliseconds since the Unix epoch, so another process
/// can compare them with its own clock).
#[derive(Clone, Debug)]
struct JobSpan {
    pub id: u64,
    pub kind: JobKind,
    pub start_ms: u64,
    pub end_ms: u64,
    pub ok: bool,
    /// The device's modelled time of the job (see [`ModelledFn`]), nanoseconds.
    pub modelled_ns: u64,
    /// Prompt tokens the worker read on the CPU meanwhile, and when.
    pub beside: Option<(usize, u64, u64)>,
    /// A prompt job's chunks as its schedule ran them, each chunk's work per processor (an
    /// out-of-order prefill: the NPU's linear groups of one chunk beside the CPU's attention
    /// of another); none: the job is one record.
    pub parts: Vec<JobRecord>,
}

/// A prompt job's records from the schedules its prefill ran (`Devices::take_traces`): per
/// chunk and processor, from its first job's start to its last one's end.
fn trace_records(kind: &JobKind, traces: &[llmd_engine::model::Trace], ok: bool) -> Vec<JobRecord> {
    let (Some((offset, rows)), Some(&request)) = (kind.prefill, kind.requests.first()) else { return Vec::new() };
    let rows = rows.max(1);
    let mut out: Vec<JobRecord> = Vec::new();
    let mut first_chunk = offset / rows;
    for t in traces {
        let origin = t.origin.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3);
        let chunks = t.runs.iter().map(|r| r.0.chunk + 1).max().unwrap_or(0);
        for (job, lane, a, b) in &t.runs {
            let processor = match lane {
                llmd_engine::sched::Processor::Npu => "npu",
                llmd_engine::sched::Processor::Gpu => "gpu",
                llmd_engine::sched::Processor::Cpu => "cpu",
            };
            let chunk = first_chunk + job.chunk;
            let (start_ms, end_ms) = ((origin + a * 1e3) as u64, (origin + b * 1e3) as u64);
            match out.iter_mut().find(|r| r.chunk == Some(chunk) && r.processor == processor) {
                Some(r) => {
                    r.start_ms = r.start_ms.min(start_ms);
                    r.end_ms = r.end_ms.max(end_ms);
                }
                None => out.push(JobRecord {
                    request,
                    processor,
                    kind: "prefill",
                    chunk: Some(chunk),
                    tokens: rows.min(kind.tokens.saturating_sub((chunk - offset / rows) * rows)),
                    start_ms,
                    end_ms,
                    ok,
                }),
            }
        }
        first_chunk += chunks;
    }
    out
}

#[derive(Clone, Debug)]
struct ModelEntry {
    name: String,
    key: usize,
    model: Weak<Model>,
    prep: Prep,
}

#[derive(Debug)]
struct Status {
    state: State,
    /// The thread is preparing a model: a job now would wait for that.
    preparing: bool,
    models: Vec<ModelEntry>,
    jobs: u64,
    tokens: u64,
    sequences: u64,
    busy: Duration,
    modelled_ns: Option<u64>,
    recent: VecDeque<JobSpan>,
    /// The backend's counter lines after the last job.
    lines: Vec<String>,
    /// CPU work reported for a job not yet recorded (the worker may hear of a job's result
    /// before the thread records its span).
    pending_beside: Vec<(u64, (usize, u64, u64))>,
}

enum Msg {
    Prepare { key: usize, model: Weak<Model> },
    Run { id: u64, key: usize, kind: JobKind, job: Job },
}

/// What work a processor takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Takes {
    /// Rows of its prompt graphs, if it reads prompts: a job's tokens run in chunks of this many.
    pub chunk: Option<usize>,
    /// Chunks one prompt job takes (prefilled out of order).
    pub chunks_per_job: usize,
    /// Whether it runs decode passes.
    pub decode: bool,
    /// Whether a decode pass runs its sequences one at a time (HeteroLLM's plan is cut for
    /// one token, not for a batch of them).
    pub one_sequence_at_a_time: bool,
}

/// One of the daemon's processors (see the module doc).
pub struct Processor {
    label: Label,
    takes: Takes,
    tx: Option<Mutex<Sender<Msg>>>,
    status: Arc<Mutex<Status>>,
    next_id: AtomicU64,
}

/// Milliseconds since the Unix epoch.
pub fn epoch_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}

fn key_of(model: &Arc<Model>) -> usize {
    Arc::as_ptr(model) as usize
}

impl Status {
    fn new(state: State) -> Self {
        Self {
            state,
            preparing: false,
            models: Vec::new(),
            jobs: 0,
            tokens: 0,
            sequences: 0,
            busy: Duration::ZERO,
            modelled_ns: None,
            recent: VecDeque::new(),
            lines: Vec::new(),
            pending_beside: Vec::new(),
        }
    }

    fn unavailable(&mut self, label: Label, r: Refusal) {
        if r.expected {
            tracing::info!(reason = %r.reason, "no {}: {}", label.name(), label.fallback());
        } else {
            tracing::warn!(reason = %r.reason, "{} unavailable, {}", label.name(), label.fallback());
        }
        self.state = State::Unavailable { reason: r.reason };
        self.models.clear();
    }

    fn entry(&mut self, key: usize) -> Option<&mut ModelEntry> {
        self.models.iter_mut().find(|m| m.key == key && m.model.strong_count() > 0)
    }
}

impl Processor {
    /// A processor the backend does not use.
    pub fn off(label: Label) -> Arc<Self> {
        Self::not_started(label, State::Off)
    }

    /// A processor that cannot be used, said once (see [`Refusal`]).
    pub fn refused(label: Label, r: Refusal) -> Arc<Self> {
        let mut s = Status::new(State::Starting);
        s.unavailable(label, r);
        Arc::new(Self { label, takes: Takes::default(), tx: None, status: Arc::new(Mutex::new(s)), next_id: 1.into() })
    }

    fn not_started(label: Label, state: State) -> Arc<Self> {
        let status = Arc::new(Mutex::new(Status::new(state)));
        Arc::new(Self { label, takes: Takes::default(), tx: None, status, next_id: 1.into() })
    }

    /// Starts the processor's thread, which opens `backend`'s devices. Never fails: see the
    /// module doc.
    pub fn start(label: Label, takes: Takes, backend: Box<dyn Backend>) -> Arc<Self> {
        let status = Arc::new(Mutex::new(Status::new(State::Starting)));
        let (tx, rx) = std::sync::mpsc::channel();
        let st = status.clone();
        let spawned =
            std::thread::Builder::new().name(label.thread().into()).spawn(move || serve(label, backend, &st, rx));
        let tx = match spawned {
            Ok(_) => Some(Mutex::new(tx)),
            Err(e) => {
                lock(&status).unavailable(label, Refusal::unexpected(format!("its thread did not start: {e}")));
                None
            }
        };
        Arc::new(Self { label, takes, tx, status, next_id: 1.into() })
    }

    fn status(&self) -> MutexGuard<'_, Status> {
        lock(&self.status)
    }

    pub fn label(&self) -> Label {
        self.label
    }

    pub fn state(&self) -> State {
        self.status().state.clone()
    }

    /// What work it takes for `model`: its plan's, once prepared with one, else its own.
    pub fn takes_for(&self, model: &Arc<Model>) -> Takes {
        let key = key_of(model);
        match self.status().entry(key).map(|m| &m.prep) {
            Some(Prep::Ready { takes: Some(t), .. }) => *t,
            _ => self.takes,
        }
    }

    /// Has the thread prepare `model`'s device set, unless it has it or is at it.
    pub fn prepare(&self, model: &Arc<Model>) {
        let Some(tx) = &self.tx else { return };
        let key = key_of(model);
        {
            let mut s = self.status();
            if !matches!(s.state, State::Serving { .. } | State::Starting) {
                return;
            }
            s.models.retain(|m| m.model.strong_count() > 0);
            if s.models.iter().any(|m| m.key == key) {
                return;
            }
            s.models.push(ModelEntry {
                name: model.name.clone(),
                key,
                model: Arc::downgrade(model),
                prep: Prep::Preparing,
            });
        }
        let _ = lock(tx).send(Msg::Prepare { key, model: Arc::downgrade(model) });
    }

    /// Whether a job for `model` runs now: the processor serves, the model's device set is
    /// ready, and the thread is not busy preparing another model's.
    pub fn ready(&self, model: &Arc<Model>) -> bool {
        let key = key_of(model);
        let mut s = self.status();
        matches!(s.state, State::Serving { .. })
            && !s.preparing
            && s.entry(key).is_some_and(|m| matches!(m.prep, Prep::Ready { .. }))
    }

    /// The prompt tokens one job for `model` takes, when it reads prompts and is ready for it.
    pub fn prompt_tokens(&self, model: &Arc<Model>) -> Option<usize> {
        let takes = self.takes_for(model);
        let chunk = takes.chunk?;
        self.ready(model).then_some(chunk * takes.chunks_per_job.max(1))
    }

    /// Whether `model`'s decode passes run here now.
    pub fn decodes(&self, model: &Arc<Model>) -> bool {
        self.takes_for(model).decode && self.ready(model)
    }

    /// Queues `job` for `model`'s device set; returns its id, or gives the job back if there is
    /// no thread to take it.
    pub fn submit(&self, model: &Arc<Model>, kind: JobKind, job: Job) -> Result<u64, Job> {
        let Some(tx) = &self.tx else { return Err(job) };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(tx).send(Msg::Run { id, key: key_of(model), kind, job }).map(|()| id).map_err(|e| match e.0 {
            Msg::Run { job, .. } => job,
            Msg::Prepare { .. } => unreachable!("a Run was sent"),
        })
    }

    /// Its recent jobs, one record per request each served.
    pub fn records(&self) -> Vec<JobRecord> {
        let name = match self.label {
            Label::Npu => "npu",
            Label::Gpu => "gpu",
        };
        self.status()
            .recent
            .iter()
            .flat_map(|j| match j.parts.is_empty() {
                true => JobRecord::of(name, &j.kind, j.start_ms, j.end_ms, j.ok),
                false => j.parts.clone(),
            })
            .collect()
    }

    /// Records the CPU work the worker ran beside job `id`: `tokens` prompt tokens from
    /// `start_ms` to `end_ms`.
    pub fn beside(&self, id: u64, tokens: usize, start_ms: u64, end_ms: u64) {
        let mut s = self.status();
        match s.recent.iter_mut().find(|j| j.id == id) {
            Some(j) => j.beside = Some((tokens, start_ms, end_ms)),
            None => {
                s.pending_beside.retain(|(i, _)| id.saturating_sub(*i) < RECENT_JOBS as u64);
                s.pending_beside.push((id, (tokens, start_ms, end_ms)));
            }
        }
    }

    /// Takes `model` off the processor (a job on it failed): its work runs on the CPU from now
    /// on. Its thread does the same when the job returns; this closes the window between a
    /// job's result reaching the engine and that. A no-op when it is off already.
    pub fn take_off(&self, model: &Arc<Model>, reason: &str) {
        fail_model(self.label, &mut self.status(), key_of(model), reason);
    }

    /// Its line of `dump`'s `DEVICES` section: taken or not, and why.
    pub fn taken(&self) -> String {
        let name = self.label.name().to_lowercase();
        match &self.status().state {
            State::Off => format!("{name} not taken: the backend does not use it"),
            State::Starting => format!("{name} starting"),
            State::Serving { what } => format!("{name} taken: {what}"),
            State::Unavailable { reason } => format!("{name} not taken: {reason}"),
        }
    }

    /// This processor's section of `dump` (and `llmctl status`).
    pub fn dump(&self) -> String {
        let s = self.status();
        let (name, fallback) = (self.label.name(), self.label.fallback());
        let mut out = format!("\n{name}\n");
        match &s.state {
            State::Off => out.push_str(&format!("  state off (the backend does not use it): {fallback}\n")),
            State::Starting => out.push_str("  state starting\n"),
            State::Unavailable { reason } => out.push_str(&format!("  state unavailable: {fallback}: {reason}\n")),
            State::Serving { what } => out.push_str(&format!("  state serving\n  {what}\n")),
        }
        for m in s.models.iter().filter(|m| m.model.strong_count() > 0) {
            let what = match &m.prep {
                Prep::Preparing => "preparing".to_owned(),
                Prep::Ready { graphs, how, seconds, .. } => format!("ready: {graphs} graphs, {how} in {seconds:.2} s"),
                Prep::Failed { reason } => format!("failed, on the CPU: {reason}"),
            };
            out.push_str(&format!("  model {} {what}\n", m.name));
        }
        if matches!(s.state, State::Off) {
            return out;
        }
        out.push_str(&format!(
            "  jobs {} ({} tokens, {} sequences), busy {:.2} s",
            s.jobs,
            s.tokens,
            s.sequences,
            s.busy.as_secs_f64()
        ));
        if let Some(ns) = s.modelled_ns {
            out.push_str(&format!(
                "; modelled {name} time {:.3} s (the library's model of the chip, not measured)",
                ns as f64 / 1e9
            ));
        }
        out.push('\n');
        for l in &s.lines {
            out.push_str(&format!("  {l}\n"));
        }
        for j in &s.recent {
            let beside = j
                .beside
                .map_or(String::new(), |(t, a, b)| format!(" cpu_prefill_tokens={t} cpu_start_ms={a} cpu_end_ms={b}"));
            let request = match j.kind.requests[..] {
                [one] => one,
                _ => 0,
            };
            out.push_str(&format!(
                "  {} request={} tokens={} sequences={} start_ms={} end_ms={} ok={} modelled_ms={:.1}{beside}\n",
                self.label.job_line(),
                request,
                j.kind.tokens,
                j.kind.sequences,
                j.start_ms,
                j.end_ms,
                j.ok,
                j.modelled_ns as f64 / 1e6
            ));
        }
        out
    }
}

fn fail_model(label: Label, s: &mut Status, key: usize, reason: &str) {
    if let Some(m) = s.entry(key) {
        if !matches!(m.prep, Prep::Failed { .. }) {
            tracing::warn!(model = %m.name, %reason, "a job failed on the {}: the model's work runs on the CPU", label.name());
            m.prep = Prep::Failed { reason: reason.to_owned() };
        }
    }
}

/// A model's device set on its processor's thread.
struct Resident {
    key: usize,
    model: Weak<Model>,
    prepared: Prepared,
}

/// Marks the processor unavailable if its thread ends while serving (a panic outside a job):
/// every model's work then runs on the CPU instead of waiting for a thread that is gone.
struct ExitGuard<'a>(Label, &'a Mutex<Status>);

impl Drop for ExitGuard<'_> {
    fn drop(&mut self) {
        let mut s = lock(self.1);
        if std::thread::panicking() && matches!(s.state, State::Serving { .. } | State::Starting) {
            s.unavailable(self.0, Refusal::unexpected("its thread stopped"));
        }
    }
}

/// A processor's thread: opens the backend's devices, then serves messages until the daemon
/// drops its handle.
fn serve(label: Label, mut backend: Box<dyn Backend>, status: &Mutex<Status>, rx: Receiver<Msg>) {
    let _guard = ExitGuard(label, status);
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.open()))
        .unwrap_or_else(|p| Err(Refusal::unexpected(format!("opening it panicked: {}", panic_text(&*p)))));
    match opened {
        Ok(what) => {
            tracing::info!(%what, "{} serving", label.name());
            lock(status).state = State::Serving { what };
        }
        Err(r) => {
            lock(status).unavailable(label, r);
            return drain(label, rx);
        }
    }
    let mut resident: Vec<Resident> = Vec::new();
    loop {
        let msg = match rx.recv_timeout(IDLE_CHECK) {
            Ok(m) => Some(m),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // A dropped (evicted) model's device set goes.
        resident.retain(|r| r.model.strong_count() > 0);
        match msg {
            None => {}
            Some(Msg::Prepare { key, model }) => {
                let Some(m) = model.upgrade() else { continue };
                if resident.iter().any(|r| r.key == key) || !matches!(lock(status).state, State::Serving { .. }) {
                    continue;
                }
                let t = Instant::now();
                lock(status).preparing = true;
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.prepare(&m)));
                let mut s = lock(status);
                s.preparing = false;
                let outcome = match outcome {
                    Ok(o) => o,
                    // Preparing drives the device (graphs built, finalized, loaded): after a
                    // panic nobody knows its state, as after a job's.
                    Err(p) => {
                        s.unavailable(
                            label,
                            Refusal::unexpected(format!("preparing a model panicked: {}", panic_text(&*p))),
                        );
                        drop(s);
                        return drain(label, rx);
                    }
                };
                let entry = s.models.iter_mut().find(|e| e.key == key && e.model.ptr_eq(&model));
                match outcome {
                    Ok(prepared) => {
                        tracing::info!(model = %m.name, graphs = prepared.graphs, how = %prepared.how, "{} ready", label.name());
                        if let Some(e) = entry {
                            e.prep = Prep::Ready {
                                graphs: prepared.graphs,
                                how: prepared.how.clone(),
                                seconds: t.elapsed().as_secs_f64(),
                                takes: prepared.takes,
                            };
                        }
                        resident.push(Resident { key, model, prepared });
                    }
                    Err(reason) => {
                        tracing::warn!(model = %m.name, %reason, "{} graphs not prepared, the model's work runs on the CPU", label.name());
                        if let Some(e) = entry {
                            e.prep = Prep::Failed { reason };
                        }
                    }
                }
            }
            Some(Msg::Run { id, key, kind, job }) => {
                // A model taken off the processor since (`Processor::take_off`) lets its set go.
                {
                    let s = lock(status);
                    resident.retain(|r| {
                        r.key != key || s.models.iter().any(|m| m.key == key && matches!(m.prep, Prep::Ready { .. }))
                    });
                }
                let r = resident.iter().find(|r| r.key == key);
                let name = r.and_then(|r| r.model.upgrade()).map(|m| m.name.clone()).unwrap_or_default();
                let modelled_now = || r.and_then(|r| r.prepared.modelled.as_ref()).map(|f| f());
                let before = modelled_now();
                let (t0, start_ms) = (Instant::now(), epoch_ms());
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match r {
                    Some(r) => job(Ok(&r.prepared.devs)),
                    None => job(Err(format!("the model is not prepared on the {}", label.name()))),
                }));
                let end_ms = epoch_ms();
                let after = modelled_now();
                let lines = r.map(|r| (r.prepared.lines)(&r.prepared.devs, &name));
                let traces = r.map(|r| r.prepared.devs.take_traces()).unwrap_or_default();
                let parts = trace_records(&kind, &traces, matches!(ran, Ok(Ok(()))));
                let mut s = lock(status);
                s.jobs += 1;
                s.tokens += kind.tokens as u64;
                s.sequences += kind.sequences as u64;
                s.busy += t0.elapsed();
                let mut modelled = 0;
                if let (Some(a), Some(b)) = (before, after) {
                    modelled = b.saturating_sub(a);
                    s.modelled_ns = Some(s.modelled_ns.unwrap_or(0) + modelled);
                }
                if let Some(l) = lines {
                    s.lines = l;
                }
                if s.recent.len() == RECENT_JOBS {
                    s.recent.pop_front();
                }
                let beside =
                    s.pending_beside.iter().position(|(i, _)| *i == id).map(|at| s.pending_beside.remove(at).1);
                let ok = matches!(ran, Ok(Ok(())));
                s.recent.push_back(JobSpan { id, kind, start_ms, end_ms, ok, modelled_ns: modelled, beside, parts });
                match ran {
                    Ok(Ok(())) => {}
                    Ok(Err(reason)) if r.is_some() => {
                        fail_model(label, &mut s, key, &reason);
                        let model = r.and_then(|r| r.model.upgrade());
                        resident.retain(|r| r.key != key);
                        drop(s);
                        let said = model.and_then(|m| {
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.failed(&m, &reason)))
                                .ok()
                                .flatten()
                        });
                        if let Some(said) = said {
                            tracing::warn!(model = %name, %said, "{}", label.name());
                            let mut s = lock(status);
                            if let Some(Prep::Failed { reason }) = s.entry(key).map(|m| &mut m.prep) {
                                reason.push_str("; ");
                                reason.push_str(&said);
                            }
                        }
                    }
                    // No device set: the job was told why; nothing to take off.
                    Ok(Err(_)) => {}
                    Err(p) => {
                        let reason = format!("a job panicked: {}", panic_text(&*p));
                        s.unavailable(label, Refusal::unexpected(reason));
                        drop(s);
                        return drain(label, rx);
                    }
                }
            }
        }
    }
}

/// Answers every job with the reason there is no processor (its work runs on the CPU), until
/// the daemon drops its handle.
fn drain(label: Label, rx: Receiver<Msg>) {
    while let Ok(m) = rx.recv() {
        if let Msg::Run { job, .. } = m {
            let _ = job(Err(format!("the {} is unavailable", label.name())));
        }
    }
}
