//! Events order work between the host and devices (ggml-backend's `ggml_backend_event`, a
//! GPU queue's fence): a call made `after` some events starts once they have signalled.

use crate::DeviceError;
use std::sync::{Arc, Condvar, Mutex};

/// Signalled once, with the outcome of the work it stands for; cheap to clone and wait on from
/// any thread.
#[derive(Clone)]
pub struct Event(Arc<(Mutex<Outcome>, Condvar)>);

/// Not yet signalled (None), or the work's result and when it was signalled.
type Outcome = Option<(Result<(), DeviceError>, std::time::Instant)>;

impl Default for Event {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Event").field(&self.state()).finish()
    }
}

impl Event {
    /// Not yet signalled.
    pub fn new() -> Self {
        Self(Arc::new((Mutex::new(None), Condvar::new())))
    }

    /// Already signalled with `r` (work done synchronously).
    pub fn ready(r: Result<(), DeviceError>) -> Self {
        let e = Self::new();
        e.signal(r);
        e
    }

    /// Signals the outcome; later calls are ignored (the first outcome stands).
    pub fn signal(&self, r: Result<(), DeviceError>) {
        let mut s = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            *s = Some((r, std::time::Instant::now()));
            self.0 .1.notify_all();
        }
    }

    /// The outcome, if signalled.
    pub fn state(&self) -> Option<Result<(), DeviceError>> {
        self.0 .0.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|o| o.0.clone())
    }

    /// When it was signalled (the producer finished: a runtime's completion callback), if it
    /// was.
    pub fn signalled_at(&self) -> Option<std::time::Instant> {
        self.0 .0.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|o| o.1)
    }

    /// Blocks until signalled; the work's outcome.
    pub fn wait(&self) -> Result<(), DeviceError> {
        let mut s = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((r, _)) = s.as_ref() {
                return r.clone();
            }
            s = self.0 .1.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether `other` is this event (a clone of it), not merely one in the same state: a
    /// device tells its own events, which its queue already orders, from another's.
    pub fn same(&self, other: &Event) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Waits for every event; the first failure among them, if any.
    pub fn wait_all(events: &[Event]) -> Result<(), DeviceError> {
        let mut first = Ok(());
        for e in events {
            let r = e.wait();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_event_orders_work_across_threads_and_carries_its_outcome() {
        let e = Event::new();
        assert_eq!(e.state(), None);
        let e2 = e.clone();
        let t = std::thread::spawn(move || e2.wait());
        e.signal(Ok(()));
        e.signal(Err(DeviceError::Execution { device: "x".into(), detail: "late".into() }));
        assert_eq!(t.join().ok(), Some(Ok(())), "the first outcome stands");
        let failed = Event::ready(Err(DeviceError::Execution { device: "x".into(), detail: "boom".into() }));
        assert!(Event::wait_all(&[Event::ready(Ok(())), failed]).is_err());
    }
}
