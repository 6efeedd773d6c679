//! The GPU as one more processor of the daemon (`backend = "gpu"`, `[gpu]`): one thread
//! (`llmd-gpu`) owns the OpenCL device (`llmd_engine::backend::gpu`) and, per resident model,
//! the device set its passes run on (the model's weights uploaded once, at its first decode
//! step there). The engine hands it each pass's decode steps — one batched pass over every
//! decoding session of a model — while the worker's own thread reads other apps' prompt chunks
//! on the CPU, so the two overlap; each session's KV cache is handed to the GPU at its turn's
//! first decode step and comes home when its next prompt is read on the CPU.
//!
//! - **Start:** [`Gpu::from_config`] never fails. No OpenCL library, no device, or kernels that
//!   do not build leave the GPU `unavailable` with the reason, logged once and shown in `dump` /
//!   `llmctl status`; the daemon serves on the CPU.
//! - **Jobs:** [`Gpu::submit`] hands the thread a closure run with the model's device set.
//!   Each job's wall-clock span, and that of the CPU work the worker ran beside it
//!   ([`Gpu::beside`]), are kept for `dump`.
//! - **Failures:** a job that fails (or panics) makes the GPU unavailable with the reason; the
//!   steps it held are run again on the CPU.
//!
//! **Decision:** the GPU decodes and the CPU reads prompts (`sched::DecodeOn`'s split, the
//! mission's: decode on the GPU, prefill on the NPU or CPU). A pass's decode steps all go to
//! the GPU as one batch; its prompt chunks stay on the CPU, run while the GPU works.

use crate::config::{Backend, Config, GpuMatmul};
use llmd_engine::backend::gpu::{GpuDevice, GpuError, GpuOptions, MatmulVariant, OpenClError};

use llmd_engine::model::Devices;
use llmd_engine::sched::Pinned;
use llmd_engine::Model;
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Jobs whose spans `dump` lists.
pub const RECENT_JOBS: usize = 64;

/// Work for the GPU thread: called with the model's device set, or with why there is none.
/// Returns whether it succeeded.
pub type Job = Box<dyn FnOnce(Result<&Devices, String>) -> Result<(), String> + Send>;

struct Msg {
    id: u64,
    key: usize,
    model: Weak<Model>,
    sequences: usize,
    job: Job,
}

/// What the GPU is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// `backend` is not "gpu".
    Off,
    /// The library is being opened and the kernels built.
    Starting,
    Serving {
        device: String,
        platform: String,
        program: String,
    },
    /// It cannot be used: the daemon serves on the CPU.
    Unavailable {
        reason: String,
    },
}

/// One decode pass the GPU ran, and the CPU work beside it (wall-clock milliseconds since the
/// Unix epoch, so another process can compare them with its own clock).
#[derive(Clone, Debug)]
pub struct JobSpan {
    pub id: u64,
    pub sequences: usize,
    pub start_ms: u64,
    pub end_ms: u64,
    pub ok: bool,
    /// Prompt tokens the worker read on the CPU meanwhile, and when.
    pub beside: Option<(usize, u64, u64)>,
}

#[derive(Debug)]
struct Status {
    state: State,
    jobs: u64,
    sequences: u64,
    busy: Duration,
    recent: VecDeque<JobSpan>,
    kernels: u64,
    host_waits: u64,
    bytes_up: u64,
    bytes_down: u64,
    /// Weight matrices' bytes the device reads in place in the CPU's memory, and copied
    /// (`GpuDevice::weight_bytes`, since it opened).
    weights_in_place: u64,
    weights_copied: u64,
    /// CPU work reported for a job not yet recorded (the worker hears of the job's result
    /// before the thread records its span).
    pending_beside: Vec<(u64, (usize, u64, u64))>,
    /// Models whose pass failed on the GPU (a weight type its kernels do not read, a shape they
    /// do not take): decoded on the CPU from then on, with the reason.
    failed: Vec<(usize, Weak<Model>, String, String)>,
}

/// The daemon's GPU.
pub struct Gpu {
    status: Arc<Mutex<Status>>,
    tx: Option<Mutex<Sender<Msg>>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// Milliseconds since the Unix epoch.
pub fn epoch_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn lock(s: &Mutex<Status>) -> MutexGuard<'_, Status> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}

impl Gpu {
    /// No GPU (`backend` other than "gpu").
    pub fn off() -> Self {
        Self { status: Arc::new(Mutex::new(Status::new(State::Off))), tx: None, next_id: 1.into() }
    }

