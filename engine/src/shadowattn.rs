//! shadowAttn's offline half for one model: the profile that sets its sparse attention (the paper's
//! §3.2–3.3) — each head's and each layer's importance as the loss increase when it is zeroed
//! on a calibration text (Eq. 1–2), and the pilot's mean scales per layer (the buckets' centres)
//! — kept as a file keyed by the model and the calibration tokens (like the NPU calibration), and
//! the per-head kept ratios made from it (Eq. 3).
//!
//! Where the paper is silent, llmd decided:
//! - zeroing a head zeroes its attention output before the O projection; zeroing a layer zeroes
//!   every head of its attention (the block then adds nothing to the residual);
//! - importance below zero (zeroing helped) counts as zero; the products `head · layer` are
//!   floored at their median and clamped at four times it ([`PRODUCT_FLOOR`], [`PRODUCT_CLAMP`]:
//!   the paper's "clamping extremely large points", with a floor so no head keeps almost
//!   nothing), then scaled so their mean ratio is the global one; a ratio above 1 is capped and
//!   its excess shared among the others in proportion, so the mean stays the global ratio;
//! - the profile's passes use an f16 KV cache whatever the model's (the pilot reads f16 keys).
//! - the profile reads at most [`PROFILE_TOKENS`] calibration tokens (time: one pass per head and
//!   per layer).

use crate::backend::blocks::{CaptureSite, Logits};
use crate::backend::sparse::{bucket_grid, Probe, SparseAttn, DEFAULT_STEP};
use crate::error::{BackendError, EngineError};
use crate::model::Transformer;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Calibration tokens a profile reads at most.
pub const PROFILE_TOKENS: usize = 256;
/// Prompt rows per pass while profiling (as the CPU's default prefill chunk).
const PROFILE_CHUNK: usize = 128;
/// Bumped when what a profile holds or how it is made changes.
pub const PROFILE_VERSION: u32 = 2;
/// The floor and clamp of Eq. 3's products, as multiples of their median. Chosen on earlier code
/// (k rounded up from the f32 ratio; docs/BENCHMARKS.md has today's figures), the default
/// model (Jargon File, `--ctx 2048`, 4,094 tokens, ratio 0.2, perplexity; dense 17.73, uniform
/// 18.79): floor 1/8 and clamp 8 gave ratios 0.010–0.613 and 22.66 (8,188 tokens; uniform 15.19,
/// dense 14.22); floor 1/2, clamp 2: 19.36; floor 1, no clamp: 20.65; floor 1, clamp 4: 19.15,
/// the least harm, kept.
pub const PRODUCT_FLOOR: f64 = 1.0;
pub const PRODUCT_CLAMP: f64 = 4.0;

/// A model's shadowAttn profile.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    pub version: u32,
    /// `prefill::calfile::key` of the model and the calibration tokens, in hex.
    pub key: String,
    pub n_layers: usize,
    pub n_heads: usize,
    pub tokens: usize,
    /// Mean NLL of the calibration tokens, dense.
    pub loss: f64,
    /// Mean NLL with head `l * n_heads + h` zeroed (Eq. 1's first term); empty when the profile
    /// was made without importance (uniform ratios need none).
    pub head_loss: Vec<f64>,
    /// Mean NLL with layer `l`'s attention zeroed (Eq. 2's first term); empty likewise.
    pub layer_loss: Vec<f64>,
    /// Per layer, the mean (Q, K) scales the pilot saw at exact scales: the buckets' centres.
    pub centres: Vec<(f32, f32)>,
}

