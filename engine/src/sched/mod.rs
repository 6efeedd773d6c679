//! The engine's scheduler: which device runs each subgraph of a pass, in what order the
//! subgraphs of several prompt chunks run, and how one matmul may be split between devices.
//!
//! - **Placement** ([`place`]): for each subgraph of a pass in order, the devices that can take
//!   it ([`DeviceDesc::check`]: ops, weight types, static shapes) are priced by a
//!   [`CostModel`] — each subgraph's own time plus moving the residual stream between
//!   neighbours on different devices (a copy for dedicated memory; for unified memory, the
//!   mapping and cache maintenance the model's figure stands for) — and the cheapest chain over
//!   the pass wins (ties: the earlier device). A layer's attention stays on the device that
//!   holds its KV cache (`kv_home`), and is first placed only where one-token steps can follow.
//! - **The job graph** ([`Dag`], `graph.rs`): chunk × step, each job waiting for its same-chunk
//!   predecessors and, for a step that uses the KV cache, the same step of the previous chunk.
//!   One job graph for every pass, run by the one executor (`model/placed.rs`): a pass in
//!   model order, or a prompt's chunks out of order (llm.npu), each layer then its five parts.
//! - **Order** ([`Scheduler`], `order.rs`): which ready job an idle processor takes — llm.npu's
//!   out-of-order score, in order, or random legal orders; [`simulate`] and [`optimum`] measure
//!   it, [`run_threads`] (`threads.rs`) runs it on one thread per processor.
//! - **Splitting** ([`Splitter`], [`Split`], `split.rs`): how one projection is divided
//!   between devices — by rows, by tokens, or any tiling ([`Part`]s: HeteroLLM's hybrid cut,
//!   padded to a static device's graph). HeteroLLM's plan (`hetero::plan::HeteroPlan`) is a
//!   splitter; the executor (`model/split.rs`) runs the parts through the device contract.

mod graph;
pub mod heads;
mod order;
mod split;
mod threads;

pub use graph::{Dag, Job, Spec};
pub use llmd_device::Processor;
pub use order::{optimum, simulate, Policy, Scheduler, Timeline, LANES};
pub use split::{check, proportional, views, GroupsOnNpu, NoSplit, Part, Split, Splitter};
pub(crate) use threads::count_spawned;
pub use threads::{run_threads, threads_spawned};

use llmd_device::{BlockShape, Cost, DeviceDesc, GgmlType, MemoryKind, Subgraph, SubgraphKind};

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
    // A whole projection of its role.
    let projection = |role: llmd_device::WeightRole| {
        use llmd_device::WeightRole::*;
        match role {
            Wq | Wo => d * qd,
            Wk | Wv => d * kvd,
            Gate | Up | Down => d * f,
            Output | TokenEmbd => d * v,
            _ => d,
        }
    };
    let weights = match sg.kind {
        SubgraphKind::Embed => n * d,
        SubgraphKind::Attention => d * (qd + 2.0 * kvd) + qd * d,
        SubgraphKind::Ffn => 3.0 * d * f,
        SubgraphKind::Head => d * v,
        // A split's pieces are priced by the splitter.
        SubgraphKind::Linear(role) => projection(role),
        SubgraphKind::Group(site) => site.roles().iter().map(|&r| projection(r)).sum(),
        SubgraphKind::AttnQkv => d * (qd + 2.0 * kvd),
        SubgraphKind::AttnCore => 0.0,
        SubgraphKind::AttnOut => qd * d,
        SubgraphKind::FfnGateUp => 2.0 * d * f,
        SubgraphKind::FfnDown => d * f,
    };
    let attn = if matches!(sg.kind, SubgraphKind::Attention | SubgraphKind::AttnCore) {
        2.0 * n * context as f64 * qd
    } else {
        0.0
    };
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

/// Every block of a pass on the host (the CPU's processor), where the devices' splitter places
/// its projections and linear groups: llm.npu's split, the NPU taking the groups
/// ([`GroupsOnNpu`]) while norms, RoPE, attention, SwiGLU and the head stay on the CPU.
pub struct HostBlocks;

impl CostModel for HostBlocks {
    fn cost(&self, dev: &DeviceDesc, _: Subgraph, _: &BlockShape, _: usize) -> Option<Cost> {
        (dev.processor == Processor::Cpu).then_some(Cost::default())
    }
    fn transfer_s(&self, _: &DeviceDesc, _: usize) -> f64 {
        0.0
    }
}

/// Decode on one device, prompts on the host: a pass of at most `max_tokens` tokens goes whole
/// to the device named `device`, a longer one stays whole on the host — the GPU decoding what
/// the CPU (or the NPU) read. Each sequence's KV cache moves to the device once per turn, at
/// its first decode step, and back at its next prompt.
pub struct DecodeOn {
    pub device: String,
    pub max_tokens: usize,
}

