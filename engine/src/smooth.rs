//! EdgeFlow's NPU-aware smoothing (§4.1): per input channel `j` of a linear layer, a scale
//! `s_j = S_I[j]^α` (S_I: the channel's max |activation| over a calibration text) multiplies
//! the weight's column `j` and divides the operator that produces the input, so the network's
//! function is unchanged while the bit allocation and the rounding see the columns that carry
//! large activations as larger — they get more precision.
//!
//! Where the factors fold (the paper names the norm or the previous linear; the rest is ours):
//! * Q, K, V share their input: one scale vector, folded into `attn_norm`.
//! * gate and up share theirs: folded into `ffn_norm`.
//! * O's input is the attention output; channel `(h, i)` is a softmax-weighted sum of row
//!   `(kv(h), i)` of V, so the scale is shared by the query heads of one KV head (their max
//!   activation) and folded into V's rows (and V's bias).
//! * down's input is `silu(gate) · up`: folded into up's rows.
//!
//! β (the output-side factor for a per-tensor quantized matmul *output*) changes no weight code:
//! it multiplies whole output channels, and both the closed-form error and the per-channel
//! scales are invariant to that. The CPU path quantizes activations dynamically per block, so
//! β = 1 is implied and not stored; an NPU backend applies it in its output requantization.
//!
//! α is chosen per layer and per input group from a grid, minimizing the squared error of the
//! quantized linear's output on the calibration activations (the paper's "quantization error";
//! its step and granularity are not given: we use steps of 0.1, per group).

use crate::error::EngineError;
use crate::format::llmd::encode_edgeflow;
use crate::model::CaptureSite;
use crate::quant::edgeflow;
use crate::Model;

/// The α grid (0, 0.1, …, 1).
pub const ALPHAS: [f32; 11] = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
/// Calibration tokens whose activations enter the α objective (all tokens enter the maxima).
pub const OBJECTIVE_TOKENS: usize = 64;

/// Column scales of one layer, per input group.
#[derive(Clone, Debug, Default)]
pub struct LayerScales {
    /// Q/K/V input (d_model).
    pub qkv: Vec<f32>,
    /// O input (q_dim; equal within a KV head's group of query heads).
    pub o: Vec<f32>,
    /// gate/up input (d_model).
    pub gate_up: Vec<f32>,
    /// down input (ffn_dim).
    pub down: Vec<f32>,
}

/// The smoothing of a whole model, from [`Smoothing::calibrate`].
#[derive(Clone, Debug, Default)]
pub struct Smoothing {
    pub layers: Vec<LayerScales>,
    /// The α chosen per layer and group (qkv, o, gate_up, down), flattened.
    pub alpha: Vec<f32>,
    pub calibration_tokens: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

fn scale_cols(w: &mut [f32], cols: usize, s: &[f32]) {
    if s.len() != cols {
        return;
    }
    for row in w.chunks_exact_mut(cols) {
        row.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
    }
}

fn divide_rows(w: &mut [f32], cols: usize, s: &[f32]) {
    for (row, &s) in w.chunks_exact_mut(cols).zip(s) {
        row.iter_mut().for_each(|x| *x /= s);
    }
}

impl Smoothing {
    /// V's row scales: the O scale of the first query head of each KV head's group.
    fn v_rows(&self, l: &LayerScales) -> Vec<f32> {
        let group = self.n_heads / self.n_kv_heads.max(1);
        (0..self.n_kv_heads * self.head_dim)
            .map(|r| {
                let (g, i) = (r / self.head_dim, r % self.head_dim);
                l.o.get(g * group * self.head_dim + i).copied().unwrap_or(1.0)
            })
            .collect()
    }

    /// Scales a linear weight of layer `li` (`short`: its name inside the layer).
    pub fn apply_to_weight(&self, li: usize, short: &str, w: &mut [f32], _rows: usize, cols: usize) {
        let Some(l) = self.layers.get(li) else { return };
        match short {
            "attn_q.weight" | "attn_k.weight" => scale_cols(w, cols, &l.qkv),
            "attn_v.weight" => {
                scale_cols(w, cols, &l.qkv);
                divide_rows(w, cols, &self.v_rows(l));
            }
            "attn_output.weight" => scale_cols(w, cols, &l.o),
            "ffn_gate.weight" => scale_cols(w, cols, &l.gate_up),
            "ffn_up.weight" => {
                scale_cols(w, cols, &l.gate_up);
                divide_rows(w, cols, &l.down);
            }
            "ffn_down.weight" => scale_cols(w, cols, &l.down),
            _ => {}
        }
    }

