//! The emulator itself, in safe Rust: backends, devices, contexts and graphs kept in one table
//! behind a lock, the ops it runs, its context binaries, its memory cap and its cost model.
//! `lib.rs` turns QNN's C structs into the descriptions here and back.

use qnn_sys::{data_type as dt, tensor_type};
use std::collections::HashMap;
use std::sync::Mutex;

/// QNN error codes the emulator returns (QNN's own values, so callers map them as they map
/// Qualcomm's library's).
pub mod code {
    pub const NOT_SUPPORTED: u64 = 1000;
    pub const MEM_ALLOC: u64 = 1002;
    pub const INVALID_ARGUMENT: u64 = 1004;
    pub const BACKEND_INVALID_HANDLE: u64 = 4011;
    pub const CONTEXT_INVALID_HANDLE: u64 = 5002;
    pub const CONTEXT_BINARY_VERSION: u64 = 5004;
    pub const CONTEXT_CREATE_FROM_BINARY: u64 = 5005;
    /// The graph range's first code (QNN_GRAPH_MIN_ERROR), for a device that fails a run
    /// ([`super::FAIL_AFTER_ENV`]).
    pub const GRAPH_GENERAL: u64 = 6000;
    pub const GRAPH_INVALID_HANDLE: u64 = 6001;
    pub const GRAPH_DOES_NOT_EXIST: u64 = 6002;
    pub const GRAPH_INVALID_NAME: u64 = 6003;
    pub const GRAPH_INVALID_TENSOR: u64 = 6004;
    pub const GRAPH_INVALID_OP_CONFIG: u64 = 6005;
    pub const GRAPH_FINALIZE_FAILED: u64 = 6022;
    pub const GRAPH_NOT_FINALIZED: u64 = 6023;
    pub const GRAPH_FINALIZED: u64 = 6024;
    pub const GRAPH_DYNAMIC_TENSOR_SHAPE: u64 = 6036;
    pub const TENSOR_ALREADY_EXISTS: u64 = 7003;
    pub const DEVICE_INVALID_HANDLE: u64 = 14000;
}

/// An error: QNN's code and what went wrong (kept for `errorGetMessage`).
#[derive(Debug)]
pub struct EmuError {
    pub code: u64,
    pub message: String,
}

fn err<T>(code: u64, message: impl Into<String>) -> Result<T, EmuError> {
    Err(EmuError { code, message: message.into() })
}

/// How a tensor's codes map to real numbers (QNN's convention: `real = (q + offset) · scale`).
#[derive(Clone, Debug, PartialEq)]
pub enum Quant {
    None,
    PerTensor { scale: f32, offset: i32 },
    PerAxis { axis: i32, scale_offsets: Vec<(f32, i32)> },
}

impl Quant {
    /// The scale and offset of index `i` along the quantized axis (or of the whole tensor).
    fn at(&self, i: usize) -> Option<(f32, i32)> {
        match self {
            Quant::None => None,
            Quant::PerTensor { scale, offset } => Some((*scale, *offset)),
            Quant::PerAxis { scale_offsets, .. } => scale_offsets.get(i).copied(),
        }
    }
}

/// A tensor as a client described it.
#[derive(Clone, Debug)]
pub struct TensorDesc {
    pub id: u32,
    pub name: String,
    pub kind: u32,
    pub data_type: u32,
    pub quant: Quant,
    pub dims: Vec<u32>,
    /// A static tensor's data.
    pub data: Option<Vec<u8>>,
}

impl TensorDesc {
    pub fn element_bytes(&self) -> Option<usize> {
        dt::element_bytes(self.data_type)
    }

    pub fn bytes(&self) -> Option<usize> {
        self.dims.iter().try_fold(self.element_bytes()?, |n, &d| n.checked_mul(d as usize))
    }
}

/// A node: an op of QNN's built-in package on tensors of its graph.
#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op: String,
    pub inputs: Vec<u32>,
    pub outputs: Vec<u32>,
}

/// What a FullyConnected node computes, checked at finalize.
#[derive(Clone, Debug)]
struct FcPlan {
    m: usize,
    k: usize,
    n: usize,
    /// A float (fp16) FullyConnected: its weights as f32, and its bias (HeteroLLM's placement).
    float: Option<FloatFc>,
}

#[derive(Clone, Debug)]
struct FloatFc {
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    out_f16: bool,
}

struct GraphState {
    context: u64,
    name: String,
    tensors: Vec<TensorDesc>,
    nodes: Vec<Node>,
    plans: Vec<FcPlan>,
    finalized: bool,
    /// Bytes it holds against its backend's cap once finalized.
    bytes: u64,
    last_modelled_ns: u64,
    total_modelled_ns: u64,
}

impl GraphState {
    fn tensor(&self, id: u32) -> Option<&TensorDesc> {
        self.tensors.iter().find(|t| t.id == id)
    }
}

struct ContextState {
    backend: u64,
    soc: u32,
    graphs: Vec<u64>,
}

struct BackendState {
    /// Addressable memory the backend's finalized graphs may hold.
    cap: u64,
    used: u64,
}

#[derive(Default)]
struct State {
    next: u64,
    backends: HashMap<u64, BackendState>,
    devices: HashMap<u64, u32>,
    contexts: HashMap<u64, ContextState>,
    graphs: HashMap<u64, GraphState>,
    logs: Vec<u64>,
}

impl State {
    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut State) -> Result<T, EmuError>) -> Result<T, EmuError> {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(State::default))
}

/// The chip the emulator stands in for when a device names none: SM8650 (Snapdragon 8 Gen 3),
/// QNN's `Qnn_SocModel_t` 57.
pub const DEFAULT_SOC: u32 = 57;

/// The addressable memory a backend's graphs may hold unless `LLMD_QNN_EMU_MEMORY_MB` says
/// otherwise: a phone's HTP session, ~3.5 GB (llm.npu §4 gives 4 GB for the Hexagon NPU's
/// address space; the rest is the runtime's own).
pub const DEFAULT_MEMORY_CAP: u64 = 3584 << 20;

const MIB: f64 = (1u64 << 20) as f64;

/// With `LLMD_QNN_EMU_FAIL_AFTER=N`, every graph execution after the process's first `N`
/// fails (`GRAPH_GENERAL`): an NPU that fails mid-run, for the daemon's tests of what a
/// request does then.
pub const FAIL_AFTER_ENV: &str = "LLMD_QNN_EMU_FAIL_AFTER";

static EXECUTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn fail_after() -> Option<u64> {
    static N: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var(FAIL_AFTER_ENV).ok().and_then(|v| v.trim().parse().ok()))
}

/// The environment variable that sets the memory cap, in MiB.
pub const MEMORY_ENV: &str = "LLMD_QNN_EMU_MEMORY_MB";

pub fn backend_create() -> Result<u64, EmuError> {
    let cap = match std::env::var(MEMORY_ENV) {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(mb) if mb > 0 => mb << 20,
            _ => return err(code::INVALID_ARGUMENT, format!("{MEMORY_ENV}={v:?} is not a positive number of MiB")),
        },
        Err(_) => DEFAULT_MEMORY_CAP,
    };
    backend_create_with_cap(cap)
}

/// A backend whose graphs may hold `cap` bytes.
pub fn backend_create_with_cap(cap: u64) -> Result<u64, EmuError> {
    with(|s| {
        let id = s.id();
        s.backends.insert(id, BackendState { cap, used: 0 });
        Ok(id)
    })
}

