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
//! **Threads:** QNN handles may be used from any thread, but a backend is not shared: a
//! `QnnDevice` is `Send`, not `Sync`; its owner (the daemon's NPU thread) makes contexts and
//! graphs, and graphs may then run from other threads (each is `Send`).
//!
//! **Not yet:** `QnnDevice` does not implement the device contract (`llmd_device::Device`),
//! though the contract now has the subgraph the NPU takes (`SubgraphKind::Linear`, one
//! projection's rows): a contract executable is a `'static` handle shared between threads,
//! and `qnn-sys` ties a context to its backend and a graph to its context by lifetimes (a
//! backend is not `Sync`). The device needs `qnn-sys` handles that own what they use (a graph
//! keeping its context alive, as an OpenCL kernel keeps its program) — see ARCHITECTURE.md,
//! "Not built yet".

use crate::error::{NpuError, QnnFailure};
use std::path::{Path, PathBuf};

type BackendOf<'a> = qnn_sys::api::Backend<'a>;

self_cell::self_cell!(
    /// The library and the backend that borrows it.
    struct Opened {
        owner: qnn_sys::Library,
        #[covariant]
        dependent: BackendOf,
    }
);

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
    opened: Opened,
    path: PathBuf,
    soc: u32,
    provider: Provider,
    build_id: String,
}

/// A QNN context of a [`QnnDevice`]: the graphs built in it or loaded with it.
pub struct NpuContext<'d>(pub(crate) qnn_sys::api::Context<'d>);

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
        let opened = Opened::try_new(lib, |lib| qnn_sys::api::Backend::htp(lib, soc))
            .map_err(|e| NpuError::BackendStart { path: path.to_owned(), reason: NpuError::from(e).to_string() })?;
        let build_id = opened.borrow_dependent().build_id()?;
        Ok(Self { opened, path: path.to_owned(), soc, provider, build_id })
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

    /// A new, empty context.
    pub fn context(&self) -> Result<NpuContext<'_>, NpuError> {
        Ok(NpuContext(self.backend().context()?))
    }

    pub(crate) fn backend(&self) -> &qnn_sys::api::Backend<'_> {
        self.opened.borrow_dependent()
    }

    /// The library, which may be shared between threads (the backend may not): graphs ask it
    /// for their modelled durations (`qnn_sys::Library::modelled_ns`: llmd's emulator
    /// provider models a phone's NPU; Qualcomm's library runs for real and models nothing).
    pub(crate) fn library(&self) -> &qnn_sys::Library {
        self.opened.borrow_owner()
    }
}
