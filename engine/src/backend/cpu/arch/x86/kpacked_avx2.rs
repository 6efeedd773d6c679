//! AVX2 kernel over the K-quant packed layout (see `kpacked.rs` for the layout and the
//! arithmetic it reproduces bit for bit). A tile's 16 rows are two halves of 8 rows, one 256-bit
//! register each: 32 bytes of every 64-byte plane block. Per chunk (4 columns × 8 rows) and token
//! one `vpmaddubsw` multiplies the rows' unsigned weights by 4 signed activations into i16 pairs;
//! weights are at most 6 bits (≤ 63) and activations in −127..=127, so a pair is at most
//! 2 · 63 · 127 = 16 002 in magnitude and never saturates. The pairs of a *segment* of chunks are
//! added in i16 (as many chunks as keep the sum exact: a whole group for Q2_K, Q3_K and Q4_K,
//! 4 chunks for Q5_K, 2 for Q6_K), then one `vpmaddwd` by the rows' group scale (an i16 pair)
//! adds `sc · dot` to the i32 sums. Per pair of groups one more `vpmaddwd` against the
//! activation sums gives the offset term (Q3_K, Q6_K); the minimums' sum (Q2_K, Q4_K, Q5_K) is a
//! short pass of its own after the weights. Per super-block and half, one FMA per sum.
//! Up to four tokens per call share each segment's unpacked weights.

use crate::backend::layout::kpacked::{KActs, KKind, KPackedMatrix, SB};
use crate::backend::layout::packed::TILE_ROWS;
use std::arch::x86_64::*;

use crate::backend::layout::kpacked::{kind_of, K_Q2K, K_Q3K, K_Q4K, K_Q5K, K_Q6K};

/// Tokens per inner call: each token's i16 and i32 sums of one half stay in registers.
const MAX_NT: usize = 4;

/// # Safety
/// The CPU must support AVX2, FMA and F16C; the shapes were checked by `kpacked::run` (`out`
/// holds `nt * TILE_ROWS` values, tokens `t0..t0 + nt` are quantized).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_avx2(w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, nt: usize, out: &mut [f32]) {
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

#[target_feature(enable = "avx2,fma,f16c")]
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

/// Every byte shifted left by `N` bits (a 16-bit shift: the callers keep only bits that come
/// from the same byte).
#[inline]
#[target_feature(enable = "avx2")]
fn shl<const N: i32>(x: __m256i) -> __m256i {
    _mm256_slli_epi16::<N>(x)
}

/// Every byte shifted right by `N` bits (as [`shl`]).
#[inline]
#[target_feature(enable = "avx2")]
fn shr<const N: i32>(x: __m256i) -> __m256i {
    _mm256_srli_epi16::<N>(x)
}

#[inline(always)]
fn same(x: __m256i) -> __m256i {
    x
}

