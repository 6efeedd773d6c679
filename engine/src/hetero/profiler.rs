//! HeteroLLM's profiler in prediction mode (§4.3): the NPU's latency from a decision-tree
//! regression over tensor shapes, fitted to timed samples; the GPU's from a roofline (its rate
//! hardly depends on shape).
//!
//! **Decisions where the paper is silent.** The tree predicts the logarithm of seconds per FLOP
//! (a shape's efficiency) from `ln m`, `ln k`, `ln n` and `ln(n/k)`, so one leaf covers shapes
//! of any size at one efficiency and the prediction is `FLOPs × e^leaf` (a tree on raw seconds
//! cannot extrapolate to sizes between its samples); splits minimize the squared error (CART),
//! at most [`MAX_DEPTH`] deep, leaves of at least [`MIN_LEAF`] samples. The samples come from
//! timing real runs of the shapes on a device; on this host, with no phone, from the SoC
//! profile's NPU model ([`npu_samples`]) — the tree then stands where a phone's measurements
//! would, and its fit error is what the tests hold.

use super::soc::Soc;
use super::solver::Profiler;

/// Deepest split chain of the tree.
pub const MAX_DEPTH: usize = 8;
/// Fewest samples in a leaf.
pub const MIN_LEAF: usize = 3;

/// One timed run: `m` tokens (the graph's size), `k` inputs, `n` outputs, seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub seconds: f64,
}

fn features(m: usize, k: usize, n: usize) -> [f64; 4] {
    let (m, k, n) = (m.max(1) as f64, k.max(1) as f64, n.max(1) as f64);
    [m.ln(), k.ln(), n.ln(), (n / k).ln()]
}

fn flops(m: usize, k: usize, n: usize) -> f64 {
    2.0 * m.max(1) as f64 * k.max(1) as f64 * n.max(1) as f64
}

#[derive(Clone, Debug)]
enum Node {
    Leaf(f64),
    Split { feature: usize, threshold: f64, left: usize, right: usize },
}

/// A regression tree over shapes (see the module).
#[derive(Clone, Debug)]
pub struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    /// Fits the tree to `samples` (at least one; samples with a non-positive or non-finite
    /// time are left out).
    pub fn fit(samples: &[Sample]) -> Option<Self> {
        let rows: Vec<([f64; 4], f64)> = samples
            .iter()
            .filter(|s| s.seconds.is_finite() && s.seconds > 0.0)
            .map(|s| (features(s.m, s.k, s.n), (s.seconds / flops(s.m, s.k, s.n)).ln()))
            .collect();
        if rows.is_empty() {
            return None;
        }
        let mut t = Tree { nodes: Vec::new() };
        let idx: Vec<usize> = (0..rows.len()).collect();
        t.grow(&rows, idx, 0);
        Some(t)
    }

    fn grow(&mut self, rows: &[([f64; 4], f64)], idx: Vec<usize>, depth: usize) -> usize {
        let mean = idx.iter().map(|&i| rows[i].1).sum::<f64>() / idx.len() as f64;
        let at = self.nodes.len();
        self.nodes.push(Node::Leaf(mean));
        if depth >= MAX_DEPTH || idx.len() < 2 * MIN_LEAF {
            return at;
        }
        let sse = |ix: &[usize]| {
            let mu = ix.iter().map(|&i| rows[i].1).sum::<f64>() / ix.len() as f64;
            ix.iter().map(|&i| (rows[i].1 - mu).powi(2)).sum::<f64>()
        };
        let base = sse(&idx);
        let mut best: Option<(f64, usize, f64)> = None;
        for f in 0..4 {
            let mut sorted = idx.clone();
            sorted.sort_by(|&a, &b| rows[a].0[f].total_cmp(&rows[b].0[f]));
            // Running sums for the squared error of each side.
            let (mut ls, mut lq) = (0.0, 0.0);
            let (ts, tq): (f64, f64) =
                sorted.iter().fold((0.0, 0.0), |(s, q), &i| (s + rows[i].1, q + rows[i].1 * rows[i].1));
            for cut in 1..sorted.len() {
                let y = rows[sorted[cut - 1]].1;
                ls += y;
                lq += y * y;
                let (a, b) = (rows[sorted[cut - 1]].0[f], rows[sorted[cut]].0[f]);
                if cut < MIN_LEAF || sorted.len() - cut < MIN_LEAF || a == b {
                    continue;
                }
                let (nl, nr) = (cut as f64, (sorted.len() - cut) as f64);
                let err = (lq - ls * ls / nl) + ((tq - lq) - (ts - ls).powi(2) / nr);
                if best.is_none_or(|(e, _, _)| err < e) {
                    best = Some((err, f, (a + b) / 2.0));
                }
            }
        }
        let Some((err, feature, threshold)) = best else { return at };
        if err >= base * (1.0 - 1e-9) {
            return at;
        }
        let (l, r): (Vec<usize>, Vec<usize>) = idx.into_iter().partition(|&i| rows[i].0[feature] <= threshold);
        let left = self.grow(rows, l, depth + 1);
        let right = self.grow(rows, r, depth + 1);
        self.nodes[at] = Node::Split { feature, threshold, left, right };
        at
    }

    /// Predicted seconds for a shape.
    pub fn predict(&self, m: usize, k: usize, n: usize) -> f64 {
        let x = features(m, k, n);
        let mut at = 0;
        loop {
            match self.nodes.get(at) {
                Some(Node::Split { feature, threshold, left, right }) => {
                    at = if x[*feature] <= *threshold { *left } else { *right };
                }
                Some(Node::Leaf(v)) => return flops(m, k, n) * v.exp(),
                None => return f64::INFINITY,
            }
        }
    }

    pub fn leaves(&self) -> usize {
        self.nodes.iter().filter(|n| matches!(n, Node::Leaf(_))).count()
    }
}

