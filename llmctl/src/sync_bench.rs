//! `llmctl sync-bench`: HeteroLLM's fast synchronisation measured on this machine. A producer
//! thread emulates a GPU/NPU kernel of a known duration (spinning until it is over, ±5% from
//! round to round) and then publishes its completion; the waiting thread — the control plane
//! — learns the duration and waits for it by
//!
//! - **predicted sleep then poll** (`llmd_engine::hetero::sync::Waiter`: sleep until the
//!   moving average's prediction less a margin and its learned oversleep, then poll the flag
//!   beside the output),
//! - a **condition variable** (the conventional blocking wait), or
//! - **sleep only** (sleep the prediction, then 50 µs at a time until done).
//!
//! Wake latency is from the producer's flag store to the waiter seeing it; CPU time is the
//! waiter thread's own (`CLOCK_THREAD_CPUTIME_ID`) per wait.

use clap::Args;
use llmd_engine::hetero::sync::{wait_sleeping, CondFlag, Flag, Predictor, Waiter};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sleep-only's step once the prediction has passed.
pub const SLEEP_STEP: Duration = Duration::from_micros(50);
/// Round-to-round spread of the emulated kernel's duration.
pub const JITTER: f64 = 0.05;

#[derive(Args, Debug)]
pub struct SyncBenchArgs {
    /// Emulated kernel durations, µs.
    #[arg(long, value_delimiter = ',', default_value = "100,200,500,1000")]
    pub waits_us: Vec<u64>,
    /// Waits measured per duration and method (after 20 to learn the duration).
    #[arg(long, default_value_t = 400)]
    pub rounds: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    Predicted,
    Condvar,
    SleepOnly,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Predicted => "predicted sleep + poll",
            Method::Condvar => "condition variable",
            Method::SleepOnly => "sleep only",
        }
    }
}

fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| Duration::new(t.tv_sec().max(0) as u64, t.tv_nsec().clamp(0, 999_999_999) as u32))
        .unwrap_or_default()
}

struct Shared {
    base: Instant,
    go: AtomicU64,
    set_ns: AtomicU64,
    flag: Flag,
    cond: CondFlag,
}

/// Latencies (µs, sorted) and CPU µs per wait.
fn measure(method: Method, wait: Duration, rounds: usize) -> (Vec<f64>, f64) {
    let warm = 20;
    let sh = Arc::new(Shared {
        base: Instant::now(),
        go: AtomicU64::new(0),
        set_ns: AtomicU64::new(0),
        flag: Flag::new(),
        cond: CondFlag::new(),
    });
    let total = (warm + rounds) as u64;
    let p = sh.clone();
    let producer = std::thread::spawn(move || {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for seq in 1..=total {
            while p.go.load(Ordering::Acquire) < seq {
                std::hint::spin_loop();
            }
            let t0 = Instant::now();
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let j = 1.0 + JITTER * (2.0 * (rng >> 11) as f64 / (1u64 << 53) as f64 - 1.0);
            let d = wait.mul_f64(j);
            while t0.elapsed() < d {
                std::hint::spin_loop();
            }
            p.set_ns.store(p.base.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match method {
                Method::Condvar => p.cond.set(seq),
                _ => p.flag.set(seq),
            }
        }
    });
    let mut pred = Predictor::new();
    let mut waiter = Waiter::new();
    let mut lat = Vec::with_capacity(rounds);
    let mut cpu = Duration::ZERO;
    for seq in 1..=total {
        let submitted = Instant::now();
        sh.go.store(seq, Ordering::Release);
        let c0 = thread_cpu();
        match method {
            Method::Predicted => {
                waiter.wait(&sh.flag, seq, submitted, pred.predict("kernel"));
            }
            Method::Condvar => sh.cond.wait(seq),
            Method::SleepOnly => {
                wait_sleeping(&sh.flag, seq, submitted, pred.predict("kernel"), SLEEP_STEP);
            }
        }
        let seen = sh.base.elapsed().as_nanos() as u64;
        let c1 = thread_cpu();
        // The producer's completion time, as an OpenCL event's end would give it.
        let done = sh.base + Duration::from_nanos(sh.set_ns.load(Ordering::Relaxed));
        pred.observe("kernel", done.saturating_duration_since(submitted));
        if seq as usize > warm {
            cpu += c1.saturating_sub(c0);
            lat.push(seen.saturating_sub(sh.set_ns.load(Ordering::Relaxed)) as f64 / 1e3);
        }
    }
    let _ = producer.join();
    lat.sort_by(f64::total_cmp);
    (lat, cpu.as_secs_f64() * 1e6 / rounds.max(1) as f64)
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(a: &SyncBenchArgs) -> Result<(), String> {
    if a.rounds == 0 || a.rounds > 1_000_000 {
        return Err("--rounds must be 1 to 1000000".into());
    }
    if a.waits_us.is_empty() || a.waits_us.iter().any(|&w| w == 0 || w > 1_000_000) {
        return Err("--waits-us must list durations of 1 to 1000000 µs".into());
    }
    let slack = std::fs::read_to_string("/proc/self/timerslack_ns").ok().and_then(|s| s.trim().parse::<u64>().ok());
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut rows = Vec::new();
    for &w in &a.waits_us {
        for m in [Method::Predicted, Method::Condvar, Method::SleepOnly] {
            let (lat, cpu) = measure(m, Duration::from_micros(w), a.rounds);
            rows.push(serde_json::json!({
                "wait_us": w, "method": m.name(),
                "p50_us": pct(&lat, 0.5), "p99_us": pct(&lat, 0.99), "max_us": pct(&lat, 1.0),
                "cpu_us_per_wait": cpu, "cpu_share": cpu / w as f64,
            }));
        }
    }
    if a.json {
        crate::out!(
            "{}",
            serde_json::json!({"labelled": "measured", "cpus": cpus, "timer_slack_ns": slack, "rounds": a.rounds, "rows": rows})
        );
        return Ok(());
    }
    crate::out!(
        "MEASURED on this machine ({cpus} CPUs, timer slack {}): {} waits per row after 20 to learn; kernel ±{:.0}%",
        slack.map(|s| format!("{} µs", s / 1000)).unwrap_or_else(|| "unknown".into()),
        a.rounds,
        JITTER * 100.0
    );
    crate::out!("| kernel µs | waiter | wake p50 µs | wake p99 µs | CPU µs per wait | CPU / wait |");
    crate::out!("|---|---|---|---|---|---|");
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        crate::out!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.0}% |",
            r["wait_us"],
            r["method"].as_str().unwrap_or(""),
            f("p50_us"),
            f("p99_us"),
            f("cpu_us_per_wait"),
            100.0 * f("cpu_share")
        );
    }
    Ok(())
}
