//! `llmctl`, the command line for llmd: the client side of the service (connecting over a
//! Unix socket or kernel Binder, streaming a request's callbacks, Ctrl-C), the subcommands,
//! model tools (`convert`, `perplexity`) and the benchmarks.

#![forbid(unsafe_code)]

pub mod attention;
pub mod bench;
pub mod cli;
pub mod client;
pub mod gantt;
pub mod gpu;
pub mod modeltools;
pub mod npu;
pub mod npu_model;
pub mod output;
pub mod paths;
pub mod plan;
pub mod sync_bench;
