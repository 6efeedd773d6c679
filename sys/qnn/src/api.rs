//! A safe interface over a QNN provider's function table: a backend (with its device), its
//! contexts, graphs built in a context and run. Each object owns (`Arc`) what it was made from
//! — a graph keeps its context alive, a context its backend, a backend the library — as an
//! OpenCL kernel keeps its program, so a graph can be handed to another thread or kept in a
//! long-lived, shared handle; the last owner's `Drop` frees each handle once, in the right
//! order (graphs, then their context, then the backend). Every failed call is a [`QnnError`]
//! naming the call, the QNN error code and the library's message.
//!
//! **Threads:** QNN handles may be used from any thread, but llmd never makes two calls on one
//! object at once: [`Backend`], [`Context`] and [`Graph`] are `Send` and not `Sync`
//! (`execute` takes `&mut self`); a caller that shares one puts it behind a lock.
//!
//! Tensors are described by [`TensorSpec`] (name, shape, type, quantization); the builder
//! keeps the names and shapes the QNN structs point to for as long as the graph lives.

use crate::types::*;
use crate::{error_code, ErrorHandle, FunctionTable, Handle, Library, BACKEND_ID_HTP, QNN_SUCCESS};
use std::ffi::{c_char, CStr, CString};
use std::marker::PhantomData;
use std::sync::Arc;

/// A QNN call that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QnnError {
    /// The QNN function (`graphFinalize`, ...), or what llmd checked before calling it.
    pub call: &'static str,
    /// QNN's error code (0 when llmd refused before calling).
    pub code: u16,
    pub message: String,
}

impl std::fmt::Display for QnnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.code == 0 {
            write!(f, "{}: {}", self.call, self.message)
        } else {
            write!(f, "{} failed with QNN error {} ({})", self.call, self.code, self.message)
        }
    }
}

impl std::error::Error for QnnError {}

pub type Result<T> = std::result::Result<T, QnnError>;

fn refused(call: &'static str, message: impl Into<String>) -> QnnError {
    QnnError { call, code: 0, message: message.into() }
}

/// The table's entry `f`, or an error naming it when the provider left it NULL.
fn entry<F: Copy>(f: Option<F>, call: &'static str) -> Result<F> {
    f.ok_or_else(|| refused(call, "the provider does not implement it"))
}

fn check(t: &FunctionTable, call: &'static str, e: ErrorHandle) -> Result<()> {
    if e == QNN_SUCCESS {
        return Ok(());
    }
    let mut msg: *const c_char = std::ptr::null();
    let message = match t.error_get_message {
        Some(f) => {
            // SAFETY: `msg` is valid for a write; the library points it at a string it keeps.
            let r = unsafe { f(e, &mut msg) };
            if r == QNN_SUCCESS && !msg.is_null() {
                // SAFETY: a NUL-terminated string owned by the library.
                unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
            } else {
                String::new()
            }
        }
        None => String::new(),
    };
    Err(QnnError { call, code: error_code(e), message })
}

/// How a tensor's values map to real numbers.
#[derive(Clone, Debug, PartialEq)]
pub enum Quantization {
    /// A float (or plain integer) tensor.
    None,
    /// `real = (q + offset) * scale` for the whole tensor (QNN's offset is the negated zero point).
    PerTensor { scale: f32, offset: i32 },
    /// One scale and offset per index along `axis` (a weight's output channels, say).
    PerAxis { axis: i32, scale_offsets: Vec<(f32, i32)> },
}

/// A tensor of a graph: its name (unique in the graph), shape, `data_type` and quantization.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u32>,
    pub data_type: u32,
    pub quantization: Quantization,
}

impl TensorSpec {
    pub fn new(name: &str, dims: &[u32], data_type: u32, quantization: Quantization) -> Self {
        Self { name: name.to_owned(), dims: dims.to_vec(), data_type, quantization }
    }

    /// Bytes one element takes ([`data_type::element_bytes`]).
    pub fn element_bytes(&self) -> Option<usize> {
        data_type::element_bytes(self.data_type)
    }

