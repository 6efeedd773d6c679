//! The [`Planner`]: which [`Backend`] runs each op of the host blocks.

use super::ops::{Backend, OpDesc};
use crate::error::BackendError;
use llmd_device::DeviceDesc;
use std::sync::Arc;

/// Chooses a backend for each op, in preference order, asking each whether it supports it.
#[derive(Clone)]
pub struct Planner {
    backends: Vec<Arc<dyn Backend>>,
}

impl Planner {
    /// Backends in order of preference.
    pub fn new(backends: Vec<Arc<dyn Backend>>) -> Self {
        Self { backends }
    }

    /// A planner over the CPU backend alone with `threads` worker threads (0 = all cores).
    pub fn cpu(threads: usize) -> Self {
        Self::new(vec![Arc::new(super::cpu::CpuBackend::new(threads))])
    }

    pub fn place(&self, op: &OpDesc) -> Result<&dyn Backend, BackendError> {
        self.backends
            .iter()
            .find(|b| b.supports(op))
            .map(|b| b.as_ref())
            .ok_or_else(|| BackendError::NoBackend(format!("{op:?}")))
    }

    /// [`Backend::split_parts`] of the only backend; 1 with several (a part's ops could be
    /// placed on another backend, whose work would not split with it).
    pub fn split_parts(&self) -> usize {
        match self.backends.as_slice() {
            [only] => only.split_parts(),
            _ => 1,
        }
    }

    /// [`Backend::split`] on the only backend; false (nothing run) with several.
    pub fn split(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        match self.backends.as_slice() {
            [only] => only.split(parts, f),
            _ => false,
        }
    }

    pub fn backends(&self) -> impl Iterator<Item = &DeviceDesc> {
        self.backends.iter().map(|b| b.descriptor())
    }
}
