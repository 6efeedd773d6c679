//! The GPU behind the device contract, through OpenCL (`opencl-rt-sys`, loaded at run time:
//! the vendor's `libOpenCL.so` on a phone, PoCL or another ICD runtime on a host).
//!
//! - **Weights**: on a device whose memory is the host's (a phone's GPU, PoCL) the kernels read
//!   the CPU's own copy in place — its packed tiles ([`Layout::Tiles`]: Q4_0, Q4_1, Q8_0,
//!   Q2_K–Q6_K; Q5_0/Q5_1 as the Q8_0 tiles the CPU converted them to) or the mapped file's
//!   rows ([`Layout::Rows`]: F32, F16) — through `CL_MEM_USE_HOST_PTR` buffers, so a weight is
//!   in memory once (as far as the driver honours the flag: that is its own business). A
//!   device with memory of its own gets a copy, uploaded once: the tiles, or the file's rows
//!   (GGUF's F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K). The kernels dequantize 32
//!   values at a time. (A tied embedding and output head is loaded once: the engine's executor
//!   hands the same [`Weight`] to both subgraphs.)
//! - **Subgraphs** (the embedding, each layer's attention and FFN, the head) are chains of
//!   kernels on one in-order queue: RMSNorm, the matmuls (bias and residual add fused in),
//!   RoPE, the KV store, attention over the f16 KV cache with grouped-query heads, SwiGLU.
//!   No kernel waits for the host and the host waits for none: a submission returns an
//!   [`Event`] signalled by the runtime's callback, and the one host wait of a decode step is
//!   the logits' read-back.
//! - **The KV cache** of a layer and sequence is one device buffer ([`BufferUsage::Kv`]): f16
//!   keys `[ctx][kv_dim]`, then the values.
//! - **The program** (`kernels/llmd.cl`, embedded) is built once per device and driver and
//!   cached as a program binary ([`program`]).
//!
//! Decisions (docs/DECISIONS.md): a portable baseline (OpenCL C 1.2, fp32 arithmetic, f16
//! storage through `vload_half`), which every runtime here and every phone GPU runs, and the
//! matmul in three shapes chosen from the device's capabilities ([`MatmulVariant`]: by
//! work-group, by work-item, by subgroup where `cl_intel_subgroups` or Qualcomm's
//! `cl_qcom_reqd_sub_group_size` fixes a subgroup's size), and the fp16 variant where the
//! device has `cl_khr_fp16` ([`GpuOptions::fp16`]); image-backed weights and integer dot
//! products are not built.

pub mod check;
pub mod program;

use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Device, DeviceDesc, DeviceError, DeviceId, Event, Executable, GgmlType,
    HostLayout, HostWeight, MemoryDesc, MemoryKind, OpKind, Processor, StaticShapes, Subgraph, SubgraphKind, Weight,
    WeightRole,
};
use opencl_rt_sys::{Access, Arg, ClError, Context, DeviceInfo, Kernel, Library, Mem};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use opencl_rt_sys::{ClError as OpenClError, Stats};
pub use program::Origin;

/// The Snapdragon 8 Gen 3 GPU's (Adreno 750) memory bandwidth in decode: 43.3 GB/s, measured
/// by HeteroLLM (§5.3, GPU-only PPL-OpenCL decode; `soc-profiles.toml`
/// `snapdragon_8gen3.gpu.decode_bandwidth_gb_per_s`). Decode reads every weight once per token,
/// so this over the bytes a step reads models the phone's decode rate — a model from the
/// paper's number, not a measurement.
pub const SD8GEN3_GPU_DECODE_BYTES_PER_S: f64 = 43.3e9;

/// The weight types the kernels read.
pub const WEIGHT_TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

/// The weight types the kernels read in the CPU's tile layout ([`Layout::Tiles`]: the types
/// the CPU packs), as a host hands them over in place.
pub const TILE_TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// How a weight's bytes are laid out on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// The model file's rows (ggml's blocks).
    Rows,
    /// The CPU kernels' tiles of 16 rows (`backend::layout::packed`, `kpacked`), read where the
    /// host keeps them.
    Tiles,
}

/// A page: where a buffer over host memory starts when it can (Intel's GPUs avoid a copy only
/// for page-aligned host memory; every runtime here asks for less).
const PAGE: usize = 4096;

/// The kernel-name suffix of a weight type in the tile layout.
fn tile_suffix(t: GgmlType) -> Option<&'static str> {
    Some(match t {
        GgmlType::Q4_0 => "pq4_0",
        GgmlType::Q4_1 => "pq4_1",
        GgmlType::Q8_0 => "pq8_0",
        GgmlType::Q2_K => "pq2_k",
        GgmlType::Q3_K => "pq3_k",
        GgmlType::Q4_K => "pq4_k",
        GgmlType::Q5_K => "pq5_k",
        GgmlType::Q6_K => "pq6_k",
        _ => return None,
    })
}

/// Bytes of one tile of 16 rows of `cols` columns of `t` in the CPU's tile layout (the
/// kernels' `stride`), from the CPU's own record sizes.
pub fn tile_stride(t: GgmlType, cols: usize) -> Option<usize> {
    use crate::backend::layout::kpacked::{KKind, SB};
    use crate::backend::layout::packed::{PackKind, BLOCK};
    if let Some(k) = PackKind::of(t) {
        return cols.is_multiple_of(BLOCK).then(|| cols / BLOCK * k.record_bytes());
    }
    let k = KKind::of(t)?;
    cols.is_multiple_of(SB).then(|| cols / SB * k.record_bytes())
}

/// The kernel-name suffix of a weight type.
fn type_suffix(t: GgmlType) -> Option<&'static str> {
    Some(match t {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q6_K => "q6_k",
        _ => return None,
    })
}

/// Work-group size of the kernels (`-DLS`): 64, or the device's largest power of two below.
fn work_group(max: usize) -> usize {
    let mut ls = 64;
    while ls > 1 && ls > max {
        ls /= 2;
    }
    ls
}

/// How a matmul spreads over work-items.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulVariant {
    /// By the device: [`Self::Subgroup`] where the subgroup's size can be fixed, else
    /// [`Self::RowPerItem`] on a CPU device, else [`Self::GroupPerRow`].
    #[default]
    Auto,
    /// A work-group per weight row, its work-items splitting the row and summing in local
    /// memory (a GPU's many lanes on one row).
    GroupPerRow,
    /// A work-item per weight row, no local memory or barriers (PoCL: a CPU device runs each
    /// stretch between a work-group's barriers as a loop of its own; decode of the default
    /// model on PoCL here: 9.7 tok/s, against 4.0 with a work-group per row).
    RowPerItem,
    /// A subgroup per weight row, summed with `sub_group_reduce_add` (no local memory or
    /// barrier): needs `cl_intel_subgroups` (16 lanes) or `cl_qcom_reqd_sub_group_size` (64,
    /// Adreno's "half" wave; not run here).
    Subgroup,
}

