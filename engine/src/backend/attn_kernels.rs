//! Float kernels of attention over an f16 KV cache: `q·k` dot products, `out += w·v` and the
//! f16 rounding of softmax weights. Each has a scalar reference; the SIMD versions (AVX2+F16C,
//! also used on AVX-512 machines) perform the same operations in the same order, so they equal
//! the reference bit for bit (tested). The order is the one that reproduces llama.cpp's greedy
//! outputs on the golden prompts (see `tests/golden.rs`):
//!
//! - `dot`: 8 lanes, element `i` multiplied then added (not fused) into lane `i % 8`, the lanes
//!   summed left to right. Lengths not a multiple of 8 use the reference alone.
//! - `axpy`: `out[i] + w · v[i]`, multiplied then added.
//! - f16 rounding: round to nearest even, as `half` and `vcvtps2ph` both do.
//! - The softmax exponentials stay libm's `expf` (a polynomial would move greedy outputs).

use half::f16;

/// The kernels one CPU uses, chosen once.
#[derive(Clone, Copy)]
pub struct AttnKernels {
    pub name: &'static str,
    /// `Σ q[i]·k[i]`.
    pub dot: fn(&[f32], &[f16]) -> f32,
    /// `out[i] += w · v[i]` (fused).
    pub axpy: fn(f32, &[f16], &mut [f32]),
    /// `Σ q[i]·k[i]` over int8 keys (the caller applies the key's scale).
    pub dot_q8: fn(&[f32], &[i8]) -> f32,
    /// `out[i] += w · v[i]` over int8 values (`w` carries the value's scale).
    pub axpy_q8: fn(f32, &[i8], &mut [f32]),
    /// `x[i] = f16(x[i] · s)` as f32.
    pub scale_round: fn(&mut [f32], f32),
}

impl AttnKernels {
    pub const REFERENCE: AttnKernels = AttnKernels {
        name: "scalar",
        dot: dot_ref,
        axpy: axpy_ref,
        dot_q8: dot_q8_ref,
        axpy_q8: axpy_q8_ref,
        scale_round: scale_round_ref,
    };

    /// Every set this CPU runs, best first; the reference last.
    pub fn available() -> Vec<AttnKernels> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(x86::AVX2);
            }
        }
        v.push(Self::REFERENCE);
        v
    }

    /// The best set (or the reference when `LLMD_KERNEL=scalar`).
    pub fn best() -> AttnKernels {
        static BEST: std::sync::OnceLock<AttnKernels> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            if std::env::var("LLMD_KERNEL").is_ok_and(|k| k == "scalar") {
                Self::REFERENCE
            } else {
                Self::available()[0]
            }
        })
    }
}

pub fn dot_ref(q: &[f32], k: &[f16]) -> f32 {
    let mut l = [0f32; 8];
    for (i, (a, b)) in q.iter().zip(k).enumerate() {
        l[i % 8] += a * b.to_f32();
    }
    l.iter().sum()
}

pub fn dot_q8_ref(q: &[f32], k: &[i8]) -> f32 {
    let mut l = [0f32; 8];
    for (i, (a, &b)) in q.iter().zip(k).enumerate() {
        l[i % 8] += a * b as f32;
    }
    l.iter().sum()
}

pub fn axpy_q8_ref(w: f32, v: &[i8], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += w * x as f32;
    }
}

pub fn axpy_ref(w: f32, v: &[f16], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x.to_f32();
    }
}

