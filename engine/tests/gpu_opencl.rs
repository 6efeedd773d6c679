//! The OpenCL GPU backend on a real OpenCL runtime (PoCL in CI, `scripts/setup-opencl.sh`):
//! every kernel against a reference written from its definition (f64, over the format's own
//! dequantization), and greedy decode with the whole model on the GPU against the CPU.
//!
//! Without a runtime the tests say so and pass, unless `LLMD_REQUIRE_OPENCL=1` (set by
//! `scripts/test.sh`, so CI fails instead).

#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

mod common;

use llmd_device::{BlockShape, GgmlType, HostWeight, RopeParams, RopeStyle, Subgraph, WeightRole};
use llmd_engine::backend::blocks::Logits;
use llmd_engine::backend::gpu::{check, GpuDevice, GpuOptions, WEIGHT_TYPES};
use llmd_engine::quant::dequantize_row;
use llmd_engine::sched::Pinned;
use llmd_engine::{LoadOptions, Model};
use std::sync::{Arc, OnceLock};

/// A matmul output against the f64 sum of the dequantized weights times x: the kernel sums in
/// f32 (fused multiply-adds, 32 values per work-item step, then a tree), so it may differ by
/// a few f32 roundings of the sum of |w·x| (n·2⁻²⁴ bounds it for n terms; 1e-5 covers rows of
/// 4096 with room).
const MATMUL_REL_TOL: f64 = 1e-5;
/// Dequantized rows: the same products as the reference; an FMA contraction may round once
/// differently.
const GET_ROWS_REL_TOL: f64 = 1e-6;
/// RMSNorm: an f32 tree sum of squares against f64.
const RMS_NORM_REL_TOL: f64 = 1e-5;
/// RoPE: OpenCL's `cos`/`sin` are within 4 ulp (OpenCL 1.2 §7.4); the angle is built the same
/// way as the reference; |x| ≤ 1 here.
const ROPE_ABS_TOL: f64 = 2e-6;
/// SwiGLU: `exp` within 3 ulp and one division.
const SWIGLU_REL_TOL: f64 = 1e-6;
/// Attention against f64 over the f16-rounded keys and values the cache holds: f32 dot
/// products, `exp`, and sums over up to 80 positions.
const ATTENTION_ABS_TOL: f64 = 2e-5;
/// Greedy decode on the GPU may part from the CPU's only where the CPU's top two logits are
/// this close: the CPU quantizes activations to Q8 for its integer dot products (as
/// llama.cpp's CPU backend does), the GPU multiplies in f32.
const NEAR_TIE: f32 = 0.25;

fn gpu() -> Option<&'static GpuDevice> {
    static G: OnceLock<Option<GpuDevice>> = OnceLock::new();
    G.get_or_init(|| {
        let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
        match GpuDevice::open(&GpuOptions::default()) {
            Ok(g) => {
                eprintln!(
                    "OpenCL: {} / {} ({}), program {:?}",
                    g.info().platform,
                    g.info().name,
                    g.info().kind,
                    g.program_origin()
                );
                Some(g)
            }
            Err(e) if !required => {
                eprintln!("skipped: no usable OpenCL device ({e})");
                None
            }
            Err(e) => panic!("LLMD_REQUIRE_OPENCL=1 and the GPU backend cannot start: {e}"),
        }
    })
    .as_ref()
}

