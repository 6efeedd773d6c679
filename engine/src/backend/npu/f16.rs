//! HeteroLLM's NPU half of a partitioned matmul: fp16 `FullyConnected` graphs (float compute,
//! no activation quantization) over row ranges of one matrix, through QNN — Qualcomm's library
//! or the emulator provider.
//!
//! The graphs are static: one per (token count, row range), built before the run (a QNN
//! context is used from the thread that owns it; graphs can run from any). Its input is the
//! piece's tokens in f16, padded with zeros to the graph's token count; its weight the matrix's
//! rows dequantized to f16 (W4A16 / W8A16: the file's blocks expanded once, when the graph is
//! built); its output f16, read back as f32. The engine's partitioned matmul
//! (`crate::hetero::exec`) runs its pieces here.

use super::device::NpuContext;
use crate::error::NpuError;
use qnn_sys::api::{Graph, Quantization, TensorSpec};
use qnn_sys::data_type as dt;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

/// The NPU's fp16 graphs for one matrix: one per (token count, row range), built up front,
/// each with its input and output buffers (allocated once, reused by every run: the slots a
/// phone would map into both the NPU and the GPU).
pub struct NpuF16Runner {
    pub name: String,
    pub k: usize,
    graphs: HashMap<(usize, usize, usize), Mutex<NpuGraph>>,
}

struct NpuGraph {
    graph: Graph,
    x: Vec<u8>,
    y: Vec<u8>,
}

/// The name of the fp16 graph of `name` at `m` tokens over `rows`.
pub fn f16_graph_name(name: &str, m: usize, rows: &Range<usize>) -> String {
    format!("{name}_f16_m{m}_r{}_{}", rows.start, rows.end)
}

/// `shapes` without repeats or empty ones, in their first order (the order graphs are built,
/// cached and retrieved in).
fn unique_shapes(shapes: impl IntoIterator<Item = (usize, Range<usize>)>) -> Vec<(usize, Range<usize>)> {
    let mut seen = std::collections::HashSet::new();
    shapes.into_iter().filter(|(m, r)| *m > 0 && !r.is_empty() && seen.insert((*m, r.start, r.end))).collect()
}

/// The input and output of the graph `y[m, rows] = x[m, k] · w[rows, k]ᵀ`.
fn f16_io(m: usize, k: usize, rows: &Range<usize>) -> (TensorSpec, TensorSpec) {
    (
        TensorSpec::new("x", &[m as u32, k as u32], dt::FLOAT_16, Quantization::None),
        TensorSpec::new("y", &[m as u32, rows.len() as u32], dt::FLOAT_16, Quantization::None),
    )
}

/// Builds and finalizes one fp16 graph of `name` at `m` tokens over `rows` of `w16`.
pub(crate) fn build_f16(
    context: &NpuContext,
    name: &str,
    w16: &[u16],
    k: usize,
    m: usize,
    rows: &Range<usize>,
) -> Result<Graph, NpuError> {
    let n = w16.len().checked_div(k).unwrap_or(0);
    let gname = f16_graph_name(name, m, rows);
    if rows.end > n || u32::try_from(m).is_err() || u32::try_from(k).is_err() {
        return Err(NpuError::Shape { graph: gname, detail: format!("rows {rows:?} of {n}, {m} tokens") });
    }
    let mut g = context.0.graph(&gname)?;
    let (xs, ys) = f16_io(m, k, rows);
    let x = g.input(&xs)?;
    let wb: Vec<u8> = w16[rows.start * k..rows.end * k].iter().flat_map(|v| v.to_le_bytes()).collect();
    let w = g.constant(&TensorSpec::new("w", &[rows.len() as u32, k as u32], dt::FLOAT_16, Quantization::None), &wb)?;
    let y = g.output(&ys)?;
    g.node("fc", "FullyConnected", &[x, w], &[y], &[])?;
    Ok(g.finalize()?)
}

