//! AVX-512 VNNI kernels over the K-quant packed layout (see `kpacked.rs` for the layout and the
//! arithmetic they reproduce bit for bit). One call computes a tile of 16 rows for up to four
//! tokens at a time, so each group's unpacked weights feed every token while they are in
//! registers: per chunk (4 columns × 16 rows) one `vpdpbusd` per token, per group one
//! `vpmulld` by the 16 rows' scales, per super-block two FMAs.

use super::kpacked::{KActs, KKind, KPackedMatrix, SB};
use super::packed::TILE_ROWS;
use std::arch::x86_64::*;

const K_Q2K: u8 = 0;
const K_Q3K: u8 = 1;
const K_Q4K: u8 = 2;
const K_Q5K: u8 = 3;
const K_Q6K: u8 = 4;

const fn kind_of<const KIND: u8>() -> KKind {
    match KIND {
        K_Q2K => KKind::Q2K,
        K_Q3K => KKind::Q3K,
        K_Q4K => KKind::Q4K,
        K_Q5K => KKind::Q5K,
        _ => KKind::Q6K,
    }
}

/// Tokens per inner call (4 × 4 accumulators of 16 lanes stay in registers).
const MAX_NT: usize = 4;

/// # Safety
/// The CPU must support AVX-512 F/BW and VNNI, FMA and F16C; the shapes were checked by
/// `kpacked::run` (`out` holds `nt * TILE_ROWS` values, tokens `t0..t0 + nt` are quantized).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub unsafe fn tile_avx512vnni(w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, nt: usize, out: &mut [f32]) {
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

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn by_kind<const NT: usize>(w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, out: &mut [f32]) {
    // SAFETY: the caller's contract; each inner loop checks its own shapes.
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
#[target_feature(enable = "avx512f,avx512bw")]
fn shl<const N: u32>(x: __m512i) -> __m512i {
    _mm512_slli_epi16::<N>(x)
}

/// Every byte shifted right by `N` bits (as [`shl`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn shr<const N: u32>(x: __m512i) -> __m512i {
    _mm512_srli_epi16::<N>(x)
}

