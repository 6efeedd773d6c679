//! HeteroLLM's plan of a model: every projection of every layer cut between the NPU (fp16
//! graphs) and the GPU, for a set of token counts decided up front — the scheduler's
//! [`Splitter`]. The executor (`model/split.rs`) runs the cuts through the device contract;
//! the rest of the pass — norms, RoPE, attention, SwiGLU, the head — runs where the
//! placement puts it.
//!
//! The NPU's graphs are static, so the plan is made for a set of token counts (the daemon's:
//! the standard sizes and 1 for decode). A pass of another count is composed from them as
//! HeteroLLM's multi-sequence cut: its tokens in blocks of the planned sizes, largest first,
//! each block cut as planned for its size, the tokens left over (fewer than the smallest size)
//! all on the GPU. Only a pass too short for any planned size other than 1 is left whole.
//! **Decision:** each projection of a group (Q, K, V; gate, up) is cut on its own — the group
//! shares its input, and each projection has its own output buffer, so no merge is needed.

use super::partition::{Cut, Piece, Processor, Segment};
use super::soc::Soc;
use super::solver::{Op, Phase, Predicted, Solver};
use crate::error::NpuError;
use crate::sched::{Part, Split, Splitter};
use llmd_device::{DeviceDesc, WeightRole};
use std::collections::HashMap;

/// One projection of a model, as the plan sees it.
#[derive(Clone, Debug)]
pub struct Projection {
    pub layer: usize,
    pub role: WeightRole,
    pub name: String,
    /// Output rows (weight rows).
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
}

/// One projection's cut per planned token count.
struct Planned {
    p: Projection,
    cuts: HashMap<usize, Cut>,
}

/// HeteroLLM's plan of a model (see the module).
pub struct HeteroPlan {
    projs: HashMap<(usize, WeightRole), Planned>,
    counts: Vec<usize>,
}

/// A layer's projections by site (QKV, O, gate/up, down), for [`HeteroPlan::to_json`].
const SITES: [(&str, &[WeightRole]); 4] = [
    ("qkv", &[WeightRole::Wq, WeightRole::Wk, WeightRole::Wv]),
    ("o", &[WeightRole::Wo]),
    ("gate_up", &[WeightRole::Gate, WeightRole::Up]),
    ("down", &[WeightRole::Down]),
];

impl HeteroPlan {
    /// Plans each of `projections` for each of `token_counts` (zeros ignored) with `plan`.
    pub fn new(
        projections: impl IntoIterator<Item = Projection>,
        token_counts: &[usize],
        plan: &dyn Fn(&Op) -> Cut,
    ) -> Result<Self, NpuError> {
        let mut counts: Vec<usize> = token_counts.iter().copied().filter(|&m| m > 0).collect();
        counts.sort_unstable();
        counts.dedup();
        let mut projs = HashMap::new();
        // Every layer has the same shapes: each (tokens, in, out) is planned once.
        let mut planned: HashMap<(usize, usize, usize), Cut> = HashMap::new();
        for p in projections {
            let mut cuts = HashMap::new();
            for &m in &counts {
                let op = Op { name: p.name.clone(), m, k: p.cols, n: p.rows };
                let cut = planned.entry((m, p.cols, p.rows)).or_insert_with(|| plan(&op)).clone();
                cut.pieces(m, p.rows).map_err(|e| NpuError::Shape { graph: p.name.clone(), detail: e.to_string() })?;
                cuts.insert(m, cut);
            }
            projs.insert((p.layer, p.role), Planned { p, cuts });
        }
        Ok(Self { projs, counts })
    }

    /// The NPU graphs the plan runs: (layer, role, token count, rows), each once.
    pub fn npu_graphs(&self) -> Vec<(usize, WeightRole, usize, std::ops::Range<usize>)> {
        let mut v = Vec::new();
        for pl in self.projs.values() {
            for (&m, cut) in &pl.cuts {
                for piece in cut.pieces(m, pl.p.rows).unwrap_or_default() {
                    if piece.dev == Processor::Npu {
                        v.push((pl.p.layer, pl.p.role, piece.graph.unwrap_or(m), piece.rows));
                    }
                }
            }
        }
        v.sort_by_key(|(l, r, m, rows)| (*l, *r, *m, rows.start, rows.end));
        v.dedup();
        v
    }

