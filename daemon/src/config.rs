//! The daemon's configuration: one typed struct read from TOML, overridden by flags, validated
//! once at start-up, logged once and shown in `dump`.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Whether to register with the kernel Binder service manager.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelBinder {
    /// When a binder device exists.
    #[default]
    Auto,
    On,
    Off,
}

/// How KV caches store keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheType {
    /// f16, as llama.cpp (the default).
    #[default]
    F16,
    /// int8 with a scale per position and head: half the memory, logits within ~1e-2 KL.
    Q8,
}

impl KvCacheType {
    pub fn engine(self) -> llmd_engine::model::kv::KvType {
        match self {
            Self::F16 => llmd_engine::model::kv::KvType::F16,
            Self::Q8 => llmd_engine::model::kv::KvType::Q8,
        }
    }
}

/// Which processor besides the CPU takes work (`backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The NPU reads prompts and the GPU decodes where the system has them — a phone's QNN
    /// library (the system's `libQnnHtp.so` on Android, or `[npu] library`), an OpenCL device
    /// that is a GPU — and the CPU does what they do not, each model as its plan says (INT8
    /// chunked or HeteroLLM's partitioned prefill, decode on the GPU or cut; over `[devices]
    /// soc`'s profile). Emulated devices (llmd's QNN emulator, any QNN library off a phone,
    /// OpenCL on the host's CPU) only with `[devices] allow_emulated`.
    #[default]
    Auto,
    /// Everything on the CPU.
    Cpu,
    /// Prompt chunks' linear groups as W8A8 graphs on the NPU (llm.npu's split: norms, RoPE,
    /// attention on the CPU), decode on the CPU.
    Npu,
    /// Decode steps on the GPU (OpenCL, `[gpu]`), batched across apps, while prompts are read
    /// on the CPU; each turn's KV cache is handed to the GPU at its first decode step.
    Gpu,
    /// HeteroLLM (`[hetero]`): every linear layer's matmul cut between the NPU (fp16 graphs
    /// through `[npu]`'s QNN library) and the GPU (`[gpu]`'s OpenCL device) on a plan, prompt
    /// chunks and decode steps alike; norms, RoPE and attention on the CPU.
    Hetero,
}

/// How `backend = "hetero"` cuts each matmul.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeteroPlan {
    /// HeteroLLM's solver over `[devices] soc`'s profile (a small model may stay GPU-only).
    #[default]
    Solver,
    /// Every matmul cut in two by rows (NPU about half, at multiples of `row_align`): the
    /// partitioned path whatever the solver would choose.
    Even,
}

/// HeteroLLM's partitioned execution (`[hetero]`, used with `backend = "hetero"`, and by
/// `"auto"` for a model whose plan is HeteroLLM's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeteroConfig {
    pub plan: HeteroPlan,
    /// Prompt token counts each projection is planned for (a prompt chunk is cut into blocks of
    /// these, the rest on the GPU; with `plan = "solver"` each count's cut decides the NPU's
    /// graphs — standard sizes, possibly padded — or none); decode (one token) is always planned.
    pub sizes: Vec<usize>,
    /// Row alignment of the `even` plan's cut.
    pub row_align: usize,
    /// Bits per weight the solver assumes the processors read (W4A16 as Q4_0: 4.5).
    pub weight_bits: f64,
}

impl Default for HeteroConfig {
    fn default() -> Self {
        Self { plan: HeteroPlan::Solver, sizes: vec![32, 256], row_align: 64, weight_bits: 4.5 }
    }
}

/// The SoC the processors are planned for, and what `backend = "auto"` may take (`[devices]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesConfig {
    /// The SoC profile the planners use (built in: snapdragon_8gen3, snapdragon_8gen2,
    /// snapdragon_8elite; or a table of `soc_file`). Unset: on Android the profile of the
    /// chip the system names (`/sys/devices/soc0/machine`), else snapdragon_8gen3. **Decision:**
    /// a key set here wins over the detected chip (an OEM's word on its own device).
    pub soc: Option<String>,
    /// A TOML file of SoC profiles in the form of `engine/data/socs.toml` (an OEM's own).
    pub soc_file: Option<PathBuf>,
    /// Let `backend = "auto"` take emulated devices: llmd's QNN emulator (or any QNN library
    /// off a phone) and OpenCL runtimes on the host's CPU (PoCL, Intel's CPU runtime). They
    /// are no faster than the CPU path; tests use them.
    pub allow_emulated: bool,
}

