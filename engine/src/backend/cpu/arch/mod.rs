//! The CPU kernels written for one instruction-set family each (as ggml-cpu's `arch/`): every
//! file here imports only the weights' layout (`crate::backend::layout`) and `std::arch`; the
//! dispatchers one level up (`packed.rs`, `kpacked.rs`, `rows.rs`) pick them by the features
//! `features.rs` detected.

#[cfg(target_arch = "aarch64")]
pub mod arm;
#[cfg(target_arch = "x86_64")]
pub mod x86;
