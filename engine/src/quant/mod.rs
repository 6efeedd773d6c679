//! Tensor element types of the GGML family: block layouts, dequantization, activation
//! quantization and the dot products that pair a weight type with its activation type.
//!
//! Layouts follow the GGUF specification (and ggml's `ggml-common.h`) byte for byte. Each weight
//! type names the activation type its dot product consumes (`vec_dot_type`), as llama.cpp does: the
//! integer weight types pair with 8-bit activations (Q8_0, Q8_1 or Q8_K), so the hot loop is an
//! integer dot product per block and one float multiply per block.

mod blocks;
pub mod edgeflow;

pub use blocks::{dequantize_row, quantize_row, vec_dot};
pub(crate) use blocks::{q3k_scales, vec_dot_portable};

pub use llmd_device::GgmlType;

#[cfg(test)]
mod tests;
