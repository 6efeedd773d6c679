//! llm.npu's prefill on the NPU path: a model's linear groups as W8A8 QNN graphs at a chunk size,
//! run in place of the CPU's matmuls ([`Linears`]) while norms, RoPE, attention (into the host
//! KV cache), SwiGLU and the head stay on the CPU in float — llm.npu's split. The CPU then decodes
//! from the same cache: nothing is copied between the two.
//!
//! - [`calibrate`]: two passes of calibration text on the CPU — each group's input range, its
//!   outlier threshold τ, per-channel ranges, each projection's output ranges; then each
//!   channel's count of values past ±τ ([`SiteRanges`]). Saved with the NPU artefacts
//!   ([`calfile`]).
//! - [`quantized_groups`]: the model's weights requantized to int8 ([`WeightQuant`]), inputs
//!   8-bit over the clipped range where shadow execution runs and the whole range elsewhere.
//! - [`NpuLinears`]: those groups' graphs in one QNN context, run chunk by chunk (a short last
//!   chunk padded with the input's zero point; its rows are dropped), with llm.npu's shadow
//!   outlier execution at the sites [`Calibration::shadow_sites`] keeps ([`shadow_sites`]).
//! - [`prepare`]: all of it, from the caches where they hold it.
//!
//! Biases stay on the CPU in float (added after the graph, as for the CPU's matmuls), so the
//! graphs the model uses are bias-free even for Qwen2's QKV. The decisions where llm.npu is
//! silent are in docs/DECISIONS.md ("llm.npu on the NPU path").

pub mod calfile;

use crate::backend::blocks::{CaptureSite, Linears};
use crate::backend::npu::graph::{build_linear_group, graph_name, run_linear_group, LinearGroup, Projection};
use crate::backend::npu::quant::{ActQuant, QuantWeights};
use crate::backend::npu::shadow::{extract, hot_channels, ColdRows, ShadowWeights};
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

/// The share of a site's input values, largest magnitudes first, that calibration leaves out of
/// the outlier threshold τ: τ is the largest `|x|` once the top 0.1% are dropped — the statistic
/// of llm.npu's authors' code (`top_0_1`), over the whole calibration text at once.
pub const OUTLIER_TRIM: f64 = 0.001;

/// What calibration saw at one group of one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SiteRanges {
    /// The input's smallest and largest value.
    pub input: (f32, f32),
    /// Each projection's output range (before bias).
    pub outputs: Vec<(f32, f32)>,
    /// Each projection's output range per output channel (smallest, largest): the range of
    /// outputs whose per-channel weight scales the host applies ([`WeightQuant::Folded`]).
    pub output_channels: Vec<(Vec<f32>, Vec<f32>)>,
    /// The outlier threshold: the largest `|x|` after dropping the top [`OUTLIER_TRIM`].
    pub tau: f32,
    /// Per input channel, its smallest and largest value (SmoothQuant's statistic).
    pub channel_min: Vec<f32>,
    pub channel_max: Vec<f32>,
    /// Per input channel, how many of its values fell outside the clipped range
    /// ([`Calibration::input_range`] with clipping) — filled by [`count_outliers`].
    pub outlier_counts: Vec<u64>,
    /// Values seen in all (rows × channels).
    pub values: u64,
}

impl SiteRanges {
    /// llm.npu's importance of a layer: its largest input magnitude over the threshold (the
    /// ratio to the clipped scale `τ/127`, up to that constant).
    pub fn importance(&self) -> f32 {
        let m = self.input.0.abs().max(self.input.1.abs());
        if self.tau > 0.0 {
            m / self.tau
        } else {
            1.0
        }
    }
}

/// Calibration of every layer's groups, `[layer][site]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    pub layers: Vec<[SiteRanges; 4]>,
    pub tokens: usize,
}

impl Calibration {
    /// Site `site` of layer `li`'s input range: the whole range seen, or (`clipped`) that range
    /// cut to `±τ` — the range the NPU's 8-bit codes span when shadow execution takes the rest.
    pub fn input_range(&self, li: usize, site: CaptureSite, clipped: bool) -> (f32, f32) {
        let r = &self.layers[li][site as usize];
        if clipped && r.tau > 0.0 {
            (r.input.0.max(-r.tau), r.input.1.min(r.tau))
        } else {
            r.input
        }
    }