    /// Bytes the whole tensor takes.
    pub fn bytes(&self) -> Option<usize> {
        self.dims.iter().try_fold(self.element_bytes()?, |n, &d| n.checked_mul(d as usize))
    }
}

/// A tensor as QNN knows it in one graph: the struct it filled (with its id), and the name and
/// shape it points to.
struct Described {
    spec: TensorSpec,
    tensor: Tensor,
    _name: CString,
    _dims: Box<[u32]>,
    /// A per-axis quantization's scales and offsets, which `tensor` points to.
    _scale_offsets: Box<[ScaleOffset]>,
}

fn describe(spec: &TensorSpec, kind: u32) -> Result<Described> {
    let name = CString::new(spec.name.as_str()).map_err(|_| refused("tensor", "a tensor name holds a NUL"))?;
    let bytes = spec.bytes().ok_or_else(|| refused("tensor", format!("tensor {} has no size", spec.name)))?;
    if u32::try_from(bytes).is_err() {
        return Err(refused("tensor", format!("tensor {} is 4 GiB or more", spec.name)));
    }
    let mut dims: Box<[u32]> = spec.dims.clone().into_boxed_slice();
    let mut scale_offsets: Box<[ScaleOffset]> = Box::new([]);
    let quantize_params = match &spec.quantization {
        Quantization::None => QuantizeParams::NONE,
        Quantization::PerTensor { scale, offset } => QuantizeParams::per_tensor(*scale, *offset),
        Quantization::PerAxis { axis, scale_offsets: so } => {
            let along = usize::try_from(*axis).ok().and_then(|a| spec.dims.get(a));
            if along != Some(&(so.len() as u32)) {
                return Err(refused(
                    "tensor",
                    format!("tensor {}: {} scales for axis {axis} of {:?}", spec.name, so.len(), spec.dims),
                ));
            }
            scale_offsets = so.iter().map(|&(scale, offset)| ScaleOffset { scale, offset }).collect();
            QuantizeParams::per_axis(*axis, &mut scale_offsets)
        }
    };
    let tensor = Tensor {
        version: TENSOR_VERSION_1,
        v: TensorVersions {
            v1: TensorV1 {
                id: 0,
                name: name.as_ptr(),
                tensor_type: kind,
                data_format: 0,
                data_type: spec.data_type,
                quantize_params,
                rank: dims.len() as u32,
                dimensions: dims.as_mut_ptr(),
                mem_type: TENSOR_MEM_RAW,
                memory: TensorMemory { client_buf: ClientBuffer { data: std::ptr::null_mut(), data_size: 0 } },
            },
        },
    };
    Ok(Described { spec: spec.clone(), tensor, _name: name, _dims: dims, _scale_offsets: scale_offsets })
}

/// Not `Sync`: a marker for the objects whose calls must not run concurrently.
type NotSync = PhantomData<std::cell::Cell<()>>;

/// A backend's handles, freed when the last [`Backend`], [`Context`] or [`Graph`] made from it
/// is dropped. It makes no call through a shared reference but the frees of its `Drop`.
struct BackendShared {
    /// The provider's function table, in `lib`'s memory.
    t: *const FunctionTable,
    backend: Handle,
    device: Handle,
    // Last: the table above points into it.
    lib: Arc<Library>,
}

// SAFETY: QNN handles may be used from any thread; nothing here is called through `&self` but
// the table lookup (read-only memory of the loaded library) and `Drop` runs once.
unsafe impl Send for BackendShared {}
// SAFETY: as above.
unsafe impl Sync for BackendShared {}

impl BackendShared {
    fn t(&self) -> &FunctionTable {
        // SAFETY: `t` points into the provider records of `lib`, which this struct keeps loaded
        // (and `Library` opens with RTLD_NODELETE).
        unsafe { &*self.t }
    }
}

impl Drop for BackendShared {
    fn drop(&mut self) {
        let t = self.t();
        // SAFETY: the handles were made by this backend, every context and graph made from it
        // is gone (each holds this struct), and each is freed once.
        unsafe {
            if !self.device.is_null() {
                if let Some(f) = t.device_free {
                    f(self.device);
                }
            }
            if !self.backend.is_null() {
                if let Some(f) = t.backend_free {
                    f(self.backend);
                }
            }
        }
    }
}

