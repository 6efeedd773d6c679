//! Llama-family models (llama, mistral-style GQA, qwen2 with Q/K/V biases): configuration,
//! weights, KV cache, and the forward pass, which places every op through the [`Planner`].

pub use crate::backend::kv;
pub use crate::config;
mod chunks;
mod devices;
mod placed;
pub mod split;
pub use devices::{Devices, SplitStats, Trace};
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
/// (a host pass of [`Transformer::run`]) is slower than one pass over the whole batch. Measured on
/// the default model with 2 threads (`batchbench`, split and whole passes alternating, 300
/// passes, ratio of median ms per pass): 4 and 8 sequences per part (B=8, B=16) 0.91–0.97;
/// 3 and 4 (B=7) 0.95–0.99; 3 (B=6) 1.05–1.07 and 2 (B=4) 1.08–1.09, where each part reading
/// all the layers' weights for itself costs more than the barriers it saves.
pub const SPLIT_MIN_TOKENS_PER_PART: usize = 4;

/// The parts a host pass of [`Transformer::run`] runs a batch in, given each sequence's token count
/// and how many parts the backend can run at once: `Some(parts)` (every thread one part) for a
/// batch of decode steps (one token each) with at least [`SPLIT_MIN_TOKENS_PER_PART`] per part,
/// else `None` (one pass). Prompt chunks are not split: a chunk is one sequence's tokens, so
/// parts would be uneven, and its matmuls already keep every thread busy.
pub fn split_plan(tokens: &[usize], parts: usize) -> Option<usize> {
    (parts >= 2 && tokens.iter().all(|&t| t == 1) && tokens.len() >= SPLIT_MIN_TOKENS_PER_PART * parts).then_some(parts)
}

/// How one pass runs ([`Transformer::run`]): which logits it returns, the devices it is placed
/// across, how a prompt is cut, and what may stop it.
#[derive(Clone, Copy)]
pub struct Run<'a> {
    /// Which tokens' logits (per sequence).
    pub which: Logits,
    /// The devices besides the host it is placed across — a set of the caller's (a daemon
    /// processor's, llmctl's NPU), not attached to the model, so the model's other passes stay
    /// where they were; None: the model's own placement (its attached devices, else the host).
    pub on: Option<&'a Devices>,
    /// One sequence's prompt in chunks of this many tokens, run out of order across the chunks
    /// (llm.npu's job graph, ordered by its score over [`Transformer::prefill_times`]; the
    /// same bits as in order) with the last token's logits; needs `on`. None: one pass.
    pub chunk: Option<usize>,
    /// Asked before each of the host subgraphs' linear groups: true ends the pass with an
    /// error, every cache as before it (a withdrawn job); needs `on`.
    pub stop: Option<&'a (dyn Fn() -> bool + Sync)>,
}

impl Run<'static> {
    /// The last token's logits, on the model's own placement, in one pass.
    pub const LAST: Self = Self { which: Logits::Last, on: None, chunk: None, stop: None };
    /// Every token's logits, on the model's own placement, in one pass.
    pub const ALL: Self = Self { which: Logits::All, on: None, chunk: None, stop: None };
}

impl<'a> Run<'a> {
    /// Placed across `devs`.
    pub fn on(self, devs: &'a Devices) -> Self {
        Self { on: Some(devs), ..self }
    }

    /// In chunks of `chunk` tokens, out of order across them.
    pub fn chunked(self, chunk: usize) -> Self {
        Self { chunk: Some(chunk), ..self }
    }

    /// Stopped when `stop` says so.
    pub fn until(self, stop: &'a (dyn Fn() -> bool + Sync)) -> Self {
        Self { stop: Some(stop), ..self }
    }
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
    /// shadowAttn: prompt rows' attention sparse under these settings (`None`: dense); set
    /// while the model serves (a daemon's profile finished after load), each pass reads it once.
    sparse: std::sync::RwLock<Option<std::sync::Arc<crate::backend::sparse::SparseAttn>>>,
}

impl Transformer {
    pub fn new(config: ModelConfig, weights: ModelWeights, planner: Planner) -> Self {
        let shape =
            config.block_shape(weights.layers.first().is_some_and(|l| l.bq.is_some()), weights.rope_freqs.is_some());
        Self { config, weights, shape, planner, devices: None, kv_type: kv::KvType::F16, sparse: Default::default() }
    }

    /// Runs later passes' prompt rows with shadowAttn's sparse attention under `sa` (checked
    /// against the model's shape), or dense again (`None`).
    pub fn set_sparse_attention(
        &self,
        sa: Option<std::sync::Arc<crate::backend::sparse::SparseAttn>>,
    ) -> Result<(), BackendError> {
        if let Some(s) = &sa {
            s.check(self.config.n_layers, self.config.n_heads)
                .map_err(|detail| BackendError::Shape { op: "sparse attention", detail })?;
        }
        *self.sparse.write().unwrap_or_else(|e| e.into_inner()) = sa;
        Ok(())
    }

