//! x86-64: AVX-512 VNNI (and AMX) and AVX2.

/// AVX-512 VNNI (and AMX) kernels over the K-quant tiles.
pub mod kpacked;
/// AVX2 kernels over the K-quant tiles.
pub mod kpacked_avx2;
/// AVX-512 VNNI and AVX2 kernels over the Q4_0/Q4_1/Q8_0 tiles.
pub mod packed;
/// AVX-512 VNNI: shadowAttn's INT8 pilot scores.
pub mod pilot;
/// AVX2 row dot products of the types without tiles.
pub mod rows;
