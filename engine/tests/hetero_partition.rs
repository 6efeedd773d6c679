//! HeteroLLM's cuts on real processors, run by the engine's executor (`Devices::run_parts`,
//! what a placed pass runs for every split projection): over random shapes and weights, every
//! aligned cut the solver may choose (row, sequence, multi-sequence, hybrid; NPU rows at
//! multiples of 256, NPU tokens at multiples of 32 in standard graphs, padded or not) as a
//! scheduler `Split` equals the unsplit operator **bit for bit on one device type** — two
//! `CpuDevice`s, two OpenCL devices (PoCL or Intel's runtime), the NPU's fp16 graphs on the
//! emulator provider — and, with the NPU's parts on the emulator and the GPU's on OpenCL,
//! stays within [`CROSS_DEVICE_REL_TOL`] of the f64 product. Also: the fp16 graphs on
//! Qualcomm's x86-64 HTP library against the emulator's definition.

#![allow(clippy::unwrap_used)]

mod common;

use llmd_device::{BlockShape, Device, GgmlType, RopeStyle, WeightRole};
use llmd_engine::backend::cpu::device::CpuDevice;
use llmd_engine::backend::gpu::{check, GpuDevice, GpuOptions};
use llmd_engine::backend::npu::f16::f16_rows;
use llmd_engine::backend::npu::QnnDevice;
use llmd_engine::backend::weight::WeightMatrix;
use llmd_engine::hetero::partition::{Cut, Processor};
use llmd_engine::hetero::soc;
use llmd_engine::hetero::solver::{Phase, Predicted, Solver};
use llmd_engine::model::Devices;
use llmd_engine::sched::{Part, Pinned, Split};
use std::sync::{Arc, OnceLock};

/// NPU (fp16 inputs, weights and output; f32 sums) against GPU (f32) pieces, relative to
/// Σ|w·x| per output: x and w each rounded to half (2⁻¹¹ relative each), the f32 sums (≈ 1e-6
/// at these widths), the output rounded to half (2⁻¹¹ of |y| ≤ Σ|w·x|): ≤ 3·2⁻¹¹ ≈ 1.5e-3
/// in the worst case.
pub const CROSS_DEVICE_REL_TOL: f64 = 1.5e-3;

const SM8650: u32 = 57;

fn gpu() -> Option<Arc<GpuDevice>> {
    static G: OnceLock<Option<Arc<GpuDevice>>> = OnceLock::new();
    G.get_or_init(|| {
        let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
        match GpuDevice::open(&GpuOptions::default()) {
            Ok(g) => Some(Arc::new(g)),
            Err(e) if !required => {
                eprintln!("skipped: no usable OpenCL device ({e})");
                None
            }
            Err(e) => panic!("LLMD_REQUIRE_OPENCL=1 and the GPU backend cannot start: {e}"),
        }
    })
    .clone()
}

/// The NPU (the QNN library at `path`) with graphs for every token count up to `most`: the
/// tests run pieces in graphs of their exact count.
fn npu(path: &std::path::Path, most: usize) -> Arc<QnnDevice> {
    let counts: Vec<usize> = (1..=most).collect();
    Arc::new(QnnDevice::open(path, SM8650).expect("the QNN library opens").with_token_counts(&counts))
}

struct Case {
    m: usize,
    k: usize,
    n: usize,
    w: WeightMatrix,
    dense: Vec<f32>,
    x: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let mut rng = check::Rng(0x5eed_1234);
    let mut out = Vec::new();
    let shapes: [(GgmlType, usize, usize, usize); 7] = [
        (GgmlType::Q6_K, 200, 256, 512),
        (GgmlType::Q5_0, 65, 64, 768),
        (GgmlType::Q8_0, 77, 256, 512),
        (GgmlType::Q4_0, 300, 128, 768),
        (GgmlType::Q4_K, 45, 256, 256),
        (GgmlType::F16, 130, 96, 512),
        (GgmlType::Q8_0, 1, 192, 1024),
    ];
    for (ty, m, k, n) in shapes {
        let (bytes, dense) = check::random_weight(ty, n, k, &mut rng).unwrap();
        let w = WeightMatrix::from_host_bytes("w", ty, n, k, bytes).unwrap();
        let x = rng.vec(m * k);
        out.push(Case { m, k, n, w, dense, x });
    }
    out
}

