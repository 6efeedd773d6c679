//! Tensor element types of the GGML family: block layouts, dequantization, activation
//! quantization and the dot products that pair a weight type with its activation type.
//!
//! Layouts follow the GGUF specification (and ggml's `ggml-common.h`) byte for byte. Each weight
//! type names the activation type its dot product consumes (`vec_dot_type`), as llama.cpp does: the
//! integer weight types pair with 8-bit activations (Q8_0, Q8_1 or Q8_K), so the hot loop is an
//! integer dot product per block and one float multiply per block.

mod blocks;
pub mod edgeflow;
pub mod packed;
#[cfg(target_arch = "aarch64")]
mod packed_arm;
#[cfg(target_arch = "x86_64")]
mod packed_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use packed::int8_peak_macs_per_s;

/// The name of the packed-weight kernel this process uses.
pub fn kernel_name() -> &'static str {
    packed::Kernel::best().name()
}

pub(crate) use blocks::vec_dot_unchecked as blocks_dot;
pub use blocks::{dequantize_row, quantize_row, vec_dot};

pub use llmd_device::GgmlType;

#[cfg(test)]
mod tests;
