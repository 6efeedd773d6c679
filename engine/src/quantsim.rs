//! The accuracy of the NPU path's arithmetic, simulated on the host as llm.npu's authors measured
//! theirs (on a server, by simulated quantization): every linear group of a model run through
//! one quantization scheme — quantize, dequantize, multiply in f32 — so that each scheme's
//! perplexity and next-token agreement can be read on the same text (`llmctl npu-accuracy`,
//! llm.npu's Table 6 in kind). The NPU path itself ([`crate::prefill::NpuLinears`]) runs the
//! integer graphs; the shadow scheme here uses the same extraction and product code as it does
//! ([`crate::backend::npu::shadow`]).
//!
//! The schemes ([`Scheme`]):
//! - `Float`: the model's weights dequantized to f32, f32 activations (the reference).
//! - `W8`: int8 weights (per tensor, or per channel unless [`SimOptions::weights`] is
//!   per-tensor), f32 activations (the weights' share of the error).
//! - `W8A8`: the NPU path's int8 weights, 8-bit activations per tensor over the calibration's
//!   whole range, 16-bit outputs (the NPU path without shadow execution).
//! - `SmoothQuant`: activations divided and weights multiplied per input channel by
//!   `max|x_j|^α / max|W_j|^(1−α)`, then W8A8 (Xiao et al.; α = 0.5 in llm.npu's comparison).
//! - `LlmInt8`: LLM.int8()'s decomposition (Dettmers et al.): the input channels holding a value
//!   of magnitude ≥ the threshold (6.0) multiply in float with the float weights; the rest in
//!   int8 with one scale per token row and one per output channel.
//! - `Shadow`: llm.npu — W8A8 at the clipped range `±τ` plus the shadow product of the
//!   extracted outliers, in the sites calibration ranks most important; the pruned sites run
//!   W8A8 over their whole range (the authors' code) or clipped ([`Pruned`]). An NPU output
//!   that saturates its 16-bit range is recomputed in float (the authors' output-side rule).

use crate::backend::blocks::CaptureSite;
use crate::backend::cpu::sgemm::{sgemm, BLayout};
use crate::backend::npu::graph::LinearGroup;
use crate::backend::npu::linears::dequantize;
use crate::backend::npu::quant::{ActQuant, QuantWeights};
use crate::backend::npu::shadow::extract;
use crate::backend::npu::shadow::ShadowWeights;
use crate::error::{BackendError, NpuError};
use crate::model::Transformer;
use crate::prefill::{projections, quantized_groups, Calibration, WeightQuant, SITES};
use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Device, DeviceDesc, DeviceError, DeviceId, Event, Executable, GgmlType,
    HostWeight, MemoryDesc, MemoryKind, OpKind, Processor, StaticShapes, Subgraph, SubgraphKind, Weight,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What pruned sites do with their outliers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pruned {
    /// Quantize over the whole calibrated range (no clipping: llm.npu's authors' code).
    Widen,
    /// Clip at `±τ` and drop what is past it (the paper's "simply removed").
    Clip,
}

/// A quantization scheme for every linear group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scheme {
    Float,
    W8,
    W8A8,
    SmoothQuant { alpha: f32 },
    LlmInt8 { threshold: f32 },
    Shadow { prune: f64, pruned: Pruned },
}

impl Scheme {
    /// A short label for tables.
    pub fn label(&self) -> String {
        match self {
            Self::Float => "float".into(),
            Self::W8 => "W8 (int8 weights, float activations)".into(),
            Self::W8A8 => "W8A8 per tensor".into(),
            Self::SmoothQuant { alpha } => format!("SmoothQuant α={alpha}"),
            Self::LlmInt8 { threshold } => format!("LLM.int8() threshold {threshold}"),
            Self::Shadow { prune, pruned } => format!(
                "shadow, {:.0}% of sites pruned{}",
                prune * 100.0,
                match pruned {
                    Pruned::Widen => "",
                    Pruned::Clip => " (pruned sites clipped at τ)",
                }
            ),
        }
    }
}

/// The 16-bit outputs every NPU-like scheme gives (the NPU path's default).
pub const SIM_OUT_BITS: u8 = 16;

