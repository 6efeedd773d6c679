//! `libllmd_qnn_emu.so`: llmd's emulator of a QNN HTP backend, a library with the same C ABI as
//! Qualcomm's `libQnnHtp.so` (`QnnInterface_getProviders` and the core API 2.27 function table,
//! declared in `qnn-sys`), for fast tests and for hosts without Qualcomm's library.
//!
//! What it emulates (the NPU path's needs, no more):
//! - **W8A8 `FullyConnected` graphs** with exact integer arithmetic and ideal rounding
//!   ([`emu`]'s `fully_connected`: the same definition as the engine's reference, bit for bit):
//!   uint8 input and uint8 or uint16 output with one scale and offset each, int8 weights per tensor or per output
//!   channel, optional int32 bias at the input's scale times the weight's.
//! - **fp16 `FullyConnected` graphs** (HeteroLLM's float matmuls): fp16 input and weight, fp16
//!   or fp32 output, optional float bias; products in f32 summed in eight lanes
//!   ([`emu::dot_f16_lanes`], the definition), rounded to the output type.
//! - **What an NPU refuses**: fp32 inputs on a FullyConnected,
//!   ops it does not emulate, new tensors or nodes after finalize, a tensor at execute whose
//!   shape or type differs from the one finalized (shapes are static), graphs past the
//!   addressable-memory cap of a backend (`LLMD_QNN_EMU_MEMORY_MB`, 3.5 GiB by default).
//! - **Context binaries** of its own layout (magic, version, chip, graphs, CRC-32), refused
//!   when truncated, corrupt, of another version or for another chip.
//! - **A failing device** for tests: `LLMD_QNN_EMU_FAIL_AFTER=N` fails every execution after the
//!   process's first `N`.
//! - **A modelled duration** for each execution, from the Snapdragon 8 Gen 3's measured figures
//!   (`emu::cost`), read with [`LlmdQnnEmu_graphModelledNanos`]: what the phone would take,
//!   labelled as modelled wherever it is shown.
//!
//! The provider reports backend id 6 (HTP), name `LLMD_HTP_EMULATOR`, core API 2.27.0 (the
//! table it fills is exactly that version's) and backend API 0.1.0.
//!
//! This is a `*-sys` crate: the C ABI needs `unsafe` (each block with its `// SAFETY:`); the
//! emulator behind it ([`emu`]) is safe Rust.

pub mod emu;

use emu::{EmuError, IoTensor, Node, Quant, TensorDesc};
use qnn_sys::{
    quantization, tensor_type, ApiVersion, Config, ErrorHandle, FunctionTable, Handle, HtpDeviceCustomConfig,
    Interface, InterfaceHead, OpConfig, Param, Tensor, Version, BACKEND_ID_HTP, PARAMTYPE_SCALAR, QNN_SUCCESS,
};
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

/// The file name of this crate's cdylib, the library QNN clients load.
pub const LIBRARY_FILE: &str = "libllmd_qnn_emu.so";

/// Where cargo put this crate's cdylib for the running test binary: in its `deps/` directory
/// (when the emulator is a dependency of the package under test) or the profile directory
/// above it (its own tests). For tests that load the emulator as a QNN library.
pub fn built_library() -> Result<std::path::PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("the test's own path: {e}"))?;
    let deps = exe.parent().ok_or("the test binary has no directory")?;
    [deps.join(LIBRARY_FILE), deps.join("..").join(LIBRARY_FILE)]
        .into_iter()
        .find(|p| p.exists())
        .ok_or_else(|| format!("{LIBRARY_FILE} is not built beside {}", deps.display()))
}

/// The provider's name.
pub const PROVIDER_NAME: &CStr = c"LLMD_HTP_EMULATOR";
/// The core API version whose table the provider fills.
pub const CORE_API: Version = Version { major: 2, minor: 27, patch: 0 };
/// Environment variable: the core API version the provider announces instead of
/// [`CORE_API`] ("MAJOR.MINOR[.PATCH]"; its table stays 2.27's), to check that a client refuses
/// a library of an SDK older than it supports, as Qualcomm's of that SDK would announce.
pub const CORE_API_ENV: &str = "LLMD_QNN_EMU_CORE_API";

/// The core API version announced: [`CORE_API`] unless [`CORE_API_ENV`] names a valid one.
fn announced_core_api() -> Version {
    static V: OnceLock<Version> = OnceLock::new();
    *V.get_or_init(|| std::env::var(CORE_API_ENV).ok().and_then(|v| parse_version(&v)).unwrap_or(CORE_API))
}

