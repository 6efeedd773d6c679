//! The packed kernels' dispatch: activations quantized and tiles of the packed layout
//! ([`crate::backend::layout::packed`]) multiplied with the instructions of the [`Kernel`] the
//! CPU's features allow ([`super::features`]), and the machine's int8 and read-bandwidth
//! ceilings the benchmark reports against.

#[cfg(target_arch = "x86_64")]
use super::features::features;
pub use super::features::{Kernel, KernelKind};
pub use crate::backend::layout::packed::*;

/// Quantizes whole 32-blocks of `x` into the matching slices of a [`QuantActs`].
///
/// # Panics
/// If the slices do not hold exactly `x.len() / 32` blocks (a bug in the caller).
pub fn quantize_rows(x: &[f32], o: QuantOut<'_>) {
    let blocks = x.len() / BLOCK;
    assert!(
        x.len().is_multiple_of(BLOCK)
            && o.qs.len() == x.len()
            && o.d.len() == blocks
            && o.sum.len() == blocks
            && o.ms.len() == blocks
            && o.gsum.len() == 8 * blocks
            && o.gcorr.len() == 16 * blocks
    );
    #[cfg(target_arch = "x86_64")]
    {
        let f = features();
        if f.avx512_quantize() && f.avx512vnni && f.f16c {
            // SAFETY: the features were detected; the slice sizes are asserted.
            return unsafe { super::arch::x86::packed::quantize_rows_avx512(x, o) };
        }
        if f.avx2 && f.sse41 {
            // SAFETY: AVX2 and SSE4.1 were detected.
            return unsafe { quantize_rows_avx2(x, o) };
        }
    }
    quantize_rows_body(x, o)
}

/// The same code compiled with AVX2 and SSE4.1, so rounding is one instruction and the loops
/// vectorize; the operations and their results are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,sse4.1")]
fn quantize_rows_avx2(x: &[f32], o: QuantOut<'_>) {
    quantize_rows_body(x, o)
}

/// Quantizing into the layout's activation format, with this CPU's fastest quantizer.
impl QuantActs {
    /// Quantizes `n` rows of `cols` (a multiple of 32) from `x`, reusing this buffer.
    pub fn quantize(&mut self, x: &[f32], n: usize, cols: usize) {
        self.resize(n, cols);
        quantize_rows(
            &x[..n * cols],
            QuantOut {
                qs: &mut self.qs,
                d: &mut self.d,
                sum: &mut self.sum,
                ms: &mut self.ms,
                gsum: &mut self.gsum,
                gcorr: &mut self.gcorr,
            },
        );
    }
}

impl Kernel {
    /// Rows of tile `tile` for tokens `t0..t0 + rows.len()` straight into each token's output
    /// row: `rows[j][r0 + lane]` for the tile's real rows (the last tile may have fewer than
    /// 16), summed in `order`. The AVX-512 kernel in [`Order::Lanes`] stores whole tiles in
    /// place; the others, and a partial last tile, go through `scratch` (resized as needed).
    ///
    /// # Panics
    /// On shapes that do not fit (a bug in the caller, never input data).
    #[allow(clippy::too_many_arguments)] // `run`'s arguments, the order, the rows' offset and a buffer
    pub fn run_rows(
        self,
        order: Order,
        w: &PackedMatrix,
        tile: usize,
        a: &QuantActs,
        t0: usize,
        rows: &mut [&mut [f32]],
        r0: usize,
        scratch: &mut Vec<f32>,
    ) {
        let nt = rows.len();
        let lanes = w.rows.saturating_sub(tile * TILE_ROWS).min(TILE_ROWS);
        assert!(tile < w.tiles() && a.cols == w.cols && t0 + nt <= a.n && rows.iter().all(|r| r.len() >= r0 + lanes));
        #[cfg(target_arch = "x86_64")]
        if order == Order::Lanes && self.is_avx512() && lanes == TILE_ROWS {
            // SAFETY: this `Kernel` exists only if AVX-512 F/BW/VNNI, FMA and F16C were
            // detected; the shape contract is asserted above (whole tile: 16 rows fit).
            return unsafe { super::arch::x86::packed::tile_avx512vnni_rows(w, tile, a, t0, rows, r0) };
        }
        scratch.resize(TILE_ROWS * nt, 0.0);
        self.run_order(order, w, tile, a, t0, nt, scratch);
        for (d, src) in rows.iter_mut().zip(scratch.chunks_exact(TILE_ROWS)) {
            d[r0..r0 + lanes].copy_from_slice(&src[..lanes]);
        }
    }

