//! The CPU's dot product of one unpacked weight row with a quantized activation row (weights
//! of types without a packed layout, and embeddings on flash): AVX2 kernels for Q4_0, Q4_1 and
//! Q8_0 (`arch/x86/rows.rs`), else the portable reference (`quant::vec_dot`) compiled for AVX2 and
//! FMA, chosen once at run time; bit-equal to the reference (tested).

use crate::quant::{vec_dot_portable, GgmlType};

/// The dot product of `w` (a row of `wty`) and `a` (the same length in `wty.vec_dot_type()`);
/// the caller guarantees both rows match.
///
/// On x86-64 with AVX2 and FMA the same code is compiled for those features and chosen at run
/// time, so `mul_add` is one instruction and the integer loops use 256-bit registers.
#[inline]
pub fn dot(wty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma_f16c() {
            // SAFETY: the CPU supports AVX2, FMA and F16C, checked just above; the kernels
            // read only within the whole blocks of `w` and `a`.
            return unsafe {
                match wty {
                    GgmlType::Q4_1 => super::arch::x86::rows::dot_q4_1_q8_1(w, a),
                    GgmlType::Q4_0 => super::arch::x86::rows::dot_q4_0_q8_0(w, a),
                    GgmlType::Q8_0 => super::arch::x86::rows::dot_q8_0_q8_0(w, a),
                    _ => vec_dot_avx2_fma(wty, w, a),
                }
            };
        }
    }
    vec_dot_portable(wty, w, a)
}

/// The name of the row kernels this process uses (for listings).
pub fn row_kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma_f16c() {
        return "avx2";
    }
    "portable"
}

/// Whether the x86 kernels can run.
#[cfg(target_arch = "x86_64")]
fn has_avx2_fma_f16c() -> bool {
    super::features::features().avx2_fma_f16c()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn vec_dot_avx2_fma(wty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    vec_dot_portable(wty, w, a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn simd_kernels_equal_the_portable_ones_bit_for_bit() {
        // Pseudo-random blocks with finite f16 scales; every type the dispatcher specialises.
        let mut state = 0x2545F4914F6CDD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K] {
            let n = 512;
            for _ in 0..20 {
                let x: Vec<f32> = (0..n).map(|_| (next() % 2001) as f32 / 400.0 - 2.5).collect();
                let at = ty.vec_dot_type();
                let mut xq = vec![0u8; at.row_bytes(n).expect("blocks")];
                quantize_row(at, &x, &mut xq).expect("quantize");
                let mut w: Vec<u8> = (0..ty.row_bytes(n).expect("blocks")).map(|_| next() as u8).collect();
                let (bs, ts) = (ty.block_size(), ty.type_size());
                for b in 0..n / bs {
                    let scale = half::f16::from_f32((next() % 1000) as f32 / 20000.0 + 0.001).to_le_bytes();
                    let at_d = if ty == GgmlType::Q6_K { 208 } else { 0 };
                    w[b * ts + at_d..b * ts + at_d + 2].copy_from_slice(&scale);
                    if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4_K) {
                        w[b * ts + 2..b * ts + 4].copy_from_slice(&scale);
                    }
                }
                let fast = dot(ty, &w, &xq);
                let portable = crate::quant::vec_dot_portable(ty, &w, &xq);
                assert_eq!(fast.to_bits(), portable.to_bits(), "{ty}: {fast} vs {portable}");
            }
        }
    }
}
