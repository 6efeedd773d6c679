//! `llmctl`'s GPU path: `run --local --backend gpu` (the prompt read on the CPU, decode on an
//! OpenCL device) and `gpu-info` (the OpenCL platforms and devices, their capabilities, the
//! kernel variants, the program cache, and a one-layer self-check against references).

use llmd_engine::backend::gpu::{self, check, GpuDevice, GpuOptions, MatmulVariant};
use llmd_engine::sched::DecodeOn;
use std::path::PathBuf;
use std::sync::Arc;

/// The GPU options of `run --local`, `bench --local` and `gpu-info`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuArgs {
    /// The OpenCL library (default: the ICD loader, libOpenCL.so.1, then a phone's
    /// /vendor/lib64/libOpenCL.so).
    #[arg(long, env = "LLMD_OPENCL_LIB", value_name = "PATH")]
    pub opencl_lib: Option<PathBuf>,
    /// The OpenCL device, by its number in `llmctl gpu-info` (default: the first GPU, else the
    /// first device).
    #[arg(long, value_name = "N")]
    pub gpu_device: Option<usize>,
    /// Directory of cached program binaries ("none": build the kernels at every start).
    /// Default: $XDG_CACHE_HOME/llmd/opencl, else ~/.cache/llmd/opencl.
    #[arg(long, value_name = "DIR")]
    pub gpu_cache: Option<String>,
    /// How a matmul spreads over the device: auto (a subgroup per weight row where the device
    /// can fix a subgroup's size, else a work-item per row on a CPU device such as PoCL, else a
    /// work-group per row), rows, groups or subgroups.
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_matmul: MatmulChoice,
    /// The fp16 kernels (weights dequantized to half, half dot products): auto (on for a GPU
    /// with cl_khr_fp16, off on an OpenCL CPU device), on (an error without cl_khr_fp16) or
    /// off.
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_fp16: Fp16Choice,
}

/// `--gpu-fp16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fp16Choice {
    Auto,
    On,
    Off,
}

/// `--gpu-matmul`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MatmulChoice {
    Auto,
    Rows,
    Groups,
    Subgroups,
}

fn cache_dir(args: &GpuArgs) -> Option<PathBuf> {
    crate::paths::cache_dir(args.gpu_cache.as_deref(), "opencl")
}

pub fn options(args: &GpuArgs) -> GpuOptions {
    let matmul = match args.gpu_matmul {
        MatmulChoice::Auto => MatmulVariant::Auto,
        MatmulChoice::Rows => MatmulVariant::RowPerItem,
        MatmulChoice::Groups => MatmulVariant::GroupPerRow,
        MatmulChoice::Subgroups => MatmulVariant::Subgroup,
    };
    GpuOptions {
        library: args.opencl_lib.clone(),
        device: args.gpu_device,
        cache_dir: cache_dir(args),
        matmul,
        fp16: match args.gpu_fp16 {
            Fp16Choice::Auto => None,
            Fp16Choice::On => Some(true),
            Fp16Choice::Off => Some(false),
        },
        gpu_only: false,
    }
}

/// Opens the GPU and says so on standard error.
pub fn open(args: &GpuArgs) -> Result<Arc<GpuDevice>, String> {
    let g = GpuDevice::open(&options(args)).map_err(|e| format!("the GPU cannot be used: {e}"))?;
    let i = g.info();
    eprintln!("gpu: {} ({}, {}); kernels {}", i.name, i.kind, i.platform, g.program_origin());
    Ok(Arc::new(g))
}

