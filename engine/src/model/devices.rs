//! The devices a model's passes are placed on besides the host, and what each holds of the model
//! (weights, prepared executables, the buffers of split matmuls' parts); the executor
//! (`placed.rs`, `split.rs`) fills and reads them.

use crate::hetero::sync::FastSync;
use crate::sched::{CostModel, NoSplit, Splitter};
use llmd_device::{Bindings, Buffer, Device, Executable, Subgraph, Weight, WeightRole};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// The devices a model runs on besides the host, and what they hold of it.
pub struct Devices {
    pub list: Vec<Arc<dyn Device>>,
    pub cost: Arc<dyn CostModel>,
    /// How each projection of a pass is divided between devices ([`NoSplit`] by default).
    pub splitter: Arc<dyn Splitter>,
    /// The splitter's planned token counts, asked once ([`Splitter::planned_counts`]).
    pub(super) planned: Option<Vec<usize>>,
    /// HeteroLLM's fast synchronisation of a split matmul: the caller, its own devices' parts
    /// done, sleeps for the operator's predicted remainder, then polls the others' events.
    pub sync: FastSync,
    /// What split matmuls ran where.
    pub stats: SplitStats,
    state: Mutex<DevState>,
    pub(super) parts: Mutex<PartState>,
    /// The schedules of the chunked prefills run on these devices since last taken
    /// ([`Self::take_traces`]).
    traces: Mutex<Vec<Trace>>,
}

/// One chunked prefill's schedule as it ran: every job's lane, start and end (seconds from
/// `origin`, the wall clock when its lanes started).
#[derive(Clone, Debug)]
pub struct Trace {
    pub origin: std::time::SystemTime,
    pub runs: Vec<(crate::sched::Job, crate::sched::Processor, f64, f64)>,
}

/// Traces kept at most between two takes (a caller that never takes them loses the oldest).
const TRACES_KEPT: usize = 16;

/// Counters of the split matmuls run.
#[derive(Debug, Default)]
pub struct SplitStats {
    /// Projections run by a split.
    pub matmuls: AtomicU64,
    /// Of them, divided between more than one device.
    pub split_matmuls: AtomicU64,
    /// Linear groups run whole on a device (llm.npu's W8A8 groups on the NPU).
    pub groups: AtomicU64,
    /// Parts run on an NPU, a GPU and a CPU device.
    pub npu_parts: AtomicU64,
    pub gpu_parts: AtomicU64,
    pub cpu_parts: AtomicU64,
}

#[derive(Default)]
pub(super) struct DevState {
    /// Per (device index, subgraph): its weights on that device.
    pub(super) weights: HashMap<(usize, Subgraph), Arc<Vec<Weight>>>,
    /// Per (device index, subgraph, tokens).
    pub(super) exes: HashMap<(usize, Subgraph, usize), Executable>,
    /// Per (device index, the model's bytes): a matrix already on that device — a tied
    /// embedding and output head share their bytes and are loaded once.
    pub(super) by_bytes: HashMap<(usize, usize, usize), Weight>,
    /// Idle input and output buffers of groups placed whole on a device, per device index:
    /// taken by a group that fits them, given back after (a group's input and outputs are a
    /// prefix of each).
    pub(super) group_bufs: Vec<GroupBufs>,
}

/// A group's input and output buffers on device `dev`.
pub(super) struct GroupBufs {
    pub(super) dev: usize,
    pub(super) x: Buffer,
    pub(super) y: Buffer,
}

/// A part's place: device index, layer, role, token count it runs in, first and end row.
pub(super) type PartKey = (usize, usize, WeightRole, usize, usize, usize);

/// The executor's state for split matmuls.
#[derive(Default)]
pub(super) struct PartState {
    /// Row ranges loaded per (device index, layer, role, first row, end row).
    pub(super) weights: HashMap<(usize, usize, WeightRole, usize, usize), Weight>,
    pub(super) exes: HashMap<PartKey, Executable>,
    /// Idle input/output buffers per part shape: taken by a running part, given back after.
    pub(super) slots: HashMap<PartKey, Vec<Slot>>,
}

/// One part shape's executable and its buffers on a device, bound once.
pub(super) struct Slot {
    pub(super) key: PartKey,
    pub(super) exe: Executable,
    pub(super) bind: Bindings,
    pub(super) y: Buffer,
}

impl Devices {
    pub fn new(list: Vec<Arc<dyn Device>>, cost: Arc<dyn CostModel>) -> Self {
        Self {
            list,
            cost,
            splitter: Arc::new(NoSplit),
            planned: None,
            sync: FastSync::new(),
            stats: SplitStats::default(),
            state: Mutex::new(DevState::default()),
            parts: Mutex::new(PartState::default()),
            traces: Mutex::new(Vec::new()),
        }
    }

    /// Keeps a chunked prefill's schedule for [`Self::take_traces`].
    pub(super) fn push_trace(&self, t: Trace) {
        let mut v = self.traces.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() == TRACES_KEPT {
            v.remove(0);
        }
        v.push(t);
    }

    /// The schedules of the chunked prefills run since the last call (the daemon's job log).
    pub fn take_traces(&self) -> Vec<Trace> {
        std::mem::take(&mut *self.traces.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// These devices with `splitter` dividing the passes' projections between them.
    pub fn with_splitter(mut self, splitter: Arc<dyn Splitter>) -> Self {
        self.planned = splitter.planned_counts();
        self.splitter = splitter;
        self
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, DevState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_parts(&self) -> std::sync::MutexGuard<'_, PartState> {
        self.parts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Device `d` (index in the placement's list, ≥ 1) holds `weights` of subgraph `sg`,
    /// loaded by the caller: weights made with what only the whole model gives (the NPU's W8A8
    /// groups, quantized with the model's calibration: `QnnDevice::group_weights`).
    pub fn hold(&self, d: usize, sg: Subgraph, weights: Vec<Weight>) {
        self.lock().weights.insert((d, sg), Arc::new(weights));
    }

    /// The token counts of the part buffers device `d` (index in the placement's list, ≥ 1)
    /// keeps idle now (after a pass: the counts kept).
    pub fn kept_part_counts(&self, d: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.lock_parts().slots.keys().filter(|k| k.0 == d).map(|k| k.3).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}
