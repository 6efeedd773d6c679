//! A phone SoC as the HeteroLLM planner sees it: the figures of `engine/data/socs.toml` (or an
//! OEM's own file of the same form) and the cost of one matmul on each processor computed from
//! them — the profiler's prediction mode (a roofline for the GPU, a shape-dependent rate for
//! the NPU; [`super::profiler`] fits HeteroLLM's regression over shapes to it).
//!
//! Everything here is *modelled* from the papers' measured figures; nothing is a measurement of
//! this machine.

use serde::Deserialize;
use std::collections::BTreeMap;

/// The profiles built into llmd (`engine/data/socs.toml`).
pub const BUILTIN: &str = include_str!("../../data/socs.toml");

#[derive(Debug, thiserror::Error)]
pub enum SocError {
    #[error("SoC profile file: {0}")]
    Parse(String),
    #[error("no SoC profile {name:?} (known: {known})")]
    Unknown { name: String, known: String },
    #[error("SoC profile {name}: {detail}")]
    Invalid { name: String, detail: String },
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Npu {
    pub fp16_tflops: f64,
    pub fp16_reduce_tflops: f64,
    pub saturation_tokens: usize,
    pub stage_exponent: f64,
    pub bandwidth_gb_per_s: f64,
    pub launch_us: f64,
    pub sizes: Vec<usize>,
    pub row_align: usize,
    pub seq_align: usize,
    /// The NPU's INT8 rate over its fp16 rate, for the same shapes.
    pub int8_over_fp16: f64,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    pub fp16_tflops: f64,
    pub bandwidth_gb_per_s: f64,
    pub submit_us: f64,
    pub empty_queue_us: f64,
    pub elementwise_gb_per_s: f64,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cpu {
    pub attention_gflops: f64,
    pub elementwise_gelems_per_s: f64,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    pub pair_gb_per_s: f64,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Sync {
    pub copy_us: f64,
    pub poll_us: f64,
    pub cpu_npu_handoff_us: f64,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Graph {
    pub prepare_intercept_ms: f64,
    pub prepare_ms_per_token: f64,
}

/// One table of the file as written: a full profile, or `base` plus speed factors.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    name: String,
    base: Option<String>,
    npu_speed: Option<f64>,
    gpu_speed: Option<f64>,
    npu: Option<Npu>,
    gpu: Option<Gpu>,
    cpu: Option<Cpu>,
    memory: Option<Memory>,
    sync: Option<Sync>,
    graph: Option<Graph>,
}

/// A SoC's figures, resolved.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Soc {
    pub key: String,
    pub name: String,
    pub npu: Npu,
    pub gpu: Gpu,
    pub cpu: Cpu,
    pub memory: Memory,
    pub sync: Sync,
    pub graph: Graph,
    /// Multiplies every NPU rate (a profile derived from another).
    pub npu_speed: f64,
    pub gpu_speed: f64,
}

/// The tables of a profile file by key.
pub fn parse(text: &str) -> Result<BTreeMap<String, toml::Value>, SocError> {
    let v: toml::Table = text.parse().map_err(|e: toml::de::Error| SocError::Parse(e.to_string()))?;
    Ok(v.into_iter().collect())
}

/// Profile `name` from `text` (a file of tables like `engine/data/socs.toml`).
pub fn load(text: &str, name: &str) -> Result<Soc, SocError> {
    let tables = parse(text)?;
    resolve(&tables, name, 0)
}

/// Profile `name` among the built-in ones and `file`'s (whose tables replace built-in ones
/// of the same name; a `base` may name either).
pub fn find(file: Option<&str>, name: &str) -> Result<Soc, SocError> {
    let mut tables = parse(BUILTIN)?;
    if let Some(text) = file {
        tables.extend(parse(text)?);
    }
    resolve(&tables, name, 0)
}

/// The built-in profile of the chip QNN knows as `chip` (`QNN_HTP_DEVICE_CONFIG_OPTION_SOC`:
/// 43, 57, 69 = SM8550, SM8650, SM8750), if there is one.
pub fn for_qnn_chip(chip: u32) -> Option<Soc> {
    let key = match chip {
        43 => "snapdragon_8gen2",
        57 => "snapdragon_8gen3",
        69 => "snapdragon_8elite",
        _ => return None,
    };
    find(None, key).ok()
}

/// One INT8 graph's time by llm.npu's cost model (the emulator's, `qnn-emu`'s `cost`): the
/// launch, then per FullyConnected node of `k` inputs and `n` outputs the slower of streaming
/// its `k·n` weight bytes and its `2·m·k·n` operations, for `m` rows; seconds.
pub fn int8_graph_s(launch_s: f64, weight_bytes_per_s: f64, ops_per_s: f64, m: usize, fcs: &[(usize, usize)]) -> f64 {
    launch_s
        + fcs
            .iter()
            .map(|&(k, n)| ((k * n) as f64 / weight_bytes_per_s).max(2.0 * (m * k * n) as f64 / ops_per_s))
            .sum::<f64>()
}

/// The keys of the built-in profiles.
pub fn builtin_names() -> Vec<String> {
    parse(BUILTIN).map(|t| t.into_keys().collect()).unwrap_or_default()
}

fn resolve(tables: &BTreeMap<String, toml::Value>, name: &str, depth: usize) -> Result<Soc, SocError> {
    let invalid = |detail: String| SocError::Invalid { name: name.to_owned(), detail };
    let v = tables.get(name).ok_or_else(|| SocError::Unknown {
        name: name.to_owned(),
        known: tables.keys().cloned().collect::<Vec<_>>().join(", "),
    })?;
    let t: Table = v.clone().try_into().map_err(|e: toml::de::Error| invalid(e.to_string()))?;
    let mut soc = match (&t.base, t.npu, t.gpu, t.cpu, t.memory, t.sync, t.graph) {
        (Some(base), npu, gpu, cpu, memory, sync, graph) => {
            if depth > 4 || base == name {
                return Err(invalid(format!("base {base:?} refers back to itself")));
            }
            let mut b = resolve(tables, base, depth + 1)?;
            b.npu = npu.unwrap_or(b.npu);
            b.gpu = gpu.unwrap_or(b.gpu);
            b.cpu = cpu.unwrap_or(b.cpu);
            b.memory = memory.unwrap_or(b.memory);
            b.sync = sync.unwrap_or(b.sync);
            b.graph = graph.unwrap_or(b.graph);
            b
        }
        (None, Some(npu), Some(gpu), Some(cpu), Some(memory), Some(sync), Some(graph)) => Soc {
            key: String::new(),
            name: String::new(),
            npu,
            gpu,
            cpu,
            memory,
            sync,
            graph,
            npu_speed: 1.0,
            gpu_speed: 1.0,
        },
        _ => return Err(invalid("needs tables npu, gpu, cpu, memory, sync and graph, or a base".into())),
    };
    soc.key = name.to_owned();
    soc.name = t.name;
    soc.npu_speed *= t.npu_speed.unwrap_or(1.0);
    soc.gpu_speed *= t.gpu_speed.unwrap_or(1.0);
    soc.check().map_err(invalid)?;
    Ok(soc)
}

impl Soc {
    /// One INT8 graph of `m` rows over the FullyConnected nodes `fcs` (`k` inputs, `n`
    /// outputs each) on this profile's NPU, seconds — on the footing of its fp16 graphs
    /// ([`Self::npu_matmul_s`]): one launch (`launch_us`, the same graph execute), then per node
    /// the slower of its int8 weights and uint8 activations at the NPU's bandwidth and its
    /// operations at the fp16 rate of that shape times `int8_over_fp16`.
    ///
    /// **Decision:** the INT8 and the fp16 graphs differ only in the bytes they read and the
    /// rate ratio the hardware is specified with, so that the INT8-or-float choice comes from
    /// those and not from figures fitted to two papers' different software stacks (llm.npu's
    /// 0.355 ms launch and 1.97 TOPS are its stack's; `llmctl plan --paper` holds them out).
    pub fn npu_int8_graph_s(&self, m: usize, fcs: &[(usize, usize)]) -> f64 {
        self.npu.launch_us * 1e-6
            + fcs
                .iter()
                .map(|&(k, n)| {
                    let bytes = (k * n + m * (k + n)) as f64;
                    let ops = 2.0 * (m * k * n) as f64;
                    (bytes / self.npu_bw()).max(ops / (self.npu_rate(m, k, n) * self.npu.int8_over_fp16))
                })
                .sum::<f64>()
    }

    fn check(&self) -> Result<(), String> {
        let pos = [
            ("npu.fp16_tflops", self.npu.fp16_tflops),
            ("npu.fp16_reduce_tflops", self.npu.fp16_reduce_tflops),
            ("npu.bandwidth_gb_per_s", self.npu.bandwidth_gb_per_s),
            ("npu.int8_over_fp16", self.npu.int8_over_fp16),
            ("gpu.fp16_tflops", self.gpu.fp16_tflops),
            ("gpu.bandwidth_gb_per_s", self.gpu.bandwidth_gb_per_s),
            ("gpu.elementwise_gb_per_s", self.gpu.elementwise_gb_per_s),
            ("cpu.attention_gflops", self.cpu.attention_gflops),
            ("cpu.elementwise_gelems_per_s", self.cpu.elementwise_gelems_per_s),
            ("memory.pair_gb_per_s", self.memory.pair_gb_per_s),
            ("npu_speed", self.npu_speed),
            ("gpu_speed", self.gpu_speed),
        ];
        for (k, v) in pos {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{k} = {v}: must be a positive number"));
            }
        }
        let nonneg = [
            ("npu.launch_us", self.npu.launch_us),
            ("npu.stage_exponent", self.npu.stage_exponent),
            ("gpu.submit_us", self.gpu.submit_us),
            ("gpu.empty_queue_us", self.gpu.empty_queue_us),
            ("sync.copy_us", self.sync.copy_us),
            ("sync.poll_us", self.sync.poll_us),
            ("sync.cpu_npu_handoff_us", self.sync.cpu_npu_handoff_us),
            ("graph.prepare_intercept_ms", self.graph.prepare_intercept_ms),
            ("graph.prepare_ms_per_token", self.graph.prepare_ms_per_token),
        ];
        for (k, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{k} = {v}: must be a number ≥ 0"));
            }
        }
        // Bounds that keep the solver's search (tokens / seq_align × rows / row_align cuts per
        // operator) to a second or so on a phone-sized model.
        if self.npu.sizes.is_empty() || self.npu.sizes.len() > 16 || self.npu.sizes.iter().any(|&s| s == 0 || s > 65536)
        {
            return Err(format!("npu.sizes {:?}: 1 to 16 sizes of 1 to 65536 tokens", self.npu.sizes));
        }
        if !(16..=65536).contains(&self.npu.row_align) || !(8..=4096).contains(&self.npu.seq_align) {
            return Err(format!(
                "npu.row_align {} (16 to 65536) or seq_align {} (8 to 4096) out of range",
                self.npu.row_align, self.npu.seq_align
            ));
        }
        if self.npu.saturation_tokens == 0 || self.npu.saturation_tokens > 1 << 20 {
            return Err("npu.saturation_tokens must be 1 to 2^20".into());
        }
        Ok(())
    }

