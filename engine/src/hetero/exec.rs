//! The processors behind a partitioned matmul ([`super::partition::PieceRunner`]): the CPU's
//! own kernels over a row range of a weight, and any device of the contract over a row range
//! loaded onto it ([`DeviceRunner`]): the OpenCL GPU, and the NPU (`QnnDevice`'s fp16
//! `FullyConnected` graphs: HeteroLLM's placement, float compute, no activation quantization).

use super::partition::{Piece, PieceRunner, Started};
use crate::backend::cpu::CpuBackend;
use crate::backend::weight::WeightMatrix;
use crate::backend::Backend;
use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Device, Event, Executable, HostWeight, Subgraph, Weight, WeightRole,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

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

/// A device of the contract over row ranges of one matrix: each row range loaded once
/// ([`Device::load_weight`]), each piece a [`Subgraph::linear`] prepared once per (tokens,
/// rows) — or handed in prepared ([`Self::with_executables`]: an NPU's graphs, built together)
/// — with its input and output buffers (kept and reused: no buffer is made per call),
/// submitted ([`PieceRunner::start`]: the GPU's queue runs it while the caller goes on; the
/// NPU runs it before `submit` returns) and read back when the caller has run the other
/// device's pieces. A device with static shapes runs a piece in its graph's token count
/// (`Piece::graph`), its input padded with zeros.
pub struct DeviceRunner<'a> {
    pub dev: Arc<dyn Device>,
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
    /// Executables per (tokens, first row, end row).
    exes: Mutex<HashMap<(usize, usize, usize), Executable>>,
}

/// One piece shape's executable and buffers on the device.
struct Slot {
    key: (usize, usize, usize),
    exe: Executable,
    /// Its input (`x`) and output (`y`) buffers, bound once.
    bind: Bindings,
    y: Buffer,
}

impl<'a> DeviceRunner<'a> {
    /// `w` (the weight of `role` in a model of `shape`) on `dev`.
    pub fn new(dev: Arc<dyn Device>, w: &'a WeightMatrix, role: WeightRole, shape: BlockShape) -> Self {
        Self {
            dev,
            w,
            role,
            shape,
            loaded: Mutex::new(HashMap::new()),
            slots: Mutex::new(HashMap::new()),
            keep: None,
            exes: Mutex::new(HashMap::new()),
        }
    }

    /// The runner with these executables, prepared elsewhere, for (tokens, rows).
    pub fn with_executables(self, exes: impl IntoIterator<Item = ((usize, Range<usize>), Executable)>) -> Self {
        if let Ok(mut e) = self.exes.lock() {
            e.extend(exes.into_iter().map(|((m, r), x)| ((m, r.start, r.end), x)));
        }
        self
    }

    /// Rows `rows` loaded on its device (kept for later pieces until [`Self::forget_weights`]).
    pub fn weight(&self, rows: &Range<usize>) -> Result<Weight, String> {
        let mut loaded = self.loaded.lock().map_err(|_| "poisoned")?;
        if let Some(w) = loaded.get(&(rows.start, rows.end)) {
            return Ok(w.clone());
        }
        let data = self.w.source_bytes().ok_or_else(|| format!("{}: rows not in memory", self.w.name))?;
        let hw = HostWeight { role: self.role, ty: self.w.ty, rows: self.w.rows, cols: self.w.cols, data, host: None };
        let w = self.dev.load_weight(&hw, rows.clone()).map_err(|e| e.to_string())?;
        loaded.insert((rows.start, rows.end), w.clone());
        Ok(w)
    }

    /// Drops the loaded weights it keeps (an NPU's graphs hold their own copy).
    pub fn forget_weights(&self) {
        if let Ok(mut l) = self.loaded.lock() {
            l.clear();
        }
    }

    /// Executables it holds.
    pub fn executables(&self) -> usize {
        self.exes.lock().map(|e| e.len()).unwrap_or(0)
    }

    /// The token count a piece runs in on its device: its graph's on a device with static
    /// shapes, its own elsewhere.
    fn tokens_for(&self, piece: &Piece) -> usize {
        match self.dev.desc().static_shapes {
            llmd_device::StaticShapes::Only(_) => piece.graph.unwrap_or(piece.tokens.len()).max(piece.tokens.len()),
            llmd_device::StaticShapes::Any => piece.tokens.len(),
        }
    }