/// Decode steps of `model` on `g`; prompts stay on the CPU (each turn's cache is handed to the
/// GPU at its first decode step).
pub fn attach(model: &mut llmd_engine::Model, g: Arc<GpuDevice>) {
    let name = llmd_device::Device::desc(&*g).name.clone();
    model.transformer.attach_devices(vec![g], Arc::new(DecodeOn { device: name, max_tokens: 1 }));
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// `llmctl gpu-info`: every OpenCL device, the chosen one's program and self-check. Fails when
/// there is no usable device or a kernel is out of tolerance.
pub fn info(args: &GpuArgs) -> Result<(), String> {
    let (lib, devs) = gpu::list_devices(args.opencl_lib.as_deref()).map_err(|e| e.to_string())?;
    crate::out!("OpenCL library: {}", lib.path());
    if devs.is_empty() {
        return Err(format!("{} lists no OpenCL device", lib.path()));
    }
    for (n, d) in devs.iter().enumerate() {
        crate::out!("device {n}: {} ({}), {}", d.name, d.kind, d.vendor);
        crate::out!(
            "  platform {} ({}); {}; driver {}; {}",
            d.platform,
            d.platform_version,
            d.version,
            d.driver_version,
            d.c_version
        );
        crate::out!(
            "  {} compute units; memory {} MiB (largest buffer {} MiB), local {} KiB; work-groups up to {}; shared with the host: {}; buffers aligned to {} B; images: {}",
            d.compute_units,
            d.global_mem >> 20,
            d.max_alloc >> 20,
            d.local_mem >> 10,
            d.max_work_group,
            yes(d.host_unified_memory),
            d.base_align,
            yes(d.image_support)
        );
        let subgroups =
            ["cl_khr_subgroups", "cl_intel_subgroups", "cl_qcom_reqd_sub_group_size"].iter().any(|e| d.has(e));
        let dot = ["cl_khr_integer_dot_product", "cl_arm_integer_dot_product_int8", "cl_qcom_dot_product8"]
            .iter()
            .any(|e| d.has(e));
        crate::out!(
            "  fp16 arithmetic (cl_khr_fp16): {}; subgroups: {}; integer dot product: {}",
            yes(d.has("cl_khr_fp16")),
            yes(subgroups),
            yes(dot)
        );
        crate::out!("  extensions: {}", d.extensions.join(" "));
    }
    let g = GpuDevice::open(&options(args)).map_err(|e| e.to_string())?;
    let i = g.info();
    crate::out!("selected: {} ({}), work-groups of {}", i.name, i.kind, g.work_group());
    for v in g.variants() {
        crate::out!("kernel variant: {v}");
    }
    crate::out!("not built yet: weights through image1d_buffer_t");
    crate::out!("program: {}", g.program_origin());
    match g.cache_file() {
        Some(p) => crate::out!("program cache: {} ({})", p.display(), if p.exists() { "present" } else { "absent" }),
        None => crate::out!("program cache: off"),
    }
    // One layer of the default model's shapes (SmolLM2-135M): 576 wide, 9/3 heads of 64.
    let shape = llmd_device::BlockShape {
        n_layers: 1,
        d_model: 576,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        ffn_dim: 1536,
        vocab: 64,
        context_length: 8192,
        norm_eps: 1e-5,
        rope_dims: 64,
        rope_theta: 100000.0,
        rope_freq_scale: 1.0,
        rope_style: llmd_device::RopeStyle::Interleaved,
        qkv_bias: false,
        rope_freqs: false,
    };
    crate::out!("self-check: one layer at SmolLM2-135M's shapes against f64 references");
    let results = check::self_check(&g, &shape).map_err(|e| format!("the self-check could not run: {e}"))?;
    let mut failed = 0;
    for c in &results {
        let verdict = if c.ok() { "ok" } else { "FAILED" };
        crate::out!("  {:<48} worst {:>9.2e}  tolerance {:.0e}  {verdict}", c.kernel, c.worst, c.tolerance);
        failed += usize::from(!c.ok());
    }
    if failed > 0 {
        return Err(format!("{failed} of {} kernel checks out of tolerance on {}", results.len(), i.name));
    }
    crate::out!("self-check: all {} within tolerance", results.len());
    Ok(())
}
