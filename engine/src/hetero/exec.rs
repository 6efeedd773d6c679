//! The processors behind a partitioned matmul ([`super::partition::PieceRunner`]): the CPU's
//! own kernels over a row range of a weight, the OpenCL GPU over a row range loaded onto it,
//! and the NPU's fp16 `FullyConnected` graphs (HeteroLLM's placement: float compute, no
//! activation quantization), which `crate::backend::npu::f16` builds and runs.

use super::partition::{Piece, PieceRunner, Started};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::GpuDevice;
pub use crate::backend::npu::f16::{f16_graph_name, NpuF16Runner};
use crate::backend::weight::WeightMatrix;
use crate::backend::Backend;
use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Device, Event, Executable, HostWeight, Subgraph, Weight, WeightRole,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

fn piece_x<'x>(piece: &Piece, x: &'x [f32], k: usize) -> Result<&'x [f32], String> {
    x.get(piece.tokens.start * k..piece.tokens.end * k)
        .ok_or_else(|| format!("tokens {:?} past the input", piece.tokens))
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

/// The OpenCL GPU over row ranges of one matrix through the device contract: each row range
/// loaded once ([`Device::load_weight`]), each piece a [`Subgraph::linear`] prepared once per
/// (tokens, rows) with its input and output buffers (kept and reused: no buffer is made per
/// call), submitted to the GPU's queue ([`PieceRunner::start`]) and read back when the caller
/// has run the NPU's pieces.
pub struct GpuRunner<'a> {
    pub gpu: &'a GpuDevice,
    pub w: &'a WeightMatrix,
    role: WeightRole,
    shape: BlockShape,
    loaded: Mutex<HashMap<(usize, usize), Weight>>,
    /// Idle slots per (tokens, first row, end row): taken by a started piece, given back when
    /// it finishes (a pass may run two pieces of one shape at once).
    slots: Mutex<HashMap<(usize, usize, usize), Vec<Slot>>>,
    /// The token counts whose slots are kept (a plan's sizes); None: every count's. A piece of
    /// another count (the tokens a composed pass leaves over, any number below the smallest
    /// size) gets buffers for its run only, so a long-lived plan does not keep one set per
    /// prompt length it ever met.
    keep: Option<Vec<usize>>,
}

/// One piece shape's executable and buffers on the GPU.
struct Slot {
    key: (usize, usize, usize),
    exe: Executable,
    /// Its input (`x`) and output (`y`) buffers, bound once.
    bind: Bindings,
    y: Buffer,
}

impl<'a> GpuRunner<'a> {
    /// `w` (the weight of `role` in a model of `shape`) on `gpu`.
    pub fn new(gpu: &'a GpuDevice, w: &'a WeightMatrix, role: WeightRole, shape: BlockShape) -> Self {
        Self { gpu, w, role, shape, loaded: Mutex::new(HashMap::new()), slots: Mutex::new(HashMap::new()), keep: None }
    }

