//! One test body for every device of the contract: a projection's rows (`Subgraph::linear`,
//! the piece of a matmul a partitioned plan places on a device) submitted through `Device`
//! (`load_weight` of a row range, `prepare`, `alloc`, `write`, `submit`, `read`) on the CPU
//! device, on every OpenCL device and kernel variant here (PoCL; Intel's CPU runtime for the
//! subgroup and fp16 variants) and on the NPU (`QnnDevice`: llmd's emulator provider and
//! Qualcomm's x86-64 HTP library), each against its reference within its named tolerance:
//! - `CpuDevice`: the engine's own host matmul over the same rows, bit for bit (the same
//!   kernels on the same bytes);
//! - an OpenCL device: the f64 sum of the dequantized weights times `x`, relative to Σ|w·x|,
//!   within `check::MATMUL_REL_TOL` (`FP16_MATMUL_REL_TOL` for the fp16 kernels) — the
//!   tolerances the GPU's self-check documents;
//! - a QNN device: the same definition within `contract::F16_LINEAR_REL_TOL` (fp16 operands
//!   and output, as the GPU's fp16 kernels).
//!
//! The weights are the default model's own (its types and widths), at whole and partial row
//! ranges and token counts of a decode step, a short and a standard prefill block.
//!
//! The same devices then run a whole pass of the default model (a 32-token prompt and greedy
//! steps): a device that runs whole blocks takes every subgraph, one that runs projections only
//! (the NPU) every projection through the executor's splits, the host the rest — the CPU device
//! bit for bit the host's logits, every other device the CPU's greedy tokens or a parting at a
//! near tie.
//! `scripts/test.sh` sets LLMD_REQUIRE_OPENCL / _SUBGROUPS / _FP16: a runtime missing there
//! fails this test.

mod common;

use llmd_device::{Bindings, BlockShape, BufferUsage, Device, HostWeight, OpKind, Subgraph, WeightRole};
use llmd_engine::backend::cpu::device::CpuDevice;
use llmd_engine::backend::cpu::CpuBackend;
use llmd_engine::backend::gpu::{check, GpuDevice, GpuOptions, MatmulVariant};
use llmd_engine::backend::npu::contract::F16_LINEAR_REL_TOL;
use llmd_engine::backend::npu::QnnDevice;
use llmd_engine::backend::weight::WeightMatrix;
use llmd_engine::backend::Backend;
use llmd_engine::model::Devices;
use llmd_engine::sched::{Pinned, Split};
use std::ops::Range;
use std::sync::Arc;

/// QNN's SoC model of the Snapdragon 8 Gen 3 (the chip the NPU's graphs are built for).
const SM8650: u32 = 57;
/// The token counts the body runs: a decode step, a short and a standard prefill block.
const TOKEN_COUNTS: [usize; 3] = [1, 5, 32];

/// What a device's output is held to.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Bit for bit the host's own matmul.
    HostBits,
    /// Relative to Σ|w·x| against the f64 definition.
    Within(f64),
}

