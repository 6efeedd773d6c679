//! A request the admission books accepted, as the worker runs it.

use super::admission::Admitted;
use super::outbox::{Outbox, Sink};
use crate::policy::Class;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// An admitted request on its way to (and in) the worker.
pub struct Job<T> {
    pub id: u64,
    pub uid: u32,
    pub session: u64,
    /// The scheduling class (the request's hint capped by its uid's).
    pub class: Class,
    /// Milliseconds from admission by which it must finish (0 = none).
    pub deadline_ms: u64,
    /// When it was admitted, on the admission clock.
    pub admitted_ms: u64,
    pub enqueued: Instant,
    /// Set to stop it (see [`Admitted::cancel`]).
    pub cancel: Arc<AtomicBool>,
    /// Its session's closed flag: a closed session's request ends as cancelled.
    pub closed: Arc<AtomicBool>,
    /// Where the worker puts the request's callbacks.
    pub outbox: Outbox,
    /// What the engine needs to run it.
    pub turn: T,
}

impl<T> Job<T> {
    /// The job of an admitted request whose callbacks go to `sink`.
    pub fn new(a: Admitted, closed: Arc<AtomicBool>, sink: Arc<dyn Sink>, turn: T) -> Self {
        Self {
            id: a.id,
            uid: a.ticket.uid,
            session: a.ticket.session,
            class: a.ticket.class,
            deadline_ms: a.ticket.deadline_ms,
            admitted_ms: a.admitted_ms,
            enqueued: a.enqueued,
            outbox: Outbox::new(sink, a.cancel.clone()),
            cancel: a.cancel,
            closed,
            turn,
        }
    }

    /// Whether it was cancelled or its session closed.
    pub fn stopped(&self) -> bool {
        self.cancel.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire)
    }
}
