//! How one matmul of a pass is divided between devices: [`Split`] (whole, by output rows, by
//! tokens, or any tiling of the output into [`Part`]s — HeteroLLM's hybrid cut), decided per
//! projection by a [`Splitter`] (HeteroLLM's plan is one) and run by the executor
//! (`model/split.rs`). [`views`] cuts the one output buffer into each part's rectangles.

use llmd_device::{DeviceDesc, GroupSite, Processor, WeightRole};
use std::ops::Range;

/// One rectangle of a matmul's output (`tokens` × weight `rows`) and the device that computes
/// it: an index into the placement's device list (0 is the host).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Part {
    pub dev: usize,
    pub tokens: Range<usize>,
    pub rows: Range<usize>,
    /// The token count the part runs in on a device with static shapes (its tokens padded with
    /// zeros to it); `None`: its own.
    pub graph: Option<usize>,
}

/// How one matmul of `m` tokens by `n` output rows is divided between devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// Where its subgraph runs, undivided.
    Whole,
    /// Output rows per device: HeteroLLM's row cut.
    Rows(Vec<(usize, Range<usize>)>),
    /// Tokens per device: HeteroLLM's sequence cut.
    Tokens(Vec<(usize, Range<usize>)>),
    /// Any tiling of the output (HeteroLLM's multi-sequence and hybrid cuts, padded graphs).
    Hybrid(Vec<Part>),
}

impl Split {
    /// The parts of an `m`×`n` output (`None` for [`Split::Whole`]), empty ones left out, not
    /// yet checked: [`check`] does, and so does [`views`], which every run cuts its output with.
    pub fn parts(&self, m: usize, n: usize) -> Option<Vec<Part>> {
        let parts: Vec<Part> = match self {
            Split::Whole => return None,
            Split::Rows(v) => {
                v.iter().map(|(d, r)| Part { dev: *d, tokens: 0..m, rows: r.clone(), graph: None }).collect()
            }
            Split::Tokens(v) => {
                v.iter().map(|(d, t)| Part { dev: *d, tokens: t.clone(), rows: 0..n, graph: None }).collect()
            }
            Split::Hybrid(v) => v.clone(),
        };
        Some(parts.into_iter().filter(|p| !p.tokens.is_empty() && !p.rows.is_empty()).collect())
    }
}

/// An error unless `parts` tile an `m`×`n` output exactly once, each within its graph.
pub fn check(m: usize, n: usize, parts: &[Part]) -> Result<(), String> {
    tiling(m, n, parts).map(|_| ())
}

/// Decides the [`Split`] of each projection of a pass.
pub trait Splitter: Send + Sync {
    /// Projection `role` of layer `layer` (`rows` output rows) at `n_tokens` tokens, over
    /// `devices` (the placement's list: index 0 the host).
    fn split(&self, layer: usize, role: WeightRole, rows: usize, n_tokens: usize, devices: &[&DeviceDesc]) -> Split;

    /// The device (an index into `devices`, ≥ 1) that runs linear group `site` of layer
    /// `layer` whole at `n_tokens` tokens — llm.npu's unit of NPU work, a device that holds
    /// the model's groups — or None: the group's projections go to [`Self::split`].
    fn group(&self, _layer: usize, _site: GroupSite, _n_tokens: usize, _devices: &[&DeviceDesc]) -> Option<usize> {
        None
    }

    /// Whether it ever places a projection off the host (the executor then routes the host's
    /// projections through it).
    fn splits(&self) -> bool {
        true
    }

    /// The token counts it plans for, if it has a fixed set (asked once, when the devices take
    /// it): the parts of a pass of these counts keep their executables and buffers between
    /// passes (other passes' live for their pass only), and a device with static shapes has
    /// every part of these counts prepared up front (`Transformer::prepare_splits`).
    fn planned_counts(&self) -> Option<Vec<usize>> {
        None
    }
}

/// Never splits.
pub struct NoSplit;