pub fn backend_free(backend: u64) -> Result<(), EmuError> {
    with(|s| {
        if s.contexts.values().any(|c| c.backend == backend) {
            return err(code::INVALID_ARGUMENT, "the backend still has contexts");
        }
        s.backends
            .remove(&backend)
            .map(|_| ())
            .ok_or(EmuError { code: code::BACKEND_INVALID_HANDLE, message: "no such backend".into() })
    })
}

pub fn device_create(soc: Option<u32>) -> Result<u64, EmuError> {
    with(|s| {
        let id = s.id();
        s.devices.insert(id, soc.unwrap_or(DEFAULT_SOC));
        Ok(id)
    })
}

pub fn device_free(device: u64) -> Result<(), EmuError> {
    with(|s| {
        s.devices
            .remove(&device)
            .map(|_| ())
            .ok_or(EmuError { code: code::DEVICE_INVALID_HANDLE, message: "no such device".into() })
    })
}

pub fn log_create() -> Result<u64, EmuError> {
    with(|s| {
        let id = s.id();
        s.logs.push(id);
        Ok(id)
    })
}

pub fn log_free(log: u64) -> Result<(), EmuError> {
    with(|s| {
        s.logs.retain(|&l| l != log);
        Ok(())
    })
}

fn soc_of(s: &State, device: u64) -> Result<u32, EmuError> {
    if device == 0 {
        return Ok(DEFAULT_SOC);
    }
    s.devices
        .get(&device)
        .copied()
        .ok_or(EmuError { code: code::DEVICE_INVALID_HANDLE, message: "no such device".into() })
}

pub fn context_create(backend: u64, device: u64) -> Result<u64, EmuError> {
    with(|s| {
        if !s.backends.contains_key(&backend) {
            return err(code::BACKEND_INVALID_HANDLE, "no such backend");
        }
        let soc = soc_of(s, device)?;
        let id = s.id();
        s.contexts.insert(id, ContextState { backend, soc, graphs: Vec::new() });
        Ok(id)
    })
}

pub fn context_free(context: u64) -> Result<(), EmuError> {
    with(|s| {
        let c = s.contexts.remove(&context).ok_or_else(no_context)?;
        let mut freed = 0;
        for g in c.graphs {
            if let Some(g) = s.graphs.remove(&g) {
                freed += g.bytes;
            }
        }
        if let Some(b) = s.backends.get_mut(&c.backend) {
            b.used = b.used.saturating_sub(freed);
        }
        Ok(())
    })
}

pub fn graph_create(context: u64, name: &str) -> Result<u64, EmuError> {
    with(|s| {
        let c = context_ref(s, context)?;
        if name.is_empty() || c.graphs.iter().any(|g| s.graphs.get(g).is_some_and(|g| g.name == name)) {
            return err(code::GRAPH_INVALID_NAME, format!("graph name {name:?} is empty or taken in this context"));
        }
        let id = s.id();
        s.graphs.insert(
            id,
            GraphState {
                context,
                name: name.to_owned(),
                tensors: Vec::new(),
                nodes: Vec::new(),
                plans: Vec::new(),
                finalized: false,
                bytes: 0,
                last_modelled_ns: 0,
                total_modelled_ns: 0,
            },
        );
        if let Some(c) = s.contexts.get_mut(&context) {
            c.graphs.push(id);
        }
        Ok(id)
    })
}

fn no_context() -> EmuError {
    EmuError { code: code::CONTEXT_INVALID_HANDLE, message: "no such context".into() }
}

fn context_ref(s: &State, context: u64) -> Result<&ContextState, EmuError> {
    s.contexts.get(&context).ok_or_else(no_context)
}

fn graph_mut(s: &mut State, graph: u64) -> Result<&mut GraphState, EmuError> {
    s.graphs.get_mut(&graph).ok_or(EmuError { code: code::GRAPH_INVALID_HANDLE, message: "no such graph".into() })
}

/// Adds `t` to `graph`; returns the id it gets.
pub fn tensor_create(graph: u64, mut t: TensorDesc) -> Result<u32, EmuError> {
    with(|s| {
        let g = graph_mut(s, graph)?;
        if g.finalized {
            return err(code::GRAPH_FINALIZED, "the graph is finalized: no new tensors");
        }
        if g.tensors.iter().any(|x| x.name == t.name) {
            return err(code::TENSOR_ALREADY_EXISTS, format!("tensor {:?} exists in this graph", t.name));
        }
        let Some(bytes) = t.bytes() else {
            return err(
                code::GRAPH_INVALID_TENSOR,
                format!("tensor {:?}: unknown data type {:#x} or too large", t.name, t.data_type),
            );
        };
        if t.dims.is_empty() || t.dims.contains(&0) {
            return err(code::GRAPH_INVALID_TENSOR, format!("tensor {:?} has dimensions {:?}", t.name, t.dims));
        }
        if let Quant::PerAxis { axis, scale_offsets } = &t.quant {
            let along = usize::try_from(*axis).ok().and_then(|a| t.dims.get(a));
            if along != Some(&(scale_offsets.len() as u32)) {
                return err(
                    code::GRAPH_INVALID_TENSOR,
                    format!("tensor {:?}: {} scales for axis {axis}", t.name, scale_offsets.len()),
                );
            }
        }
        match (&t.data, t.kind) {
            (Some(d), tensor_type::STATIC) if d.len() == bytes => {}
            (Some(d), tensor_type::STATIC) => {
                return err(
                    code::GRAPH_INVALID_TENSOR,
                    format!("static tensor {:?}: {} bytes for {bytes}", t.name, d.len()),
                )
            }
            (None, tensor_type::STATIC) => {
                return err(code::GRAPH_INVALID_TENSOR, format!("static tensor {:?} has no data", t.name))
            }
            (_, tensor_type::APP_WRITE | tensor_type::APP_READ | tensor_type::NATIVE) => t.data = None,
            (_, kind) => {
                return err(code::NOT_SUPPORTED, format!("tensor {:?}: tensor type {kind} is not emulated", t.name))
            }
        }
        t.id = g.tensors.len() as u32 + 1;
        let id = t.id;
        g.tensors.push(t);
        Ok(id)
    })
}

/// The ops the emulator runs, all quantized: a float op has no place on the NPU path's graphs.
pub const OPS: [&str; 1] = ["FullyConnected"];

pub fn node_add(graph: u64, node: Node, params: &[(String, u64)]) -> Result<(), EmuError> {
    with(|s| {
        let g = graph_mut(s, graph)?;
        if g.finalized {
            return err(code::GRAPH_FINALIZED, "the graph is finalized: no new nodes");
        }
        if !OPS.contains(&node.op.as_str()) {
            return err(code::GRAPH_INVALID_OP_CONFIG, format!("op {} is not emulated (only {OPS:?})", node.op));
        }
        // FullyConnected's one parameter, keep_dims, changes only the output's rank: allowed
        // off (the default).
        if let Some((name, v)) = params.iter().find(|(n, v)| n != "keep_dims" || *v != 0) {
            return err(
                code::GRAPH_INVALID_OP_CONFIG,
                format!("parameter {name} = {v} of {} is not emulated", node.op),
            );
        }
        for id in node.inputs.iter().chain(&node.outputs) {
            if g.tensor(*id).is_none() {
                return err(
                    code::GRAPH_INVALID_TENSOR,
                    format!("node {}: tensor id {id} is not of this graph", node.name),
                );
            }
        }
        g.nodes.push(node);
        Ok(())
    })
}

