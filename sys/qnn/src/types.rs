//! QNN's C types as far as llmd uses them, declared from the public API documentation. Every
//! enum is a 4-byte C enum (here `u32` constants); every size and offset that the ABI fixes is
//! asserted at compile time (LP64: x86-64 and aarch64).

use std::ffi::{c_char, c_void};

/// `Qnn_ErrorHandle_t`: 0 is success; the low 16 bits are the error code.
pub type ErrorHandle = u64;
/// `QNN_SUCCESS`.
pub const QNN_SUCCESS: ErrorHandle = 0;

/// `Qnn_Version_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// `Qnn_ApiVersion_t`: the core API's version and the backend API's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiVersion {
    pub core: Version,
    pub backend: Version,
}

/// A QNN handle (backend, device, context, graph, log, profile, signal, memory): opaque, never
/// dereferenced (a device handle may be the value 1).
pub type Handle = *mut c_void;

/// `Qnn_DataType_t` values (the low byte is the bit width written in decimal, read as hex).
pub mod data_type {
    pub const INT_8: u32 = 0x0008;
    pub const INT_16: u32 = 0x0016;
    pub const INT_32: u32 = 0x0032;
    pub const UINT_8: u32 = 0x0108;
    pub const UINT_16: u32 = 0x0116;
    pub const UINT_32: u32 = 0x0132;
    pub const FLOAT_16: u32 = 0x0216;
    pub const FLOAT_32: u32 = 0x0232;
    pub const SFIXED_POINT_8: u32 = 0x0308;
    pub const SFIXED_POINT_16: u32 = 0x0316;
    pub const SFIXED_POINT_32: u32 = 0x0332;
    pub const UFIXED_POINT_8: u32 = 0x0408;
    pub const UFIXED_POINT_16: u32 = 0x0416;
    pub const BOOL_8: u32 = 0x0508;
    pub const UNDEFINED: u32 = 0x7FFF_FFFF;

    /// Bytes one element of `data_type` takes (its bit width is its low byte written in
    /// decimal: 0x08, 0x16, 0x32, 0x64), None for a width that is not a whole number of bytes.
    pub fn element_bytes(data_type: u32) -> Option<usize> {
        let low = data_type & 0xFF;
        let bits = (low >> 4) * 10 + (low & 0xF);
        matches!(bits, 8 | 16 | 32 | 64).then_some(bits as usize / 8)
    }
}

/// `Qnn_TensorType_t` values.
pub mod tensor_type {
    /// A graph input the application writes.
    pub const APP_WRITE: u32 = 0;
    /// A graph output the application reads.
    pub const APP_READ: u32 = 1;
    pub const APP_READWRITE: u32 = 2;
    /// An intermediate tensor inside the graph.
    pub const NATIVE: u32 = 3;
    /// Constant data (weights), copied by QNN when the tensor is created.
    pub const STATIC: u32 = 4;
}

/// `Qnn_QuantizationEncoding_t` and `Qnn_Definition_t` values.
pub mod quantization {
    pub const SCALE_OFFSET: u32 = 0;
    pub const AXIS_SCALE_OFFSET: u32 = 1;
    pub const BW_SCALE_OFFSET: u32 = 2;
    pub const BW_AXIS_SCALE_OFFSET: u32 = 3;
    pub const UNDEFINED: u32 = 0x7FFF_FFFF;
    /// `QNN_DEFINITION_DEFINED`: the parameters are the application's.
    pub const DEFINED: u32 = 1;
    pub const DEFINITION_UNDEFINED: u32 = 0x7FFF_FFFF;
}

/// `Qnn_TensorMemType_t`: `RAW` (a client buffer) or `MEMHANDLE` (registered memory).
pub const TENSOR_MEM_RAW: u32 = 0;
pub const TENSOR_MEM_MEMHANDLE: u32 = 1;
/// `Qnn_TensorVersion_t`.
pub const TENSOR_VERSION_1: u32 = 1;
/// `Qnn_OpConfigVersion_t`.
pub const OPCONFIG_VERSION_1: u32 = 1;
/// `Qnn_ParamType_t`.
pub const PARAMTYPE_SCALAR: u32 = 0;
pub const PARAMTYPE_TENSOR: u32 = 1;
/// `QNN_OP_PACKAGE_NAME_QTI_AISW`: the package of QNN's built-in ops.
pub const OP_PACKAGE_QTI_AISW: &CStr = c"qti.aisw";
use std::ffi::CStr;

