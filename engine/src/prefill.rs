//! llm.npu's prefill on the NPU path: a model's linear groups as W8A8 QNN graphs at a chunk size,
//! run in place of the CPU's matmuls ([`Linears`]) while norms, RoPE, attention (into the host
//! KV cache), SwiGLU and the head stay on the CPU in float — llm.npu's split. The CPU then decodes
//! from the same cache: nothing is copied between the two.
//!
//! - [`calibrate`]: one pass of calibration text on the CPU; the range of each group's input and
//!   of each projection's output (before its bias) per layer.
//! - [`quantized_groups`]: the model's weights, dequantized and requantized to int8 (per tensor,
//!   llm.npu's choice, or per output channel), with the calibrated activation quantizations.
//! - [`NpuLinears`]: those groups' graphs built and finalized in one QNN context, run chunk by
//!   chunk (a short last chunk padded with the input's zero point; its rows are dropped).
//!
//! Decisions where llm.npu is silent or differs: activation ranges are the calibration's min
//! and max (no clipping: llm.npu clips and runs the outliers on the CPU — shadow outlier
//! execution, issue 30 — which this path does not have yet, and clipping without it loses the
//! outliers outright); biases stay on the CPU in float (added after the graph, as for the CPU's
//! matmuls), so the graphs the model uses are bias-free even for Qwen2's QKV.

use crate::backend::blocks::{CaptureSite, Linears};
use crate::backend::npu::graph::{build_linear_group, graph_name, run_linear_group, LinearGroup, Projection};
use crate::backend::npu::quant::{ActQuant, QuantWeights};
use crate::backend::weight::WeightMatrix;
use crate::backend::{OpDesc, OpKind};
use crate::error::{BackendError, EngineError, NpuError};
use crate::model::Transformer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The calibration text used when none is given: plain English prose, the register of ordinary
/// requests (llm.npu calibrates on a general corpus; any text of a few hundred tokens of the
/// kind the model will be asked about serves).
pub const CALIBRATION_TEXT: &str =
    "The history of computing is a story of machines that grew smaller while their reach grew \
larger. Early computers filled whole rooms, drew enough power to light a street, and were tended by teams who fed \
them punched cards. Each new generation of hardware traded vacuum tubes for transistors, transistors for integrated \
circuits, and circuits for chips holding billions of switches. Software followed the same path: programs once written \
in machine code for a single model of computer became portable, layered and shared. Today a phone in a pocket holds \
more processing power than the machines that guided the first missions to the moon. It carries a central processor, \
a graphics processor and a neural processor, each suited to different work. The neural processor multiplies small \
integers very quickly, which is exactly what a quantized language model needs when it reads a long prompt. Reading \
the prompt is called prefill; producing the answer one word at a time is called decoding. Prefill is limited by \
arithmetic, decoding by memory bandwidth. A good system puts each part of the work where it runs best, keeps the \
data where it is needed, and never makes the user wait longer than necessary. Questions about gardens, recipes, \
travel, history and science all reach the same model, so the calibration should look like ordinary conversation: \
greetings, requests for help, explanations of how things work, and short answers that are polite and clear.";

/// The four groups of a layer, in [`CaptureSite`] order.
pub const SITES: [CaptureSite; 4] = [CaptureSite::Qkv, CaptureSite::O, CaptureSite::GateUp, CaptureSite::Down];

/// What calibration saw at one group of one layer: its input's range and each projection's
/// output range (before bias).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SiteRanges {
    pub input: (f32, f32),
    pub outputs: Vec<(f32, f32)>,
}

/// Calibration of every layer's groups, `[layer][site]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    pub layers: Vec<[SiteRanges; 4]>,
    pub tokens: usize,
}

/// The projections of `site` in layer `li` of `t`, with their names.
fn projections(t: &Transformer, li: usize, site: CaptureSite) -> Vec<(&'static str, &WeightMatrix)> {
    let l = &t.weights.layers[li];
    match site {
        CaptureSite::Qkv => vec![("q", &l.wq), ("k", &l.wk), ("v", &l.wv)],
        CaptureSite::O => vec![("o", &l.wo)],
        CaptureSite::GateUp => vec![("gate", &l.w_gate), ("up", &l.w_up)],
        CaptureSite::Down => vec![("down", &l.w_down)],
    }
}

fn widen(r: &mut (f32, f32), v: &[f32]) {
    for &x in v {
        if x.is_finite() {
            r.0 = r.0.min(x);
            r.1 = r.1.max(x);
        }
    }
}

