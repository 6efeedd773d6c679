//! HeteroLLM's partition solver (§4.3): per matmul, the minimum over GPU-only, NPU-only and
//! every aligned split of `max(T_gpu, T_npu) + T_sync + T_copy`, with the costs from a
//! [`Profiler`]. Splits are aligned as the paper prunes its search: NPU rows at multiples of
//! `row_align` (256), NPU tokens at multiples of `seq_align` (32) made of the pre-built
//! standard sizes (every segment a whole graph, or the last one padded).
//!
//! **Decisions where the paper is silent.** "max" is [`Soc::overlap`] (both processors slow
//! while they share memory); `T_copy` is 0 with the zero-copy buffer pool and two 400 µs
//! copies without it; `T_sync` is two flag hand-offs plus, in prefill, one GPU submission per
//! matmul the NPU takes part in (NPU-dominant: the next GPU kernel goes in after the NPU is
//! done), or, without fast synchronisation, a drained queue's restart ([`SyncCosts`]). The GPU-only option carries no sync term: the
//! GPU runs the neighbouring norms and SwiGLU anyway.

use super::partition::{Cut, CutKind, Segment, Sizes};
use super::soc::Soc;

/// Prefill (a prompt's tokens at once) or decode (one token per step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Phase {
    Prefill,
    Decode,
}

/// One matmul: `m` tokens, `k` inputs, `n` outputs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Op {
    pub name: String,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// The cost of a matmul piece on each processor (seconds): HeteroLLM's profiler.
pub trait Profiler {
    fn npu_s(&self, graph: usize, k: usize, n: usize) -> f64;
    fn gpu_s(&self, m: usize, k: usize, n: usize) -> f64;
}

/// The prediction mode straight from a SoC profile (the roofline and the NPU's shape rates).
pub struct Predicted<'a> {
    pub soc: &'a Soc,
    /// Bits per weight the processors read (W4A16 as Q4_0: 4.5).
    pub bits: f64,
}

impl Profiler for Predicted<'_> {
    fn npu_s(&self, graph: usize, k: usize, n: usize) -> f64 {
        self.soc.npu_matmul_s(graph, k, n, self.bits)
    }
    fn gpu_s(&self, m: usize, k: usize, n: usize) -> f64 {
        self.soc.gpu_matmul_s(m, k, n, self.bits)
    }
}

/// What handing a matmul between the processors costs (seconds).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct SyncCosts {
    /// Per matmul the NPU takes part in.
    pub per_npu_op: f64,
}

impl SyncCosts {
    pub fn new(soc: &Soc, phase: Phase, fast: bool) -> Self {
        let s = &soc.sync;
        let us = if fast {
            // Two flag hand-offs (the waiter wakes before the flag flips and polls: a few µs);
            // in NPU-dominant prefill the next GPU kernel is submitted after the NPU is done.
            2.0 * s.poll_us + if phase == Phase::Prefill { soc.gpu.submit_us } else { 0.0 }
        } else {
            // The activation copied in and the result out (clEnqueueWriteBuffer-style, fixed),
            // and the GPU's queue restarted after draining.
            2.0 * s.copy_us + soc.gpu.empty_queue_us
        };
        Self { per_npu_op: us * 1e-6 }
    }
}

/// A solved matmul: its cut and modelled cost, and the two single-processor costs beside it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Choice {
    pub op: Op,
    pub cut: Cut,
    pub kind: CutKind,
    pub seconds: f64,
    pub gpu_only_s: f64,
    pub npu_only_s: f64,
}

/// The solver over one SoC's alignment rules, sizes and sync costs.
pub struct Solver<'a> {
    pub profiler: &'a dyn Profiler,
    pub soc: &'a Soc,
    pub sync: SyncCosts,
    pub phase: Phase,
    /// Standard graph sizes (prefill: the SoC's; decode: one token).
    pub sizes: Sizes,
}

impl<'a> Solver<'a> {
    pub fn new(profiler: &'a dyn Profiler, soc: &'a Soc, phase: Phase, fast_sync: bool) -> Self {
        let sizes = match phase {
            Phase::Prefill => soc.sizes(),
            Phase::Decode => Sizes::new(vec![1]).unwrap_or_else(Sizes::heterollm),
        };
        Self { profiler, soc, sync: SyncCosts::new(soc, phase, fast_sync), phase, sizes }
    }

