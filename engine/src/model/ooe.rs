//! llm.npu's out-of-order prefill (§3.6) on real threads: a prompt's chunks each hold their own
//! pass state, and every layer is three subgraphs per chunk — the input norm and QKV group
//! (NPU), RoPE and attention into the KV cache (CPU; after the same layer's attention of the
//! previous chunk), the O group, residual, norm, gate/up, SwiGLU and down (NPU) — which one NPU
//! thread and one CPU thread take from the shared [`crate::sched::Scheduler`] in whatever order
//! it picks. The arithmetic of each subgraph is the in-order pass's own (`Pass::attn_qkv`,
//! `attn_core`, `attn_out`, `ffn`), so every legal order gives the same bits.
//!
//! The NPU thread's subgraphs run their linear groups through the executor
//! ([`Transformer::split_linears`]): where the devices' splitter places them — llm.npu's W8A8
//! groups as the NPU device's `Group` executables ([`crate::sched::GroupsOnNpu`]), or
//! HeteroLLM's cuts as parts on the NPU and the GPU.
//!
//! Decision (the authors' code's split): the element-wise work between the O and down groups
//! runs with them as one NPU-thread subgraph, as llm.npu's "Part 2" graph fuses it on the NPU;
//! here it is host arithmetic on that thread.

use super::{Devices, Transformer};
use crate::backend::blocks::{Linears, Logits, Pass, PassState};
use crate::backend::kv::KvCache;
use crate::error::BackendError;
use crate::sched::{run_threads, Dag, Job, Policy, Processor, Timeline};
use llmd_device::{GroupSite, Subgraph};
use std::sync::Mutex;

/// The three subgraphs of a layer, in order.
pub const SUBGRAPHS_PER_LAYER: usize = 3;

impl Transformer {
    /// The chunk × subgraph graph [`Self::prefill_out_of_order`] runs for `chunks` chunks.
    pub fn prefill_dag(&self, chunks: usize) -> Dag {
        let mut specs = Vec::with_capacity(self.weights.layers.len() * SUBGRAPHS_PER_LAYER);
        for l in 0..self.weights.layers.len() {
            specs.push((format!("l{l}.norm_qkv"), Processor::Npu, false));
            specs.push((format!("l{l}.attention"), Processor::Cpu, true));
            specs.push((format!("l{l}.o_ffn"), Processor::Npu, false));
        }
        Dag::chain(chunks, specs)
    }

    /// llm.npu's profiled time T(G) of each job of [`Self::prefill_dag`] for `tokens` prompt
    /// tokens after `base` in chunks of `chunk`. An NPU-lane subgraph's is the modelled time of
    /// its linear groups on the device `devs`' splitter places them on ([`Device::estimate`]:
    /// llm.npu's INT8 cost model over a SoC profile, `QnnDevice::with_chip_profile`) when that
    /// device prices every group; else all are estimated from the shapes, an NPU subgraph by its
    /// multiply-accumulates, attention by its own over its context. Decision: the scheduler's
    /// scores compare only NPU times (Eq. 6), so the CPU's jobs keep the shapes' figure either
    /// way; and any legal order gives the same bits (`engine/tests/npu_ooe.rs`), so an estimate
    /// costs speed at most, never results.
    pub fn prefill_times(
        &self,
        devs: &Devices,
        base: usize,
        tokens: usize,
        chunk: usize,
    ) -> impl Fn(Job) -> f64 + Sync {
        let s = &self.shape;
        let (d, q, kv, ff) =
            (s.d_model as f64, (s.n_heads * s.head_dim) as f64, (s.n_kv_heads * s.head_dim) as f64, s.ffn_dim as f64);
        let (qkv, o_ffn) = (d * (q + 2.0 * kv), d * q + 3.0 * d * ff);
        let chunk = chunk.max(1);
        // The devices' figures for a chunk of `n` rows: (QKV, O + gate/up + down), seconds.
        let descs = self.descs(devs).unwrap_or_default();
        let group_s = |site: GroupSite, n: usize| -> Option<f64> {
            let dev = devs.list.get(devs.splitter.group(0, site, n, &descs)?.checked_sub(1)?)?;
            dev.estimate(Subgraph::group(0, site), &self.shape, n).map(|c| c.total())
        };
        let priced = |n: usize| -> Option<(f64, f64)> {
            Some((
                group_s(GroupSite::Qkv, n)?,
                group_s(GroupSite::O, n)? + group_s(GroupSite::GateUp, n)? + group_s(GroupSite::Down, n)?,
            ))
        };
        let last = match tokens % chunk {
            0 => chunk,
            r => r,
        };
        let modelled = priced(chunk).zip(priced(last));
        move |j: Job| {
            let start = j.chunk * chunk;
            let rows = tokens.saturating_sub(start).min(chunk);
            let n = rows as f64;
            let npu = modelled.map(|(full, tail)| if rows == chunk { full } else { tail });
            match (j.step % SUBGRAPHS_PER_LAYER, npu) {
                (0, Some((qkv_s, _))) => qkv_s,
                (2, Some((_, rest_s))) => rest_s,
                (0, None) => n * qkv,
                // Queries × the keys and values they see (the chunk's own, half on average).
                (1, _) => n * q * 2.0 * ((base + start) as f64 + n / 2.0),
                _ => n * o_ffn,
            }
        }
    }

