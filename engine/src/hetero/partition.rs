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
//! [`Cut::pieces`] turns a cut into rectangles of the output that tile it exactly once;
//! [`execute`] hands each device its rectangles as views into the one output buffer (each
//! token's row split at the pieces' row bounds: disjoint borrows, no merge copies) and runs the
//! two devices on two threads (the NPU's on the caller's). Per output element nothing changes — the same weight row and the
//! same token's activations, in the same order — so a cut equals the whole operator bit for bit
//! on one device type (tested on the CPU's kernels and on OpenCL).

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

/// One processor's share of a partitioned matmul: computes its pieces' rectangles.
pub trait PieceRunner: Sync {
    /// Rows `piece.rows` of `Y` for tokens `piece.tokens`: `x` is all `m` tokens' activations
    /// (`m × k`), `out[i]` the output of token `piece.tokens.start + i`, `piece.rows.len()` long.
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String>;

    /// Submits `pieces` to the runner's device and returns at once (the device works while
    /// the caller runs the other processor's pieces); [`Started::finish`] collects the
    /// outputs. None: the runner computes on the caller's thread, in [`Self::run`].
    fn start(&self, _pieces: &[&Piece], _x: &[f32]) -> Result<Option<Box<dyn Started + '_>>, String> {
        Ok(None)
    }
}

/// Pieces a device is computing ([`PieceRunner::start`]).
pub trait Started {
    /// Whether the device has finished them (polled by the fast synchronisation).
    fn done(&self) -> bool;
    /// Waits for them and writes each piece's output into its views (`outs[i]`: piece `i`'s,
    /// in the order they were started).
    fn finish(self: Box<Self>, outs: &mut [&mut Vec<&mut [f32]>]) -> Result<(), String>;
}

/// The output buffer (`m` rows of `n`) split into each piece's views: per piece, one slice per
/// token, its rows. The pieces must tile the output (as [`Cut::pieces`] gives them).
pub fn views<'a>(out: &'a mut [f32], n: usize, pieces: &[Piece]) -> Result<Vec<Vec<&'a mut [f32]>>, CutError> {
    let m = out.len().checked_div(n).unwrap_or(0);
    let bad = |detail: String| CutError::Invalid { m, n, detail };
    if n == 0 || !out.len().is_multiple_of(n) {
        return Err(bad(format!("an output of {} values", out.len())));
    }
    let mut per: Vec<Vec<&'a mut [f32]>> = pieces.iter().map(|p| Vec::with_capacity(p.tokens.len())).collect();
    // Per token, the pieces covering it by their first row.
    let mut by_token: Vec<Vec<usize>> = vec![Vec::new(); m];
    for (i, p) in pieces.iter().enumerate() {
        if p.tokens.end > m || p.rows.end > n {
            return Err(bad(format!("piece {:?}×{:?} outside the output", p.tokens, p.rows)));
        }
        for t in p.tokens.clone() {
            by_token[t].push(i);
        }
    }
    for (t, row) in out.chunks_exact_mut(n).enumerate() {
        let mut ids = std::mem::take(&mut by_token[t]);
        ids.sort_by_key(|&i| pieces[i].rows.start);
        let mut rest = row;
        let mut at = 0;
        for i in ids {
            let r = &pieces[i].rows;
            if r.start != at {
                return Err(bad(format!("token {t}: rows {at}..{} not covered once", r.start)));
            }
            let (mine, tail) = rest.split_at_mut(r.len());
            per[i].push(mine);
            rest = tail;
            at = r.end;
        }
        if at != n {
            return Err(bad(format!("token {t}: rows {at}..{n} not covered")));
        }
    }
    Ok(per)
}

/// Runs `cut` of the `m`×`n` matmul of `x` (`m × k`) into `out` (`m × n`): the GPU's pieces
/// submitted to its queue, the NPU's run on the caller's thread meanwhile (in order), each
/// writing its rectangles in place.
pub fn execute(
    cut: &Cut,
    x: &[f32],
    m: usize,
    n: usize,
    out: &mut [f32],
    npu: &dyn PieceRunner,
    gpu: &dyn PieceRunner,
) -> Result<(), String> {
    let pieces = cut.pieces(m, n).map_err(|e| e.to_string())?;
    execute_pieces(&pieces, x, m, n, out, npu, gpu)
}

/// [`execute`] over pieces given directly (they must tile the output once).
pub fn execute_pieces(
    pieces: &[Piece],
    x: &[f32],
    m: usize,
    n: usize,
    out: &mut [f32],
    npu: &dyn PieceRunner,
    gpu: &dyn PieceRunner,
) -> Result<(), String> {
    execute_synced(pieces, x, m, n, out, npu, gpu, None)
}