/// `Qnn_ScaleOffset_t`: `real = (q + offset) * scale` (the offset is the negated zero point).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScaleOffset {
    pub scale: f32,
    pub offset: i32,
}

/// `Qnn_AxisScaleOffset_t`: one scale and offset per index of `axis`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AxisScaleOffset {
    pub axis: i32,
    pub num_scale_offsets: u32,
    pub scale_offset: *mut ScaleOffset,
}

/// `Qnn_BwAxisScaleOffset_t` (the union's largest member, which sizes it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BwAxisScaleOffset {
    pub bitwidth: u32,
    pub axis: i32,
    pub num_elements: u32,
    pub scales: *mut f32,
    pub offsets: *mut i32,
}

/// The encodings of `Qnn_QuantizeParams_t` llmd uses.
#[repr(C)]
#[derive(Clone, Copy)]
pub union QuantizeEncoding {
    pub scale_offset: ScaleOffset,
    pub axis_scale_offset: AxisScaleOffset,
    pub bw_axis_scale_offset: BwAxisScaleOffset,
}

/// `Qnn_QuantizeParams_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QuantizeParams {
    pub encoding_definition: u32,
    pub quantization_encoding: u32,
    pub encoding: QuantizeEncoding,
}

impl QuantizeParams {
    /// `QNN_QUANTIZE_PARAMS_INIT`: a float tensor's (no quantization).
    pub const NONE: Self = Self {
        encoding_definition: quantization::DEFINITION_UNDEFINED,
        quantization_encoding: quantization::UNDEFINED,
        encoding: QuantizeEncoding {
            bw_axis_scale_offset: BwAxisScaleOffset {
                bitwidth: 0,
                axis: 0,
                num_elements: 0,
                scales: std::ptr::null_mut(),
                offsets: std::ptr::null_mut(),
            },
        },
    };

    /// One scale and offset per index along `axis`; the result points into `scale_offsets`, which
    /// must outlive every use of it.
    pub fn per_axis(axis: i32, scale_offsets: &mut [ScaleOffset]) -> Self {
        let mut q = Self::NONE;
        q.encoding_definition = quantization::DEFINED;
        q.quantization_encoding = quantization::AXIS_SCALE_OFFSET;
        q.encoding.axis_scale_offset = AxisScaleOffset {
            axis,
            num_scale_offsets: scale_offsets.len() as u32,
            scale_offset: scale_offsets.as_mut_ptr(),
        };
        q
    }

    /// One scale and offset for the whole tensor.
    pub fn per_tensor(scale: f32, offset: i32) -> Self {
        let mut q = Self::NONE;
        q.encoding_definition = quantization::DEFINED;
        q.quantization_encoding = quantization::SCALE_OFFSET;
        q.encoding.scale_offset = ScaleOffset { scale, offset };
        q
    }
}

/// `Qnn_ClientBuffer_t`: application memory (`data_size` in bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ClientBuffer {
    pub data: *mut c_void,
    pub data_size: u32,
}

/// The memory of a tensor: a client buffer or a registered memory handle.
#[repr(C)]
#[derive(Clone, Copy)]
pub union TensorMemory {
    pub client_buf: ClientBuffer,
    pub mem_handle: Handle,
}

/// `Qnn_TensorV1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TensorV1 {
    /// Written by QNN when the tensor is created.
    pub id: u32,
    pub name: *const c_char,
    pub tensor_type: u32,
    /// `Qnn_TensorDataFormat_t`: 0, dense.
    pub data_format: u32,
    pub data_type: u32,
    pub quantize_params: QuantizeParams,
    pub rank: u32,
    pub dimensions: *mut u32,
    pub mem_type: u32,
    pub memory: TensorMemory,
}

/// `Qnn_TensorV2_t`'s own fields after the V1 ones (only sized here: llmd writes version 1).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TensorV2 {
    pub v1: TensorV1,
    pub is_dynamic_dimensions: *mut u8,
    /// `Qnn_SparseParams_t`.
    pub sparse_params: [u32; 3],
    pub is_produced: u8,
}

