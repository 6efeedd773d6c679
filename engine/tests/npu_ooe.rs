//! llm.npu's out-of-order prefill on real threads (`Transformer::prefill_out_of_order`): the
//! default model's chunks on the NPU path (emulator provider, shadow execution) with their
//! subgraphs run by an NPU thread and a CPU thread in the scheduler's order — llm.npu's
//! contribution score, the in-order baseline, and pseudo-random legal orders — all give the
//! in-order chunked prefill's logits and KV cache bit for bit, run by the engine's executor
//! over each layer's five parts (`Subgraph::layer_parts`). Every linear group runs through
//! the engine's executor as the NPU device's `Group` subgraph (`prefill::devices`), and the
//! product's job times (llm.npu's T(G), `Transformer::prefill_times`) are the device's estimates
//! of its groups.

mod common;

use llmd_engine::prefill::{
    calibrate, quantized_groups, shadow_sites, NpuLinears, ShadowConfig, WeightQuant, CALIBRATION_TEXT, DEFAULT_PRUNE,
};
use llmd_engine::sched::{Job, Policy, Processor};

const SM8650: u32 = 57;
const CHUNK: usize = 32;

fn kv_bytes(kv: &llmd_engine::backend::kv::KvCache) -> Vec<u8> {
    let mut b = Vec::new();
    kv.write_to(&mut b).expect("serializes");
    b
}

