//! A whole prefill or decode step of a llama-family model on a modelled SoC, driving the
//! same [`Solver`] the real run uses: per layer the paper's operators in order — RMSNorm,
//! Q, K, V, RoPE + attention, O, residual + RMSNorm, gate, up, SwiGLU, down, residual — the
//! matmuls placed (or cut) by the strategy, everything else on the GPU (HeteroLLM §4), the
//! output head for the last token. Operators run one after another (each needs the last's
//! output); a cut matmul's two halves overlap ([`super::soc::Soc::overlap`]).
//!
//! The strategies are the paper's: GPU-only (PPL-OpenCL), Hetero-layer (matmuls on the NPU in
//! prefill, all on the GPU in decode), Hetero-tensor (the solver), and for prompts that are
//! not a standard size, Padding, Pipe and Online-prepare. Every figure is modelled.

use super::partition::{Cut, CutKind, Segment, Sizes};
use super::soc::Soc;
use super::solver::{Choice, Op, Phase, Profiler, Solver};

/// A model's shapes (what the simulator needs of it).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Shape {
    pub name: String,
    pub layers: usize,
    pub d: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// Bits per weight of the linear layers as the processors read them (Q4_0: 4.5).
    pub bits: f64,
}

/// Public configurations of the papers' models (`[public-config]`), W4A16 as Q4_0.
pub fn known_shape(name: &str) -> Option<Shape> {
    let s = |layers, d, heads: usize, kv_heads: usize, head_dim: usize, ffn, vocab| Shape {
        name: name.to_owned(),
        layers,
        d,
        q_dim: heads * head_dim,
        kv_dim: kv_heads * head_dim,
        ffn,
        vocab,
        bits: 4.5,
    };
    Some(match name {
        "llama3_8b" => s(32, 4096, 32, 8, 128, 14336, 128256),
        "llama2_7b" => s(32, 4096, 32, 32, 128, 11008, 32000),
        "llama3_2_3b" => s(28, 3072, 24, 8, 128, 8192, 128256),
        "internlm2_1_8b" => s(24, 2048, 16, 8, 128, 8192, 92544),
        "qwen1_5_1_8b" => s(24, 2048, 16, 16, 128, 5504, 151936),
        "qwen2_5_1_5b" => s(28, 1536, 12, 2, 128, 8960, 151936),
        "smollm2_135m" => s(30, 576, 9, 3, 64, 1536, 49152),
        _ => return None,
    })
}

pub const KNOWN_SHAPES: &[&str] =
    &["llama3_8b", "llama2_7b", "llama3_2_3b", "internlm2_1_8b", "qwen1_5_1_8b", "qwen2_5_1_5b", "smollm2_135m"];

impl Shape {
    /// The matmuls of one layer for `m` tokens, in order: the engine's linear groups (one
    /// input each), which the NPU path also builds as one graph apiece — QKV, O, gate/up, down.
    /// **Decision:** HeteroLLM does not say whether its Q, K, V (and gate, up) are separate
    /// operators; fused, GQA's narrow K and V do not count as dimension-reducing.
    pub fn layer_ops(&self, m: usize) -> Vec<Op> {
        let op = |name: &str, k, n| Op { name: name.into(), m, k, n };
        vec![
            op("qkv", self.d, self.q_dim + 2 * self.kv_dim),
            op("o", self.q_dim, self.d),
            op("gate_up", self.d, 2 * self.ffn),
            op("down", self.ffn, self.d),
        ]
    }

    /// Weights of the linear layers and the head (values).
    pub fn weights(&self) -> f64 {
        let per_layer = self.d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.d + 3 * self.d * self.ffn;
        (self.layers * per_layer + self.vocab * self.d) as f64
    }

    /// FLOPs of the linear layers per token (no attention, no head), HeteroLLM's measure.
    pub fn linear_flops_per_token(&self) -> f64 {
        2.0 * (self.weights() - (self.vocab * self.d) as f64)
    }
}