/// Settings shared by every scheme.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimOptions {
    /// How int8 weights are scaled (LLM.int8() always has one scale per output channel). The
    /// W8A8 and shadow schemes quantize exactly as the NPU path does ([`quantized_groups`]).
    pub weights: WeightQuant,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self { weights: WeightQuant::Folded }
    }
}

enum Input {
    Float,
    PerTensor(ActQuant),
    /// Clipped per tensor, outliers to the shadow product.
    Shadow(ActQuant),
    /// LLM.int8(): outlier channels (≥ threshold) in float, the rest per token row.
    Decomposed(f32),
}

struct Group {
    /// The projections' weights as the scheme multiplies them, `[n_total][k]`.
    w: Vec<f32>,
    /// Float weights (LLM.int8()'s outlier channels, saturated outputs), `[n_total][k]`.
    float_w: Option<Vec<f32>>,
    /// Rows per projection.
    segs: Vec<usize>,
    k: usize,
    input: Input,
    /// SmoothQuant: the input is divided by these, per channel.
    smooth: Option<Vec<f32>>,
    /// Each projection's output quantization (NPU-like schemes).
    outputs: Option<Vec<ActQuant>>,
    /// Per output column, the host's gain after dequantizing ([`WeightQuant::Folded`]).
    gains: Option<Vec<f32>>,
    /// The shadow product's weights (shadow sites).
    shadow: Option<ShadowWeights>,
}

/// Counters of a simulated run.
#[derive(Debug, Default)]
pub struct SimStats {
    pub groups: AtomicU64,
    pub shadow_groups: AtomicU64,
    pub outlier_elements: AtomicU64,
    pub outlier_channels: AtomicU64,
    pub saturated_outputs: AtomicU64,
    pub values: AtomicU64,
}

/// Every linear group of a model under one [`Scheme`].
pub struct SimLinears {
    layers: Vec<[Group; 4]>,
    threads: usize,
    pub stats: SimStats,
    pub shadow_sites: usize,
}

fn fake_quant(q: &ActQuant, x: &[f32], out: &mut [f32]) {
    let inv = 1.0 / q.scale;
    let top = q.max_code() as f32;
    for (o, &v) in out.iter_mut().zip(x) {
        let c = ((v * inv).round() + q.zero_point as f32).clamp(0.0, top);
        *o = q.scale * (c - q.zero_point as f32);
    }
}

fn dequantized(q: &QuantWeights) -> Vec<f32> {
    let mut out = Vec::with_capacity(q.q.len());
    for (o, row) in q.q.chunks_exact(q.cols).enumerate() {
        let s = q.scales.of(o);
        out.extend(row.iter().map(|&v| f32::from(v) * s));
    }
    out
}

impl SimLinears {
    /// Every group of `t` under `scheme`, with `cal`'s ranges; products on `threads` threads.
    pub fn new(
        t: &Transformer,
        cal: &Calibration,
        scheme: Scheme,
        opts: SimOptions,
        threads: usize,
    ) -> Result<Self, NpuError> {
        if cal.layers.len() != t.config.n_layers {
            return Err(NpuError::Quantization(format!(
                "the calibration has {} layers, the model {}",
                cal.layers.len(),
                t.config.n_layers
            )));
        }
        let shadow = match scheme {
            Scheme::Shadow { prune, .. } => cal.shadow_sites(prune),
            _ => vec![[false; 4]; cal.layers.len()],
        };
        let shadow_sites = shadow.iter().flatten().filter(|&&b| b).count();
        // The NPU path's own quantization for the schemes it runs.
        let npu = match scheme {
            Scheme::W8A8 => Some(quantized_groups(t, cal, opts.weights, SIM_OUT_BITS, &shadow)?),
            Scheme::Shadow { pruned: Pruned::Widen, .. } => {
                Some(quantized_groups(t, cal, opts.weights, SIM_OUT_BITS, &shadow)?)
            }
            Scheme::Shadow { pruned: Pruned::Clip, .. } => {
                Some(quantized_groups(t, cal, opts.weights, SIM_OUT_BITS, &vec![[true; 4]; cal.layers.len()])?)
            }
            _ => None,
        };
        let mut npu = npu.map(|v| v.into_iter());
        let mut layers = Vec::with_capacity(cal.layers.len());
        for (li, sh) in shadow.iter().enumerate() {
            let lgs = npu.as_mut().and_then(|it| it.next());
            let mut lgs = lgs.map(|l| l.into_iter());
            let mut groups = Vec::with_capacity(4);
            for site in SITES {
                let g = match lgs.as_mut().and_then(|it| it.next()) {
                    Some(lg) => Self::from_npu(t, li, site, lg, sh[site as usize])?,
                    None => Self::group(t, cal, scheme, opts, li, site)?,
                };
                groups.push(g);
            }
            layers.push(groups.try_into().map_err(|_| NpuError::Quantization("four groups per layer".into()))?);
        }
        Ok(Self { layers, threads: threads.max(1), stats: SimStats::default(), shadow_sites })
    }