/// Every cut the solver may consider for `c`, GPU-only and NPU-only included.
fn cuts(c: &Case) -> Vec<Cut> {
    let soc = soc::find(None, "snapdragon_8gen3").unwrap();
    let p = Predicted { soc: &soc, bits: 4.5 };
    let phase = if c.m == 1 { Phase::Decode } else { Phase::Prefill };
    let s = Solver::new(&p, &soc, phase, true);
    let mut v = vec![Cut::gpu_only()];
    for segs in s.token_sets(c.m) {
        let mut r = 256;
        while r < c.n {
            v.push(Cut { npu: segs.clone(), npu_rows: r });
            r += 256;
        }
        v.push(Cut { npu: segs, npu_rows: c.n });
    }
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Devices 1 and 2 of a placement: the NPU's parts on `npu`, the GPU's on `gpu`.
fn devices(npu: Arc<dyn Device>, gpu: Arc<dyn Device>) -> Devices {
    Devices::new(vec![npu, gpu], Arc::new(Pinned { names: vec![], pick: |_| 0 }))
}

/// `cut` as the scheduler's split: the NPU's pieces on device 1, the GPU's on device 2;
/// `exact`: each NPU piece in a graph of exactly its tokens (the NPU standing in for the GPU).
fn split(cut: &Cut, c: &Case, exact: bool) -> Split {
    Split::Hybrid(
        cut.pieces(c.m, c.n)
            .unwrap()
            .into_iter()
            .map(|p| Part {
                dev: if p.dev == Processor::Npu { 1 } else { 2 },
                graph: if exact { Some(p.tokens.len()) } else { p.graph },
                tokens: p.tokens,
                rows: p.rows,
            })
            .collect(),
    )
}

/// The projection's output for `split`, run by the executor on `devs`.
fn run(split: &Split, c: &Case, devs: &Devices) -> Vec<f32> {
    let mut y = vec![f32::NAN; c.m * c.n];
    let parts = split.parts(c.m, c.n).expect("a split");
    devs.run_parts(&linear_shape(), (0, WeightRole::Up), &c.w, &c.x, c.m, &mut y, &parts)
        .unwrap_or_else(|e| panic!("{split:?}: {e}"));
    y
}

/// The whole operator on device 1.
fn whole(c: &Case) -> Split {
    Split::Rows(vec![(1, 0..c.n)])
}

#[test]
fn every_cut_equals_the_whole_on_the_cpu() {
    let mut checked = 0;
    for c in cases() {
        let devs = devices(Arc::new(CpuDevice::new(2)), Arc::new(CpuDevice::new(2)));
        let whole = run(&whole(&c), &c, &devs);
        for cut in cuts(&c) {
            assert_eq!(
                bits(&run(&split(&cut, &c, false), &c, &devs)),
                bits(&whole),
                "{:?} m {} k {} n {}: {cut:?}",
                c.w.ty,
                c.m,
                c.k,
                c.n
            );
            checked += 1;
        }
    }
    eprintln!("{checked} cuts bit-identical on the CPU device");
    assert!(checked > 100);
}

/// The shape a lone projection is prepared with (a linear subgraph reads only its weight's).
fn linear_shape() -> BlockShape {
    BlockShape {
        n_layers: 1,
        d_model: 64,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 64,
        ffn_dim: 64,
        vocab: 1,
        context_length: 1,
        norm_eps: 1e-6,
        rope_dims: 64,
        rope_theta: 1e4,
        rope_freq_scale: 1.0,
        rope_style: RopeStyle::Neox,
        qkv_bias: false,
        rope_freqs: false,
    }
}

#[test]
fn every_cut_equals_the_whole_on_opencl() {
    let Some(g) = gpu() else { return };
    let mut checked = 0;
    for c in cases() {
        let devs = devices(g.clone(), g.clone());
        let whole = run(&whole(&c), &c, &devs);
        for cut in cuts(&c) {
            assert_eq!(
                bits(&run(&split(&cut, &c, false), &c, &devs)),
                bits(&whole),
                "{:?} m {} n {}: {cut:?}",
                c.w.ty,
                c.m,
                c.n
            );
            checked += 1;
        }
    }
    eprintln!("{checked} cuts bit-identical on OpenCL");
}

#[test]
fn every_cut_equals_the_whole_on_the_emulated_npu_and_across_npu_and_gpu() {
    let cases = cases();
    // Every count a piece runs in: its tokens', or its padded graph's.
    let most = cases
        .iter()
        .flat_map(|c| cuts(c).into_iter().flat_map(|cut| cut.pieces(c.m, c.n).unwrap()).map(|p| p.graph.unwrap_or(0)))
        .chain(cases.iter().map(|c| c.m))
        .max()
        .unwrap_or(1);
    let device = npu(&common::emulator_library(), most);
    let mut checked = 0;
    let mut worst = 0f64;
    for c in cases {
        let cuts = cuts(&c);
        // Each part's graph prepared through the contract as it first runs.
        let on_npu = devices(device.clone(), device.clone());
        // The whole operator as one NPU graph of exactly m tokens.
        let whole = run(&split(&Cut::padded(c.m, c.m, c.n), &c, false), &c, &on_npu);
        for cut in &cuts {
            assert_eq!(bits(&run(&split(cut, &c, true), &c, &on_npu)), bits(&whole), "{cut:?}");
            checked += 1;
        }
        // Across devices: the NPU's parts on the emulator, the GPU's on OpenCL.
        if let Some(g) = gpu() {
            let across = devices(device.clone(), g);
            for cut in &cuts {
                let y = run(&split(cut, &c, false), &c, &across);
                for t in 0..c.m {
                    for o in 0..c.n {
                        let (wr, xr) = (&c.dense[o * c.k..(o + 1) * c.k], &c.x[t * c.k..(t + 1) * c.k]);
                        let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let scale: f64 = wr.iter().zip(xr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                        let e = (y[t * c.n + o] as f64 - exact).abs() / scale.max(1e-30);
                        worst = worst.max(e);
                        assert!(e <= CROSS_DEVICE_REL_TOL, "{cut:?} token {t} row {o}: {e}");
                    }
                }
            }
            let st = &across.stats;
            let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(load(&across.sync.waits), load(&st.split_matmuls), "a fast-sync wait per cut matmul");
        }
    }
    eprintln!("{checked} cuts bit-identical on the emulated NPU; NPU+GPU worst {worst:.2e} of Σ|w·x|");
    assert!(checked > 100);
}

/// How far Qualcomm's HTP library may land from the emulator's fp16 definition, in units of
/// the output's half-precision spacing: its summation order is its own. Seen (QAIRT 2.51,
/// SM8650): 0–0.2% of outputs differ, by at most 12 ULPs (outputs near cancellation, whose
/// ULP is small against their terms).
pub const HTP_F16_MAX_ULPS: f32 = 16.0;

#[test]
fn fp16_graphs_on_qualcomms_htp_library_follow_the_emulators_definition() {
    let shapes = [(32usize, 576usize, 256usize), (64, 256, 512), (1, 576, 1536), (256, 1536, 576)];
    let counts: Vec<usize> = shapes.iter().map(|s| s.0).collect();
    let device: Arc<QnnDevice> = Arc::new(
        QnnDevice::open(&common::htp_library(), SM8650).expect("the QNN library opens").with_token_counts(&counts),
    );
    let mut rng = check::Rng(99);
    for (m, k, n) in shapes {
        let (bytes, _) = check::random_weight(GgmlType::Q8_0, n, k, &mut rng).unwrap();
        let w = WeightMatrix::from_host_bytes("w", GgmlType::Q8_0, n, k, bytes).unwrap();
        let w16 = f16_rows(&w, 0..n).unwrap();
        let x = rng.vec(m * k);
        let c = Case { m, k, n, w, dense: Vec::new(), x };
        let on_npu = devices(device.clone(), device.clone());
        let y = run(&split(&Cut::padded(m, m, n), &c, false), &c, &on_npu);
        let wf: Vec<f32> = w16.iter().map(|&h| half::f16::from_bits(h).to_f32()).collect();
        let (mut worst, mut differ) = (0f32, 0usize);
        for t in 0..m {
            let xr: Vec<f32> = c.x[t * k..(t + 1) * k].iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            for o in 0..n {
                let want = half::f16::from_f32(llmd_qnn_emu::emu::dot_f16_lanes(&xr, &wf[o * k..(o + 1) * k]));
                let got = y[t * n + o];
                let ulp = (half::f16::from_bits(want.to_bits() | 1).to_f32()
                    - half::f16::from_bits(want.to_bits() & !1).to_f32())
                .abs()
                .max(f32::MIN_POSITIVE);
                let e = (got - want.to_f32()).abs() / ulp;
                if e > 0.0 {
                    differ += 1;
                }
                worst = worst.max(e);
            }
        }
        eprintln!(
            "HTP fp16 {m}×{k}→{n}: {differ} of {} outputs differ from the emulator, worst {worst} half ULPs",
            m * n
        );
        assert!(worst <= HTP_F16_MAX_ULPS, "{m}×{k}→{n}: {worst} ULPs");
    }
}
