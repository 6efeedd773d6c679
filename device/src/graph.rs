//! The units of work the engine hands a device: subgraphs of a llama-family transformer, with
//! the shape parameters a device needs to build them — and no model type.

/// The operations subgraphs are made of; a device lists those it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Embedding lookup: rows of a (possibly quantized) matrix to f32.
    GetRows,
    /// Weight matrix times a batch of activation rows.
    MatMul,
    RmsNorm,
    Rope,
    /// Causal attention of new queries over a sequence's KV cache (appending its keys and values).
    Attention,
    /// `silu(gate) * up`.
    SwiGlu,
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

/// Rotary embedding parameters of one rotation (queries or keys).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub n_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub theta: f32,
    pub freq_scale: f32,
    pub style: RopeStyle,
}

/// Which part of a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SubgraphKind {
    /// Token ids → the residual stream.
    Embed,
    /// RMSNorm, Q/K/V (+ biases), RoPE, the KV append and causal attention, O, the residual add.
    Attention,
    /// RMSNorm, gate/up, SwiGLU, down, the residual add.
    Ffn,
    /// The final RMSNorm and the output head (logits of the chosen rows).
    Head,
    /// One projection over the rows its weight was loaded with (`y = x · Wᵀ`): the piece of a
    /// matmul that a partitioned plan (HeteroLLM's row and token cuts) places on a device. It
    /// reads `n_tokens` rows of the weight's `cols` values from [`crate::Bindings::x`] and
    /// writes `n_tokens` rows of the loaded rows' count to [`crate::Bindings::y`].
    Linear(WeightRole),
    /// One linear group of a layer: the projections that read one input (Q, K and V; O;
    /// gate and up; down), llm.npu's unit of NPU work. It reads one row of the group's input
    /// from [`crate::Bindings::x`] per position its bindings name, and writes to
    /// [`crate::Bindings::y`] each projection's rows in turn, in [`GroupSite::roles`] order
    /// (f32, before any bias). Every device takes it — the CPU and the GPU run its
    /// projections in turn, the NPU as one W8A8 graph of the weights it quantized and
    /// calibrated when it loaded them — and its executable runs the rows it is bound to,
    /// whatever count it was prepared for.
    Group(GroupSite),
}

/// A layer's linear groups: the projections that share an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupSite {
    /// The normed input of Q, K and V.
    Qkv = 0,
    /// The attention output, input of O.
    O = 1,
    /// The normed input of gate and up.
    GateUp = 2,
    /// `silu(gate) · up`, input of down.
    Down = 3,
}

impl GroupSite {
    /// Every group of a layer, in the pass's order.
    pub const ALL: [GroupSite; 4] = [GroupSite::Qkv, GroupSite::O, GroupSite::GateUp, GroupSite::Down];

    /// The projections of the group, in the order the group's outputs come.
    pub fn roles(self) -> &'static [WeightRole] {
        use WeightRole::*;
        match self {
            GroupSite::Qkv => &[Wq, Wk, Wv],
            GroupSite::O => &[Wo],
            GroupSite::GateUp => &[Gate, Up],
            GroupSite::Down => &[Down],
        }
    }
}

/// One subgraph of a pass: a kind, and the layer for [`SubgraphKind::Attention`] and
/// [`SubgraphKind::Ffn`] (0 for the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Subgraph {
    pub kind: SubgraphKind,
    pub layer: usize,
}

/// The weights a subgraph reads, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightRole {
    TokenEmbd,
    AttnNorm,
    Wq,
    Wk,
    Wv,
    Wo,
    Bq,
    Bk,
    Bv,
    RopeFreqs,
    FfnNorm,
    Gate,
    Up,
    Down,
    OutputNorm,
    Output,
}

