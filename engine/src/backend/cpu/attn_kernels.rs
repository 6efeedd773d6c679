//! Float kernels of attention over an f16 KV cache: `q·k` dot products, `out += w·v` and the
//! f16 rounding of softmax weights. Each has a scalar reference; the SIMD versions (AVX2+F16C,
//! also used on AVX-512 machines) perform the same operations in the same order, so they equal
//! the reference bit for bit (tested; the grouped ones fuse multiply-adds whose products are
//! exact, see [`GroupFn`]). The order is the one that reproduces llama.cpp's greedy
//! outputs on the golden prompts (see `tests/golden.rs`):
//!
//! - `dot`: 8 lanes, element `i` multiplied then added (not fused) into lane `i % 8`, the lanes
//!   summed left to right. Lengths not a multiple of 8 use the reference alone.
//! - `axpy`: `out[i] + w · v[i]`, multiplied then added.
//! - f16 rounding: round to nearest even, as `half` and `vcvtps2ph` both do.
//! - Exponentials (softmax and SiLU): [`exp_ref`], evaluated in f64 and rounded once to f32,
//!   so the result is the correctly rounded `e^x` except within ~1e-14 (relative) of a rounding
//!   midpoint. Over every f32 in (-110, 90) it differs from libm's f64 `exp` rounded to f32 on
//!   2 inputs and from glibc's `expf` on 7.6e-5 of them (170,648 inputs), always by one
//!   ulp; the f64 comparison is tested on a sweep. An f32-precision polynomial (a few
//!   ulp) moves greedy outputs on the golden prompts; this one moves no golden agreement
//!   figure.

use half::f16;

/// A kernel over the query heads of one KV head's group: per head, its query (or softmax
/// weights), then the shared key (or value) rows, the row stride, and per head its output.
///
/// Contract: every query value and weight is an f16 value (attention rounds both to f16
/// first, as llama.cpp does). The product of two f16 values is exact in f32 (11 × 11
/// significand bits ≤ 24, exponents far inside f32's range), so `acc + q·k` rounds once
/// either way: the SIMD versions fuse each multiply-add and still equal the unfused reference
/// bit for bit (tested). Measured with the variants alternating pass by pass (`batchbench`,
/// B=8, 300 passes, three runs): pass median ratio 0.979, 0.983 and 0.995, attention
/// 3.5–4.4% faster. Inputs outside the contract may differ from the reference in the last bit.
pub type GroupFn = fn(&[&[f32]], &[f16], usize, &mut [&mut [f32]]);

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
    /// `out[j] = dot(q, k[j·stride..j·stride + q.len()])` for every `j < out.len()`: `dot` over
    /// many positions at once (same values, bit for bit).
    pub dots: fn(&[f32], &[f16], usize, &mut [f32]),
    /// `axpy(w[j], v[j·stride..j·stride + out.len()], out)` for `j` = 0, 1, … in order: `axpy`
    /// over many positions with `out` kept in registers (same values, bit for bit).
    pub axpys: fn(&[f32], &[f16], usize, &mut [f32]),
    /// `dots(q[h], k, stride, out[h])` for every query head `h` of one KV head's group
    /// (grouped-query attention): each key row is loaded and converted once for all of them.
    pub dots_group: GroupFn,
    /// `axpys(w[h], v, stride, out[h])` for every query head `h` of one KV head's group: each
    /// value row is converted once for all of them.
    pub axpys_group: GroupFn,
    /// `x[i] = exp_ref(x[i] − m)`, the subtraction in f32 (softmax numerators).
    pub exp_sub: fn(&mut [f32], f32),
    /// `x[i] = x[i] · s` in f32, then the largest `x[i]` (NaNs skipped; −∞ for none; a zero
    /// maximum may come back with either sign): attention scores scaled, and their maximum.
    pub scale_max: fn(&mut [f32], f32) -> f32,
    /// `g[i] = g[i] / (1 + exp_ref(−g[i])) · u[i]` in f32 (SiLU(gate) · up); `u.len() == g.len()`.
    pub swiglu: fn(&mut [f32], &[f32]),
    /// `out[i] = f16(x[i])`, rounding to nearest even (new KV cache rows).
    pub to_f16: fn(&[f32], &mut [f16]),
}

impl AttnKernels {
    pub const REFERENCE: AttnKernels = AttnKernels {
        name: "scalar",
        dot: dot_ref,
        axpy: axpy_ref,
        dot_q8: dot_q8_ref,
        axpy_q8: axpy_q8_ref,
        scale_round: scale_round_ref,
        dots: dots_ref,
        axpys: axpys_ref,
        dots_group: dots_group_ref,
        axpys_group: axpys_group_ref,
        exp_sub: exp_sub_ref,
        scale_max: scale_max_ref,
        swiglu: swiglu_ref,
        to_f16: to_f16_ref,
    };