/// A QNN backend and its device, for one chip (`soc`: QNN's `Qnn_SocModel_t`, e.g. SM8650 = 57).
pub struct Backend {
    shared: Arc<BackendShared>,
    _not_sync: NotSync,
}

impl Backend {
    /// The HTP provider of `lib`, a backend and a device for `soc`.
    pub fn htp(lib: Arc<Library>, soc: u32) -> Result<Self> {
        let iface = lib
            .provider(BACKEND_ID_HTP)
            .ok_or_else(|| refused("QnnInterface_getProviders", "no HTP provider with core API 2.27 or newer"))?;
        let t: *const FunctionTable = &iface.table;
        let mut shared =
            BackendShared { t, backend: std::ptr::null_mut(), device: std::ptr::null_mut(), lib: Arc::clone(&lib) };
        let mut backend: Handle = std::ptr::null_mut();
        // SAFETY: a NULL logger and NULL config are allowed; `backend` is valid for a write.
        check(shared.t(), "backendCreate", unsafe {
            entry(shared.t().backend_create, "backendCreate")?(std::ptr::null_mut(), std::ptr::null(), &mut backend)
        })?;
        shared.backend = backend;
        let soc_cfg = HtpDeviceCustomConfig::soc(soc);
        let cfg = Config { option: CONFIG_OPTION_CUSTOM, value: &soc_cfg as *const HtpDeviceCustomConfig as *mut _ };
        let cfgs = [&cfg as *const Config, std::ptr::null()];
        let mut device: Handle = std::ptr::null_mut();
        // SAFETY: a NULL-terminated array of one config whose value outlives the call.
        check(shared.t(), "deviceCreate", unsafe {
            entry(shared.t().device_create, "deviceCreate")?(std::ptr::null_mut(), cfgs.as_ptr(), &mut device)
        })?;
        shared.device = device;
        Ok(Self { shared: Arc::new(shared), _not_sync: PhantomData })
    }

    fn t(&self) -> &FunctionTable {
        self.shared.t()
    }

    /// The library this backend was made from.
    pub fn library(&self) -> &Arc<Library> {
        &self.shared.lib
    }

    /// The library's build id (`backendGetBuildId`).
    pub fn build_id(&self) -> Result<String> {
        let mut id: *const c_char = std::ptr::null();
        // SAFETY: `id` is valid for a write; the library points it at a string it keeps.
        check(self.t(), "backendGetBuildId", unsafe {
            entry(self.t().backend_get_build_id, "backendGetBuildId")?(&mut id)
        })?;
        Ok(if id.is_null() {
            String::new()
        } else {
            // SAFETY: a NUL-terminated string owned by the library.
            unsafe { CStr::from_ptr(id) }.to_string_lossy().into_owned()
        })
    }

    /// A new, empty context.
    pub fn context(&self) -> Result<Context> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: live backend and device handles; NULL config; `handle` valid for a write.
        check(self.t(), "contextCreate", unsafe {
            entry(self.t().context_create, "contextCreate")?(
                self.shared.backend,
                self.shared.device,
                std::ptr::null(),
                &mut handle,
            )
        })?;
        Ok(Context::owning(&self.shared, handle))
    }

    /// A context made from a binary that [`Context::binary`] wrote.
    pub fn context_from_binary(&self, binary: &[u8]) -> Result<Context> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `binary` is readable for its length during the call (QNN copies what it
        // keeps); live handles; `handle` valid for a write.
        check(self.t(), "contextCreateFromBinary", unsafe {
            entry(self.t().context_create_from_binary, "contextCreateFromBinary")?(
                self.shared.backend,
                self.shared.device,
                std::ptr::null(),
                binary.as_ptr().cast(),
                binary.len() as u64,
                &mut handle,
                std::ptr::null_mut(),
            )
        })?;
        Ok(Context::owning(&self.shared, handle))
    }
}

/// A context's handle, freed when the last [`Context`] or [`Graph`] of it is dropped.
struct ContextShared {
    handle: Handle,
    // Last: freed after the context.
    backend: Arc<BackendShared>,
}