    /// Divides the operator before each group by its scales (norms, V's bias).
    pub fn apply_to_vector(&self, li: usize, short: &str, v: &mut [f32]) {
        let Some(l) = self.layers.get(li) else { return };
        let s = match short {
            "attn_norm.weight" => l.qkv.clone(),
            "ffn_norm.weight" => l.gate_up.clone(),
            "attn_v.bias" => self.v_rows(l),
            _ => return,
        };
        if s.len() == v.len() {
            v.iter_mut().zip(&s).for_each(|(x, s)| *x /= s);
        }
    }

    /// Runs `tokens` through `model` (the source), records each linear group's input, and
    /// picks α per layer and group for a `bits` budget.
    pub fn calibrate(model: &Model, tokens: &[u32], bits: f64, threads: usize) -> Result<Self, EngineError> {
        let c = model.config().clone();
        let mut stats = vec![SiteStats::default(); c.n_layers * 4];
        let chunk = 256usize;
        let mut kv = model.transformer.new_kv();
        for (k, part) in tokens.chunks(chunk).enumerate() {
            if kv.len() + part.len() > c.context_length {
                kv = model.transformer.new_kv();
            }
            model.transformer.forward_capture(
                &mut kv,
                part,
                crate::backend::blocks::Logits::Last,
                None,
                &mut |li, site, x, cols| {
                    let s = &mut stats[li * 4 + site as usize];
                    s.add(x, cols, if k == 0 { OBJECTIVE_TOKENS } else { 0 });
                },
            )?;
        }
        let w = &model.transformer.weights;
        let mut out = Smoothing {
            calibration_tokens: tokens.len(),
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            ..Default::default()
        };
        let group = c.n_heads / c.n_kv_heads;
        for (li, l) in w.layers.iter().enumerate() {
            let mut ls = LayerScales::default();
            for site in [CaptureSite::Qkv, CaptureSite::O, CaptureSite::GateUp, CaptureSite::Down] {
                let st = &stats[li * 4 + site as usize];
                let mut smax = st.max.clone();
                if site == CaptureSite::O {
                    // One scale per (KV head, dim): the max over the query heads that share it.
                    for g in 0..c.n_kv_heads {
                        for i in 0..c.head_dim {
                            let idx = |h: usize| (g * group + h) * c.head_dim + i;
                            let m = (0..group).map(|h| smax[idx(h)]).fold(0f32, f32::max);
                            (0..group).for_each(|h| smax[idx(h)] = m);
                        }
                    }
                }
                let mats: Vec<&crate::model::weights::WeightMatrix> = match site {
                    CaptureSite::Qkv => vec![&l.wq, &l.wk, &l.wv],
                    CaptureSite::O => vec![&l.wo],
                    CaptureSite::GateUp => vec![&l.w_gate, &l.w_up],
                    CaptureSite::Down => vec![&l.w_down],
                };
                let deq: Vec<(Vec<f32>, usize)> = mats.iter().map(|m| (dequantize_matrix(m), m.rows)).collect();
                let cols = smax.len();
                // The grid's points are independent: spread them over the threads.
                let n_threads = if threads == 0 {
                    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
                } else {
                    threads
                };
                let errs: Vec<f64> = std::thread::scope(|sc| {
                    let hs: Vec<_> = (0..n_threads)
                        .map(|t| {
                            let (deq, smax, st) = (&deq, &smax, st);
                            sc.spawn(move || {
                                ALPHAS
                                    .iter()
                                    .enumerate()
                                    .filter(|(i, _)| i % n_threads == t)
                                    .map(|(i, &alpha)| {
                                        let s = scales_for(smax, alpha);
                                        let e: f64 = deq
                                            .iter()
                                            .map(|(wf, rows)| {
                                                output_error(wf, *rows, cols, &s, &st.sample, st.sample_rows, bits, 1)
                                            })
                                            .sum();
                                        (i, e)
                                    })
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    let mut all = vec![f64::INFINITY; ALPHAS.len()];
                    for h in hs {
                        for (i, e) in h.join().unwrap_or_default() {
                            all[i] = e;
                        }
                    }
                    all
                });
                // The lowest error; ties to the smaller α (less change to the network).
                let (bi, _) = errs
                    .iter()
                    .enumerate()
                    .fold((0usize, f64::INFINITY), |b, (i, &e)| if e < b.1 { (i, e) } else { b });
                let best = (errs[bi], ALPHAS[bi], scales_for(&smax, ALPHAS[bi]));
                out.alpha.push(best.1);
                match site {
                    CaptureSite::Qkv => ls.qkv = best.2,
                    CaptureSite::O => ls.o = best.2,
                    CaptureSite::GateUp => ls.gate_up = best.2,
                    CaptureSite::Down => ls.down = best.2,
                }
            }
            out.layers.push(ls);
        }
        Ok(out)
    }
}

/// `s_j = S_I[j]^α`, normalized to a geometric mean of 1 (keeps scales near 1 for f16),
/// with channels that never fired left at 1.
pub fn scales_for(smax: &[f32], alpha: f32) -> Vec<f32> {
    let raw: Vec<f32> = smax.iter().map(|&m| if m > 0.0 { m.powf(alpha) } else { 1.0 }).collect();
    let log_mean = raw.iter().map(|x| (*x as f64).ln()).sum::<f64>() / raw.len().max(1) as f64;
    let norm = (-log_mean).exp() as f32;
    raw.iter().map(|x| (x * norm).clamp(1e-4, 1e4)).collect()
}

/// A weight's rows as f32 (from its packed copy or its file bytes).
fn dequantize_matrix(m: &crate::model::weights::WeightMatrix) -> Vec<f32> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (r, o) in out.chunks_exact_mut(m.cols).enumerate() {
        if let Some(p) = &m.packed {
            p.dequantize_row(r, o);
        } else if let Some(row) = m.row(r) {
            let _ = crate::quant::dequantize_row(m.ty, row, o);
        }
    }
    out
}

/// Σ over sample tokens and rows of (x·w − (x/s)·Q(w·s))² for a `bits` EdgeFlow quantization.
#[allow(clippy::too_many_arguments)]
fn output_error(w: &[f32], rows: usize, cols: usize, s: &[f32], x: &[f32], n: usize, bits: f64, threads: usize) -> f64 {
    let mut ws = w.to_vec();
    scale_cols(&mut ws, cols, s);
    let (bytes, widths) = encode_edgeflow(&ws, rows, cols, bits, threads);
    let (bits_len, scales_len) = crate::format::llmd::edgeflow_prefix(rows);
    let mut at = bits_len + scales_len;
    let mut q = vec![0f32; rows * cols];
    let mut buf = vec![0i8; edgeflow::groups(cols) * edgeflow::GROUP];
    for (r, row) in q.chunks_exact_mut(cols).enumerate() {
        let d = half::f16::from_le_bytes([bytes[bits_len + 2 * r], bytes[bits_len + 2 * r + 1]]).to_f32();
        let nb = edgeflow::channel_bytes(widths[r], cols);
        crate::backend::cpu::unpack::unpack_channel(widths[r], &bytes[at..at + nb], &mut buf);
        at += nb;
        // Undo the column scale here, so the product below uses the unscaled input.
        for ((o, &v), &sj) in row.iter_mut().zip(&buf).zip(s) {
            *o = d * v as f32 / sj;
        }
    }
    let mut err = 0f64;
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let (a, b) = (&w[r * cols..(r + 1) * cols], &q[r * cols..(r + 1) * cols]);
            let mut e = 0f32;
            for ((&xv, &av), &bv) in xt.iter().zip(a).zip(b) {
                e += xv * (av - bv);
            }
            err += (e as f64) * (e as f64);
        }
    }
    err
}

/// Per input channel max |x| over all tokens, and the first tokens' rows for the objective.
#[derive(Clone, Debug, Default)]
struct SiteStats {
    max: Vec<f32>,
    sample: Vec<f32>,
    sample_rows: usize,
}

impl SiteStats {
    fn add(&mut self, x: &[f32], cols: usize, keep: usize) {
        if self.max.len() != cols {
            self.max = vec![0.0; cols];
        }
        for row in x.chunks_exact(cols) {
            for (m, v) in self.max.iter_mut().zip(row) {
                *m = m.max(v.abs());
            }
        }
        let rows = (x.len() / cols).min(keep.saturating_sub(self.sample_rows));
        self.sample.extend_from_slice(&x[..rows * cols]);
        self.sample_rows += rows;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic pseudo-random sequence in [-1, 1).
    fn vals(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn matvec(w: &[f32], cols: usize, x: &[f32]) -> Vec<f32> {
        w.chunks_exact(cols).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
    }

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + x.abs()), "{x} vs {y}");
        }
    }

