//! The NPU as one more processor of the daemon: one thread (`llmd-npu`) owns the QNN library,
//! its HTP backend and every resident model's finalized graphs (`llmd_engine::prefill`:
//! W8A8 linear groups; norms, RoPE and attention stay on the CPU, as in llm.npu), and runs the
//! prompt chunks the engine worker hands it while the worker goes on with other requests'
//! decode steps on the CPU.
//!
//! - **Start:** [`Npu::start`] never fails. A library that does not load, has no HTP provider of
//!   a core API we support, or whose backend does not start leaves the NPU `unavailable` with
//!   the reason, logged once and shown in `dump` / `llmctl status`; the daemon serves on the CPU.
//! - **Models:** [`Npu::prepare`] (when a model becomes resident) has the thread calibrate it,
//!   requantize its weights and load its graphs from the context cache or build and finalize
//!   them (`[npu]`: chip, chunk, cache directory). Until that is done, and if it fails, the
//!   model's prompts run on the CPU. A model's graphs go when the model is dropped (evicted).
//! - **Jobs:** [`Npu::submit`] hands the thread a closure that runs with the model's graphs
//!   (the daemon's: one prompt chunk of one session, `conversation::engine`). QNN is called
//!   from this one thread only. Each job's wall-clock span is kept for `dump` (the last
//!   [`RECENT_JOBS`]).
//!
//! **Decision:** one chunk at a time, on one thread. An NPU runs one graph at a time, a prompt's
//! chunks depend on each other through its KV cache, and a chunk is the unit at which a
//! foreground prompt can take the NPU from a background one (llm.npu's chunk, 256 tokens).

use llmd_device::Device as _;
use llmd_engine::backend::gpu::{GpuDevice, GpuOptions};
use llmd_engine::backend::npu::cache::CacheOutcome;
use llmd_engine::backend::npu::QnnDevice;
use llmd_engine::hetero::plan::{even_cut, solver_cut, HeteroPlan};
use llmd_engine::hetero::solver::Op;
use llmd_engine::model::Devices;
use llmd_engine::prefill::{self, NpuLinears, CALIBRATION_TEXT};
use llmd_engine::Model;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Jobs whose spans `dump` lists.
pub const RECENT_JOBS: usize = 64;

/// A model's HeteroLLM plan on the engine's executor: the NPU (its fp16 graphs prepared) and
/// the GPU as devices whose parts of each projection the plan (the devices' splitter) gives.
struct HeteroGraphs {
    devs: Devices,
    /// NPU graphs prepared.
    graphs: usize,
}

/// A model's llm.npu path on the engine's executor: the NPU device holding its W8A8 groups.
struct Int8Graphs {
    devs: Devices,
    /// The groups' graphs (their counters).
    groups: Arc<NpuLinears>,
}

/// A model's prepared NPU work: llm.npu's INT8 graphs or HeteroLLM's plan.
enum Prepared {
    Int8(Box<Int8Graphs>),
    Hetero(Box<HeteroGraphs>),
}

/// The `[hetero]` settings the thread needs (`backend = "hetero"`).
#[derive(Clone, Debug)]
pub struct HeteroSettings {
    pub gpu: GpuOptions,
    pub soc: llmd_engine::hetero::soc::Soc,
    pub plan: crate::config::HeteroPlan,
    pub sizes: Vec<usize>,
    pub row_align: usize,
    pub weight_bits: f64,
    /// Where each model's plan is stored (`<state_dir>/hetero`), if anywhere.
    pub plan_dir: Option<PathBuf>,
}

/// Writes `bytes` to `file` through a temporary name in its directory (made if missing).
fn write_atomically(file: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = file.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, file)
}

/// Work for the NPU thread: called with the model's graphs, or with why there are none (the
/// model was dropped, or its graphs failed); returns whether it succeeded (for `dump`).
pub type Job = Box<dyn FnOnce(Result<&Devices, String>) -> bool + Send>;