pub fn scale_round_ref(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v = f16::from_f32(*v * s).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    pub const AVX2: AttnKernels = AttnKernels {
        name: "avx2",
        dot: dot256,
        axpy: axpy256,
        dot_q8: dotq8_256,
        axpy_q8: axpyq8_256,
        scale_round: round256,
    };

    fn dotq8_256(q: &[f32], k: &[i8]) -> f32 {
        // SAFETY: AVX2 was detected before this table was handed out.
        unsafe { dotq8_256_impl(q, k) }
    }
    fn axpyq8_256(w: f32, v: &[i8], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpyq8_256_impl(w, v, out) }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn dotq8_256_impl(q: &[f32], k: &[i8]) -> f32 {
        let n = q.len().min(k.len());
        if n % 8 != 0 {
            return dot_q8_ref(q, k);
        }
        let mut acc = _mm256_setzero_ps();
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, inside both slices (an 8-byte load of `k`).
            unsafe {
                let kv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(k.as_ptr().add(i) as *const __m128i)));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(i)), kv));
            }
        }
        let mut l = [0f32; 8];
        // SAFETY: `l` holds 8 f32s.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), acc) };
        l.iter().sum()
    }

    #[target_feature(enable = "avx2")]
    unsafe fn axpyq8_256_impl(w: f32, v: &[i8], out: &mut [f32]) {
        let n = v.len().min(out.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, inside both slices.
            unsafe {
                let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.as_ptr().add(i) as *const __m128i)));
                let o = out.as_mut_ptr().add(i);
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(wv, x)));
            }
            i += 8;
        }
        axpy_q8_ref(w, &v[i..n], &mut out[i..n]);
    }

    // The safe wrappers below are reachable only through AVX2, which `available()` hands out
    // only after detecting the features their `target_feature` bodies need.

    fn dot256(q: &[f32], k: &[f16]) -> f32 {
        // SAFETY: AVX2 and F16C were detected before this table was handed out.
        unsafe { dot256_impl(q, k) }
    }
    fn axpy256(w: f32, v: &[f16], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpy256_impl(w, v, out) }
    }
    fn round256(x: &mut [f32], s: f32) {
        // SAFETY: as above.
        unsafe { round256_impl(x, s) }
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot256_impl(q: &[f32], k: &[f16]) -> f32 {
        let n = q.len().min(k.len());
        if n % 8 != 0 {
            return dot_ref(q, k);
        }
        let mut acc = _mm256_setzero_ps();
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, inside both slices; f16 is a transparent u16.
            unsafe {
                let kv = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(i) as *const __m128i));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(i)), kv));
            }
        }
        let mut l = [0f32; 8];
        // SAFETY: `l` holds 8 f32s.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), acc) };
        l.iter().sum()
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn axpy256_impl(w: f32, v: &[f16], out: &mut [f32]) {
        let n = v.len().min(out.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, inside both slices.
            unsafe {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i));
                let o = out.as_mut_ptr().add(i);
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(wv, x)));
            }
            i += 8;
        }
        axpy_ref(w, &v[i..n], &mut out[i..n]);
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn round256_impl(x: &mut [f32], s: f32) {
        let sv = _mm256_set1_ps(s);
        let mut i = 0;
        while i + 8 <= x.len() {
            // SAFETY: i + 8 <= len.
            unsafe {
                let p = x.as_mut_ptr().add(i);
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(_mm256_loadu_ps(p), sv));
                _mm256_storeu_ps(p, _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        scale_round_ref(&mut x[i..], s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn det(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((((i as u32).wrapping_mul(2654435761).wrapping_add(seed)) >> 8) % 20001) as f32 / 10000.0 * scale
                    - scale
            })
            .collect()
    }

    #[test]
    fn every_attention_kernel_equals_the_reference_bit_for_bit() {
        let r = AttnKernels::REFERENCE;
        for k in AttnKernels::available() {
            for n in [16usize, 64, 128, 80, 7, 33] {
                let q = det(n, 1, 3.0);
                let kv: Vec<f16> = det(n, 2, 2.0).into_iter().map(f16::from_f32).collect();
                assert_eq!((k.dot)(&q, &kv).to_bits(), (r.dot)(&q, &kv).to_bits(), "{} dot n={n}", k.name);
                let (mut a, mut b) = (det(n, 3, 1.0), det(n, 3, 1.0));
                (k.axpy)(0.37, &kv, &mut a);
                (r.axpy)(0.37, &kv, &mut b);
                assert_eq!(a, b, "{} axpy n={n}", k.name);
                let k8: Vec<i8> = det(n, 6, 127.0).into_iter().map(|x| x as i8).collect();
                assert_eq!((k.dot_q8)(&q, &k8).to_bits(), (r.dot_q8)(&q, &k8).to_bits(), "{} dot_q8 n={n}", k.name);
                let (mut a, mut b) = (det(n, 3, 1.0), det(n, 3, 1.0));
                (k.axpy_q8)(0.0037, &k8, &mut a);
                (r.axpy_q8)(0.0037, &k8, &mut b);
                assert_eq!(a, b, "{} axpy_q8 n={n}", k.name);
                let (mut a, mut b) = (det(n, 5, 1.0), det(n, 5, 1.0));
                (k.scale_round)(&mut a, 0.731);
                (r.scale_round)(&mut b, 0.731);
                assert_eq!(a, b, "{} round n={n}", k.name);
            }
        }
    }
}
