//! The default model (SmolLM2-135M, Q4_1) with every projection of every layer cut between the
//! NPU (fp16 graphs on the emulator provider) and the GPU (OpenCL), prompt and decode: its
//! greedy tokens against the CPU's, the same plan's unpartitioned forms (NPU only; GPU only)
//! and the solver's own plan. The float path (fp16 on the NPU, f32 on the GPU, no activation
//! quantization) and the CPU's (activations quantized to Q8_1 for the integer dots) differ by
//! float noise only; a step may part only at a near tie, [`NEAR_TIE`].

#![allow(clippy::unwrap_used)]

mod common;

use llmd_engine::backend::blocks::Logits;
use llmd_engine::backend::gpu::{GpuDevice, GpuOptions};
use llmd_engine::hetero::partition::{Cut, Segment, Sizes};
use llmd_engine::hetero::plan::{even_cut, HeteroPlan};
use llmd_engine::hetero::soc;
use llmd_engine::hetero::solver::{Op, Phase, Predicted, Solver};
use llmd_engine::model::Devices;
use llmd_engine::sched::Pinned;
use std::sync::atomic::Ordering;

/// Greedy steps compared.
const DECODED: usize = 12;
/// A top-two logit margin below this is a near tie: Q8_1 activations against f16 ones move
/// logits by a few hundredths (seen: see the test's output).
const NEAR_TIE: f32 = 0.25;
const SM8650: u32 = 57;

use common::argmax_and_margin;

/// Greedy tokens and margins: the prompt, then `DECODED` steps, every pass placed on `devs`
/// (None: the CPU), fed `forced` tokens when given (teacher forcing).
fn greedy(
    m: &llmd_engine::Model,
    prompt: &[u32],
    devs: Option<&Devices>,
    forced: Option<&[u32]>,
) -> (Vec<u32>, Vec<f32>) {
    let mut kv = m.transformer.new_kv();
    let pass = |kv: &mut llmd_engine::backend::kv::KvCache, toks: &[u32]| match devs {
        Some(d) => m.transformer.run(&mut [(kv, toks)], llmd_engine::model::Run::LAST.on(d)).unwrap().pop().unwrap(),
        None => m.transformer.forward(kv, toks, Logits::Last).unwrap(),
    };
    let mut logits = pass(&mut kv, prompt);
    let (mut toks, mut margins) = (Vec::new(), Vec::new());
    for i in 0..DECODED {
        let (t, mg) = argmax_and_margin(&logits);
        toks.push(t);
        margins.push(mg);
        logits = pass(&mut kv, &[forced.map_or(t, |f| f[i])]);
    }
    (toks, margins)
}

/// A cut of every kind on one plan: the prompt as a hybrid (standard graphs for the first
/// tokens over the first rows, the GPU the rest), decode as a row cut; rows at multiples of 64
/// (SmolLM2's widths are 192–1536: the paper's 256 would leave K and V whole).
fn forced(op: &Op) -> Cut {
    let rows = (op.n / 2 / 64 * 64).max(64).min(op.n);
    if op.m == 1 {
        return Cut::padded(1, 1, rows);
    }
    let (sizes, _) = Sizes::heterollm().greedy(op.m);
    if sizes.is_empty() {
        return Cut::padded(op.m, op.m, rows);
    }
    Cut::from_sizes(&sizes, rows)
}

/// `plan` for `counts` tokens as the executor's splitter over the emulated NPU (graphs for
/// the token counts the plan's NPU pieces run in) and `gpu`, every block on the host; the
/// NPU's graphs prepared through the contract. Returns the devices and the NPU graphs made.
fn hetero(
    t: &llmd_engine::model::Transformer,
    gpu: &std::sync::Arc<GpuDevice>,
    counts: &[usize],
    plan: &dyn Fn(&Op) -> Cut,
) -> (Devices, usize) {
    let planned = HeteroPlan::new(t.projections(), counts, plan).expect("planned");
    let npu = std::sync::Arc::new(
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650)
            .expect("the QNN library opens")
            .with_token_counts(&planned.npu_token_counts()),
    );
    let host = t.planner().backends().next().unwrap().name.clone();
    let devs = Devices::new(vec![npu, gpu.clone()], std::sync::Arc::new(Pinned { names: vec![host], pick: |_| 0 }))
        .with_splitter(std::sync::Arc::new(planned));
    let graphs = t.prepare_splits(&devs).expect("the plan's graphs are prepared");
    (devs, graphs)
}

