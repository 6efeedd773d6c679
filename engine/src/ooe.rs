//! llm.npu's out-of-order subgraph execution (§3.6): a prompt's chunks × each chunk's
//! subgraphs as a dependency graph, and the online heuristic that picks, whenever a processor
//! is idle, which ready subgraph it runs next. The same [`Scheduler`] drives the discrete-event
//! simulation here ([`simulate`], fed modelled durations) and a run on real threads
//! ([`run_threads`], fed the work itself).
//!
//! - **Graph** ([`Dag`]): subgraph `j` of chunk `i` waits for its predecessors in the same chunk
//!   (Eq. 3: the previous subgraph; a shadow subgraph and the NPU subgraph beside it share a
//!   predecessor and both precede the next one), and a subgraph that reads or appends the KV
//!   cache waits for the same subgraph of the previous chunk (Eq. 2; transitively, of every
//!   earlier chunk). One subgraph per processor at a time (Eq. 4).
//! - **Score** (Eq. 6): a CPU subgraph scores the total profiled time of the NPU subgraphs its
//!   completion makes ready (decision: "ready" counts only successors whose other
//!   predecessors have completed — running ones do not count); an NPU subgraph scores minus its
//!   own time. Decision (the digest's reading): the argmax is per processor, over the ready
//!   subgraphs assigned to the idle one; ties go to the lower chunk, then the earlier subgraph.
//! - **In order** ([`Policy::InOrder`]), the baseline: each processor runs its subgraphs in
//!   chunk-major model order and waits for the next one to be ready — the naive overlap whose
//!   NPU bubbles llm.npu measures at 37%.

use std::sync::{Condvar, Mutex};

/// A processor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proc {
    Npu,
    Cpu,
}

/// One subgraph of a chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub name: String,
    pub proc: Proc,
    /// Reads or appends the KV cache: waits for the same subgraph of the previous chunk.
    pub kv: bool,
    /// Same-chunk predecessors (indices of earlier subgraphs).
    pub after: Vec<usize>,
}

/// Chunks × subgraphs.
#[derive(Clone, Debug, PartialEq)]
pub struct Dag {
    pub chunks: usize,
    pub specs: Vec<Spec>,
}

/// Subgraph `sg` of chunk `chunk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Job {
    pub chunk: usize,
    pub sg: usize,
}

impl Dag {
    /// A chain of `specs` (each after the one before it), `chunks` times.
    pub fn chain(chunks: usize, specs: Vec<(String, Proc, bool)>) -> Self {
        let specs = specs
            .into_iter()
            .enumerate()
            .map(|(j, (name, proc, kv))| Spec { name, proc, kv, after: if j == 0 { vec![] } else { vec![j - 1] } })
            .collect();
        Self { chunks, specs }
    }

    /// The jobs `j` waits for.
    pub fn deps(&self, j: Job) -> Vec<Job> {
        let s = &self.specs[j.sg];
        let mut d: Vec<Job> = s.after.iter().map(|&p| Job { chunk: j.chunk, sg: p }).collect();
        if s.kv && j.chunk > 0 {
            d.push(Job { chunk: j.chunk - 1, sg: j.sg });
        }
        d
    }

    /// The jobs that wait for `j`.
    pub fn succs(&self, j: Job) -> Vec<Job> {
        let mut out: Vec<Job> = (0..self.specs.len())
            .filter(|&s| self.specs[s].after.contains(&j.sg))
            .map(|s| Job { chunk: j.chunk, sg: s })
            .collect();
        if self.specs[j.sg].kv && j.chunk + 1 < self.chunks {
            out.push(Job { chunk: j.chunk + 1, sg: j.sg });
        }
        out
    }

    pub fn jobs(&self) -> usize {
        self.chunks * self.specs.len()
    }

