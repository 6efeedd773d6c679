//! `llmctl`'s NPU path: `run --local --backend npu` (prefill's linear groups as W8A8 QNN graphs,
//! decode on the CPU) and `npu-info` (the QNN library, its API versions, the context cache, and
//! a one-layer self-check against the engine's reference arithmetic).

use llmd_engine::backend::npu::cache::CacheOutcome;
use llmd_engine::backend::npu::graph::{build_linear_group, run_linear_group, LinearGroup, Projection};
use llmd_engine::backend::npu::quant::{ActQuant, QuantWeights};
use llmd_engine::backend::npu::QnnDevice;
use llmd_engine::prefill::{self, NpuLinears, CALIBRATION_TEXT};
use std::path::PathBuf;

/// Where the work runs besides the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// Everything on the CPU.
    Cpu,
    /// The prompt's linear layers on the NPU (QNN); decode on the CPU.
    Npu,
    /// The prompt on the CPU; decode on the GPU (OpenCL).
    Gpu,
}

/// The NPU options of `run --local` and `npu-info`.
#[derive(clap::Args, Debug, Clone)]
pub struct NpuArgs {
    /// The QNN backend library: Qualcomm's libQnnHtp.so, or llmd's emulator provider (the
    /// default: libllmd_qnn_emu.so next to llmctl).
    #[arg(long, env = "LLMD_QNN_LIB", value_name = "PATH")]
    pub qnn_lib: Option<PathBuf>,
    /// The chip graphs are built for (QNN's SoC model: 57 = Snapdragon 8 Gen 3, 43 = 8 Gen 2).
    #[arg(long, default_value_t = 57)]
    pub soc: u32,
    /// Rows of each NPU graph: prompts run in chunks of this many tokens, the last padded
    /// (llm.npu's default is 256).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub npu_chunk: u64,
    /// Prompt chunks prefilled together, out of order (llm.npu's out-of-order execution: the
    /// NPU runs one chunk's linear groups while the CPU runs another's attention, in the order
    /// the scheduler's score picks; the same results as in order). 1: one chunk at a time.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub npu_ooe_chunks: u64,
    /// Directory of finalized NPU contexts, so later runs load instead of finalizing ("none":
    /// no cache). Default: $XDG_CACHE_HOME/llmd/npu, else ~/.cache/llmd/npu.
    #[arg(long, value_name = "DIR")]
    pub npu_cache: Option<String>,
    /// Calibration text file for the activations' scales (default: a built-in English text).
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Shadow outlier execution (llm.npu): inputs clipped to ±τ on the NPU, the values past it
    /// multiplied on the CPU and added back.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub npu_shadow: String,
    /// The share of linear sites, least important first, without shadow execution (0 to 1;
    /// llm.npu's paper uses 0.85).
    #[arg(long, default_value_t = llmd_engine::prefill::DEFAULT_PRUNE)]
    pub npu_prune: f64,
    /// int8 weight scales: folded (per-channel codes, the channels' scales applied on the
    /// host), per-tensor (llm.npu's), or per-channel (in the graph; Qualcomm's HTP refuses it
    /// with 16-bit outputs).
    #[arg(long, default_value = "folded", value_parser = ["folded", "per-tensor", "per-channel"])]
    pub npu_weights: String,
}

impl NpuArgs {
    /// The engine's quantization settings these name.
    pub fn quant(&self) -> Result<prefill::NpuQuant, String> {
        use prefill::{NpuQuant, ShadowConfig, WeightQuant};
        if !(0.0..=1.0).contains(&self.npu_prune) {
            return Err(format!("--npu-prune {} must be between 0 and 1", self.npu_prune));
        }
        Ok(NpuQuant {
            out_bits: 16,
            weights: match self.npu_weights.as_str() {
                "per-tensor" => WeightQuant::PerTensor,
                "per-channel" => WeightQuant::PerChannel,
                _ => WeightQuant::Folded,
            },
            shadow: (self.npu_shadow == "on").then_some(ShadowConfig { prune: self.npu_prune, ..Default::default() }),
        })
    }
}