/// "2.20" or "2.20.1" as a version.
pub fn parse_version(v: &str) -> Option<Version> {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u32>().ok());
    let (major, minor) = (parts.next()??, parts.next()??);
    let patch = match parts.next() {
        Some(p) => p?,
        None => 0,
    };
    parts.next().is_none().then_some(Version { major, minor, patch })
}

/// The emulator's own "backend API" version.
pub const BACKEND_API: Version = Version { major: 0, minor: 1, patch: 0 };

struct Provider {
    interface: Interface,
    list: [*const InterfaceHead; 1],
}

// SAFETY: the provider record is built once and never written again; its pointers are to
// 'static strings and to the record itself.
unsafe impl Sync for Provider {}
// SAFETY: as above.
unsafe impl Send for Provider {}

static PROVIDER: OnceLock<Box<Provider>> = OnceLock::new();

fn provider() -> &'static Provider {
    PROVIDER.get_or_init(|| {
        let table = FunctionTable {
            backend_create: Some(backend_create),
            backend_get_api_version: Some(backend_get_api_version),
            backend_get_build_id: Some(backend_get_build_id),
            backend_free: Some(backend_free),
            context_create: Some(context_create),
            context_get_binary_size: Some(context_get_binary_size),
            context_get_binary: Some(context_get_binary),
            context_create_from_binary: Some(context_create_from_binary),
            context_free: Some(context_free),
            graph_create: Some(graph_create),
            graph_add_node: Some(graph_add_node),
            graph_finalize: Some(graph_finalize),
            graph_retrieve: Some(graph_retrieve),
            graph_execute: Some(graph_execute),
            tensor_create_graph_tensor: Some(tensor_create_graph_tensor),
            log_create: Some(log_create),
            log_free: Some(log_free),
            device_create: Some(device_create),
            device_free: Some(device_free),
            error_get_message: Some(error_get_message),
            ..FunctionTable::default()
        };
        let mut p = Box::new(Provider {
            interface: Interface {
                head: InterfaceHead {
                    backend_id: BACKEND_ID_HTP,
                    provider_name: PROVIDER_NAME.as_ptr(),
                    api_version: ApiVersion { core: announced_core_api(), backend: BACKEND_API },
                },
                table,
            },
            list: [std::ptr::null()],
        });
        p.list[0] = &p.interface.head;
        p
    })
}

/// QNN's entry point: one provider.
///
/// # Safety
/// `list` and `count` must be valid for writes (or NULL, which is refused).
#[no_mangle]
pub unsafe extern "C" fn QnnInterface_getProviders(
    list: *mut *mut *const InterfaceHead,
    count: *mut u32,
) -> ErrorHandle {
    if list.is_null() || count.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    let p = provider();
    // SAFETY: both pointers were checked non-null and the caller passes them for writes; the
    // list handed out is the provider's own 'static array, which the caller only reads.
    unsafe {
        *list = p.list.as_ptr() as *mut *const InterfaceHead;
        *count = 1;
    }
    QNN_SUCCESS
}

/// The modelled duration, in nanoseconds, of `graph`'s last execution and of all of them (what a
/// Snapdragon 8 Gen 3's NPU would take: `emu::cost`). Not part of QNN: llmd looks it up by name.
///
/// # Safety
/// `last` and `total` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn LlmdQnnEmu_graphModelledNanos(graph: Handle, last: *mut u64, total: *mut u64) -> ErrorHandle {
    if last.is_null() || total.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    match emu::modelled_ns(graph as u64) {
        Ok((l, t)) => {
            // SAFETY: checked non-null; the caller passes them for writes.
            unsafe {
                *last = l;
                *total = t;
            }
            QNN_SUCCESS
        }
        Err(e) => fail(e),
    }
}

// --- Errors ----------------------------------------------------------------------------------

/// The last message of each error code, for `errorGetMessage` (kept alive for the caller).
static MESSAGES: Mutex<Vec<(u64, CString)>> = Mutex::new(Vec::new());

fn fail(e: EmuError) -> ErrorHandle {
    let msg = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
    let mut m = MESSAGES.lock().unwrap_or_else(|p| p.into_inner());
    // The newest message of a code replaces the older one; the older string is kept (a caller
    // may still hold it), so the list grows by at most one entry per message.
    m.push((e.code, msg));
    if m.len() > 256 {
        m.drain(..128);
    }
    e.code
}