    pub fn sizes(&self) -> super::partition::Sizes {
        super::partition::Sizes::new(self.npu.sizes.clone()).unwrap_or_else(super::partition::Sizes::heterollm)
    }

    /// Shared-memory efficiency while both processors run: what the pair reaches over the sum
    /// of each alone (HeteroLLM §5.3: 59.1 / (43.3 + 40) = 0.71). **Decision:** applied to
    /// compute-bound prefill too — the paper's measured 24.4 % of Hetero-tensor over
    /// Hetero-layer is what splitting FFN-down alone gives, so its solver found no gain in
    /// splitting QKV/gate/up, which a free overlap would (NPU 4.2 + GPU 1.0 TFLOPS); see
    /// [`Soc::overlap`].
    pub fn pair_efficiency(&self) -> f64 {
        let sum = self.gpu_bw() + self.npu_bw();
        (self.memory.pair_gb_per_s * 1e9 / sum).min(1.0)
    }

    fn gpu_bw(&self) -> f64 {
        self.gpu.bandwidth_gb_per_s * 1e9 * self.gpu_speed
    }

    fn npu_bw(&self) -> f64 {
        self.npu.bandwidth_gb_per_s * 1e9 * self.npu_speed
    }

    /// The NPU's fp16 rate for `m` tokens (the graph's size) of a `k`→`n` matmul in the
    /// transposed orientation: the full rate scaled by `(m / saturation)^exponent` below
    /// saturation (stage performance), capped at the reduce rate when the output is narrower
    /// than the input (FFN-down after transposition).
    pub fn npu_rate(&self, m: usize, k: usize, n: usize) -> f64 {
        let sat = (m as f64 / self.npu.saturation_tokens as f64).min(1.0);
        let rate = self.npu.fp16_tflops * sat.powf(self.npu.stage_exponent);
        let rate = if n < k { rate.min(self.npu.fp16_reduce_tflops) } else { rate };
        rate * 1e12 * self.npu_speed
    }

