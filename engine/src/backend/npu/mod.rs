//! The NPU: prompt chunks' linear layers as quantized QNN graphs, and HeteroLLM's
//! fp16 matmul pieces, run through `qnn-sys` on Qualcomm's HTP library (on a phone; on a host,
//! its x86-64 build) or on our emulator provider. This module is the engine's only importer
//! of `qnn-sys` (`tools/confined_imports.py` checks it).
//!
//! - [`device`]: [`QnnDevice`], the library and its HTP backend for one chip, opened one way
//!   for the daemon and llmctl; [`NpuContext`], a context of it.
//! - [`contract`]: `QnnDevice` as a device of the contract (`llmd_device::Device`): a
//!   projection's rows (`SubgraphKind::Linear`) as an fp16 graph per static token count, and
//!   a model's W8A8 linear groups (`SubgraphKind::Group`).
//! - [`quant`]: the W8A8 arithmetic and its reference.
//! - [`graph`]: a layer's linear groups as QNN graphs, with every shape checked first.
//! - [`linears`]: a model's groups as finalized graphs, run chunk by chunk (the `Group`
//!   executables' body), with shadow outlier execution beside them. Calibrating and quantizing a
//!   model is [`crate::prefill`] (outside `backend`: it reads the model).
//! - [`f16`]: HeteroLLM's fp16 `FullyConnected` graphs over row ranges of a matrix.
//! - [`shadow`]: llm.npu's outliers, extracted and multiplied on the CPU.
//! - [`cache`]: finalized contexts of both graph families kept on disk as QNN context
//!   binaries, keyed by what they hold, chunk size, chip and library.

pub mod cache;
pub mod contract;
pub mod device;
pub mod f16;
pub mod graph;
pub mod linears;
pub mod quant;
pub mod shadow;

pub use device::{NpuContext, QnnDevice};
