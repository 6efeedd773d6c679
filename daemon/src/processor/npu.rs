//! The NPU processor's backends: what its thread opens (the QNN library's HTP backend, as
//! `llmd_engine`'s `QnnDevice`) and prepares per model —
//! - [`Int8`] (`backend = "npu"`, or `"auto"` with a phone's NPU, or an emulated one that
//!   `[devices] allow_emulated` lets it take): llm.npu's path. The model is
//!   calibrated, its weights requantized, and its W8A8 linear groups' graphs loaded from the
//!   context cache or built and finalized (`[npu]`: chip, chunk, cache directory); the groups
//!   are the QNN device's `Group` subgraphs, norms, RoPE and attention stay on the CPU.
//! - [`Hetero`] (`backend = "hetero"`): HeteroLLM's plan — every projection cut between the
//!   QNN device's fp16 graphs (in the same context cache) and the GPU, both opened by this
//!   thread, which owns the plan's pieces on both.

use super::thread::{Backend, Label, Prepared, Processor, Refusal, Takes};
use crate::config::{Backend as ConfigBackend, Config};
use llmd_device::Device as _;
use llmd_engine::backend::gpu::cpu_backed;
use llmd_engine::backend::gpu::{GpuDevice, GpuOptions};
use llmd_engine::backend::npu::cache::CacheOutcome;
use llmd_engine::backend::npu::QnnDevice;
use llmd_engine::hetero::choose::{self, DecodePlan, Plan, PrefillPlan, Present};
use llmd_engine::hetero::plan::{even_cut, solver_cut, HeteroPlan};
use llmd_engine::hetero::solver::Op;
use llmd_engine::model::Devices;
use llmd_engine::prefill::{self, NpuLinears, CALIBRATION_TEXT};
use llmd_engine::Model;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The `[hetero]` settings the thread needs (`backend = "hetero"`).
#[derive(Clone, Debug)]
pub struct HeteroSettings {
    pub gpu: GpuOptions,
    pub soc: llmd_engine::hetero::soc::Soc,
    pub plan: crate::config::HeteroPlan,
    pub sizes: Vec<usize>,
    pub row_align: usize,
    pub weight_bits: f64,
    /// Where each model's plan is stored (`<state_dir>/hetero`), if anywhere.
    pub plan_dir: Option<PathBuf>,
}

/// What the NPU thread needs from the config.
#[derive(Clone, Debug)]
pub struct Settings {
    pub library: PathBuf,
    pub soc: u32,
    pub chunk: usize,
    /// Prompt chunks one job prefills out of order (1: in order).
    pub ooe_chunks: usize,
    pub cache_dir: Option<PathBuf>,
    pub calibration: Option<PathBuf>,
    pub quant: llmd_engine::prefill::NpuQuant,
    /// HeteroLLM's partitioned execution instead of llm.npu's INT8 graphs.
    pub hetero: Option<HeteroSettings>,
    /// Refuse an emulated NPU (`backend = "auto"` without `[devices] allow_emulated`).
    pub refuse_emulated: bool,
    /// `backend = "auto"`: each model's plan picks llm.npu's INT8 path or HeteroLLM's (whose
    /// settings are then `hetero`'s).
    pub planned: Option<PlanSettings>,
}

/// What `backend = "auto"` plans with (see [`Planned`]).
#[derive(Clone, Debug)]
pub struct PlanSettings {
    /// `[devices]`'s profile.
    pub soc: llmd_engine::hetero::soc::Soc,
    /// Where each model's plan is stored (`<state_dir>/plans`), if anywhere.
    pub dir: Option<PathBuf>,
    /// The OpenCL device for the partitioned plan's GPU pieces, when `auto` may look for one.
    pub gpu: Option<GpuOptions>,
    /// Refuse an OpenCL device on the host's CPU there.
    pub refuse_emulated_gpu: bool,
}

/// The QNN library when the config names none: on Android the system's `libQnnHtp.so` (found
/// by the dynamic linker in the vendor's library paths); elsewhere llmd's emulator provider
/// beside the llmd binary.
pub fn default_library() -> PathBuf {
    if cfg!(target_os = "android") {
        return PathBuf::from("libQnnHtp.so");
    }
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("libllmd_qnn_emu.so")))
        .unwrap_or_else(|| PathBuf::from("libllmd_qnn_emu.so"))
}

