//! shadowAttn's sparse attention, the parts that are pure arithmetic: the settings a model's
//! attention runs under ([`SparseAttn`]: per-head kept ratios, the scale buckets of the INT8
//! pilot), per-tensor INT8 quantization at a bucket's scale, the bucket grid and its selection,
//! and the per-row top-k over the pilot's scores. The CPU runs them (`backend/cpu/sparse.rs`).
//!
//! The paper (Yin et al., "Dynamic Sparse Attention on Mobile SoCs") leaves these open; what
//! llmd decided, each written where it is used:
//! - top-k is per query row over the causally visible keys, `k = max(1, ceil(ratio · visible))`
//!   (every row keeps a non-empty softmax);
//! - ties at the k-th score keep the later key (the nearer one to the query);
//! - scales are symmetric max-abs (`max|x| / 127`), values beyond a bucket's range saturate at
//!   ±127; a bucket is chosen per query head and chunk by the paper's linear-space MSE;
//! - the bucket grid's centre is the calibration's mean scales **per layer** (not one pair for
//!   the model: layers' key scales differ by more than the grid's 4× span);
//! - `n` buckets are the `n` multiplier pairs `(σ^i, σ^j)` nearest the centre, by `|i| + |j|`
//!   then `max(|i|, |j|)`: 1, 5, 9 (the paper's 3×3 grid at σ = 0.5) and 13 are whole rings.

use std::sync::Mutex;

/// The paper's default kept ratio (§5.2: the smallest with no accuracy loss).
pub const DEFAULT_RATIO: f32 = 0.2;
/// The paper's default number of scale buckets (§3.3).
pub const DEFAULT_BUCKETS: usize = 9;
/// The paper's default bucket step σ (§3.3, Fig. 14).
pub const DEFAULT_STEP: f32 = 0.5;
/// Prompt rows of one sequence below which a chunk's attention stays dense: shadowAttn is a
/// prefill mechanism (§3.1); a decode step (one row) is memory-bound and runs dense.
pub const MIN_SPARSE_ROWS: usize = 2;

/// How a model's attention runs during prefill chunks: which share of keys each query head
/// keeps, and the INT8 pilot's scale buckets.
#[derive(Debug)]
pub struct SparseAttn {
    pub n_layers: usize,
    pub n_heads: usize,
    /// Kept ratio of query head `h` of layer `l` at `l * n_heads + h`, each in (0, 1].
    pub ratios: Vec<f32>,
    /// Per layer, the calibration's mean (scale of Q, scale of K), the buckets' centre; `None`:
    /// each head quantized at its own exact scales (an oracle no static graph can be, kept to
    /// measure what bucketing costs, and to calibrate).
    pub centres: Option<Vec<(f32, f32)>>,
    /// The buckets' multipliers of the centre's (Q, K) scales.
    pub grid: Vec<(f32, f32)>,
    /// Measurements taken while attention runs (recall against float top-k, scales seen).
    pub probe: Option<Probe>,
    /// Query rows attended sparse so far, summed over layers.
    pub sparse_rows: std::sync::atomic::AtomicU64,
}

impl SparseAttn {
    /// One ratio for every head, buckets from `centres` (or exact scales).
    pub fn uniform(n_layers: usize, n_heads: usize, ratio: f32, centres: Option<Vec<(f32, f32)>>) -> Self {
        Self {
            n_layers,
            n_heads,
            ratios: vec![ratio; n_layers * n_heads],
            centres,
            grid: bucket_grid(DEFAULT_BUCKETS, DEFAULT_STEP),
            probe: None,
            sparse_rows: Default::default(),
        }
    }