    /// Every job in chunk-major model order.
    pub fn in_model_order(&self) -> impl Iterator<Item = Job> + '_ {
        (0..self.chunks).flat_map(move |chunk| (0..self.specs.len()).map(move |sg| Job { chunk, sg }))
    }
}

/// How the scheduler picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// llm.npu's contribution score, per processor.
    OutOfOrder,
    /// Each processor in chunk-major model order, waiting for its next subgraph.
    InOrder,
    /// Any ready subgraph, picked pseudo-randomly from this seed: a legal schedule of its own
    /// (tests run many, to show that every legal order gives the same result).
    Random(u64),
}

/// Which subgraphs are ready, issued and done, and the pick.
pub struct Scheduler<'a> {
    dag: &'a Dag,
    policy: Policy,
    /// Unfinished dependencies per job (chunk-major index).
    waiting: Vec<usize>,
    issued: Vec<bool>,
    done: Vec<bool>,
    finished: usize,
    /// InOrder: each processor's next position in model order.
    cursor: [usize; 2],
    /// Random: the generator's state.
    rng: u64,
}

fn pi(p: Proc) -> usize {
    match p {
        Proc::Npu => 0,
        Proc::Cpu => 1,
    }
}

impl<'a> Scheduler<'a> {
    pub fn new(dag: &'a Dag, policy: Policy) -> Self {
        let n = dag.jobs();
        let mut waiting = vec![0; n];
        for j in dag.in_model_order() {
            waiting[Self::ix(dag, j)] = dag.deps(j).len();
        }
        let rng = match policy {
            Policy::Random(seed) => seed ^ 0x9E37_79B9_7F4A_7C15,
            _ => 0,
        };
        Self { dag, policy, waiting, issued: vec![false; n], done: vec![false; n], finished: 0, cursor: [0, 0], rng }
    }

    fn ix(dag: &Dag, j: Job) -> usize {
        j.chunk * dag.specs.len() + j.sg
    }

    fn job(&self, i: usize) -> Job {
        Job { chunk: i / self.dag.specs.len(), sg: i % self.dag.specs.len() }
    }

    /// Whether every job has completed.
    pub fn is_done(&self) -> bool {
        self.finished == self.dag.jobs()
    }

    /// Ready, unissued jobs for `p`.
    pub fn ready(&self, p: Proc) -> Vec<Job> {
        (0..self.dag.jobs())
            .filter(|&i| !self.issued[i] && self.waiting[i] == 0)
            .map(|i| self.job(i))
            .filter(|j| self.dag.specs[j.sg].proc == p)
            .collect()
    }

    /// llm.npu's score of `j` (Eq. 6) under profiled times `t`.
    pub fn score(&self, j: Job, t: &dyn Fn(Job) -> f64) -> f64 {
        match self.dag.specs[j.sg].proc {
            Proc::Npu => -t(j),
            Proc::Cpu => self
                .dag
                .succs(j)
                .into_iter()
                .filter(|s| self.dag.specs[s.sg].proc == Proc::Npu && self.waiting[Self::ix(self.dag, *s)] == 1)
                .map(t)
                .sum(),
        }
    }

    /// The job idle processor `p` starts now, if any (marked issued).
    pub fn next(&mut self, p: Proc, t: &dyn Fn(Job) -> f64) -> Option<Job> {
        let pick = match self.policy {
            Policy::OutOfOrder => {
                let mut best: Option<(f64, Job)> = None;
                for j in self.ready(p) {
                    let s = self.score(j, t);
                    // Ready jobs come in chunk-major order: a strictly better score wins, so
                    // ties keep the lower chunk, then the earlier subgraph.
                    if best.is_none_or(|(bs, _)| s > bs) {
                        best = Some((s, j));
                    }
                }
                best.map(|b| b.1)
            }
            Policy::Random(_) => {
                let r = self.ready(p);
                self.rng = self.rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (!r.is_empty()).then(|| r[(self.rng >> 33) as usize % r.len()])
            }
            Policy::InOrder => {
                let c = &mut self.cursor[pi(p)];
                while *c < self.dag.jobs() && self.dag.specs[*c % self.dag.specs.len()].proc != p {
                    *c += 1;
                }
                (*c < self.dag.jobs() && self.waiting[*c] == 0)
                    .then(|| {
                        let j = *c;
                        *c += 1;
                        j
                    })
                    .map(|i| self.job(i))
            }
        }?;
        self.issued[Self::ix(self.dag, pick)] = true;
        Some(pick)
    }