/// The versions of a tensor's description.
#[repr(C)]
#[derive(Clone, Copy)]
pub union TensorVersions {
    pub v1: TensorV1,
    pub v2: TensorV2,
}

/// `Qnn_Tensor_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Tensor {
    pub version: u32,
    pub v: TensorVersions,
}

/// `Qnn_Scalar_t`'s values llmd uses.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ScalarValue {
    pub f32: f32,
    pub f64: f64,
    pub u64: u64,
    pub i64: i64,
    pub u32: u32,
    pub i32: i32,
    pub u8: u8,
    pub bool8: u8,
}

/// `Qnn_Scalar_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Scalar {
    pub data_type: u32,
    pub value: ScalarValue,
}

/// A parameter's value: a scalar or a (static) tensor.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ParamValue {
    pub scalar: Scalar,
    pub tensor: Tensor,
}

/// `Qnn_Param_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Param {
    pub param_type: u32,
    pub name: *const c_char,
    pub value: ParamValue,
}

/// `Qnn_OpConfigV1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct OpConfigV1 {
    pub name: *const c_char,
    pub package_name: *const c_char,
    pub type_name: *const c_char,
    pub num_of_params: u32,
    pub params: *mut Param,
    pub num_of_inputs: u32,
    pub input_tensors: *mut Tensor,
    pub num_of_outputs: u32,
    pub output_tensors: *mut Tensor,
}

/// `Qnn_OpConfig_t` (passed by value to `graphAddNode` and `backendValidateOpConfig`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct OpConfig {
    pub version: u32,
    pub v1: OpConfigV1,
}

/// `QnnBackend_Config_t`, `QnnDevice_Config_t`, `QnnContext_Config_t`, `QnnGraph_Config_t`:
/// an option and its value; passed as NULL-terminated arrays of pointers. llmd sets only the
/// custom option (0), whose value points to a backend-specific config.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub option: u32,
    pub value: *mut c_void,
}

/// The custom option of every core config.
pub const CONFIG_OPTION_CUSTOM: u32 = 0;

/// `QnnHtpDevice_CustomConfig_t` as QAIRT 2.4x+ reads it: the option, then its value at offset
/// 8 (older SDKs, up to 2.43, read a 12-byte layout with the value at 4, and refuse this one
/// with error 14001). Sized for the largest value known (24 bytes), zero-filled.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HtpDeviceCustomConfig {
    pub option: u32,
    pub _pad: u32,
    pub value: [u64; 2],
}

impl HtpDeviceCustomConfig {
    /// `QNN_HTP_DEVICE_CONFIG_OPTION_SOC`: the chip to emulate or run on (`Qnn_SocModel_t`:
    /// SM8550 = 43, SM8650 = 57, SM8750 = 69, ...). Always set: the x86 library otherwise
    /// emulates SM8350.
    pub fn soc(model: u32) -> Self {
        Self { option: 0, _pad: 0, value: [u64::from(model), 0] }
    }
}

/// `QnnHtpGraph_CustomConfig_t`: the option, then its value at offset 8 (56 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HtpGraphCustomConfig {
    pub option: u32,
    pub _pad: u32,
    pub value: [u64; 6],
}

impl HtpGraphCustomConfig {
    /// `QNN_HTP_GRAPH_CONFIG_OPTION_PRECISION`: float graphs at fp32 (0) or fp16 (1).
    pub fn precision_fp16() -> Self {
        Self { option: 2, _pad: 0, value: [1, 0, 0, 0, 0, 0] }
    }
}

/// `QnnHtpContext_CustomConfig_t`: the option, then its value at offset 8 (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HtpContextCustomConfig {
    pub option: u32,
    pub _pad: u32,
    pub value: [u64; 2],
}

impl HtpContextCustomConfig {
    /// `QNN_HTP_CONTEXT_CONFIG_OPTION_WEIGHT_SHARING_ENABLED`: graphs of one context share
    /// their weights.
    pub fn weight_sharing() -> Self {
        Self { option: 1, _pad: 0, value: [1, 0] }
    }
}

