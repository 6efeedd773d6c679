//! shadowAttn on the CPU (the pilot where no NPU runs it): per sequence of a prompt chunk, each
//! query head's rows quantized at its bucket's scales, the INT8 pilot's scores over the causally
//! visible keys (`pilot.rs`), the top `k` per row (`sparse::top_k`), then exact attention over
//! only those keys: the same f16 rounding, dot, softmax and weighted sum as dense attention
//! (`attend_one`), over the kept keys gathered in order, so that keeping every key gives dense
//! attention's bits.

use super::attn_kernels::AttnKernels;
use super::pilot::{self, PilotKeys, PilotQueries};
use super::{softmax_rounded, CpuBackend};
use crate::backend::kv::KvLayer;
use crate::backend::sparse::{absmax_scale, kept, top_k_f32, SparseAttn};
use crate::backend::{AttentionItem, AttentionShape};
use crate::error::BackendError;
use half::f16;
use std::collections::HashMap;
use std::sync::Mutex;

/// Query rows per task: the pilot kernel's four-row groups, twice.
const ROWS_PER_TASK: usize = 8;

#[derive(Default)]
struct Scratch {
    q: PilotQueries,
    qs: Vec<f32>,
    scores: Vec<i32>,
    topk: pilot::TopKScratch,
    idx: Vec<u32>,
    truth: Vec<u32>,
    k: Vec<f16>,
    v: Vec<f16>,
    qh: Vec<f32>,
    p: Vec<f32>,
}