fn env_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// Every device to run the body on: the CPU device, and each OpenCL device and variant.
fn devices() -> Vec<(String, Arc<dyn Device>, Expect)> {
    let mut out: Vec<(String, Arc<dyn Device>, Expect)> =
        vec![("cpu-device".into(), Arc::new(CpuDevice::new(2)), Expect::HostBits)];
    let mut libraries = vec![None];
    if let Some(l) = std::env::var_os("LLMD_INTEL_OPENCL_LIB") {
        libraries.push(Some(std::path::PathBuf::from(l)));
    }
    let (mut opened, mut subgroups, mut halves) = (0, 0, 0);
    // Built programs kept between runs (each is checked against its driver before use).
    let cache = common::repo_root().join("target/test-cache/opencl");
    for library in libraries {
        let devices = match llmd_engine::backend::gpu::list_devices(library.as_deref()) {
            Ok((_, d)) => d,
            Err(e) if !env_on("LLMD_REQUIRE_OPENCL") => {
                eprintln!("no OpenCL devices of {library:?}: {e}");
                continue;
            }
            Err(e) => panic!("LLMD_REQUIRE_OPENCL=1 and {library:?} lists no devices: {e}"),
        };
        for (index, info) in devices.iter().enumerate() {
            // The variant a device of its kind runs by default, and the subgroup and fp16
            // kernels where it has them (every variant's arithmetic is `gpu_opencl`'s
            // self-check; this is the contract's path).
            let plain = if info.kind == "CPU" { MatmulVariant::RowPerItem } else { MatmulVariant::GroupPerRow };
            let mut variants = vec![(plain, false)];
            if llmd_engine::backend::gpu::subgroup_lanes(info).is_some() {
                variants.push((MatmulVariant::Subgroup, false));
            }
            if info.has("cl_khr_fp16") {
                variants.push((plain, true));
            }
            for (matmul, fp16) in variants {
                let opts = GpuOptions {
                    library: library.clone(),
                    device: Some(index),
                    matmul,
                    fp16: Some(fp16),
                    cache_dir: Some(cache.clone()),
                    ..Default::default()
                };
                let g = match GpuDevice::open(&opts) {
                    Ok(g) => g,
                    Err(e) => panic!("{} ({matmul:?}, fp16 {fp16}) did not open: {e}", info.name),
                };
                assert_eq!((g.matmul_variant(), g.fp16()), (matmul, fp16), "{}", info.name);
                opened += 1;
                subgroups += usize::from(matmul == MatmulVariant::Subgroup);
                halves += usize::from(fp16);
                let tol = if fp16 { check::FP16_MATMUL_REL_TOL } else { check::MATMUL_REL_TOL };
                let name =
                    format!("{} / {} ({matmul:?}{})", info.platform, info.name, if fp16 { ", fp16" } else { "" });
                out.push((name, Arc::new(g), Expect::Within(tol)));
            }
        }
    }
    // The NPU: the emulator provider and Qualcomm's library, each with graphs for the token
    // counts the body runs (an NPU graph is static).
    for (what, path) in [("emulator", common::emulator_library()), ("Qualcomm's HTP", common::htp_library())] {
        let dev = QnnDevice::open(&path, SM8650)
            .unwrap_or_else(|e| panic!("the {what} library did not open: {e}"))
            .with_token_counts(&TOKEN_COUNTS);
        out.push((format!("{} [{what}]", dev.desc().name), Arc::new(dev), Expect::Within(F16_LINEAR_REL_TOL)));
    }
    if env_on("LLMD_REQUIRE_OPENCL") {
        assert!(opened > 0, "LLMD_REQUIRE_OPENCL=1 and no OpenCL device opened");
    }
    if env_on("LLMD_REQUIRE_SUBGROUPS") {
        assert!(subgroups > 0, "LLMD_REQUIRE_SUBGROUPS=1 and no device runs the subgroup variant");
    }
    if env_on("LLMD_REQUIRE_FP16") {
        assert!(halves > 0, "LLMD_REQUIRE_FP16=1 and no device runs the fp16 variant");
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Rows `rows` of `w` times `m` rows of `x` on `dev`, through the contract.
fn linear_on(
    dev: &dyn Device,
    shape: &BlockShape,
    role: WeightRole,
    w: &WeightMatrix,
    rows: Range<usize>,
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    let data = w.source_bytes().expect("the model's rows are mapped");
    let hw = HostWeight { role, ty: w.ty, rows: w.rows, cols: w.cols, data, host: None };
    let weight = dev.load_weight(&hw, rows.clone()).expect("load_weight");
    let exe = dev.prepare(Subgraph::linear(0, role), shape, m, &[weight]).expect("prepare");
    submit_rows(dev, &exe, x, m, m * rows.len())
}

/// `m` rows of `x` through `exe` on `dev` (a projection's or a group's: no ids, positions or
/// caches), `outputs` f32 values back.
fn submit_rows(dev: &dyn Device, exe: &llmd_device::Executable, x: &[f32], m: usize, outputs: usize) -> Vec<f32> {
    let xb = dev.alloc(BufferUsage::Activations, x.len() * 4).expect("alloc x");
    let yb = dev.alloc(BufferUsage::Activations, outputs * 4).expect("alloc y");
    let wrote = dev.write(&xb, 0, &f32_bytes(x), &[]).expect("write");
    let zeros: Arc<[u32]> = vec![0u32; m].into();
    let bind = Bindings {
        x: xb,
        tokens: zeros.clone(),
        positions: zeros,
        seqs: Arc::new([]),
        logit_rows: Arc::new([]),
        logits: None,
        y: Some(yb.clone()),
        h: None,
    };
    let ev = dev.submit(exe, &bind, &[wrote]).expect("submit");
    let mut raw = vec![0u8; outputs * 4];
    dev.read(&yb, 0, &mut raw, &[ev]).expect("read");
    raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The host's own matmul over rows `rows` of `w` (a matrix of those rows, as a device that
/// keeps the host's layout loads it).
fn host_matmul(cpu: &CpuBackend, w: &WeightMatrix, rows: &Range<usize>, x: &[f32], m: usize) -> Vec<f32> {
    let rb = w.row_bytes();
    let data = w.source_bytes().expect("mapped")[rows.start * rb..rows.end * rb].to_vec();
    let part = WeightMatrix::from_host_bytes("rows", w.ty, rows.len(), w.cols, data).expect("a matrix");
    let mut y = vec![0f32; m * rows.len()];
    cpu.matmul(&part, x, m, &mut y).expect("host matmul");
    y
}

/// The worst error relative to Σ|w·x| against the f64 definition.
fn worst_against_definition(w: &WeightMatrix, rows: &Range<usize>, x: &[f32], m: usize, y: &[f32]) -> f64 {
    let mut row = vec![0f32; w.cols];
    let mut worst = 0f64;
    let mut buf = Vec::new();
    for (j, r) in rows.clone().enumerate() {
        w.read_row(r, &mut buf).expect("row");
        llmd_engine::quant::dequantize_row(w.ty, &buf, &mut row).expect("dequantized");
        for t in 0..m {
            let (mut sum, mut mag) = (0f64, 0f64);
            for (a, b) in row.iter().zip(&x[t * w.cols..(t + 1) * w.cols]) {
                let p = *a as f64 * *b as f64;
                sum += p;
                mag += p.abs();
            }
            let got = y[t * rows.len() + j] as f64;
            worst = worst.max((got - sum).abs() / mag.max(1e-30));
        }
    }
    worst
}

#[test]
fn a_projections_rows_run_through_the_contract_on_every_device_within_its_tolerance() {
    let m = common::default_model();
    let t = &m.transformer;
    let cpu = CpuBackend::new(2);
    let l = &t.weights.layers[0];
    let weights: [(WeightRole, &WeightMatrix); 3] =
        [(WeightRole::Wq, &l.wq), (WeightRole::Wk, &l.wk), (WeightRole::Down, &l.w_down)];
    let mut rng = check::Rng(0x11ea_4000);
    let mut runs = 0;
    for (name, dev, expect) in devices() {
        let mut worst = 0f64;
        for (role, w) in weights {
            let n = w.rows;
            for rows in [0..n, 0..n / 2, n / 3..n] {
                for tokens in TOKEN_COUNTS {
                    let x = rng.vec(tokens * w.cols);
                    let y = linear_on(&*dev, &t.shape, role, w, rows.clone(), &x, tokens);
                    let at = format!("{name}: {role:?} ({}) rows {rows:?}, {tokens} tokens", w.ty);
                    match expect {
                        Expect::HostBits => {
                            let want = host_matmul(&cpu, w, &rows, &x, tokens);
                            let (a, b): (Vec<u32>, Vec<u32>) =
                                (y.iter().map(|v| v.to_bits()).collect(), want.iter().map(|v| v.to_bits()).collect());
                            assert!(a == b, "{at}: not the host's bits");
                        }
                        Expect::Within(tol) => {
                            let e = worst_against_definition(w, &rows, &x, tokens, &y);
                            assert!(e <= tol, "{at}: off by {e:.2e}, past {tol:.0e}");
                            worst = worst.max(e);
                        }
                    }
                    runs += 1;
                }
            }
        }
        match expect {
            Expect::HostBits => eprintln!("{name:<70} bit-equal to the host"),
            Expect::Within(tol) => eprintln!("{name:<70} worst {worst:.2e} (tolerance {tol:.0e})"),
        }
    }
    assert!(runs >= 27 * 3, "{runs} runs: the CPU, an OpenCL device and the NPU at least");
}

/// Greedy steps a whole pass runs after its prompt.
const PASS_STEPS: usize = 6;
/// A top-two logit margin under which a device may pick the other token: its float arithmetic
/// (f32 sums in another order; fp16 operands) moves the default model's logits by a few
/// hundredths (`gpu_opencl`'s `NEAR_TIE`, and `hetero_model`'s).
const NEAR_TIE: f32 = 0.25;

/// A prompt of the `TOKEN_COUNTS`' standard block (32 tokens), then greedy steps: each
/// step's logits and token.
fn greedy_pass(m: &llmd_engine::Model) -> Vec<(Vec<f32>, u32)> {
    let t = &m.transformer;
    let text = "The history of the printing press begins in the fifteenth century, when movable type made \
                books cheaper and faster to produce than ever before. Within fifty years, presses in more \
                than two hundred towns had printed millions of copies, and";
    let prompt: Vec<u32> = m.tokenizer.encode(text, false, false).expect("encodes").into_iter().take(32).collect();
    assert_eq!(prompt.len(), 32);
    let mut kv = t.new_kv();
    let mut logits = t.forward(&mut kv, &prompt, llmd_engine::backend::blocks::Logits::Last).expect("the prompt");
    let mut out = Vec::new();
    for _ in 0..PASS_STEPS {
        let next = llmd_engine::sampling::argmax(&logits);
        out.push((logits, next));
        logits = t.forward(&mut kv, &[next], llmd_engine::backend::blocks::Logits::Last).expect("a step");
    }
    out
}

/// Every projection whole on device 1.
struct AllOnDevice;

impl llmd_engine::sched::Splitter for AllOnDevice {
    fn split(&self, _: usize, _: WeightRole, rows: usize, _: usize, _: &[&llmd_device::DeviceDesc]) -> Split {
        Split::Rows(vec![(1, 0..rows)])
    }
}

#[test]
fn a_whole_pass_runs_on_every_device_with_the_cpus_greedy_tokens() {
    use llmd_engine::{LoadOptions, Model};
    let load = || Model::load(&common::default_model_path(), &LoadOptions { threads: 2, ..Default::default() });
    let cpu = greedy_pass(&load().expect("loads"));
    let mut runs = 0;
    for (name, dev, expect) in devices() {
        let mut m = load().expect("loads");
        let host = m.transformer.planner().backends().next().expect("a host backend").name.clone();
        // A device that runs whole blocks takes every subgraph of the pass (the embedding and
        // head too); one that runs projections only (the NPU) takes every projection, the host
        // the rest.
        let blocks = dev.desc().ops.contains(&OpKind::Attention);
        let devs = if blocks {
            Devices::new(
                vec![dev.clone()],
                Arc::new(Pinned { names: vec![host, dev.desc().name.clone()], pick: |_| 1 }),
            )
        } else {
            Devices::new(vec![dev.clone()], Arc::new(Pinned { names: vec![host], pick: |_| 0 }))
                .with_splitter(Arc::new(AllOnDevice))
        };
        m.transformer.attach(devs);
        let t0 = std::time::Instant::now();
        let got = greedy_pass(&m);
        let split = m.transformer.devices().map_or(0, |d| d.stats.matmuls.load(std::sync::atomic::Ordering::Relaxed));
        assert!(blocks || split == 30 * 7 * (1 + PASS_STEPS as u64), "{name}: {split} projections on the device");
        let first_diff = cpu[0].0.iter().zip(&got[0].0).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        match expect {
            Expect::HostBits => {
                for (i, ((a, _), (b, _))) in cpu.iter().zip(&got).enumerate() {
                    assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()), "{name}: step {i} differs");
                }
            }
            Expect::Within(_) => {
                if let Some(i) = cpu.iter().zip(&got).position(|(a, b)| a.1 != b.1) {
                    let mut sorted = cpu[i].0.clone();
                    sorted.sort_by(|a, b| b.total_cmp(a));
                    let margin = sorted[0] - sorted[1];
                    eprintln!("{name}: parts from the CPU at step {i}, CPU margin {margin:.3}");
                    assert!(
                        margin < NEAR_TIE,
                        "{name}: step {i}: {} vs the CPU's {}, margin {margin}",
                        got[i].1,
                        cpu[i].1
                    );
                }
            }
        }
        eprintln!(
            "{name:<70} {} ({:.1} s; first logits within {first_diff:.2e} of the CPU's)",
            if blocks { "whole pass" } else { "every projection" },
            t0.elapsed().as_secs_f64()
        );
        runs += 1;
    }
    assert!(runs >= 3, "{runs} devices: the CPU, an OpenCL device and the NPU at least");
}

/// A layer's linear groups (`Subgraph::group`: Q, K and V; O; gate and up; down — one input,
/// each projection's rows in turn) through the contract on every device: prepared once (for
/// no particular count, as the executor does) and run at each of the body's token counts, which
/// a group's executable takes from its bindings. The CPU device gives the host's matmuls bit for
/// bit, an OpenCL device each projection within its tolerance of the definition. The NPU's
/// groups are the W8A8 graphs of the weights it calibrated and quantized (`QnnDevice::
/// group_weights`, run through the contract in `npu_qnn`'s body against their integer
/// reference); given a file's plain rows it refuses the group with a typed error.
#[test]
fn a_layers_linear_groups_run_through_the_contract_on_every_device() {
    use llmd_device::{DeviceError, GroupSite};
    let m = common::default_model();
    let t = &m.transformer;
    let cpu = CpuBackend::new(2);
    let mut rng = check::Rng(0x6a0_00b5);
    let (mut ran, mut refused) = (0, 0);
    for (name, dev, expect) in devices() {
        let mut worst = 0f64;
        for layer in [0, t.weights.layers.len() - 1] {
            let l = &t.weights.layers[layer];
            for site in GroupSite::ALL {
                let mats: Vec<(WeightRole, &WeightMatrix)> =
                    site.roles().iter().map(|&r| (r, l.matrix(r).expect("the layer's projection"))).collect();
                let weights: Vec<_> = mats
                    .iter()
                    .map(|(role, w)| {
                        let data = w.source_bytes().expect("the model's rows are mapped");
                        let hw = HostWeight { role: *role, ty: w.ty, rows: w.rows, cols: w.cols, data, host: None };
                        dev.load_weight(&hw, 0..w.rows).expect("load_weight")
                    })
                    .collect();
                let sg = Subgraph::group(layer, site);
                let exe = match (dev.prepare(sg, &t.shape, 0, &weights), expect) {
                    (Ok(e), _) => e,
                    // The NPU (its tolerance is the fp16 linears'): plain rows are not its groups.
                    (Err(DeviceError::Invalid { .. } | DeviceError::Unsupported { .. }), Expect::Within(tol))
                        if tol == F16_LINEAR_REL_TOL =>
                    {
                        refused += 1;
                        continue;
                    }
                    (Err(e), _) => panic!("{name}: {sg:?} refused: {e}"),
                };
                let k = mats[0].1.cols;
                let total_rows: usize = mats.iter().map(|(_, w)| w.rows).sum();
                for tokens in TOKEN_COUNTS {
                    let x = rng.vec(tokens * k);
                    let y = submit_rows(&*dev, &exe, &x, tokens, tokens * total_rows);
                    if dev.desc().processor == llmd_device::Processor::Gpu && tokens == 1 {
                        // One buffer as input and outputs: refused (its later projections would
                        // read what the first wrote).
                        let one = dev.alloc(BufferUsage::Activations, total_rows.max(k) * 4).expect("alloc");
                        let rows: Arc<[u32]> = vec![0u32; 1].into();
                        let both = Bindings {
                            x: one.clone(),
                            tokens: rows.clone(),
                            positions: rows,
                            seqs: Arc::new([]),
                            logit_rows: Arc::new([]),
                            logits: None,
                            y: Some(one),
                            h: None,
                        };
                        assert!(dev.submit(&exe, &both, &[]).is_err(), "{name}: a group on one buffer ran");
                    }
                    let mut at = 0;
                    for (role, w) in &mats {
                        let part = &y[at..at + tokens * w.rows];
                        at += tokens * w.rows;
                        let all = 0..w.rows;
                        let where_ =
                            format!("{name}: layer {layer}'s {site:?} group, {role:?} ({}), {tokens} tokens", w.ty);
                        match expect {
                            Expect::HostBits => {
                                let want = host_matmul(&cpu, w, &all, &x, tokens);
                                let same = part.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(same, "{where_}: not the host's bits");
                            }
                            Expect::Within(tol) => {
                                let e = worst_against_definition(w, &all, &x, tokens, part);
                                assert!(e <= tol, "{where_}: off by {e:.2e}, past {tol:.0e}");
                                worst = worst.max(e);
                            }
                        }
                    }
                    ran += 1;
                }
            }
        }
        eprintln!("{name:<70} groups: worst {worst:.2e}");
    }
    assert!(ran >= 2 * 2 * 4 * TOKEN_COUNTS.len(), "{ran} group runs: the CPU and an OpenCL device at least");
    assert_eq!(refused, 2 * 2 * 4, "each NPU library refuses every group of plain rows");
}

/// Positions a layer part's test pass follows (its attention reads them from the cache).
const PART_HISTORY: usize = 7;

/// One submission of a layer part (or a block) on `dev`: the residual stream `x`, the part's
/// input `h`, `count` rows at positions `start..`, the sequence's cache `kv` when it reads
/// one. Returns the residual stream and `y` (`y_width` per row) after it.
#[allow(clippy::too_many_arguments)]
fn run_part(
    dev: &dyn Device,
    exe: &llmd_device::Executable,
    x: &[f32],
    h: &[f32],
    count: usize,
    start: usize,
    kv: Option<&llmd_device::Buffer>,
    y_width: usize,
) -> Result<(Vec<f32>, Vec<f32>), llmd_device::DeviceError> {
    let xb = dev.alloc(BufferUsage::Activations, x.len() * 4)?;
    let mut after = vec![dev.write(&xb, 0, &f32_bytes(x), &[])?];
    let hb = if h.is_empty() {
        None
    } else {
        let b = dev.alloc(BufferUsage::Activations, h.len() * 4)?;
        after.push(dev.write(&b, 0, &f32_bytes(h), &[])?);
        Some(b)
    };
    let yb = if y_width == 0 { None } else { Some(dev.alloc(BufferUsage::Activations, count * y_width * 4)?) };
    let positions: Arc<[u32]> = (start as u32..(start + count) as u32).collect();
    let bind = Bindings {
        x: xb.clone(),
        tokens: vec![0u32; count].into(),
        positions,
        seqs: vec![llmd_device::SeqBinding { offset: 0, len: count, start, kv: kv.cloned() }].into(),
        logit_rows: Arc::new([]),
        logits: None,
        y: yb.clone(),
        h: hb,
    };
    let ev = dev.submit(exe, &bind, &after)?;
    let read = |b: &llmd_device::Buffer| -> Result<Vec<f32>, llmd_device::DeviceError> {
        let mut raw = vec![0u8; b.len];
        dev.read(b, 0, &mut raw, std::slice::from_ref(&ev))?;
        Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    };
    Ok((read(&xb)?, yb.as_ref().map(read).transpose()?.unwrap_or_default()))
}

/// The largest difference relative to the reference's largest magnitude.
fn rel_diff(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    got.iter().zip(want).fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs())) / scale
}

