//! The transformer's subgraphs over host memory: the embedding, one layer's attention and FFN
//! blocks, and the head, each op placed by a [`Planner`] on an op-level [`Backend`]. The
//! engine's host path (the CPU device) and any device computing in host-layout memory run
//! the same code, so their results agree bit for bit.

use super::kv::{self, KvCache};
use super::sparse::{SparseAttn, MIN_SPARSE_ROWS};
use super::weight::WeightMatrix;
use super::{AttentionItem, AttentionShape, Backend, OpDesc, OpKind, Planner};
use crate::error::BackendError;
use llmd_device::BlockShape;

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (perplexity, scoring).
    All,
}

/// The weights of one layer's attention block.
#[derive(Clone, Copy)]
pub struct AttnWeights<'a> {
    pub norm: &'a [f32],
    pub wq: &'a WeightMatrix,
    pub wk: &'a WeightMatrix,
    pub wv: &'a WeightMatrix,
    pub wo: &'a WeightMatrix,
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
    pub rope_freqs: Option<&'a [f32]>,
}

/// The weights of attention's first part ([`Pass::attn_qkv`]).
#[derive(Clone, Copy)]
pub struct QkvWeights<'a> {
    pub norm: &'a [f32],
    pub wq: &'a WeightMatrix,
    pub wk: &'a WeightMatrix,
    pub wv: &'a WeightMatrix,
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
}

impl<'a> AttnWeights<'a> {
    /// Those of attention's first part.
    pub fn qkv(&self) -> QkvWeights<'a> {
        QkvWeights { norm: self.norm, wq: self.wq, wk: self.wk, wv: self.wv, bq: self.bq, bk: self.bk, bv: self.bv }
    }
}

/// The weights of one layer's FFN block.
#[derive(Clone, Copy)]
pub struct FfnWeights<'a> {
    pub norm: &'a [f32],
    pub gate: &'a WeightMatrix,
    pub up: &'a WeightMatrix,
    pub down: &'a WeightMatrix,
}

/// One sequence of a pass: its KV cache (and which of the cache's layers a block uses) and its
/// tokens.
pub type Batch<'a, 'b> = [(&'a mut KvCache, &'b [u32])];

/// Where `Transformer::forward_capture` shows a linear group its input: the device contract's
/// linear groups.
pub use llmd_device::GroupSite as CaptureSite;

/// A capture hook: `(layer, site, rows, columns)`.
pub type Capture<'a> = &'a mut dyn FnMut(usize, CaptureSite, &mut [f32], usize);

/// The tokens of one forward pass, between layers: the residual stream and where each
/// sequence's tokens sit in it.
pub struct PassState {
    pub x: Vec<f32>,
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// Per sequence: (first token in `x`, token count, first position).
    pub spans: Vec<(usize, usize, usize)>,
    pub n: usize,
    /// Every layer's intermediate tensors, allocated (and zeroed) once per pass and reused by
    /// each layer: every one is overwritten whole before it is read. Against a fresh zeroed
    /// vector per output and layer (alternating pass by pass, `batchbench`, 300 passes, three
    /// runs): one-token decode 0.9–2.6% faster, B=8 within ±0.8%.
    buf: Scratch,
}

impl PassState {
    /// A pass laid out by its caller (a device running one subgraph of it): `n` tokens,
    /// their ids and positions, the sequences' spans; the residual stream zero.
    pub fn new(c: &BlockShape, tokens: Vec<u32>, positions: Vec<usize>, spans: Vec<(usize, usize, usize)>) -> Self {
        let n = positions.len();
        Self { x: vec![0f32; n * c.d_model], tokens, positions, spans, n, buf: Scratch::new(c, n) }
    }
}

/// See [`PassState::buf`]. `n` tokens: `h` and `o`, `down` are `n · d_model`; `q` and `attn`
/// `n · q_dim`; `k` and `v` `n · kv_dim`; `g` and `u` `n · ffn_dim`.
impl PassState {
    /// The states of consecutive runs of one batch as one (for the output head): residual rows
    /// and positions in run order, spans shifted to their place. No layer runs on the result.
    pub fn join(d_model: usize, parts: impl Iterator<Item = PassState>) -> PassState {
        let mut j = PassState {
            x: Vec::new(),
            tokens: Vec::new(),
            positions: Vec::new(),
            spans: Vec::new(),
            n: 0,
            buf: Scratch::default(),
        };
        for st in parts {
            debug_assert_eq!(st.x.len(), st.n * d_model);
            j.spans.extend(st.spans.iter().map(|&(off, len, start)| (off + j.n, len, start)));
            j.x.extend_from_slice(&st.x);
            j.tokens.extend_from_slice(&st.tokens);
            j.positions.extend_from_slice(&st.positions);
            j.n += st.n;
        }
        j
    }
}