    /// Which sites keep shadow execution when the fraction `prune` (0..=1) of the least important
    /// are pruned (llm.npu §3.5: importance = largest value over the threshold; the top
    /// `1 − prune` by importance keep it), `[layer][site]`. Sites where nothing was ever past τ
    /// gain nothing from shadow and are never chosen.
    pub fn shadow_sites(&self, prune: f64) -> Vec<[bool; 4]> {
        let mut all: Vec<(f32, usize, usize)> = Vec::new();
        for (li, l) in self.layers.iter().enumerate() {
            for (si, r) in l.iter().enumerate() {
                all.push((r.importance(), li, si));
            }
        }
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let keep = ((1.0 - prune.clamp(0.0, 1.0)) * all.len() as f64).round() as usize;
        let mut out = vec![[false; 4]; self.layers.len()];
        for &(imp, li, si) in all.iter().take(keep) {
            if imp > 1.0 {
                out[li][si] = true;
            }
        }
        out
    }
}

/// The largest values of a stream, enough of them to read off a top-share threshold.
struct TopK {
    keep: usize,
    floor: f32,
    buf: Vec<f32>,
}

impl TopK {
    fn new(keep: usize) -> Self {
        Self { keep, floor: 0.0, buf: Vec::new() }
    }

    fn push(&mut self, v: f32) {
        if v > self.floor || self.buf.len() <= self.keep {
            self.buf.push(v);
            if self.buf.len() > 4 * self.keep + 4096 {
                self.trim();
            }
        }
    }

    fn trim(&mut self) {
        if self.buf.len() > self.keep + 1 {
            self.buf.select_nth_unstable_by(self.keep, |a, b| b.total_cmp(a));
            self.buf.truncate(self.keep + 1);
        }
        self.floor = self.buf.iter().copied().fold(f32::INFINITY, f32::min);
    }

    /// The largest value once the `keep` largest are dropped (the smallest seen when fewer).
    fn threshold(mut self) -> f32 {
        self.trim();
        if self.buf.is_empty() {
            0.0
        } else {
            self.floor
        }
    }
}