    /// The token counts of the slots it keeps idle now.
    pub fn kept_counts(&self) -> Vec<usize> {
        let idle = self.slots.lock().map(|s| s.keys().map(|k| k.0).collect::<Vec<_>>()).unwrap_or_default();
        let mut v = idle;
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Keeps the slots of these token counts only (see [`DeviceRunner`]'s `keep`).
    pub fn keeping(mut self, counts: impl IntoIterator<Item = usize>) -> Self {
        self.keep = Some(counts.into_iter().collect());
        self
    }

    /// An idle slot for `m` tokens over `rows`, made on first use.
    fn slot(&self, m: usize, rows: &Range<usize>) -> Result<Slot, String> {
        let key = (m, rows.start, rows.end);
        if let Some(s) = self.slots.lock().map_err(|_| "poisoned")?.get_mut(&key).and_then(Vec::pop) {
            return Ok(s);
        }
        let e = |e: llmd_device::DeviceError| e.to_string();
        let known = self.exes.lock().map_err(|_| "poisoned")?.get(&key).cloned();
        let exe = match known {
            Some(x) => x,
            None => {
                let weight = self.weight(rows)?;
                // A projection's layer does not matter to a device: its weight is bound here.
                let exe = self.dev.prepare(Subgraph::linear(0, self.role), &self.shape, m, &[weight]).map_err(e)?;
                if self.keep.as_ref().is_none_or(|k| k.contains(&m)) {
                    self.exes.lock().map_err(|_| "poisoned")?.insert(key, exe.clone());
                }
                exe
            }
        };
        let x = self.dev.alloc(BufferUsage::Activations, m * self.w.cols * 4).map_err(e)?;
        let y = self.dev.alloc(BufferUsage::Activations, m * rows.len() * 4).map_err(e)?;
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

/// Pieces in flight on a device: each one's slot and the event its submission signals.
struct DeviceStarted<'r, 'a> {
    runner: &'r DeviceRunner<'a>,
    work: Vec<(Slot, Event)>,
}

impl Started for DeviceStarted<'_, '_> {
    fn done(&self) -> bool {
        self.work.iter().all(|(_, ev)| ev.state().is_some())
    }

    fn finish(mut self: Box<Self>, outs: &mut [&mut Vec<&mut [f32]>]) -> Result<(), String> {
        let work = std::mem::take(&mut self.work);
        let mut r = Ok(());
        if work.len() != outs.len() {
            r = Err(format!("{} pieces on {}, {} outputs", work.len(), self.runner.dev.desc().name, outs.len()));
        }
        let mut raw = Vec::new();
        for ((slot, ev), out) in work.iter().zip(outs.iter_mut()) {
            if r.is_err() {
                break;
            }
            let w = slot.key.2 - slot.key.1;
            raw.resize(out.len() * w * 4, 0u8);
            r = self.runner.dev.read(&slot.y, 0, &mut raw, std::slice::from_ref(ev)).map_err(|e| e.to_string());
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

impl Drop for DeviceStarted<'_, '_> {
    fn drop(&mut self) {
        // Not finished (the caller failed first): the slots' buffers are still the device's
        // until their work is done.
        let work = std::mem::take(&mut self.work);
        for (_, ev) in &work {
            let _ = ev.wait();
        }
        self.runner.give_back(work.into_iter().map(|(s, _)| s).collect());
    }
}

impl PieceRunner for DeviceRunner<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        let Some(started) = self.start(&[piece], x)? else {
            return Err(format!("{} did not start", self.dev.desc().name));
        };
        let mut views: Vec<&mut [f32]> = out.iter_mut().map(|o| &mut **o).collect();
        started.finish(&mut [&mut views])
    }

    fn start(&self, pieces: &[&Piece], x: &[f32]) -> Result<Option<Box<dyn Started + '_>>, String> {
        let mut started = Box::new(DeviceStarted { runner: self, work: Vec::with_capacity(pieces.len()) });
        for piece in pieces {
            let xs = piece_x(piece, x, self.w.cols)?;
            let m = self.tokens_for(piece);
            let slot = self.slot(m, &piece.rows)?;
            let mut bytes = crate::backend::f32_bytes(xs);
            // A static graph's rows past the piece's tokens: zeros.
            bytes.resize(m * self.w.cols * 4, 0);
            let e = |e: llmd_device::DeviceError| e.to_string();
            let r = self
                .dev
                .write(&slot.bind.x, 0, &bytes, &[])
                .map_err(e)
                .and_then(|_| self.dev.submit(&slot.exe, &slot.bind, &[]).map_err(e));
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
