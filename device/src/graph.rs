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
    /// A layer's attention, first part: the input RMSNorm, then Q, K and V (+ biases). Reads
    /// the residual stream [`crate::Bindings::x`]; writes to [`crate::Bindings::y`] the
    /// queries, keys and values, each projection's `n_tokens` rows in turn (a QKV group's
    /// layout, biases added). The five layer parts ([`Subgraph::layer_parts`]) are llm.npu's
    /// and HeteroLLM's unit of placement: the attention and FFN blocks cut where their
    /// processors change.
    AttnQkv,
    /// Attention, middle part: RoPE, each sequence's KV append and causal attention. Reads
    /// [`crate::Bindings::h`] (the queries, keys and values [`SubgraphKind::AttnQkv`] wrote,
    /// left as they are) and the sequences' caches; writes the attention output to `y`
    /// (`n_tokens × q_dim`).
    AttnCore,
    /// Attention, last part: O over `h` (the attention output), added to `x`.
    AttnOut,
    /// The FFN's first part: the RMSNorm, gate and up, SwiGLU. Reads `x`; writes to `y`
    /// `silu(gate) · up` (`n_tokens × ffn_dim`).
    FfnGateUp,
    /// The FFN's last part: down over `h` (the SwiGLU output), added to `x`.
    FfnDown,
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

/// One subgraph of a pass: a kind, and its layer (0 for the embedding and the head).
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

    /// Part `kind` of layer `layer` (one of [`Self::LAYER_PARTS`]).
    pub fn part(layer: usize, kind: SubgraphKind) -> Self {
        Self { kind, layer }
    }

    /// A layer's parts, in order: the attention and FFN blocks cut where llm.npu's and
    /// HeteroLLM's processors change (the matmul groups apart from attention's core).
    pub const LAYER_PARTS: [SubgraphKind; 5] = [
        SubgraphKind::AttnQkv,
        SubgraphKind::AttnCore,
        SubgraphKind::AttnOut,
        SubgraphKind::FfnGateUp,
        SubgraphKind::FfnDown,
    ];

    /// Layer `layer`'s parts, in order.
    pub fn layer_parts(layer: usize) -> [Self; 5] {
        Self::LAYER_PARTS.map(|kind| Self { kind, layer })
    }

    /// Values per token a layer part reads from [`crate::Bindings::h`] and writes to
    /// [`crate::Bindings::y`] (0 for what it does not bind); `(0, 0)` for every other kind.
    pub fn part_widths(&self, shape: &BlockShape) -> (usize, usize) {
        let qkv = shape.q_dim() + 2 * shape.kv_dim();
        match self.kind {
            SubgraphKind::AttnQkv => (0, qkv),
            SubgraphKind::AttnCore => (qkv, shape.q_dim()),
            SubgraphKind::AttnOut => (shape.q_dim(), 0),
            SubgraphKind::FfnGateUp => (0, shape.ffn_dim),
            SubgraphKind::FfnDown => (shape.ffn_dim, 0),
            _ => (0, 0),
        }
    }

    /// The linear group whose projections it runs: its own for a [`SubgraphKind::Group`], a
    /// layer part's (QKV, O, gate/up, down); None for the others.
    pub fn group_site(&self) -> Option<GroupSite> {
        match self.kind {
            SubgraphKind::Group(site) => Some(site),
            SubgraphKind::AttnQkv => Some(GroupSite::Qkv),
            SubgraphKind::AttnOut => Some(GroupSite::O),
            SubgraphKind::FfnGateUp => Some(GroupSite::GateUp),
            SubgraphKind::FfnDown => Some(GroupSite::Down),
            _ => None,
        }
    }

    /// Whether it is one of a layer's parts ([`Self::LAYER_PARTS`]).
    pub fn is_part(&self) -> bool {
        Self::LAYER_PARTS.contains(&self.kind)
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
            SubgraphKind::AttnQkv => &[RmsNorm, MatMul],
            SubgraphKind::FfnGateUp => &[RmsNorm, MatMul, SwiGlu],
            SubgraphKind::AttnCore => &[Rope, Attention],
            SubgraphKind::AttnOut | SubgraphKind::FfnDown => &[MatMul],
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
            SubgraphKind::AttnQkv => {
                let mut v = vec![AttnNorm, Wq, Wk, Wv];
                if shape.qkv_bias {
                    v.extend([Bq, Bk, Bv]);
                }
                v
            }
            SubgraphKind::AttnCore => {
                if shape.rope_freqs {
                    vec![RopeFreqs]
                } else {
                    vec![]
                }
            }
            SubgraphKind::AttnOut => vec![Wo],
            SubgraphKind::FfnGateUp => vec![FfnNorm, Gate, Up],
            SubgraphKind::FfnDown => vec![Down],
        }
    }

    /// Whether it reads or writes a KV cache.
    pub fn uses_kv(&self) -> bool {
        matches!(self.kind, SubgraphKind::Attention | SubgraphKind::AttnCore)
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

    #[test]
    fn a_layers_parts_chain_their_intermediates_and_read_its_weights_once() {
        let shape = BlockShape {
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 96,
            vocab: 100,
            context_length: 128,
            norm_eps: 1e-5,
            rope_dims: 16,
            rope_theta: 1e4,
            rope_freq_scale: 1.0,
            rope_style: RopeStyle::Neox,
            qkv_bias: true,
            rope_freqs: true,
        };
        let parts = Subgraph::layer_parts(1);
        assert!(parts.iter().all(|p| p.layer == 1 && p.is_part()));
        // Each part reads what the one before it wrote; the first reads the residual only.
        let widths: Vec<_> = parts.iter().map(|p| p.part_widths(&shape)).collect();
        assert_eq!(widths, [(0, 64 + 2 * 32), (64 + 2 * 32, 64), (64, 0), (0, 96), (96, 0)]);
        // The parts read the whole blocks' weights between them, each once.
        let mut roles: Vec<_> = parts.iter().flat_map(|p| p.weight_roles(&shape)).collect();
        let mut whole: Vec<_> =
            [Subgraph::attention(1), Subgraph::ffn(1)].iter().flat_map(|s| s.weight_roles(&shape)).collect();
        roles.sort();
        whole.sort();
        assert_eq!(roles, whole);
        assert_eq!(parts.iter().filter(|p| p.uses_kv()).count(), 1);
        let sites: Vec<_> = parts.iter().filter_map(|p| p.group_site()).collect();
        assert_eq!(sites, GroupSite::ALL);
    }
}
