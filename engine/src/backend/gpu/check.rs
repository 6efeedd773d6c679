//! Single kernels over host data — each uploads its inputs, runs one kernel and reads the
//! result back — and the self-check `llmctl gpu-info` runs: every kernel at one layer's
//! shapes against a reference written from its definition in f64, within the tolerances below
//! (which `engine/tests/gpu_opencl.rs` holds the kernels to as well).

use super::{GpuDevice, GpuWeight, State, TILE_TYPES, WEIGHT_TYPES};
use crate::backend::layout::kpacked::{KKind, KPackedMatrix};
use crate::backend::layout::packed::{PackKind, PackedMatrix, PageAligned};
use crate::backend::{bytes_f32, f32_bytes};
use crate::quant::dequantize_row;
use llmd_device::{
    BlockShape, Device, DeviceError, GgmlType, HostCopy, HostLayout, HostWeight, RopeParams, RopeStyle, SharedBytes,
    Weight, WeightRole,
};
use opencl_rt_sys::{Access, Arg, Mem};
use std::sync::Arc;

/// A matmul output against the f64 sum of the dequantized weights times x, relative to
/// Σ|w·x|: the kernel sums in f32 (fused multiply-adds, 32 values per work-item step, then a
/// tree), whose rounding grows like √n·2⁻²⁴ for n terms (≈ 4e-6 at n = 4096 in the worst
/// case). Seen: at most 6.1e-8 at rows of 256–8960 (PoCL and Intel, every matmul variant).
pub const MATMUL_REL_TOL: f64 = 1e-6;
/// The fp16 variant's matmul, relative to Σ|w·x| as [`MATMUL_REL_TOL`]: each weight and
/// activation rounded to half (2⁻¹¹ relative each), each product and each of the three adds
/// of a four-term `dot` rounded to half, so a term carries up to ~6 roundings of 2⁻¹¹ (3e-3)
/// in the worst case; sums of random-signed terms cancel most of that (seen on Intel's CPU
/// runtime: at most 2e-4 at rows of 256–8960).
pub const FP16_MATMUL_REL_TOL: f64 = 3e-3;
/// The fp16 variant's dequantized rows: each value rounded to half once (2⁻¹¹ relative, and
/// half's subnormal spacing below 6e-5, against the 1e-3 floor of the scale).
pub const FP16_GET_ROWS_REL_TOL: f64 = 5e-4;
/// Dequantized rows: the same products as the reference; an FMA contraction may round once
/// differently.
pub const GET_ROWS_REL_TOL: f64 = 1e-6;
/// RMSNorm: an f32 tree sum of squares against f64 (seen: at most 1.9e-7).
pub const RMS_NORM_REL_TOL: f64 = 1e-6;
/// RoPE, absolute for |x| ≤ 1: OpenCL's `cos`/`sin` are within 4 ulp (OpenCL 1.2 §7.4), two
/// products and a sum; the angle is built by the same repeated f32 multiplication as the
/// reference (seen: at most 1.2e-7).
pub const ROPE_ABS_TOL: f64 = 1e-6;
/// SwiGLU: `exp` within 3 ulp, one division and a product (seen: at most 1.5e-7).
pub const SWIGLU_REL_TOL: f64 = 1e-6;
/// Attention, absolute, against f64 over the f16-rounded keys and values the cache holds: f32
/// dot products, `exp`, and sums over up to a hundred positions (seen: at most 8e-8).
pub const ATTENTION_ABS_TOL: f64 = 1e-6;

fn up(g: &GpuDevice, v: &[f32]) -> Result<Mem, DeviceError> {
    g.ctx.buffer_from(Access::ReadWrite, &f32_bytes(v), false).map_err(g.exec())
}

fn down(g: &GpuDevice, m: &Mem, len: usize) -> Result<Vec<f32>, DeviceError> {
    let mut b = vec![0u8; len * 4];
    g.ctx.read(m, 0, &mut b).map_err(g.exec())?;
    Ok(bytes_f32(&b))
}

fn vector(g: &GpuDevice, v: &[f32]) -> Result<Weight, DeviceError> {
    let data = f32_bytes(v);
    let hw =
        HostWeight { role: WeightRole::AttnNorm, ty: GgmlType::F32, rows: 1, cols: v.len(), data: &data, host: None };
    g.load_weight(&hw, 0..1)
}

