//! The K-quant kernels' dispatch: Q8_K activations quantized and tiles of the K-quant layout
//! ([`crate::backend::layout::kpacked`]) multiplied with the instructions of a [`Kernel`]: AVX-512
//! VNNI and AMX (`arch/x86/kpacked.rs`), AVX2 (`arch/x86/kpacked_avx2.rs`) and NEON with the
//! dot-product extension (`arch/arm/kpacked.rs`).

#[cfg(target_arch = "x86_64")]
use super::features::features;
use super::features::{Kernel, KernelKind};
pub use crate::backend::layout::kpacked::*;
use crate::backend::layout::packed::TILE_ROWS;

/// Quantizes whole super-blocks of `x` to Q8_K into the matching slices.
///
/// # Panics
/// If the slices do not hold exactly `x.len() / 256` super-blocks (a bug in the caller).
pub fn quantize_rows(x: &[f32], o: KActsOut<'_>) {
    let sbs = x.len() / SB;
    assert!(
        x.len().is_multiple_of(SB)
            && o.qs.len() == x.len()
            && o.d.len() == sbs
            && o.bs16.len() == 16 * sbs
            && o.bs32.len() == 8 * sbs
    );
    #[cfg(target_arch = "x86_64")]
    {
        let f = features();
        if f.avx512_quantize() {
            // SAFETY: the features were detected; the slice sizes are asserted.
            return unsafe { super::arch::x86::kpacked::quantize_rows_avx512(x, o) };
        }
        if f.avx2 && f.sse41 {
            // SAFETY: AVX2 and SSE4.1 were detected.
            return unsafe { quantize_rows_avx2(x, o) };
        }
    }
    quantize_rows_body(x, o)
}

/// The same code compiled with AVX2 and SSE4.1 (rounding in one instruction; same results).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,sse4.1")]
fn quantize_rows_avx2(x: &[f32], o: KActsOut<'_>) {
    quantize_rows_body(x, o)
}

/// Quantizing into the layout's activation format, with this CPU's fastest quantizer.
impl KActs {
    /// Quantizes `n` rows of `cols` (a multiple of 256) from `x`.
    pub fn quantize(&mut self, x: &[f32], n: usize, cols: usize) {
        self.resize(n, cols);
        quantize_rows(
            &x[..n * cols],
            KActsOut { qs: &mut self.qs, d: &mut self.d, bs16: &mut self.bs16, bs32: &mut self.bs32 },
        );
    }
}

/// Rows of tile `tile` for tokens `t0..t0 + rows.len()` straight into each token's output
/// row: `rows[j][r0 + lane]` for the tile's real rows (the last tile may have fewer than 16),
/// with `kernel`'s instructions (through `scratch`, resized as needed).
///
/// # Panics
/// On shapes that do not fit (a bug in the caller, never input data).
#[allow(clippy::too_many_arguments)]
pub fn run_rows(
    kernel: Kernel,
    w: &KPackedMatrix,
    tile: usize,
    a: &KActs,
    t0: usize,
    rows: &mut [&mut [f32]],
    r0: usize,
    scratch: &mut Vec<f32>,
) {
    let nt = rows.len();
    let lanes = w.rows.saturating_sub(tile * TILE_ROWS).min(TILE_ROWS);
    assert!(tile < w.tiles() && a.cols == w.cols && t0 + nt <= a.n && rows.iter().all(|r| r.len() >= r0 + lanes));
    #[cfg(target_arch = "x86_64")]
    if kernel.is_avx512() && lanes == TILE_ROWS {
        check_acts(w, a, t0, nt);
        let amx = kernel.kind() == KernelKind::Avx512Amx;
        // SAFETY: this `Kernel` exists only if AVX-512 F/BW/VNNI, FMA and F16C were detected,
        // and as `Avx512Amx` only if AMX-INT8 was and the process may use it; the shapes are
        // asserted above (a whole tile: 16 rows fit in every row).
        return unsafe { super::arch::x86::kpacked::tile_avx512vnni_rows(w, tile, a, t0, rows, r0, amx) };
    }
    scratch.resize(TILE_ROWS * nt, 0.0);
    run(kernel, w, tile, a, t0, nt, scratch);
    for (d, src) in rows.iter_mut().zip(scratch.chunks_exact(TILE_ROWS)) {
        d[r0..r0 + lanes].copy_from_slice(&src[..lanes]);
    }
}