    /// A group the NPU path quantized: its codes times their scales, and the shadow product's
    /// weights where `shadow`.
    fn from_npu(
        t: &Transformer,
        li: usize,
        site: CaptureSite,
        g: LinearGroup,
        shadow: bool,
    ) -> Result<Group, NpuError> {
        let k = g.k();
        let segs: Vec<usize> = g.projections.iter().map(|p| p.weights.rows).collect();
        let mut w = Vec::with_capacity(segs.iter().sum::<usize>() * k);
        for p in &g.projections {
            w.extend(dequantized(&p.weights));
        }
        let gains: Option<Vec<f32>> = if g.projections.iter().any(|p| p.gain.is_some()) {
            Some(
                g.projections
                    .iter()
                    .flat_map(|p| p.gain.clone().unwrap_or_else(|| vec![1.0; p.weights.rows]))
                    .collect(),
            )
        } else {
            None
        };
        let (sw, float_w) = if shadow {
            let projs: Vec<(&QuantWeights, Option<&[f32]>)> =
                g.projections.iter().map(|p| (&p.weights, p.gain.as_deref())).collect();
            let cm = ShadowWeights::channel_major(&projs)?;
            let sw = ShadowWeights::new(&cm, k, &vec![true; k], None)?;
            let mut float = Vec::new();
            for (_, m) in projections(t, li, site) {
                float.extend(dequantize(m)?);
            }
            (Some(sw), Some(float))
        } else {
            (None, None)
        };
        Ok(Group {
            w,
            float_w,
            segs,
            k,
            input: if shadow { Input::Shadow(g.input) } else { Input::PerTensor(g.input) },
            smooth: None,
            outputs: Some(g.projections.iter().map(|p| p.output).collect()),
            gains,
            shadow: sw,
        })
    }

