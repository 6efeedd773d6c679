//! The engine's scheduler: which device runs each subgraph of a pass, and in what order the
//! subgraphs of several prompt chunks may run.
//!
//! - **Placement** ([`place`]): for each subgraph of a pass in order, the devices that can take
//!   it ([`DeviceDesc::check`]: ops, weight types, static shapes) are priced by a
//!   [`CostModel`] — the subgraph's own time plus moving the residual stream in when the
//!   previous subgraph ran elsewhere and either side has memory of its own — and the cheapest
//!   wins (ties: the earlier device). A layer's attention stays on the device that holds its
//!   KV cache (`kv_home`).
//! - **Jobs** ([`JobQueue`]): chunk × subgraph, each job waiting for the previous subgraph of
//!   its chunk and, for attention, the same layer's attention of the previous chunk (its keys
//!   and values); everything else may run out of order — llm.npu's out-of-order subgraph
//!   execution plugs in here. A pass of the engine today is one chunk.
//! - **Splitting** ([`Splitter`], [`Split`]): the hook where HeteroLLM cuts one matmul across
//!   devices by rows or by tokens. The executor runs [`Split::Whole`] today; the contract's
//!   row-range weight loads ([`llmd_device::Device::load_weight`]) are what a split needs.

use llmd_device::{BlockShape, Cost, DeviceDesc, GgmlType, MemoryKind, Subgraph, SubgraphKind, WeightRole};
use std::ops::Range;

/// Prices a subgraph on a device (None: the model has no figure; such a device is taken only
/// where no priced one can run the subgraph).
pub trait CostModel: Send + Sync {
    fn cost(&self, dev: &DeviceDesc, sg: Subgraph, shape: &BlockShape, n_tokens: usize) -> Option<Cost>;

    /// Moving `bytes` of activations between the host and `dev` (0 for host memory).
    fn transfer_s(&self, dev: &DeviceDesc, bytes: usize) -> f64;
}

/// The work of a subgraph at `n_tokens` tokens attending over up to `context` positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Work {
    /// Multiply-accumulates.
    pub macs: f64,
    /// Weight elements read.
    pub weights: f64,
}

/// [`Work`] from the shape (the matmuls and attention; norms and element-wise ops are noise).
pub fn work(sg: Subgraph, s: &BlockShape, n_tokens: usize, context: usize) -> Work {
    let (n, d) = (n_tokens as f64, s.d_model as f64);
    let (qd, kvd, f, v) = (s.q_dim() as f64, s.kv_dim() as f64, s.ffn_dim as f64, s.vocab as f64);
    let weights = match sg.kind {
        SubgraphKind::Embed => n * d,
        SubgraphKind::Attention => d * (qd + 2.0 * kvd) + qd * d,
        SubgraphKind::Ffn => 3.0 * d * f,
        SubgraphKind::Head => d * v,
    };
    let attn = if sg.kind == SubgraphKind::Attention { 2.0 * n * context as f64 * qd } else { 0.0 };
    let macs = if sg.kind == SubgraphKind::Embed { 0.0 } else { n * weights + attn };
    Work { macs, weights }
}

/// A roofline from each device's figures: time = max(MACs / rate, weight bytes / bandwidth) +
/// a fixed launch cost; transfers at a bus bandwidth for memory that is not the host's.
#[derive(Clone, Debug, Default)]
pub struct Roofline {
    /// Per device name.
    pub figures: Vec<(String, Figures)>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub macs_per_s: f64,
    pub weight_bytes_per_s: f64,
    /// Bytes per weight element as the device keeps them.
    pub bytes_per_weight: f64,
    pub launch_s: f64,
    /// Host ↔ device copies (ignored for host memory).
    pub transfer_bytes_per_s: f64,
}

impl Roofline {
    fn of(&self, dev: &DeviceDesc) -> Option<&Figures> {
        self.figures.iter().find(|(n, _)| *n == dev.name).map(|(_, f)| f)
    }
}