/// Checks a FullyConnected node: quantized types only, shapes that fit, a bias at the input's
/// scale times the weight's.
fn plan_fc(g: &GraphState, node: &Node) -> Result<FcPlan, EmuError> {
    let bad = |m: String| err(code::GRAPH_INVALID_OP_CONFIG, format!("node {}: {m}", node.name));
    if !(2..=3).contains(&node.inputs.len()) || node.outputs.len() != 1 {
        return bad(format!(
            "{} inputs and {} outputs (FullyConnected takes 2 or 3 and gives 1)",
            node.inputs.len(),
            node.outputs.len()
        ));
    }
    let t = |id: u32| g.tensor(id).expect("checked when the node was added");
    let (x, w, y) = (t(node.inputs[0]), t(node.inputs[1]), t(node.outputs[0]));
    let b = node.inputs.get(2).map(|&id| t(id));
    if x.data_type == dt::FLOAT_16 {
        return plan_fc_float(node, x, w, b, y);
    }
    // The output may be 16-bit (int8 arithmetic, a finer requantization).
    let y_want = if y.data_type == dt::UFIXED_POINT_16 { dt::UFIXED_POINT_16 } else { dt::UFIXED_POINT_8 };
    for (what, tensor, want) in
        [("input", x, dt::UFIXED_POINT_8), ("weight", w, dt::SFIXED_POINT_8), ("output", y, y_want)]
    {
        if tensor.data_type != want {
            let kind =
                if matches!(tensor.data_type, dt::FLOAT_16 | dt::FLOAT_32) { "a float" } else { "an unsupported" };
            return bad(format!(
                "{what} {:?} is {kind} type ({:#x}): the emulator runs W8A8 graphs (uint8 or uint16 out) and fp16 ones (fp16 input and weight)",
                tensor.name, tensor.data_type
            ));
        }
    }
    if !matches!(x.quant, Quant::PerTensor { .. }) || !matches!(y.quant, Quant::PerTensor { .. }) {
        return bad("input and output need one scale and offset each".into());
    }
    if !matches!(x.kind, tensor_type::APP_WRITE | tensor_type::NATIVE) {
        return bad(format!("input {:?} must be a graph input or another node's output", x.name));
    }
    if !matches!(y.kind, tensor_type::APP_READ | tensor_type::NATIVE) {
        return bad(format!("output {:?} must be a graph output or an intermediate", y.name));
    }
    if w.kind != tensor_type::STATIC {
        return bad(format!("weight {:?} is not static", w.name));
    }
    let k = *x.dims.last().unwrap_or(&0) as usize;
    let m: usize = x.dims[..x.dims.len() - 1].iter().map(|&d| d as usize).product();
    if w.dims.len() != 2 || w.dims[1] as usize != k {
        return bad(format!("weight {:?} is {:?}, the input's rows are {k} wide", w.name, w.dims));
    }
    let n = w.dims[0] as usize;
    match &w.quant {
        Quant::PerTensor { .. } => {}
        Quant::PerAxis { axis: 0, .. } => {}
        q => return bad(format!("weight quantization {q:?}: per tensor or per output channel (axis 0)")),
    }
    if y.dims.len() != 2 || y.dims[0] as usize != m || y.dims[1] as usize != n {
        return bad(format!("output {:?} is {:?}, the product is [{m}, {n}]", y.name, y.dims));
    }
    if let Some(b) = b {
        if b.data_type != dt::SFIXED_POINT_32 || b.kind != tensor_type::STATIC || b.dims != [n as u32] {
            return bad(format!("bias {:?} must be a static int32 tensor of [{n}]", b.name));
        }
        let (sx, _) = x.quant.at(0).expect("per tensor");
        for o in 0..n {
            let (sw, _) = w.quant.at(o).expect("checked");
            let (sb, ob) = b.quant.at(o).ok_or(EmuError {
                code: code::GRAPH_INVALID_OP_CONFIG,
                message: format!("bias {:?} is not quantized", b.name),
            })?;
            // The bias is added to the integer accumulator, so it must be at its scale.
            let want = sx * sw;
            if ob != 0 || !sb.is_finite() || (sb - want).abs() > want * 1e-6 {
                return bad(format!(
                    "bias {:?} channel {o}: scale {sb} offset {ob}, needs scale {want} (input × weight) and offset 0",
                    b.name
                ));
            }
        }
    }
    for (what, tensor) in [("input", x), ("output", y)] {
        if let Some((scale, _)) = tensor.quant.at(0) {
            if !(scale.is_finite() && scale > 0.0) {
                return bad(format!("{what} {:?} has scale {scale}", tensor.name));
            }
        }
    }
    for o in 0..n {
        let (sw, _) = w.quant.at(o).expect("checked");
        if !(sw.is_finite() && sw > 0.0) {
            return bad(format!("weight {:?} channel {o} has scale {sw}", w.name));
        }
    }
    Ok(FcPlan { m, k, n, float: None })
}

fn f16_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect()
}

fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// Single to half, rounding to nearest, ties to even.
fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Checks a float FullyConnected: fp16 input and weight (static), fp16 or fp32 output, an
/// optional fp16 or fp32 bias of `[n]`; no quantization parameters.
fn plan_fc_float(
    node: &Node,
    x: &TensorDesc,
    w: &TensorDesc,
    b: Option<&TensorDesc>,
    y: &TensorDesc,
) -> Result<FcPlan, EmuError> {
    let bad = |m: String| err(code::GRAPH_INVALID_OP_CONFIG, format!("node {}: {m}", node.name));
    if w.data_type != dt::FLOAT_16 || w.kind != tensor_type::STATIC {
        return bad(format!("weight {:?} must be a static fp16 tensor beside an fp16 input", w.name));
    }
    if !matches!(y.data_type, dt::FLOAT_16 | dt::FLOAT_32) {
        return bad(format!("output {:?} must be fp16 or fp32 for an fp16 input", y.name));
    }
    if !matches!(x.kind, tensor_type::APP_WRITE | tensor_type::NATIVE) {
        return bad(format!("input {:?} must be a graph input or another node's output", x.name));
    }
    if !matches!(y.kind, tensor_type::APP_READ | tensor_type::NATIVE) {
        return bad(format!("output {:?} must be a graph output or an intermediate", y.name));
    }
    if [x, w, y].iter().any(|t| !matches!(t.quant, Quant::None)) {
        return bad("float tensors take no quantization parameters".into());
    }
    let k = *x.dims.last().unwrap_or(&0) as usize;
    let m: usize = x.dims[..x.dims.len().saturating_sub(1)].iter().map(|&d| d as usize).product();
    if w.dims.len() != 2 || w.dims[1] as usize != k {
        return bad(format!("weight {:?} is {:?}, the input's rows are {k} wide", w.name, w.dims));
    }
    let n = w.dims[0] as usize;
    if y.dims.len() != 2 || y.dims[0] as usize != m || y.dims[1] as usize != n {
        return bad(format!("output {:?} is {:?}, the product is [{m}, {n}]", y.name, y.dims));
    }
    let wv = f16_values(w.data.as_deref().unwrap_or(&[]));
    if wv.len() != n * k {
        return bad(format!("weight {:?} holds {} values for {n} × {k}", w.name, wv.len()));
    }
    let bias = match b {
        None => None,
        Some(b) => {
            if b.kind != tensor_type::STATIC || b.dims != [n as u32] || !matches!(b.quant, Quant::None) {
                return bad(format!("bias {:?} must be a static float tensor of [{n}]", b.name));
            }
            let data = b.data.as_deref().unwrap_or(&[]);
            Some(match b.data_type {
                dt::FLOAT_16 => f16_values(data),
                dt::FLOAT_32 => f32_values(data),
                t => return bad(format!("bias {:?} is of type {t:#x}: fp16 or fp32", b.name)),
            })
        }
    };
    Ok(FcPlan { m, k, n, float: Some(FloatFc { w: wv, bias, out_f16: y.data_type == dt::FLOAT_16 }) })
}

