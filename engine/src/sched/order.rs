//! Which ready job an idle processor runs next: llm.npu's out-of-order heuristic (§3.6, Eq. 6),
//! the in-order baseline and random legal orders; the discrete-event simulation ([`simulate`])
//! and the exhaustive optimum ([`optimum`]) the same [`Scheduler`] is measured by.
//!
//! - **Score** (Eq. 6): a CPU (or GPU) subgraph scores the total profiled time of the NPU
//!   subgraphs its completion makes ready (decision: "ready" counts only successors whose other
//!   predecessors have completed — running ones do not count); an NPU subgraph scores minus its
//!   own time. Decision (the digest's reading): the argmax is per processor, over the ready
//!   subgraphs assigned to the idle one; ties go to the lower chunk, then the earlier subgraph.
//! - **In order** ([`Policy::InOrder`]), the baseline: each processor runs its subgraphs in
//!   chunk-major model order and waits for the next one to be ready — the naive overlap whose
//!   NPU bubbles llm.npu measures at 37%. One subgraph per processor at a time (Eq. 4).

use super::graph::{Dag, Job};
use llmd_device::Processor;

/// The processors a job graph's subgraphs run on, in the order an idle one is offered work
/// (the NPU first, so it wins ties). The CPU's pool counts as one processor (its subgraphs use
/// every core), as does the GPU.
pub const LANES: [Processor; 3] = [Processor::Npu, Processor::Cpu, Processor::Gpu];

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
    cursor: [usize; 3],
    /// Random: the generator's state.
    rng: u64,
}