/// The projections of `site` in layer `li` of `t`, with their names.
pub(crate) fn projections(t: &Transformer, li: usize, site: CaptureSite) -> Vec<(&'static str, &WeightMatrix)> {
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
/// the context is full) and records what [`SiteRanges`] describes, then counts each channel's
/// outliers at the clipped ranges ([`count_outliers`]).
pub fn calibrate(t: &Transformer, tokens: &[u32]) -> Result<Calibration, EngineError> {
    let mut cal = ranges(t, tokens)?;
    count_outliers(t, tokens, &mut cal)?;
    Ok(cal)
}

/// Runs `tokens` through `t` on the CPU, calling `f(layer, site, rows, columns)` at every group.
fn each_group(t: &Transformer, tokens: &[u32], f: crate::backend::blocks::Capture) -> Result<(), EngineError> {
    let mut kv = t.new_kv();
    for part in tokens.chunks(256) {
        if kv.len() + part.len() > t.config.context_length {
            kv = t.new_kv();
        }
        t.forward_capture(&mut kv, part, &mut |li, site, x, cols| f(li, site, x, cols))?;
    }
    Ok(())
}

/// Counts, per channel of every site, the values outside the site's clipped range.
pub fn count_outliers(t: &Transformer, tokens: &[u32], cal: &mut Calibration) -> Result<(), EngineError> {
    let mut quants = Vec::with_capacity(cal.layers.len());
    for li in 0..cal.layers.len() {
        let mut l = Vec::with_capacity(4);
        for site in SITES {
            let (lo, hi) = cal.input_range(li, site, true);
            l.push(ActQuant::from_range(lo, hi).map_err(EngineError::from)?);
        }
        quants.push(l);
    }
    let layers = &mut cal.layers;
    each_group(t, tokens, &mut |li, site, x, cols| {
        let (Some(r), Some(q)) =
            (layers.get_mut(li).map(|l| &mut l[site as usize]), quants.get(li).map(|l| l[site as usize]))
        else {
            return;
        };
        if r.outlier_counts.len() != cols {
            r.outlier_counts = vec![0; cols];
        }
        let inv = 1.0 / q.scale;
        for row in x.chunks_exact(cols.max(1)) {
            for (c, &v) in row.iter().enumerate() {
                if crate::backend::npu::shadow::residual(v, &q, inv).is_some() {
                    r.outlier_counts[c] += 1;
                }
            }
        }
    })
}

/// The first calibration pass: ranges, τ, per-channel ranges and output ranges.
fn ranges(t: &Transformer, tokens: &[u32]) -> Result<Calibration, EngineError> {
    let c = &t.config;
    let mut layers: Vec<[SiteRanges; 4]> = (0..c.n_layers).map(|_| Default::default()).collect();
    for (li, l) in layers.iter_mut().enumerate() {
        for site in SITES {
            let np = projections(t, li, site).len();
            l[site as usize].outputs = vec![(0.0, 0.0); np];
            l[site as usize].output_channels = vec![(Vec::new(), Vec::new()); np];
        }
    }
    let mut tops: Vec<Vec<Option<TopK>>> = (0..c.n_layers).map(|_| (0..4).map(|_| None).collect()).collect();
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
            if r.channel_min.len() != cols {
                r.channel_min = vec![f32::INFINITY; cols];
                r.channel_max = vec![f32::NEG_INFINITY; cols];
            }
            r.values += x.len() as u64;
            let top = tops[li][site as usize]
                .get_or_insert_with(|| TopK::new((OUTLIER_TRIM * (tokens.len() * cols) as f64).ceil() as usize));
            for row in x.chunks_exact(cols.max(1)) {
                for (ch, &v) in row.iter().enumerate() {
                    if v.is_finite() {
                        r.channel_min[ch] = r.channel_min[ch].min(v);
                        r.channel_max[ch] = r.channel_max[ch].max(v);
                        top.push(v.abs());
                    }
                }
            }
            for (i, (_, w)) in projections(t, li, site).into_iter().enumerate() {
                let mut y = vec![0f32; n * w.rows];
                let op = OpDesc { kind: OpKind::MatMul, weight_type: Some(w.ty), n_tokens: n };
                match t.planner().place(&op).and_then(|b| b.matmul(w, x, n, &mut y)) {
                    Ok(()) => {
                        widen(&mut r.outputs[i], &y);
                        let oc = &mut r.output_channels[i];
                        if oc.0.len() != w.rows {
                            *oc = (vec![0.0; w.rows], vec![0.0; w.rows]);
                        }
                        for row in y.chunks_exact(w.rows.max(1)) {
                            for (o, &v) in row.iter().enumerate() {
                                if v.is_finite() {
                                    oc.0[o] = oc.0[o].min(v);
                                    oc.1[o] = oc.1[o].max(v);
                                }
                            }
                        }
                    }
                    Err(e) => failed = Some(e),
                }
            }
        })?;
        if let Some(e) = failed.take() {
            return Err(e.into());
        }
    }
    for (l, tl) in layers.iter_mut().zip(tops) {
        for (r, top) in l.iter_mut().zip(tl) {
            r.tau = top.map_or(0.0, TopK::threshold);
            for v in r.channel_min.iter_mut().chain(r.channel_max.iter_mut()) {
                if !v.is_finite() {
                    *v = 0.0;
                }
            }
        }
    }
    Ok(Calibration { layers, tokens: tokens.len() })
}

/// A weight's rows as f32.
pub(crate) fn dequantize(m: &WeightMatrix) -> Result<Vec<f32>, NpuError> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (r, o) in out.chunks_exact_mut(m.cols.max(1)).enumerate() {
        dequantize_row(m, r, o)?;
    }
    Ok(out)
}

/// Row `r` of a weight as f32.
pub(crate) fn dequantize_row(m: &WeightMatrix, r: usize, o: &mut [f32]) -> Result<(), NpuError> {
    if let Some(p) = &m.packed {
        p.dequantize_row(r, o);
    } else if let Some(row) = m.row(r) {
        crate::quant::dequantize_row(m.ty, row, o).map_err(|e| NpuError::Quantization(format!("{}: {e}", m.name)))?;
    } else {
        return Err(NpuError::Quantization(format!("{}: row {r} cannot be read for requantization", m.name)));
    }
    Ok(())
}