#[inline(always)]
fn same(x: __m512i) -> __m512i {
    x
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
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
    // SAFETY: see the pointer reads below; the intrinsics' features are this function's.
    unsafe {
        let m0f = _mm512_set1_epi8(0x0F);
        let m03 = _mm512_set1_epi8(0x03);
        let m04 = _mm512_set1_epi8(0x04);
        let m10 = _mm512_set1_epi8(0x10);
        let m30 = _mm512_set1_epi8(0x30);
        let mut acc = [_mm512_setzero_ps(); NT];
        for b in 0..sbs {
            // SAFETY (all pointer reads below): `r` is record `b` of this tile (`rec` bytes, the
            // offsets come from `kind`'s layout and stay inside it); activation reads are inside
            // token `t0 + j`'s super-block `b` (sizes asserted above).
            let r = data.as_ptr().add(b * rec);
            let ab: [usize; NT] = std::array::from_fn(|j| (t0 + j) * sbs + b);
            let q: [*const u8; NT] = std::array::from_fn(|j| a.qs.as_ptr().add(ab[j] * SB) as *const u8);
            let word = |j: usize, k: usize| _mm512_set1_epi32((q[j].add(4 * k) as *const i32).read_unaligned());
            let mut si = [_mm512_setzero_si512(); NT];
            let mut sm = [_mm512_setzero_si512(); NT];
            for g in 0..kind.groups() {
                // Two accumulators per token (even and odd chunks): `vpdpbusd` has a latency of
                // several cycles, and one chain per token would leave the units idle.
                let mut even = [_mm512_setzero_si512(); NT];
                let mut odd = [_mm512_setzero_si512(); NT];
                let mut feed = |k: usize, wv: __m512i| {
                    let dot = if k.is_multiple_of(2) { &mut even } else { &mut odd };
                    for (j, d) in dot.iter_mut().enumerate() {
                        *d = _mm512_dpbusd_epi32(*d, wv, word(j, k));
                    }
                };
                let base = r.add(kind.base_off());
                let high = r.add(kind.high_off());
                match kind {
                    KKind::Q4K | KKind::Q5K => {
                        // Group g: chunks 8g..8g+8, base blocks 4g..4g+4, 1-bit block g (Q5_K).
                        let h = if kind == KKind::Q5K {
                            _mm512_loadu_si512(high.add(64 * g) as *const _)
                        } else {
                            _mm512_setzero_si512()
                        };
                        // `$lo`/`$hi` move chunk 2i's / 2i+1's high bit (bits 2i, 2i+1) to bit 4.
                        macro_rules! pair {
                            ($i:literal, $lo:expr, $hi:expr) => {{
                                let x = _mm512_loadu_si512(base.add(64 * (4 * g + $i)) as *const _);
                                let mut lo = _mm512_and_si512(x, m0f);
                                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m0f);
                                if kind == KKind::Q5K {
                                    lo = _mm512_or_si512(lo, _mm512_and_si512($lo(h), m10));
                                    hi = _mm512_or_si512(hi, _mm512_and_si512($hi(h), m10));
                                }
                                feed(8 * g + 2 * $i, lo);
                                feed(8 * g + 2 * $i + 1, hi);
                            }};
                        }
                        pair!(0, shl::<4>, shl::<3>);
                        pair!(1, shl::<2>, shl::<1>);
                        pair!(2, same, shr::<1>);
                        pair!(3, shr::<2>, shr::<3>);
                    }
                    KKind::Q6K => {
                        // Group g: chunks 4g..4g+4, base blocks 2g, 2g+1, 2-bit block g.
                        let h = _mm512_loadu_si512(high.add(64 * g) as *const _);
                        let x0 = _mm512_loadu_si512(base.add(64 * (2 * g)) as *const _);
                        let x1 = _mm512_loadu_si512(base.add(64 * (2 * g + 1)) as *const _);
                        let w0 = _mm512_or_si512(_mm512_and_si512(x0, m0f), _mm512_and_si512(shl::<4>(h), m30));
                        feed(4 * g, w0);
                        let w1 = _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(x0), m0f),
                            _mm512_and_si512(shl::<2>(h), m30),
                        );
                        feed(4 * g + 1, w1);
                        let w2 = _mm512_or_si512(_mm512_and_si512(x1, m0f), _mm512_and_si512(h, m30));
                        feed(4 * g + 2, w2);
                        let w3 = _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(x1), m0f),
                            _mm512_and_si512(shr::<2>(h), m30),
                        );
                        feed(4 * g + 3, w3);
                    }
                    KKind::Q2K | KKind::Q3K => {
                        // Group g: chunks 4g..4g+4, 2-bit block g; Q3_K: 1-bit block g/2, bits
                        // 4(g%2)..4(g%2)+4.
                        let x = _mm512_loadu_si512(base.add(64 * g) as *const _);
                        let b0 = _mm512_and_si512(x, m03);
                        let b1 = _mm512_and_si512(_mm512_srli_epi16::<2>(x), m03);
                        let b2 = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m03);
                        let b3 = _mm512_and_si512(_mm512_srli_epi16::<6>(x), m03);
                        if kind == KKind::Q3K {
                            let h = _mm512_loadu_si512(high.add(64 * (g / 2)) as *const _);
                            let hb = |v: __m512i| _mm512_and_si512(v, m04);
                            let (h0, h1, h2, h3) = if g % 2 == 0 {
                                (hb(shl::<2>(h)), hb(shl::<1>(h)), hb(h), hb(shr::<1>(h)))
                            } else {
                                (hb(shr::<2>(h)), hb(shr::<3>(h)), hb(shr::<4>(h)), hb(shr::<5>(h)))
                            };
                            feed(4 * g, _mm512_or_si512(b0, h0));
                            feed(4 * g + 1, _mm512_or_si512(b1, h1));
                            feed(4 * g + 2, _mm512_or_si512(b2, h2));
                            feed(4 * g + 3, _mm512_or_si512(b3, h3));
                        } else {
                            feed(4 * g, b0);
                            feed(4 * g + 1, b1);
                            feed(4 * g + 2, b2);
                            feed(4 * g + 3, b3);
                        }
                    }
                }
                let sc_bytes = _mm_loadu_si128(r.add(kind.scales_off() + 16 * g) as *const _);
                let sc = match kind {
                    KKind::Q3K | KKind::Q6K => _mm512_cvtepi8_epi32(sc_bytes),
                    KKind::Q2K => _mm512_and_si512(_mm512_cvtepu8_epi32(sc_bytes), _mm512_set1_epi32(0xF)),
                    _ => _mm512_cvtepu8_epi32(sc_bytes),
                };
                for j in 0..NT {
                    let mut dj = _mm512_add_epi32(even[j], odd[j]);
                    if kind.offset() != 0 {
                        let s = *a.bs16.get_unchecked(16 * ab[j] + g) as i32;
                        dj = _mm512_sub_epi32(dj, _mm512_set1_epi32(kind.offset() * s));
                    }
                    si[j] = _mm512_add_epi32(si[j], _mm512_mullo_epi32(dj, sc));
                }
                if kind == KKind::Q2K {
                    let m = _mm512_srli_epi32::<4>(_mm512_cvtepu8_epi32(sc_bytes));
                    for j in 0..NT {
                        let s = *a.bs16.get_unchecked(16 * ab[j] + g) as i32;
                        sm[j] = _mm512_add_epi32(sm[j], _mm512_mullo_epi32(m, _mm512_set1_epi32(s)));
                    }
                }
            }
            if kind.mins_bytes() > 0 {
                // Q4_K/Q5_K: minimums in group pairs, i16 pairs against the pair's activation sums.
                for p in 0..kind.groups() / 2 {
                    let m16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(r.add(kind.mins_off() + 32 * p) as *const _));
                    for j in 0..NT {
                        let pair = (a.bs32.as_ptr().add(8 * ab[j] + 2 * p) as *const i32).read_unaligned();
                        sm[j] = _mm512_dpwssd_epi32(sm[j], m16, _mm512_set1_epi32(pair));
                    }
                }
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const _));
            for j in 0..NT {
                let fd = _mm512_mul_ps(dv, _mm512_set1_ps(*a.d.get_unchecked(ab[j])));
                acc[j] = _mm512_fmadd_ps(fd, _mm512_cvtepi32_ps(si[j]), acc[j]);
            }
            if kind.has_min() {
                let dm = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(kind.dmin_off()) as *const _));
                for j in 0..NT {
                    let fm = _mm512_mul_ps(dm, _mm512_set1_ps(*a.d.get_unchecked(ab[j])));
                    acc[j] = _mm512_fnmadd_ps(fm, _mm512_cvtepi32_ps(sm[j]), acc[j]);
                }
            }
        }
        for (j, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(j * TILE_ROWS), *v);
        }
    }
}