impl CostModel for DecodeOn {
    fn cost(&self, dev: &DeviceDesc, _: Subgraph, _: &BlockShape, n_tokens: usize) -> Option<Cost> {
        ((n_tokens <= self.max_tokens) == (dev.name == self.device)).then_some(Cost::default())
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

/// What an unpriced choice costs in [`place`]'s sums: more than any real pass, so a priced
/// device always wins and, among unpriced ones, fewer is better.
const UNPRICED_S: f64 = 1e12;

/// Places every subgraph of `pass` on one of `devices` (see the module doc). `types(sg)`: the
/// weight types the subgraph reads; `kv_home[l]`: the device holding layer `l`'s KV cache, if
/// any. Returns a device index per subgraph.
///
/// The cheapest chain over the whole pass (dynamic programming over subgraph × device, so a
/// hop onto a device is charged with the hop back off it): each subgraph's price plus moving
/// the residual stream wherever two neighbours differ. Ties go to the earlier device. A layer's
/// attention with no home yet goes only to a device that can also run it one token at a time:
/// its KV cache will live there, and every decode step's attention with it.
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
    let nd = devices.len();
    // best[i][d]: the least cost of subgraphs 0..=i with i on d; from[i][d]: i-1's device then.
    let mut best: Vec<Vec<Option<f64>>> = Vec::with_capacity(pass.len());
    let mut from: Vec<Vec<usize>> = Vec::with_capacity(pass.len());
    for (i, &sg) in pass.iter().enumerate() {
        let tys = types(sg);
        let home = if sg.uses_kv() { kv_home.get(sg.layer).copied().flatten() } else { None };
        let mut reasons = Vec::new();
        let mut row = vec![None; nd];
        let mut back = vec![0; nd];
        for (d, desc) in devices.iter().enumerate() {
            if home.is_some_and(|h| h != d) {
                reasons.push(format!("{} does not hold layer {}'s KV cache", desc.name, sg.layer));
                continue;
            }
            if let Err(r) = desc.check(sg, &tys, n_tokens) {
                reasons.push(r);
                continue;
            }
            if sg.uses_kv() && home.is_none() && desc.check(sg, &tys, 1).is_err() {
                reasons.push(format!("{} cannot run layer {}'s attention one token at a time", desc.name, sg.layer));
                continue;
            }
            let own = cost.cost(desc, sg, shape, n_tokens).map_or(UNPRICED_S, |c| c.total());
            let Some(prev) = best.last() else {
                row[d] = Some(own);
                continue;
            };
            let mut pick: Option<(f64, usize)> = None;
            for (p, c) in prev.iter().enumerate() {
                let Some(c) = c else { continue };
                let moved =
                    if p == d { 0.0 } else { cost.transfer_s(desc, x_bytes) + cost.transfer_s(devices[p], x_bytes) };
                if pick.is_none_or(|(b, _)| c + moved < b) {
                    pick = Some((c + moved, p));
                }
            }
            if let Some((c, p)) = pick {
                row[d] = Some(c + own);
                back[d] = p;
            }
        }
        if row.iter().all(Option::is_none) {
            if reasons.is_empty() {
                reasons.push("no device can take the subgraph before it".into());
            }
            return Err(PlaceError { subgraph: pass[i], n_tokens, reasons: reasons.join("; ") });
        }
        best.push(row);
        from.push(back);
    }
    let Some(last) = best.last() else { return Ok(Vec::new()) };
    let mut d = 0;
    let mut least = f64::INFINITY;
    for (i, c) in last.iter().enumerate() {
        if let Some(c) = c {
            if *c < least {
                least = *c;
                d = i;
            }
        }
    }
    let mut out = vec![0; pass.len()];
    for i in (0..pass.len()).rev() {
        out[i] = d;
        d = from[i][d];
    }
    Ok(out)
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
        // A GPU without the embedding: the stream must cross to it after the first subgraph.
        let gpu_ops = [OpKind::MatMul, OpKind::RmsNorm, OpKind::Rope, OpKind::Attention, OpKind::SwiGlu];
        let gpu = dev("gpu", Processor::Gpu, MemoryKind::Dedicated, &gpu_ops, StaticShapes::Any);
        // Barely faster, and a copy over its bus costs more than it saves: all on the CPU.
        let mut slow_bus = figures(1.05e9, 0.0);
        slow_bus.transfer_bytes_per_s = 1e3;
        let cost = Roofline { figures: vec![("cpu".into(), figures(1e9, 0.0)), ("gpu".into(), slow_bus)] };
        let s = shape();
        let pass = Subgraph::pass(2);
        let q8 = |_| vec![GgmlType::Q8_0];
        assert_eq!(place(&[&cpu, &gpu], &pass, &q8, &s, 4, &[], &cost).unwrap(), vec![0; 6]);
        // A fast bus: everything after the embedding on the GPU, one crossing.
        let cost = Roofline { figures: vec![("cpu".into(), figures(1e9, 0.0)), ("gpu".into(), figures(1e10, 0.0))] };
        assert_eq!(place(&[&cpu, &gpu], &pass, &q8, &s, 4, &[], &cost).unwrap(), vec![0, 1, 1, 1, 1, 1]);
        // Layer 1's KV cache lives on the CPU: its attention stays there, and the chain with it
        // is priced as a whole (the FFN of layer 1 follows it rather than cross twice more).
        let p = place(&[&cpu, &gpu], &pass, &q8, &s, 4, &[None, Some(0)], &cost).unwrap();
        assert_eq!(p[3], 0, "{p:?}");
        // A device that cannot run one-token steps gets no attention without a home.
        let chunky = DeviceDesc { static_shapes: StaticShapes::Only(vec![4]), ..gpu.clone() };
        let p = place(&[&cpu, &chunky], &pass, &q8, &s, 4, &[], &cost).unwrap();
        assert_eq!((p[1], p[3]), (0, 0), "{p:?}");
        assert_eq!((p[2], p[4]), (1, 1), "the FFNs still go to it: {p:?}");
        // Nothing can run it: the error names each device's reason.
        let none = DeviceDesc { available: false, ..cpu.clone() };
        let e = place(&[&none], &pass, &q8, &s, 4, &[], &cost).unwrap_err();
        assert_eq!(e.subgraph, Subgraph::EMBED);
        assert!(e.reasons.contains("not available"), "{e}");
    }
}
