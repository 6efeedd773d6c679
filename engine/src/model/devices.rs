//! The devices a model's passes are placed on besides the host, and what each holds of the model
//! (weights, prepared executables); the executor (`placed.rs`) fills and reads them.

use crate::sched::CostModel;
use llmd_device::{Device, Executable, Subgraph, Weight};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The devices a model runs on besides the host, and what they hold of it.
pub struct Devices {
    pub list: Vec<Arc<dyn Device>>,
    pub cost: Arc<dyn CostModel>,
    state: Mutex<DevState>,
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
}

impl Devices {
    pub fn new(list: Vec<Arc<dyn Device>>, cost: Arc<dyn CostModel>) -> Self {
        Self { list, cost, state: Mutex::new(DevState::default()) }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, DevState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}
