//! AArch64 kernel over the packed layout (see `packed.rs`): NEON with the dot-product extension
//! (`sdot`, by element). A 64-byte chunk is four registers of four rows; `sdot v.4s, w.16b,
//! a.4b[i]` multiplies four rows by the same four activations. Weights are unsigned and below 128
//! for Q4 (nibbles) so the signed instruction is exact; Q8_0 bytes are flipped back to signed
//! (`u ^ 0x80`), which makes the offset term zero. The float part follows the reference order:
//! one accumulator per group of four per row, fused multiply-add per block, llama.cpp's final sum.
//!
//! Runs in CI under qemu-user (correctness against the scalar reference, not speed).

use crate::backend::layout::packed::{PackKind, PackedMatrix, QuantActs, BLOCK, TILE_ROWS};
use half::f16;
use std::arch::aarch64::*;
use std::arch::asm;

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

/// With `BLOCKSUM`, the output head's order (`packed::Order::BlockSum`): the eight groups'
/// integer sums are added (exact) and each block takes one fused multiply-add.
///
/// # Safety
/// The CPU must support NEON and the dot-product extension; `out` holds `nt * TILE_ROWS`
/// values, `t0 + nt <= a.n`, `a.cols == w.cols`, `tile < w.tiles()`.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn tile_neon_dotprod<const BLOCKSUM: bool>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let kind = w.kind;
    let blocks = w.blocks();
    let rec = kind.record_bytes();
    let qo = kind.qs_offset();
    // Q8_0 bytes are flipped back to signed, so its offset term vanishes.
    let off = if kind == PackKind::Q8_0 { 0 } else { kind.offset() };
    let data = w.tile(tile);
    assert!(data.len() == blocks * rec && out.len() >= nt * TILE_ROWS && a.qs.len() >= (t0 + nt) * a.cols);
    let mask = vdupq_n_u8(0x0F);
    let flip = vdupq_n_u8(0x80);
    for j in 0..nt {
        for quad in 0..4 {
            let mut lanes = [vdupq_n_f32(0.0); 8];
            let mut acc = vdupq_n_f32(0.0);
            let mut summs = vdupq_n_f32(0.0);
            for b in 0..blocks {
                let r = &data[b * rec..(b + 1) * rec];
                let ab = (t0 + j) * blocks + b;
                let aq = &a.qs[ab * BLOCK..(ab + 1) * BLOCK];
                let ag = &a.gsum[ab * 8..(ab + 1) * 8];
                let mut dv = [0f32; 4];
                let mut mv = [0f32; 4];
                for i in 0..4 {
                    let lane = 4 * quad + i;
                    dv[i] = f16::from_le_bytes([r[2 * lane], r[2 * lane + 1]]).to_f32();
                    if kind == PackKind::Q4_1 {
                        mv[i] = f16::from_le_bytes([r[32 + 2 * lane], r[33 + 2 * lane]]).to_f32();
                    }
                }
                let q = &r[qo..];
                let mut isum = [vdupq_n_s32(0); 8];
                for (k, v) in isum.iter_mut().enumerate() {
                    *v = vdupq_n_s32(-off * ag[k]);
                }
                // SAFETY: every load reads 16 bytes inside `q` (the record's weight bytes: chunk
                // offsets below 512) or inside this block's 32 activations, and 4 f32s of `dv`/`mv`.
                unsafe {
                    let a0 = vld1q_s8(aq.as_ptr());
                    let a1 = vld1q_s8(aq.as_ptr().add(16));
                    macro_rules! chunk {
                        ($c:literal) => {
                            if kind == PackKind::Q8_0 {
                                let x = vld1q_u8(q.as_ptr().add(64 * $c + 16 * quad));
                                let y = vld1q_u8(q.as_ptr().add(64 * ($c + 4) + 16 * quad));
                                isum[$c] = sdot::<$c>(isum[$c], vreinterpretq_s8_u8(veorq_u8(x, flip)), a0);
                                isum[$c + 4] = sdot::<$c>(isum[$c + 4], vreinterpretq_s8_u8(veorq_u8(y, flip)), a1);
                            } else {
                                let x = vld1q_u8(q.as_ptr().add(64 * $c + 16 * quad));
                                isum[$c] = sdot::<$c>(isum[$c], vreinterpretq_s8_u8(vandq_u8(x, mask)), a0);
                                isum[$c + 4] = sdot::<$c>(isum[$c + 4], vreinterpretq_s8_u8(vshrq_n_u8::<4>(x)), a1);
                            }
                        };
                    }
                    chunk!(0);
                    chunk!(1);
                    chunk!(2);
                    chunk!(3);
                    let scale = vmulq_f32(vld1q_f32(dv.as_ptr()), vdupq_n_f32(a.d[ab]));
                    if BLOCKSUM {
                        let s03 = vaddq_s32(vaddq_s32(isum[0], isum[1]), vaddq_s32(isum[2], isum[3]));
                        let s47 = vaddq_s32(vaddq_s32(isum[4], isum[5]), vaddq_s32(isum[6], isum[7]));
                        acc = vfmaq_f32(acc, scale, vcvtq_f32_s32(vaddq_s32(s03, s47)));
                    } else {
                        for k in 0..8 {
                            lanes[k] = vfmaq_f32(lanes[k], scale, vcvtq_f32_s32(isum[k]));
                        }
                    }
                    if kind == PackKind::Q4_1 {
                        summs = vaddq_f32(summs, vmulq_f32(vld1q_f32(mv.as_ptr()), vdupq_n_f32(a.ms[ab])));
                    }
                }
            }
            let r = if BLOCKSUM {
                if kind == PackKind::Q4_1 {
                    vaddq_f32(acc, summs)
                } else {
                    acc
                }
            } else {
                let l = &lanes;
                let r = vaddq_f32(
                    vaddq_f32(vaddq_f32(l[4], l[0]), vaddq_f32(l[6], l[2])),
                    vaddq_f32(vaddq_f32(l[5], l[1]), vaddq_f32(l[7], l[3])),
                );
                vaddq_f32(r, summs)
            };
            let o = &mut out[j * TILE_ROWS + 4 * quad..j * TILE_ROWS + 4 * quad + 4];
            // SAFETY: `o` is 4 writable f32s.
            unsafe { vst1q_f32(o.as_mut_ptr(), r) };
        }
    }
}
