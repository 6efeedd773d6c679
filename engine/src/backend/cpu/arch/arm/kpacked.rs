//! AArch64 kernel over the K-quant packed layout (see `kpacked.rs` for the layout and the
//! arithmetic it reproduces bit for bit): NEON with the dot-product extension. A tile's 16 rows
//! are four quads of 4 rows, one 128-bit register each: 16 bytes of every 64-byte plane block.
//! `sdot v.4s, w.16b, a.4b[i]` multiplies the quad's 4 rows by 4 activations of a chunk; the
//! weights are unsigned and at most 6 bits (< 128), so the signed instruction is exact. A group's
//! dot products start from `−o · s_g` (Q3_K, Q6_K: the offset term, so it costs nothing per
//! chunk), take one `sdot` per chunk and token, and one `mla` by the rows' group scales; the
//! minimums' sums (Q2_K, Q4_K, Q5_K) take one widening `smlal` by element per group. Per
//! super-block and quad, one FMA per sum. Up to four tokens per call share each group's unpacked
//! weights.
//!
//! Runs in CI under qemu-user (correctness against the scalar reference, not speed).

use crate::backend::layout::kpacked::{KActs, KKind, KPackedMatrix, SB};
use crate::backend::layout::packed::TILE_ROWS;
use std::arch::aarch64::*;
use std::arch::asm;

use crate::backend::layout::kpacked::{kind_of, K_Q2K, K_Q3K, K_Q4K, K_Q5K, K_Q6K};

/// Tokens per inner call (each token's sums of one quad stay in registers).
const MAX_NT: usize = 4;

