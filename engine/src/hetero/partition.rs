//! HeteroLLM's tensor partitioning of one matmul `Y = X·Wᵀ` (X: `m` tokens × `k`, W: `n`
//! output features × `k`, Y: `m` × `n`, token-major) between the NPU and the GPU.
//!
//! Every cut the paper describes is one [`Cut`]: the NPU runs a list of token segments, each in
//! a pre-built graph of a standard size (the segment padded to it), over output rows
//! `0..npu_rows`; the GPU computes everything else — rows `npu_rows..n` of the NPU's tokens and
//! every row of the tokens no segment covers. So
//! - **row cut**: one segment of all tokens, `npu_rows < n` (prefill's FFN-down; decode);
//! - **sequence cut**: one standard-size segment, all rows; the GPU takes the remaining tokens;
//! - **multi-sequence cut**: several standard-size segments in turn, all rows; the GPU takes
//!   the margin;
//! - **hybrid cut**: segments and `npu_rows < n` together;
//! - and the baselines: **padding** (one segment, the next standard size), **pipe** (segments
//!   only, the margin padded into the smallest size that holds it), NPU-only and GPU-only.
//!
//! [`Cut::pieces`] turns a cut into rectangles of the output that tile it exactly once; the
//! plan (`plan.rs`) hands them to the scheduler as a `Split`, and the executor
//! (`model/split.rs`) runs each device's rectangles as views into the one output buffer. Per
//! output element nothing changes — the same weight row and the same token's activations, in
//! the same order — so a cut equals the whole operator bit for bit on one device type
//! (`engine/tests/hetero_partition.rs`).

use std::ops::Range;

pub use llmd_device::Processor;

/// A run of tokens the NPU computes in a pre-built graph of `graph` tokens (`tokens.len() ≤
/// graph`; the rest of the graph's input is padding, its output discarded).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Segment {
    pub tokens: Range<usize>,
    pub graph: usize,
}

/// How one matmul is divided (see the module's doc).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Cut {
    /// The NPU's token segments, in the order it runs them; none: GPU only.
    pub npu: Vec<Segment>,
    /// Output rows `0..npu_rows` of the segments' tokens are the NPU's.
    pub npu_rows: usize,
}

/// What kind of cut a [`Cut`] is, by the paper's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum CutKind {
    GpuOnly,
    NpuOnly,
    Row,
    Seq,
    MultiSeq,
    Hybrid,
}

impl CutKind {
    pub fn name(self) -> &'static str {
        match self {
            CutKind::GpuOnly => "GPU only",
            CutKind::NpuOnly => "NPU only",
            CutKind::Row => "row cut",
            CutKind::Seq => "sequence cut",
            CutKind::MultiSeq => "multi-sequence cut",
            CutKind::Hybrid => "hybrid cut",
        }
    }
}

/// One rectangle of the output and the processor that computes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub dev: Processor,
    pub tokens: Range<usize>,
    pub rows: Range<usize>,
    /// The NPU graph's token count (the tokens padded to it); `None` on the GPU.
    pub graph: Option<usize>,
}

/// A cut that does not fit the operator.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CutError {
    #[error("cut of a {m}×{n} output: {detail}")]
    Invalid { m: usize, n: usize, detail: String },
}

/// The NPU's pre-built graph sizes (HeteroLLM: powers of two from 32 to 1024), sorted.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Sizes(Vec<usize>);

impl Sizes {
    /// The sizes given, sorted, without zeros or repeats; `None` when none is left.
    pub fn new(mut v: Vec<usize>) -> Option<Self> {
        v.retain(|&s| s > 0);
        v.sort_unstable();
        v.dedup();
        (!v.is_empty()).then_some(Self(v))
    }

    /// HeteroLLM's: 32, 64, …, 1024.
    pub fn heterollm() -> Self {
        Self((5..=10).map(|p| 1usize << p).collect())
    }

