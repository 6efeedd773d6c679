//! The processors behind a partitioned matmul ([`super::partition::PieceRunner`]): the CPU's
//! own kernels over a row range of a weight, the OpenCL GPU over a row range loaded onto it,
//! and the NPU's fp16 `FullyConnected` graphs (HeteroLLM's placement: float compute, no
//! activation quantization) through QNN — Qualcomm's library or the emulator provider.
//!
//! The NPU's graphs are static: one per (token count, row range), built before the run (a QNN
//! context is used from the thread that owns it; graphs can run from any). Its input is the
//! piece's tokens in f16, padded with zeros to the graph's token count; its weight the matrix's
//! rows dequantized to f16 (W4A16 / W8A16: the file's blocks expanded once, when the graph is
//! built); its output f16, read back as f32.

use super::partition::{Piece, PieceRunner};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{check, GpuDevice};
use crate::backend::weight::WeightMatrix;
use crate::backend::Backend;
use crate::error::NpuError;
use llmd_device::{Device, HostWeight, Weight, WeightRole};
use qnn_sys::api::{Context, Graph, Quantization, TensorSpec};
use qnn_sys::data_type as dt;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

fn piece_x<'x>(piece: &Piece, x: &'x [f32], k: usize) -> Result<&'x [f32], String> {
    x.get(piece.tokens.start * k..piece.tokens.end * k)
        .ok_or_else(|| format!("tokens {:?} past the input", piece.tokens))
}

fn place(tmp: &[f32], out: &mut [&mut [f32]]) {
    let w = out.first().map_or(0, |o| o.len());
    for (o, t) in out.iter_mut().zip(tmp.chunks_exact(w.max(1))) {
        o.copy_from_slice(t);
    }
}

/// A row range of `w` as a matrix of its own (the file's rows: each row is whole blocks).
pub fn row_slice(w: &WeightMatrix, rows: Range<usize>) -> Result<WeightMatrix, String> {
    let rb = w.row_bytes();
    let bytes = w.source_bytes().ok_or_else(|| format!("{}: rows not in memory", w.name))?;
    let data = bytes.get(rows.start * rb..rows.end * rb).ok_or_else(|| format!("{}: rows {rows:?}", w.name))?;
    WeightMatrix::from_host_bytes(
        &format!("{}[{}..{}]", w.name, rows.start, rows.end),
        w.ty,
        rows.len(),
        w.cols,
        data.to_vec(),
    )
    .ok_or_else(|| format!("{}: rows {rows:?} do not form a matrix", w.name))
}

/// The CPU's kernels (packed where the type has tiles) over row ranges of one matrix.
pub struct CpuRunner<'a> {
    pub cpu: &'a CpuBackend,
    pub w: &'a WeightMatrix,
    slices: Mutex<HashMap<(usize, usize), std::sync::Arc<WeightMatrix>>>,
}

impl<'a> CpuRunner<'a> {
    pub fn new(cpu: &'a CpuBackend, w: &'a WeightMatrix) -> Self {
        Self { cpu, w, slices: Mutex::new(HashMap::new()) }
    }
}

impl PieceRunner for CpuRunner<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let xs = piece_x(piece, x, self.w.cols)?;
        let key = (piece.rows.start, piece.rows.end);
        let w = if key == (0, self.w.rows) {
            None
        } else {
            let mut s = self.slices.lock().map_err(|_| "poisoned")?;
            Some(match s.get(&key) {
                Some(w) => w.clone(),
                None => {
                    let w = std::sync::Arc::new(row_slice(self.w, piece.rows.clone())?);
                    s.insert(key, w.clone());
                    w
                }
            })
        };
        self.cpu.matmul_rows(w.as_deref().unwrap_or(self.w), xs, out).map_err(|e| e.to_string())
    }
}

/// The OpenCL GPU over row ranges of one matrix, each loaded once.
pub struct GpuRunner<'a> {
    pub gpu: &'a GpuDevice,
    pub w: &'a WeightMatrix,
    loaded: Mutex<HashMap<(usize, usize), Weight>>,
}

impl<'a> GpuRunner<'a> {
    pub fn new(gpu: &'a GpuDevice, w: &'a WeightMatrix) -> Self {
        Self { gpu, w, loaded: Mutex::new(HashMap::new()) }
    }
}