/// The lanes of the subgroup variant on `dev`, if it can fix its subgroup's size.
pub fn subgroup_lanes(dev: &DeviceInfo) -> Option<usize> {
    if dev.has("cl_intel_subgroups") {
        Some(16)
    } else if dev.has("cl_qcom_reqd_sub_group_size") {
        Some(64)
    } else {
        None
    }
}

/// Which OpenCL library and device, and where program binaries are cached.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// The OpenCL library (None: the ICD loader's names, then a phone's vendor paths).
    pub library: Option<PathBuf>,
    /// Index into [`list_devices`] (None: the first GPU, else the first device).
    pub device: Option<usize>,
    /// Where program binaries are cached (None: built at every start).
    pub cache_dir: Option<PathBuf>,
    pub matmul: MatmulVariant,
    /// The fp16 variant (half weights and products in the matmul, `-DLLMD_FP16`): None picks
    /// it for a GPU with `cl_khr_fp16` (not for an OpenCL CPU device, where it buys nothing);
    /// `Some(true)` on a device without the extension is an error.
    pub fp16: Option<bool>,
    /// Take only a device of kind GPU (automatic placement: an OpenCL CPU device is no faster
    /// than the CPU path); `device` overrides it.
    pub gpu_only: bool,
}

/// Why the GPU cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    OpenCl(#[from] ClError),
    #[error("{library} lists no OpenCL device")]
    NoDevice { library: String },
    #[error("there is no OpenCL device {index}: {count} found")]
    NoSuchDevice { index: usize, count: usize },
    #[error("the kernels did not build on {device}: {source}")]
    Build { device: String, source: ClError },
    #[error("no OpenCL device is a GPU ({devices})")]
    NoGpu { devices: String },
}

/// Why `dev` is not a GPU, if it is not: an OpenCL runtime on the host's CPU (PoCL, Intel's CPU
/// runtime: no faster than llmd's CPU path). `backend = "auto"` takes none unless told to.
pub fn cpu_backed(dev: &DeviceInfo) -> Option<String> {
    if dev.kind != "GPU" {
        Some(format!("{} is an OpenCL device of kind {} ({})", dev.name, dev.kind, dev.platform))
    } else if dev.platform.contains("Portable Computing Language") {
        Some(format!("{} is PoCL's, which runs its kernels on the host's CPU", dev.name))
    } else {
        None
    }
}

/// Every device of the library's platforms.
pub fn list_devices(library: Option<&Path>) -> Result<(Arc<Library>, Vec<DeviceInfo>), GpuError> {
    let lib = Library::open(library)?;
    let devs = lib.devices()?;
    Ok((lib, devs))
}

struct Kernels {
    matmul: HashMap<(GgmlType, Layout), Kernel>,
    /// Which variant `matmul` holds (never `Auto`).
    variant: MatmulVariant,
    /// The work-group size of the subgroup variant (one subgroup).
    lanes: usize,
    get_rows: HashMap<(GgmlType, Layout), Kernel>,
    rms_norm: Kernel,
    rope: Kernel,
    kv_store: Kernel,
    attention: Kernel,
    swiglu: Kernel,
}

/// A device buffer behind a contract [`Buffer`].
struct GpuBuf(Mem);

/// A weight on the device.
struct GpuWeight {
    mem: Mem,
    ty: GgmlType,
    layout: Layout,
    rows: usize,
    cols: usize,
    /// Bytes from one row to the next ([`Layout::Rows`]) or one tile of 16 rows to the next
    /// ([`Layout::Tiles`]): the kernels' `stride`.
    stride: usize,
    /// The buffer is the host's own memory (no copy).
    in_place: bool,
    /// Where the weight starts in the buffer (a buffer over the host's memory starts on the
    /// device's alignment; the weight may start after it), and its bytes.
    offset: usize,
    bytes: usize,
}

impl GpuWeight {
    fn key(&self) -> (GgmlType, Layout) {
        (self.ty, self.layout)
    }
}

/// A prepared subgraph: its weights and shape (the kernels are chosen at submit).
struct Plan {
    sg: Subgraph,
    shape: BlockShape,
    n: usize,
    weights: Vec<(WeightRole, Weight)>,
}

#[derive(Default)]
struct State {
    /// Intermediate buffers by name, grown as passes need (one queue: reused in order).
    scratch: HashMap<&'static str, Mem>,
    /// The pass's token ids and positions on the device (uploaded once per pass: the
    /// executor hands every subgraph the same `Arc`s).
    tokens: Option<(Arc<[u32]>, Mem)>,
    positions: Option<(Arc<[u32]>, Mem)>,
    /// Events of submissions not yet known to be done.
    pending: Vec<Event>,
}

/// An OpenCL device as an llmd [`Device`].
pub struct GpuDevice {
    id: DeviceId,
    desc: DeviceDesc,
    info: DeviceInfo,
    ctx: Arc<Context>,
    k: Kernels,
    ls: usize,
    origin: Origin,
    cache_file: Option<PathBuf>,
    /// A 4-byte buffer bound where a kernel takes an optional one (no bias, no map).
    dummy: Mem,
    /// Built with the fp16 variant.
    fp16: bool,
    /// Weight matrices' bytes loaded since the device was opened: used in place in the host's
    /// memory, and copied.
    weights_in_place: AtomicU64,
    weights_copied: AtomicU64,
    state: Mutex<State>,
}

fn cl_err(device: &str) -> impl Fn(ClError) -> DeviceError + '_ {
    move |e| DeviceError::Execution { device: device.to_string(), detail: e.to_string() }
}

