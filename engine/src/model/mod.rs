//! Llama-family models (llama, mistral-style GQA, qwen2 with Q/K/V biases): configuration,
//! weights, KV cache, and the forward pass, which places every op through the [`Planner`].

pub mod config;
pub mod kv;
pub mod stream;
pub mod weights;

use crate::backend::{AttentionItem, AttentionShape, OpDesc, OpKind, Planner, RopeParams};
use crate::error::BackendError;
use config::ModelConfig;
use kv::KvCache;
use weights::{ModelWeights, WeightMatrix};

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (perplexity, scoring).
    All,
}

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
    planner: Planner,
    /// How new KV caches store keys and values.
    pub kv_type: kv::KvType,
}

impl Transformer {
    pub fn new(config: ModelConfig, weights: ModelWeights, planner: Planner) -> Self {
        Self { config, weights, planner, kv_type: kv::KvType::F16 }
    }

    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// An empty KV cache of this model's [`kv::KvType`].
    pub fn new_kv(&self) -> KvCache {
        KvCache::with_type(self.config.n_layers, self.config.kv_dim(), self.config.head_dim, self.kv_type)
    }

    fn pass(&self) -> Pass<'_> {
        Pass { c: &self.config, planner: &self.planner }
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
            p.layer(&mut st, batch, li, l, w.rope_freqs.as_deref(), None)?;
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
                p.layer(&mut st, run, li, l, w.rope_freqs.as_deref(), None)?;
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
            p.layer(&mut st, batch, li, l, w.rope_freqs.as_deref(), Some(&mut *capture))?;
        }
        Ok(p.finish(st, batch, &w.output_norm, &w.output, Logits::Last)?.pop().unwrap_or_default())
    }
}

/// Where [`Transformer::forward_capture`] shows a linear group its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureSite {
    /// The normed input of Q, K and V.
    Qkv = 0,
    /// The attention output, input of O.
    O = 1,
    /// The normed input of gate and up.
    GateUp = 2,
    /// `silu(gate) · up`, input of down.
    Down = 3,
}

/// A capture hook: `(layer, site, rows, columns)`.
pub type Capture<'a> = &'a mut dyn FnMut(usize, CaptureSite, &[f32], usize);

/// The tokens of one forward pass, between layers: the residual stream and where each
/// sequence's tokens sit in it.
pub(crate) struct PassState {
    x: Vec<f32>,
    positions: Vec<usize>,
    /// Per sequence: (first token in `x`, token count, first position).
    spans: Vec<(usize, usize, usize)>,
    n: usize,
    /// Every layer's intermediate tensors, allocated (and zeroed) once per pass and reused by
    /// each layer: every one is overwritten whole before it is read. Against a fresh zeroed
    /// vector per output and layer (alternating pass by pass, `batchbench`, 300 passes, three
    /// runs): one-token decode 0.9–2.6% faster, B=8 within ±0.8%.
    buf: Scratch,
}

/// See [`PassState::buf`]. `n` tokens: `h` and `o`, `down` are `n · d_model`; `q` and `attn`
/// `n · q_dim`; `k` and `v` `n · kv_dim`; `g` and `u` `n · ffn_dim`.
impl PassState {
    /// The states of consecutive runs of one batch as one (for the output head): residual rows
    /// and positions in run order, spans shifted to their place. No layer runs on the result.
    fn join(d_model: usize, parts: impl Iterator<Item = PassState>) -> PassState {
        let mut j =
            PassState { x: Vec::new(), positions: Vec::new(), spans: Vec::new(), n: 0, buf: Scratch::default() };
        for st in parts {
            debug_assert_eq!(st.x.len(), st.n * d_model);
            j.spans.extend(st.spans.iter().map(|&(off, len, start)| (off + j.n, len, start)));
            j.x.extend_from_slice(&st.x);
            j.positions.extend_from_slice(&st.positions);
            j.n += st.n;
        }
        j
    }
}

#[derive(Default)]
struct Scratch {
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    down: Vec<f32>,
}

impl Scratch {
    fn new(c: &ModelConfig, n: usize) -> Self {
        let z = |d: usize| vec![0f32; n * d];
        let (d, qd, kvd, f) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        Self { h: z(d), q: z(qd), k: z(kvd), v: z(kvd), attn: z(qd), o: z(d), g: z(f), u: z(f), down: z(d) }
    }
}

