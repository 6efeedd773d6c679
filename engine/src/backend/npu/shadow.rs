//! llm.npu's shadow outlier execution (§3.3 of the paper), the host's half: the elements of a
//! group's input that fall outside its clipped 8-bit range are extracted ([`extract`]) and
//! multiplied on the CPU by the int8 weights' rows of their channels, dequantized with the weight
//! scale ([`ShadowWeights::product`]); the sum is added to the NPU's output of the clipped input.
//! By linearity `x·W = clip(x)·W + (x − clip(x))·W`, so only the clipped part is recomputed.
//!
//! Decisions where the paper is silent (docs/DECISIONS.md):
//! - **Residual.** An extracted element contributes `x − s·(clamp(q) − z)`: its value beyond the
//!   dequantized clipped code (the paper's `ext(x − s·x_q)`), not the authors' code's integer
//!   multiple of `s` — the two differ by under `s/2` per outlier.
//! - **Compaction.** A chunk's outliers are gathered by channel: the union of channels holding
//!   one in any row, as a dense `rows × channels` tensor (zero where a row has none) times those
//!   channels' weight rows — one small GEMM, as the paper's `ext()` describes; the authors' code
//!   loops per element instead.
//! - **Weights.** The NPU's own int8 weights (the paper's symbol list and the authors' code), kept
//!   channel-major (`[k][n]`: one contiguous row per input channel, all of a group's
//!   projections side by side). Hot channels' rows stay in memory; the rest are read from a
//!   file on demand (§3.4): `hot` is chosen from calibration counts by [`hot_channels`].

use super::quant::{ActQuant, QuantWeights};
use crate::backend::cpu::sgemm::{sgemm, BLayout};
use crate::error::NpuError;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The outliers of `rows` rows of a group's input.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outliers {
    pub rows: usize,
    /// Every channel holding an outlier in some row, ascending.
    pub channels: Vec<u32>,
    /// `rows × channels.len()`: the part of each value beyond its clipped code, 0 where none.
    pub values: Vec<f32>,
    /// Elements extracted.
    pub elements: usize,
}

/// Whether `v` is an outlier at `q`: its code, unclamped, outside `0..=max_code`; and if so the
/// part beyond the clipped code's value.
#[inline]
pub fn residual(v: f32, q: &ActQuant, inv: f32) -> Option<f32> {
    let raw = (v * inv).round() + q.zero_point as f32;
    let top = q.max_code() as f32;
    if !(raw < 0.0 || raw > top) {
        return None; // in range, or NaN (which the NPU's quantization clamps like anything else)
    }
    let clamped = raw.clamp(0.0, top);
    Some(v - q.scale * (clamped - q.zero_point as f32))
}

/// Extracts the outliers of `x` (`rows × k`, row-major) at the quantization `q`.
pub fn extract(x: &[f32], k: usize, q: &ActQuant) -> Outliers {
    let rows = x.len() / k.max(1);
    let inv = 1.0 / q.scale;
    let mut hit = vec![false; k];
    let mut elements = 0;
    for row in x.chunks_exact(k.max(1)) {
        for (c, &v) in row.iter().enumerate() {
            if residual(v, q, inv).is_some() {
                hit[c] = true;
                elements += 1;
            }
        }
    }
    if elements == 0 {
        return Outliers { rows, ..Default::default() };
    }
    let channels: Vec<u32> = (0..k).filter(|&c| hit[c]).map(|c| c as u32).collect();
    let mut values = vec![0f32; rows * channels.len()];
    for (row, out) in x.chunks_exact(k).zip(values.chunks_exact_mut(channels.len())) {
        for (o, &c) in out.iter_mut().zip(&channels) {
            if let Some(r) = residual(row[c as usize], q, inv) {
                *o = r;
            }
        }
    }
    Outliers { rows, channels, values, elements }
}

/// The smallest set of channels, most frequent first, that covers `coverage` (0..=1) of the
/// outlier occurrences `counts` records (per channel); channels never seen are cold.
pub fn hot_channels(counts: &[u64], coverage: f64) -> Vec<bool> {
    let total: u64 = counts.iter().sum();
    let mut hot = vec![false; counts.len()];
    if total == 0 {
        return hot;
    }
    let mut order: Vec<usize> = (0..counts.len()).filter(|&c| counts[c] > 0).collect();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    let need = (coverage.clamp(0.0, 1.0) * total as f64).ceil() as u64;
    let mut covered = 0u64;
    for c in order {
        if covered >= need {
            break;
        }
        hot[c] = true;
        covered += counts[c];
    }
    hot
}

/// Where cold rows are read from: a file holding every row of the group, channel-major, from
/// `offset`.
#[derive(Clone, Debug)]
pub struct ColdRows {
    pub file: Arc<File>,
    pub offset: u64,
}

/// A group's int8 weights by input channel ([`ShadowWeights::channel_major`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelMajor {
    /// Each output column's real weight scale.
    pub scales: Vec<f32>,
    /// `k × scales.len()` codes.
    pub rows: Vec<i8>,
}