    /// The token counts the plan's NPU graphs take (what the NPU device must be opened for).
    pub fn npu_token_counts(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.npu_graphs().into_iter().map(|g| g.2).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The pieces of projection (`layer`, `role`) over `m` tokens (see the module); None when
    /// it is not planned or no planned size above 1 fits.
    pub fn pieces(&self, layer: usize, role: WeightRole, m: usize) -> Option<Vec<Piece>> {
        let pl = self.projs.get(&(layer, role))?;
        let n = pl.p.rows;
        if let Some(c) = pl.cuts.get(&m) {
            return c.pieces(m, n).ok();
        }
        let mut sizes: Vec<usize> = pl.cuts.keys().copied().filter(|&s| s > 1 && s <= m).collect();
        if sizes.is_empty() {
            return None;
        }
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::new();
        let mut at = 0;
        for &s in &sizes {
            while m - at >= s {
                for mut p in pl.cuts[&s].pieces(s, n).ok()? {
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

    /// The plan as data: per layer and site (qkv, o, gate_up, down), each projection's cut for
    /// each planned token count (what the daemon stores per model, SoC and count).
    pub fn to_json(&self) -> serde_json::Value {
        let n_layers = self.projs.keys().map(|k| k.0 + 1).max().unwrap_or(0);
        let layers: Vec<serde_json::Value> = (0..n_layers)
            .map(|li| {
                let mut m = serde_json::Map::new();
                for (site, roles) in SITES {
                    let v: Vec<serde_json::Value> = roles
                        .iter()
                        .filter_map(|r| self.projs.get(&(li, *r)))
                        .map(|pl| {
                            let mut cuts: Vec<(&usize, &Cut)> = pl.cuts.iter().collect();
                            cuts.sort_by_key(|(k, _)| **k);
                            let cuts: serde_json::Map<String, serde_json::Value> = cuts
                                .into_iter()
                                .map(|(k, c)| {
                                    let v = serde_json::json!({"kind": c.kind(*k, pl.p.rows).name(), "npu_rows": c.npu_rows, "npu": c.npu});
                                    (k.to_string(), v)
                                })
                                .collect();
                            serde_json::json!({"weight": pl.p.name, "rows": pl.p.rows, "cols": pl.p.cols, "cuts": cuts})
                        })
                        .collect();
                    m.insert(site.into(), v.into());
                }
                serde_json::Value::Object(m)
            })
            .collect();
        serde_json::json!({ "layers": layers })
    }
}

impl Splitter for HeteroPlan {
    /// The planned cut, its NPU pieces on the first NPU of `devices` and its GPU pieces on the
    /// first GPU; whole when either is missing or the projection has no plan for `n_tokens`.
    fn split(&self, layer: usize, role: WeightRole, rows: usize, n_tokens: usize, devices: &[&DeviceDesc]) -> Split {
        let find = |p: Processor| devices.iter().position(|d| d.processor == p && d.available);
        let (Some(npu), Some(gpu)) = (find(Processor::Npu), find(Processor::Gpu)) else { return Split::Whole };
        let Some(pieces) = self.pieces(layer, role, n_tokens) else { return Split::Whole };
        if self.projs.get(&(layer, role)).is_none_or(|pl| pl.p.rows != rows) {
            return Split::Whole;
        }
        Split::Hybrid(
            pieces
                .into_iter()
                .map(|p| Part {
                    dev: if p.dev == Processor::Npu { npu } else { gpu },
                    tokens: p.tokens,
                    rows: p.rows,
                    graph: p.graph,
                })
                .collect(),
        )
    }

    fn planned_counts(&self) -> Option<Vec<usize>> {
        Some(self.counts.clone())
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
