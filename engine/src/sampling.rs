//! Token sampling: greedy, or temperature with top-k, top-p and min-p filtering, with a
//! repetition penalty; a fixed seed makes a sampled run reproducible (ChaCha8).

use crate::error::GenerateError;
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

/// Sampling parameters, with llama.cpp's meanings. `temperature == 0` is greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = none).
    pub min_p: f32,
    /// Divide positive / multiply negative logits of recent tokens by this (1 = off).
    pub repetition_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

/// Largest temperature accepted; beyond it sampling is uniform noise.
pub const MAX_TEMPERATURE: f32 = 100.0;

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    pub fn validate(&self) -> Result<(), GenerateError> {
        let bad = |name, detail: String| Err(GenerateError::InvalidSampling { name, detail });
        if !(self.temperature.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&self.temperature)) {
            return bad("temperature", format!("{} (must be 0..={MAX_TEMPERATURE})", self.temperature));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} (must be in (0, 1])", self.top_p));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return bad("min_p", format!("{} (must be in [0, 1])", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return bad("repetition_penalty", format!("{} (must be in (0, 10])", self.repetition_penalty));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// Index of the largest value (the first one on ties, as llama.cpp's greedy sampler).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, GenerateError> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Self { params, rng })
    }

    /// Picks the next token from `logits` (modified in place), given the tokens so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(p.repeat_last_n)..];
            let mut seen = std::collections::HashSet::new();
            for &t in recent {
                if let Some(l) = logits.get_mut(t as usize) {
                    if seen.insert(t) {
                        *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        if cand.is_empty() {
            return argmax(logits);
        }
        // top-p and min-p work on the probabilities before temperature (llama.cpp's order:
        // they run on the softmax of the current logits).
        let probs = softmax(&cand, 1.0);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let max = cand[0].1;
            let floor = max + p.min_p.ln();
            cand.retain(|&(_, l)| l >= floor);
        }
        let probs = softmax(&cand, p.temperature);
        let r = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0f64;
        for (i, pr) in probs.iter().enumerate() {
            acc += *pr as f64;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

fn softmax(cand: &[(u32, f32)], temperature: f32) -> Vec<f32> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let mut e: Vec<f32> = cand.iter().map(|c| ((c.1 - max) / temperature).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter_mut().for_each(|x| *x /= sum);
    e
}