/// Writes `bytes` to `file` through a temporary name in its directory (made if missing).
fn write_atomically(file: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = file.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, file)
}

/// The NPU the config asks for: off unless the backend uses it, else started over `[npu]`'s
/// library (see [`default_library`] when it names none; `llmd` puts `--qnn-lib` or
/// `LLMD_QNN_LIB` there).
pub fn from_config(config: &Config) -> Arc<Processor> {
    let n = &config.npu;
    let allow_emulated = config.devices.allow_emulated;
    let library = match (config.backend, &n.library) {
        (ConfigBackend::Npu | ConfigBackend::Hetero, l) => l.clone().unwrap_or_else(default_library),
        (ConfigBackend::Auto, Some(l)) => l.clone(),
        // Automatic placement uses a phone's NPU; llmd's emulator of one (no faster than the
        // CPU here) only when the config allows emulated devices.
        (ConfigBackend::Auto, None) if cfg!(target_os = "android") || allow_emulated => default_library(),
        (ConfigBackend::Auto, None) => {
            return Processor::refused(
                Label::Npu,
                Refusal {
                    reason: "backend \"auto\" takes a phone's NPU: off Android none is named, and llmd's emulator is taken only with [devices] allow_emulated = true".into(),
                    expected: true,
                },
            )
        }
        _ => return Processor::off(Label::Npu),
    };
    let cache_dir = n.cache_dir.clone().or_else(|| config.residency.state_dir.as_ref().map(|d| d.join("npu")));
    let hetero = match config.backend {
        ConfigBackend::Hetero | ConfigBackend::Auto => {
            let h = &config.hetero;
            let soc = match config.devices.profile() {
                Ok(s) => s,
                Err(e) => return Processor::refused(Label::Npu, Refusal::unexpected(e.to_string())),
            };
            let g = &config.gpu;
            Some(HeteroSettings {
                gpu: GpuOptions {
                    library: g.library.clone(),
                    device: g.device,
                    cache_dir: g
                        .cache_dir
                        .clone()
                        .or_else(|| config.residency.state_dir.as_ref().map(|d| d.join("gpu"))),
                    ..GpuOptions::default()
                },
                soc,
                plan: h.plan,
                sizes: h.sizes.clone(),
                row_align: h.row_align,
                weight_bits: h.weight_bits,
                plan_dir: config.residency.state_dir.as_ref().map(|d| d.join("hetero")),
            })
        }
        _ => None,
    };
    let planned = match (config.backend, &hetero) {
        (ConfigBackend::Auto, Some(h)) => Some(PlanSettings {
            soc: h.soc.clone(),
            dir: config.residency.state_dir.as_ref().map(|d| d.join("plans")),
            // The GPU's own rules for `auto` decide whether OpenCL is probed at all; with an
            // int8 KV cache the GPU processor does not decode (its attention reads f16).
            gpu: (super::gpu::auto_refusal(config).is_none() && config.kv_cache_type != crate::config::KvCacheType::Q8)
                .then(|| GpuOptions { gpu_only: !allow_emulated, ..h.gpu.clone() }),
            refuse_emulated_gpu: !allow_emulated,
        }),
        _ => None,
    };
    let (chunk, ooe_chunks) = match (&hetero, &planned) {
        // HeteroLLM's plan cuts each chunk's matmuls; only llm.npu's INT8 path runs chunks out
        // of order.
        (Some(h), None) => (h.sizes.iter().copied().max().unwrap_or(n.chunk), 1),
        _ => (n.chunk, n.ooe_chunks.max(1)),
    };
    start(Settings {
        planned,
        hetero,
        library,
        soc: n.soc,
        chunk,
        ooe_chunks,
        cache_dir,
        calibration: n.calibration.clone(),
        quant: n.quant(),
        refuse_emulated: config.backend == ConfigBackend::Auto && !allow_emulated,
    })
}