impl Splitter for NoSplit {
    fn split(&self, _: usize, _: WeightRole, _: usize, _: usize, _: &[&DeviceDesc]) -> Split {
        Split::Whole
    }

    fn splits(&self) -> bool {
        false
    }
}

/// llm.npu's placement of the linear groups: every group of every layer on the first NPU of
/// the placement (whose `Group` executables run its W8A8 graphs), at any token count — the
/// NPU device runs a pass in its graphs' chunk size. Nothing is divided.
pub struct GroupsOnNpu;

impl Splitter for GroupsOnNpu {
    fn split(&self, _: usize, _: WeightRole, _: usize, _: usize, _: &[&DeviceDesc]) -> Split {
        Split::Whole
    }

    fn group(&self, _: usize, _: GroupSite, _: usize, devices: &[&DeviceDesc]) -> Option<usize> {
        devices.iter().skip(1).position(|d| d.processor == Processor::Npu).map(|i| i + 1)
    }
}

/// Per token of an `m`×`n` output, the parts covering it in row order; an error unless the
/// parts tile the output exactly once, each with no more tokens than its graph.
fn tiling(m: usize, n: usize, parts: &[Part]) -> Result<Vec<Vec<usize>>, String> {
    let bad = |detail: String| format!("split of a {m}×{n} output: {detail}");
    let mut by_token: Vec<Vec<usize>> = vec![Vec::new(); m];
    for (i, p) in parts.iter().enumerate() {
        if p.tokens.start > p.tokens.end || p.tokens.end > m || p.rows.start > p.rows.end || p.rows.end > n {
            return Err(bad(format!("part {:?}×{:?} outside the output", p.tokens, p.rows)));
        }
        if p.graph.is_some_and(|g| p.tokens.len() > g) {
            return Err(bad(format!("{} tokens in a graph of {:?}", p.tokens.len(), p.graph)));
        }
        for t in p.tokens.clone() {
            by_token[t].push(i);
        }
    }
    for (t, ids) in by_token.iter_mut().enumerate() {
        ids.sort_by_key(|&i| parts[i].rows.start);
        let mut at = 0;
        for &i in ids.iter() {
            let r = &parts[i].rows;
            if r.start != at {
                return Err(bad(format!("token {t}: rows {at}..{} not covered once", r.start)));
            }
            at = r.end;
        }
        if at != n {
            return Err(bad(format!("token {t}: rows {at}..{n} not covered")));
        }
    }
    Ok(by_token)
}

/// The output buffer (`m` rows of `n`) cut into each part's views: per part, one slice per
/// token, its rows — disjoint borrows, no merge copies. The parts must tile the output once.
pub fn views<'a>(out: &'a mut [f32], n: usize, parts: &[Part]) -> Result<Vec<Vec<&'a mut [f32]>>, String> {
    if n == 0 || !out.len().is_multiple_of(n) {
        return Err(format!("split of an output of {} values into rows of {n}", out.len()));
    }
    let by_token = tiling(out.len() / n, n, parts)?;
    let mut per: Vec<Vec<&'a mut [f32]>> = parts.iter().map(|p| Vec::with_capacity(p.tokens.len())).collect();
    for (row, ids) in out.chunks_exact_mut(n).zip(by_token) {
        let mut rest = row;
        for i in ids {
            let (mine, tail) = rest.split_at_mut(parts[i].rows.len());
            per[i].push(mine);
            rest = tail;
        }
    }
    Ok(per)
}

