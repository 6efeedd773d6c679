//! Engine errors: one typed enum per concern, named after what failed, with the numbers that matter.

use thiserror::Error;

/// A model file (GGUF or the HF layout) could not be imported.
#[derive(Debug, Error)]
pub enum FormatError {
    #[error("cannot open model file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("GGUF file truncated: need {needed} bytes at offset {offset} for {what}, file has {len}")]
    Truncated { what: &'static str, offset: u64, needed: u64, len: u64 },
    #[error("GGUF {what} count {count} cannot fit in the {remaining} bytes left in the file")]
    CountTooLarge { what: &'static str, count: u64, remaining: u64 },
    #[error("GGUF string at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64 },
    #[error("GGUF metadata key {key:?} has unknown value type {value_type}")]
    UnknownValueType { key: String, value_type: u32 },
    #[error("GGUF metadata key {key:?}: nested arrays are not supported")]
    NestedArray { key: String },
    #[error("GGUF metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("GGUF tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("GGUF alignment {0} is not a power of two between 1 and 65536")]
    BadAlignment(u64),
    #[error("tensor {name:?} has {n_dims} dimensions (at most 4 supported)")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor {name:?} has an invalid dimension {dim} at axis {axis}")]
    BadDimension { name: String, axis: usize, dim: u64 },
    #[error("tensor {name:?} has {elements} elements, which overflows or exceeds the file")]
    TensorTooLarge { name: String, elements: String },
    #[error("tensor {name:?} has type {} (GGML type id {type_id}), which llmd cannot read: convert the model to a type it reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K–Q6_K, F16, BF16, F32)", ggml_type_name(*type_id))]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?}: row length {row} is not a multiple of its type's block size {block}")]
    RowNotBlockAligned { name: String, row: u64, block: u64 },
    #[error("tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor { name: String, offset: u64, alignment: u64 },
    #[error("tensor {name:?}: bytes {start}..{end} lie outside the data section of {data_len} bytes")]
    TensorOutOfBounds { name: String, start: u64, end: u64, data_len: u64 },
    #[error("tensors {a:?} and {b:?} overlap in the data section")]
    OverlappingTensors { a: String, b: String },
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?} has the wrong type: expected {expected}")]
    WrongKeyType { key: String, expected: &'static str },
    #[error("tensor {0:?} is missing from the model")]
    MissingTensor(String),
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch { name: String, found: Vec<u64>, expected: Vec<u64> },
    #[error("unsupported model architecture {0:?} (supported: llama, mistral, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("invalid model hyper-parameter {what}: {detail}")]
    BadHyperParameter { what: &'static str, detail: String },
    #[error("invalid HF model directory {path}: {detail}")]
    BadHfLayout { path: String, detail: String },
    #[error("safetensors file {path}: {detail}")]
    Safetensors { path: String, detail: String },
    #[error("not an llmd model file: magic bytes are {found:02x?}")]
    NativeBadMagic { found: Vec<u8> },
    #[error("unsupported llmd model file version {found} (this build reads version {supported})")]
    NativeVersion { found: u32, supported: u32 },
    #[error(
        "llmd model file {what} checksum mismatch: stored {stored:08x}, computed {computed:08x} (the file is corrupt)"
    )]
    ChecksumMismatch { what: String, stored: u32, computed: u32 },
    #[error("llmd model file layout: {0}")]
    NativeLayout(String),
}

/// The tokenizer could not be built or could not encode/decode.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("unsupported tokenizer model {0:?} (supported: gpt2, llama)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?}")]
    UnsupportedPreTokenizer(String),
    #[error("tokenizer vocabulary is invalid: {0}")]
    BadVocabulary(String),
    #[error("tokenizer failed: {0}")]
    Backend(String),
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
}