/// Runs `tokens` through `t` on the CPU (in passes of at most 256 tokens, from a fresh cache when
/// the context is full) and records the ranges [`SiteRanges`] describes.
pub fn calibrate(t: &Transformer, tokens: &[u32]) -> Result<Calibration, EngineError> {
    let c = &t.config;
    let mut layers: Vec<[SiteRanges; 4]> = (0..c.n_layers).map(|_| Default::default()).collect();
    for (li, l) in layers.iter_mut().enumerate() {
        for site in SITES {
            l[site as usize].outputs = vec![(0.0, 0.0); projections(t, li, site).len()];
        }
    }
    let mut kv = t.new_kv();
    let mut failed: Option<BackendError> = None;
    for part in tokens.chunks(256) {
        if kv.len() + part.len() > c.context_length {
            kv = t.new_kv();
        }
        t.forward_capture(&mut kv, part, &mut |li, site, x, cols| {
            let n = x.len() / cols.max(1);
            let r = &mut layers[li][site as usize];
            widen(&mut r.input, x);
            for (i, (_, w)) in projections(t, li, site).into_iter().enumerate() {
                let mut y = vec![0f32; n * w.rows];
                let op = OpDesc { kind: OpKind::MatMul, weight_type: Some(w.ty), n_tokens: n };
                match t.planner().place(&op).and_then(|b| b.matmul(w, x, n, &mut y)) {
                    Ok(()) => widen(&mut r.outputs[i], &y),
                    Err(e) => failed = Some(e),
                }
            }
        })?;
        if let Some(e) = failed.take() {
            return Err(e.into());
        }
    }
    Ok(Calibration { layers, tokens: tokens.len() })
}

/// A weight's rows as f32.
fn dequantize(m: &WeightMatrix) -> Result<Vec<f32>, NpuError> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (r, o) in out.chunks_exact_mut(m.cols.max(1)).enumerate() {
        if let Some(p) = &m.packed {
            p.dequantize_row(r, o);
        } else if let Some(row) = m.row(r) {
            crate::quant::dequantize_row(m.ty, row, o)
                .map_err(|e| NpuError::Quantization(format!("{}: {e}", m.name)))?;
        } else {
            return Err(NpuError::Quantization(format!("{}: row {r} cannot be read for requantization", m.name)));
        }
    }
    Ok(out)
}

/// Every layer's groups quantized for the NPU: weights requantized to int8 (`per_channel`: one
/// scale per output channel), inputs 8-bit and outputs `out_bits` (8 or 16) at the calibrated
/// ranges. `[layer][site]`.
pub fn quantized_groups(
    t: &Transformer,
    cal: &Calibration,
    per_channel: bool,
    out_bits: u8,
) -> Result<Vec<[LinearGroup; 4]>, NpuError> {
    if cal.layers.len() != t.config.n_layers {
        return Err(NpuError::Quantization(format!(
            "the calibration has {} layers, the model {}",
            cal.layers.len(),
            t.config.n_layers
        )));
    }
    let mut out = Vec::with_capacity(cal.layers.len());
    for (li, ranges) in cal.layers.iter().enumerate() {
        let mut groups = Vec::with_capacity(4);
        for site in SITES {
            let r = &ranges[site as usize];
            let input = ActQuant::from_range(r.input.0, r.input.1)?;
            let mut projs = Vec::new();
            for (i, (name, w)) in projections(t, li, site).into_iter().enumerate() {
                let f = dequantize(w)?;
                let weights = QuantWeights::quantize(&f, w.rows, w.cols, per_channel)?;
                let (lo, hi) = r.outputs.get(i).copied().unwrap_or((0.0, 0.0));
                projs.push(Projection {
                    name: name.into(),
                    weights,
                    bias: None,
                    output: ActQuant::from_range_bits(lo, hi, out_bits)?,
                });
            }
            groups.push(LinearGroup { name: format!("l{li}_{}", site_name(site)), input, projections: projs });
        }
        let groups: [LinearGroup; 4] =
            groups.try_into().map_err(|_| NpuError::Quantization("four groups per layer".into()))?;
        out.push(groups);
    }
    Ok(out)
}

/// A group's name in graph names.
pub fn site_name(site: CaptureSite) -> &'static str {
    match site {
        CaptureSite::Qkv => "qkv",
        CaptureSite::O => "o",
        CaptureSite::GateUp => "gate_up",
        CaptureSite::Down => "down",
    }
}

/// A group whose graph holds its weights: only its shapes and quantization stay on the host.
fn without_weights(mut g: LinearGroup) -> LinearGroup {
    for p in &mut g.projections {
        p.weights.q = Vec::new();
    }
    g
}