/// The built-in profile of a Snapdragon the system names by its part number (`SM8650`).
pub fn soc_of_machine(machine: &str) -> Option<&'static str> {
    match machine.trim().to_ascii_uppercase().as_str() {
        "SM8650" | "SM8650P" => Some("snapdragon_8gen3"),
        "SM8550" | "SM8550P" => Some("snapdragon_8gen2"),
        "SM8750" | "SM8750P" => Some("snapdragon_8elite"),
        _ => None,
    }
}

impl DevicesConfig {
    /// The profile's name: `soc`, else the chip Android names, else snapdragon_8gen3.
    pub fn soc_name(&self) -> String {
        if let Some(s) = &self.soc {
            return s.clone();
        }
        if cfg!(target_os = "android") {
            if let Some(s) = std::fs::read_to_string("/sys/devices/soc0/machine").ok().and_then(|m| soc_of_machine(&m))
            {
                return s.into();
            }
        }
        "snapdragon_8gen3".into()
    }

    /// The SoC profile (see [`Self::soc_name`]), from the built-in ones and `soc_file`'s.
    pub fn profile(&self) -> Result<llmd_engine::hetero::soc::Soc, ConfigError> {
        let file = match &self.soc_file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|e| ConfigError::Invalid(format!("devices: soc_file {}: {e}", p.display())))?,
            ),
            None => None,
        };
        llmd_engine::hetero::soc::find(file.as_deref(), &self.soc_name())
            .map_err(|e| ConfigError::Invalid(format!("devices: {e}")))
    }
}

/// How the GPU's matmuls spread over its work-items (`gpu.matmul`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuMatmul {
    /// A work-item per weight row on a CPU device (PoCL), else a work-group per row.
    #[default]
    Auto,
    Rows,
    Groups,
}

/// The GPU path (`[gpu]`, used with `backend = "gpu"`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// The OpenCL library. Default: the ICD loader (`libOpenCL.so.1`), then a phone's
    /// `/vendor/lib64/libOpenCL.so`. `llmd --opencl-lib` and then `LLMD_OPENCL_LIB` override it.
    pub library: Option<PathBuf>,
    /// The OpenCL device by its number in `llmctl gpu-info` (default: the first GPU, else the
    /// first device).
    pub device: Option<usize>,
    /// Cached program binaries, so later starts skip the kernels' build. Default:
    /// `<residency.state_dir>/gpu`; none without a state directory.
    pub cache_dir: Option<PathBuf>,
    pub matmul: GpuMatmul,
    /// The fp16 kernels (half weights and products in the matmul): default on for a GPU with
    /// `cl_khr_fp16`, off otherwise; `true` on a device without the extension keeps the GPU
    /// off (the reason in `llmctl status`).
    pub fp16: Option<bool>,
}

/// How prompt chunks attend (`attention.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionMode {
    /// Every query over every visible key.
    #[default]
    Dense,
    /// shadowAttn: an INT8 pilot picks each query row's keys, exact attention over those.
    Shadow,
}

/// Prompt attention (`[attention]`): dense, or shadowAttn's sparse attention on the CPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AttentionConfig {
    pub mode: AttentionMode,
    /// The mean share of visible keys each query row keeps, in (0, 1].
    pub ratio: f64,
    /// Scale buckets per layer of the pilot, 1..=25.
    pub buckets: usize,
    /// The paper's head-specific ratios (a profile pass per head and layer, once per model).
    pub head_ratios: bool,
}

impl Default for AttentionConfig {
    fn default() -> Self {
        Self {
            mode: AttentionMode::Dense,
            ratio: 0.2,
            buckets: llmd_engine::backend::sparse::DEFAULT_BUCKETS,
            head_ratios: false,
        }
    }
}

