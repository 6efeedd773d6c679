//! llm.npu's INT8 chunked prefill on a phone, **modelled**: the engine's out-of-order scheduler
//! (`crate::sched`) run as a discrete-event simulation over a model's shapes — the NPU's W8A8
//! linear groups, the CPU's norms, RoPE, attention, SwiGLU and shadow outliers, and the
//! hand-offs between them — with every duration from a named input ([`Int8Costs`]). `llmctl
//! npu-model` prints it on the emulator's cost model; the planner ([`super::choose`]) prices
//! INT8 chunked prefill with it on a SoC profile, on the same footing as HeteroLLM's fp16
//! graphs ([`super::soc::Soc::npu_int8_graph_s`]).

use super::soc::Soc;
use crate::sched::{simulate, Dag, Job, Policy, Processor, Spec, Timeline};
use std::sync::Arc;

/// Attention FLOPs per second on the phone's CPU cores [assumption, calibrated so that llm.npu's CPU share of a 256-token Qwen1.5-1.8B chunk is its 157.5 ms].
pub const CPU_ATTN_FLOPS: f64 = 50e9;
/// Element-wise values per second on the phone's CPU cores [assumption, calibrated].
pub const CPU_ELEMS_PER_S: f64 = 6e9;
/// One CPU–NPU hand-off at a shadow site [measured elsewhere: HeteroLLM §4.2, GPU–NPU].
pub const SYNC_S: f64 = 400e-6;
/// Outlier channels per shadow site and chunk (llm.npu Fig. 10: 5–15 per tensor).
pub const OUTLIER_CHANNELS: f64 = 10.0;
/// Building and optimizing one shape's graphs (llm.npu §2.3, Gemma-2B).
pub const BUILD_S: f64 = 0.36 + 11.54;

/// A decoder's shapes.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub name: &'static str,
    pub layers: usize,
    pub d: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub ffn: usize,
}

/// Qwen1.5-1.8B (its public config): llm.npu's reference model.
pub const QWEN1_5_1_8B: Shape =
    Shape { name: "Qwen1.5-1.8B", layers: 24, d: 2048, q_dim: 2048, kv_dim: 2048, ffn: 5504 };

/// How the NPU's INT8 graphs are priced.
#[derive(Clone, Debug)]
pub enum Int8Npu {
    /// llm.npu's cost model as the emulator fits it: a launch, then per node the slower of its
    /// weight bytes and its operations at flat rates.
    Flat { launch_s: f64, weight_bytes_per_s: f64, ops_per_s: f64 },
    /// A SoC profile's NPU, on the footing of its fp16 graphs
    /// ([`Soc::npu_int8_graph_s`]).
    Profile(Arc<Soc>),
}

/// The figures the INT8 model's durations come from: `llmctl npu-model`'s are the emulator's
/// Snapdragon 8 Gen 3 cost model and the constants above; the planner's a SoC profile's.
#[derive(Clone, Debug)]
pub struct Int8Costs {
    pub npu: Int8Npu,
    pub cpu_attn_flops: f64,
    pub cpu_elems_per_s: f64,
    /// One NPU→CPU hand-off, seconds.
    pub sync_s: f64,
}

impl Int8Costs {
    /// The NPU's time for one graph of `m` rows holding FullyConnected nodes `k × n`.
    pub fn npu_s(&self, m: usize, fcs: &[(usize, usize)]) -> f64 {
        match &self.npu {
            Int8Npu::Flat { launch_s, weight_bytes_per_s, ops_per_s } => {
                super::soc::int8_graph_s(*launch_s, *weight_bytes_per_s, *ops_per_s, m, fcs)
            }
            Int8Npu::Profile(soc) => soc.npu_int8_graph_s(m, fcs),
        }
    }
}

/// llm.npu's subgraphs of one chunk on our NPU path, with their durations: per layer norm (CPU),
/// QKV (NPU), attention (CPU, KV), O (NPU), residual + norm (CPU), gate/up (NPU), SwiGLU (CPU),
/// down (NPU); a shadow subgraph (CPU) beside each NPU graph of a shadow site.
pub struct Model {
    pub dag: Dag,
    times: Vec<Box<dyn Fn(usize) -> f64>>,
}