struct Built<'c> {
    group: LinearGroup,
    graph: Mutex<qnn_sys::api::Graph<'c>>,
}

/// A model's linear groups as finalized graphs of one QNN context, for chunks of `chunk` rows.
pub struct NpuLinears<'c> {
    chunk: usize,
    layers: Vec<[Built<'c>; 4]>,
    lib: &'c qnn_sys::Library,
    executions: AtomicU64,
    modelled_ns: AtomicU64,
}

impl<'c> NpuLinears<'c> {
    /// Builds and finalizes every group's graph at `chunk` rows in `context` (of a backend of
    /// `lib`, which is asked for modelled durations: the emulator provider has them).
    pub fn build(
        lib: &'c qnn_sys::Library,
        context: &'c qnn_sys::api::Context<'_>,
        groups: Vec<[LinearGroup; 4]>,
        chunk: usize,
    ) -> Result<Self, NpuError> {
        let mut layers = Vec::with_capacity(groups.len());
        for layer in groups {
            let mut built = Vec::with_capacity(4);
            for group in layer {
                let graph = build_linear_group(context, &group, chunk)?;
                built.push(Built { group: without_weights(group), graph: Mutex::new(graph) });
            }
            let built: [Built<'c>; 4] = match built.try_into() {
                Ok(b) => b,
                Err(_) => return Err(NpuError::Quantization("four groups per layer".into())),
            };
            layers.push(built);
        }
        Ok(Self { chunk, layers, lib, executions: AtomicU64::new(0), modelled_ns: AtomicU64::new(0) })
    }

    /// Wraps graphs already in a context (`cache::graphs`), one per group in layer-major order.
    pub fn from_graphs(
        lib: &'c qnn_sys::Library,
        groups: Vec<[LinearGroup; 4]>,
        graphs: Vec<qnn_sys::api::Graph<'c>>,
        chunk: usize,
    ) -> Result<Self, NpuError> {
        if graphs.len() != groups.len() * 4 {
            return Err(NpuError::Quantization(format!("{} graphs for {} groups", graphs.len(), groups.len() * 4)));
        }
        let mut graphs = graphs.into_iter();
        let mut layers = Vec::with_capacity(groups.len());
        for layer in groups {
            let built: Vec<Built<'c>> = layer
                .into_iter()
                .filter_map(|group| {
                    graphs.next().map(|g| Built { group: without_weights(group), graph: Mutex::new(g) })
                })
                .collect();
            match built.try_into() {
                Ok(b) => layers.push(b),
                Err(_) => return Err(NpuError::Quantization("four groups per layer".into())),
            }
        }
        // The host's int8 weights are gone into the graphs, and calibration's passes and the
        // context binary were freed before: give their pages back (the daemon's RSS with the
        // graphs ready: 250 MB with this, 361–369 MB without, 140 MB on the CPU alone; the
        // emulator holds the 106 MB of int8 weights).
        llmd_alloc_sys::release_free_memory();
        Ok(Self { chunk, layers, lib, executions: AtomicU64::new(0), modelled_ns: AtomicU64::new(0) })
    }

    /// The graphs of `context` (from [`prepare`]) for `groups` (flat, layer-major, as `prepare`
    /// returns them), by the tensor ids `ids`.
    pub fn from_context(
        lib: &'c qnn_sys::Library,
        context: &'c qnn_sys::api::Context<'_>,
        groups: Vec<LinearGroup>,
        ids: &[(u32, Vec<u32>)],
        chunk: usize,
    ) -> Result<Self, NpuError> {
        let graphs = crate::backend::npu::cache::graphs(context, &groups, chunk, ids)?;
        let mut layers = Vec::with_capacity(groups.len() / 4);
        let mut it = groups.into_iter();
        loop {
            let layer: Vec<LinearGroup> = it.by_ref().take(4).collect();
            if layer.is_empty() {
                break;
            }
            layers.push(layer.try_into().map_err(|_| NpuError::Quantization("four groups per layer".into()))?);
        }
        Self::from_graphs(lib, layers, graphs, chunk)
    }

    /// The chunk size its graphs take.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Graph executions so far, and the modelled NPU time they add up to (nanoseconds; 0 on a
    /// library that runs for real and models nothing).
    pub fn stats(&self) -> (u64, u64) {
        (self.executions.load(Ordering::Relaxed), self.modelled_ns.load(Ordering::Relaxed))
    }

    /// The names of its graphs.
    pub fn graph_names(&self) -> Vec<String> {
        self.layers.iter().flat_map(|l| l.iter().map(|b| graph_name(&b.group, self.chunk))).collect()
    }
}

