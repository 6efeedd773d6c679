//! `qnn-sys`: the part of Qualcomm's QNN C API that llmd uses, declared here from Qualcomm's
//! public API documentation (no SDK headers, nothing generated from the libraries), and the
//! library loaded at run time with `libloading`, so nothing links against QNN and the crate
//! builds with no QNN file present.
//!
//! A QNN backend library (`libQnnHtp.so` for the Hexagon NPU) exports one entry point,
//! `QnnInterface_getProviders`, which hands out provider records: a backend id, a name, the
//! core and backend API versions, and a table of function pointers. [`Library::open`] loads a
//! library and reads its providers; every other call goes through a provider's table.
//!
//! On a host, the library is Qualcomm's HTP backend built for x86-64 (`scripts/fetch-qnn.sh`
//! fetches it into a cache; its licence allows development and benchmarking only, so it is
//! never committed or packaged) or llmd's own emulator provider.
//!
//! All `unsafe` of the NPU path lives in this crate, each block with its `// SAFETY:`.

use std::ffi::{c_char, CStr};
use std::path::Path;

pub mod api;
pub mod types;
pub use types::*;

/// The head of `QnnInterface_t`, the fields before its function table (which is read only
/// through the whole record, once its API version is known to have it).
#[repr(C)]
pub struct InterfaceHead {
    pub backend_id: u32,
    pub provider_name: *const c_char,
    pub api_version: ApiVersion,
}

const _: () = assert!(std::mem::size_of::<Version>() == 12);
const _: () = assert!(std::mem::size_of::<ApiVersion>() == 24);
const _: () = assert!(std::mem::offset_of!(InterfaceHead, provider_name) == 8);
const _: () = assert!(std::mem::offset_of!(InterfaceHead, api_version) == 16);
const _: () = assert!(std::mem::size_of::<InterfaceHead>() == 40);

/// `QnnInterface_getProviders(const QnnInterface_t*** providerList, uint32_t* numProviders)`.
type GetProviders = unsafe extern "C" fn(*mut *mut *const InterfaceHead, *mut u32) -> ErrorHandle;

/// The oldest core API whose function table [`FunctionTable`] declares in full (68 entries,
/// ending `globalConfigSet`); older providers are refused rather than read past their table.
pub const MIN_CORE_API: Version = Version { major: 2, minor: 27, patch: 0 };

/// `QnnInterface_t` with the part of its function table llmd declares (the first 68 entries:
/// later API versions only append).
#[repr(C)]
pub struct Interface {
    pub head: InterfaceHead,
    pub table: FunctionTable,
}

const _: () = assert!(std::mem::offset_of!(Interface, table) == 40);
const _: () = assert!(std::mem::size_of::<FunctionTable>() == 68 * 8);

/// What a provider says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderInfo {
    pub backend_id: u32,
    pub name: String,
    pub api: ApiVersion,
}

/// Why a QNN library could not be used.
#[derive(Debug)]
pub enum LoadError {
    /// The library file did not load (missing, wrong architecture, missing dependency).
    Open(String),
    /// It has no `QnnInterface_getProviders`.
    NoEntryPoint(String),
    /// `QnnInterface_getProviders` failed with this QNN error code.
    Providers(ErrorHandle),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Open(e) => write!(f, "the QNN library did not load: {e}"),
            LoadError::NoEntryPoint(e) => write!(f, "not a QNN backend library (no QnnInterface_getProviders): {e}"),
            LoadError::Providers(code) => write!(f, "QnnInterface_getProviders failed with QNN error {code}"),
        }
    }
}

impl std::error::Error for LoadError {}

/// `LlmdQnnEmu_graphModelledNanos(graph, last, total)`: exported by llmd's emulator provider
/// only (not QNN): the modelled duration of a graph's last execution and of all of them.
type ModelledNanos = unsafe extern "C" fn(Handle, *mut u64, *mut u64) -> ErrorHandle;

/// A loaded QNN backend library and its providers' records (valid while it stays loaded).
pub struct Library {
    providers: Vec<*const InterfaceHead>,
    modelled: Option<ModelledNanos>,
    // Last: the records above point into it.
    _lib: libloading::Library,
}

