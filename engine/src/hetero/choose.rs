//! The per-SoC plan: how one model's requests should use the processors a device has,
//! **modelled** over its SoC profile — llm.npu's INT8 chunked prefill ([`super::int8`]) or
//! HeteroLLM's fp16 partitioned prefill ([`super::sim`]), the GPU's share of the partitioned
//! matmuls, and the decode placement (the GPU, or HeteroLLM's tensor-level cut). The daemon
//! makes one per model when it loads (`backend = "auto"`); `llmctl plan` prints it, with how
//! the decision moves with each figure the profile assumes ([`sensitivity`]).
//!
//! Both prefills are priced on one footing: the NPU's INT8 graphs from the same launch,
//! bandwidth and per-shape rates as its fp16 graphs (`Soc::npu_int8_graph_s`), and every
//! hand-off with the same synchronisation (fast: HeteroLLM's poll; else the conventional
//! cost) — so the choice comes from what differs (the bytes and rates of the two precisions,
//! and where attention runs), not from two papers' differently fitted figures.

use super::int8::{int8_prefill_s, Int8Costs, Int8Npu, Shape as Int8Shape};
use super::sim::{Shape, Sim, Strategy};
use super::soc::Soc;
use super::solver::Predicted;
use std::sync::Arc;

/// llm.npu's chunk on the 8 Gen 3.
pub const INT8_CHUNK: usize = 256;
/// llm.npu's default pruning (its §3.3: shadow execution in the top 15% of layers).
pub const INT8_PRUNE: f64 = 0.85;
/// INT8 prefill is chosen only this much faster than float: it changes the model's outputs
/// (W8A8 with shadow outliers: +2.9% perplexity on SmolLM2-135M at our default pruning,
/// docs/BENCHMARKS.md), float does not. **Decision** (ours).
pub const INT8_WORTH_X: f64 = 1.25;
/// HeteroLLM's tensor-level decode is chosen only this much faster than the GPU alone: it runs
/// one sequence at a time on the NPU's thread, where the GPU batches every app's decode.
/// **Decision** (ours).
pub const HETERO_DECODE_WORTH_X: f64 = 1.5;
/// The prompt length the daemon plans a model for (llm.npu's workloads: 500–1,800 tokens).
pub const PLAN_PROMPT: usize = 512;
/// The planner's rules, as a number a stored plan is keyed by: raise it with any change to
/// [`choose`], the cost models it prices with, or the constants above, so that plans stored by
/// an older llmd are made again rather than followed.
pub const PLANNER_VERSION: u32 = 1;

/// The processors a device has (that `auto` may take).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Present {
    pub npu: bool,
    pub gpu: bool,
}

/// How prompts are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillPlan {
    /// llm.npu: W8A8 linear groups on the NPU in chunks, shadow outliers and attention on the
    /// CPU, chunks out of order.
    Int8Chunked,
    /// HeteroLLM: every matmul cut between the NPU's fp16 graphs and the GPU.
    Fp16Partitioned,
    /// On the CPU (no NPU).
    Cpu,
}

/// Where decode steps run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodePlan {
    /// The GPU, batched across apps.
    Gpu,
    /// HeteroLLM's tensor-level cut between the NPU and the GPU, one sequence at a time.
    HeteroTensor,
    /// The CPU (no GPU).
    Cpu,
}

/// A model's plan on a SoC (see the module).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    pub soc: String,
    pub model: String,
    pub present: Present,
    /// The prompt length it was made for.
    pub prompt: usize,
    pub fast_sync: bool,
    pub prefill: PrefillPlan,
    pub decode: DecodePlan,
    /// Modelled prefill rates (tokens/s) of the two, when both processors are there.
    pub int8_prefill_tok_s: Option<f64>,
    pub float_prefill_tok_s: Option<f64>,
    /// The GPU's share of the partitioned prefill's matmul weights (0 when not partitioned).
    pub gpu_share: f64,
    /// Modelled decode steps/s: the GPU alone, and HeteroLLM's cut.
    pub gpu_decode_tok_s: Option<f64>,
    pub hetero_decode_tok_s: Option<f64>,
    /// Why, in a line.
    pub why: String,
}

