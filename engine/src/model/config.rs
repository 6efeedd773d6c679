//! Architecture hyper-parameters, read from GGUF metadata or an HF `config.json`.

use crate::error::FormatError;
use crate::format::gguf::GgufFile;

/// Supported architecture families. Mistral-style models are llama with grouped-query attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    Llama,
    Qwen2,
}

/// How rotary embeddings pair dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): ggml's "normal" mode, used by llama-architecture GGUF files,
    /// whose Q/K rows were permuted by the converter to make this equal HF's rotate-half.
    Interleaved,
    /// Halves (i, i + d/2): HF's rotate-half ("NeoX") — qwen2 GGUF and every HF checkpoint.
    Neox,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    /// Dimensions of each head that are rotated (usually all of them).
    pub rope_dims: usize,
    /// Linear RoPE scaling: positions are multiplied by this (1 / scaling factor).
    pub rope_freq_scale: f32,
    pub rope_style: RopeStyle,
    pub norm_eps: f32,
}

/// Largest sizes we accept; past these a file is more likely hostile than real.
const MAX_LAYERS: usize = 1024;
const MAX_DIM: usize = 1 << 20;
const MAX_CONTEXT: usize = 1 << 24;

impl ModelConfig {
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Reads `general.architecture` and the `<arch>.*` keys of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, FormatError> {
        let arch_name = g.get_str("general.architecture")?;
        let (arch, rope_style) = match arch_name {
            "llama" | "mistral" => (Arch::Llama, RopeStyle::Interleaved),
            "qwen2" => (Arch::Qwen2, RopeStyle::Neox),
            other => return Err(FormatError::UnsupportedArchitecture(other.to_owned())),
        };
        let k = |s: &str| format!("{arch_name}.{s}");
        let usize_key = |s: &str| -> Result<usize, FormatError> {
            let v = g.get_u64(&k(s))?;
            usize::try_from(v)
                .map_err(|_| FormatError::BadHyperParameter { what: "size", detail: format!("{} = {v}", k(s)) })
        };
        let n_layers = usize_key("block_count")?;
        let d_model = usize_key("embedding_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = match g.get_u64_opt(&k("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_heads,
        };
        let ffn_dim = usize_key("feed_forward_length")?;
        let context_length = usize_key("context_length")?;
        let head_dim = match g.get_u64_opt(&k("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_heads > 0 => d_model / n_heads,
            None => 0,
        };
        let rope_dims = match g.get_u64_opt(&k("rope.dimension_count"))? {
            Some(v) => v as usize,
            None => head_dim,
        };
        let rope_theta = g.get_f64_opt(&k("rope.freq_base"))?.unwrap_or(10000.0) as f32;
        let rope_freq_scale = match (
            g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()),
            g.get_f64_opt(&k("rope.scaling.factor"))?,
        ) {
            (Some("linear"), Some(f)) if f > 0.0 => (1.0 / f) as f32,
            (None | Some("none"), _) => 1.0,
            (Some("linear"), _) => 1.0,
            (Some(other), _) => {
                return Err(FormatError::BadHyperParameter {
                    what: "rope scaling",
                    detail: format!("unsupported type {other:?}"),
                })
            }
        };
        let norm_eps = g.get_f64_opt(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5) as f32;
        let vocab_size = match g.get_u64_opt(&k("vocab_size"))? {
            Some(v) => v as usize,
            None => g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(|a| a.len()).unwrap_or(0),
        };
        let c = Self {
            arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab_size,
            context_length,
            rope_theta,
            rope_dims,
            rope_freq_scale,
            rope_style,
            norm_eps,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the relations the forward pass relies on.
    pub fn validate(&self) -> Result<(), FormatError> {
        let bad = |what, detail: String| Err(FormatError::BadHyperParameter { what, detail });
        if self.n_layers == 0 || self.n_layers > MAX_LAYERS {
            return bad("block_count", format!("{} (1..={MAX_LAYERS})", self.n_layers));
        }
        for (what, v) in [
            ("embedding_length", self.d_model),
            ("feed_forward_length", self.ffn_dim),
            ("vocab_size", self.vocab_size),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 || v > MAX_DIM {
                return bad(what, format!("{v} (1..={MAX_DIM})"));
            }
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad("head_count", format!("{} query heads, {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if self.rope_dims == 0 || self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2) {
            return bad("rope.dimension_count", format!("{} for head size {}", self.rope_dims, self.head_dim));
        }
        if self.context_length == 0 || self.context_length > MAX_CONTEXT {
            return bad("context_length", format!("{} (1..={MAX_CONTEXT})", self.context_length));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad("rope.freq_base", format!("{}", self.rope_theta));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return bad("layer_norm_rms_epsilon", format!("{}", self.norm_eps));
        }
        Ok(())
    }
}
