//! The streaming loader for llmd files (EdgeFlow §4.3's macro pipeline): reader threads →
//! one unpack thread → compute, pipelined per layer region, so that a cold start's prefill runs
//! layer 0 while later layers are still coming off storage.
//!
//! * **Read**: `readers` threads take regions in file order from a shared counter. Each asks
//!   the kernel to read its region ahead (`MADV_WILLNEED` on the file's map) and then computes
//!   the CRC-32 of every tensor and of the whole region in one pass over the mapped bytes, which
//!   brings them in in order. (Reading through the map, not into buffers of our own, lets the
//!   storage fill the page cache directly: no copy, and no zeroing of fresh anonymous pages —
//!   both showed up as the largest CPU costs of a 1.1 GB cold start.)
//! * **Unpack**: one thread puts regions back in order, checks every tensor's CRC-32 and the
//!   region's share of the whole-data CRC-32, and turns the bytes into weights: K-quant records
//!   (`TensorKind::KPacked`) are used in place from the map; EdgeFlow tensors are SIMD-unpacked
//!   to int8 straight into the CPU kernels' tile layout and GGML tensors repacked as the GGUF
//!   loader does, after which their pages of the map are let go (`MADV_DONTNEED`), so they are
//!   not resident twice.
//! * **Compute**: the caller's thread; with a prompt, it runs the forward pass one layer at a
//!   time as each layer's weights arrive ([`crate::model::Pass`], the same code as
//!   [`crate::model::Transformer::run`]'s host pass, so the logits are the same bit for bit).
//!
//! The whole-data checksum is known only when the last region has been read; a mismatch there
//! fails the load even though earlier layers were already used (their own CRCs had matched).

use super::config::ModelConfig;
use super::kv::KvCache;
use super::weights::{LayerWeights, ModelWeights, WeightMatrix};
use super::Logits;
use crate::backend::blocks::Pass;
use crate::backend::layout::kpacked::{self, KKind, KPackedMatrix};
use crate::backend::layout::packed::{PackKind, PackedMatrix};
use crate::backend::Planner;
use crate::error::{EngineError, FormatError};
use crate::format::llmd::{self, Metadata, TensorEntry, TensorKind};
use crate::format::{ModelBytes, TensorRef};
use crate::quant::edgeflow;
use crate::quant::{self, GgmlType};
use half::f16;
use llmd_alloc_sys::HugeArena;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

/// Bytes per `pread` call (progress is reported between calls).
const READ_CHUNK: usize = 8 << 20;

/// Where the pipeline is, for progress displays.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Bytes read so far / in all.
    pub read_bytes: u64,
    pub total_bytes: u64,
    /// Regions whose weights are ready so far / in all.
    pub regions_ready: usize,
    pub regions: usize,
}

/// A progress callback, called from the pipeline's threads.
pub type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// How to run the pipeline.
#[derive(Clone)]
pub struct StreamOptions {
    /// Reader threads (EdgeFlow used 2).
    pub readers: usize,
    /// Called from the pipeline's threads as bytes are read and regions become ready.
    pub progress: Option<ProgressFn>,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self { readers: 2, progress: None }
    }
}

/// One region's times, in seconds from the start of the load.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RegionTiming {
    pub name: String,
    pub bytes: u64,
    pub read: (f64, f64),
    pub unpack: (f64, f64),
    /// When the prompt's prefill ran this region (layers, head), if there was a prompt.
    pub compute: Option<(f64, f64)>,
}

/// What the pipeline did: bytes, per-stage busy times, and the timeline per region.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LoadReport {
    pub file_bytes: u64,
    pub bytes_read: u64,
    /// When the setup (tokenizer, chat template; on its own thread) was done.
    pub setup_s: f64,
    /// Sums over threads of the time spent in each stage.
    pub read_busy_s: f64,
    pub unpack_busy_s: f64,
    pub compute_busy_s: f64,
    /// Time the compute stage waited for weights.
    pub compute_wait_s: f64,
    /// From the start to the last weights ready (no prompt) or to the first token's logits.
    pub wall_s: f64,
    pub regions: Vec<RegionTiming>,
}

impl LoadReport {
    /// Seconds during which reading, unpacking and computing overlapped another stage: the
    /// stage busy times minus the wall time of the stages together (0 when run one by one).
    pub fn overlap_s(&self) -> f64 {
        let first = self.regions.iter().map(|r| r.read.0).fold(f64::INFINITY, f64::min);
        let last = self.regions.iter().map(|r| r.compute.map(|c| c.1).unwrap_or(r.unpack.1)).fold(0.0, f64::max);
        let span = (last - first).max(0.0);
        (self.read_busy_s + self.unpack_busy_s + self.compute_busy_s - span).max(0.0)
    }
}

