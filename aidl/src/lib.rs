//! llmd's AIDL interfaces (`aidl/com/llmd/*.aidl`), compiled to Rust by rsbinder-aidl.
//! Interface version: `ILlmService::VERSION`.

#![allow(clippy::all, non_snake_case, missing_docs)]

rsbinder::include_aidl!("llmd_aidl");

pub use com::llmd::*;
