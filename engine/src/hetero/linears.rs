//! A model's linear layers on HeteroLLM's plan: every projection of every layer cut between the
//! NPU (fp16 graphs through QNN) and the GPU (OpenCL) as the plan says, both writing into the
//! projection's one output buffer; the rest of the pass — norms, RoPE, attention, SwiGLU, the
//! head — runs where the engine's planner puts it (the host). Implements the engine's
//! [`Linears`] hook, so the same pass code runs with or without it.
//!
//! The NPU's graphs are static, so the plan is made for a set of token counts up front (the
//! daemon's: the standard sizes and 1 for decode). A pass of another count is composed from
//! them as HeteroLLM's multi-sequence cut: its tokens in blocks of the planned sizes, largest
//! first, each block cut as planned for its size, the tokens left over (fewer than the
//! smallest size) all on the GPU — one set of pieces run at once into the one output buffer.
//! Only a pass too short for any planned size other than 1 goes to the planner instead
//! (`group` returns false). **Decision:** each projection of a group (Q, K, V; gate, up) is cut
//! on its own — the group shares its input, and the engine hands each projection its own
//! output buffer, so no merge is needed.

use super::exec::DeviceRunner;
use super::partition::{execute_synced, Cut, Piece, Processor, Segment};
use super::soc::Soc;
use super::solver::Op;
use super::solver::{Phase, Predicted, Solver};
use crate::backend::blocks::{CaptureSite, Linears};
use crate::backend::gpu::GpuDevice;
use crate::backend::npu::cache::CacheOutcome;
use crate::backend::npu::QnnDevice;
use crate::backend::weight::WeightMatrix;
use crate::error::{BackendError, NpuError};
use crate::model::Transformer;
use llmd_device::{Device, Executable, Preparation, Subgraph, WeightRole};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One projection: its weight, its processors, and its cut per token count.
struct Proj<'a> {
    w: &'a WeightMatrix,
    npu: DeviceRunner<'a>,
    gpu: DeviceRunner<'a>,
    cuts: HashMap<usize, Cut>,
}

/// Counters of what ran where.
#[derive(Debug, Default)]
pub struct HeteroStats {
    pub matmuls: AtomicU64,
    pub npu_pieces: AtomicU64,
    pub gpu_pieces: AtomicU64,
    pub split_matmuls: AtomicU64,
}

/// A model's projections on a plan (see the module).
pub struct HeteroLinears<'a> {
    layers: Vec<[Vec<Proj<'a>>; 4]>,
    pub stats: HeteroStats,
    /// The control plane's wait for the NPU's half of each cut matmul (predicted sleep, then
    /// polling its flag), predictions per projection kind and token count.
    pub sync: super::sync::FastSync,
}

/// One projection's part of a [`HeteroPlan`]: its cut per token count and the NPU graphs
/// (token count, rows) those cuts need.
struct PlannedProj {
    /// Layer, site (QKV, O, gate/up, down) and projection within the site.
    at: (usize, usize, usize),
    cuts: HashMap<usize, Cut>,
    shapes: Vec<(usize, std::ops::Range<usize>)>,
}

/// HeteroLLM's plan of a model before any graph exists: every projection's cut for each
/// planned token count, and so the NPU graphs to build — what the graph cache's key is made of.
pub struct HeteroPlan {
    projs: Vec<PlannedProj>,
}

impl HeteroPlan {
    /// Plans every projection of `model` for each of `token_counts` with `plan`.
    pub fn new(model: &Transformer, token_counts: &[usize], plan: &dyn Fn(&Op) -> Cut) -> Result<Self, NpuError> {
        let mut projs = Vec::new();
        // Every layer has the same shapes: each (tokens, in, out) is planned once.
        let mut planned: HashMap<(usize, usize, usize), Cut> = HashMap::new();
        for (li, l) in model.weights.layers.iter().enumerate() {
            for (si, ws) in sites(l).into_iter().enumerate() {
                for (pi, w) in ws.into_iter().enumerate() {
                    let mut cuts = HashMap::new();
                    let mut shapes = Vec::new();
                    for &m in token_counts.iter().filter(|&&m| m > 0) {
                        let op = Op { name: format!("l{li}.s{si}.p{pi}"), m, k: w.cols, n: w.rows };
                        let cut = planned.entry((m, w.cols, w.rows)).or_insert_with(|| plan(&op)).clone();
                        let pieces = cut
                            .pieces(m, w.rows)
                            .map_err(|e| NpuError::Shape { graph: op.name.clone(), detail: e.to_string() })?;
                        shapes.extend(
                            pieces
                                .into_iter()
                                .filter(|p| p.dev == Processor::Npu)
                                .map(|p| (p.graph.unwrap_or(m), p.rows)),
                        );
                        cuts.insert(m, cut);
                    }
                    projs.push(PlannedProj { at: (li, si, pi), cuts, shapes });
                }
            }
        }
        Ok(Self { projs })
    }

    /// Distinct NPU graphs the plan needs, in all.
    pub fn npu_graphs(&self) -> usize {
        self.projs.iter().map(|p| unique_count(&p.shapes)).sum()
    }