impl CostModel for Roofline {
    fn cost(&self, dev: &DeviceDesc, sg: Subgraph, shape: &BlockShape, n_tokens: usize) -> Option<Cost> {
        let f = self.of(dev)?;
        let w = work(sg, shape, n_tokens, shape.context_length.min(4096));
        let compute = (w.macs / f.macs_per_s).max(w.weights * f.bytes_per_weight / f.weight_bytes_per_s);
        Some(Cost { compute_s: compute + f.launch_s, transfer_s: 0.0 })
    }

    fn transfer_s(&self, dev: &DeviceDesc, bytes: usize) -> f64 {
        match (dev.memory.kind, self.of(dev)) {
            (MemoryKind::Host, _) => 0.0,
            (_, Some(f)) => bytes as f64 / f.transfer_bytes_per_s,
            (_, None) => 0.0,
        }
    }
}

/// A fixed placement (a test, an operator's pin): `pick(sg)` names the device index; the
/// others get no price.
pub struct Pinned<F: Fn(Subgraph) -> usize + Send + Sync> {
    pub names: Vec<String>,
    pub pick: F,
}

impl<F: Fn(Subgraph) -> usize + Send + Sync> CostModel for Pinned<F> {
    fn cost(&self, dev: &DeviceDesc, sg: Subgraph, _: &BlockShape, _: usize) -> Option<Cost> {
        let i = (self.pick)(sg);
        (self.names.get(i) == Some(&dev.name)).then_some(Cost::default())
    }
    fn transfer_s(&self, _: &DeviceDesc, _: usize) -> f64 {
        0.0
    }
}

/// Why a pass could not be placed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("no device can run {subgraph:?} at {n_tokens} tokens: {reasons}")]
pub struct PlaceError {
    pub subgraph: Subgraph,
    pub n_tokens: usize,
    /// Each device's reason, `; `-separated.
    pub reasons: String,
}

/// Places every subgraph of `pass` on one of `devices` (see the module doc). `types(sg)`: the
/// weight types the subgraph reads; `kv_home[l]`: the device holding layer `l`'s KV cache, if
/// any. Returns a device index per subgraph.
pub fn place(
    devices: &[&DeviceDesc],
    pass: &[Subgraph],
    types: &dyn Fn(Subgraph) -> Vec<GgmlType>,
    shape: &BlockShape,
    n_tokens: usize,
    kv_home: &[Option<usize>],
    cost: &dyn CostModel,
) -> Result<Vec<usize>, PlaceError> {
    let x_bytes = n_tokens * shape.d_model * 4;
    let mut out = Vec::with_capacity(pass.len());
    let mut prev: Option<usize> = None;
    for &sg in pass {
        let tys = types(sg);
        let mut reasons = Vec::new();
        let mut best: Option<(bool, f64, usize)> = None; // (unpriced, seconds, index)
        let home = if sg.uses_kv() { kv_home.get(sg.layer).copied().flatten() } else { None };
        for (i, d) in devices.iter().enumerate() {
            if home.is_some_and(|h| h != i) {
                reasons.push(format!("{} does not hold layer {}'s KV cache", d.name, sg.layer));
                continue;
            }
            if let Err(r) = d.check(sg, &tys, n_tokens) {
                reasons.push(r);
                continue;
            }
            let moved = match prev {
                Some(p) if p != i => cost.transfer_s(d, x_bytes) + cost.transfer_s(devices[p], x_bytes),
                _ => 0.0,
            };
            let key = match cost.cost(d, sg, shape, n_tokens) {
                Some(c) => (false, c.total() + moved),
                None => (true, moved),
            };
            if best.is_none_or(|(u, s, _)| (key.0, key.1) < (u, s)) {
                best = Some((key.0, key.1, i));
            }
        }
        let Some((_, _, i)) = best else {
            return Err(PlaceError { subgraph: sg, n_tokens, reasons: reasons.join("; ") });
        };
        out.push(i);
        prev = Some(i);
    }
    Ok(out)
}

