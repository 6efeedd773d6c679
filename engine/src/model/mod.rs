//! Llama-family models (llama, mistral-style GQA, qwen2 with Q/K/V biases): configuration,
//! weights, KV cache, and the forward pass, which places every op through the [`Planner`].

pub use crate::backend::kv;
pub use crate::config;
mod devices;
mod ooe;
mod placed;
pub mod split;
pub use devices::{Devices, SplitStats};
pub mod stream;
pub mod weights;

pub use crate::backend::blocks::{Capture, CaptureSite, Logits};
use crate::backend::blocks::{Pass, PassState};
use crate::backend::Planner;
use crate::error::BackendError;
use config::ModelConfig;
use kv::KvCache;
use llmd_device::BlockShape;
use weights::ModelWeights;

/// Decode tokens per part below which a pass split over the threads
/// ([`Transformer::forward_batch`]) is slower than one pass over the whole batch. Measured on
/// the default model with 2 threads (`batchbench`, split and whole passes alternating, 300
/// passes, ratio of median ms per pass): 4 and 8 sequences per part (B=8, B=16) 0.91–0.97;
/// 3 and 4 (B=7) 0.95–0.99; 3 (B=6) 1.05–1.07 and 2 (B=4) 1.08–1.09, where each part reading
/// all the layers' weights for itself costs more than the barriers it saves.
pub const SPLIT_MIN_TOKENS_PER_PART: usize = 4;

/// The parts [`Transformer::forward_batch`] runs a batch in, given each sequence's token count
/// and how many parts the backend can run at once: `Some(parts)` (every thread one part) for a
/// batch of decode steps (one token each) with at least [`SPLIT_MIN_TOKENS_PER_PART`] per part,
/// else `None` (one pass). Prompt chunks are not split: a chunk is one sequence's tokens, so
/// parts would be uneven, and its matmuls already keep every thread busy.
pub fn split_plan(tokens: &[usize], parts: usize) -> Option<usize> {
    (parts >= 2 && tokens.iter().all(|&t| t == 1) && tokens.len() >= SPLIT_MIN_TOKENS_PER_PART * parts).then_some(parts)
}

/// The network: configuration, weights and the backends that run it.
pub struct Transformer {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    /// The configuration as devices see it.
    pub shape: BlockShape,
    planner: Planner,
    /// Devices besides the host that passes are placed on (none: every subgraph on the host).
    devices: Option<devices::Devices>,
    /// How new KV caches store keys and values.
    pub kv_type: kv::KvType,
}

impl Transformer {
    pub fn new(config: ModelConfig, weights: ModelWeights, planner: Planner) -> Self {
        let shape =
            config.block_shape(weights.layers.first().is_some_and(|l| l.bq.is_some()), weights.rope_freqs.is_some());
        Self { config, weights, shape, planner, devices: None, kv_type: kv::KvType::F16 }
    }

    /// Runs later passes across the host and `devices`, each subgraph where `cost` prices it
    /// cheapest among those that can run it ([`crate::sched::place`]); an empty list goes back
    /// to the host alone. Weights are loaded onto a device when a pass first places a subgraph
    /// there. KV caches made before this call hold only host layers.
    pub fn attach_devices(
        &mut self,
        devices: Vec<std::sync::Arc<dyn llmd_device::Device>>,
        cost: std::sync::Arc<dyn crate::sched::CostModel>,
    ) {
        self.attach(Devices::new(devices, cost));
    }

    /// The devices attached ([`Self::attach`]), if any.
    pub fn devices(&self) -> Option<&Devices> {
        self.devices.as_ref()
    }

    /// Runs later passes on `devs` (their cost model and splitter), as [`Self::attach_devices`].
    pub fn attach(&mut self, devs: Devices) {
        self.devices = (!devs.list.is_empty()).then_some(devs);
    }

    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// The prefill chunk to use when `wanted` tokens would do: the largest token count up to
    /// `wanted` that an attached device with static shapes has a graph for (so a chunk can be
    /// placed on it), else `wanted` (every device takes any count).
    pub fn prefill_chunk(&self, wanted: usize) -> usize {
        let Some(devs) = &self.devices else { return wanted };
        devs.list
            .iter()
            .filter_map(|d| match &d.desc().static_shapes {
                llmd_device::StaticShapes::Only(s) => s.iter().copied().filter(|&n| n > 0 && n <= wanted).max(),
                llmd_device::StaticShapes::Any => None,
            })
            .max()
            .unwrap_or(wanted)
    }

