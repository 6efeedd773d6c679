//! One subgraph run by the host blocks over memory a device keeps in host layout: its own copies
//! of the weights ([`HostCopy`], made from the bytes [`llmd_device::Device::load_weight`] is
//! handed), the residual stream, each sequence's one-layer KV cache, the logits. The CPU device
//! ([`super::cpu::device::CpuDevice`]) runs every subgraph so, and a device of any memory whose
//! arithmetic is the CPU's can too; the results equal the engine's own host pass bit for bit
//! (the same blocks, the same kernels).

use super::blocks::{AttnWeights, Batch, FfnWeights, Logits, Pass, PassState, QkvWeights};
use super::kv::KvCache;
use super::weight::WeightMatrix;
use super::Planner;
use llmd_device::{BlockShape, GgmlType, HostWeight, SeqBinding, Subgraph, SubgraphKind};
use std::ops::Range;

/// A weight in a device's memory as the host blocks read it.
pub enum HostCopy {
    /// Packed for the CPU kernels where the type has a packed layout.
    Matrix(WeightMatrix),
    /// A norm, a bias, RoPE frequencies.
    Vector(Vec<f32>),
}

impl HostCopy {
    /// Rows `rows` of `w` (an f32 row of one is a vector); None if the bytes do not fit the shape.
    pub fn load(w: &HostWeight<'_>, rows: Range<usize>) -> Option<Self> {
        let bytes = w.rows_bytes(rows.clone())?;
        if w.ty == GgmlType::F32 && w.rows == 1 {
            return Some(Self::Vector(
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ));
        }
        WeightMatrix::from_host_bytes(&format!("{:?}", w.role), w.ty, rows.len(), w.cols, bytes.to_vec())
            .map(Self::Matrix)
    }

    /// Bytes it holds.
    pub fn size_bytes(&self) -> usize {
        match self {
            Self::Matrix(m) => m.size_bytes(),
            Self::Vector(v) => v.len() * 4,
        }
    }
}

/// What one submission binds, in host memory.
pub struct HostIo<'a, 'k> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub seqs: &'a [SeqBinding],
    /// The residual stream, `n_tokens × d_model` (read and written in place).
    pub x: &'a mut Vec<f32>,
    /// Attention: each sequence's cache of this layer (one layer per cache), holding at least
    /// its `start` positions; the pass's are written at `start..` and counted.
    pub kv: &'a mut [&'k mut KvCache],
    /// The head: `logit_rows` of `x` get logits, `vocab` each, into `logits`.
    pub logit_rows: &'a [u32],
    pub logits: &'a mut [f32],
    /// A linear subgraph's output (`n_tokens` rows of its weight's rows), a layer part's
    /// ([`Subgraph::part_widths`]); empty otherwise.
    pub y: &'a mut [f32],
    /// A layer part's input besides `x` ([`Subgraph::part_widths`]); empty otherwise.
    pub h: &'a [f32],
}

/// Checks a pass's bindings: the sequences' spans back to back from row 0 and covering every
/// token, and each token's position its sequence's start plus its index.
pub fn check_bindings(tokens: &[u32], positions: &[u32], seqs: &[SeqBinding]) -> Result<(), String> {
    if tokens.len() != positions.len() {
        return Err(format!("{} tokens with {} positions", tokens.len(), positions.len()));
    }
    let mut at = 0usize;
    for (i, s) in seqs.iter().enumerate() {
        if s.offset != at {
            return Err(format!("sequence {i} starts at row {}, not {at}", s.offset));
        }
        at = at
            .checked_add(s.len)
            .filter(|&e| e <= positions.len())
            .ok_or_else(|| format!("sequence {i} runs past the pass"))?;
        for (j, &p) in positions[s.offset..at].iter().enumerate() {
            if p as usize != s.start + j {
                return Err(format!("sequence {i}, token {j}: position {p}, not {}", s.start + j));
            }
        }
    }
    if at != positions.len() {
        return Err(format!("the sequences cover {at} of {} tokens", positions.len()));
    }
    Ok(())
}