    /// The modelled time of `cut` for `op`.
    pub fn cost(&self, op: &Op, cut: &Cut) -> f64 {
        let (npu, gpu) = self.times(op, cut);
        if !(npu.is_finite() && gpu.is_finite()) {
            return f64::INFINITY;
        }
        match cut.kind(op.m, op.n) {
            CutKind::GpuOnly => gpu,
            CutKind::NpuOnly => npu + self.sync.per_npu_op,
            _ => self.soc.overlap(gpu, npu) + self.sync.per_npu_op,
        }
    }

    /// The NPU's candidate token segments for `m` tokens: for every multiple `t` of the
    /// alignment, `t` tokens in whole standard graphs, largest first (the rest to the GPU), and
    /// the same with the rest padded into the smallest graph that holds it (`t = 0`: the whole
    /// prompt padded; the largest `t`: the "pipe"). Largest first is enough: a graph's cost
    /// per token does not rise with its size.
    pub fn token_sets(&self, m: usize) -> Vec<Vec<Segment>> {
        let align = if self.phase == Phase::Decode { 1 } else { self.soc.npu.seq_align.max(1) };
        let mut out: Vec<Vec<Segment>> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut push = |v: Vec<Segment>| {
            if !v.is_empty() && seen.insert(v.clone()) {
                out.push(v);
            }
        };
        // Whole graphs for the first t tokens (largest first), the GPU taking the rest — or
        // the rest padded into one more graph.
        let mut t = 0;
        while t <= m {
            let (sizes, left) = self.sizes.greedy(t);
            if left == 0 {
                let segs = Cut::from_sizes(&sizes, 0).npu;
                if t < m {
                    if let Some(g) = self.sizes.pad(m - t) {
                        let mut padded = segs.clone();
                        padded.push(Segment { tokens: t..m, graph: g });
                        push(padded);
                    }
                }
                push(segs);
            }
            t += align;
        }
        out
    }

    fn row_options(&self, n: usize) -> Vec<usize> {
        let a = self.soc.npu.row_align.max(1);
        let mut v: Vec<usize> = (1..).map(|i| i * a).take_while(|&r| r < n).collect();
        v.push(n);
        v
    }

    /// The best cut of `op`.
    pub fn solve(&self, op: &Op) -> Choice {
        let gpu_only = Cut::gpu_only();
        let gpu_only_s = self.cost(op, &gpu_only);
        let mut best = (gpu_only_s, gpu_only);
        let mut npu_only_s = f64::INFINITY;
        let rows = self.row_options(op.n);
        for segs in self.token_sets(op.m) {
            let covers = segs.iter().map(|s| s.tokens.len()).sum::<usize>() == op.m;
            for &r in &rows {
                let cut = Cut { npu: segs.clone(), npu_rows: r };
                let c = self.cost(op, &cut);
                if covers && r == op.n {
                    npu_only_s = npu_only_s.min(c);
                }
                if c < best.0 || (c == best.0 && prefer(&cut, &best.1)) {
                    best = (c, cut);
                }
            }
        }
        let (seconds, cut) = best;
        Choice { kind: cut.kind(op.m, op.n), op: op.clone(), cut, seconds, gpu_only_s, npu_only_s }
    }

    /// Every candidate, exhaustively (what the solver is tested against): the NPU's tokens
    /// as every multiset of standard sizes that fits the prompt (not only the largest-first
    /// one the solver tries), with or without the rest padded into one more graph, at every
    /// aligned row count. Exponential: for small cases.
    pub fn brute_force(&self, op: &Op) -> (f64, Cut) {
        let mut best = (self.cost(op, &Cut::gpu_only()), Cut::gpu_only());
        let mut sets: Vec<Vec<usize>> = Vec::new();
        multisets(self.sizes.all(), op.m, &mut Vec::new(), &mut sets);
        for set in sets {
            let base = Cut::from_sizes(&set, 0).npu;
            let used: usize = set.iter().sum();
            let mut variants = vec![base.clone()];
            if used < op.m {
                for &g in self.sizes.all().iter().filter(|&&g| g >= op.m - used) {
                    let mut v = base.clone();
                    v.push(Segment { tokens: used..op.m, graph: g });
                    variants.push(v);
                }
            }
            for segs in variants.into_iter().filter(|v| !v.is_empty()) {
                for r in self.row_options(op.n) {
                    let cut = Cut { npu: segs.clone(), npu_rows: r };
                    let c = self.cost(op, &cut);
                    if c < best.0 {
                        best = (c, cut);
                    }
                }
            }
        }
        best
    }