    pub fn all(&self) -> &[usize] {
        &self.0
    }

    pub fn largest(&self) -> usize {
        *self.0.last().unwrap_or(&1)
    }

    /// The smallest size holding `m` tokens, if any does.
    pub fn pad(&self, m: usize) -> Option<usize> {
        self.0.iter().copied().find(|&s| s >= m)
    }

    /// The largest size not above `m`, if any.
    pub fn floor(&self, m: usize) -> Option<usize> {
        self.0.iter().rev().copied().find(|&s| s <= m)
    }

    /// Greedy standard-size pieces of `m` tokens, largest first, while one fits; the tokens
    /// left over (fewer than the smallest size).
    pub fn greedy(&self, m: usize) -> (Vec<usize>, usize) {
        let mut left = m;
        let mut out = Vec::new();
        while let Some(s) = self.floor(left) {
            out.push(s);
            left -= s;
        }
        (out, left)
    }
}

impl Cut {
    pub fn gpu_only() -> Self {
        Self { npu: Vec::new(), npu_rows: 0 }
    }

    /// Segments of `sizes` (each full) from token 0, over rows `0..npu_rows`.
    pub fn from_sizes(sizes: &[usize], npu_rows: usize) -> Self {
        let mut at = 0;
        let npu = sizes
            .iter()
            .map(|&s| {
                let seg = Segment { tokens: at..at + s, graph: s };
                at += s;
                seg
            })
            .collect();
        Self { npu, npu_rows }
    }

    /// All `m` tokens on the NPU in one graph of `graph` tokens, over rows `0..npu_rows`
    /// (padding when `graph > m`; a row cut when `npu_rows < n`).
    pub fn padded(m: usize, graph: usize, npu_rows: usize) -> Self {
        Self { npu: vec![Segment { tokens: 0..m, graph }], npu_rows }
    }

    /// Tokens the NPU's segments cover.
    pub fn npu_tokens(&self) -> usize {
        self.npu.iter().map(|s| s.tokens.len()).sum()
    }

    /// The kind of cut this is for an `m`×`n` output.
    pub fn kind(&self, m: usize, n: usize) -> CutKind {
        let rows = self.npu_rows.min(n);
        if self.npu.is_empty() || rows == 0 || self.npu_tokens() == 0 {
            return CutKind::GpuOnly;
        }
        let all_tokens = self.npu_tokens() >= m;
        match (all_tokens, rows >= n) {
            (true, true) => CutKind::NpuOnly,
            (true, false) if self.npu.len() == 1 => CutKind::Row,
            (_, false) => CutKind::Hybrid,
            (false, true) if self.npu.len() == 1 => CutKind::Seq,
            (_, true) => CutKind::MultiSeq,
        }
    }

