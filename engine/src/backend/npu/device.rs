//! The NPU as one device of the engine: [`QnnDevice`] owns a QNN library and its HTP backend
//! for one chip, and is the only way into QNN from outside this module — the daemon, llmctl
//! and the engine's own NPU paths (the W8A8 prefill, HeteroLLM's fp16 matmuls) open the
//! library, make contexts, key the graph cache and read modelled durations through it.
//!
//! **Open sequence** (one, shared by the daemon and llmctl): load the library; find its HTP
//! provider of a core API llmd supports (else [`NpuError::NoHtp`], naming the providers
//! found); start a backend and a device for the chip; read the build id. Each step's failure is
//! its own error, so `dump` and `llmctl npu-info` say which step failed.
//!
//! **Threads:** a `QnnDevice` is `Send` and `Sync`: its backend is behind a lock (QNN calls on
//! one backend never run at once), and what it makes — contexts and their graphs — owns what
//! it needs, so a graph may run on any thread and outlive the call that built it.
//!
//! **The contract:** `QnnDevice` implements `llmd_device::Device` (`super::contract`): one
//! projection's rows as an fp16 graph per static token count.

use crate::error::{NpuError, QnnFailure};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// What a QNN library says of one of its providers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Provider {
    pub name: String,
    pub backend_id: u32,
    pub core_api: String,
    pub backend_api: String,
    /// The HTP (NPU) backend, of a core API llmd supports.
    pub usable_htp: bool,
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (backend {}, core API {})", self.name, self.backend_id, self.core_api)
    }
}

/// A QNN library's HTP backend for one chip (see the module).
pub struct QnnDevice {
    backend: Mutex<qnn_sys::api::Backend>,
    /// The contract's identity and description (`super::contract`).
    pub(crate) id: llmd_device::DeviceId,
    pub(crate) desc: llmd_device::DeviceDesc,
    /// Modelled NPU time of the contract's submissions (the emulator's).
    pub(crate) modelled: std::sync::atomic::AtomicU64,
    /// The graph cache of the contract's `prepare_all` (`super::contract`), if any.
    pub(crate) cache_dir: Option<PathBuf>,
    /// Where the last `prepare_all` with a cache directory got its context: `Some(None)`
    /// loaded, `Some(Some(why))` built (`super::contract` turns it into a `CacheOutcome`).
    pub(crate) last_cache: Mutex<Option<Option<String>>>,
    /// The SoC profile its `estimate` prices graphs with (`super::contract`), if any.
    pub(crate) profile: Option<crate::hetero::soc::Soc>,
    /// A `Group` submission's input and outputs in f32 (`super::contract`), kept between
    /// submissions: groups run one at a time, as the NPU runs its graphs.
    pub(crate) group_staging: Mutex<(Vec<f32>, Vec<f32>)>,
    path: PathBuf,
    soc: u32,
    provider: Provider,
    build_id: String,
}

/// A QNN context of a [`QnnDevice`]: the graphs built in it or loaded with it.
pub struct NpuContext(pub(crate) qnn_sys::api::Context);

impl From<qnn_sys::api::QnnError> for NpuError {
    fn from(e: qnn_sys::api::QnnError) -> Self {
        NpuError::Qnn(QnnFailure { call: e.call, code: e.code, message: e.message })
    }
}

/// The core API version llmd needs of a provider.
pub fn min_core_api() -> String {
    qnn_sys::MIN_CORE_API.to_string()
}

fn library(path: &Path) -> Result<qnn_sys::Library, NpuError> {
    qnn_sys::Library::open(path).map_err(|e| NpuError::Open { path: path.to_owned(), reason: e.to_string() })
}

fn providers_of(lib: &qnn_sys::Library) -> Vec<Provider> {
    let htp = lib.provider(qnn_sys::BACKEND_ID_HTP).map(|i| i.head.backend_id);
    lib.providers()
        .into_iter()
        .map(|p| Provider {
            usable_htp: p.backend_id == qnn_sys::BACKEND_ID_HTP && htp == Some(p.backend_id),
            name: p.name,
            backend_id: p.backend_id,
            core_api: p.api.core.to_string(),
            backend_api: p.api.backend.to_string(),
        })
        .collect()
}

