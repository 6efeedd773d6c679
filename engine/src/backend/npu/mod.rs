//! The NPU path (issue 28): prompt chunks' linear layers as quantized QNN graphs, run through
//! `qnn-sys` on Qualcomm's HTP library (on a phone; on a host, its x86-64 build) or on our
//! emulator provider.
//!
//! - [`quant`]: the W8A8 arithmetic and its reference.
//! - [`graph`]: a layer's linear groups as QNN graphs, with every shape checked first.
//! - [`crate::prefill`] (outside `backend`: it reads the model): a model's groups calibrated,
//!   quantized and built, run in place of the CPU's matmuls during prefill.
//! - [`cache`]: finalized contexts kept on disk as QNN context binaries, keyed by model,
//!   quantization, chunk size, chip and library.

pub mod cache;
pub mod graph;
pub mod quant;
pub mod shadow;