    /// The NPU's and the GPU's busy time for `cut` (each alone).
    pub fn times(&self, op: &Op, cut: &Cut) -> (f64, f64) {
        let Ok(pieces) = cut.pieces(op.m, op.n) else { return (f64::INFINITY, f64::INFINITY) };
        let mut npu = 0.0;
        let mut gpu = 0.0;
        for p in &pieces {
            match p.graph {
                Some(g) => npu += self.profiler.npu_s(g, op.k, p.rows.len()),
                None => gpu += self.profiler.gpu_s(p.tokens.len(), op.k, p.rows.len()),
            }
        }
        (npu, gpu)
    }
}

/// Every multiset of `sizes` (non-increasing) summing to at most `left`, the empty one included.
fn multisets(sizes: &[usize], left: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
    out.push(cur.clone());
    let max = cur.last().copied().unwrap_or(usize::MAX);
    for &s in sizes.iter().rev().filter(|&&s| s <= left && s <= max) {
        cur.push(s);
        multisets(sizes, left - s, cur, out);
        cur.pop();
    }
}

/// Between cuts of equal cost: fewer NPU graphs, then more NPU rows.
fn prefer(a: &Cut, b: &Cut) -> bool {
    (a.npu.len(), std::cmp::Reverse(a.npu_rows)) < (b.npu.len(), std::cmp::Reverse(b.npu_rows))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::hetero::soc;

    fn s8g3() -> Soc {
        soc::load(soc::BUILTIN, "snapdragon_8gen3").unwrap()
    }

    #[test]
    fn the_solver_equals_brute_force_on_small_cases() {
        let soc = s8g3();
        let p = Predicted { soc: &soc, bits: 4.5 };
        let mut rng = 7u64;
        let mut next = |n: usize| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) as usize % n
        };
        let mut kinds = std::collections::HashSet::new();
        for phase in [Phase::Prefill, Phase::Decode] {
            for fast in [true, false] {
                let solver = Solver::new(&p, &soc, phase, fast);
                for _ in 0..150 {
                    let m = if phase == Phase::Decode { 1 } else { 1 + next(400) };
                    let op = Op { name: "x".into(), m, k: 256 * (1 + next(24)), n: 256 * (1 + next(24)) };
                    let c = solver.solve(&op);
                    let (b, bcut) = solver.brute_force(&op);
                    assert!(
                        (c.seconds - b).abs() <= 1e-12 * b.max(1e-9),
                        "{op:?}: solver {} {:?} vs brute {b} {bcut:?}",
                        c.seconds,
                        c.cut
                    );
                    kinds.insert(c.kind);
                }
            }
        }
        assert!(kinds.len() >= 4, "{kinds:?}");
    }

    #[test]
    fn llama3_8b_decisions_are_the_papers() {
        let soc = s8g3();
        let p = Predicted { soc: &soc, bits: 4.5 };
        let pre = Solver::new(&p, &soc, Phase::Prefill, true);
        let op = |name: &str, m, k, n| Op { name: name.into(), m, k, n };
        for m in [256, 512, 1024] {
            for (name, k, n) in [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672)] {
                assert_eq!(pre.solve(&op(name, m, k, n)).kind, CutKind::NpuOnly, "{name} at {m}");
            }
            let c = pre.solve(&op("down", m, 14336, 4096));
            // Split between the two: by rows (the paper's), or — where 32-token steps balance
            // the two more finely than 256-row steps — by tokens.
            assert!(!matches!(c.kind, CutKind::NpuOnly | CutKind::GpuOnly), "down at {m}: {:?}", c.cut);
        }
        // Just under a standard size (1000 → 1024) padding wastes little: NPU only.
        assert_eq!(pre.solve(&op("gate_up", 1000, 4096, 28672)).kind, CutKind::NpuOnly);
        for m in [300, 525, 600] {
            let c = pre.solve(&op("gate_up", m, 4096, 28672));
            assert!(
                matches!(c.kind, CutKind::Seq | CutKind::MultiSeq | CutKind::Hybrid),
                "gate_up at {m}: {:?}",
                c.cut
            );
        }
        let dec = Solver::new(&p, &soc, Phase::Decode, true);
        for (k, n) in [(4096, 6144), (4096, 28672), (14336, 4096)] {
            let c = dec.solve(&op("d", 1, k, n));
            assert_eq!(c.kind, CutKind::Row, "decode {k}→{n}: {:?} {} vs GPU {}", c.cut, c.seconds, c.gpu_only_s);
        }
    }
}