/// How the matmuls are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Strategy {
    /// Everything on the GPU (PPL-OpenCL in the paper).
    GpuOnly,
    /// Matmuls on the NPU in prefill (the whole prompt padded into one graph, or whole graphs
    /// in turn with the margin padded), all on the GPU in decode.
    HeteroLayer,
    /// The solver's cut of every matmul.
    HeteroTensor,
    /// The NPU alone, the prompt padded to the next standard size.
    Padding,
    /// The NPU alone, standard graphs in turn, the margin padded into the smallest that holds it.
    Pipe,
    /// The NPU alone, graphs of the prompt's exact length built for the request.
    OnlinePrepare,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::GpuOnly => "GPU only",
            Strategy::HeteroLayer => "Hetero-layer",
            Strategy::HeteroTensor => "Hetero-tensor",
            Strategy::Padding => "Padding",
            Strategy::Pipe => "Pipe",
            Strategy::OnlinePrepare => "Online-prepare",
        }
    }
}

/// One modelled pass.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Pass {
    pub strategy: Strategy,
    pub phase: Phase,
    /// Prompt tokens (prefill) or context length (decode).
    pub tokens: usize,
    pub fast_sync: bool,
    pub seconds: f64,
    /// Prompt tokens per second (prefill) or steps per second (decode).
    pub tok_per_s: f64,
    /// Graph preparation inside `seconds` (Online-prepare).
    pub prepare_s: f64,
    /// Sync inside `seconds`.
    pub sync_s: f64,
    /// Bytes of weights read per pass over its time (decode's effective bandwidth).
    pub weight_gb_per_s: f64,
    /// One layer's matmuls as placed, and the head.
    pub ops: Vec<Choice>,
    pub head: Choice,
    /// Distinct NPU graph sizes the layers' matmuls use (to pre-build; the head's, if on the
    /// NPU, is the one-token decode graph).
    pub graphs: Vec<usize>,
    /// Bytes of weights each processor needs resident (NPU, GPU).
    pub npu_weight_bytes: f64,
    pub gpu_weight_bytes: f64,
}

/// The simulator over one SoC.
pub struct Sim<'a> {
    pub soc: &'a Soc,
    pub profiler: &'a dyn Profiler,
}

impl<'a> Sim<'a> {
    pub fn new(soc: &'a Soc, profiler: &'a dyn Profiler) -> Self {
        Self { soc, profiler }
    }

    fn fixed(&self, solver: &Solver, op: &Op, cut: Cut) -> Choice {
        let seconds = solver.cost(op, &cut);
        Choice {
            kind: cut.kind(op.m, op.n),
            op: op.clone(),
            cut,
            seconds,
            gpu_only_s: solver.cost(op, &Cut::gpu_only()),
            npu_only_s: f64::NAN,
        }
    }

    /// The NPU-only cut of `m` tokens: one padded graph when one holds them (`pad`), else
    /// whole graphs in turn and the margin padded.
    fn npu_cut(sizes: &Sizes, m: usize, n: usize, pad: bool) -> Cut {
        if pad {
            if let Some(g) = sizes.pad(m) {
                return Cut::padded(m, g, n);
            }
        }
        let (whole, left) = sizes.greedy(m);
        let mut c = Cut::from_sizes(&whole, n);
        if left > 0 {
            let g = sizes.pad(left).unwrap_or(left);
            c.npu.push(Segment { tokens: m - left..m, graph: g });
        }
        c
    }

    fn place(&self, solver: &Solver, strategy: Strategy, op: &Op) -> Choice {
        let sizes = &solver.sizes;
        match (strategy, solver.phase) {
            (Strategy::GpuOnly, _) | (Strategy::HeteroLayer, Phase::Decode) => self.fixed(solver, op, Cut::gpu_only()),
            (Strategy::HeteroTensor, _) => solver.solve(op),
            (Strategy::HeteroLayer, Phase::Prefill) | (Strategy::Padding, _) => {
                self.fixed(solver, op, Self::npu_cut(sizes, op.m, op.n, true))
            }
            (Strategy::Pipe, _) => self.fixed(solver, op, Self::npu_cut(sizes, op.m, op.n, false)),
            (Strategy::OnlinePrepare, _) => self.fixed(solver, op, Cut::padded(op.m, op.m, op.n)),
        }
    }

