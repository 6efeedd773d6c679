//! The NPU's graphs: a transformer layer's linear groups (QKV, O, gate/up, down) as QNN graphs of
//! W8A8 `FullyConnected` nodes, one graph per group and chunk size (static shapes: a prompt is cut
//! into chunks of the graph's size, llm.npu's chunked prefill).
//!
//! A group's projections share one input (the QKV projections read the same normed hidden
//! state, gate and up too), so a group is one graph with one uint8 input `[chunk, k]` and one
//! uint8 or uint16 output `[chunk, n]` per projection. Norms, RoPE, attention and the SiLU·up product stay
//! on the CPU in float (llm.npu's split): the graph's outputs are dequantized there.
//!
//! QNN's library accepts a `FullyConnected` whose weight does not match its input's width
//! (seen with Qualcomm's x86-64 HTP library), so every shape is checked here before QNN sees it.

use super::device::NpuContext;
use super::quant::{ActQuant, QuantWeights, WeightScales};
use crate::error::NpuError;
use qnn_sys::api::{Context, Graph, Quantization, TensorSpec};
use qnn_sys::data_type as dt;

/// One projection of a group: its weights, optional bias (int32 at input × weight scale), and
/// the calibrated quantization of its output.
#[derive(Clone, Debug)]
pub struct Projection {
    pub name: String,
    pub weights: QuantWeights,
    pub bias: Option<Vec<i32>>,
    pub output: ActQuant,
    /// Per output channel, the factor the host multiplies the dequantized output by: the
    /// channel's own weight scale over the graph's per-tensor one
    /// ([`QuantWeights::quantize_folded`]); none for plain per-tensor or per-channel weights.
    pub gain: Option<Vec<f32>>,
}

/// Projections reading one input: the unit a graph is built for.
#[derive(Clone, Debug)]
pub struct LinearGroup {
    pub name: String,
    pub input: ActQuant,
    pub projections: Vec<Projection>,
}

impl LinearGroup {
    /// The input's width (every projection's weight columns).
    pub fn k(&self) -> usize {
        self.projections.first().map_or(0, |p| p.weights.cols)
    }

    /// Refuses a group whose projections do not fit together or whose numbers QNN cannot take.
    pub fn check(&self) -> Result<(), NpuError> {
        let bad = |detail: String| Err(NpuError::Shape { graph: self.name.clone(), detail });
        if self.projections.is_empty() {
            return bad("no projections".into());
        }
        let k = self.k();
        check_quant(&self.name, "input", self.input)?;
        if self.input.bits != 8 {
            return bad(format!("{}-bit input: the NPU's matmuls take 8-bit activations", self.input.bits));
        }
        for p in &self.projections {
            let w = &p.weights;
            if w.cols != k {
                return bad(format!("{} takes {} inputs, the group's input has {k}", p.name, w.cols));
            }
            if w.q.len() != w.rows * w.cols {
                return bad(format!("{} holds {} weights for {} × {}", p.name, w.q.len(), w.rows, w.cols));
            }
            if let WeightScales::PerChannel(s) = &w.scales {
                if s.len() != w.rows {
                    return bad(format!("{} has {} channel scales for {} channels", p.name, s.len(), w.rows));
                }
            }
            let scales: Vec<f32> = (0..w.rows).map(|o| w.scales.of(o)).collect();
            if let Some(s) = scales.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
                return bad(format!("{} has a weight scale of {s}", p.name));
            }
            if let Some(b) = &p.bias {
                if b.len() != w.rows {
                    return bad(format!("{} has {} biases for {} channels", p.name, b.len(), w.rows));
                }
            }
            check_quant(&self.name, &p.name, p.output)?;
            if p.output.bits == 16 && p.output.zero_point == super::quant::HTP_BAD_ZERO_POINT_16 {
                return bad(format!(
                    "{}: a 16-bit output zero point of 32768 computes wrong outputs on the HTP",
                    p.name
                ));
            }
            if p.output.bits == 16 && matches!(w.scales, WeightScales::PerChannel(_)) {
                // Seen with Qualcomm's x86-64 HTP library (QAIRT 2.51): MEM_ALLOC at finalize.
                return bad(format!("{}: per-channel weights with 16-bit outputs do not finalize on the HTP", p.name));
            }
            if u32::try_from(w.rows).is_err() || u32::try_from(k).is_err() {
                return bad(format!("{} is too large", p.name));
            }
        }
        Ok(())
    }

    /// The reference outputs (`super::quant::linear_reference`) for `m` rows of `x`.
    pub fn reference(&self, x: &[u8], m: usize) -> Vec<Vec<u16>> {
        self.projections
            .iter()
            .map(|p| super::quant::linear_reference(x, self.input, &p.weights, p.bias.as_deref(), p.output, m))
            .collect()
    }
}

fn check_quant(graph: &str, what: &str, q: ActQuant) -> Result<(), NpuError> {
    if q.scale.is_finite()
        && q.scale > 0.0
        && (q.bits == 8 || q.bits == 16)
        && (0..=q.max_code()).contains(&q.zero_point)
    {
        Ok(())
    } else {
        Err(NpuError::Shape {
            graph: graph.into(),
            detail: format!("{what} has scale {} and zero point {}", q.scale, q.zero_point),
        })
    }
}