/// Runs `sg` of a model of `shape` with `weights` (in [`Subgraph::weight_roles`] order).
pub fn run_subgraph(
    planner: &Planner,
    shape: &BlockShape,
    sg: Subgraph,
    weights: &[&HostCopy],
    io: HostIo<'_, '_>,
) -> Result<(), String> {
    // A projection (a weight's loaded rows) or a group (each projection's rows in turn): `x`
    // holds one row of the weights' columns per bound position, not the residual.
    let projections = match sg.kind {
        SubgraphKind::Linear(role) => Some(vec![role]),
        SubgraphKind::Group(site) => Some(site.roles().to_vec()),
        _ => None,
    };
    if let Some(roles) = projections {
        let n = io.positions.len();
        let mut at = 0;
        for (i, role) in roles.iter().enumerate() {
            let Some(HostCopy::Matrix(w)) = weights.get(i) else {
                return Err(format!("{sg:?}: its {role:?} weight is not a matrix"));
            };
            if io.x.len() < n * w.cols || io.y.len() < at + n * w.rows {
                return Err(format!(
                    "{sg:?}: {} inputs and {} outputs for {n} rows of its {}×{} {role:?}",
                    io.x.len(),
                    io.y.len(),
                    w.rows,
                    w.cols
                ));
            }
            let op =
                crate::backend::OpDesc { kind: crate::backend::OpKind::MatMul, weight_type: Some(w.ty), n_tokens: n };
            let (x, y) = (&io.x[..n * w.cols], &mut io.y[at..at + n * w.rows]);
            planner.place(&op).and_then(|b| b.matmul(w, x, n, y)).map_err(|e| e.to_string())?;
            at += n * w.rows;
        }
        return Ok(());
    }
    let pass = Pass { c: shape, planner, linears: None, sparse: None };
    check_bindings(io.tokens, io.positions, io.seqs)?;
    let spans: Vec<_> = io.seqs.iter().map(|s| (s.offset, s.len, s.start)).collect();
    let positions: Vec<usize> = io.positions.iter().map(|&p| p as usize).collect();
    let mut st = PassState::new(shape, io.tokens.to_vec(), positions, spans);
    if io.x.len() != st.x.len() {
        return Err(format!("the residual stream holds {} values, the pass needs {}", io.x.len(), st.x.len()));
    }
    if weights.len() != sg.weight_roles(shape).len() {
        return Err(format!("{sg:?} needs {} weights, {} were bound", sg.weight_roles(shape).len(), weights.len()));
    }
    std::mem::swap(&mut st.x, io.x);
    let m = |i: usize| match weights.get(i) {
        Some(HostCopy::Matrix(m)) => Ok(m),
        _ => Err(format!("{sg:?}: weight {i} is not a matrix")),
    };
    let v = |i: usize| match weights.get(i) {
        Some(HostCopy::Vector(v)) => Ok(&v[..]),
        _ => Err(format!("{sg:?}: weight {i} is not a vector")),
    };
    let e = |e: crate::error::BackendError| e.to_string();
    let r = (|| -> Result<(), String> {
        match sg.kind {
            SubgraphKind::Embed => pass.embed(&mut st, m(0)?).map_err(e),
            SubgraphKind::Attention => {
                let mut i = 5;
                let mut next = || {
                    i += 1;
                    i - 1
                };
                let (bq, bk, bv) = if shape.qkv_bias {
                    (Some(v(next())?), Some(v(next())?), Some(v(next())?))
                } else {
                    (None, None, None)
                };
                let rope_freqs = if shape.rope_freqs { Some(v(next())?) } else { None };
                let w = AttnWeights { norm: v(0)?, wq: m(1)?, wk: m(2)?, wv: m(3)?, wo: m(4)?, bq, bk, bv, rope_freqs };
                with_caches(io.kv, io.seqs, |batch| pass.attention(&mut st, batch, sg.layer, 0, w, None).map_err(e))
            }
            SubgraphKind::AttnQkv
            | SubgraphKind::AttnCore
            | SubgraphKind::AttnOut
            | SubgraphKind::FfnGateUp
            | SubgraphKind::FfnDown => {
                let (hw, yw) = sg.part_widths(shape);
                let n = st.n;
                if io.h.len() < n * hw || io.y.len() < n * yw {
                    return Err(format!(
                        "{sg:?} of {n} rows bound to h of {} values and y of {} (it takes {hw} and {yw} a row)",
                        io.h.len(),
                        io.y.len()
                    ));
                }
                let mut at = 0;
                for t in st.part_inputs(sg.kind) {
                    let len = t.len();
                    t.copy_from_slice(&io.h[at..at + len]);
                    at += len;
                }
                match sg.kind {
                    SubgraphKind::AttnQkv => {
                        let (bq, bk, bv) =
                            if shape.qkv_bias { (Some(v(4)?), Some(v(5)?), Some(v(6)?)) } else { (None, None, None) };
                        let w = QkvWeights { norm: v(0)?, wq: m(1)?, wk: m(2)?, wv: m(3)?, bq, bk, bv };
                        pass.attn_qkv(&mut st, sg.layer, w, None).map_err(e)?
                    }
                    SubgraphKind::AttnCore => {
                        let rope_freqs = if shape.rope_freqs { Some(v(0)?) } else { None };
                        with_caches(io.kv, io.seqs, |batch| {
                            Pass::prepare_append(&st, batch, 0);
                            pass.attn_core(&mut st, batch, sg.layer, 0, rope_freqs).map_err(e)
                        })?
                    }
                    SubgraphKind::AttnOut => pass.attn_out(&mut st, sg.layer, m(0)?, None).map_err(e)?,
                    SubgraphKind::FfnGateUp => {
                        pass.ffn_gate_up(&mut st, sg.layer, (v(0)?, m(1)?, m(2)?), None).map_err(e)?
                    }
                    _ => pass.ffn_down(&mut st, sg.layer, m(0)?, None).map_err(e)?,
                }
                let mut at = 0;
                for t in st.part_outputs(sg.kind) {
                    io.y[at..at + t.len()].copy_from_slice(t);
                    at += t.len();
                }
                Ok(())
            }
            SubgraphKind::Ffn => {
                let w = FfnWeights { norm: v(0)?, gate: m(1)?, up: m(2)?, down: m(3)? };
                pass.ffn(&mut st, sg.layer, w, None).map_err(e)
            }
            SubgraphKind::Head => {
                let d = shape.d_model;
                let rows = io.logit_rows;
                if io.logits.len() != rows.len() * shape.vocab {
                    return Err(format!("{} logits for {} rows of {}", io.logits.len(), rows.len(), shape.vocab));
                }
                if rows.is_empty() {
                    return Ok(());
                }
                let mut only =
                    PassState::new(shape, vec![0; rows.len()], vec![0; rows.len()], vec![(0, rows.len(), 0)]);
                for (i, &r) in rows.iter().enumerate() {
                    let r = r as usize;
                    let src = st.x.get(r * d..(r + 1) * d).ok_or_else(|| format!("logit row {r} past the pass"))?;
                    only.x[i * d..(i + 1) * d].copy_from_slice(src);
                }
                let out = pass.head(&only, v(0)?, m(1)?, Logits::All).map_err(e)?.concat();
                if out.len() != io.logits.len() {
                    return Err(format!("the head gave {} logits for {} wanted", out.len(), io.logits.len()));
                }
                io.logits.copy_from_slice(&out);
                Ok(())
            }
            SubgraphKind::Linear(_) | SubgraphKind::Group(_) => Err("a projection past its own path".into()),
        }
    })();
    std::mem::swap(&mut st.x, io.x);
    r
}

/// Runs `f` over each sequence's cache of the layer (one per sequence, holding at least its
/// `start` positions; what a rolled-back turn left past it cut first), then counts the
/// pass's positions in each.
fn with_caches(
    kv: &mut [&mut KvCache],
    seqs: &[SeqBinding],
    f: impl FnOnce(&mut Batch) -> Result<(), String>,
) -> Result<(), String> {
    if kv.len() != seqs.len() {
        return Err(format!("{} KV caches for {} sequences", kv.len(), seqs.len()));
    }
    for (c, s) in kv.iter_mut().zip(seqs) {
        if c.len() < s.start {
            return Err(format!("a KV cache holds {} positions, its pass starts at {}", c.len(), s.start));
        }
        // Positions a rolled-back turn left are overwritten (a truncation frees memory, so
        // only when there is something to cut).
        if c.len() > s.start {
            c.truncate(s.start);
        }
    }
    let empty: &[u32] = &[];
    let mut batch: Vec<(&mut KvCache, &[u32])> = kv.iter_mut().map(|c| (&mut **c, empty)).collect();
    f(&mut batch)?;
    for ((c, _), s) in batch.iter_mut().zip(seqs) {
        c.advance(s.len);
    }
    Ok(())
}
