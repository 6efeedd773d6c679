//! The op-level contract of a processor that computes in host memory (the CPU): the
//! [`Backend`] trait the host blocks call op by op, and the shapes its ops take.

use crate::backend::kv::{KvInput, KvLayer};
use crate::backend::weight::WeightMatrix;
use crate::error::BackendError;
use crate::quant::GgmlType;

pub use llmd_device::{DeviceDesc, OpKind, Processor};

/// f32 values as the little-endian bytes a device buffer holds (the residual stream, logits,
/// norm vectors crossing the device contract).
pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// The reverse of [`f32_bytes`] (a trailing partial value is ignored).
pub(crate) fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// One op as the planner sees it.
#[derive(Clone, Copy, Debug)]
pub struct OpDesc {
    pub kind: OpKind,
    /// Weight type for `MatMul` / `GetRows`.
    pub weight_type: Option<GgmlType>,
    /// Tokens in the batch.
    pub n_tokens: usize,
}

/// Shapes for attention over a KV cache.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Position of the first new query token; the cache holds `start + n_tokens` positions.
    pub start: usize,
    pub n_tokens: usize,
}

/// One sequence's part of [`Backend::attention_many`].
pub struct AttentionItem<'a> {
    pub shape: AttentionShape,
    pub q: &'a [f32],
    /// The cache, with this step's keys and values in it or still to be appended.
    pub kv: KvInput<'a>,
    pub out: &'a mut [f32],
}

impl<'a> AttentionItem<'a> {
    /// Appends the item's new keys and values to an f16 cache (after its first `shape.start`
    /// positions) and leaves it ready to read; the cache layer as attention then reads it.
    pub fn append_all(&mut self) -> Result<KvLayer<'a>, BackendError> {
        let s = self.shape;
        let ready = match std::mem::replace(&mut self.kv, KvInput::Ready(KvLayer::F16 { k: &[], v: &[] })) {
            KvInput::Ready(kv) => kv,
            KvInput::AppendF16 { k, v, k_new, v_new } => {
                check_append(&s, (self.q, self.out), (k, v), (k_new, v_new))?;
                let to_f16 = super::cpu::attn_kernels::AttnKernels::best().to_f16;
                let kv_dim = s.n_kv_heads * s.head_dim;
                for (store, new) in [(&mut *k, k_new), (&mut *v, v_new)] {
                    for (h, x) in store.iter_mut().enumerate() {
                        crate::backend::kv::append_head(x, s.start, h, s.head_dim, new, kv_dim, to_f16);
                    }
                }
                KvLayer::F16 { k, v }
            }
        };
        self.kv = KvInput::Ready(ready);
        Ok(ready)
    }
}

/// Checks an [`KvInput::AppendF16`] item: a valid shape, `q` and `out` of `n_tokens` rows of
/// all heads, one vector per KV head holding at least `start` positions, and `n_tokens` new
/// rows of keys and of values.
pub fn check_append(
    s: &AttentionShape,
    (q, out): (&[f32], &[f32]),
    (k, v): (&[Vec<half::f16>], &[Vec<half::f16>]),
    (k_new, v_new): (&[f32], &[f32]),
) -> Result<(), BackendError> {
    let rows = s.n_tokens * s.n_kv_heads * s.head_dim;
    if s.n_kv_heads == 0
        || s.head_dim == 0
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
        || q.len() != s.n_tokens * s.n_heads * s.head_dim
        || out.len() != q.len()
        || k.len() != s.n_kv_heads
        || v.len() != s.n_kv_heads
        || k_new.len() != rows
        || v_new.len() != rows
        || k.iter().chain(v).any(|x| x.len() < s.start * s.head_dim)
    {
        return Err(BackendError::Shape {
            op: "attention",
            detail: format!(
                "{s:?} with q {}, out {}, appending {} key and {} value values to {} and {} heads",
                q.len(),
                out.len(),
                k_new.len(),
                v_new.len(),
                k.len(),
                v.len()
            ),
        });
    }
    Ok(())
}

pub use llmd_device::RopeParams;

/// The op-level kernels of a processor that computes in host memory (the CPU): what the host
/// blocks ([`super::blocks`]) call, op by op. Devices with memory or graphs of their own implement
/// [`llmd_device::Device`] instead, at the level of subgraphs.
pub trait Backend: Send + Sync {
    fn descriptor(&self) -> &DeviceDesc;

