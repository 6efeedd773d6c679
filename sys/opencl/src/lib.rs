//! OpenCL for llmd's GPU backend, loaded at run time — on a phone the vendor's
//! `/vendor/lib64/libOpenCL.so`, on a host an ICD loader (`libOpenCL.so.1`) with PoCL or another
//! runtime behind it. Nothing links against OpenCL: a system without it still starts, and the
//! daemon says why it serves on the CPU.
//!
//! **Decision** (docs/DECISIONS.md): the declarations come from `opencl-sys` (types, constants
//! and function-pointer types; without its `static` feature it links nothing) and the library is
//! opened with `libloading`, as `qnn-sys` opens QNN. `opencl3`/`cl3` load through `dlopen2`,
//! whose newest release does not compile for Android (it uses `once_cell` there without
//! depending on it), and they read the library's path once per process from an environment
//! variable, where the daemon needs a path from its config and a test needs a library that is
//! absent.
//!
//! Every `unsafe` of the GPU path is in this crate. The safe interface: [`Library`] → its
//! [`DeviceInfo`]s → a [`Context`] with one in-order queue on one device → [`Mem`] buffers,
//! [`Program`]s (from source or a binary, and their binaries for a cache) and [`Kernel`]s,
//! enqueued with their arguments in one call; reads block, kernels do not, and
//! [`Context::on_done`] calls back once the queue has reached a point. The context counts what
//! crosses between host and device and how often the host waited ([`Stats`]).
//!
//! **A failing device** for tests: `LLMD_OPENCL_FAIL_AFTER=N` fails every kernel enqueue after
//! the process's first `N` with `CL_OUT_OF_RESOURCES`, as a device that stops mid-request (the
//! QNN emulator's `LLMD_QNN_EMU_FAIL_AFTER` does the same for the NPU).

use opencl_sys as cl;
use std::ffi::{c_void, CString};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What an OpenCL call can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClError {
    #[error("cannot load the OpenCL library {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("the OpenCL library {path} has no {symbol}")]
    Symbol { path: String, symbol: &'static str },
    #[error("{call} failed with {} ({code})", code_name(*.code))]
    Call { call: &'static str, code: i32 },
    #[error("the OpenCL program did not build: {log}")]
    Build { log: String },
    #[error("{0}")]
    Invalid(String),
}

/// OpenCL's name for an error code (the common ones).
pub fn code_name(code: i32) -> &'static str {
    match code {
        0 => "CL_SUCCESS",
        -1 => "CL_DEVICE_NOT_FOUND",
        -2 => "CL_DEVICE_NOT_AVAILABLE",
        -3 => "CL_COMPILER_NOT_AVAILABLE",
        -4 => "CL_MEM_OBJECT_ALLOCATION_FAILURE",
        -5 => "CL_OUT_OF_RESOURCES",
        -6 => "CL_OUT_OF_HOST_MEMORY",
        -11 => "CL_BUILD_PROGRAM_FAILURE",
        -30 => "CL_INVALID_VALUE",
        -33 => "CL_INVALID_DEVICE",
        -34 => "CL_INVALID_CONTEXT",
        -36 => "CL_INVALID_COMMAND_QUEUE",
        -38 => "CL_INVALID_MEM_OBJECT",
        -42 => "CL_INVALID_BINARY",
        -44 => "CL_INVALID_PROGRAM",
        -45 => "CL_INVALID_PROGRAM_EXECUTABLE",
        -46 => "CL_INVALID_KERNEL_NAME",
        -48 => "CL_INVALID_KERNEL",
        -49 => "CL_INVALID_ARG_INDEX",
        -50 => "CL_INVALID_ARG_VALUE",
        -51 => "CL_INVALID_ARG_SIZE",
        -52 => "CL_INVALID_KERNEL_ARGS",
        -54 => "CL_INVALID_WORK_GROUP_SIZE",
        -55 => "CL_INVALID_WORK_ITEM_SIZE",
        -58 => "CL_INVALID_EVENT",
        -61 => "CL_INVALID_BUFFER_SIZE",
        -1001 => "CL_PLATFORM_NOT_FOUND_KHR",
        _ => "an OpenCL error",
    }
}

fn check(call: &'static str, code: cl::cl_int) -> Result<(), ClError> {
    if code == cl::CL_SUCCESS {
        Ok(())
    } else {
        Err(ClError::Call { call, code })
    }
}

/// `Option<F>`'s `F`: opencl-sys declares each entry point as an optional function pointer.
trait Entry {
    type F: Copy;
}
impl<F: Copy> Entry for Option<F> {
    type F = F;
}

macro_rules! entry_points {
    ($($field:ident: $ty:ident = $sym:literal),* $(,)?) => {
        /// The entry points llmd calls, resolved when the library is opened (OpenCL 1.2).
        struct Fns { $($field: <cl::cl_function_types::$ty as Entry>::F),* }

        impl Fns {
            fn resolve(lib: &libloading::Library, path: &str) -> Result<Self, ClError> {
                Ok(Self { $($field: {
                    // SAFETY: the symbol is OpenCL's entry point of this name, whose signature
                    // opencl-sys declares from Khronos' headers; it is copied out as a function
                    // pointer that the `Library` keeps valid by holding the library open.
                    let sym = unsafe { lib.get::<cl::cl_function_types::$ty>(concat!($sym, "\0").as_bytes()) };
                    sym.ok().and_then(|s| *s).ok_or(ClError::Symbol { path: path.to_string(), symbol: $sym })?
                }),*})
            }
        }
    };
}

entry_points! {
    get_platform_ids: clGetPlatformIDs_t = "clGetPlatformIDs",
    get_platform_info: clGetPlatformInfo_t = "clGetPlatformInfo",
    get_device_ids: clGetDeviceIDs_t = "clGetDeviceIDs",
    get_device_info: clGetDeviceInfo_t = "clGetDeviceInfo",
    create_context: clCreateContext_t = "clCreateContext",
    release_context: clReleaseContext_t = "clReleaseContext",
    create_command_queue: clCreateCommandQueue_t = "clCreateCommandQueue",
    release_command_queue: clReleaseCommandQueue_t = "clReleaseCommandQueue",
    create_buffer: clCreateBuffer_t = "clCreateBuffer",
    release_mem_object: clReleaseMemObject_t = "clReleaseMemObject",
    create_program_with_source: clCreateProgramWithSource_t = "clCreateProgramWithSource",
    create_program_with_binary: clCreateProgramWithBinary_t = "clCreateProgramWithBinary",
    build_program: clBuildProgram_t = "clBuildProgram",
    get_program_info: clGetProgramInfo_t = "clGetProgramInfo",
    get_program_build_info: clGetProgramBuildInfo_t = "clGetProgramBuildInfo",
    release_program: clReleaseProgram_t = "clReleaseProgram",
    create_kernel: clCreateKernel_t = "clCreateKernel",
    release_kernel: clReleaseKernel_t = "clReleaseKernel",
    set_kernel_arg: clSetKernelArg_t = "clSetKernelArg",
    enqueue_nd_range_kernel: clEnqueueNDRangeKernel_t = "clEnqueueNDRangeKernel",
    enqueue_read_buffer: clEnqueueReadBuffer_t = "clEnqueueReadBuffer",
    enqueue_write_buffer: clEnqueueWriteBuffer_t = "clEnqueueWriteBuffer",
    enqueue_copy_buffer: clEnqueueCopyBuffer_t = "clEnqueueCopyBuffer",
    enqueue_marker_with_wait_list: clEnqueueMarkerWithWaitList_t = "clEnqueueMarkerWithWaitList",
    set_event_callback: clSetEventCallback_t = "clSetEventCallback",
    release_event: clReleaseEvent_t = "clReleaseEvent",
    flush: clFlush_t = "clFlush",
    finish: clFinish_t = "clFinish",
}

/// An opened OpenCL library.
pub struct Library {
    f: Fns,
    path: String,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("path", &self.path).finish()
    }
}