enum Msg {
    Prepare {
        key: usize,
        model: Weak<Model>,
    },
    Run {
        key: usize,
        job: Job,
    },
    /// A model's graphs failed: let them go.
    Forget {
        key: usize,
    },
}

/// What the NPU is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// `backend = "cpu"`.
    Off,
    /// The library is being opened.
    Starting,
    Serving {
        provider: String,
        library: PathBuf,
        build_id: String,
    },
    /// It cannot be used: the daemon serves on the CPU.
    Unavailable {
        reason: String,
    },
}

/// A model's graphs.
#[derive(Clone, Debug, PartialEq)]
pub enum GraphState {
    Preparing,
    Ready { graphs: usize, how: String, seconds: f64 },
    Failed { reason: String },
}

#[derive(Clone, Debug)]
struct ModelEntry {
    name: String,
    key: usize,
    model: Weak<Model>,
    graphs: GraphState,
}

/// One chunk the NPU ran (wall-clock milliseconds since the Unix epoch, so another process
/// can compare them with its own clock).
#[derive(Clone, Debug)]
pub struct JobSpan {
    pub request: u64,
    pub tokens: usize,
    pub start_ms: u64,
    pub end_ms: u64,
    pub ok: bool,
    /// The NPU time its graphs took by the library's model of the chip (the emulator's SoC
    /// model; 0 from a library that runs for real and models nothing), nanoseconds.
    pub modelled_ns: u64,
}

#[derive(Debug)]
struct Status {
    state: State,
    /// The thread is preparing a model's graphs: a job now would wait for that.
    preparing: bool,
    models: Vec<ModelEntry>,
    jobs: u64,
    tokens: u64,
    busy: Duration,
    /// The jobs' modelled NPU time (see [`JobSpan::modelled_ns`]).
    modelled_ns: u64,
    recent: VecDeque<JobSpan>,
    /// Shadow outlier execution's counters of the model that ran last.
    shadow: Option<(String, llmd_engine::prefill::ShadowStats)>,
    /// HeteroLLM's counters of the model that ran last: matmuls, of them split, NPU pieces,
    /// GPU pieces, fast-sync waits and their polling nanoseconds.
    hetero: Option<(String, [u64; 6])>,
}

/// The daemon's handle of the NPU thread (see the module doc).
pub struct Npu {
    tx: Option<Mutex<Sender<Msg>>>,
    status: Arc<Mutex<Status>>,
    chunk: usize,
    /// Prompt chunks one job prefills out of order (`[npu] ooe_chunks`).
    ooe_chunks: usize,
    soc: u32,
    /// HeteroLLM's plan (`backend = "hetero"`): decode steps run on it too.
    hetero: bool,
}

/// What the NPU thread needs from the config.
#[derive(Clone, Debug)]
pub struct Settings {
    pub library: PathBuf,
    pub soc: u32,
    pub chunk: usize,
    /// Prompt chunks one job prefills out of order (1: in order).
    pub ooe_chunks: usize,
    pub cache_dir: Option<PathBuf>,
    pub calibration: Option<PathBuf>,
    pub quant: llmd_engine::prefill::NpuQuant,
    /// HeteroLLM's partitioned execution instead of llm.npu's INT8 graphs.
    pub hetero: Option<HeteroSettings>,
}

