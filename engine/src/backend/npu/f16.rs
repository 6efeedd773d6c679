//! HeteroLLM's NPU half of a partitioned matmul: fp16 `FullyConnected` graphs (float compute,
//! no activation quantization) over row ranges of one matrix, through QNN — Qualcomm's library
//! or the emulator provider. The device contract's `QnnDevice` (`super::contract`) builds and
//! runs them; this is the graph itself.
//!
//! A graph is static: one per (token count, row range). Its input is the piece's tokens in
//! f16 (padded with zeros to the graph's token count by the caller); its weight the matrix's
//! rows dequantized to f16 (W4A16 / W8A16: the file's blocks expanded once, when the graph is
//! built); its output f16.

use super::device::NpuContext;
use crate::error::NpuError;
use qnn_sys::api::{Graph, Quantization, TensorSpec};
use qnn_sys::data_type as dt;
use std::ops::Range;

/// The input and output of the graph `y[m, rows] = x[m, k] · w[rows, k]ᵀ`.
pub(crate) fn f16_io(m: usize, k: usize, rows: &Range<usize>) -> (TensorSpec, TensorSpec) {
    (
        TensorSpec::new("x", &[m as u32, k as u32], dt::FLOAT_16, Quantization::None),
        TensorSpec::new("y", &[m as u32, rows.len() as u32], dt::FLOAT_16, Quantization::None),
    )
}

/// Builds and finalizes one fp16 graph, called `name`, at `m` tokens over `rows` of `w16`.
pub(crate) fn build_f16(
    context: &NpuContext,
    name: &str,
    w16: &[u16],
    k: usize,
    m: usize,
    rows: &Range<usize>,
) -> Result<Graph, NpuError> {
    let n = w16.len().checked_div(k).unwrap_or(0);
    if rows.end > n || u32::try_from(m).is_err() || u32::try_from(k).is_err() {
        return Err(NpuError::Shape { graph: name.to_owned(), detail: format!("rows {rows:?} of {n}, {m} tokens") });
    }
    let mut g = context.0.graph(name)?;
    let (xs, ys) = f16_io(m, k, rows);
    let x = g.input(&xs)?;
    let wb: Vec<u8> = w16[rows.start * k..rows.end * k].iter().flat_map(|v| v.to_le_bytes()).collect();
    let w = g.constant(&TensorSpec::new("w", &[rows.len() as u32, k as u32], dt::FLOAT_16, Quantization::None), &wb)?;
    let y = g.output(&ys)?;
    g.node("fc", "FullyConnected", &[x, w], &[y], &[])?;
    Ok(g.finalize()?)
}

/// A matrix's rows dequantized and rounded to f16 (bits), row-major: what a graph's weight
/// holds.
pub fn f16_rows(w: &crate::backend::weight::WeightMatrix, rows: Range<usize>) -> Result<Vec<u16>, String> {
    let mut out = Vec::with_capacity(rows.len() * w.cols);
    let mut row = vec![0f32; w.cols];
    let mut buf = Vec::new();
    for r in rows {
        w.read_row(r, &mut buf).map_err(|e| format!("{}: row {r}: {e}", w.name))?;
        crate::quant::dequantize_row(w.ty, &buf, &mut row).map_err(|e| e.to_string())?;
        out.extend(row.iter().map(|&v| half::f16::from_f32(v).to_bits()));
    }
    Ok(out)
}