/// The float FullyConnected's arithmetic, defined once (the engine's
/// `backend::npu::fp16::reference` is the same sum): per output, the products of the f16 input
/// and weight values in f32, summed in eight lanes (lane `j` takes the indices `≡ j mod 8` in
/// order), the lanes added as `((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`, then the bias, then rounded
/// to the output type (fp16: nearest, ties to even).
pub fn dot_f16_lanes(x: &[f32], w: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    let (xc, xr) = x.split_at(x.len() / 8 * 8);
    let (wc, wr) = w.split_at(xc.len());
    for (a, b) in xc.chunks_exact(8).zip(wc.chunks_exact(8)) {
        for j in 0..8 {
            l[j] += a[j] * b[j];
        }
    }
    for (j, (a, b)) in xr.iter().zip(wr).enumerate() {
        l[j] += a * b;
    }
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

fn fully_connected_float(xs: &[u8], p: &FcPlan, f: &FloatFc) -> Vec<u8> {
    let x = f16_values(xs);
    let mut out = Vec::with_capacity(p.m * p.n * if f.out_f16 { 2 } else { 4 });
    for r in 0..p.m {
        let xr = &x[r * p.k..(r + 1) * p.k];
        for o in 0..p.n {
            let v = dot_f16_lanes(xr, &f.w[o * p.k..(o + 1) * p.k]) + f.bias.as_ref().map_or(0.0, |b| b[o]);
            if f.out_f16 {
                out.extend_from_slice(&f32_to_f16(v).to_le_bytes());
            } else {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    out
}

pub fn graph_finalize(graph: u64) -> Result<(), EmuError> {
    with(|s| {
        let g = graph_mut(s, graph)?;
        if g.finalized {
            return err(code::GRAPH_FINALIZED, "the graph is finalized already");
        }
        if g.nodes.is_empty() {
            return err(code::GRAPH_FINALIZE_FAILED, "the graph has no nodes");
        }
        let plans = g.nodes.iter().map(|n| plan_fc(g, n)).collect::<Result<Vec<_>, _>>()?;
        // Every intermediate is written before it is read.
        let mut written: Vec<u32> = g
            .tensors
            .iter()
            .filter(|t| matches!(t.kind, tensor_type::APP_WRITE | tensor_type::STATIC))
            .map(|t| t.id)
            .collect();
        for n in &g.nodes {
            if let Some(id) = n.inputs.iter().find(|id| !written.contains(id)) {
                return err(
                    code::GRAPH_FINALIZE_FAILED,
                    format!("node {} reads tensor {id} before any node writes it", n.name),
                );
            }
            written.extend(&n.outputs);
        }
        let bytes: u64 = g.tensors.iter().map(|t| t.bytes().unwrap_or(0) as u64).sum();
        let backend = s.contexts.get(&s.graphs[&graph].context).map(|c| c.backend).unwrap_or(0);
        let b = s
            .backends
            .get_mut(&backend)
            .ok_or(EmuError { code: code::BACKEND_INVALID_HANDLE, message: "the graph's backend is gone".into() })?;
        if b.used + bytes > b.cap {
            return err(
                code::MEM_ALLOC,
                format!(
                    "the graph needs {:.2} MiB; {:.2} of the NPU's {:.2} MiB are held already ({MEMORY_ENV})",
                    bytes as f64 / MIB,
                    b.used as f64 / MIB,
                    b.cap as f64 / MIB
                ),
            );
        }
        b.used += bytes;
        let g = graph_mut(s, graph)?;
        g.plans = plans;
        g.bytes = bytes;
        g.finalized = true;
        Ok(())
    })
}

pub fn graph_retrieve(context: u64, name: &str) -> Result<u64, EmuError> {
    with(|s| {
        let c = context_ref(s, context)?;
        c.graphs
            .iter()
            .copied()
            .find(|g| s.graphs.get(g).is_some_and(|g| g.name == name))
            .ok_or(EmuError { code: code::GRAPH_DOES_NOT_EXIST, message: format!("no graph {name:?} in this context") })
    })
}

/// A tensor a client passes to `graphExecute`: its id and shape as the client describes it, and
/// its buffer's bytes (inputs) or size (outputs).
pub struct IoTensor<'a> {
    pub id: u32,
    pub dims: Vec<u32>,
    pub data_type: u32,
    pub data: &'a [u8],
}

/// Runs `graph`: `inputs` are the client's input tensors; returns each output's bytes in the
/// order of `outputs` (id, dims, type; their buffers' sizes in `data.len()`).
pub fn graph_execute(graph: u64, inputs: &[IoTensor<'_>], outputs: &[IoTensor<'_>]) -> Result<Vec<Vec<u8>>, EmuError> {
    if let Some(n) = fail_after() {
        if EXECUTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= n {
            return err(code::GRAPH_GENERAL, format!("the emulated NPU failed the run ({FAIL_AFTER_ENV}={n})"));
        }
    }
    with(|s| {
        let soc = {
            let g = s
                .graphs
                .get(&graph)
                .ok_or(EmuError { code: code::GRAPH_INVALID_HANDLE, message: "no such graph".into() })?;
            s.contexts.get(&g.context).map_or(DEFAULT_SOC, |c| c.soc)
        };
        let g = graph_mut(s, graph)?;
        if !g.finalized {
            return err(code::GRAPH_NOT_FINALIZED, "the graph is not finalized");
        }
        let mut values: HashMap<u32, Vec<u8>> = HashMap::new();
        let check = |io: &IoTensor<'_>, kind: u32| -> Result<usize, EmuError> {
            let Some(t) = g.tensor(io.id).filter(|t| t.kind == kind) else {
                return err(
                    code::GRAPH_INVALID_TENSOR,
                    format!(
                        "tensor id {} is not an {} of this graph",
                        io.id,
                        if kind == tensor_type::APP_WRITE { "input" } else { "output" }
                    ),
                );
            };
            if io.dims != t.dims || io.data_type != t.data_type {
                return err(
                    code::GRAPH_DYNAMIC_TENSOR_SHAPE,
                    format!("tensor {:?} was finalized as {:?} of type {:#x}, given {:?} of {:#x}: shapes are fixed at finalize", t.name, t.dims, t.data_type, io.dims, io.data_type),
                );
            }
            let bytes = t.bytes().unwrap_or(0);
            if io.data.len() != bytes {
                return err(
                    code::GRAPH_INVALID_TENSOR,
                    format!("tensor {:?} takes {bytes} bytes, its buffer has {}", t.name, io.data.len()),
                );
            }
            Ok(bytes)
        };
        for io in inputs {
            check(io, tensor_type::APP_WRITE)?;
            if values.insert(io.id, io.data.to_vec()).is_some() {
                return err(code::GRAPH_INVALID_TENSOR, format!("input tensor id {} is given twice", io.id));
            }
        }
        let mut seen = Vec::with_capacity(outputs.len());
        for io in outputs {
            check(io, tensor_type::APP_READ)?;
            if seen.contains(&io.id) {
                return err(code::GRAPH_INVALID_TENSOR, format!("output tensor id {} is given twice", io.id));
            }
            seen.push(io.id);
        }
        let n_in = g.tensors.iter().filter(|t| t.kind == tensor_type::APP_WRITE).count();
        let n_out = g.tensors.iter().filter(|t| t.kind == tensor_type::APP_READ).count();
        if inputs.len() != n_in || outputs.len() != n_out {
            return err(
                code::GRAPH_INVALID_TENSOR,
                format!(
                    "the graph has {n_in} inputs and {n_out} outputs, given {} and {}",
                    inputs.len(),
                    outputs.len()
                ),
            );
        }
        let mut modelled =
            if g.plans.iter().all(|p| p.float.is_some()) { cost::LAUNCH_F16_NS } else { cost::launch_ns(soc) };
        for (node, plan) in g.nodes.iter().zip(&g.plans) {
            let t = |id: u32| g.tensor(id).expect("finalized");
            let (x, w, y) = (t(node.inputs[0]), t(node.inputs[1]), t(node.outputs[0]));
            let b = node.inputs.get(2).map(|&id| t(id));
            let Some(xs) = values.get(&x.id) else {
                return err(
                    code::GRAPH_INVALID_TENSOR,
                    format!("node {} reads {:?}, which nothing wrote", node.name, x.name),
                );
            };
            let out = match &plan.float {
                Some(f) => fully_connected_float(xs, plan, f),
                None => fully_connected(xs, x, w, b, y, plan),
            };
            values.insert(y.id, out);
            modelled += match plan.float {
                Some(_) => cost::fc_f16_ns(soc, plan.m, plan.k, plan.n),
                None => cost::fc_ns(soc, plan.m, plan.k, plan.n),
            };
        }
        g.last_modelled_ns = modelled;
        g.total_modelled_ns += modelled;
        Ok(outputs.iter().map(|io| values.remove(&io.id).unwrap_or_default()).collect())
    })
}

/// `y = round(((Σ (x + ox)·(w + ow)) + b) · sx·sw / sy) − oy`, clamped to the output's codes (8 or 16 bits): the integer sum
/// exact (i64), the requantization in f64 rounded half away from zero — ideal rounding, as
/// `llmd_engine::backend::npu::quant::linear_reference` defines it.
fn fully_connected(
    xs: &[u8],
    x: &TensorDesc,
    w: &TensorDesc,
    b: Option<&TensorDesc>,
    y: &TensorDesc,
    p: &FcPlan,
) -> Vec<u8> {
    let (sx, ox) = x.quant.at(0).expect("per tensor");
    let (sy, oy) = y.quant.at(0).expect("per tensor");
    let wd = w.data.as_deref().expect("static");
    let bias: Option<Vec<i64>> = b.map(|b| {
        b.data
            .as_deref()
            .expect("static")
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect()
    });
    // The sum is exact either way; in i32 (which the compiler vectorizes) when no sum can
    // overflow it: |x + ox| ≤ 510 and |w + ow| ≤ 255 + |ow|, times k.
    let max_ow = (0..p.n).map(|o| w.quant.at(o).map_or(0, |(_, ow)| i64::from(ow).abs())).max().unwrap_or(0);
    let narrow = max_ow <= 255
        && i64::from(ox).abs() <= 255
        && (p.k as i64).checked_mul(510 * (255 + max_ow)).is_some_and(|b| b <= i64::from(i32::MAX));
    let xi: Vec<i16> = xs.iter().map(|&a| (i32::from(a) + ox) as i16).collect();
    let wi: Vec<i16> = if narrow {
        (0..p.n)
            .flat_map(|o| {
                let ow = w.quant.at(o).map_or(0, |(_, ow)| ow);
                wd[o * p.k..(o + 1) * p.k].iter().map(move |&c| (i32::from(c as i8) + ow) as i16)
            })
            .collect()
    } else {
        Vec::new()
    };
    let wide_out = y.data_type == dt::UFIXED_POINT_16;
    let mut out = Vec::with_capacity(p.m * p.n * if wide_out { 2 } else { 1 });
    for r in 0..p.m {
        let xr = &xs[r * p.k..(r + 1) * p.k];
        for o in 0..p.n {
            let (sw, ow) = w.quant.at(o).expect("checked");
            let acc: i64 = if narrow {
                let (xr, wr) = (&xi[r * p.k..(r + 1) * p.k], &wi[o * p.k..(o + 1) * p.k]);
                i64::from(xr.iter().zip(wr).map(|(&a, &c)| i32::from(a) * i32::from(c)).sum::<i32>())
            } else {
                let wr = &wd[o * p.k..(o + 1) * p.k];
                xr.iter()
                    .zip(wr)
                    .map(|(&a, &c)| (i64::from(a) + i64::from(ox)) * (i64::from(c as i8) + i64::from(ow)))
                    .sum()
            };
            let acc = acc + bias.as_ref().map_or(0, |b| b[o]);
            let real = acc as f64 * f64::from(sx) * f64::from(sw);
            let q = (real / f64::from(sy)).round() - f64::from(oy);
            if wide_out {
                out.extend_from_slice(&(q.clamp(0.0, 65535.0) as u16).to_le_bytes());
            } else {
                out.push(q.clamp(0.0, 255.0) as u8);
            }
        }
    }
    out
}

/// The modelled duration of `graph`'s last execution and of all of them, in nanoseconds.
pub fn modelled_ns(graph: u64) -> Result<(u64, u64), EmuError> {
    with(|s| {
        let g = graph_mut(s, graph)?;
        Ok((g.last_modelled_ns, g.total_modelled_ns))
    })
}

/// What a phone's NPU would take for the work, from the papers' measured figures.
pub mod cost {
    /// Fixed cost of one graph execution (one launch): 0.355 ms, the intercept of the
    /// least-squares fit `t = a + k·n/B` over llm.npu's Table 3 INT8 rows on the Snapdragon 8
    /// Gen 3 (soc-profiles.toml `npu.matmul_int8.fit_intercept_ms`, [derived]).
    pub const LAUNCH_NS: u64 = 355_000;
    /// Weight bytes per second the INT8 matmuls stream: 12.66 GB/s, the slope of the same fit
    /// (`fit_weight_gb_per_s`, [derived]); at m ≤ 64 latency follows weight bytes.
    pub const WEIGHT_BYTES_PER_S: f64 = 12.66e9;
    /// INT8 operations per second at prompt-chunk sizes: 1.97 TOPS, calibrated so that
    /// Qwen1.5-1.8B's 256-token prompt takes llm.npu's measured 315 ms of NPU time
    /// (`gaps.npu_int8_chunk_shapes.suggested_compute_tops`, an [assumption] on measured figures).
    pub const OPS_PER_S: f64 = 1.97e12;

    /// One execution's fixed cost on chip `soc` (the only profile: the Snapdragon 8 Gen 3's,
    /// used for every chip).
    pub fn launch_ns(_soc: u32) -> u64 {
        LAUNCH_NS
    }

    /// One W8A8 FullyConnected of `m × k` by `k × n`: the slower of streaming its weights and
    /// computing it.
    pub fn fc_ns(_soc: u32, m: usize, k: usize, n: usize) -> u64 {
        let weights = (k * n) as f64 / WEIGHT_BYTES_PER_S;
        let compute = 2.0 * (m * k * n) as f64 / OPS_PER_S;
        (weights.max(compute) * 1e9).round() as u64
    }

    /// One launch of a graph of fp16 nodes: 20 µs (`engine/data/socs.toml` `npu.launch_us`,
    /// an [assumption]).
    pub const LAUNCH_F16_NS: u64 = 20_000;

    /// HeteroLLM's fp16 matmul on the 8 Gen 3 (`engine/data/socs.toml`, which the planner
    /// reads; repeated here because this crate sits below the engine): compute at 4.2 TFLOPS
    /// (at most 1.43 when the output is narrower than the input) times `(m/256)^0.5` below 256
    /// rows, or the fp16 weights at 40 GB/s, whichever is slower.
    pub fn fc_f16_ns(_soc: u32, m: usize, k: usize, n: usize) -> u64 {
        let stage = (m as f64 / 256.0).min(1.0).sqrt();
        let mut rate = 4.2e12 * stage;
        if n < k {
            rate = rate.min(1.43e12);
        }
        let compute = 2.0 * (m * k * n) as f64 / rate;
        let bytes = (2 * k * n + 2 * m * (k + n)) as f64 / 40e9;
        (compute.max(bytes) * 1e9).round() as u64
    }
}

// --- Context binaries ------------------------------------------------------------------------

/// The first bytes of the emulator's context binaries.
pub const BINARY_MAGIC: &[u8; 8] = b"LLMDQEMU";
/// Their layout's version: a binary of another version is refused (QNN's BINARY_VERSION).
pub const BINARY_VERSION: u32 = 1;

struct Writer(Vec<u8>);

impl Writer {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i32(&mut self, v: i32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32(&mut self, v: f32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], EmuError> {
        if self.0.len() < n {
            return err(code::CONTEXT_CREATE_FROM_BINARY, "the context binary is truncated");
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, EmuError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn i32(&mut self) -> Result<i32, EmuError> {
        Ok(self.u32()? as i32)
    }
    fn f32(&mut self) -> Result<f32, EmuError> {
        Ok(f32::from_bits(self.u32()?))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, EmuError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String, EmuError> {
        String::from_utf8(self.bytes()?)
            .map_err(|_| EmuError { code: code::CONTEXT_CREATE_FROM_BINARY, message: "a name is not UTF-8".into() })
    }
}

/// `context` as a binary: magic, version, chip, then every graph (finalized ones only are
/// kept, as QNN keeps them), and a CRC-32 of all of it.
pub fn context_binary(context: u64) -> Result<Vec<u8>, EmuError> {
    with(|s| {
        let c = context_ref(s, context)?;
        let graphs: Vec<&GraphState> =
            c.graphs.iter().filter_map(|g| s.graphs.get(g)).filter(|g| g.finalized).collect();
        let mut w = Writer(BINARY_MAGIC.to_vec());
        w.u32(BINARY_VERSION);
        w.u32(c.soc);
        w.u32(graphs.len() as u32);
        for g in graphs {
            w.bytes(g.name.as_bytes());
            w.u32(g.tensors.len() as u32);
            for t in &g.tensors {
                w.u32(t.id);
                w.bytes(t.name.as_bytes());
                w.u32(t.kind);
                w.u32(t.data_type);
                match &t.quant {
                    Quant::None => w.u32(0),
                    Quant::PerTensor { scale, offset } => {
                        w.u32(1);
                        w.f32(*scale);
                        w.i32(*offset);
                    }
                    Quant::PerAxis { axis, scale_offsets } => {
                        w.u32(2);
                        w.i32(*axis);
                        w.u32(scale_offsets.len() as u32);
                        for &(sc, of) in scale_offsets {
                            w.f32(sc);
                            w.i32(of);
                        }
                    }
                }
                w.u32(t.dims.len() as u32);
                for &d in &t.dims {
                    w.u32(d);
                }
                match &t.data {
                    Some(d) => {
                        w.u32(1);
                        w.bytes(d);
                    }
                    None => w.u32(0),
                }
            }
            w.u32(g.nodes.len() as u32);
            for n in &g.nodes {
                w.bytes(n.name.as_bytes());
                w.bytes(n.op.as_bytes());
                for ids in [&n.inputs, &n.outputs] {
                    w.u32(ids.len() as u32);
                    for &id in ids {
                        w.u32(id);
                    }
                }
            }
        }
        let crc = crc32fast::hash(&w.0);
        w.u32(crc);
        Ok(w.0)
    })
}

/// A context made from `binary` (see [`context_binary`]): checked whole (magic, version, CRC)
/// before anything is made, then each graph rebuilt and finalized again (so its shapes and
/// types are checked as a new graph's are).
pub fn context_from_binary(backend: u64, device: u64, binary: &[u8]) -> Result<u64, EmuError> {
    if binary.len() < 8 + 4 + 4 || &binary[..8] != BINARY_MAGIC {
        return err(code::CONTEXT_CREATE_FROM_BINARY, "not an emulator context binary");
    }
    let (body, crc) = binary.split_at(binary.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return err(code::CONTEXT_CREATE_FROM_BINARY, "the context binary is corrupt or truncated (CRC mismatch)");
    }
    let mut r = Reader(&body[8..]);
    let version = r.u32()?;
    if version != BINARY_VERSION {
        return err(
            code::CONTEXT_BINARY_VERSION,
            format!("context binary version {version}, this emulator reads {BINARY_VERSION}"),
        );
    }
    let soc = r.u32()?;
    let wanted_soc = with(|s| soc_of(s, device))?;
    if device != 0 && soc != wanted_soc {
        return err(
            code::CONTEXT_CREATE_FROM_BINARY,
            format!("the binary was made for chip {soc}, the device is {wanted_soc}"),
        );
    }
    let n_graphs = r.u32()?;
    let mut graphs = Vec::new();
    for _ in 0..n_graphs {
        let name = r.string()?;
        let n_tensors = r.u32()?;
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let id = r.u32()?;
            let tname = r.string()?;
            let kind = r.u32()?;
            let data_type = r.u32()?;
            let quant = match r.u32()? {
                0 => Quant::None,
                1 => Quant::PerTensor { scale: r.f32()?, offset: r.i32()? },
                2 => {
                    let axis = r.i32()?;
                    let n = r.u32()? as usize;
                    if n > r.0.len() / 8 {
                        return err(code::CONTEXT_CREATE_FROM_BINARY, "the context binary is truncated");
                    }
                    let so = (0..n).map(|_| Ok((r.f32()?, r.i32()?))).collect::<Result<Vec<_>, EmuError>>()?;
                    Quant::PerAxis { axis, scale_offsets: so }
                }
                q => return err(code::CONTEXT_CREATE_FROM_BINARY, format!("unknown quantization {q}")),
            };
            let rank = r.u32()? as usize;
            if rank > r.0.len() / 4 {
                return err(code::CONTEXT_CREATE_FROM_BINARY, "the context binary is truncated");
            }
            let dims = (0..rank).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
            let data = if r.u32()? == 1 { Some(r.bytes()?) } else { None };
            tensors.push(TensorDesc { id, name: tname, kind, data_type, quant, dims, data });
        }
        let n_nodes = r.u32()?;
        let mut nodes = Vec::new();
        for _ in 0..n_nodes {
            let nname = r.string()?;
            let op = r.string()?;
            let mut ids = [Vec::new(), Vec::new()];
            for list in &mut ids {
                let n = r.u32()? as usize;
                if n > r.0.len() / 4 {
                    return err(code::CONTEXT_CREATE_FROM_BINARY, "the context binary is truncated");
                }
                *list = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
            }
            let [inputs, outputs] = ids;
            nodes.push(Node { name: nname, op, inputs, outputs });
        }
        graphs.push((name, tensors, nodes));
    }
    if !r.0.is_empty() {
        return err(code::CONTEXT_CREATE_FROM_BINARY, "the context binary has bytes past its last graph");
    }
    let context = context_create(backend, device)?;
    with(|s| {
        if let Some(c) = s.contexts.get_mut(&context) {
            c.soc = soc;
        }
        Ok(())
    })?;
    let rebuilt = (|| {
        for (name, tensors, nodes) in graphs {
            let g = graph_create(context, &name)?;
            for t in tensors {
                let want = t.id;
                if tensor_create(g, t)? != want {
                    return err(code::CONTEXT_CREATE_FROM_BINARY, "the binary's tensor ids are not in order");
                }
            }
            for n in nodes {
                node_add(g, n, &[])?;
            }
            graph_finalize(g)?;
        }
        Ok(())
    })();
    if let Err(e) = rebuilt {
        let _ = context_free(context);
        return Err(EmuError {
            code: if e.code == code::MEM_ALLOC { e.code } else { code::CONTEXT_CREATE_FROM_BINARY },
            message: e.message,
        });
    }
    Ok(context)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, kind: u32, data_type: u32, quant: Quant, dims: &[u32], data: Option<Vec<u8>>) -> TensorDesc {
        TensorDesc { id: 0, name: name.into(), kind, data_type, quant, dims: dims.to_vec(), data }
    }

    /// A W8A8 FullyConnected graph of `m × k` by `n × k` with per-tensor scales; returns
    /// (backend, context, graph, input id, output id).
    fn fc_graph(cap: u64, m: u32, k: u32, n: u32) -> (u64, u64, u64, u32, u32) {
        let b = backend_create_with_cap(cap).expect("backend");
        let c = context_create(b, 0).expect("context");
        let g = graph_create(c, "fc").expect("graph");
        let q = |scale| Quant::PerTensor { scale, offset: -128 };
        let x = tensor_create(g, tensor("x", tensor_type::APP_WRITE, dt::UFIXED_POINT_8, q(0.1), &[m, k], None))
            .expect("x");
        let w_data: Vec<u8> = (0..n * k).map(|i| (i % 7) as u8).collect();
        let w = tensor_create(
            g,
            tensor(
                "w",
                tensor_type::STATIC,
                dt::SFIXED_POINT_8,
                Quant::PerTensor { scale: 0.01, offset: 0 },
                &[n, k],
                Some(w_data),
            ),
        )
        .expect("w");
        let y =
            tensor_create(g, tensor("y", tensor_type::APP_READ, dt::UFIXED_POINT_8, q(0.2), &[m, n], None)).expect("y");
        node_add(g, Node { name: "fc".into(), op: "FullyConnected".into(), inputs: vec![x, w], outputs: vec![y] }, &[])
            .expect("node");
        (b, c, g, x, y)
    }

    #[test]
    fn shapes_are_fixed_once_a_graph_is_finalized() {
        let (_, c, g, x, y) = fc_graph(DEFAULT_MEMORY_CAP, 4, 8, 2);
        graph_finalize(g).expect("finalizes");
        let more = tensor_create(
            g,
            tensor(
                "z",
                tensor_type::APP_WRITE,
                dt::UFIXED_POINT_8,
                Quant::PerTensor { scale: 1.0, offset: 0 },
                &[1],
                None,
            ),
        );
        assert_eq!(more.expect_err("refused").code, code::GRAPH_FINALIZED);
        let xs = [0u8; 32];
        let ys = [0u8; 8];
        let ok = graph_execute(
            g,
            &[IoTensor { id: x, dims: vec![4, 8], data_type: dt::UFIXED_POINT_8, data: &xs }],
            &[IoTensor { id: y, dims: vec![4, 2], data_type: dt::UFIXED_POINT_8, data: &ys }],
        );
        assert!(ok.is_ok(), "{ok:?}");
        // The same bytes as 8 rows of 4: a different shape.
        let e = graph_execute(
            g,
            &[IoTensor { id: x, dims: vec![8, 4], data_type: dt::UFIXED_POINT_8, data: &xs }],
            &[IoTensor { id: y, dims: vec![4, 2], data_type: dt::UFIXED_POINT_8, data: &ys }],
        )
        .expect_err("refused");
        assert_eq!(e.code, code::GRAPH_DYNAMIC_TENSOR_SHAPE, "{}", e.message);
        context_free(c).expect("freed");
    }

    #[test]
    fn an_fp16_fully_connected_follows_its_definition() {
        let b = backend_create_with_cap(DEFAULT_MEMORY_CAP).expect("backend");
        let c = context_create(b, 0).expect("context");
        let g = graph_create(c, "f16").expect("graph");
        let (m, k, n) = (3usize, 21usize, 5usize);
        let h = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        let xv: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 19) as f32 - 9.0) / 7.0).collect();
        let wv: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 23) as f32 - 11.0) / 13.0).collect();
        let bv: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 0.5).collect();
        let xs: Vec<u8> = xv.iter().flat_map(|&v| h(v)).collect();
        let ws: Vec<u8> = wv.iter().flat_map(|&v| h(v)).collect();
        let bs: Vec<u8> = bv.iter().flat_map(|&v| v.to_le_bytes()).collect();
        let x = tensor_create(
            g,
            tensor("x", tensor_type::APP_WRITE, dt::FLOAT_16, Quant::None, &[m as u32, k as u32], None),
        )
        .expect("x");
        let w = tensor_create(
            g,
            tensor("w", tensor_type::STATIC, dt::FLOAT_16, Quant::None, &[n as u32, k as u32], Some(ws)),
        )
        .expect("w");
        let bt = tensor_create(g, tensor("b", tensor_type::STATIC, dt::FLOAT_32, Quant::None, &[n as u32], Some(bs)))
            .expect("b");
        let y = tensor_create(
            g,
            tensor("y", tensor_type::APP_READ, dt::FLOAT_16, Quant::None, &[m as u32, n as u32], None),
        )
        .expect("y");
        node_add(
            g,
            Node { name: "fc".into(), op: "FullyConnected".into(), inputs: vec![x, w, bt], outputs: vec![y] },
            &[],
        )
        .expect("added");
        graph_finalize(g).expect("finalized");
        let ys = vec![0u8; m * n * 2];
        let out = graph_execute(
            g,
            &[IoTensor { id: x, dims: vec![m as u32, k as u32], data_type: dt::FLOAT_16, data: &xs }],
            &[IoTensor { id: y, dims: vec![m as u32, n as u32], data_type: dt::FLOAT_16, data: &ys }],
        )
        .expect("ran");
        let r16 = |v: f32| half::f16::from_f32(v).to_f32();
        for r in 0..m {
            for o in 0..n {
                let xr: Vec<f32> = xv[r * k..(r + 1) * k].iter().map(|&v| r16(v)).collect();
                let wr: Vec<f32> = wv[o * k..(o + 1) * k].iter().map(|&v| r16(v)).collect();
                let want = half::f16::from_f32(dot_f16_lanes(&xr, &wr) + bv[o]).to_bits();
                let i = 2 * (r * n + o);
                assert_eq!(u16::from_le_bytes([out[0][i], out[0][i + 1]]), want);
                // And close to the f64 product.
                let exact: f64 = xr.iter().zip(&wr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() + bv[o] as f64;
                assert!((half::f16::from_bits(want).to_f64() - exact).abs() <= 2e-3 * exact.abs().max(1.0));
            }
        }
        let (last, _) = modelled_ns(g).expect("modelled");
        assert!((cost::LAUNCH_F16_NS..cost::LAUNCH_NS).contains(&last), "{last}");
        context_free(c).expect("freed");
    }

    #[test]
    fn an_fp32_fully_connected_is_refused() {
        let b = backend_create_with_cap(DEFAULT_MEMORY_CAP).expect("backend");
        let c = context_create(b, 0).expect("context");
        let g = graph_create(c, "float").expect("graph");
        let x =
            tensor_create(g, tensor("x", tensor_type::APP_WRITE, dt::FLOAT_32, Quant::None, &[1, 4], None)).expect("x");
        let w =
            tensor_create(g, tensor("w", tensor_type::STATIC, dt::FLOAT_32, Quant::None, &[2, 4], Some(vec![0; 32])))
                .expect("w");
        let y =
            tensor_create(g, tensor("y", tensor_type::APP_READ, dt::FLOAT_32, Quant::None, &[1, 2], None)).expect("y");
        node_add(g, Node { name: "fc".into(), op: "FullyConnected".into(), inputs: vec![x, w], outputs: vec![y] }, &[])
            .expect("added");
        let e = graph_finalize(g).expect_err("refused");
        assert_eq!(e.code, code::GRAPH_INVALID_OP_CONFIG);
        assert!(e.message.contains("float"), "{}", e.message);
        let e = node_add(g, Node { name: "s".into(), op: "Softmax".into(), inputs: vec![x], outputs: vec![y] }, &[])
            .expect_err("refused");
        assert_eq!(e.code, code::GRAPH_INVALID_OP_CONFIG);
        context_free(c).expect("freed");
    }

    #[test]
    fn graphs_past_the_memory_cap_are_refused_and_freeing_gives_it_back() {
        // Each graph holds 64×1024 + 1024×1024 + 64×1024 bytes = 1.125 MiB; the cap takes two.
        let cap = 2_400_000;
        let (b, c, g1, _, _) = fc_graph(cap, 64, 1024, 1024);
        graph_finalize(g1).expect("the first fits");
        let c2 = context_create(b, 0).expect("context");
        let mk = |name: &str| {
            let g = graph_create(c2, name).expect("graph");
            let q = Quant::PerTensor { scale: 0.1, offset: 0 };
            let x =
                tensor_create(g, tensor("x", tensor_type::APP_WRITE, dt::UFIXED_POINT_8, q.clone(), &[64, 1024], None))
                    .expect("x");
            let w = tensor_create(
                g,
                tensor("w", tensor_type::STATIC, dt::SFIXED_POINT_8, q.clone(), &[1024, 1024], Some(vec![1; 1 << 20])),
            )
            .expect("w");
            let y = tensor_create(g, tensor("y", tensor_type::APP_READ, dt::UFIXED_POINT_8, q, &[64, 1024], None))
                .expect("y");
            node_add(
                g,
                Node { name: "fc".into(), op: "FullyConnected".into(), inputs: vec![x, w], outputs: vec![y] },
                &[],
            )
            .expect("node");
            g
        };
        graph_finalize(mk("a")).expect("the second fits");
        let e = graph_finalize(mk("b")).expect_err("the third does not");
        assert_eq!(e.code, code::MEM_ALLOC, "{}", e.message);
        context_free(c).expect("freed");
        graph_finalize(mk("c")).expect("fits once the first context is freed");
        context_free(c2).expect("freed");
    }

    #[test]
    fn the_modelled_cost_follows_llm_npu_table_3() {
        // llm.npu Table 3, NPU INT8 on the Redmi K70 Pro (Snapdragon 8 Gen 3): m, k, n, ms.
        const ROWS: [(usize, usize, usize, f64); 6] = [
            (64, 2048, 2048, 0.9),
            (64, 2048, 8192, 1.5),
            (64, 2048, 11008, 2.0),
            (32, 4096, 4096, 1.7),
            (32, 4096, 8192, 2.9),
            (32, 4096, 11008, 4.1),
        ];
        /// The weight-bytes fit the model uses leaves residuals up to 0.21 ms on these rows.
        const TOLERANCE_MS: f64 = 0.25;
        for (m, k, n, ms) in ROWS {
            let modelled = (cost::launch_ns(DEFAULT_SOC) + cost::fc_ns(DEFAULT_SOC, m, k, n)) as f64 / 1e6;
            assert!((modelled - ms).abs() <= TOLERANCE_MS, "{m}x{k}x{n}: modelled {modelled:.3} ms, measured {ms} ms");
        }
        // At a 256-token chunk the compute term takes over for square layers.
        assert!(cost::fc_ns(DEFAULT_SOC, 256, 4096, 4096) > cost::fc_ns(DEFAULT_SOC, 32, 4096, 4096));
    }

    fn io<'a>(id: u32, dims: &[u32], data: &'a [u8]) -> IoTensor<'a> {
        IoTensor { id, dims: dims.to_vec(), data_type: dt::UFIXED_POINT_8, data }
    }

    /// The definition by hand, in i64: `round((Σ (x + ox)(w + ow)) · sx·sw / sy) − oy`.
    fn by_hand(xs: &[u8], wd: &[i8], ow: i64, m: usize, k: usize, n: usize) -> Vec<u8> {
        let mut want = Vec::new();
        for r in 0..m {
            for o in 0..n {
                let acc: i64 = (0..k).map(|j| (i64::from(xs[r * k + j]) - 128) * (i64::from(wd[o * k + j]) + ow)).sum();
                let q = (acc as f64 * f64::from(0.1f32) * f64::from(0.01f32) / f64::from(0.2f32)).round() + 128.0;
                want.push(q.clamp(0.0, 255.0) as u8);
            }
        }
        want
    }

    #[test]
    fn the_vectorized_sum_and_the_wide_one_both_follow_the_definition() {
        let (m, k, n) = (3usize, 40usize, 5usize);
        let xs: Vec<u8> = (0..m * k).map(|i| (i * 37 % 256) as u8).collect();
        let wd: Vec<i8> = (0..n * k).map(|i| (i % 7) as i8).collect();
        // Offset 0: the i32 path.
        let (_, c, g, x, y) = fc_graph(DEFAULT_MEMORY_CAP, m as u32, k as u32, n as u32);
        graph_finalize(g).expect("finalizes");
        let ys = vec![0u8; m * n];
        let got = graph_execute(g, &[io(x, &[3, 40], &xs)], &[io(y, &[3, 5], &ys)]).expect("runs");
        assert_eq!(got[0], by_hand(&xs, &wd, 0, m, k, n));
        context_free(c).expect("freed");
        // A weight offset of 300 cannot be summed in i16 products: the i64 path.
        let b = backend_create_with_cap(DEFAULT_MEMORY_CAP).expect("backend");
        let c = context_create(b, 0).expect("context");
        let g = graph_create(c, "wide").expect("graph");
        let q = |scale| Quant::PerTensor { scale, offset: -128 };
        let x = tensor_create(g, tensor("x", tensor_type::APP_WRITE, dt::UFIXED_POINT_8, q(0.1), &[3, 40], None))
            .expect("x");
        let w_data: Vec<u8> = wd.iter().map(|&v| v as u8).collect();
        let w = tensor_create(
            g,
            tensor(
                "w",
                tensor_type::STATIC,
                dt::SFIXED_POINT_8,
                Quant::PerTensor { scale: 0.01, offset: 300 },
                &[5, 40],
                Some(w_data),
            ),
        )
        .expect("w");
        let y =
            tensor_create(g, tensor("y", tensor_type::APP_READ, dt::UFIXED_POINT_8, q(0.2), &[3, 5], None)).expect("y");
        node_add(g, Node { name: "fc".into(), op: "FullyConnected".into(), inputs: vec![x, w], outputs: vec![y] }, &[])
            .expect("node");
        graph_finalize(g).expect("finalizes");
        let got = graph_execute(g, &[io(x, &[3, 40], &xs)], &[io(y, &[3, 5], &ys)]).expect("runs");
        assert_eq!(got[0], by_hand(&xs, &wd, 300, m, k, n));
        context_free(c).expect("freed");
    }
}