/// The QNN library when the config names none: on Android the system's `libQnnHtp.so` (found
/// by the dynamic linker in the vendor's library paths); elsewhere llmd's emulator provider
/// beside the llmd binary.
pub fn default_library() -> PathBuf {
    if cfg!(target_os = "android") {
        return PathBuf::from("libQnnHtp.so");
    }
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("libllmd_qnn_emu.so")))
        .unwrap_or_else(|| PathBuf::from("libllmd_qnn_emu.so"))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Npu {
    /// No NPU (`backend = "cpu"`).
    pub fn off() -> Arc<Self> {
        Arc::new(Self {
            tx: None,
            status: Arc::new(Mutex::new(Status::new(State::Off))),
            chunk: 0,
            ooe_chunks: 1,
            soc: 0,
            hetero: false,
        })
    }

    /// The NPU the config asks for: off with `backend = "cpu"`, else started over `[npu]`'s
    /// library (see [`default_library`] when it names none; `llmd` puts `--qnn-lib` or
    /// `LLMD_QNN_LIB` there).
    pub fn from_config(config: &crate::config::Config) -> Arc<Self> {
        use crate::config::Backend;
        let n = &config.npu;
        let library = match (config.backend, &n.library) {
            (Backend::Npu | Backend::Hetero, l) => l.clone().unwrap_or_else(default_library),
            (Backend::Auto, Some(l)) => l.clone(),
            // Automatic placement uses a phone's NPU, not llmd's emulator of one (no faster than
            // the CPU here).
            (Backend::Auto, None) if cfg!(target_os = "android") => default_library(),
            (Backend::Auto, None) => {
                return Self::not_here(
                    "backend \"auto\" found no NPU library (off Android, set [npu] library; llmd's emulator runs with backend = \"npu\")",
                )
            }
            _ => return Self::off(),
        };
        let cache_dir = n.cache_dir.clone().or_else(|| config.residency.state_dir.as_ref().map(|d| d.join("npu")));
        let hetero = match config.backend {
            Backend::Hetero => {
                let h = &config.hetero;
                let file = h.soc_file.as_ref().and_then(|p| std::fs::read_to_string(p).ok());
                let soc = match llmd_engine::hetero::soc::find(file.as_deref(), &h.soc) {
                    Ok(s) => s,
                    Err(e) => return Self::not_here(&format!("[hetero] soc: {e}")),
                };
                let g = &config.gpu;
                Some(HeteroSettings {
                    gpu: GpuOptions {
                        library: g.library.clone(),
                        device: g.device,
                        cache_dir: g
                            .cache_dir
                            .clone()
                            .or_else(|| config.residency.state_dir.as_ref().map(|d| d.join("gpu"))),
                        ..GpuOptions::default()
                    },
                    soc,
                    plan: h.plan,
                    sizes: h.sizes.clone(),
                    row_align: h.row_align,
                    weight_bits: h.weight_bits,
                    plan_dir: config.residency.state_dir.as_ref().map(|d| d.join("hetero")),
                })
            }
            _ => None,
        };
        let chunk = match &hetero {
            Some(h) => h.sizes.iter().copied().max().unwrap_or(n.chunk),
            None => n.chunk,
        };
        // HeteroLLM's plan cuts each chunk's matmuls; only llm.npu's INT8 path runs chunks out
        // of order.
        let ooe_chunks = if hetero.is_some() { 1 } else { n.ooe_chunks.max(1) };
        Self::start(Settings {
            hetero,
            library,
            soc: n.soc,
            chunk,
            ooe_chunks,
            cache_dir,
            calibration: n.calibration.clone(),
            quant: n.quant(),
        })
    }

    /// No NPU on this system, said once at start (info: automatic placement expects it).
    fn not_here(reason: &str) -> Arc<Self> {
        tracing::info!("no NPU: prompts run on the CPU: {reason}");
        let state = State::Unavailable { reason: reason.to_string() };
        Arc::new(Self {
            tx: None,
            status: Arc::new(Mutex::new(Status::new(state))),
            chunk: 0,
            ooe_chunks: 1,
            soc: 0,
            hetero: false,
        })
    }

    /// Starts the NPU thread over `settings.library`. Never fails: see the module doc.
    pub fn start(settings: Settings) -> Arc<Self> {
        let status = Arc::new(Mutex::new(Status::new(State::Starting)));
        let (tx, rx) = std::sync::mpsc::channel();
        let (chunk, ooe_chunks, soc, hetero) =
            (settings.chunk, settings.ooe_chunks.max(1), settings.soc, settings.hetero.is_some());
        let st = status.clone();
        let spawned = std::thread::Builder::new().name("llmd-npu".into()).spawn(move || serve(settings, &st, rx));
        let tx = match spawned {
            Ok(_) => Some(Mutex::new(tx)),
            Err(e) => {
                let reason = format!("the NPU thread did not start: {e}");
                tracing::warn!("NPU unavailable, prompts run on the CPU: {reason}");
                lock(&status).state = State::Unavailable { reason };
                None
            }
        };
        Arc::new(Self { tx, status, chunk, ooe_chunks, soc, hetero })
    }

    fn status(&self) -> MutexGuard<'_, Status> {
        lock(&self.status)
    }

    /// The NPU's state.
    pub fn state(&self) -> State {
        self.status().state.clone()
    }

    /// Has the NPU thread prepare `model`'s graphs, unless it has them or is at it.
    pub fn prepare(&self, model: &Arc<Model>) {
        let Some(tx) = &self.tx else { return };
        let key = Arc::as_ptr(model) as usize;
        {
            let mut s = self.status();
            if matches!(s.state, State::Off | State::Unavailable { .. }) {
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
                graphs: GraphState::Preparing,
            });
        }
        let _ = lock(tx).send(Msg::Prepare { key, model: Arc::downgrade(model) });
    }

    /// Rows of each graph: a job's prompt tokens run in chunks of this many.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// The prompt tokens a job for `model` may take when its graphs are ready and the thread is
    /// not busy preparing another model's (up to `[npu] ooe_chunks` chunks, prefilled out of
    /// order), else None.
    pub fn ready(&self, model: &Arc<Model>) -> Option<usize> {
        let key = Arc::as_ptr(model) as usize;
        let s = self.status();
        let ready = matches!(s.state, State::Serving { .. })
            && !s.preparing
            && s.models
                .iter()
                .any(|m| m.key == key && m.model.strong_count() > 0 && matches!(m.graphs, GraphState::Ready { .. }));
        ready.then_some(self.chunk * self.ooe_chunks)
    }

    /// Whether `model`'s decode steps run on the NPU thread's plan (HeteroLLM's, ready).
    pub fn decodes(&self, model: &Arc<Model>) -> bool {
        self.hetero && self.ready(model).is_some()
    }

    /// Queues `job` (request `request`'s chunk of `tokens` prompt tokens) for `model`'s
    /// graphs. Gives the job back if the NPU thread is gone.
    pub fn submit(&self, model: &Arc<Model>, request: u64, tokens: usize, job: Job) -> Result<(), Job> {
        let Some(tx) = &self.tx else { return Err(job) };
        let key = Arc::as_ptr(model) as usize;
        let status = self.status.clone();
        let timed: Job = Box::new(move |graphs| {
            let (start, t0) = (SystemTime::now(), Instant::now());
            let ok = job(graphs);
            let mut s = lock(&status);
            s.jobs += 1;
            s.tokens += tokens as u64;
            s.busy += t0.elapsed();
            if s.recent.len() == RECENT_JOBS {
                s.recent.pop_front();
            }
            s.recent.push_back(JobSpan {
                request,
                tokens,
                start_ms: unix_ms(start),
                end_ms: unix_ms(SystemTime::now()),
                ok,
                modelled_ns: 0,
            });
            ok
        });
        lock(tx).send(Msg::Run { key, job: timed }).map_err(|e| match e.0 {
            Msg::Run { job, .. } => job,
            _ => unreachable!("a Run was sent"),
        })
    }

    /// Marks `model`'s graphs failed (a job on them failed): its prompts go back to the CPU,
    /// and the NPU thread lets the graphs go.
    pub fn fail(&self, model: &Arc<Model>, reason: &str) {
        let key = Arc::as_ptr(model) as usize;
        {
            let mut s = self.status();
            for m in s.models.iter_mut().filter(|m| m.key == key) {
                if !matches!(m.graphs, GraphState::Failed { .. }) {
                    tracing::warn!(model = %m.name, "NPU graphs failed, its prompts run on the CPU: {reason}");
                    m.graphs = GraphState::Failed { reason: reason.to_owned() };
                }
            }
        }
        if let Some(tx) = &self.tx {
            let _ = lock(tx).send(Msg::Forget { key });
        }
    }

    /// The `NPU` section of `dump` (and `llmctl status`).
    pub fn dump(&self) -> String {
        let s = self.status();
        let mut out = String::from("\nNPU\n");
        match &s.state {
            State::Off => {
                out.push_str("  state off (backend is neither \"npu\" nor \"auto\"): prompts run on the CPU\n")
            }
            State::Starting => out.push_str("  state starting\n"),
            State::Unavailable { reason } => {
                out.push_str(&format!("  state unavailable: prompts run on the CPU: {reason}\n"))
            }
            State::Serving { provider, library, build_id } => out.push_str(&format!(
                "  state serving\n  provider {provider} ({}), build {build_id:?}, chip {}, chunk {} rows\n",
                library.display(),
                self.soc,
                self.chunk
            )),
        }
        for m in s.models.iter().filter(|m| m.model.strong_count() > 0) {
            let what = match &m.graphs {
                GraphState::Preparing => "preparing".to_owned(),
                GraphState::Ready { graphs, how, seconds } => {
                    format!("ready: {graphs} graphs, {how} in {seconds:.2} s")
                }
                GraphState::Failed { reason } => format!("failed, on the CPU: {reason}"),
            };
            out.push_str(&format!("  model {} {what}\n", m.name));
        }
        if !matches!(s.state, State::Off) {
            out.push_str(&format!(
                "  jobs {} ({} tokens), busy {:.2} s; modelled NPU time {:.3} s (the library's model of the chip, not measured)\n",
                s.jobs,
                s.tokens,
                s.busy.as_secs_f64(),
                s.modelled_ns as f64 / 1e9
            ));
            if let Some((model, st)) = &s.shadow {
                out.push_str(&format!(
                    "  shadow {model}: {} of {} sites; {} of {} chunk runs found outliers ({} values); {} saturated outputs recomputed; rows {} hot, {} cold read ({} B); {} of {} B held in memory\n",
                    st.sites,
                    st.all_sites,
                    st.chunks_with_outliers,
                    st.chunks,
                    st.outlier_elements,
                    st.saturated_outputs,
                    st.hot_rows_used,
                    st.cold_rows_read,
                    st.cold_bytes_read,
                    st.resident_bytes,
                    st.total_bytes
                ));
            }
            if let Some((model, [m, split, np, gp, waits, polled])) = &s.hetero {
                out.push_str(&format!(
                    "  hetero {model}: {m} matmuls, {split} cut between the NPU and the GPU; {np} NPU pieces, {gp} GPU pieces\n  fast sync {model}: {waits} waits for the GPU, {:.1} ms polling\n",
                    *polled as f64 / 1e6
                ));
            }
            for j in &s.recent {
                out.push_str(&format!(
                    "  npu_job request={} tokens={} start_ms={} end_ms={} ok={} modelled_ms={:.1}\n",
                    j.request,
                    j.tokens,
                    j.start_ms,
                    j.end_ms,
                    j.ok,
                    j.modelled_ns as f64 / 1e6
                ));
            }
        }
        out
    }
}

