//! llmd's service side: for now the `llmctl` command line and what it shares with the daemon
//! that follows (the service, sessions, scheduler and residency land in later changes).

#![forbid(unsafe_code)]

pub mod cli;
