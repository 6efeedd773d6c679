//! HeteroLLM (Chen et al., arXiv 2501.14794): one matmul cut across the NPU and the GPU,
//! fast synchronisation between them, a solver that picks each cut, and a SoC simulator
//! that drives the same solver to tell how a phone should run a model.
//!
//! - [`partition`]: the cuts (row, sequence, multi-sequence, hybrid) as rectangles of one
//!   output buffer;
//! - [`plan`]: a model's cuts for a set of token counts, the scheduler's `Splitter` (the
//!   executor, `model/split.rs`, runs them through the device contract);
//! - [`soc`]: SoC profiles (`engine/data/socs.toml`) and the cost of a matmul on each processor;
//! - [`solver`]: the paper's objective, per matmul;
//! - [`sim`]: a whole prefill and decode on a modelled SoC — HeteroLLM's strategies;
//! - [`int8`]: llm.npu's INT8 chunked prefill on a modelled SoC, out of order;
//! - [`choose`]: a model's plan on a SoC — INT8 chunked or fp16 partitioned prefill, the
//!   decode placement — and how the choice moves with each assumed figure;
//! - [`sync`]: the predicted-sleep-then-poll waiter and the fixed buffer pool.

pub mod choose;
pub mod int8;
pub mod partition;
pub mod plan;
pub mod profiler;
pub mod sim;
pub mod soc;
pub mod solver;
pub mod sync;
