//! What a device call can fail with.

use crate::desc::BufferUsage;

/// What a device call can fail with.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DeviceError {
    /// The device cannot do this (an op, a weight type, a shape it has no graph for).
    #[error("{device}: unsupported: {what}")]
    Unsupported { device: String, what: String },
    /// Its memory is full (or the allocation is larger than it can ever hold).
    #[error("{device}: out of memory: {bytes} bytes of {usage:?} asked")]
    OutOfMemory { device: String, usage: BufferUsage, bytes: usize },
    /// A handle of another device, or of the wrong kind, or a range past a buffer's end.
    #[error("{device}: invalid argument: {detail}")]
    Invalid { device: String, detail: String },
    /// The work itself failed on the device.
    #[error("{device}: execution failed: {detail}")]
    Execution { device: String, detail: String },
}
