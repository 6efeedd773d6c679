//! The NPU path's graphs on Qualcomm's own HTP library built for x86-64 (`scripts/fetch-qnn.sh`
//! fills the cache at set-up; `LLMD_QNN_LIB` names another copy) and on our emulator provider
//! (`libllmd_qnn_emu.so`, built as this test's dependency): every kind of graph the backend
//! builds — each linear group of a layer, at each chunk size, with and without bias, per-tensor
//! and per-channel weights, 8- and 16-bit outputs — against the engine's reference of the same integer arithmetic
//! (`backend::npu::quant::linear_reference`). The emulator must equal the reference bit for bit;
//! Qualcomm's library must stay within `MAX_LSB` of it on at most `MAX_DIFFERING_SHARE` of the
//! outputs.

mod common;

use llmd_engine::backend::npu::graph::{build_linear_group, run_linear_group, LinearGroup, Projection};
use llmd_engine::backend::npu::quant::{quantize_bias, ActQuant, QuantWeights};
use llmd_engine::backend::npu::QnnDevice;

/// Largest difference from the reference, in output codes: the HTP requantizes with fixed-point
/// multipliers and may round to the neighbouring code (the design's first probe: 1 LSB).
const MAX_LSB: i32 = 1;
/// Most outputs that may differ from the reference at all (the design's probe saw 7–9% on its
/// data; qnn-sys's own W8A8 test 0.8%).
const MAX_DIFFERING_SHARE: f64 = 0.10;
/// Chunk sizes the backend builds graphs for: llm.npu's C = 256 (its default on the Snapdragon 8
/// Gen 3) and 32 for short prompts.
const CHUNKS: [usize; 2] = [32, 256];
/// SM8650 (Snapdragon 8 Gen 3), QNN's `Qnn_SocModel_t` 57.
const SM8650: u32 = 57;

/// Deterministic values with a roughly normal spread (sum of four uniforms), seeded.
fn normal(seed: u64, n: usize, sd: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32) / ((1u64 << 24) as f32) - 0.5
    };
    (0..n).map(|_| (next() + next() + next() + next()) * sd * 1.7).collect()
}

/// A linear group of SmolLM2-135M's shapes (hidden 576, 9 heads and 3 KV heads of 64, FFN 1536)
/// with synthetic weights; each output's quantization calibrated on `x` as a calibration pass
/// would (the float outputs' range).
#[allow(clippy::too_many_arguments)]
fn group(
    name: &str,
    k: usize,
    outs: &[(&str, usize)],
    bias: bool,
    per_channel: bool,
    out_bits: u8,
    x: &[f32],
    m: usize,
) -> LinearGroup {
    let (lo, hi) = x.iter().fold((0.0f32, 0.0f32), |(a, b), &v| (a.min(v), b.max(v)));
    let input = ActQuant::from_range(lo, hi).expect("input range");
    let projections = outs
        .iter()
        .enumerate()
        .map(|(i, &(pname, n))| {
            let w = normal(1000 + i as u64 * 7 + k as u64, n * k, 0.05);
            let b = bias.then(|| normal(2000 + i as u64, n, 0.2));
            let weights = QuantWeights::quantize(&w, n, k, per_channel).expect("weights");
            let bias_q = b.as_ref().map(|b| quantize_bias(b, input.scale, &weights).expect("bias"));
            // The float outputs' range, for the output quantization.
            let (mut ylo, mut yhi) = (0.0f32, 0.0f32);
            for r in 0..m {
                for o in 0..n {
                    let v: f32 =
                        (0..k).map(|j| x[r * k + j] * w[o * k + j]).sum::<f32>() + b.as_ref().map_or(0.0, |b| b[o]);
                    ylo = ylo.min(v);
                    yhi = yhi.max(v);
                }
            }
            Projection {
                name: pname.into(),
                weights,
                bias: bias_q,
                output: ActQuant::from_range_bits(ylo, yhi, out_bits).expect("range"),
                gain: None,
            }
        })
        .collect();
    LinearGroup { name: name.into(), input, projections }
}