/// Where OpenCL is looked for when no path is given: the ICD loader's names, then a phone's
/// vendor libraries.
pub const DEFAULT_PATHS: &[&str] = &[
    "libOpenCL.so.1",
    "libOpenCL.so",
    "/vendor/lib64/libOpenCL.so",
    "/system/vendor/lib64/libOpenCL.so",
    "/vendor/lib64/egl/libGLES_mali.so",
];

impl Library {
    /// Opens `path`, or the first of [`DEFAULT_PATHS`] that opens.
    pub fn open(path: Option<&Path>) -> Result<Arc<Self>, ClError> {
        let candidates: Vec<PathBuf> = match path {
            Some(p) => vec![p.to_path_buf()],
            None => DEFAULT_PATHS.iter().map(PathBuf::from).collect(),
        };
        let mut last = ClError::Invalid("no OpenCL library to try".into());
        for p in candidates {
            let shown = p.display().to_string();
            // SAFETY: loading a shared library runs its initialisers; an OpenCL library (or
            // ICD loader) is a system component meant to be loaded this way, and the path is
            // the operator's (config, command line) or a well-known system name.
            match unsafe { libloading::Library::new(&p) } {
                Ok(lib) => {
                    let f = Fns::resolve(&lib, &shown)?;
                    return Ok(Arc::new(Self { f, path: shown, _lib: lib }));
                }
                Err(e) => last = ClError::Load { path: shown, reason: e.to_string() },
            }
        }
        Err(last)
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Every device of every platform.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, ClError> {
        // The ICD loader (ocl-icd 2.3) reads its vendor files at the first clGetPlatformIDs
        // without a lock: two threads enumerating at once can see no platform at all (seen in the
        // tests). Enumeration is serialised process-wide.
        static ENUMERATE: Mutex<()> = Mutex::new(());
        let _one = ENUMERATE.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0u32;
        // SAFETY: asks for the count only (null list, 0 entries); `n` outlives the call.
        let code = unsafe { (self.f.get_platform_ids)(0, ptr::null_mut(), &mut n) };
        if code == -1001 || n == 0 {
            return Ok(Vec::new()); // CL_PLATFORM_NOT_FOUND_KHR: the loader found no runtime
        }
        check("clGetPlatformIDs", code)?;
        let mut plats = vec![ptr::null_mut(); n as usize];
        // SAFETY: `plats` has room for `n` ids.
        check("clGetPlatformIDs", unsafe { (self.f.get_platform_ids)(n, plats.as_mut_ptr(), ptr::null_mut()) })?;
        let mut out = Vec::new();
        for p in plats {
            let platform = self.platform_string(p, cl::CL_PLATFORM_NAME)?;
            let platform_version = self.platform_string(p, cl::CL_PLATFORM_VERSION)?;
            let mut nd = 0u32;
            // SAFETY: count only, for a platform id the library returned.
            let code = unsafe { (self.f.get_device_ids)(p, cl::CL_DEVICE_TYPE_ALL, 0, ptr::null_mut(), &mut nd) };
            if code == -1 || nd == 0 {
                continue; // CL_DEVICE_NOT_FOUND
            }
            check("clGetDeviceIDs", code)?;
            let mut ids = vec![ptr::null_mut(); nd as usize];
            // SAFETY: `ids` has room for `nd` ids.
            check("clGetDeviceIDs", unsafe {
                (self.f.get_device_ids)(p, cl::CL_DEVICE_TYPE_ALL, nd, ids.as_mut_ptr(), ptr::null_mut())
            })?;
            for d in ids {
                out.push(self.device_info(p, d, &platform, &platform_version)?);
            }
        }
        Ok(out)
    }

    fn platform_string(&self, p: cl::cl_platform_id, what: cl::cl_platform_info) -> Result<String, ClError> {
        let mut len = 0usize;
        // SAFETY: size query for a platform id the library returned.
        check("clGetPlatformInfo", unsafe { (self.f.get_platform_info)(p, what, 0, ptr::null_mut(), &mut len) })?;
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is `len` bytes, as the size query said.
        check("clGetPlatformInfo", unsafe {
            (self.f.get_platform_info)(p, what, len, buf.as_mut_ptr().cast(), ptr::null_mut())
        })?;
        Ok(c_string(&buf))
    }

    fn device_bytes(&self, d: cl::cl_device_id, what: cl::cl_device_info) -> Result<Vec<u8>, ClError> {
        let mut len = 0usize;
        // SAFETY: size query for a device id the library returned.
        check("clGetDeviceInfo", unsafe { (self.f.get_device_info)(d, what, 0, ptr::null_mut(), &mut len) })?;
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is `len` bytes, as the size query said.
        check("clGetDeviceInfo", unsafe {
            (self.f.get_device_info)(d, what, len, buf.as_mut_ptr().cast(), ptr::null_mut())
        })?;
        Ok(buf)
    }

    fn device_u64(&self, d: cl::cl_device_id, what: cl::cl_device_info) -> Result<u64, ClError> {
        let b = self.device_bytes(d, what)?;
        Ok(match b.len() {
            4 => u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as u64,
            8 => u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            _ => 0,
        })
    }

    fn device_info(
        &self,
        p: cl::cl_platform_id,
        d: cl::cl_device_id,
        platform: &str,
        platform_version: &str,
    ) -> Result<DeviceInfo, ClError> {
        let s = |w| self.device_bytes(d, w).map(|b| c_string(&b));
        let ty = self.device_u64(d, cl::CL_DEVICE_TYPE)?;
        Ok(DeviceInfo {
            platform: platform.to_string(),
            platform_version: platform_version.to_string(),
            name: s(cl::CL_DEVICE_NAME)?,
            vendor: s(cl::CL_DEVICE_VENDOR)?,
            version: s(cl::CL_DEVICE_VERSION)?,
            driver_version: s(cl::CL_DRIVER_VERSION)?,
            c_version: s(cl::CL_DEVICE_OPENCL_C_VERSION)?,
            extensions: s(cl::CL_DEVICE_EXTENSIONS)?.split_whitespace().map(str::to_string).collect(),
            kind: if ty & cl::CL_DEVICE_TYPE_GPU != 0 {
                "GPU"
            } else if ty & cl::CL_DEVICE_TYPE_CPU != 0 {
                "CPU"
            } else if ty & cl::CL_DEVICE_TYPE_ACCELERATOR != 0 {
                "accelerator"
            } else {
                "other"
            },
            compute_units: self.device_u64(d, cl::CL_DEVICE_MAX_COMPUTE_UNITS)? as u32,
            global_mem: self.device_u64(d, cl::CL_DEVICE_GLOBAL_MEM_SIZE)?,
            max_alloc: self.device_u64(d, cl::CL_DEVICE_MAX_MEM_ALLOC_SIZE)?,
            local_mem: self.device_u64(d, cl::CL_DEVICE_LOCAL_MEM_SIZE)?,
            max_work_group: self.device_u64(d, cl::CL_DEVICE_MAX_WORK_GROUP_SIZE)? as usize,
            host_unified_memory: self.device_u64(d, cl::CL_DEVICE_HOST_UNIFIED_MEMORY)? != 0,
            image_support: self.device_u64(d, cl::CL_DEVICE_IMAGE_SUPPORT)? != 0,
            base_align: (self.device_u64(d, cl::CL_DEVICE_MEM_BASE_ADDR_ALIGN)? / 8).max(1) as usize,
            id: DeviceRef { platform: p, device: d },
        })
    }
}

fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim().to_string()
}