    /// The GPU the config asks for: started on its thread, or off.
    pub fn from_config(config: &Config) -> Arc<Self> {
        if !matches!(config.backend, Backend::Gpu | Backend::Auto) {
            return Arc::new(Self::off());
        }
        if config.backend == Backend::Auto && config.gpu.library.is_none() && !cfg!(target_os = "android") {
            // Automatic placement is for a phone's GPU. Off Android, probing the ICD loader's
            // platforms would load whatever runtimes are installed (PoCL brings LLVM; CI's
            // accounting test saw RSS 219 MB against 151 MB accounted) to find, most likely, no
            // GPU; `[gpu] library` or backend = "gpu" asks.
            let mut s = Status::new(State::Starting);
            s.not_here(
                "backend \"auto\" looks for a GPU on Android (off Android, set [gpu] library or backend = \"gpu\")"
                    .into(),
            );
            return Arc::new(Self { status: Arc::new(Mutex::new(s)), tx: None, next_id: 1.into() });
        }
        if config.kv_cache_type == crate::config::KvCacheType::Q8 {
            // The GPU's attention reads f16 caches, and an int8 one does not move to it.
            let mut s = Status::new(State::Starting);
            let reason = "the GPU decodes from f16 KV caches; kv_cache_type is \"q8\"".to_string();
            match config.backend {
                Backend::Auto => s.not_here(reason),
                _ => s.unavailable(reason),
            }
            return Arc::new(Self { status: Arc::new(Mutex::new(s)), tx: None, next_id: 1.into() });
        }
        let g = &config.gpu;
        let opts = GpuOptions {
            library: g.library.clone(),
            device: g.device,
            cache_dir: g.cache_dir.clone().or_else(|| config.residency.state_dir.as_ref().map(|d| d.join("gpu"))),
            matmul: match g.matmul {
                GpuMatmul::Auto => MatmulVariant::Auto,
                GpuMatmul::Rows => MatmulVariant::RowPerItem,
                GpuMatmul::Groups => MatmulVariant::GroupPerRow,
            },
            fp16: g.fp16,
            gpu_only: config.backend == Backend::Auto,
        };
        Arc::new(Self::start(opts))
    }

    /// Starts the `llmd-gpu` thread, which opens the device.
    pub fn start(opts: GpuOptions) -> Self {
        let status = Arc::new(Mutex::new(Status::new(State::Starting)));
        let (tx, rx) = std::sync::mpsc::channel();
        let st = status.clone();
        let spawned = std::thread::Builder::new().name("llmd-gpu".into()).spawn(move || thread_main(opts, rx, st));
        if let Err(e) = spawned {
            lock(&status).unavailable(format!("the GPU thread did not start: {e}"));
        }
        Self { status, tx: Some(Mutex::new(tx)), next_id: 1.into() }
    }

    /// Whether decode steps can go to the GPU now.
    pub fn serving(&self) -> bool {
        matches!(lock(&self.status).state, State::Serving { .. })
    }

    /// Whether `model`'s decode steps go to the GPU: it is serving and no pass of that model
    /// failed there.
    pub fn takes(&self, model: &Arc<Model>) -> bool {
        let s = lock(&self.status);
        let key = Arc::as_ptr(model) as usize;
        matches!(s.state, State::Serving { .. })
            && !s.failed.iter().any(|(k, m, _, _)| *k == key && m.strong_count() > 0)
    }

    pub fn state(&self) -> State {
        lock(&self.status).state.clone()
    }

    /// Hands the thread a job for `model` (`sequences` decode steps); it returns at once with
    /// the job's id (None: there is no GPU thread to take it).
    pub fn submit(&self, model: &Arc<Model>, sequences: usize, job: Job) -> Option<u64> {
        let tx = self.tx.as_ref()?;
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let msg = Msg { id, key: Arc::as_ptr(model) as usize, model: Arc::downgrade(model), sequences, job };
        tx.lock().unwrap_or_else(|e| e.into_inner()).send(msg).ok()?;
        Some(id)
    }

    /// Records the CPU work the worker ran beside job `id`: `tokens` prompt tokens from
    /// `start_ms` to `end_ms`.
    pub fn beside(&self, id: u64, tokens: usize, start_ms: u64, end_ms: u64) {
        let mut s = lock(&self.status);
        match s.recent.iter_mut().find(|j| j.id == id) {
            Some(j) => j.beside = Some((tokens, start_ms, end_ms)),
            None => {
                s.pending_beside.retain(|(i, _)| id.saturating_sub(*i) < RECENT_JOBS as u64);
                s.pending_beside.push((id, (tokens, start_ms, end_ms)));
            }
        }
    }