impl Status {
    fn new(state: State) -> Self {
        Self {
            state,
            preparing: false,
            models: Vec::new(),
            jobs: 0,
            tokens: 0,
            busy: Duration::ZERO,
            modelled_ns: 0,
            recent: VecDeque::new(),
            shadow: None,
            hetero: None,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A model's graphs on the NPU thread.
struct Resident {
    key: usize,
    model: Weak<Model>,
    graphs: Prepared,
}

impl Prepared {
    fn count(&self) -> usize {
        match self {
            Prepared::Int8(g) => g.groups.graph_names().len(),
            Prepared::Hetero(g) => g.graphs,
        }
    }
}

/// Marks the NPU unavailable if its thread ends while serving (a panic outside a job): every
/// model's prompts then run on the CPU instead of waiting for a thread that is gone.
struct ExitGuard<'a>(&'a Mutex<Status>);

impl Drop for ExitGuard<'_> {
    fn drop(&mut self) {
        let mut s = lock(self.0);
        if std::thread::panicking() && matches!(s.state, State::Serving { .. } | State::Starting) {
            tracing::error!("the NPU thread stopped: prompts run on the CPU");
            s.state = State::Unavailable { reason: "the NPU thread stopped".into() };
            s.models.clear();
        }
    }
}

/// The NPU thread: opens the library and its backend, then serves messages until the daemon
/// drops its handle.
fn serve(settings: Settings, status: &Mutex<Status>, rx: Receiver<Msg>) {
    let _guard = ExitGuard(status);
    let unavailable = |reason: String| {
        tracing::warn!("NPU unavailable, prompts run on the CPU: {reason}");
        let mut s = lock(status);
        s.state = State::Unavailable { reason };
        s.models.clear();
    };
    let path = &settings.library;
    let device = match QnnDevice::open(path, settings.soc) {
        // HeteroLLM's graphs through the device contract: static at the plan's token counts,
        // in the NPU's graph cache.
        Ok(d) => Arc::new(match &settings.hetero {
            Some(h) => {
                // The plan's counts, and the SoC's standard sizes the solver pads pieces to.
                let mut counts = hetero_counts(h);
                counts.extend_from_slice(h.soc.sizes().all());
                d.with_token_counts(&counts).with_cache_dir(settings.cache_dir.clone()).with_profile(h.soc.clone())
            }
            None => d,
        }),
        Err(e) => return unavailable(e.to_string()),
    };
    let (provider, build_id) = (device.provider().name.clone(), device.build_id().to_owned());
    // HeteroLLM's GPU half, opened by this thread (which owns the plan's pieces on both).
    let gpu = match &settings.hetero {
        Some(h) => match GpuDevice::open(&h.gpu) {
            Ok(g) => Some(Arc::new(g)),
            Err(e) => return unavailable(format!("backend \"hetero\" needs an OpenCL device: {e}")),
        },
        None => None,
    };
    tracing::info!(provider = %provider, library = %path.display(), hetero = gpu.is_some(), "NPU serving");
    lock(status).state = State::Serving { provider, library: path.clone(), build_id };
    let mut resident: Vec<Resident> = Vec::new();
    loop {
        let msg = match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(m) => Some(m),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // A dropped (evicted) model's graphs go.
        resident.retain(|r| r.model.strong_count() > 0);
        match msg {
            None => {}
            Some(Msg::Prepare { key, model }) => {
                let Some(m) = model.upgrade() else { continue };
                if resident.iter().any(|r| r.key == key) {
                    continue;
                }
                let t = Instant::now();
                lock(status).preparing = true;
                let outcome =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match (&settings.hetero, &gpu) {
                        (Some(h), Some(g)) => prepare_hetero(&device, h, g, &m),
                        _ => prepare(&device, &settings, &m).map(|(g, how)| (Prepared::Int8(Box::new(g)), how)),
                    }))
                    .unwrap_or_else(|_| Err("preparing the graphs panicked".into()));
                let mut s = lock(status);
                s.preparing = false;
                let entry = s.models.iter_mut().find(|e| e.key == key && e.model.ptr_eq(&model));
                match outcome {
                    Ok((graphs, how)) => {
                        let n = graphs.count();
                        tracing::info!(model = %m.name, graphs = n, "NPU graphs {how}");
                        if let Some(e) = entry {
                            e.graphs = GraphState::Ready { graphs: n, how, seconds: t.elapsed().as_secs_f64() };
                        }
                        resident.push(Resident { key, model, graphs });
                    }
                    Err(reason) => {
                        tracing::warn!(model = %m.name, "NPU graphs not prepared, its prompts run on the CPU: {reason}");
                        if let Some(e) = entry {
                            e.graphs = GraphState::Failed { reason };
                        }
                    }
                }
            }
            Some(Msg::Forget { key }) => resident.retain(|r| r.key != key),
            Some(Msg::Run { key, job }) => {
                let r = resident.iter().find(|r| r.key == key && r.model.strong_count() > 0);
                // A job that panics loses only itself (its own guard reports it).
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match r.map(|r| (r, &r.graphs)) {
                    Some((r, Prepared::Int8(g))) => {
                        let l: &NpuLinears = &g.groups;
                        let before = l.stats().1;
                        job(Ok(&g.devs));
                        // The job's span is the last one recorded: give it its modelled time.
                        let modelled = l.stats().1.saturating_sub(before);
                        let name = r.model.upgrade().map(|m| m.name.clone()).unwrap_or_default();
                        let mut s = lock(status);
                        s.modelled_ns += modelled;
                        if let Some(span) = s.recent.back_mut() {
                            span.modelled_ns = modelled;
                        }
                        s.shadow = Some((name, l.shadow_stats()));
                    }
                    Some((r, Prepared::Hetero(h))) => {
                        let Some(m) = r.model.upgrade() else {
                            job(Err("the model was dropped".into()));
                            return;
                        };
                        let before = device.modelled_ns();
                        job(Ok(&h.devs));
                        // The NPU's parts' modelled time (the emulator's), as for INT8 jobs.
                        let modelled = device.modelled_ns().saturating_sub(before);
                        let (st, sync) = (&h.devs.stats, &h.devs.sync);
                        let c = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
                        let mut s = lock(status);
                        s.modelled_ns += modelled;
                        if let Some(span) = s.recent.back_mut() {
                            span.modelled_ns = modelled;
                        }
                        s.hetero = Some((
                            m.name.clone(),
                            [
                                c(&st.matmuls),
                                c(&st.split_matmuls),
                                c(&st.npu_parts),
                                c(&st.gpu_parts),
                                c(&sync.waits),
                                c(&sync.polled_ns),
                            ],
                        ));
                    }
                    None => {
                        job(Err("the model's NPU graphs are not loaded".into()));
                    }
                }));
            }
        }
    }
}