/// Mean NLL of `tokens` under `t` (dense, or sparse under `sparse`), each position's next token
/// scored; `edit` sees every O group's input (the heads' attention outputs).
fn loss(
    t: &Transformer,
    tokens: &[u32],
    sparse: Option<&SparseAttn>,
    edit: &mut dyn FnMut(usize, &mut [f32]),
) -> Result<f64, EngineError> {
    let c = &t.config;
    let mut kv =
        crate::backend::kv::KvCache::with_type(c.n_layers, c.kv_dim(), c.head_dim, crate::backend::kv::KvType::F16);
    let vocab = t.weights.output.rows;
    let (mut total, mut n) = (0f64, 0usize);
    for (ci, chunk) in tokens.chunks(PROFILE_CHUNK).enumerate() {
        let logits = t.forward_capture(&mut kv, chunk, Logits::All, sparse, &mut |li, site, x, _| {
            if site == CaptureSite::O {
                edit(li, x)
            }
        })?;
        for (i, row) in logits.chunks_exact(vocab.max(1)).enumerate() {
            if let Some(&next) = tokens.get(ci * PROFILE_CHUNK + i + 1) {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                total += sum.ln() + max - row.get(next as usize).copied().unwrap_or(f32::NEG_INFINITY) as f64;
                n += 1;
            }
        }
    }
    Ok(total / n.max(1) as f64)
}

impl Profile {
    /// Profiles `t` on `tokens` (the first [`PROFILE_TOKENS`]): one pass at exact scales for the
    /// pilot's mean scales, and with `importance` one dense pass and one per head and per layer
    /// with it zeroed. `progress(done, of)` after each pass; false from it stops the profile (an
    /// error). `t`'s own attention setting is not read or changed (it may be serving meanwhile).
    pub fn build(
        t: &Transformer,
        tokens: &[u32],
        importance: bool,
        progress: &dyn Fn(usize, usize) -> bool,
    ) -> Result<Self, EngineError> {
        let tokens = &tokens[..tokens.len().min(PROFILE_TOKENS)];
        if tokens.len() < 2 {
            return Err(BackendError::Shape {
                op: "shadowAttn profile",
                detail: format!("{} calibration tokens: at least 2 are needed", tokens.len()),
            }
            .into());
        }
        let key = format!("{:016x}", crate::prefill::calfile::key(t, tokens));
        let c = t.config.clone();
        let (nl, nh, hd) = (c.n_layers, c.n_heads, c.head_dim);
        let passes = if importance { 2 + nl * nh + nl } else { 1 };
        let mut done = 0;
        let mut step = || -> Result<(), EngineError> {
            done += 1;
            if progress(done, passes) {
                Ok(())
            } else {
                Err(BackendError::Shape { op: "shadowAttn profile", detail: "stopped".into() }.into())
            }
        };
        let (mut base, mut layer_loss, mut head_loss) = (0.0, Vec::new(), Vec::new());
        if importance {
            base = loss(t, tokens, None, &mut |_, _| {})?;
            step()?;
        }
        let zero = |x: &mut [f32], heads: std::ops::Range<usize>| {
            for row in x.chunks_exact_mut(nh * hd) {
                row[heads.start * hd..heads.end * hd].fill(0.0);
            }
        };
        for l in (0..nl).filter(|_| importance) {
            layer_loss.push(loss(t, tokens, None, &mut |li, x| {
                if li == l {
                    zero(x, 0..nh)
                }
            })?);
            step()?;
        }
        for l in (0..nl).filter(|_| importance) {
            for h in 0..nh {
                head_loss.push(loss(t, tokens, None, &mut |li, x| {
                    if li == l {
                        zero(x, h..h + 1)
                    }
                })?);
                step()?;
            }
        }
        let mut exact = SparseAttn::uniform(nl, nh, 1.0, None);
        exact.probe = Some(Probe::new(nl, false));
        exact.check(nl, nh).map_err(|detail| BackendError::Shape { op: "sparse attention", detail })?;
        loss(t, tokens, Some(&exact), &mut |_, _| {})?;
        step()?;
        let data = exact.probe.as_ref().map(|p| p.data()).unwrap_or_default();
        if let Some(l) = data.scales.iter().position(|s| s.2 == 0 || !(s.0 > 0.0 && s.1 > 0.0)) {
            return Err(BackendError::Shape {
                op: "shadowAttn profile",
                detail: format!("the pilot saw no scales at layer {l} (a chunk of one row?)"),
            }
            .into());
        }
        let centres = data
            .scales
            .iter()
            .map(|&(q, k, n)| {
                let n = n.max(1) as f64;
                (((q / n) as f32).max(f32::MIN_POSITIVE), ((k / n) as f32).max(f32::MIN_POSITIVE))
            })
            .collect();
        Ok(Self {
            version: PROFILE_VERSION,
            key,
            n_layers: nl,
            n_heads: nh,
            tokens: tokens.len(),
            loss: base,
            head_loss,
            layer_loss,
            centres,
        })
    }