    /// Marks `j` complete, releasing what waited for it.
    pub fn complete(&mut self, j: Job) {
        let i = Self::ix(self.dag, j);
        if std::mem::replace(&mut self.done[i], true) {
            return;
        }
        self.finished += 1;
        for s in self.dag.succs(j) {
            let k = Self::ix(self.dag, s);
            self.waiting[k] = self.waiting[k].saturating_sub(1);
        }
    }
}

/// What a simulated or real run did.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Every job with its processor, start and end (seconds from the start).
    pub runs: Vec<(Job, Proc, f64, f64)>,
    pub makespan: f64,
}

impl Timeline {
    /// Time processor `p` was busy.
    pub fn busy(&self, p: Proc) -> f64 {
        self.runs.iter().filter(|r| r.1 == p).map(|r| r.3 - r.2).sum()
    }

    /// llm.npu's bubble rate: the share of the makespan the NPU sat idle.
    pub fn npu_bubble(&self) -> f64 {
        if self.makespan > 0.0 {
            1.0 - self.busy(Proc::Npu) / self.makespan
        } else {
            0.0
        }
    }

    /// Each processor's jobs in the order it ran them.
    pub fn order(&self, p: Proc) -> Vec<Job> {
        let mut r: Vec<_> = self.runs.iter().filter(|r| r.1 == p).collect();
        r.sort_by(|a, b| a.2.total_cmp(&b.2));
        r.into_iter().map(|r| r.0).collect()
    }
}

/// A discrete-event run of `dag` under `policy`, each job taking `t(job)` seconds, one NPU and
/// one CPU (the CPU's pool counts as one processor: its subgraphs use every core).
pub fn simulate(dag: &Dag, policy: Policy, t: &dyn Fn(Job) -> f64) -> Timeline {
    let mut s = Scheduler::new(dag, policy);
    let mut now = 0.0f64;
    let mut running: [Option<(Job, f64, f64)>; 2] = [None, None];
    let mut runs = Vec::with_capacity(dag.jobs());
    while !s.is_done() {
        for p in [Proc::Npu, Proc::Cpu] {
            if running[pi(p)].is_none() {
                if let Some(j) = s.next(p, t) {
                    running[pi(p)] = Some((j, now, now + t(j).max(0.0)));
                }
            }
        }
        // The earliest completion (the NPU's first on a tie).
        let Some((p, (j, start, end))) = [Proc::Npu, Proc::Cpu]
            .into_iter()
            .filter_map(|p| running[pi(p)].map(|r| (p, r)))
            .min_by(|a, b| a.1 .2.total_cmp(&b.1 .2))
        else {
            break; // nothing runs and nothing is ready: a cycle (not a DAG)
        };
        now = end;
        running[pi(p)] = None;
        s.complete(j);
        runs.push((j, p, start, end));
    }
    Timeline { runs, makespan: now }
}