/// How the NPU path's int8 weights are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightQuant {
    /// One scale per tensor (llm.npu's).
    PerTensor,
    /// One scale per output channel, in the graph (QNN's per-axis quantization).
    PerChannel,
    /// Per-channel codes under one per-tensor graph scale, the channels' scales applied by the
    /// host ([`QuantWeights::quantize_folded`]): the default.
    Folded,
}

/// Every layer's groups quantized for the NPU: weights requantized to int8 as `weights` says,
/// inputs 8-bit — at the range clipped to `±τ` where `shadow[layer][site]` (shadow execution
/// takes the rest), else the whole calibrated range — and outputs `out_bits` (8 or 16) at the
/// calibrated ranges. `[layer][site]`.
pub fn quantized_groups(
    t: &Transformer,
    cal: &Calibration,
    weights: WeightQuant,
    out_bits: u8,
    shadow: &[[bool; 4]],
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
            let clipped = shadow.get(li).is_some_and(|s| s[site as usize]);
            let (lo, hi) = cal.input_range(li, site, clipped);
            let input = ActQuant::from_range(lo, hi)?;
            let mut projs = Vec::new();
            for (i, (name, w)) in projections(t, li, site).into_iter().enumerate() {
                let f = dequantize(w)?;
                let (weights, gain) = match weights {
                    WeightQuant::PerTensor => (QuantWeights::quantize(&f, w.rows, w.cols, false)?, None),
                    WeightQuant::PerChannel => (QuantWeights::quantize(&f, w.rows, w.cols, true)?, None),
                    WeightQuant::Folded => {
                        let (q, g) = QuantWeights::quantize_folded(&f, w.rows, w.cols)?;
                        (q, Some(g))
                    }
                };
                let (lo, hi) = match (&gain, r.output_channels.get(i)) {
                    // The graph's outputs are the real ones over each channel's gain.
                    (Some(g), Some((mins, maxs))) if mins.len() == g.len() => mins
                        .iter()
                        .zip(maxs)
                        .zip(g)
                        .fold((0f32, 0f32), |(lo, hi), ((&a, &b), &g)| (lo.min(a / g), hi.max(b / g))),
                    // No per-channel ranges: the overall one, over the smallest gain.
                    _ => {
                        let (lo, hi) = r.outputs.get(i).copied().unwrap_or((0.0, 0.0));
                        let m = gain.as_ref().map_or(1.0, |g| g.iter().copied().fold(1.0f32, f32::min).max(1e-6));
                        (lo / m, hi / m)
                    }
                };
                projs.push(Projection {
                    name: name.into(),
                    weights,
                    bias: None,
                    output: ActQuant::from_range_bits(lo, hi, out_bits)?,
                    gain,
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
    shadow: Option<ShadowSite>,
}

/// Shadow outlier execution at one group: its int8 weights by input channel (hot in memory,
/// cold on storage) and the CPU's own weights of its projections, which recompute an output the
/// NPU saturated (the authors' code's output-side rule).
pub struct ShadowSite {
    pub weights: ShadowWeights,
    cpu: Vec<WeightMatrix>,
    recompute_saturated: bool,
}

/// Counters of shadow execution over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShadowStats {
    /// Groups with shadow execution, of all groups.
    pub sites: usize,
    pub all_sites: usize,
    /// Chunks that ran a shadow group, and those that found outliers.
    pub chunks: u64,
    pub chunks_with_outliers: u64,
    pub outlier_elements: u64,
    pub outlier_channels: u64,
    pub saturated_outputs: u64,
    pub hot_rows_used: u64,
    pub cold_rows_read: u64,
    pub cold_bytes_read: u64,
    /// Shadow weight bytes in memory, and all of them (memory + storage).
    pub resident_bytes: u64,
    pub total_bytes: u64,
}

/// A model's linear groups as finalized graphs of one QNN context, for chunks of `chunk` rows.
pub struct NpuLinears<'c> {
    chunk: usize,
    layers: Vec<[Built<'c>; 4]>,
    lib: &'c qnn_sys::Library,
    executions: AtomicU64,
    modelled_ns: AtomicU64,
    shadow: ShadowCounters,
}

#[derive(Debug, Default)]
struct ShadowCounters {
    chunks: AtomicU64,
    chunks_with_outliers: AtomicU64,
    elements: AtomicU64,
    channels: AtomicU64,
    saturated: AtomicU64,
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
                built.push(Built { group: without_weights(group), graph: Mutex::new(graph), shadow: None });
            }
            let built: [Built<'c>; 4] = match built.try_into() {
                Ok(b) => b,
                Err(_) => return Err(NpuError::Quantization("four groups per layer".into())),
            };
            layers.push(built);
        }
        Ok(Self {
            chunk,
            layers,
            lib,
            executions: AtomicU64::new(0),
            modelled_ns: AtomicU64::new(0),
            shadow: ShadowCounters::default(),
        })
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
                    graphs.next().map(|g| Built { group: without_weights(group), graph: Mutex::new(g), shadow: None })
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
        Ok(Self {
            chunk,
            layers,
            lib,
            executions: AtomicU64::new(0),
            modelled_ns: AtomicU64::new(0),
            shadow: ShadowCounters::default(),
        })
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

    /// Turns on shadow outlier execution at the groups `sites` has one for (layer-major, one
    /// entry per group, as [`prepare`] returns them).
    pub fn set_shadow(&mut self, sites: Vec<Option<ShadowSite>>) -> Result<(), NpuError> {
        if sites.len() != self.layers.len() * 4 {
            return Err(NpuError::Quantization(format!(
                "{} shadow entries for {} groups",
                sites.len(),
                self.layers.len() * 4
            )));
        }
        for (b, s) in self.layers.iter_mut().flat_map(|l| l.iter_mut()).zip(sites) {
            if let Some(s) = &s {
                if s.weights.k != b.group.k()
                    || s.weights.n() != b.group.projections.iter().map(|p| p.weights.rows).sum::<usize>()
                {
                    return Err(NpuError::Shape {
                        graph: b.group.name.clone(),
                        detail: "shadow weights of another shape".into(),
                    });
                }
            }
            b.shadow = s;
        }
        Ok(())
    }

    /// Shadow execution's counters so far.
    pub fn shadow_stats(&self) -> ShadowStats {
        let mut st = ShadowStats {
            all_sites: self.layers.len() * 4,
            chunks: self.shadow.chunks.load(Ordering::Relaxed),
            chunks_with_outliers: self.shadow.chunks_with_outliers.load(Ordering::Relaxed),
            outlier_elements: self.shadow.elements.load(Ordering::Relaxed),
            outlier_channels: self.shadow.channels.load(Ordering::Relaxed),
            saturated_outputs: self.shadow.saturated.load(Ordering::Relaxed),
            ..Default::default()
        };
        for s in self.layers.iter().flat_map(|l| l.iter()).filter_map(|b| b.shadow.as_ref()) {
            let c = &s.weights.counters;
            st.sites += 1;
            st.hot_rows_used += c.hot_rows_used.load(Ordering::Relaxed);
            st.cold_rows_read += c.cold_rows_read.load(Ordering::Relaxed);
            st.cold_bytes_read += c.cold_bytes_read.load(Ordering::Relaxed);
            st.resident_bytes += s.weights.resident_bytes() as u64;
            st.total_bytes += (s.weights.k * s.weights.n()) as u64;
        }
        st
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
            let xs = &x[start * k..(start + m) * k];
            g.input.quantize(xs, &mut xq[..m * k]);
            xq[m * k..].fill(zero);
            // The NPU's graph, and beside it on another thread the outliers' extraction and
            // product (llm.npu: the CPU works while the NPU runs the graph).
            let run_graph = || -> Result<Vec<Vec<u16>>, BackendError> {
                let mut graph = b.graph.lock().unwrap_or_else(|e| e.into_inner());
                let ys =
                    run_linear_group(&mut graph, g, chunk, &xq).map_err(|e| BackendError::Device(e.to_string()))?;
                if let Some((last, _)) = self.lib.modelled_ns(&graph) {
                    self.modelled_ns.fetch_add(last, Ordering::Relaxed);
                }
                Ok(ys)
            };
            let shadow_part = |s: &ShadowSite| -> Result<Option<Vec<f32>>, BackendError> {
                let o = extract(xs, k, &g.input);
                self.shadow.chunks.fetch_add(1, Ordering::Relaxed);
                if o.elements == 0 {
                    return Ok(None);
                }
                self.shadow.chunks_with_outliers.fetch_add(1, Ordering::Relaxed);
                self.shadow.elements.fetch_add(o.elements as u64, Ordering::Relaxed);
                self.shadow.channels.fetch_add(o.channels.len() as u64, Ordering::Relaxed);
                s.weights.product(&o, 1).map(Some).map_err(|e| BackendError::Device(e.to_string()))
            };
            let (ys, shadow) = match &b.shadow {
                Some(s) => std::thread::scope(|sc| {
                    let beside = sc.spawn(|| shadow_part(s));
                    let ys = run_graph();
                    let prod = beside
                        .join()
                        .unwrap_or_else(|_| Err(BackendError::Device("the shadow product panicked".into())));
                    (ys, prod.map(|p| Some((s, p))))
                }),
                None => (run_graph(), Ok(None)),
            };
            let (ys, shadow) = (ys?, shadow?);
            self.executions.fetch_add(1, Ordering::Relaxed);
            let nt = shadow.as_ref().map_or(0, |(s, _)| s.weights.n());
            let mut col = 0;
            for (pi, ((p, y), out)) in g.projections.iter().zip(&ys).zip(outs.iter_mut()).enumerate() {
                let w = p.weights.rows;
                let out = &mut out[start * w..(start + m) * w];
                p.output.dequantize_codes(&y[..m * w], out);
                if let Some(gain) = &p.gain {
                    for row in out.chunks_exact_mut(w) {
                        for (v, g) in row.iter_mut().zip(gain) {
                            *v *= g;
                        }
                    }
                }
                if let Some((s, prod)) = &shadow {
                    let top = p.output.max_code() as u16;
                    let mut wrow = Vec::new();
                    for (r, row) in out.chunks_exact_mut(w).enumerate() {
                        for (o, v) in row.iter_mut().enumerate() {
                            let code = y[r * w + o];
                            // A code at either end, unless it is the zero point (an exact 0).
                            let extreme = (code == 0 || code == top) && i32::from(code) != p.output.zero_point;
                            if s.recompute_saturated && extreme {
                                // Saturated: the whole product in float, on the CPU's weights.
                                let cpu = &s.cpu[pi];
                                wrow.resize(cpu.cols, 0.0);
                                dequantize_row(cpu, o, &mut wrow).map_err(|e| BackendError::Device(e.to_string()))?;
                                *v = xs[r * k..(r + 1) * k].iter().zip(&wrow).map(|(a, b)| a * b).sum();
                                self.shadow.saturated.fetch_add(1, Ordering::Relaxed);
                            } else if let Some(prod) = prod {
                                *v += prod[r * nt + col + o];
                            }
                        }
                    }
                }
                col += w;
            }
            start += m;
        }
        Ok(true)
    }
}

