//! shadowAttn's pilot on the CPU: the dense INT8 Q·Kᵀ of one head (no softmax, mask or 1/√d:
//! the order of the scores is what top-k reads), exact i32 sums. AVX-512 VNNI where the CPU has
//! it (`arch/x86/pilot.rs`), else the portable loop (compiled as is: on aarch64 LLVM vectorises
//! it with NEON); both give the same integers (tested).

use crate::backend::sparse::quantize_i8;

/// Keys per tile (one 512-bit register of i32 sums).
pub const KEY_TILE: usize = 16;

/// One head's keys quantized at one scale: row-major bytes, and the VNNI tiles (16 keys × 4
/// bytes per group of 4 dimensions) with each key's offset term.
#[derive(Default)]
pub struct PilotKeys {
    n: usize,
    d: usize,
    plain: Vec<i8>,
    tiles: Vec<i8>,
    bias: Vec<i32>,
}

impl PilotKeys {
    /// Quantizes `n` keys of `d` values (`key(j)` gives key `j`) at `scale`.
    pub fn build(n: usize, d: usize, scale: f32, key: impl Fn(usize, &mut [f32])) -> Self {
        let inv = 1.0 / scale;
        let mut plain = vec![0i8; n * d];
        let mut row = vec![0f32; d];
        for j in 0..n {
            key(j, &mut row);
            for (o, &x) in plain[j * d..(j + 1) * d].iter_mut().zip(&row) {
                *o = quantize_i8(x, inv);
            }
        }
        let mut k = Self { n, d, plain, tiles: Vec::new(), bias: Vec::new() };
        if vnni() && d.is_multiple_of(4) {
            let blocks = n.div_ceil(KEY_TILE);
            k.tiles = vec![0i8; blocks * KEY_TILE * d];
            k.bias = vec![0i32; blocks * KEY_TILE];
            for j in 0..n {
                let (blk, lane) = (j / KEY_TILE, j % KEY_TILE);
                let src = &k.plain[j * d..(j + 1) * d];
                for g in 0..d / 4 {
                    let at = blk * KEY_TILE * d + g * 64 + lane * 4;
                    k.tiles[at..at + 4].copy_from_slice(&src[4 * g..4 * g + 4]);
                }
                k.bias[j] = 128 * src.iter().map(|&x| x as i32).sum::<i32>();
            }
        }
        k
    }

    pub fn row(&self, j: usize) -> &[i8] {
        &self.plain[j * self.d..(j + 1) * self.d]
    }
}

/// Query rows quantized at one scale: signed bytes, and the same plus 128 as unsigned bytes
/// (`vpdpbusd` multiplies unsigned by signed; the keys' offset term takes the 128 back out).
#[derive(Default)]
pub struct PilotQueries {
    d: usize,
    i8s: Vec<i8>,
    u8s: Vec<u8>,
}

impl PilotQueries {
    /// Quantizes `rows` (each `d` long) at `scale`, reusing the buffers.
    pub fn fill(&mut self, rows: &[&[f32]], d: usize, scale: f32) {
        self.d = d;
        self.i8s.clear();
        self.u8s.clear();
        for r in rows {
            self.push(r, scale);
        }
    }

    /// [`Self::fill`] from rows laid end to end.
    pub fn fill_flat(&mut self, rows: &[f32], d: usize, scale: f32) {
        self.d = d;
        self.i8s.clear();
        self.u8s.clear();
        self.push(rows, scale);
    }

    fn push(&mut self, x: &[f32], scale: f32) {
        let inv = 1.0 / scale;
        for &x in x {
            let q = quantize_i8(x, inv);
            self.i8s.push(q);
            self.u8s.push((q as i32 + 128) as u8);
        }
    }
}

fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::features::features().avx512_vnni_kernels()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether [`scores`] runs the VNNI kernel here (for listings).
pub fn pilot_kernel_name() -> &'static str {
    if vnni() {
        "avx512vnni"
    } else {
        "portable"
    }
}

/// Row stride [`scores`] needs for `n` keys.
pub fn stride_for(n: usize) -> usize {
    n.div_ceil(KEY_TILE) * KEY_TILE
}