/// Starts the NPU's thread over `settings`.
pub fn start(settings: Settings) -> Arc<Processor> {
    let hetero_only = settings.hetero.is_some() && settings.planned.is_none();
    let takes = Takes {
        chunk: Some(settings.chunk),
        chunks_per_job: settings.ooe_chunks.max(1),
        decode: hetero_only,
        one_sequence_at_a_time: hetero_only,
    };
    let backend: Box<dyn Backend> = match (settings.planned.clone(), settings.hetero.clone()) {
        (Some(plan), Some(h)) => Box::new(Planned {
            int8: Int8 { settings: settings.clone(), device: None },
            hetero: Hetero { settings, hetero: h, opened: None },
            plan,
            gpu: Err("not looked for".into()),
        }),
        (None, Some(h)) => Box::new(Hetero { settings, hetero: h, opened: None }),
        _ => Box::new(Int8 { settings, device: None }),
    };
    Processor::start(Label::Npu, takes, backend)
}

/// Opens the QNN library at `s.library` for `s.soc`, unless it is emulated and `s` refuses that.
fn open_library(s: &Settings) -> Result<QnnDevice, Refusal> {
    let d = QnnDevice::open(&s.library, s.soc).map_err(|e| Refusal::unexpected(e.to_string()))?;
    match d.emulated() {
        Some(what) if s.refuse_emulated => Err(Refusal {
            reason: format!(
                "backend \"auto\" does not take {what} ({}): set [devices] allow_emulated = true",
                s.library.display()
            ),
            expected: true,
        }),
        _ => Ok(d),
    }
}

/// Opens the QNN device over `s.library`; what `dump` says of it.
fn open_qnn(s: &Settings, d: QnnDevice) -> (Arc<QnnDevice>, String) {
    let emulated = d.emulated().map_or(String::new(), |w| format!(" ({w})"));
    let what = format!(
        "provider {}{emulated} ({}), build {:?}, chip {}, chunk {} rows",
        d.provider().name,
        s.library.display(),
        d.build_id(),
        s.soc,
        s.chunk
    );
    (Arc::new(d), what)
}

/// llm.npu's INT8 path (see the module doc).
struct Int8 {
    settings: Settings,
    device: Option<Arc<QnnDevice>>,
}

impl Backend for Int8 {
    fn open(&mut self) -> Result<String, Refusal> {
        let d = open_library(&self.settings)?;
        // The chip's profile prices each group for the job graph's order (llm.npu's T(G)).
        let (d, what) = open_qnn(&self.settings, d.with_chip_profile());
        self.device = Some(d);
        Ok(what)
    }

    /// Calibrates `model`, requantizes it, and loads its graphs from the cache or builds them.
    fn prepare(&mut self, model: &Arc<Model>) -> Result<Prepared, String> {
        let (s, device) = (&self.settings, self.device.clone().ok_or("the NPU is not open")?);
        let text = match &s.calibration {
            Some(f) => std::fs::read_to_string(f).map_err(|e| format!("calibration text {}: {e}", f.display()))?,
            None => CALIBRATION_TEXT.to_owned(),
        };
        let tokens = model.tokenizer.encode(&text, false, false).map_err(|e| format!("calibration text: {e}"))?;
        if tokens.is_empty() {
            return Err("the calibration text has no tokens".into());
        }
        let prefill::PreparedNpu { context, groups, ids, shadow, report: p } =
            prefill::prepare(&device, &model.transformer, &tokens, s.chunk, &s.quant, s.cache_dir.as_deref())
                .map_err(|e| e.to_string())?;
        let how = match &p.cache {
            CacheOutcome::Loaded => format!(
                "loaded from {}",
                p.cache_file.as_ref().map_or_else(|| "the cache".to_owned(), |f| f.display().to_string())
            ),
            CacheOutcome::Built { reason } => format!("built and finalized ({reason})"),
        };
        let mut graphs = NpuLinears::from_context(&context, groups, &ids, s.chunk).map_err(|e| e.to_string())?;
        graphs.set_shadow(shadow).map_err(|e| e.to_string())?;
        let groups = Arc::new(graphs);
        let count = groups.graph_names().len();
        let devs = prefill::devices(device, &groups);
        // The groups' modelled time (the emulator's SoC model) and shadow outlier execution's
        // counters.
        let g = groups.clone();
        let modelled = Box::new(move || g.stats().1);
        let lines = Box::new(move |_: &Devices, name: &str| {
            let st = groups.shadow_stats();
            vec![format!(
                "shadow {name}: {} of {} sites; {} of {} chunk runs found outliers ({} values); {} saturated outputs recomputed; rows {} hot, {} cold read ({} B); {} of {} B held in memory",
                st.sites,
                st.all_sites,
                st.chunks_with_outliers,
                st.chunks,
                st.outlier_elements,
                st.saturated_outputs,
                st.hot_rows_used,
                st.cold_rows_read,
                st.cold_bytes_read,
                st.resident_bytes,
                st.total_bytes
            )]
        });
        Ok(Prepared { devs, graphs: count, how, modelled: Some(modelled), lines, takes: None })
    }
}