fn inner<'a>(g: &GpuDevice, w: &'a Weight) -> Result<&'a GpuWeight, DeviceError> {
    w.get::<GpuWeight>(g.id).ok_or_else(|| g.err("weight"))
}

/// `y = W·x (+ bias)` for `n` rows of `x`; with `acc`, added to `acc`.
pub fn matmul(
    g: &GpuDevice,
    w: &HostWeight<'_>,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    acc: Option<&[f32]>,
) -> Result<Vec<f32>, DeviceError> {
    matmul_of_rows(g, w, 0..w.rows, x, n, bias, acc)
}

/// [`matmul`] with only rows `rows` of `w` loaded (a weight split by rows, as HeteroLLM's
/// partitioning loads it): `rows.len()` outputs per token.
pub fn matmul_of_rows(
    g: &GpuDevice,
    w: &HostWeight<'_>,
    rows: std::ops::Range<usize>,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    acc: Option<&[f32]>,
) -> Result<Vec<f32>, DeviceError> {
    let out = rows.len();
    let wt = g.load_weight(w, rows)?;
    let gw = inner(g, &wt)?;
    let b = bias.map(|b| vector(g, b)).transpose()?;
    let b = b.as_ref().map(|b| inner(g, b)).transpose()?;
    let xm = up(g, x)?;
    let y = match acc {
        Some(a) => up(g, a)?,
        None => up(g, &vec![0.0; n * out])?,
    };
    g.matmul(gw, &xm, &y, n, acc.is_some(), b)?;
    down(g, &y, n * out)
}

/// Rows `tokens` of `w`, dequantized.
pub fn get_rows(g: &GpuDevice, w: &HostWeight<'_>, tokens: &[u32]) -> Result<Vec<f32>, DeviceError> {
    let wt = g.load_weight(w, 0..w.rows)?;
    let gw = inner(g, &wt)?;
    let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let tm = g.ctx.buffer_from(Access::ReadOnly, &ids, false).map_err(g.exec())?;
    let x = up(g, &vec![0.0; tokens.len() * w.cols])?;
    let k = g.k.get_rows.get(&gw.key()).ok_or_else(|| g.err("type"))?;
    let args = [
        Arg::Mem(&gw.mem),
        Arg::U32(gw.offset as u32),
        Arg::U32(gw.stride as u32),
        Arg::U32(gw.cols as u32),
        Arg::U32(gw.rows as u32),
        Arg::Mem(&tm),
        Arg::Mem(&x),
    ];
    g.ctx.enqueue(k, &args, &[w.cols / 32, tokens.len()], None).map_err(g.exec())?;
    down(g, &x, tokens.len() * w.cols)
}

/// RMSNorm of each row of `x` (rows of `w.len()`).
pub fn rms_norm(g: &GpuDevice, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>, DeviceError> {
    let rows = x.len() / w.len().max(1);
    let (xm, om, wv) = (up(g, x)?, up(g, &vec![0.0; x.len()])?, vector(g, w)?);
    g.rms_norm(&xm, &om, inner(g, &wv)?, rows, eps, None)?;
    down(g, &om, x.len())
}

/// RoPE of `x` (one row per position).
pub fn rope(
    g: &GpuDevice,
    x: &[f32],
    positions: &[u32],
    p: &llmd_device::RopeParams,
    ff: Option<&[f32]>,
) -> Result<Vec<f32>, DeviceError> {
    let xm = up(g, x)?;
    let pb: Vec<u8> = positions.iter().flat_map(|t| t.to_le_bytes()).collect();
    let pm = g.ctx.buffer_from(Access::ReadOnly, &pb, false).map_err(g.exec())?;
    let f = ff.map(|f| vector(g, f)).transpose()?;
    let f = f.as_ref().map(|f| inner(g, f)).transpose()?;
    g.rope(&xm, &pm, positions.len(), p, f)?;
    down(g, &xm, x.len())
}

/// `silu(gate) · up`.
pub fn swiglu(g: &GpuDevice, gate: &[f32], upv: &[f32]) -> Result<Vec<f32>, DeviceError> {
    let (gm, um) = (up(g, gate)?, up(g, upv)?);
    g.swiglu(&gm, &um, gate.len())?;
    down(g, &gm, gate.len())
}

/// Attention of `len` new rows over a cache that held `start` positions: `k_old`/`v_old`
/// (`start × kv_dim` each) then the new `k`/`v`; the output rows (`len × q_dim`).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    g: &GpuDevice,
    s: &BlockShape,
    q: &[f32],
    k_old: &[f32],
    v_old: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
) -> Result<Vec<f32>, DeviceError> {
    let kvd = s.kv_dim();
    let start = k_old.len() / kvd.max(1);
    let ctx = start + len + 3;
    let cache = g.ctx.buffer(Access::ReadWrite, 2 * ctx * kvd * 2).map_err(g.exec())?;
    let mut st = State::default();
    if start > 0 {
        // The old positions go in through the same store kernel.
        let (ko, vo) = (up(g, k_old)?, up(g, v_old)?);
        let store = [
            Arg::Mem(&ko),
            Arg::Mem(&vo),
            Arg::Mem(&cache),
            Arg::U32(kvd as u32),
            Arg::U32((ctx * kvd) as u32),
            Arg::U32(0),
            Arg::U32(0),
        ];
        g.ctx.enqueue(&g.k.kv_store, &store, &[kvd, start], None).map_err(g.exec())?;
    }
    let (qm, km, vm) = (up(g, q)?, up(g, k)?, up(g, v)?);
    let out = up(g, &vec![0.0; len * s.q_dim()])?;
    g.attend(&mut st, s, (&qm, &km, &vm, &out), &cache, start, len, 0)?;
    down(g, &out, len * s.q_dim())
}

