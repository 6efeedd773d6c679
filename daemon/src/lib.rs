//! llmd's service side: configuration, permissions, sessions, the work queue and engine
//! worker, the `ILlmService` Binder object. The command line, `llmctl`, is its own crate.
//!
//! # The daemon's core, top to bottom
//!
//! A module uses only modules below it (`tools/module_cycles.py daemon`, run by
//! `scripts/test.sh`, finds no circle among them):
//!
//! 1. `service` — the `ILlmService`/`ILlmAdmin` Binder objects and `Daemon` (start-up); status
//!    and dump.
//! 2. `session` — the `ILlmSession` Binder object: request validation, submitting a turn
//!    (admission, a death recipient, the job queued).
//! 3. `pressure` — the memory-pressure response (shed idle KV, evict, reload, prefetch).
//! 4. `shared` — `Shared`, the state the above share: config, residency, open sessions, the
//!    scheduler handle; opening, closing (idle sessions too) and model acquisition. It knows
//!    nothing of Binder objects or pressure.
//! 5. `conversation` — a session's context (the engine's `Sequence` handle of it, its tokens and
//!    messages: the only place the handle is used) and `ModelEngine`, the scheduler's `Engine`
//!    over models.
//! 6. `scheduler` — `admission` (books, quota), `worker` (engine passes, every request's end)
//!    and `outbox` (each request's callbacks); it reaches models and sessions only through its
//!    `Engine` trait, and Binder clients through the outbox's `Sink`.
//! 7. `policy` (pure rules, clock injected), then the leaves: `error` (the one error → code
//!    map), `config`, `attention` (each resident model's shadowAttn profile and stage),
//!    `permission`, `residency`, `integrity` (model files against their
//!    fingerprints), `models`, `connections` (the socket's accept loop and its per-uid
//!    connection caps), `processor` (one thread type for the NPU and the GPU: each owns its
//!    devices and every resident model's device set, and runs the jobs the engine hands it —
//!    the NPU's prompt chunks, the GPU's decode passes; `processor::npu` and `processor::gpu`
//!    say what each opens and prepares).
//!
//! Above them all, `fuzzing` holds the fuzz targets' bodies (`fuzz/`, and the replay of their
//! corpora in `daemon/tests/fuzz_replay.rs`): parcels into the generated AIDL stubs with the
//! daemon's argument checks, and config files.
//!
//! Every Binder method guards (caller identity, permission or ownership), calls a private
//! method, and maps its error in one place (`ServiceError::into_status`).

#![forbid(unsafe_code)]

pub mod attention;
pub mod config;
pub mod connections;
pub mod conversation;
pub mod error;
pub mod fuzzing;
pub mod integrity;
pub mod models;
pub mod permission;
pub mod policy;
pub mod pressure;
pub mod processor;
pub mod residency;
pub mod scheduler;
pub mod service;
pub mod session;
pub mod shared;

pub use llmd_aidl::socket_uri;