/// A small deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// `rows × cols` weights of `ty`: random bytes with every scale field set to a sane f16 (the
/// engine quantizes only activation types), and their dequantization by the engine's reference.
fn quantized(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes: Vec<u8> = (0..rows * rb).map(|_| (rng.f() * 128.0 + 128.0) as u8).collect();
    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let (block, scales): (usize, &[usize]) = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => (ty.type_size(), &[0]),
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K => (ty.type_size(), &[0, 2]),
        GgmlType::Q6_K => (ty.type_size(), &[208]),
        GgmlType::F16 => (2, &[0]),
        GgmlType::F32 => (4, &[]),
        other => panic!("no generator for {other}"),
    };
    for b in bytes.chunks_exact_mut(block) {
        if ty == GgmlType::F32 {
            b.copy_from_slice(&rng.f().to_le_bytes());
        }
        for &at in scales {
            let v = if ty == GgmlType::F16 { rng.f() } else { 0.001 + 0.02 * rng.f().abs() };
            b[at..at + 2].copy_from_slice(&h(v));
        }
    }
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut deq[r * cols..(r + 1) * cols]).unwrap();
    }
    (bytes, deq)
}

fn rel_err(got: f32, want: f64, scale: f64) -> f64 {
    (got as f64 - want).abs() / scale.max(1e-30)
}

#[test]
fn every_matmul_and_get_rows_type_equals_the_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in WEIGHT_TYPES {
        // 256 columns: one K-quant super-block per row; 3 token rows, and 11 (more than a tile).
        let (rows, cols) = (37, 512);
        let (bytes, deq) = quantized(ty, rows, cols, &mut rng);
        let w = HostWeight { role: WeightRole::Wq, ty, rows, cols, data: &bytes };
        for n in [1, 3, 11] {
            let x = rng.vec(n * cols);
            let bias = rng.vec(rows);
            let acc = rng.vec(n * rows);
            let plain = check::matmul(g, &w, &x, n, None, None).unwrap();
            let fused = check::matmul(g, &w, &x, n, Some(&bias), Some(&acc)).unwrap();
            let mut worst = 0f64;
            for t in 0..n {
                for r in 0..rows {
                    let (mut s, mut mag) = (0f64, 0f64);
                    for k in 0..cols {
                        let p = deq[r * cols + k] as f64 * x[t * cols + k] as f64;
                        s += p;
                        mag += p.abs();
                    }
                    worst = worst.max(rel_err(plain[t * rows + r], s, mag));
                    let want = s + bias[r] as f64 + acc[t * rows + r] as f64;
                    worst = worst.max(rel_err(fused[t * rows + r], want, mag + 2.0));
                }
            }
            assert!(worst <= MATMUL_REL_TOL, "{ty} n={n}: matmul off by {worst:e} of Σ|w·x|");
        }
        let toks = [5u32, 0, 36, 5];
        let got = check::get_rows(g, &w, &toks).unwrap();
        for (i, &t) in toks.iter().enumerate() {
            for k in 0..cols {
                let want = deq[t as usize * cols + k] as f64;
                let e = rel_err(got[i * cols + k], want, want.abs().max(1e-3));
                assert!(e <= GET_ROWS_REL_TOL, "{ty}: get_rows row {t} col {k}: {} vs {want}", got[i * cols + k]);
            }
        }
    }
}