    /// An empty KV cache of this model's [`kv::KvType`].
    pub fn new_kv(&self) -> KvCache {
        KvCache::with_type(self.config.n_layers, self.config.kv_dim(), self.config.head_dim, self.kv_type)
    }

    fn pass(&self) -> Pass<'_> {
        Pass { c: &self.shape, planner: &self.planner, linears: None }
    }

    /// Runs `tokens` at the positions after what `kv` holds, appends their keys and values, and
    /// returns logits (`vocab` per returned token).
    pub fn forward(&self, kv: &mut KvCache, tokens: &[u32], which: Logits) -> Result<Vec<f32>, BackendError> {
        let mut out = self.forward_batch(&mut [(kv, tokens)], which)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One pass over several sequences at once (continuous batching): sequence `i` runs
    /// `batch[i].1` at the positions after what its cache `batch[i].0` holds. Every matmul
    /// runs once over all their tokens; attention runs per sequence over its own cache. Returns
    /// each sequence's logits as [`Self::forward`] would — and bit for bit the same values, since
    /// every row of a matmul is computed independently of the others (tested).
    ///
    /// A large batch of decode steps ([`split_plan`]) is cut into one part per thread, each
    /// running every layer over its sequences on its own thread: the threads then meet once
    /// per pass instead of at ~190 parallel steps, where a thread that ran late (another
    /// process, the daemon's own threads, the host) held the other one up at every barrier.
    /// Each part reads the layers' weights for itself, which only a compute-bound batch can
    /// afford; the output head then runs once over every sequence, on all threads (B=8 pass
    /// 0.968–0.982 of the head run per part, alternated in `batchbench`).
    pub fn forward_batch(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.forward_batch_unchecked(batch, which);
        self.weights.check_files()?;
        out
    }

    /// One pass over `batch` placed across the host and `devs` — a set not attached to the
    /// model (a daemon thread driving a device keeps its own, with the weights it loaded), so
    /// the model's other passes stay on the host meanwhile. A sequence's KV cache of a layer
    /// is handed to the device running that layer's attention (and comes back for a host
    /// pass).
    pub fn forward_batch_on(
        &self,
        devs: &Devices,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        self.forward_batch_on_until(devs, batch, which, None)
    }

    /// [`Self::forward_batch_on`] that, given `stop`, asks it before each host linear group.
    pub(crate) fn forward_batch_on_until(
        &self,
        devs: &Devices,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
        stop: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.forward_placed(devs, batch, which, stop);
        self.weights.check_files()?;
        out
    }

    /// [`Self::forward_batch`] without the check that the model's file lost no page meanwhile.
    fn forward_batch_unchecked(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        if let Some(devs) = &self.devices {
            return self.forward_placed(devs, batch, which, None);
        }
        // A sequence that decoded on a device brings its cache home for the host's pass.
        for (kv, _) in batch.iter_mut() {
            if kv.has_device_layers() {
                kv.move_all_home()?;
            }
        }
        let tokens: Vec<usize> = batch.iter().map(|b| b.1.len()).collect();
        if let Some(parts) = split_plan(&tokens, self.planner.split_parts()) {
            if let Some(out) = self.forward_split(batch, which, parts) {
                return out;
            }
        }
        let p = self.pass();
        let w = &self.weights;
        let Some(mut st) = p.begin(batch, &w.token_embd)? else {
            return Ok(vec![Vec::new(); batch.len()]);
        };
        for (li, l) in w.layers.iter().enumerate() {
            p.layer(&mut st, batch, li, l.blocks(w.rope_freqs.as_deref()), None)?;
        }
        p.finish(st, batch, &w.output_norm, &w.output, which)
    }

    /// [`Self::forward_batch`] in `parts` contiguous runs of sequences, each run's layers on its
    /// own thread; then the output head over every sequence at once, on all threads (it reads
    /// its weights once for the whole batch instead of once per run, and no cache advances
    /// unless every run got through). None if the backend did not split after all.
    fn forward_split(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
        parts: usize,
    ) -> Option<Result<Vec<Vec<f32>>, BackendError>> {
        type PartOut = Option<Result<Option<PassState>, BackendError>>;
        let p = self.pass();
        let w = &self.weights;
        let n = batch.len();
        let mut runs = Vec::with_capacity(parts);
        let mut rest: &mut [(&mut KvCache, &[u32])] = &mut *batch;
        for i in 0..parts {
            let (run, tail) = std::mem::take(&mut rest).split_at_mut((i + 1) * n / parts - i * n / parts);
            runs.push(std::sync::Mutex::new((run, PartOut::None)));
            rest = tail;
        }
        let layers = |run: &mut [(&mut KvCache, &[u32])]| -> Result<Option<PassState>, BackendError> {
            let Some(mut st) = p.begin(run, &w.token_embd)? else { return Ok(None) };
            for (li, l) in w.layers.iter().enumerate() {
                p.layer(&mut st, run, li, l.blocks(w.rope_freqs.as_deref()), None)?;
            }
            Ok(Some(st))
        };
        let ran = self.planner.split(parts, &|i| {
            let mut part = runs[i].lock().unwrap_or_else(|e| e.into_inner());
            let (ref mut run, ref mut out) = *part;
            *out = Some(layers(run));
        });
        if !ran {
            return None;
        }
        let mut states = Vec::with_capacity(parts);
        for run in runs {
            // Every part has run once `split` returns (a panic in one is raised in there); a
            // part without output would only be run here, on this thread.
            let (run, out) = run.into_inner().unwrap_or_else(|e| e.into_inner());
            match out.unwrap_or_else(|| layers(run)) {
                Ok(st) => states.push(st),
                Err(e) => return Some(Err(e)),
            }
        }
        let joined = PassState::join(self.config.d_model, states.into_iter().flatten());
        Some(p.finish(joined, batch, &w.output_norm, &w.output, which))
    }

    /// [`Self::forward_batch_on`] for one sequence (as [`Self::forward`] is
    /// [`Self::forward_batch`] for one): llm.npu's prompt chunk with its linear groups on the
    /// NPU, or a pass on HeteroLLM's cuts — every block where `devs`' cost model places it, each
    /// host block's projections and groups where their splitter does.
    pub fn forward_on(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        devs: &Devices,
        which: Logits,
    ) -> Result<Vec<f32>, BackendError> {
        Ok(self.forward_batch_on(devs, &mut [(kv, tokens)], which)?.pop().unwrap_or_default())
    }

    /// [`Self::forward`] for one sequence that shows every linear group's input to `capture`
    /// (calibration); returns the last token's logits.
    pub fn forward_capture(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        capture: Capture,
    ) -> Result<Vec<f32>, BackendError> {
        let p = self.pass();
        let w = &self.weights;
        let batch = &mut [(kv, tokens)];
        let Some(mut st) = p.begin(batch, &w.token_embd)? else { return Ok(Vec::new()) };
        for (li, l) in w.layers.iter().enumerate() {
            p.layer(&mut st, batch, li, l.blocks(w.rope_freqs.as_deref()), Some(&mut *capture))?;
        }
        let out = p.finish(st, batch, &w.output_norm, &w.output, Logits::Last)?.pop().unwrap_or_default();
        w.check_files()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_large_batches_of_decode_steps_are_split() {
        assert_eq!(split_plan(&[1; 8], 2), Some(2));
        assert_eq!(split_plan(&[1; 9], 2), Some(2));
        assert_eq!(split_plan(&[1; 7], 2), None, "fewer than 4 decode steps per part");
        assert_eq!(split_plan(&[1; 16], 4), Some(4));
        assert_eq!(split_plan(&[1; 15], 4), None);
        assert_eq!(split_plan(&[1; 64], 1), None, "one thread");
        assert_eq!(split_plan(&[1; 64], 0), None);
        assert_eq!(split_plan(&[], 2), None);
        let mut with_chunk = vec![1; 12];
        with_chunk[3] = 64;
        assert_eq!(split_plan(&with_chunk, 2), None, "a prompt chunk in the batch");
    }
}
