//! `llmctl npu-model`: llm.npu's prefill on a phone, **modelled** — the engine's out-of-order
//! scheduler (`llmd_engine::sched`) run as a discrete-event simulation over a model's shapes, with
//! every duration from a named input:
//!
//! - **NPU graphs**: the emulator provider's cost model of the Snapdragon 8 Gen 3
//!   (`llmd_qnn_emu::emu::cost`: 0.355 ms per launch, then the slower of the weights at
//!   12.66 GB/s and the MACs at 1.97 TOPS — fitted to llm.npu's Table 3 and its 315 ms of NPU
//!   time for a 256-token Qwen1.5-1.8B prompt).
//! - **CPU subgraphs** (norms, RoPE, attention, SwiGLU, shadow extraction): attention FLOPs at
//!   [`CPU_ATTN_FLOPS`] and element-wise work at [`CPU_ELEMS_PER_S`], both assumptions chosen so
//!   that the CPU's share of that same prompt is llm.npu's 157.5 ms ("about half" the NPU's).
//! - **Hand-offs**: every CPU subgraph that takes an NPU graph's output waits [`SYNC_S`]
//!   (HeteroLLM's "at least 400 µs" for a conventional cross-processor synchronization, the only
//!   measured per-sync figure; llm.npu gives a 29.7% latency share without pruning and none).
//! - **Shadow sites**: extraction and the outliers' product on the CPU beside the NPU graph,
//!   from the input the CPU already holds ([`OUTLIER_CHANNELS`] channels). On this engine's
//!   split — every NPU graph a linear group, norms and SwiGLU on the CPU — the hand-off is paid
//!   at every group whether or not it has shadow execution, so pruning saves only that CPU
//!   work; llm.npu's graphs fuse the element-wise work on the NPU, and a shadow site there
//!   splits a graph and adds hand-offs (its Fig. 16: 156 → 596 tok/s from 0 to 100% pruned).
//! - **Graph preparation**: llm.npu's Gemma-2B figures, 360 ms to build and 11.54 s to optimize
//!   a model's graphs for one shape.

use clap::Args;
use llmd_engine::sched::{simulate, Dag, Job, Policy, Processor, Spec};
use llmd_qnn_emu::emu::cost;

/// Attention FLOPs per second on the phone's CPU cores [assumption, calibrated: see the module].
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