/// Deterministic values in [-1, 1) (xorshift64).
pub struct Rng(pub u64);

impl Rng {
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// `rows × cols` weights of `ty` (one of [`WEIGHT_TYPES`]): random bytes with every scale field
/// set to a sane f16, and their dequantization by the format's reference
/// ([`crate::quant::dequantize_row`]).
pub fn random_weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Result<(Vec<u8>, Vec<f32>), String> {
    let rb = ty.row_bytes(cols).ok_or_else(|| format!("{ty}: {cols} columns are not whole blocks"))?;
    let mut bytes: Vec<u8> = (0..rows * rb).map(|_| (rng.f() * 128.0 + 128.0) as u8).collect();
    let (block, scales): (usize, &[usize]) = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => (ty.type_size(), &[0]),
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => (ty.type_size(), &[0, 2]),
        GgmlType::Q2_K => (ty.type_size(), &[80, 82]),
        GgmlType::Q3_K => (ty.type_size(), &[108]),
        GgmlType::Q6_K => (ty.type_size(), &[208]),
        GgmlType::F16 => (2, &[0]),
        GgmlType::F32 => (4, &[]),
        other => return Err(format!("no generator for {other}")),
    };
    for b in bytes.chunks_exact_mut(block) {
        if ty == GgmlType::F32 {
            b.copy_from_slice(&rng.f().to_le_bytes());
        }
        for &at in scales {
            let v = if ty == GgmlType::F16 { rng.f() } else { 0.001 + 0.02 * rng.f().abs() };
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut deq[r * cols..(r + 1) * cols])
            .map_err(|e| e.to_string())?;
    }
    Ok((bytes, deq))
}

/// `bytes` (GGUF rows of `ty`) as the host would keep them in `layout`, in page-aligned memory
/// of its own (as the CPU's packed matrices are), so a device that shares the host's memory
/// takes them in place.
pub fn host_copy(ty: GgmlType, layout: HostLayout, rows: usize, cols: usize, bytes: &[u8]) -> Result<HostCopy, String> {
    let rb = ty.row_bytes(cols).ok_or_else(|| format!("{ty}: {cols} columns"))?;
    let read = |r0: usize, buf: &mut [u8]| {
        buf.copy_from_slice(&bytes[r0 * rb..r0 * rb + buf.len()]);
        Ok(())
    };
    // A file's rows start 32 bytes into the page they are shared from (GGUF aligns tensors to
    // 32 bytes), so the kernels' weight offset is exercised.
    let offset = if layout == HostLayout::Rows { 32 } else { 0 };
    let shared: SharedBytes = match layout {
        HostLayout::Rows => {
            let mut a = PageAligned::zeroed(offset + bytes.len());
            a[offset..].copy_from_slice(bytes);
            Arc::new(a)
        }
        HostLayout::CpuTiles => match (PackKind::of(ty), KKind::of(ty)) {
            (Some(k), _) => Arc::new(PackedMatrix::pack(k, rows, cols, read).map_err(|e| e.to_string())?),
            (_, Some(k)) => Arc::new(KPackedMatrix::pack_in(None, k, rows, cols, read).map_err(|e| e.to_string())?),
            _ => return Err(format!("{ty} has no CPU tile layout")),
        },
    };
    Ok(HostCopy { layout, ty, bytes: shared, offset })
}

