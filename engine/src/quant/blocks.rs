//! Block kernels: dequantize, quantize activations, and weight×activation dot products.
//!
//! These are the portable reference kernels (plain Rust that LLVM vectorises). Every function
//! checks lengths up front and returns a [`BackendError`] on a mismatch instead of panicking.

use super::GgmlType;
use crate::error::BackendError;
use half::{bf16, f16};

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[inline(always)]
fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn check_row(op: &'static str, ty: GgmlType, n: usize, bytes: usize) -> Result<(), BackendError> {
    match ty.row_bytes(n) {
        Some(expected) if expected == bytes => Ok(()),
        Some(expected) => Err(BackendError::Shape {
            op,
            detail: format!("{ty} row of {n} elements needs {expected} bytes, got {bytes}"),
        }),
        None => Err(BackendError::Shape { op, detail: format!("{n} elements is not a whole number of {ty} blocks") }),
    }
}

/// 6-bit scale and min `j` of a Q4_K/Q5_K super-block (ggml's `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 16 six-bit scales of a Q3_K super-block, unsigned (subtract 32 for the signed scale);
/// ggml's bit shuffle of its 12 scale bytes.
pub(crate) fn q3k_scales(s: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = low | (high << 4);
    }
    out
}

/// Dequantizes one row of `dst.len()` elements stored as `ty` in `src`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), BackendError> {
    check_row("dequantize", ty, dst.len(), src.len())?;
    let bs = ty.block_size();
    let ts = ty.type_size();
    for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
        match ty {
            GgmlType::F32 => y[0] = f32_at(b, 0),
            GgmlType::F16 => y[0] = f16_at(b, 0),
            GgmlType::BF16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            GgmlType::Q4_0 => {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                    y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
            GgmlType::Q4_1 => {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    y[j] = (b[4 + j] & 0xF) as f32 * d + m;
                    y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let (d, m, qh_at) =
                    if ty == GgmlType::Q5_0 { (f16_at(b, 0), 0.0, 2) } else { (f16_at(b, 0), f16_at(b, 2), 4) };
                let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                let qs = &b[qh_at + 4..qh_at + 20];
                let offset = if ty == GgmlType::Q5_0 { 16 } else { 0 };
                for j in 0..16 {
                    let xh0 = (((qh >> j) << 4) & 0x10) as i32;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as i32;
                    y[j] = (((qs[j] & 0xF) as i32 | xh0) - offset) as f32 * d + m;
                    y[j + 16] = (((qs[j] >> 4) as i32 | xh1) - offset) as f32 * d + m;
                }
            }
            GgmlType::Q8_0 => {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    y[j] = b[2 + j] as i8 as f32 * d;
                }
            }
            GgmlType::Q8_1 => {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    y[j] = b[4 + j] as i8 as f32 * d;
                }
            }
            GgmlType::Q2_K => {
                // ggml's dequantize_row_q2_K: scales[16] (scale | min << 4), qs[64], d, dmin.
                let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
                let mut e = 0;
                for n in 0..2 {
                    let q = &b[16 + 32 * n..16 + 32 * n + 32];
                    for j in 0..4 {
                        for half in 0..2 {
                            let sc = b[8 * n + 2 * j + half];
                            let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                            for l in 0..16 {
                                y[e] = dl * ((q[16 * half + l] >> (2 * j)) & 3) as f32 - ml;
                                e += 1;
                            }
                        }
                    }
                }
            }
            GgmlType::Q3_K => {
                // ggml's dequantize_row_q3_K: hmask[32], qs[64], scales[12] (6-bit, offset 32), d.
                let d = f16_at(b, 108);
                let sc = q3k_scales(&b[96..108]);
                let mut e = 0;
                for n in 0..2 {
                    let q = &b[32 + 32 * n..32 + 32 * n + 32];
                    for j in 0..4 {
                        let m = 1u8 << (4 * n + j);
                        for half in 0..2 {
                            let dl = d * (sc[8 * n + 2 * j + half] as i32 - 32) as f32;
                            for l in 16 * half..16 * half + 16 {
                                let low = ((q[l] >> (2 * j)) & 3) as i32;
                                let sub = if b[l] & m != 0 { 0 } else { 4 };
                                y[e] = dl * (low - sub) as f32;
                                e += 1;
                            }
                        }
                    }
                }
            }
            GgmlType::Q4_K => {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for g in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * g, scales);
                    let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                    let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * g..32 * g + 32];
                    for l in 0..32 {
                        y[64 * g + l] = d1 * (q[l] & 0xF) as f32 - m1;
                        y[64 * g + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
            GgmlType::Q5_K => {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qh = &b[16..48];
                let ql = &b[48..176];
                for g in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * g, scales);
                    let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                    let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &ql[32 * g..32 * g + 32];
                    for l in 0..32 {
                        let h1 = ((qh[l] >> (2 * g)) & 1) << 4;
                        let h2 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
                        y[64 * g + l] = d1 * ((q[l] & 0xF) + h1) as f32 - m1;
                        y[64 * g + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
                    }
                }
            }
            GgmlType::Q6_K => {
                let mut q = [0i8; 256];
                q6k_unpack(b, &mut q);
                let d = f16_at(b, 208);
                for (e, v) in q.iter().enumerate() {
                    y[e] = d * (b[192 + e / 16] as i8) as f32 * *v as f32;
                }
            }
            GgmlType::Q8_K => {
                let d = f32_at(b, 0);
                for j in 0..256 {
                    y[j] = d * b[4 + j] as i8 as f32;
                }
            }
        }
    }
    Ok(())
}