    fn group(
        t: &Transformer,
        cal: &Calibration,
        scheme: Scheme,
        opts: SimOptions,
        li: usize,
        site: CaptureSite,
    ) -> Result<Group, NpuError> {
        let r = &cal.layers[li][site as usize];
        let projs = projections(t, li, site);
        let k = projs.first().map_or(0, |p| p.1.cols);
        let segs: Vec<usize> = projs.iter().map(|p| p.1.rows).collect();
        let mut float = Vec::with_capacity(segs.iter().sum::<usize>() * k);
        for (_, m) in &projs {
            float.extend(dequantize(m)?);
        }
        let per_tensor = |w: &[f32], segs: &[usize]| -> Result<Vec<f32>, NpuError> {
            let mut out = Vec::with_capacity(w.len());
            let mut at = 0;
            for &rows in segs {
                out.extend(dequantized(&QuantWeights::quantize(
                    &w[at..at + rows * k],
                    rows,
                    k,
                    opts.weights != WeightQuant::PerTensor,
                )?));
                at += rows * k;
            }
            Ok(out)
        };
        let outputs = || -> Result<Vec<ActQuant>, NpuError> {
            r.outputs.iter().map(|&(lo, hi)| ActQuant::from_range_bits(lo, hi, SIM_OUT_BITS)).collect()
        };
        Ok(match scheme {
            Scheme::Float => Group {
                w: float,
                float_w: None,
                segs,
                k,
                input: Input::Float,
                smooth: None,
                outputs: None,
                gains: None,
                shadow: None,
            },
            Scheme::W8 => Group {
                w: per_tensor(&float, &segs)?,
                float_w: None,
                segs,
                k,
                input: Input::Float,
                smooth: None,
                outputs: None,
                gains: None,
                shadow: None,
            },
            Scheme::SmoothQuant { alpha } => {
                let mut wmax = vec![0f32; k];
                for row in float.chunks_exact(k.max(1)) {
                    for (m, &v) in wmax.iter_mut().zip(row) {
                        *m = m.max(v.abs());
                    }
                }
                let s: Vec<f32> = (0..k)
                    .map(|j| {
                        let xm = r
                            .channel_min
                            .get(j)
                            .map_or(0.0, |v| v.abs())
                            .max(r.channel_max.get(j).map_or(0.0, |v| v.abs()));
                        let v = xm.max(1e-5).powf(alpha) / wmax[j].max(1e-5).powf(1.0 - alpha);
                        if v.is_finite() && v > 0.0 {
                            v
                        } else {
                            1.0
                        }
                    })
                    .collect();
                let mut scaled = float;
                for row in scaled.chunks_exact_mut(k.max(1)) {
                    for (v, sj) in row.iter_mut().zip(&s) {
                        *v *= sj;
                    }
                }
                let (mut lo, mut hi) = (0f32, 0f32);
                for (j, sj) in s.iter().enumerate() {
                    lo = lo.min(r.channel_min.get(j).copied().unwrap_or(0.0) / sj);
                    hi = hi.max(r.channel_max.get(j).copied().unwrap_or(0.0) / sj);
                }
                Group {
                    w: per_tensor(&scaled, &segs)?,
                    float_w: None,
                    segs,
                    k,
                    input: Input::PerTensor(ActQuant::from_range(lo, hi)?),
                    smooth: Some(s),
                    outputs: Some(outputs()?),
                    gains: None,
                    shadow: None,
                }
            }
            Scheme::LlmInt8 { threshold } => {
                let n: usize = segs.iter().sum();
                let w = dequantized(&QuantWeights::quantize(&float, n, k, true)?);
                Group {
                    w,
                    float_w: Some(float),
                    segs,
                    k,
                    input: Input::Decomposed(threshold),
                    smooth: None,
                    outputs: None,
                    gains: None,
                    shadow: None,
                }
            }
            // Built from the NPU path's own groups in `new`.
            Scheme::W8A8 | Scheme::Shadow { .. } => {
                return Err(NpuError::Quantization("W8A8 and shadow groups come from quantized_groups".into()))
            }
        })
    }

