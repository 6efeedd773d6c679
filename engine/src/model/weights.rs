//! Weights of a llama-family model, checked against the configuration before first use.

use super::config::{Arch, ModelConfig};
use crate::error::FormatError;
use crate::format::{TensorMap, TensorRef};
use crate::quant;
use llmd_alloc_sys::HugeArena;

use crate::backend::blocks::{AttnWeights, FfnWeights};
pub use crate::backend::weight::WeightMatrix;
use crate::backend::weight::{pack, packed_len, Packed};

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: WeightMatrix,
    pub wk: WeightMatrix,
    pub wv: WeightMatrix,
    pub wo: WeightMatrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightMatrix,
    pub w_up: WeightMatrix,
    pub w_down: WeightMatrix,
}

impl LayerWeights {
    /// The matrix of `role`, if the layer has one of it.
    pub fn matrix(&self, role: llmd_device::WeightRole) -> Option<&WeightMatrix> {
        use llmd_device::WeightRole::*;
        Some(match role {
            Wq => &self.wq,
            Wk => &self.wk,
            Wv => &self.wv,
            Wo => &self.wo,
            Gate => &self.w_gate,
            Up => &self.w_up,
            Down => &self.w_down,
            _ => return None,
        })
    }

    /// The layer's weights as its two subgraphs take them.
    pub fn blocks<'a>(&'a self, rope_freqs: Option<&'a [f32]>) -> (AttnWeights<'a>, FfnWeights<'a>) {
        (
            AttnWeights {
                norm: &self.attn_norm,
                wq: &self.wq,
                wk: &self.wk,
                wv: &self.wv,
                wo: &self.wo,
                bq: self.bq.as_deref(),
                bk: self.bk.as_deref(),
                bv: self.bv.as_deref(),
                rope_freqs,
            },
            FfnWeights { norm: &self.ffn_norm, gate: &self.w_gate, up: &self.w_up, down: &self.w_down },
        )
    }
}

pub struct ModelWeights {
    pub token_embd: WeightMatrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output head; shares `token_embd`'s bytes when embeddings are tied.
    pub output: WeightMatrix,
    /// Per-pair RoPE frequency divisors (llama-3 style scaling), if the model has them.
    pub rope_freqs: Option<Vec<f32>>,
}

/// Bytes of the packed copies of every packable matrix in `tensors` (an upper bound of what
/// the loader packs: a tensor it leaves on storage or does not use only reserves address
/// space, which costs no memory).
fn packed_bytes(tensors: &TensorMap) -> usize {
    tensors
        .values()
        .filter_map(|t| {
            let (&cols, rest) = t.dims.split_first()?;
            let rows = rest.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
            packed_len(t.ty, usize::try_from(rows).ok()?, usize::try_from(cols).ok()?)
        })
        .map(llmd_alloc_sys::HugeArena::footprint)
        .fold(0usize, |a, b| a.saturating_add(b))
}

struct Loader<'a> {
    t: &'a TensorMap,
    /// Where the packed matrices go (see [`crate::backend::layout::packed::weight_arena`]).
    arena: Option<HugeArena>,
    /// Bytes of matrices bound so far and in all, reported after each.
    done: std::cell::Cell<u64>,
    total: u64,
    progress: &'a dyn Fn(u64, u64),
    /// Matrices converted to Q8_0 tiles at load, per source type: (tensors, file bytes, bytes).
    converted: std::cell::RefCell<std::collections::BTreeMap<&'static str, (usize, u64, u64)>>,
    /// Matrices left on the row kernels (float types), per type: (tensors, bytes).
    float_rows: std::cell::RefCell<std::collections::BTreeMap<&'static str, (usize, u64)>>,
}