#[test]
fn the_default_model_on_a_partitioned_plan_decodes_the_cpus_tokens() {
    let Ok(gpu) = GpuDevice::open(&GpuOptions::default()) else {
        assert!(std::env::var("LLMD_REQUIRE_OPENCL").is_err(), "LLMD_REQUIRE_OPENCL=1 and no OpenCL device");
        eprintln!("skipped: no OpenCL device");
        return;
    };
    let gpu = std::sync::Arc::new(gpu);
    let m = common::default_model();
    let prompt = m
        .tokenizer
        .encode("A prism splits white light into a spectrum because each wavelength bends by a different amount. The three primary colours of light are red, green and blue; mixing them in equal parts gives", false, false)
        .unwrap();
    let counts = [prompt.len(), 1];
    let soc = soc::find(None, "snapdragon_8gen3").unwrap();
    let prof = Predicted { soc: &soc, bits: 4.5 };
    let solved = |op: &Op| {
        let phase = if op.m == 1 { Phase::Decode } else { Phase::Prefill };
        Solver::new(&prof, &soc, phase, true).solve(op).cut
    };
    let npu_only = |op: &Op| Cut { npu: vec![Segment { tokens: 0..op.m, graph: op.m }], npu_rows: op.n };
    type Plan<'p> = (&'p str, &'p dyn Fn(&Op) -> Cut);
    let plans: [Plan; 4] = [
        ("partitioned", &forced),
        ("NPU only", &npu_only),
        ("GPU only", &|_: &Op| Cut::gpu_only()),
        ("solver", &solved),
    ];
    let (cpu, cpu_m) = greedy(m, &prompt, None, None);
    eprintln!("prompt {} tokens; CPU: {cpu:?}", prompt.len());
    let mut runs = Vec::new();
    for (name, plan) in plans {
        let (l, graphs) = hetero(&m.transformer, &gpu, &counts, plan);
        let (toks, margins) = greedy(m, &prompt, Some(&l), None);
        let s = &l.stats;
        eprintln!(
            "{name}: {toks:?} ({graphs} NPU graphs; {} matmuls, {} split, {} NPU and {} GPU pieces; {} fast-sync waits, {:.1} ms polling)",
            s.matmuls.load(Ordering::Relaxed),
            s.split_matmuls.load(Ordering::Relaxed),
            s.npu_parts.load(Ordering::Relaxed),
            s.gpu_parts.load(Ordering::Relaxed),
            l.sync.waits.load(Ordering::Relaxed),
            l.sync.polled_ns.load(Ordering::Relaxed) as f64 / 1e6
        );
        if name == "partitioned" {
            // A hybrid in prefill (standard graphs for the first tokens, half the rows), a
            // row cut in decode.
            assert!(prompt.len() > 32 && !prompt.len().is_multiple_of(32));
            assert!(s.split_matmuls.load(Ordering::Relaxed) > 0 && s.npu_parts.load(Ordering::Relaxed) > 0);
            assert_eq!(
                l.sync.waits.load(Ordering::Relaxed),
                s.split_matmuls.load(Ordering::Relaxed),
                "a fast-sync wait per cut matmul"
            );
        }
        // Against the CPU, teacher-forced so one parting does not cascade.
        let (tf, _) = greedy(m, &prompt, Some(&l), Some(&cpu));
        for (i, (&a, &b)) in cpu.iter().zip(&tf).enumerate() {
            assert!(a == b || cpu_m[i] < NEAR_TIE, "{name} step {i}: CPU {a}, hetero {b}, CPU margin {}", cpu_m[i]);
        }
        runs.push((name, toks, margins));
    }
    // Free-running against the unpartitioned NPU-only plan: equal up to a first parting, which
    // must be a near tie (after it the contexts differ).
    let base = &runs[1];
    for (name, toks, _) in &runs {
        if let Some(i) = base.1.iter().zip(toks).position(|(a, b)| a != b) {
            eprintln!("{name} parts from NPU-only at step {i}, where its margin is {:.3}", base.2[i]);
            assert!(
                base.2[i] < NEAR_TIE,
                "{name} step {i}: {} vs NPU-only {}, margin {}",
                toks[i],
                base.1[i],
                base.2[i]
            );
        }
    }
}

#[test]
fn a_prompt_length_without_a_plan_is_composed_from_the_planned_sizes() {
    let Ok(gpu) = GpuDevice::open(&GpuOptions::default()) else {
        assert!(std::env::var("LLMD_REQUIRE_OPENCL").is_err(), "LLMD_REQUIRE_OPENCL=1 and no OpenCL device");
        return;
    };
    let gpu = std::sync::Arc::new(gpu);
    let m = common::default_model();
    let prompt = m.tokenizer.encode("Water boils at one hundred degrees Celsius at sea level, but at the top of a high mountain, where the air is thinner and its pressure lower, it boils at a lower temperature, so that cooking pasta there takes", false, false).unwrap();
    assert!(prompt.len() > 32 && !prompt.len().is_multiple_of(32), "{}", prompt.len());
    eprintln!("prompt {} tokens: blocks of 32 and the rest on the GPU", prompt.len());
    let even = |op: &Op| even_cut(op, 64);
    let (l, _) = hetero(&m.transformer, &gpu, &[32, 1], &even);
    let (cpu, cpu_m) = greedy(m, &prompt, None, None);
    let (tf, _) = greedy(m, &prompt, Some(&l), Some(&cpu));
    let s = &l.stats;
    // Every prefill matmul: one 32-token block (NPU rows, GPU rows) and the rest on the GPU.
    assert!(s.split_matmuls.load(Ordering::Relaxed) >= 30 * 7 * (1 + DECODED as u64));
    for (i, (&a, &b)) in cpu.iter().zip(&tf).enumerate() {
        assert!(a == b || cpu_m[i] < NEAR_TIE, "step {i}: CPU {a}, hetero {b}, CPU margin {}", cpu_m[i]);
    }
    // The GPU keeps buffers for the planned sizes only, not for the count the prompt left over.
    let kept = l.kept_part_counts(2);
    assert!(!kept.is_empty() && kept.iter().all(|c| [32, 1].contains(c)), "kept {kept:?}");
}