/// A layer part's outputs on another device, relative to the CPU device's largest output, at
/// most this. The CPU's kernels round each projection's input rows to 8-bit blocks (ggml's
/// `vec_dot` scheme) and the other devices compute in f32 or fp16, so the bound is the CPU's
/// rounding: measured worst 1.05e-2 on the default model and 1.23e-2 on the tiny qwen2 (their
/// last layer's parts, 1 to 32 tokens), on PoCL and on Intel's runtime with every kernel variant
/// alike — the fp16 kernels add nothing visible — with a margin of about half again.
/// The parts' own arithmetic is held tighter by the chained check (the device's whole blocks,
/// bit for bit), and the blocks by `a_whole_pass_runs_on_every_device_with_the_cpus_greedy_tokens`.
const CPU_ROUNDING_PART_REL_TOL: f64 = 2e-2;

/// A layer's five parts (`Subgraph::layer_parts`: norm and QKV, attention's core, O, norm with
/// gate/up and SwiGLU, down) through the contract on every device, for the default model and a
/// tiny qwen2 of K-quants with Q/K/V biases. Each device's parts run a
/// pass of `PART_HISTORY` positions, then one of each of the body's token counts, over the KV
/// cache of the layer in the device's memory:
/// - chained (each part reading what the one before it wrote), they give the residual stream
///   the device's whole attention and FFN blocks give, bit for bit (the CPU device's blocks are
///   the host's, `device_contract`);
/// - fed the CPU device's inputs, each part gives the CPU device's outputs within
///   `CPU_ROUNDING_PART_REL_TOL` (the CPU device is that reference, held to its own blocks by
///   the chained check).
///
/// The NPU takes only the linear groups it quantized: it refuses every part with a typed error.
#[test]
fn a_layers_parts_run_through_the_contract_on_every_device() {
    // The default model (llama: no biases, Q4_1), and a tiny qwen2 of K-quants with Q, K and V
    // biases and rotate-half RoPE.
    parts_on_every_device(common::default_model(), "the default model");
    let qwen = llmd_engine::Model::load(
        &common::repo_root().join("tests/fixtures/tiny-qwen2-q4km.gguf"),
        &llmd_engine::LoadOptions { threads: 2, ..Default::default() },
    )
    .expect("the tiny qwen2 loads");
    assert!(qwen.transformer.shape.qkv_bias);
    parts_on_every_device(&qwen, "tiny-qwen2-q4km");
}