/// The NPU path (`[npu]`, used with `backend = "npu"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NpuConfig {
    /// The QNN backend library. Default: on Android the system's `libQnnHtp.so`; elsewhere
    /// llmd's emulator provider, `libllmd_qnn_emu.so` beside the llmd binary. `llmd --qnn-lib`
    /// and then `LLMD_QNN_LIB` override it.
    pub library: Option<PathBuf>,
    /// The chip graphs are built for (QNN's SoC model: 57 = Snapdragon 8 Gen 3).
    pub soc: u32,
    /// Rows of each graph: the NPU takes prompts in chunks of this many tokens, the last one
    /// padded (llm.npu's default 256).
    pub chunk: usize,
    /// Prompt chunks one NPU job prefills together, out of order (llm.npu's out-of-order
    /// execution: the NPU runs one chunk's linear groups while a CPU thread runs another's
    /// attention; the same results as one chunk at a time). 1..=64; 1: one chunk per job. A
    /// job is not preempted, so a larger value delays another app's prompt by up to that many
    /// chunks of the NPU.
    pub ooe_chunks: usize,
    /// Finalized contexts, so later starts load instead of finalizing. Default:
    /// `<residency.state_dir>/npu`; none without a state directory.
    pub cache_dir: Option<PathBuf>,
    /// Calibration text for the activations' scales (default: a built-in English text).
    pub calibration: Option<PathBuf>,
    /// Bits of the graphs' outputs: 8 or 16.
    pub output_bits: u8,
    /// Shadow outlier execution (llm.npu): inputs clipped to ±τ on the NPU, the values past it
    /// multiplied on the CPU and added back.
    pub shadow: bool,
    /// The share of linear sites, least important first, that run without shadow execution
    /// (0 to 1; llm.npu's paper uses 0.85).
    pub shadow_prune: f64,
    /// int8 weight scales: "folded" (per-channel codes, the channels' scales applied by the
    /// host: the default), "per-tensor" (llm.npu's), or "per-channel" (in the graph; Qualcomm's
    /// HTP refuses it with 16-bit outputs).
    pub weights: String,
}

impl Default for NpuConfig {
    fn default() -> Self {
        Self {
            library: None,
            soc: 57,
            chunk: 256,
            ooe_chunks: 4,
            cache_dir: None,
            calibration: None,
            output_bits: 16,
            shadow: true,
            shadow_prune: llmd_engine::prefill::DEFAULT_PRUNE,
            weights: "folded".into(),
        }
    }
}

