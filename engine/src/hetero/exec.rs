//! The processors behind a partitioned matmul ([`super::partition::PieceRunner`]): the CPU's
//! own kernels over a row range of a weight, the OpenCL GPU over a row range loaded onto it,
//! and the NPU's fp16 `FullyConnected` graphs (HeteroLLM's placement: float compute, no
//! activation quantization), which `crate::backend::npu::f16` builds and runs.

use super::partition::{Piece, PieceRunner};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{check, GpuDevice};
pub use crate::backend::npu::f16::{f16_graph_name, NpuF16Runner};
use crate::backend::weight::WeightMatrix;
use crate::backend::Backend;
use llmd_device::{Device, HostWeight, Weight, WeightRole};
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

impl PieceRunner for NpuF16Runner<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let m = piece.graph.unwrap_or(piece.tokens.len());
        let xs = piece_x(piece, x, self.k)?;
        self.run_rows(m, &piece.rows, xs, out)
    }
}