    /// Folding the scales leaves every group's function unchanged (before quantization).
    #[test]
    fn folded_scales_preserve_the_layer() {
        let (d, heads, kvh, hd, ffn) = (8, 4, 2, 2, 6);
        let (q, kv) = (heads * hd, kvh * hd);
        let pos = |v: Vec<f32>| v.into_iter().map(|x| 0.2 + x.abs() * 3.0).collect::<Vec<f32>>();
        let mut o_s = pos(vals(q, 3));
        // O's scales are shared by the query heads of one KV head, as calibrate makes them.
        for h in 0..heads {
            for i in 0..hd {
                o_s[h * hd + i] = o_s[(h / (heads / kvh)) * (heads / kvh) * hd + i];
            }
        }
        let sm = Smoothing {
            layers: vec![LayerScales {
                qkv: pos(vals(d, 1)),
                o: o_s,
                gate_up: pos(vals(d, 2)),
                down: pos(vals(ffn, 4)),
            }],
            n_heads: heads,
            n_kv_heads: kvh,
            head_dim: hd,
            ..Default::default()
        };
        let xhat = vals(d, 5);
        // Q/K/V through attn_norm.
        let (wq, gamma) = (vals(q * d, 6), vals(d, 7));
        let (mut wq2, mut gamma2) = (wq.clone(), gamma.clone());
        sm.apply_to_weight(0, "attn_q.weight", &mut wq2, q, d);
        sm.apply_to_vector(0, "attn_norm.weight", &mut gamma2);
        let h: Vec<f32> = xhat.iter().zip(&gamma).map(|(a, b)| a * b).collect();
        let h2: Vec<f32> = xhat.iter().zip(&gamma2).map(|(a, b)| a * b).collect();
        close(&matvec(&wq, d, &h), &matvec(&wq2, d, &h2));
        // V (with bias) → each query head reads its KV head's values → O.
        let (wv, bv, wo) = (vals(kv * d, 8), vals(kv, 9), vals(d * q, 10));
        let (mut wv2, mut bv2, mut wo2) = (wv.clone(), bv.clone(), wo.clone());
        sm.apply_to_weight(0, "attn_v.weight", &mut wv2, kv, d);
        sm.apply_to_vector(0, "attn_v.bias", &mut bv2);
        sm.apply_to_weight(0, "attn_output.weight", &mut wo2, d, q);
        let run = |wv: &[f32], bv: &[f32], wo: &[f32], gamma: &[f32]| {
            let h: Vec<f32> = xhat.iter().zip(gamma).map(|(a, b)| a * b).collect();
            let v: Vec<f32> = matvec(wv, d, &h).iter().zip(bv).map(|(a, b)| a + b).collect();
            let attn: Vec<f32> = (0..q).map(|c| v[(c / hd) / (heads / kvh) * hd + c % hd]).collect();
            matvec(wo, q, &attn)
        };
        close(&run(&wv, &bv, &wo, &gamma), &run(&wv2, &bv2, &wo2, &gamma2));
        // gate/up through ffn_norm, then down.
        let (wg, wu, wd, g2) = (vals(ffn * d, 11), vals(ffn * d, 12), vals(d * ffn, 13), vals(d, 14));
        let (mut wg2, mut wu2, mut wd2, mut g22) = (wg.clone(), wu.clone(), wd.clone(), g2.clone());
        sm.apply_to_weight(0, "ffn_gate.weight", &mut wg2, ffn, d);
        sm.apply_to_weight(0, "ffn_up.weight", &mut wu2, ffn, d);
        sm.apply_to_weight(0, "ffn_down.weight", &mut wd2, d, ffn);
        sm.apply_to_vector(0, "ffn_norm.weight", &mut g22);
        let ffn_out = |wg: &[f32], wu: &[f32], wd: &[f32], gamma: &[f32]| {
            let h: Vec<f32> = xhat.iter().zip(gamma).map(|(a, b)| a * b).collect();
            let g = matvec(wg, d, &h);
            let u = matvec(wu, d, &h);
            let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            matvec(wd, ffn, &a)
        };
        close(&ffn_out(&wg, &wu, &wd, &g2), &ffn_out(&wg2, &wu2, &wd2, &g22));
    }

    #[test]
    fn scales_have_unit_geometric_mean_and_alpha_zero_is_identity() {
        let smax = vec![0.5, 2.0, 8.0, 0.0, 1.0];
        assert!(scales_for(&smax, 0.0).iter().all(|&s| (s - 1.0).abs() < 1e-6));
        let s = scales_for(&smax, 0.5);
        let gm: f64 = s.iter().map(|x| (*x as f64).ln()).sum::<f64>() / s.len() as f64;
        assert!(gm.abs() < 1e-6);
        assert!(s[2] > s[1] && s[1] > s[0], "larger activations get larger column scales");
    }
}