/// A decoder's shape as the planner needs it, from a loaded model.
pub fn shape_of(model: &crate::Model, name: &str) -> Shape {
    let c = model.config();
    let l = &model.transformer.weights.layers[0];
    let ws = [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down];
    let bytes: usize = ws.iter().map(|w| w.size_bytes()).sum();
    let values: usize = ws.iter().map(|w| w.rows * w.cols).sum();
    Shape {
        name: name.to_owned(),
        layers: c.n_layers,
        d: c.d_model,
        q_dim: c.n_heads * c.head_dim,
        kv_dim: c.n_kv_heads * c.head_dim,
        ffn: c.ffn_dim,
        vocab: c.vocab_size,
        bits: if values > 0 { bytes as f64 * 8.0 / values as f64 } else { 4.5 },
    }
}

/// llm.npu's INT8 path on `soc`: its NPU on the fp16 graphs' footing, its CPU figures, and the
/// CPU–NPU hand-off of the same synchronisation as HeteroLLM's (`fast_sync`: a poll after a
/// predicted wait; else the conventional cost).
pub fn int8_costs(soc: &Soc, fast_sync: bool) -> Int8Costs {
    Int8Costs {
        npu: Int8Npu::Profile(Arc::new(soc.clone())),
        cpu_attn_flops: soc.cpu.attention_gflops * 1e9,
        cpu_elems_per_s: soc.cpu.elementwise_gelems_per_s * 1e9,
        sync_s: if fast_sync { soc.sync.poll_us } else { soc.sync.cpu_npu_handoff_us } * 1e-6,
    }
}

/// `shape` as the INT8 model takes it.
pub fn int8_shape(s: &Shape) -> Int8Shape {
    Int8Shape { name: "model", layers: s.layers, d: s.d, q_dim: s.q_dim, kv_dim: s.kv_dim, ffn: s.ffn }
}

/// Modelled INT8 chunked and fp16 partitioned prefill of `prompt` tokens, tokens/s.
pub fn prefill_rates(soc: &Soc, shape: &Shape, prompt: usize, fast_sync: bool) -> (f64, f64) {
    let prompt = prompt.max(1);
    let int8 =
        prompt as f64 / int8_prefill_s(int8_shape(shape), prompt, INT8_CHUNK, INT8_PRUNE, int8_costs(soc, fast_sync));
    let prof = Predicted { soc, bits: shape.bits };
    let float = Sim::new(soc, &prof).prefill(shape, prompt, Strategy::HeteroTensor, fast_sync).tok_per_s;
    (int8, float)
}

/// The plan for `shape` on `soc` with the processors `present`, for prompts of `prompt` tokens.
pub fn choose(soc: &Soc, shape: &Shape, prompt: usize, present: Present, fast_sync: bool) -> Plan {
    let prof = Predicted { soc, bits: shape.bits };
    let sim = Sim::new(soc, &prof);
    let mut plan = Plan {
        soc: soc.key.clone(),
        model: shape.name.clone(),
        present,
        prompt,
        fast_sync,
        prefill: PrefillPlan::Cpu,
        decode: DecodePlan::Cpu,
        int8_prefill_tok_s: None,
        float_prefill_tok_s: None,
        gpu_share: 0.0,
        gpu_decode_tok_s: None,
        hetero_decode_tok_s: None,
        why: String::new(),
    };
    let mut why = Vec::new();
    if present.gpu {
        let g = sim.decode(shape, prompt, Strategy::GpuOnly, fast_sync).tok_per_s;
        plan.gpu_decode_tok_s = Some(g);
        plan.decode = DecodePlan::Gpu;
        if present.npu {
            let h = sim.decode(shape, prompt, Strategy::HeteroTensor, fast_sync).tok_per_s;
            plan.hetero_decode_tok_s = Some(h);
            if h >= HETERO_DECODE_WORTH_X * g {
                plan.decode = DecodePlan::HeteroTensor;
            }
            why.push(format!(
                "decode {:.1} steps/s on the GPU, {h:.1} cut with the NPU ({} at ≥ {HETERO_DECODE_WORTH_X}×)",
                g,
                if plan.decode == DecodePlan::HeteroTensor { "cut" } else { "GPU" }
            ));
        } else {
            why.push(format!("decode {g:.1} steps/s on the GPU (no NPU)"));
        }
    } else {
        why.push("decode on the CPU (no GPU)".into());
    }
    match (present.npu, present.gpu) {
        (true, true) => {
            let (int8, float) = prefill_rates(soc, shape, prompt, fast_sync);
            plan.int8_prefill_tok_s = Some(int8);
            plan.float_prefill_tok_s = Some(float);
            let int8_wins = int8 >= INT8_WORTH_X * float;
            plan.prefill = if int8_wins { PrefillPlan::Int8Chunked } else { PrefillPlan::Fp16Partitioned };
            if !int8_wins {
                let p = sim.prefill(shape, prompt, Strategy::HeteroTensor, fast_sync);
                let all = p.npu_weight_bytes + p.gpu_weight_bytes;
                plan.gpu_share = if all > 0.0 { p.gpu_weight_bytes / all } else { 0.0 };
            }
            why.insert(
                0,
                format!(
                    "prefill of {prompt} tokens: INT8 chunked {int8:.0} tok/s, fp16 partitioned {float:.0} tok/s ({} at ≥ {INT8_WORTH_X}×)",
                    if int8_wins { "INT8" } else { "fp16" }
                ),
            );
        }
        (true, false) => {
            plan.prefill = PrefillPlan::Int8Chunked;
            why.insert(0, "prefill INT8 chunked on the NPU (no GPU for the partitioned fp16 plan)".into());
        }
        (false, _) => why.insert(0, "prefill on the CPU (no NPU)".into()),
    }
    plan.why = why.join("; ");
    plan
}

