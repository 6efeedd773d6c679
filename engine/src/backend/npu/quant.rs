//! The NPU path's integer arithmetic, defined here once: how activations, weights and biases are
//! quantized (llm.npu's per-tensor W8A8), and the reference a linear layer on the NPU is held to.
//!
//! - **Activations**: uint8, asymmetric, one scale and zero point per tensor, from the range a
//!   calibration pass saw: `real = scale · (q − zero_point)`. (QNN writes the zero point negated,
//!   as its `offset`: [`ActQuant::qnn_offset`].)
//! - **Weights**: int8, symmetric (zero point 0, codes −127..=127), one scale per tensor —
//!   llm.npu's choice, which the HTP runs fastest — or one per output channel
//!   ([`WeightScales::PerChannel`], measured as an option).
//! - **Bias**: int32 at the scale `activation scale × weight scale`, zero point 0: added to the
//!   accumulator before requantization.
//! - **Output**: uint8 again (llm.npu's W8A8 end to end), or uint16 (`ActQuant::bits` 16), with
//!   the output's calibrated scale and zero point. The arithmetic is int8 either way; 16-bit
//!   outputs keep the precision the float operations after the graph (norms, attention) need,
//!   and make the HTP's one-code rounding differences 256 times smaller.
//!
//! [`linear_reference`] computes `y = round(((Σ (x − zx)·w) + b) · sx·sw / sy) + zy`, clamped to
//! the output's codes, with the sum exact (i64) and the requantization in f64 — ideal rounding of the exact
//! result. Qualcomm's HTP requantizes with fixed-point multipliers and may land one code away
//! (≤ 1 LSB, on a share of outputs that the tests bound); the emulator provider must equal this
//! reference bit for bit.

use crate::error::NpuError;

/// A 16-bit zero point Qualcomm's HTP library mishandles: a uint16 output with QNN offset −32768
/// comes out wrong by up to the whole range on layers of real size (seen with QAIRT 2.51's x86-64
/// HTP library at 32 × 576 by 64: 2,016 of 2,048 outputs wrong, while 32,767 and 32,769 are
/// within 1 LSB; `qnn-sys`'s test `a_16_bit_output_with_zero_point_32768_comes_out_wrong_on_the_htp`). A symmetric range would land
/// on it exactly, so [`ActQuant::from_range_bits`] moves it one code down and the graph builder
/// refuses it.
pub const HTP_BAD_ZERO_POINT_16: i32 = 32768;

/// An unsigned tensor's quantization: `real = scale · (q − zero_point)`, codes and
/// `zero_point` in `0..=max_code()` (8 or 16 `bits`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActQuant {
    pub scale: f32,
    pub zero_point: i32,
    pub bits: u8,
}

impl ActQuant {
    /// The 8-bit quantization covering `min..=max` (see [`Self::from_range_bits`]).
    pub fn from_range(min: f32, max: f32) -> Result<Self, NpuError> {
        Self::from_range_bits(min, max, 8)
    }

    /// The quantization of `bits` (8 or 16) covering `min..=max` (widened to hold 0, so that
    /// zero is exact — padding and ReLU-like zeros stay zeros), every code used.
    pub fn from_range_bits(min: f32, max: f32, bits: u8) -> Result<Self, NpuError> {
        if !(min.is_finite() && max.is_finite() && min <= max) {
            return Err(NpuError::Quantization(format!("activation range {min}..{max} is not a finite range")));
        }
        if bits != 8 && bits != 16 {
            return Err(NpuError::Quantization(format!("{bits}-bit activations (8 or 16)")));
        }
        let top = ((1u32 << bits) - 1) as f32;
        let (lo, hi) = (min.min(0.0), max.max(0.0));
        // A range of only zeros still needs a valid (positive, normal) scale.
        let scale = ((hi - lo) / top).max(f32::MIN_POSITIVE * 65536.0);
        let mut zero_point = (-lo / scale).round().clamp(0.0, top) as i32;
        if bits == 16 && zero_point == HTP_BAD_ZERO_POINT_16 {
            // Qualcomm's HTP computes wrong outputs at this zero point (see the constant): one
            // code lower moves the range up by one step.
            zero_point -= 1;
        }
        Ok(Self { scale, zero_point, bits })
    }