thread_local! {
    static SPARSE: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

impl CpuBackend {
    /// shadowAttn over each item (a sequence's prompt rows; f16 caches), layer `layer` of `sa`.
    pub(super) fn sparse_attention(
        &self,
        items: &mut [AttentionItem<'_>],
        layer: usize,
        sa: &SparseAttn,
    ) -> Result<(), BackendError> {
        for it in items.iter_mut() {
            if let crate::backend::kv::KvInput::Ready(kv) = &it.kv {
                super::check_attention(&it.shape, it.q, *kv, it.out)?;
            }
            let kv = it.append_all()?;
            let KvLayer::F16 { k, v } = kv else {
                // An int8 cache: dense attention (the pilot reads f16 keys).
                super::super::Backend::attention(self, &it.shape, it.q, kv, it.out)?;
                continue;
            };
            self.sparse_item(&it.shape, it.q, (k, v), it.out, layer, sa)?;
        }
        Ok(())
    }

    fn sparse_item(
        &self,
        s: &AttentionShape,
        q: &[f32],
        (k, v): (&[Vec<f16>], &[Vec<f16>]),
        out: &mut [f32],
        layer: usize,
        sa: &SparseAttn,
    ) -> Result<(), BackendError> {
        let hd = s.head_dim;
        let (nh, nkv) = (s.n_heads, s.n_kv_heads);
        let total = s.start + s.n_tokens;
        let group = nh / nkv;
        let q_row = nh * hd;
        if k.iter().chain(v).any(|x| x.len() < total * hd) {
            return Err(BackendError::Shape { op: "sparse attention", detail: format!("{s:?}: cache too short") });
        }
        // Two exact changes of the operands before quantizing, neither changing any row's order
        // of scores (all top-k reads), both narrowing the ranges INT8 must cover:
        // - each KV head's mean key taken out (a row's scores all move by the same q·mean);
        // - per channel c, queries times s_c and keys divided by it, s_c = sqrt(max|k_c| /
        //   max|q_c|) over the group's heads (SmoothQuant at α = 0.5): q·k is unchanged, an
        //   outlier channel's range shared between the two.
        let prep: Vec<(Vec<f32>, Vec<f32>)> = (0..nkv)
            .map(|kvh| {
                let kh = &k[kvh][..total * hd];
                let mut mean = vec![0f64; hd];
                for row in kh.chunks_exact(hd) {
                    mean.iter_mut().zip(row).for_each(|(m, x)| *m += x.to_f32() as f64);
                }
                let mean: Vec<f32> = mean.into_iter().map(|x| (x / total as f64) as f32).collect();
                let mut mk = vec![0f32; hd];
                for row in kh.chunks_exact(hd) {
                    for ((m, x), mu) in mk.iter_mut().zip(row).zip(&mean) {
                        *m = m.max((x.to_f32() - mu).abs());
                    }
                }
                let mut mq = vec![0f32; hd];
                for t in 0..s.n_tokens {
                    for h in kvh * group..(kvh + 1) * group {
                        let row = &q[t * q_row + h * hd..t * q_row + (h + 1) * hd];
                        mq.iter_mut().zip(row).for_each(|(m, x)| *m = m.max(x.abs()));
                    }
                }
                let smooth =
                    mk.iter().zip(&mq).map(|(&a, &b)| if a > 0.0 && b > 0.0 { (a / b).sqrt() } else { 1.0 }).collect();
                (mean, smooth)
            })
            .collect();
        // Each head's exact scales of the changed operands, then its bucket's: Q over the chunk's
        // rows, K over every visible key of its KV head.
        let k_exact: Vec<f32> = (0..nkv)
            .map(|kvh| {
                let (mean, smooth) = &prep[kvh];
                absmax_scale(
                    k[kvh][..total * hd]
                        .chunks_exact(hd)
                        .flat_map(|r| r.iter().zip(mean).zip(smooth).map(|((x, m), s)| (x.to_f32() - m) / s)),
                )
            })
            .collect();
        let mut scales = Vec::with_capacity(nh);
        for h in 0..nh {
            let smooth = &prep[h / group].1;
            let qe =
                absmax_scale((0..s.n_tokens).flat_map(|t| {
                    q[t * q_row + h * hd..t * q_row + (h + 1) * hd].iter().zip(smooth).map(|(x, s)| x * s)
                }));
            let ke = k_exact[h / group];
            if let Some(p) = &sa.probe {
                p.add_scales(layer, qe as f64, ke as f64);
            }
            scales.push(sa.scales(layer, (qe, ke)));
        }
        // The keys at each (KV head, key scale) some head of the group uses, quantized once.
        let mut wanted: Vec<(usize, u32)> = (0..nh).map(|h| (h / group, scales[h].1.to_bits())).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let built: Vec<Mutex<Option<PilotKeys>>> = wanted.iter().map(|_| Mutex::new(None)).collect();
        self.pool.run(wanted.len(), &|i| {
            let (kvh, bits) = wanted[i];
            let (kh, (mean, smooth)) = (&k[kvh], &prep[kvh]);
            let keys = PilotKeys::build(total, hd, f32::from_bits(bits), |j, row| {
                for (((o, x), m), s) in row.iter_mut().zip(&kh[j * hd..(j + 1) * hd]).zip(mean).zip(smooth) {
                    *o = (x.to_f32() - m) / s;
                }
            });
            *built[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(keys);
        });
        let keys: HashMap<(usize, u32), PilotKeys> = wanted
            .iter()
            .zip(built)
            .filter_map(|(w, b)| b.into_inner().unwrap_or_else(|e| e.into_inner()).map(|k| (*w, k)))
            .collect();
        sa.sparse_rows.fetch_add(s.n_tokens as u64, std::sync::atomic::Ordering::Relaxed);
        let measure = sa.probe.as_ref().is_some_and(|p| p.measures_recall());
        let kern = AttnKernels::best();
        let scale = 1.0 / (hd as f32).sqrt();
        let stride = pilot::stride_for(total);
        let tasks: Vec<Mutex<(usize, &mut [f32])>> = out
            .chunks_mut(ROWS_PER_TASK * q_row)
            .enumerate()
            .map(|(i, c)| Mutex::new((i * ROWS_PER_TASK, c)))
            .collect();
        let failed = Mutex::new(None);
        self.pool.run(tasks.len(), &|ti| {
            let mut g = tasks[ti].lock().unwrap_or_else(|e| e.into_inner());
            let (t0, ref mut o) = *g;
            let rows = o.len() / q_row;
            SPARSE.with(|sc| {
                let sc = &mut *sc.borrow_mut();
                let visible: Vec<usize> = (t0..t0 + rows).map(|t| s.start + t + 1).collect();
                let mut qrows: Vec<&[f32]> = Vec::with_capacity(rows);
                sc.scores.resize(rows * stride, 0);
                let (mut hit, mut all, mut tied) = (0u64, 0u64, 0u64);
                for h in 0..nh {
                    let kvh = h / group;
                    let Some(pk) = keys.get(&(kvh, scales[h].1.to_bits())) else {
                        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some("pilot keys missing");
                        return;
                    };
                    qrows.clear();
                    qrows.extend((t0..t0 + rows).map(|t| &q[t * q_row + h * hd..t * q_row + (h + 1) * hd]));
                    let smooth = &prep[kvh].1;
                    sc.qs.clear();
                    for r in &qrows {
                        sc.qs.extend(r.iter().zip(smooth).map(|(x, s)| x * s));
                    }
                    sc.q.fill_flat(&sc.qs, hd, scales[h].0);
                    pilot::scores(&sc.q, pk, &visible, &mut sc.scores, stride);
                    let ratio = sa.ratio(layer, h);
                    for (r, &vis) in visible.iter().enumerate() {
                        let kr = kept(ratio, vis);
                        let row = &sc.scores[r * stride..r * stride + vis];
                        pilot::top_k(row, kr, &mut sc.topk, &mut sc.idx);
                        // The query rounded to f16, as dense attention rounds it.
                        sc.qh.clear();
                        sc.qh.extend_from_slice(qrows[r]);
                        (kern.scale_round)(&mut sc.qh, 1.0);
                        if measure && kr < vis {
                            sc.p.resize(vis, 0.0);
                            (kern.dots)(&sc.qh, &k[kvh], hd, &mut sc.p);
                            top_k_f32(&sc.p, kr, &mut sc.truth);
                            hit += count_common(&sc.idx, &sc.truth);
                            all += kr as u64;
                            // A tie at the k-th score: the pilot's choice there is arbitrary.
                            let kth = sc.idx.iter().map(|&j| row[j as usize]).min().unwrap_or(i32::MIN);
                            let mut sel = sc.idx.iter().peekable();
                            let rest_max = (0..vis)
                                .filter(|&j| {
                                    if sel.peek().is_some_and(|&&x| x as usize == j) {
                                        sel.next();
                                        false
                                    } else {
                                        true
                                    }
                                })
                                .map(|j| row[j])
                                .max();
                            tied += u64::from(rest_max == Some(kth));
                        }
                        // Kept rows copied element by element (a loop the compiler unrolls;
                        // `extend_from_slice` calls memmove per 128-byte row).
                        let kk = sc.idx.len() * hd;
                        sc.k.resize(kk, f16::ZERO);
                        sc.v.resize(kk, f16::ZERO);
                        for ((&j, kd), vd) in
                            sc.idx.iter().zip(sc.k.chunks_exact_mut(hd)).zip(sc.v.chunks_exact_mut(hd))
                        {
                            let j = j as usize;
                            for (d, s) in kd.iter_mut().zip(&k[kvh][j * hd..(j + 1) * hd]) {
                                *d = *s;
                            }
                            for (d, s) in vd.iter_mut().zip(&v[kvh][j * hd..(j + 1) * hd]) {
                                *d = *s;
                            }
                        }
                        sc.p.clear();
                        sc.p.resize(sc.idx.len(), 0.0);
                        (kern.dots)(&sc.qh, &sc.k, hd, &mut sc.p);
                        softmax_rounded(&mut sc.p, scale, &kern);
                        let oh = &mut o[r * q_row + h * hd..r * q_row + (h + 1) * hd];
                        oh.fill(0.0);
                        (kern.axpys)(&sc.p, &sc.v, hd, oh);
                    }
                }
                if measure {
                    if let Some(p) = &sa.probe {
                        p.add_recall(layer, hit, all, (rows * nh) as u64, tied);
                    }
                }
            });
        });
        if let Some(what) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(BackendError::Shape { op: "sparse attention", detail: what.into() });
        }
        Ok(())
    }
}

/// How many values two ascending lists share.
fn count_common(a: &[u32], b: &[u32]) -> u64 {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}