    /// The token counts the plan's NPU graphs take (what the NPU device must build for).
    pub fn npu_token_counts(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.projs.iter().flat_map(|p| p.shapes.iter().map(|s| s.0)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// A layer's projections by site (QKV, O, gate/up, down), by role.
const SITE_ROLES: [&[WeightRole]; 4] = [
    &[WeightRole::Wq, WeightRole::Wk, WeightRole::Wv],
    &[WeightRole::Wo],
    &[WeightRole::Gate, WeightRole::Up],
    &[WeightRole::Down],
];

/// A layer's projections by site.
fn sites(l: &crate::model::weights::LayerWeights) -> [Vec<&WeightMatrix>; 4] {
    SITE_ROLES.map(|roles| roles.iter().filter_map(|&r| l.matrix(r)).collect())
}

fn weight(model: &Transformer, (li, si, pi): (usize, usize, usize)) -> Option<&WeightMatrix> {
    let l = model.weights.layers.get(li)?;
    sites(l).get(si)?.get(pi).copied()
}

fn unique_count(shapes: &[(usize, std::ops::Range<usize>)]) -> usize {
    let set: std::collections::HashSet<(usize, usize, usize)> =
        shapes.iter().filter(|(m, r)| *m > 0 && !r.is_empty()).map(|(m, r)| (*m, r.start, r.end)).collect();
    set.len()
}

impl<'a> HeteroLinears<'a> {
    /// `plan`'s projections: the NPU's graphs of every projection prepared on `npu` in one
    /// call of the contract ([`QnnDevice::prepare_cached`], which says whether they came
    /// from its cache), the GPU's pieces prepared on `gpu` as they first run.
    pub fn new(
        model: &'a Transformer,
        npu: &Arc<QnnDevice>,
        gpu: &Arc<GpuDevice>,
        plan: &HeteroPlan,
    ) -> Result<(Self, Option<CacheOutcome>), NpuError> {
        let missing: Vec<usize> =
            plan.npu_token_counts().into_iter().filter(|&m| !npu.desc().static_shapes.allows(m)).collect();
        if !missing.is_empty() {
            return Err(NpuError::Shape {
                graph: "hetero".into(),
                detail: format!(
                    "the plan runs NPU graphs of {missing:?} tokens, which {} was not opened for (with_token_counts)",
                    npu.desc().name
                ),
            });
        }
        let npu_dev: Arc<dyn Device> = npu.clone();
        let gpu_dev: Arc<dyn Device> = gpu.clone();
        let mut projs = Vec::with_capacity(plan.projs.len());
        let mut items = Vec::new();
        let mut owners = Vec::new();
        for p in &plan.projs {
            let w = weight(model, p.at).ok_or_else(|| NpuError::Quantization(format!("no weight at {:?}", p.at)))?;
            let (li, si, pi) = p.at;
            let role = SITE_ROLES[si][pi];
            let npu_runner = DeviceRunner::new(npu_dev.clone(), w, role, model.shape);
            let mut seen = std::collections::HashSet::new();
            for (m, rows) in p.shapes.iter().filter(|(m, r)| *m > 0 && !r.is_empty()) {
                if !seen.insert((*m, rows.start, rows.end)) {
                    continue;
                }
                let weight = npu_runner.weight(rows).map_err(NpuError::Quantization)?;
                items.push(Preparation { subgraph: Subgraph::linear(li, role), n_tokens: *m, weights: vec![weight] });
                owners.push((projs.len(), (*m, rows.clone())));
            }
            let gpu_runner = DeviceRunner::new(gpu_dev.clone(), w, role, model.shape).keeping(p.cuts.keys().copied());
            projs.push((li, si, Proj { w, npu: npu_runner, gpu: gpu_runner, cuts: p.cuts.clone() }));
        }
        let (exes, outcome) = npu
            .prepare_cached(&model.shape, &items)
            .map_err(|e| NpuError::Shape { graph: "hetero".into(), detail: e.to_string() })?;
        drop(items);
        type Shaped = ((usize, std::ops::Range<usize>), Executable);
        let mut per_proj: Vec<Vec<Shaped>> = (0..projs.len()).map(|_| Vec::new()).collect();
        for ((i, shape), exe) in owners.into_iter().zip(exes) {
            per_proj[i].push((shape, exe));
        }
        let mut layers: Vec<[Vec<Proj<'a>>; 4]> = (0..model.weights.layers.len()).map(|_| Default::default()).collect();
        for ((li, si, mut proj), exes) in projs.into_iter().zip(per_proj) {
            proj.npu = proj.npu.with_executables(exes);
            // The graphs hold the NPU's copy of the rows.
            proj.npu.forget_weights();
            layers[li][si].push(proj);
        }
        Ok((Self { layers, stats: HeteroStats::default(), sync: super::sync::FastSync::new() }, outcome))
    }

    /// The token counts whose GPU buffers the projections keep between passes (the planned
    /// sizes; a composed pass's leftover count is not kept).
    pub fn gpu_kept_counts(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .layers
            .iter()
            .flat_map(|l| l.iter())
            .flat_map(|s| s.iter())
            .flat_map(|p| p.gpu.kept_counts())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// NPU graphs built in all.
    pub fn npu_graphs(&self) -> usize {
        self.layers.iter().flat_map(|l| l.iter()).flat_map(|s| s.iter()).map(|p| p.npu.executables()).sum()
    }

    /// The plan as data: per layer, site and projection, the cut for each planned token count
    /// (what the daemon stores per model, SoC and count).
    pub fn plan_json(&self) -> serde_json::Value {
        let sites = ["qkv", "o", "gate_up", "down"];
        let layers: Vec<serde_json::Value> = self
            .layers
            .iter()
            .map(|l| {
                let mut m = serde_json::Map::new();
                for (si, projs) in l.iter().enumerate() {
                    let v: Vec<serde_json::Value> = projs
                        .iter()
                        .map(|p| {
                            let mut cuts: Vec<(&usize, &Cut)> = p.cuts.iter().collect();
                            cuts.sort_by_key(|(k, _)| **k);
                            let cuts: serde_json::Map<String, serde_json::Value> = cuts
                                .into_iter()
                                .map(|(k, c)| {
                                    let v = serde_json::json!({"kind": c.kind(*k, p.w.rows).name(), "npu_rows": c.npu_rows, "npu": c.npu});
                                    (k.to_string(), v)
                                })
                                .collect();
                            serde_json::json!({"weight": p.w.name, "rows": p.w.rows, "cols": p.w.cols, "cuts": cuts})
                        })
                        .collect();
                    m.insert(sites[si].into(), v.into());
                }
                serde_json::Value::Object(m)
            })
            .collect();
        serde_json::json!({ "layers": layers })
    }
}

impl Proj<'_> {
    /// The pieces of a pass of `m` tokens (see the module): a planned count's own cut, else
    /// blocks of the planned sizes (largest first) and the rest on the GPU; None if no planned
    /// size above 1 fits.
    fn pieces(&self, m: usize) -> Option<Vec<Piece>> {
        let n = self.w.rows;
        if let Some(c) = self.cuts.get(&m) {
            return c.pieces(m, n).ok();
        }
        let mut sizes: Vec<usize> = self.cuts.keys().copied().filter(|&s| s > 1 && s <= m).collect();
        if sizes.is_empty() {
            return None;
        }
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::new();
        let mut at = 0;
        for &s in &sizes {
            while m - at >= s {
                for mut p in self.cuts[&s].pieces(s, n).ok()? {
                    p.tokens = p.tokens.start + at..p.tokens.end + at;
                    out.push(p);
                }
                at += s;
            }
        }
        if at < m {
            out.push(Piece { dev: Processor::Gpu, tokens: at..m, rows: 0..n, graph: None });
        }
        Some(out)
    }
}

/// The solver's cut on `soc` (prediction mode at `bits` per weight; decode for one token).
pub fn solver_cut(soc: &Soc, bits: f64, op: &Op) -> Cut {
    let prof = Predicted { soc, bits };
    let phase = if op.m == 1 { Phase::Decode } else { Phase::Prefill };
    Solver::new(&prof, soc, phase, true).solve(op).cut
}

/// A fixed cut of every matmul, to run the partitioned path whatever the solver would choose
/// for a model (a small one is GPU-only on a phone's profile): the NPU takes rows
/// `0..n/2` (a multiple of `align`, at least one `align`) of all tokens in one graph of
/// exactly `m` tokens — a row cut; the GPU the rest.
pub fn even_cut(op: &Op, align: usize) -> Cut {
    let a = align.max(1);
    let rows = (op.n / 2 / a * a).max(a).min(op.n);
    Cut { npu: vec![Segment { tokens: 0..op.m, graph: op.m }], npu_rows: rows }
}

impl Linears for HeteroLinears<'_> {
    fn group(
        &self,
        li: usize,
        site: CaptureSite,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<bool, BackendError> {
        let Some(projs) = self.layers.get(li).and_then(|l| l.get(site as usize)) else { return Ok(false) };
        if projs.len() != outs.len() {
            return Ok(false);
        }
        let Some(plans) = projs.iter().map(|p| p.pieces(n)).collect::<Option<Vec<_>>>() else { return Ok(false) };
        for (pi, ((p, out), pieces)) in projs.iter().zip(outs.iter_mut()).zip(plans).enumerate() {
            // Every layer runs the same operators: one prediction per site, projection and count.
            let key = format!("{}.{pi}.{n}", site as usize);
            execute_synced(&pieces, x, n, p.w.rows, out, &p.npu, &p.gpu, Some((&self.sync, &key)))
                .map_err(|e| BackendError::Device(format!("{}: {e}", p.w.name)))?;
            let npu = pieces.iter().filter(|q| q.dev == Processor::Npu).count() as u64;
            let gpu = pieces.len() as u64 - npu;
            self.stats.matmuls.fetch_add(1, Ordering::Relaxed);
            self.stats.npu_pieces.fetch_add(npu, Ordering::Relaxed);
            self.stats.gpu_pieces.fetch_add(gpu, Ordering::Relaxed);
            if npu > 0 && gpu > 0 {
                self.stats.split_matmuls.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(true)
    }
}