impl Linears for NpuLinears<'_> {
    fn group(
        &self,
        li: usize,
        site: CaptureSite,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<bool, BackendError> {
        let Some(b) = self.layers.get(li).map(|l| &l[site as usize]) else { return Ok(false) };
        let g = &b.group;
        let (k, chunk) = (g.k(), self.chunk);
        if x.len() != n * k
            || outs.len() != g.projections.len()
            || outs.iter().zip(&g.projections).any(|(o, p)| o.len() != n * p.weights.rows)
        {
            return Err(BackendError::Shape {
                op: "npu linear group",
                detail: format!("{} values for {n} rows of {k}, or outputs not {n} rows each", x.len()),
            });
        }
        let zero = g.input.zero_point as u8;
        let mut xq = vec![zero; chunk * k];
        let mut start = 0;
        while start < n {
            let m = chunk.min(n - start);
            g.input.quantize(&x[start * k..(start + m) * k], &mut xq[..m * k]);
            xq[m * k..].fill(zero);
            let ys = {
                let mut graph = b.graph.lock().unwrap_or_else(|e| e.into_inner());
                let ys =
                    run_linear_group(&mut graph, g, chunk, &xq).map_err(|e| BackendError::Device(e.to_string()))?;
                if let Some((last, _)) = self.lib.modelled_ns(&graph) {
                    self.modelled_ns.fetch_add(last, Ordering::Relaxed);
                }
                ys
            };
            self.executions.fetch_add(1, Ordering::Relaxed);
            for ((p, y), out) in g.projections.iter().zip(&ys).zip(outs.iter_mut()) {
                let w = p.weights.rows;
                p.output.dequantize_codes(&y[..m * w], &mut out[start * w..(start + m) * w]);
            }
            start += m;
        }
        Ok(true)
    }
}

/// What [`prepare`] did and how long it took.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub calibration_tokens: usize,
    pub calibrate_s: f64,
    pub quantize_s: f64,
    /// Building and finalizing (and storing), or loading from the cache.
    pub context_s: f64,
    pub cache: crate::backend::npu::cache::CacheOutcome,
    pub cache_file: Option<std::path::PathBuf>,
}

/// A model's NPU context, ready for [`NpuLinears::from_context`]: calibrated on
/// `calibration` (tokens), quantized (`out_bits` outputs, per-tensor weights), and its graphs at
/// `chunk` rows loaded from `cache_dir`'s cache file when a sound one is there, else built,
/// finalized and stored there (no cache without a directory).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn prepare<'b>(
    lib: &qnn_sys::Library,
    backend: &'b qnn_sys::api::Backend<'_>,
    soc: u32,
    t: &Transformer,
    calibration: &[u32],
    chunk: usize,
    out_bits: u8,
    cache_dir: Option<&std::path::Path>,
) -> Result<(qnn_sys::api::Context<'b>, Vec<LinearGroup>, crate::backend::npu::cache::GraphIds, Prepared), EngineError>
{
    let t0 = std::time::Instant::now();
    let cal = calibrate(t, calibration)?;
    let calibrate_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let groups: Vec<LinearGroup> = quantized_groups(t, &cal, false, out_bits)?.into_iter().flatten().collect();
    let quantize_s = t1.elapsed().as_secs_f64();
    let t2 = std::time::Instant::now();
    let (context, ids, cache, cache_file) = match cache_dir {
        Some(dir) => {
            let key = crate::backend::npu::cache::key_for(lib, backend, soc, &groups, chunk)?;
            let file = crate::backend::npu::cache::path_for(dir, &key)?;
            let (c, ids, outcome) = crate::backend::npu::cache::load_or_build(backend, dir, &key, &groups, chunk)?;
            (c, ids, outcome, Some(file))
        }
        None => {
            let context = backend.context().map_err(NpuError::from)?;
            let mut ids = Vec::with_capacity(groups.len());
            for g in &groups {
                let io = build_linear_group(&context, g, chunk)?.io();
                ids.push((io.inputs.first().map_or(0, |i| i.1), io.outputs.iter().map(|o| o.1).collect()));
            }
            (
                context,
                ids,
                crate::backend::npu::cache::CacheOutcome::Built { reason: "no cache directory".into() },
                None,
            )
        }
    };
    let prepared = Prepared {
        calibration_tokens: calibration.len(),
        calibrate_s,
        quantize_s,
        context_s: t2.elapsed().as_secs_f64(),
        cache,
        cache_file,
    };
    Ok((context, groups, ids, prepared))
}