impl NpuConfig {
    /// The engine's quantization settings these name.
    pub fn quant(&self) -> llmd_engine::prefill::NpuQuant {
        use llmd_engine::prefill::{NpuQuant, ShadowConfig, WeightQuant};
        NpuQuant {
            out_bits: self.output_bits,
            weights: match self.weights.as_str() {
                "per-tensor" => WeightQuant::PerTensor,
                "per-channel" => WeightQuant::PerChannel,
                _ => WeightQuant::Folded,
            },
            shadow: self.shadow.then_some(ShadowConfig { prune: self.shadow_prune, ..Default::default() }),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Every `*.gguf` and `*.llmd` file and HF directory here is a model; its id is the name without extension.
    pub models_dir: Option<PathBuf>,
    /// Model files or HF directories served in addition to `models_dir`.
    pub models: Vec<PathBuf>,
    /// Serve Binder over this Unix socket (for hosts without kernel Binder, and tests).
    pub socket: Option<PathBuf>,
    /// The socket's file mode (octal), set whatever the umask; its owner is llmd's uid and gid.
    /// Who may use the service is decided per call from the peer's uid (`[permissions]`).
    pub socket_mode: String,
    pub kernel_binder: KernelBinder,
    /// Name registered with the service manager and on the socket.
    pub service_name: String,
    /// CPU threads for inference (0 = one per core).
    pub threads: usize,
    /// On SIGTERM or SIGINT, how long requests in flight may take to finish before they are
    /// cancelled (their clients get `CANCELLED`); then llmd exits 0.
    pub shutdown_grace_ms: u64,
    /// Tokens per prefill step (a unit of scheduled work).
    pub prefill_chunk: usize,
    /// KV cache storage: "f16" or "q8".
    pub kv_cache_type: KvCacheType,
    /// Which processors besides the CPU take work: "auto" (the default: the NPU for prompts
    /// and the GPU for decode where the system has them); "cpu" (none); "npu" (prompts' linear
    /// layers on QNN, configured in `[npu]`, the emulator included); "gpu" (decode on OpenCL,
    /// configured in `[gpu]`, whatever the device). A library that cannot start leaves the
    /// daemon on the CPU, saying why in `llmctl status`.
    pub backend: Backend,
    pub npu: NpuConfig,
    pub gpu: GpuConfig,
    pub hetero: HeteroConfig,
    pub devices: DevicesConfig,
    pub attention: AttentionConfig,
    pub limits: Limits,
    pub permissions: Permissions,
    pub scheduler: SchedulerConfig,
    pub residency: ResidencyConfig,
}

/// Which models live in memory (see `residency.rs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResidencyConfig {
    /// Memory for weights, KV caches and scratch, in MB (0 = no limit). `llmd --memory-budget-mb`.
    pub memory_budget_mb: u64,
    /// Model ids loaded at start-up and never evicted.
    pub pinned: Vec<String>,
    /// Eviction priority by model id (default 0; higher stays longer).
    pub priorities: std::collections::BTreeMap<String, u32>,
    /// Where the usage history and spilled KV caches live (none: history in memory only, KV
    /// dropped and recomputed instead of spilled). `llmd --state-dir`.
    pub state_dir: Option<PathBuf>,
    /// The PSI file read for memory pressure.
    pub pressure_file: PathBuf,
    /// `some avg10` at or above which the daemon sheds memory, one step per poll: first the
    /// KV caches of idle sessions, then unpinned idle models.
    pub pressure_high: f64,
    /// `some avg10` at or below which pressure has ended and evicted models may come back.
    pub pressure_low: f64,
    pub pressure_poll_ms: u64,
    /// Load the model the usage history predicts for this hour (at start-up and each hour).
    pub prefetch_predicted: bool,
    /// Load every model at start-up while the budget has room (pinned ones first); off: only
    /// pinned and predicted models are loaded ahead of use.
    pub load_at_start: bool,
    /// Leave token embeddings on storage, rows read on demand (models with a separate head).
    pub embeddings_on_flash: bool,
    /// An idle session whose KV cache holds more positions than this is spilled to `state_dir`
    /// without waiting for memory pressure (restored at its next turn); 0 = only under pressure.
    pub kv_spill_tokens: usize,
    /// Every this many seconds each model's files are checked against their fingerprint taken
    /// at start (`stat` and sampled blocks; `integrity.rs`); a model whose file changed is
    /// refused (`MODEL_LOAD_FAILED`) and evicted. Every request also `stat`s its model's file
    /// and every load checks the samples. 0 = no periodic check.
    pub model_check_s: u64,
}

impl Default for ResidencyConfig {
    fn default() -> Self {
        Self {
            memory_budget_mb: 0,
            pinned: Vec::new(),
            priorities: Default::default(),
            state_dir: None,
            pressure_file: PathBuf::from("/proc/pressure/memory"),
            pressure_high: 10.0,
            pressure_low: 1.0,
            pressure_poll_ms: 1000,
            prefetch_predicted: true,
            load_at_start: true,
            embeddings_on_flash: false,
            kv_spill_tokens: 0,
            model_check_s: 60,
        }
    }
}

/// Arbitration between requests and apps (see `policy.rs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Tokens one engine pass may carry (batched decode tokens + one prefill chunk).
    pub step_tokens: usize,
    /// Sequences whose decode steps share one pass.
    pub max_batch: usize,
    /// Prefill chunk of background and batch prompts (foreground uses `prefill_chunk`): the
    /// longest a foreground prompt can wait behind one.
    pub background_chunk: usize,
    /// A request not served for this long ranks one class better (per period waited); a
    /// request of class index c (foreground 0, background 1, batch 2) waits at most (c+1) periods.
    pub aging_ms: u64,
    /// The best class a uid may claim, by uid ("10123" = "background"); others get
    /// `default_class_cap`.
    pub class_caps: std::collections::BTreeMap<String, crate::policy::Class>,
    pub default_class_cap: crate::policy::Class,
    /// Fair-share weights by uid (default 1).
    pub weights: std::collections::BTreeMap<String, u32>,
    /// Tokens (prompt + generated) a uid may use per `quota_window_s`; 0 = unlimited.
    pub quota_tokens_per_uid: usize,
    pub quota_window_s: u64,
    /// Least time between two `onTokens` callbacks of one request: tokens decoded meanwhile
    /// go out together (the first at once, the last with `onCompleted`). 0 = one per pass.
    pub stream_interval_ms: u64,
    /// A request whose client has not taken a callback for this long (a stopped client, a
    /// callback that blocks) is ended with `DEADLINE_EXCEEDED`, its turn rolled back and its
    /// memory freed; on the socket, a send the client takes nothing of for this long also ends
    /// the client's connection (its sessions close). 0 = never.
    pub stream_stall_timeout_s: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            step_tokens: 256,
            max_batch: 16,
            background_chunk: 16,
            aging_ms: 5000,
            class_caps: Default::default(),
            default_class_cap: crate::policy::Class::Foreground,
            weights: Default::default(),
            quota_tokens_per_uid: 0,
            quota_window_s: 60,
            stream_interval_ms: 16,
            stream_stall_timeout_s: 30,
        }
    }
}