/// The token counts HeteroLLM's plan is made for: `[hetero] sizes` and one (decode).
fn hetero_counts(h: &HeteroSettings) -> Vec<usize> {
    let mut counts = h.sizes.clone();
    counts.push(1);
    counts
}

/// HeteroLLM's plan for `model`: every projection's cut for each of `[hetero] sizes` and one
/// token, the NPU's fp16 graphs prepared together through the device contract — loaded from
/// the NPU's graph cache (`cache_dir`, the same cache as the INT8 graphs', keyed by the
/// library, chip, graphs and weights) when a sound one is there, else built, finalized and
/// stored.
fn prepare_hetero(
    device: &Arc<QnnDevice>,
    h: &HeteroSettings,
    gpu: &Arc<GpuDevice>,
    model: &Arc<Model>,
) -> Result<(Prepared, String), String> {
    let counts = hetero_counts(h);
    let plan = |op: &Op| match h.plan {
        crate::config::HeteroPlan::Solver => solver_cut(&h.soc, h.weight_bits, op),
        crate::config::HeteroPlan::Even => even_cut(op, h.row_align),
    };
    let planned = HeteroPlan::new(model.transformer.projections(), &counts, &plan).map_err(|e| e.to_string())?;
    let missing: Vec<usize> =
        planned.npu_token_counts().into_iter().filter(|&m| !device.desc().static_shapes.allows(m)).collect();
    if !missing.is_empty() {
        return Err(format!(
            "the plan runs NPU graphs of {missing:?} tokens, which {} was not opened for",
            device.desc().name
        ));
    }
    let cuts = planned.to_json();
    // Every block on the host (the CPU: norms, RoPE, attention, SwiGLU, the head); each
    // projection's parts on the NPU and the GPU as the plan cuts it.
    let host = model.transformer.planner().backends().next().map(|d| d.name.clone()).unwrap_or_default();
    let devs = Devices::new(
        vec![device.clone() as Arc<dyn llmd_device::Device>, gpu.clone() as Arc<dyn llmd_device::Device>],
        Arc::new(llmd_engine::sched::Pinned { names: vec![host], pick: |_| 0 }),
    )
    .with_splitter(Arc::new(planned));
    let graphs = model.transformer.prepare_splits(&devs).map_err(|e| e.to_string())?;
    let mut how =
        format!("planned ({:?} on {}, token counts {:?}; GPU {})", h.plan, h.soc.key, counts, gpu.info().name);
    // The plan's NPU graphs were prepared in one `prepare_all` just now (a fresh set of
    // devices), which set the outcome; a plan with none prepared nothing.
    match device.last_cache_outcome() {
        _ if graphs == 0 => how.push_str(", no NPU graphs in the plan"),
        Some(CacheOutcome::Loaded) => how.push_str(", fp16 graphs loaded from the cache"),
        Some(CacheOutcome::Built { reason }) => how.push_str(&format!(", fp16 graphs built and finalized ({reason})")),
        None => how.push_str(", fp16 graphs built (no cache directory)"),
    }
    // The plan kept per model, SoC and token count, for `dump`'s readers and OEM tooling.
    if let Some(dir) = &h.plan_dir {
        let file = dir.join(format!("{}.{}.{:?}.json", model.name, h.soc.key, h.plan).to_lowercase());
        let body = serde_json::json!({"model": model.name, "soc": h.soc.key, "plan": format!("{:?}", h.plan), "token_counts": counts, "cuts": cuts});
        match write_atomically(&file, body.to_string().as_bytes()) {
            Ok(()) => how.push_str(&format!(", stored in {}", file.display())),
            Err(e) => tracing::warn!("the hetero plan was not stored in {}: {e}", file.display()),
        }
    }
    Ok((Prepared::Hetero(Box::new(HeteroGraphs { devs, graphs })), how))
}