/// HeteroLLM's plan (see the module doc).
struct Hetero {
    settings: Settings,
    hetero: HeteroSettings,
    opened: Option<(Arc<QnnDevice>, Arc<GpuDevice>)>,
}

/// The layer parts whose projections `plan` gives wholly to the GPU at `chunk` tokens.
fn gpu_only_parts(
    plan: &HeteroPlan,
    layers: usize,
    chunk: usize,
) -> std::collections::HashSet<(usize, llmd_device::SubgraphKind)> {
    use llmd_device::{SubgraphKind as K, WeightRole as R};
    let parts: [(K, &[R]); 4] = [
        (K::AttnQkv, &[R::Wq, R::Wk, R::Wv]),
        (K::AttnOut, &[R::Wo]),
        (K::FfnGateUp, &[R::Gate, R::Up]),
        (K::FfnDown, &[R::Down]),
    ];
    let gpu = |l: usize, r: R| {
        plan.pieces(l, r, chunk).is_some_and(|ps| ps.iter().all(|p| p.dev == llmd_engine::sched::Processor::Gpu))
    };
    (0..layers)
        .flat_map(|l| {
            parts.iter().filter(move |(_, roles)| roles.iter().all(|&r| gpu(l, r))).map(move |(k, _)| (l, *k))
        })
        .collect()
}

/// The token counts HeteroLLM's plan is made for: `[hetero] sizes` and one (decode).
fn hetero_counts(h: &HeteroSettings) -> Vec<usize> {
    let mut counts = h.sizes.clone();
    counts.push(1);
    counts
}

impl Backend for Hetero {
    fn open(&mut self) -> Result<String, Refusal> {
        let gpu = GpuDevice::open(&self.hetero.gpu)
            .map_err(|e| Refusal::unexpected(format!("backend \"hetero\" needs an OpenCL device: {e}")))?;
        self.open_with(Arc::new(gpu))
    }

    /// Every projection's cut for each of `[hetero] sizes` and one token, the NPU's fp16 graphs
    /// prepared together through the device contract — loaded from the NPU's graph cache (the
    /// same cache as the INT8 graphs', keyed by the library, chip, graphs and weights) when a
    /// sound one is there, else built, finalized and stored.
    fn prepare(&mut self, model: &Arc<Model>) -> Result<Prepared, String> {
        self.prepare_plan(model)
    }
}

impl Hetero {
    /// Opens the QNN device for HeteroLLM's fp16 graphs, with `gpu` for the GPU's pieces.
    fn open_with(&mut self, gpu: Arc<GpuDevice>) -> Result<String, Refusal> {
        let (s, h) = (&self.settings, &self.hetero);
        let d = open_library(s)?;
        // HeteroLLM's graphs through the device contract: static at the plan's token counts and
        // the SoC's standard sizes the solver pads pieces to, in the NPU's graph cache.
        let mut counts = hetero_counts(h);
        counts.extend_from_slice(h.soc.sizes().all());
        let d = d.with_token_counts(&counts).with_cache_dir(s.cache_dir.clone()).with_profile(h.soc.clone());
        let (npu, what) = open_qnn(s, d);
        let what = format!("{what}; GPU {} for HeteroLLM's plan", gpu.info().name);
        self.opened = Some((npu, gpu));
        Ok(what)
    }