    /// A prefill of `m` prompt tokens (`m ≥ 1`).
    pub fn prefill(&self, shape: &Shape, m: usize, strategy: Strategy, fast_sync: bool) -> Pass {
        self.pass(shape, Phase::Prefill, m, strategy, fast_sync)
    }

    /// One decode step at context `ctx`.
    pub fn decode(&self, shape: &Shape, ctx: usize, strategy: Strategy, fast_sync: bool) -> Pass {
        self.pass(shape, Phase::Decode, ctx, strategy, fast_sync)
    }

    fn pass(&self, shape: &Shape, phase: Phase, tokens: usize, strategy: Strategy, fast_sync: bool) -> Pass {
        let tokens = tokens.max(1);
        let mut solver = Solver::new(self.profiler, self.soc, phase, fast_sync);
        if strategy == Strategy::OnlinePrepare {
            solver.sizes = Sizes::new(vec![tokens]).unwrap_or(solver.sizes);
        }
        let m = if phase == Phase::Prefill { tokens } else { 1 };
        let ops: Vec<Choice> = shape.layer_ops(m).iter().map(|op| self.place(&solver, strategy, op)).collect();
        // The head: the last token's logits, one row (decode's solver: a one-token graph).
        let head_solver = Solver::new(self.profiler, self.soc, Phase::Decode, fast_sync);
        let head_op = Op { name: "head".into(), m: 1, k: shape.d, n: shape.vocab };
        let head = match strategy {
            Strategy::HeteroTensor => head_solver.solve(&head_op),
            _ => self.fixed(&head_solver, &head_op, Cut::gpu_only()),
        };
        let npu_ops = ops.iter().filter(|c| c.kind != CutKind::GpuOnly).count();
        let sync_s = npu_ops as f64 * solver.sync.per_npu_op * shape.layers as f64
            + if head.kind != CutKind::GpuOnly { head_solver.sync.per_npu_op } else { 0.0 };
        let matmul_s: f64 = ops.iter().map(|c| c.seconds).sum::<f64>() * shape.layers as f64 + head.seconds;
        let other_s = self.gpu_other_s(shape, phase, tokens) * shape.layers as f64;
        let prepare_s = if strategy == Strategy::OnlinePrepare { self.soc.prepare_s(m) } else { 0.0 };
        let seconds = matmul_s + other_s + prepare_s;
        let tok_per_s = if phase == Phase::Prefill { tokens as f64 / seconds } else { 1.0 / seconds };
        let mut graphs: Vec<usize> = ops.iter().flat_map(|c| c.cut.npu.iter().map(|s| s.graph)).collect();
        graphs.sort_unstable();
        graphs.dedup();
        let bpw = shape.bits / 8.0;
        let mut npu_w = 0.0;
        let mut gpu_w = 0.0;
        for c in &ops {
            let w = (c.op.k * c.op.n) as f64 * bpw * shape.layers as f64;
            let share = if c.cut.npu.is_empty() { 0.0 } else { c.cut.npu_rows as f64 / c.op.n as f64 };
            npu_w += w * share;
            gpu_w += w * (1.0 - share);
        }
        let head_w = (shape.d * shape.vocab) as f64 * bpw;
        let head_share = if head.cut.npu.is_empty() { 0.0 } else { head.cut.npu_rows as f64 / shape.vocab as f64 };
        npu_w += head_w * head_share;
        gpu_w += head_w * (1.0 - head_share);
        // A sequence cut needs the whole matrix on both: count the GPU's full copy where it
        // computes every row of some tokens.
        for c in &ops {
            let gpu_all_rows =
                matches!(c.kind, CutKind::Seq | CutKind::MultiSeq | CutKind::Hybrid) && c.cut.npu_tokens() < c.op.m;
            if gpu_all_rows {
                gpu_w += (c.op.k * c.cut.npu_rows) as f64 * bpw * shape.layers as f64;
            }
        }
        Pass {
            strategy,
            phase,
            tokens,
            fast_sync,
            seconds,
            tok_per_s,
            prepare_s,
            sync_s,
            weight_gb_per_s: shape.weights() * bpw / seconds / 1e9,
            ops,
            head,
            graphs,
            npu_weight_bytes: npu_w,
            gpu_weight_bytes: gpu_w,
        }
    }

