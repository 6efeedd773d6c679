//! The daemon's processors beside the CPU: one thread type, [`Processor`], for the NPU and the
//! GPU alike. Each owns its devices (opened on its own thread, so a library is only ever
//! called from the thread that owns it) and, per resident model, the engine's device set its
//! passes run on (`Devices`: the model's graphs prepared, its weights loaded where the backend
//! does that up front — the GPU's go up at the model's first pass); the engine
//! worker hands it jobs — closures run with that device set — and goes on with other work.
//! What differs between processors is only what they open and prepare (a [`Backend`]):
//! - `npu`: llm.npu's W8A8 linear groups on the QNN device (`backend = "npu"`, or `"auto"`
//!   with a library), or HeteroLLM's plan cutting each projection between the QNN device and
//!   the GPU (`backend = "hetero"`, whose decode steps run on it too);
//! - `gpu`: every block of a decode pass on the OpenCL device (`backend = "gpu"` or `"auto"`).
//!
//! - **Start:** never fails. A library that does not load, no device, or kernels that do not
//!   build leave the processor `unavailable` with the reason, logged once and shown in `dump`
//!   and `llmctl status`; the daemon serves on the CPU.
//! - **Models:** [`Processor::prepare`] (when a model becomes resident) has the thread prepare
//!   its device set; until that is done, and if it fails, the model's work runs on the CPU. A
//!   model's device set goes when the model is dropped (evicted).
//! - **Jobs:** [`Processor::submit`]; each job's wall-clock span, the CPU work the worker ran
//!   beside it ([`Processor::beside`]) and the device's modelled time are kept for `dump` (the
//!   last [`RECENT_JOBS`]).
//! - **Failures:** a job that fails takes its model off the processor (its work runs on the
//!   CPU from then on; other models keep it). A job — or a model's preparation — that panics
//!   leaves the device in a state nobody knows: the processor is let go, every model's work
//!   runs on the CPU.
//!
//! **Decision:** one job at a time, on one thread per processor. An NPU runs one graph at a
//! time, a prompt's chunks depend on each other through its KV cache, and a chunk (llm.npu's,
//! 256 tokens) or a decode pass is the unit at which a foreground request can take the device
//! from a background one.

pub mod gpu;
pub mod npu;
mod thread;

pub use thread::{
    epoch_ms, Backend, Job, JobKind, JobRecord, Label, LinesFn, ModelledFn, Prepared, Processor, Refusal, State, Takes,
    RECENT_JOBS,
};

use llmd_engine::Model;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// CPU jobs `dump`'s `JOBS` section keeps (the NPU's and the GPU's keep [`RECENT_JOBS`] each).
pub const RECENT_CPU_JOBS: usize = 256;

/// The daemon's processors beside the CPU, and the CPU's recent jobs.
#[derive(Clone)]
pub struct Processors {
    pub npu: Arc<Processor>,
    pub gpu: Arc<Processor>,
    cpu_jobs: Arc<Mutex<VecDeque<JobRecord>>>,
}

impl Processors {
    /// The processors the config's backend uses, each started on its thread (or off).
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self::new(npu::from_config(config), gpu::from_config(config))
    }

    pub fn new(npu: Arc<Processor>, gpu: Arc<Processor>) -> Self {
        Self { npu, gpu, cpu_jobs: Arc::default() }
    }

    /// Records a job the worker ran on the CPU (see [`JobRecord::of`]).
    pub fn record_cpu(&self, kind: &JobKind, start_ms: u64, end_ms: u64, ok: bool) {
        let mut log = self.cpu_jobs.lock().unwrap_or_else(|p| p.into_inner());
        for r in JobRecord::of("cpu", kind, start_ms, end_ms, ok) {
            if log.len() == RECENT_CPU_JOBS {
                log.pop_front();
            }
            log.push_back(r);
        }
    }

    /// Every processor's recent jobs, in the order they started.
    pub fn jobs(&self) -> Vec<JobRecord> {
        let mut all = self.npu.records();
        all.extend(self.gpu.records());
        all.extend(self.cpu_jobs.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned());
        all.sort_by_key(|r| (r.start_ms, r.end_ms));
        all
    }

    /// `dump`'s `JOBS` section: [`Self::jobs`], a line each (`llmctl dump --json` reads it).
    pub fn jobs_section(&self) -> String {
        let mut out = String::from("\nJOBS\n");
        for r in self.jobs() {
            out.push_str(&format!("  {}\n", r.line()));
        }
        out
    }

    /// Has every processor prepare `model` (a no-op where it is prepared, or off).
    pub fn prepare(&self, model: &Arc<Model>) {
        self.npu.prepare(model);
        self.gpu.prepare(model);
    }

    /// The processor that reads `model`'s prompt chunks now, and the tokens one job takes.
    pub fn prompts(&self, model: &Arc<Model>) -> Option<(&Processor, usize)> {
        [&self.npu, &self.gpu].into_iter().find_map(|p| p.prompt_tokens(model).map(|n| (&**p, n)))
    }

    /// The processor that runs `model`'s decode passes now.
    pub fn decoder(&self, model: &Arc<Model>) -> Option<&Processor> {
        [&self.npu, &self.gpu].into_iter().find(|p| p.decodes(model)).map(|p| &**p)
    }

    /// `dump`'s `DEVICES` section: each processor taken or not, and why (`llmctl status` shows
    /// it).
    pub fn devices(&self) -> String {
        format!(
            "\nDEVICES\n  {}\n  {}\n  cpu taken: what the others do not take\n  threads spawned={} by the engine since start (its lanes, workers and helpers)\n",
            self.npu.taken(),
            self.gpu.taken(),
            llmd_engine::sched::threads_spawned()
        )
    }

    /// Their sections of `dump`.
    pub fn dump(&self) -> String {
        self.devices() + &self.npu.dump() + &self.gpu.dump() + &self.jobs_section()
    }
}