unsafe extern "C" fn error_get_message(error: ErrorHandle, message: *mut *const c_char) -> ErrorHandle {
    if message.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    let m = MESSAGES.lock().unwrap_or_else(|p| p.into_inner());
    let text = m.iter().rev().find(|(c, _)| *c == error & 0xFFFF).map_or(c"".as_ptr(), |(_, s)| s.as_ptr());
    // SAFETY: checked non-null. The string stays allocated: entries are only dropped 128 at a
    // time after 256 more failures, long after a caller reads its message.
    unsafe { *message = text };
    QNN_SUCCESS
}

fn done(r: Result<(), EmuError>) -> ErrorHandle {
    match r {
        Ok(()) => QNN_SUCCESS,
        Err(e) => fail(e),
    }
}

/// Writes a new object's id as its handle.
///
/// # Safety
/// `out` must be NULL or valid for a write.
unsafe fn hand_out(r: Result<u64, EmuError>, out: *mut Handle) -> ErrorHandle {
    if out.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    match r {
        Ok(id) => {
            // SAFETY: checked non-null; valid for a write by the caller's contract.
            unsafe { *out = id as Handle };
            QNN_SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// A NUL-terminated string from the caller, as Rust text.
///
/// # Safety
/// `s` must be NULL or point to a NUL-terminated string.
unsafe fn text(s: *const c_char) -> Result<String, EmuError> {
    if s.is_null() {
        return Err(EmuError { code: emu::code::INVALID_ARGUMENT, message: "a NULL name".into() });
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    Ok(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

// --- Backend, device, log --------------------------------------------------------------------

unsafe extern "C" fn backend_create(_log: Handle, _config: *const *const Config, backend: *mut Handle) -> ErrorHandle {
    // SAFETY: `backend` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(emu::backend_create(), backend) }
}

unsafe extern "C" fn backend_get_api_version(version: *mut ApiVersion) -> ErrorHandle {
    if version.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller passes it for a write.
    unsafe { *version = ApiVersion { core: announced_core_api(), backend: BACKEND_API } };
    QNN_SUCCESS
}

static BUILD_ID: OnceLock<CString> = OnceLock::new();

unsafe extern "C" fn backend_get_build_id(id: *mut *const c_char) -> ErrorHandle {
    if id.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    let s = BUILD_ID
        .get_or_init(|| CString::new(format!("llmd-qnn-emu {}", env!("CARGO_PKG_VERSION"))).unwrap_or_default());
    // SAFETY: checked non-null; the string is 'static.
    unsafe { *id = s.as_ptr() };
    QNN_SUCCESS
}

unsafe extern "C" fn backend_free(backend: Handle) -> ErrorHandle {
    done(emu::backend_free(backend as u64))
}

unsafe extern "C" fn device_create(_log: Handle, config: *const *const Config, device: *mut Handle) -> ErrorHandle {
    // The one option read: the HTP custom config's SoC model.
    let mut soc = None;
    if !config.is_null() {
        for i in 0.. {
            // SAFETY: `config` is a NULL-terminated array of config pointers (QNN's contract).
            let c = unsafe { *config.add(i) };
            if c.is_null() {
                break;
            }
            // SAFETY: a non-null entry points to a config; a custom one's value to the HTP
            // device custom config, whose first field is the option.
            let cfg = unsafe { &*c };
            if cfg.option == qnn_sys::CONFIG_OPTION_CUSTOM && !cfg.value.is_null() {
                // SAFETY: the custom value is an `HtpDeviceCustomConfig` for the HTP backend.
                let custom = unsafe { &*(cfg.value as *const HtpDeviceCustomConfig) };
                if custom.option == 0 {
                    soc = Some(custom.value[0] as u32);
                }
            }
        }
    }
    // SAFETY: `device` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(emu::device_create(soc), device) }
}

unsafe extern "C" fn device_free(device: Handle) -> ErrorHandle {
    done(emu::device_free(device as u64))
}

unsafe extern "C" fn log_create(
    _callback: Option<unsafe extern "C" fn(*const c_char, u32, u64, *mut c_void)>,
    _max_level: u32,
    log: *mut Handle,
) -> ErrorHandle {
    // SAFETY: `log` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(emu::log_create(), log) }
}

unsafe extern "C" fn log_free(log: Handle) -> ErrorHandle {
    done(emu::log_free(log as u64))
}

// --- Contexts --------------------------------------------------------------------------------

unsafe extern "C" fn context_create(
    backend: Handle,
    device: Handle,
    _config: *const *const Config,
    context: *mut Handle,
) -> ErrorHandle {
    // SAFETY: `context` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(emu::context_create(backend as u64, device as u64), context) }
}

unsafe extern "C" fn context_free(context: Handle, _profile: Handle) -> ErrorHandle {
    done(emu::context_free(context as u64))
}

unsafe extern "C" fn context_get_binary_size(context: Handle, size: *mut u64) -> ErrorHandle {
    if size.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    match emu::context_binary(context as u64) {
        Ok(b) => {
            // SAFETY: checked non-null.
            unsafe { *size = b.len() as u64 };
            QNN_SUCCESS
        }
        Err(e) => fail(e),
    }
}

unsafe extern "C" fn context_get_binary(
    context: Handle,
    buf: *mut c_void,
    size: u64,
    written: *mut u64,
) -> ErrorHandle {
    if buf.is_null() || written.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    match emu::context_binary(context as u64) {
        Ok(b) if b.len() as u64 <= size => {
            // SAFETY: `buf` holds `size` writable bytes (the caller's contract), at least `b.len()`.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), buf.cast::<u8>(), b.len());
                *written = b.len() as u64;
            }
            QNN_SUCCESS
        }
        Ok(b) => fail(EmuError {
            code: emu::code::INVALID_ARGUMENT,
            message: format!("the binary takes {} bytes, the buffer {size}", b.len()),
        }),
        Err(e) => fail(e),
    }
}

unsafe extern "C" fn context_create_from_binary(
    backend: Handle,
    device: Handle,
    _config: *const *const Config,
    binary: *const c_void,
    size: u64,
    context: *mut Handle,
    _profile: Handle,
) -> ErrorHandle {
    if binary.is_null() {
        return emu::code::INVALID_ARGUMENT;
    }
    // SAFETY: `binary` points to `size` readable bytes (the caller's contract).
    let bytes = unsafe { std::slice::from_raw_parts(binary.cast::<u8>(), size as usize) };
    // SAFETY: `context` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(emu::context_from_binary(backend as u64, device as u64, bytes), context) }
}

// --- Graphs ----------------------------------------------------------------------------------

unsafe extern "C" fn graph_create(
    context: Handle,
    name: *const c_char,
    _config: *const *const Config,
    graph: *mut Handle,
) -> ErrorHandle {
    // SAFETY: `name` is a NUL-terminated string (QNN's contract).
    let r = unsafe { text(name) }.and_then(|n| emu::graph_create(context as u64, &n));
    // SAFETY: `graph` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(r, graph) }
}

unsafe extern "C" fn graph_retrieve(context: Handle, name: *const c_char, graph: *mut Handle) -> ErrorHandle {
    // SAFETY: `name` is a NUL-terminated string (QNN's contract).
    let r = unsafe { text(name) }.and_then(|n| emu::graph_retrieve(context as u64, &n));
    // SAFETY: `graph` is the caller's out-pointer (checked in `hand_out`).
    unsafe { hand_out(r, graph) }
}

unsafe extern "C" fn graph_finalize(graph: Handle, _profile: Handle, _signal: Handle) -> ErrorHandle {
    done(emu::graph_finalize(graph as u64))
}

/// The fields of a caller's tensor the emulator reads (version 1, or the version-1 part of
/// version 2), without its data.
///
/// # Safety
/// `t` must point to a valid `Qnn_Tensor_t` whose name, dimensions and quantization arrays are
/// readable.
unsafe fn describe(t: *const Tensor) -> Result<TensorDesc, EmuError> {
    let bad = |m: &str| EmuError { code: emu::code::GRAPH_INVALID_TENSOR, message: m.into() };
    if t.is_null() {
        return Err(bad("a NULL tensor"));
    }
    // SAFETY: non-null and valid by the caller's contract.
    let t = unsafe { &*t };
    if t.version != 1 && t.version != 2 {
        return Err(bad("an unknown tensor version"));
    }
    // SAFETY: versions 1 and 2 both start with the version-1 fields.
    let v1 = unsafe { t.v.v1 };
    let name = if v1.name.is_null() {
        String::new()
    } else {
        // SAFETY: a non-null name is NUL-terminated (QNN's contract).
        unsafe { CStr::from_ptr(v1.name) }.to_string_lossy().into_owned()
    };
    if v1.rank > 8 || (v1.rank > 0 && v1.dimensions.is_null()) {
        return Err(bad("a tensor's rank is over 8 or its dimensions are missing"));
    }
    let dims = if v1.rank == 0 {
        Vec::new()
    } else {
        // SAFETY: `rank` dimensions are readable (QNN's contract); checked non-null above.
        unsafe { std::slice::from_raw_parts(v1.dimensions, v1.rank as usize) }.to_vec()
    };
    let q = v1.quantize_params;
    let quant = if q.encoding_definition != quantization::DEFINED {
        Quant::None
    } else {
        match q.quantization_encoding {
            quantization::SCALE_OFFSET => {
                // SAFETY: the encoding says which union member is set.
                let so = unsafe { q.encoding.scale_offset };
                Quant::PerTensor { scale: so.scale, offset: so.offset }
            }
            quantization::AXIS_SCALE_OFFSET => {
                // SAFETY: the encoding says which union member is set.
                let a = unsafe { q.encoding.axis_scale_offset };
                if a.num_scale_offsets > 0 && a.scale_offset.is_null() {
                    return Err(bad("per-axis quantization without its scales"));
                }
                let so = if a.num_scale_offsets == 0 {
                    Vec::new()
                } else {
                    // SAFETY: `num_scale_offsets` entries are readable (QNN's contract).
                    unsafe { std::slice::from_raw_parts(a.scale_offset, a.num_scale_offsets as usize) }
                        .iter()
                        .map(|s| (s.scale, s.offset))
                        .collect()
                };
                Quant::PerAxis { axis: a.axis, scale_offsets: so }
            }
            e => {
                return Err(EmuError {
                    code: emu::code::NOT_SUPPORTED,
                    message: format!("quantization encoding {e} is not emulated"),
                })
            }
        }
    };
    Ok(TensorDesc { id: v1.id, name, kind: v1.tensor_type, data_type: v1.data_type, quant, dims, data: None })
}

/// A tensor's client buffer.
///
/// # Safety
/// As [`describe`]; its client buffer, if set, holds `data_size` readable bytes.
unsafe fn client_bytes<'a>(t: *const Tensor) -> Result<&'a [u8], EmuError> {
    // SAFETY: `t` was checked by `describe` before this is called.
    let v1 = unsafe { (*t).v.v1 };
    if v1.mem_type != qnn_sys::TENSOR_MEM_RAW {
        return Err(EmuError {
            code: emu::code::NOT_SUPPORTED,
            message: "only client buffers are emulated (no registered memory)".into(),
        });
    }
    // SAFETY: a raw tensor's memory is its client buffer.
    let buf = unsafe { v1.memory.client_buf };
    if buf.data.is_null() {
        return Ok(&[]);
    }
    // SAFETY: `data_size` bytes at `data` are readable (QNN's contract).
    Ok(unsafe { std::slice::from_raw_parts(buf.data.cast::<u8>(), buf.data_size as usize) })
}

unsafe extern "C" fn tensor_create_graph_tensor(graph: Handle, tensor: *mut Tensor) -> ErrorHandle {
    // SAFETY: `tensor` is a valid tensor description (QNN's contract).
    let desc = unsafe { describe(tensor) };
    let r = desc.and_then(|mut d| {
        if d.kind == tensor_type::STATIC {
            // SAFETY: as above; a static tensor's client buffer holds its data.
            d.data = Some(unsafe { client_bytes(tensor) }?.to_vec());
        }
        emu::tensor_create(graph as u64, d)
    });
    match r {
        Ok(id) => {
            // SAFETY: `tensor` is valid and writable (QNN writes the id back into it); versions 1
            // and 2 both hold `id` in their version-1 part.
            unsafe { (*tensor).v.v1.id = id };
            QNN_SUCCESS
        }
        Err(e) => fail(e),
    }
}

unsafe extern "C" fn graph_add_node(graph: Handle, op: OpConfig) -> ErrorHandle {
    let r = (|| {
        if op.version != 1 {
            return Err(EmuError {
                code: emu::code::GRAPH_INVALID_OP_CONFIG,
                message: "an unknown op config version".into(),
            });
        }
        let v = op.v1;
        // SAFETY: the op's strings are NUL-terminated (QNN's contract).
        let (name, package, type_name) = unsafe { (text(v.name)?, text(v.package_name)?, text(v.type_name)?) };
        if package != "qti.aisw" {
            return Err(EmuError {
                code: emu::code::GRAPH_INVALID_OP_CONFIG,
                message: format!("op package {package} is not emulated"),
            });
        }
        let ids = |ptr: *mut Tensor, n: u32| -> Result<Vec<u32>, EmuError> {
            if n > 0 && ptr.is_null() {
                return Err(EmuError {
                    code: emu::code::GRAPH_INVALID_OP_CONFIG,
                    message: "a NULL tensor list".into(),
                });
            }
            // SAFETY: `n` tensors are readable at `ptr` (QNN's contract); each is described.
            (0..n as usize).map(|i| unsafe { describe(ptr.add(i)) }.map(|d| d.id)).collect()
        };
        let inputs = ids(v.input_tensors, v.num_of_inputs)?;
        let outputs = ids(v.output_tensors, v.num_of_outputs)?;
        if v.num_of_params > 0 && v.params.is_null() {
            return Err(EmuError { code: emu::code::GRAPH_INVALID_OP_CONFIG, message: "a NULL parameter list".into() });
        }
        let mut params = Vec::new();
        for i in 0..v.num_of_params as usize {
            // SAFETY: `num_of_params` params are readable (QNN's contract).
            let p: Param = unsafe { *v.params.add(i) };
            // SAFETY: a parameter's name is NUL-terminated.
            let pname = unsafe { text(p.name)? };
            if p.param_type != PARAMTYPE_SCALAR {
                return Err(EmuError {
                    code: emu::code::GRAPH_INVALID_OP_CONFIG,
                    message: format!("tensor parameter {pname} is not emulated"),
                });
            }
            // SAFETY: a scalar parameter's value is its scalar; the member read is the one its
            // data type names (every member is plain bits).
            let value = unsafe {
                let sc = p.value.scalar;
                match sc.data_type & 0xFF {
                    0x08 => u64::from(sc.value.u8),
                    0x16 => u64::from(sc.value.u32 & 0xFFFF),
                    0x32 => u64::from(sc.value.u32),
                    _ => sc.value.u64,
                }
            };
            params.push((pname, value));
        }
        emu::node_add(graph as u64, Node { name, op: type_name, inputs, outputs }, &params)
    })();
    done(r)
}

unsafe extern "C" fn graph_execute(
    graph: Handle,
    inputs: *const Tensor,
    num_inputs: u32,
    outputs: *mut Tensor,
    num_outputs: u32,
    _profile: Handle,
    _signal: Handle,
) -> ErrorHandle {
    let r = (|| {
        if (num_inputs > 0 && inputs.is_null()) || (num_outputs > 0 && outputs.is_null()) {
            return Err(EmuError { code: emu::code::INVALID_ARGUMENT, message: "a NULL tensor list".into() });
        }
        let io = |ptr: *const Tensor, i: usize| -> Result<IoTensor<'_>, EmuError> {
            // SAFETY: `i` is below the list's length, whose tensors are valid (QNN's contract).
            let t = unsafe { ptr.add(i) };
            // SAFETY: as above.
            let d = unsafe { describe(t) }?;
            // SAFETY: as above; the client buffer holds `data_size` bytes.
            let data = unsafe { client_bytes(t) }?;
            Ok(IoTensor { id: d.id, dims: d.dims, data_type: d.data_type, data })
        };
        let ins = (0..num_inputs as usize).map(|i| io(inputs, i)).collect::<Result<Vec<_>, _>>()?;
        let outs = (0..num_outputs as usize).map(|i| io(outputs, i)).collect::<Result<Vec<_>, _>>()?;
        let results = emu::graph_execute(graph as u64, &ins, &outs)?;
        drop(outs);
        for (i, bytes) in results.iter().enumerate() {
            // SAFETY: output `i` was described above (a raw client buffer); the slices read from
            // the buffers are dropped, and the copy is bounded by the buffer's own size.
            unsafe {
                let buf = (*outputs.add(i)).v.v1.memory.client_buf;
                if buf.data.is_null() || bytes.len() > buf.data_size as usize {
                    return Err(EmuError {
                        code: emu::code::GRAPH_INVALID_TENSOR,
                        message: format!("output {i}'s buffer is too small"),
                    });
                }
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.data.cast::<u8>(), bytes.len());
            }
        }
        Ok(())
    })();
    done(r)
}
