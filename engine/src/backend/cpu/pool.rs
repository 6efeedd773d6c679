//! The CPU backend's persistent worker pool: `threads - 1` workers plus the calling thread run
//! the tasks of one parallel step, taking task indices from a shared counter (dynamic load
//! balance). Dispatch is a store and a counter bump, and workers spin briefly for the next step
//! before parking, so the ~200 small steps of one decode token cost microseconds in total — a
//! general-purpose pool costs tens of microseconds per step, which is most of a small model's
//! decode time. Idle workers park on a condition variable and use no CPU.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker spins for the next step before parking.
const SPIN: Duration = Duration::from_micros(300);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

thread_local! {
    /// Set while this thread runs one part of a [`Pool::run_split`]: the steps that part
    /// starts run inline on this thread.
    static IN_SPLIT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

struct Shared {
    /// Bumped once per step; workers wait for it to change.
    epoch: AtomicU64,
    /// The current step's task function, lifetime-erased (valid while `run` waits).
    job: Mutex<Option<&'static Task<'static>>>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    /// Workers that finished the current step.
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: Mutex<usize>,
    wake: Condvar,
}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One step at a time: `run` is not reentrant across threads.
    step: Mutex<()>,
}

impl Pool {
    /// A pool that runs steps on `threads` threads in all (the caller's included).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                crate::sched::count_spawned(1);
                std::thread::Builder::new()
                    .name(format!("llmd-cpu-{i}"))
                    .spawn(move || worker(&s))
                    // Only fails if the OS refuses threads; nothing can run without them.
                    .expect("the OS must allow spawning CPU worker threads")
            })
            .collect();
        Self { shared, workers, step: Mutex::new(()) }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0) .. f(parts - 1)` at once, one part per thread (at most [`Self::threads`]
    /// parts run at a time), and returns when all have finished. Every step a part starts
    /// ([`Self::run`]) runs inline on the part's thread: the parts meet only at the end, not at
    /// each step's barrier.
    pub fn run_split(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run(parts, &|i| {
            struct Reset;
            impl Drop for Reset {
                fn drop(&mut self) {
                    IN_SPLIT.with(|c| c.set(false));
                }
            }
            IN_SPLIT.with(|c| c.set(true));
            let _reset = Reset;
            f(i)
        })
    }

    /// True on a thread that is running a part of a [`Self::run_split`].
    pub fn in_split() -> bool {
        IN_SPLIT.with(|c| c.get())
    }

    /// Runs `f(0) .. f(n_tasks - 1)` across the pool and returns when all have finished.
    /// A panic in a task is re-raised here after every thread has left the step. Inside a
    /// part of a [`Self::run_split`], the tasks run in turn on the calling thread.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 || Self::in_split() {
            (0..n_tasks).for_each(f);
            return;
        }
        let _step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: the reference is erased to 'static only for the duration of this call: it is
        // cleared below after every worker has reported `done` for this epoch, and workers
        // never touch the job after reporting, so it does not outlive `f`.
        let erased: &'static Task<'static> = unsafe { std::mem::transmute::<&Task<'_>, &'static Task<'static>>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(erased);
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        {
            let sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            if *sleepers > 0 {
                s.wake.notify_all();
            }
        }
        let caller = std::panic::catch_unwind(AssertUnwindSafe(|| take_tasks(s, f)));
        while s.done.load(Ordering::Acquire) < self.workers.len() {
            std::hint::spin_loop();
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Err(p) = caller {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU worker task panicked");
        }
    }
}

fn take_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        // Wait for a new step: spin a little, then park.
        let start = Instant::now();
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if s.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            *sleepers += 1;
            while s.epoch.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire) {
                sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
            }
            *sleepers -= 1;
        }
        seen = s.epoch.load(Ordering::Acquire);
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = job {
            if std::panic::catch_unwind(AssertUnwindSafe(|| take_tasks(s, f))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _g = self.shared.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_per_step_across_many_steps() {
        let pool = Pool::new(3);
        for n in [1usize, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50), "n={n}");
        }
    }

    #[test]
    fn split_parts_run_at_once_and_their_steps_run_inline() {
        let pool = Pool::new(2);
        let threads: Vec<Mutex<Vec<std::thread::ThreadId>>> = (0..2).map(|_| Mutex::new(Vec::new())).collect();
        let arrived = AtomicUsize::new(0);
        let together = AtomicBool::new(true);
        pool.run_split(2, &|part| {
            // Both parts run at once: each sees the other arrive (a part run after the other
            // would wait out the deadline, and the test fails rather than hangs).
            arrived.fetch_add(1, Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(10);
            while arrived.load(Ordering::SeqCst) < 2 {
                if Instant::now() > deadline {
                    together.store(false, Ordering::SeqCst);
                    break;
                }
                std::hint::spin_loop();
            }
            assert!(Pool::in_split());
            pool.run(8, &|_| threads[part].lock().expect("lock").push(std::thread::current().id()));
        });
        assert!(together.load(Ordering::SeqCst), "the two parts did not run at once");
        assert!(!Pool::in_split());
        let a = threads[0].lock().expect("lock").clone();
        let b = threads[1].lock().expect("lock").clone();
        assert_eq!((a.len(), b.len()), (8, 8));
        assert!(a.iter().all(|t| *t == a[0]) && b.iter().all(|t| *t == b[0]), "each part's tasks on its own thread");
        assert_ne!(a[0], b[0]);
        // After the split, steps use both threads again.
        let count = AtomicUsize::new(0);
        pool.run(16, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }

    #[test]
    fn workers_park_and_wake_after_idling() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(20));
        pool.run(4, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_pool_keeps_working() {
        let pool = Pool::new(2);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(16, &|i| {
                if i == 9 {
                    panic!("task 9");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(16, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }
}