/// The result of a cold start with a prompt: its last token's logits and the filled KV cache.
pub struct Prefilled {
    pub logits: Vec<f32>,
    pub kv: KvCache,
}

enum Part {
    Matrix(WeightMatrix),
    Vector(Vec<f32>),
}

struct ReadRegion {
    index: usize,
    /// CRC-32 of each of the region's tensors, in the region's order.
    tensor_crcs: Vec<u32>,
    crc: crc32fast::Hasher,
    read: (f64, f64),
}

struct ReadyRegion {
    index: usize,
    read: (f64, f64),
    parts: HashMap<String, Part>,
    unpack: (f64, f64),
}

/// Loads an llmd file through the pipeline. With `prompt`, also prefills it as the layers
/// arrive and returns the last token's logits and the KV cache (`kv_type` from `planner`'s
/// caller). Returns the header's metadata (tokenizer and chat template still to build), the
/// weights and the report.
pub(crate) fn load<T: Send + 'static>(
    path: &Path,
    planner: &Planner,
    kv_type: super::kv::KvType,
    opts: &StreamOptions,
    prompt: Option<&[u32]>,
    setup: impl FnOnce(&Metadata) -> Result<T, EngineError> + Send + 'static,
) -> Result<(Metadata, T, ModelWeights, Option<Prefilled>, LoadReport), EngineError> {
    let t0 = Instant::now();
    let secs = move || t0.elapsed().as_secs_f64();
    let (header, meta, file_len) = llmd::read_head(path)?;
    let map = Arc::new(ModelBytes::map(path)?);
    let c = meta.config.clone();
    let data_offset = header.data_offset;
    let n_regions = meta.regions.len();
    let total = header.data_len;
    let readers = opts.readers.clamp(1, 8);

    let arena = crate::backend::layout::packed::weight_arena(packed_bytes(&meta.tensors));
    let meta = Arc::new(meta);
    let next = Arc::new(AtomicUsize::new(0));
    let read_so_far = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let ready_so_far = Arc::new(AtomicUsize::new(0));
    let (read_tx, read_rx) = mpsc::sync_channel::<Result<ReadRegion, FormatError>>(readers + 1);
    let (ready_tx, ready_rx) = mpsc::channel::<Result<ReadyRegion, FormatError>>();
    let report_progress = {
        let p = opts.progress.clone();
        let (read_so_far, ready_so_far) = (read_so_far.clone(), ready_so_far.clone());
        move || {
            if let Some(p) = &p {
                p(&Progress {
                    read_bytes: read_so_far.load(Ordering::Relaxed),
                    total_bytes: total,
                    regions_ready: ready_so_far.load(Ordering::Relaxed),
                    regions: n_regions,
                })
            }
        }
    };
    let mut handles = Vec::new();
    for _ in 0..readers {
        let (meta, next, tx, read_so_far) = (meta.clone(), next.clone(), read_tx.clone(), read_so_far.clone());
        let report_progress = report_progress.clone();
        let path = path.display().to_string();
        let map = map.clone();
        handles.push(std::thread::spawn(move || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= meta.regions.len() {
                break;
            }
            let start = secs();
            let msg = read_region(&map, &meta, i, data_offset, &mut |n| {
                read_so_far.fetch_add(n as u64, Ordering::Relaxed);
                report_progress();
            })
            .map(|(tensor_crcs, crc)| ReadRegion { index: i, tensor_crcs, crc, read: (start, secs()) })
            .map_err(|e| match e {
                FormatError::Io { source, .. } => FormatError::Io { path: path.clone(), source },
                e => e,
            });
            if tx.send(msg).is_err() {
                break;
            }
        }));
    }
    drop(read_tx);
    {
        let (meta, map, ready_so_far) = (meta.clone(), map.clone(), ready_so_far.clone());
        let report_progress = report_progress.clone();
        let stored_crc = header.data_crc;
        let arena = arena.clone();
        handles.push(std::thread::spawn(move || {
            let mut pending = BTreeMap::new();
            let mut want = 0usize;
            let mut whole = crc32fast::Hasher::new();
            for msg in read_rx {
                let r = match msg {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                pending.insert(r.index, r);
                while let Some(r) = pending.remove(&want) {
                    let start = secs();
                    whole.combine(&r.crc);
                    let region = &meta.regions[r.index];
                    let mut parts = HashMap::new();
                    let mut result = Ok(());
                    for (&ti, &crc) in region.tensors.iter().zip(&r.tensor_crcs) {
                        let t = &meta.tensors[ti];
                        match build_part(t, crc, &map, data_offset, arena.as_ref()) {
                            Ok(p) => {
                                parts.insert(t.name.clone(), p);
                            }
                            Err(e) => {
                                result = Err(e);
                                break;
                            }
                        }
                    }
                    if result.is_ok() && want + 1 == meta.regions.len() {
                        let computed = whole.clone().finalize();
                        if computed != stored_crc {
                            result = Err(FormatError::ChecksumMismatch {
                                what: "data".into(),
                                stored: stored_crc,
                                computed,
                            });
                        }
                    }
                    let msg =
                        result.map(|_| ReadyRegion { index: r.index, read: r.read, parts, unpack: (start, secs()) });
                    let failed = msg.is_err();
                    ready_so_far.fetch_add(1, Ordering::Relaxed);
                    report_progress();
                    if ready_tx.send(msg).is_err() || failed {
                        return;
                    }
                    want += 1;
                }
            }
        }));
    }
    // The caller's setup (tokenizer, chat template) runs on its own thread, beside the reads,
    // unpacking and the prompt's prefill, which need none of it.
    let setup_thread = {
        let meta = meta.clone();
        std::thread::spawn(move || {
            // At normal priority: the load returns only once this is done, and run niced it
            // is starved until the prefill ends and then becomes the cold start's tail.
            let r = setup(&meta);
            (r, secs())
        })
    };

    let mut report = LoadReport { file_bytes: file_len, ..Default::default() };
    report.regions = meta
        .regions
        .iter()
        .map(|r| RegionTiming { name: r.name.clone(), bytes: r.len, ..Default::default() })
        .collect();
    let shape = c.block_shape(false, false);
    let pass = Pass { c: &shape, planner, linears: None, sparse: None };
    let mut kv = prompt.map(|_| KvCache::with_type(c.n_layers, c.kv_dim(), c.head_dim, kv_type));
    let mut state = None;
    let mut parts: HashMap<String, Part> = HashMap::new();
    let mut layers: Vec<LayerWeights> = Vec::with_capacity(c.n_layers);
    let mut token_embd: Option<WeightMatrix> = None;
    let mut rope_freqs = None;
    let mut compute_busy = 0.0;
    let mut wait = 0.0;
    let run = (|| -> Result<(), EngineError> {
        for _ in 0..n_regions {
            let w0 = secs();
            let ready = ready_rx
                .recv()
                .map_err(|_| FormatError::NativeLayout("the loader stopped before the last region".into()))??;
            wait += secs() - w0;
            let ri = ready.index;
            report.regions[ri].unpack = ready.unpack;
            report.regions[ri].read = ready.read;
            parts.extend(ready.parts);
            let c0 = secs();
            // Everything a region brings is used as soon as it is complete.
            if token_embd.is_none() && parts.contains_key("token_embd.weight") {
                let e = take_matrix(&mut parts, "token_embd.weight", c.vocab_size, c.d_model)?;
                rope_freqs = take_opt_vector(&mut parts, "rope_freqs.weight", c.rope_dims / 2)?;
                if let (Some(p), Some(kv)) = (prompt, kv.as_mut()) {
                    state = pass.begin(&[(kv, p)], &e)?;
                }
                token_embd = Some(e);
            }
            while layers.len() < c.n_layers && parts.contains_key(&format!("blk.{}.ffn_down.weight", layers.len())) {
                let li = layers.len();
                let l = take_layer(&mut parts, &c, li)?;
                if let (Some(st), Some(p), Some(kv)) = (state.as_mut(), prompt, kv.as_mut()) {
                    pass.layer(st, &mut [(kv, p)], li, l.blocks(rope_freqs.as_deref()), None)?;
                }
                layers.push(l);
            }
            let c1 = secs();
            if c1 - c0 > 1e-6 && prompt.is_some() {
                report.regions[ri].compute = Some((c0, c1));
                compute_busy += c1 - c0;
            }
        }
        Ok(())
    })();
    // Stop the threads whatever happened (they end when their channels close).
    drop(ready_rx);
    for h in handles {
        let _ = h.join();
    }
    let (built, setup_end) =
        setup_thread.join().map_err(|_| FormatError::NativeLayout("the setup thread panicked".into()))?;
    run?;
    let built = built?;
    report.setup_s = setup_end;
    let token_embd = token_embd.ok_or_else(|| FormatError::MissingTensor("token_embd.weight".into()))?;
    if layers.len() != c.n_layers {
        return Err(FormatError::MissingTensor(format!("blk.{}.ffn_down.weight", layers.len())).into());
    }
    let output_norm = take_vector(&mut parts, "output_norm.weight", c.d_model)?;
    let output = if parts.contains_key("output.weight") {
        take_matrix(&mut parts, "output.weight", c.vocab_size, c.d_model)?
    } else {
        token_embd.renamed("output.weight (tied to token_embd.weight)")
    };
    if let Some(extra) = parts.keys().next() {
        return Err(FormatError::NativeLayout(format!("unexpected tensor {extra:?}")).into());
    }
    let weights = ModelWeights { token_embd, layers, output_norm, output, rope_freqs };
    let prefilled = match (state, prompt, kv) {
        (Some(st), Some(p), Some(mut kv)) => {
            let c0 = secs();
            let mut out = pass.finish(st, &mut [(&mut kv, p)], &weights.output_norm, &weights.output, Logits::Last)?;
            let c1 = secs();
            compute_busy += c1 - c0;
            if let Some(last) = report.regions.last_mut() {
                let start = last.compute.map(|c| c.0).unwrap_or(c0);
                last.compute = Some((start, c1));
            }
            Some(Prefilled { logits: out.pop().unwrap_or_default(), kv })
        }
        _ => None,
    };
    report.bytes_read = read_so_far.load(Ordering::Relaxed);
    report.compute_busy_s = compute_busy;
    report.compute_wait_s = wait;
    report.read_busy_s = report.regions.iter().map(|r| r.read.1 - r.read.0).sum();
    report.unpack_busy_s = report.regions.iter().map(|r| r.unpack.1 - r.unpack.0).sum();
    report.wall_s = secs();
    let meta = Arc::try_unwrap(meta).unwrap_or_else(|m| (*m).clone());
    Ok((meta, built, weights, prefilled, report))
}