/// The graph name for `group` at `chunk` rows: what a context binary keeps it under.
pub fn graph_name(group: &LinearGroup, chunk: usize) -> String {
    format!("{}_c{chunk}", group.name)
}

/// Builds and finalizes `group`'s graph for chunks of `chunk` rows in `context`.
pub fn build_linear_group(context: &NpuContext, group: &LinearGroup, chunk: usize) -> Result<Graph, NpuError> {
    group.check()?;
    if chunk == 0 || u32::try_from(chunk).is_err() {
        return Err(NpuError::Shape { graph: group.name.clone(), detail: format!("a chunk of {chunk} rows") });
    }
    let k = group.k() as u32;
    let name = graph_name(group, chunk);
    let mut g = context.0.graph(&name)?;
    let (x_spec, y_specs) = io_specs(group, chunk);
    let x = g.input(&x_spec)?;
    for (p, y_spec) in group.projections.iter().zip(&y_specs) {
        let w = &p.weights;
        let n = w.rows as u32;
        let w_quant = match &w.scales {
            WeightScales::PerTensor(s) => Quantization::PerTensor { scale: *s, offset: 0 },
            WeightScales::PerChannel(s) => {
                Quantization::PerAxis { axis: 0, scale_offsets: s.iter().map(|&s| (s, 0)).collect() }
            }
        };
        let w_bytes: Vec<u8> = w.q.iter().map(|&v| v as u8).collect();
        let tw =
            g.constant(&TensorSpec::new(&format!("{}.w", p.name), &[n, k], dt::SFIXED_POINT_8, w_quant), &w_bytes)?;
        let mut inputs = vec![x, tw];
        if let Some(b) = &p.bias {
            let b_quant = match &w.scales {
                WeightScales::PerTensor(s) => Quantization::PerTensor { scale: group.input.scale * s, offset: 0 },
                WeightScales::PerChannel(s) => Quantization::PerAxis {
                    axis: 0,
                    scale_offsets: s.iter().map(|&s| (group.input.scale * s, 0)).collect(),
                },
            };
            let b_bytes: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
            inputs.push(
                g.constant(&TensorSpec::new(&format!("{}.b", p.name), &[n], dt::SFIXED_POINT_32, b_quant), &b_bytes)?,
            );
        }
        let y = g.output(y_spec)?;
        g.node(&format!("{}.fc", p.name), "FullyConnected", &inputs, &[y], &[])?;
    }
    Ok(g.finalize()?)
}

fn act(q: ActQuant) -> Quantization {
    Quantization::PerTensor { scale: q.scale, offset: q.qnn_offset() }
}

/// The input and outputs of `group`'s graph at `chunk` rows, as [`build_linear_group`] declares
/// them (and [`retrieve_linear_group`] finds them again).
pub fn io_specs(group: &LinearGroup, chunk: usize) -> (TensorSpec, Vec<TensorSpec>) {
    let (m, k) = (chunk as u32, group.k() as u32);
    let x = TensorSpec::new("x", &[m, k], dt::UFIXED_POINT_8, act(group.input));
    let ys = group
        .projections
        .iter()
        .map(|p| {
            let y_type = if p.output.bits == 16 { dt::UFIXED_POINT_16 } else { dt::UFIXED_POINT_8 };
            TensorSpec::new(&p.name, &[m, p.weights.rows as u32], y_type, act(p.output))
        })
        .collect();
    (x, ys)
}

/// `group`'s graph at `chunk` rows in a context loaded from a binary, by the tensor ids QNN gave
/// its input and outputs when it was built (`input_id`, `output_ids` in projection order).
pub(crate) fn retrieve_linear_group(
    context: &Context,
    group: &LinearGroup,
    chunk: usize,
    input_id: u32,
    output_ids: &[u32],
) -> Result<Graph, NpuError> {
    group.check()?;
    let (x, ys) = io_specs(group, chunk);
    if ys.len() != output_ids.len() {
        return Err(NpuError::Shape {
            graph: group.name.clone(),
            detail: format!("{} output ids for {} projections", output_ids.len(), ys.len()),
        });
    }
    let io = qnn_sys::api::GraphIo {
        inputs: vec![(x, input_id)],
        outputs: ys.into_iter().zip(output_ids.iter().copied()).collect(),
    };
    Ok(context.retrieve(&graph_name(group, chunk), &io)?)
}

/// Runs `graph` (built by [`build_linear_group`] for `group` at `chunk` rows) on `x`, returning
/// each projection's output codes.
pub fn run_linear_group(
    graph: &mut Graph,
    group: &LinearGroup,
    chunk: usize,
    x: &[u8],
) -> Result<Vec<Vec<u16>>, NpuError> {
    if x.len() != chunk * group.k() {
        return Err(NpuError::Shape {
            graph: group.name.clone(),
            detail: format!("an input of {} bytes for {chunk} rows of {}", x.len(), group.k()),
        });
    }
    let mut outs: Vec<Vec<u8>> =
        group.projections.iter().map(|p| vec![0u8; chunk * p.weights.rows * p.output.code_bytes()]).collect();
    {
        let mut refs: Vec<&mut [u8]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        graph.execute(&[x], &mut refs)?;
    }
    Ok(group.projections.iter().zip(&outs).map(|(p, o)| p.output.codes(o)).collect())
}