/// `p`'s index in [`LANES`].
pub(super) fn pi(p: Processor) -> usize {
    match p {
        Processor::Npu => 0,
        Processor::Cpu => 1,
        Processor::Gpu => 2,
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
        Self { dag, policy, waiting, issued: vec![false; n], done: vec![false; n], finished: 0, cursor: [0; 3], rng }
    }

    fn ix(dag: &Dag, j: Job) -> usize {
        j.chunk * dag.specs.len() + j.step
    }

    fn job(&self, i: usize) -> Job {
        Job { chunk: i / self.dag.specs.len(), step: i % self.dag.specs.len() }
    }

    /// Whether every job has completed.
    pub fn is_done(&self) -> bool {
        self.finished == self.dag.jobs()
    }

    /// Ready, unissued jobs for `p`.
    pub fn ready(&self, p: Processor) -> Vec<Job> {
        (0..self.dag.jobs())
            .filter(|&i| !self.issued[i] && self.waiting[i] == 0)
            .map(|i| self.job(i))
            .filter(|j| self.dag.specs[j.step].proc == p)
            .collect()
    }

    /// llm.npu's score of `j` (Eq. 6) under profiled times `t`.
    pub fn score(&self, j: Job, t: &dyn Fn(Job) -> f64) -> f64 {
        match self.dag.specs[j.step].proc {
            Processor::Npu => -t(j),
            Processor::Cpu | Processor::Gpu => self
                .dag
                .succs(j)
                .into_iter()
                .filter(|s| self.dag.specs[s.step].proc == Processor::Npu && self.waiting[Self::ix(self.dag, *s)] == 1)
                .map(t)
                .sum(),
        }
    }

    /// The job idle processor `p` starts now, if any (marked issued).
    pub fn next(&mut self, p: Processor, t: &dyn Fn(Job) -> f64) -> Option<Job> {
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
    pub runs: Vec<(Job, Processor, f64, f64)>,
    pub makespan: f64,
    /// The wall clock at the start, when it ran (None: simulated).
    pub origin: Option<std::time::SystemTime>,
}

impl Timeline {
    /// Time processor `p` was busy.
    pub fn busy(&self, p: Processor) -> f64 {
        self.runs.iter().filter(|r| r.1 == p).map(|r| r.3 - r.2).sum()
    }

    /// llm.npu's bubble rate: the share of the makespan the NPU sat idle.
    pub fn npu_bubble(&self) -> f64 {
        if self.makespan > 0.0 {
            1.0 - self.busy(Processor::Npu) / self.makespan
        } else {
            0.0
        }
    }

    /// Each processor's jobs in the order it ran them.
    pub fn order(&self, p: Processor) -> Vec<Job> {
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
    let mut running: [Option<(Job, f64, f64)>; 3] = [None; 3];
    let mut runs = Vec::with_capacity(dag.jobs());
    while !s.is_done() {
        for p in LANES {
            if running[pi(p)].is_none() {
                if let Some(j) = s.next(p, t) {
                    running[pi(p)] = Some((j, now, now + t(j).max(0.0)));
                }
            }
        }
        // The earliest completion (the NPU's first on a tie).
        let Some((p, (j, start, end))) =
            LANES.into_iter().filter_map(|p| running[pi(p)].map(|r| (p, r))).min_by(|a, b| a.1 .2.total_cmp(&b.1 .2))
        else {
            break; // nothing runs and nothing is ready: a cycle (not a DAG)
        };
        now = end;
        running[pi(p)] = None;
        s.complete(j);
        runs.push((j, p, start, end));
    }
    Timeline { runs, makespan: now, origin: None }
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
        running: [Option<(usize, f64)>; 3],
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
        let ready = |p: Processor, waiting: &Vec<usize>, started: &Vec<bool>| -> Vec<usize> {
            (0..waiting.len()).filter(|&i| !started[i] && waiting[i] == 0 && dag.specs[i % n].proc == p).collect()
        };
        for (slot, p) in LANES.into_iter().enumerate() {
            if running[slot].is_none() {
                let r = ready(p, waiting, started);
                if !r.is_empty() {
                    for i in r {
                        started[i] = true;
                        let mut run2 = running;
                        run2[slot] = Some((i, now + t(Job { chunk: i / n, step: i % n })));
                        go(dag, t, waiting, started, run2, now, left, best);
                        started[i] = false;
                    }
                    return;
                }
            }
        }
        // Both busy or nothing startable: advance to the next completion.
        let Some(slot) = (0..3).filter(|&s| running[s].is_some()).min_by(|&a, &b| {
            running[a].map_or(f64::INFINITY, |r| r.1).total_cmp(&running[b].map_or(f64::INFINITY, |r| r.1))
        }) else {
            return;
        };
        let (i, end) = running[slot].expect("running");
        let job = Job { chunk: i / n, step: i % n };
        let succ = dag.succs(job);
        for s in &succ {
            waiting[s.chunk * n + s.step] -= 1;
        }
        let mut run2 = running;
        run2[slot] = None;
        go(dag, t, waiting, started, run2, end, left - 1, best);
        for s in &succ {
            waiting[s.chunk * n + s.step] += 1;
        }
    }
    let mut waiting: Vec<usize> = dag.in_model_order().map(|j| dag.deps(j).len()).collect();
    let mut started = vec![false; dag.jobs()];
    let mut best = f64::INFINITY;
    go(dag, t, &mut waiting, &mut started, [None; 3], 0.0, dag.jobs(), &mut best);
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::run_threads;
    use std::sync::Mutex;

    /// llm.npu's per-layer split on the NPU path: norm (CPU), QKV (NPU), attention (CPU, KV),
    /// O + FFN (NPU) — `layers` times.
    fn model_dag(chunks: usize, layers: usize) -> Dag {
        let mut specs = Vec::new();
        for l in 0..layers {
            specs.push((format!("l{l}.norm"), Processor::Cpu, false));
            specs.push((format!("l{l}.qkv"), Processor::Npu, false));
            specs.push((format!("l{l}.attn"), Processor::Cpu, true));
            specs.push((format!("l{l}.o_ffn"), Processor::Npu, false));
        }
        Dag::chain(chunks, specs)
    }

    fn times(dag: &Dag) -> impl Fn(Job) -> f64 + '_ {
        move |j: Job| match dag.specs[j.step].name.rsplit('.').next() {
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
            for p in [Processor::Npu, Processor::Cpu] {
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
        assert_eq!(dag.deps(Job { chunk: 2, step: 2 }), vec![Job { chunk: 2, step: 1 }, Job { chunk: 1, step: 2 }]);
        assert_eq!(dag.deps(Job { chunk: 2, step: 1 }), vec![Job { chunk: 2, step: 0 }]);
        // A CPU subgraph's score is the NPU time its completion makes ready.
        let s = Scheduler::new(&dag, Policy::OutOfOrder);
        let t = |_j: Job| 1.5;
        assert_eq!(s.score(Job { chunk: 0, step: 0 }, &t), 1.5);
        assert_eq!(s.score(Job { chunk: 0, step: 1 }, &t), -1.5);
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