/// Bytes of the packed copies of every matrix in `tensors` (GGML types with a tile layout,
/// and EdgeFlow tensors, unpacked to Q8_0 tiles).
fn packed_bytes(tensors: &[TensorEntry]) -> usize {
    tensors
        .iter()
        .filter(|t| t.rows > 1)
        .filter_map(|t| {
            let ty = match t.kind {
                TensorKind::Ggml { type_id } => GgmlType::from_id(type_id)?,
                TensorKind::Edgeflow => GgmlType::Q8_0,
                TensorKind::KPacked { .. } => return usize::try_from(t.len).ok(),
            };
            crate::backend::weight::packed_len(ty, usize::try_from(t.rows).ok()?, usize::try_from(t.cols).ok()?)
        })
        .map(llmd_alloc_sys::HugeArena::footprint)
        .fold(0usize, |a, b| a.saturating_add(b))
}

/// Reads region `i` through the map: asks the kernel to read it ahead, then computes the
/// CRC-32 of each tensor and of the whole region (the gaps between tensors included) in one
/// pass over its bytes, which faults them in in order. `progress(bytes)` after each chunk.
fn read_region(
    map: &ModelBytes,
    meta: &Metadata,
    i: usize,
    data_offset: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<u32>, crc32fast::Hasher), FormatError> {
    let r = &meta.regions[i];
    let (start, end) = ((data_offset + r.offset) as usize, (data_offset + r.offset + r.len) as usize);
    if end > map.len() {
        return Err(FormatError::Io {
            path: String::new(),
            source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file is shorter than its regions"),
        });
    }
    map.will_need(start..end);
    let mut whole = crc32fast::Hasher::new();
    let mut tensor_crcs = Vec::with_capacity(r.tensors.len());
    let mut at = start;
    let span = |from: usize, to: usize, whole: &mut crc32fast::Hasher, progress: &mut dyn FnMut(usize)| {
        let mut h = crc32fast::Hasher::new();
        for chunk in map[from..to].chunks(READ_CHUNK) {
            h.update(chunk);
            progress(chunk.len());
        }
        whole.combine(&h);
        h.finalize()
    };
    for &ti in &r.tensors {
        let t = &meta.tensors[ti];
        let (t0, t1) = ((data_offset + t.offset) as usize, (data_offset + t.offset + t.len) as usize);
        if t0 > at {
            span(at, t0, &mut whole, progress);
        }
        tensor_crcs.push(span(t0, t1, &mut whole, progress));
        at = t1;
    }
    if end > at {
        span(at, end, &mut whole, progress);
    }
    Ok((tensor_crcs, whole))
}