    /// See [`Backend::prepare`] above.
    fn prepare_plan(&mut self, model: &Arc<Model>) -> Result<Prepared, String> {
        let h = &self.hetero;
        let (device, gpu) = self.opened.clone().ok_or("the NPU is not open")?;
        let counts = hetero_counts(h);
        let plan = |op: &Op| match h.plan {
            crate::config::HeteroPlan::Solver => solver_cut(&h.soc, h.weight_bits, op),
            crate::config::HeteroPlan::Even => even_cut(op, h.row_align),
        };
        let planned = HeteroPlan::new(model.transformer.projections(), &counts, &plan).map_err(|e| e.to_string())?;
        let missing: Vec<usize> =
            planned.npu_token_counts().into_iter().filter(|&m| !device.desc().static_shapes.allows(m)).collect();
        if !missing.is_empty() {
            return Err(format!(
                "the plan runs NPU graphs of {missing:?} tokens, which {} was not opened for",
                device.desc().name
            ));
        }
        let cuts = planned.to_json();
        // Every block on the host (the CPU: norms, RoPE, attention, SwiGLU, the head); each
        // projection's parts on the NPU and the GPU as the plan cuts it. In a prompt's chunks
        // (layer parts, out of order), a part whose projections the plan gives wholly to the
        // GPU at the chunk's size runs there whole (HeteroLLM: norms and SwiGLU on the GPU), on
        // the GPU's lane beside the CPU's attention of another chunk.
        let host = model.transformer.planner().backends().next().map(|d| d.name.clone()).unwrap_or_default();
        let chunk = h.sizes.iter().copied().max().unwrap_or(1);
        let on_gpu = gpu_only_parts(&planned, model.config().n_layers, chunk);
        let names = vec![host, device.desc().name.clone(), gpu.desc().name.clone()];
        let pick = move |sg: llmd_device::Subgraph| if on_gpu.contains(&(sg.layer, sg.kind)) { 2 } else { 0 };
        let devs = Devices::new(
            vec![device.clone() as Arc<dyn llmd_device::Device>, gpu.clone() as Arc<dyn llmd_device::Device>],
            Arc::new(llmd_engine::sched::Pinned { names, pick }),
        )
        .with_splitter(Arc::new(planned));
        let graphs = model.transformer.prepare_splits(&devs).map_err(|e| e.to_string())?;
        let mut how =
            format!("planned ({:?} on {}, token counts {:?}; GPU {})", h.plan, h.soc.key, counts, gpu.info().name);
        // The plan's NPU graphs were prepared in one `prepare_all` just now (a fresh set of
        // devices), which set the outcome; a plan with none prepared nothing.
        match device.last_cache_outcome() {
            _ if graphs == 0 => how.push_str(", no NPU graphs in the plan"),
            Some(CacheOutcome::Loaded) => how.push_str(", fp16 graphs loaded from the cache"),
            Some(CacheOutcome::Built { reason }) => {
                how.push_str(&format!(", fp16 graphs built and finalized ({reason})"))
            }
            None => how.push_str(", fp16 graphs built (no cache directory)"),
        }
        // The plan kept per model, SoC and token count, for `dump`'s readers and OEM tooling.
        if let Some(dir) = &h.plan_dir {
            let file = dir.join(format!("{}.{}.{:?}.json", model.name, h.soc.key, h.plan).to_lowercase());
            let body = serde_json::json!({"model": model.name, "soc": h.soc.key, "plan": format!("{:?}", h.plan), "token_counts": counts, "cuts": cuts});
            match write_atomically(&file, body.to_string().as_bytes()) {
                Ok(()) => how.push_str(&format!(", stored in {}", file.display())),
                Err(e) => tracing::warn!("the hetero plan was not stored in {}: {e}", file.display()),
            }
        }
        // The NPU's parts' modelled time (the emulator's), HeteroLLM's counters and its fast
        // sync's.
        let modelled = Box::new(move || device.modelled_ns());
        let lines = Box::new(move |devs: &Devices, name: &str| {
            let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let (st, sync) = (&devs.stats, &devs.sync);
            let mut lines = vec![
                format!(
                    "hetero {name}: {} matmuls, {} cut between the NPU and the GPU; {} NPU pieces, {} GPU pieces",
                    c(&st.matmuls),
                    c(&st.split_matmuls),
                    c(&st.npu_parts),
                    c(&st.gpu_parts)
                ),
                format!(
                    "fast sync {name}: {} waits for the GPU, {:.1} ms polling",
                    c(&sync.waits),
                    c(&sync.polled_ns) as f64 / 1e6
                ),
            ];
            // Per operator kind (projection and token count): how soon after the GPU's part
            // finished the NPU thread woke (its completion callback to the waiter seeing it).
            for w in sync.wake_stats() {
                lines.push(format!(
                    "fast sync {name} {}: waits={} wake_p50_us={:.0} wake_p99_us={:.0} polling_ms={:.2}",
                    w.key, w.waits, w.p50_us, w.p99_us, w.polled_ms
                ));
            }
            lines
        });
        Ok(Prepared { devs, graphs, how, modelled: Some(modelled), lines, takes: None })
    }
}