    /// The rectangles of an `m`×`n` output this cut gives each processor, tiling it exactly
    /// once: the NPU's segments in order (rows `0..npu_rows`), then the GPU's rows beside them,
    /// then the GPU's tokens no segment covers. Empty rectangles are left out.
    pub fn pieces(&self, m: usize, n: usize) -> Result<Vec<Piece>, CutError> {
        let bad = |detail: String| CutError::Invalid { m, n, detail };
        if self.npu_rows > n {
            return Err(bad(format!("{} NPU rows", self.npu_rows)));
        }
        // The segments' token ranges, sorted: checked for overlaps without touching every token
        // (the solver prices thousands of cuts per operator).
        let mut spans: Vec<Range<usize>> = Vec::with_capacity(self.npu.len());
        for s in &self.npu {
            if s.tokens.start > s.tokens.end || s.tokens.end > m {
                return Err(bad(format!("segment {:?}", s.tokens)));
            }
            if s.tokens.len() > s.graph {
                return Err(bad(format!("segment {:?} in a graph of {} tokens", s.tokens, s.graph)));
            }
            if !s.tokens.is_empty() {
                spans.push(s.tokens.clone());
            }
        }
        spans.sort_by_key(|r| r.start);
        if let Some(w) = spans.windows(2).find(|w| w[1].start < w[0].end) {
            return Err(bad(format!("segment {:?} overlaps another", w[1])));
        }
        let mut out = Vec::new();
        if self.npu_rows > 0 {
            for s in self.npu.iter().filter(|s| !s.tokens.is_empty()) {
                out.push(Piece {
                    dev: Processor::Npu,
                    tokens: s.tokens.clone(),
                    rows: 0..self.npu_rows,
                    graph: Some(s.graph),
                });
            }
        }
        // The GPU: beside each segment (rows past npu_rows, or all of them when the NPU has none).
        if self.npu_rows < n {
            for s in self.npu.iter().filter(|s| !s.tokens.is_empty()) {
                out.push(Piece { dev: Processor::Gpu, tokens: s.tokens.clone(), rows: self.npu_rows..n, graph: None });
            }
        }
        // …and the runs of tokens no segment covers.
        let mut t = 0;
        for r in spans.iter().chain(std::iter::once(&(m..m))) {
            if r.start > t && n > 0 {
                out.push(Piece { dev: Processor::Gpu, tokens: t..r.start, rows: 0..n, graph: None });
            }
            t = t.max(r.end);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn covers_once(pieces: &[Piece], m: usize, n: usize) -> bool {
        let mut seen = vec![0u8; m * n];
        for p in pieces {
            for t in p.tokens.clone() {
                for r in p.rows.clone() {
                    seen[t * n + r] += 1;
                }
            }
        }
        seen.iter().all(|&c| c == 1)
    }

    #[test]
    fn every_kind_tiles_the_output_once() {
        let (m, n) = (600, 1024);
        let sizes = Sizes::heterollm();
        let cuts = [
            (Cut::gpu_only(), CutKind::GpuOnly),
            (Cut::padded(m, 1024, n), CutKind::NpuOnly),
            (Cut::padded(m, 1024, 512), CutKind::Row),
            (Cut::from_sizes(&[512], n), CutKind::Seq),
            (Cut::from_sizes(&[512, 64], n), CutKind::MultiSeq),
            (Cut::from_sizes(&[512, 64], 768), CutKind::Hybrid),
            (Cut::from_sizes(&[512], 256), CutKind::Hybrid),
        ];
        for (c, kind) in cuts {
            assert_eq!(c.kind(m, n), kind, "{c:?}");
            let p = c.pieces(m, n).unwrap();
            assert!(covers_once(&p, m, n), "{c:?}");
            assert!(p.iter().filter(|p| p.dev == Processor::Npu).all(|p| sizes.all().contains(&p.graph.unwrap())));
        }
    }

    #[test]
    fn bad_cuts_are_refused() {
        assert!(Cut::padded(10, 32, 65).pieces(10, 64).is_err());
        assert!(Cut::from_sizes(&[32], 64).pieces(20, 64).is_err());
        assert!(Cut { npu: vec![Segment { tokens: 0..40, graph: 32 }], npu_rows: 8 }.pieces(64, 8).is_err());
        let overlap =
            Cut { npu: vec![Segment { tokens: 0..32, graph: 32 }, Segment { tokens: 16..48, graph: 32 }], npu_rows: 8 };
        assert!(overlap.pieces(64, 8).is_err());
    }

    #[test]
    fn sizes_pad_floor_greedy() {
        let s = Sizes::heterollm();
        assert_eq!(s.pad(300), Some(512));
        assert_eq!(s.pad(2000), None);
        assert_eq!(s.floor(300), Some(256));
        assert_eq!(s.floor(31), None);
        assert_eq!(s.greedy(600), (vec![512, 64], 24));
        assert_eq!(Sizes::new(vec![0, 64, 32, 64]).unwrap().all(), &[32, 64]);
        assert!(Sizes::new(vec![0]).is_none());
    }
}