/// A platform's device, as the library names it (valid while the library is open).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRef {
    platform: cl::cl_platform_id,
    device: cl::cl_device_id,
}

// SAFETY: platform and device ids are opaque handles owned by the OpenCL runtime, valid from
// any thread for as long as the library is loaded (OpenCL 1.2 §A.2: the API is thread-safe
// except clSetKernelArg on one kernel, which `Kernel` serialises).
unsafe impl Send for DeviceRef {}
// SAFETY: as above; the ids are only passed back to the runtime.
unsafe impl Sync for DeviceRef {}

/// What a device says about itself.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub platform: String,
    pub platform_version: String,
    pub name: String,
    pub vendor: String,
    pub version: String,
    pub driver_version: String,
    pub c_version: String,
    pub extensions: Vec<String>,
    /// "GPU", "CPU", "accelerator" or "other".
    pub kind: &'static str,
    pub compute_units: u32,
    pub global_mem: u64,
    pub max_alloc: u64,
    pub local_mem: u64,
    pub max_work_group: usize,
    /// Its memory is the host's (a phone's GPU, PoCL): buffers need no copy over a bus.
    pub host_unified_memory: bool,
    pub image_support: bool,
    /// The alignment (bytes) the device wants of a buffer's start
    /// (`CL_DEVICE_MEM_BASE_ADDR_ALIGN`): host memory a buffer uses in place should start on it.
    pub base_align: usize,
    pub id: DeviceRef,
}