    /// Whether the profile holds heads' and layers' importance.
    pub fn has_importance(&self) -> bool {
        !self.head_loss.is_empty()
    }

    /// The per-head kept ratios at global ratio `r` (Eq. 3, with the module's decisions); their
    /// mean is `r` (uniform where the profile holds no importance).
    pub fn ratios(&self, r: f32) -> Vec<f32> {
        if !self.has_importance() {
            return vec![r; self.n_layers * self.n_heads];
        }
        let nh = self.n_heads;
        let products: Vec<f64> = self
            .head_loss
            .iter()
            .enumerate()
            .map(|(i, &hl)| {
                let layer = self.layer_loss.get(i / nh.max(1)).copied().unwrap_or(self.loss);
                (hl - self.loss).max(0.0) * (layer - self.loss).max(0.0)
            })
            .collect();
        eq3(&products, r)
    }

    /// The sparse attention settings at global ratio `r`: head-specific ratios (`uniform`: one
    /// for all), `buckets` scale buckets around the profile's centres.
    pub fn settings(&self, r: f32, uniform: bool, buckets: usize) -> SparseAttn {
        SparseAttn {
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            ratios: if uniform { vec![r; self.n_layers * self.n_heads] } else { self.ratios(r) },
            centres: Some(self.centres.clone()),
            grid: bucket_grid(buckets, DEFAULT_STEP),
            probe: None,
            sparse_rows: Default::default(),
        }
    }

    /// The profile's file for `key` in `dir`.
    pub fn path(dir: &Path, key: &str) -> PathBuf {
        dir.join(format!("shadowattn-{key}.json"))
    }

    /// The profile of `t` on `tokens` from `dir` if one is there and whole (holding importance
    /// where `importance` asks for it), else built (and written there, where `dir` is given).
    /// Returns it and whether it was read.
    pub fn load_or_build(
        dir: Option<&Path>,
        t: &Transformer,
        tokens: &[u32],
        importance: bool,
        progress: &dyn Fn(usize, usize) -> bool,
    ) -> Result<(Self, bool), EngineError> {
        let used = &tokens[..tokens.len().min(PROFILE_TOKENS)];
        let key = format!("{:016x}", crate::prefill::calfile::key(t, used));
        if let Some(d) = dir {
            if let Some(p) = Self::read(&Self::path(d, &key), &key, t).filter(|p| p.has_importance() || !importance) {
                return Ok((p, true));
            }
        }
        let p = Self::build(t, tokens, importance, progress)?;
        if let Some(d) = dir {
            // A cache: failing to write it costs the next start the profile's time, nothing more.
            let _ = std::fs::create_dir_all(d).and_then(|_| {
                let tmp = Self::path(d, &format!("{key}.tmp"));
                std::fs::write(&tmp, serde_json::to_vec_pretty(&p).unwrap_or_default())?;
                std::fs::rename(&tmp, Self::path(d, &key))
            });
        }
        Ok((p, false))
    }