#[test]
fn rms_norm_rope_and_swiglu_equal_their_definitions() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(7);
    let (d, rows, eps) = (576, 5, 1e-5f32);
    let x = rng.vec(rows * d);
    let w = rng.vec(d);
    let got = check::rms_norm(g, &x, &w, eps).unwrap();
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let s = 1.0 / (ms + eps as f64).sqrt();
        for k in 0..d {
            let want = row[k] as f64 * s * w[k] as f64;
            let e = rel_err(got[r * d + k], want, want.abs().max(1e-3));
            assert!(e <= RMS_NORM_REL_TOL, "rms_norm row {r} col {k}: {e:e}");
        }
    }

    for (style, ff) in [(RopeStyle::Interleaved, false), (RopeStyle::Neox, false), (RopeStyle::Neox, true)] {
        let p = RopeParams { n_heads: 3, head_dim: 64, rope_dims: 48, theta: 10000.0, freq_scale: 0.5, style };
        let positions = [0u32, 1, 17, 900, 4095];
        let x = rng.vec(positions.len() * 3 * 64);
        let factors: Vec<f32> = (0..24).map(|i| 1.0 + i as f32 * 0.25).collect();
        let got = check::rope(g, &x, &positions, &p, ff.then_some(&factors[..])).unwrap();
        let theta_scale = p.theta.powf(-2.0 / p.rope_dims as f32);
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..3 {
                let base = (t * 3 + h) * 64;
                let mut want: Vec<f64> = x[base..base + 64].iter().map(|&v| v as f64).collect();
                let mut th = pos as f32;
                for i in 0..24 {
                    let f = if ff { factors[i] } else { 1.0 };
                    let a = (p.freq_scale * (th / f)) as f64;
                    th *= theta_scale;
                    let (i0, i1) = match style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + 24),
                    };
                    let (a0, a1) = (want[i0], want[i1]);
                    want[i0] = a0 * a.cos() - a1 * a.sin();
                    want[i1] = a0 * a.sin() + a1 * a.cos();
                }
                for k in 0..64 {
                    let e = (got[base + k] as f64 - want[k]).abs();
                    assert!(e <= ROPE_ABS_TOL, "rope {style:?} ff={ff} pos {pos} head {h} dim {k}: {e:e}");
                }
            }
        }
    }

    let (gate, up) = (rng.vec(1000).iter().map(|v| v * 8.0).collect::<Vec<_>>(), rng.vec(1000));
    let got = check::swiglu(g, &gate, &up).unwrap();
    for i in 0..1000 {
        let a = gate[i] as f64;
        let want = a / (1.0 + (-a).exp()) * up[i] as f64;
        assert!(rel_err(got[i], want, want.abs().max(1e-3)) <= SWIGLU_REL_TOL, "swiglu {i}");
    }
}

fn f16_round(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect()
}

#[test]
fn attention_with_grouped_query_heads_equals_its_definition() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(99);
    for (n_heads, n_kv, start, len) in [(9, 3, 0, 1), (9, 3, 70, 1), (4, 4, 0, 7), (12, 2, 40, 5)] {
        let hd = 64;
        let s = BlockShape {
            n_layers: 1,
            d_model: n_heads * hd,
            n_heads,
            n_kv_heads: n_kv,
            head_dim: hd,
            ffn_dim: 64,
            vocab: 32,
            context_length: 4096,
            norm_eps: 1e-5,
            rope_dims: hd,
            rope_theta: 10000.0,
            rope_freq_scale: 1.0,
            rope_style: RopeStyle::Neox,
            qkv_bias: false,
            rope_freqs: false,
        };
        let kvd = n_kv * hd;
        let q = rng.vec(len * n_heads * hd);
        let (k_old, v_old) = (rng.vec(start * kvd), rng.vec(start * kvd));
        let (k, v) = (rng.vec(len * kvd), rng.vec(len * kvd));
        let got = check::attention(g, &s, &q, &k_old, &v_old, &k, &v, len).unwrap();
        let keys = f16_round(&[k_old.clone(), k.clone()].concat());
        let vals = f16_round(&[v_old.clone(), v.clone()].concat());
        let scale = 1.0 / (hd as f64).sqrt();
        for t in 0..len {
            for h in 0..n_heads {
                let kh = h / (n_heads / n_kv);
                let qr = &q[(t * n_heads + h) * hd..][..hd];
                let total = start + t + 1;
                let scores: Vec<f64> = (0..total)
                    .map(|p| (0..hd).map(|d| qr[d] as f64 * keys[p * kvd + kh * hd + d]).sum::<f64>() * scale)
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 = (0..total).map(|p| e[p] * vals[p * kvd + kh * hd + d]).sum::<f64>() / sum;
                    let gv = got[(t * n_heads + h) * hd + d] as f64;
                    assert!(
                        (gv - want).abs() <= ATTENTION_ABS_TOL,
                        "heads {n_heads}/{n_kv} start {start} token {t} head {h} dim {d}: {gv} vs {want}"
                    );
                }
            }
        }
    }
}