impl DeviceInfo {
    pub fn has(&self, ext: &str) -> bool {
        self.extensions.iter().any(|e| e == ext)
    }
}

/// What crossed between host and device, and how often the host waited, since the context was
/// made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub kernels: u64,
    pub host_waits: u64,
    pub bytes_to_device: u64,
    pub bytes_from_device: u64,
}

#[derive(Default)]
struct Counters {
    kernels: AtomicU64,
    host_waits: AtomicU64,
    to_device: AtomicU64,
    from_device: AtomicU64,
}

/// A context on one device with one in-order queue.
pub struct Context {
    lib: Arc<Library>,
    ctx: cl::cl_context,
    queue: cl::cl_command_queue,
    device: DeviceRef,
    counters: Counters,
}

// SAFETY: the context and queue are runtime objects usable from any thread (OpenCL 1.2 §A.2);
// they are released once, in Drop.
unsafe impl Send for Context {}
// SAFETY: as above; every call through `&Context` is one of the thread-safe entry points.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: queue and context were created by `Context::new` and are released once; the
        // queue is drained first so no callback outlives them.
        unsafe {
            (self.lib.f.finish)(self.queue);
            (self.lib.f.release_command_queue)(self.queue);
            (self.lib.f.release_context)(self.ctx);
        }
    }
}

/// How a buffer is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Kernels only read it (weights).
    ReadOnly,
    ReadWrite,
}

/// One argument of a kernel launch.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    Mem(&'a Mem),
    U32(u32),
    I32(i32),
    F32(f32),
    /// Local memory of this many bytes.
    Local(usize),
}