/// The QNN library to load: `--qnn-lib`/`LLMD_QNN_LIB`, else the emulator provider beside llmctl.
pub fn library_path(args: &NpuArgs) -> Result<PathBuf, String> {
    if let Some(p) = &args.qnn_lib {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find llmctl's own path: {e}"))?;
    let beside = exe.parent().map(|d| d.join("libllmd_qnn_emu.so"));
    match beside {
        Some(p) if p.exists() => Ok(p),
        _ => Err("no QNN library: pass --qnn-lib PATH or set LLMD_QNN_LIB (llmd's emulator provider, \
                  libllmd_qnn_emu.so, is built beside llmctl by `cargo build --release -p qnn-emu-sys`)"
            .into()),
    }
}

/// The cache directory, or None when disabled.
pub fn cache_dir(args: &NpuArgs) -> Option<PathBuf> {
    crate::paths::cache_dir(args.npu_cache.as_deref(), "npu")
}

/// llm.npu's prefill on the engine's executor: the NPU device holding the model's W8A8 groups,
/// placed on it by the devices' splitter.
pub struct NpuPrefill {
    pub devs: llmd_engine::model::Devices,
    /// The groups' graphs (their counters: executions, modelled time, shadow execution).
    pub groups: std::sync::Arc<NpuLinears>,
    /// The rows of each graph.
    pub chunk: usize,
}

/// The NPU prefill for `model`: the library opened, the model calibrated and quantized, its
/// graphs loaded from the cache or built, the NPU device holding them. Prints what it did on
/// standard error.
pub fn prepare(model: &llmd_engine::Model, args: &NpuArgs) -> Result<NpuPrefill, String> {
    let path = library_path(args)?;
    // The chip's profile prices each group for the job graph's order (llm.npu's T(G)).
    let device = std::sync::Arc::new(QnnDevice::open(&path, args.soc).map_err(|e| e.to_string())?.with_chip_profile());
    let text = match &args.calibration {
        Some(f) => std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?,
        None => CALIBRATION_TEXT.to_owned(),
    };
    let tokens = model.tokenizer.encode(&text, false, false).map_err(|e| e.to_string())?;
    if tokens.is_empty() {
        return Err("the calibration text has no tokens".into());
    }
    let chunk = args.npu_chunk as usize;
    let dir = cache_dir(args);
    let q = args.quant()?;
    let prefill::PreparedNpu { context, groups, ids, shadow, report: p } =
        prefill::prepare(&device, &model.transformer, &tokens, chunk, &q, dir.as_deref())
            .map_err(|e| format!("preparing the NPU graphs: {e}"))?;
    let mut npu = NpuLinears::from_context(&context, groups, &ids, chunk).map_err(|e| e.to_string())?;
    npu.set_shadow(shadow).map_err(|e| e.to_string())?;
    let provider = &device.provider().name;
    let how = match &p.cache {
        CacheOutcome::Loaded => {
            format!("loaded from {}", p.cache_file.as_ref().map_or(String::new(), |f| f.display().to_string()))
        }
        CacheOutcome::Built { reason } => format!("built and finalized ({reason})"),
    };
    let st = npu.shadow_stats();
    eprintln!(
        "npu: {provider} ({}), {} graphs of {chunk} rows {how} in {:.2} s; calibration {} tokens {} {:.2} s, requantization {:.2} s; shadow execution at {} of {} sites ({:.1} MB of int8 rows in memory, {:.1} MB on storage)",
        path.display(),
        npu.graph_names().len(),
        p.context_s,
        p.calibration_tokens,
        if p.calibration_cached { "read from the cache in" } else { "run in" },
        p.calibrate_s,
        p.quantize_s,
        st.sites,
        st.all_sites,
        st.resident_bytes as f64 / 1e6,
        (st.total_bytes - st.resident_bytes.min(st.total_bytes)) as f64 / 1e6
    );
    let groups = std::sync::Arc::new(npu);
    Ok(NpuPrefill { devs: prefill::devices(device, &groups), groups, chunk })
}

/// One line on shadow execution's work so far (for the end of a run).
pub fn shadow_summary(npu: &NpuLinears) -> String {
    let s = npu.shadow_stats();
    format!(
        "shadow execution: {} of {} sites; {} of {} chunk runs found outliers ({} values, {} channel rows); {} saturated outputs recomputed; weight rows: {} hot (in memory), {} cold read ({:.1} KB); {:.1} MB of {:.1} MB held in memory",
        s.sites,
        s.all_sites,
        s.chunks_with_outliers,
        s.chunks,
        s.outlier_elements,
        s.outlier_channels,
        s.saturated_outputs,
        s.hot_rows_used,
        s.cold_rows_read,
        s.cold_bytes_read as f64 / 1e3,
        s.resident_bytes as f64 / 1e6,
        s.total_bytes as f64 / 1e6
    )
}

/// `llmctl npu-info`.
pub fn info(args: &NpuArgs) -> Result<(), String> {
    let path = library_path(args)?;
    let providers = QnnDevice::providers(&path).map_err(|e| e.to_string())?;
    crate::out!("library        {}", path.display());
    for p in &providers {
        crate::out!(
            "provider       {} (backend id {}), core API {}, backend API {}",
            p.name,
            p.backend_id,
            p.core_api,
            p.backend_api
        );
    }
    let device = QnnDevice::open(&path, args.soc).map_err(|e| e.to_string())?;
    crate::out!("build id       {}", device.build_id());
    crate::out!("chip           {} (QNN SoC model)", args.soc);
    match cache_dir(args) {
        None => crate::out!("context cache  off"),
        Some(d) => {
            let mut files: Vec<(String, u64)> = std::fs::read_dir(&d)
                .map(|r| {
                    r.filter_map(|e| e.ok())
                        .filter(|e| e.file_name().to_string_lossy().ends_with(".qnnctx"))
                        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().map_or(0, |m| m.len())))
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            crate::out!(
                "context cache  {} ({} files, {:.1} MB)",
                d.display(),
                files.len(),
                files.iter().map(|f| f.1).sum::<u64>() as f64 / 1e6
            );
            for (name, size) in files {
                crate::out!("               {name}  {:.1} MB", size as f64 / 1e6);
            }
        }
    }
    // The self-check: one layer of SmolLM2-135M's shapes (hidden 576, Q 576, K/V 192, FFN 1536)
    // with fixed pseudo-random weights, every group at 32 rows, against the reference.
    let context = device.context().map_err(|e| e.to_string())?;
    let (d, q, kv, f) = (576usize, 576usize, 192usize, 1536usize);
    let chunk = 32;
    let mut worst = (0i32, 0usize, 0usize);
    let t = std::time::Instant::now();
    for (name, k, outs) in [
        ("qkv", d, vec![("q", q), ("k", kv), ("v", kv)]),
        ("o", q, vec![("o", d)]),
        ("gate_up", d, vec![("gate", f), ("up", f)]),
        ("down", f, vec![("down", d)]),
    ] {
        let g = synthetic_group(name, k, &outs);
        let x: Vec<u8> = (0..chunk * k).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
        let mut graph = build_linear_group(&context, &g, chunk).map_err(|e| format!("self-check {name}: {e}"))?;
        let got = run_linear_group(&mut graph, &g, chunk, &x).map_err(|e| format!("self-check {name}: {e}"))?;
        for (gp, wp) in got.iter().zip(g.reference(&x, chunk)) {
            for (&a, &b) in gp.iter().zip(&wp) {
                let diff = (i32::from(a) - i32::from(b)).abs();
                worst.0 = worst.0.max(diff);
                worst.1 += usize::from(diff != 0);
            }
            worst.2 += wp.len();
        }
    }
    crate::out!(
        "self-check     one layer (4 groups, 32 rows): {} of {} outputs differ from the reference ({:.2}%), at most {} LSB; {:.2} s",
        worst.1,
        worst.2,
        100.0 * worst.1 as f64 / worst.2.max(1) as f64,
        worst.0,
        t.elapsed().as_secs_f64()
    );
    if worst.0 > 1 {
        return Err(format!(
            "the self-check is off by {} LSB (more than 1): this library does not compute what llmd expects",
            worst.0
        ));
    }
    Ok(())
}

/// A group with fixed pseudo-random weights and ranges that use the output codes.
fn synthetic_group(name: &str, k: usize, outs: &[(&str, usize)]) -> LinearGroup {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ k as u64;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32) / ((1u64 << 24) as f32) - 0.5
    };
    let input = ActQuant { scale: 4.0 / 255.0, zero_point: 128, bits: 8 };
    let projections = outs
        .iter()
        .map(|&(p, n)| {
            let w: Vec<f32> = (0..n * k).map(|_| next() * 0.1).collect();
            let weights = QuantWeights::quantize(&w, n, k, false).unwrap_or_else(|_| QuantWeights {
                rows: n,
                cols: k,
                q: vec![0; n * k],
                scales: llmd_engine::backend::npu::quant::WeightScales::PerTensor(1.0),
            });
            let range = 0.05 * (k as f32).sqrt();
            Projection {
                name: p.into(),
                weights,
                bias: None,
                output: ActQuant { scale: 2.0 * range / 65535.0, zero_point: 32767, bits: 16 },
                gain: None,
            }
        })
        .collect();
    LinearGroup { name: format!("selfcheck_{name}"), input, projections }
}
