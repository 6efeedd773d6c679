//! What a device says about itself: data the engine's scheduler reads before it places work.

pub use crate::graph::OpKind;
use crate::graph::Subgraph;
use crate::GgmlType;

/// The kind of processor behind a device: the engine's one processor enum (placement, the job
/// graph's lanes, the pieces of a cut operator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Processor {
    Cpu,
    Gpu,
    Npu,
}

impl Processor {
    /// Its name as llmd's reports print it.
    pub fn name(self) -> &'static str {
        match self {
            Processor::Cpu => "CPU",
            Processor::Gpu => "GPU",
            Processor::Npu => "NPU",
        }
    }
}

/// Where a device's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// The host's own memory: buffers are host memory, transfers are copies the device may skip.
    Host,
    /// Shared with the host physically (a phone's GPU/NPU): no copy over a bus, but buffers are
    /// still the device's (mapped, cache-maintained).
    Unified,
    /// Memory of its own: everything crosses with [`crate::Device::write`] / `read`.
    Dedicated,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryDesc {
    pub kind: MemoryKind,
    /// Bytes it can hold, if limited (an NPU's shared-memory budget, a GPU's heap).
    pub capacity: Option<u64>,
}

/// What a buffer is for (a device may place them differently: weights read-only and
/// long-lived, KV growing, activations short-lived and reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferUsage {
    Weights,
    Kv,
    Activations,
}

/// The token counts a device can build a graph for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StaticShapes {
    /// Any count (CPU, GPU: shapes are dynamic).
    Any,
    /// Only these (an NPU compiles one static graph per shape: llm.npu's fixed-size chunks).
    Only(Vec<usize>),
}

impl StaticShapes {
    pub fn allows(&self, n_tokens: usize) -> bool {
        match self {
            Self::Any => true,
            Self::Only(s) => s.contains(&n_tokens),
        }
    }
}

/// A device's description of itself.
#[derive(Clone, Debug)]
pub struct DeviceDesc {
    pub name: String,
    pub processor: Processor,
    /// False for a device compiled out or absent: it accepts no work.
    pub available: bool,
    pub ops: Vec<OpKind>,
    /// The weight types it loads (into whatever layout it keeps them in).
    pub weight_types: Vec<GgmlType>,
    pub static_shapes: StaticShapes,
    pub memory: MemoryDesc,
    /// Largest token count one submission may carry, if limited.
    pub max_tokens: Option<usize>,
    /// Threads (CPU) or compute units it runs with, for reports.
    pub threads: usize,
}

impl DeviceDesc {
    /// Whether it can run `sg` at `n_tokens` with weight matrices of `types` (norms and biases,
    /// f32 vectors, every device takes); the reason if not.
    pub fn check(&self, sg: Subgraph, types: &[GgmlType], n_tokens: usize) -> Result<(), String> {
        if !self.available {
            return Err(format!("{} is not available", self.name));
        }
        if let Some(op) = sg.ops().iter().find(|op| !self.ops.contains(op)) {
            return Err(format!("{} has no {op:?}", self.name));
        }
        if let Some(t) = types.iter().find(|t| !self.weight_types.contains(t)) {
            return Err(format!("{} takes no {t} weights", self.name));
        }
        if !self.static_shapes.allows(n_tokens) || self.max_tokens.is_some_and(|m| n_tokens > m) {
            return Err(format!("{} has no graph for {n_tokens} tokens", self.name));
        }
        Ok(())
    }

    /// Whether it runs one op on weights of `ty` (if any) at `n_tokens`.
    pub fn supports_op(&self, op: OpKind, ty: Option<GgmlType>, n_tokens: usize) -> bool {
        self.available
            && self.ops.contains(&op)
            && ty.is_none_or(|t| self.weight_types.contains(&t))
            && self.max_tokens.is_none_or(|m| n_tokens <= m)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::graph::SubgraphKind;

    fn npu() -> DeviceDesc {
        DeviceDesc {
            name: "npu".into(),
            processor: Processor::Npu,
            available: true,
            ops: vec![OpKind::MatMul, OpKind::RmsNorm, OpKind::SwiGlu],
            weight_types: vec![GgmlType::Q8_0],
            static_shapes: StaticShapes::Only(vec![32, 256]),
            memory: MemoryDesc { kind: MemoryKind::Unified, capacity: Some(1 << 30) },
            max_tokens: None,
            threads: 1,
        }
    }

    #[test]
    fn a_device_is_asked_about_ops_types_and_shapes() {
        let d = npu();
        let ffn = Subgraph { kind: SubgraphKind::Ffn, layer: 3 };
        let attn = Subgraph { kind: SubgraphKind::Attention, layer: 3 };
        assert_eq!(d.check(ffn, &[GgmlType::Q8_0], 32), Ok(()));
        assert!(d.check(ffn, &[GgmlType::F32], 32).is_err(), "an f32 matrix is a weight type too");
        assert!(d.check(ffn, &[GgmlType::Q8_0], 33).unwrap_err().contains("no graph for 33"));
        assert!(d.check(ffn, &[GgmlType::Q4_0], 32).unwrap_err().contains("no Q4_0"));
        assert!(d.check(attn, &[GgmlType::Q8_0], 32).unwrap_err().contains("no Rope"));
        let off = DeviceDesc { available: false, ..d };
        assert!(off.check(ffn, &[GgmlType::Q8_0], 32).is_err());
    }
}