impl Model {
    /// The subgraphs of `chunks` chunks of `chunk` rows, shadow execution where `shadow(layer,
    /// site)` says, with durations from `k`.
    pub fn with_costs(
        s: Shape,
        chunk: usize,
        chunks: usize,
        shadow: &dyn Fn(usize, usize) -> bool,
        k: Int8Costs,
    ) -> Self {
        let c = chunk as f64;
        let (sync_s, cpu_attn_flops, cpu_elems_per_s) = (k.sync_s, k.cpu_attn_flops, k.cpu_elems_per_s);
        let mut specs: Vec<Spec> = Vec::new();
        let mut times: Vec<Box<dyn Fn(usize) -> f64>> = Vec::new();
        let el = move |per_row: usize| c * per_row as f64 / cpu_elems_per_s;
        let mut prev: Vec<usize> = Vec::new();
        for l in 0..s.layers {
            let mut cpu = |name: String, kv: bool, t: Box<dyn Fn(usize) -> f64>, after: Vec<usize>| {
                specs.push(Spec { name, proc: Processor::Cpu, kv, after });
                times.push(t);
                specs.len() - 1
            };
            let hand_off = if l > 0 { sync_s } else { 0.0 };
            let norm = cpu(format!("l{l}.norm"), false, Box::new(move |_| el(3 * s.d) + hand_off), prev.clone());
            let (qd, kvd) = (s.q_dim, s.kv_dim);
            // Attention of chunk i: its rows against (i + 1/2)·C positions on average, QK and PV.
            let att = move |i: usize| {
                let ctx = (i as f64 + 0.5) * c;
                2.0 * 2.0 * c * ctx * qd as f64 / cpu_attn_flops + el(qd + kvd)
            };
            let mut after = vec![norm];
            type Group = (&'static str, Vec<(usize, usize)>, usize);
            let groups: [Group; 4] = [
                ("qkv", vec![(s.d, qd), (s.d, kvd), (s.d, kvd)], s.d),
                ("o", vec![(qd, s.d)], qd),
                ("gate_up", vec![(s.d, s.ffn), (s.d, s.ffn)], s.d),
                ("down", vec![(s.ffn, s.d)], s.ffn),
            ];
            for (site, (gname, fcs, kin)) in groups.into_iter().enumerate() {
                let n_out: usize = fcs.iter().map(|f| f.1).sum();
                let t_npu = k.npu_s(chunk, &fcs);
                specs.push(Spec {
                    name: format!("l{l}.{gname}"),
                    proc: Processor::Npu,
                    kv: false,
                    after: after.clone(),
                });
                times.push(Box::new(move |_| t_npu));
                let npu = specs.len() - 1;
                let mut outs = vec![npu];
                if shadow(l, site) {
                    // Extraction and the product: from the input the CPU already holds; the merge
                    // is in the next CPU subgraph, which waits for the NPU's output anyway.
                    let t = el(kin) + c * OUTLIER_CHANNELS * n_out as f64 * 2.0 / cpu_attn_flops;
                    specs.push(Spec {
                        name: format!("l{l}.{gname}.shadow"),
                        proc: Processor::Cpu,
                        kv: false,
                        after: after.clone(),
                    });
                    times.push(Box::new(move |_| t));
                    outs.push(specs.len() - 1);
                }
                let (name, kv, t): (String, bool, Box<dyn Fn(usize) -> f64>) = match gname {
                    "qkv" => (format!("l{l}.attention"), true, Box::new(att)),
                    "o" => (format!("l{l}.residual_norm"), false, Box::new(move |_| el(4 * s.d))),
                    "gate_up" => (format!("l{l}.swiglu"), false, Box::new(move |_| el(3 * s.ffn))),
                    _ => {
                        prev = outs;
                        continue;
                    }
                };
                specs.push(Spec { name, proc: Processor::Cpu, kv, after: outs });
                // Every CPU subgraph after an NPU graph waits for its output: one hand-off.
                times.push(Box::new(move |i| t(i) + sync_s));
                after = vec![specs.len() - 1];
            }
        }
        Self { dag: Dag { chunks, specs }, times }
    }

    pub fn t(&self, j: Job) -> f64 {
        (self.times[j.step])(j.chunk)
    }

    /// Busy time per processor over all chunks.
    pub fn work(&self, p: Processor) -> f64 {
        self.dag.in_model_order().filter(|j| self.dag.specs[j.step].proc == p).map(|j| self.t(j)).sum()
    }
}

/// Sites with shadow execution at pruning `prune`: the top `1 − prune` by llm.npu's importance
/// profile — high near the input and the output (§3.5, Fig. 12) — modelled as the layers
/// farthest from the middle, all four sites of a layer together.
pub fn shadow_by_depth(layers: usize, prune: f64) -> impl Fn(usize, usize) -> bool {
    let keep = ((1.0 - prune) * (layers * 4) as f64).round() as usize;
    let mut order: Vec<usize> = (0..layers).collect();
    let mid = (layers as f64 - 1.0) / 2.0;
    order.sort_by(|&a, &b| (b as f64 - mid).abs().total_cmp(&(a as f64 - mid).abs()).then(a.cmp(&b)));
    let mut keep_site = vec![[false; 4]; layers];
    for (n, (l, s)) in order.iter().flat_map(|&l| (0..4).map(move |s| (l, s))).enumerate() {
        keep_site[l][s] = n < keep;
    }
    move |l, s| keep_site[l][s]
}

/// llm.npu's INT8 chunked prefill of `prompt` tokens (chunks of `chunk`, out-of-order, shadow
/// execution at pruning `prune` by depth), modelled with `costs`: seconds.
pub fn int8_prefill_s(s: Shape, prompt: usize, chunk: usize, prune: f64, costs: Int8Costs) -> f64 {
    int8_prefill_timeline(s, prompt, chunk, prune, costs).1.makespan
}

/// [`int8_prefill_s`]'s model and its schedule (every job's processor, start and end).
pub fn int8_prefill_timeline(s: Shape, prompt: usize, chunk: usize, prune: f64, costs: Int8Costs) -> (Model, Timeline) {
    let chunk = chunk.max(1);
    let m = Model::with_costs(s, chunk, prompt.max(1).div_ceil(chunk), &shadow_by_depth(s.layers, prune), costs);
    let t = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j));
    (m, t)
}