#[test]
fn every_legal_out_of_order_schedule_gives_the_in_order_bits() {
    let m = common::default_model();
    let cal_tokens = m.tokenizer.encode(CALIBRATION_TEXT, false, false).expect("calibration");
    let cal = calibrate(&m.transformer, &cal_tokens).expect("calibrates");
    let sites = cal.shadow_sites(DEFAULT_PRUNE);
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &sites).expect("quantizes");
    let flat: Vec<_> = groups.iter().flatten().cloned().collect();
    let device = std::sync::Arc::new(
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650)
            .expect("the QNN library opens")
            .with_chip_profile(),
    );
    let ctx = device.context().expect("context");
    let mut npu = NpuLinears::build(&ctx, groups, CHUNK).expect("graphs");
    npu.set_shadow(shadow_sites(&m.transformer, &flat, &cal, &sites, &ShadowConfig::default(), None).expect("shadow"))
        .expect("set");
    let npu = std::sync::Arc::new(npu);
    let devs = llmd_engine::prefill::devices(device, &npu);
    // Four chunks, the last one short; after a turn already in the cache.
    let history = m.tokenizer.encode("A short earlier turn.", false, false).expect("history");
    let prompt: Vec<u32> = cal_tokens[..3 * CHUNK + 11].to_vec();
    let fresh = || {
        let mut kv = m.transformer.new_kv();
        m.transformer.forward(&mut kv, &history, llmd_engine::backend::blocks::Logits::Last).expect("history");
        kv
    };
    // In order, chunk after chunk.
    let mut kv = fresh();
    let mut want = Vec::new();
    for part in prompt.chunks(CHUNK) {
        want = m
            .transformer
            .run(&mut [(&mut kv, part)], llmd_engine::model::Run::LAST.on(&devs))
            .expect("chunk")
            .pop()
            .expect("its logits");
    }
    let want_kv = kv_bytes(&kv);
    // llm.npu's profiled times stand in as: NPU subgraphs 2, attention 1 plus the chunk index.
    let dag = m.transformer.prefill_dag(&devs, prompt.len().div_ceil(CHUNK), CHUNK).expect("the job graph");
    // Every layer's four parts with a linear group in the NPU's lane, attention's core in the
    // CPU's (the splitter places the groups on the NPU device).
    let lanes: Vec<Processor> = dag.specs.iter().map(|s| s.proc).collect();
    assert_eq!(lanes.len(), 5 * m.config().n_layers);
    assert!(lanes
        .chunks(5)
        .all(|l| l == [Processor::Npu, Processor::Cpu, Processor::Npu, Processor::Npu, Processor::Npu]));
    let times = |j: Job| if dag.specs[j.step].proc == Processor::Npu { 2.0 } else { 1.0 + j.chunk as f64 };
    let mut orders = std::collections::HashSet::new();
    let policies = [Policy::OutOfOrder, Policy::InOrder, Policy::Random(1), Policy::Random(2), Policy::Random(3)];
    for policy in policies {
        let mut kv = fresh();
        let (got, tl) =
            m.transformer.prefill_out_of_order(&mut kv, &prompt, CHUNK, &devs, policy, &times).expect("prefills");
        assert_eq!(tl.runs.len(), dag.jobs(), "{policy:?}");
        assert!(
            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()) && got.len() == want.len(),
            "{policy:?}: logits differ"
        );
        assert!(kv_bytes(&kv) == want_kv, "{policy:?}: KV caches differ");
        let order: Vec<Job> = tl.order(Processor::Npu).into_iter().chain(tl.order(Processor::Cpu)).collect();
        let out_of_model_order = tl.order(Processor::Npu).windows(2).filter(|w| w[1] < w[0]).count();
        eprintln!(
            "{policy:?}: {} jobs in {:.2} s, NPU thread idle {:.0}%, {out_of_model_order} NPU subgraphs run before an earlier one",
            tl.runs.len(),
            tl.makespan,
            100.0 * tl.npu_bubble()
        );
        orders.insert(order);
    }
    assert!(orders.len() >= 3, "the policies ran only {} distinct orders", orders.len());
    // The product's T(G): each NPU subgraph's time is the device's estimate of its groups over
    // the chip's profile — INT8 graphs on the footing of its fp16 ones (the launch, then per
    // node the slower of its int8 weights and uint8 activations at the NPU's bandwidth and its
    // operations at the shape's fp16 rate times int8_over_fp16), written here from that
    // definition. The emulator's modelled time of the same groups is llm.npu's own cost model
    // (launch 0.355 ms, 12.66 GB/s of int8 weights, 1.97 TOPS), checked below too.
    let s = m.transformer.shape;
    let (d, q, kv, f) = (s.d_model, s.q_dim(), s.kv_dim(), s.ffn_dim);
    let soc = llmd_engine::hetero::soc::for_qnn_chip(SM8650).expect("the 8 Gen 3's profile");
    let graph_s = |rows: usize, fcs: &[(usize, usize)]| {
        soc.npu.launch_us * 1e-6
            + fcs
                .iter()
                .map(|&(k, n)| {
                    let bytes = (k * n + rows * (k + n)) as f64 / (soc.npu.bandwidth_gb_per_s * 1e9 * soc.npu_speed);
                    bytes.max(2.0 * (rows * k * n) as f64 / (soc.npu_rate(rows, k, n) * soc.npu.int8_over_fp16))
                })
                .sum::<f64>()
    };
    let llm_npu_s = |rows: usize, fcs: &[(usize, usize)]| {
        0.355e-3
            + fcs
                .iter()
                .map(|&(k, n)| ((k * n) as f64 / 12.66e9).max(2.0 * (rows * k * n) as f64 / 1.97e12))
                .sum::<f64>()
    };
    let qkv_s = |rows| graph_s(rows, &[(d, q), (d, kv), (d, kv)]);
    // The parts' groups in order (attention's core, step 1, has none).
    let part_s = |rows, step: usize| match step {
        0 => qkv_s(rows),
        2 => graph_s(rows, &[(q, d)]),
        3 => graph_s(rows, &[(d, f), (d, f)]),
        _ => graph_s(rows, &[(f, d)]),
    };
    let t = m.transformer.prefill_times(&devs, 0, prompt.len(), CHUNK);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.max(1e-12);
    for (chunk, rows) in [(0, CHUNK), (3, 11)] {
        for step in [0, 2, 3, 4, 5 + 3] {
            let got = t(Job { chunk, step });
            assert!(close(got, part_s(rows, step % 5)), "chunk {chunk}, step {step}: {got}");
        }
    }
    let before = npu.stats().1;
    let x = vec![0.5f32; CHUNK * d];
    let mut y: Vec<Vec<f32>> = vec![vec![0.0; CHUNK * q], vec![0.0; CHUNK * kv], vec![0.0; CHUNK * kv]];
    let mut views: Vec<&mut [f32]> = y.iter_mut().map(|v| &mut v[..]).collect();
    npu.run(0, llmd_engine::backend::blocks::CaptureSite::Qkv, &x, CHUNK, &mut views).expect("runs");
    let emulated = (npu.stats().1 - before) as f64 / 1e9;
    let llm_npu = llm_npu_s(CHUNK, &[(d, q), (d, kv), (d, kv)]);
    eprintln!(
        "QKV group of {CHUNK} rows: estimated {:.6} ms, the emulator's model (llm.npu's) {:.6} ms",
        qkv_s(CHUNK) * 1e3,
        emulated * 1e3
    );
    // The emulator rounds each node's time to a nanosecond: three nodes here.
    const EMULATOR_ROUNDING_S: f64 = 3e-9;
    assert!((emulated - llm_npu).abs() <= EMULATOR_ROUNDING_S, "{emulated} s modelled by the emulator");
    // Without a profile the device prices nothing: the shapes' multiply-accumulates instead.
    let plain = std::sync::Arc::new(
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("opens"),
    );
    let unpriced = llmd_engine::prefill::devices(plain, &npu);
    let t = m.transformer.prefill_times(&unpriced, 0, prompt.len(), CHUNK);
    assert_eq!(t(Job { chunk: 0, step: 0 }), (CHUNK * d * (q + 2 * kv)) as f64);
    // Every group of every chunk, in order and under each policy, was the NPU device's.
    let groups = (1 + policies.len()) * prompt.len().div_ceil(CHUNK) * m.config().n_layers * 4;
    assert_eq!(devs.stats.groups.load(std::sync::atomic::Ordering::Relaxed), groups as u64);
}
