//! Architecture hyper-parameters, read from GGUF metadata or an HF `config.json`.

use crate::error::FormatError;

/// Supported architecture families. Mistral-style models are llama with grouped-query attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    Llama,
    Qwen2,
}

pub use llmd_device::RopeStyle;

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
    /// The shape devices see: these parameters, and whether the weights have Q/K/V biases
    /// and RoPE frequency divisors.
    pub fn block_shape(&self, qkv_bias: bool, rope_freqs: bool) -> llmd_device::BlockShape {
        llmd_device::BlockShape {
            n_layers: self.n_layers,
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            ffn_dim: self.ffn_dim,
            vocab: self.vocab_size,
            context_length: self.context_length,
            norm_eps: self.norm_eps,
            rope_dims: self.rope_dims,
            rope_theta: self.rope_theta,
            rope_freq_scale: self.rope_freq_scale,
            rope_style: self.rope_style,
            qkv_bias,
            rope_freqs,
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
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
        if !(self.rope_freq_scale.is_finite() && self.rope_freq_scale > 0.0) {
            return bad("rope.scaling.factor", format!("position scale {}", self.rope_freq_scale));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return bad("layer_norm_rms_epsilon", format!("{}", self.norm_eps));
        }
        Ok(())
    }
}