/// Unpacks a Q6_K block's 6-bit values to `-32..=31`, in element order.
#[inline(always)]
fn q6k_unpack(b: &[u8], q: &mut [i8; 256]) {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    for n in 0..2 {
        let (ql, qh) = (&ql[64 * n..64 * n + 64], &qh[32 * n..32 * n + 32]);
        for l in 0..32 {
            let base = 128 * n + l;
            q[base] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            q[base + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            q[base + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            q[base + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
}

/// Quantizes activations `x` to the activation type `ty` (F32, F16, BF16, Q8_0, Q8_1 or Q8_K),
/// rounding as llama.cpp's x86 CPU backend does (ties to even).
pub fn quantize_row(ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<(), BackendError> {
    check_row("quantize", ty, x.len(), dst.len())?;
    let bs = ty.block_size();
    for (xb, b) in x.chunks_exact(bs).zip(dst.chunks_exact_mut(ty.type_size())) {
        match ty {
            GgmlType::F32 => b.copy_from_slice(&xb[0].to_le_bytes()),
            GgmlType::F16 => b.copy_from_slice(&f16::from_f32(xb[0]).to_le_bytes()),
            GgmlType::BF16 => b.copy_from_slice(&bf16::from_f32(xb[0]).to_le_bytes()),
            GgmlType::Q8_0 | GgmlType::Q8_1 => {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let qs_at = if ty == GgmlType::Q8_0 { 2 } else { 4 };
                let mut sum = 0i32;
                for (j, v) in xb.iter().enumerate() {
                    let q = (v * id).round_ties_even() as i32;
                    sum += q;
                    b[qs_at + j] = q as i8 as u8;
                }
                b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                if ty == GgmlType::Q8_1 {
                    b[2..4].copy_from_slice(&f16::from_f32(d * sum as f32).to_le_bytes());
                }
            }
            GgmlType::Q8_K => {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in xb {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                b.fill(0);
                if amax == 0.0 {
                    continue;
                }
                let iscale = -127.0 / max;
                for (j, v) in xb.iter().enumerate() {
                    let q = ((iscale * v).round_ties_even() as i32).min(127);
                    b[4 + j] = q as i8 as u8;
                }
                for g in 0..16 {
                    let s: i16 = b[4 + 16 * g..4 + 16 * g + 16].iter().map(|&q| q as i8 as i16).sum();
                    b[260 + 2 * g..262 + 2 * g].copy_from_slice(&s.to_le_bytes());
                }
                b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
            }
            other => {
                return Err(BackendError::Unsupported {
                    backend: "cpu",
                    op: format!("quantizing activations to {other}"),
                })
            }
        }
    }
    Ok(())
}

/// Dot product of a weight row of type `wty` with an activation row already quantized to
/// `wty.vec_dot_type()`, both `n` elements long: the portable reference (the CPU backend's
/// row kernels, `backend::cpu::rows`, equal it bit for bit).
pub fn vec_dot(wty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> Result<f32, BackendError> {
    check_row("vec_dot weights", wty, n, w.len())?;
    check_row("vec_dot activations", wty.vec_dot_type(), n, a.len())?;
    Ok(vec_dot_portable(wty, w, a))
}

/// Eight float lanes as one 256-bit register holds them. For 32-element blocks, lane `k`
/// gathers the integer products of elements `4k..4k+4` and accumulates `scale × sum` with a
/// fused multiply-add — the order llama.cpp's x86 kernels use, so rounding agrees with it.
#[derive(Clone, Copy, Default)]
struct Lanes([f32; 8]);

impl Lanes {
    #[inline(always)]
    fn fma_block(&mut self, scale: f32, prod: &[i16; 32]) {
        for k in 0..8 {
            let s = prod[4 * k] as i32 + prod[4 * k + 1] as i32 + prod[4 * k + 2] as i32 + prod[4 * k + 3] as i32;
            self.0[k] = scale.mul_add(s as f32, self.0[k]);
        }
    }

    /// Horizontal sum in the order of `hsum_float_8` (high half + low half, then pairs).
    #[inline(always)]
    fn sum(&self) -> f32 {
        let a = &self.0;
        let r = [a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]];
        (r[0] + r[2]) + (r[1] + r[3])
    }
}

#[inline(always)]
pub(crate) fn vec_dot_portable(wty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    let at = wty.vec_dot_type();
    let wb = w.chunks_exact(wty.type_size());
    let ab = a.chunks_exact(at.type_size());
    let mut lanes = Lanes::default();
    // Products of a ≤5-bit weight (or an i8) and an i8 fit in i16; sums of four go to i32.
    let mut prod = [0i16; 32];
    match wty {
        GgmlType::F32 => dot_floats(w, a, 4, |b| f32_at(b, 0), |b| f32_at(b, 0)),
        GgmlType::F16 => dot_floats(w, a, 2, |b| f16_at(b, 0), |b| f16_at(b, 0)),
        GgmlType::BF16 => {
            let cv = |b: &[u8]| bf16::from_le_bytes([b[0], b[1]]).to_f32();
            dot_floats(w, a, 2, cv, cv)
        }
        GgmlType::Q4_0 => {
            for (w, a) in w.as_chunks::<18>().0.iter().zip(a.as_chunks::<34>().0) {
                for j in 0..16 {
                    prod[j] = ((w[2 + j] & 0xF) as i16 - 8) * a[2 + j] as i8 as i16;
                    prod[j + 16] = ((w[2 + j] >> 4) as i16 - 8) * a[18 + j] as i8 as i16;
                }
                lanes.fma_block(f16_at(w, 0) * f16_at(a, 0), &prod);
            }
            lanes.sum()
        }
        GgmlType::Q4_1 => {
            let mut summs = 0f32;
            for (w, a) in w.as_chunks::<20>().0.iter().zip(a.as_chunks::<36>().0) {
                summs += f16_at(w, 2) * f16_at(a, 2);
                for j in 0..16 {
                    prod[j] = (w[4 + j] & 0xF) as i16 * a[4 + j] as i8 as i16;
                    prod[j + 16] = (w[4 + j] >> 4) as i16 * a[20 + j] as i8 as i16;
                }
                lanes.fma_block(f16_at(w, 0) * f16_at(a, 0), &prod);
            }
            lanes.sum() + summs
        }
        GgmlType::Q5_0 => {
            for (w, a) in w.as_chunks::<22>().0.iter().zip(a.as_chunks::<34>().0) {
                let qh = u32::from_le_bytes([w[2], w[3], w[4], w[5]]);
                for j in 0..16 {
                    let xh0 = (((qh >> j) << 4) & 0x10) as i16;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as i16;
                    prod[j] = (((w[6 + j] & 0xF) as i16 | xh0) - 16) * a[2 + j] as i8 as i16;
                    prod[j + 16] = (((w[6 + j] >> 4) as i16 | xh1) - 16) * a[18 + j] as i8 as i16;
                }
                lanes.fma_block(f16_at(w, 0) * f16_at(a, 0), &prod);
            }
            lanes.sum()
        }
        GgmlType::Q5_1 => {
            let mut summs = 0f32;
            for (w, a) in w.as_chunks::<24>().0.iter().zip(a.as_chunks::<36>().0) {
                summs += f16_at(w, 2) * f16_at(a, 2);
                let qh = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
                for j in 0..16 {
                    let xh0 = (((qh >> j) << 4) & 0x10) as i16;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as i16;
                    prod[j] = ((w[8 + j] & 0xF) as i16 | xh0) * a[4 + j] as i8 as i16;
                    prod[j + 16] = ((w[8 + j] >> 4) as i16 | xh1) * a[20 + j] as i8 as i16;
                }
                lanes.fma_block(f16_at(w, 0) * f16_at(a, 0), &prod);
            }
            lanes.sum() + summs
        }
        GgmlType::Q8_0 => {
            for (w, a) in w.as_chunks::<34>().0.iter().zip(a.as_chunks::<34>().0) {
                for j in 0..32 {
                    prod[j] = w[2 + j] as i8 as i16 * a[2 + j] as i8 as i16;
                }
                lanes.fma_block(f16_at(w, 0) * f16_at(a, 0), &prod);
            }
            lanes.sum()
        }
        GgmlType::Q8_1 => {
            let mut summs = 0f32;
            for (w, a) in w.as_chunks::<36>().0.iter().zip(a.as_chunks::<36>().0) {
                summs += f16_at(w, 2) * f16_at(a, 2);
                for j in 0..32 {
                    prod[j] = w[4 + j] as i8 as i16 * a[4 + j] as i8 as i16;
                }
                lanes.fma_block(f16_at(w, 0) * f16_at(a, 0), &prod);
            }
            lanes.sum() + summs
        }
        GgmlType::Q2_K | GgmlType::Q3_K => wb
            .zip(ab)
            .map(|(w, a)| {
                // The weights as ggml defines them (via dequantization's integer parts):
                // Σ_groups d·s·Σ q·a − dmin·m·Σ a, per 16-element group.
                let aq = &a[4..260];
                let bsum = |k: usize| i16::from_le_bytes([a[260 + 2 * k], a[261 + 2 * k]]) as i32;
                let (mut sumi, mut summ) = (0i32, 0i32);
                let sc3 = if wty == GgmlType::Q3_K { q3k_scales(&w[96..108]) } else { [0; 16] };
                for n in 0..2 {
                    for j in 0..4 {
                        for half in 0..2 {
                            let g = 8 * n + 2 * j + half;
                            let mut s = 0i32;
                            for l in 16 * half..16 * half + 16 {
                                let e = 128 * n + 32 * j + l;
                                let q = if wty == GgmlType::Q2_K {
                                    ((w[16 + 32 * n + l] >> (2 * j)) & 3) as i32
                                } else {
                                    let low = ((w[32 + 32 * n + l] >> (2 * j)) & 3) as i32;
                                    low - if w[l] & (1 << (4 * n + j)) != 0 { 0 } else { 4 }
                                };
                                s += q * aq[e] as i8 as i32;
                            }
                            if wty == GgmlType::Q2_K {
                                sumi += (w[g] & 0xF) as i32 * s;
                                summ += (w[g] >> 4) as i32 * bsum(g);
                            } else {
                                sumi += (sc3[g] as i32 - 32) * s;
                            }
                        }
                    }
                }
                if wty == GgmlType::Q2_K {
                    f32_at(a, 0) * (f16_at(w, 80) * sumi as f32 - f16_at(w, 82) * summ as f32)
                } else {
                    f16_at(w, 108) * f32_at(a, 0) * sumi as f32
                }
            })
            .sum(),
        GgmlType::Q4_K | GgmlType::Q5_K => wb.zip(ab).map(|(w, a)| dot_q45k_q8k(wty, w, a)).sum(),
        GgmlType::Q6_K => wb
            .zip(ab)
            .map(|(w, a)| {
                let mut q = [0i8; 256];
                q6k_unpack(w, &mut q);
                let mut sumi = 0i32;
                for g in 0..16 {
                    let mut s = 0i32;
                    for l in 0..16 {
                        s += q[16 * g + l] as i32 * a[4 + 16 * g + l] as i8 as i32;
                    }
                    sumi += s * w[192 + g] as i8 as i32;
                }
                f16_at(w, 208) * f32_at(a, 0) * sumi as f32
            })
            .sum(),
        GgmlType::Q8_K => wb
            .zip(ab)
            .map(|(w, a)| {
                let mut s = 0i32;
                for j in 0..256 {
                    s += w[4 + j] as i8 as i32 * a[4 + j] as i8 as i32;
                }
                f32_at(w, 0) * f32_at(a, 0) * s as f32
            })
            .sum(),
    }
}

#[inline(always)]
fn dot_q45k_q8k(wty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    let (d, dmin) = (f16_at(w, 0), f16_at(w, 2));
    let d8 = f32_at(a, 0);
    let scales = &w[4..16];
    let (qh, ql) = if wty == GgmlType::Q5_K { (&w[16..48], &w[48..176]) } else { (&w[0..0], &w[16..144]) };
    let aq = &a[4..260];
    let (mut sumi, mut summ) = (0i32, 0i32);
    for g in 0..4 {
        let q = &ql[32 * g..32 * g + 32];
        let (mut s_lo, mut s_hi) = (0i32, 0i32);
        for l in 0..32 {
            let (mut lo, mut hi) = ((q[l] & 0xF) as i32, (q[l] >> 4) as i32);
            if wty == GgmlType::Q5_K {
                lo |= (((qh[l] >> (2 * g)) & 1) as i32) << 4;
                hi |= (((qh[l] >> (2 * g + 1)) & 1) as i32) << 4;
            }
            s_lo += lo * aq[64 * g + l] as i8 as i32;
            s_hi += hi * aq[64 * g + 32 + l] as i8 as i32;
        }
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        sumi += sc1 as i32 * s_lo + sc2 as i32 * s_hi;
        let bsum = |k: usize| i16::from_le_bytes([a[260 + 2 * k], a[261 + 2 * k]]) as i32;
        summ += m1 as i32 * (bsum(4 * g) + bsum(4 * g + 1)) + m2 as i32 * (bsum(4 * g + 2) + bsum(4 * g + 3));
    }
    d8 * (d * sumi as f32 - dmin * summ as f32)
}

/// Float dot product with eight independent accumulators (as a SIMD register would hold).
#[inline(always)]
fn dot_floats(w: &[u8], a: &[u8], size: usize, cw: impl Fn(&[u8]) -> f32, ca: impl Fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut wi = w.chunks_exact(size);
    let mut ai = a.chunks_exact(size);
    let mut k = 0;
    while let (Some(x), Some(y)) = (wi.next(), ai.next()) {
        acc[k & 7] += cw(x) * ca(y);
        k += 1;
    }
    acc.iter().sum()
}