/// [`execute_pieces`] where the caller, its NPU pieces done, waits for the GPU's by HeteroLLM's
/// fast synchronisation (`sync`: the waiter and predictions, and the operator's key): the
/// caller sleeps for the operator's predicted remainder and polls the GPU's completion. Pieces
/// with more tokens than their graph are refused.
#[allow(clippy::too_many_arguments)]
pub fn execute_synced(
    pieces: &[Piece],
    x: &[f32],
    m: usize,
    n: usize,
    out: &mut [f32],
    npu: &dyn PieceRunner,
    gpu: &dyn PieceRunner,
    sync: Option<(&super::sync::FastSync, &str)>,
) -> Result<(), String> {
    if out.len() != m * n || (m > 0 && !x.len().is_multiple_of(m)) {
        return Err(format!("execute: {} inputs, {} outputs for {m}×{n}", x.len(), out.len()));
    }
    if let Some(p) = pieces.iter().find(|p| p.graph.is_some_and(|g| p.tokens.len() > g)) {
        return Err(format!("execute: {} tokens in a graph of {:?}", p.tokens.len(), p.graph));
    }
    let mut views = views(out, n, pieces).map_err(|e| e.to_string())?;
    let mut npu_work = Vec::new();
    let mut gpu_work = Vec::new();
    for (p, v) in pieces.iter().zip(views.iter_mut()) {
        match p.dev {
            Processor::Npu => npu_work.push((p, v)),
            Processor::Gpu => gpu_work.push((p, v)),
            Processor::Cpu => return Err("execute: a cut runs on the NPU and the GPU, not the CPU".into()),
        }
    }
    let run = |runner: &dyn PieceRunner, work: Vec<(&Piece, &mut Vec<&mut [f32]>)>| -> Result<(), String> {
        for (p, v) in work {
            runner.run(p, x, v)?;
        }
        Ok(())
    };
    if npu_work.is_empty() || gpu_work.is_empty() {
        run(npu, npu_work)?;
        return run(gpu, gpu_work);
    }
    // The GPU's pieces go to its queue first; the caller then runs the NPU's (so QNN is called
    // from the caller's thread only) while the GPU computes, and waits for the GPU's by
    // polling its completion — after the operator's predicted remainder asleep, with `sync`.
    // No thread is made: the overlap is the device's queue.
    let submitted = std::time::Instant::now();
    let gpu_pieces: Vec<&Piece> = gpu_work.iter().map(|(p, _)| *p).collect();
    let Some(started) = gpu.start(&gpu_pieces, x)? else {
        // A runner on the host (the tests' references): one after the other.
        run(npu, npu_work)?;
        return run(gpu, gpu_work);
    };
    let n = run(npu, npu_work);
    if let Some((fs, key)) = sync {
        let done = || started.done();
        // Only a wait that found the GPU still busy sees its completion (≈ when the poll
        // succeeds); one that found it done knows only an upper bound, and learns nothing.
        let busy = !done();
        fs.wait(key, &super::sync::Polled(&done), 1, submitted);
        if busy {
            fs.observe(key, submitted.elapsed());
        }
    }
    let mut outs: Vec<&mut Vec<&mut [f32]>> = gpu_work.into_iter().map(|(_, v)| v).collect();
    let g = started.finish(&mut outs);
    n.and(g)
}

/// A reference runner: `Y = X·Wᵀ` over f32 weights (`n × k`), each element summed in f64 in
/// column order then rounded; padding a piece to its graph changes nothing (its rows are
/// discarded). For the property tests and as the specification of a piece.
pub struct Reference<'a> {
    pub w: &'a [f32],
    pub k: usize,
}

impl PieceRunner for Reference<'_> {
    fn run(&self, piece: &Piece, x: &[f32], out: &mut [&mut [f32]]) -> Result<(), String> {
        for (i, o) in out.iter_mut().enumerate() {
            let t = piece.tokens.start + i;
            let xr = x.get(t * self.k..(t + 1) * self.k).ok_or("x too short")?;
            for (j, v) in o.iter_mut().enumerate() {
                let r = piece.rows.start + j;
                let wr = self.w.get(r * self.k..(r + 1) * self.k).ok_or("w too short")?;
                *v = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
            }
        }
        Ok(())
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

    #[test]
    fn execute_equals_the_whole_operator_on_one_device() {
        let (m, n, k) = (70, 48, 40);
        let mut rng = 0x1234_5678u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let r = Reference { w: &w, k };
        let mut whole = vec![0.0; m * n];
        execute(&Cut::gpu_only(), &x, m, n, &mut whole, &r, &r).unwrap();
        for cut in [Cut::padded(m, 128, 16), Cut::from_sizes(&[64], n), Cut::from_sizes(&[32, 32], 32)] {
            let mut y = vec![f32::NAN; m * n];
            execute(&cut, &x, m, n, &mut y, &r, &r).unwrap();
            assert_eq!(
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