/// `backend = "auto"`'s NPU: each model's plan (`llmd_engine::hetero::choose` over `[devices]`'s
/// profile and the processors present) picks llm.npu's INT8 chunked prefill ([`Int8`]) or
/// HeteroLLM's fp16 partitioned prefill ([`Hetero`], its GPU pieces on an OpenCL device this
/// thread opens), and whether decode runs here (HeteroLLM's cut) or on the GPU processor.
/// The plan is stored under `<state_dir>/plans/` and made again when the profile, the model
/// or the devices present change.
struct Planned {
    int8: Int8,
    hetero: Hetero,
    plan: PlanSettings,
    /// The partitioned plan's GPU, or why there is none.
    gpu: Result<Arc<GpuDevice>, String>,
}

impl Backend for Planned {
    fn open(&mut self) -> Result<String, Refusal> {
        let what = self.int8.open()?;
        self.gpu = match &self.plan.gpu {
            None => Err("auto looks for a GPU only on Android, with [gpu] library or device, or allow_emulated".into()),
            Some(opts) => match GpuDevice::open(opts) {
                Ok(g) => match cpu_backed(g.info()) {
                    Some(why) if self.plan.refuse_emulated_gpu => Err(why),
                    _ => Ok(Arc::new(g)),
                },
                Err(e) => Err(e.to_string()),
            },
        };
        let gpu = match &self.gpu {
            Ok(g) => format!("GPU {} for partitioned plans", g.info().name),
            Err(e) => format!("no GPU for partitioned plans ({e})"),
        };
        Ok(format!("{what}; each model planned on the {} profile; {gpu}", self.plan.soc.key))
    }

    fn prepare(&mut self, model: &Arc<Model>) -> Result<Prepared, String> {
        let present = Present { npu: true, gpu: self.gpu.is_ok() };
        let (plan, told) = plan_for(&self.plan, model, present);
        let said = format!("plan {:?} prefill, {:?} decode ({told}): {}", plan.prefill, plan.decode, plan.why);
        tracing::info!(model = %model.name, plan = %said, "NPU plan");
        let mut prepared = match plan.prefill {
            PrefillPlan::Int8Chunked => self.prepare_int8(model)?,
            // **Decision:** a partitioned plan that cannot be prepared (its GPU or its fp16
            // graphs fail) falls back to INT8 chunks on the NPU, which the planner ranked
            // second but still above the CPU; the reason is in the model's `how`.
            PrefillPlan::Fp16Partitioned => match self.prepare_fp16(model, &plan) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(model = %model.name, "the partitioned plan could not be prepared ({e}): INT8 chunks instead");
                    let mut p = self.prepare_int8(model)?;
                    p.how = format!("the partitioned plan could not be prepared ({e}): INT8 chunks instead; {}", p.how);
                    p
                }
            },
            PrefillPlan::Cpu => return Err(format!("the plan reads prompts on the CPU: {}", plan.why)),
        };
        prepared.how = format!("{said}; {}", prepared.how);
        Ok(prepared)
    }

    fn failed(&mut self, model: &Arc<Model>, _reason: &str) -> Option<String> {
        Some(self.replan_without_npu(model))
    }
}