/// One job: subgraph `step` (an index into the pass) of prompt chunk `chunk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Job {
    pub chunk: usize,
    pub step: usize,
}

/// The jobs of `chunks` chunks of one pass layout, with their dependencies (module doc).
pub struct JobQueue {
    pass: Vec<Subgraph>,
    chunks: usize,
    state: Vec<u8>, // 0 waiting, 1 issued, 2 done
}

impl JobQueue {
    pub fn new(pass: Vec<Subgraph>, chunks: usize) -> Self {
        let n = pass.len() * chunks;
        Self { pass, chunks, state: vec![0; n] }
    }

    fn idx(&self, j: Job) -> usize {
        j.chunk * self.pass.len() + j.step
    }

    pub fn subgraph(&self, j: Job) -> Subgraph {
        self.pass[j.step]
    }

    /// The jobs `j` waits for.
    pub fn deps(&self, j: Job) -> Vec<Job> {
        let mut d = Vec::new();
        if j.step > 0 {
            d.push(Job { chunk: j.chunk, step: j.step - 1 });
        }
        if j.chunk > 0 && self.pass[j.step].uses_kv() {
            d.push(Job { chunk: j.chunk - 1, step: j.step });
        }
        d
    }

    /// Jobs not yet issued whose dependencies are done, chunk-major.
    pub fn ready(&self) -> Vec<Job> {
        let mut r = Vec::new();
        for chunk in 0..self.chunks {
            for step in 0..self.pass.len() {
                let j = Job { chunk, step };
                if self.state[self.idx(j)] == 0 && self.deps(j).iter().all(|&d| self.state[self.idx(d)] == 2) {
                    r.push(j);
                }
            }
        }
        r
    }

    pub fn issue(&mut self, j: Job) {
        let i = self.idx(j);
        self.state[i] = 1;
    }

    pub fn complete(&mut self, j: Job) {
        let i = self.idx(j);
        self.state[i] = 2;
    }

    pub fn is_done(&self) -> bool {
        self.state.iter().all(|&s| s == 2)
    }

    /// Every job in an order that respects the dependencies: always the first ready job.
    pub fn in_order(mut self) -> Vec<Job> {
        let mut v = Vec::with_capacity(self.state.len());
        while let Some(&j) = self.ready().first() {
            self.issue(j);
            self.complete(j);
            v.push(j);
        }
        v
    }
}

/// How one matmul of a subgraph is divided between devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// On the subgraph's device alone.
    Whole,
    /// Output rows (weight rows) per device index: HeteroLLM's row cut.
    Rows(Vec<(usize, Range<usize>)>),
    /// Tokens per device index: HeteroLLM's sequence cut.
    Tokens(Vec<(usize, Range<usize>)>),
}

/// Decides the [`Split`] of each matmul (HeteroLLM's partition solver implements this).
pub trait Splitter: Send + Sync {
    fn split(&self, sg: Subgraph, role: WeightRole, rows: usize, n_tokens: usize, devices: &[&DeviceDesc]) -> Split;
}

/// Never splits.
pub struct NoSplit;

impl Splitter for NoSplit {
    fn split(&self, _: Subgraph, _: WeightRole, _: usize, _: usize, _: &[&DeviceDesc]) -> Split {
        Split::Whole
    }
}

