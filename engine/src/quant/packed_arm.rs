//! AArch64 kernel over the packed layout (see `packed.rs`): NEON with the dot-product extension
//! (`sdot`, by element). A 64-byte chunk is four registers of four rows; `sdot v.4s, w.16b,
//! a.4b[i]` multiplies four rows by the same four activations. Weights are unsigned and below 128
//! for Q4 (nibbles) so the signed instruction is exact; Q8_0 bytes are flipped back to signed
//! (`u ^ 0x80`), which makes the offset term zero. The float part follows the reference order.
//!
//! Runs in CI under qemu-user (correctness against the scalar reference, not speed).

use super::packed::{PackKind, PackedMatrix, QuantActs, BLOCK, TILE_ROWS};
use half::f16;
use std::arch::aarch64::*;
use std::arch::asm;

/// Largest token group held in registers.
const GROUP: usize = 4;

/// `acc += w · a.4b[I]` per 32-bit lane.
#[inline(always)]
fn sdot<const I: i32>(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
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

/// # Safety
/// The CPU must support NEON and the dot-product extension; `out` holds `nt * TILE_ROWS`
/// values, `t0 + nt <= a.n`, `a.cols == w.cols`, `tile < w.tiles()`.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn tile_neon_dotprod(w: &PackedMatrix, tile: usize, a: &QuantActs, t0: usize, nt: usize, out: &mut [f32]) {
    let mut j = 0;
    while j < nt {
        let g = (nt - j).min(GROUP);
        // SAFETY: same contract as this function, for tokens t0+j..t0+j+g.
        unsafe {
            match g {
                4 => group::<4>(w, tile, a, t0 + j, &mut out[j * TILE_ROWS..]),
                3 => group::<3>(w, tile, a, t0 + j, &mut out[j * TILE_ROWS..]),
                2 => group::<2>(w, tile, a, t0 + j, &mut out[j * TILE_ROWS..]),
                _ => group::<1>(w, tile, a, t0 + j, &mut out[j * TILE_ROWS..]),
            }
        }
        j += g;
    }
}

#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn group<const NT: usize>(w: &PackedMatrix, tile: usize, a: &QuantActs, t0: usize, out: &mut [f32]) {
    let kind = w.kind;
    let blocks = w.blocks();
    let rec = kind.record_bytes();
    let qo = kind.qs_offset();
    let off = if kind == PackKind::Q8_0 { 0 } else { kind.offset() };
    let data = w.tile(tile);
    assert!(data.len() == blocks * rec && out.len() >= NT * TILE_ROWS && a.qs.len() >= (t0 + NT) * a.cols);
    let mut acc = [[vdupq_n_f32(0.0); 4]; NT];
    let mask = vdupq_n_u8(0x0F);
    let flip = vdupq_n_u8(0x80);
    for b in 0..blocks {
        let r = &data[b * rec..(b + 1) * rec];
        let mut dv = [0f32; TILE_ROWS];
        let mut mv = [0f32; TILE_ROWS];
        for lane in 0..TILE_ROWS {
            dv[lane] = f16::from_le_bytes([r[2 * lane], r[2 * lane + 1]]).to_f32();
            if kind == PackKind::Q4_1 {
                mv[lane] = f16::from_le_bytes([r[32 + 2 * lane], r[33 + 2 * lane]]).to_f32();
            }
        }
        let mut isum = [[vdupq_n_s32(0); 4]; NT];
        let q = &r[qo..];
        // SAFETY: every load below reads 16 bytes inside `q` (the record's 256 or 512 weight
        // bytes) or inside token j's 32 activations of block b (bounds asserted above).
        unsafe {
            let mut acts = [(vdupq_n_s8(0), vdupq_n_s8(0)); NT];
            for (j, av) in acts.iter_mut().enumerate() {
                let ab = ((t0 + j) * blocks + b) * BLOCK;
                let p = a.qs.as_ptr().add(ab);
                *av = (vld1q_s8(p), vld1q_s8(p.add(16)));
            }
            macro_rules! chunk {
                ($c:literal) => {
                    for k in 0..4 {
                        let x = vld1q_u8(q.as_ptr().add(64 * $c + 16 * k));
                        if kind == PackKind::Q8_0 {
                            let s = vreinterpretq_s8_u8(veorq_u8(x, flip));
                            let y = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(q.as_ptr().add(64 * ($c + 4) + 16 * k)), flip));
                            for j in 0..NT {
                                isum[j][k] = sdot::<$c>(isum[j][k], s, acts[j].0);
                                isum[j][k] = sdot::<$c>(isum[j][k], y, acts[j].1);
                            }
                        } else {
                            let lo = vreinterpretq_s8_u8(vandq_u8(x, mask));
                            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(x));
                            for j in 0..NT {
                                isum[j][k] = sdot::<$c>(isum[j][k], lo, acts[j].0);
                                isum[j][k] = sdot::<$c>(isum[j][k], hi, acts[j].1);
                            }
                        }
                    }
                };
            }
            chunk!(0);
            chunk!(1);
            chunk!(2);
            chunk!(3);
            for j in 0..NT {
                let ad = a.d[(t0 + j) * blocks + b];
                let asum = a.sum[(t0 + j) * blocks + b];
                for k in 0..4 {
                    let mut s = isum[j][k];
                    if off != 0 {
                        s = vsubq_s32(s, vdupq_n_s32(off * asum));
                    }
                    let d4 = vld1q_f32(dv.as_ptr().add(4 * k));
                    acc[j][k] = vfmaq_f32(acc[j][k], vcvtq_f32_s32(s), vmulq_f32(d4, vdupq_n_f32(ad)));
                    if kind == PackKind::Q4_1 {
                        let m4 = vld1q_f32(mv.as_ptr().add(4 * k));
                        acc[j][k] = vfmaq_f32(acc[j][k], m4, vdupq_n_f32(a.ms[(t0 + j) * blocks + b]));
                    }
                }
            }
        }
    }
    for (j, accj) in acc.iter().enumerate() {
        for (k, v) in accj.iter().enumerate() {
            let o = &mut out[j * TILE_ROWS + 4 * k..j * TILE_ROWS + 4 * k + 4];
            // SAFETY: `o` is 4 writable f32s.
            unsafe { vst1q_f32(o.as_mut_ptr(), *v) };
        }
    }
}