impl Context {
    /// A context and an in-order queue on `device`.
    pub fn new(lib: &Arc<Library>, device: &DeviceInfo) -> Result<Arc<Self>, ClError> {
        let props: [cl::cl_context_properties; 3] =
            [cl::CL_CONTEXT_PLATFORM as cl::cl_context_properties, device.id.platform as cl::cl_context_properties, 0];
        let mut err = 0;
        // SAFETY: one device id of this library, properties terminated by 0, no callback.
        let ctx =
            unsafe { (lib.f.create_context)(props.as_ptr(), 1, &device.id.device, None, ptr::null_mut(), &mut err) };
        check("clCreateContext", err)?;
        // SAFETY: a context just made on this device; properties 0: in order, no profiling.
        let queue = unsafe { (lib.f.create_command_queue)(ctx, device.id.device, 0, &mut err) };
        if let Err(e) = check("clCreateCommandQueue", err) {
            // SAFETY: the context was made above and nothing else holds it.
            unsafe { (lib.f.release_context)(ctx) };
            return Err(e);
        }
        Ok(Arc::new(Self { lib: lib.clone(), ctx, queue, device: device.id, counters: Counters::default() }))
    }

    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            kernels: c.kernels.load(Ordering::Relaxed),
            host_waits: c.host_waits.load(Ordering::Relaxed),
            bytes_to_device: c.to_device.load(Ordering::Relaxed),
            bytes_from_device: c.from_device.load(Ordering::Relaxed),
        }
    }

    fn mem_flags(access: Access) -> cl::cl_mem_flags {
        match access {
            Access::ReadOnly => cl::CL_MEM_READ_ONLY,
            Access::ReadWrite => cl::CL_MEM_READ_WRITE,
        }
    }

    /// An uninitialised buffer of `bytes` (at least 1).
    pub fn buffer(self: &Arc<Self>, access: Access, bytes: usize) -> Result<Mem, ClError> {
        let mut err = 0;
        // SAFETY: no host pointer; the size is at least 1.
        let mem = unsafe {
            (self.lib.f.create_buffer)(self.ctx, Self::mem_flags(access), bytes.max(1), ptr::null_mut(), &mut err)
        };
        check("clCreateBuffer", err)?;
        Ok(Mem { ctx: self.clone(), mem, len: bytes, _keep: None })
    }

    /// A buffer holding a copy of `data` (made at once, without waiting for the queue). With
    /// `host_memory`, the runtime allocates it in host-visible memory (a unified-memory GPU's
    /// zero-copy path: the device reads the same pages).
    pub fn buffer_from(self: &Arc<Self>, access: Access, data: &[u8], host_memory: bool) -> Result<Mem, ClError> {
        if data.is_empty() {
            return self.buffer(access, 1);
        }
        let mut flags = Self::mem_flags(access) | cl::CL_MEM_COPY_HOST_PTR;
        if host_memory {
            flags |= cl::CL_MEM_ALLOC_HOST_PTR;
        }
        let mut err = 0;
        // SAFETY: COPY_HOST_PTR copies `data.len()` bytes from `data` before returning; the
        // runtime does not keep the pointer and never writes through it.
        let mem =
            unsafe { (self.lib.f.create_buffer)(self.ctx, flags, data.len(), data.as_ptr() as *mut c_void, &mut err) };
        check("clCreateBuffer", err)?;
        self.counters.to_device.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(Mem { ctx: self.clone(), mem, len: data.len(), _keep: None })
    }

    /// A buffer over `range` of host memory that `keep` owns, used in place
    /// (`CL_MEM_USE_HOST_PTR`): on a device that shares the host's memory the kernels read
    /// those very pages, so the data is in memory once. The buffer holds `keep` until it is
    /// released. Read-only: the device never writes through it.
    pub fn buffer_shared(self: &Arc<Self>, keep: SharedBytes, range: Range<usize>) -> Result<Mem, ClError> {
        let bytes: &[u8] = (*keep).as_ref();
        let data = bytes
            .get(range.clone())
            .filter(|d| !d.is_empty())
            .ok_or_else(|| ClError::Invalid(format!("bytes {range:?} of {} shared", bytes.len())))?;
        let mut err = 0;
        // SAFETY: `data` lives in memory `keep` owns and never moves or changes while `keep`
        // lives (the `SharedBytes` contract); the returned `Mem` holds `keep` until after
        // clReleaseMemObject, so the runtime's pointer stays valid for the buffer's life. The
        // buffer is read-only, so the runtime never writes through the pointer.
        let mem = unsafe {
            (self.lib.f.create_buffer)(
                self.ctx,
                cl::CL_MEM_READ_ONLY | cl::CL_MEM_USE_HOST_PTR,
                data.len(),
                data.as_ptr() as *mut c_void,
                &mut err,
            )
        };
        check("clCreateBuffer (CL_MEM_USE_HOST_PTR)", err)?;
        let len = data.len();
        Ok(Mem { ctx: self.clone(), mem, len, _keep: Some(keep) })
    }

    fn same(&self, m: &Mem) -> Result<(), ClError> {
        if std::ptr::eq(&*m.ctx, self) {
            Ok(())
        } else {
            Err(ClError::Invalid("a buffer of another OpenCL context".into()))
        }
    }

    /// Copies `src` into `dst` at `offset`, after the queue's earlier work; returns once the
    /// copy is done (a host wait).
    pub fn write(&self, dst: &Mem, offset: usize, src: &[u8]) -> Result<(), ClError> {
        self.same(dst)?;
        if offset.checked_add(src.len()).is_none_or(|e| e > dst.len) {
            return Err(ClError::Invalid(format!(
                "write of {} bytes at {offset} past a {}-byte buffer",
                src.len(),
                dst.len
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: blocking write: `src` is read before the call returns; the range was checked
        // against the buffer's size.
        check("clEnqueueWriteBuffer", unsafe {
            (self.lib.f.enqueue_write_buffer)(
                self.queue,
                dst.mem,
                cl::CL_TRUE,
                offset,
                src.len(),
                src.as_ptr().cast(),
                0,
                ptr::null(),
                ptr::null_mut(),
            )
        })?;
        self.counters.host_waits.fetch_add(1, Ordering::Relaxed);
        self.counters.to_device.fetch_add(src.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` of `src` into `dst` once the queue's earlier work
    /// is done (a host wait).
    pub fn read(&self, src: &Mem, offset: usize, dst: &mut [u8]) -> Result<(), ClError> {
        self.same(src)?;
        if offset.checked_add(dst.len()).is_none_or(|e| e > src.len) {
            return Err(ClError::Invalid(format!(
                "read of {} bytes at {offset} past a {}-byte buffer",
                dst.len(),
                src.len
            )));
        }
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: blocking read into `dst`, which is `dst.len()` bytes and borrowed mutably
        // for the call; the range was checked against the buffer's size.
        check("clEnqueueReadBuffer", unsafe {
            (self.lib.f.enqueue_read_buffer)(
                self.queue,
                src.mem,
                cl::CL_TRUE,
                offset,
                dst.len(),
                dst.as_mut_ptr().cast(),
                0,
                ptr::null(),
                ptr::null_mut(),
            )
        })?;
        self.counters.host_waits.fetch_add(1, Ordering::Relaxed);
        self.counters.from_device.fetch_add(dst.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Enqueues a copy of `bytes` bytes at `src_offset` of `src` to `dst_offset` of `dst`, after
    /// the queue's earlier work. Does not wait.
    pub fn copy(
        &self,
        src: &Mem,
        src_offset: usize,
        dst: &Mem,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<(), ClError> {
        self.same(src)?;
        self.same(dst)?;
        let past = |off: usize, len: usize| off.checked_add(bytes).is_none_or(|e| e > len);
        if past(src_offset, src.len) || past(dst_offset, dst.len) {
            return Err(ClError::Invalid(format!(
                "copy of {bytes} bytes from {src_offset} of a {}-byte buffer to {dst_offset} of a {}-byte one",
                src.len, dst.len
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both buffers belong to this queue's context (checked) and outlive the call
        // (the runtime retains what it enqueues); both ranges were checked against their sizes.
        check("clEnqueueCopyBuffer", unsafe {
            (self.lib.f.enqueue_copy_buffer)(
                self.queue,
                src.mem,
                dst.mem,
                src_offset,
                dst_offset,
                bytes,
                0,
                ptr::null(),
                ptr::null_mut(),
            )
        })?;
        self.counters.kernels.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Enqueues `kernel` with `args` over `global` work-items in groups of `local` (None: the
    /// runtime chooses). Does not wait.
    pub fn enqueue(
        &self,
        kernel: &Kernel,
        args: &[Arg<'_>],
        global: &[usize],
        local: Option<&[usize]>,
    ) -> Result<(), ClError> {
        if !std::ptr::eq(&*kernel.ctx, self) {
            return Err(ClError::Invalid("a kernel of another OpenCL context".into()));
        }
        if global.is_empty() || global.len() > 3 || local.is_some_and(|l| l.len() != global.len()) {
            return Err(ClError::Invalid(format!("{}: bad work size {global:?}/{local:?}", kernel.name)));
        }
        if global.contains(&0) {
            return Ok(());
        }
        if let Some(n) = fail_after() {
            static ENQUEUED: AtomicU64 = AtomicU64::new(0);
            if ENQUEUED.fetch_add(1, Ordering::Relaxed) >= n {
                return Err(ClError::Invalid(format!(
                    "{}: clEnqueueNDRangeKernel: CL_OUT_OF_RESOURCES (-5) ({FAIL_AFTER_ENV}={n})",
                    kernel.name
                )));
            }
        }
        let _one_at_a_time = kernel.args.lock().unwrap_or_else(|e| e.into_inner());
        for (i, a) in args.iter().enumerate() {
            let i = i as u32;
            let code = match *a {
                Arg::Mem(m) => {
                    self.same(m)?;
                    // SAFETY: the argument is a cl_mem of this context, passed by address with
                    // its size; the kernel's lock keeps another thread's arguments out until it
                    // is enqueued.
                    unsafe {
                        (self.lib.f.set_kernel_arg)(
                            kernel.k,
                            i,
                            size_of::<cl::cl_mem>(),
                            (&m.mem as *const cl::cl_mem).cast(),
                        )
                    }
                }
                // SAFETY: a scalar passed by address with its size.
                Arg::U32(v) => unsafe { (self.lib.f.set_kernel_arg)(kernel.k, i, 4, (&v as *const u32).cast()) },
                // SAFETY: as above.
                Arg::I32(v) => unsafe { (self.lib.f.set_kernel_arg)(kernel.k, i, 4, (&v as *const i32).cast()) },
                // SAFETY: as above.
                Arg::F32(v) => unsafe { (self.lib.f.set_kernel_arg)(kernel.k, i, 4, (&v as *const f32).cast()) },
                // SAFETY: local memory: a size and a null value, as the API specifies.
                Arg::Local(n) => unsafe { (self.lib.f.set_kernel_arg)(kernel.k, i, n, ptr::null()) },
            };
            if code != cl::CL_SUCCESS {
                return Err(ClError::Invalid(format!("{}: argument {i}: {} ({code})", kernel.name, code_name(code))));
            }
        }
        // SAFETY: the work sizes have `global.len()` (1..=3) entries each; every argument was
        // set above under the kernel's lock; the buffers are held by the caller's `Mem`s, and
        // a `Mem` is released only after the queue has finished with it (see `Mem::drop`).
        let code = unsafe {
            (self.lib.f.enqueue_nd_range_kernel)(
                self.queue,
                kernel.k,
                global.len() as u32,
                ptr::null(),
                global.as_ptr(),
                local.map_or(ptr::null(), <[usize]>::as_ptr),
                0,
                ptr::null(),
                ptr::null_mut(),
            )
        };
        if code != cl::CL_SUCCESS {
            return Err(ClError::Invalid(format!(
                "{}: clEnqueueNDRangeKernel: {} ({code})",
                kernel.name,
                code_name(code)
            )));
        }
        self.counters.kernels.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Calls `done` (on a thread of the runtime's) once everything enqueued so far has run, with
    /// the queue's status: Ok, or the error code of a command that failed. Does not wait.
    pub fn on_done(&self, done: Box<dyn FnOnce(Result<(), i32>) + Send>) -> Result<(), ClError> {
        let mut ev: cl::cl_event = ptr::null_mut();
        // SAFETY: a marker after all earlier commands of this in-order queue; `ev` receives it.
        check("clEnqueueMarkerWithWaitList", unsafe {
            (self.lib.f.enqueue_marker_with_wait_list)(self.queue, 0, ptr::null(), &mut ev)
        })?;
        let user: *mut Box<dyn FnOnce(Result<(), i32>) + Send> = Box::into_raw(Box::new(done));
        // SAFETY: `notify` takes back the box exactly once: the runtime calls it once for
        // CL_COMPLETE (or an error status, which also ends the event).
        let code = unsafe { (self.lib.f.set_event_callback)(ev, cl::CL_COMPLETE, Some(notify), user.cast()) };
        if code != cl::CL_SUCCESS {
            // SAFETY: the callback was not registered: the box is still ours; the event too.
            unsafe {
                drop(Box::from_raw(user));
                (self.lib.f.release_event)(ev);
            }
            return Err(ClError::Call { call: "clSetEventCallback", code });
        }
        // SAFETY: the callback holds no reference of ours to the event; releasing our
        // reference leaves the runtime's own until it completes.
        unsafe { (self.lib.f.release_event)(ev) };
        // SAFETY: submits the queue's commands to the device (no wait).
        check("clFlush", unsafe { (self.lib.f.flush)(self.queue) })
    }

    /// Waits for everything enqueued (a host wait).
    pub fn finish(&self) -> Result<(), ClError> {
        self.counters.host_waits.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the context's own queue.
        check("clFinish", unsafe { (self.lib.f.finish)(self.queue) })
    }

    /// Builds `source` for this device with `options`; the build log on failure.
    pub fn program_from_source(self: &Arc<Self>, source: &str, options: &str) -> Result<Program, ClError> {
        let src = CString::new(source).map_err(|_| ClError::Invalid("a NUL byte in the OpenCL source".into()))?;
        let mut ptrs = [src.as_ptr()];
        let lens = [source.len()];
        let mut err = 0;
        // SAFETY: one string of `lens[0]` bytes, alive for the call (the runtime copies it).
        let prog =
            unsafe { (self.lib.f.create_program_with_source)(self.ctx, 1, ptrs.as_mut_ptr(), lens.as_ptr(), &mut err) };
        check("clCreateProgramWithSource", err)?;
        let p = Program { ctx: self.clone(), prog };
        p.build(options)?;
        Ok(p)
    }

    /// Loads a binary that [`Program::binary`] gave on this device and driver, and builds it.
    pub fn program_from_binary(self: &Arc<Self>, binary: &[u8], options: &str) -> Result<Program, ClError> {
        let lens = [binary.len()];
        let mut ptrs = [binary.as_ptr()];
        let mut status = 0;
        let mut err = 0;
        // SAFETY: one device, one binary of `lens[0]` bytes alive for the call (copied).
        let prog = unsafe {
            (self.lib.f.create_program_with_binary)(
                self.ctx,
                1,
                &self.device.device,
                lens.as_ptr(),
                ptrs.as_mut_ptr(),
                &mut status,
                &mut err,
            )
        };
        check("clCreateProgramWithBinary", err)?;
        let p = Program { ctx: self.clone(), prog };
        check("clCreateProgramWithBinary (binary status)", status)?;
        p.build(options)?;
        Ok(p)
    }
}

/// Host bytes shared with a device (a buffer over them used in place): they must not move or
/// change while any clone of the `Arc` lives — an immutable buffer the owner never reallocates,
/// such as a mapped file or a matrix packed once at load.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A buffer.
pub struct Mem {
    ctx: Arc<Context>,
    mem: cl::cl_mem,
    len: usize,
    /// The host memory a [`Context::buffer_shared`] buffer uses (dropped after the release:
    /// fields drop after `Drop::drop`).
    _keep: Option<SharedBytes>,
}

// SAFETY: a cl_mem is a runtime object usable from any thread; released once, in Drop.
unsafe impl Send for Mem {}
// SAFETY: as above; `&Mem` only hands its id to thread-safe entry points.
unsafe impl Sync for Mem {}

impl Mem {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mem").field("len", &self.len).finish()
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        if self._keep.is_some() {
            // The runtime may still run commands that read this buffer after the release,
            // and the host memory goes with `_keep`: wait for the queue first (weights are
            // dropped at unload, not per token). A failed wait leaks the memory rather than
            // free it under a running kernel.
            // SAFETY: the context's own queue.
            let done = unsafe { (self.ctx.lib.f.finish)(self.ctx.queue) };
            if done != cl::CL_SUCCESS {
                std::mem::forget(self._keep.take());
            }
        }
        // SAFETY: released once. The runtime keeps a memory object alive until the commands
        // enqueued with it have run (OpenCL 1.2 §5.4.1: clReleaseMemObject defers the delete).
        unsafe { (self.ctx.lib.f.release_mem_object)(self.mem) };
    }
}

/// A built program.
pub struct Program {
    ctx: Arc<Context>,
    prog: cl::cl_program,
}

// SAFETY: a built program is a runtime object usable from any thread; released once, in Drop.
unsafe impl Send for Program {}
// SAFETY: as above.
unsafe impl Sync for Program {}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: released once; kernels made from it hold their own reference in the runtime.
        unsafe { (self.ctx.lib.f.release_program)(self.prog) };
    }
}

impl Program {
    fn build(&self, options: &str) -> Result<(), ClError> {
        let opts = CString::new(options).map_err(|_| ClError::Invalid("a NUL byte in the build options".into()))?;
        // SAFETY: builds for the context's one device; options NUL-terminated; no callback.
        let code = unsafe {
            (self.ctx.lib.f.build_program)(self.prog, 1, &self.ctx.device.device, opts.as_ptr(), None, ptr::null_mut())
        };
        if code == cl::CL_SUCCESS {
            return Ok(());
        }
        let log = self.build_log().unwrap_or_default();
        Err(ClError::Build { log: format!("{} ({code}); {}", code_name(code), log.trim()) })
    }

    fn build_log(&self) -> Result<String, ClError> {
        let f = &self.ctx.lib.f;
        let dev = self.ctx.device.device;
        let mut len = 0usize;
        // SAFETY: size query.
        check("clGetProgramBuildInfo", unsafe {
            (f.get_program_build_info)(self.prog, dev, cl::CL_PROGRAM_BUILD_LOG, 0, ptr::null_mut(), &mut len)
        })?;
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is `len` bytes.
        check("clGetProgramBuildInfo", unsafe {
            (f.get_program_build_info)(
                self.prog,
                dev,
                cl::CL_PROGRAM_BUILD_LOG,
                len,
                buf.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        })?;
        Ok(c_string(&buf))
    }

    /// The program's binary for its one device (for a cache keyed by device and driver).
    pub fn binary(&self) -> Result<Vec<u8>, ClError> {
        let f = &self.ctx.lib.f;
        let mut size = 0usize;
        // SAFETY: one device: one size_t.
        check("clGetProgramInfo", unsafe {
            (f.get_program_info)(
                self.prog,
                cl::CL_PROGRAM_BINARY_SIZES,
                size_of::<usize>(),
                (&mut size as *mut usize).cast(),
                ptr::null_mut(),
            )
        })?;
        let mut bin = vec![0u8; size];
        let mut ptrs = [bin.as_mut_ptr()];
        // SAFETY: one device: one pointer, to `size` bytes.
        check("clGetProgramInfo", unsafe {
            (f.get_program_info)(
                self.prog,
                cl::CL_PROGRAM_BINARIES,
                size_of::<*mut u8>(),
                ptrs.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        })?;
        Ok(bin)
    }

    /// The kernel named `name`.
    pub fn kernel(&self, name: &str) -> Result<Kernel, ClError> {
        let n = CString::new(name).map_err(|_| ClError::Invalid("a NUL byte in a kernel name".into()))?;
        let mut err = 0;
        // SAFETY: a built program and a NUL-terminated name.
        let k = unsafe { (self.ctx.lib.f.create_kernel)(self.prog, n.as_ptr(), &mut err) };
        if err != cl::CL_SUCCESS {
            return Err(ClError::Invalid(format!("kernel {name}: {} ({err})", code_name(err))));
        }
        Ok(Kernel { ctx: self.ctx.clone(), k, name: name.to_string(), args: Mutex::new(()) })
    }
}

/// A kernel; [`Context::enqueue`] sets its arguments and enqueues it under its own lock.
pub struct Kernel {
    ctx: Arc<Context>,
    k: cl::cl_kernel,
    name: String,
    args: Mutex<()>,
}

// SAFETY: a kernel object may be used from any thread as long as setting its arguments and
// enqueueing it are not interleaved between threads (OpenCL 1.2 §A.2); `args` serialises that.
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: released once; enqueued launches keep their own reference in the runtime.
        unsafe { (self.ctx.lib.f.release_kernel)(self.k) };
    }
}

/// The event callback: takes back the box `Context::on_done` made and calls it once.
unsafe extern "C" fn notify(_ev: cl::cl_event, status: cl::cl_int, user: *mut c_void) {
    // SAFETY: `user` is the pointer `on_done` made with Box::into_raw, and the runtime calls
    // this once per registration.
    let done = unsafe { Box::from_raw(user.cast::<Box<dyn FnOnce(Result<(), i32>) + Send>>()) };
    done(if status == cl::CL_COMPLETE { Ok(()) } else { Err(status) });
}

/// The variable that makes kernel enqueues fail after a count (see the crate's doc).
pub const FAIL_AFTER_ENV: &str = "LLMD_OPENCL_FAIL_AFTER";

/// `LLMD_OPENCL_FAIL_AFTER`, read once.
fn fail_after() -> Option<u64> {
    static N: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var(FAIL_AFTER_ENV).ok().and_then(|v| v.trim().parse().ok()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let e = Library::open(Some(Path::new("/nonexistent/libOpenCL.so"))).unwrap_err();
        assert!(matches!(&e, ClError::Load { path, .. } if path == "/nonexistent/libOpenCL.so"), "{e}");
    }

    #[test]
    fn a_library_without_opencl_is_refused_by_symbol() {
        // libc opens but exports no OpenCL entry point.
        let e = Library::open(Some(Path::new("libc.so.6"))).unwrap_err();
        assert!(matches!(e, ClError::Symbol { symbol: "clGetPlatformIDs", .. }), "{e}");
    }
}