    /// The `GPU` section of `dump`.
    pub fn dump(&self) -> String {
        let s = lock(&self.status);
        let mut out = String::from("\nGPU\n");
        match &s.state {
            State::Off => {
                out.push_str("  state off (backend is neither \"gpu\" nor \"auto\"): decode runs on the CPU\n")
            }
            State::Starting => out.push_str("  state starting\n"),
            State::Unavailable { reason } => {
                out.push_str(&format!("  state unavailable: decode runs on the CPU: {reason}\n"))
            }
            State::Serving { device, platform, program } => {
                out.push_str(&format!("  state serving\n  device {device} ({platform}); kernels {program}\n"))
            }
        }
        for (_, _, name, reason) in s.failed.iter().filter(|f| f.1.strong_count() > 0) {
            out.push_str(&format!("  model {name} failed, decoded on the CPU: {reason}\n"));
        }
        if !matches!(s.state, State::Off) {
            out.push_str(&format!(
                "  jobs {} ({} decode steps), busy {:.2} s; {} kernels, {} host waits, {} B up, {} B down\n",
                s.jobs,
                s.sequences,
                s.busy.as_secs_f64(),
                s.kernels,
                s.host_waits,
                s.bytes_up,
                s.bytes_down
            ));
            out.push_str(&format!(
                "  weights {} B read in place in the CPU's memory, {} B copied to the device\n",
                s.weights_in_place, s.weights_copied
            ));
            for j in &s.recent {
                let beside = j.beside.map_or(String::new(), |(t, a, b)| {
                    format!(" cpu_prefill_tokens={t} cpu_start_ms={a} cpu_end_ms={b}")
                });
                out.push_str(&format!(
                    "  gpu_job sequences={} start_ms={} end_ms={} ok={}{beside}\n",
                    j.sequences, j.start_ms, j.end_ms, j.ok
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
            jobs: 0,
            sequences: 0,
            busy: Duration::ZERO,
            recent: VecDeque::new(),
            kernels: 0,
            host_waits: 0,
            bytes_up: 0,
            bytes_down: 0,
            weights_in_place: 0,
            weights_copied: 0,
            pending_beside: Vec::new(),
            failed: Vec::new(),
        }
    }

    fn unavailable(&mut self, reason: String) {
        tracing::warn!(%reason, "the GPU cannot be used; decode runs on the CPU");
        self.state = State::Unavailable { reason };
    }

    /// No GPU on this system (automatic placement expects that: said at info).
    fn not_here(&mut self, reason: String) {
        tracing::info!(%reason, "no GPU: decode runs on the CPU");
        self.state = State::Unavailable { reason };
    }
}

fn thread_main(opts: GpuOptions, rx: Receiver<Msg>, status: Arc<Mutex<Status>>) {
    let opened = std::panic::catch_unwind(|| GpuDevice::open(&opts));
    let dev = match opened {
        Ok(Ok(d)) => Arc::new(d),
        Ok(Err(e))
            if opts.gpu_only && matches!(e, GpuError::NoGpu { .. } | GpuError::OpenCl(OpenClError::Load { .. })) =>
        {
            lock(&status).not_here(format!("backend \"auto\": {e}"));
            return drain(rx);
        }
        Ok(Err(e)) => {
            lock(&status).unavailable(e.to_string());
            return drain(rx);
        }
        Err(p) => {
            lock(&status).unavailable(format!("opening the GPU panicked: {}", panic_text(&*p)));
            return drain(rx);
        }
    };
    let name = llmd_device::Device::desc(&*dev).name.clone();
    {
        let i = dev.info();
        tracing::info!(device = %i.name, platform = %i.platform, "GPU serving decode");
        lock(&status).state = State::Serving {
            device: i.name.clone(),
            platform: i.platform.clone(),
            program: dev.program_origin().to_string(),
        };
    }
    // Per resident model: its device set (weights on the GPU), dropped with the model.
    let mut sets: Vec<(usize, Weak<Model>, Devices)> = Vec::new();
    while let Ok(Msg { id, key, model, sequences, job }) = rx.recv() {
        sets.retain(|(_, m, _)| m.strong_count() > 0);
        if !matches!(lock(&status).state, State::Serving { .. }) {
            let _ = job(Err("the GPU is unavailable".into()));
            continue;
        }
        if !sets.iter().any(|(k, m, _)| *k == key && m.strong_count() > 0) && model.strong_count() > 0 {
            let all_here = Pinned { names: vec![String::new(), name.clone()], pick: |_| 1 };
            let dyn_dev: Arc<dyn llmd_device::Device> = dev.clone();
            sets.push((key, model.clone(), Devices::new(vec![dyn_dev], Arc::new(all_here))));
        }
        let devs = sets.iter().find(|(k, _, _)| *k == key).map(|(_, _, d)| d);
        let before = dev.stats();
        let (t0, start_ms) = (Instant::now(), epoch_ms());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            job(devs.ok_or_else(|| "the model was dropped".to_string()))
        }));
        let panicked = r.is_err();
        let r = r.unwrap_or_else(|p| Err(format!("the GPU job panicked: {}", panic_text(&*p))));
        let after = dev.stats();
        let mut s = lock(&status);
        s.jobs += 1;
        s.sequences += sequences as u64;
        s.busy += t0.elapsed();
        s.kernels += after.kernels - before.kernels;
        s.host_waits += after.host_waits - before.host_waits;
        s.bytes_up += after.bytes_to_device - before.bytes_to_device;
        s.bytes_down += after.bytes_from_device - before.bytes_from_device;
        (s.weights_in_place, s.weights_copied) = dev.weight_bytes();
        if s.recent.len() == RECENT_JOBS {
            s.recent.pop_front();
        }
        let beside = s.pending_beside.iter().position(|(i, _)| *i == id).map(|at| s.pending_beside.remove(at).1);
        s.recent.push_back(JobSpan { id, sequences, start_ms, end_ms: epoch_ms(), ok: r.is_ok(), beside });
        match r {
            Ok(()) => {}
            // A panic leaves the device in a state nobody knows: the GPU is let go.
            Err(reason) if panicked => {
                s.unavailable(format!("a decode pass failed: {reason}"));
                sets.clear();
            }
            // A pass that failed (a weight type or shape the kernels do not take, a device
            // error): that model decodes on the CPU from now on; others keep the GPU.
            Err(reason) => {
                let name = model.upgrade().map_or_else(|| "(dropped)".to_string(), |m| m.name.clone());
                tracing::warn!(model = %name, %reason, "a decode pass failed on the GPU; the model decodes on the CPU");
                s.failed.retain(|f| f.1.strong_count() > 0);
                s.failed.push((key, model.clone(), name, reason));
                sets.retain(|(k, _, _)| *k != key);
            }
        }
    }
}

/// Answers every job with the reason there is no GPU (the engine runs those steps on the CPU).
fn drain(rx: Receiver<Msg>) {
    while let Ok(m) = rx.recv() {
        let _ = (m.job)(Err("the GPU is unavailable".into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_int8_kv_cache_keeps_decode_on_the_cpu_and_says_why() {
        let mut c = Config { backend: Backend::Gpu, ..Config::default() };
        c.kv_cache_type = crate::config::KvCacheType::Q8;
        let g = Gpu::from_config(&c);
        assert!(matches!(g.state(), State::Unavailable { reason } if reason.contains("q8")), "{:?}", g.state());
        assert!(!g.serving());
        assert!(g.dump().contains("state unavailable: decode runs on the CPU"), "{}", g.dump());
        let off = Gpu::from_config(&Config { backend: Backend::Cpu, ..Config::default() });
        assert_eq!(off.state(), State::Off);
    }

    #[test]
    fn a_model_whose_pass_fails_decodes_on_the_cpu_and_the_others_keep_the_gpu() {
        let g = Gpu::start(GpuOptions::default());
        let t = Instant::now();
        while matches!(g.state(), State::Starting) && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !g.serving() {
            let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
            assert!(!required, "LLMD_REQUIRE_OPENCL=1 and {:?}", g.state());
            return;
        }
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-qwen2.gguf");
        let load = || Arc::new(Model::load(std::path::Path::new(fixture), &Default::default()).expect("loads"));
        let (bad, good) = (load(), load());
        let (tx, rx) = std::sync::mpsc::channel();
        let job: Job = Box::new(move |_| {
            let _ = tx.send(());
            Err("a weight type the kernels do not read".into())
        });
        assert!(g.submit(&bad, 1, job).is_some());
        rx.recv_timeout(Duration::from_secs(30)).expect("the job ran");
        let t = Instant::now();
        while g.takes(&bad) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!g.takes(&bad), "the failed model still goes to the GPU");
        assert!(g.serving() && g.takes(&good), "another model keeps the GPU: {:?}", g.state());
        assert!(g.dump().contains("failed, decoded on the CPU: a weight type the kernels do not read"), "{}", g.dump());
    }
}