/// The pilot: `out[r * stride + j] = Σ q[r]·k[j]` for every query row `r` of `q` and key
/// `j < visible[r]` (entries past `visible[r]` may be written with scores of later keys, or left
/// as they were). `stride >= stride_for(k.n)`; `visible[r] <= k.n`.
pub fn scores(q: &PilotQueries, k: &PilotKeys, visible: &[usize], out: &mut [i32], stride: usize) {
    let d = k.d;
    let rows = visible.len();
    assert!(q.d == d && q.i8s.len() >= rows * d && stride >= stride_for(k.n) && out.len() >= rows * stride);
    // The kernel's own reads: the unsigned queries, and every tile and offset term of the keys.
    assert!(k.tiles.is_empty() || (q.u8s.len() >= rows * d && k.tiles.len() >= stride_for(k.n) * d));
    assert!(k.tiles.is_empty() || k.bias.len() >= stride_for(k.n));
    assert!(visible.iter().all(|&v| v <= k.n));
    #[cfg(target_arch = "x86_64")]
    if !k.tiles.is_empty() && vnni() {
        for r0 in (0..rows).step_by(4) {
            let nr = (rows - r0).min(4);
            let most = visible[r0..r0 + nr].iter().copied().max().unwrap_or(0);
            let blocks = most.div_ceil(KEY_TILE);
            // SAFETY: VNNI checked (`vnni`); `d % 4 == 0` (tiles are built only then); `nr <= 4`;
            // `q.u8s` holds `rows * d` values; `blocks <= k.n.div_ceil(16)`, the tiles' and offset
            // terms' blocks; rows `r0..r0 + nr` of `out` hold `stride >= 16 · blocks` values each
            // (asserted above).
            unsafe {
                super::arch::x86::pilot::scores_vnni(
                    &q.u8s[r0 * d..],
                    d,
                    nr,
                    &k.tiles,
                    &k.bias,
                    blocks,
                    &mut out[r0 * stride..],
                    stride,
                )
            };
        }
        return;
    }
    scores_portable(q, k, visible, out, stride);
}

/// The portable pilot (the reference of the VNNI kernel).
pub fn scores_portable(q: &PilotQueries, k: &PilotKeys, visible: &[usize], out: &mut [i32], stride: usize) {
    let d = k.d;
    for (r, &vis) in visible.iter().enumerate() {
        let qr = &q.i8s[r * d..(r + 1) * d];
        for (j, o) in out[r * stride..r * stride + vis].iter_mut().enumerate() {
            *o = qr.iter().zip(k.row(j)).map(|(&a, &b)| a as i32 * b as i32).sum();
        }
    }
}

/// Scratch of [`top_k`], reused across rows (the sample, band and lists only with AVX-512).
#[derive(Default)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct TopKScratch {
    sample: Vec<i32>,
    band: Vec<i32>,
    above: Vec<u32>,
    ties: Vec<u32>,
    hist: Vec<u32>,
}

/// Rows shorter than this take the portable selection (the sample would be most of the row).
#[cfg(target_arch = "x86_64")]
const TOP_K_SIMD_MIN: usize = 256;