/// Counters of a group's shadow weights.
#[derive(Debug, Default)]
pub struct ShadowCounters {
    pub hot_rows_used: AtomicU64,
    pub cold_rows_read: AtomicU64,
    pub cold_bytes_read: AtomicU64,
}

/// A group's int8 weights by input channel, for the shadow product.
#[derive(Debug)]
pub struct ShadowWeights {
    pub k: usize,
    /// Each output column's weight scale (every projection's, side by side).
    pub scales: Vec<f32>,
    /// Per channel: its row among `hot`, or `u32::MAX` when cold.
    slot: Vec<u32>,
    hot: Vec<i8>,
    cold: Option<ColdRows>,
    /// Every row when there is no file to leave the cold ones in.
    all: Option<Vec<i8>>,
    pub counters: ShadowCounters,
}

impl ShadowWeights {
    /// Row width: every projection's outputs.
    pub fn n(&self) -> usize {
        self.scales.len()
    }

    /// A group's weights channel-major: each output column's real scale (the weight scale
    /// times the channel's gain, when the host applies one) and `k` rows of `n` codes.
    pub fn channel_major(projections: &[(&QuantWeights, Option<&[f32]>)]) -> Result<ChannelMajor, NpuError> {
        let k = projections.first().map_or(0, |w| w.0.cols);
        let mut scales = Vec::new();
        for (w, gain) in projections {
            if w.cols != k || w.q.len() != w.rows * w.cols || gain.is_some_and(|g| g.len() != w.rows) {
                return Err(NpuError::Quantization(format!(
                    "shadow weights: a {} × {} projection in a group of {k} inputs",
                    w.rows, w.cols
                )));
            }
            scales.extend((0..w.rows).map(|o| w.scales.of(o) * gain.map_or(1.0, |g| g[o])));
        }
        let n = scales.len();
        let mut rows = vec![0i8; k * n];
        let mut base = 0;
        for (w, _) in projections {
            for o in 0..w.rows {
                let src = &w.q[o * k..(o + 1) * k];
                for (c, &v) in src.iter().enumerate() {
                    rows[c * n + base + o] = v;
                }
            }
            base += w.rows;
        }
        Ok(ChannelMajor { scales, rows })
    }

    /// Keeps the rows of `hot` channels in memory; the others are read from `cold` (which holds
    /// all of `rows`), or kept too when there is no file.
    pub fn new(cm: &ChannelMajor, k: usize, hot: &[bool], cold: Option<ColdRows>) -> Result<Self, NpuError> {
        let (rows, n) = (&cm.rows, cm.scales.len());
        if rows.len() != k * n || hot.len() != k {
            return Err(NpuError::Quantization(format!(
                "shadow weights: {} codes and {} channel flags for {k} × {n}",
                rows.len(),
                hot.len()
            )));
        }
        let mut slot = vec![u32::MAX; k];
        let mut kept = Vec::new();
        // Without a file every row stays in memory, once.
        for c in (0..k).filter(|&c| hot[c] && cold.is_some()) {
            slot[c] = (kept.len() / n.max(1)) as u32;
            kept.extend_from_slice(&rows[c * n..(c + 1) * n]);
        }
        let all = if cold.is_none() { Some(rows.to_vec()) } else { None };
        Ok(Self { k, scales: cm.scales.clone(), slot, hot: kept, cold, all, counters: ShadowCounters::default() })
    }

    /// Bytes of weight rows held in memory.
    pub fn resident_bytes(&self) -> usize {
        self.hot.len() + self.all.as_ref().map_or(0, Vec::len)
    }

    /// Channels kept in memory.
    pub fn hot_count(&self) -> usize {
        self.slot.iter().filter(|&&s| s != u32::MAX).count()
    }