    /// Query rows attended sparse so far, summed over layers.
    pub fn rows(&self) -> u64 {
        self.sparse_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Checks the settings against a model's shape.
    pub fn check(&self, n_layers: usize, n_heads: usize) -> Result<(), String> {
        if self.n_layers != n_layers || self.n_heads != n_heads || self.ratios.len() != n_layers * n_heads {
            return Err(format!(
                "sparse attention set for {} layers × {} heads, the model has {n_layers} × {n_heads}",
                self.n_layers, self.n_heads
            ));
        }
        if let Some(r) = self.ratios.iter().find(|r| !(**r > 0.0 && **r <= 1.0)) {
            return Err(format!("a kept ratio of {r} is outside (0, 1]"));
        }
        if self.centres.as_ref().is_some_and(|c| c.len() != n_layers || c.iter().any(|&(q, k)| !(q > 0.0 && k > 0.0))) {
            return Err("bucket centres must be one positive pair per layer".into());
        }
        if self.grid.is_empty() {
            return Err("no scale buckets".into());
        }
        Ok(())
    }

    pub fn ratio(&self, layer: usize, head: usize) -> f32 {
        self.ratios.get(layer * self.n_heads + head).copied().unwrap_or(1.0)
    }

    /// The (Q, K) scales head `head` of `layer` is quantized at, given its exact ones.
    pub fn scales(&self, layer: usize, exact: (f32, f32)) -> (f32, f32) {
        match self.centres.as_ref().and_then(|c| c.get(layer)) {
            Some(&(cq, ck)) => {
                let b = select_bucket(&self.grid, (cq, ck), exact);
                (cq * self.grid[b].0, ck * self.grid[b].1)
            }
            None => (exact.0.max(f32::MIN_POSITIVE), exact.1.max(f32::MIN_POSITIVE)),
        }
    }
}

/// The kept keys of a row of `visible` keys at `ratio`: `max(1, ceil(ratio · visible))`.
pub fn kept(ratio: f32, visible: usize) -> usize {
    // An f32 ratio is not its decimal (0.2f32 is 0.2000000030): taken to its nearest millionth
    // first, so 0.2 of 10 keys is 2 (and a ratio of 1 keeps every key at any length).
    let r = (ratio as f64 * 1e6).round() / 1e6;
    ((r * visible as f64 - 1e-9).ceil() as usize).clamp(1, visible.max(1))
}

/// `n` buckets' multiplier pairs at step `sigma` (see the module's notes), centre first.
pub fn bucket_grid(n: usize, sigma: f32) -> Vec<(f32, f32)> {
    let m = (n as f64).sqrt().ceil() as i32 + 1;
    let mut e: Vec<(i32, i32)> = (-m..=m).flat_map(|i| (-m..=m).map(move |j| (i, j))).collect();
    e.sort_by_key(|&(i, j)| (i.abs() + j.abs(), i.abs().max(j.abs()), i, j));
    e.truncate(n.max(1));
    e.into_iter().map(|(i, j)| (sigma.powi(i), sigma.powi(j))).collect()
}

/// The bucket whose scales are nearest `exact` by squared error (the paper's MSE), first on a tie.
pub fn select_bucket(grid: &[(f32, f32)], centre: (f32, f32), exact: (f32, f32)) -> usize {
    let err = |&(mq, mk): &(f32, f32)| {
        let (dq, dk) = ((centre.0 * mq - exact.0) as f64, (centre.1 * mk - exact.1) as f64);
        dq * dq + dk * dk
    };
    let mut best = 0;
    for (i, g) in grid.iter().enumerate() {
        if err(g) < err(&grid[best]) {
            best = i;
        }
    }
    best
}

/// The symmetric INT8 scale of `x`: `max|x| / 127`.
pub fn absmax_scale(x: impl Iterator<Item = f32>) -> f32 {
    x.fold(0f32, |m, v| m.max(v.abs())) / 127.0
}

/// `x / scale` rounded to nearest (ties away from zero) and saturated at ±127.
#[inline]
pub fn quantize_i8(x: f32, inv_scale: f32) -> i8 {
    (x * inv_scale).round().clamp(-127.0, 127.0) as i8
}

/// The `k` largest of `scores` (ties: the later index), as ascending indices into `out`; all of
/// them when `k >= scores.len()`. `hist` is scratch.
pub fn top_k(scores: &[i32], k: usize, hist: &mut Vec<u32>, out: &mut Vec<u32>) {
    out.clear();
    let n = scores.len();
    if k >= n {
        out.extend(0..n as u32);
        return;
    }
    if k == 0 {
        return;
    }
    // One pass for the range, one to count scores per bin (1024 bins over the range), the bin
    // holding the k-th largest found from the top, then one pass keeping every index above
    // that bin and the boundary bin's candidates, of which the largest (later first) fill k.
    let (mut lo, mut hi) = (i32::MAX, i32::MIN);
    for &s in scores {
        lo = lo.min(s);
        hi = hi.max(s);
    }
    let span = (hi as i64 - lo as i64) as u64;
    let shift = (64 - span.leading_zeros()).saturating_sub(10);
    let bin = |s: i32| ((s as i64 - lo as i64) as u64 >> shift) as usize;
    hist.clear();
    hist.resize(bin(hi) + 1, 0);
    for &s in scores {
        hist[bin(s)] += 1;
    }
    let (mut above, mut b) = (0usize, hist.len() - 1);
    loop {
        let c = hist[b] as usize;
        if above + c >= k || b == 0 {
            break;
        }
        above += c;
        b -= 1;
    }
    let need = k - above;
    let mut edge: Vec<(i32, u32)> = Vec::with_capacity(hist[b] as usize);
    for (j, &s) in scores.iter().enumerate() {
        let sb = bin(s);
        if sb > b {
            out.push(j as u32);
        } else if sb == b {
            edge.push((s, j as u32));
        }
    }
    // Largest first, the later index first among equals.
    edge.sort_unstable_by(|a, b| b.cmp(a));
    edge.truncate(need);
    let mut chosen: Vec<u32> = edge.into_iter().map(|(_, j)| j).collect();
    chosen.sort_unstable();
    // Merge the two ascending lists.
    let above_list = std::mem::take(out);
    let (mut i, mut j) = (0, 0);
    while i < above_list.len() || j < chosen.len() {
        if j == chosen.len() || (i < above_list.len() && above_list[i] < chosen[j]) {
            out.push(above_list[i]);
            i += 1;
        } else {
            out.push(chosen[j]);
            j += 1;
        }
    }
}

/// The same selection over float scores (the ground truth of recall).
pub fn top_k_f32(scores: &[f32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    if k >= scores.len() {
        out.extend(0..scores.len() as u32);
        return;
    }
    let mut idx: Vec<u32> = (0..scores.len() as u32).collect();
    let key = |j: &u32| (scores[*j as usize], *j);
    idx.select_nth_unstable_by(k.saturating_sub(1), |a, b| {
        let (x, y) = (key(a), key(b));
        y.0.total_cmp(&x.0).then(y.1.cmp(&x.1))
    });
    idx.truncate(k);
    idx.sort_unstable();
    out.extend(idx);
}

/// What attention saw while a probe was attached, per layer.
#[derive(Debug, Default)]
pub struct Probe {
    inner: Mutex<ProbeData>,
}

/// A probe's sums.
#[derive(Clone, Debug, Default)]
pub struct ProbeData {
    /// Per layer: (float top-k positions the pilot also picked, float top-k positions).
    pub recall: Vec<(u64, u64)>,
    /// Per layer: (sum of Q scales, sum of K scales, heads × chunks seen).
    pub scales: Vec<(f64, f64, u64)>,
    /// Per layer: (query rows, query rows whose pilot scores tie at the k-th position).
    pub ties: Vec<(u64, u64)>,
    /// Whether recall is measured (it costs a float Q·Kᵀ per row).
    pub measure_recall: bool,
}

impl Probe {
    pub fn new(n_layers: usize, measure_recall: bool) -> Self {
        Self {
            inner: Mutex::new(ProbeData {
                recall: vec![(0, 0); n_layers],
                scales: vec![(0.0, 0.0, 0); n_layers],
                ties: vec![(0, 0); n_layers],
                measure_recall,
            }),
        }
    }

    pub fn measures_recall(&self) -> bool {
        self.lock().measure_recall
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProbeData> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn add_recall(&self, layer: usize, hit: u64, total: u64, rows: u64, tied: u64) {
        let mut d = self.lock();
        if let Some(r) = d.recall.get_mut(layer) {
            r.0 += hit;
            r.1 += total;
        }
        if let Some(t) = d.ties.get_mut(layer) {
            t.0 += rows;
            t.1 += tied;
        }
    }

    pub fn add_scales(&self, layer: usize, q: f64, k: f64) {
        if let Some(s) = self.lock().scales.get_mut(layer) {
            s.0 += q;
            s.1 += k;
            s.2 += 1;
        }
    }

    pub fn data(&self) -> ProbeData {
        self.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            s >> 33
        }
    }

    /// The reference: sort all (score, index) pairs, largest first and the later index first.
    fn top_k_by_sort(scores: &[i32], k: usize) -> Vec<u32> {
        let mut all: Vec<(i32, u32)> = scores.iter().enumerate().map(|(j, &s)| (s, j as u32)).collect();
        all.sort_unstable_by(|a, b| b.cmp(a));
        let mut v: Vec<u32> = all.into_iter().take(k).map(|(_, j)| j).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn top_k_equals_a_full_sort_with_ties_and_any_range() {
        let mut r = lcg(7);
        let (mut hist, mut out) = (Vec::new(), Vec::new());
        for case in 0..400 {
            let n = 1 + (r() % 700) as usize;
            let range = [3u64, 100, 70_000, 2_000_000][case % 4];
            let scores: Vec<i32> = (0..n).map(|_| (r() % range) as i32 - (range / 2) as i32).collect();
            for k in [1, n / 5, n / 2, n - 1, n, n + 3] {
                top_k(&scores, k, &mut hist, &mut out);
                assert_eq!(out, top_k_by_sort(&scores, k.min(n)), "n {n} k {k} range {range}");
            }
        }
        top_k(&[i32::MIN, i32::MAX, 0], 1, &mut hist, &mut out);
        assert_eq!(out, [1]);
    }

    #[test]
    fn float_top_k_equals_a_full_sort() {
        let mut r = lcg(9);
        let mut out = Vec::new();
        for _ in 0..100 {
            let n = 1 + (r() % 300) as usize;
            let scores: Vec<f32> = (0..n).map(|_| (r() % 50) as f32 * 0.25).collect();
            let as_int: Vec<i32> = scores.iter().map(|s| (s * 4.0) as i32).collect();
            for k in [1, n / 3, n] {
                top_k_f32(&scores, k, &mut out);
                assert_eq!(out, top_k_by_sort(&as_int, k));
            }
        }
    }

    #[test]
    fn kept_rounds_up_and_keeps_at_least_one() {
        assert_eq!(kept(0.2, 1), 1);
        assert_eq!(kept(0.2, 10), 2);
        assert_eq!(kept(0.2, 11), 3);
        assert_eq!(kept(1.0, 7), 7);
        assert_eq!(kept(0.001, 100), 1);
        assert_eq!(kept(1.0, 5_000_000), 5_000_000);
        assert_eq!(kept(0.3, 10), 3);
        assert_eq!(kept(0.3, 11), 4);
    }

    #[test]
    fn bucket_grids_are_whole_rings_and_nine_is_the_papers_three_by_three() {
        let g9 = bucket_grid(9, 0.5);
        assert_eq!(g9[0], (1.0, 1.0));
        let mut m: Vec<(f32, f32)> = g9.clone();
        m.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut want: Vec<(f32, f32)> =
            [0.5f32, 1.0, 2.0].iter().flat_map(|&a| [0.5f32, 1.0, 2.0].map(move |b| (a, b))).collect();
        want.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        assert_eq!(m, want);
        assert_eq!(bucket_grid(1, 0.5), [(1.0, 1.0)]);
        let g5 = bucket_grid(5, 0.5);
        assert!(g5.iter().all(|&(q, k)| q == 1.0 || k == 1.0));
        let g13 = bucket_grid(13, 0.5);
        assert!(g13.contains(&(4.0, 1.0)) && g13.contains(&(1.0, 0.25)));
    }

    #[test]
    fn bucket_selection_takes_the_least_squared_error() {
        let g = bucket_grid(9, 0.5);
        let c = (0.1, 0.2);
        assert_eq!(g[select_bucket(&g, c, (0.1, 0.2))], (1.0, 1.0));
        assert_eq!(g[select_bucket(&g, c, (0.21, 0.39))], (2.0, 2.0));
        assert_eq!(g[select_bucket(&g, c, (0.04, 0.5))], (0.5, 2.0));
        // Far outside the grid: the nearest corner.
        assert_eq!(g[select_bucket(&g, c, (10.0, 0.001))], (2.0, 0.5));
    }

    #[test]
    fn quantization_saturates_and_rounds_to_nearest() {
        assert_eq!(quantize_i8(1.0, 127.0), 127);
        assert_eq!(quantize_i8(5.0, 127.0), 127);
        assert_eq!(quantize_i8(-5.0, 127.0), -127);
        assert_eq!(quantize_i8(0.5 / 127.0, 127.0), 1);
        let s = absmax_scale([0.5f32, -2.54, 1.0].into_iter());
        assert!((s - 0.02).abs() < 1e-7);
        // In range, the round trip is within half a step.
        for i in -300..300 {
            let x = i as f32 * 0.0083;
            let q = quantize_i8(x, 1.0 / s);
            assert!((q as f32 * s - x).abs() <= s / 2.0 + 1e-6);
        }
    }
}