// SAFETY: as `BackendShared`: only `Drop` calls QNN, once.
unsafe impl Send for ContextShared {}
// SAFETY: as above.
unsafe impl Sync for ContextShared {}

impl ContextShared {
    fn t(&self) -> &FunctionTable {
        self.backend.t()
    }
}

impl Drop for ContextShared {
    fn drop(&mut self) {
        if let Some(f) = self.t().context_free {
            // SAFETY: made by this context's backend (kept alive by `backend`), freed once;
            // every graph of it holds this struct, so none is alive.
            unsafe { f(self.handle, std::ptr::null_mut()) };
        }
    }
}

/// A QNN context: the graphs built or loaded in it, and what its binary holds.
pub struct Context {
    shared: Arc<ContextShared>,
    _not_sync: NotSync,
}

impl Context {
    fn owning(backend: &Arc<BackendShared>, handle: Handle) -> Self {
        Self { shared: Arc::new(ContextShared { handle, backend: Arc::clone(backend) }), _not_sync: PhantomData }
    }

    fn t(&self) -> &FunctionTable {
        self.shared.t()
    }

    /// Starts a graph called `name`.
    pub fn graph(&self, name: &str) -> Result<GraphBuilder> {
        let cname = CString::new(name).map_err(|_| refused("graphCreate", "a graph name holds a NUL"))?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: live context; NUL-terminated name; NULL config; `handle` valid for a write.
        check(self.t(), "graphCreate", unsafe {
            entry(self.t().graph_create, "graphCreate")?(
                self.shared.handle,
                cname.as_ptr(),
                std::ptr::null(),
                &mut handle,
            )
        })?;
        Ok(GraphBuilder {
            context: Arc::clone(&self.shared),
            handle,
            tensors: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            _not_sync: PhantomData,
        })
    }

    /// The context as a binary (every graph in it finalized), for [`Backend::context_from_binary`].
    pub fn binary(&self) -> Result<Vec<u8>> {
        let mut size = 0u64;
        // SAFETY: live context; `size` valid for a write.
        check(self.t(), "contextGetBinarySize", unsafe {
            entry(self.t().context_get_binary_size, "contextGetBinarySize")?(self.shared.handle, &mut size)
        })?;
        let mut buf = vec![0u8; usize::try_from(size).map_err(|_| refused("contextGetBinarySize", "too large"))?];
        let mut written = 0u64;
        // SAFETY: `buf` is writable for `size` bytes; `written` valid for a write.
        check(self.t(), "contextGetBinary", unsafe {
            entry(self.t().context_get_binary, "contextGetBinary")?(
                self.shared.handle,
                buf.as_mut_ptr().cast(),
                size,
                &mut written,
            )
        })?;
        buf.truncate(written.min(size) as usize);
        Ok(buf)
    }

    /// A finalized graph of this context (made here or loaded with its binary), with the
    /// inputs and outputs `io` describes (as [`Graph::io`] gave them when it was built).
    pub fn retrieve(&self, name: &str, io: &GraphIo) -> Result<Graph> {
        let cname = CString::new(name).map_err(|_| refused("graphRetrieve", "a graph name holds a NUL"))?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: live context; NUL-terminated name; `handle` valid for a write.
        check(self.t(), "graphRetrieve", unsafe {
            entry(self.t().graph_retrieve, "graphRetrieve")?(self.shared.handle, cname.as_ptr(), &mut handle)
        })?;
        let with_ids = |v: &[(TensorSpec, u32)], kind: u32| -> Result<Vec<Described>> {
            v.iter()
                .map(|(spec, id)| {
                    let mut d = describe(spec, kind)?;
                    d.tensor.v.v1.id = *id;
                    Ok(d)
                })
                .collect()
        };
        Ok(Graph {
            context: Arc::clone(&self.shared),
            handle,
            inputs: with_ids(&io.inputs, tensor_type::APP_WRITE)?,
            outputs: with_ids(&io.outputs, tensor_type::APP_READ)?,
            _not_sync: PhantomData,
        })
    }
}

/// A tensor of a graph being built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorRef(usize);