impl NpuF16Runner {
    /// Builds and finalizes, in `context`, a graph `y[m, rows] = x[m, k] · w[rows, k]ᵀ` for each
    /// `(m, rows)` in `shapes`, from `w16` (`n × k` f16 values).
    pub fn build(
        context: &NpuContext,
        name: &str,
        w16: &[u16],
        k: usize,
        shapes: impl IntoIterator<Item = (usize, Range<usize>)>,
    ) -> Result<Self, NpuError> {
        let mut graphs = HashMap::new();
        for (m, rows) in unique_shapes(shapes) {
            let graph = build_f16(context, name, w16, k, m, &rows)?;
            let (x, y) = (vec![0u8; m * k * 2], vec![0u8; m * rows.len() * 2]);
            graphs.insert((m, rows.start, rows.end), Mutex::new(NpuGraph { graph, x, y }));
        }
        Ok(Self { name: name.to_owned(), k, graphs })
    }

    /// Builds and finalizes the same graphs as [`Self::build`] in `context` and returns each
    /// one's tensor ids (input, outputs) in `shapes`' order without repeats — what a cached
    /// context records to retrieve them by ([`Self::retrieve`]).
    pub fn build_ids(
        context: &NpuContext,
        name: &str,
        w16: &[u16],
        k: usize,
        shapes: impl IntoIterator<Item = (usize, Range<usize>)>,
    ) -> Result<Vec<(u32, Vec<u32>)>, NpuError> {
        unique_shapes(shapes)
            .into_iter()
            .map(|(m, rows)| {
                let io = build_f16(context, name, w16, k, m, &rows)?.io();
                Ok((io.inputs.first().map_or(0, |i| i.1), io.outputs.iter().map(|o| o.1).collect()))
            })
            .collect()
    }

    /// The graphs [`Self::build_ids`] built for `shapes`, retrieved from `context` (built in
    /// this process or loaded from a context binary) by their tensor ids `ids`.
    pub fn retrieve(
        context: &NpuContext,
        name: &str,
        k: usize,
        shapes: impl IntoIterator<Item = (usize, Range<usize>)>,
        ids: &[(u32, Vec<u32>)],
    ) -> Result<Self, NpuError> {
        let shapes = unique_shapes(shapes);
        if shapes.len() != ids.len() {
            return Err(NpuError::Shape {
                graph: name.to_owned(),
                detail: format!("{} graph ids for {} graphs", ids.len(), shapes.len()),
            });
        }
        let mut graphs = HashMap::new();
        for ((m, rows), (input, outputs)) in shapes.into_iter().zip(ids) {
            let (xs, ys) = f16_io(m, k, &rows);
            let Some(&output) = outputs.first() else {
                return Err(NpuError::Shape { graph: f16_graph_name(name, m, &rows), detail: "no output id".into() });
            };
            let io = qnn_sys::api::GraphIo { inputs: vec![(xs, *input)], outputs: vec![(ys, output)] };
            let graph = context.0.retrieve(&f16_graph_name(name, m, &rows), &io)?;
            let (x, y) = (vec![0u8; m * k * 2], vec![0u8; m * rows.len() * 2]);
            graphs.insert((m, rows.start, rows.end), Mutex::new(NpuGraph { graph, x, y }));
        }
        Ok(Self { name: name.to_owned(), k, graphs })
    }

    pub fn graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Runs the graph of `m` tokens over `rows` on `xs` (at most `m` rows of `k` values) into
    /// `out` (one slice per token of `xs`, `rows.len()` values each).
    pub fn run_rows(&self, m: usize, rows: &Range<usize>, xs: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let key = (m, rows.start, rows.end);
        let g = self.graphs.get(&key).ok_or_else(|| format!("no NPU graph {}", f16_graph_name(&self.name, m, rows)))?;
        let mut slot = g.lock().map_err(|_| "poisoned")?;
        let NpuGraph { graph, x: xb, y: yb } = &mut *slot;
        let used = xs.len() * 2;
        if used > xb.len() {
            return Err(format!("{} tokens in a graph of {m}", xs.len() / self.k.max(1)));
        }
        for (d, &v) in xb[..used].chunks_exact_mut(2).zip(xs) {
            d.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
        xb[used..].fill(0);
        graph.execute(&[xb], &mut [yb]).map_err(|e| e.to_string())?;
        let w = rows.len();
        for (i, o) in out.iter_mut().enumerate() {
            for (j, v) in o.iter_mut().enumerate() {
                let at = 2 * (i * w + j);
                *v = half::f16::from_bits(u16::from_le_bytes([yb[at], yb[at + 1]])).to_f32();
            }
        }
        Ok(())
    }
}