/// Calibrates `model`, requantizes it, and loads its graphs from the cache or builds them.
fn prepare(device: &Arc<QnnDevice>, s: &Settings, model: &Model) -> Result<(Int8Graphs, String), String> {
    let text = match &s.calibration {
        Some(f) => std::fs::read_to_string(f).map_err(|e| format!("calibration text {}: {e}", f.display()))?,
        None => CALIBRATION_TEXT.to_owned(),
    };
    let tokens = model.tokenizer.encode(&text, false, false).map_err(|e| format!("calibration text: {e}"))?;
    if tokens.is_empty() {
        return Err("the calibration text has no tokens".into());
    }
    let prefill::PreparedNpu { context, groups, ids, shadow, report: p } =
        prefill::prepare(device, &model.transformer, &tokens, s.chunk, &s.quant, s.cache_dir.as_deref())
            .map_err(|e| e.to_string())?;
    let how = match &p.cache {
        CacheOutcome::Loaded => format!(
            "loaded from {}",
            p.cache_file.as_ref().map_or_else(|| "the cache".to_owned(), |f| f.display().to_string())
        ),
        CacheOutcome::Built { reason } => format!("built and finalized ({reason})"),
    };
    let mut graphs = NpuLinears::from_context(&context, groups, &ids, s.chunk).map_err(|e| e.to_string())?;
    graphs.set_shadow(shadow).map_err(|e| e.to_string())?;
    let groups = Arc::new(graphs);
    Ok((Int8Graphs { devs: prefill::devices(device.clone(), &groups), groups }, how))
}