    fn run(&self, g: &Group, x: &[f32], n: usize) -> Vec<f32> {
        let (k, nt) = (g.k, g.segs.iter().sum::<usize>());
        let mut y = vec![0f32; n * nt];
        let smoothed;
        let x = match &g.smooth {
            Some(s) => {
                smoothed =
                    x.chunks_exact(k).flat_map(|row| row.iter().zip(s).map(|(v, s)| v / s)).collect::<Vec<f32>>();
                &smoothed[..]
            }
            None => x,
        };
        self.stats.values.fetch_add(x.len() as u64, Ordering::Relaxed);
        match &g.input {
            Input::Float => sgemm(n, k, nt, x, &g.w, BLayout::NByK, &mut y, false, self.threads),
            Input::PerTensor(q) | Input::Shadow(q) => {
                let mut xq = vec![0f32; x.len()];
                fake_quant(q, x, &mut xq);
                sgemm(n, k, nt, &xq, &g.w, BLayout::NByK, &mut y, false, self.threads);
            }
            Input::Decomposed(thr) => {
                let mut cols = vec![false; k];
                for row in x.chunks_exact(k) {
                    for (c, v) in cols.iter_mut().zip(row) {
                        *c |= v.abs() >= *thr;
                    }
                }
                let mut xq = vec![0f32; x.len()];
                for (row, out) in x.chunks_exact(k).zip(xq.chunks_exact_mut(k)) {
                    let amax = row.iter().zip(&cols).filter(|(_, &c)| !c).fold(0f32, |m, (v, _)| m.max(v.abs()));
                    let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                    for ((o, &v), &c) in out.iter_mut().zip(row).zip(&cols) {
                        *o = if c { 0.0 } else { (v / s).round().clamp(-127.0, 127.0) * s };
                    }
                }
                sgemm(n, k, nt, &xq, &g.w, BLayout::NByK, &mut y, false, self.threads);
                let chans: Vec<usize> = (0..k).filter(|&c| cols[c]).collect();
                if let (false, Some(fw)) = (chans.is_empty(), &g.float_w) {
                    self.stats.outlier_channels.fetch_add(chans.len() as u64, Ordering::Relaxed);
                    let a: Vec<f32> = x.chunks_exact(k).flat_map(|row| chans.iter().map(|&c| row[c])).collect();
                    let b: Vec<f32> = chans.iter().flat_map(|&c| (0..nt).map(move |o| fw[o * k + c])).collect();
                    sgemm(n, chans.len(), nt, &a, &b, BLayout::KByN, &mut y, true, self.threads);
                }
            }
        }
        // The NPU's output codes, dequantized (and each channel's gain applied).
        let mut saturated = vec![false; y.len()];
        if let Some(outs) = &g.outputs {
            for (row, sat) in y.chunks_exact_mut(nt).zip(saturated.chunks_exact_mut(nt)) {
                let mut at = 0;
                for (&len, q) in g.segs.iter().zip(outs) {
                    let lo = q.scale * (0 - q.zero_point) as f32;
                    let hi = q.scale * (q.max_code() - q.zero_point) as f32;
                    let mut tmp = vec![0f32; len];
                    fake_quant(q, &row[at..at + len], &mut tmp);
                    for ((v, t), s) in row[at..at + len].iter_mut().zip(&tmp).zip(&mut sat[at..at + len]) {
                        // The first or last code, unless it is the zero point (the NPU path's rule).
                        *s = (*v < lo + q.scale * 0.5 && q.zero_point != 0)
                            || (*v > hi - q.scale * 0.5 && q.zero_point != q.max_code());
                        *v = *t;
                    }
                    at += len;
                }
                if let Some(gains) = &g.gains {
                    for (v, gn) in row.iter_mut().zip(gains) {
                        *v *= gn;
                    }
                }
            }
        }
        if let (Input::Shadow(q), Some(sw)) = (&g.input, &g.shadow) {
            self.stats.shadow_groups.fetch_add(1, Ordering::Relaxed);
            let o = extract(x, k, q);
            self.stats.outlier_elements.fetch_add(o.elements as u64, Ordering::Relaxed);
            self.stats.outlier_channels.fetch_add(o.channels.len() as u64, Ordering::Relaxed);
            let prod = if o.elements > 0 { sw.product(&o, self.threads).ok() } else { None };
            for (i, v) in y.iter_mut().enumerate() {
                if saturated[i] {
                    // The NPU saturated: the whole product in float, on the CPU's weights.
                    if let Some(fw) = &g.float_w {
                        let (r, j) = (i / nt, i % nt);
                        *v = x[r * k..(r + 1) * k].iter().zip(&fw[j * k..(j + 1) * k]).map(|(a, b)| a * b).sum();
                    }
                    self.stats.saturated_outputs.fetch_add(1, Ordering::Relaxed);
                } else if let Some(p) = &prod {
                    *v += p[i];
                }
            }
        } else {
            self.stats.saturated_outputs.fetch_add(saturated.iter().filter(|&&s| s).count() as u64, Ordering::Relaxed);
        }
        y
    }
}