impl GpuDevice {
    /// Opens the library, picks the device and builds (or loads) the kernels.
    pub fn open(opts: &GpuOptions) -> Result<Self, GpuError> {
        let (lib, devs) = list_devices(opts.library.as_deref())?;
        if devs.is_empty() {
            return Err(GpuError::NoDevice { library: lib.path().to_string() });
        }
        let info = match opts.device {
            Some(i) => devs.get(i).cloned().ok_or(GpuError::NoSuchDevice { index: i, count: devs.len() })?,
            None => match devs.iter().find(|d| d.kind == "GPU") {
                Some(d) => d.clone(),
                None if opts.gpu_only => {
                    let list: Vec<String> = devs.iter().map(|d| format!("{}: {}", d.name, d.kind)).collect();
                    return Err(GpuError::NoGpu { devices: list.join(", ") });
                }
                None => devs[0].clone(),
            },
        };
        let ctx = Context::new(&lib, &info)?;
        let ls = work_group(info.max_work_group);
        let lanes = subgroup_lanes(&info);
        let variant = match (opts.matmul, lanes) {
            (MatmulVariant::Auto, Some(_)) => MatmulVariant::Subgroup,
            (MatmulVariant::Auto, None) if info.kind == "CPU" => MatmulVariant::RowPerItem,
            (MatmulVariant::Auto, None) => MatmulVariant::GroupPerRow,
            (MatmulVariant::Subgroup, None) => {
                return Err(GpuError::Build {
                    device: info.name.clone(),
                    source: ClError::Invalid(
                        "the subgroup matmul needs cl_intel_subgroups or cl_qcom_reqd_sub_group_size".into(),
                    ),
                })
            }
            (v, _) => v,
        };
        let has_fp16 = info.has("cl_khr_fp16");
        let fp16 = match opts.fp16 {
            None => has_fp16 && info.kind == "GPU",
            Some(true) if !has_fp16 => {
                return Err(GpuError::Build {
                    device: info.name.clone(),
                    source: ClError::Invalid("the fp16 variant needs cl_khr_fp16".into()),
                })
            }
            Some(on) => on,
        };
        // The subgroup and fp16 kernels are compiled only where they can be (the program is
        // cached per options, so each device keeps its own).
        let mut options = format!("-cl-std=CL1.2 -DLS={ls}");
        if let Some(sg) = lanes {
            options += &format!(" -DLLMD_SUBGROUPS -DSG={sg}");
        }
        if fp16 {
            options += " -DLLMD_FP16";
        }
        let build_err = |source| GpuError::Build { device: info.name.clone(), source };
        let (prog, origin) = program::load(&ctx, &info, &options, opts.cache_dir.as_deref()).map_err(build_err)?;
        let kernel = |name: &str| prog.kernel(name).map_err(build_err);
        let mut matmul = HashMap::new();
        let mut get_rows = HashMap::new();
        let rows = WEIGHT_TYPES.iter().map(|&t| (t, Layout::Rows, type_suffix(t)));
        let tiles = TILE_TYPES.iter().map(|&t| (t, Layout::Tiles, tile_suffix(t)));
        for (t, layout, s) in rows.chain(tiles) {
            let s = s.unwrap_or_default();
            let name = match variant {
                MatmulVariant::RowPerItem => format!("matmul_rows_{s}"),
                MatmulVariant::Subgroup => format!("matmul_sg_{s}"),
                _ => format!("matmul_{s}"),
            };
            matmul.insert((t, layout), kernel(&name)?);
            get_rows.insert((t, layout), kernel(&format!("get_rows_{s}"))?);
        }
        let k = Kernels {
            matmul,
            variant,
            lanes: lanes.unwrap_or(1),
            get_rows,
            rms_norm: kernel("rms_norm")?,
            rope: kernel("rope")?,
            kv_store: kernel("kv_store")?,
            attention: kernel("attention")?,
            swiglu: kernel("swiglu")?,
        };
        let dummy = ctx.buffer(Access::ReadWrite, 4)?;
        let desc = DeviceDesc {
            name: format!("gpu:{}", info.name),
            processor: Processor::Gpu,
            available: true,
            ops: vec![
                OpKind::GetRows,
                OpKind::MatMul,
                OpKind::RmsNorm,
                OpKind::Rope,
                OpKind::Attention,
                OpKind::SwiGlu,
            ],
            weight_types: {
                let mut v = WEIGHT_TYPES.to_vec();
                v.extend(TILE_TYPES.iter().filter(|t| !WEIGHT_TYPES.contains(t)));
                v
            },
            static_shapes: StaticShapes::Any,
            memory: MemoryDesc {
                kind: if info.host_unified_memory { MemoryKind::Unified } else { MemoryKind::Dedicated },
                capacity: Some(info.global_mem),
            },
            max_tokens: None,
            threads: info.compute_units as usize,
        };
        let cache_file = opts.cache_dir.as_deref().map(|d| program::cache_path(d, &info, &options));
        Ok(Self {
            id: DeviceId::fresh(),
            desc,
            info,
            ctx,
            k,
            ls,
            origin,
            cache_file,
            dummy,
            fp16,
            weights_in_place: AtomicU64::new(0),
            weights_copied: AtomicU64::new(0),
            state: Mutex::default(),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Where the kernels' program came from (built, or the cache) and how long it took.
    pub fn program_origin(&self) -> &Origin {
        &self.origin
    }

    pub fn cache_file(&self) -> Option<&Path> {
        self.cache_file.as_deref()
    }

    /// The kernel variants in use: the portable baseline or fp16, the matmul spread by
    /// work-group, work-item or subgroup.
    pub fn variants(&self) -> Vec<&'static str> {
        vec![
            if self.fp16 {
                "fp16 (cl_khr_fp16): weights dequantized to half, half dot products of four summed in f32; activations, norms, attention f32"
            } else {
                "baseline: OpenCL C 1.2, fp32 math, f16 storage (vload_half)"
            },
            match self.k.variant {
                MatmulVariant::RowPerItem => "matmul: a work-item per weight row (CPU device)",
                MatmulVariant::Subgroup => "matmul: a subgroup per weight row, summed by sub_group_reduce_add",
                _ => "matmul: a work-group per weight row, summed in local memory",
            },
        ]
    }

    /// Whether the fp16 variant was built.
    pub fn fp16(&self) -> bool {
        self.fp16
    }

    /// The matmul variant in use.
    pub fn matmul_variant(&self) -> MatmulVariant {
        self.k.variant
    }

    /// Work-group size of the kernels.
    pub fn work_group(&self) -> usize {
        self.ls
    }

    /// Weight matrices' bytes loaded since the device was opened: (read in place in the host's
    /// memory, copied into buffers of the device's); vectors (norms, biases: always copied)
    /// are not counted. On shared memory the first is the CPU's own copy: the weights are in
    /// memory once.
    pub fn weight_bytes(&self) -> (u64, u64) {
        (self.weights_in_place.load(Ordering::Relaxed), self.weights_copied.load(Ordering::Relaxed))
    }

    /// Kernels enqueued, host waits and bytes moved since the device was opened.
    pub fn stats(&self) -> Stats {
        self.ctx.stats()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn err(&self, detail: impl Into<String>) -> DeviceError {
        DeviceError::Invalid { device: self.desc.name.clone(), detail: detail.into() }
    }

    fn exec(&self) -> impl Fn(ClError) -> DeviceError + '_ {
        cl_err(&self.desc.name)
    }

    /// `rows` of `w` from the host's own copy, if it has one this device reads: its CPU tiles
    /// (in place where the device shares the host's memory and the tiles start on the device's
    /// alignment, else copied), or the file's rows in place on shared memory. None: load
    /// `w.data` instead.
    fn host_weight(&self, w: &HostWeight<'_>, rows: &Range<usize>) -> Result<Option<GpuWeight>, DeviceError> {
        let Some(h) = w.host else { return Ok(None) };
        let bytes = h.weight_bytes();
        let shared = self.info.host_unified_memory;
        let ty = h.ty;
        let (layout, stride, range) = match h.layout {
            HostLayout::CpuTiles => {
                // A range of rows must be whole tiles (a row split at a multiple of 16). The
                // tiles' type may be one the host converted to (Q5_0, Q5_1 → Q8_0).
                let Some(stride) = tile_stride(ty, w.cols) else { return Ok(None) };
                if !rows.start.is_multiple_of(16) || !(rows.end.is_multiple_of(16) || rows.end == w.rows) {
                    return Ok(None);
                }
                if bytes.len() != w.rows.div_ceil(16) * stride {
                    return Err(self.err(format!(
                        "{:?}: {} bytes of tiles for {} × {} {}",
                        w.role,
                        bytes.len(),
                        w.rows,
                        w.cols,
                        ty
                    )));
                }
                (Layout::Tiles, stride, rows.start / 16 * stride..rows.end.div_ceil(16) * stride)
            }
            HostLayout::Rows => {
                let Some(rb) = w.ty.row_bytes(w.cols) else { return Ok(None) };
                if !shared || ty != w.ty || type_suffix(ty).is_none() || bytes.len() != w.rows * rb {
                    return Ok(None);
                }
                (Layout::Rows, rb, rows.start * rb..rows.end * rb)
            }
        };
        if range.is_empty() {
            return Ok(None);
        }
        // A device with memory of its own takes a copy: of the tiles only where they are the
        // weight's own type (Q5_0/Q5_1 tiles are a lossy Q8_0 conversion, larger than the
        // file's rows).
        if !shared && ty != w.ty && !w.data.is_empty() {
            return Ok(None);
        }
        // In place: a buffer from the page (else the device's alignment) at or before the
        // weight's first byte, within what the host shared, its length rounded up to 64 bytes
        // where the host's bytes go on (drivers that copy short of those). The kernels are
        // told how far in the weight starts. A driver that refuses the host memory (read-only
        // file pages, say) gets a copy instead.
        if shared {
            let all: &[u8] = h.bytes.as_ref().as_ref();
            let first = h.offset + range.start;
            let addr = all.as_ptr() as usize + first;
            let back = [PAGE, self.info.base_align]
                .into_iter()
                .map(|a| addr % a.max(1))
                .find(|&b| b <= first)
                .filter(|b| (addr - b).is_multiple_of(self.info.base_align.max(1)));
            if let Some(back) = back {
                let end = (h.offset + range.end).next_multiple_of(64).min(all.len());
                match self.ctx.buffer_shared(h.bytes.clone(), first - back..end) {
                    Ok(mem) => {
                        let (rows, cols) = (rows.len(), w.cols);
                        let bytes = range.len();
                        return Ok(Some(GpuWeight {
                            mem,
                            ty,
                            layout,
                            rows,
                            cols,
                            stride,
                            in_place: true,
                            offset: back,
                            bytes,
                        }));
                    }
                    Err(e) => {
                        tracing::info!(device = %self.desc.name, role = ?w.role, error = %e, "host memory refused; copying")
                    }
                }
            }
        }
        if layout == Layout::Rows {
            return Ok(None);
        }
        let oom = |e: ClError| DeviceError::OutOfMemory {
            device: format!("{}: {e}", self.desc.name),
            usage: BufferUsage::Weights,
            bytes: range.len(),
        };
        let mem = self.ctx.buffer_from(Access::ReadOnly, &bytes[range.clone()], shared).map_err(oom)?;
        Ok(Some(GpuWeight {
            mem,
            ty,
            layout,
            rows: rows.len(),
            cols: w.cols,
            stride,
            in_place: false,
            offset: 0,
            bytes: range.len(),
        }))
    }

    /// Scratch buffer `name` of at least `bytes`.
    fn ensure(&self, st: &mut State, name: &'static str, bytes: usize) -> Result<(), DeviceError> {
        if st.scratch.get(name).is_none_or(|m| m.len() < bytes) {
            let m = self.ctx.buffer(Access::ReadWrite, bytes).map_err(|e| DeviceError::OutOfMemory {
                device: format!("{}: {e}", self.desc.name),
                usage: BufferUsage::Activations,
                bytes,
            })?;
            st.scratch.insert(name, m);
        }
        Ok(())
    }

    /// The pass's `which` ids (tokens or positions) on the device.
    fn upload_ids(&self, st: &mut State, ids: &Arc<[u32]>, positions: bool) -> Result<(), DeviceError> {
        let slot = if positions { &mut st.positions } else { &mut st.tokens };
        if slot.as_ref().is_some_and(|(a, _)| Arc::ptr_eq(a, ids)) {
            return Ok(());
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = self.ctx.buffer_from(Access::ReadOnly, &bytes, false).map_err(self.exec())?;
        *slot = Some((ids.clone(), m));
        Ok(())
    }

    fn matmul(
        &self,
        w: &GpuWeight,
        x: &Mem,
        y: &Mem,
        n: usize,
        accumulate: bool,
        bias: Option<&GpuWeight>,
    ) -> Result<(), DeviceError> {
        let k = self.k.matmul.get(&w.key()).ok_or_else(|| self.err(format!("no matmul for {}", w.ty)))?;
        if x.len() < n * w.cols * 4 || y.len() < n * w.rows * 4 || bias.is_some_and(|b| b.cols != w.rows) {
            return Err(self.err(format!("matmul {}×{} over {n} rows: buffers too small", w.rows, w.cols)));
        }
        let args = [
            Arg::Mem(&w.mem),
            Arg::U32(w.offset as u32),
            Arg::U32(w.stride as u32),
            Arg::U32(w.cols as u32),
            Arg::Mem(x),
            Arg::Mem(y),
            Arg::U32(n as u32),
            Arg::U32(w.rows as u32),
            Arg::U32(accumulate as u32),
            Arg::Mem(bias.map_or(&self.dummy, |b| &b.mem)),
            Arg::U32(bias.is_some() as u32),
        ];
        match self.k.variant {
            MatmulVariant::RowPerItem => {
                let global = w.rows.div_ceil(self.ls) * self.ls;
                return self.ctx.enqueue(k, &args, &[global], Some(&[self.ls])).map_err(self.exec());
            }
            MatmulVariant::Subgroup => {
                let lanes = self.k.lanes;
                return self.ctx.enqueue(k, &args, &[w.rows * lanes], Some(&[lanes])).map_err(self.exec());
            }
            _ => {}
        }
        self.ctx.enqueue(k, &args, &[w.rows * self.ls], Some(&[self.ls])).map_err(self.exec())
    }

    fn rms_norm(
        &self,
        x: &Mem,
        out: &Mem,
        w: &GpuWeight,
        rows: usize,
        eps: f32,
        map: Option<&Mem>,
    ) -> Result<(), DeviceError> {
        let args = [
            Arg::Mem(x),
            Arg::Mem(out),
            Arg::Mem(&w.mem),
            Arg::U32(w.cols as u32),
            Arg::F32(eps),
            Arg::Mem(map.unwrap_or(&self.dummy)),
            Arg::U32(map.is_some() as u32),
        ];
        self.ctx.enqueue(&self.k.rms_norm, &args, &[rows * self.ls], Some(&[self.ls])).map_err(self.exec())
    }

    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &Mem,
        pos: &Mem,
        n: usize,
        p: &llmd_device::RopeParams,
        ff: Option<&GpuWeight>,
    ) -> Result<(), DeviceError> {
        let half = p.rope_dims / 2;
        if ff.is_some_and(|f| f.cols < half) {
            return Err(self.err("fewer frequency factors than rotated pairs"));
        }
        let theta_scale = p.theta.powf(-2.0 / p.rope_dims as f32);
        let args = [
            Arg::Mem(x),
            Arg::Mem(pos),
            Arg::U32(p.n_heads as u32),
            Arg::U32(p.head_dim as u32),
            Arg::U32(p.rope_dims as u32),
            Arg::F32(theta_scale),
            Arg::F32(p.freq_scale),
            Arg::U32((p.style == llmd_device::RopeStyle::Neox) as u32),
            Arg::Mem(ff.map_or(&self.dummy, |f| &f.mem)),
            Arg::U32(ff.is_some() as u32),
        ];
        self.ctx.enqueue(&self.k.rope, &args, &[half, p.n_heads, n], None).map_err(self.exec())
    }

    fn swiglu(&self, g: &Mem, u: &Mem, len: usize) -> Result<(), DeviceError> {
        self.ctx.enqueue(&self.k.swiglu, &[Arg::Mem(g), Arg::Mem(u)], &[len], None).map_err(self.exec())
    }

    /// Stores rows `offset..offset + len` of `k`, `v` at positions `start..` of `cache` and
    /// runs their attention into `out`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        st: &mut State,
        s: &BlockShape,
        (q, k, v, out): (&Mem, &Mem, &Mem, &Mem),
        cache: &Mem,
        start: usize,
        len: usize,
        offset: usize,
    ) -> Result<(), DeviceError> {
        let kvd = s.kv_dim();
        let ctx_len = cache.len() / (4 * kvd);
        if start + len > ctx_len || s.n_kv_heads == 0 || !s.n_heads.is_multiple_of(s.n_kv_heads) {
            return Err(self.err(format!("{} positions in a KV buffer of {ctx_len}", start + len)));
        }
        let v_base = (ctx_len * kvd) as u32;
        let store = [
            Arg::Mem(k),
            Arg::Mem(v),
            Arg::Mem(cache),
            Arg::U32(kvd as u32),
            Arg::U32(v_base),
            Arg::U32(start as u32),
            Arg::U32(offset as u32),
        ];
        self.ctx.enqueue(&self.k.kv_store, &store, &[kvd, len], None).map_err(self.exec())?;
        let used = start + len;
        self.ensure(st, "scores", len * s.n_heads * used * 4)?;
        let scores = st.scratch.get("scores").ok_or_else(|| self.err("no score buffer"))?;
        let args = [
            Arg::Mem(q),
            Arg::Mem(cache),
            Arg::Mem(out),
            Arg::Mem(scores),
            Arg::U32(s.n_heads as u32),
            Arg::U32(s.n_kv_heads as u32),
            Arg::U32(s.head_dim as u32),
            Arg::U32(v_base),
            Arg::U32(start as u32),
            Arg::U32(offset as u32),
            Arg::U32(used as u32),
            Arg::F32(1.0 / (s.head_dim as f32).sqrt()),
        ];
        self.ctx
            .enqueue(&self.k.attention, &args, &[s.n_heads * self.ls, len], Some(&[self.ls, 1]))
            .map_err(self.exec())
    }

    fn buf<'a>(&self, b: &'a Buffer) -> Result<&'a Mem, DeviceError> {
        b.get::<GpuBuf>(self.id).map(|g| &g.0).ok_or_else(|| self.err("a buffer of another device"))
    }

    /// Enqueues one subgraph's kernels (the state locked: one submission at a time).
    fn enqueue_subgraph(&self, st: &mut State, p: &Plan, b: &Bindings) -> Result<(), DeviceError> {
        let s = &p.shape;
        let n = b.positions.len();
        let opt = |role: WeightRole| {
            p.weights.iter().find(|(r, _)| *r == role).and_then(|(_, w)| w.get::<GpuWeight>(self.id))
        };
        let w = |role: WeightRole| opt(role).ok_or_else(|| self.err(format!("{:?} has no {role:?} weight", p.sg)));
        let x = self.buf(&b.x)?;
        if let SubgraphKind::Linear(role) = p.sg.kind {
            let wt = w(role)?;
            let y = self.buf(b.y.as_ref().ok_or_else(|| self.err("a linear subgraph bound without y"))?)?;
            if x.len() < n * wt.cols * 4 || y.len() < n * wt.rows * 4 {
                return Err(self.err(format!(
                    "a {}×{} linear of {n} rows bound to x of {} bytes and y of {}",
                    wt.rows,
                    wt.cols,
                    x.len(),
                    y.len()
                )));
            }
            return self.matmul(wt, x, y, n, false, None);
        }
        if let SubgraphKind::Group(site) = p.sg.kind {
            // Each projection's rows in turn: the first straight into y, the others through a
            // scratch buffer copied to their place (the matmul kernels write from y's start).
            let y = self.buf(b.y.as_ref().ok_or_else(|| self.err("a linear group bound without y"))?)?;
            if std::ptr::eq(x, y) {
                // Its later projections would read what the first one wrote.
                return Err(self.err("a linear group bound to one buffer for its input and its outputs"));
            }
            let mut at = 0;
            for (i, &role) in site.roles().iter().enumerate() {
                let wt = w(role)?;
                let bytes = n * wt.rows * 4;
                if x.len() < n * wt.cols * 4 || y.len() < at + bytes {
                    return Err(self.err(format!(
                        "{:?} of {n} rows bound to x of {} bytes and y of {}",
                        p.sg,
                        x.len(),
                        y.len()
                    )));
                }
                if i == 0 {
                    self.matmul(wt, x, y, n, false, None)?;
                } else {
                    self.ensure(st, "group", bytes)?;
                    let g = st.scratch.get("group").ok_or_else(|| self.err("scratch"))?;
                    self.matmul(wt, x, g, n, false, None)?;
                    self.ctx.copy(g, 0, y, at, bytes).map_err(self.exec())?;
                }
                at += bytes;
            }
            return Ok(());
        }
        if x.len() < n * s.d_model * 4 {
            return Err(self.err(format!("x holds {} bytes, {n} rows need {}", x.len(), n * s.d_model * 4)));
        }
        match p.sg.kind {
            SubgraphKind::Embed => {
                let e = w(WeightRole::TokenEmbd)?;
                if b.tokens.iter().any(|&t| t as usize >= e.rows) {
                    return Err(self.err(format!("a token id past the vocabulary of {}", e.rows)));
                }
                self.upload_ids(st, &b.tokens, false)?;
                let tok = &st.tokens.as_ref().ok_or_else(|| self.err("no tokens"))?.1;
                let k = self.k.get_rows.get(&e.key()).ok_or_else(|| self.err(format!("no get_rows for {}", e.ty)))?;
                let args = [
                    Arg::Mem(&e.mem),
                    Arg::U32(e.offset as u32),
                    Arg::U32(e.stride as u32),
                    Arg::U32(e.cols as u32),
                    Arg::U32(e.rows as u32),
                    Arg::Mem(tok),
                    Arg::Mem(x),
                ];
                self.ctx.enqueue(k, &args, &[e.cols / 32, n], None).map_err(self.exec())
            }
            SubgraphKind::Attention => {
                let (qd, kvd) = (s.q_dim(), s.kv_dim());
                for (name, len) in [("h", s.d_model), ("q", qd), ("k", kvd), ("v", kvd), ("attn", qd)] {
                    self.ensure(st, name, n * len * 4)?;
                }
                self.upload_ids(st, &b.positions, true)?;
                let (wq, wk, wv, wo) = (w(WeightRole::Wq)?, w(WeightRole::Wk)?, w(WeightRole::Wv)?, w(WeightRole::Wo)?);
                let norm = w(WeightRole::AttnNorm)?;
                let (bq, bk, bv) = (opt(WeightRole::Bq), opt(WeightRole::Bk), opt(WeightRole::Bv));
                let ff = opt(WeightRole::RopeFreqs);
                let sc = |name: &str| st.scratch.get(name).ok_or_else(|| self.err("scratch"));
                let (h, q, k, v) = (sc("h")?, sc("q")?, sc("k")?, sc("v")?);
                self.rms_norm(x, h, norm, n, s.norm_eps, None)?;
                self.matmul(wq, h, q, n, false, bq)?;
                self.matmul(wk, h, k, n, false, bk)?;
                self.matmul(wv, h, v, n, false, bv)?;
                let pos = &st.positions.as_ref().ok_or_else(|| self.err("no positions"))?.1;
                self.rope(q, pos, n, &s.rope(s.n_heads), ff)?;
                self.rope(k, pos, n, &s.rope(s.n_kv_heads), ff)?;
                for seq in b.seqs.iter().filter(|q| q.len > 0) {
                    let kv =
                        seq.kv.as_ref().ok_or_else(|| self.err("an attention subgraph bound without a KV buffer"))?;
                    let cache = self.buf(kv)?;
                    self.attend_seq(st, s, cache, seq.start, seq.len, seq.offset)?;
                }
                let sc = |name: &str| st.scratch.get(name).ok_or_else(|| self.err("scratch"));
                self.matmul(wo, sc("attn")?, x, n, true, None)
            }
            SubgraphKind::Ffn => {
                let f = s.ffn_dim;
                for (name, len) in [("h", s.d_model), ("g", f), ("u", f)] {
                    self.ensure(st, name, n * len * 4)?;
                }
                let (norm, gate, up, down) =
                    (w(WeightRole::FfnNorm)?, w(WeightRole::Gate)?, w(WeightRole::Up)?, w(WeightRole::Down)?);
                let sc = |name: &str| st.scratch.get(name).ok_or_else(|| self.err("scratch"));
                let (h, g, u) = (sc("h")?, sc("g")?, sc("u")?);
                self.rms_norm(x, h, norm, n, s.norm_eps, None)?;
                self.matmul(gate, h, g, n, false, None)?;
                self.matmul(up, h, u, n, false, None)?;
                self.swiglu(g, u, n * f)?;
                self.matmul(down, g, x, n, true, None)
            }
            SubgraphKind::Head => {
                let rows = b.logit_rows.len();
                if rows == 0 {
                    return Ok(());
                }
                if b.logit_rows.iter().any(|&r| r as usize >= n) {
                    return Err(self.err("a logit row past the pass"));
                }
                let (norm, out) = (w(WeightRole::OutputNorm)?, w(WeightRole::Output)?);
                let logits = self.buf(b.logits.as_ref().ok_or_else(|| self.err("the head bound without logits"))?)?;
                if logits.len() < rows * out.rows * 4 {
                    return Err(self.err("the logits buffer is too small"));
                }
                self.ensure(st, "h", rows * s.d_model * 4)?;
                let map_bytes: Vec<u8> = b.logit_rows.iter().flat_map(|v| v.to_le_bytes()).collect();
                let map = self.ctx.buffer_from(Access::ReadOnly, &map_bytes, false).map_err(self.exec())?;
                let h = st.scratch.get("h").ok_or_else(|| self.err("scratch"))?;
                self.rms_norm(x, h, norm, rows, s.norm_eps, Some(&map))?;
                self.matmul(out, h, logits, rows, false, None)
            }
            SubgraphKind::Linear(_) | SubgraphKind::Group(_) => Err(self.err("a projection past its own path")),
            SubgraphKind::AttnQkv
            | SubgraphKind::AttnCore
            | SubgraphKind::AttnOut
            | SubgraphKind::FfnGateUp
            | SubgraphKind::FfnDown => self.enqueue_part(st, p, b, x),
        }
    }

    fn scratch<'a>(&self, st: &'a State, name: &str) -> Result<&'a Mem, DeviceError> {
        st.scratch.get(name).ok_or_else(|| self.err(format!("no scratch buffer {name}")))
    }

    /// One of a layer's parts: the whole blocks' kernels, cut where the parts meet, the
    /// intermediate tensors in the bound `h` and `y` (projections written into place through
    /// scratch, as a group's are).
    fn enqueue_part(&self, st: &mut State, p: &Plan, b: &Bindings, x: &Mem) -> Result<(), DeviceError> {
        let s = &p.shape;
        let n = b.positions.len();
        let opt = |role: WeightRole| {
            p.weights.iter().find(|(r, _)| *r == role).and_then(|(_, w)| w.get::<GpuWeight>(self.id))
        };
        let w = |role: WeightRole| opt(role).ok_or_else(|| self.err(format!("{:?} has no {role:?} weight", p.sg)));
        let (hw, yw) = p.sg.part_widths(s);
        let h = match (&b.h, hw) {
            (_, 0) => None,
            (Some(h), _) => Some(self.buf(h)?),
            (None, _) => return Err(self.err(format!("{:?} bound without h", p.sg))),
        };
        let y = match (&b.y, yw) {
            (_, 0) => None,
            (Some(y), _) => Some(self.buf(y)?),
            (None, _) => return Err(self.err(format!("{:?} bound without y", p.sg))),
        };
        if h.is_some_and(|h| h.len() < n * hw * 4 || std::ptr::eq(h, x) || y.is_some_and(|y| std::ptr::eq(h, y)))
            || y.is_some_and(|y| y.len() < n * yw * 4 || std::ptr::eq(x, y))
        {
            return Err(self.err(format!("{:?} of {n} rows: h or y too small, or one buffer bound twice", p.sg)));
        }
        let (qd, kvd, f) = (s.q_dim(), s.kv_dim(), s.ffn_dim);
        match (p.sg.kind, h, y) {
            (SubgraphKind::AttnQkv, _, Some(y)) => {
                self.ensure(st, "h", n * s.d_model * 4)?;
                self.ensure(st, "group", n * kvd * 4)?;
                let (hn, g) = (self.scratch(st, "h")?, self.scratch(st, "group")?);
                self.rms_norm(x, hn, w(WeightRole::AttnNorm)?, n, s.norm_eps, None)?;
                self.matmul(w(WeightRole::Wq)?, hn, y, n, false, opt(WeightRole::Bq))?;
                for (i, (role, bias)) in
                    [(WeightRole::Wk, WeightRole::Bk), (WeightRole::Wv, WeightRole::Bv)].into_iter().enumerate()
                {
                    self.matmul(w(role)?, hn, g, n, false, opt(bias))?;
                    self.ctx.copy(g, 0, y, n * (qd + i * kvd) * 4, n * kvd * 4).map_err(self.exec())?;
                }
                Ok(())
            }
            (SubgraphKind::AttnCore, Some(h), Some(y)) => {
                for (name, len) in [("q", qd), ("k", kvd), ("v", kvd), ("attn", qd)] {
                    self.ensure(st, name, n * len * 4)?;
                }
                self.upload_ids(st, &b.positions, true)?;
                // The queries, keys and values out of `h` (left as they are), rotated in scratch.
                for (name, at, len) in [("q", 0, qd), ("k", qd, kvd), ("v", qd + kvd, kvd)] {
                    self.ctx.copy(h, n * at * 4, self.scratch(st, name)?, 0, n * len * 4).map_err(self.exec())?;
                }
                let ff = opt(WeightRole::RopeFreqs);
                let pos = &st.positions.as_ref().ok_or_else(|| self.err("no positions"))?.1;
                self.rope(self.scratch(st, "q")?, pos, n, &s.rope(s.n_heads), ff)?;
                self.rope(self.scratch(st, "k")?, pos, n, &s.rope(s.n_kv_heads), ff)?;
                for seq in b.seqs.iter().filter(|q| q.len > 0) {
                    let kv =
                        seq.kv.as_ref().ok_or_else(|| self.err("an attention subgraph bound without a KV buffer"))?;
                    self.attend_seq(st, s, self.buf(kv)?, seq.start, seq.len, seq.offset)?;
                }
                self.ctx.copy(self.scratch(st, "attn")?, 0, y, 0, n * qd * 4).map_err(self.exec())
            }
            (SubgraphKind::AttnOut, Some(h), _) => self.matmul(w(WeightRole::Wo)?, h, x, n, true, None),
            (SubgraphKind::FfnGateUp, _, Some(y)) => {
                self.ensure(st, "h", n * s.d_model * 4)?;
                self.ensure(st, "u", n * f * 4)?;
                let (hn, u) = (self.scratch(st, "h")?, self.scratch(st, "u")?);
                self.rms_norm(x, hn, w(WeightRole::FfnNorm)?, n, s.norm_eps, None)?;
                self.matmul(w(WeightRole::Gate)?, hn, y, n, false, None)?;
                self.matmul(w(WeightRole::Up)?, hn, u, n, false, None)?;
                self.swiglu(y, u, n * f)
            }
            (SubgraphKind::FfnDown, Some(h), _) => self.matmul(w(WeightRole::Down)?, h, x, n, true, None),
            _ => Err(self.err(format!("{:?} is not a layer part", p.sg))),
        }
    }

    /// One sequence's KV store and attention, over the pass's q/k/v scratch.
    fn attend_seq(
        &self,
        st: &mut State,
        s: &BlockShape,
        cache: &Mem,
        start: usize,
        len: usize,
        offset: usize,
    ) -> Result<(), DeviceError> {
        let used = start + len;
        self.ensure(st, "scores", len * s.n_heads * used * 4)?;
        let take = |name: &'static str, st: &mut State| st.scratch.remove(name).ok_or_else(|| self.err("scratch"));
        let (q, k, v, attn) = (take("q", st)?, take("k", st)?, take("v", st)?, take("attn", st)?);
        let r = self.attend(st, s, (&q, &k, &v, &attn), cache, start, len, offset);
        for (name, m) in [("q", q), ("k", k), ("v", v), ("attn", attn)] {
            st.scratch.insert(name, m);
        }
        r
    }

    /// Waits for the events of `after` that are not this device's own (its queue orders
    /// those); the first failure among them.
    fn wait_foreign(&self, after: &[Event]) -> Result<(), DeviceError> {
        let pending = self.lock().pending.clone();
        for e in after {
            if e.state().is_none() && pending.iter().any(|p| p.same(e)) {
                continue;
            }
            e.wait()?;
        }
        Ok(())
    }
}