impl Loader<'_> {
    fn get(&self, name: &str) -> Result<&TensorRef, FormatError> {
        self.t.get(name).ok_or_else(|| FormatError::MissingTensor(name.to_owned()))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix, FormatError> {
        self.matrix_opt(name, rows, cols, false)
    }

    /// `on_flash`: no packed copy; rows are read from storage when used.
    fn matrix_opt(&self, name: &str, rows: usize, cols: usize, on_flash: bool) -> Result<WeightMatrix, FormatError> {
        let t = self.get(name)?;
        let expected = vec![cols as u64, rows as u64];
        if t.dims != expected {
            return Err(FormatError::ShapeMismatch { name: name.into(), found: t.dims.clone(), expected });
        }
        let need = t.ty.row_bytes(cols).and_then(|r| r.checked_mul(rows));
        if need != Some(t.range.len()) {
            return Err(FormatError::RowNotBlockAligned {
                name: name.into(),
                row: cols as u64,
                block: t.ty.block_size() as u64,
            });
        }
        let packed = if on_flash {
            Packed::default()
        } else {
            pack(self.arena.as_ref(), t, rows, cols)
                .map_err(|e| FormatError::Io { path: format!("tensor {name}"), source: e })?
        };
        if let (Some(ty), Some(p)) = (packed.converted_from, &packed.int8) {
            let mut c = self.converted.borrow_mut();
            let e = c.entry(ty.name()).or_default();
            *e = (e.0 + 1, e.1 + t.range.len() as u64, e.2 + p.size_bytes() as u64);
        } else if packed.int8.is_none() && packed.k.is_none() && !on_flash {
            let mut c = self.float_rows.borrow_mut();
            let e = c.entry(t.ty.name()).or_default();
            *e = (e.0 + 1, e.1 + t.range.len() as u64);
        }
        self.done.set(self.done.get() + t.range.len() as u64);
        (self.progress)(self.done.get(), self.total);
        Ok(WeightMatrix {
            name: name.into(),
            ty: t.ty,
            rows,
            cols,
            tensor: t.clone(),
            packed: packed.int8,
            kpacked: packed.k,
            on_flash,
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, FormatError> {
        let t = self.get(name)?;
        if t.dims.iter().product::<u64>() != len as u64 || t.dims.iter().filter(|&&d| d != 1).count() > 1 {
            return Err(FormatError::ShapeMismatch {
                name: name.into(),
                found: t.dims.clone(),
                expected: vec![len as u64],
            });
        }
        let mut out = vec![0f32; len];
        quant::dequantize_row(t.ty, t.bytes(), &mut out)
            .map_err(|e| FormatError::BadHyperParameter { what: "tensor", detail: format!("{name}: {e}") })?;
        Ok(out)
    }

    fn opt_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, FormatError> {
        if self.t.contains_key(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// One line of [`ModelWeights::kernel_table`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelUse {
    /// The type in the model file.
    pub ty: &'static str,
    /// What its matrices run on (e.g. "avx512-vnni, K-quant tiles").
    pub kernel: String,
    pub matrices: usize,
    pub file_bytes: u64,
    pub memory_bytes: u64,
}

impl ModelWeights {
    /// Binds every tensor the architecture needs, checking names, shapes and sizes.
    pub fn load(c: &ModelConfig, tensors: &TensorMap) -> Result<Self, FormatError> {
        Self::load_with(c, tensors, false)
    }

    /// [`Self::load`], with the token embedding left on storage when `embeddings_on_flash` and
    /// the output head is separate (a tied head needs the table in memory).
    pub fn load_with(c: &ModelConfig, tensors: &TensorMap, embeddings_on_flash: bool) -> Result<Self, FormatError> {
        Self::load_progress(c, tensors, embeddings_on_flash, &|_, _| {})
    }

    /// [`Self::load_with`], calling `progress(bytes bound, bytes in all)` after each matrix.
    pub fn load_progress(
        c: &ModelConfig,
        tensors: &TensorMap,
        embeddings_on_flash: bool,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Self, FormatError> {
        let total = tensors.values().map(|t| t.range.len() as u64).sum();
        let arena = crate::backend::layout::packed::weight_arena(packed_bytes(tensors));
        let l = Loader {
            t: tensors,
            arena,
            done: std::cell::Cell::new(0),
            total,
            progress,
            converted: Default::default(),
            float_rows: Default::default(),
        };
        let (d, q, kv, f) = (c.d_model, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let untied = tensors.contains_key("output.weight");
        let token_embd = l.matrix_opt("token_embd.weight", c.vocab_size, d, embeddings_on_flash && untied)?;
        let output = if tensors.contains_key("output.weight") {
            l.matrix("output.weight", c.vocab_size, d)?
        } else {
            WeightMatrix { name: "output.weight (tied to token_embd.weight)".into(), ..token_embd.clone() }
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let biases = c.arch == Arch::Qwen2;
            let bias = |s: &str, len| {
                if biases {
                    l.vector(&n(s), len).map(Some)
                } else {
                    l.opt_vector(&n(s), len)
                }
            };
            layers.push(LayerWeights {
                attn_norm: l.vector(&n("attn_norm.weight"), d)?,
                wq: l.matrix(&n("attn_q.weight"), q, d)?,
                wk: l.matrix(&n("attn_k.weight"), kv, d)?,
                wv: l.matrix(&n("attn_v.weight"), kv, d)?,
                wo: l.matrix(&n("attn_output.weight"), d, q)?,
                bq: bias("attn_q.bias", q)?,
                bk: bias("attn_k.bias", kv)?,
                bv: bias("attn_v.bias", kv)?,
                ffn_norm: l.vector(&n("ffn_norm.weight"), d)?,
                w_gate: l.matrix(&n("ffn_gate.weight"), f, d)?,
                w_up: l.matrix(&n("ffn_up.weight"), f, d)?,
                w_down: l.matrix(&n("ffn_down.weight"), d, f)?,
            });
        }
        for (ty, (n, from, to)) in l.converted.borrow().iter() {
            tracing::info!(
                "{n} {ty} matrices ({:.1} MB) have no kernels of their own: converted to Q8_0 tiles at load ({:.1} MB, {:+.0}%)",
                *from as f64 / 1e6,
                *to as f64 / 1e6,
                (*to as f64 / (*from).max(1) as f64 - 1.0) * 100.0
            );
        }
        for (ty, (n, bytes)) in l.float_rows.borrow().iter() {
            tracing::info!(
                "{n} {ty} matrices ({:.1} MB) run on the float row kernels (no integer form; exact, as llama.cpp runs them)",
                *bytes as f64 / 1e6
            );
        }
        Ok(Self {
            token_embd,
            layers,
            output_norm: l.vector("output_norm.weight", d)?,
            output,
            rope_freqs: l.opt_vector("rope_freqs.weight", c.rope_dims / 2)?,
        })
    }

    /// What each weight type of the model's matrices runs on: per file type, the matrices, their
    /// bytes in the file and in memory, and the kernel (for `llmctl bench`); sorted by type.
    pub fn kernel_table(&self) -> Vec<KernelUse> {
        let mut by: std::collections::BTreeMap<(&'static str, String), KernelUse> = Default::default();
        let tied = self.output.same_weights(&self.token_embd);
        let mats = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain([&self.token_embd])
            .chain((!tied).then_some(&self.output));
        for m in mats {
            let kernel = crate::backend::cpu::matrix_kernel(m);
            let e = by.entry((m.ty.name(), kernel.clone())).or_insert_with(|| KernelUse {
                ty: m.ty.name(),
                kernel,
                matrices: 0,
                file_bytes: 0,
                memory_bytes: 0,
            });
            e.matrices += 1;
            e.file_bytes += m.tensor.range.len() as u64;
            e.memory_bytes += m.size_bytes() as u64;
        }
        by.into_values().collect()
    }

    /// Total bytes of weights (the output head counted once when tied).
    /// An error if a page of a file these weights are read from in place was lost (the file
    /// shrank under us and the page read as zeros): results computed since are void.
    pub fn check_files(&self) -> Result<(), crate::error::BackendError> {
        let mats = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain([&self.token_embd, &self.output]);
        for m in mats {
            if m.tensor.file.faulted() {
                return Err(crate::error::BackendError::ModelFileTruncated(m.name.clone()));
            }
        }
        Ok(())
    }

    pub fn size_bytes(&self) -> usize {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|m| m.size_bytes())
                    .sum::<usize>()
            })
            .sum();
        let tied = self.output.same_weights(&self.token_embd);
        layer + self.token_embd.size_bytes() + if tied { 0 } else { self.output.size_bytes() }
    }
}