impl SimLinears {
    /// Group `site` of layer `li` over `n` rows of `x` into `outs` (one per projection, `n`
    /// rows each), under the scheme: the body of [`SimDevice`]'s `Group` executables.
    pub(crate) fn run_group(
        &self,
        li: usize,
        site: CaptureSite,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), BackendError> {
        let g = self.layers.get(li).map(|l| &l[site as usize]).ok_or_else(|| BackendError::Shape {
            op: "simulated linear group",
            detail: format!("no layer {li} in {} simulated layers", self.layers.len()),
        })?;
        if x.len() != n * g.k || outs.len() != g.segs.len() || outs.iter().zip(&g.segs).any(|(o, &r)| o.len() != n * r)
        {
            return Err(BackendError::Shape {
                op: "simulated linear group",
                detail: format!("{} values for {n} rows of {}", x.len(), g.k),
            });
        }
        self.stats.groups.fetch_add(1, Ordering::Relaxed);
        let y = self.run(g, x, n);
        let nt: usize = g.segs.iter().sum();
        for r in 0..n {
            let mut at = 0;
            for (o, &len) in outs.iter_mut().zip(&g.segs) {
                o[r * len..(r + 1) * len].copy_from_slice(&y[r * nt + at..r * nt + at + len]);
                at += len;
            }
        }
        Ok(())
    }

    /// Group `site` of layer `li`'s input width and its projections' rows.
    pub(crate) fn group_shape(&self, li: usize, site: CaptureSite) -> Option<(usize, Vec<usize>)> {
        self.layers.get(li).map(|l| &l[site as usize]).map(|g| (g.k, g.segs.clone()))
    }

    /// Layers simulated.
    pub(crate) fn layers(&self) -> usize {
        self.layers.len()
    }
}

/// A scheme's simulated groups as a device of the contract: it takes only `Group` subgraphs,
/// each over the weights [`SimDevice::group_weights`] hands out (its simulation of that group),
/// in host memory — so a pass under a scheme is a placement like any other (every group on
/// this device, every block on the host: [`devices`]), run by the engine's executor.
pub struct SimDevice {
    id: DeviceId,
    desc: DeviceDesc,
    sim: Arc<SimLinears>,
}

/// A group's weights on a [`SimDevice`]: which group of its simulation.
struct SimGroup {
    layer: usize,
    site: CaptureSite,
}

impl SimDevice {
    /// The device running `sim`'s groups; `label` names its scheme.
    pub fn new(sim: Arc<SimLinears>, label: &str) -> Self {
        let desc = DeviceDesc {
            name: format!("quantsim ({label})"),
            // It stands in for the NPU's arithmetic: the splitter gives it the groups.
            processor: Processor::Npu,
            available: true,
            ops: vec![OpKind::MatMul],
            weight_types: GgmlType::ALL.to_vec(),
            max_tokens: None,
            static_shapes: StaticShapes::Any,
            memory: MemoryDesc { kind: MemoryKind::Unified, capacity: None },
            threads: sim.threads,
        };
        Self { id: DeviceId::fresh(), desc, sim }
    }

    /// Each group of the simulation as this device's weights of its `Group` subgraph.
    pub fn group_weights(&self) -> Vec<(Subgraph, Vec<Weight>)> {
        let mut out = Vec::with_capacity(self.sim.layers() * 4);
        for layer in 0..self.sim.layers() {
            for site in CaptureSite::ALL {
                let Some((cols, rows)) = self.sim.group_shape(layer, site) else { continue };
                let ws = site
                    .roles()
                    .iter()
                    .zip(&rows)
                    .map(|(&role, &n)| Weight::new(self.id, role, 0..n, cols, 0, Arc::new(SimGroup { layer, site })))
                    .collect();
                out.push((Subgraph::group(layer, site), ws));
            }
        }
        out
    }

    fn invalid(&self, detail: impl Into<String>) -> DeviceError {
        DeviceError::Invalid { device: self.desc.name.clone(), detail: detail.into() }
    }

    fn mem<'a>(&self, b: &'a Buffer) -> Result<&'a llmd_device::host::HostBytes, DeviceError> {
        llmd_device::host::bytes(self.id, &self.desc.name, b)
    }
}