impl Device for GpuDevice {
    fn id(&self) -> DeviceId {
        self.id
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError> {
        let m = self.ctx.buffer(Access::ReadWrite, bytes).map_err(|e| DeviceError::OutOfMemory {
            device: format!("{}: {e}", self.desc.name),
            usage,
            bytes,
        })?;
        Ok(Buffer::new(self.id, usage, bytes, Arc::new(GpuBuf(m))))
    }

    fn write(&self, dst: &Buffer, offset: usize, src: &[u8], after: &[Event]) -> Result<Event, DeviceError> {
        self.wait_foreign(after)?;
        self.ctx.write(self.buf(dst)?, offset, src).map_err(self.exec())?;
        Ok(Event::ready(Ok(())))
    }

    fn read(&self, src: &Buffer, offset: usize, dst: &mut [u8], after: &[Event]) -> Result<(), DeviceError> {
        self.wait_foreign(after)?;
        self.ctx.read(self.buf(src)?, offset, dst).map_err(self.exec())
    }

    fn load_weight(&self, w: &HostWeight<'_>, rows: Range<usize>) -> Result<Weight, DeviceError> {
        let name = &self.desc.name;
        let is_vector = w.ty == GgmlType::F32 && w.rows == 1;
        if !is_vector && !w.cols.is_multiple_of(32) {
            return Err(DeviceError::Unsupported {
                device: name.clone(),
                what: format!("{:?}: rows of {} values (a multiple of 32 is needed)", w.role, w.cols),
            });
        }
        if rows.start > rows.end || rows.end > w.rows {
            return Err(self.err(format!("rows {rows:?} of {:?}'s {}", w.role, w.rows)));
        }
        if let Some(gw) = self.host_weight(w, &rows)? {
            let counter = if gw.in_place { &self.weights_in_place } else { &self.weights_copied };
            let bytes = gw.bytes;
            counter.fetch_add(bytes as u64, Ordering::Relaxed);
            return Ok(Weight::new(self.id, w.role, rows, w.cols, bytes, Arc::new(gw)));
        }
        if type_suffix(w.ty).is_none() {
            return Err(DeviceError::Unsupported { device: name.clone(), what: format!("{} weights", w.ty) });
        }
        let data = w.rows_bytes(rows.clone()).filter(|d| !d.is_empty() || rows.is_empty()).ok_or_else(|| {
            self.err(format!(
                "{:?}: no bytes of rows {rows:?} in the file's layout, and none of the host's it reads",
                w.role
            ))
        })?;
        let mem = self.ctx.buffer_from(Access::ReadOnly, data, self.info.host_unified_memory).map_err(|e| {
            DeviceError::OutOfMemory { device: format!("{name}: {e}"), usage: BufferUsage::Weights, bytes: data.len() }
        })?;
        if !is_vector {
            self.weights_copied.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        let stride = w.ty.row_bytes(w.cols).unwrap_or(0);
        let gw = GpuWeight {
            mem,
            ty: w.ty,
            layout: Layout::Rows,
            rows: rows.len(),
            cols: w.cols,
            stride,
            in_place: false,
            offset: 0,
            bytes: data.len(),
        };
        Ok(Weight::new(self.id, w.role, rows, w.cols, data.len(), Arc::new(gw)))
    }

    fn prepare(
        &self,
        subgraph: Subgraph,
        shape: &BlockShape,
        n_tokens: usize,
        weights: &[Weight],
    ) -> Result<Executable, DeviceError> {
        let roles = subgraph.weight_roles(shape);
        if roles.len() != weights.len() {
            return Err(self.err(format!("{subgraph:?} takes {} weights, {} given", roles.len(), weights.len())));
        }
        let mut ws = Vec::with_capacity(weights.len());
        for (role, w) in roles.iter().zip(weights) {
            if w.get::<GpuWeight>(self.id).is_none() {
                return Err(self.err("a weight of another device"));
            }
            if w.role != *role {
                return Err(self.err(format!("weight {:?} where {role:?} goes", w.role)));
            }
            ws.push((*role, w.clone()));
        }
        if matches!(subgraph.kind, SubgraphKind::Attention | SubgraphKind::AttnCore)
            && (shape.n_kv_heads == 0
                || !shape.n_heads.is_multiple_of(shape.n_kv_heads)
                || shape.rope_dims > shape.head_dim
                || !shape.rope_dims.is_multiple_of(2))
        {
            return Err(self.err(format!("attention of {} heads over {} KV heads", shape.n_heads, shape.n_kv_heads)));
        }
        let plan = Plan { sg: subgraph, shape: *shape, n: n_tokens, weights: ws };
        Ok(Executable::new(self.id, subgraph, n_tokens, Arc::new(plan)))
    }

    fn submit(&self, exe: &Executable, bind: &Bindings, after: &[Event]) -> Result<Event, DeviceError> {
        let plan = exe.get::<Plan>(self.id).ok_or_else(|| self.err("an executable of another device"))?;
        // A group runs the rows it is bound to (the contract's rule); the rest their count.
        let group = matches!(plan.sg.kind, SubgraphKind::Group(_));
        if bind.positions.len() != bind.tokens.len() || !(group || bind.positions.len() == plan.n) {
            return Err(self.err(format!("prepared for {} tokens, bound {}", plan.n, bind.positions.len())));
        }
        self.wait_foreign(after)?;
        let mut st = self.lock();
        self.enqueue_subgraph(&mut st, plan, bind)?;
        let ev = Event::new();
        let signal = ev.clone();
        let name = self.desc.name.clone();
        self.ctx
            .on_done(Box::new(move |r| {
                signal.signal(r.map_err(|code| DeviceError::Execution {
                    device: name,
                    detail: format!("a command failed: {} ({code})", opencl_rt_sys::code_name(code)),
                }))
            }))
            .map_err(self.exec())?;
        st.pending.retain(|e| e.state().is_none());
        st.pending.push(ev.clone());
        Ok(ev)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::backend::layout::kpacked::KKind;
    use crate::backend::layout::packed::PackKind;

    /// The kernels' record offsets (`DQ_PK` in llmd.cl, `tile_rec` sizes in the `dq_pq*`
    /// functions) are the CPU layout's own numbers.
    #[test]
    fn the_kernels_tile_offsets_are_the_cpu_layouts() {
        let src = program::SOURCE;
        for (kind, name) in [
            (KKind::Q2K, "pq2_k"),
            (KKind::Q3K, "pq3_k"),
            (KKind::Q4K, "pq4_k"),
            (KKind::Q5K, "pq5_k"),
            (KKind::Q6K, "pq6_k"),
        ] {
            let line = src.lines().find(|l| l.starts_with(&format!("DQ_PK({name},"))).unwrap();
            let args: Vec<usize> = line
                .trim_start_matches("DQ_PK(")
                .trim_end_matches(')')
                .split(',')
                .skip(1)
                .map(|a| a.trim().parse().unwrap())
                .collect();
            let k = kind;
            let want = [
                [2, 3, 4, 5, 6][k as usize],
                k.base_bits(),
                k.high_bits(),
                k.group(),
                k.scales_off(),
                k.mins_off(),
                k.base_off(),
                k.high_off(),
                k.record_bytes(),
            ];
            assert_eq!(args, want, "{name}");
            assert_eq!(tile_stride(k.ggml(), 512), Some(2 * k.record_bytes()));
        }
        for (kind, name) in [(PackKind::Q4_0, "pq4_0"), (PackKind::Q4_1, "pq4_1"), (PackKind::Q8_0, "pq8_0")] {
            let body = src.split(&format!("inline void dq_{name}(")).nth(1).unwrap();
            let rec = format!("tile_rec(w, r, stride, {}, j)", kind.record_bytes());
            assert!(body.lines().nth(1).unwrap().contains(&rec), "{name}: {rec}");
            assert!(src.contains(&format!("MATMUL({name})")) && src.contains(&format!("MATMUL_SG({name})")));
        }
        assert_eq!(tile_stride(GgmlType::Q4_0, 33), None);
        assert_eq!(tile_stride(GgmlType::F16, 64), None);
    }
}