/// Rows of tile `tile` for tokens `t0..t0 + nt` into `out[j * TILE_ROWS + lane]`.
///
/// # Panics
/// On shapes that do not fit (a bug in the caller, never input data).
pub fn run(kernel: Kernel, w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, nt: usize, out: &mut [f32]) {
    assert!(tile < w.tiles() && out.len() >= nt * TILE_ROWS);
    check_acts(w, a, t0, nt);
    match kernel.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: this `Kernel` exists only if AVX-512 F/BW/VNNI, FMA and F16C were detected;
        // the shape contract is asserted above.
        KernelKind::Avx512Vnni => unsafe { super::arch::x86::kpacked::tile_avx512vnni(w, tile, a, t0, nt, out, false) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as `Avx512Vnni`, and this `Kernel` exists only if AMX-INT8 was detected and
        // the process was granted its tile state.
        KernelKind::Avx512Amx => unsafe { super::arch::x86::kpacked::tile_avx512vnni(w, tile, a, t0, nt, out, true) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: this `Kernel` exists only if AVX2, FMA and F16C were detected; the shape
        // contract is asserted above.
        KernelKind::Avx2 => unsafe { super::arch::x86::kpacked_avx2::tile_avx2(w, tile, a, t0, nt, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: this `Kernel` exists only if the dot-product extension was detected; the shape
        // contract is asserted above.
        KernelKind::NeonDotprod => unsafe { super::arch::arm::kpacked::tile_neon_dotprod(w, tile, a, t0, nt, out) },
        _ => reference(w, tile, a, t0, nt, out),
    }
}

/// Panics unless `a` holds tokens `t0..t0 + nt` of `w.cols` columns, whole.
fn check_acts(w: &KPackedMatrix, a: &KActs, t0: usize, nt: usize) {
    let sbs = w.superblocks();
    assert!(
        a.cols == w.cols
            && t0 + nt <= a.n
            && a.qs.len() >= (t0 + nt) * w.cols
            && a.d.len() >= (t0 + nt) * sbs
            && a.bs16.len() >= (t0 + nt) * sbs * 16
            && a.bs32.len() >= (t0 + nt) * sbs * 8
    );
}

/// The name of the kernel K-quant tiles run on with `kernel` (for listings).
pub fn kernel_name(kernel: Kernel, kind: KKind) -> &'static str {
    match kernel.kind() {
        KernelKind::Avx512Vnni => "avx512-vnni",
        // AMX runs the prompt chunks of the kinds with 32-column groups only (`arch/x86/kpacked.rs`).
        KernelKind::Avx512Amx if kind.group() == 32 => "avx512-vnni, prompts on amx",
        KernelKind::Avx512Amx => "avx512-vnni",
        KernelKind::Avx2 => "avx2",
        KernelKind::NeonDotprod => "neon-dotprod",
        _ => "scalar",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;
    use crate::quant::GgmlType;
    use half::f16;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// Random GGUF rows of `kind` with sane f16 scales.
    pub(crate) fn random_rows(kind: KKind, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let ty = kind.ggml();
        let ts = ty.type_size();
        let mut s = seed | 1;
        let mut raw: Vec<u8> = (0..rows * cols / SB * ts).map(|_| rng(&mut s) as u8).collect();
        for b in raw.chunks_exact_mut(ts) {
            let mut f = |at: usize, s: &mut u64| {
                let v = f16::from_f32(0.001 + (rng(s) % 1000) as f32 * 0.00005);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            };
            match kind {
                KKind::Q2K => {
                    f(80, &mut s);
                    f(82, &mut s)
                }
                KKind::Q3K => f(108, &mut s),
                KKind::Q4K | KKind::Q5K => {
                    f(0, &mut s);
                    f(2, &mut s)
                }
                KKind::Q6K => f(208, &mut s),
            }
        }
        raw
    }

    pub(crate) fn random_x(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n).map(|_| ((rng(&mut s) % 20001) as f32 - 10000.0) / 3000.0).collect()
    }

    pub(crate) fn pack(kind: KKind, raw: &[u8], rows: usize, cols: usize) -> KPackedMatrix {
        let rb = kind.ggml().row_bytes(cols).expect("test data fits");
        KPackedMatrix::pack_in(None, kind, rows, cols, |r0, buf| {
            buf.copy_from_slice(&raw[r0 * rb..r0 * rb + buf.len()]);
            Ok(())
        })
        .expect("test data fits")
    }

    const KINDS: [KKind; 5] = [KKind::Q2K, KKind::Q3K, KKind::Q4K, KKind::Q5K, KKind::Q6K];

    #[test]
    fn records_are_no_larger_than_the_files_rows_but_for_byte_scales() {
        for k in KINDS {
            let src = 16 * k.ggml().type_size();
            let extra = k.record_bytes() as f64 / src as f64 - 1.0;
            assert!((0.0..0.04).contains(&extra), "{k:?}: record {} vs {} file bytes", k.record_bytes(), src);
        }
        assert_eq!(KKind::Q6K.record_bytes(), 16 * 210);
        assert_eq!(KKind::Q2K.record_bytes(), 16 * 84);
    }

    #[test]
    fn packed_rows_dequantize_to_the_gguf_values_bit_for_bit() {
        for k in KINDS {
            let (rows, cols) = (21, 512);
            let raw = random_rows(k, rows, cols, 7 + k as u64);
            let p = pack(k, &raw, rows, cols);
            let rb = k.ggml().row_bytes(cols).expect("test data fits");
            let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                quant::dequantize_row(k.ggml(), &raw[r * rb..(r + 1) * rb], &mut want).expect("test data fits");
                p.dequantize_row(r, &mut got);
                for i in 0..cols {
                    assert_eq!(got[i].to_bits(), want[i].to_bits(), "{k:?} row {r} col {i}: {} vs {}", got[i], want[i]);
                }
            }
        }
    }

    #[test]
    fn every_activation_quantizer_equals_the_definition_on_ties_zeros_and_extremes() {
        let cols = 4 * SB;
        let mut x = random_x(cols, 21);
        // Block 1: +m and -m both present (the first one decides the sign); block 2: zeros;
        // block 3: values whose scaled magnitude lands on .5 and the cap.
        x[SB + 7] = 9.0;
        x[SB + 3] = -9.0;
        x[2 * SB..3 * SB].fill(0.0);
        for (i, v) in x[3 * SB..].iter_mut().enumerate() {
            *v = (i as f32 - 128.0) * 0.5;
        }
        let mut want = KActs::default();
        want.resize(1, cols);
        quantize_rows_body(
            &x,
            KActsOut { qs: &mut want.qs, d: &mut want.d, bs16: &mut want.bs16, bs32: &mut want.bs32 },
        );
        let mut got = KActs::default();
        got.quantize(&x, 1, cols);
        assert_eq!(got.qs, want.qs);
        assert_eq!(
            got.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(got.bs16, want.bs16);
        assert_eq!(got.bs32, want.bs32);
    }

    #[test]
    fn the_activation_quantizer_equals_the_gguf_q8_k_definition() {
        let cols = 1024;
        let x = random_x(3 * cols, 5);
        let mut a = KActs::default();
        a.quantize(&x, 3, cols);
        let mut want = vec![0u8; GgmlType::Q8_K.row_bytes(cols).expect("test data fits")];
        for t in 0..3 {
            quant::quantize_row(GgmlType::Q8_K, &x[t * cols..(t + 1) * cols], &mut want).expect("test data fits");
            for b in 0..cols / SB {
                let blk = &want[b * 292..(b + 1) * 292];
                assert_eq!(
                    a.d[t * 4 + b].to_bits(),
                    f32::from_le_bytes(blk[0..4].try_into().expect("test data fits")).to_bits()
                );
                for i in 0..SB {
                    assert_eq!(a.qs[(t * 4 + b) * SB + i], blk[4 + i] as i8);
                }
                for g in 0..16 {
                    assert_eq!(a.bs16[(t * 4 + b) * 16 + g], i16::from_le_bytes([blk[260 + 2 * g], blk[261 + 2 * g]]));
                }
            }
        }
    }

    /// The reference against the GGUF dot product (`quant::vec_dot`, another order of the same
    /// integers): float rounding only.
    #[test]
    fn the_reference_agrees_with_the_gguf_dot_product() {
        const REL_TOL: f32 = 1e-4;
        for k in KINDS {
            let (rows, cols, n) = (16, 768, 2);
            let raw = random_rows(k, rows, cols, 11 + k as u64);
            let p = pack(k, &raw, rows, cols);
            let x = random_x(n * cols, 3);
            let mut a = KActs::default();
            a.quantize(&x, n, cols);
            let mut out = vec![0f32; n * TILE_ROWS];
            reference(&p, 0, &a, 0, n, &mut out);
            let rb = k.ggml().row_bytes(cols).expect("test data fits");
            let mut q8 = vec![0u8; GgmlType::Q8_K.row_bytes(cols).expect("test data fits")];
            for t in 0..n {
                quant::quantize_row(GgmlType::Q8_K, &x[t * cols..(t + 1) * cols], &mut q8).expect("test data fits");
                for r in 0..rows {
                    let want = quant::vec_dot(k.ggml(), cols, &raw[r * rb..(r + 1) * rb], &q8).expect("test data fits");
                    let got = out[t * TILE_ROWS + r];
                    assert!((got - want).abs() <= REL_TOL * want.abs().max(1.0), "{k:?} t{t} r{r}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn every_kernel_equals_the_scalar_reference_bit_for_bit() {
        for kernel in Kernel::available() {
            for k in KINDS {
                // 37 rows: two whole tiles and a partial one; 80 tokens: groups of 4, a
                // remainder, the buffered path of prompt chunks (8 tokens or more), and with
                // AMX its blocks of 16 tokens in spans of 64, the rest of a span on VNNI.
                let (rows, cols, n) = (37, 512, 80);
                let raw = random_rows(k, rows, cols, 100 + k as u64);
                let p = pack(k, &raw, rows, cols);
                let x = random_x(n * cols, 9);
                let mut a = KActs::default();
                a.quantize(&x, n, cols);
                for tile in 0..p.tiles() {
                    for (t0, nt) in [(0, n), (1, 1), (2, 3), (0, 4), (3, 9), (5, 2), (7, 16), (4, 35), (9, 70)] {
                        let mut want = vec![0f32; nt * TILE_ROWS];
                        reference(&p, tile, &a, t0, nt, &mut want);
                        let mut got = vec![0f32; nt * TILE_ROWS];
                        run(kernel, &p, tile, &a, t0, nt, &mut got);
                        for i in 0..nt * TILE_ROWS {
                            assert_eq!(
                                got[i].to_bits(),
                                want[i].to_bits(),
                                "{} {k:?} tile {tile} t0 {t0} nt {nt} [{i}]: {} vs {}",
                                kernel.name(),
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn results_stored_into_token_rows_equal_the_reference() {
        for kernel in Kernel::available() {
            for k in KINDS {
                let (rows, cols, n) = (37, 256, 21);
                let raw = random_rows(k, rows, cols, 300 + k as u64);
                let p = pack(k, &raw, rows, cols);
                let x = random_x(n * cols, 13);
                let mut a = KActs::default();
                a.quantize(&x, n, cols);
                for (t0, nt) in [(0, n), (2, 1), (1, 9), (3, 18)] {
                    // Each token's row holds all 37 outputs after 3 values of padding.
                    let mut out = vec![vec![f32::NAN; 3 + rows]; nt];
                    let mut scratch = Vec::new();
                    for tile in 0..p.tiles() {
                        let mut dst: Vec<&mut [f32]> = out.iter_mut().map(|r| &mut r[..]).collect();
                        run_rows(kernel, &p, tile, &a, t0, &mut dst, 3 + tile * TILE_ROWS, &mut scratch);
                    }
                    for tile in 0..p.tiles() {
                        let mut want = vec![0f32; nt * TILE_ROWS];
                        reference(&p, tile, &a, t0, nt, &mut want);
                        for (j, row) in out.iter().enumerate() {
                            for lane in 0..(rows - tile * TILE_ROWS).min(TILE_ROWS) {
                                let got = row[3 + tile * TILE_ROWS + lane];
                                let w = want[j * TILE_ROWS + lane];
                                assert_eq!(
                                    got.to_bits(),
                                    w.to_bits(),
                                    "{} {k:?} t0 {t0} token {j}: {got} vs {w}",
                                    kernel.name()
                                );
                            }
                        }
                    }
                    assert!(out.iter().all(|r| r[..3].iter().all(|v| v.is_nan())), "padding untouched");
                }
            }
        }
    }

    #[test]
    fn packing_refuses_partial_super_blocks() {
        assert!(KPackedMatrix::pack_in(None, KKind::Q4K, 16, 128, |_, _| Ok(())).is_err());
    }
}