/// The last bytes of a cold-rows file: the CRC-32 of its rows, then this.
const COLD_MAGIC: &[u8; 4] = b"LSH1";

/// The cold-rows file at `path` for `cms` (`total` bytes of rows, back to back): reused when its
/// trailer names these very rows, else written (atomically); opened, and unlinked if asked.
fn cold_file(
    path: &std::path::Path,
    cms: &[Option<crate::backend::npu::shadow::ChannelMajor>],
    total: usize,
    unlink: bool,
) -> std::io::Result<std::fs::File> {
    let mut crc = crc32fast::Hasher::new();
    for c in cms.iter().flatten() {
        crc.update(&c.rows.iter().map(|&v| v as u8).collect::<Vec<u8>>());
    }
    let mut trailer = crc.finalize().to_le_bytes().to_vec();
    trailer.extend_from_slice(COLD_MAGIC);
    let sound = || -> std::io::Result<bool> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(path)?;
        if f.metadata()?.len() != (total + trailer.len()) as u64 {
            return Ok(false);
        }
        let mut t = vec![0u8; trailer.len()];
        f.read_exact_at(&mut t, total as u64)?;
        Ok(t == trailer)
    };
    if !sound().unwrap_or(false) {
        let tmp = path.with_extension("tmp");
        let mut bytes = Vec::with_capacity(total + trailer.len());
        for c in cms.iter().flatten() {
            bytes.extend(c.rows.iter().map(|&v| v as u8));
        }
        bytes.extend_from_slice(&trailer);
        std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, path)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
    }
    let f = std::fs::File::open(path)?;
    if unlink {
        let _ = std::fs::remove_file(path);
    }
    Ok(f)
}