    /// The int8 row of channel `c` into `buf`.
    fn row(&self, c: usize, buf: &mut [i8]) -> Result<(), NpuError> {
        let n = self.n();
        if c >= self.k {
            return Err(NpuError::Quantization(format!("shadow channel {c} of {}", self.k)));
        }
        if self.slot[c] != u32::MAX {
            let s = self.slot[c] as usize * n;
            buf.copy_from_slice(&self.hot[s..s + n]);
            self.counters.hot_rows_used.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if let Some(all) = &self.all {
            buf.copy_from_slice(&all[c * n..(c + 1) * n]);
            return Ok(());
        }
        let cold = self.cold.as_ref().ok_or_else(|| NpuError::Quantization("shadow rows: no cold file".into()))?;
        // An i8 buffer read as bytes: i8 and u8 have one layout, so this is a safe reinterpretation.
        let mut bytes = vec![0u8; n];
        cold.file
            .read_exact_at(&mut bytes, cold.offset + (c * n) as u64)
            .map_err(|e| NpuError::Quantization(format!("shadow rows: reading channel {c}: {e}")))?;
        for (d, s) in buf.iter_mut().zip(&bytes) {
            *d = *s as i8;
        }
        self.counters.cold_rows_read.fetch_add(1, Ordering::Relaxed);
        self.counters.cold_bytes_read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    /// `outliers · W_q[channels, :] · s_w` (`rows × n()`, row-major, the projections side by side):
    /// the shadow product to add to the NPU's output.
    pub fn product(&self, o: &Outliers, threads: usize) -> Result<Vec<f32>, NpuError> {
        let n = self.n();
        let mut y = vec![0f32; o.rows * n];
        if o.channels.is_empty() {
            return Ok(y);
        }
        let ko = o.channels.len();
        let mut b = vec![0f32; ko * n];
        let mut codes = vec![0i8; n];
        for (i, &c) in o.channels.iter().enumerate() {
            self.row(c as usize, &mut codes)?;
            for ((d, &q), s) in b[i * n..(i + 1) * n].iter_mut().zip(&codes).zip(&self.scales) {
                *d = f32::from(q) * s;
            }
        }
        sgemm(o.rows, ko, n, &o.values, &b, BLayout::KByN, &mut y, false, threads);
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn extraction_takes_exactly_the_elements_past_the_clipped_range() {
        let q = ActQuant::from_range(-1.0, 1.0).expect("q");
        let x = [0.5, -3.0, 0.9, 2.0, 0.1, -0.2];
        let o = extract(&x, 3, &q);
        assert_eq!(o.channels, vec![0, 1]);
        assert_eq!(o.elements, 2);
        // Row 0: channel 1 (-3.0); row 1: channel 0 (2.0).
        let lo = q.scale * (0.0 - q.zero_point as f32);
        let hi = q.scale * (255.0 - q.zero_point as f32);
        assert_eq!(o.values, vec![0.0, -3.0 - lo, 2.0 - hi, 0.0]);
        // Nothing past the range: nothing extracted.
        assert_eq!(extract(&[0.1, 0.2], 2, &q).elements, 0);
    }

    #[test]
    fn hot_channels_cover_the_share_asked_with_the_fewest_channels() {
        let counts = [0, 50, 30, 15, 5];
        assert_eq!(hot_channels(&counts, 0.8), vec![false, true, true, false, false]);
        assert_eq!(hot_channels(&counts, 0.81), vec![false, true, true, true, false]);
        assert_eq!(hot_channels(&counts, 0.0), vec![false; 5]);
        assert_eq!(hot_channels(&[0, 0], 0.8), vec![false, false]);
    }

    #[test]
    fn the_shadow_product_equals_a_float_reference_from_memory_and_from_a_file() {
        let mut seed = 7;
        let (k, rows) = (40, 5);
        let w1: Vec<f32> = (0..24 * k).map(|_| lcg(&mut seed)).collect();
        let w2: Vec<f32> = (0..8 * k).map(|_| lcg(&mut seed) * 3.0).collect();
        let q1 = QuantWeights::quantize(&w1, 24, k, false).expect("q1");
        let q2 = QuantWeights::quantize(&w2, 8, k, false).expect("q2");
        let cm = ShadowWeights::channel_major(&[(&q1, None), (&q2, None)]).expect("cm");
        let xq = ActQuant::from_range(-0.5, 0.5).expect("x");
        let x: Vec<f32> = (0..rows * k).map(|i| lcg(&mut seed) * if i % 13 == 0 { 4.0 } else { 0.4 }).collect();
        let o = extract(&x, k, &xq);
        assert!(o.elements > 0);
        // The float reference: each extracted residual times the dequantized int8 weights.
        let reference = |o: &Outliers| {
            let mut y = vec![0f64; rows * 32];
            for r in 0..rows {
                for (i, &c) in o.channels.iter().enumerate() {
                    let v = f64::from(o.values[r * o.channels.len() + i]);
                    for j in 0..24 {
                        y[r * 32 + j] += v * f64::from(q1.q[j * k + c as usize]) * f64::from(q1.scales.of(0));
                    }
                    for j in 0..8 {
                        y[r * 32 + 24 + j] += v * f64::from(q2.q[j * k + c as usize]) * f64::from(q2.scales.of(0));
                    }
                }
            }
            y
        };
        let want = reference(&o);
        let dir = std::env::temp_dir().join(format!("llmd-shadow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("rows");
        let bytes: Vec<u8> = cm.rows.iter().map(|&v| v as u8).collect();
        std::fs::write(&path, [vec![9u8; 3], bytes].concat()).expect("write");
        let file = Arc::new(File::open(&path).expect("open"));
        let mut hot = vec![false; k];
        hot[o.channels[0] as usize] = true;
        for (label, cold) in [("memory", None), ("file", Some(ColdRows { file, offset: 3 }))] {
            let s = ShadowWeights::new(&cm, k, &hot, cold).expect("shadow");
            let got = s.product(&o, 2).expect("product");
            for (g, w) in got.iter().zip(&want) {
                assert!((f64::from(*g) - w).abs() <= SHADOW_PRODUCT_TOL * (1.0 + w.abs()), "{label}: {g} vs {w}");
            }
            if label == "file" {
                assert_eq!(s.hot_count(), 1);
                assert_eq!(s.counters.cold_rows_read.load(Ordering::Relaxed), o.channels.len() as u64 - 1);
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// f32 products of at most 40 terms against an f64 reference: a few ulps of the sum.
    const SHADOW_PRODUCT_TOL: f64 = 1e-5;
}