// SAFETY: the provider records are read-only tables the library keeps for its lifetime; QNN
// documents its API as callable from any thread (handles carry their own synchronisation).
unsafe impl Send for Library {}
// SAFETY: as above: nothing here is mutated through a shared reference.
unsafe impl Sync for Library {}

/// `dlopen`'s flag that keeps a library mapped after `dlclose` (the same value in glibc and
/// bionic).
const RTLD_NODELETE: std::ffi::c_int = 0x1000;

impl Library {
    /// Loads the QNN backend library at `path` and reads its providers.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        // SAFETY: loading a shared library runs its initialisers; a QNN backend library's are
        // Qualcomm's (or our emulator's), which is what the caller asked to load. RTLD_NODELETE:
        // the library stays mapped after its last handle closes — a backend's worker threads may
        // outlive the handle (a test process once crashed at exit after all its tests passed).
        let lib: libloading::Library = unsafe {
            libloading::os::unix::Library::open(
                Some(path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL | RTLD_NODELETE,
            )
        }
        .map_err(|e| LoadError::Open(e.to_string()))?
        .into();
        // SAFETY: the symbol's type is QNN's documented signature for this entry point.
        let get: libloading::Symbol<'_, GetProviders> =
            unsafe { lib.get(b"QnnInterface_getProviders\0") }.map_err(|e| LoadError::NoEntryPoint(e.to_string()))?;
        let mut list: *mut *const InterfaceHead = std::ptr::null_mut();
        let mut n: u32 = 0;
        // SAFETY: both out-pointers are valid for writes; the library fills them with its own
        // static table of `n` records.
        let code = unsafe { get(&mut list, &mut n) };
        if code != QNN_SUCCESS {
            return Err(LoadError::Providers(code));
        }
        let providers = if list.is_null() {
            Vec::new()
        } else {
            // SAFETY: on success `list` points to `n` provider pointers owned by the library.
            unsafe { std::slice::from_raw_parts(list, n as usize) }.iter().copied().filter(|p| !p.is_null()).collect()
        };
        // SAFETY: the symbol, when present, is the emulator's with exactly this signature.
        let modelled = unsafe { lib.get::<ModelledNanos>(b"LlmdQnnEmu_graphModelledNanos\0") }.ok().map(|s| *s);
        Ok(Self { providers, modelled, _lib: lib })
    }

    /// The first provider for `backend_id` whose core API is 2.x at or past [`MIN_CORE_API`],
    /// with its function table (valid while `self` is loaded).
    pub fn provider(&self, backend_id: u32) -> Option<&Interface> {
        self.providers.iter().find_map(|&p| {
            // SAFETY: `p` is a non-null record of the still-loaded library (see `open`); its
            // head is read first, and the whole record only once its core API version says the
            // table holds every entry `FunctionTable` declares.
            let head = unsafe { &*p };
            let core = head.api_version.core;
            if head.backend_id != backend_id || core.major != MIN_CORE_API.major || core < MIN_CORE_API {
                return None;
            }
            // SAFETY: as above: this provider's table holds at least the 68 entries declared.
            Some(unsafe { &*(p as *const Interface) })
        })
    }

    /// What each provider says of itself.
    pub fn providers(&self) -> Vec<ProviderInfo> {
        self.providers
            .iter()
            .map(|&p| {
                // SAFETY: `p` is a non-null record of the still-loaded library (see `open`).
                let head = unsafe { &*p };
                let name = if head.provider_name.is_null() {
                    String::new()
                } else {
                    // SAFETY: a provider's name is a NUL-terminated string the library keeps.
                    unsafe { CStr::from_ptr(head.provider_name) }.to_string_lossy().into_owned()
                };
                ProviderInfo { backend_id: head.backend_id, name, api: head.api_version }
            })
            .collect()
    }
}

/// `QNN_BACKEND_ID_HTP`: the Hexagon NPU backend.
pub const BACKEND_ID_HTP: u32 = 6;

/// The QNN error code of an error handle (its low 16 bits; the rest is reserved).
pub fn error_code(e: ErrorHandle) -> u16 {
    (e & 0xFFFF) as u16
}
