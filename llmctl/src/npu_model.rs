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
pub use llmd_engine::hetero::int8::{
    int8_prefill_s, int8_prefill_timeline, shadow_by_depth, Int8Costs, Int8Npu, Model, Shape, BUILD_S, CPU_ATTN_FLOPS,
    CPU_ELEMS_PER_S, OUTLIER_CHANNELS, QWEN1_5_1_8B, SYNC_S,
};
use llmd_engine::sched::{simulate, Policy, Processor};
use llmd_qnn_emu::emu::cost;

/// The emulator's Snapdragon 8 Gen 3 cost model for the NPU (llm.npu's fit) and the constants
/// of the CPU side and the hand-offs.
pub fn emulator_costs() -> Int8Costs {
    Int8Costs {
        npu: Int8Npu::Flat {
            launch_s: cost::LAUNCH_NS as f64 / 1e9,
            weight_bytes_per_s: cost::WEIGHT_BYTES_PER_S,
            ops_per_s: cost::OPS_PER_S,
        },
        cpu_attn_flops: CPU_ATTN_FLOPS,
        cpu_elems_per_s: CPU_ELEMS_PER_S,
        sync_s: SYNC_S,
    }
}

/// [`Model::with_costs`] on [`emulator_costs`].
fn model(s: Shape, chunk: usize, chunks: usize, shadow: &dyn Fn(usize, usize) -> bool) -> Model {
    Model::with_costs(s, chunk, chunks, shadow, emulator_costs())
}

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
    let one = model(s, 256, 1, &|_, _| false);
    let (npu1, cpu1) = (one.work(Processor::Npu), one.work(Processor::Cpu));
    // 2. Chunk-sharing vs one graph set per prompt length vs pad to the longest.
    let wbytes = (s.layers * (s.d * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.d + 3 * s.d * s.ffn)) as f64;
    let longest = *a.prompts.iter().max().unwrap_or(&a.chunk);
    let act = |rows: usize| (rows * (s.d + s.q_dim + 2 * s.kv_dim + 2 * s.ffn) * 4) as f64 * s.layers as f64;
    let mut graphs = Vec::new();
    for &p in &a.prompts {
        let chunks = p.div_ceil(a.chunk);
        let m = model(s, a.chunk, chunks, &|_, _| false);
        let shared = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j)).makespan;
        let per_len = model(s, p, 1, &|_, _| false);
        let per_len_s = simulate(&per_len.dag, Policy::OutOfOrder, &|j| per_len.t(j)).makespan;
        let pad = model(s, longest, 1, &|_, _| false);
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
        let m = model(s, a.chunk, chunks, &shadow_by_depth(s.layers, 0.85));
        let o = simulate(&m.dag, Policy::OutOfOrder, &|j| m.t(j));
        let i = simulate(&m.dag, Policy::InOrder, &|j| m.t(j));
        sched.push(serde_json::json!({
            "prompt": p, "chunks": chunks,
            "ooe_makespan_s": o.makespan, "in_order_makespan_s": i.makespan,
            "ooe_bubble": o.npu_bubble(), "in_order_bubble": i.npu_bubble(),
            "gain": 1.0 - o.makespan / i.makespan,
        }));
        for &r in &a.prune {
            let m = model(s, a.chunk, chunks, &shadow_by_depth(s.layers, r));
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
