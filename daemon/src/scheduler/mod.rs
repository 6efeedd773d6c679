//! The scheduler: which request runs when, and how its output gets back to its client.
//!
//! - [`admission`]: the books of requests in flight, the token quota and the calls into
//!   [`crate::policy::admit`] (a Binder thread admits a request before it is queued).
//! - [`worker`]: the engine thread — starts admitted requests, runs passes planned by
//!   [`crate::policy::Policy`] (batched forward per model), ends every request exactly once.
//!   It reaches models and sessions only through its [`Engine`] trait.
//! - [`outbox`]: each request's callbacks, sent in order by a thread of its own, through a
//!   [`Sink`] (the client's `IGenerationCallback`).
//!
//! Inside: `admission` and `outbox` know nothing of each other or of the worker; the worker
//! uses both; this file holds what they share ([`Job`]) and the handle Binder threads use
//! ([`Scheduler`]). Outside: the scheduler depends only on `policy` and `error` (and the
//! engine's data types), never on sessions, the service or the shared state — those are
//! above it (see the crate's doc comment).

pub mod admission;
mod job;
pub mod outbox;
pub mod worker;

pub use admission::{Admission, Admitted, JobInfo, QueueReport, Ticket};
pub use job::Job;
pub use outbox::{CallbackSink, Delivery, Outbox, Sink, MAX_UNSENT};
pub use worker::{Engine, Fed, Worker};

use crate::policy::PolicyConfig;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What Binder threads hold of the scheduler: the admission books and the worker's queue.
pub struct Scheduler<T> {
    pub admission: Arc<Admission>,
    queue: Mutex<Sender<Job<T>>>,
}

impl<T: Send + 'static> Scheduler<T> {
    /// Starts the engine worker thread (`llmd-engine`) over `engine`; it runs until the
    /// scheduler is dropped. `stream_interval` paces `onTokens`; a request whose client leaves
    /// a callback untaken for `stall_timeout` is ended (zero: never).
    pub fn start<E>(
        admission: Arc<Admission>,
        engine: E,
        policy: PolicyConfig,
        stream_interval: Duration,
        stall_timeout: Duration,
    ) -> std::io::Result<Self>
    where
        E: Engine<Turn = T> + Send + 'static,
        E::Seq: Send,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = Worker::new(rx, admission.clone(), engine, policy)
            .with_stream_interval(stream_interval)
            .with_stall_timeout(stall_timeout);
        std::thread::Builder::new().name("llmd-engine".into()).spawn(move || worker.run())?;
        Ok(Self { admission, queue: Mutex::new(tx) })
    }

    /// Hands an admitted job to the worker; gives it back if the worker has stopped.
    pub fn queue(&self, job: Job<T>) -> Result<(), Box<Job<T>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).send(job).map_err(|e| Box::new(e.0))
    }
}
