//! The job graph: a pass's steps (subgraphs) × its prompt chunks, with their dependencies —
//! llm.npu's Eq. 3 (a step waits for its same-chunk predecessors; a shadow subgraph and the NPU
//! subgraph beside it share a predecessor and both precede the next one) and Eq. 2 (a step that
//! reads or appends the KV cache waits for the same step of the previous chunk; transitively, of
//! every earlier chunk). The scheduler ([`super::Scheduler`]) orders its jobs; the executor runs
//! them.

use llmd_device::{Processor, Subgraph};

/// One subgraph of a chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub name: String,
    pub proc: Processor,
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

/// Subgraph `step` of chunk `chunk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Job {
    pub chunk: usize,
    pub step: usize,
}

impl Dag {
    /// A chain of `specs` (each after the one before it), `chunks` times.
    pub fn chain(chunks: usize, specs: Vec<(String, Processor, bool)>) -> Self {
        let specs = specs
            .into_iter()
            .enumerate()
            .map(|(j, (name, proc, kv))| Spec { name, proc, kv, after: if j == 0 { vec![] } else { vec![j - 1] } })
            .collect();
        Self { chunks, specs }
    }

    /// The job graph of a placed pass: `pass`'s subgraphs in order, each on `procs[i]`,
    /// each after the one before it; attention (the KV cache's reader and writer) also after the
    /// same layer's attention of the previous chunk.
    pub fn from_pass(pass: &[Subgraph], procs: &[Processor], chunks: usize) -> Self {
        Self::chain(
            chunks,
            pass.iter().zip(procs).map(|(sg, &p)| (format!("{:?}.{}", sg.kind, sg.layer), p, sg.uses_kv())).collect(),
        )
    }

    /// The jobs `j` waits for.
    pub fn deps(&self, j: Job) -> Vec<Job> {
        let s = &self.specs[j.step];
        let mut d: Vec<Job> = s.after.iter().map(|&p| Job { chunk: j.chunk, step: p }).collect();
        if s.kv && j.chunk > 0 {
            d.push(Job { chunk: j.chunk - 1, step: j.step });
        }
        d
    }

    /// The jobs that wait for `j`.
    pub fn succs(&self, j: Job) -> Vec<Job> {
        let mut out: Vec<Job> = (0..self.specs.len())
            .filter(|&s| self.specs[s].after.contains(&j.step))
            .map(|s| Job { chunk: j.chunk, step: s })
            .collect();
        if self.specs[j.step].kv && j.chunk + 1 < self.chunks {
            out.push(Job { chunk: j.chunk + 1, step: j.step });
        }
        out
    }

    pub fn jobs(&self) -> usize {
        self.chunks * self.specs.len()
    }

    /// Every job in chunk-major model order.
    pub fn in_model_order(&self) -> impl Iterator<Item = Job> + '_ {
        (0..self.chunks).flat_map(move |chunk| (0..self.specs.len()).map(move |step| Job { chunk, step }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{Policy, Scheduler};

    #[test]
    fn jobs_wait_for_their_chunk_and_for_the_previous_chunks_kv() {
        let pass = Subgraph::pass(2); // embed a0 f0 a1 f1 head
        let on_cpu = vec![Processor::Cpu; pass.len()];
        let dag = Dag::from_pass(&pass, &on_cpu, 2);
        let j = |chunk, step| Job { chunk, step };
        assert_eq!(dag.deps(j(1, 1)), vec![j(1, 0), j(0, 1)]);
        assert_eq!(dag.deps(j(1, 2)), vec![j(1, 1)], "FFN needs no KV");
        // At the start both chunks' embeddings are ready: chunk 1 need not wait for chunk 0.
        let mut s = Scheduler::new(&dag, Policy::OutOfOrder);
        assert_eq!(s.ready(Processor::Cpu), vec![j(0, 0), j(1, 0)]);
        let t = |_: Job| 1.0;
        let (a, b) = (s.next(Processor::Cpu, &t), s.next(Processor::Cpu, &t));
        assert_eq!((a, b), (Some(j(0, 0)), Some(j(1, 0))));
        s.complete(j(0, 0));
        s.complete(j(1, 0));
        // Chunk 1's first attention waits for chunk 0's.
        assert_eq!(s.ready(Processor::Cpu), vec![j(0, 1)]);
        let dag = Dag::from_pass(&pass, &on_cpu, 3);
        let order: Vec<Job> = dag.in_model_order().collect();
        assert_eq!(order.len(), 18);
        let pos = |x: Job| order.iter().position(|&o| o == x).expect("in the order");
        for &x in &order {
            for d in dag.deps(x) {
                assert!(pos(d) < pos(x), "{d:?} before {x:?}");
            }
        }
        assert_eq!(Dag::from_pass(&pass, &on_cpu, 1).in_model_order().count(), 6);
        // One processor taking its next job in order walks the model order.
        let mut s = Scheduler::new(&dag, Policy::InOrder);
        let mut walk = Vec::new();
        while let Some(x) = s.next(Processor::Cpu, &t) {
            s.complete(x);
            walk.push(x);
        }
        assert!(s.is_done());
        assert_eq!(walk, order);
    }
}
