//! How one matmul of a subgraph is divided between devices: the hook HeteroLLM's partition
//! solver implements ([`Splitter`]), and proportional row ranges.

use llmd_device::{DeviceDesc, Subgraph, WeightRole};
use std::ops::Range;

/// How one matmul of a subgraph is divided between devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// On the subgraph's device alone.
    Whole,
    /// Output rows (weight rows) per device index: HeteroLLM's row cut.
    Rows(Vec<(usize, Range<usize>)>),
    /// Tokens per device index: HeteroLLM's sequence cut.
    Tokens(Vec<(usize, Range<usize>)>),
}

/// Decides the [`Split`] of each matmul (HeteroLLM's partition solver implements this).
pub trait Splitter: Send + Sync {
    fn split(&self, sg: Subgraph, role: WeightRole, rows: usize, n_tokens: usize, devices: &[&DeviceDesc]) -> Split;
}

/// Never splits.
pub struct NoSplit;

impl Splitter for NoSplit {
    fn split(&self, _: Subgraph, _: WeightRole, _: usize, _: usize, _: &[&DeviceDesc]) -> Split {
        Split::Whole
    }
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
        assert_eq!(NoSplit.split(Subgraph::ffn(0), WeightRole::Up, 10, 1, &[]), Split::Whole);
    }
}