    /// A profile file, if it is this model's and whole.
    fn read(path: &Path, key: &str, t: &Transformer) -> Option<Self> {
        let p: Self = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        let (nl, nh) = (t.config.n_layers, t.config.n_heads);
        let fine = p.version == PROFILE_VERSION
            && p.key == key
            && p.n_layers == nl
            && p.n_heads == nh
            && ((p.head_loss.len() == nl * nh && p.layer_loss.len() == nl)
                || (p.head_loss.is_empty() && p.layer_loss.is_empty()))
            && p.centres.len() == nl
            && p.centres.iter().all(|&(q, k)| q >= 1e-20 && k >= 1e-20 && q.is_finite() && k.is_finite())
            && p.head_loss.iter().chain(&p.layer_loss).chain([&p.loss]).all(|x| x.is_finite());
        fine.then_some(p)
    }
}

/// Eq. 3 over importance products: floored and clamped around their median, scaled to mean
/// ratio `r`, capped at 1 with the excess shared in proportion among the uncapped heads.
pub fn eq3(products: &[f64], r: f32) -> Vec<f32> {
    let n = products.len();
    if n == 0 {
        return Vec::new();
    }
    let mut sorted: Vec<f64> = products.iter().copied().filter(|x| x.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    if median <= 0.0 {
        return vec![r; n];
    }
    let w: Vec<f64> = products
        .iter()
        .map(|&p| if p.is_finite() { p.clamp(median * PRODUCT_FLOOR, median * PRODUCT_CLAMP) } else { median })
        .collect();
    let mut ratio = vec![0f64; n];
    let mut capped = vec![false; n];
    let total = r as f64 * n as f64;
    // Each round gives the budget left to the uncapped heads in proportion; a head reaching 1
    // is capped and the next round shares what it could not take.
    for _ in 0..n {
        let left = total - capped.iter().filter(|&&c| c).count() as f64;
        let sum: f64 = w.iter().zip(&capped).filter(|(_, &c)| !c).map(|(w, _)| w).sum();
        let mut again = false;
        for i in 0..n {
            if !capped[i] {
                ratio[i] = left * w[i] / sum;
                if ratio[i] > 1.0 {
                    capped[i] = true;
                    ratio[i] = 1.0;
                    again = true;
                }
            }
        }
        if !again {
            break;
        }
    }
    ratio.into_iter().map(|x| x.clamp(f64::MIN_POSITIVE, 1.0) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eq3_keeps_the_mean_ratio_and_orders_heads_by_importance() {
        // Median 4: the heads below it floored there, 30 clamped at 16.
        let p = [1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 30.0];
        let r = eq3(&p, 0.2);
        let mean = r.iter().sum::<f32>() / r.len() as f32;
        assert!((mean - 0.2).abs() < 1e-6, "{mean}");
        // Proportional between floor and clamp: 2× the importance, 2× the ratio.
        assert!((r[4] / r[3] - 2.0).abs() < 1e-5 && (r[5] / r[4] - 2.0).abs() < 1e-5, "{r:?}");
        assert!(r[..4].iter().all(|&x| x == r[3]) && r[6] == r[5], "{r:?}");
    }

    #[test]
    fn eq3_floors_clamps_caps_and_falls_back_to_uniform() {
        // One head 1000× the median is clamped, one near zero floored.
        let mut p = vec![1.0; 10];
        p[0] = 1000.0;
        p[1] = 1e-9;
        let r = eq3(&p, 0.2);
        assert!((r[0] / r[2] - PRODUCT_CLAMP as f32).abs() < 1e-4, "{r:?}");
        assert!((r[1] / r[2] - PRODUCT_FLOOR as f32).abs() < 1e-4, "{r:?}");
        // A high global ratio: capped at 1, the excess shared, the mean kept.
        let r = eq3(&[4.0, 1.0, 1.0, 1.0], 0.5);
        assert_eq!(r[0], 1.0);
        assert!((r.iter().sum::<f32>() / 4.0 - 0.5).abs() < 1e-6, "{r:?}");
        assert!(r[1..].iter().all(|&x| (x - 1.0 / 3.0).abs() < 1e-6));
        // No importance anywhere (or negative only): one ratio for all.
        assert_eq!(eq3(&[0.0; 5], 0.3), vec![0.3; 5]);
        assert!(eq3(&[], 0.2).is_empty());
    }
}
