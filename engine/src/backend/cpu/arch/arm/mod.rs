//! aarch64: NEON with the dot-product extension.

/// NEON `sdot` kernels over the K-quant tiles.
pub mod kpacked;
/// NEON `sdot` kernels over the Q4_0/Q4_1/Q8_0 tiles.
pub mod packed;