    /// One NPU graph of `m` tokens computing `n` outputs of `k` inputs from weights of
    /// `bits` per value: launch + the slower of its compute and its bytes, in seconds.
    pub fn npu_matmul_s(&self, m: usize, k: usize, n: usize, bits: f64) -> f64 {
        if m == 0 || n == 0 {
            return 0.0;
        }
        let flops = 2.0 * m as f64 * k as f64 * n as f64;
        let bytes = n as f64 * k as f64 * bits / 8.0 + 2.0 * m as f64 * (k + n) as f64;
        self.npu.launch_us * 1e-6 + (flops / self.npu_rate(m, k, n)).max(bytes / self.npu_bw())
    }

    /// One GPU kernel over `m` tokens, `n` outputs of `k` inputs: the roofline plus a submission.
    pub fn gpu_matmul_s(&self, m: usize, k: usize, n: usize, bits: f64) -> f64 {
        if m == 0 || n == 0 {
            return 0.0;
        }
        let flops = 2.0 * m as f64 * k as f64 * n as f64;
        let bytes = n as f64 * k as f64 * bits / 8.0 + 4.0 * m as f64 * (k + n) as f64;
        self.gpu.submit_us * 1e-6 + (flops / (self.gpu.fp16_tflops * 1e12 * self.gpu_speed)).max(bytes / self.gpu_bw())
    }