    /// The largest code.
    pub fn max_code(&self) -> i32 {
        (1i32 << self.bits) - 1
    }

    /// Bytes a code takes (little-endian).
    pub fn code_bytes(&self) -> usize {
        usize::from(self.bits / 8)
    }

    /// Codes from their little-endian bytes.
    pub fn codes(&self, bytes: &[u8]) -> Vec<u16> {
        if self.bits == 16 {
            bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
        } else {
            bytes.iter().map(|&b| u16::from(b)).collect()
        }
    }

    /// Real values of `codes`.
    pub fn dequantize_codes(&self, codes: &[u16], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(codes) {
            *o = self.scale * (i32::from(v) - self.zero_point) as f32;
        }
    }

    /// QNN's `offset` for this quantization (the negated zero point).
    pub fn qnn_offset(&self) -> i32 {
        -self.zero_point
    }

    /// `q = clamp(round(x / scale) + zero_point, 0, 255)` (rounding half away from zero): an
    /// 8-bit quantization's codes.
    pub fn quantize(&self, x: &[f32], out: &mut [u8]) {
        let inv = 1.0 / self.scale;
        for (q, &v) in out.iter_mut().zip(x) {
            *q = ((v * inv).round() + self.zero_point as f32).clamp(0.0, 255.0) as u8;
        }
    }

    pub fn dequantize(&self, q: &[u8], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(q) {
            *o = self.scale * (i32::from(v) - self.zero_point) as f32;
        }
    }
}

/// A weight matrix's scales: one for all of it, or one per output channel (row).
#[derive(Clone, Debug, PartialEq)]
pub enum WeightScales {
    PerTensor(f32),
    PerChannel(Vec<f32>),
}

impl WeightScales {
    /// The scale of output channel `o`.
    pub fn of(&self, o: usize) -> f32 {
        match self {
            Self::PerTensor(s) => *s,
            Self::PerChannel(v) => v[o],
        }
    }
}

/// An int8 weight matrix of `rows` output channels by `cols` inputs, row-major (QNN's
/// FullyConnected takes weights as `[out, in]`).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantWeights {
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<i8>,
    pub scales: WeightScales,
}

/// Largest weight code: the int8 range is used symmetrically (−127..=127), so that negating a
/// weight never overflows and the zero point is exactly 0.
pub const WEIGHT_MAX_CODE: f32 = 127.0;

impl QuantWeights {
    /// Quantizes `w` (`rows × cols`, row-major) with one scale (`per_channel` false) or one per row.
    pub fn quantize(w: &[f32], rows: usize, cols: usize, per_channel: bool) -> Result<Self, NpuError> {
        if rows.checked_mul(cols) != Some(w.len()) || rows == 0 || cols == 0 {
            return Err(NpuError::Quantization(format!("{} weights are not a {rows} × {cols} matrix", w.len())));
        }
        if let Some(bad) = w.iter().find(|v| !v.is_finite()) {
            return Err(NpuError::Quantization(format!("a weight is {bad}")));
        }
        let scale_of = |vals: &[f32]| {
            let amax = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax > 0.0 {
                amax / WEIGHT_MAX_CODE
            } else {
                1.0
            }
        };
        let scales = if per_channel {
            WeightScales::PerChannel(w.chunks_exact(cols).map(scale_of).collect())
        } else {
            WeightScales::PerTensor(scale_of(w))
        };
        let mut q = Vec::with_capacity(w.len());
        for (o, row) in w.chunks_exact(cols).enumerate() {
            let inv = 1.0 / scales.of(o);
            q.extend(row.iter().map(|&v| (v * inv).round().clamp(-WEIGHT_MAX_CODE, WEIGHT_MAX_CODE) as i8));
        }
        Ok(Self { rows, cols, q, scales })
    }
}