/// Cuts `0..n` into contiguous ranges in proportion to `shares` (each a non-negative weight),
/// every range a multiple of `align` except the last; ranges may be empty.
pub fn proportional(n: usize, shares: &[f64], align: usize) -> Vec<Range<usize>> {
    let total: f64 = shares.iter().filter(|s| s.is_finite() && **s > 0.0).sum();
    let align = align.max(1);
    let mut out = Vec::with_capacity(shares.len());
    let mut at = 0usize;
    let mut acc = 0.0;
    for (i, s) in shares.iter().enumerate() {
        let end = if i + 1 == shares.len() {
            n
        } else {
            acc += if s.is_finite() && *s > 0.0 { *s } else { 0.0 };
            let raw = if total > 0.0 { (n as f64 * acc / total).round() as usize } else { 0 };
            (raw / align * align).clamp(at, n)
        };
        out.push(at..end);
        at = end;
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use llmd_device::{MemoryDesc, OpKind, Processor, RopeStyle, StaticShapes};

    fn shape() -> BlockShape {
        BlockShape {
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 128,
            vocab: 100,
            context_length: 256,
            norm_eps: 1e-5,
            rope_dims: 16,
            rope_theta: 10000.0,
            rope_freq_scale: 1.0,
            rope_style: RopeStyle::Neox,
            qkv_bias: false,
            rope_freqs: false,
        }
    }

    fn dev(name: &str, p: Processor, mem: MemoryKind, ops: &[OpKind], shapes: StaticShapes) -> DeviceDesc {
        DeviceDesc {
            name: name.into(),
            processor: p,
            available: true,
            ops: ops.to_vec(),
            weight_types: vec![GgmlType::Q8_0, GgmlType::Q4_0],
            static_shapes: shapes,
            memory: MemoryDesc { kind: mem, capacity: None },
            max_tokens: None,
            threads: 1,
        }
    }

    fn all_ops() -> Vec<OpKind> {
        vec![OpKind::GetRows, OpKind::MatMul, OpKind::RmsNorm, OpKind::Rope, OpKind::Attention, OpKind::SwiGlu]
    }

    fn figures(macs: f64, launch: f64) -> Figures {
        Figures {
            macs_per_s: macs,
            weight_bytes_per_s: 1e12,
            bytes_per_weight: 1.0,
            launch_s: launch,
            transfer_bytes_per_s: 1e9,
        }
    }

    #[test]
    fn placement_takes_the_cheapest_device_that_can_run_each_subgraph() {
        let cpu = dev("cpu", Processor::Cpu, MemoryKind::Host, &all_ops(), StaticShapes::Any);
        // An NPU without attention or embedding, with graphs for 32-token chunks only, 10x faster.
        let npu = dev(
            "npu",
            Processor::Npu,
            MemoryKind::Unified,
            &[OpKind::MatMul, OpKind::RmsNorm, OpKind::SwiGlu],
            StaticShapes::Only(vec![32]),
        );
        let cost = Roofline { figures: vec![("cpu".into(), figures(1e9, 0.0)), ("npu".into(), figures(1e10, 1e-6))] };
        let s = shape();
        let pass = Subgraph::pass(2);
        let q8 = |_| vec![GgmlType::Q8_0];
        let p = place(&[&cpu, &npu], &pass, &q8, &s, 32, &[], &cost).unwrap();
        // embed cpu, attn cpu (no Rope/Attention on the NPU), ffn npu, ..., head npu (RmsNorm+MatMul)
        assert_eq!(p, vec![0, 0, 1, 0, 1, 1]);
        // A shape the NPU has no graph for: all on the CPU.
        assert_eq!(place(&[&cpu, &npu], &pass, &q8, &s, 7, &[], &cost).unwrap(), vec![0; 6]);
        // A weight type the NPU does not take.
        let f16 = |_| vec![GgmlType::F16];
        let cpu16 = DeviceDesc { weight_types: vec![GgmlType::F16], ..cpu.clone() };
        assert_eq!(place(&[&cpu16, &npu], &pass, &f16, &s, 32, &[], &cost).unwrap(), vec![0; 6]);
    }

    #[test]
    fn moving_the_residual_stream_is_priced_and_kv_pins_attention() {
        let cpu = dev("cpu", Processor::Cpu, MemoryKind::Host, &all_ops(), StaticShapes::Any);
        let gpu = dev("gpu", Processor::Gpu, MemoryKind::Dedicated, &all_ops(), StaticShapes::Any);
        // The GPU is barely faster, and a copy over its bus costs more than it saves: all CPU.
        let mut slow_bus = figures(1.05e9, 0.0);
        slow_bus.transfer_bytes_per_s = 1e3;
        let cost = Roofline { figures: vec![("cpu".into(), figures(1e9, 0.0)), ("gpu".into(), slow_bus)] };
        let s = shape();
        let pass = Subgraph::pass(2);
        let q8 = |_| vec![GgmlType::Q8_0];
        assert_eq!(place(&[&cpu, &gpu], &pass, &q8, &s, 4, &[], &cost).unwrap(), vec![0; 6]);
        // A fast bus: all GPU except the embedding (both unpriced-equal there: the first).
        let cost = Roofline { figures: vec![("cpu".into(), figures(1e9, 0.0)), ("gpu".into(), figures(1e10, 0.0))] };
        let p = place(&[&cpu, &gpu], &pass, &q8, &s, 4, &[], &cost).unwrap();
        assert!(p[1..].iter().all(|&d| d == 1), "{p:?}");
        // Layer 1's KV cache lives on the CPU: its attention stays there.
        let p = place(&[&cpu, &gpu], &pass, &q8, &s, 4, &[None, Some(0)], &cost).unwrap();
        assert_eq!(p[3], 0, "{p:?}");
        // Nothing can run it: the error names each device's reason.
        let none = DeviceDesc { available: false, ..cpu.clone() };
        let e = place(&[&none], &pass, &q8, &s, 4, &[], &cost).unwrap_err();
        assert_eq!(e.subgraph, Subgraph::EMBED);
        assert!(e.reasons.contains("not available"), "{e}");
    }

    #[test]
    fn jobs_wait_for_their_chunk_and_for_the_previous_chunks_kv() {
        let pass = Subgraph::pass(2); // embed a0 f0 a1 f1 head
        let q = JobQueue::new(pass.clone(), 2);
        assert_eq!(q.deps(Job { chunk: 1, step: 1 }), vec![Job { chunk: 1, step: 0 }, Job { chunk: 0, step: 1 }]);
        assert_eq!(q.deps(Job { chunk: 1, step: 2 }), vec![Job { chunk: 1, step: 1 }], "FFN needs no KV");
        // At the start both chunks' embeddings are ready: chunk 1 need not wait for chunk 0.
        assert_eq!(q.ready(), vec![Job { chunk: 0, step: 0 }, Job { chunk: 1, step: 0 }]);
        let mut q = q;
        for j in [Job { chunk: 0, step: 0 }, Job { chunk: 1, step: 0 }] {
            q.issue(j);
            q.complete(j);
        }
        // Chunk 1's first attention waits for chunk 0's.
        assert_eq!(q.ready(), vec![Job { chunk: 0, step: 1 }]);
        let order = JobQueue::new(pass.clone(), 3).in_order();
        assert_eq!(order.len(), 18);
        let pos = |j: Job| order.iter().position(|&o| o == j).unwrap();
        for &j in &order {
            for d in JobQueue::new(pass.clone(), 3).deps(j) {
                assert!(pos(d) < pos(j), "{d:?} before {j:?}");
            }
        }
        assert_eq!(JobQueue::new(pass, 1).in_order().len(), 6);
    }

    #[test]
    fn proportional_cuts_cover_every_row_once_on_aligned_bounds() {
        assert_eq!(proportional(100, &[1.0, 1.0], 1), vec![0..50, 50..100]);
        assert_eq!(proportional(100, &[3.0, 1.0], 16), vec![0..64, 64..100]);
        assert_eq!(proportional(10, &[0.0, 1.0], 1), vec![0..0, 0..10]);
        assert_eq!(proportional(10, &[f64::NAN, 0.0], 1), vec![0..0, 0..10]);
        assert_eq!(NoSplit.split(Subgraph::ffn(0), WeightRole::Up, 10, 1, &[]), Split::Whole);
    }
}