/// Turns one tensor's checked bytes into weights: K-quant records are used in place from the
/// map; other tensors are unpacked or repacked into memory of their own, and their pages of
/// the map are let go.
fn build_part(
    t: &TensorEntry,
    computed: u32,
    map: &Arc<ModelBytes>,
    data_offset: u64,
    arena: Option<&HugeArena>,
) -> Result<Part, FormatError> {
    if computed != t.crc32 {
        return Err(FormatError::ChecksumMismatch { what: format!("tensor {:?}", t.name), stored: t.crc32, computed });
    }
    let start = (data_offset + t.offset) as usize;
    let part = build_from(t, map, start, arena)?;
    // Weights now in memory of their own no longer need the map's pages (they would count as
    // resident twice); records used in place, and rows the kernels read from the map, keep them.
    let own = match &part {
        Part::Vector(_) => true,
        Part::Matrix(m) => m.packed.is_some() || m.kpacked.as_ref().is_some_and(|k| !k.in_file()),
    };
    if own {
        map.release(start..start + t.len as usize);
    }
    Ok(part)
}

fn build_from(
    t: &TensorEntry,
    map: &Arc<ModelBytes>,
    start: usize,
    arena: Option<&HugeArena>,
) -> Result<Part, FormatError> {
    let (rows, cols) = (t.rows as usize, t.cols as usize);
    let bytes = &map[start..start + t.len as usize];
    let tref =
        |ty| TensorRef { ty, dims: vec![t.cols, t.rows], file: map.clone(), range: start..start + t.len as usize };
    let bad = |m: String| FormatError::NativeLayout(format!("tensor {:?}: {m}", t.name));
    match t.kind {
        TensorKind::Ggml { type_id } => {
            let ty =
                GgmlType::from_id(type_id).ok_or(FormatError::UnknownTensorType { name: t.name.clone(), type_id })?;
            if rows == 1 {
                let mut v = vec![0f32; cols];
                quant::dequantize_row(ty, bytes, &mut v).map_err(|e| bad(e.to_string()))?;
                return Ok(Part::Vector(v));
            }
            let Some(kind) = PackKind::of(ty) else {
                // K-quants pack from the file (the map is not touched); other types stay as rows.
                return WeightMatrix::from_tensor_in(arena, &t.name, rows, cols, tref(ty))
                    .map(Part::Matrix)
                    .map_err(|e| bad(e.to_string()));
            };
            let row_bytes = bytes.len() / rows;
            let p = PackedMatrix::pack_in(arena, kind, rows, cols, |r0, buf| {
                buf.copy_from_slice(&bytes[r0 * row_bytes..r0 * row_bytes + buf.len()]);
                Ok(())
            })
            .map_err(|e| bad(e.to_string()))?;
            Ok(Part::Matrix(WeightMatrix::with_packed(&t.name, tref(ty), p)))
        }
        TensorKind::KPacked { type_id, layout } => {
            let ty =
                GgmlType::from_id(type_id).ok_or(FormatError::UnknownTensorType { name: t.name.clone(), type_id })?;
            let kind = KKind::of(ty).ok_or_else(|| bad(format!("packed records of {}", ty.name())))?;
            if layout != kpacked::RECORD_LAYOUT {
                return Err(bad(format!(
                    "packed with record layout {layout}, this build reads layout {}: convert the model again",
                    kpacked::RECORD_LAYOUT
                )));
            }
            let k = KPackedMatrix::from_file(map.clone(), start..start + t.len as usize, kind, rows, cols)
                .map_err(|e| bad(e.to_string()))?;
            Ok(Part::Matrix(WeightMatrix::with_kpacked(&t.name, tref(ty), k)))
        }
        TensorKind::Edgeflow => {
            if cols % crate::backend::layout::packed::BLOCK != 0 {
                return Err(bad(format!("{cols} columns are not a multiple of 32")));
            }
            let (bits_len, scales_len) = llmd::edgeflow_prefix(rows);
            let bits =
                edgeflow::unpack_bit_widths(bytes, rows).ok_or_else(|| bad("bit-width array truncated".into()))?;
            let scales = bytes.get(bits_len..bits_len + 2 * rows).ok_or_else(|| bad("scales truncated".into()))?;
            let mut offsets = Vec::with_capacity(rows + 1);
            let mut at = bits_len + scales_len;
            for &b in &bits {
                offsets.push(at);
                at += edgeflow::channel_bytes(b, cols);
            }
            if at != bytes.len() {
                return Err(bad(format!("{} bytes, the bit-widths need {at}", bytes.len())));
            }
            let buf_len = edgeflow::groups(cols) * edgeflow::GROUP;
            let p = PackedMatrix::from_i8_rows_in(arena, rows, cols, buf_len, |r, out| {
                let d = f16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]);
                if !d.is_finite() {
                    return Err(bad(format!("channel {r} has scale {d}")));
                }
                let b = bits[r];
                crate::backend::cpu::unpack::unpack_channel(
                    b,
                    &bytes[offsets[r]..offsets[r] + edgeflow::channel_bytes(b, cols)],
                    out,
                );
                Ok(d)
            })?;
            Ok(Part::Matrix(WeightMatrix::with_packed(&t.name, tref(GgmlType::Q8_0), p)))
        }
    }
}