impl ResidencyConfig {
    /// `memory_budget_mb` in bytes (0: no limit).
    pub fn memory_budget_bytes(&self) -> u64 {
        self.memory_budget_mb.saturating_mul(1 << 20)
    }
}

impl SchedulerConfig {
    /// The best class `uid` may claim.
    pub fn class_cap(&self, uid: u32) -> crate::policy::Class {
        self.class_caps.get(&uid.to_string()).copied().unwrap_or(self.default_class_cap)
    }

    pub fn policy(&self, prefill_chunk: usize) -> crate::policy::PolicyConfig {
        crate::policy::PolicyConfig {
            step_tokens: self.step_tokens,
            max_batch: self.max_batch,
            chunk: [prefill_chunk, self.background_chunk, self.background_chunk],
            aging_ms: self.aging_ms,
            weights: self.weights.iter().filter_map(|(k, v)| Some((k.parse().ok()?, *v))).collect(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_sessions_per_uid: usize,
    pub max_sessions: usize,
    /// Requests queued or running per uid.
    pub max_requests_per_uid: usize,
    /// Requests queued or running in all.
    pub max_requests: usize,
    pub max_prompt_tokens: usize,
    pub max_new_tokens: usize,
    /// Longest prompt or message accepted, in bytes (checked before tokenizing).
    pub max_prompt_bytes: usize,
    /// Connections to the socket one uid may hold open (each client holds about three: its
    /// own and two for callbacks); more are closed at once. Admin uids are not capped.
    pub max_connections_per_uid: usize,
    /// Connections to the socket in all; 0 = what `RLIMIT_NOFILE` leaves room for (the soft
    /// limit less max(32, limit / 8)), which also bounds a set value. Admins may go past it,
    /// up to the limit less 16.
    pub max_connections: usize,
    /// A session unused for this long (no call of its owner's on it, no request running) is
    /// closed and its KV memory freed; its owner's next call on it gets `SESSION_CLOSED`
    /// saying so. Checked every quarter of it (at most every 10 s). 0 = never.
    pub session_idle_timeout_s: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_sessions_per_uid: 8,
            max_sessions: 64,
            max_requests_per_uid: 4,
            max_requests: 32,
            max_prompt_tokens: 4096,
            max_new_tokens: 4096,
            max_prompt_bytes: 256 * 1024,
            max_connections_per_uid: 32,
            max_connections: 0,
            session_idle_timeout_s: 600,
        }
    }
}

/// Who may call what. On Android the uids come from the caller's Binder identity; on the
/// socket transport from the peer's credentials (SO_PEERCRED).
///
/// Closed by default: with neither `allowed_uids` nor `open`, only admins (`admin_uids` and
/// llmd's own uid) may use the service; every other uid gets `PERMISSION_DENIED`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Permissions {
    /// Every uid may use the service (an explicit opt-in: on a device, where SELinux decides
    /// which domains may find it). Not together with `allowed_uids`.
    pub open: bool,
    /// Uids that may use the service (list models, open sessions, generate, status); empty
    /// (the default) = admins only, unless `open`.
    pub allowed_uids: Vec<u32>,
    /// Uids that may also call admin methods (dump, prefetch), and use the service. The
    /// daemon's own uid always may.
    pub admin_uids: Vec<u32>,
}