impl PieceRunner for GpuRunner<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let xs = piece_x(piece, x, self.w.cols)?;
        let key = (piece.rows.start, piece.rows.end);
        let mut loaded = self.loaded.lock().map_err(|_| "poisoned")?;
        if let std::collections::hash_map::Entry::Vacant(e) = loaded.entry(key) {
            let data = self.w.source_bytes().ok_or_else(|| format!("{}: rows not in memory", self.w.name))?;
            let hw = HostWeight {
                role: WeightRole::Up,
                ty: self.w.ty,
                rows: self.w.rows,
                cols: self.w.cols,
                data,
                host: None,
            };
            e.insert(self.gpu.load_weight(&hw, piece.rows.clone()).map_err(|e| e.to_string())?);
        }
        let wt = loaded.get(&key).ok_or("weight")?;
        let mut tmp = vec![0f32; piece.tokens.len() * piece.rows.len()];
        check::matmul_loaded(self.gpu, wt, xs, piece.tokens.len(), &mut tmp).map_err(|e| e.to_string())?;
        place(&tmp, out);
        Ok(())
    }
}

/// A matrix's rows dequantized and rounded to f16 (bits), row-major.
pub fn f16_rows(w: &WeightMatrix, rows: Range<usize>) -> Result<Vec<u16>, String> {
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

/// The NPU's fp16 graphs for one matrix: one per (token count, row range), built up front,
/// each with its input and output buffers (allocated once, reused by every run: the slots a
/// phone would map into both the NPU and the GPU).
pub struct NpuF16Runner<'c> {
    pub name: String,
    pub k: usize,
    graphs: HashMap<(usize, usize, usize), Mutex<NpuGraph<'c>>>,
}

struct NpuGraph<'c> {
    graph: Graph<'c>,
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
fn build_f16<'c>(
    context: &'c Context<'_>,
    name: &str,
    w16: &[u16],
    k: usize,
    m: usize,
    rows: &Range<usize>,
) -> Result<Graph<'c>, NpuError> {
    let n = w16.len().checked_div(k).unwrap_or(0);
    let gname = f16_graph_name(name, m, rows);
    if rows.end > n || u32::try_from(m).is_err() || u32::try_from(k).is_err() {
        return Err(NpuError::Shape { graph: gname, detail: format!("rows {rows:?} of {n}, {m} tokens") });
    }
    let mut g = context.graph(&gname)?;
    let (xs, ys) = f16_io(m, k, rows);
    let x = g.input(&xs)?;
    let wb: Vec<u8> = w16[rows.start * k..rows.end * k].iter().flat_map(|v| v.to_le_bytes()).collect();
    let w = g.constant(&TensorSpec::new("w", &[rows.len() as u32, k as u32], dt::FLOAT_16, Quantization::None), &wb)?;
    let y = g.output(&ys)?;
    g.node("fc", "FullyConnected", &[x, w], &[y], &[])?;
    Ok(g.finalize()?)
}

impl<'c> NpuF16Runner<'c> {
    /// Builds and finalizes, in `context`, a graph `y[m, rows] = x[m, k] · w[rows, k]ᵀ` for each
    /// `(m, rows)` in `shapes`, from `w16` (`n × k` f16 values).
    pub fn build(
        context: &'c Context<'_>,
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
        context: &Context<'_>,
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
        context: &'c Context<'_>,
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
            let graph = context.retrieve(&f16_graph_name(name, m, &rows), &io)?;
            let (x, y) = (vec![0u8; m * k * 2], vec![0u8; m * rows.len() * 2]);
            graphs.insert((m, rows.start, rows.end), Mutex::new(NpuGraph { graph, x, y }));
        }
        Ok(Self { name: name.to_owned(), k, graphs })
    }

    pub fn graphs(&self) -> usize {
        self.graphs.len()
    }
}

impl PieceRunner for NpuF16Runner<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let m = piece.graph.unwrap_or(piece.tokens.len());
        let key = (m, piece.rows.start, piece.rows.end);
        let g = self
            .graphs
            .get(&key)
            .ok_or_else(|| format!("no NPU graph {}", f16_graph_name(&self.name, m, &piece.rows)))?;
        let xs = piece_x(piece, x, self.k)?;
        let mut slot = g.lock().map_err(|_| "poisoned")?;
        let NpuGraph { graph, x: xb, y: yb } = &mut *slot;
        let used = xs.len() * 2;
        if used > xb.len() {
            return Err(format!("{} tokens in a graph of {m}", piece.tokens.len()));
        }
        for (d, &v) in xb[..used].chunks_exact_mut(2).zip(xs) {
            d.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
        xb[used..].fill(0);
        graph.execute(&[xb], &mut [yb]).map_err(|e| e.to_string())?;
        let w = piece.rows.len();
        for (i, o) in out.iter_mut().enumerate() {
            for (j, v) in o.iter_mut().enumerate() {
                let at = 2 * (i * w + j);
                *v = half::f16::from_bits(u16::from_le_bytes([yb[at], yb[at + 1]])).to_f32();
            }
        }
        Ok(())
    }
}
