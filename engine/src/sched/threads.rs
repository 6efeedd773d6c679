//! A job graph run on real threads, one per processor, each taking its next job from one shared
//! [`Scheduler`].

use super::graph::{Dag, Job};
use super::order::{Policy, Scheduler, Timeline, LANES};
use llmd_device::Processor;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

/// Threads the engine has spawned since the process started (its lanes, workers and helpers):
/// `dump` shows it, so that a thread spawned per operator shows as this growing with every one.
static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`SPAWNED`] so far.
pub fn threads_spawned() -> u64 {
    SPAWNED.load(Ordering::Relaxed)
}

/// Counts `n` threads spawned.
pub(crate) fn count_spawned(n: u64) {
    SPAWNED.fetch_add(n, Ordering::Relaxed);
}

/// Runs `dag` on real threads — one per processor its subgraphs use, the NPU's being the
/// caller's own (so QNN is only ever called from the thread that owns it) — each taking its next
/// job from one shared [`Scheduler`] (profiled times `t` for the scores) and running `work(job)`;
/// returns the timeline measured. The first error stops every lane and is returned; a lane that
/// panics stops the others, and the panic goes on in the caller.
pub fn run_threads<E: Send>(
    dag: &Dag,
    policy: Policy,
    t: &(dyn Fn(Job) -> f64 + Sync),
    work: &(dyn Fn(Job) -> Result<(), E> + Sync),
) -> Result<Timeline, E> {
    /// Wakes and stops every other lane if this one unwinds (a panic in `work`), so none waits
    /// for a job that will never complete.
    struct StopOthers<'s, T>(&'s Mutex<T>, &'s Condvar, &'s AtomicBool);
    impl<T> Drop for StopOthers<'_, T> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.2.store(true, Ordering::SeqCst);
                drop(self.0.lock());
                self.1.notify_all();
            }
        }
    }
    let shared = Mutex::new((Scheduler::new(dag, policy), Vec::new(), None::<E>));
    let cv = Condvar::new();
    let stopped = AtomicBool::new(false);
    let (t0, origin) = (std::time::Instant::now(), std::time::SystemTime::now());
    let lane = |p: Processor| loop {
        let _guard = StopOthers(&shared, &cv, &stopped);
        let job = {
            let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if g.0.is_done() || g.2.is_some() || stopped.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(j) = g.0.next(p, t) {
                    break j;
                }
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        let start = t0.elapsed().as_secs_f64();
        let r = work(job);
        let end = t0.elapsed().as_secs_f64();
        let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
        match r {
            Ok(()) => {
                g.0.complete(job);
                g.1.push((job, p, start, end));
            }
            Err(e) => g.2 = Some(e),
        }
        cv.notify_all();
    };
    let used: Vec<Processor> = LANES.into_iter().filter(|p| dag.specs.iter().any(|s| s.proc == *p)).collect();
    let here = if used.contains(&Processor::Npu) { Some(Processor::Npu) } else { used.first().copied() };
    std::thread::scope(|s| {
        let lane = &lane;
        for p in used.iter().copied().filter(|p| Some(*p) != here) {
            count_spawned(1);
            s.spawn(move || lane(p));
        }
        if let Some(p) = here {
            lane(p);
        }
    });
    let (_, runs, err) = shared.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = err {
        return Err(e);
    }
    let makespan = runs.iter().map(|r: &(Job, Processor, f64, f64)| r.3).fold(0.0, f64::max);
    Ok(Timeline { runs, makespan, origin: Some(origin) })
}