/// A node's parameter.
pub enum ParamSpec<'a> {
    /// A scalar: `data_type` and its value's bits (as `Qnn_Scalar_t` holds them).
    Scalar { name: &'a str, data_type: u32, value: u64 },
    /// A static tensor parameter (`Conv2d`'s `stride`, ...) with its bytes.
    Tensor { name: &'a str, spec: TensorSpec, data: &'a [u8] },
}

/// A graph being built: tensors, then nodes in order, then [`Self::finalize`].
pub struct GraphBuilder {
    context: Arc<ContextShared>,
    handle: Handle,
    tensors: Vec<Described>,
    inputs: Vec<usize>,
    outputs: Vec<usize>,
    _not_sync: NotSync,
}

impl GraphBuilder {
    fn t(&self) -> &FunctionTable {
        self.context.t()
    }

    fn create(&mut self, spec: &TensorSpec, kind: u32, data: Option<&[u8]>) -> Result<TensorRef> {
        if self.tensors.iter().any(|d| d.spec.name == spec.name) {
            return Err(refused("tensorCreateGraphTensor", format!("a second tensor named {}", spec.name)));
        }
        let mut d = describe(spec, kind)?;
        if let Some(bytes) = data {
            if Some(bytes.len()) != spec.bytes() {
                return Err(refused(
                    "tensorCreateGraphTensor",
                    format!("tensor {} takes {:?} bytes, given {}", spec.name, spec.bytes(), bytes.len()),
                ));
            }
            // QNN copies a static tensor's data when it is created and never writes it (the
            // `*mut` is its API's).
            d.tensor.v.v1.memory.client_buf =
                ClientBuffer { data: bytes.as_ptr() as *mut _, data_size: bytes.len() as u32 };
        }
        // SAFETY: live graph; `d.tensor` points to its name, shape and (for static data) bytes,
        // all alive during the call; QNN writes the tensor's id into it.
        check(self.t(), "tensorCreateGraphTensor", unsafe {
            entry(self.t().tensor_create_graph_tensor, "tensorCreateGraphTensor")?(self.handle, &mut d.tensor)
        })?;
        d.tensor.v.v1.memory.client_buf = ClientBuffer { data: std::ptr::null_mut(), data_size: 0 };
        self.tensors.push(d);
        Ok(TensorRef(self.tensors.len() - 1))
    }

    /// A graph input (written by the application at each run).
    pub fn input(&mut self, spec: &TensorSpec) -> Result<TensorRef> {
        let r = self.create(spec, tensor_type::APP_WRITE, None)?;
        self.inputs.push(r.0);
        Ok(r)
    }

    /// A graph output (read by the application after each run).
    pub fn output(&mut self, spec: &TensorSpec) -> Result<TensorRef> {
        let r = self.create(spec, tensor_type::APP_READ, None)?;
        self.outputs.push(r.0);
        Ok(r)
    }

    /// An intermediate tensor between two nodes.
    pub fn intermediate(&mut self, spec: &TensorSpec) -> Result<TensorRef> {
        self.create(spec, tensor_type::NATIVE, None)
    }

    /// Constant data (weights, biases), copied by QNN now.
    pub fn constant(&mut self, spec: &TensorSpec, data: &[u8]) -> Result<TensorRef> {
        self.create(spec, tensor_type::STATIC, Some(data))
    }