impl PassState {
    /// The intermediate tensors layer part `kind` reads besides the residual stream (what
    /// [`Self::part_outputs`] of the part before it holds): the queries, keys and values for
    /// attention's core, the attention output for O, the SwiGLU output for down; none for the
    /// others. In the contract's order ([`llmd_device::Subgraph::part_widths`]).
    pub fn part_inputs(&mut self, kind: llmd_device::SubgraphKind) -> Vec<&mut [f32]> {
        use llmd_device::SubgraphKind as K;
        let Scratch { q, k, v, attn, g, .. } = &mut self.buf;
        match kind {
            K::AttnCore => vec![q, k, v],
            K::AttnOut => vec![attn],
            K::FfnDown => vec![g],
            _ => vec![],
        }
    }

    /// The intermediate tensors layer part `kind` writes: the queries, keys and values, the
    /// attention output, the SwiGLU output; none for the parts that add to the residual.
    pub fn part_outputs(&self, kind: llmd_device::SubgraphKind) -> Vec<&[f32]> {
        use llmd_device::SubgraphKind as K;
        let Scratch { q, k, v, attn, g, .. } = &self.buf;
        match kind {
            K::AttnQkv => vec![q, k, v],
            K::AttnCore => vec![attn],
            K::FfnGateUp => vec![g],
            _ => vec![],
        }
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
    fn new(c: &BlockShape, n: usize) -> Self {
        let z = |d: usize| vec![0f32; n * d];
        let (d, qd, kvd, f) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        Self { h: z(d), q: z(qd), k: z(kvd), v: z(kvd), attn: z(qd), o: z(d), g: z(f), u: z(f), down: z(d) }
    }
}

/// Bytes of gate and up outputs (f32) one FFN token block may produce before SwiGLU reads them.
/// Over it, a prompt chunk's gate and up projections run in blocks of tokens: the 1.5B Q4_K_M
/// (`prefillbench`, one 256-token chunk, 2 threads, tok/s) made 18 MB of outputs a layer in
/// one block and ran at 233.5 / 233.5; in blocks of 32, 48, 64, 96 and 128 tokens 254.4, 247.9,
/// 247.5–260.2, 234.8, 234.8–238.4 (on VNNI alone 226.1 whole, 230.5 in 64s). The default
/// model (3 MB at 256 tokens) lost 6% in blocks of 64 (1342 → 1264), so it stays whole.
pub const FFN_OUT_BLOCK_BYTES: usize = 5 << 20;

/// Tokens per block of an FFN's gate and up projections over `n` tokens of an `ffn`-wide
/// layer: all `n` when their outputs fit in [`FFN_OUT_BLOCK_BYTES`], else as few blocks as keep
/// each within it, the tokens shared evenly in multiples of 16 (the AMX kernels' unit).
pub fn ffn_token_block(ffn: usize, n: usize) -> usize {
    let per_token = 2 * ffn * std::mem::size_of::<f32>();
    if n.saturating_mul(per_token) <= FFN_OUT_BLOCK_BYTES {
        return n.max(1);
    }
    let most = (FFN_OUT_BLOCK_BYTES / per_token.max(1)).max(16);
    let blocks = n.div_ceil(most);
    n.div_ceil(blocks).next_multiple_of(16).min(most.next_multiple_of(16)).clamp(1, n)
}

/// The forward pass in pieces (embedding, one layer, the head), so that a loader can run
/// layers as their weights arrive (the cold-start pipeline) with the same code as
/// `Transformer::run`'s host pass.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    pub c: &'a BlockShape,
    pub planner: &'a Planner,
    /// Runs the layers' linear groups instead of the planner, where it takes them: the
    /// executor's `SplitLinears` (groups and projections where the devices' splitter places
    /// them: a simulated scheme's too, `quantsim::SimDevice`).
    pub(crate) linears: Option<&'a dyn Linears>,
    /// shadowAttn: prompt rows' attention (a sequence's rows of a pass, at least
    /// `sparse::MIN_SPARSE_ROWS`) sparse under these settings; `None`: every row dense.
    pub sparse: Option<&'a SparseAttn>,
}