impl QuantWeights {
    /// Per-channel codes under one per-tensor scale: each output channel `o` quantized with its
    /// own scale `s_o = max|W[o,:]| / 127`, the NPU told the one scale `s = max_o s_o`, and the
    /// host multiplying output channel `o` by its gain `s_o / s` (≤ 1) when it dequantizes the
    /// NPU's outputs. The NPU's arithmetic stays per tensor (llm.npu's W8A8, which Qualcomm's
    /// HTP runs with 16-bit outputs: its native per-channel weights do not finalize with them),
    /// while the weights keep per-channel precision. Returns the weights and the gains.
    pub fn quantize_folded(w: &[f32], rows: usize, cols: usize) -> Result<(Self, Vec<f32>), NpuError> {
        let per = Self::quantize(w, rows, cols, true)?;
        let WeightScales::PerChannel(scales) = &per.scales else {
            return Err(NpuError::Quantization("per-channel scales expected".into()));
        };
        // A row of zeros has codes 0 whatever its scale (`quantize` gives it 1.0): it must not
        // set the graph's scale, and takes the graph's own (gain 1).
        let zero_row = |o: usize| w[o * cols..(o + 1) * cols].iter().all(|&v| v == 0.0);
        let top = (0..rows).filter(|&o| !zero_row(o)).map(|o| scales[o]).fold(0f32, f32::max);
        let top = if top > 0.0 { top } else { 1.0 };
        let gains = (0..rows).map(|o| if zero_row(o) { 1.0 } else { scales[o] / top }).collect();
        Ok((Self { rows, cols, q: per.q, scales: WeightScales::PerTensor(top) }, gains))
    }
}

/// A bias quantized for `x_scale` and `w`'s scales: `round(b / (sx · sw[o]))` as int32.
pub fn quantize_bias(b: &[f32], x_scale: f32, w: &QuantWeights) -> Result<Vec<i32>, NpuError> {
    if b.len() != w.rows {
        return Err(NpuError::Quantization(format!("{} biases for {} output channels", b.len(), w.rows)));
    }
    b.iter()
        .enumerate()
        .map(|(o, &v)| {
            let q = (f64::from(v) / (f64::from(x_scale) * f64::from(w.scales.of(o)))).round();
            if q.is_finite() && q.abs() <= f64::from(i32::MAX) {
                Ok(q as i32)
            } else {
                Err(NpuError::Quantization(format!("bias {v} of channel {o} does not fit int32 at its scale")))
            }
        })
        .collect()
}