/// The shadow half of every group `sites` marks (layer-major, one entry per group of
/// `groups`, which still hold their int8 weights): channel-major rows, the channels that cover
/// `config.hot_coverage` of calibration's outliers kept in memory and every row written to
/// `cold` (a file, created or reused when its length is right) to read the others from;
/// without a file, every row stays in memory.
pub fn shadow_sites(
    t: &Transformer,
    groups: &[LinearGroup],
    cal: &Calibration,
    sites: &[[bool; 4]],
    config: &ShadowConfig,
    cold: Option<&std::path::Path>,
) -> Result<Vec<Option<ShadowSite>>, NpuError> {
    let mut cms = Vec::with_capacity(groups.len());
    for (gi, g) in groups.iter().enumerate() {
        let (li, si) = (gi / 4, gi % 4);
        if !sites.get(li).is_some_and(|s| s[si]) {
            cms.push(None);
            continue;
        }
        let projs: Vec<(&QuantWeights, Option<&[f32]>)> =
            g.projections.iter().map(|p| (&p.weights, p.gain.as_deref())).collect();
        cms.push(Some(ShadowWeights::channel_major(&projs)?));
    }
    let total: usize = cms.iter().flatten().map(|c| c.rows.len()).sum();
    // Without a cache directory the rows go to a temporary file, unlinked once open: holding
    // them all in memory would be half a second int8 copy of the model at the default pruning.
    let scratch;
    let (cold, unlink) = match cold {
        Some(p) => (Some(p), false),
        None if total > 0 => {
            static SEQ: AtomicU64 = AtomicU64::new(0);
            scratch = std::env::temp_dir().join(format!(
                "llmd-shadow-{}-{}.bin",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            (Some(scratch.as_path()), true)
        }
        None => (None, false),
    };
    let file = match cold {
        Some(path) if total > 0 => match cold_file(path, &cms, total, unlink) {
            Ok(f) => Some(std::sync::Arc::new(f)),
            Err(e) => {
                tracing::warn!(file = %path.display(), "shadow rows kept in memory, the file failed: {e}");
                None
            }
        },
        _ => None,
    };
    let mut offset = 0u64;
    let mut out = Vec::with_capacity(groups.len());
    for (gi, cm) in cms.into_iter().enumerate() {
        let Some(cm) = cm else {
            out.push(None);
            continue;
        };
        let (li, site) = (gi / 4, SITES[gi % 4]);
        let k = groups[gi].k();
        let counts = &cal.layers[li][site as usize].outlier_counts;
        let hot = if counts.len() == k { hot_channels(counts, config.hot_coverage) } else { vec![false; k] };
        let cold = file.clone().map(|file| ColdRows { file, offset });
        offset += cm.rows.len() as u64;
        let weights = ShadowWeights::new(&cm, k, &hot, cold)?;
        let cpu = projections(t, li, site).into_iter().map(|(_, w)| w.clone()).collect();
        out.push(Some(ShadowSite { weights, cpu, recompute_saturated: config.recompute_saturated }));
    }
    Ok(out)
}

/// What [`prepare`] did and how long it took.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub calibration_tokens: usize,
    /// The calibration was read from the cache directory (else computed, and saved there).
    pub calibration_cached: bool,
    pub calibrate_s: f64,
    pub quantize_s: f64,
    /// Building and finalizing (and storing), or loading from the cache.
    pub context_s: f64,
    /// Laying out the shadow sites' weights (and writing their cold rows).
    pub shadow_s: f64,
    pub shadow_sites: usize,
    pub cache: crate::backend::npu::cache::CacheOutcome,
    pub cache_file: Option<std::path::PathBuf>,
}

/// How the NPU path quantizes a model, and where shadow execution runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NpuQuant {
    /// 8 or 16-bit graph outputs.
    pub out_bits: u8,
    pub weights: WeightQuant,
    /// Shadow outlier execution, or none (every input over its whole calibrated range).
    pub shadow: Option<ShadowConfig>,
}