    /// Prefills `tokens` after what `kv` holds with the linear groups where `devs`' splitter
    /// places them (the NPU's graphs of `chunk` rows) and returns the last token's logits: one
    /// chunk as an in-order pass, more out of order across the chunks
    /// ([`Self::prefill_out_of_order`], llm.npu's score over [`Self::prefill_times`]) — the same
    /// bits either way. `stop`, asked before each group, ends the prefill with an error when it
    /// says so (a withdrawn job); [`Transformer::run`] cuts `kv` back on an error. The product
    /// path's one way in ([`Transformer::run`] with [`super::Run::chunked`]): llmctl's generation and
    /// the daemon's NPU jobs.
    pub(crate) fn prefill_chunks(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        chunk: usize,
        devs: &Devices,
        stop: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Result<Vec<f32>, BackendError> {
        let before = kv.len();
        if tokens.len() <= chunk.max(1) {
            self.forward_batch_on_until(devs, &mut [(&mut *kv, tokens)], Logits::Last, stop)
                .map(|mut l| l.pop().unwrap_or_default())
        } else {
            let linears = self.split_linears_until(devs, stop)?;
            let times = self.prefill_times(devs, before, tokens.len(), chunk);
            self.chunks_out_of_order(kv, tokens, chunk, &linears, Policy::OutOfOrder, &times).map(|(l, _)| l)
        }
    }

    /// Prefills `tokens` after what `kv` holds in chunks of `chunk` tokens, their subgraphs
    /// run out of order across chunks under `policy` on an NPU thread (the linear groups where
    /// `devs`' splitter places them) and a CPU thread, scored with the profiled times `times`
    /// (llm.npu's T(G)); returns the last token's logits and the timeline. `kv` ends as an
    /// in-order prefill leaves it.
    pub fn prefill_out_of_order(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        chunk: usize,
        devs: &Devices,
        policy: Policy,
        times: &(dyn Fn(Job) -> f64 + Sync),
    ) -> Result<(Vec<f32>, Timeline), BackendError> {
        let linears = self.split_linears(devs)?;
        self.chunks_out_of_order(kv, tokens, chunk, &linears, policy, times)
    }

    fn chunks_out_of_order(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        chunk: usize,
        linears: &dyn Linears,
        policy: Policy,
        times: &(dyn Fn(Job) -> f64 + Sync),
    ) -> Result<(Vec<f32>, Timeline), BackendError> {
        if self.devices.is_some() {
            return Err(BackendError::Device(
                "the NPU prefill runs on the host's caches: detach the devices first".into(),
            ));
        }
        if chunk == 0 {
            return Err(BackendError::Shape { op: "prefill", detail: "a chunk of 0 tokens".into() });
        }
        if tokens.is_empty() {
            return Ok((Vec::new(), Timeline { runs: Vec::new(), makespan: 0.0 }));
        }
        let base = kv.len();
        if base + tokens.len() > self.config.context_length {
            return Err(BackendError::Shape {
                op: "prefill",
                detail: format!(
                    "{} positions exceed the context of {}",
                    base + tokens.len(),
                    self.config.context_length
                ),
            });
        }
        kv.move_all_home()?;
        let p = Pass { linears: Some(linears), ..self.pass() };
        let w = &self.weights;
        let parts: Vec<&[u32]> = tokens.chunks(chunk).collect();
        let mut states = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let start = base + i * chunk;
            let mut st = PassState::new(
                &self.shape,
                part.to_vec(),
                (start..start + part.len()).collect(),
                vec![(0, part.len(), start)],
            );
            p.embed(&mut st, &w.token_embd)?;
            states.push(Mutex::new(st));
        }
        let dag = self.prefill_dag(parts.len());
        let kvm = Mutex::new(&mut *kv);
        let work = |j: Job| -> Result<(), BackendError> {
            let (li, part) = (j.step / SUBGRAPHS_PER_LAYER, j.step % SUBGRAPHS_PER_LAYER);
            let (attn, ffn) = w.layers[li].blocks(w.rope_freqs.as_deref());
            let mut st = states[j.chunk].lock().unwrap_or_else(|e| e.into_inner());
            match part {
                0 => p.attn_qkv(&mut st, li, attn, None),
                1 => {
                    let mut kv = kvm.lock().unwrap_or_else(|e| e.into_inner());
                    // This layer holds exactly the earlier chunks' positions (the graph's
                    // cross-chunk edge): the chunk appends after them.
                    kv.set_len(base + j.chunk * chunk);
                    let batch = &mut [(&mut **kv, parts[j.chunk])];
                    Pass::prepare_append(&st, batch, li);
                    p.attn_core(&mut st, batch, li, attn)
                }
                _ => {
                    p.attn_out(&mut st, li, attn, None)?;
                    p.ffn(&mut st, li, ffn, None)
                }
            }
        };
        let timeline = match run_threads(&dag, policy, times, &work) {
            Ok(t) => t,
            Err(e) => {
                // Layers hold different numbers of the prompt's positions: cut every one back.
                kv.set_len(base);
                kv.truncate(base);
                return Err(e);
            }
        };
        let last = states.pop().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()));
        let Some(last) = last else { return Ok((Vec::new(), timeline)) };
        let tail = parts.last().copied().unwrap_or_default();
        kv.set_len(base + tokens.len() - tail.len());
        let out = p.finish(last, &mut [(kv, tail)], &w.output_norm, &w.output, Logits::Last)?.pop().unwrap_or_default();
        w.check_files()?;
        Ok((out, timeline))
    }
}