fn parts_on_every_device(m: &llmd_engine::Model, model: &str) {
    use llmd_device::{DeviceError, SubgraphKind};
    let t = &m.transformer;
    let shape = t.shape;
    let d = shape.d_model;
    let kv_bytes = 2 * 256 * shape.kv_dim() * 2;
    let mut rng = check::Rng(0x9a27_5e00);
    let devices = devices();
    let layer = t.weights.layers.len() - 1;
    // The subgraph's weights loaded on `dev`, in its order.
    let load = |dev: &dyn Device, sg: Subgraph| -> Result<Vec<llmd_device::Weight>, DeviceError> {
        let l = &t.weights.layers[sg.layer];
        let f32_bytes_of = |v: &[f32]| f32_bytes(v);
        sg.weight_roles(&shape)
            .into_iter()
            .map(|role| {
                let vector = match role {
                    WeightRole::AttnNorm => Some(f32_bytes_of(&l.attn_norm)),
                    WeightRole::FfnNorm => Some(f32_bytes_of(&l.ffn_norm)),
                    WeightRole::Bq => l.bq.as_deref().map(f32_bytes_of),
                    WeightRole::Bk => l.bk.as_deref().map(f32_bytes_of),
                    WeightRole::Bv => l.bv.as_deref().map(f32_bytes_of),
                    WeightRole::RopeFreqs => t.weights.rope_freqs.as_deref().map(f32_bytes_of),
                    _ => None,
                };
                match vector {
                    Some(data) => {
                        let hw = HostWeight {
                            role,
                            ty: llmd_device::GgmlType::F32,
                            rows: 1,
                            cols: data.len() / 4,
                            data: &data,
                            host: None,
                        };
                        dev.load_weight(&hw, 0..1)
                    }
                    None => {
                        let w = l.matrix(role).expect("the layer's projection");
                        let data = w.source_bytes().expect("the model's rows are mapped");
                        let hw = HostWeight { role, ty: w.ty, rows: w.rows, cols: w.cols, data, host: None };
                        dev.load_weight(&hw, 0..w.rows)
                    }
                }
            })
            .collect()
    };
    // Inputs of every pass: (start, count, residual stream).
    let passes: Vec<Vec<(usize, usize, Vec<f32>)>> = TOKEN_COUNTS
        .iter()
        .map(|&n| vec![(0, PART_HISTORY, rng.vec(PART_HISTORY * d)), (PART_HISTORY, n, rng.vec(n * d))])
        .collect();
    // The CPU device's parts, chained: per count and pass, each part's (x, h) in and (x, y) out.
    type Io = ((Vec<f32>, Vec<f32>), (Vec<f32>, Vec<f32>));
    let mut reference: Vec<Vec<Vec<Io>>> = Vec::new();
    let (mut ran, mut refused) = (0, 0);
    for (name, dev, expect) in &devices {
        let parts = Subgraph::layer_parts(layer);
        let prepared: Result<Vec<_>, DeviceError> = parts
            .iter()
            .map(|&sg| load(&**dev, sg).and_then(|w| dev.prepare(sg, &shape, PART_HISTORY, &w).map(|e| (sg, w, e))))
            .collect();
        let prepared = match (prepared, expect) {
            (Ok(p), _) => p,
            (Err(DeviceError::Invalid { .. } | DeviceError::Unsupported { .. }), Expect::Within(tol))
                if *tol == F16_LINEAR_REL_TOL =>
            {
                refused += 1;
                continue;
            }
            (Err(e), _) => panic!("{name}: a layer part refused: {e}"),
        };
        let tol = match expect {
            Expect::HostBits => 0.0,
            Expect::Within(_) => CPU_ROUNDING_PART_REL_TOL,
        };
        let is_reference = reference.is_empty();
        let (mut worst_chain, mut worst_fed) = (0f64, 0f64);
        for (ci, count_passes) in passes.iter().enumerate() {
            let (kv_chain, kv_fed, kv_blocks) = (
                dev.alloc(BufferUsage::Kv, kv_bytes).expect("kv"),
                dev.alloc(BufferUsage::Kv, kv_bytes).expect("kv"),
                dev.alloc(BufferUsage::Kv, kv_bytes).expect("kv"),
            );
            let mut per_pass = Vec::new();
            for (pi, (start, count, x0)) in count_passes.iter().enumerate() {
                let at = format!("{model}, {name}: layer {layer}, {count} tokens after {start}");
                // Each executable runs the count it was prepared for: prepare again at this one.
                let exe_at =
                    |sg: Subgraph, w: &[llmd_device::Weight]| dev.prepare(sg, &shape, *count, w).expect("prepare");
                let (mut x, mut h) = (x0.clone(), Vec::new());
                let mut ios = Vec::new();
                for (k, (sg, w, _)) in prepared.iter().enumerate() {
                    let exe = exe_at(*sg, w);
                    let (hw, yw) = sg.part_widths(&shape);
                    let kv = sg.uses_kv().then_some(&kv_chain);
                    let (x_out, y) =
                        run_part(&**dev, &exe, &x, &h, *count, *start, kv, yw).unwrap_or_else(|e| panic!("{at}: {e}"));
                    assert_eq!(h.len(), count * hw, "{at}: {sg:?} input");
                    // Fed the CPU device's inputs (its own, for the CPU device).
                    if !is_reference {
                        let ((rx, rh), (wx, wy)) = &reference[ci][pi][k];
                        let kv = sg.uses_kv().then_some(&kv_fed);
                        let (fx, fy) = run_part(&**dev, &exe, rx, rh, *count, *start, kv, yw)
                            .unwrap_or_else(|e| panic!("{at}: {e}"));
                        let e = rel_diff(&fx, wx).max(if yw > 0 { rel_diff(&fy, wy) } else { 0.0 });
                        assert!(e <= tol, "{at}: {sg:?} off the CPU device's by {e:.2e}, past {tol:.0e}");
                        worst_fed = worst_fed.max(e);
                    }
                    ios.push(((x.clone(), h.clone()), (x_out.clone(), y.clone())));
                    // Parts that read the residual leave it as it was.
                    if matches!(sg.kind, SubgraphKind::AttnQkv | SubgraphKind::AttnCore | SubgraphKind::FfnGateUp) {
                        assert!(x_out == x, "{at}: {sg:?} changed the residual stream");
                    }
                    x = x_out;
                    if yw > 0 {
                        h = y;
                    } else {
                        h.clear();
                    }
                }
                // The device's whole blocks over the same pass.
                let mut xb = x0.clone();
                for sg in [Subgraph::attention(layer), Subgraph::ffn(layer)] {
                    let w = load(&**dev, sg).expect("block weights");
                    let exe = exe_at(sg, &w);
                    let kv = sg.uses_kv().then_some(&kv_blocks);
                    xb = run_part(&**dev, &exe, &xb, &[], *count, *start, kv, 0)
                        .unwrap_or_else(|e| panic!("{at}: {e}"))
                        .0;
                }
                let e = rel_diff(&x, &xb);
                assert!(
                    x.iter().zip(&xb).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{at}: the parts chained are not the blocks' bits ({e:.2e} apart)"
                );
                worst_chain = worst_chain.max(e);
                per_pass.push(ios);
                ran += 1;
            }
            if is_reference {
                reference.push(per_pass);
            }
        }
        let fed = if is_reference { "(the reference)".to_string() } else { format!("{worst_fed:.2e}") };
        eprintln!("{model}: {name:<70} parts: chained vs blocks {worst_chain:.2e}, fed the CPU's inputs {fed}");
    }
    assert!(ran >= 2 * 2 * TOKEN_COUNTS.len(), "{ran} passes: the CPU and an OpenCL device at least");
    assert_eq!(refused, 2, "each NPU library refuses the parts");
}