/// Shadow outlier execution's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShadowConfig {
    /// The share of sites, least important first, that run without it (llm.npu §3.5).
    pub prune: f64,
    /// Hot channels: the fewest that cover this share of calibration's outliers (§3.4).
    pub hot_coverage: f64,
    /// Recompute in float, on the CPU's weights, an output whose code is the first or last
    /// (the authors' code's output-side rule: the NPU may have saturated it).
    pub recompute_saturated: bool,
}

/// llm.npu's default pruning rate (§3.5): shadow execution in the 15% most important sites.
pub const PAPER_PRUNE: f64 = 0.85;

/// The pruning rate the NPU path uses unless told otherwise.
pub const DEFAULT_PRUNE: f64 = 0.5;

/// The share of calibration's outliers the hot channels cover (the paper: "fewer than 3% of
/// channels account for more than 80% of outliers").
pub const HOT_COVERAGE: f64 = 0.8;

impl Default for ShadowConfig {
    fn default() -> Self {
        Self { prune: DEFAULT_PRUNE, hot_coverage: HOT_COVERAGE, recompute_saturated: true }
    }
}

impl Default for NpuQuant {
    fn default() -> Self {
        Self { out_bits: 16, weights: WeightQuant::Folded, shadow: Some(ShadowConfig::default()) }
    }
}

