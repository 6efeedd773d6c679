//! EdgeFlow's bit planes unpacked to int8 with SIMD (the cold-start loader's hot loop): SSE2 or
//! AVX2 on x86, NEON on aarch64; the format and its scalar reference are `quant::edgeflow`'s.

use crate::quant::edgeflow::{planes, BLOCK_BYTES, GROUP, MAX_BITS, MIN_BITS, STRIPE};

/// One plane's part of one stripe: which block of the group, the mask, and the shift that
/// moves the field to its place in the left-aligned code (positive: left).
#[derive(Clone, Copy, Default, Debug)]
struct PlaneOp {
    block: u8,
    mask: u8,
    shift: i8,
}

/// The operations that unpack each of the 8 stripes of a `bits`-bit group.
#[derive(Clone, Copy, Debug)]
struct Table {
    ops: [[PlaneOp; 3]; 8],
    n: usize,
    xor: u8,
}

impl Table {
    fn new(bits: u8) -> Self {
        let mut ops = [[PlaneOp::default(); 3]; 8];
        let ps = planes(bits);
        for (s, row) in ops.iter_mut().enumerate() {
            let (mut first_block, mut hi) = (0usize, 0i32);
            for (p, &b) in ps.iter().enumerate() {
                let per = 8 / b as usize;
                let (j, t) = (s / per, s % per);
                let top = ((1u32 << b) - 1) << (8 - b as u32);
                row[p] = PlaneOp {
                    block: (first_block + j) as u8,
                    mask: (top >> (b as usize * t)) as u8,
                    shift: (b as i32 * t as i32 - hi) as i8,
                };
                first_block += b as usize;
                hi += b as i32;
            }
        }
        let xor = if bits >= 8 { 0x80 } else { 0x80 | (1u8 << (7 - bits)) };
        Self { ops, n: ps.len(), xor }
    }
}