// The sizes and offsets QNN's ABI fixes (LP64).
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ScaleOffset>() == 8);
    assert!(size_of::<QuantizeParams>() == 40);
    assert!(offset_of!(QuantizeParams, encoding) == 8);
    assert!(size_of::<ClientBuffer>() == 16);
    assert!(size_of::<TensorV1>() == 112);
    assert!(offset_of!(TensorV1, name) == 8);
    assert!(offset_of!(TensorV1, quantize_params) == 32);
    assert!(offset_of!(TensorV1, rank) == 72);
    assert!(offset_of!(TensorV1, dimensions) == 80);
    assert!(offset_of!(TensorV1, mem_type) == 88);
    assert!(offset_of!(TensorV1, memory) == 96);
    assert!(size_of::<TensorV2>() == 136);
    assert!(size_of::<Tensor>() == 144);
    assert!(offset_of!(Tensor, v) == 8);
    assert!(size_of::<Scalar>() == 16);
    assert!(size_of::<Param>() == 160);
    assert!(offset_of!(Param, value) == 16);
    assert!(size_of::<OpConfigV1>() == 72);
    assert!(size_of::<OpConfig>() == 80);
    assert!(offset_of!(OpConfig, v1) == 8);
    assert!(size_of::<Config>() == 16);
    assert!(size_of::<HtpDeviceCustomConfig>() == 24);
    assert!(size_of::<HtpGraphCustomConfig>() == 56);
    assert!(size_of::<HtpContextCustomConfig>() == 24);
};

/// An entry llmd does not call (declared only to keep the table's order).
pub type Unused = Option<unsafe extern "C" fn()>;