/// A figure of the profile the decision rests on, and how the INT8/float ratio moves with it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sensitivity {
    /// The profile's key (or the planner's constant).
    pub figure: &'static str,
    /// How the profile labels it: assumption, stated, derived, measured.
    pub label: &'static str,
    pub value: f64,
    /// (factor on the figure, INT8 tok/s / float tok/s) at 0.25×, 0.5×, 1×, 2×, 4×.
    pub ratios: Vec<(f64, f64)>,
    /// The factor at which the decision flips (the ratio crosses [`INT8_WORTH_X`]), if it
    /// does between 1/64× and 64×.
    pub flips_at: Option<f64>,
}

type Knob = (&'static str, &'static str, fn(&Soc) -> f64, fn(&mut Soc, f64));

/// The figures [`sensitivity`] moves.
const KNOBS: [Knob; 8] = [
    ("npu.launch_us", "assumption", |s| s.npu.launch_us, |s, v| s.npu.launch_us = v),
    ("npu.int8_over_fp16", "stated", |s| s.npu.int8_over_fp16, |s, v| s.npu.int8_over_fp16 = v),
    ("npu.fp16_tflops", "derived", |s| s.npu.fp16_tflops, |s, v| s.npu.fp16_tflops = v),
    ("npu.stage_exponent", "assumption", |s| s.npu.stage_exponent, |s, v| s.npu.stage_exponent = v),
    ("cpu.attention_gflops", "assumption", |s| s.cpu.attention_gflops, |s, v| s.cpu.attention_gflops = v),
    (
        "cpu.elementwise_gelems_per_s",
        "assumption",
        |s| s.cpu.elementwise_gelems_per_s,
        |s, v| s.cpu.elementwise_gelems_per_s = v,
    ),
    ("sync.poll_us", "stated", |s| s.sync.poll_us, |s, v| s.sync.poll_us = v),
    ("gpu.fp16_tflops", "measured", |s| s.gpu.fp16_tflops, |s, v| s.gpu.fp16_tflops = v),
];