impl Planned {
    /// llm.npu's INT8 chunked prefill for `model`, out of order.
    fn prepare_int8(&mut self, model: &Arc<Model>) -> Result<Prepared, String> {
        let mut p = self.int8.prepare(model)?;
        let s = &self.int8.settings;
        p.takes = Some(Takes {
            chunk: Some(s.chunk),
            chunks_per_job: s.ooe_chunks.max(1),
            decode: false,
            one_sequence_at_a_time: false,
        });
        Ok(p)
    }

    /// HeteroLLM's fp16 partitioned prefill for `model` (and decode, where `plan` cuts it).
    fn prepare_fp16(&mut self, model: &Arc<Model>, plan: &Plan) -> Result<Prepared, String> {
        if self.hetero.opened.is_none() {
            let gpu = self.gpu.clone().map_err(|e| format!("the plan needs the GPU: {e}"))?;
            self.hetero.open_with(gpu).map_err(|r| r.reason)?;
        }
        let mut p = self.hetero.prepare_plan(model)?;
        p.takes = Some(Takes {
            chunk: Some(self.hetero.hetero.sizes.iter().copied().max().unwrap_or(self.int8.settings.chunk)),
            // Out of order across chunks: the GPU's parts of one beside the CPU's attention of
            // another.
            chunks_per_job: self.int8.settings.ooe_chunks.max(1),
            decode: plan.decode == DecodePlan::HeteroTensor,
            one_sequence_at_a_time: true,
        });
        Ok(p)
    }

    /// The plan of a model whose NPU job failed, made again without the NPU.
    fn replan_without_npu(&mut self, model: &Arc<Model>) -> String {
        let (plan, told) = plan_for(&self.plan, model, Present { npu: false, gpu: self.gpu.is_ok() });
        format!("plan made again without the NPU: {:?} prefill, {:?} decode ({told})", plan.prefill, plan.decode)
    }
}

/// `model`'s plan with the processors `present`: the stored one when its key (the planner's
/// version, the profile, the model's shape and size, the processors, the prompt length planned
/// for) is the same, else
/// made and stored. Also says which, and why it was made.
fn plan_for(p: &PlanSettings, model: &Arc<Model>, present: Present) -> (Plan, String) {
    let shape = choose::shape_of(model, &model.name);
    let key = serde_json::json!({
        "planner": choose::PLANNER_VERSION,
        "profile": p.soc,
        "model": {"name": model.name, "shape": shape, "weight_bytes": model.transformer.weights.size_bytes()},
        "present": present,
        "prompt": choose::PLAN_PROMPT,
    });
    let file = p.dir.as_ref().map(|d| d.join(format!("{}.{}.json", model.name, p.soc.key).to_lowercase()));
    let stored: Option<serde_json::Value> =
        file.as_ref().and_then(|f| std::fs::read(f).ok()).and_then(|b| serde_json::from_slice(&b).ok());
    let why = match &stored {
        None => "none stored".to_owned(),
        Some(v) if v["key"] == key => match serde_json::from_value::<Plan>(v["plan"].clone()) {
            Ok(plan) => {
                return (
                    plan,
                    format!("loaded from {}", file.as_ref().map_or(String::new(), |f| f.display().to_string())),
                )
            }
            Err(_) => "the stored one does not read".to_owned(),
        },
        Some(v) => ["planner", "profile", "model", "present", "prompt"]
            .iter()
            .filter(|k| v["key"][**k] != key[**k])
            .map(|k| match *k {
                "planner" => "the planner changed",
                "present" => "the devices present changed",
                "model" => "the model changed",
                "profile" => "the profile changed",
                _ => "the prompt length planned for changed",
            })
            .collect::<Vec<_>>()
            .join(", "),
    };
    let plan = choose::choose(&p.soc, &shape, choose::PLAN_PROMPT, present, true);
    let mut told = format!("made: {why}");
    if let Some(f) = &file {
        let body = serde_json::json!({"key": key, "plan": plan});
        match write_atomically(f, body.to_string().as_bytes()) {
            Ok(()) => told.push_str(&format!(", stored in {}", f.display())),
            Err(e) => tracing::warn!("the plan was not stored in {}: {e}", f.display()),
        }
    }
    (plan, told)
}