/// `QNN_INTERFACE_VER_TYPE`: the function table of core API 2.27 (68 entries; later versions
/// append). Any entry may be NULL.
#[repr(C)]
#[derive(Default)]
pub struct FunctionTable {
    pub property_has_capability: Option<unsafe extern "C" fn(key: u32) -> ErrorHandle>,
    pub backend_create:
        Option<unsafe extern "C" fn(log: Handle, config: *const *const Config, backend: *mut Handle) -> ErrorHandle>,
    pub backend_set_config: Unused,
    pub backend_get_api_version: Option<unsafe extern "C" fn(version: *mut ApiVersion) -> ErrorHandle>,
    pub backend_get_build_id: Option<unsafe extern "C" fn(id: *mut *const c_char) -> ErrorHandle>,
    pub backend_register_op_package: Unused,
    pub backend_get_supported_operations: Unused,
    pub backend_validate_op_config: Option<unsafe extern "C" fn(backend: Handle, op: OpConfig) -> ErrorHandle>,
    pub backend_free: Option<unsafe extern "C" fn(backend: Handle) -> ErrorHandle>,
    pub context_create: Option<
        unsafe extern "C" fn(
            backend: Handle,
            device: Handle,
            config: *const *const Config,
            context: *mut Handle,
        ) -> ErrorHandle,
    >,
    pub context_set_config: Unused,
    pub context_get_binary_size: Option<unsafe extern "C" fn(context: Handle, size: *mut u64) -> ErrorHandle>,
    pub context_get_binary:
        Option<unsafe extern "C" fn(context: Handle, buf: *mut c_void, size: u64, written: *mut u64) -> ErrorHandle>,
    pub context_create_from_binary: Option<
        unsafe extern "C" fn(
            backend: Handle,
            device: Handle,
            config: *const *const Config,
            binary: *const c_void,
            size: u64,
            context: *mut Handle,
            profile: Handle,
        ) -> ErrorHandle,
    >,
    pub context_free: Option<unsafe extern "C" fn(context: Handle, profile: Handle) -> ErrorHandle>,
    pub graph_create: Option<
        unsafe extern "C" fn(
            context: Handle,
            name: *const c_char,
            config: *const *const Config,
            graph: *mut Handle,
        ) -> ErrorHandle,
    >,
    pub graph_create_subgraph: Unused,
    pub graph_set_config: Unused,
    pub graph_add_node: Option<unsafe extern "C" fn(graph: Handle, op: OpConfig) -> ErrorHandle>,
    pub graph_finalize: Option<unsafe extern "C" fn(graph: Handle, profile: Handle, signal: Handle) -> ErrorHandle>,
    pub graph_retrieve:
        Option<unsafe extern "C" fn(context: Handle, name: *const c_char, graph: *mut Handle) -> ErrorHandle>,
    pub graph_execute: Option<
        unsafe extern "C" fn(
            graph: Handle,
            inputs: *const Tensor,
            num_inputs: u32,
            outputs: *mut Tensor,
            num_outputs: u32,
            profile: Handle,
            signal: Handle,
        ) -> ErrorHandle,
    >,
    pub graph_execute_async: Unused,
    pub tensor_create_context_tensor: Option<unsafe extern "C" fn(context: Handle, tensor: *mut Tensor) -> ErrorHandle>,
    pub tensor_create_graph_tensor: Option<unsafe extern "C" fn(graph: Handle, tensor: *mut Tensor) -> ErrorHandle>,
    /// `logCreate(callback, maxLevel, logger)`; the callback's last argument is a C `va_list`.
    pub log_create: Option<
        unsafe extern "C" fn(
            callback: Option<unsafe extern "C" fn(fmt: *const c_char, level: u32, timestamp: u64, args: *mut c_void)>,
            max_level: u32,
            log: *mut Handle,
        ) -> ErrorHandle,
    >,
    pub log_set_log_level: Unused,
    pub log_free: Option<unsafe extern "C" fn(log: Handle) -> ErrorHandle>,
    pub profile_create: Unused,
    pub profile_set_config: Unused,
    pub profile_get_events: Unused,
    pub profile_get_sub_events: Unused,
    pub profile_get_event_data: Unused,
    pub profile_get_extended_event_data: Unused,
    pub profile_free: Unused,
    pub mem_register: Unused,
    pub mem_de_register: Unused,
    pub device_get_platform_info: Unused,
    pub device_free_platform_info: Unused,
    pub device_get_infrastructure: Unused,
    pub device_create:
        Option<unsafe extern "C" fn(log: Handle, config: *const *const Config, device: *mut Handle) -> ErrorHandle>,
    pub device_set_config: Unused,
    pub device_get_info: Unused,
    pub device_free: Option<unsafe extern "C" fn(device: Handle) -> ErrorHandle>,
    pub signal_create: Unused,
    pub signal_set_config: Unused,
    pub signal_trigger: Unused,
    pub signal_free: Unused,
    pub error_get_message: Option<unsafe extern "C" fn(error: ErrorHandle, message: *mut *const c_char) -> ErrorHandle>,
    pub error_get_verbose_message: Unused,
    pub error_free_verbose_message: Unused,
    pub graph_prepare_execution_environment: Unused,
    pub graph_release_execution_environment: Unused,
    pub graph_get_property: Unused,
    pub context_validate_binary: Unused,
    pub context_create_from_binary_with_signal: Unused,
    pub context_create_from_binary_list_async: Unused,
    pub tensor_update_graph_tensors: Unused,
    pub tensor_update_context_tensors: Unused,
    pub context_get_binary_section_size: Unused,
    pub context_get_binary_section: Unused,
    pub context_apply_binary_section: Unused,
    pub backend_get_property: Unused,
    pub context_get_property: Unused,
    pub context_get_incremental_binary: Unused,
    pub context_release_incremental_binary: Unused,
    pub context_finalize: Unused,
    pub global_config_set: Unused,
}

const _: () = {
    use std::mem::offset_of;
    // Entries whose position the probe of Qualcomm's library confirmed by calling them.
    assert!(offset_of!(FunctionTable, backend_get_api_version) == 3 * 8);
    assert!(offset_of!(FunctionTable, backend_free) == 8 * 8);
    assert!(offset_of!(FunctionTable, graph_create) == 15 * 8);
    assert!(offset_of!(FunctionTable, graph_execute) == 21 * 8);
    assert!(offset_of!(FunctionTable, tensor_create_graph_tensor) == 24 * 8);
    assert!(offset_of!(FunctionTable, device_create) == 40 * 8);
    assert!(offset_of!(FunctionTable, device_free) == 43 * 8);
    assert!(offset_of!(FunctionTable, error_get_message) == 48 * 8);
    assert!(offset_of!(FunctionTable, global_config_set) == 67 * 8);
};