    /// A node of op `type_name` (QNN's built-in package) reading `inputs` and writing `outputs`.
    pub fn node(
        &mut self,
        name: &str,
        type_name: &str,
        inputs: &[TensorRef],
        outputs: &[TensorRef],
        params: &[ParamSpec<'_>],
    ) -> Result<()> {
        let cname = CString::new(name).map_err(|_| refused("graphAddNode", "a node name holds a NUL"))?;
        let ctype = CString::new(type_name).map_err(|_| refused("graphAddNode", "an op name holds a NUL"))?;
        let pick = |r: &TensorRef| -> Result<Tensor> {
            self.tensors.get(r.0).map(|d| d.tensor).ok_or_else(|| refused("graphAddNode", "a tensor of another graph"))
        };
        let mut ins: Vec<Tensor> = inputs.iter().map(pick).collect::<Result<_>>()?;
        let mut outs: Vec<Tensor> = outputs.iter().map(pick).collect::<Result<_>>()?;
        // Parameters: names and tensor parameters live until the node is added.
        let mut names = Vec::new();
        let mut tensor_params = Vec::new();
        let mut qparams = Vec::new();
        for p in params {
            match p {
                ParamSpec::Scalar { name, data_type, value } => {
                    let n = CString::new(*name).map_err(|_| refused("graphAddNode", "a parameter name holds a NUL"))?;
                    qparams.push(Param {
                        param_type: PARAMTYPE_SCALAR,
                        name: n.as_ptr(),
                        value: ParamValue {
                            scalar: Scalar { data_type: *data_type, value: ScalarValue { u64: *value } },
                        },
                    });
                    names.push(n);
                }
                ParamSpec::Tensor { name, spec, data } => {
                    let n = CString::new(*name).map_err(|_| refused("graphAddNode", "a parameter name holds a NUL"))?;
                    // A tensor parameter is a static tensor of the graph, registered first.
                    let r = self.constant(spec, data)?;
                    tensor_params.push(r);
                    qparams.push(Param {
                        param_type: PARAMTYPE_TENSOR,
                        name: n.as_ptr(),
                        value: ParamValue { tensor: self.tensors[r.0].tensor },
                    });
                    names.push(n);
                }
            }
        }
        let op = OpConfig {
            version: OPCONFIG_VERSION_1,
            v1: OpConfigV1 {
                name: cname.as_ptr(),
                package_name: OP_PACKAGE_QTI_AISW.as_ptr(),
                type_name: ctype.as_ptr(),
                num_of_params: qparams.len() as u32,
                params: if qparams.is_empty() { std::ptr::null_mut() } else { qparams.as_mut_ptr() },
                num_of_inputs: ins.len() as u32,
                input_tensors: ins.as_mut_ptr(),
                num_of_outputs: outs.len() as u32,
                output_tensors: outs.as_mut_ptr(),
            },
        };
        // SAFETY: live graph; the op's strings, tensors and parameters are alive for the call
        // (QNN copies what it keeps); the tensors were created in this graph.
        check(self.t(), "graphAddNode", unsafe { entry(self.t().graph_add_node, "graphAddNode")?(self.handle, op) })
    }

    /// Finalizes the graph (QNN prepares it for the chip): it can run from now on.
    pub fn finalize(self) -> Result<Graph> {
        // SAFETY: live graph; NULL profile and signal are allowed.
        check(self.t(), "graphFinalize", unsafe {
            entry(self.t().graph_finalize, "graphFinalize")?(self.handle, std::ptr::null_mut(), std::ptr::null_mut())
        })?;
        let GraphBuilder { context, handle, mut tensors, inputs, outputs, .. } = self;
        // Keep the inputs' and outputs' descriptions; the rest are QNN's now.
        let mut take = |idx: &[usize]| -> Vec<Described> {
            idx.iter().map(|&i| std::mem::replace(&mut tensors[i], placeholder())).collect()
        };
        let inputs = take(&inputs);
        let outputs = take(&outputs);
        Ok(Graph { context, handle, inputs, outputs, _not_sync: PhantomData })
    }
}

fn placeholder() -> Described {
    Described {
        spec: TensorSpec::new("", &[], data_type::UNDEFINED, Quantization::None),
        tensor: Tensor { version: 0, v: TensorVersions { v1: empty_v1() } },
        _name: CString::default(),
        _dims: Box::new([]),
        _scale_offsets: Box::new([]),
    }
}

fn empty_v1() -> TensorV1 {
    TensorV1 {
        id: 0,
        name: std::ptr::null(),
        tensor_type: 0,
        data_format: 0,
        data_type: data_type::UNDEFINED,
        quantize_params: QuantizeParams::NONE,
        rank: 0,
        dimensions: std::ptr::null_mut(),
        mem_type: TENSOR_MEM_RAW,
        memory: TensorMemory { client_buf: ClientBuffer { data: std::ptr::null_mut(), data_size: 0 } },
    }
}

/// A graph's inputs and outputs with QNN's ids for them, to run it again after its context is
/// loaded from a binary.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphIo {
    pub inputs: Vec<(TensorSpec, u32)>,
    pub outputs: Vec<(TensorSpec, u32)>,
}