/// The shape of the model a subgraph belongs to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockShape {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub norm_eps: f32,
    pub rope_dims: usize,
    pub rope_theta: f32,
    pub rope_freq_scale: f32,
    pub rope_style: RopeStyle,
    /// Q, K and V have biases (qwen2).
    pub qkv_bias: bool,
    /// RoPE frequency divisors (llama-3 scaling).
    pub rope_freqs: bool,
}

impl BlockShape {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// The rotation of `heads` heads (queries: `n_heads`, keys: `n_kv_heads`).
    pub fn rope(&self, heads: usize) -> RopeParams {
        RopeParams {
            n_heads: heads,
            head_dim: self.head_dim,
            rope_dims: self.rope_dims,
            theta: self.rope_theta,
            freq_scale: self.rope_freq_scale,
            style: self.rope_style,
        }
    }
}

impl Subgraph {
    pub const EMBED: Self = Self { kind: SubgraphKind::Embed, layer: 0 };
    pub const HEAD: Self = Self { kind: SubgraphKind::Head, layer: 0 };

    pub fn attention(layer: usize) -> Self {
        Self { kind: SubgraphKind::Attention, layer }
    }
    pub fn ffn(layer: usize) -> Self {
        Self { kind: SubgraphKind::Ffn, layer }
    }
    /// One projection of layer `layer` (the weight of `role`).
    pub fn linear(layer: usize, role: WeightRole) -> Self {
        Self { kind: SubgraphKind::Linear(role), layer }
    }
    /// Linear group `site` of layer `layer`.
    pub fn group(layer: usize, site: GroupSite) -> Self {
        Self { kind: SubgraphKind::Group(site), layer }
    }

    /// A pass in order: the embedding, each layer's attention then FFN, the head.
    pub fn pass(n_layers: usize) -> Vec<Self> {
        let mut v = Vec::with_capacity(2 * n_layers + 2);
        v.push(Self::EMBED);
        for l in 0..n_layers {
            v.push(Self::attention(l));
            v.push(Self::ffn(l));
        }
        v.push(Self::HEAD);
        v
    }

    /// The ops it is made of (what a device must run to take it).
    pub fn ops(&self) -> &'static [OpKind] {
        use OpKind::*;
        match self.kind {
            SubgraphKind::Embed => &[GetRows],
            SubgraphKind::Attention => &[RmsNorm, MatMul, Rope, Attention],
            SubgraphKind::Ffn => &[RmsNorm, MatMul, SwiGlu],
            SubgraphKind::Head => &[RmsNorm, MatMul],
            SubgraphKind::Linear(_) | SubgraphKind::Group(_) => &[MatMul],
        }
    }

    /// The weights it reads, in the order [`crate::Device::prepare`] takes them.
    pub fn weight_roles(&self, shape: &BlockShape) -> Vec<WeightRole> {
        use WeightRole::*;
        match self.kind {
            SubgraphKind::Embed => vec![TokenEmbd],
            SubgraphKind::Attention => {
                let mut v = vec![AttnNorm, Wq, Wk, Wv, Wo];
                if shape.qkv_bias {
                    v.extend([Bq, Bk, Bv]);
                }
                if shape.rope_freqs {
                    v.push(RopeFreqs);
                }
                v
            }
            SubgraphKind::Ffn => vec![FfnNorm, Gate, Up, Down],
            SubgraphKind::Head => vec![OutputNorm, Output],
            SubgraphKind::Linear(role) => vec![role],
            SubgraphKind::Group(site) => site.roles().to_vec(),
        }
    }

    /// Whether it reads or writes a KV cache.
    pub fn uses_kv(&self) -> bool {
        self.kind == SubgraphKind::Attention
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_lists_every_subgraph_in_order() {
        let p = Subgraph::pass(2);
        assert_eq!(
            p,
            [
                Subgraph::EMBED,
                Subgraph::attention(0),
                Subgraph::ffn(0),
                Subgraph::attention(1),
                Subgraph::ffn(1),
                Subgraph::HEAD
            ]
        );
    }
}