/// The best makespan over every schedule a non-idling dispatcher could produce (exhaustive
/// search: for small graphs, to measure the heuristic's gap to the optimum).
pub fn optimum(dag: &Dag, t: &dyn Fn(Job) -> f64) -> f64 {
    #[allow(clippy::too_many_arguments)]
    fn go(
        dag: &Dag,
        t: &dyn Fn(Job) -> f64,
        waiting: &mut Vec<usize>,
        started: &mut Vec<bool>,
        running: [Option<(usize, f64)>; 2],
        now: f64,
        left: usize,
        best: &mut f64,
    ) {
        if left == 0 {
            *best = best.min(now);
            return;
        }
        if now >= *best {
            return;
        }
        let n = dag.specs.len();
        // Choices for each idle processor: any ready job of its kind, or (only if nothing is
        // ready for it) nothing.
        let ready = |p: Proc, waiting: &Vec<usize>, started: &Vec<bool>| -> Vec<usize> {
            (0..waiting.len()).filter(|&i| !started[i] && waiting[i] == 0 && dag.specs[i % n].proc == p).collect()
        };
        for (slot, p) in [(0usize, Proc::Npu), (1, Proc::Cpu)] {
            if running[slot].is_none() {
                let r = ready(p, waiting, started);
                if !r.is_empty() {
                    for i in r {
                        started[i] = true;
                        let mut run2 = running;
                        run2[slot] = Some((i, now + t(Job { chunk: i / n, sg: i % n })));
                        go(dag, t, waiting, started, run2, now, left, best);
                        started[i] = false;
                    }
                    return;
                }
            }
        }
        // Both busy or nothing startable: advance to the next completion.
        let Some(slot) = (0..2).filter(|&s| running[s].is_some()).min_by(|&a, &b| {
            running[a].map_or(f64::INFINITY, |r| r.1).total_cmp(&running[b].map_or(f64::INFINITY, |r| r.1))
        }) else {
            return;
        };
        let (i, end) = running[slot].expect("running");
        let job = Job { chunk: i / n, sg: i % n };
        let succ = dag.succs(job);
        for s in &succ {
            waiting[s.chunk * n + s.sg] -= 1;
        }
        let mut run2 = running;
        run2[slot] = None;
        go(dag, t, waiting, started, run2, end, left - 1, best);
        for s in &succ {
            waiting[s.chunk * n + s.sg] += 1;
        }
    }
    let mut waiting: Vec<usize> = dag.in_model_order().map(|j| dag.deps(j).len()).collect();
    let mut started = vec![false; dag.jobs()];
    let mut best = f64::INFINITY;
    go(dag, t, &mut waiting, &mut started, [None, None], 0.0, dag.jobs(), &mut best);
    best
}