impl QnnDevice {
    /// The providers of the library at `path`, without starting a backend (`npu-info`).
    pub fn providers(path: &Path) -> Result<Vec<Provider>, NpuError> {
        Ok(providers_of(&library(path)?))
    }

    /// Opens the library at `path` and starts its HTP backend for chip `soc` (QNN's SoC
    /// model: 57 = Snapdragon 8 Gen 3): the open sequence of the module.
    pub fn open(path: &Path, soc: u32) -> Result<Self, NpuError> {
        let lib = library(path)?;
        let providers = providers_of(&lib);
        let Some(provider) = providers.iter().find(|p| p.usable_htp).cloned() else {
            return Err(NpuError::NoHtp {
                path: path.to_owned(),
                min_core_api: min_core_api(),
                found: providers.iter().map(Provider::to_string).collect(),
            });
        };
        let backend = qnn_sys::api::Backend::htp(Arc::new(lib), soc)
            .map_err(|e| NpuError::BackendStart { path: path.to_owned(), reason: NpuError::from(e).to_string() })?;
        let build_id = backend.build_id()?;
        let desc = describe(&provider.name, soc, &DEFAULT_TOKEN_COUNTS);
        Ok(Self {
            backend: Mutex::new(backend),
            id: llmd_device::DeviceId::fresh(),
            desc,
            modelled: std::sync::atomic::AtomicU64::new(0),
            cache_dir: None,
            last_cache: Mutex::new(None),
            profile: None,
            group_staging: Mutex::default(),
            path: path.to_owned(),
            soc,
            provider,
            build_id,
        })
    }

    /// The library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The chip its graphs are built for.
    pub fn soc(&self) -> u32 {
        self.soc
    }

    /// The HTP provider serving it.
    pub fn provider(&self) -> &Provider {
        &self.provider
    }

    /// The library's build id.
    pub fn build_id(&self) -> &str {
        &self.build_id
    }

    /// Why this is not a phone's NPU, if it is not: llmd's emulator (its provider, or its
    /// build id), or any QNN library off Android (Qualcomm's x86-64 HTP library simulates the
    /// HTP on the host's CPU). `backend = "auto"` takes neither unless told to.
    pub fn emulated(&self) -> Option<&'static str> {
        if self.provider.name == "LLMD_HTP_EMULATOR" || self.build_id.starts_with("llmd-qnn-emu") {
            Some("llmd's QNN emulator")
        } else if !cfg!(target_os = "android") {
            Some("a QNN library off a phone (its HTP simulated on the host's CPU)")
        } else {
            None
        }
    }

    /// A new, empty context.
    pub fn context(&self) -> Result<NpuContext, NpuError> {
        Ok(NpuContext(self.backend()?.context()?))
    }

    /// A context loaded from a binary that [`NpuContext`]'s `binary` wrote (the graph cache).
    pub(crate) fn context_from_binary(&self, binary: &[u8]) -> Result<NpuContext, NpuError> {
        Ok(NpuContext(self.backend()?.context_from_binary(binary)?))
    }

    fn backend(&self) -> Result<MutexGuard<'_, qnn_sys::api::Backend>, NpuError> {
        self.backend.lock().map_err(|_| NpuError::Poisoned)
    }
}

/// The token counts a [`QnnDevice`] builds graphs for unless told otherwise
/// ([`QnnDevice::with_token_counts`], in `super::contract`): a decode step and the daemon's
/// default `[hetero] sizes`.
pub const DEFAULT_TOKEN_COUNTS: [usize; 3] = [1, 32, 256];

/// The description a QNN device gives of itself.
pub(crate) fn describe(provider: &str, soc: u32, counts: &[usize]) -> llmd_device::DeviceDesc {
    let mut counts = counts.to_vec();
    counts.sort_unstable();
    counts.dedup();
    llmd_device::DeviceDesc {
        name: format!("qnn-htp ({provider}, soc {soc})"),
        processor: llmd_device::Processor::Npu,
        available: true,
        ops: vec![llmd_device::OpKind::MatMul],
        weight_types: llmd_device::GgmlType::ALL.to_vec(),
        max_tokens: counts.last().copied(),
        static_shapes: llmd_device::StaticShapes::Only(counts),
        memory: llmd_device::MemoryDesc { kind: llmd_device::MemoryKind::Unified, capacity: None },
        threads: 1,
    }
}