    /// How many parts [`Self::split`] would run at once now: 1 where the backend cannot split
    /// (the default), or while it is already running a part.
    fn split_parts(&self) -> usize {
        1
    }

    /// Runs `f(0) .. f(parts - 1)` at once, each part on its own thread of this backend and
    /// every op a part issues inline on that thread (no barrier between the parts until all
    /// end). Returns false, having run nothing, where the backend cannot.
    fn split(&self, _parts: usize, _f: &(dyn Fn(usize) + Sync)) -> bool {
        false
    }

    fn supports(&self, op: &OpDesc) -> bool {
        self.descriptor().supports_op(op.kind, op.weight_type, op.n_tokens)
    }

    /// `out[t][r] = dot(w.row(r), x[t])` for `n_tokens` rows of `x` (each `w.cols` long); every
    /// element of `out` is written (callers pass buffers reused from earlier layers).
    fn matmul(&self, w: &WeightMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) -> Result<(), BackendError>;

    /// [`Self::matmul`] with each token's output row in its own slice (`rows[t]`, `w.rows`
    /// long), so the caller can hand results out without copying them (the output head's
    /// logits, one vector per sequence). By default through a temporary buffer. This is the
    /// output head's op: its results are final (never re-quantized), so a backend may round its
    /// float sums in a faster order than `matmul`'s (the CPU's packed weights: one integer sum
    /// per block, `quant::packed::Order::BlockSum`), the same for any batch.
    fn matmul_rows(&self, w: &WeightMatrix, x: &[f32], rows: &mut [&mut [f32]]) -> Result<(), BackendError> {
        if rows.iter().any(|r| r.len() != w.rows) {
            return Err(BackendError::Shape {
                op: "matmul_rows",
                detail: format!("output rows are not {} long", w.rows),
            });
        }
        let mut out = vec![0f32; rows.len() * w.rows];
        self.matmul(w, x, rows.len(), &mut out)?;
        for (r, o) in rows.iter_mut().zip(out.chunks_exact(w.rows.max(1))) {
            r.copy_from_slice(o);
        }
        Ok(())
    }

    /// Several matmuls of the same input: `outs[i] = ws[i] · x` (e.g. Q, K and V). A backend may
    /// share one activation quantization and one parallel step among them; by default they run
    /// in turn.
    fn matmul_many(
        &self,
        ws: &[&WeightMatrix],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), BackendError> {
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, n_tokens, o)?;
        }
        Ok(())
    }

    /// `out[t] = w.row(ids[t])` as f32.
    fn get_rows(&self, w: &WeightMatrix, ids: &[u32], out: &mut [f32]) -> Result<(), BackendError>;

    /// In place over rows of `weight.len()`: `x * weight / rms(x)`.
    fn rms_norm(&self, x: &mut [f32], weight: &[f32], eps: f32) -> Result<(), BackendError>;

    /// Rotates each head of each row of `x` in place; row `t` is at position `positions[t]`.
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        p: &RopeParams,
        freq_factors: Option<&[f32]>,
    ) -> Result<(), BackendError>;

    /// Causal attention of `q` (`n_tokens` × heads × head_dim) over one layer of the cache
    /// (positions × kv_heads × head_dim, f16 or int8) into `out` (same shape as `q`).
    fn attention(&self, s: &AttentionShape, q: &[f32], kv: KvLayer<'_>, out: &mut [f32]) -> Result<(), BackendError>;

    /// Attention of several sequences (each over its own cache), in one parallel step where the
    /// backend can; by default one after another.
    fn attention_many(&self, items: &mut [AttentionItem<'_>]) -> Result<(), BackendError> {
        for it in items.iter_mut() {
            let kv = it.append_all()?;
            self.attention(&it.shape, it.q, kv, it.out)?;
        }
        Ok(())
    }

    /// shadowAttn's sparse attention of several sequences' prompt rows, layer `layer` of `sa`: an
    /// INT8 pilot's Q·Kᵀ picks each query row's keys, exact attention runs over only those.
    /// A backend without a pilot refuses it.
    fn attention_sparse(
        &self,
        _items: &mut [AttentionItem<'_>],
        _layer: usize,
        _sa: &crate::backend::sparse::SparseAttn,
    ) -> Result<(), BackendError> {
        Err(BackendError::NoBackend(format!("sparse attention on {}", self.descriptor().name)))
    }

    /// `gate = silu(gate) * up`, elementwise.
    fn swiglu(&self, gate: &mut [f32], up: &[f32]) -> Result<(), BackendError>;
}