    /// Rows of tile `tile` for tokens `t0..t0 + nt` into `out[j * TILE_ROWS + lane]`.
    ///
    /// # Panics
    /// On shapes that do not fit (a bug in the caller, never input data).
    pub fn run(self, w: &PackedMatrix, tile: usize, a: &QuantActs, t0: usize, nt: usize, out: &mut [f32]) {
        self.run_order(Order::Lanes, w, tile, a, t0, nt, out)
    }

    /// [`Kernel::run`] in either accumulation order.
    ///
    /// # Panics
    /// On shapes that do not fit (a bug in the caller, never input data).
    #[allow(clippy::too_many_arguments)] // `run`'s arguments and the order
    pub fn run_order(
        self,
        order: Order,
        w: &PackedMatrix,
        tile: usize,
        a: &QuantActs,
        t0: usize,
        nt: usize,
        out: &mut [f32],
    ) {
        assert!(tile < w.tiles() && a.cols == w.cols && t0 + nt <= a.n && out.len() >= nt * TILE_ROWS);
        let blocksum = order == Order::BlockSum;
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: this `Kernel` exists only if AVX-512 F/BW/VNNI, FMA and F16C were
            // detected; the shape contract is asserted above.
            KernelKind::Avx512Vnni | KernelKind::Avx512Amx => unsafe {
                if blocksum {
                    super::arch::x86::packed::tile_avx512vnni_blocksum(w, tile, a, t0, nt, out)
                } else {
                    super::arch::x86::packed::tile_avx512vnni(w, tile, a, t0, nt, out)
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2, FMA and F16C were detected; shapes asserted above.
            KernelKind::Avx2 => unsafe {
                if blocksum {
                    super::arch::x86::packed::tile_avx2::<true>(w, tile, a, t0, nt, out)
                } else {
                    super::arch::x86::packed::tile_avx2::<false>(w, tile, a, t0, nt, out)
                }
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: the dot-product extension was detected; shapes asserted above.
            KernelKind::NeonDotprod => unsafe {
                if blocksum {
                    super::arch::arm::packed::tile_neon_dotprod::<true>(w, tile, a, t0, nt, out)
                } else {
                    super::arch::arm::packed::tile_neon_dotprod::<false>(w, tile, a, t0, nt, out)
                }
            },
            _ => reference_order(order, w, tile, a, t0, nt, out),
        }
    }
}

/// Multiply-accumulates per second of `threads` threads each running `run(iters)` at once,
/// `macs_per_iter` per iteration.
#[cfg(target_arch = "x86_64")]
fn sustained(threads: usize, iters: u64, macs_per_iter: u64, run: impl Fn(u64) + Sync) -> f64 {
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| run(iters));
        }
    });
    (threads.max(1) as u64 * iters * macs_per_iter) as f64 / t0.elapsed().as_secs_f64()
}

