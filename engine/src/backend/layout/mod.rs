//! The weights' tile formats, below every processor: how a matrix is repacked at load into tiles
//! of 16 rows (`packed`: Q4_0, Q4_1, Q8_0; `kpacked`: the K-quants), the activations the integer
//! kernels consume, and the scalar reference arithmetic every kernel must equal bit for bit. The
//! CPU's kernels (`backend/cpu`), the GPU's loaders (`backend/gpu`) and the weight store
//! (`backend/weight.rs`) all read these tiles; nothing here picks instructions.

pub mod kpacked;
pub mod packed;