#[target_feature(enable = "avx2,fma,f16c")]
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
    let zero = _mm256_setzero_si256();
    let m0f = _mm256_set1_epi8(0x0F);
    let m03 = _mm256_set1_epi8(0x03);
    let m04 = _mm256_set1_epi8(0x04);
    let m10 = _mm256_set1_epi8(0x10);
    let m30 = _mm256_set1_epi8(0x30);
    // Per 32-bit lane (one row) holding the i16 pair (scale of group 2p, of group 2p + 1): the
    // first or the second scale in both halves.
    #[rustfmt::skip]
    let dup_even = _mm256_setr_epi8(
        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
    );
    #[rustfmt::skip]
    let dup_odd = _mm256_setr_epi8(
        2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
        2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
    );
    // Per half of 8 rows, per token.
    let mut acc = [[_mm256_setzero_ps(); NT]; 2];
    // SAFETY: the pointer reads below: `r` is record `b` of this tile (`rec` bytes; every offset
    // comes from `kind`'s layout plus 32·h (plane blocks), 8·h (scale bytes) or 16·h (f16s and
    // minimums) for half h of 8 rows, and stays inside the record); activation reads are inside
    // token `t0 + j`'s super-block `b`: 4 bytes at 4k (k < 64) of its 256 values, 4 bytes at an
    // even index (< 16 / < 8) of its group sums (sizes asserted above).
    unsafe {
        for b in 0..sbs {
            let r = data.as_ptr().add(b * rec);
            let ab: [usize; NT] = std::array::from_fn(|j| (t0 + j) * sbs + b);
            let q: [*const u8; NT] = std::array::from_fn(|j| a.qs.as_ptr().add(ab[j] * SB) as *const u8);
            let s16: [*const i16; NT] = std::array::from_fn(|j| a.bs16.as_ptr().add(16 * ab[j]));
            let s32: [*const i16; NT] = std::array::from_fn(|j| a.bs32.as_ptr().add(8 * ab[j]));
            // Two i16 activation sums (groups `2p`, `2p + 1`) in every 32-bit lane.
            let sums = |s: *const i16, p: usize| _mm256_set1_epi32((s.add(2 * p) as *const i32).read_unaligned());
            for (h, acc) in acc.iter_mut().enumerate() {
                let base = r.add(kind.base_off() + 32 * h);
                let high = r.add(kind.high_off() + 32 * h);
                let scales = r.add(kind.scales_off() + 8 * h);
                let mut si = [zero; NT];
                for p in 0..kind.groups() / 2 {
                    // Rows 8h..8h+8 of groups 2p and 2p + 1, interleaved: per row the i16 pair
                    // (s_2p, s_2p+1) of scale bytes.
                    let bytes = _mm_unpacklo_epi8(
                        _mm_loadl_epi64(scales.add(32 * p) as *const _),
                        _mm_loadl_epi64(scales.add(32 * p + 16) as *const _),
                    );
                    let pairs = match kind {
                        KKind::Q3K | KKind::Q6K => _mm256_cvtepi8_epi16(bytes),
                        _ => _mm256_cvtepu8_epi16(bytes),
                    };
                    let scp = if kind == KKind::Q2K { _mm256_and_si256(pairs, _mm256_set1_epi16(0xF)) } else { pairs };
                    let sc2 = [_mm256_shuffle_epi8(scp, dup_even), _mm256_shuffle_epi8(scp, dup_odd)];
                    // The chunks `$k0..` of one segment (as many as keep the i16 sums exact) with
                    // weights `$w`, for every token: `sc · Σ pairs` into the rows' i32 sums.
                    macro_rules! seg {
                        ($k0:expr, $sc:expr, [$($w:expr),+]) => {{
                            let (k0, sc) = ($k0, $sc);
                            let wv = [$($w),+];
                            for j in 0..NT {
                                let av = |c: usize| _mm256_set1_epi32((q[j].add(4 * (k0 + c)) as *const i32).read_unaligned());
                                let mut p16 = _mm256_maddubs_epi16(wv[0], av(0));
                                for c in 1..wv.len() {
                                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wv[c], av(c)));
                                }
                                si[j] = _mm256_add_epi32(si[j], _mm256_madd_epi16(p16, sc));
                            }
                        }};
                    }
                    match kind {
                        KKind::Q4K | KKind::Q5K => {
                            // Group g: chunks 8g..8g+8, base blocks 4g..4g+4 (chunks 8g+2i in the low
                            // nibbles, 8g+2i+1 in the high), 1-bit block g (Q5_K).
                            macro_rules! group {
                                ($e:literal) => {{
                                    let g = 2 * p + $e;
                                    let hv = if kind == KKind::Q5K {
                                        _mm256_loadu_si256(high.add(64 * g) as *const _)
                                    } else {
                                        zero
                                    };
                                    let x = |i: usize| _mm256_loadu_si256(base.add(64 * (4 * g + i)) as *const _);
                                    let lo = |x: __m256i| _mm256_and_si256(x, m0f);
                                    let hi = |x: __m256i| _mm256_and_si256(_mm256_srli_epi16::<4>(x), m0f);
                                    // Chunk 8g + c's high bit (bit c of `hv`) moved to bit 4 by `f`.
                                    let hb = |f: __m256i| if kind == KKind::Q5K { _mm256_and_si256(f, m10) } else { zero };
                                    let (x0, x1) = (x(0), x(1));
                                    let w0 = _mm256_or_si256(lo(x0), hb(shl::<4>(hv)));
                                    let w1 = _mm256_or_si256(hi(x0), hb(shl::<3>(hv)));
                                    let w2 = _mm256_or_si256(lo(x1), hb(shl::<2>(hv)));
                                    let w3 = _mm256_or_si256(hi(x1), hb(shl::<1>(hv)));
                                    let (x2, x3) = (x(2), x(3));
                                    let w4 = _mm256_or_si256(lo(x2), hb(hv));
                                    let w5 = _mm256_or_si256(hi(x2), hb(shr::<1>(hv)));
                                    let w6 = _mm256_or_si256(lo(x3), hb(shr::<2>(hv)));
                                    let w7 = _mm256_or_si256(hi(x3), hb(shr::<3>(hv)));
                                    if kind == KKind::Q5K {
                                        // 5-bit weights: 4 chunks of pairs (≤ 31 496) fit i16, 8 may not.
                                        seg!(8 * g, sc2[$e], [w0, w1, w2, w3]);
                                        seg!(8 * g + 4, sc2[$e], [w4, w5, w6, w7]);
                                    } else {
                                        // 4-bit weights: 8 chunks of pairs (≤ 30 480) fit i16.
                                        seg!(8 * g, sc2[$e], [w0, w1, w2, w3, w4, w5, w6, w7]);
                                    }
                                }};
                            }
                            group!(0);
                            group!(1);
                        }
                        KKind::Q6K => {
                            // Group g: chunks 4g..4g+4, base blocks 2g, 2g+1, 2-bit block g.
                            macro_rules! group {
                                ($e:literal) => {{
                                    let g = 2 * p + $e;
                                    let hv = _mm256_loadu_si256(high.add(64 * g) as *const _);
                                    let x0 = _mm256_loadu_si256(base.add(64 * (2 * g)) as *const _);
                                    let x1 = _mm256_loadu_si256(base.add(64 * (2 * g + 1)) as *const _);
                                    let w0 =
                                        _mm256_or_si256(_mm256_and_si256(x0, m0f), _mm256_and_si256(shl::<4>(hv), m30));
                                    let w1 = _mm256_or_si256(
                                        _mm256_and_si256(_mm256_srli_epi16::<4>(x0), m0f),
                                        _mm256_and_si256(shl::<2>(hv), m30),
                                    );
                                    // 6-bit weights: 2 chunks of pairs (≤ 32 004) fit i16, 4 may not.
                                    seg!(4 * g, sc2[$e], [w0, w1]);
                                    let w2 = _mm256_or_si256(_mm256_and_si256(x1, m0f), _mm256_and_si256(hv, m30));
                                    let w3 = _mm256_or_si256(
                                        _mm256_and_si256(_mm256_srli_epi16::<4>(x1), m0f),
                                        _mm256_and_si256(shr::<2>(hv), m30),
                                    );
                                    seg!(4 * g + 2, sc2[$e], [w2, w3]);
                                }};
                            }
                            group!(0);
                            group!(1);
                        }
                        KKind::Q2K | KKind::Q3K => {
                            // Group g: chunks 4g..4g+4, 2-bit block g; Q3_K: 1-bit block p = g/2,
                            // bits 4e..4e+4 for group 2p + e.
                            let hv = if kind == KKind::Q3K {
                                _mm256_loadu_si256(high.add(64 * p) as *const _)
                            } else {
                                zero
                            };
                            let hb = |v: __m256i| if kind == KKind::Q3K { _mm256_and_si256(v, m04) } else { zero };
                            macro_rules! group {
                                ($e:literal, $h0:expr, $h1:expr, $h2:expr, $h3:expr) => {{
                                    let g = 2 * p + $e;
                                    let x = _mm256_loadu_si256(base.add(64 * g) as *const _);
                                    let b0 = _mm256_or_si256(_mm256_and_si256(x, m03), hb($h0(hv)));
                                    let b1 =
                                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<2>(x), m03), hb($h1(hv)));
                                    let b2 =
                                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(x), m03), hb($h2(hv)));
                                    let b3 =
                                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<6>(x), m03), hb($h3(hv)));
                                    // 2- and 3-bit weights: 4 chunks of pairs (≤ 7 112) fit i16.
                                    seg!(4 * g, sc2[$e], [b0, b1, b2, b3]);
                                }};
                            }
                            group!(0, shl::<2>, shl::<1>, same, shr::<1>);
                            group!(1, shr::<2>, shr::<3>, shr::<4>, shr::<5>);
                        }
                    }
                    if kind.offset() != 0 {
                        // SI −= o · (sc_2p · s_2p + sc_2p+1 · s_2p+1); o · sc fits i16.
                        let osc = if kind == KKind::Q6K { shl::<5>(scp) } else { shl::<2>(scp) };
                        for j in 0..NT {
                            si[j] = _mm256_sub_epi32(si[j], _mm256_madd_epi16(osc, sums(s16[j], p)));
                        }
                    }
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(r.add(16 * h) as *const _));
                for j in 0..NT {
                    let fd = _mm256_mul_ps(dv, _mm256_set1_ps(*a.d.get_unchecked(ab[j])));
                    acc[j] = _mm256_fmadd_ps(fd, _mm256_cvtepi32_ps(si[j]), acc[j]);
                }
                if kind.has_min() {
                    // SM in a pass of its own, so its sums are not held through the weights'.
                    let mut sm = [zero; NT];
                    for p in 0..kind.groups() / 2 {
                        let (m, s) = if kind == KKind::Q2K {
                            // Minimums in the scale bytes' high nibbles, pairs as above.
                            let bytes = _mm_unpacklo_epi8(
                                _mm_loadl_epi64(scales.add(32 * p) as *const _),
                                _mm_loadl_epi64(scales.add(32 * p + 16) as *const _),
                            );
                            (_mm256_srli_epi16::<4>(_mm256_cvtepu8_epi16(bytes)), s16)
                        } else {
                            // Q4_K/Q5_K: minimums in group pairs, byte 32p + 2r + e (rows 8h.. at 16h).
                            let m = _mm_loadu_si128(r.add(kind.mins_off() + 32 * p + 16 * h) as *const _);
                            (_mm256_cvtepu8_epi16(m), s32)
                        };
                        for j in 0..NT {
                            sm[j] = _mm256_add_epi32(sm[j], _mm256_madd_epi16(m, sums(s[j], p)));
                        }
                    }
                    let dm = _mm256_cvtph_ps(_mm_loadu_si128(r.add(kind.dmin_off() + 16 * h) as *const _));
                    for j in 0..NT {
                        let fm = _mm256_mul_ps(dm, _mm256_set1_ps(*a.d.get_unchecked(ab[j])));
                        // −(fm · sm) + acc, one rounding: fma(−(dmin · a_d), SM, acc).
                        acc[j] = _mm256_fnmadd_ps(fm, _mm256_cvtepi32_ps(sm[j]), acc[j]);
                    }
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (j, v) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(j * TILE_ROWS + 8 * h), *v);
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

    /// The AVX2 kernel equals the reference where its i16 sums are fullest (largest weights
    /// times activations of −127 or 127 throughout) and for every token count up to 9.
    #[test]
    fn avx2_equals_the_reference_at_the_extremes_and_every_token_count() {
        let Some(kernel) = Kernel::available().into_iter().find(|k| k.kind() == KernelKind::Avx2) else {
            eprintln!("no AVX2 here: skipped");
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