#[derive(Args, Debug)]
pub struct NpuModelArgs {
    /// Prompt lengths to model.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    pub prompts: Vec<usize>,
    /// Chunk rows (llm.npu: 256 on the Snapdragon 8 Gen 3).
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// Pruning rates to model (share of sites without shadow execution).
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.8,0.85,1")]
    pub prune: Vec<f64>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The figures the INT8 model's durations come from: by default the emulator's Snapdragon 8
/// Gen 3 cost model and the constants above; `llmctl plan` gives a SoC profile's.
#[derive(Clone, Copy, Debug)]
pub struct Int8Costs {
    /// Per graph execution, seconds.
    pub launch_s: f64,
    /// INT8 weight bytes the NPU streams per second.
    pub weight_bytes_per_s: f64,
    /// INT8 operations per second at chunk sizes.
    pub ops_per_s: f64,
    pub cpu_attn_flops: f64,
    pub cpu_elems_per_s: f64,
    /// One NPU→CPU hand-off, seconds.
    pub sync_s: f64,
}

impl Default for Int8Costs {
    fn default() -> Self {
        Self {
            launch_s: cost::LAUNCH_NS as f64 / 1e9,
            weight_bytes_per_s: cost::WEIGHT_BYTES_PER_S,
            ops_per_s: cost::OPS_PER_S,
            cpu_attn_flops: CPU_ATTN_FLOPS,
            cpu_elems_per_s: CPU_ELEMS_PER_S,
            sync_s: SYNC_S,
        }
    }
}

impl Int8Costs {
    /// The NPU's time for one graph of `m` rows holding FullyConnected nodes `k × n` (the
    /// emulator's `cost::fc_ns` with these rates: `soc::int8_graph_s`).
    fn npu_s(&self, m: usize, fcs: &[(usize, usize)]) -> f64 {
        llmd_engine::hetero::soc::int8_graph_s(self.launch_s, self.weight_bytes_per_s, self.ops_per_s, m, fcs)
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
    pub fn new(s: Shape, chunk: usize, chunks: usize, shadow: &dyn Fn(usize, usize) -> bool) -> Self {
        Self::with_costs(s, chunk, chunks, shadow, Int8Costs::default())
    }

    /// [`Self::new`] with durations from `k`.
    pub fn with_costs(
        s: Shape,
        chunk: usize,
        chunks: usize,
        shadow: &dyn Fn(usize, usize) -> bool,
        k: Int8Costs,
    ) -> Self {
        let c = chunk as f64;
        let mut specs: Vec<Spec> = Vec::new();
        let mut times: Vec<Box<dyn Fn(usize) -> f64>> = Vec::new();
        let el = move |per_row: usize| c * per_row as f64 / k.cpu_elems_per_s;
        let mut prev: Vec<usize> = Vec::new();
        for l in 0..s.layers {
            let mut cpu = |name: String, kv: bool, t: Box<dyn Fn(usize) -> f64>, after: Vec<usize>| {
                specs.push(Spec { name, proc: Processor::Cpu, kv, after });
                times.push(t);
                specs.len() - 1
            };
            let hand_off = if l > 0 { k.sync_s } else { 0.0 };
            let norm = cpu(format!("l{l}.norm"), false, Box::new(move |_| el(3 * s.d) + hand_off), prev.clone());
            let (qd, kvd) = (s.q_dim, s.kv_dim);
            // Attention of chunk i: its rows against (i + 1/2)·C positions on average, QK and PV.
            let att = move |i: usize| {
                let ctx = (i as f64 + 0.5) * c;
                2.0 * 2.0 * c * ctx * qd as f64 / k.cpu_attn_flops + el(qd + kvd)
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
                    let t = el(kin) + c * OUTLIER_CHANNELS * n_out as f64 * 2.0 / k.cpu_attn_flops;
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
                times.push(Box::new(move |i| t(i) + k.sync_s));
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
fn shadow_by_depth(layers: usize, prune: f64) -> impl Fn(usize, usize) -> bool {
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
pub fn int8_prefill_timeline(
    s: Shape,
    prompt: usize,
    chunk: usize,
    prune: f64,
    costs: Int8Costs,
) -> (Model, llmd_engine::sched::Timeline) {
    let chunk = chunk.max(1);
    let m = Model::with_costs(s, chunk, prompt.max(1).div_ceil(chunk), &shadow_by_depth(s.layers, prune), costs);
    let t = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j));
    (m, t)
}

pub fn run(a: &NpuModelArgs) -> Result<(), String> {
    if a.chunk == 0 || a.prompts.contains(&0) {
        return Err("--chunk and every --prompts length must be at least 1".into());
    }
    if a.prune.iter().any(|p| !(0.0..=1.0).contains(p)) {
        return Err("--prune rates must be between 0 and 1".into());
    }
    let s = QWEN1_5_1_8B;
    let mut out = serde_json::Map::new();
    let header = format!(
        "MODELLED, not measured: {} shapes on the Snapdragon 8 Gen 3 profile (NPU: the emulator's cost model; CPU: {:.0} GFLOP/s attention, {:.0} G values/s element-wise; NPU→CPU hand-off {:.0} µs; graph build {:.2} s)",
        s.name,
        CPU_ATTN_FLOPS / 1e9,
        CPU_ELEMS_PER_S / 1e9,
        SYNC_S * 1e6,
        BUILD_S
    );
    // 1. Anchors: one 256-token chunk, no shadow.
    let one = Model::new(s, 256, 1, &|_, _| false);
    let (npu1, cpu1) = (one.work(Processor::Npu), one.work(Processor::Cpu));
    // 2. Chunk-sharing vs one graph set per prompt length vs pad to the longest.
    let wbytes = (s.layers * (s.d * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.d + 3 * s.d * s.ffn)) as f64;
    let longest = *a.prompts.iter().max().unwrap_or(&a.chunk);
    let act = |rows: usize| (rows * (s.d + s.q_dim + 2 * s.kv_dim + 2 * s.ffn) * 4) as f64 * s.layers as f64;
    let mut graphs = Vec::new();
    for &p in &a.prompts {
        let chunks = p.div_ceil(a.chunk);
        let m = Model::new(s, a.chunk, chunks, &|_, _| false);
        let shared = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j)).makespan;
        let per_len = Model::new(s, p, 1, &|_, _| false);
        let per_len_s = simulate(&per_len.dag, Policy::OutOfOrder, &|j| per_len.t(j)).makespan;
        let pad = Model::new(s, longest, 1, &|_, _| false);
        let pad_s = simulate(&pad.dag, Policy::OutOfOrder, &|j| pad.t(j)).makespan;
        graphs.push(serde_json::json!({
            "prompt": p,
            "chunk_sharing": {"latency_s": shared, "graph_bytes": wbytes + act(a.chunk), "build_s": 0.0, "padding": (chunks * a.chunk - p) as f64 / (chunks * a.chunk) as f64},
            "graph_per_length": {"latency_s": per_len_s, "first_latency_s": per_len_s + BUILD_S, "graph_bytes": wbytes + act(p), "build_s": BUILD_S},
            "pad_to_max": {"latency_s": pad_s, "graph_bytes": wbytes + act(longest), "build_s": 0.0, "padding": (longest - p) as f64 / longest as f64},
        }));
    }
    // 3. Out of order vs in order, and 4. pruning.
    let mut sched = Vec::new();
    let mut prune = Vec::new();
    for &p in &a.prompts {
        let chunks = p.div_ceil(a.chunk);
        let m = Model::new(s, a.chunk, chunks, &shadow_by_depth(s.layers, 0.85));
        let o = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j));
        let i = simulate(&m.dag, Policy::InOrder, &|j| m.t(j));
        sched.push(serde_json::json!({
            "prompt": p, "chunks": chunks,
            "ooe_makespan_s": o.makespan, "in_order_makespan_s": i.makespan,
            "ooe_bubble": o.npu_bubble(), "in_order_bubble": i.npu_bubble(),
            "gain": 1.0 - o.makespan / i.makespan,
        }));
        for &r in &a.prune {
            let m = Model::new(s, a.chunk, chunks, &shadow_by_depth(s.layers, r));
            let o = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j));
            prune.push(serde_json::json!({"prompt": p, "prune": r, "tok_s": p as f64 / o.makespan, "makespan_s": o.makespan, "bubble": o.npu_bubble()}));
        }
    }
    out.insert("labelled".into(), "modelled".into());
    out.insert("inputs".into(), header.clone().into());
    out.insert("npu_s_per_chunk256".into(), npu1.into());
    out.insert("cpu_s_per_chunk256".into(), cpu1.into());
    out.insert("graphs".into(), graphs.clone().into());
    out.insert("scheduler".into(), sched.clone().into());
    out.insert("pruning".into(), prune.clone().into());
    if a.json {
        crate::out!("{}", serde_json::Value::Object(out));
        return Ok(());
    }
    crate::out!("{header}");
    crate::out!(
        "one 256-token chunk: NPU {:.1} ms (llm.npu measured 315), CPU {:.1} ms (llm.npu: about half, 157.5)",
        npu1 * 1e3,
        cpu1 * 1e3
    );
    crate::out!("\nchunk-sharing (C={}) vs one graph set per prompt length vs padding to {longest}:", a.chunk);
    crate::out!("| prompt | sharing: latency, graph MB, padding | per length: latency (first use), graph MB | pad to max: latency, graph MB, padding |");
    crate::out!("|---|---|---|---|");
    for g in &graphs {
        let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(0.0);
        let (c, l, p) = (&g["chunk_sharing"], &g["graph_per_length"], &g["pad_to_max"]);
        crate::out!(
            "| {} | {:.0} ms, {:.0} MB, {:.0}% | {:.0} ms ({:.1} s), {:.0} MB | {:.0} ms, {:.0} MB, {:.0}% |",
            g["prompt"],
            f(c, "latency_s") * 1e3,
            f(c, "graph_bytes") / 1e6,
            f(c, "padding") * 100.0,
            f(l, "latency_s") * 1e3,
            f(l, "first_latency_s"),
            f(l, "graph_bytes") / 1e6,
            f(p, "latency_s") * 1e3,
            f(p, "graph_bytes") / 1e6,
            f(p, "padding") * 100.0
        );
    }
    let sum = |k: &str| graphs.iter().map(|g| g[k]["graph_bytes"].as_f64().unwrap_or(0.0)).sum::<f64>() / 1e6;
    crate::out!(
        "serving every length above: chunk-sharing keeps one graph set ({:.0} MB), per-length one per length ({:.0} MB, {} builds of {:.1} s), pad-to-max one ({:.0} MB)",
        graphs.first().map_or(0.0, |g| g["chunk_sharing"]["graph_bytes"].as_f64().unwrap_or(0.0)) / 1e6,
        sum("graph_per_length"),
        graphs.len(),
        BUILD_S,
        graphs.first().map_or(0.0, |g| g["pad_to_max"]["graph_bytes"].as_f64().unwrap_or(0.0)) / 1e6
    );
    crate::out!("\nout-of-order vs in-order (85% pruned; llm.npu: 37% bubbles in order, OOE 18–44% faster):");
    crate::out!("| prompt | chunks | in order: makespan, NPU bubbles | out of order: makespan, NPU bubbles | gain |");
    crate::out!("|---|---|---|---|---|");
    for r in &sched {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        crate::out!(
            "| {} | {} | {:.0} ms, {:.0}% | {:.0} ms, {:.0}% | {:.0}% |",
            r["prompt"],
            r["chunks"],
            f("in_order_makespan_s") * 1e3,
            f("in_order_bubble") * 100.0,
            f("ooe_makespan_s") * 1e3,
            f("ooe_bubble") * 100.0,
            f("gain") * 100.0
        );
    }
    crate::out!("\nprefill tok/s by pruning rate (llm.npu Fig. 16, Qwen1.5-1.8B: 156 / 544 / 596 at 0 / 80 / 100%):");
    crate::out!(
        "| prompt | {} |",
        a.prune.iter().map(|r| format!("{:.0}% pruned", r * 100.0)).collect::<Vec<_>>().join(" | ")
    );
    crate::out!("|---|{}", "---|".repeat(a.prune.len()));
    for &p in &a.prompts {
        let cells: Vec<String> = prune
            .iter()
            .filter(|r| r["prompt"].as_u64() == Some(p as u64))
            .map(|r| format!("{:.0}", r["tok_s"].as_f64().unwrap_or(0.0)))
            .collect();
        crate::out!("| {p} | {} |", cells.join(" | "));
    }
    Ok(())
}