/// Runs `dag` on real threads — one for the NPU's subgraphs and one for the CPU's — each
/// taking its next job from one shared [`Scheduler`] (profiled times `t` for the scores) and
/// running `work(job)`; returns the timeline measured.
pub fn run_threads<E: Send>(
    dag: &Dag,
    policy: Policy,
    t: &(dyn Fn(Job) -> f64 + Sync),
    work: &(dyn Fn(Job) -> Result<(), E> + Sync),
) -> Result<Timeline, E> {
    let shared = Mutex::new((Scheduler::new(dag, policy), Vec::new(), None::<E>));
    let cv = Condvar::new();
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        for p in [Proc::Npu, Proc::Cpu] {
            let (shared, cv) = (&shared, &cv);
            s.spawn(move || loop {
                let job = {
                    let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                    loop {
                        if g.0.is_done() || g.2.is_some() {
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
            });
        }
    });
    let (_, runs, err) = shared.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = err {
        return Err(e);
    }
    let makespan = runs.iter().map(|r: &(Job, Proc, f64, f64)| r.3).fold(0.0, f64::max);
    Ok(Timeline { runs, makespan })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llm.npu's per-layer split on the NPU path: norm (CPU), QKV (NPU), attention (CPU, KV),
    /// O + FFN (NPU) — `layers` times.
    fn model_dag(chunks: usize, layers: usize) -> Dag {
        let mut specs = Vec::new();
        for l in 0..layers {
            specs.push((format!("l{l}.norm"), Proc::Cpu, false));
            specs.push((format!("l{l}.qkv"), Proc::Npu, false));
            specs.push((format!("l{l}.attn"), Proc::Cpu, true));
            specs.push((format!("l{l}.o_ffn"), Proc::Npu, false));
        }
        Dag::chain(chunks, specs)
    }

    fn times(dag: &Dag) -> impl Fn(Job) -> f64 + '_ {
        move |j: Job| match dag.specs[j.sg].name.rsplit('.').next() {
            Some("norm") => 0.2,
            Some("qkv") => 1.0,
            Some("attn") => 0.6 + 0.4 * j.chunk as f64,
            _ => 2.0,
        }
    }

    #[test]
    fn every_run_respects_the_dependencies_and_one_job_per_processor() {
        let dag = model_dag(3, 2);
        let t = times(&dag);
        for policy in [Policy::OutOfOrder, Policy::InOrder] {
            let tl = simulate(&dag, policy, &t);
            assert_eq!(tl.runs.len(), dag.jobs());
            let end = |j: Job| tl.runs.iter().find(|r| r.0 == j).map(|r| r.3).expect("ran");
            for r in &tl.runs {
                for d in dag.deps(r.0) {
                    assert!(end(d) <= r.2 + 1e-12, "{:?} started before {:?} ended", r.0, d);
                }
            }
            for p in [Proc::Npu, Proc::Cpu] {
                let mut rs: Vec<_> = tl.runs.iter().filter(|r| r.1 == p).collect();
                rs.sort_by(|a, b| a.2.total_cmp(&b.2));
                assert!(rs.windows(2).all(|w| w[0].3 <= w[1].2 + 1e-12), "{p:?} ran two jobs at once");
            }
        }
    }

    #[test]
    fn out_of_order_beats_in_order_and_is_near_the_optimum_on_small_graphs() {
        for (chunks, layers) in [(2, 1), (3, 1), (2, 2), (3, 2)] {
            let dag = model_dag(chunks, layers);
            let t = times(&dag);
            let ooe = simulate(&dag, Policy::OutOfOrder, &t);
            let ino = simulate(&dag, Policy::InOrder, &t);
            let best = optimum(&dag, &t);
            assert!(ooe.makespan <= ino.makespan + 1e-12, "{chunks}×{layers}: {} vs {}", ooe.makespan, ino.makespan);
            assert!(best <= ooe.makespan + 1e-12);
            assert!(ooe.makespan <= best * 1.10, "{chunks}×{layers}: heuristic {} vs optimum {best}", ooe.makespan);
        }
    }

    #[test]
    fn attention_waits_for_the_previous_chunks_and_static_subgraphs_do_not() {
        let dag = model_dag(3, 1);
        assert_eq!(dag.deps(Job { chunk: 2, sg: 2 }), vec![Job { chunk: 2, sg: 1 }, Job { chunk: 1, sg: 2 }]);
        assert_eq!(dag.deps(Job { chunk: 2, sg: 1 }), vec![Job { chunk: 2, sg: 0 }]);
        // A CPU subgraph's score is the NPU time its completion makes ready.
        let s = Scheduler::new(&dag, Policy::OutOfOrder);
        let t = |_j: Job| 1.5;
        assert_eq!(s.score(Job { chunk: 0, sg: 0 }, &t), 1.5);
        assert_eq!(s.score(Job { chunk: 0, sg: 1 }, &t), -1.5);
    }

    #[test]
    fn real_threads_run_every_job_once_in_a_legal_order() {
        let dag = model_dag(3, 2);
        let t = times(&dag);
        let seen = Mutex::new(Vec::new());
        let tl = run_threads::<()>(&dag, Policy::OutOfOrder, &t, &|j| {
            let mut s = seen.lock().expect("lock");
            for d in dag.deps(j) {
                assert!(s.contains(&d), "{j:?} ran before {d:?}");
            }
            s.push(j);
            Ok(())
        })
        .expect("runs");
        assert_eq!(tl.runs.len(), dag.jobs());
        assert_eq!(seen.lock().expect("lock").len(), dag.jobs());
    }
}