/// The reference W8A8 linear layer: `m` rows of `x` (uint8, `x_q`) by `w`, plus `bias`, into the
/// codes of `y_q` — the exact integer sum, requantized in f64 and rounded half away from zero.
pub fn linear_reference(
    x: &[u8],
    x_q: ActQuant,
    w: &QuantWeights,
    bias: Option<&[i32]>,
    y_q: ActQuant,
    m: usize,
) -> Vec<u16> {
    let top = f64::from(y_q.max_code());
    let (k, n) = (w.cols, w.rows);
    assert_eq!(x.len(), m * k, "x is not {m} × {k}");
    let mut y = Vec::with_capacity(m * n);
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for o in 0..n {
            let wr = &w.q[o * k..(o + 1) * k];
            let acc: i64 =
                xr.iter().zip(wr).map(|(&a, &b)| (i64::from(a) - i64::from(x_q.zero_point)) * i64::from(b)).sum();
            let acc = acc + bias.map_or(0, |b| i64::from(b[o]));
            let real = acc as f64 * f64::from(x_q.scale) * f64::from(w.scales.of(o));
            let q = (real / f64::from(y_q.scale)).round() + f64::from(y_q.zero_point);
            y.push(q.clamp(0.0, top) as u16);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_activation_range_keeps_zero_exact_and_uses_every_code() {
        let q = ActQuant::from_range(-1.0, 3.0).expect("a range");
        let mut out = [0u8; 3];
        q.quantize(&[-1.0, 0.0, 3.0], &mut out);
        assert_eq!(out, [0, q.zero_point as u8, 255]);
        let mut back = [1.0f32; 1];
        q.dequantize(&[q.zero_point as u8], &mut back);
        assert_eq!(back[0], 0.0);
        // A range on one side of zero is widened to hold it.
        let pos = ActQuant::from_range(2.0, 5.0).expect("a range");
        assert_eq!(pos.zero_point, 0);
        assert!(ActQuant::from_range(f32::NAN, 1.0).is_err());
        assert!(ActQuant::from_range(0.0, 0.0).expect("zeros").scale > 0.0);
    }

    #[test]
    fn weights_use_the_symmetric_int8_range_per_tensor_or_per_channel() {
        let w = [0.5, -1.0, 0.25, 0.1, -0.05, 0.0];
        let t = QuantWeights::quantize(&w, 2, 3, false).expect("quantized");
        assert_eq!(t.q, vec![64, -127, 32, 13, -6, 0]);
        let c = QuantWeights::quantize(&w, 2, 3, true).expect("quantized");
        assert_eq!(c.q, vec![64, -127, 32, 127, -64, 0]);
        assert!(QuantWeights::quantize(&w, 4, 3, false).is_err());
        assert!(QuantWeights::quantize(&[f32::INFINITY], 1, 1, false).is_err());
    }

    #[test]
    fn folded_weights_keep_each_channels_scale_and_ignore_zero_rows() {
        let w = [0.5, -1.0, 0.0, 0.0, 0.1, -0.05];
        let (q, gains) = QuantWeights::quantize_folded(&w, 3, 2).expect("folded");
        assert_eq!(q.scales, WeightScales::PerTensor(1.0 / 127.0));
        assert_eq!(q.q, vec![64, -127, 0, 0, 127, -64]);
        assert_eq!(gains[1], 1.0, "a zero row takes the graph's scale");
        assert!((gains[2] - 0.1).abs() < 1e-6, "{gains:?}");
        // Code × graph scale × gain is each channel's own dequantization.
        let real = f32::from(q.q[4]) * (1.0 / 127.0) * gains[2];
        assert!((real - 0.1).abs() < 1e-6);
    }

    #[test]
    fn the_reference_matches_float_arithmetic_within_its_quantization_steps() {
        // 2 × 4 by 3 × 4: every output within one output step plus the inputs' rounding.
        let x = [0.3f32, -0.7, 1.1, 0.0, -0.2, 0.9, -1.3, 0.5];
        let w = [0.2f32, -0.1, 0.4, 0.05, -0.3, 0.25, 0.1, -0.2, 0.15, 0.15, -0.35, 0.3];
        let b = [0.1f32, -0.2, 0.05];
        let xq = ActQuant::from_range(-1.3, 1.1).expect("x");
        let wq = QuantWeights::quantize(&w, 3, 4, false).expect("w");
        let bq = quantize_bias(&b, xq.scale, &wq).expect("b");
        let yq = ActQuant::from_range(-1.0, 1.0).expect("y");
        let mut xs = [0u8; 8];
        xq.quantize(&x, &mut xs);
        let y = linear_reference(&xs, xq, &wq, Some(&bq), yq, 2);
        for r in 0..2 {
            for o in 0..3 {
                let exact: f32 = (0..4).map(|j| x[r * 4 + j] * w[o * 4 + j]).sum::<f32>() + b[o];
                let got = yq.scale * (i32::from(y[r * 3 + o]) - yq.zero_point) as f32;
                assert!((got - exact).abs() < 2.0 * yq.scale, "{got} vs {exact}");
            }
        }
        // 16-bit outputs: the same values, 257 times finer.
        let y16q = ActQuant::from_range_bits(-1.0, 1.0, 16).expect("y16");
        let y16 = linear_reference(&xs, xq, &wq, Some(&bq), y16q, 2);
        for (a, b) in y.iter().zip(&y16) {
            let (fa, fb) = (
                yq.scale * (i32::from(*a) - yq.zero_point) as f32,
                y16q.scale * (i32::from(*b) - y16q.zero_point) as f32,
            );
            assert!((fa - fb).abs() <= yq.scale * 0.51, "{fa} vs {fb}");
        }
    }
}