    /// The sparse attention settings later passes run under, if any.
    pub fn sparse_attention(&self) -> Option<std::sync::Arc<crate::backend::sparse::SparseAttn>> {
        self.sparse.read().unwrap_or_else(|e| e.into_inner()).clone()
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

    fn pass<'a>(&'a self, sparse: Option<&'a crate::backend::sparse::SparseAttn>) -> Pass<'a> {
        Pass { c: &self.shape, planner: &self.planner, linears: None, sparse }
    }

    /// The forward pass: sequence `i` of `batch` runs `batch[i].1` at the positions after what
    /// its cache `batch[i].0` holds (appending their keys and values) and gets its logits
    /// (`vocab` per returned token), as `r` asks — on the model's own placement or a set of
    /// devices, in one pass or one prompt's chunks out of order, stoppable. A pass on
    /// [`Run::on`]'s devices leaves every cache as it was on an error.
    pub fn run(&self, batch: &mut [(&mut KvCache, &[u32])], r: Run<'_>) -> Result<Vec<Vec<f32>>, BackendError> {
        let Some(devs) = r.on else {
            if r.chunk.is_some() || r.stop.is_some() {
                return Err(BackendError::Device(
                    "a pass in chunks, or one that can be stopped, is placed on a set of devices (Run::on)".into(),
                ));
            }
            return self.forward_batch(batch, r.which);
        };
        let before: Vec<usize> = batch.iter().map(|(kv, _)| kv.len()).collect();
        let out = match (r.chunk, &mut *batch) {
            (None, _) => self.forward_batch_on_until(devs, batch, r.which, r.stop),
            (Some(chunk), [(kv, tokens)]) if r.which == Logits::Last => {
                self.prefill_chunks(kv, tokens, chunk, devs, r.stop).map(|l| vec![l])
            }
            (Some(_), _) => Err(BackendError::Shape {
                op: "prefill",
                detail: format!(
                    "a prompt in chunks is one sequence's, with its last token's logits ({} sequences, {:?})",
                    batch.len(),
                    r.which
                ),
            }),
        };
        if out.is_err() {
            for ((kv, _), &b) in batch.iter_mut().zip(&before) {
                kv.truncate(b);
            }
        }
        out
    }

    /// [`Self::run`] for one sequence on the model's own placement, in one pass: its logits.
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
    /// per pass instead of at ~190 parallel steps, where a thread that runs late (another
    /// process, the daemon's own threads, the host) holds the other one up at every barrier.
    /// Each part reads the layers' weights for itself, which only a compute-bound batch can
    /// afford; the output head then runs once over every sequence, on all threads (B=8 pass
    /// 0.968–0.982 of the head run per part, alternated in `batchbench`).
    fn forward_batch(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.forward_batch_unchecked(batch, which);
        self.weights.check_files()?;
        out
    }

    /// One pass over `batch` placed across the host and `devs` (a set not attached to the
    /// model: a sequence's KV cache of a layer is handed to the device running that layer's
    /// attention, and comes back for a host pass); `stop`, when given, is asked before each host
    /// linear group.
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
        let sa = self.sparse_attention();
        let p = self.pass(sa.as_deref());
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
        let sa = self.sparse_attention();
        let p = self.pass(sa.as_deref());
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

    /// [`Self::forward`] for one sequence that shows every linear group's input to `capture`
    /// (calibration), which may also change it (shadowAttn's importance profiling zeroes heads'
    /// attention outputs); returns the logits `which` asks for. Attention is dense, or sparse
    /// under `sparse` (shadowAttn's calibration of its scales), whatever the model's setting.
    pub fn forward_capture(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        which: Logits,
        sparse: Option<&crate::backend::sparse::SparseAttn>,
        capture: Capture,
    ) -> Result<Vec<f32>, BackendError> {
        let p = self.pass(sparse);
        let w = &self.weights;
        let batch = &mut [(kv, tokens)];
        let Some(mut st) = p.begin(batch, &w.token_embd)? else { return Ok(Vec::new()) };
        for (li, l) in w.layers.iter().enumerate() {
            p.layer(&mut st, batch, li, l.blocks(w.rope_freqs.as_deref()), Some(&mut *capture))?;
        }
        let out = p.finish(st, batch, &w.output_norm, &w.output, which)?.pop().unwrap_or_default();
        w.check_files()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run`'s shapes of a pass on the tiny fixture: a host pass, the same on an empty set of
    /// devices (every subgraph on the host), one prompt in chunks out of order — all the same
    /// bits — and the passes it refuses, every cache as before them.
    #[test]
    fn run_takes_every_shape_of_pass_and_refuses_what_does_not_fit() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-qwen2.gguf");
        let m = crate::Model::load(std::path::Path::new(path), &Default::default()).expect("loads");
        let t = &m.transformer;
        let devs = Devices::new(Vec::new(), std::sync::Arc::new(crate::sched::HostBlocks));
        let prompt: Vec<u32> = (1..30).collect();
        let mut kv = t.new_kv();
        let host = t.run(&mut [(&mut kv, &prompt)], Run::LAST).expect("host pass");
        for r in [Run::LAST.on(&devs), Run::LAST.on(&devs).chunked(8), Run::LAST.on(&devs).chunked(8).until(&|| false)]
        {
            let mut kv2 = t.new_kv();
            let got = t.run(&mut [(&mut kv2, &prompt)], r).expect("runs");
            assert!(got == host, "a pass on an empty set of devices, or in chunks, gives the host's bits");
            assert_eq!(kv2.len(), prompt.len());
        }
        let refused = |r: Run<'_>, two: bool| {
            let (mut a, mut b) = (t.new_kv(), t.new_kv());
            t.forward(&mut a, &prompt[..3], Logits::Last).expect("a start");
            let out = if two {
                t.run(&mut [(&mut a, &prompt[3..9]), (&mut b, &prompt[..2])], r)
            } else {
                t.run(&mut [(&mut a, &prompt[3..9])], r)
            };
            assert!(out.is_err());
            assert_eq!((a.len(), b.len()), (3, 0), "the caches as before");
        };
        refused(Run::LAST.chunked(4), false);
        refused(Run::LAST.until(&|| false), false);
        refused(Run::ALL.on(&devs).chunked(4), false);
        refused(Run::LAST.on(&devs).chunked(4), true);
        refused(Run::LAST.on(&devs).until(&|| true), false);
    }

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