/// A prepared NPU path: the context holding its graphs, the groups (with their int8 weights,
/// until [`NpuLinears::from_context`] takes them), the graphs' tensor ids, the shadow sites for
/// [`NpuLinears::set_shadow`], and what preparing did.
pub struct PreparedNpu<'b> {
    pub context: qnn_sys::api::Context<'b>,
    pub groups: Vec<LinearGroup>,
    pub ids: crate::backend::npu::cache::GraphIds,
    pub shadow: Vec<Option<ShadowSite>>,
    pub report: Prepared,
}

/// A model's NPU path, ready for [`NpuLinears::from_context`]: calibrated on `calibration`
/// (tokens), quantized as `q` says, its graphs at `chunk` rows loaded from `cache_dir`'s cache
/// file when a sound one is there, else built, finalized and stored there (no cache without a
/// directory), and its shadow sites' weights (cold rows in a file beside the cache file).
#[allow(clippy::too_many_arguments)]
pub fn prepare<'b>(
    lib: &qnn_sys::Library,
    backend: &'b qnn_sys::api::Backend<'_>,
    soc: u32,
    t: &Transformer,
    calibration: &[u32],
    chunk: usize,
    q: &NpuQuant,
    cache_dir: Option<&std::path::Path>,
) -> Result<PreparedNpu<'b>, EngineError> {
    let t0 = std::time::Instant::now();
    let (cal, calibration_cached) =
        calfile::load_or_calibrate(cache_dir, t, calibration, || calibrate(t, calibration))?;
    let calibrate_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let sites = match q.shadow {
        Some(s) => cal.shadow_sites(s.prune),
        None => vec![[false; 4]; cal.layers.len()],
    };
    let groups: Vec<LinearGroup> =
        quantized_groups(t, &cal, q.weights, q.out_bits, &sites)?.into_iter().flatten().collect();
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
    let context_s = t2.elapsed().as_secs_f64();
    let t3 = std::time::Instant::now();
    let cold = cache_file.as_ref().map(|f| f.with_extension("shadow"));
    let shadow = shadow_sites(t, &groups, &cal, &sites, &q.shadow.unwrap_or_default(), cold.as_deref())?;
    let report = Prepared {
        calibration_tokens: calibration.len(),
        calibration_cached,
        calibrate_s,
        quantize_s,
        context_s,
        shadow_s: t3.elapsed().as_secs_f64(),
        shadow_sites: shadow.iter().flatten().count(),
        cache,
        cache_file,
    };
    Ok(PreparedNpu { context, groups, ids, shadow, report })
}
