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