impl Device for SimDevice {
    fn id(&self) -> DeviceId {
        self.id
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError> {
        llmd_device::host::alloc(self.id, &self.desc.name, usage, bytes)
    }

    fn write(&self, dst: &Buffer, offset: usize, src: &[u8], after: &[Event]) -> Result<Event, DeviceError> {
        llmd_device::host::write(self.id, &self.desc.name, dst, offset, src, after)
    }

    fn read(&self, src: &Buffer, offset: usize, dst: &mut [u8], after: &[Event]) -> Result<(), DeviceError> {
        llmd_device::host::read(self.id, &self.desc.name, src, offset, dst, after)
    }

    fn load_weight(&self, w: &HostWeight<'_>, _rows: std::ops::Range<usize>) -> Result<Weight, DeviceError> {
        Err(DeviceError::Unsupported {
            device: self.desc.name.clone(),
            what: format!("{:?} from a file (its weights are its scheme's groups: group_weights)", w.role),
        })
    }

    fn prepare(&self, sg: Subgraph, _: &BlockShape, n: usize, weights: &[Weight]) -> Result<Executable, DeviceError> {
        let SubgraphKind::Group(site) = sg.kind else {
            return Err(DeviceError::Unsupported { device: self.desc.name.clone(), what: format!("{sg:?}") });
        };
        let roles = site.roles();
        if weights.len() != roles.len() || weights.iter().zip(roles).any(|(w, r)| w.role != *r) {
            return Err(self.invalid(format!("{sg:?} takes the weights {roles:?}")));
        }
        for w in weights {
            let g = w.get::<SimGroup>(self.id).ok_or_else(|| self.invalid("a weight of another device"))?;
            if (g.layer, g.site) != (sg.layer, site) {
                return Err(self.invalid(format!("{sg:?} given layer {}'s {:?} group", g.layer, g.site)));
            }
        }
        Ok(Executable::new(self.id, sg, n, Arc::new(SimGroup { layer: sg.layer, site })))
    }

    fn submit(&self, exe: &Executable, bind: &Bindings, after: &[Event]) -> Result<Event, DeviceError> {
        let g = exe.get::<SimGroup>(self.id).ok_or_else(|| self.invalid("an executable of another device"))?;
        Event::wait_all(after)?;
        let y = bind.y.as_ref().ok_or_else(|| self.invalid("a Group subgraph without an output buffer"))?;
        let (xm, ym) = (self.mem(&bind.x)?, self.mem(y)?);
        if std::ptr::eq(xm, ym) {
            return Err(self.invalid("a Group subgraph bound to one buffer for its input and its outputs"));
        }
        // A group runs the rows it is bound to (the contract's rule).
        let n = bind.positions.len();
        let (k, rows) = self.sim.group_shape(g.layer, g.site).ok_or_else(|| self.invalid("no such group"))?;
        let total: usize = rows.iter().map(|r| n * r).sum();
        let fail = |e: BackendError| DeviceError::Execution { device: self.desc.name.clone(), detail: e.to_string() };
        // The buffers' bytes as f32 in place (the host's little-endian bytes; a `Vec<u8>` of
        // f32 rows is aligned in practice), else through copies.
        let xb = llmd_device::host::lock(xm);
        let src = xb.get(..n * k * 4).ok_or_else(|| self.invalid(format!("x is shorter than {n} rows of {k}")))?;
        let copied: Vec<f32>;
        let x: &[f32] = match bytemuck::try_cast_slice(src) {
            Ok(x) => x,
            Err(_) => {
                copied = src.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                &copied
            }
        };
        let mut yb = llmd_device::host::lock(ym);
        let dst = yb.get_mut(..total * 4).ok_or_else(|| self.invalid(format!("y is shorter than {total} outputs")))?;
        let mut staged: Vec<f32> = Vec::new();
        let in_place = bytemuck::try_cast_slice_mut::<u8, f32>(&mut dst[..]).is_ok();
        let out: &mut [f32] = if in_place {
            bytemuck::cast_slice_mut(&mut dst[..])
        } else {
            staged.resize(total, 0.0);
            &mut staged
        };
        let mut views: Vec<&mut [f32]> = Vec::with_capacity(rows.len());
        let mut rest = out;
        for &r in &rows {
            let (v, tail) = std::mem::take(&mut rest).split_at_mut(n * r);
            views.push(v);
            rest = tail;
        }
        self.sim.run_group(g.layer, g.site, x, n, &mut views).map_err(fail)?;
        if !in_place {
            for (d, v) in dst.chunks_exact_mut(4).zip(&staged) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ok(Event::ready(Ok(())))
    }
}

/// The devices a pass under a simulated scheme runs on: `device` holding every group of its
/// simulation, every group placed on it ([`crate::sched::GroupsOnNpu`]) and every block on the
/// host ([`crate::sched::HostBlocks`]) — llm.npu's split, with the scheme's arithmetic.
pub fn devices(device: Arc<SimDevice>) -> crate::model::Devices {
    let held = device.group_weights();
    let devs = crate::model::Devices::new(vec![device], Arc::new(crate::sched::HostBlocks))
        .with_splitter(Arc::new(crate::sched::GroupsOnNpu));
    for (sg, ws) in held {
        devs.hold(1, sg, ws);
    }
    devs
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::backend::blocks::Logits;

    /// A scheme on the executor: every group of every layer runs on the `SimDevice` (its own
    /// counter and the executor's agree), the float scheme's logits stay within the quantized
    /// kernels' distance of the plain pass, and the device refuses what is not its groups with
    /// typed errors.
    #[test]
    fn a_scheme_runs_as_the_group_device_of_a_placed_pass_and_refuses_other_work() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-qwen2.gguf");
        let m = crate::Model::load(std::path::Path::new(path), &Default::default()).unwrap();
        let t = &m.transformer;
        let tokens: Vec<u32> = (1..40).collect();
        let cal = crate::prefill::calibrate(t, &tokens).unwrap();
        let sim = Arc::new(SimLinears::new(t, &cal, Scheme::Float, SimOptions::default(), 1).unwrap());
        let dev = Arc::new(SimDevice::new(sim.clone(), "float"));
        let devs = devices(dev.clone());
        let mut kv = t.new_kv();
        let got = t.run(&mut [(&mut kv, &tokens[..9])], crate::model::Run::LAST.on(&devs)).unwrap().pop().unwrap();
        let groups = (t.config.n_layers * 4) as u64;
        assert_eq!(sim.stats.groups.load(Ordering::Relaxed), groups);
        assert_eq!(devs.stats.groups.load(Ordering::Relaxed), groups);
        assert_eq!(kv.len(), 9);
        let want = t.forward(&mut t.new_kv(), &tokens[..9], Logits::Last).unwrap();
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        // The float scheme multiplies the dequantized weights in f32 (sgemm); the fixture's
        // weights are float, so the CPU's kernels differ from it only in summation order
        // (measured here: 3.8e-6).
        const FLOAT_VS_KERNELS: f32 = 1e-4;
        eprintln!("float scheme vs the kernels: worst logit difference {worst:.2e}");
        assert!(worst < FLOAT_VS_KERNELS, "{worst}");
        // Typed refusals.
        let shape = t.shape;
        let w = &t.weights.layers[0].wq;
        let hw = HostWeight {
            role: llmd_device::WeightRole::Wq,
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            data: &[],
            host: None,
        };
        assert!(matches!(dev.load_weight(&hw, 0..1), Err(DeviceError::Unsupported { .. })));
        assert!(matches!(dev.prepare(Subgraph::attention(0), &shape, 4, &[]), Err(DeviceError::Unsupported { .. })));
        let held = dev.group_weights();
        let (sg0, w0) = &held[0];
        let other = Subgraph::group(1, CaptureSite::Qkv);
        assert!(matches!(dev.prepare(other, &shape, 4, w0), Err(DeviceError::Invalid { .. })));
        assert!(matches!(dev.prepare(*sg0, &shape, 4, &w0[..1]), Err(DeviceError::Invalid { .. })));
        let exe = dev.prepare(*sg0, &shape, 4, w0).unwrap();
        let one = dev.alloc(BufferUsage::Activations, 1 << 16).unwrap();
        let rows: Arc<[u32]> = vec![0u32; 4].into();
        let both = Bindings {
            x: one.clone(),
            tokens: rows.clone(),
            positions: rows,
            seqs: Arc::from(Vec::new()),
            logit_rows: Arc::from(Vec::new()),
            logits: None,
            y: Some(one),
            h: None,
        };
        assert!(matches!(dev.submit(&exe, &both, &[]), Err(DeviceError::Invalid { .. })));
    }
}
