//! AVX2 kernels for the 32-element block dots the common models use (Q4_0, Q4_1 and Q8_0
//! weights). They compute exactly what the portable kernels in `blocks.rs` compute, in the same
//! order: lane `k` of a 256-bit register holds the integer sum of elements `4k..4k+4`
//! (`maddubs` then `madd` with ones), scaled into the accumulator with one FMA per block, then
//! summed as `hsum_float_8`. So their results are bit-identical to the portable kernels'
//! (tested), and to llama.cpp's x86 kernels' order.

use std::arch::x86_64::*;

/// An IEEE half at `b[i..i + 2]`, converted by the F16C instruction (exact, like `half`'s
/// conversion, without its per-call feature check).
#[inline]
#[target_feature(enable = "f16c")]
fn f16(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_float_8(x: __m256) -> f32 {
    let mut res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}

/// 16 bytes of packed nibbles as 32 bytes: low nibbles in the low half, high in the high half.
#[inline]
#[target_feature(enable = "avx2")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
    let tmp = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

#[inline]
#[target_feature(enable = "avx2")]
fn load32(q: &[u8; 32]) -> __m256i {
    // SAFETY: `q` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(q.as_ptr() as *const __m256i) }
}

/// Eight i32 lanes of unsigned × signed byte products, four per lane.
#[inline]
#[target_feature(enable = "avx2")]
fn sum_u8_i8(ux: __m256i, sy: __m256i) -> __m256 {
    // |products| ≤ 15·128·2 or 128·127·2, below the i16 saturation point.
    let pairs = _mm256_maddubs_epi16(ux, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// Signed × signed: the sign of x moved onto y (as llama.cpp does).
#[inline]
#[target_feature(enable = "avx2")]
fn sum_i8_i8(x: __m256i, y: __m256i) -> __m256 {
    sum_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

fn sub<const N: usize>(b: &[u8], at: usize) -> &[u8; N] {
    b[at..at + N].try_into().expect("block layout: the slice has N bytes")
}

/// Q4_1 weights · Q8_1 activations.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (w, a) in w.as_chunks::<20>().0.iter().zip(a.as_chunks::<36>().0) {
        summs += f16(w, 2) * f16(a, 2);
        let d = _mm256_set1_ps(f16(w, 0) * f16(a, 0));
        acc = _mm256_fmadd_ps(d, sum_u8_i8(nibbles(sub::<16>(w, 4)), load32(sub::<32>(a, 4))), acc);
    }
    // SAFETY: AVX2 and FMA are enabled for this function.
    unsafe { hsum_float_8(acc) + summs }
}

/// Q4_0 weights · Q8_0 activations.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in w.as_chunks::<18>().0.iter().zip(a.as_chunks::<34>().0) {
        let d = _mm256_set1_ps(f16(w, 0) * f16(a, 0));
        let x = _mm256_sub_epi8(nibbles(sub::<16>(w, 2)), _mm256_set1_epi8(8));
        acc = _mm256_fmadd_ps(d, sum_i8_i8(x, load32(sub::<32>(a, 2))), acc);
    }
    // SAFETY: AVX2 and FMA are enabled for this function.
    unsafe { hsum_float_8(acc) }
}

/// Q8_0 weights · Q8_0 activations.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in w.as_chunks::<34>().0.iter().zip(a.as_chunks::<34>().0) {
        let d = _mm256_set1_ps(f16(w, 0) * f16(a, 0));
        acc = _mm256_fmadd_ps(d, sum_i8_i8(load32(sub::<32>(w, 2)), load32(sub::<32>(a, 2))), acc);
    }
    // SAFETY: AVX2 and FMA are enabled for this function.
    unsafe { hsum_float_8(acc) }
}