/// A runner of a layer's linear groups — QKV, O, gate/up, down, without biases — in place of the
/// planner's matmuls: the executor's way into the host blocks (its `SplitLinears` is the one
/// implementation; a trait only because the blocks sit below the executor).
pub(crate) trait Linears: Sync {
    /// Computes group `site` of layer `li` over `n` rows of `x` into `outs` (one per projection,
    /// `n` rows each, f32), or returns false to leave it to the planner.
    fn group(
        &self,
        li: usize,
        site: CaptureSite,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<bool, BackendError>;
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

    /// Group `site` of layer `li`: on [`Self::linears`] when it takes it, else the planner's.
    fn group<const N: usize>(
        &self,
        li: usize,
        site: CaptureSite,
        ws: [&WeightMatrix; N],
        x: &[f32],
        n: usize,
        mut outs: [&mut [f32]; N],
    ) -> Result<(), BackendError> {
        if let Some(l) = self.linears {
            if l.group(li, site, x, n, &mut outs)? {
                return Ok(());
            }
        }
        if let [o] = &mut outs[..] {
            return self.matmul(ws[0], x, n, o);
        }
        self.matmul_many(ws, x, n, outs)
    }

    fn op(&self, kind: OpKind, n: usize) -> Result<&dyn Backend, BackendError> {
        self.planner.place(&OpDesc { kind, weight_type: None, n_tokens: n })
    }

    /// Checks the batch against the context and lays out the pass: positions, spans, scratch
    /// (`None`: no tokens at all). The residual stream is zero until [`Self::embed`].
    pub fn state(&self, batch: &Batch) -> Result<Option<PassState>, BackendError> {
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
        let x = vec![0f32; n * c.d_model];
        Ok(Some(PassState { x, tokens, positions, spans, n, buf: Scratch::new(c, n) }))
    }

    /// The embedding subgraph: the pass's token rows into the residual stream.
    pub fn embed(&self, st: &mut PassState, token_embd: &WeightMatrix) -> Result<(), BackendError> {
        self.planner
            .place(&OpDesc { kind: OpKind::GetRows, weight_type: Some(token_embd.ty), n_tokens: st.n })?
            .get_rows(token_embd, &st.tokens, &mut st.x)
    }

    /// [`Self::state`] and [`Self::embed`].
    pub fn begin(&self, batch: &Batch, token_embd: &WeightMatrix) -> Result<Option<PassState>, BackendError> {
        let Some(mut st) = self.state(batch)? else { return Ok(None) };
        self.embed(&mut st, token_embd)?;
        Ok(Some(st))
    }

    /// Layer `li` (attention then FFN) over every token of the pass; appends their keys and
    /// values to the caches' layer `li`.
    pub fn layer(
        &self,
        st: &mut PassState,
        batch: &mut Batch,
        li: usize,
        (attn, ffn): (AttnWeights, FfnWeights),
        capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        match capture {
            Some(f) => {
                self.attention(st, batch, li, li, attn, Some(&mut *f))?;
                self.ffn(st, li, ffn, Some(f))
            }
            None => {
                self.attention(st, batch, li, li, attn, None)?;
                self.ffn(st, li, ffn, None)
            }
        }
    }

    /// The attention subgraph of layer `li` (`li` names it to `capture`); the keys and values go
    /// to layer `kv_layer` of each sequence's cache (a device holding one layer per cache
    /// passes 0). Its three parts — [`Self::attn_qkv`], [`Self::attn_core`], [`Self::attn_out`]
    /// — are also run apart, as the contract's layer parts (the executor's prompt chunks).
    pub fn attention(
        &self,
        st: &mut PassState,
        batch: &mut Batch,
        li: usize,
        kv_layer: usize,
        w: AttnWeights,
        capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        // The caches' next rows, fetched while Q, K and V are computed (B=8 pass ~1–2% faster,
        // measured alternating pass by pass: unfetched, the append waits ~0.6 ms per pass on them).
        Self::prepare_append(st, batch, kv_layer);
        match capture {
            Some(f) => {
                self.attn_qkv(st, li, w.qkv(), Some(&mut *f))?;
                self.attn_core(st, batch, li, kv_layer, w.rope_freqs)?;
                self.attn_out(st, li, w.wo, Some(f))
            }
            None => {
                self.attn_qkv(st, li, w.qkv(), None)?;
                self.attn_core(st, batch, li, kv_layer, w.rope_freqs)?;
                self.attn_out(st, li, w.wo, None)
            }
        }
    }

    /// Fetches the caches' next rows for layer `kv_layer`. Not for one-token steps into f16
    /// caches: attention appends those in its parallel step (see `CpuBackend::attention_many`).
    pub(crate) fn prepare_append(st: &PassState, batch: &mut Batch, kv_layer: usize) {
        for ((kv, _), &(_, len, _)) in batch.iter_mut().zip(&st.spans) {
            if len > 1 || (len == 1 && kv.kv_type() != kv::KvType::F16) {
                kv.prepare_append(kv_layer, len);
            }
        }
    }

    /// Attention's first part: the input norm, then the QKV group (and its biases).
    pub fn attn_qkv(
        &self,
        st: &mut PassState,
        li: usize,
        w: QkvWeights,
        mut capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = st.n;
        let PassState { x, buf, .. } = st;
        let Scratch { h, q, k, v, .. } = buf;
        h.copy_from_slice(x);
        self.op(OpKind::RmsNorm, n)?.rms_norm(h, w.norm, c.norm_eps)?;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::Qkv, h, c.d_model);
        }
        self.group(li, CaptureSite::Qkv, [w.wq, w.wk, w.wv], h, n, [&mut q[..], &mut k[..], &mut v[..]])?;
        for (t, b) in [(&mut *q, w.bq), (&mut *k, w.bk), (&mut *v, w.bv)] {
            if let Some(b) = b {
                for row in t.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
            }
        }
        Ok(())
    }

    /// Attention's middle part: RoPE, then every sequence's attention over its own cache, which
    /// receives the new keys and values first (in the step itself where the backend can); a
    /// sequence's prompt rows sparse where [`Self::sparse`] says so (layer `li` of its settings).
    pub fn attn_core(
        &self,
        st: &mut PassState,
        batch: &mut Batch,
        li: usize,
        kv_layer: usize,
        rope_freqs: Option<&[f32]>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = st.n;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let PassState { buf, positions, spans, .. } = st;
        let Scratch { q, k, v, attn, .. } = buf;
        let rope_op = self.op(OpKind::Rope, n)?;
        rope_op.rope(q, positions, &c.rope(c.n_heads), rope_freqs)?;
        rope_op.rope(k, positions, &c.rope(c.n_kv_heads), rope_freqs)?;
        let mut items = Vec::with_capacity(batch.len());
        let mut sparse_items = Vec::new();
        let mut rest: &mut [f32] = attn;
        for ((kv, _), &(off, len, start)) in batch.iter_mut().zip(spans.iter()) {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len * qd);
            rest = tail;
            if len > 0 {
                let to = if self.sparse.is_some() && len >= MIN_SPARSE_ROWS { &mut sparse_items } else { &mut items };
                to.push(AttentionItem {
                    shape: AttentionShape {
                        n_heads: c.n_heads,
                        n_kv_heads: c.n_kv_heads,
                        head_dim: c.head_dim,
                        start,
                        n_tokens: len,
                    },
                    q: &q[off * qd..(off + len) * qd],
                    kv: kv.attention_input(
                        kv_layer,
                        &k[off * kvd..(off + len) * kvd],
                        &v[off * kvd..(off + len) * kvd],
                    ),
                    out: mine,
                });
            }
        }
        let op = self.op(OpKind::Attention, n)?;
        if let (Some(sa), false) = (self.sparse, sparse_items.is_empty()) {
            op.attention_sparse(&mut sparse_items, li, sa)?;
        }
        op.attention_many(&mut items)
    }

    /// Attention's last part: the O group and the residual.
    pub fn attn_out(
        &self,
        st: &mut PassState,
        li: usize,
        wo: &WeightMatrix,
        mut capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = st.n;
        let PassState { x, buf, .. } = st;
        let Scratch { attn, o, .. } = buf;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::O, attn, c.q_dim());
        }
        self.group(li, CaptureSite::O, [wo], attn, n, [&mut o[..]])?;
        x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
        Ok(())
    }

    /// The FFN subgraph of layer `li`: [`Self::ffn_gate_up`], then [`Self::ffn_down`].
    pub fn ffn(
        &self,
        st: &mut PassState,
        li: usize,
        w: FfnWeights,
        capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        match capture {
            Some(f) => {
                self.ffn_gate_up(st, li, (w.norm, w.gate, w.up), Some(&mut *f))?;
                self.ffn_down(st, li, w.down, Some(f))
            }
            None => {
                self.ffn_gate_up(st, li, (w.norm, w.gate, w.up), None)?;
                self.ffn_down(st, li, w.down, None)
            }
        }
    }

    /// The FFN's first part: the norm, gate and up, SwiGLU (into the pass's hidden state).
    pub fn ffn_gate_up(
        &self,
        st: &mut PassState,
        li: usize,
        (norm, gate, up): (&[f32], &WeightMatrix, &WeightMatrix),
        mut capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = st.n;
        let PassState { x, buf, .. } = st;
        let Scratch { h, g, u, .. } = buf;
        h.copy_from_slice(x);
        self.op(OpKind::RmsNorm, n)?.rms_norm(h, norm, c.norm_eps)?;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::GateUp, h, c.d_model);
        }
        // Gate, up and SwiGLU in token blocks (each token's values are the same either way).
        let (d, f) = (c.d_model, c.ffn_dim);
        // On `linears` (the NPU path) gate/up runs over the whole pass at once: its graphs take
        // fixed chunks, and a CPU token block would be padded up to one.
        let block = if self.linears.is_some() { n.max(1) } else { ffn_token_block(f, n) };
        let mut t0 = 0;
        while t0 < n {
            let m = block.min(n - t0);
            let (gs, us) = (&mut g[t0 * f..(t0 + m) * f], &mut u[t0 * f..(t0 + m) * f]);
            self.group(li, CaptureSite::GateUp, [gate, up], &h[t0 * d..(t0 + m) * d], m, [&mut gs[..], &mut us[..]])?;
            self.op(OpKind::SwiGlu, m)?.swiglu(gs, us)?;
            t0 += m;
        }
        Ok(())
    }

    /// The FFN's last part: down over the hidden state, and the residual.
    pub fn ffn_down(
        &self,
        st: &mut PassState,
        li: usize,
        down_w: &WeightMatrix,
        mut capture: Option<Capture>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = st.n;
        let PassState { x, buf, .. } = st;
        let Scratch { g, down, .. } = buf;
        if let Some(f) = capture.as_mut() {
            f(li, CaptureSite::Down, g, c.ffn_dim);
        }
        self.group(li, CaptureSite::Down, [down_w], g, n, [&mut down[..]])?;
        x.iter_mut().zip(down.iter()).for_each(|(x, o)| *x += o);
        Ok(())
    }

    /// Advances the caches past the pass and returns each sequence's logits.
    pub fn finish(
        &self,
        st: PassState,
        batch: &mut Batch,
        output_norm: &[f32],
        output: &WeightMatrix,
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        for ((kv, _), &(_, len, _)) in batch.iter_mut().zip(&st.spans) {
            kv.advance(len);
        }
        self.head(&st, output_norm, output, which)
    }

    /// The rows of the pass whose logits `which` asks for, and how many each sequence has.
    pub fn logit_rows(spans: &[(usize, usize, usize)], which: Logits) -> (Vec<usize>, Vec<usize>) {
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(spans.len());
        for &(off, len, _) in spans {
            let r: Vec<usize> = match which {
                Logits::Last if len > 0 => vec![off + len - 1],
                Logits::Last => vec![],
                Logits::All => (off..off + len).collect(),
            };
            counts.push(r.len());
            rows.extend(r);
        }
        (rows, counts)
    }

    /// The head subgraph: each sequence's logits (`vocab` per row [`Self::logit_rows`] picks).
    pub fn head(
        &self,
        st: &PassState,
        output_norm: &[f32],
        output: &WeightMatrix,
        which: Logits,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let c = self.c;
        let d = c.d_model;
        let x = &st.x;
        // The rows whose logits are wanted, all sequences in one output-head matmul.
        let (rows, counts) = Self::logit_rows(&st.spans, which);
        let mut last = Vec::with_capacity(rows.len() * d);
        for &r in &rows {
            last.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        if rows.is_empty() {
            return Ok(vec![Vec::new(); st.spans.len()]);
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
    fn ffn_token_blocks_keep_small_chunks_whole_and_split_large_ones_evenly() {
        // The default model's 1,536-wide FFN: a 256-token chunk's outputs (3 MB) stay whole.
        assert_eq!(ffn_token_block(1536, 256), 256);
        assert_eq!(ffn_token_block(8960, 1), 1);
        assert_eq!(ffn_token_block(8960, 64), 64);
        // The 1.5B's 8,960: 256 tokens in four blocks of 64, each within the budget.
        assert_eq!(ffn_token_block(8960, 256), 64);
        for n in [74, 100, 200, 256, 1000, 4096] {
            let b = ffn_token_block(8960, n);
            assert!(b.is_multiple_of(16) && b <= 80, "n {n}: block {b}");
            assert!(n.div_ceil(b) <= n.div_ceil(73) + 1, "n {n}: block {b} makes too many blocks");
        }
        assert_eq!(ffn_token_block(0, 0), 1);
    }
}