/// Read bandwidth in bytes/s over a buffer of `bytes` split between `threads` threads, each
/// summing its part: the best of five passes each plainly (the hardware prefetchers alone) and
/// with a software prefetch into L2 as far ahead as the decode kernels run
/// (`arch::x86::kpacked::STREAM_PREFETCH_BYTES`), the better of the two. The decode ceiling the
/// benchmark reports divides this by the bytes a token reads; a plain sum alone reads 26–28 GB/s
/// where the 1.5B's decode streams ~30 GB/s, so it is no ceiling.
pub fn read_peak_bytes_per_s(bytes: usize, threads: usize) -> f64 {
    let words = (bytes / 8).max(1 << 16);
    let buf: Vec<u64> = (0..words as u64).collect();
    let per = words.div_ceil(threads.max(1));
    let pass = |prefetch: bool| {
        let t0 = std::time::Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf.chunks(per).map(|c| s.spawn(move || sum_words(c, prefetch))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        t0.elapsed().as_secs_f64()
    };
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        best = best.min(pass(false)).min(pass(true));
    }
    (words * 8) as f64 / best
}

/// The wrapping sum of `c` (eight lanes, so it vectorizes), prefetching ahead if asked.
fn sum_words(c: &[u64], prefetch: bool) -> u64 {
    let mut acc = [0u64; 8];
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    for (i, w) in c.chunks_exact(8).enumerate() {
        #[cfg(target_arch = "x86_64")]
        if prefetch {
            super::arch::x86::packed::prefetch_l2(
                c.as_ptr().wrapping_add(8 * i) as *const u8,
                super::arch::x86::kpacked::STREAM_PREFETCH_BYTES,
            );
        }
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(w[k]);
        }
    }
    let _ = prefetch;
    acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
}

/// Sustained int8 multiply-accumulates per second on `threads` threads with the best kernel's
/// instruction (the prefill ceiling the benchmark reports against); 0 where not measured.
pub fn int8_peak_macs_per_s(threads: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if Kernel::best().is_avx512() {
        let run = |n| {
            // SAFETY: AVX-512 VNNI was detected (this kernel exists).
            std::hint::black_box(unsafe { super::arch::x86::packed::vnni_peak_loop(n) });
        };
        return sustained(threads, 20_000_000, 16 * 64, run);
    }
    let _ = threads;
    0.0
}