/// How the INT8-or-float decision for `shape` moves with each figure the profile gives it
/// (each scaled alone, the others as they are).
pub fn sensitivity(soc: &Soc, shape: &Shape, prompt: usize, fast_sync: bool) -> Vec<Sensitivity> {
    KNOBS
        .iter()
        .map(|&(figure, label, get, set)| {
            let ratio = |f: f64| {
                let mut s = soc.clone();
                set(&mut s, get(soc) * f);
                let (i, fl) = prefill_rates(&s, shape, prompt, fast_sync);
                i / fl
            };
            let ratios: Vec<(f64, f64)> = [0.25, 0.5, 1.0, 2.0, 4.0].iter().map(|&f| (f, ratio(f))).collect();
            // Bisection in log space over 1/64..64 where the ratio crosses the threshold.
            let side = |f: f64| ratio(f) >= INT8_WORTH_X;
            let (mut lo, mut hi) = (1.0f64 / 64.0, 64.0f64);
            let flips_at = if side(lo) != side(hi) {
                let want = side(hi);
                for _ in 0..24 {
                    let mid = (lo * hi).sqrt();
                    if side(mid) == want {
                        hi = mid;
                    } else {
                        lo = mid;
                    }
                }
                Some(hi)
            } else {
                None
            };
            Sensitivity { figure, label, value: get(soc), ratios, flips_at }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hetero::sim::known_shape;
    use crate::hetero::soc::find;

    const BOTH: Present = Present { npu: true, gpu: true };

    #[test]
    fn int8_graphs_are_faster_than_fp16_ones_on_the_same_npu() {
        // One footing: the same shapes, launch and bandwidth; the rate ratio the hardware is
        // specified with. A 256-row gate/up of Llama-3-8B.
        let soc = find(None, "snapdragon_8gen3").expect("profile");
        let (d, f) = (4096, 14336);
        let int8 = soc.npu_int8_graph_s(256, &[(d, f)]);
        let fp16 = soc.npu_matmul_s(256, d, f, 16.0);
        assert!(int8 < fp16 && fp16 / int8 > 1.5, "int8 {int8} s, fp16 {fp16} s");
    }

    #[test]
    fn the_plan_follows_the_processors_present_and_the_modelled_rates() {
        let soc = find(None, "snapdragon_8gen3").expect("profile");
        let shape = known_shape("qwen1_5_1_8b").expect("shape");
        let none = choose(&soc, &shape, 512, Present { npu: false, gpu: false }, true);
        assert_eq!((none.prefill, none.decode), (PrefillPlan::Cpu, DecodePlan::Cpu));
        let gpu = choose(&soc, &shape, 512, Present { npu: false, gpu: true }, true);
        assert_eq!((gpu.prefill, gpu.decode), (PrefillPlan::Cpu, DecodePlan::Gpu));
        let npu = choose(&soc, &shape, 512, Present { npu: true, gpu: false }, true);
        assert_eq!((npu.prefill, npu.decode), (PrefillPlan::Int8Chunked, DecodePlan::Cpu));
        let both = choose(&soc, &shape, 512, BOTH, true);
        let (i, f) = (both.int8_prefill_tok_s.expect("int8"), both.float_prefill_tok_s.expect("float"));
        let want = if i >= INT8_WORTH_X * f { PrefillPlan::Int8Chunked } else { PrefillPlan::Fp16Partitioned };
        assert_eq!(both.prefill, want, "{both:?}");
        assert!(both.why.contains("tok/s"), "{}", both.why);
        // A CPU side fast enough (llm.npu's attention and norms there) makes INT8 win.
        let mut fast = soc.clone();
        fast.cpu.attention_gflops *= 16.0;
        fast.cpu.elementwise_gelems_per_s *= 16.0;
        assert_eq!(choose(&fast, &shape, 512, BOTH, true).prefill, PrefillPlan::Int8Chunked);
    }

    #[test]
    fn sensitivity_moves_the_ratio_with_each_figure_and_finds_where_it_flips() {
        let soc = find(None, "snapdragon_8gen3").expect("profile");
        let shape = known_shape("qwen1_5_1_8b").expect("shape");
        let rows = sensitivity(&soc, &shape, 512, true);
        assert_eq!(rows.len(), KNOBS.len());
        let at = |r: &Sensitivity, f: f64| r.ratios.iter().find(|x| x.0 == f).expect("factor").1;
        let attn = rows.iter().find(|r| r.figure == "cpu.attention_gflops").expect("row");
        assert!(at(attn, 4.0) > at(attn, 1.0), "a faster CPU side helps INT8: {attn:?}");
        let gpu = rows.iter().find(|r| r.figure == "gpu.fp16_tflops").expect("row");
        assert!(at(gpu, 4.0) < at(gpu, 1.0), "a faster GPU helps float: {gpu:?}");
        for r in rows.iter().filter_map(|r| r.flips_at.map(|f| (r, f))) {
            let (row, f) = r;
            let mut s = soc.clone();
            let knob = KNOBS.iter().find(|k| k.0 == row.figure).expect("knob");
            (knob.3)(&mut s, (knob.2)(&soc) * f * 1.05);
            let (a, b) = prefill_rates(&s, &shape, 512, true);
            let mut t = soc.clone();
            (knob.3)(&mut t, (knob.2)(&soc) * f / 1.05);
            let (c, d) = prefill_rates(&t, &shape, 512, true);
            assert_ne!(a / b >= INT8_WORTH_X, c / d >= INT8_WORTH_X, "{} flips near {f}", row.figure);
        }
    }
}