/// The forward pass in pieces (embedding, one layer, the head), so that a loader can run
/// layers as their weights arrive (the cold-start pipeline) with the same code as
/// [`Transformer::forward_batch`].
#[derive(Clone, Copy)]
pub(crate) struct Pass<'a> {
    pub c: &'a ModelConfig,
    pub planner: &'a Planner,
}

impl Pass<'_> {
    fn matmul(&self, w: &WeightMatrix, x: &[f32], n: usize, out: &mut [f32]) -> Result<(), BackendError> {
        let op = OpDesc { kind: OpKind::MatMul, weight_type: Some(w.ty), n_tokens: n };
        self.planner.place(&op)?.matmul(w, x, n, out)
    }

    /// Matmuls of one input by several weights of the same type, placed together.
    fn matmul_many<const N: usize>(
        &self,
        ws: [&WeightMatrix; N],
        x: &[f32],
        n: usize,
        mut outs: [&mut [f32]; N],
    ) -> Result<(), BackendError> {
        if ws.iter().any(|w| w.ty != ws[0].ty) {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(w, x, n, o)?;
            }
            return Ok(());
        }
        let op = OpDesc { kind: OpKind::MatMul, weight_type: Some(ws[0].ty), n_tokens: n };
        self.planner.place(&op)?.matmul_many(&ws, x, n, &mut outs)
    }

    fn op(&self, kind: OpKind, n: usize) -> Result<&dyn crate::backend::Backend, BackendError> {
        self.planner.place(&OpDesc { kind, weight_type: None, n_tokens: n })
    }

    /// Checks the batch against the context and embeds its tokens (`None`: no tokens at all).
    pub(crate) fn begin(
        &self,
        batch: &[(&mut KvCache, &[u32])],
        token_embd: &WeightMatrix,
    ) -> Result<Option<PassState>, BackendError> {
        let c = self.c;
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(batch.len());
        for (kv, toks) in batch.iter() {
            let start = kv.len();
            if start + toks.len() > c.context_length {
                return Err(BackendError::Shape {
                    op: "forward",
                    detail: format!("{} positions exceed the context of {}", start + toks.len(), c.context_length),
                });
            }
            spans.push((tokens.len(), toks.len(), start));
            tokens.extend_from_slice(toks);
            positions.extend(start..start + toks.len());
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(None);
        }
        let mut x = vec![0f32; n * c.d_model];
        self.planner
            .place(&OpDesc { kind: OpKind::GetRows, weight_type: Some(token_embd.ty), n_tokens: n })?
            .get_rows(token_embd, &tokens, &mut x)?;
        Ok(Some(PassState { x, positions, spans, n, buf: Scratch::new(c, n) }))
    }

    /// Layer `li` over every token of the pass; appends their keys and values to the caches.
    pub(crate) fn layer(
        &self,
        st: &mut PassState,
        batch: &mut [(&mut KvCache, &[u32])],
        li: usize,
        l: &weights::LayerWeights,
        rope_freqs: Option<&[f32]>,
        mut capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = st.n;
        let rope = |heads| RopeParams {
            n_heads: heads,
            head_dim: c.head_dim,
            rope_dims: c.rope_dims,
            theta: c.rope_theta,
            freq_scale: c.rope_freq_scale,
            style: c.rope_style,
        };
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let PassState { x, buf, .. } = st;
        let Scratch { h, q, k, v, attn, o, g, u, down } = buf;
        // The caches' next rows, fetched while Q, K and V are computed (B=8 pass ~1–2% faster,
        // measured alternating pass by pass: the append had waited ~0.6 ms per pass on them).
        // Not for one-token steps into f16 caches: attention appends those in its parallel
        // step (see `CpuBackend::attention_many`).
        for ((kv, _), &(_, len, _)) in batch.iter_mut().zip(&st.spans) {
            if len > 1 || (len == 1 && kv.kv_type() != kv::KvType::F16) {
                kv.prepare_append(li, len);
            }
        }
        h.copy_from_slice(x);
        self.op(OpKind::RmsNorm, n)?.rms_norm(h, &l.attn_norm, c.norm_eps)?;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::Qkv, h, c.d_model);
        }
        self.matmul_many([&l.wq, &l.wk, &l.wv], h, n, [&mut q[..], &mut k[..], &mut v[..]])?;
        for (t, b) in [(&mut *q, &l.bq), (&mut *k, &l.bk), (&mut *v, &l.bv)] {
            if let Some(b) = b {
                for row in t.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
            }
        }
        let rope_op = self.op(OpKind::Rope, n)?;
        rope_op.rope(q, &st.positions, &rope(c.n_heads), rope_freqs)?;
        rope_op.rope(k, &st.positions, &rope(c.n_kv_heads), rope_freqs)?;
        // Every sequence's attention in one step, each over its own cache, which receives the
        // new keys and values first (in the step itself where the backend can).
        let mut items = Vec::with_capacity(batch.len());
        let mut rest: &mut [f32] = attn;
        for ((kv, _), &(off, len, start)) in batch.iter_mut().zip(&st.spans) {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len * qd);
            rest = tail;
            if len > 0 {
                items.push(AttentionItem {
                    shape: AttentionShape {
                        n_heads: c.n_heads,
                        n_kv_heads: c.n_kv_heads,
                        head_dim: c.head_dim,
                        start,
                        n_tokens: len,
                    },
                    q: &q[off * qd..(off + len) * qd],
                    kv: kv.attention_input(li, &k[off * kvd..(off + len) * kvd], &v[off * kvd..(off + len) * kvd]),
                    out: mine,
                });
            }
        }
        self.op(OpKind::Attention, n)?.attention_many(&mut items)?;
        drop(items);
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::O, attn, qd);
        }
        self.matmul(&l.wo, attn, n, o)?;
        x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);

        h.copy_from_slice(x);
        self.op(OpKind::RmsNorm, n)?.rms_norm(h, &l.ffn_norm, c.norm_eps)?;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::GateUp, h, c.d_model);
        }
        self.matmul_many([&l.w_gate, &l.w_up], h, n, [&mut g[..], &mut u[..]])?;
        self.op(OpKind::SwiGlu, n)?.swiglu(g, u)?;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::Down, g, c.ffn_dim);
        }
        self.matmul(&l.w_down, g, n, down)?;
        x.iter_mut().zip(down.iter()).for_each(|(x, o)| *x += o);
        Ok(())
    }

    /// Advances the caches past the pass and returns each sequence's logits.
    pub(crate) fn finish(
        &self,
        st: PassState,
        batch: &mut [(&mut KvCache, &[u32])],
        output_norm: &[f32],
        output: &WeightMatrix,
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let c = self.c;
        let d = c.d_model;
        let x = &st.x;
        for ((kv, _), &(_, len, _)) in batch.iter_mut().zip(&st.spans) {
            kv.advance(len);
        }
        // The rows whose logits are wanted, all sequences in one output-head matmul.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(st.spans.len());
        for &(off, len, _) in &st.spans {
            let r: Vec<usize> = match which {
                Logits::Last if len > 0 => vec![off + len - 1],
                Logits::Last => vec![],
                Logits::All => (off..off + len).collect(),
            };
            counts.push(r.len());
            rows.extend(r);
        }
        let mut last = Vec::with_capacity(rows.len() * d);
        for &r in &rows {
            last.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        if rows.is_empty() {
            return Ok(vec![Vec::new(); batch.len()]);
        }
        self.op(OpKind::RmsNorm, rows.len())?.rms_norm(&mut last, output_norm, c.norm_eps)?;
        // Each sequence's logits go straight into its own vector (no copy out of one buffer).
        let vocab = output.rows;
        let mut out: Vec<Vec<f32>> = counts.iter().map(|&cnt| vec![0f32; cnt * vocab]).collect();
        {
            let mut row_refs: Vec<&mut [f32]> = out.iter_mut().flat_map(|o| o.chunks_exact_mut(vocab.max(1))).collect();
            let op = OpDesc { kind: OpKind::MatMul, weight_type: Some(output.ty), n_tokens: rows.len() };
            self.planner.place(&op)?.matmul_rows(output, &last, &mut row_refs)?;
        }
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
