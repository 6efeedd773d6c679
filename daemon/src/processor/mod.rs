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
    epoch_ms, Backend, Job, JobKind, Label, LinesFn, ModelledFn, Prepared, Processor, Refusal, State, Takes,
    RECENT_JOBS,
};

use llmd_engine::Model;
use std::sync::Arc;

/// The daemon's processors beside the CPU.
#[derive(Clone)]
pub struct Processors {
    pub npu: Arc<Processor>,
    pub gpu: Arc<Processor>,
}

impl Processors {
    /// The processors the config's backend uses, each started on its thread (or off).
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self { npu: npu::from_config(config), gpu: gpu::from_config(config) }
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
        format!("\nDEVICES\n  {}\n  {}\n  cpu taken: what the others do not take\n", self.npu.taken(), self.gpu.taken())
    }

    /// Their sections of `dump`.
    pub fn dump(&self) -> String {
        self.devices() + &self.npu.dump() + &self.gpu.dump()
    }
}