/// The shapes HeteroLLM's offline profiler would time: every standard graph size (and one
/// token) by widths from 256 to 32768 (row partitions of 256 and the models' widths), both
/// orientations.
pub fn profile_shapes(sizes: &[usize]) -> Vec<(usize, usize, usize)> {
    let widths = [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 11008, 14336, 18944, 28672];
    let mut ms: Vec<usize> = sizes.to_vec();
    ms.push(1);
    ms.sort_unstable();
    ms.dedup();
    let mut out = Vec::new();
    for &m in &ms {
        for &k in &widths {
            for &n in &widths {
                out.push((m, k, n));
            }
        }
    }
    out
}

/// Samples of the SoC profile's NPU model at `shapes` (what stands in for timing a phone here).
pub fn npu_samples(soc: &Soc, bits: f64, shapes: &[(usize, usize, usize)]) -> Vec<Sample> {
    shapes.iter().map(|&(m, k, n)| Sample { m, k, n, seconds: soc.npu_matmul_s(m, k, n, bits) }).collect()
}

/// Prediction mode with the NPU from a fitted [`Tree`], the GPU from the profile's roofline.
pub struct Regression<'a> {
    pub soc: &'a Soc,
    pub bits: f64,
    pub npu: Tree,
}

impl<'a> Regression<'a> {
    /// Fits the NPU's tree to the profile's model at [`profile_shapes`].
    pub fn from_profile(soc: &'a Soc, bits: f64) -> Option<Self> {
        let shapes = profile_shapes(&soc.npu.sizes);
        Some(Self { soc, bits, npu: Tree::fit(&npu_samples(soc, bits, &shapes))? })
    }
}

impl Profiler for Regression<'_> {
    fn npu_s(&self, graph: usize, k: usize, n: usize) -> f64 {
        if graph == 0 || n == 0 {
            return 0.0;
        }
        self.npu.predict(graph, k, n)
    }
    fn gpu_s(&self, m: usize, k: usize, n: usize) -> f64 {
        self.soc.gpu_matmul_s(m, k, n, self.bits)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::hetero::partition::CutKind;
    use crate::hetero::soc;
    use crate::hetero::solver::{Op, Phase, Predicted, Solver};

    /// The tree's error on shapes it was not fitted to, relative to the profile's model: the
    /// median and the 95th percentile (seen: 0.004 and 0.029 with 127 leaves).
    const MEDIAN_REL_ERR: f64 = 0.02;
    const P95_REL_ERR: f64 = 0.10;

    #[test]
    fn the_tree_predicts_held_out_shapes() {
        let soc = soc::load(soc::BUILTIN, "snapdragon_8gen3").unwrap();
        let r = Regression::from_profile(&soc, 4.5).unwrap();
        let mut rng = 11u64;
        let mut next = |lo: usize, hi: usize| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (rng >> 33) as usize % (hi - lo)
        };
        let sizes = [1, 32, 64, 128, 256, 512, 1024];
        let mut errs: Vec<f64> = (0..400)
            .map(|_| {
                let (m, k, n) = (sizes[next(0, sizes.len())], 64 * next(4, 400), 64 * next(4, 400));
                let want = soc.npu_matmul_s(m, k, n, 4.5);
                (r.npu.predict(m, k, n) - want).abs() / want
            })
            .collect();
        errs.sort_by(f64::total_cmp);
        let (med, p95) = (errs[errs.len() / 2], errs[errs.len() * 95 / 100]);
        eprintln!("regression tree: {} leaves; held-out relative error median {med:.3}, p95 {p95:.3}", r.npu.leaves());
        assert!(med <= MEDIAN_REL_ERR && p95 <= P95_REL_ERR, "median {med}, p95 {p95}");
    }

    #[test]
    fn the_solver_decides_alike_on_the_tree() {
        let soc = soc::load(soc::BUILTIN, "snapdragon_8gen3").unwrap();
        let tree = Regression::from_profile(&soc, 4.5).unwrap();
        let exact = Predicted { soc: &soc, bits: 4.5 };
        let op = |m, k, n| Op { name: "x".into(), m, k, n };
        let mut same = 0;
        let mut all = 0;
        for m in [1, 32, 64, 128, 256, 300, 525, 600, 1024] {
            let phase = if m == 1 { Phase::Decode } else { Phase::Prefill };
            for (k, n) in [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)] {
                let a = Solver::new(&exact, &soc, phase, true).solve(&op(m, k, n)).kind;
                let b = Solver::new(&tree, &soc, phase, true).solve(&op(m, k, n)).kind;
                let split = |c: CutKind| !matches!(c, CutKind::GpuOnly | CutKind::NpuOnly);
                all += 1;
                same += usize::from(a == b || (split(a) && split(b)));
            }
        }
        eprintln!("{same} of {all} Llama-3-8B decisions alike");
        // Seen: 35 of 36.
        assert!(same * 10 >= all * 9, "{same} of {all}");
    }
}
