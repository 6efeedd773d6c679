//! llmd's service side: configuration, permissions, sessions, the work queue and engine
//! worker, the `ILlmService` Binder object, and the `llmctl` command line.

#![forbid(unsafe_code)]

pub mod bench;
pub mod cli;
pub mod client;
pub mod coldbench;
pub mod config;
pub mod error;
pub mod loadbench;
pub mod models;
pub mod modeltools;
pub mod permission;
pub mod policy;
pub mod residency;
pub mod scheduler;
pub mod service;
pub mod session;
