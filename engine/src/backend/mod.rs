//! The processor abstraction. A backend describes itself with data (which ops, which weight
//! types, static shapes or not, memory); the [`Planner`] asks before placing any work, so GPU and
//! NPU backends slot in beside the CPU without reshaping the model code.

pub mod blocks;
pub mod cpu;
pub mod device_run;
pub mod gpu;
pub mod kv;
pub mod layout;
pub mod npu;
mod ops;
mod planner;
pub mod sparse;
pub mod weight;

pub use ops::*;
pub use planner::Planner;