/// Unpacks one packed channel to int8 (`out`: `groups · 128` values), with the fastest kernel
/// this CPU has; equal to `unpack_channel_reference` bit for bit.
///
/// # Panics
/// Never on lengths: `data` must be whole groups and `out` at least as many weights, else the
/// call unpacks only the groups both hold.
pub fn unpack_channel(bits: u8, data: &[u8], out: &mut [i8]) {
    if !(MIN_BITS..=MAX_BITS).contains(&bits) {
        return;
    }
    let n = (data.len() / (bits as usize * BLOCK_BYTES)).min(out.len() / GROUP);
    let tab = Table::new(bits);
    #[cfg(target_arch = "x86_64")]
    {
        if super::features::features().avx2 {
            // SAFETY: AVX2 was detected at run time; the kernel reads `n` whole groups of
            // `data` and writes `n · 128` bytes of `out`, both checked just above.
            unsafe { x86::unpack_avx2(&tab, bits, data.as_ptr(), out.as_mut_ptr(), n) };
        } else {
            // SAFETY: SSE2 is part of x86_64; same bounds as above.
            unsafe { x86::unpack_sse2(&tab, bits, data.as_ptr(), out.as_mut_ptr(), n) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of aarch64; reads `n` whole groups, writes `n · 128` bytes.
        unsafe { arm::unpack_neon(&tab, bits, data.as_ptr(), out.as_mut_ptr(), n) };
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        crate::quant::edgeflow::unpack_channel_reference(
            bits,
            &data[..n * bits as usize * BLOCK_BYTES],
            &mut out[..n * GROUP],
        );
    }
}

/// The kernel [`unpack_channel`] uses on this CPU.
pub fn unpack_kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if super::features::features().avx2 {
            return "avx2";
        }
        "sse2"
    }
    #[cfg(target_arch = "aarch64")]
    {
        "neon"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar"
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Table, BLOCK_BYTES, GROUP, STRIPE};
    use std::arch::x86_64::*;

    /// x86 has no byte shifts: the field is masked first, so a 16-bit shift cannot carry it
    /// into the neighbouring byte (it moves toward its target inside its own byte).
    #[inline(always)]
    unsafe fn shift128(v: __m128i, shift: i8) -> __m128i {
        // SAFETY: SSE2 is baseline on x86_64; pure register operations.
        unsafe {
            if shift >= 0 {
                _mm_sll_epi16(v, _mm_cvtsi32_si128(shift as i32))
            } else {
                _mm_srl_epi16(v, _mm_cvtsi32_si128(-(shift as i32)))
            }
        }
    }

    /// # Safety
    /// `data` holds `n` groups of `bits · 16` bytes and `out` `n · 128` bytes.
    #[target_feature(enable = "sse2")]
    pub(super) unsafe fn unpack_sse2(tab: &Table, bits: u8, data: *const u8, out: *mut i8, n: usize) {
        let gb = bits as usize * BLOCK_BYTES;
        // SAFETY: every load is inside group `g` of `data` (block < bits) and every store inside
        // group `g` of `out`, g < n, as the caller guarantees.
        unsafe {
            let xor = _mm_set1_epi8(tab.xor as i8);
            for g in 0..n {
                let src = data.add(g * gb);
                for (s, ops) in tab.ops.iter().enumerate() {
                    let mut acc = _mm_setzero_si128();
                    for op in &ops[..tab.n] {
                        let blk = _mm_loadu_si128(src.add(op.block as usize * BLOCK_BYTES) as *const __m128i);
                        let m = _mm_and_si128(blk, _mm_set1_epi8(op.mask as i8));
                        acc = _mm_or_si128(acc, shift128(m, op.shift));
                    }
                    _mm_storeu_si128(out.add(g * GROUP + s * STRIPE) as *mut __m128i, _mm_xor_si128(acc, xor));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn shift256(v: __m256i, shift: i8) -> __m256i {
        // SAFETY: only called from the AVX2 kernel; pure register operations.
        unsafe {
            if shift >= 0 {
                _mm256_sll_epi16(v, _mm_cvtsi32_si128(shift as i32))
            } else {
                _mm256_srl_epi16(v, _mm_cvtsi32_si128(-(shift as i32)))
            }
        }
    }

    /// Two groups per 256-bit register (the same on-disk format as the 128-bit kernels).
    ///
    /// # Safety
    /// AVX2 is available; `data` holds `n` groups of `bits · 16` bytes and `out` `n · 128` bytes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn unpack_avx2(tab: &Table, bits: u8, data: *const u8, out: *mut i8, n: usize) {
        let gb = bits as usize * BLOCK_BYTES;
        // SAFETY: loads stay inside groups g and g + 1 < n of `data`, stores inside the same
        // groups of `out`; the odd last group goes to the 128-bit kernel with the same bounds.
        unsafe {
            let xor = _mm256_set1_epi8(tab.xor as i8);
            let mut g = 0;
            while g + 2 <= n {
                let src = data.add(g * gb);
                for (s, ops) in tab.ops.iter().enumerate() {
                    let mut acc = _mm256_setzero_si256();
                    for op in &ops[..tab.n] {
                        let p = src.add(op.block as usize * BLOCK_BYTES);
                        let blk = _mm256_loadu2_m128i(p.add(gb) as *const __m128i, p as *const __m128i);
                        let m = _mm256_and_si256(blk, _mm256_set1_epi8(op.mask as i8));
                        acc = _mm256_or_si256(acc, shift256(m, op.shift));
                    }
                    let v = _mm256_xor_si256(acc, xor);
                    _mm_storeu_si128(out.add(g * GROUP + s * STRIPE) as *mut __m128i, _mm256_castsi256_si128(v));
                    _mm_storeu_si128(
                        out.add((g + 1) * GROUP + s * STRIPE) as *mut __m128i,
                        _mm256_extracti128_si256::<1>(v),
                    );
                }
                g += 2;
            }
            if g < n {
                unpack_sse2(tab, bits, data.add(g * gb), out.add(g * GROUP), n - g);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::{Table, BLOCK_BYTES, GROUP, STRIPE};
    use std::arch::aarch64::*;

    /// NEON has per-byte shifts: `vshlq_u8` by a signed count (negative: right).
    ///
    /// # Safety
    /// `data` holds `n` groups of `bits · 16` bytes and `out` `n · 128` bytes.
    pub(super) unsafe fn unpack_neon(tab: &Table, bits: u8, data: *const u8, out: *mut i8, n: usize) {
        let gb = bits as usize * BLOCK_BYTES;
        // SAFETY: NEON is baseline on aarch64; loads stay inside group g of `data` and stores
        // inside group g of `out`, g < n, as the caller guarantees.
        unsafe {
            let xor = vdupq_n_u8(tab.xor);
            for g in 0..n {
                let src = data.add(g * gb);
                for (s, ops) in tab.ops.iter().enumerate() {
                    let mut acc = vdupq_n_u8(0);
                    for op in &ops[..tab.n] {
                        let blk = vld1q_u8(src.add(op.block as usize * BLOCK_BYTES));
                        let m = vandq_u8(blk, vdupq_n_u8(op.mask));
                        acc = vorrq_u8(acc, vshlq_u8(m, vdupq_n_s8(op.shift)));
                    }
                    vst1q_u8(out.add(g * GROUP + s * STRIPE) as *mut u8, veorq_u8(acc, xor));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::edgeflow::{channel_bytes, groups, unpack_channel_reference};
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rng() -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(0xED6E_F10E)
    }

    #[test]
    fn unpack_kernel_equals_reference_on_any_bytes() {
        let mut r = rng();
        eprintln!("edgeflow unpack kernel here: {}", unpack_kernel_name());
        for bits in 1..=8u8 {
            for d in [128, 200, 576, 1536, 64] {
                let mut data = vec![0u8; channel_bytes(bits, d)];
                r.fill_bytes(&mut data);
                let mut a = vec![0i8; groups(d) * GROUP];
                let mut b = vec![1i8; groups(d) * GROUP];
                unpack_channel_reference(bits, &data, &mut a);
                unpack_channel(bits, &data, &mut b);
                assert_eq!(a, b, "bits {bits} d {d}");
            }
        }
    }
}