/// Cuts `0..n` into contiguous ranges in proportion to `shares` (each a non-negative weight;
/// others count as 0), every range a multiple of `align` rows except the one that takes the
/// remainder: the last with a positive share (all of `0..n` if none is positive, the last
/// range). Ranges may be empty; no `shares`, no ranges.
pub fn proportional(n: usize, shares: &[f64], align: usize) -> Vec<Range<usize>> {
    let share = |s: f64| if s.is_finite() && s > 0.0 { s } else { 0.0 };
    let total: f64 = shares.iter().map(|&s| share(s)).sum();
    let last = shares.iter().rposition(|&s| share(s) > 0.0).unwrap_or(shares.len().saturating_sub(1));
    let align = align.max(1);
    let mut out = Vec::with_capacity(shares.len());
    let mut at = 0usize;
    let mut acc = 0.0;
    for (i, &s) in shares.iter().enumerate() {
        let end = if i >= last {
            n
        } else {
            acc += share(s);
            let raw = if total > 0.0 { (n as f64 * acc / total).round() as usize } else { 0 };
            (raw / align * align).clamp(at, n)
        };
        out.push(at..end);
        at = end;
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn proportional_cuts_cover_every_row_once_on_aligned_bounds() {
        assert_eq!(proportional(100, &[1.0, 1.0], 1), vec![0..50, 50..100]);
        assert_eq!(proportional(100, &[3.0, 1.0], 16), vec![0..64, 64..100]);
        assert_eq!(proportional(10, &[0.0, 1.0], 1), vec![0..0, 0..10]);
        assert_eq!(proportional(10, &[f64::NAN, 0.0], 1), vec![0..0, 0..10]);
        assert_eq!(proportional(10, &[1.0, 0.0], 1), vec![0..10, 10..10], "the remainder to a positive share");
        assert_eq!(proportional(10, &[], 1), Vec::<Range<usize>>::new());
        assert_eq!(NoSplit.split(0, WeightRole::Up, 10, 1, &[]), Split::Whole);
        assert!(!NoSplit.splits());
    }

    #[test]
    fn parts_must_tile_the_output_once() {
        let (m, n) = (6, 10);
        let checked = |sp: Split| check(m, n, &sp.parts(m, n).unwrap());
        assert_eq!(Split::Whole.parts(m, n), None);
        let rows = Split::Rows(vec![(1, 0..4), (2, 4..10)]).parts(m, n).unwrap();
        assert_eq!(rows[1], Part { dev: 2, tokens: 0..6, rows: 4..10, graph: None });
        assert!(check(m, n, &rows).is_ok());
        assert!(checked(Split::Tokens(vec![(1, 0..4), (2, 4..6)])).is_ok());
        assert!(checked(Split::Tokens(vec![(1, 0..0), (2, 0..6)])).is_ok(), "an empty part is left out");
        assert!(checked(Split::Rows(vec![(1, 0..4), (2, 5..10)])).is_err(), "a gap");
        assert!(checked(Split::Tokens(vec![(1, 0..4), (2, 3..6)])).is_err(), "an overlap");
        assert!(checked(Split::Tokens(vec![(1, 0..7)])).is_err(), "past the end");
        let hybrid = Split::Hybrid(vec![
            Part { dev: 1, tokens: 0..4, rows: 0..8, graph: Some(4) },
            Part { dev: 2, tokens: 0..4, rows: 8..10, graph: None },
            Part { dev: 2, tokens: 4..6, rows: 0..10, graph: None },
        ]);
        assert_eq!(hybrid.parts(m, n).unwrap().len(), 3);
        assert!(checked(hybrid.clone()).is_ok());
        let over = Split::Hybrid(vec![Part { dev: 1, tokens: 0..6, rows: 0..10, graph: Some(4) }]);
        assert!(checked(over.clone()).is_err(), "more tokens than the graph takes");
        assert!(views(&mut vec![0f32; m * n], n, &over.parts(m, n).unwrap()).is_err(), "views check too");
        // The views of a tiling write every element once.
        let mut out = vec![0f32; m * n];
        let parts = hybrid.parts(m, n).unwrap();
        for (i, v) in views(&mut out, n, &parts).unwrap().into_iter().enumerate() {
            for row in v {
                row.iter_mut().for_each(|x| *x += (i + 1) as f32);
            }
        }
        assert!(out[..4 * n].chunks(n).all(|r| r[..8].iter().all(|&x| x == 1.0) && r[8..].iter().all(|&x| x == 2.0)));
        assert!(out[4 * n..].iter().all(|&x| x == 3.0));
    }
}