impl From<std::io::Error> for FormatError {
    fn from(source: std::io::Error) -> Self {
        FormatError::Io { path: "model data".into(), source }
    }
}

fn take_matrix(
    parts: &mut HashMap<String, Part>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<WeightMatrix, FormatError> {
    match parts.remove(name) {
        Some(Part::Matrix(m)) if m.rows == rows && m.cols == cols => Ok(m),
        Some(Part::Matrix(m)) => Err(FormatError::ShapeMismatch {
            name: name.into(),
            found: vec![m.cols as u64, m.rows as u64],
            expected: vec![cols as u64, rows as u64],
        }),
        Some(Part::Vector(v)) => Err(FormatError::ShapeMismatch {
            name: name.into(),
            found: vec![v.len() as u64],
            expected: vec![cols as u64, rows as u64],
        }),
        None => Err(FormatError::MissingTensor(name.into())),
    }
}

fn take_vector(parts: &mut HashMap<String, Part>, name: &str, len: usize) -> Result<Vec<f32>, FormatError> {
    match parts.remove(name) {
        Some(Part::Vector(v)) if v.len() == len => Ok(v),
        Some(Part::Vector(v)) => Err(FormatError::ShapeMismatch {
            name: name.into(),
            found: vec![v.len() as u64],
            expected: vec![len as u64],
        }),
        Some(Part::Matrix(m)) => Err(FormatError::ShapeMismatch {
            name: name.into(),
            found: vec![m.cols as u64, m.rows as u64],
            expected: vec![len as u64],
        }),
        None => Err(FormatError::MissingTensor(name.into())),
    }
}

fn take_opt_vector(parts: &mut HashMap<String, Part>, name: &str, len: usize) -> Result<Option<Vec<f32>>, FormatError> {
    if parts.contains_key(name) {
        take_vector(parts, name, len).map(Some)
    } else {
        Ok(None)
    }
}

fn take_layer(parts: &mut HashMap<String, Part>, c: &ModelConfig, i: usize) -> Result<LayerWeights, FormatError> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (d, q, kv, f) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
    let qwen = c.arch == super::config::Arch::Qwen2;
    let mut bias = |s: &str, len| {
        if qwen {
            take_vector(parts, &n(s), len).map(Some)
        } else {
            take_opt_vector(parts, &n(s), len)
        }
    };
    let (bq, bk, bv) = (bias("attn_q.bias", q)?, bias("attn_k.bias", kv)?, bias("attn_v.bias", kv)?);
    Ok(LayerWeights {
        attn_norm: take_vector(parts, &n("attn_norm.weight"), d)?,
        wq: take_matrix(parts, &n("attn_q.weight"), q, d)?,
        wk: take_matrix(parts, &n("attn_k.weight"), kv, d)?,
        wv: take_matrix(parts, &n("attn_v.weight"), kv, d)?,
        wo: take_matrix(parts, &n("attn_output.weight"), d, q)?,
        bq,
        bk,
        bv,
        ffn_norm: take_vector(parts, &n("ffn_norm.weight"), d)?,
        w_gate: take_matrix(parts, &n("ffn_gate.weight"), f, d)?,
        w_up: take_matrix(parts, &n("ffn_up.weight"), f, d)?,
        w_down: take_matrix(parts, &n("ffn_down.weight"), d, f)?,
    })
}
