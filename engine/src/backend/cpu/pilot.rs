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
    pub n: usize,
    pub d: usize,
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
    pub d: usize,
    pub i8s: Vec<i8>,
    pub u8s: Vec<u8>,
}

impl PilotQueries {
    /// Quantizes `rows` (each `d` long) at `scale`, reusing the buffers.
    pub fn fill(&mut self, rows: &[&[f32]], d: usize, scale: f32) {
        let inv = 1.0 / scale;
        self.d = d;
        self.i8s.clear();
        self.u8s.clear();
        for r in rows {
            for &x in r.iter() {
                let q = quantize_i8(x, inv);
                self.i8s.push(q);
                self.u8s.push((q as i32 + 128) as u8);
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