    /// One layer's GPU work other than matmuls: two RMSNorms, RoPE, attention, SwiGLU, two
    /// residual adds (f32 activations; an f16 KV cache).
    pub fn gpu_other_s(&self, s: &Shape, phase: Phase, tokens: usize) -> f64 {
        let soc = self.soc;
        let (m, ctx) = match phase {
            Phase::Prefill => (tokens as f64, tokens as f64),
            Phase::Decode => (1.0, tokens as f64),
        };
        let d = s.d as f64;
        let el = |values: f64| soc.gpu_elementwise_s(values * 4.0);
        let norms = 2.0 * el(2.0 * m * d);
        let rope = el(2.0 * m * (s.q_dim + s.kv_dim) as f64);
        let swiglu = el(3.0 * m * s.ffn as f64);
        let residual = 2.0 * el(3.0 * m * d);
        // Attention: QKᵀ and PV over the causal context (half the prompt on average in
        // prefill), the KV cache read once (f16).
        let pairs = if phase == Phase::Prefill { m * (ctx + 1.0) / 2.0 } else { ctx };
        let flops = 4.0 * pairs * s.q_dim as f64;
        let kv_bytes = 2.0 * ctx * s.kv_dim as f64 * 2.0;
        let attn = soc.gpu.submit_us * 1e-6
            + (flops / (soc.gpu.fp16_tflops * 1e12 * soc.gpu_speed))
                .max(kv_bytes / (soc.gpu.bandwidth_gb_per_s * 1e9 * soc.gpu_speed));
        norms + rope + swiglu + residual + attn
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::hetero::soc;
    use crate::hetero::solver::Predicted;

    #[test]
    fn strategies_compute_and_order_as_the_paper() {
        let soc = soc::load(soc::BUILTIN, "snapdragon_8gen3").unwrap();
        let p = Predicted { soc: &soc, bits: 4.5 };
        let sim = Sim::new(&soc, &p);
        let s = known_shape("llama3_8b").unwrap();
        let t = sim.prefill(&s, 256, Strategy::HeteroTensor, true);
        let l = sim.prefill(&s, 256, Strategy::HeteroLayer, true);
        let g = sim.prefill(&s, 256, Strategy::GpuOnly, true);
        assert!(
            t.tok_per_s > l.tok_per_s && l.tok_per_s > g.tok_per_s,
            "{} {} {}",
            t.tok_per_s,
            l.tok_per_s,
            g.tok_per_s
        );
        let slow = sim.prefill(&s, 256, Strategy::HeteroTensor, false);
        assert!(slow.tok_per_s < t.tok_per_s);
        let d = sim.decode(&s, 256, Strategy::HeteroTensor, true);
        let dg = sim.decode(&s, 256, Strategy::GpuOnly, true);
        assert!(d.tok_per_s > dg.tok_per_s);
        let pad = sim.prefill(&s, 525, Strategy::Padding, true);
        let online = sim.prefill(&s, 525, Strategy::OnlinePrepare, true);
        let het = sim.prefill(&s, 525, Strategy::HeteroTensor, true);
        assert!(het.seconds < pad.seconds && het.seconds < online.seconds);
        assert!(online.prepare_s > 1.0);
    }
}
