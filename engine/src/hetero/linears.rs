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

use super::exec::{f16_rows, GpuRunner, NpuF16Runner};
use super::partition::{execute_synced, Cut, Piece, Processor, Segment};
use super::soc::Soc;
use super::solver::Op;
use super::solver::{Phase, Predicted, Solver};
use crate::backend::blocks::{CaptureSite, Linears};
use crate::backend::gpu::GpuDevice;
use crate::backend::npu::cache::GraphIds;
use crate::backend::npu::NpuContext;
use crate::backend::weight::WeightMatrix;
use crate::error::{BackendError, NpuError};
use crate::model::Transformer;
use llmd_device::WeightRole;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// One projection: its weight, its processors, and its cut per token count.
struct Proj<'a> {
    w: &'a WeightMatrix,
    npu: NpuF16Runner,
    gpu: GpuRunner<'a>,
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

    /// Feeds `f` what the NPU's graphs are made of — each graph's name and shape and its
    /// matrix's weights (the file's bytes, or its rows read one by one) — for the graph cache's
    /// key: another model, plan or weight gives another key.
    pub fn content(&self, model: &Transformer, f: &mut dyn FnMut(&[u8])) -> Result<(), NpuError> {
        let mut row = Vec::new();
        for p in self.projs.iter().filter(|p| !p.shapes.is_empty()) {
            let w = weight(model, p.at).ok_or_else(|| NpuError::Quantization(format!("no weight at {:?}", p.at)))?;
            f(projection_name(p.at).as_bytes());
            for (m, rows) in &p.shapes {
                for v in [*m, rows.start, rows.end, w.cols] {
                    f(&(v as u64).to_le_bytes());
                }
            }
            f(w.name.as_bytes());
            match w.source_bytes() {
                Some(b) => f(b),
                None => {
                    for r in 0..w.rows {
                        w.read_row(r, &mut row)
                            .map_err(|e| NpuError::Quantization(format!("{}: row {r}: {e}", w.name)))?;
                        f(&row);
                    }
                }
            }
        }
        Ok(())
    }

    /// Builds and finalizes every NPU graph of the plan in `context`, returning their tensor
    /// ids in the order [`HeteroLinears::from_context`] retrieves them.
    pub fn build_graphs(&self, model: &Transformer, context: &NpuContext) -> Result<GraphIds, NpuError> {
        let mut ids = Vec::new();
        for p in self.projs.iter().filter(|p| !p.shapes.is_empty()) {
            let w = weight(model, p.at).ok_or_else(|| NpuError::Quantization(format!("no weight at {:?}", p.at)))?;
            let w16 = f16_rows(w, 0..w.rows).map_err(NpuError::Quantization)?;
            ids.extend(NpuF16Runner::build_ids(
                context,
                &projection_name(p.at),
                &w16,
                w.cols,
                p.shapes.iter().cloned(),
            )?);
        }
        Ok(ids)
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

fn projection_name((li, si, pi): (usize, usize, usize)) -> String {
    format!("l{li}_s{si}_p{pi}")
}

fn unique_count(shapes: &[(usize, std::ops::Range<usize>)]) -> usize {
    let set: std::collections::HashSet<(usize, usize, usize)> =
        shapes.iter().filter(|(m, r)| *m > 0 && !r.is_empty()).map(|(m, r)| (*m, r.start, r.end)).collect();
    set.len()
}

impl<'a> HeteroLinears<'a> {
    /// Plans every projection of `model` for each of `token_counts` with `plan` and builds the
    /// NPU graphs the plans need in `context` (its owning thread: this one) and loads the GPU's
    /// row ranges lazily on `gpu`.
    pub fn build(
        model: &'a Transformer,
        context: &NpuContext,
        gpu: &'a GpuDevice,
        token_counts: &[usize],
        plan: &dyn Fn(&Op) -> Cut,
    ) -> Result<Self, NpuError> {
        let plan = HeteroPlan::new(model, token_counts, plan)?;
        let ids = plan.build_graphs(model, context)?;
        Self::from_context(model, context, gpu, &plan, &ids)
    }

    /// `plan`'s projections over the NPU graphs already in `context` — built in this process
    /// ([`HeteroPlan::build_graphs`]) or loaded from the graph cache — by their tensor ids.
    pub fn from_context(
        model: &'a Transformer,
        context: &NpuContext,
        gpu: &'a GpuDevice,
        plan: &HeteroPlan,
        ids: &[(u32, Vec<u32>)],
    ) -> Result<Self, NpuError> {
        let mut layers: Vec<[Vec<Proj<'a>>; 4]> = (0..model.weights.layers.len()).map(|_| Default::default()).collect();
        let mut at = 0usize;
        for p in &plan.projs {
            let w = weight(model, p.at).ok_or_else(|| NpuError::Quantization(format!("no weight at {:?}", p.at)))?;
            let n = unique_count(&p.shapes);
            let mine = ids.get(at..at + n).ok_or_else(|| NpuError::Shape {
                graph: projection_name(p.at),
                detail: format!("{} graph ids for more graphs", ids.len()),
            })?;
            at += n;
            let npu = NpuF16Runner::retrieve(context, &projection_name(p.at), w.cols, p.shapes.iter().cloned(), mine)?;
            let (li, si, _) = p.at;
            let role = SITE_ROLES[si][p.at.2];
            let gpu = GpuRunner::new(gpu, w, role, model.shape).keeping(p.cuts.keys().copied());
            layers[li][si].push(Proj { w, npu, gpu, cuts: p.cuts.clone() });
        }
        if at != ids.len() {
            return Err(NpuError::Shape {
                graph: "hetero".into(),
                detail: format!("{} graph ids for {at} graphs", ids.len()),
            });
        }
        Ok(Self { layers, stats: HeteroStats::default(), sync: super::sync::FastSync::new() })
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
        self.layers.iter().flat_map(|l| l.iter()).flat_map(|s| s.iter()).map(|p| p.npu.graphs()).sum()
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