/// Greedy tokens after `prompt`, `steps` of them, with each step's top-two margin.
fn greedy(m: &Model, prompt: &[u32], steps: usize) -> Vec<(u32, f32)> {
    let t = &m.transformer;
    let mut kv = t.new_kv();
    let mut logits = t.forward(&mut kv, prompt, Logits::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let next = llmd_engine::sampling::argmax(&logits);
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        out.push((next, sorted[0] - sorted[1]));
        logits = t.forward(&mut kv, &[next], Logits::Last).unwrap();
    }
    out
}

/// The whole model on `g` (every subgraph pinned to it).
fn on_gpu(path: &std::path::Path, g: Arc<dyn llmd_device::Device>) -> Model {
    let mut m = Model::load(path, &LoadOptions { threads: 2, ..Default::default() }).unwrap();
    let names = vec!["cpu".to_string(), g.desc().name.clone()];
    m.transformer.attach_devices(vec![g], Arc::new(Pinned { names, pick: |_: Subgraph| 1 }));
    m
}

/// Greedy decode on the GPU and on the CPU from the same prompts: the same tokens, or they part
/// at a step where the CPU's top two logits are within [`NEAR_TIE`].
pub fn greedy_matches(path: &std::path::Path, prompts: &[&str], steps: usize) {
    let cpu = Model::load(path, &LoadOptions { threads: 2, ..Default::default() }).unwrap();
    let dev = match GpuDevice::open(&GpuOptions::default()) {
        Ok(d) => Arc::new(d),
        Err(_) => return,
    };
    let gm = on_gpu(path, dev.clone());
    for p in prompts {
        let toks = cpu.tokenizer.encode(p, false, true).unwrap();
        let before = dev.stats();
        let a = greedy(&cpu, &toks, steps);
        let b = greedy(&gm, &toks, steps);
        let after = dev.stats();
        let parted = a.iter().zip(&b).position(|(x, y)| x.0 != y.0);
        match parted {
            None => eprintln!("{p:?}: {steps} tokens equal"),
            Some(i) => {
                eprintln!("{p:?}: part at step {i}, CPU margin {}", a[i].1);
                assert!(a[i].1 <= NEAR_TIE, "{p:?}: GPU and CPU part at step {i} with a margin of {}", a[i].1);
            }
        }
        eprintln!(
            "  per pass: {:.1} kernels, {:.2} host waits, {:.0} B up, {:.0} B down",
            (after.kernels - before.kernels) as f64 / (steps + 1) as f64,
            (after.host_waits - before.host_waits) as f64 / (steps + 1) as f64,
            (after.bytes_to_device - before.bytes_to_device) as f64 / (steps + 1) as f64,
            (after.bytes_from_device - before.bytes_from_device) as f64 / (steps + 1) as f64,
        );
    }
}

#[test]
fn greedy_decode_on_the_gpu_gives_the_cpu_tokens_on_the_default_model() {
    if gpu().is_none() {
        return;
    }
    greedy_matches(
        &common::default_model_path(),
        &["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"],
        32,
    );
}

/// The K-quant model (Q4_K and Q6_K weights): `LLMD_LARGE_MODEL_TESTS=1 scripts/test.sh`, or
/// `scripts/fetch-model-1.5b.sh` then this test with `--ignored`.
#[test]
#[ignore = "needs the 1.5B model (scripts/fetch-model-1.5b.sh)"]
fn greedy_decode_on_the_gpu_gives_the_cpu_tokens_on_the_1_5b_k_quant_model() {
    if gpu().is_none() {
        return;
    }
    let path = common::repo_root().join("models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf");
    assert!(path.is_file(), "{} is missing: run scripts/fetch-model-1.5b.sh", path.display());
    greedy_matches(&path, &["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"], 32);
}