/// Sustained multiply-accumulates per second on `threads` threads in the rounding order the
/// packed kernels follow (`vpdpbusd`, conversion and FMA per 64 MACs: see
/// `arch::x86::packed::order_peak_loop`) — the ceiling of a kernel that is bit-equal to [`reference`];
/// 0 where not measured.
pub fn order_peak_macs_per_s(threads: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if Kernel::best().is_avx512() {
        let run = |n| {
            // SAFETY: AVX-512 VNNI and FMA were detected (this kernel exists).
            std::hint::black_box(unsafe { super::arch::x86::packed::order_peak_loop(n) });
        };
        return sustained(threads, 10_000_000, 12 * 64, run);
    }
    let _ = threads;
    0.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::quant::{quantize_row, vec_dot};
    use half::f16;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// Random GGUF rows of `ty`: scales of ordinary magnitude, every quant value possible.
    fn random_rows(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let bs = ty.type_size();
        let mut v = vec![0u8; rows * cols / BLOCK * bs];
        for b in v.chunks_exact_mut(bs) {
            for x in b.iter_mut() {
                *x = rng(&mut s) as u8;
            }
            let d = f16::from_f32((rng(&mut s) % 1000) as f32 / 20000.0 + 1e-4);
            b[0..2].copy_from_slice(&d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = f16::from_f32(-((rng(&mut s) % 1000) as f32) / 5000.0);
                b[2..4].copy_from_slice(&m.to_le_bytes());
            }
        }
        v
    }

    fn random_x(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n).map(|_| (rng(&mut s) % 20001) as f32 / 5000.0 - 2.0).collect()
    }

    fn pack(ty: GgmlType, raw: &[u8], rows: usize, cols: usize) -> PackedMatrix {
        let rb = raw.len() / rows;
        PackedMatrix::pack(PackKind::of(ty).expect("packable"), rows, cols, |r0, buf| {
            buf.copy_from_slice(&raw[r0 * rb..r0 * rb + buf.len()]);
            Ok(())
        })
        .expect("pack")
    }

    fn run_all(k: Kernel, w: &PackedMatrix, a: &QuantActs) -> Vec<f32> {
        run_all_order(k, Order::Lanes, w, a)
    }

    fn run_all_order(k: Kernel, order: Order, w: &PackedMatrix, a: &QuantActs) -> Vec<f32> {
        let mut out = vec![0f32; w.tiles() * TILE_ROWS * a.n];
        for (t, o) in out.chunks_exact_mut(TILE_ROWS * a.n).enumerate() {
            k.run_order(order, w, t, a, 0, a.n, o);
        }
        out
    }

    const ORDERS: [Order; 2] = [Order::Lanes, Order::BlockSum];

    #[test]
    fn results_stored_into_token_rows_equal_the_tile_buffer_bit_for_bit() {
        // 50 rows: three whole tiles and a partial last one (2 rows), which takes the buffered
        // path; outputs at an offset inside longer rows, the rest of each row left alone.
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols, n, r0, extra) = (50, 128, 5, 3, 7);
            let w = pack(ty, &random_rows(ty, rows, cols, 3 + ty.id() as u64), rows, cols);
            let mut a = QuantActs::default();
            a.quantize(&random_x(n * cols, 21), n, cols);
            for (k, order) in Kernel::available().into_iter().flat_map(|k| ORDERS.map(|o| (k, o))) {
                let want = run_all_order(k, order, &w, &a);
                let mut out = vec![vec![f32::NAN; r0 + rows + extra]; n];
                let mut scratch = Vec::new();
                for t in 0..w.tiles() {
                    let mut refs: Vec<&mut [f32]> = out.iter_mut().map(|o| &mut o[r0 + t * TILE_ROWS..]).collect();
                    k.run_rows(order, &w, t, &a, 0, &mut refs, 0, &mut scratch);
                }
                for (j, row) in out.iter().enumerate() {
                    for r in 0..rows {
                        let e = want[(r / TILE_ROWS) * TILE_ROWS * n + j * TILE_ROWS + r % TILE_ROWS];
                        assert_eq!(row[r0 + r].to_bits(), e.to_bits(), "{} {ty} token {j} row {r}", k.name());
                    }
                    assert!(
                        row[..r0].iter().chain(&row[r0 + rows..]).all(|v| v.is_nan()),
                        "{} wrote outside",
                        k.name()
                    );
                }
            }
        }
    }

    /// The block-sum order rounds the same exact sum in f32 as `vec_dot`, elsewhere: one
    /// rounding per block and term (48 blocks here), 2^-24 relative each, with margin; relative
    /// to Σ|w·a| of the row.
    const F32_SUM_TOL: f64 = 1e-5;

    #[test]
    fn the_references_agree_with_the_gguf_dot_product() {
        // `vec_dot` is the llama.cpp-order dot product checked against gguf-py and llama.cpp:
        // the lanes reference equals it bit for bit, the block-sum (output head) reference
        // within f32 rounding.
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols, n) = (37, 1536, 3);
            let raw = random_rows(ty, rows, cols, 7 + ty.id() as u64);
            let w = pack(ty, &raw, rows, cols);
            let x = random_x(n * cols, 11);
            let mut a = QuantActs::default();
            a.quantize(&x, n, cols);
            let lanes = run_all(Kernel(KernelKind::Scalar), &w, &a);
            let blocksum = run_all_order(Kernel(KernelKind::Scalar), Order::BlockSum, &w, &a);
            let at = ty.vec_dot_type();
            let arow = at.row_bytes(cols).expect("blocks");
            let wrow = ty.row_bytes(cols).expect("blocks");
            let mut deq = vec![0f32; cols];
            let mut differ = 0;
            for t in 0..n {
                let mut aq = vec![0u8; arow];
                quantize_row(at, &x[t * cols..(t + 1) * cols], &mut aq).expect("quantize");
                for r in 0..rows {
                    let want = vec_dot(ty, cols, &raw[r * wrow..(r + 1) * wrow], &aq).expect("dot");
                    let at_r = (r / TILE_ROWS) * TILE_ROWS * n + t * TILE_ROWS + r % TILE_ROWS;
                    let got = lanes[at_r];
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} row {r} token {t}: {got} vs {want}");
                    w.dequantize_row(r, &mut deq);
                    let mag: f64 = (0..cols)
                        .map(|i| (deq[i] as f64 * a.qs[t * cols + i] as f64 * a.d[(t * cols + i) / BLOCK] as f64).abs())
                        .sum();
                    let got = blocksum[at_r];
                    let diff = (got as f64 - want as f64).abs();
                    assert!(
                        diff <= F32_SUM_TOL * mag,
                        "{ty} block sum, row {r} token {t}: {got} vs {want} (Σ|w·a| {mag})"
                    );
                    differ += usize::from(got != want);
                }
            }
            // The orders do round differently (else the block-sum check would show nothing).
            assert!(differ > 0, "{ty}: every block-sum result equal to the lanes order's");
            // Dequantizing a packed row gives GGUF's values.
            let mut want = vec![0f32; cols];
            for r in [0, 15, 16, rows - 1] {
                w.dequantize_row(r, &mut deq);
                crate::quant::dequantize_row(ty, &raw[r * wrow..(r + 1) * wrow], &mut want).expect("deq");
                assert_eq!(deq, want, "{ty} row {r}");
            }
        }
    }

    #[test]
    fn every_kernel_equals_the_scalar_reference_bit_for_bit() {
        let kernels = Kernel::available();
        eprintln!("kernels here: {:?}", kernels.iter().map(|k| k.name()).collect::<Vec<_>>());
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, cols, n) in [(16, 32, 1), (50, 576, 1), (33, 128, 5), (64, 1536, 9), (7, 64, 2), (20, 64, 3)] {
                let raw = random_rows(ty, rows, cols, (rows * 31 + cols + n) as u64);
                let w = pack(ty, &raw, rows, cols);
                let x = random_x(n * cols, rows as u64);
                let mut a = QuantActs::default();
                a.quantize(&x, n, cols);
                for order in ORDERS {
                    let want = run_all_order(Kernel(KernelKind::Scalar), order, &w, &a);
                    for &k in &kernels {
                        let got = run_all_order(k, order, &w, &a);
                        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                e.to_bits(),
                                "{} {order:?} {ty} {rows}x{cols} n={n} at {i}: {g} vs {e}",
                                k.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_activation_quantizer_equals_the_definition_bit_for_bit() {
        // Random values, a zero block, values that round at exactly .5 steps, tiny and huge.
        let cols = 256;
        let mut x = random_x(3 * cols, 5);
        x[32..64].fill(0.0);
        for (i, v) in x[64..96].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5;
        }
        for (i, v) in x[96..128].iter_mut().enumerate() {
            *v = (i as f32 + 1.0) * 1e-30;
        }
        for (i, v) in x[128..160].iter_mut().enumerate() {
            *v = (i as f32 - 7.0) * 1e30;
        }
        let mut want = QuantActs::default();
        want.resize(3, cols);
        let QuantActs { qs, d, sum, ms, gsum, gcorr, .. } = &mut want;
        quantize_rows_body(&x, QuantOut { qs, d, sum, ms, gsum, gcorr });
        let mut got = QuantActs::default();
        got.quantize(&x, 3, cols);
        assert_eq!(got.qs, want.qs);
        assert_eq!(got.sum, want.sum);
        assert_eq!(got.gsum, want.gsum);
        assert_eq!(got.gcorr, want.gcorr);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.d), bits(&want.d));
        assert_eq!(bits(&got.ms), bits(&want.ms));
    }

    #[test]
    fn packing_refuses_partial_blocks() {
        let r = PackedMatrix::pack(PackKind::Q8_0, 2, 48, |_, _| Ok(()));
        assert!(r.is_err());
    }
}