/// [`crate::backend::sparse::top_k`] (the same indices): with AVX-512, the k-th largest score
/// found by bisection on counts of scores at least a value (16 per instruction), bracketed first
/// by a sorted sample of 64, then one pass splitting the row at it.
pub fn top_k(scores: &[i32], k: usize, sc: &mut TopKScratch, out: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    let n = scores.len();
    #[cfg(target_arch = "x86_64")]
    if n >= TOP_K_SIMD_MIN && k > 0 && k < n && super::features::features().avx512f {
        use super::arch::x86::pilot::{count_ge, split_at};
        // SAFETY: AVX-512 F checked just above.
        let count = |t: i64| if t > i32::MAX as i64 { 0 } else { unsafe { count_ge(scores, t as i32) } };
        let step = n / 64;
        sc.sample.clear();
        sc.sample.extend((0..64).map(|i| scores[i * step + step / 2]));
        sc.sample.sort_unstable_by(|a, b| b.cmp(a));
        let r = k * 64 / n;
        let (mut lo, mut hi) = (sc.sample[(r + 6).min(63)] as i64, sc.sample[r.saturating_sub(6)] as i64);
        // Wanted: at least k scores >= lo, fewer than k >= hi + 1; else the row's whole range.
        if count(lo) < k {
            lo = scores.iter().copied().min().unwrap_or(i32::MIN) as i64;
        }
        if count(hi + 1) >= k {
            hi = scores.iter().copied().max().unwrap_or(i32::MAX) as i64;
        }
        // The largest t with k scores >= t: the k-th largest score, by bisection over the
        // bracket's scores alone (copied out once), counting those above it once.
        let above_band = count(hi + 1);
        sc.band.clear();
        // SAFETY: AVX-512 F checked above; `lo` and `hi` are scores or the row's bounds.
        unsafe { super::arch::x86::pilot::band(scores, lo as i32, hi as i32, &mut sc.band) };
        let band_ge = |band: &[i32], t: i64| {
            if t > i32::MAX as i64 {
                0
            } else {
                // SAFETY: AVX-512 F checked above.
                unsafe { count_ge(band, t as i32) }
            }
        };
        while lo < hi {
            let mid = lo + (hi - lo + 1) / 2;
            if above_band + band_ge(&sc.band, mid) >= k {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        sc.above.clear();
        sc.ties.clear();
        // SAFETY: AVX-512 F checked above.
        unsafe { split_at(scores, lo as i32, &mut sc.above, &mut sc.ties) };
        let need = k - sc.above.len();
        let ties = &sc.ties[sc.ties.len() - need..];
        out.clear();
        let (a, t) = (&sc.above, ties);
        let (mut i, mut j) = (0, 0);
        while i < a.len() || j < t.len() {
            if j == t.len() || (i < a.len() && a[i] < t[j]) {
                out.push(a[i]);
                i += 1;
            } else {
                out.push(t[j]);
                j += 1;
            }
        }
        return;
    }
    crate::backend::sparse::top_k(scores, k, &mut sc.hist, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_equals_the_portable_selection_for_any_row() {
        let mut s = 0x2545F4914F6CDD1Du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let (mut sc, mut a, mut b, mut hist) = (TopKScratch::default(), Vec::new(), Vec::new(), Vec::new());
        for case in 0..300 {
            let n = 200 + (next() % 3000) as usize;
            let range = [2u64, 50, 5_000, 2_000_000, u32::MAX as u64][case % 5];
            let row: Vec<i32> = (0..n).map(|_| (next() % range) as i64 as i32 - (range / 2) as i32).collect();
            for k in [1, n / 5, n / 5 + 1, n / 2, n - 1, n] {
                top_k(&row, k, &mut sc, &mut a);
                crate::backend::sparse::top_k(&row, k, &mut hist, &mut b);
                assert_eq!(a, b, "n {n} k {k} range {range}");
            }
        }
        // Extremes of the i32 range.
        let row: Vec<i32> = (0..300).map(|i| if i % 3 == 0 { i32::MAX } else { i32::MIN }).collect();
        top_k(&row, 150, &mut sc, &mut a);
        crate::backend::sparse::top_k(&row, 150, &mut hist, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn the_kernel_equals_the_portable_sums_for_any_rows_keys_and_saturation() {
        let mut s = 0x9E3779B97F4A7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20001) as f32 / 10000.0 - 1.0
        };
        for &(n, d, rows) in &[(1usize, 64usize, 1usize), (17, 64, 3), (100, 128, 9), (33, 4, 5), (5, 6, 2)] {
            let keys: Vec<f32> = (0..n * d).map(|_| next() * 3.0).collect();
            let qs: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            // A key scale below the keys' range: some saturate at ±127.
            let k = PilotKeys::build(n, d, 2.0 / 127.0, |j, row| row.copy_from_slice(&keys[j * d..(j + 1) * d]));
            let mut q = PilotQueries::default();
            let rs: Vec<&[f32]> = qs.chunks_exact(d).collect();
            q.fill(&rs, d, 1.0 / 127.0);
            let visible: Vec<usize> = (0..rows).map(|r| n.min(1 + r * n / rows.max(1))).collect();
            let stride = stride_for(n);
            let (mut a, mut b) = (vec![0i32; rows * stride], vec![0i32; rows * stride]);
            scores(&q, &k, &visible, &mut a, stride);
            scores_portable(&q, &k, &visible, &mut b, stride);
            for (r, &v) in visible.iter().enumerate() {
                assert_eq!(a[r * stride..r * stride + v], b[r * stride..r * stride + v], "n {n} d {d} row {r}");
            }
            assert!(k.plain.iter().any(|&x| x == 127 || x == -127), "saturation exercised");
        }
    }
}