    /// Every set this CPU runs, best first; the reference last.
    pub fn available() -> Vec<AttnKernels> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let f = super::features::features();
            if f.avx2_fma_f16c() && f.avx512f && f.avx512vl {
                v.push(x86::AVX512VL);
            }
            if f.avx2_fma_f16c() {
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

pub fn dots_ref(q: &[f32], k: &[f16], stride: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_ref(q, &k[j * stride..j * stride + q.len()]);
    }
}

pub fn axpys_ref(w: &[f32], v: &[f16], stride: usize, out: &mut [f32]) {
    let n = out.len();
    for (j, &wj) in w.iter().enumerate() {
        axpy_ref(wj, &v[j * stride..j * stride + n], out);
    }
}

/// A grouped kernel as one head at a time: `one(a[h], kv, stride, out[h])` for every head.
#[inline]
fn each_head(
    one: fn(&[f32], &[f16], usize, &mut [f32]),
    a: &[&[f32]],
    kv: &[f16],
    stride: usize,
    out: &mut [&mut [f32]],
) {
    for (a, o) in a.iter().zip(out.iter_mut()) {
        one(a, kv, stride, o);
    }
}

pub fn dots_group_ref(q: &[&[f32]], k: &[f16], stride: usize, out: &mut [&mut [f32]]) {
    each_head(dots_ref, q, k, stride, out)
}

pub fn axpys_group_ref(w: &[&[f32]], v: &[f16], stride: usize, out: &mut [&mut [f32]]) {
    each_head(axpys_ref, w, v, stride, out)
}

/// Inputs are clamped to this range first (after NaN, which passes through): `e^-160` rounds
/// to 0 and `e^100` to infinity in f32, and `2^k` stays a normal f64 for every `k` in between.
const EXP_MIN: f64 = -160.0;
const EXP_MAX: f64 = 100.0;
const LOG2_E: f64 = std::f64::consts::LOG2_E;
/// ln 2 split in two (Cody and Waite's reduction): `LN2_HI` = 0x3FE62E42FEE00000 has 21
/// trailing zero bits, so `k · LN2_HI` is exact for our |k| ≤ 231; `LN2_LO` = ln 2 − `LN2_HI`.
const LN2_HI: f64 = 0.693_147_180_369_123_8;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
/// Taylor coefficients 1/n! of `e^r`, highest first (degree 11: the truncation error on
/// |r| ≤ ln2/2 is below 7e-15 relative, far under f32's 6e-8 half ulp).
const EXP_POLY: [f64; 12] = [
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `e^x` for f32: in f64, `k = round(x · log2 e)` (ties to even), `r = x − k·ln2` in two fused
/// steps, `e^r` by Horner's rule with fused multiply-adds, times `2^k`, then one rounding to
/// f32. The SIMD versions run exactly these operations, so they equal this bit for bit.
pub fn exp_ref(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let xd = (x as f64).clamp(EXP_MIN, EXP_MAX);
    let kd = (xd * LOG2_E).round_ties_even();
    let r = (-kd).mul_add(LN2_LO, (-kd).mul_add(LN2_HI, xd));
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    // `kd` is an integer in [-231, 145], so this is the exact power of two.
    let scale = f64::from_bits(((kd as i64 + 1023) as u64) << 52);
    (p * scale) as f32
}

pub fn exp_sub_ref(x: &mut [f32], m: f32) {
    for v in x.iter_mut() {
        *v = exp_ref(*v - m);
    }
}

pub fn scale_max_ref(x: &mut [f32], s: f32) -> f32 {
    let mut m = f32::NEG_INFINITY;
    for v in x.iter_mut() {
        *v *= s;
        m = m.max(*v);
    }
    m
}

pub fn swiglu_ref(g: &mut [f32], u: &[f32]) {
    for (g, u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + exp_ref(-*g)) * u;
    }
}

pub fn to_f16_ref(x: &[f32], out: &mut [f16]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f16::from_f32(v);
    }
}

pub fn scale_round_ref(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v = f16::from_f32(*v * s).to_f32();
    }
}