/// One kernel's check: its worst error (as its tolerance measures it) and the tolerance.
#[derive(Clone, Debug)]
pub struct Checked {
    pub kernel: String,
    pub worst: f64,
    pub tolerance: f64,
}

impl Checked {
    pub fn ok(&self) -> bool {
        self.worst <= self.tolerance
    }
}

fn rel(got: f32, want: f64, scale: f64) -> f64 {
    (got as f64 - want).abs() / scale.max(1e-30)
}

/// Every kernel at the shapes of one layer of `s`: each matmul and get_rows weight type (with
/// bias and residual fused, over 1, 3 and 11 token rows), RMSNorm, RoPE (the model's style,
/// then with frequency factors), SwiGLU, and attention with grouped-query heads over a cache
/// that held positions before.
pub fn self_check(g: &GpuDevice, s: &BlockShape) -> Result<Vec<Checked>, DeviceError> {
    let bad = |e: String| g.err(e);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    let cols = s.d_model.div_ceil(256) * 256;
    let rows = 40;
    // The file's rows (in place where the device shares the host's memory), then the CPU's
    // tiles (the host's own copy: nothing else is handed over).
    let rows_kinds = WEIGHT_TYPES.iter().map(|&t| (t, HostLayout::Rows));
    for (ty, layout) in rows_kinds.chain(TILE_TYPES.iter().map(|&t| (t, HostLayout::CpuTiles))) {
        let (bytes, deq) = random_weight(ty, rows, cols, &mut rng).map_err(bad)?;
        let host = host_copy(ty, layout, rows, cols, &bytes).map_err(bad)?;
        let data = if layout == HostLayout::Rows { &bytes[..] } else { &[] };
        let w = HostWeight { role: WeightRole::Wq, ty, rows, cols, data, host: Some(&host) };
        let label = if layout == HostLayout::Rows { ty.to_string() } else { format!("{ty}, CPU tiles") };
        let mut worst = 0f64;
        for n in [1, 3, 11] {
            let x = rng.vec(n * cols);
            let (bias, acc) = (rng.vec(rows), rng.vec(n * rows));
            let plain = matmul(g, &w, &x, n, None, None)?;
            let fused = matmul(g, &w, &x, n, Some(&bias), Some(&acc))?;
            for t in 0..n {
                for r in 0..rows {
                    let (mut sum, mut mag) = (0f64, 0f64);
                    for k in 0..cols {
                        let p = deq[r * cols + k] as f64 * x[t * cols + k] as f64;
                        sum += p;
                        mag += p.abs();
                    }
                    worst = worst.max(rel(plain[t * rows + r], sum, mag));
                    let want = sum + bias[r] as f64 + acc[t * rows + r] as f64;
                    worst = worst.max(rel(fused[t * rows + r], want, mag + 2.0));
                }
            }
        }
        let tolerance = if g.fp16() { FP16_MATMUL_REL_TOL } else { MATMUL_REL_TOL };
        out.push(Checked { kernel: format!("matmul {label}"), worst, tolerance });
        let toks = [5u32, 0, rows as u32 - 1, 5];
        let got = get_rows(g, &w, &toks)?;
        let mut worst = 0f64;
        for (i, &t) in toks.iter().enumerate() {
            for k in 0..cols {
                let want = deq[t as usize * cols + k] as f64;
                worst = worst.max(rel(got[i * cols + k], want, want.abs().max(1e-3)));
            }
        }
        let tolerance = if g.fp16() { FP16_GET_ROWS_REL_TOL } else { GET_ROWS_REL_TOL };
        out.push(Checked { kernel: format!("get_rows {label}"), worst, tolerance });
    }

    let (d, n) = (s.d_model, 5);
    let (x, w) = (rng.vec(n * d), rng.vec(d));
    let got = rms_norm(g, &x, &w, s.norm_eps)?;
    let mut worst = 0f64;
    for r in 0..n {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let scale = 1.0 / (ms + s.norm_eps as f64).sqrt();
        for k in 0..d {
            let want = row[k] as f64 * scale * w[k] as f64;
            worst = worst.max(rel(got[r * d + k], want, want.abs().max(1e-3)));
        }
    }
    out.push(Checked { kernel: "rms_norm".into(), worst, tolerance: RMS_NORM_REL_TOL });

    let other = if s.rope_style == RopeStyle::Neox { RopeStyle::Interleaved } else { RopeStyle::Neox };
    for (style, with_ff) in [(s.rope_style, false), (other, true)] {
        let p = RopeParams { style, ..s.rope(s.n_heads) };
        let half = p.rope_dims / 2;
        let positions = [0u32, 1, 17, 900, (s.context_length.max(2) - 1) as u32];
        let x = rng.vec(positions.len() * p.n_heads * p.head_dim);
        let factors: Vec<f32> = (0..half).map(|i| 1.0 + i as f32 * 0.25).collect();
        let got = rope(g, &x, &positions, &p, with_ff.then_some(&factors[..]))?;
        let theta_scale = p.theta.powf(-2.0 / p.rope_dims as f32);
        let mut worst = 0f64;
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..p.n_heads {
                let base = (t * p.n_heads + h) * p.head_dim;
                let mut want: Vec<f64> = x[base..base + p.head_dim].iter().map(|&v| v as f64).collect();
                let mut th = pos as f32;
                for (i, &f) in factors.iter().enumerate() {
                    let a = (p.freq_scale * (th / if with_ff { f } else { 1.0 })) as f64;
                    th *= theta_scale;
                    let (i0, i1) = match style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (a0, a1) = (want[i0], want[i1]);
                    want[i0] = a0 * a.cos() - a1 * a.sin();
                    want[i1] = a0 * a.sin() + a1 * a.cos();
                }
                for (k, w) in want.iter().enumerate() {
                    worst = worst.max((got[base + k] as f64 - w).abs());
                }
            }
        }
        let kernel = format!("rope {style:?}{}", if with_ff { " with frequency factors" } else { "" });
        out.push(Checked { kernel, worst, tolerance: ROPE_ABS_TOL });
    }

    let f = s.ffn_dim;
    let gate: Vec<f32> = rng.vec(f).iter().map(|v| v * 8.0).collect();
    let up = rng.vec(f);
    let got = swiglu(g, &gate, &up)?;
    let mut worst = 0f64;
    for i in 0..f {
        let a = gate[i] as f64;
        let want = a / (1.0 + (-a).exp()) * up[i] as f64;
        worst = worst.max(rel(got[i], want, want.abs().max(1e-3)));
    }
    out.push(Checked { kernel: "swiglu".into(), worst, tolerance: SWIGLU_REL_TOL });

    for (start, len) in [(0, 1), (70, 1), (20, 5)] {
        let (hd, nh, nkv) = (s.head_dim, s.n_heads, s.n_kv_heads);
        let kvd = nkv * hd;
        let q = rng.vec(len * nh * hd);
        let (k_old, v_old, k, v) = (rng.vec(start * kvd), rng.vec(start * kvd), rng.vec(len * kvd), rng.vec(len * kvd));
        let got = attention(g, s, &q, &k_old, &v_old, &k, &v, len)?;
        let round = |a: &[f32], b: &[f32]| -> Vec<f64> {
            a.iter().chain(b).map(|&x| half::f16::from_f32(x).to_f64()).collect()
        };
        let (keys, vals) = (round(&k_old, &k), round(&v_old, &v));
        let scale = 1.0 / (hd as f64).sqrt();
        let mut worst = 0f64;
        for t in 0..len {
            for h in 0..nh {
                let kh = h / (nh / nkv);
                let qr = &q[(t * nh + h) * hd..][..hd];
                let total = start + t + 1;
                let scores: Vec<f64> = (0..total)
                    .map(|p| (0..hd).map(|i| qr[i] as f64 * keys[p * kvd + kh * hd + i]).sum::<f64>() * scale)
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for i in 0..hd {
                    let want: f64 = (0..total).map(|p| e[p] * vals[p * kvd + kh * hd + i]).sum::<f64>() / sum;
                    worst = worst.max((got[(t * nh + h) * hd + i] as f64 - want).abs());
                }
            }
        }
        out.push(Checked {
            kernel: format!("attention {nh}/{nkv} heads, {start} held + {len} new"),
            worst,
            tolerance: ATTENTION_ABS_TOL,
        });
    }
    Ok(out)
}
