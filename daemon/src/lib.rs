//! llmd's service side: configuration, permissions, sessions, the work queue and engine
//! worker, the `ILlmService` Binder object. The command line, `llmctl`, is its own crate.

#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod models;
pub mod permission;
pub mod policy;
pub mod residency;
pub mod scheduler;
pub mod service;
pub mod session;

/// The Binder-over-socket endpoint at `path`, with the android-13+ wire (needed for callbacks
/// on their own connections). Server and clients use the same: `llmctl::client::socket_uri`
/// must stay equal to this one.
pub fn socket_uri(path: &std::path::Path) -> rsbinder::Uri {
    rsbinder::Uri::from(rsbinder::Endpoint::unix(path))
        .with_wire(rsbinder::entry::WireProfile::Android13Plus(rsbinder::entry::WireVersion::MAX))
}
