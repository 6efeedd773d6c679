//! llm.npu's out-of-order prefill (§3.6) as the executor runs it: a prompt's chunks each hold
//! their own pass state, every layer is its five parts ([`llmd_device::Subgraph::layer_parts`]),
//! and one thread per processor takes the parts from the shared [`crate::sched::Scheduler`] in
//! whatever order it picks (`placed.rs`: [`Transformer::prefill_dag`], `prefill_placed`). A
//! part whose linear group the devices' splitter places on the NPU (llm.npu's W8A8 groups,
//! [`crate::sched::GroupsOnNpu`]; HeteroLLM's cuts) is in the NPU's lane, attention's core in
//! the CPU's. The arithmetic of each part is the in-order pass's own, so every legal order
//! gives the same bits. This file holds the job times the scheduler scores with and the
//! product's way in.
//!
//! Decision (the authors' code's split): the element-wise work between the O and down groups
//! (the residual add, the norm, SwiGLU) runs with them, as llm.npu's "Part 2" graph fuses it on
//! the NPU; here it is host arithmetic on that lane's thread.

use super::{Devices, Transformer};
use crate::backend::blocks::Logits;
use crate::backend::kv::KvCache;
use crate::error::BackendError;
use crate::sched::{Job, Policy, Timeline};
use llmd_device::{GroupSite, Subgraph};

impl Transformer {
    /// llm.npu's profiled time T(G) of each job of [`Self::prefill_dag`] for `tokens` prompt
    /// tokens after `base` in chunks of `chunk`. A part's with a linear group is the modelled
    /// time of that group on the device `devs`' splitter places it on ([`Device::estimate`]:
    /// llm.npu's INT8 cost model over a SoC profile, `QnnDevice::with_chip_profile`) when that
    /// device prices every group; else all are estimated from the shapes, a part by its
    /// multiply-accumulates, attention's core by its own over its context. Decision: the
    /// scheduler's scores compare only NPU times (Eq. 6), so the CPU's jobs keep the shapes'
    /// figure either way; and any legal order gives the same bits (`engine/tests/npu_ooe.rs`),
    /// so an estimate costs speed at most, never results.
    ///
    /// [`Device::estimate`]: llmd_device::Device::estimate
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
        // Multiply-accumulates per token of each part's group, in the parts' order.
        let macs = [d * (q + 2.0 * kv), 0.0, q * d, 2.0 * d * ff, ff * d];
        let chunk = chunk.max(1);
        let descs = self.descs(devs).unwrap_or_default();
        let group_s = |site: GroupSite, n: usize| -> Option<f64> {
            let dev = devs.list.get(devs.splitter.group(0, site, n, &descs)?.checked_sub(1)?)?;
            dev.estimate(Subgraph::group(0, site), &self.shape, n).map(|c| c.total())
        };
        // The devices' figures for a chunk of `n` rows, per part (seconds; attention's unused).
        let priced = |n: usize| -> Option<[f64; 5]> {
            let mut t = [0.0; 5];
            for (i, p) in Subgraph::layer_parts(0).iter().enumerate() {
                if let Some(site) = p.group_site() {
                    t[i] = group_s(site, n)?;
                }
            }
            Some(t)
        };
        let last = match tokens % chunk {
            0 => chunk,
            r => r,
        };
        let modelled = priced(chunk).zip(priced(last));
        let per_layer = Subgraph::LAYER_PARTS.len();
        move |j: Job| {
            let start = j.chunk * chunk;
            let rows = tokens.saturating_sub(start).min(chunk);
            let n = rows as f64;
            let part = j.step % per_layer;
            if Subgraph::LAYER_PARTS[part] == llmd_device::SubgraphKind::AttnCore {
                // Queries × the keys and values they see (the chunk's own, half on average).
                return n * q * 2.0 * ((base + start) as f64 + n / 2.0);
            }
            match modelled {
                Some((full, tail)) => (if rows == chunk { full } else { tail })[part],
                None => n * macs[part],
            }
        }
    }

    /// Prefills `tokens` after what `kv` holds with the linear groups where `devs`' splitter
    /// places them (the NPU's graphs of `chunk` rows) and returns the last token's logits: one
    /// chunk as an in-order pass, more out of order across the chunks (llm.npu's score over
    /// [`Self::prefill_times`]) — the same bits either way. `stop`, asked before each job and
    /// each group, ends the prefill with an error when it says so (a withdrawn job);
    /// [`Transformer::run`] cuts `kv` back on an error. The product path's one way in
    /// ([`Transformer::run`] with [`super::Run::chunked`]): llmctl's generation and the
    /// daemon's NPU jobs.
    pub(crate) fn prefill_chunks(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        chunk: usize,
        devs: &Devices,
        stop: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Result<Vec<f32>, BackendError> {
        if tokens.len() <= chunk.max(1) {
            self.forward_batch_on_until(devs, &mut [(&mut *kv, tokens)], Logits::Last, stop)
                .map(|mut l| l.pop().unwrap_or_default())
        } else {
            let times = self.prefill_times(devs, kv.len(), tokens.len(), chunk);
            self.prefill_placed(devs, kv, tokens, chunk, Policy::OutOfOrder, &times, stop).map(|(l, t)| {
                if let Some(origin) = t.origin {
                    devs.push_trace(super::devices::Trace { origin, runs: t.runs });
                }
                l
            })
        }
    }

    /// Prefills `tokens` after what `kv` holds in chunks of `chunk` tokens through the
    /// executor, the jobs ordered by `policy` over the job times `times` (llm.npu's T(G)):
    /// the last token's logits and the timeline, `kv` as an in-order prefill leaves it. For
    /// comparing schedules (`engine/tests/npu_ooe.rs`); the product runs
    /// [`Transformer::run`] with [`super::Run::chunked`] (llm.npu's policy and times).
    pub fn prefill_out_of_order(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        chunk: usize,
        devs: &Devices,
        policy: Policy,
        times: &(dyn Fn(Job) -> f64 + Sync),
    ) -> Result<(Vec<f32>, Timeline), BackendError> {
        self.prefill_placed(devs, kv, tokens, chunk, policy, times, None)
    }
}