    /// The token counts of the slots it keeps idle now.
    pub fn kept_counts(&self) -> Vec<usize> {
        let idle = self.slots.lock().map(|s| s.keys().map(|k| k.0).collect::<Vec<_>>()).unwrap_or_default();
        let mut v = idle;
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Keeps the slots of these token counts only (see [`GpuRunner`]'s `keep`).
    pub fn keeping(mut self, counts: impl IntoIterator<Item = usize>) -> Self {
        self.keep = Some(counts.into_iter().collect());
        self
    }

    fn weight(&self, rows: &Range<usize>) -> Result<Weight, String> {
        let mut loaded = self.loaded.lock().map_err(|_| "poisoned")?;
        if let Some(w) = loaded.get(&(rows.start, rows.end)) {
            return Ok(w.clone());
        }
        let data = self.w.source_bytes().ok_or_else(|| format!("{}: rows not in memory", self.w.name))?;
        let hw = HostWeight { role: self.role, ty: self.w.ty, rows: self.w.rows, cols: self.w.cols, data, host: None };
        let w = self.gpu.load_weight(&hw, rows.clone()).map_err(|e| e.to_string())?;
        loaded.insert((rows.start, rows.end), w.clone());
        Ok(w)
    }

    /// An idle slot for `m` tokens over `rows`, made on first use.
    fn slot(&self, m: usize, rows: &Range<usize>) -> Result<Slot, String> {
        let key = (m, rows.start, rows.end);
        if let Some(s) = self.slots.lock().map_err(|_| "poisoned")?.get_mut(&key).and_then(Vec::pop) {
            return Ok(s);
        }
        let e = |e: llmd_device::DeviceError| e.to_string();
        let weight = self.weight(rows)?;
        // A projection's layer does not matter to the GPU: its weight is bound here.
        let exe = self.gpu.prepare(Subgraph::linear(0, self.role), &self.shape, m, &[weight]).map_err(e)?;
        let x = self.gpu.alloc(BufferUsage::Activations, m * self.w.cols * 4).map_err(e)?;
        let y = self.gpu.alloc(BufferUsage::Activations, m * rows.len() * 4).map_err(e)?;
        let zeros: std::sync::Arc<[u32]> = vec![0u32; m].into();
        let bind = Bindings {
            x,
            tokens: zeros.clone(),
            positions: zeros,
            seqs: std::sync::Arc::new([]),
            logit_rows: std::sync::Arc::new([]),
            logits: None,
            y: Some(y.clone()),
        };
        Ok(Slot { key, exe, bind, y })
    }

    fn give_back(&self, slots: Vec<Slot>) {
        if let Ok(mut idle) = self.slots.lock() {
            for s in slots {
                if self.keep.as_ref().is_none_or(|k| k.contains(&s.key.0)) {
                    idle.entry(s.key).or_default().push(s);
                }
            }
        }
    }
}

/// GPU pieces in flight: each one's slot and the event its submission signals.
struct GpuStarted<'r, 'a> {
    runner: &'r GpuRunner<'a>,
    work: Vec<(Slot, Event)>,
}

impl Started for GpuStarted<'_, '_> {
    fn done(&self) -> bool {
        self.work.iter().all(|(_, ev)| ev.state().is_some())
    }

    fn finish(mut self: Box<Self>, outs: &mut [&mut Vec<&mut [f32]>]) -> Result<(), String> {
        let work = std::mem::take(&mut self.work);
        let mut r = Ok(());
        if work.len() != outs.len() {
            r = Err(format!("{} GPU pieces, {} outputs", work.len(), outs.len()));
        }
        let mut raw = Vec::new();
        for ((slot, ev), out) in work.iter().zip(outs.iter_mut()) {
            if r.is_err() {
                break;
            }
            let w = slot.key.2 - slot.key.1;
            raw.resize(out.len() * w * 4, 0u8);
            r = self.runner.gpu.read(&slot.y, 0, &mut raw, std::slice::from_ref(ev)).map_err(|e| e.to_string());
            for (o, row) in out.iter_mut().zip(raw.chunks_exact(w * 4)) {
                for (v, c) in o.iter_mut().zip(row.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
        // A slot goes back once its work is done (an error leaves the queue's later work to
        // finish first: wait for it).
        for (_, ev) in &work {
            let _ = ev.wait();
        }
        self.runner.give_back(work.into_iter().map(|(s, _)| s).collect());
        r
    }
}

impl Drop for GpuStarted<'_, '_> {
    fn drop(&mut self) {
        // Not finished (the caller failed first): the slots' buffers are still the GPU's
        // until their work is done.
        let work = std::mem::take(&mut self.work);
        for (_, ev) in &work {
            let _ = ev.wait();
        }
        self.runner.give_back(work.into_iter().map(|(s, _)| s).collect());
    }
}

impl PieceRunner for GpuRunner<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let Some(started) = self.start(&[piece], x)? else { return Err("the GPU did not start".into()) };
        let mut views: Vec<&mut [f32]> = out.iter_mut().map(|o| &mut **o).collect();
        started.finish(&mut [&mut views])
    }

    fn start(&self, pieces: &[&Piece], x: &[f32]) -> Result<Option<Box<dyn Started + '_>>, String> {
        let mut started = Box::new(GpuStarted { runner: self, work: Vec::with_capacity(pieces.len()) });
        for piece in pieces {
            let xs = piece_x(piece, x, self.w.cols)?;
            let slot = self.slot(piece.tokens.len(), &piece.rows)?;
            let e = |e: llmd_device::DeviceError| e.to_string();
            let r = self
                .gpu
                .write(&slot.bind.x, 0, &crate::backend::f32_bytes(xs), &[])
                .map_err(e)
                .and_then(|_| self.gpu.submit(&slot.exe, &slot.bind, &[]).map_err(e));
            match r {
                Ok(ev) => started.work.push((slot, ev)),
                Err(err) => {
                    self.give_back(vec![slot]);
                    return Err(err);
                }
            }
        }
        Ok(Some(started))
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

impl PieceRunner for NpuF16Runner {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let m = piece.graph.unwrap_or(piece.tokens.len());
        let xs = piece_x(piece, x, self.k)?;
        self.run_rows(m, &piece.rows, xs, out)
    }
}
