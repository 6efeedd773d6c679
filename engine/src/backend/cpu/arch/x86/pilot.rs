//! shadowAttn's INT8 pilot on AVX-512 VNNI: a dense Q·Kᵀ of one head's quantized queries and
//! keys, 16 keys per `vpdpbusd`, four query rows sharing each key tile. Exact integer sums, the
//! same as the portable kernel's (tested in `cpu/pilot.rs`).

use std::arch::x86_64::*;

/// Scores of `rows` query rows (`q_u8`: each row's `d` values plus 128, as unsigned bytes)
/// against key blocks `0..blocks` (`tiles`: per block of 16 keys, `d / 4` groups of 16 keys × 4
/// bytes; `bias`: 128 · the sum of each key's bytes, per key): `out[r * stride + j]` for
/// `j < 16 · blocks`.
///
/// # Safety
/// The CPU must support AVX-512 F/BW and VNNI; `d % 4 == 0`, `rows <= 4`,
/// `q_u8.len() >= rows * d`, `tiles.len() >= blocks * 16 * d`, `bias.len() >= blocks * 16`,
/// `out.len() >= (rows - 1) * stride + 16 * blocks` (checked by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores_vnni(
    q_u8: &[u8],
    d: usize,
    rows: usize,
    tiles: &[i8],
    bias: &[i32],
    blocks: usize,
    out: &mut [i32],
    stride: usize,
) {
    let groups = d / 4;
    let q = q_u8.as_ptr();
    let t = tiles.as_ptr();
    let o = out.as_mut_ptr();
    for blk in 0..blocks {
        // SAFETY: every pointer below stays inside the slices the caller sized (the contract).
        unsafe {
            let mut acc = [_mm512_setzero_si512(); 4];
            let tile = t.add(blk * 16 * d);
            for g in 0..groups {
                let kt = _mm512_loadu_si512(tile.add(g * 64) as *const __m512i);
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    let qv = _mm512_set1_epi32((q.add(r * d + 4 * g) as *const i32).read_unaligned());
                    *a = _mm512_dpbusd_epi32(*a, qv, kt);
                }
            }
            let b = _mm512_loadu_si512(bias.as_ptr().add(blk * 16) as *const __m512i);
            for (r, a) in acc.iter().enumerate().take(rows) {
                _mm512_storeu_si512(o.add(r * stride + blk * 16) as *mut __m512i, _mm512_sub_epi32(*a, b));
            }
        }
    }
}

/// How many of `row` are at least `t`.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f")]
pub unsafe fn count_ge(row: &[i32], t: i32) -> usize {
    let tv = _mm512_set1_epi32(t);
    let mut n = 0u32;
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        // SAFETY: `c` is 16 readable i32s; the load is unaligned.
        let v = unsafe { _mm512_loadu_si512(c.as_ptr() as *const __m512i) };
        n += _mm512_cmpge_epi32_mask(v, tv).count_ones();
    }
    n as usize + chunks.remainder().iter().filter(|&&s| s >= t).count()
}

/// Appends to `above` the indices of `row` whose value exceeds `t`, and to `ties` those equal to
/// it, each ascending.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f")]
pub unsafe fn split_at(row: &[i32], t: i32, above: &mut Vec<u32>, ties: &mut Vec<u32>) {
    above.reserve(row.len() + 16);
    ties.reserve(row.len() + 16);
    let tv = _mm512_set1_epi32(t);
    let step = _mm512_set1_epi32(16);
    let mut idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        // SAFETY: `c` is 16 readable i32s; each vector is stored after the lists' lengths, within
        // the 16 spare values reserved beyond any count they can reach; the lengths then grow by
        // the number of lanes stored, all written.
        unsafe {
            let v = _mm512_loadu_si512(c.as_ptr() as *const __m512i);
            let gt = _mm512_cmpgt_epi32_mask(v, tv);
            let eq = _mm512_cmpeq_epi32_mask(v, tv);
            let a = _mm512_maskz_compress_epi32(gt, idx);
            _mm512_storeu_si512(above.as_mut_ptr().add(above.len()) as *mut __m512i, a);
            above.set_len(above.len() + gt.count_ones() as usize);
            if eq != 0 {
                let e = _mm512_maskz_compress_epi32(eq, idx);
                _mm512_storeu_si512(ties.as_mut_ptr().add(ties.len()) as *mut __m512i, e);
                ties.set_len(ties.len() + eq.count_ones() as usize);
            }
            idx = _mm512_add_epi32(idx, step);
        }
    }
    let base = row.len() - chunks.remainder().len();
    for (j, &s) in chunks.remainder().iter().enumerate() {
        if s > t {
            above.push((base + j) as u32);
        } else if s == t {
            ties.push((base + j) as u32);
        }
    }
}

/// Appends to `band` the values of `row` within `lo..=hi`, in order.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[target_feature(enable = "avx512f")]
pub unsafe fn band(row: &[i32], lo: i32, hi: i32, band: &mut Vec<i32>) {
    band.reserve(row.len() + 16);
    let (lv, hv) = (_mm512_set1_epi32(lo), _mm512_set1_epi32(hi));
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        // SAFETY: `c` is 16 readable i32s; the vector is stored after `band`'s length, within the
        // 16 spare values reserved; the length grows by the lanes stored.
        unsafe {
            let v = _mm512_loadu_si512(c.as_ptr() as *const __m512i);
            let m = _mm512_cmpge_epi32_mask(v, lv) & _mm512_cmple_epi32_mask(v, hv);
            _mm512_storeu_si512(band.as_mut_ptr().add(band.len()) as *mut __m512i, _mm512_maskz_compress_epi32(m, v));
            band.set_len(band.len() + m.count_ones() as usize);
        }
    }
    band.extend(chunks.remainder().iter().copied().filter(|&s| s >= lo && s <= hi));
}