/// A finalized graph.
/// A finalized graph (it keeps its context, and so its backend, alive).
pub struct Graph {
    context: Arc<ContextShared>,
    handle: Handle,
    inputs: Vec<Described>,
    outputs: Vec<Described>,
    _not_sync: NotSync,
}

// SAFETY: QNN handles may be used from any thread; `Graph` is not `Sync` and `execute` takes
// `&mut self`, so one graph never runs two executions at once from safe code. The tensor
// descriptions' pointers point into boxes the graph owns.
unsafe impl Send for Graph {}

impl Graph {
    fn t(&self) -> &FunctionTable {
        self.context.t()
    }

    /// The modelled duration of this graph's last execution and of all of them, in
    /// nanoseconds — what a phone's NPU would take, from measured figures — if its library is
    /// llmd's emulator provider (`None` for Qualcomm's library, which runs for real).
    pub fn modelled_ns(&self) -> Option<(u64, u64)> {
        let f = self.context.backend.lib.modelled?;
        let (mut last, mut total) = (0u64, 0u64);
        // SAFETY: a live graph of a provider of this library; both out-pointers are valid for
        // writes.
        let code = unsafe { f(self.handle, &mut last, &mut total) };
        (code == QNN_SUCCESS).then_some((last, total))
    }

    /// Its inputs and outputs, with QNN's ids.
    pub fn io(&self) -> GraphIo {
        let id = |d: &Described| {
            // SAFETY: every description here was made as version 1, so `v1` is the field set.
            unsafe { d.tensor.v.v1.id }
        };
        GraphIo {
            inputs: self.inputs.iter().map(|d| (d.spec.clone(), id(d))).collect(),
            outputs: self.outputs.iter().map(|d| (d.spec.clone(), id(d))).collect(),
        }
    }

    /// Runs the graph: `inputs` and `outputs` in the order they were declared, each exactly its
    /// tensor's size in bytes.
    pub fn execute(&mut self, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<()> {
        if inputs.len() != self.inputs.len() || outputs.len() != self.outputs.len() {
            return Err(refused(
                "graphExecute",
                format!(
                    "the graph has {} inputs and {} outputs, given {} and {}",
                    self.inputs.len(),
                    self.outputs.len(),
                    inputs.len(),
                    outputs.len()
                ),
            ));
        }
        let mut ins = Vec::with_capacity(inputs.len());
        for (d, buf) in self.inputs.iter().zip(inputs) {
            if Some(buf.len()) != d.spec.bytes() {
                return Err(refused(
                    "graphExecute",
                    format!("input {} takes {:?} bytes, given {}", d.spec.name, d.spec.bytes(), buf.len()),
                ));
            }
            let mut t = d.tensor;
            // QNN reads an input's buffer; the cast to *mut is its API's, it does not write.
            t.v.v1.memory.client_buf = ClientBuffer { data: buf.as_ptr() as *mut _, data_size: buf.len() as u32 };
            ins.push(t);
        }
        let mut outs = Vec::with_capacity(outputs.len());
        for (d, buf) in self.outputs.iter().zip(outputs.iter_mut()) {
            if Some(buf.len()) != d.spec.bytes() {
                return Err(refused(
                    "graphExecute",
                    format!("output {} takes {:?} bytes, given {}", d.spec.name, d.spec.bytes(), buf.len()),
                ));
            }
            let mut t = d.tensor;
            t.v.v1.memory.client_buf = ClientBuffer { data: buf.as_mut_ptr().cast(), data_size: buf.len() as u32 };
            outs.push(t);
        }
        // SAFETY: live, finalized graph; every tensor points to a buffer of exactly its size,
        // alive and (outputs) exclusively borrowed for the call, which is synchronous.
        check(self.t(), "graphExecute", unsafe {
            entry(self.t().graph_execute, "graphExecute")?(
                self.handle,
                ins.as_ptr(),
                ins.len() as u32,
                outs.as_mut_ptr(),
                outs.len() as u32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })
    }
}