/// A group's kind: its name, input width, and its projections' names and widths.
type GroupKind<'a> = (&'a str, usize, Vec<(&'a str, usize)>);

/// Builds, finalizes and runs `g` at `chunk` rows in a new context of `device`; returns the
/// outputs and the finalize and run times in seconds.
fn run_on(device: &QnnDevice, g: &LinearGroup, chunk: usize, xq: &[u8]) -> (Vec<Vec<u16>>, f64, f64) {
    let context = device.context().expect("context");
    let t0 = std::time::Instant::now();
    let mut graph = build_linear_group(&context, g, chunk).expect("graph builds and finalizes");
    let built = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let got = run_linear_group(&mut graph, g, chunk, xq).expect("graph runs");
    (got, built, t1.elapsed().as_secs_f64())
}

/// How many outputs differ, and by how much at most.
fn compare(got: &[Vec<u16>], want: &[Vec<u16>]) -> (usize, usize, i32) {
    let (mut differing, mut total, mut max) = (0usize, 0usize, 0i32);
    for (gp, wp) in got.iter().zip(want) {
        assert_eq!(gp.len(), wp.len());
        for (&a, &b) in gp.iter().zip(wp) {
            let d = (i32::from(a) - i32::from(b)).abs();
            differing += usize::from(d != 0);
            max = max.max(d);
        }
        total += wp.len();
    }
    (differing, total, max)
}

#[test]
fn every_linear_group_runs_on_qualcomms_library_within_one_lsb_and_on_the_emulator_exactly() {
    let htp = QnnDevice::open(&common::htp_library(), SM8650).expect("libQnnHtp.so opens");
    let emu = QnnDevice::open(&common::emulator_library(), SM8650).expect("libllmd_qnn_emu.so opens");
    let (hidden, q, kv, ffn) = (576usize, 576usize, 192usize, 1536usize);
    let kinds: [GroupKind; 4] = [
        ("qkv", hidden, vec![("q", q), ("k", kv), ("v", kv)]),
        ("o", q, vec![("o", hidden)]),
        ("gate_up", hidden, vec![("gate", ffn), ("up", ffn)]),
        ("down", ffn, vec![("down", hidden)]),
    ];
    let mut worst = (0i32, 0.0f64);
    for &chunk in &CHUNKS {
        for (kind, k, outs) in &kinds {
            for (bias, per_channel, out_bits) in
                [(false, false, 8), (true, false, 8), (false, true, 8), (false, false, 16), (true, false, 16)]
            {
                let x = normal(chunk as u64 + *k as u64, chunk * k, 1.0);
                let g = group(kind, *k, outs, bias, per_channel, out_bits, &x, chunk);
                let mut xq = vec![0u8; x.len()];
                g.input.quantize(&x, &mut xq);
                let want = g.reference(&xq, chunk);
                let (on_emu, _, _) = run_on(&emu, &g, chunk, &xq);
                assert!(on_emu == want, "{kind} chunk {chunk} bias {bias} per-channel {per_channel}: the emulator differs from the reference");
                let (on_htp, built, ran) = run_on(&htp, &g, chunk, &xq);
                let (differing, total, max) = compare(&on_htp, &want);
                let share = differing as f64 / total as f64;
                eprintln!(
                    "{kind:8} chunk {chunk:3} bias {bias:5} per-channel {per_channel:5} out {out_bits:2}-bit: HTP {differing:6} of {total:7} differ ({:.2}%), max {max} LSB (emulator: exact); HTP finalize {built:.2} s, run {ran:.2} s",
                    100.0 * share,
                );
                assert!(max <= MAX_LSB, "{kind} chunk {chunk}: {max} LSB");
                assert!(share <= MAX_DIFFERING_SHARE, "{kind} chunk {chunk}: {:.2}% differ", 100.0 * share);
                worst = (worst.0.max(max), worst.1.max(share));
            }
        }
    }
    eprintln!("worst on Qualcomm's library: {} LSB, {:.2}% of outputs differing; the emulator equals the reference everywhere", worst.0, 100.0 * worst.1);
}

#[test]
fn a_group_whose_shapes_do_not_fit_is_refused_before_qnn_sees_it() {
    let x = normal(1, 4 * 8, 1.0);
    let mut g = group("bad", 8, &[("a", 4), ("b", 4)], true, false, 8, &x, 4);
    // b's weights are 4 × 6: its input width is not the group's.
    g.projections[1].weights = QuantWeights::quantize(&normal(2, 24, 0.1), 4, 6, false).expect("weights");
    let e = g.check().expect_err("refused");
    assert!(e.to_string().contains("b takes 6 inputs"), "{e}");
    let mut g2 = group("bad2", 8, &[("a", 4)], true, false, 8, &x, 4);
    g2.projections[0].bias = Some(vec![0; 3]);
    assert!(g2.check().expect_err("refused").to_string().contains("3 biases for 4 channels"));
    // A 16-bit output zero point of 32768: Qualcomm's library computes garbage there.
    let mut g4 = group("bad4", 8, &[("a", 4)], false, false, 16, &x, 4);
    g4.projections[0].output.zero_point = 32768;
    assert!(g4.check().expect_err("refused").to_string().contains("32768"));
    assert_ne!(
        ActQuant::from_range_bits(-1.0, 1.0, 16).expect("range").zero_point,
        32768,
        "a symmetric range avoids it"
    );
    // Per-channel weights with 16-bit outputs: Qualcomm's library fails them at finalize.
    let g3 = group("bad3", 8, &[("a", 4)], false, true, 16, &x, 4);
    assert!(g3.check().expect_err("refused").to_string().contains("per-channel weights with 16-bit outputs"));
}

#[test]
fn opening_a_qnn_library_names_the_step_that_failed() {
    use llmd_engine::error::NpuError;
    let dir = std::env::temp_dir().join(format!("llmd-qnn-open-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let not_elf = dir.join("libQnnHtp.so");
    std::fs::write(&not_elf, b"not a shared library").expect("written");
    for path in [dir.join("missing/libQnnHtp.so"), not_elf] {
        match QnnDevice::open(&path, SM8650) {
            Err(NpuError::Open { path: p, .. }) => assert_eq!(p, path),
            Err(e) => panic!("{}: another error: {e}", path.display()),
            Ok(_) => panic!("{} opened", path.display()),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Both libraries: the HTP provider found, its build id read, the chip kept.
    for path in [common::emulator_library(), common::htp_library()] {
        let d = QnnDevice::open(&path, SM8650).expect("opens");
        assert!(d.provider().usable_htp && d.provider().backend_id == 6, "{:?}", d.provider());
        assert!(!d.build_id().is_empty(), "{}: no build id", path.display());
        assert_eq!((d.soc(), d.path()), (SM8650, path.as_path()));
        let listed = QnnDevice::providers(&path).expect("providers");
        assert!(listed.contains(d.provider()), "{listed:?}");
    }
}

#[test]
fn the_npu_device_refuses_what_it_cannot_run_with_a_typed_error() {
    use llmd_device::{BufferUsage, Device, DeviceError, GgmlType, HostWeight, Subgraph, WeightRole};
    let m = common::default_model();
    let shape = m.transformer.shape;
    let npu = QnnDevice::open(&common::emulator_library(), SM8650).expect("opens").with_token_counts(&[1, 32]);
    assert!(npu.desc().static_shapes.allows(32) && !npu.desc().static_shapes.allows(33));
    let cpu = llmd_engine::backend::cpu::device::CpuDevice::new(1);
    let wq = &m.transformer.weights.layers[0].wq;
    let data = wq.source_bytes().expect("mapped");
    let hw = HostWeight { role: WeightRole::Wq, ty: wq.ty, rows: wq.rows, cols: wq.cols, data, host: None };
    let w = npu.load_weight(&hw, 0..64).expect("loads a row range");
    let unsupported = |e: DeviceError| matches!(e, DeviceError::Unsupported { .. });
    let invalid = |e: DeviceError| matches!(e, DeviceError::Invalid { .. });
    // Not a graph kind it takes, not a static token count, the wrong weight, no KV caches.
    assert!(unsupported(npu.prepare(Subgraph::ffn(0), &shape, 32, std::slice::from_ref(&w)).expect_err("refused")));
    assert!(unsupported(
        npu.prepare(Subgraph::linear(0, WeightRole::Wq), &shape, 33, std::slice::from_ref(&w)).expect_err("refused")
    ));
    assert!(invalid(
        npu.prepare(Subgraph::linear(0, WeightRole::Wk), &shape, 32, std::slice::from_ref(&w)).expect_err("refused")
    ));
    assert!(invalid(npu.prepare(Subgraph::linear(0, WeightRole::Wq), &shape, 32, &[]).expect_err("refused")));
    assert!(unsupported(npu.alloc(BufferUsage::Kv, 64).expect_err("refused")));
    // A weight's bytes that do not hold its shape, a handle of another device, a range past a
    // buffer's end.
    let short = HostWeight { data: &data[..10], ..hw };
    assert!(invalid(npu.load_weight(&short, 0..1).expect_err("refused")));
    let wrong_type = HostWeight { ty: GgmlType::F32, ..hw };
    assert!(invalid(npu.load_weight(&wrong_type, 0..1).expect_err("refused")));
    let theirs = cpu.alloc(BufferUsage::Activations, 16).expect("alloc");
    assert!(invalid(npu.write(&theirs, 0, &[0; 4], &[]).expect_err("refused")));
    let mine = npu.alloc(BufferUsage::Activations, 16).expect("alloc");
    assert!(invalid(npu.write(&mine, 14, &[0; 4], &[]).expect_err("refused")));
    let cpu_w = cpu.load_weight(&hw, 0..64).expect("cpu loads");
    assert!(invalid(npu.prepare(Subgraph::linear(0, WeightRole::Wq), &shape, 32, &[cpu_w]).expect_err("refused")));
}

#[test]
fn the_npu_device_estimates_its_graphs_from_the_soc_profile() {
    use llmd_device::{Device, Subgraph, WeightRole};
    let shape = common::default_model().transformer.shape;
    let soc = llmd_engine::hetero::soc::find(None, "snapdragon_8gen3").expect("a built-in profile");
    let open = || QnnDevice::open(&common::emulator_library(), SM8650).expect("opens").with_token_counts(&[1, 32, 256]);
    let up = Subgraph::linear(0, WeightRole::Up);
    assert_eq!(open().estimate(up, &shape, 32), None, "no profile, no figures");
    let npu = open().with_profile(soc.clone());
    let (d, f) = (shape.d_model, shape.ffn_dim);
    // A pass of 20 tokens runs in the 32-token graph: its price, HeteroLLM's model of it.
    let c = npu.estimate(up, &shape, 20).expect("priced");
    assert_eq!(c.compute_s, soc.npu_matmul_s(32, d, f, 16.0));
    assert_eq!(npu.estimate(up, &shape, 32), Some(c));
    let one = npu.estimate(up, &shape, 1).expect("priced").compute_s;
    let big = npu.estimate(up, &shape, 256).expect("priced").compute_s;
    assert!(one < c.compute_s && c.compute_s < big, "{one} {} {big}", c.compute_s);
    // Down reads the FFN's width: its own shape.
    let down = npu.estimate(Subgraph::linear(0, WeightRole::Down), &shape, 32).expect("priced");
    assert_eq!(down.compute_s, soc.npu_matmul_s(32, f, d, 16.0));
    // Past its largest graph, and kinds it does not run: no figure.
    assert_eq!(npu.estimate(up, &shape, 257), None);
    assert_eq!(npu.estimate(Subgraph::attention(0), &shape, 32), None);
    // A W8A8 group: one INT8 graph of its projections over the rows asked, on the footing of
    // the fp16 graphs: the launch, then per node the slower of its int8 weights and uint8
    // activations at the NPU's bandwidth and its operations at the shape's fp16 rate times
    // `int8_over_fp16` — written out here from that definition.
    let gate_up = Subgraph::group(0, llmd_device::GroupSite::GateUp);
    let want = |p: &llmd_engine::hetero::soc::Soc, m: usize| {
        let n = &p.npu;
        let bytes = (d * f + m * (d + f)) as f64;
        let node = (bytes / (n.bandwidth_gb_per_s * 1e9 * p.npu_speed))
            .max(2.0 * (m * d * f) as f64 / (p.npu_rate(m, d, f) * n.int8_over_fp16));
        n.launch_us * 1e-6 + 2.0 * node
    };
    for m in [1, 20, 300] {
        let got = npu.estimate(gate_up, &shape, m).expect("priced").compute_s;
        assert!((got - want(&soc, m)).abs() <= 1e-15, "{m} rows: {got} vs {}", want(&soc, m));
    }
    // The chip's own profile (QNN's SoC model 43, 57, 69): the 8 Gen 2's NPU is the slower.
    let by_chip = |chip| {
        QnnDevice::open(&common::emulator_library(), chip)
            .expect("opens")
            .with_chip_profile()
            .estimate(gate_up, &shape, 256)
    };
    let (gen2, gen3) = (by_chip(43).expect("8 Gen 2"), by_chip(SM8650).expect("8 Gen 3"));
    assert!(gen2.compute_s > gen3.compute_s, "{gen2:?} {gen3:?}");
    assert_eq!(by_chip(30), None, "SM8350 has no built-in profile");
}

/// llm.npu's W8A8 groups as the NPU device's second graph kind: a model's groups (calibrated,
/// quantized, their graphs built in a context of the device) are the device's weights of each
/// `Group` subgraph, and a group prepared, written, submitted and read through the contract
/// gives the groups' own run (`NpuLinears::run`, checked against the integer reference above)
/// bit for bit — at a token count that is not the graphs' chunk size (two chunks, the last
/// padded) — on the emulator (every layer, shadow execution on) and on Qualcomm's library
/// (two layers, to keep finalizing short). A weight that is not this device's group of that
/// layer and site is refused with a typed error.
#[test]
fn a_models_w8a8_groups_run_as_the_npu_devices_group_subgraphs() {
    use llmd_device::{Bindings, BufferUsage, Device, DeviceError, Subgraph};
    use llmd_engine::backend::blocks::CaptureSite;
    use llmd_engine::prefill::{
        calibrate, quantized_groups, shadow_sites, NpuLinears, ShadowConfig, WeightQuant, CALIBRATION_TEXT,
        DEFAULT_PRUNE,
    };
    use std::sync::Arc;
    const CHUNK: usize = 32;
    const ROWS: usize = 45;
    let m = common::default_model();
    let shape = m.transformer.shape;
    let cal_tokens = m.tokenizer.encode(CALIBRATION_TEXT, false, false).expect("calibration");
    let cal = calibrate(&m.transformer, &cal_tokens).expect("calibrates");
    let sites = cal.shadow_sites(DEFAULT_PRUNE);
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &sites).expect("quantizes");
    let flat: Vec<_> = groups.iter().flatten().cloned().collect();
    for (lib, layers) in [(common::emulator_library(), groups.len()), (common::htp_library(), 2)] {
        let dev = Arc::new(QnnDevice::open(&lib, SM8650).expect("opens"));
        let ctx = dev.context().expect("context");
        let mut npu = NpuLinears::build(&ctx, groups[..layers].to_vec(), CHUNK).expect("graphs");
        if layers == groups.len() {
            let sh = shadow_sites(&m.transformer, &flat, &cal, &sites, &ShadowConfig::default(), None).expect("sh");
            npu.set_shadow(sh).expect("shadow");
        }
        let npu = Arc::new(npu);
        let held = dev.group_weights(&npu);
        assert_eq!(held.len(), layers * 4, "a weight set per group");
        let mut checked = 0;
        for (sg, weights) in &held {
            if sg.layer != 0 && sg.layer + 1 != layers {
                continue;
            }
            let llmd_device::SubgraphKind::Group(site) = sg.kind else { panic!("{sg:?} is not a group") };
            let (k, rows) = npu.group_shape(sg.layer, site).expect("shape");
            let x = normal(sg.layer as u64 * 4 + site as u64, ROWS * k, 1.0);
            // The groups' own run.
            let mut want: Vec<Vec<f32>> = rows.iter().map(|&r| vec![0f32; ROWS * r]).collect();
            let mut views: Vec<&mut [f32]> = want.iter_mut().map(|w| &mut w[..]).collect();
            npu.run(sg.layer, site, &x, ROWS, &mut views).expect("runs");
            // Through the contract.
            let exe = dev.prepare(*sg, &shape, ROWS, weights).expect("prepares");
            let total: usize = rows.iter().map(|r| r * ROWS).sum();
            let xb = dev.alloc(BufferUsage::Activations, x.len() * 4).expect("x");
            let yb = dev.alloc(BufferUsage::Activations, total * 4).expect("y");
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let wrote = dev.write(&xb, 0, &bytes, &[]).expect("writes");
            // One position per row: the rows the group runs.
            let rows_bound: Arc<[u32]> = vec![0u32; ROWS].into();
            let bind = Bindings {
                x: xb,
                tokens: rows_bound.clone(),
                positions: rows_bound,
                seqs: Arc::from(Vec::new()),
                logit_rows: Arc::from(Vec::new()),
                logits: None,
                y: Some(yb.clone()),
                h: None,
            };
            let ran = dev.submit(&exe, &bind, &[wrote]).expect("submits");
            let mut raw = vec![0u8; total * 4];
            dev.read(&yb, 0, &mut raw, &[ran]).expect("reads");
            let got: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let want: Vec<u32> = want.iter().flatten().map(|v| v.to_bits()).collect();
            assert!(got == want, "{}: {sg:?} through the contract differs from the groups' run", lib.display());
            checked += 1;
        }
        assert_eq!(checked, if layers == 1 { 4 } else { 8 });
        // Typed refusals: another layer's or site's group, weights of the wrong roles, none.
        let invalid = |e: DeviceError| matches!(e, DeviceError::Invalid { .. });
        let (sg0, w0) = &held[0];
        assert!(invalid(dev.prepare(Subgraph::group(1, CaptureSite::Qkv), &shape, 8, w0).expect_err("refused")));
        assert!(invalid(dev.prepare(Subgraph::group(0, CaptureSite::O), &shape, 8, w0).expect_err("refused")));
        assert!(invalid(dev.prepare(*sg0, &shape, 8, &w0[..1]).expect_err("refused")));
        assert!(invalid(dev.prepare(*sg0, &shape, 8, &[]).expect_err("refused")));
        // One buffer bound as both the input and the outputs.
        let exe = dev.prepare(*sg0, &shape, 8, w0).expect("prepares");
        let one = dev.alloc(BufferUsage::Activations, 1 << 20).expect("alloc");
        let rows8: Arc<[u32]> = vec![0u32; 8].into();
        let both = Bindings {
            x: one.clone(),
            tokens: rows8.clone(),
            positions: rows8,
            seqs: Arc::from(Vec::new()),
            logit_rows: Arc::from(Vec::new()),
            logits: None,
            y: Some(one),
            h: None,
        };
        assert!(invalid(dev.submit(&exe, &both, &[]).expect_err("refused")));
        eprintln!("{}: {checked} groups through the contract equal the groups' own run", lib.display());
    }
}