/// A chat request could not be turned into a prompt.
#[derive(Debug, Error)]
pub enum ChatTemplateError {
    #[error("the model has no chat template and none was configured")]
    Missing,
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed while rendering: {0}")]
    Render(String),
    /// The rendering ran more template instructions than any real template needs.
    #[error("chat template ran out of fuel: more than {fuel} instructions")]
    OutOfFuel { fuel: u64 },
    /// The rendering grew longer than the conversation can justify.
    #[error("chat template's rendering exceeds {limit} bytes")]
    TooLong { limit: usize },
    /// The model's template was rendered in its sandbox process, and that failed or was
    /// stopped (its memory or CPU limit).
    #[error("chat template's rendering failed in its sandbox: {0}")]
    Sandbox(String),
}

/// Generation parameters or the generation itself failed.
#[derive(Debug, Error)]
pub enum GenerateError {
    #[error("invalid sampling parameter {name}: {detail}")]
    InvalidSampling { name: &'static str, detail: String },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens plus {max_new} new tokens exceeds the context of {context} tokens")]
    ContextOverflow { prompt: usize, max_new: usize, context: usize },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// A backend refused or failed a unit of work.
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("backend {backend} does not support {op}")]
    Unsupported { backend: &'static str, op: String },
    #[error("no backend can run {0}")]
    NoBackend(String),
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    /// A device of the contract (`llmd_device`) failed or refused a call.
    #[error("device: {0}")]
    Device(String),
    /// The model's file shrank while its weights were read from it in place (a page read as
    /// zeros instead of killing the process): this pass's results are void; reload the model.
    #[error("the model file shrank while in use (weights of {0} lost): reload the model")]
    ModelFileTruncated(String),
}

/// The NPU path refused a graph or its numbers, or QNN failed a call.
#[derive(Debug, Error)]
pub enum NpuError {
    #[error("NPU graph {graph}: {detail}")]
    Shape { graph: String, detail: String },
    #[error("NPU quantization: {0}")]
    Quantization(String),
    /// The QNN library lacks what the NPU path needs.
    #[error("NPU library: {0}")]
    Library(String),
    /// The context cache could not be read or written.
    #[error("NPU context cache: {0}")]
    Cache(String),
    /// The QNN library did not load (missing, another architecture, not a QNN library).
    #[error("NPU library {path}: {reason}")]
    Open { path: std::path::PathBuf, reason: String },
    /// The library has no HTP provider of a core API llmd supports.
    #[error("NPU library {path}: no HTP provider with core API {min_core_api} or newer (found: {})", if found.is_empty() { "none".to_owned() } else { found.join(", ") })]
    NoHtp { path: std::path::PathBuf, min_core_api: String, found: Vec<String> },
    /// The HTP backend or its device did not start.
    #[error("NPU library {path}: the HTP backend did not start: {reason}")]
    BackendStart { path: std::path::PathBuf, reason: String },
    /// A thread panicked while it held the NPU backend's lock; the device is unusable.
    #[error("NPU backend: a thread failed while using it; reload the NPU")]
    Poisoned,
    #[error(transparent)]
    Qnn(QnnFailure),
}

/// A QNN call that failed (`backend::npu` converts QNN's own error into it).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{}", if *code == 0 { format!("{call}: {message}") } else { format!("{call} failed with QNN error {code} ({message})") })]
pub struct QnnFailure {
    /// The QNN function (`graphFinalize`, ...), or what llmd checked before calling it.
    pub call: &'static str,
    /// QNN's error code (0 when llmd refused before calling).
    pub code: u16,
    pub message: String,
}

/// Any engine error, for callers that do not care which part failed.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Npu(#[from] NpuError),
}

/// The name ggml gives type id `id` (for errors about types llmd does not read), or "unknown".
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2 (removed)",
        "Q4_3 (removed)",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "unknown",
        "unknown",
        "unknown",
        "TQ1_0",
        "TQ2_0",
        "unknown",
        "unknown",
        "unknown",
        "MXFP4",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}