/// Asks the CPU to bring the cache lines of `s` (memory about to be written, such as a KV
/// cache's spare capacity) into cache ahead of the write, so the write does not stall on
/// them. A hint only: no effect on values; a no-op where the target has no prefetch here.
pub fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let (p, bytes) = (s.as_ptr() as *const i8, std::mem::size_of_val(s));
        let mut o = 0;
        while o < bytes {
            // SAFETY: `p + o` lies inside `s`; a prefetch reads nothing into the program and
            // never faults. SSE is part of x86-64.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.wrapping_add(o)) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
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
        dots: dots256,
        axpys: axpys256,
        dots_group: dots_group256,
        axpys_group: axpys_group256,
        exp_sub: exp_sub256,
        scale_max: scale_max_ref,
        swiglu: swiglu256,
        to_f16: to_f16_256,
    };

    /// AVX2 with AVX-512's 32 vector registers, which hold the accumulators of three query
    /// heads at once: the grouped kernels convert each key and value row once per group of
    /// three heads instead of once per head, on 512-bit registers (`dots_group_zmm`: two
    /// positions per register; `axpys_group_zmm`: 16 columns), in the reference's order.
    /// Against 256-bit grouped kernels in that order, alternating pass by pass
    /// (B=8 decode, SmolLM2-135M, 300–400 passes from contexts 64–512, medians), with the softmax's
    /// scaling and maximum in 16 lanes (`scale_max512`, against a scalar fold and an SSE
    /// loop): pass time ×0.977, 0.968, 0.970, 0.966, 0.956 and 0.947 from contexts 64, 128,
    /// 128, 192, 256 and 512; the grouped kernels alone ×0.975–0.994 up to 256, 0.961 at 512
    /// (the cache streams from memory: the multiply-adds are not all of the cost). One
    /// sequence unchanged (×0.996–1.000). The other kernels are AVX2's.
    pub const AVX512VL: AttnKernels = AttnKernels {
        name: "avx512vl",
        dots_group: dots_group512,
        axpys_group: axpys_group512,
        exp_sub: exp_sub512,
        scale_max: scale_max512,
        swiglu: swiglu512,
        ..AVX2
    };

    /// [`exp_ref`] of 4 values (AVX2: four f64 lanes).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4(x: __m128) -> __m128 {
        let xd = _mm256_cvtps_pd(x);
        // `max(lo, x)` and `min(hi, x)` return x when it is NaN, which then stays NaN.
        let xd = _mm256_min_pd(_mm256_set1_pd(EXP_MAX), _mm256_max_pd(_mm256_set1_pd(EXP_MIN), xd));
        let kd = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_pd(
            xd,
            _mm256_set1_pd(LOG2_E),
        ));
        let r = _mm256_fnmadd_pd(kd, _mm256_set1_pd(LN2_HI), xd);
        let r = _mm256_fnmadd_pd(kd, _mm256_set1_pd(LN2_LO), r);
        let mut p = _mm256_set1_pd(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(c));
        }
        // 2^k from k's bits: k + 2^52 + 2^51 holds k in its low mantissa bits; adding 1023
        // and shifting into the exponent field gives the exact power of two.
        let shift = _mm256_set1_pd(6_755_399_441_055_744.0);
        let kbits = _mm256_castpd_si256(_mm256_add_pd(kd, shift));
        let e = _mm256_slli_epi64::<52>(_mm256_add_epi64(kbits, _mm256_set1_epi64x(1023)));
        _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)))
    }

    fn to_f16_256(x: &[f32], out: &mut [f16]) {
        // SAFETY: F16C was detected before this table was handed out.
        unsafe { to_f16_256_impl(x, out) }
    }

    #[target_feature(enable = "avx2,f16c")]
    fn to_f16_256_impl(x: &[f32], out: &mut [f16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        for (xv, ov) in (&mut xc).zip(&mut oc) {
            // SAFETY: `xv` and `ov` are 8 values each, read and written unaligned.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(xv.as_ptr()));
                _mm_storeu_si128(ov.as_mut_ptr() as *mut __m128i, h);
            }
        }
        to_f16_ref(xc.remainder(), oc.into_remainder());
    }

    fn exp_sub256(x: &mut [f32], m: f32) {
        // SAFETY: AVX2 and FMA were detected before this table was handed out.
        unsafe { exp_sub256_impl(x, m) }
    }

    #[target_feature(enable = "avx2,fma")]
    fn exp_sub256_impl(x: &mut [f32], m: f32) {
        let mut c = x.chunks_exact_mut(4);
        for v in &mut c {
            // SAFETY: `v` is 4 f32s, read and written unaligned.
            unsafe {
                let d = _mm_sub_ps(_mm_loadu_ps(v.as_ptr()), _mm_set1_ps(m));
                _mm_storeu_ps(v.as_mut_ptr(), exp4(d));
            }
        }
        exp_sub_ref(c.into_remainder(), m);
    }

    fn swiglu256(g: &mut [f32], u: &[f32]) {
        // SAFETY: as in `exp_sub256`.
        unsafe { swiglu256_impl(g, u) }
    }

    #[target_feature(enable = "avx2,fma")]
    fn swiglu256_impl(g: &mut [f32], u: &[f32]) {
        let n = g.len().min(u.len());
        let (g, u) = (&mut g[..n], &u[..n]);
        let mut gc = g.chunks_exact_mut(4);
        let mut uc = u.chunks_exact(4);
        for (gv, uv) in (&mut gc).zip(&mut uc) {
            // SAFETY: `gv` and `uv` are 4 f32s each, read and written unaligned.
            unsafe {
                let x = _mm_loadu_ps(gv.as_ptr());
                let e = exp4(_mm_sub_ps(_mm_setzero_ps(), x));
                let y = _mm_mul_ps(_mm_div_ps(x, _mm_add_ps(_mm_set1_ps(1.0), e)), _mm_loadu_ps(uv.as_ptr()));
                _mm_storeu_ps(gv.as_mut_ptr(), y);
            }
        }
        swiglu_ref(gc.into_remainder(), uc.remainder());
    }

    /// [`exp_ref`] of 8 values (AVX-512F: eight f64 lanes; `scalef` multiplies by 2^k exactly).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let xd = _mm512_cvtps_pd(x);
        let xd = _mm512_min_pd(_mm512_set1_pd(EXP_MAX), _mm512_max_pd(_mm512_set1_pd(EXP_MIN), xd));
        let kd = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_pd(
            xd,
            _mm512_set1_pd(LOG2_E),
        ));
        let r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(LN2_HI), xd);
        let r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(LN2_LO), r);
        let mut p = _mm512_set1_pd(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c));
        }
        _mm512_cvtpd_ps(_mm512_scalef_pd(p, kd))
    }

    fn scale_max512(x: &mut [f32], s: f32) -> f32 {
        // SAFETY: AVX-512F was detected before this table was handed out.
        unsafe { scale_max512_impl(x, s) }
    }

    /// 16 lanes: the same products; the maximum is exact in any order (`vmaxps` returns its
    /// second operand, the running maximum, when the new value is a NaN, as `f32::max` skips
    /// NaNs).
    #[target_feature(enable = "avx512f")]
    fn scale_max512_impl(x: &mut [f32], s: f32) -> f32 {
        let sv = _mm512_set1_ps(s);
        let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut c = x.chunks_exact_mut(16);
        for v in &mut c {
            // SAFETY: `v` is 16 f32s, read and written unaligned.
            unsafe {
                let y = _mm512_mul_ps(_mm512_loadu_ps(v.as_ptr()), sv);
                _mm512_storeu_ps(v.as_mut_ptr(), y);
                mv = _mm512_max_ps(y, mv);
            }
        }
        let m = _mm512_reduce_max_ps(mv);
        m.max(scale_max_ref(c.into_remainder(), s))
    }

    fn exp_sub512(x: &mut [f32], m: f32) {
        // SAFETY: AVX-512F/VL, AVX2 and FMA were detected before this table was handed out.
        unsafe { exp_sub512_impl(x, m) }
    }

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn exp_sub512_impl(x: &mut [f32], m: f32) {
        let mut c = x.chunks_exact_mut(8);
        for v in &mut c {
            // SAFETY: `v` is 8 f32s, read and written unaligned.
            unsafe {
                let d = _mm256_sub_ps(_mm256_loadu_ps(v.as_ptr()), _mm256_set1_ps(m));
                _mm256_storeu_ps(v.as_mut_ptr(), exp8(d));
            }
        }
        exp_sub_ref(c.into_remainder(), m);
    }

    fn swiglu512(g: &mut [f32], u: &[f32]) {
        // SAFETY: as in `exp_sub512`.
        unsafe { swiglu512_impl(g, u) }
    }

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn swiglu512_impl(g: &mut [f32], u: &[f32]) {
        let n = g.len().min(u.len());
        let (g, u) = (&mut g[..n], &u[..n]);
        let mut gc = g.chunks_exact_mut(8);
        let mut uc = u.chunks_exact(8);
        for (gv, uv) in (&mut gc).zip(&mut uc) {
            // SAFETY: `gv` and `uv` are 8 f32s each, read and written unaligned.
            unsafe {
                let x = _mm256_loadu_ps(gv.as_ptr());
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let y = _mm256_mul_ps(
                    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e)),
                    _mm256_loadu_ps(uv.as_ptr()),
                );
                _mm256_storeu_ps(gv.as_mut_ptr(), y);
            }
        }
        swiglu_ref(gc.into_remainder(), uc.remainder());
    }

    fn dots_group256(q: &[&[f32]], k: &[f16], stride: usize, out: &mut [&mut [f32]]) {
        each_head(dots256, q, k, stride, out)
    }
    fn axpys_group256(w: &[&[f32]], v: &[f16], stride: usize, out: &mut [&mut [f32]]) {
        each_head(axpys256, w, v, stride, out)
    }

    /// Heads per grouped call: 3 × 4 accumulators, their queries or weights and the converted
    /// rows fit in the 32 vector registers.
    const GROUP_HEADS: usize = 3;

    fn dots_group512(q: &[&[f32]], k: &[f16], stride: usize, out: &mut [&mut [f32]]) {
        let hd = q.first().map_or(0, |q| q.len());
        let n = out.first().map_or(0, |o| o.len());
        let fits = hd.is_multiple_of(8)
            && hd <= 256
            && stride >= hd
            && q.len() == out.len()
            && q.iter().all(|x| x.len() == hd)
            && out.iter().all(|o| o.len() == n);
        if !fits {
            return dots_group_ref(q, k, stride, out);
        }
        if let Some(last) = n.checked_sub(1) {
            let _ = &k[last * stride..last * stride + hd];
        }
        for (qs, os) in q.chunks(GROUP_HEADS).zip(out.chunks_mut(GROUP_HEADS)) {
            // SAFETY: AVX2, F16C, FMA, AVX-512F/VL were detected before this table was handed
            // out; every row `j < n` is inside `k` (checked above) and every head has `hd` (a
            // multiple of 8) query values and `n` outputs.
            unsafe {
                match qs.len() {
                    3 => dots_group_zmm::<3>(qs, k, stride, os),
                    2 => dots_group_zmm::<2>(qs, k, stride, os),
                    _ => dots_group_zmm::<1>(qs, k, stride, os),
                }
            }
        }
    }

    fn axpys_group512(w: &[&[f32]], v: &[f16], stride: usize, out: &mut [&mut [f32]]) {
        let hd = out.first().map_or(0, |o| o.len());
        let n = w.first().map_or(0, |w| w.len());
        let fits = hd.is_multiple_of(8)
            && stride >= hd
            && w.len() == out.len()
            && w.iter().all(|x| x.len() == n)
            && out.iter().all(|o| o.len() == hd);
        if !fits {
            return axpys_group_ref(w, v, stride, out);
        }
        if let Some(last) = n.checked_sub(1) {
            let _ = &v[last * stride..last * stride + hd];
        }
        for (ws, os) in w.chunks(GROUP_HEADS).zip(out.chunks_mut(GROUP_HEADS)) {
            // 64 columns at a time (4 registers a head), then 16, then a last 8.
            let mut c = 0;
            while c < hd {
                // SAFETY: as `dots_group512`: features detected, rows inside `v`; the columns
                // each call covers (64, 16 or 8 from `c`) are inside every output.
                unsafe {
                    let (left, g) = (hd - c, ws.len());
                    c += match (left, g) {
                        (64.., 3) => axpys_group_zmm::<3, 4, false>(ws, v, stride, os, c),
                        (64.., 2) => axpys_group_zmm::<2, 4, false>(ws, v, stride, os, c),
                        (64.., _) => axpys_group_zmm::<1, 4, false>(ws, v, stride, os, c),
                        (16.., 3) => axpys_group_zmm::<3, 1, false>(ws, v, stride, os, c),
                        (16.., 2) => axpys_group_zmm::<2, 1, false>(ws, v, stride, os, c),
                        (16.., _) => axpys_group_zmm::<1, 1, false>(ws, v, stride, os, c),
                        (_, 3) => axpys_group_zmm::<3, 1, true>(ws, v, stride, os, c),
                        (_, 2) => axpys_group_zmm::<2, 1, true>(ws, v, stride, os, c),
                        (_, _) => axpys_group_zmm::<1, 1, true>(ws, v, stride, os, c),
                    };
                }
            }
        }
    }

    /// Eight positions' dot products with `G` query heads at once, each key row converted
    /// once for all of them, fused (exact for f16 queries: see [`GroupFn`](super::GroupFn)), in
    /// the one-head kernel's order ([`dots256_impl`]: element `i` into lane `i % 8`, then the
    /// lanes left to right). Each 512-bit register holds two positions: lanes 0–7 the first's
    /// 8-lane accumulator, lanes 8–15 the second's, so half as many multiply-adds are issued as
    /// on 256-bit registers. `hd` is a multiple of 8 (a last 8 elements take one step alone).
    #[allow(clippy::needless_range_loop)] // heads and positions index several arrays at once
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl")]
    unsafe fn dots_group_zmm<const G: usize>(q: &[&[f32]], k: &[f16], stride: usize, out: &mut [&mut [f32]]) {
        let hd = q[0].len();
        let n = out[0].len();
        let whole = hd - hd % 16;
        let kp = k.as_ptr();
        let qp: [*const f32; G] = std::array::from_fn(|h| q[h].as_ptr());
        let mut j = 0;
        while j + 8 <= n {
            for p in j + PREFETCH_ROWS..(j + PREFETCH_ROWS + 8).min(n) {
                // SAFETY: row p < n is inside `k`; prefetches never fault.
                unsafe { prefetch_row(kp.add(p * stride), hd) };
            }
            // acc[h][m]: positions j + 2m (lanes 0–7) and j + 2m + 1 (lanes 8–15).
            let mut acc = [[_mm512_setzero_ps(); 4]; G];
            // Where position j + p's elements from i start (the loads below read inside `k`).
            let row = |p: usize, i: usize| kp.wrapping_add((j + p) * stride + i);
            for i in (0..whole).step_by(16) {
                // SAFETY: i + 16 <= whole <= hd; rows j..j+8 are inside `k`; each query holds
                // hd values.
                unsafe {
                    let qz: [__m512; G] = std::array::from_fn(|h| _mm512_loadu_ps(qp[h].add(i)));
                    // Query elements i..i+8 in both halves, then i+8..i+16 in both halves.
                    let qlo: [__m512; G] = std::array::from_fn(|h| _mm512_shuffle_f32x4::<0b01_00_01_00>(qz[h], qz[h]));
                    let qhi: [__m512; G] = std::array::from_fn(|h| _mm512_shuffle_f32x4::<0b11_10_11_10>(qz[h], qz[h]));
                    for m in 0..4 {
                        let a = _mm512_cvtph_ps(_mm256_loadu_si256(row(2 * m, i) as *const __m256i));
                        let b = _mm512_cvtph_ps(_mm256_loadu_si256(row(2 * m + 1, i) as *const __m256i));
                        // [a's i..i+8 | b's i..i+8] and [a's i+8..i+16 | b's i+8..i+16].
                        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
                        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
                        for h in 0..G {
                            acc[h][m] = _mm512_fmadd_ps(qlo[h], lo, acc[h][m]);
                            acc[h][m] = _mm512_fmadd_ps(qhi[h], hi, acc[h][m]);
                        }
                    }
                }
            }
            if whole < hd {
                let i = whole;
                // SAFETY: i + 8 = hd; rows j..j+8 are inside `k`; each query holds hd values.
                unsafe {
                    let qt: [__m512; G] = std::array::from_fn(|h| {
                        let x = _mm512_castps256_ps512(_mm256_loadu_ps(qp[h].add(i)));
                        _mm512_shuffle_f32x4::<0b01_00_01_00>(x, x)
                    });
                    for m in 0..4 {
                        let a = _mm_loadu_si128(row(2 * m, i) as *const __m128i);
                        let b = _mm_loadu_si128(row(2 * m + 1, i) as *const __m128i);
                        let ab = _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b));
                        for h in 0..G {
                            acc[h][m] = _mm512_fmadd_ps(qt[h], ab, acc[h][m]);
                        }
                    }
                }
            }
            for h in 0..G {
                let half = |m: usize, upper: bool| -> __m256 {
                    let z = acc[h][m];
                    if upper {
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z)))
                    } else {
                        _mm512_castps512_ps256(z)
                    }
                };
                // Transposed, lane i of every position sits in one register: adding them in
                // lane order is each position's left-to-right lane sum, 8 positions at once.
                let t = transpose8(std::array::from_fn(|p| half(p / 2, p % 2 == 1)));
                let mut sum = t[0];
                for v in &t[1..] {
                    sum = _mm256_add_ps(sum, *v);
                }
                // SAFETY: j + 8 <= n = out[h].len().
                unsafe { _mm256_storeu_ps(out[h].as_mut_ptr().add(j), sum) };
            }
            j += 8;
        }
        for h in 0..G {
            for jj in j..n {
                // SAFETY: row jj is inside `k`; AVX2/F16C as this function.
                out[h][jj] = unsafe { dot256_impl(q[h], &k[jj * stride..jj * stride + hd]) };
            }
        }
    }

    /// `out[h][c..] += w[h][j] · v[j][c..]` for every position `j` in order and `G` heads at
    /// once, each value row converted once for all of them, fused (exact for f16 weights: see
    /// [`GroupFn`](super::GroupFn)): `R` registers of 16 columns from `c`, or one of 8 when
    /// `EIGHT` (masked). Each output column adds the same products in the same order as the
    /// reference, so the values are the same. Returns the columns covered.
    #[allow(clippy::needless_range_loop)] // heads and columns index several arrays at once
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl")]
    unsafe fn axpys_group_zmm<const G: usize, const R: usize, const EIGHT: bool>(
        w: &[&[f32]],
        v: &[f16],
        stride: usize,
        out: &mut [&mut [f32]],
        c: usize,
    ) -> usize {
        let width = if EIGHT { 8 } else { 16 };
        let mask: __mmask16 = if EIGHT { 0x00FF } else { 0xFFFF };
        let n = w[0].len();
        let mut acc = [[_mm512_setzero_ps(); R]; G];
        for h in 0..G {
            for (r, a) in acc[h].iter_mut().enumerate() {
                // SAFETY: each output holds at least c + width·R f32s (the caller's contract);
                // the masked load reads only those.
                *a = unsafe { _mm512_maskz_loadu_ps(mask, out[h].as_ptr().add(c + width * r)) };
            }
        }
        let vp = v.as_ptr();
        for j in 0..n {
            if j + PREFETCH_ROWS < n {
                // SAFETY: row j + PREFETCH_ROWS is inside `v`; prefetches never fault.
                unsafe { prefetch_row(vp.add((j + PREFETCH_ROWS) * stride + c), width * R) };
            }
            let wv: [__m512; G] = std::array::from_fn(|h| _mm512_set1_ps(w[h][j]));
            for r in 0..R {
                // SAFETY: row j's columns c+width·r .. +width are inside `v` (the caller's
                // contract); eight columns are read as 16 bytes, sixteen as 32.
                let x = unsafe {
                    let p = vp.add(j * stride + c + width * r);
                    if EIGHT {
                        _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128(p as *const __m128i)))
                    } else {
                        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
                    }
                };
                for h in 0..G {
                    acc[h][r] = _mm512_fmadd_ps(wv[h], x, acc[h][r]);
                }
            }
        }
        for h in 0..G {
            for (r, a) in acc[h].iter().enumerate() {
                // SAFETY: as the load: the masked store writes only the covered columns.
                unsafe { _mm512_mask_storeu_ps(out[h].as_mut_ptr().add(c + width * r), mask, *a) };
            }
        }
        width * R
    }

    fn dots256(q: &[f32], k: &[f16], stride: usize, out: &mut [f32]) {
        let hd = q.len();
        if !hd.is_multiple_of(8) || hd > 256 || stride < hd {
            return dots_ref(q, k, stride, out);
        }
        // Every row read lies inside `k` (the slice index panics otherwise, as the reference).
        if let Some(last) = out.len().checked_sub(1) {
            let _ = &k[last * stride..last * stride + hd];
        }
        // SAFETY: AVX2 and F16C were detected before this table was handed out; every row
        // `j < out.len()` is inside `k` (checked just above).
        unsafe { dots256_impl(q, k, stride, out) }
    }
    fn axpys256(w: &[f32], v: &[f16], stride: usize, out: &mut [f32]) {
        let hd = out.len();
        if !hd.is_multiple_of(8) || stride < hd {
            return axpys_ref(w, v, stride, out);
        }
        if let Some(last) = w.len().checked_sub(1) {
            let _ = &v[last * stride..last * stride + hd];
        }
        // SAFETY: as above: every row `j < w.len()` is inside `v`.
        unsafe { axpys256_impl(w, v, stride, out) }
    }

    /// How many positions ahead the attention kernels prefetch the cache.
    const PREFETCH_ROWS: usize = 32;

    /// Prefetches the cache lines of `len` f16 values from `p`.
    #[inline(always)]
    unsafe fn prefetch_row(p: *const f16, len: usize) {
        let b = p as *const i8;
        let mut o = 0;
        while o < 2 * len {
            // SAFETY: the caller's row is readable; a prefetch never faults anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(b.add(o)) };
            o += 64;
        }
        // SAFETY: as above (the row's last byte, in case it starts mid-line).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(b.add(2 * len - 1)) };
    }

    /// `r[i][p] = a[p][i]`: an 8×8 transpose of f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn transpose8(a: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(a[0], a[1]);
        let t1 = _mm256_unpackhi_ps(a[0], a[1]);
        let t2 = _mm256_unpacklo_ps(a[2], a[3]);
        let t3 = _mm256_unpackhi_ps(a[2], a[3]);
        let t4 = _mm256_unpacklo_ps(a[4], a[5]);
        let t5 = _mm256_unpackhi_ps(a[4], a[5]);
        let t6 = _mm256_unpacklo_ps(a[6], a[7]);
        let t7 = _mm256_unpackhi_ps(a[6], a[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }

    /// Eight positions at a time, one accumulator each, then the reference's lane sum.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dots256_impl(q: &[f32], k: &[f16], stride: usize, out: &mut [f32]) {
        let hd = q.len();
        let n = out.len();
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut j = 0;
        while j + 8 <= n {
            // The KV cache streams from memory once per layer: fetch rows well ahead (memory
            // latency is a few hundred cycles, a row's dot product a few dozen).
            for p in j + PREFETCH_ROWS..(j + PREFETCH_ROWS + 8).min(n) {
                // SAFETY: row p < n is inside `k`; prefetches never fault.
                unsafe { prefetch_row(kp.add(p * stride), hd) };
            }
            let mut acc = [_mm256_setzero_ps(); 8];
            for i in (0..hd).step_by(8) {
                // SAFETY: i + 8 <= hd; rows j..j+8 are inside `k` (the caller's contract).
                unsafe {
                    let qv = _mm256_loadu_ps(qp.add(i));
                    for (p, a) in acc.iter_mut().enumerate() {
                        let kv = _mm256_cvtph_ps(_mm_loadu_si128(kp.add((j + p) * stride + i) as *const __m128i));
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(qv, kv));
                    }
                }
            }
            // Transposed, lane i of every position sits in one register: adding them in lane
            // order is each position's left-to-right lane sum, for 8 positions at once.
            let t = transpose8(acc);
            let mut sum = t[0];
            for v in &t[1..] {
                sum = _mm256_add_ps(sum, *v);
            }
            // SAFETY: j + 8 <= n = out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j), sum) };
            j += 8;
        }
        for (jj, o) in out.iter_mut().enumerate().skip(j) {
            // SAFETY: row jj is inside `k`; AVX2/F16C as this function.
            *o = unsafe { dot256_impl(q, &k[jj * stride..jj * stride + hd]) };
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn axpys256_impl(w: &[f32], v: &[f16], stride: usize, out: &mut [f32]) {
        let hd = out.len();
        let mut c = 0;
        while c + 64 <= hd {
            // SAFETY: columns c..c+64 of every row (the caller's contract).
            unsafe { axpys_cols::<8>(w, v, stride, &mut out[c..c + 64], c) };
            c += 64;
        }
        while c + 8 <= hd {
            // SAFETY: as above, columns c..c+8.
            unsafe { axpys_cols::<1>(w, v, stride, &mut out[c..c + 8], c) };
            c += 8;
        }
    }

    /// Columns `c..c + 8R` of every row, accumulated in `R` registers over all positions.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn axpys_cols<const R: usize>(w: &[f32], v: &[f16], stride: usize, out: &mut [f32], c: usize) {
        let op = out.as_mut_ptr();
        let mut acc = [_mm256_setzero_ps(); R];
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: `out` holds 8R f32s.
            *a = unsafe { _mm256_loadu_ps(op.add(8 * r)) };
        }
        let vp = v.as_ptr();
        for (j, &wj) in w.iter().enumerate() {
            if j + PREFETCH_ROWS < w.len() {
                // SAFETY: row j + PREFETCH_ROWS is inside `v`; prefetches never fault.
                unsafe { prefetch_row(vp.add((j + PREFETCH_ROWS) * stride + c), 8 * R) };
            }
            let wv = _mm256_set1_ps(wj);
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: row j's columns c+8r..c+8r+8 are inside `v` (the caller's contract).
                unsafe {
                    let x = _mm256_cvtph_ps(_mm_loadu_si128(vp.add(j * stride + c + 8 * r) as *const __m128i));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, x));
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: `out` holds 8R f32s.
            unsafe { _mm256_storeu_ps(op.add(8 * r), *a) };
        }
    }

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
        if !n.is_multiple_of(8) {
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
        if !n.is_multiple_of(8) {
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
            for n in [16usize, 64, 128, 80, 72, 24, 8, 7, 33] {
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
                // Scaled scores and their maximum, with a NaN (skipped) and signed zeros.
                let (mut a, mut b) = (det(n, 7, 4.0), det(n, 7, 4.0));
                for x in [&mut a, &mut b] {
                    x[n / 2] = f32::NAN;
                    x[0] = -0.0;
                }
                let (ma, mb) = ((k.scale_max)(&mut a, 0.125), (r.scale_max)(&mut b, 0.125));
                assert_eq!(ma, mb, "{} scale_max n={n}", k.name);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{} scale_max values n={n}", k.name);
                let (mut a, mut b) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                let (ma, mb) = ((k.scale_max)(&mut a, 0.5), (r.scale_max)(&mut b, 0.5));
                assert_eq!((ma, mb), (f32::NEG_INFINITY, f32::NEG_INFINITY), "{} scale_max all NaN n={n}", k.name);
                // Many positions of a strided cache (a head inside rows of 3 heads).
                for pos in [1usize, 7, 8, 19, 40] {
                    let stride = 3 * n;
                    let cache: Vec<f16> = det(pos * stride, 8, 2.0).into_iter().map(f16::from_f32).collect();
                    let head = &cache[n..];
                    let (mut a, mut b) = (vec![0f32; pos], vec![0f32; pos]);
                    (k.dots)(&q, head, stride, &mut a);
                    for (j, e) in b.iter_mut().enumerate() {
                        *e = (r.dot)(&q, &head[j * stride..j * stride + n]);
                    }
                    assert_eq!(a, b, "{} dots n={n} positions={pos}", k.name);
                    let w = det(pos, 9, 0.5);
                    let (mut a, mut b) = (det(n, 4, 1.0), det(n, 4, 1.0));
                    (k.axpys)(&w, head, stride, &mut a);
                    for (j, &wj) in w.iter().enumerate() {
                        (r.axpy)(wj, &head[j * stride..j * stride + n], &mut b);
                    }
                    assert_eq!(a, b, "{} axpys n={n} positions={pos}", k.name);
                    // Groups of 1 to 7 heads sharing the cache (chunks of 3 inside the kernel).
                    for g in 1..=7usize {
                        // The grouped kernels' contract: f16 queries and weights.
                        let f16s =
                            |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect() };
                        let qs: Vec<Vec<f32>> = (0..g).map(|h| f16s(det(n, 20 + h as u32, 3.0))).collect();
                        let qr: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
                        let mut outs = vec![vec![0f32; pos]; g];
                        let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                        (k.dots_group)(&qr, head, stride, &mut refs);
                        for (h, o) in outs.iter().enumerate() {
                            let mut want = vec![0f32; pos];
                            (r.dots)(&qs[h], head, stride, &mut want);
                            assert_eq!(o, &want, "{} dots_group n={n} positions={pos} heads={g} head {h}", k.name);
                        }
                        let ws: Vec<Vec<f32>> = (0..g).map(|h| f16s(det(pos, 30 + h as u32, 0.5))).collect();
                        let wr: Vec<&[f32]> = ws.iter().map(|w| &w[..]).collect();
                        let mut outs: Vec<Vec<f32>> = (0..g).map(|h| det(n, 40 + h as u32, 1.0)).collect();
                        let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                        (k.axpys_group)(&wr, head, stride, &mut refs);
                        for (h, o) in outs.iter().enumerate() {
                            let mut want = det(n, 40 + h as u32, 1.0);
                            (r.axpys)(&ws[h], head, stride, &mut want);
                            assert_eq!(o, &want, "{} axpys_group n={n} positions={pos} heads={g} head {h}", k.name);
                        }
                    }
                }
            }
        }
    }

    /// Inputs whose `e^x` the f64 reference (libm's `exp`, then one rounding to f32) gets one
    /// ulp away from `exp_ref` may exist only at the rate found over every f32 in (-110, 90):
    /// 2 of 2,240,806,912. Allowed: one in a million.
    const EXP_MISMATCH_RATE: f64 = 1e-6;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_correctly_rounded_over_a_sweep_of_every_binade() {
        // Every 997th f32 bit pattern in (-110, 90): ~2.2 million inputs, all exponents.
        let (mut n, mut off) = (0u64, 0u64);
        for bits in (0..u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            if !(x > -110.0 && x < 90.0) {
                continue;
            }
            n += 1;
            let (got, want) = (exp_ref(x), (x as f64).exp() as f32);
            if got.to_bits() != want.to_bits() {
                off += 1;
                assert!(ulps(got, want) <= 1, "exp({x:e}) = {got:e}, want {want:e}");
            }
        }
        assert!(n > 2_000_000);
        assert!(off as f64 <= EXP_MISMATCH_RATE * n as f64, "{off} of {n} off by one ulp");
        // The edges: overflow, underflow through the subnormals, and the special values.
        for x in [88.72283f32, 88.72284, 89.0, -87.33654, -87.5, -100.0, -103.9, -103.98, -104.0, -105.0, 0.0, -0.0] {
            assert_eq!(exp_ref(x).to_bits(), ((x as f64).exp() as f32).to_bits(), "exp({x})");
        }
        assert_eq!(exp_ref(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_ref(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_ref(1e30), f32::INFINITY);
        assert_eq!(exp_ref(-1e30), 0.0);
        assert!(exp_ref(f32::NAN).is_nan());
    }

    #[test]
    fn every_exp_kernel_equals_the_reference_bit_for_bit() {
        let mut xs: Vec<f32> = det(1003, 7, 120.0);
        xs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 88.72284, -103.98, 1e-40, -1e-40]);
        xs.extend((0..200).map(|i| -110.0 + i as f32 * 1.0001));
        let us = det(xs.len(), 8, 2.0);
        let same = |a: &[f32], b: &[f32]| {
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
        };
        for k in AttnKernels::available() {
            // Every length up to 17 (the SIMD bodies and their scalar tails), then all of them.
            for len in (0..=17).chain([xs.len()]) {
                for m in [0.0f32, 3.5, -20.0] {
                    let (mut a, mut b) = (xs[..len].to_vec(), xs[..len].to_vec());
                    (k.exp_sub)(&mut a, m);
                    exp_sub_ref(&mut b, m);
                    assert!(same(&a, &b), "{} exp_sub len={len} m={m}", k.name);
                }
                let (mut a, mut b) = (xs[..len].to_vec(), xs[..len].to_vec());
                (k.swiglu)(&mut a, &us[..len]);
                swiglu_ref(&mut b, &us[..len]);
                assert!(same(&a, &b), "{} swiglu len={len}", k.name);
            }
        }
        // New KV rows: f16 rounding, specials and subnormals included.
        let mut hs = xs.clone();
        hs.extend([65504.0, 65520.0, 1e-5, 6e-8, 3e-8, -2.5e-8, 0.1, 1.0 / 3.0]);
        for k in AttnKernels::available() {
            for len in (0..=17).chain([hs.len()]) {
                let (mut a, mut b) = (vec![f16::ZERO; len], vec![f16::ZERO; len]);
                (k.to_f16)(&hs[..len], &mut a);
                to_f16_ref(&hs[..len], &mut b);
                let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
                assert!(same, "{} to_f16 len={len}", k.name);
            }
        }
        // SiLU's definition at a few points, against f64.
        for g in [-30.0f32, -3.0, -0.5, 0.0, 0.5, 3.0, 30.0] {
            let mut a = [g];
            swiglu_ref(&mut a, &[1.5]);
            let want = g as f64 / (1.0 + (-g as f64).exp()) * 1.5;
            assert!((a[0] as f64 - want).abs() <= want.abs() * 1e-6 + 1e-30, "silu({g})·1.5 = {}, want {want}", a[0]);
        }
    }
}