/// `acc += w · a.4b[I]` per 32-bit lane, the weights' bytes taken as signed (they are < 128).
#[inline(always)]
fn sdot<const I: i32>(acc: int32x4_t, w: uint8x16_t, a: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` (by element) reads and writes registers only; callers run only where the
    // dot-product extension was detected (the enclosing function enables it).
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {a:v}.4b[{i}]",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            a = in(vreg) a,
            i = const I,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// Four f16 (as their bits) to f32, exactly: `fcvtl` (base AArch64 SIMD; the f16 vector types of
/// `std::arch` are not stable).
#[inline(always)]
fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: `fcvtl` reads and writes registers only and is part of base AArch64 SIMD.
    unsafe {
        asm!(
            "fcvtl {o:v}.4s, {h:v}.4h",
            o = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    out
}

/// # Safety
/// The CPU must support NEON and the dot-product extension; the shapes were checked by
/// `kpacked::run` (`out` holds `nt * TILE_ROWS` values, tokens `t0..t0 + nt` are quantized).
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn tile_neon_dotprod(w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, nt: usize, out: &mut [f32]) {
    let mut j = 0;
    while j < nt {
        let m = (nt - j).min(MAX_NT);
        let o = &mut out[j * TILE_ROWS..(j + m) * TILE_ROWS];
        // SAFETY: the same contract, for tokens `t0 + j..t0 + j + m`.
        unsafe {
            match m {
                4 => by_kind::<4>(w, tile, a, t0 + j, o),
                3 => by_kind::<3>(w, tile, a, t0 + j, o),
                2 => by_kind::<2>(w, tile, a, t0 + j, o),
                _ => by_kind::<1>(w, tile, a, t0 + j, o),
            }
        }
        j += m;
    }
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn by_kind<const NT: usize>(w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, out: &mut [f32]) {
    // SAFETY: the caller's contract; the inner loop checks its own shapes.
    unsafe {
        match w.kind {
            KKind::Q2K => tile_k::<K_Q2K, NT>(w, tile, a, t0, out),
            KKind::Q3K => tile_k::<K_Q3K, NT>(w, tile, a, t0, out),
            KKind::Q4K => tile_k::<K_Q4K, NT>(w, tile, a, t0, out),
            KKind::Q5K => tile_k::<K_Q5K, NT>(w, tile, a, t0, out),
            KKind::Q6K => tile_k::<K_Q6K, NT>(w, tile, a, t0, out),
        }
    }
}

/// Bit `C` of every byte moved to bit 4 (Q5_K's fifth bit), the other bits left as they come.
#[inline(always)]
fn to_bit4<const C: i32>(x: uint8x16_t) -> uint8x16_t {
    // SAFETY: NEON is part of every AArch64 target; the shifts read and write registers only.
    unsafe {
        match C {
            0 => vshlq_n_u8::<4>(x),
            1 => vshlq_n_u8::<3>(x),
            2 => vshlq_n_u8::<2>(x),
            3 => vshlq_n_u8::<1>(x),
            4 => x,
            5 => vshrq_n_u8::<1>(x),
            6 => vshrq_n_u8::<2>(x),
            _ => vshrq_n_u8::<3>(x),
        }
    }
}

/// Bit `C` of every byte moved to bit 0 (Q3_K's third bit, before its shift into place).
#[inline(always)]
fn to_bit0<const C: i32>(x: uint8x16_t) -> uint8x16_t {
    // SAFETY: as in `to_bit4`.
    unsafe {
        match C {
            0 => x,
            1 => vshrq_n_u8::<1>(x),
            2 => vshrq_n_u8::<2>(x),
            3 => vshrq_n_u8::<3>(x),
            4 => vshrq_n_u8::<4>(x),
            5 => vshrq_n_u8::<5>(x),
            6 => vshrq_n_u8::<6>(x),
            _ => vshrq_n_u8::<7>(x),
        }
    }
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn tile_k<const KIND: u8, const NT: usize>(
    w: &KPackedMatrix,
    tile: usize,
    a: &KActs,
    t0: usize,
    out: &mut [f32],
) {
    let kind = kind_of::<KIND>();
    let sbs = w.superblocks();
    let rec = kind.record_bytes();
    let data = w.tile(tile);
    assert!(
        w.kind == kind
            && data.len() == sbs * rec
            && out.len() >= NT * TILE_ROWS
            && a.cols == w.cols
            && a.qs.len() >= (t0 + NT) * w.cols
            && a.d.len() >= (t0 + NT) * sbs
            && a.bs16.len() >= (t0 + NT) * sbs * 16
            && a.bs32.len() >= (t0 + NT) * sbs * 8
    );
    let zero = vdupq_n_s32(0);
    let m03 = vdupq_n_u8(0x03);
    let m07 = vdupq_n_u8(0x07);
    let m0f = vdupq_n_u8(0x0F);
    let m10 = vdupq_n_u8(0x10);
    let m3f = vdupq_n_u8(0x3F);
    // Bytes (e0 o0 e1 o1 e2 o2 e3 o3) to (e0 e1 e2 e3 o0 o1 o2 o3).
    let unzip = vcreate_u8(0x0705_0301_0604_0200);
    // Per quad of 4 rows, per token.
    let mut acc = [[vdupq_n_f32(0.0); NT]; 4];
    // Per token: −o · s_g, the starting value of group g's dot products (Q3_K, Q6_K).
    let mut neg_off = [[0i32; 16]; NT];
    // SAFETY: the pointer reads below: `r` is record `b` of this tile (`rec` bytes; every offset
    // comes from `kind`'s layout plus 16·quad (plane blocks), 4·quad (scale bytes), 8·quad (f16s
    // and minimums) for rows 4·quad..4·quad+4, and stays inside the record); activation reads are
    // inside token `t0 + j`'s super-block `b`: 16 bytes at 16k (k < 16) of its 256 values, i16
    // sums at index < 16 / < 8 (sizes asserted above); `neg_off` reads are at g < 16.
    unsafe {
        for b in 0..sbs {
            let r = data.as_ptr().add(b * rec);
            let ab: [usize; NT] = std::array::from_fn(|j| (t0 + j) * sbs + b);
            let q: [*const i8; NT] = std::array::from_fn(|j| a.qs.as_ptr().add(ab[j] * SB));
            let s16: [*const i16; NT] = std::array::from_fn(|j| a.bs16.as_ptr().add(16 * ab[j]));
            let s32: [*const i16; NT] = std::array::from_fn(|j| a.bs32.as_ptr().add(8 * ab[j]));
            if kind.offset() != 0 {
                for (o, s) in neg_off.iter_mut().zip(s16) {
                    for (g, v) in o.iter_mut().enumerate() {
                        *v = -kind.offset() * *s.add(g) as i32;
                    }
                }
            }
            // The i16 activation sums of groups 2p (lane 0) and 2p + 1 (lane 1).
            let sums = |s: *const i16, p: usize| {
                vreinterpret_s16_u32(vdup_n_u32((s.add(2 * p) as *const u32).read_unaligned()))
            };
            for (quad, acc) in acc.iter_mut().enumerate() {
                let base = r.add(kind.base_off() + 16 * quad);
                let high = r.add(kind.high_off() + 16 * quad);
                let scales = r.add(kind.scales_off() + 4 * quad);
                let mut si = [zero; NT];
                let mut sm = [zero; NT];
                for p in 0..kind.groups() / 2 {
                    // The quad's scale bytes of group 2p (bytes 0..4) and 2p + 1 (4..8).
                    let lo = (scales.add(32 * p) as *const u32).read_unaligned();
                    let hi = (scales.add(32 * p + 16) as *const u32).read_unaligned();
                    let sb = vcreate_u8(lo as u64 | (hi as u64) << 32);
                    let sc16 = match kind {
                        KKind::Q3K | KKind::Q6K => vmovl_s8(vreinterpret_s8_u8(sb)),
                        KKind::Q2K => vreinterpretq_s16_u16(vmovl_u8(vand_u8(sb, vdup_n_u8(0x0F)))),
                        _ => vreinterpretq_s16_u16(vmovl_u8(sb)),
                    };
                    let sc = [vmovl_s16(vget_low_s16(sc16)), vmovl_high_s16(sc16)];
                    // A 16-column group g = 2p + e with the weights of its chunks 4g..4g+4 (one
                    // 16-byte activation load per token): `sc · (dot − o · s_g)` into the rows'
                    // i32 sums for every token.
                    macro_rules! group16 {
                        ($e:literal, [$w0:expr, $w1:expr, $w2:expr, $w3:expr]) => {{
                            let g = 2 * p + $e;
                            let (w0, w1, w2, w3) = ($w0, $w1, $w2, $w3);
                            for j in 0..NT {
                                let av = vld1q_s8(q[j].add(16 * g));
                                let mut dot = if kind.offset() != 0 { vld1q_dup_s32(&neg_off[j][g]) } else { zero };
                                dot = sdot::<0>(dot, w0, av);
                                dot = sdot::<1>(dot, w1, av);
                                dot = sdot::<2>(dot, w2, av);
                                dot = sdot::<3>(dot, w3, av);
                                si[j] = vmlaq_s32(si[j], dot, sc[$e]);
                            }
                        }};
                    }
                    match kind {
                        KKind::Q4K | KKind::Q5K => {
                            // Group g: chunks 8g..8g+8, base blocks 4g..4g+4 (chunk 8g+2i in the low
                            // nibbles, 8g+2i+1 in the high), 1-bit block g at bit c for chunk 8g+c
                            // (Q5_K).
                            macro_rules! group {
                                ($e:literal) => {{
                                    let g = 2 * p + $e;
                                    let hv = if kind == KKind::Q5K { vld1q_u8(high.add(64 * g)) } else { m0f };
                                    let x = |i: usize| vld1q_u8(base.add(64 * (4 * g + i)));
                                    let lo = |x: uint8x16_t, h: uint8x16_t| {
                                        let n = vandq_u8(x, m0f);
                                        if kind == KKind::Q5K { vbslq_u8(m10, h, n) } else { n }
                                    };
                                    let hi = |x: uint8x16_t, h: uint8x16_t| {
                                        let n = vshrq_n_u8::<4>(x);
                                        if kind == KKind::Q5K { vbslq_u8(m10, h, n) } else { n }
                                    };
                                    let (x0, x1, x2, x3) = (x(0), x(1), x(2), x(3));
                                    let w0 = lo(x0, to_bit4::<0>(hv));
                                    let w1 = hi(x0, to_bit4::<1>(hv));
                                    let w2 = lo(x1, to_bit4::<2>(hv));
                                    let w3 = hi(x1, to_bit4::<3>(hv));
                                    let w4 = lo(x2, to_bit4::<4>(hv));
                                    let w5 = hi(x2, to_bit4::<5>(hv));
                                    let w6 = lo(x3, to_bit4::<6>(hv));
                                    let w7 = hi(x3, to_bit4::<7>(hv));
                                    for j in 0..NT {
                                        let a0 = vld1q_s8(q[j].add(32 * g));
                                        let a1 = vld1q_s8(q[j].add(32 * g + 16));
                                        let mut dot = sdot::<0>(zero, w0, a0);
                                        dot = sdot::<1>(dot, w1, a0);
                                        dot = sdot::<2>(dot, w2, a0);
                                        dot = sdot::<3>(dot, w3, a0);
                                        dot = sdot::<0>(dot, w4, a1);
                                        dot = sdot::<1>(dot, w5, a1);
                                        dot = sdot::<2>(dot, w6, a1);
                                        dot = sdot::<3>(dot, w7, a1);
                                        si[j] = vmlaq_s32(si[j], dot, sc[$e]);
                                    }
                                }};
                            }
                            group!(0);
                            group!(1);
                        }
                        KKind::Q6K => {
                            // Group g: chunks 4g..4g+4, base blocks 2g, 2g+1, 2-bit block g (bits
                            // 2c, 2c+1 for chunk 4g+c, to bits 4 and 5).
                            macro_rules! group {
                                ($e:literal) => {{
                                    let g = 2 * p + $e;
                                    let hv = vld1q_u8(high.add(64 * g));
                                    let x0 = vld1q_u8(base.add(64 * (2 * g)));
                                    let x1 = vld1q_u8(base.add(64 * (2 * g + 1)));
                                    // (hv << 4) | low nibble of x0, bits 6 and 7 cleared.
                                    let w0 = vandq_u8(vsliq_n_u8::<4>(x0, hv), m3f);
                                    // (hv << 2)'s high nibble | x0 >> 4, bits 6 and 7 cleared.
                                    let w1 = vandq_u8(vsriq_n_u8::<4>(vshlq_n_u8::<2>(hv), x0), m3f);
                                    // hv's high nibble | low nibble of x1, bits 6 and 7 cleared.
                                    let w2 = vandq_u8(vbslq_u8(m0f, x1, hv), m3f);
                                    // (hv >> 2)'s high nibble (bits 6, 7 already clear) | x1 >> 4.
                                    let w3 = vsriq_n_u8::<4>(vshrq_n_u8::<2>(hv), x1);
                                    group16!($e, [w0, w1, w2, w3]);
                                }};
                            }
                            group!(0);
                            group!(1);
                        }
                        KKind::Q2K | KKind::Q3K => {
                            // Group g: chunks 4g..4g+4, 2-bit block g; Q3_K: 1-bit block p = g/2,
                            // bit 4e + c for chunk 4g + c of group 2p + e, to bit 2.
                            let hv = if kind == KKind::Q3K { vld1q_u8(high.add(64 * p)) } else { m03 };
                            // Bits 0 and 1 of `t`, and for Q3_K bit 0 of `h` as bit 2.
                            let w = |t: uint8x16_t, h: uint8x16_t| {
                                if kind == KKind::Q3K {
                                    vandq_u8(vsliq_n_u8::<2>(t, h), m07)
                                } else {
                                    vandq_u8(t, m03)
                                }
                            };
                            macro_rules! group {
                                ($e:literal, $c0:literal, $c1:literal, $c2:literal, $c3:literal) => {{
                                    let g = 2 * p + $e;
                                    let x = vld1q_u8(base.add(64 * g));
                                    let w0 = w(x, to_bit0::<$c0>(hv));
                                    let w1 = w(vshrq_n_u8::<2>(x), to_bit0::<$c1>(hv));
                                    let w2 = w(vshrq_n_u8::<4>(x), to_bit0::<$c2>(hv));
                                    let w3 = w(vshrq_n_u8::<6>(x), to_bit0::<$c3>(hv));
                                    group16!($e, [w0, w1, w2, w3]);
                                }};
                            }
                            group!(0, 0, 1, 2, 3);
                            group!(1, 4, 5, 6, 7);
                        }
                    }
                    if kind.has_min() {
                        // The quad's minimums: groups 2p (i16 lanes 0..4) and 2p + 1 (4..8).
                        let (m16, s) = if kind == KKind::Q2K {
                            (vreinterpretq_s16_u16(vmovl_u8(vshr_n_u8::<4>(sb))), s16)
                        } else {
                            // Q4_K/Q5_K: in group pairs, byte 32p + 2r + e (the quad's rows at 8·quad).
                            let m = vld1_u8(r.add(kind.mins_off() + 32 * p + 8 * quad));
                            (vreinterpretq_s16_u16(vmovl_u8(vtbl1_u8(m, unzip))), s32)
                        };
                        for j in 0..NT {
                            let sp = sums(s[j], p);
                            sm[j] = vmlal_lane_s16::<0>(sm[j], vget_low_s16(m16), sp);
                            sm[j] = vmlal_high_lane_s16::<1>(sm[j], m16, sp);
                        }
                    }
                }
                let dv = f16x4_to_f32(vreinterpret_u16_u8(vld1_u8(r.add(8 * quad))));
                for j in 0..NT {
                    let fd = vmulq_n_f32(dv, *a.d.get_unchecked(ab[j]));
                    acc[j] = vfmaq_f32(acc[j], fd, vcvtq_f32_s32(si[j]));
                }
                if kind.has_min() {
                    let dm = f16x4_to_f32(vreinterpret_u16_u8(vld1_u8(r.add(kind.dmin_off() + 8 * quad))));
                    for j in 0..NT {
                        let fm = vmulq_n_f32(dm, *a.d.get_unchecked(ab[j]));
                        // acc − fm · sm, one rounding: fma(−(dmin · a_d), SM, acc).
                        acc[j] = vfmsq_f32(acc[j], fm, vcvtq_f32_s32(sm[j]));
                    }
                }
            }
        }
        for (quad, acc) in acc.iter().enumerate() {
            for (j, v) in acc.iter().enumerate() {
                vst1q_f32(out.as_mut_ptr().add(j * TILE_ROWS + 4 * quad), *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::kpacked::{reference, run, KActs, KKind, KPackedMatrix, SB};
    use crate::backend::cpu::packed::{Kernel, KernelKind, TILE_ROWS};

    /// GGUF rows of `kind`: the first tile with every bit set (every weight, scale and minimum
    /// at its largest), the rest pseudo-random; the f16 scales sane.
    fn rows(kind: KKind, rows: usize, cols: usize) -> Vec<u8> {
        let ts = kind.ggml().type_size();
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut raw: Vec<u8> = (0..rows * cols / SB * ts)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                if i < TILE_ROWS * cols / SB * ts {
                    0xFF
                } else {
                    s as u8
                }
            })
            .collect();
        let f16s: &[usize] = match kind {
            KKind::Q2K => &[80, 82],
            KKind::Q3K => &[108],
            KKind::Q4K | KKind::Q5K => &[0, 2],
            KKind::Q6K => &[208],
        };
        for b in raw.chunks_exact_mut(ts) {
            for &at in f16s {
                b[at..at + 2].copy_from_slice(&0x2C00u16.to_le_bytes()); // 0.0625
            }
        }
        raw
    }

    /// The NEON kernel equals the reference at the extremes (largest weights times activations
    /// of −127 or 127 throughout) and for every token count up to 9.
    #[test]
    fn neon_equals_the_reference_at_the_extremes_and_every_token_count() {
        let Some(kernel) = Kernel::available().into_iter().find(|k| k.kind() == KernelKind::NeonDotprod) else {
            eprintln!("no dot-product extension here: skipped");
            return;
        };
        let (nrows, cols, n) = (37, 768, 9);
        // Token 0: every activation −127. Token 1: 127 but for the first of each super-block
        // (Q8_K scales by the first value of largest magnitude, which becomes −127). The rest vary.
        let x: Vec<f32> = (0..n * cols)
            .map(|i| match i / cols {
                0 => 1.0,
                1 if i % SB == 0 => 1.0,
                1 => -1.0,
                t => ((i * 7919 + t) % 255) as f32 / 127.0 - 1.0,
            })
            .collect();
        let mut a = KActs::default();
        a.quantize(&x, n, cols);
        assert!(a.qs[..cols].iter().all(|&q| q == -127));
        assert!(a.qs[cols..2 * cols].iter().enumerate().all(|(i, &q)| q == if i % SB == 0 { -127 } else { 127 }));
        for kind in [KKind::Q2K, KKind::Q3K, KKind::Q4K, KKind::Q5K, KKind::Q6K] {
            let raw = rows(kind, nrows, cols);
            let rb = kind.ggml().row_bytes(cols).expect("row bytes");
            let w = KPackedMatrix::pack_in(None, kind, nrows, cols, |r0, buf| {
                buf.copy_from_slice(&raw[r0 * rb..r0 * rb + buf.len()]);
                Ok(())
            })
            .expect("pack");
            for tile in 0..w.tiles() {
                for nt in 1..=n {
                    let (mut want, mut got) = (vec![0f32; nt * TILE_ROWS], vec![0f32; nt * TILE_ROWS]);
                    reference(&w, tile, &a, 0, nt, &mut want);
                    run(kernel, &w, tile, &a, 0, nt, &mut got);
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), e.to_bits(), "{kind:?} tile {tile} nt {nt} [{i}]: {g} vs {e}");
                    }
                }
            }
        }
    }
}
