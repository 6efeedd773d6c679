//! `llmd`: the on-device LLM service daemon.

use clap::Parser;
use llmd_daemon::config::{Config, KernelBinder};
use llmd_daemon::connections::{SocketOptions, SocketServer};
use llmd_daemon::{models, service};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "llmd", version, about = "On-device LLM system service")]
struct Args {
    /// TOML configuration file (flags below override it).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Directory of models (*.gguf and *.llmd files, HF directories); a model's id is its file name without extension.
    #[arg(long, value_name = "DIR")]
    models_dir: Option<PathBuf>,
    /// Serve this model file or HF directory (may be repeated).
    #[arg(long, value_name = "PATH")]
    model: Vec<PathBuf>,
    /// Serve Binder over this Unix socket.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Register with kernel Binder: auto (when a binder device exists), on, off.
    #[arg(long, value_enum)]
    kernel_binder: Option<KernelArg>,
    /// CPU threads for inference (0 = one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Memory for models, KV caches and scratch, in MB (0 = no limit); overrides the config.
    #[arg(long, value_name = "MB")]
    memory_budget_mb: Option<u64>,
    /// Where the usage history and spilled KV caches live; overrides the config.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// Which processors besides the CPU take work: auto (the default: a phone's NPU for
    /// prompts and its GPU for decode, where the system has them), cpu (none), npu (prompts'
    /// linear layers on QNN, the emulator included; `[npu]` in the config) or gpu (decode on
    /// OpenCL, whatever the device; `[gpu]`) or hetero (HeteroLLM: every linear layer cut
    /// between the NPU's fp16 graphs and the GPU on a plan; `[hetero]`, `[npu]`, `[gpu]`).
    /// Overrides the config's `backend`.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// The QNN backend library for `--backend npu` (Qualcomm's libQnnHtp.so, or llmd's
    /// emulator provider, the default off Android: libllmd_qnn_emu.so beside llmd). Without it,
    /// `LLMD_QNN_LIB`, then the config's `npu.library`.
    #[arg(long, value_name = "PATH")]
    qnn_lib: Option<PathBuf>,
    /// The OpenCL library for `--backend gpu` (default: the ICD loader, libOpenCL.so.1, then a
    /// phone's /vendor/lib64/libOpenCL.so). Without it, `LLMD_OPENCL_LIB`, then the config's
    /// `gpu.library`.
    #[arg(long, value_name = "PATH")]
    opencl_lib: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum BackendArg {
    Auto,
    Cpu,
    Npu,
    Gpu,
    Hetero,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum KernelArg {
    Auto,
    On,
    Off,
}

/// Binder threads serving socket connections (they only validate and enqueue).
const SOCKET_THREADS: u32 = 16;

fn binder_device_exists() -> bool {
    ["/dev/binderfs/binder", "/dev/binder"].iter().any(|p| std::path::Path::new(p).exists())
}

fn run(args: Args) -> Result<(), String> {
    let mut config = match &args.config {
        Some(p) => Config::from_file(p).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    if let Some(d) = args.models_dir {
        config.models_dir = Some(d);
    }
    config.models.extend(args.model);
    if let Some(s) = args.socket {
        config.socket = Some(std::path::absolute(&s).map_err(|e| format!("socket path {}: {e}", s.display()))?);
    }
    if let Some(k) = args.kernel_binder {
        config.kernel_binder = match k {
            KernelArg::Auto => KernelBinder::Auto,
            KernelArg::On => KernelBinder::On,
            KernelArg::Off => KernelBinder::Off,
        };
    }
    if let Some(t) = args.threads {
        config.threads = t;
    }
    if let Some(b) = args.memory_budget_mb {
        config.residency.memory_budget_mb = b;
    }
    if let Some(d) = args.state_dir {
        config.residency.state_dir = Some(d);
    }
    if let Some(b) = args.backend {
        config.backend = match b {
            BackendArg::Auto => llmd_daemon::config::Backend::Auto,
            BackendArg::Cpu => llmd_daemon::config::Backend::Cpu,
            BackendArg::Npu => llmd_daemon::config::Backend::Npu,
            BackendArg::Gpu => llmd_daemon::config::Backend::Gpu,
            BackendArg::Hetero => llmd_daemon::config::Backend::Hetero,
        };
    }
    // The OpenCL library: --opencl-lib, else LLMD_OPENCL_LIB, else the config's, else the default.
    if let Some(l) =
        args.opencl_lib.or_else(|| std::env::var_os("LLMD_OPENCL_LIB").filter(|v| !v.is_empty()).map(PathBuf::from))
    {
        config.gpu.library = Some(l);
    }
    // The QNN library: --qnn-lib, else LLMD_QNN_LIB, else the config's, else the default.
    if let Some(l) =
        args.qnn_lib.or_else(|| std::env::var_os("LLMD_QNN_LIB").filter(|v| !v.is_empty()).map(PathBuf::from))
    {
        config.npu.library = Some(l);
    }
    config.validate().map_err(|e| e.to_string())?;
    let kernel = match config.kernel_binder {
        KernelBinder::On => true,
        KernelBinder::Off => false,
        KernelBinder::Auto => binder_device_exists(),
    };
    if !kernel && config.socket.is_none() {
        return Err("nothing to serve on: no binder device and no --socket".into());
    }
    tracing::info!("effective configuration:\n{}", config.to_toml());
    let paths = models::discover(&config)?;
    let probed = models::probe_all(&paths);
    if probed.is_empty() {
        return Err("no usable model".into());
    }
    check_budget(&config, &probed)?;
    let n_models = probed.len();
    let r = &config.residency;
    let residency = llmd_daemon::residency::Residency::new(
        probed,
        r.memory_budget_bytes(),
        &r.pinned,
        &r.priorities,
        llmd_engine::LoadOptions {
            threads: config.threads,
            kv_type: config.kv_cache_type.engine(),
            embeddings_on_flash: r.embeddings_on_flash,
        },
    );
    let pressure = Box::new(llmd_daemon::residency::PsiFile(r.pressure_file.clone()));
    let name = config.service_name.clone();
    let admin_name = format!("{name}.admin");
    let socket = config.socket.clone();
    let socket_mode = config.socket_mode_bits().map_err(|e| e.to_string())?;
    let grace_ms = config.shutdown_grace_ms;
    let stall_s = config.scheduler.stream_stall_timeout_s;
    let daemon =
        service::Daemon::start(config, residency, pressure).map_err(|e| format!("starting the engine worker: {e}"))?;
    daemon.load_at_start();
    let mut guards = Vec::new();
    let mut socket_server = None;
    if let Some(path) = &socket {
        // llmd's own accept loop: each connection counted against its uid's cap
        // (`llmd_daemon::connections`), then served by rsbinder.
        let options = SocketOptions {
            path: path.clone(),
            mode: socket_mode,
            services: vec![
                (name.clone(), daemon.service().as_binder()),
                (admin_name.clone(), daemon.admin().as_binder()),
            ],
            threads: SOCKET_THREADS,
            // A client that takes nothing of a send for this long is taken for stopped: its
            // connection ends (its sessions close); the worker ends its request meanwhile.
            send_timeout: (stall_s > 0).then(|| Duration::from_secs(stall_s)),
        };
        let server = SocketServer::start(options, daemon.shared.connections.clone())
            .map_err(|e| format!("serving on {}: {e}", path.display()))?;
        let (per_uid, overall, _) = daemon.shared.connections.caps();
        tracing::info!(socket = %path.display(), per_uid, overall, "serving Binder over a Unix socket");
        eprintln!("llmd: serving {} model(s) on {}", n_models, path.display());
        socket_server = Some(server);
    }
    if kernel {
        let server = rsbinder::serve(rsbinder::Endpoint::kernel())
            .and_then(|s| s.add(&name, daemon.service().as_binder()))
            .and_then(|s| s.add(&admin_name, daemon.admin().as_binder()))
            .and_then(|s| s.spawn())
            .map_err(|e| format!("registering {name:?} with the service manager: {e:?}"))?;
        tracing::info!(service = %name, "registered with the kernel Binder service manager");
        eprintln!("llmd: registered {name:?} with the service manager");
        guards.push(server);
    }
    // Until SIGTERM (init's stop, `kill`) or SIGINT (Ctrl-C), blocked in every thread since
    // `main` began and taken here: then drain and exit 0.
    let sig = stop_signals().wait().map_err(|e| format!("waiting for SIGTERM or SIGINT: {e}"))?;
    tracing::info!(signal = %sig, "stopping");
    let grace = Duration::from_millis(grace_ms);
    eprintln!("llmd: stopping: no new requests; those in flight have {} ms to finish", grace.as_millis());
    let r = daemon.drain(grace);
    eprintln!(
        "llmd: stopped in {} ms: {} requests were in flight, {} cancelled{}{}",
        r.took.as_millis(),
        r.in_flight,
        r.cancelled,
        if r.left > 0 { format!(", {} still booked", r.left) } else { String::new() },
        if r.undelivered { ", some callbacks undelivered (a client not reading)" } else { "" }
    );
    if let Some(path) = &socket {
        let _ = std::fs::remove_file(path);
    }
    if let Some(server) = socket_server {
        server.stop();
    }
    drop(guards);
    Ok(())
}

/// A memory budget below what a model's weights need is refused at start, with the numbers:
/// for a pinned model, or when no model fits at all. A model that alone does not fit is logged
/// (it would fail to load when asked for).
fn check_budget(
    config: &Config,
    probed: &std::collections::BTreeMap<String, (PathBuf, llmd_engine::ModelProbe)>,
) -> Result<(), String> {
    let budget_mb = config.residency.memory_budget_mb;
    if budget_mb == 0 {
        return Ok(());
    }
    let mb = |b: u64| b.div_ceil(1 << 20);
    let over: Vec<(&String, u64)> = probed
        .iter()
        .filter(|(_, (_, p))| mb(p.weight_bytes) > budget_mb)
        .map(|(id, (_, p))| (id, mb(p.weight_bytes)))
        .collect();
    if let Some((id, need)) = over.iter().find(|(id, _)| config.residency.pinned.contains(id)) {
        return Err(format!(
            "the pinned model {id} needs {need} MB for its weights alone, more than the memory budget of {budget_mb} MB \
             (memory_budget_mb / --memory-budget-mb): raise the budget or unpin it"
        ));
    }
    if over.len() == probed.len() {
        let (id, need) = over.iter().min_by_key(|(_, n)| *n).map(|(i, n)| (i.as_str(), *n)).unwrap_or(("?", 0));
        return Err(format!(
            "the memory budget of {budget_mb} MB is below every model's weights (the smallest, {id}, needs {need} MB): \
             raise memory_budget_mb / --memory-budget-mb"
        ));
    }
    for (id, need) in over {
        tracing::warn!("model {id} needs {need} MB for its weights, more than the memory budget of {budget_mb} MB: it cannot be loaded");
    }
    Ok(())
}

use llmd_engine::chat::SANDBOX_ARG as RENDER_CHAT_TEMPLATE;

/// SIGTERM and SIGINT: blocked in every thread from the start of `main` (threads inherit the
/// mask) and taken by `sigwait` when llmd has started. A handler would not do: an OpenCL
/// runtime built on LLVM (PoCL) installs handlers of its own for them that restore the default
/// action and raise the signal again, so that `kill` would end llmd by the signal (exit 143)
/// instead of draining it. (Children get an empty mask: std resets it before `exec`.)
fn stop_signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    [Signal::SIGTERM, Signal::SIGINT].into_iter().collect::<SigSet>()
}

fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|a| a == RENDER_CHAT_TEMPLATE) {
        return ExitCode::from(llmd_engine::chat::sandbox_child_main().clamp(0, 255) as u8);
    }
    if let Err(e) = stop_signals().thread_block() {
        eprintln!("llmd: error: blocking SIGTERM and SIGINT for their waiter: {e}");
        return ExitCode::FAILURE;
    }
    // Model files' chat templates render in a child llmd with bounded memory and CPU.
    match std::env::current_exe() {
        Ok(program) => {
            llmd_engine::chat::set_sandbox(llmd_engine::chat::Sandbox {
                program,
                args: vec![RENDER_CHAT_TEMPLATE.into()],
            });
        }
        Err(e) => {
            eprintln!("llmd: error: cannot find its own executable for the chat-template sandbox: {e}");
            return ExitCode::FAILURE;
        }
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("LLMD_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llmd: error: {e}");
            ExitCode::FAILURE
        }
    }
}