    /// An element-wise GPU kernel touching `bytes`.
    pub fn gpu_elementwise_s(&self, bytes: f64) -> f64 {
        self.gpu.submit_us * 1e-6 + bytes / (self.gpu.elementwise_gb_per_s * 1e9 * self.gpu_speed)
    }

    /// Both processors busy at once, the GPU's work `a` s and the NPU's `b` s when each runs
    /// alone: while they overlap each runs at [`Self::pair_efficiency`], then the longer one
    /// goes on alone — `max(a, b) + min(a, b)·(1/η − 1)`. At a balanced, bandwidth-bound split
    /// this is the pair's measured bandwidth.
    pub fn overlap(&self, a: f64, b: f64) -> f64 {
        let eta = self.pair_efficiency();
        a.max(b) + a.min(b) * (1.0 / eta - 1.0)
    }

    /// Preparing (building and finalizing) graphs for an `m`-token request online.
    pub fn prepare_s(&self, m: usize) -> f64 {
        (self.graph.prepare_intercept_ms + self.graph.prepare_ms_per_token * m as f64) * 1e-3
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_resolve() {
        let names = builtin_names();
        assert!(names.contains(&"snapdragon_8gen3".to_string()), "{names:?}");
        for n in &names {
            let s = load(BUILTIN, n).unwrap();
            assert!(s.pair_efficiency() > 0.5 && s.pair_efficiency() <= 1.0);
        }
        let g2 = load(BUILTIN, "snapdragon_8gen2").unwrap();
        assert_eq!(g2.npu_speed, 0.75);
    }

    #[test]
    fn bad_profiles_are_named() {
        assert!(matches!(load(BUILTIN, "nope"), Err(SocError::Unknown { .. })));
        assert!(matches!(load("x = [", "x"), Err(SocError::Parse(_))));
        assert!(matches!(load("[a]\nname = \"A\"\nbase = \"a\"\n", "a"), Err(SocError::Invalid { .. })));
        let neg = BUILTIN.replace("fp16_tflops = 1.0 ", "fp16_tflops = -1.0 ");
        assert!(matches!(load(&neg, "snapdragon_8gen3"), Err(SocError::Invalid { .. })));
        assert!(matches!(load("[a]\nname = \"A\"\n", "a"), Err(SocError::Invalid { .. })));
        let typo = BUILTIN.replace("launch_us = 20.0", "lunch_us = 20.0");
        assert!(load(&typo, "snapdragon_8gen3").is_err());
    }

    #[test]
    fn an_oem_table_overrides_and_derives() {
        let own = "[my_soc]\nname = \"Mine\"\nbase = \"snapdragon_8gen3\"\ngpu_speed = 2.0\n";
        let s = find(Some(own), "my_soc").unwrap();
        assert_eq!(s.gpu_speed, 2.0);
        assert!(find(Some(own), "snapdragon_8gen3").is_ok(), "built-ins stay reachable");
    }

    #[test]
    fn pair_bandwidth_is_the_papers() {
        let s = load(BUILTIN, "snapdragon_8gen3").unwrap();
        // A balanced bandwidth-bound split moves bytes at the pair's 59.1 GB/s.
        let bytes = 1e9;
        let (gb, nb) = (43.3e9, 40e9);
        let f = gb / (gb + nb);
        let t = s.overlap(bytes * f / gb, bytes * (1.0 - f) / nb);
        assert!((bytes / t / 1e9 - 59.1).abs() < 0.01, "{}", bytes / t / 1e9);
    }
}