impl Default for Permissions {
    fn default() -> Self {
        // root and Android's shell user.
        Self { open: false, allowed_uids: Vec::new(), admin_uids: vec![0, 2000] }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            models_dir: None,
            models: Vec::new(),
            socket: None,
            socket_mode: "0660".into(),
            kernel_binder: KernelBinder::Auto,
            service_name: "llmd".into(),
            threads: 0,
            shutdown_grace_ms: 3000,
            prefill_chunk: llmd_engine::generate::DEFAULT_PREFILL_CHUNK,
            kv_cache_type: KvCacheType::F16,
            backend: Backend::Auto,
            npu: NpuConfig::default(),
            gpu: GpuConfig::default(),
            hetero: HeteroConfig::default(),
            devices: DevicesConfig::default(),
            attention: AttentionConfig::default(),
            limits: Limits::default(),
            permissions: Permissions::default(),
            scheduler: SchedulerConfig::default(),
            residency: ResidencyConfig::default(),
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        Self::from_toml(&text, path)
    }

    /// Parses the text of a config file (`path` names it in errors). Not yet validated.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.display().to_string(), message: e.to_string() })
    }

    /// `socket_mode` as permission bits.
    pub fn socket_mode_bits(&self) -> Result<u32, ConfigError> {
        let s = self.socket_mode.trim();
        u32::from_str_radix(s.strip_prefix("0o").unwrap_or(s), 8)
            .ok()
            .filter(|&m| m <= 0o777)
            .ok_or_else(|| ConfigError::Invalid(format!("socket_mode {s:?} is not an octal mode from 0 to 0777")))
    }

    /// Checks what start-up relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let h = &self.hetero;
        if h.sizes.is_empty() || h.sizes.iter().any(|&s| !(2..=4096).contains(&s)) {
            return bad(format!("hetero: sizes {:?}: one or more prompt token counts from 2 to 4096", h.sizes));
        }
        if h.row_align == 0 || h.row_align > 1 << 16 {
            return bad(format!("hetero: row_align {} must be 1 to 65536", h.row_align));
        }
        if !(h.weight_bits.is_finite() && h.weight_bits > 0.0 && h.weight_bits <= 32.0) {
            return bad(format!("hetero: weight_bits {} must be above 0 and at most 32", h.weight_bits));
        }
        if self.backend != Backend::Cpu {
            self.devices.profile()?;
        }
        self.socket_mode_bits()?;
        if self.permissions.open && !self.permissions.allowed_uids.is_empty() {
            return bad("permissions: open = true admits every uid; allowed_uids would mean nothing: set one".into());
        }
        if self.models_dir.is_none() && self.models.is_empty() {
            return bad("no models: set models_dir or models (or pass --models-dir / --model)".into());
        }
        if self.service_name.is_empty() || self.service_name.len() > 128 {
            return bad("service_name must be 1..=128 characters".into());
        }
        if self.prefill_chunk == 0 {
            return bad("prefill_chunk must be at least 1".into());
        }
        let a = &self.attention;
        if !(a.ratio >= 0.001 && a.ratio <= 1.0) {
            return bad(format!("attention.ratio {} must be between 0.001 and 1", a.ratio));
        }
        if a.mode == AttentionMode::Shadow && self.kv_cache_type == KvCacheType::Q8 {
            return bad("attention.mode \"shadow\" needs kv_cache_type = \"f16\" (the pilot reads f16 keys)".into());
        }
        if !(1..=25).contains(&a.buckets) {
            return bad(format!("attention.buckets {} must be 1..=25", a.buckets));
        }
        let n = &self.npu;
        if !(1..=4096).contains(&n.chunk) {
            return bad(format!("npu.chunk {} must be 1..=4096", n.chunk));
        }
        if !(1..=64).contains(&n.ooe_chunks) {
            return bad(format!("npu.ooe_chunks {} must be 1..=64", n.ooe_chunks));
        }
        if !(0.0..=1.0).contains(&n.shadow_prune) {
            return bad(format!("npu.shadow_prune {} must be between 0 and 1", n.shadow_prune));
        }
        if !matches!(n.weights.as_str(), "folded" | "per-tensor" | "per-channel") {
            return bad(format!("npu.weights {:?} must be \"folded\", \"per-tensor\" or \"per-channel\"", n.weights));
        }
        if !matches!(n.output_bits, 8 | 16) {
            return bad(format!("npu.output_bits {} must be 8 or 16", n.output_bits));
        }
        let sc = &self.scheduler;
        for (name, v) in
            [("step_tokens", sc.step_tokens), ("max_batch", sc.max_batch), ("background_chunk", sc.background_chunk)]
        {
            if v == 0 {
                return bad(format!("scheduler.{name} must be at least 1"));
            }
        }
        if sc.quota_tokens_per_uid > 0 && sc.quota_window_s == 0 {
            return bad("scheduler.quota_window_s must be at least 1 when a quota is set".into());
        }
        for k in sc.class_caps.keys().chain(sc.weights.keys()) {
            if k.parse::<u32>().is_err() {
                return bad(format!("scheduler: {k:?} is not a uid"));
            }
        }
        if sc.weights.values().any(|&w| w == 0) {
            return bad("scheduler.weights must be at least 1".into());
        }
        let r = &self.residency;
        if !(r.pressure_low < r.pressure_high && r.pressure_low >= 0.0 && r.pressure_high <= 100.0) {
            return bad("residency: need 0 <= pressure_low < pressure_high <= 100".into());
        }
        if r.memory_budget_mb > u64::MAX >> 20 {
            // In bytes it would wrap (`<< 20`) to a small budget, or to 0: no limit.
            return bad(format!("residency.memory_budget_mb {} is more than {}", r.memory_budget_mb, u64::MAX >> 20));
        }
        if r.pressure_poll_ms == 0 {
            return bad("residency.pressure_poll_ms must be at least 1".into());
        }
        let l = &self.limits;
        for (name, v) in [
            ("max_sessions_per_uid", l.max_sessions_per_uid),
            ("max_sessions", l.max_sessions),
            ("max_requests_per_uid", l.max_requests_per_uid),
            ("max_requests", l.max_requests),
            ("max_prompt_tokens", l.max_prompt_tokens),
            ("max_new_tokens", l.max_new_tokens),
            ("max_prompt_bytes", l.max_prompt_bytes),
            ("max_connections_per_uid", l.max_connections_per_uid),
        ] {
            if v == 0 {
                return bad(format!("limits.{name} must be at least 1"));
            }
        }
        Ok(())
    }

    /// The effective configuration as TOML (for logs and dump).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# config not printable: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_budget_that_overflows_in_bytes_is_refused() {
        let with = |mb: u64| {
            let mut c = Config { models: vec!["m.gguf".into()], ..Config::default() };
            c.residency.memory_budget_mb = mb;
            c.validate()
        };
        assert!(with(u64::MAX >> 20).is_ok());
        // 2^44 MB is 2^64 bytes: it wrapped to 0, "no limit"; one more MB wrapped to 1 MB.
        assert!(matches!(with(1 << 44), Err(ConfigError::Invalid(_))));
        assert!(matches!(with((1 << 44) + 1), Err(ConfigError::Invalid(_))));
    }

    #[test]
    fn socket_mode_is_an_octal_mode() {
        let with = |m: &str| Config { socket_mode: m.into(), ..Config::default() }.socket_mode_bits().ok();
        assert_eq!(with("0660"), Some(0o660));
        assert_eq!(with("0o600"), Some(0o600));
        assert_eq!(with("666"), Some(0o666));
        for bad in ["1777", "999", "rw-rw----", "", "-1"] {
            assert_eq!(with(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn permissions_are_closed_by_default_and_open_is_not_mixed_with_a_list() {
        let p = Permissions::default();
        assert!(!p.open && p.allowed_uids.is_empty());
        let parsed: Config = toml::from_str("models = [\"m.gguf\"]\n[permissions]\nopen = true\n").expect("parses");
        assert!(parsed.permissions.open);
        parsed.validate().expect("valid");
        let both: Config =
            toml::from_str("models = [\"m.gguf\"]\n[permissions]\nopen = true\nallowed_uids = [10001]\n")
                .expect("parses");
        assert!(both.validate().is_err());
    }

    #[test]
    fn the_devices_section_names_a_profile_and_keeps_emulated_devices_out_of_auto_by_default() {
        let parse =
            |extra: &str| -> Config { toml::from_str(&format!("models = [\"m.gguf\"]\n{extra}")).expect("parses") };
        let c = parse("");
        assert!(!c.devices.allow_emulated);
        assert_eq!(c.devices.profile().expect("the default profile").key, "snapdragon_8gen3");
        let c = parse("[devices]\nsoc = \"snapdragon_8elite\"\nallow_emulated = true\n");
        assert!(c.devices.allow_emulated);
        assert_eq!(c.devices.profile().expect("built in").key, "snapdragon_8elite");
        assert!(matches!(parse("[devices]\nsoc = \"no_such_chip\"\n").validate(), Err(ConfigError::Invalid(_))));
        let missing = parse("[devices]\nsoc_file = \"/nonexistent/socs.toml\"\n").validate();
        assert!(matches!(&missing, Err(ConfigError::Invalid(m)) if m.contains("soc_file")), "{missing:?}");
        // The CPU alone plans nothing: a bad profile does not keep it from starting.
        parse("backend = \"cpu\"\n[devices]\nsoc = \"no_such_chip\"\n").validate().expect("valid");
        // The keys moved from [hetero] are refused there, not ignored.
        assert!(toml::from_str::<Config>("models = [\"m\"]\n[hetero]\nsoc = \"snapdragon_8gen3\"\n").is_err());
        assert_eq!(soc_of_machine("SM8650\n"), Some("snapdragon_8gen3"));
        assert_eq!(soc_of_machine("sm8550"), Some("snapdragon_8gen2"));
        assert_eq!(soc_of_machine("SM8750"), Some("snapdragon_8elite"));
        assert_eq!(soc_of_machine("MT6989"), None);
    }

    #[test]
    fn the_npu_keys_parse_and_bad_values_are_refused() {
        let parse =
            |extra: &str| -> Config { toml::from_str(&format!("models = [\"m.gguf\"]\n{extra}")).expect("parses") };
        let c = parse("backend = \"npu\"\n[npu]\nlibrary = \"/vendor/lib64/libQnnHtp.so\"\nchunk = 128\n");
        assert_eq!(c.backend, Backend::Npu);
        assert_eq!((c.npu.chunk, c.npu.soc, c.npu.output_bits), (128, 57, 16));
        c.validate().expect("valid");
        assert_eq!(parse("").backend, Backend::Auto, "accelerators where the system has them, unless asked");
        assert_eq!(parse("backend = \"cpu\"\n").backend, Backend::Cpu);
        for bad in [
            "[npu]\nchunk = 0\n",
            "[npu]\nchunk = 4097\n",
            "[npu]\noutput_bits = 12\n",
            "[npu]\nshadow_prune = 1.5\n",
            "[npu]\nweights = \"per-group\"\n",
        ] {
            assert!(matches!(parse(bad).validate(), Err(ConfigError::Invalid(_))), "{bad}");
        }
        assert!(toml::from_str::<Config>("backend = \"tpu\"\n").is_err(), "an unknown backend is a parse error");
    }

    #[test]
    fn the_gpu_keys_parse_and_unknown_ones_are_refused() {
        let c: Config = toml::from_str(
            "models = [\"m.gguf\"]\nbackend = \"gpu\"\n[gpu]\nlibrary = \"/vendor/lib64/libOpenCL.so\"\ndevice = 1\nmatmul = \"rows\"\nfp16 = false\n",
        )
        .expect("parses");
        assert_eq!(c.backend, Backend::Gpu);
        assert_eq!(c.gpu.library.as_deref(), Some(std::path::Path::new("/vendor/lib64/libOpenCL.so")));
        assert_eq!((c.gpu.device, c.gpu.matmul, c.gpu.fp16), (Some(1), GpuMatmul::Rows, Some(false)));
        c.validate().expect("valid");
        assert_eq!(toml::from_str::<Config>("").expect("parses").gpu, GpuConfig::default());
        for bad in
            ["[gpu]\nmatmul = \"fast\"\n", "[gpu]\ndevice = -1\n", "[gpu]\nlibary = \"x\"\n", "[gpu]\nfp16 = \"yes\"\n"]
        {
            assert!(toml::from_str::<Config>(bad).is_err(), "{bad}");
        }
    }
}
