//! llm.npu's prefill on the NPU path: a model's linear groups as W8A8 QNN graphs at a chunk size,
//! run as the NPU device's `Group` subgraphs in place of the CPU's matmuls ([`devices`]) while
//! norms, RoPE, attention (into the host KV cache), SwiGLU and the head stay on the CPU in
//! float — llm.npu's split. The CPU then decodes
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

use crate::backend::blocks::CaptureSite;
use crate::backend::npu::device::{NpuContext, QnnDevice};
use crate::backend::npu::graph::{LinearGroup, Projection};
use crate::backend::npu::linears::dequantize;
pub use crate::backend::npu::linears::{NpuLinears, ShadowSite, ShadowStats};
use crate::backend::npu::quant::{ActQuant, QuantWeights};
use crate::backend::npu::shadow::{hot_channels, ColdRows, ShadowWeights};
use crate::backend::weight::WeightMatrix;
use crate::backend::{OpDesc, OpKind};
use crate::error::{BackendError, EngineError, NpuError};
use crate::model::Transformer;
use std::sync::atomic::{AtomicU64, Ordering};

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
        t.forward_capture(&mut kv, part, crate::backend::blocks::Logits::Last, None, &mut |li, site, x, cols| {
            f(li, site, x, cols)
        })?;
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
        t.forward_capture(&mut kv, part, crate::backend::blocks::Logits::Last, None, &mut |li, site, x, cols| {
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
        out.push(Some(ShadowSite::new(weights, cpu, config.recompute_saturated)));
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
pub struct PreparedNpu {
    pub context: NpuContext,
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
pub fn prepare(
    device: &QnnDevice,
    t: &Transformer,
    calibration: &[u32],
    chunk: usize,
    q: &NpuQuant,
    cache_dir: Option<&std::path::Path>,
) -> Result<PreparedNpu, EngineError> {
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
            let key = crate::backend::npu::cache::key_for(device, &groups, chunk)?;
            let file = crate::backend::npu::cache::path_for(dir, &key)?;
            let (c, ids, outcome) = crate::backend::npu::cache::load_or_build(device, dir, &key, &groups, chunk)?;
            (c, ids, outcome, Some(file))
        }
        None => {
            let context = device.context()?;
            let ids = crate::backend::npu::cache::build_groups(&context, &groups, chunk)?;
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

/// The devices llm.npu's prefill runs on: `device` holding the model's W8A8 groups `groups`
/// (a graph of `device`'s per group: [`QnnDevice::group_weights`]), every linear group placed on
/// it ([`crate::sched::GroupsOnNpu`]) and every block on the host ([`crate::sched::HostBlocks`]):
/// norms, RoPE, attention into the host cache, SwiGLU and the head stay on the CPU.
pub fn devices(device: std::sync::Arc<QnnDevice>, groups: &std::sync::Arc<NpuLinears>) -> crate::model::Devices {
    let held = device.group_weights(groups);
    let devs = crate::model::Devices::new(vec![device], std::sync::Arc::new(crate::sched::HostBlocks))
        .with_splitter(std::sync::Arc::new(crate::sched::GroupsOnNpu));
    for (sg, ws) in held {
        devs.hold(1, sg, ws);
    }
    devs
}
