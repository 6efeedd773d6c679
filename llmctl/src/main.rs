//! `llmctl`: the engineer's command line for llmd.

use clap::{Parser, Subcommand};
use llmctl::cli::{self, ChatArgs, RunArgs};
use llmctl::{bench, client, modeltools};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "llmctl", version, about = "Command line for the llmd on-device LLM service")]
struct Cli {
    /// Reach llmd over this Unix socket instead of kernel Binder.
    #[arg(long, global = true, env = "LLMD_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Service name to look up.
    #[arg(long, global = true, default_value = "llmd")]
    service: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt, streaming it to standard output.
    Run(RunArgs),
    /// A multi-turn conversation: one user message per line of standard input.
    Chat(ChatArgs),
    /// List the installed models; with `--local FILE`, a model file's weight types and the
    /// kernel each runs on here (no daemon needed).
    Models(cli::ModelsArgs),
    /// Show the daemon's status (and, for an admin uid, each model's residency and memory pressure).
    Status,
    /// Load a model ahead of use (admin); returns when it is resident.
    Prefetch {
        /// The model id.
        model: String,
    },
    /// Print the daemon's state: models, sessions, queues, memory, devices, recent jobs,
    /// config (admin); `--json` as a document, `--timeline FILE` the jobs as a Gantt chart.
    Dump(cli::DumpArgs),
    /// Measure prefill and decode speed and peak memory (`--local`), optionally side by side
    /// with llama.cpp (`--compare-llamacpp`).
    Bench(bench::BenchArgs),
    /// Convert a GGUF file or HF directory to an llmd file with EdgeFlow mixed-precision
    /// weights (`--bits`, optionally smoothed with `--calibrate TEXT`).
    Convert(modeltools::ConvertArgs),
    /// Perplexity of a model on a text file (windows of `--ctx` tokens).
    Perplexity(modeltools::PerplexityArgs),
    /// shadowAttn's pilot against float attention on a text: per layer and overall, the share
    /// of the float top-k keys the INT8 pilot picks (prints `{"recall": …}` last).
    AttentionRecall(llmctl::attention::RecallArgs),
    /// shadowAttn's attention kernel on a phone, MODELLED (the head-wise pipeline's greedy plan
    /// over the paper's own NPU and CPU figures): dense on one mid core against the NPU pilot.
    AttentionModel(llmctl::attention::ModelArgs),
    /// The NPU path's quantization schemes side by side on a text (llm.npu's Table 6 in kind):
    /// perplexity and next-token agreement with the float model for W8A8, SmoothQuant,
    /// LLM.int8() and shadow outlier execution at several pruning rates (simulated quantization).
    NpuAccuracy(modeltools::NpuAccuracyArgs),
    /// llm.npu's prefill on a phone, MODELLED: chunk-sharing graphs vs per-length and padded
    /// graphs, out-of-order vs in-order scheduling, prefill tok/s by pruning rate (the engine's
    /// scheduler in a discrete-event simulation over the emulator's cost model).
    NpuModel(llmctl::npu_model::NpuModelArgs),
    /// How a phone SoC should run a model, MODELLED (HeteroLLM's solver and simulator over a
    /// SoC profile): per operator placement and cut, prefill and decode rates, weights per
    /// processor, graphs to pre-build, INT8 (llm.npu) vs float (HeteroLLM) prefill with a
    /// recommendation; `--paper` prints the paper's figures beside the model's.
    Plan(llmctl::plan::PlanArgs),
    /// Fast synchronisation on this machine, MEASURED: wake latency and CPU time of
    /// predicted-sleep-then-poll against a condition variable and against sleeping, for
    /// emulated kernels of 100–1000 µs.
    SyncBench(llmctl::sync_bench::SyncBenchArgs),
    /// The QNN library for the NPU path: its provider, API versions and build id, the context
    /// cache, and a one-layer self-check against llmd's reference arithmetic (no daemon needed).
    NpuInfo(llmctl::npu::NpuArgs),
    /// The OpenCL devices for the GPU path: platform, device, extensions, kernel variants, the
    /// program cache, and a one-layer self-check of every kernel against references (no daemon
    /// needed).
    GpuInfo(llmctl::gpu::GpuArgs),
}

use llmd_engine::chat::SANDBOX_ARG as RENDER_CHAT_TEMPLATE;

fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|a| a == RENDER_CHAT_TEMPLATE) {
        return ExitCode::from(llmd_engine::chat::sandbox_child_main().clamp(0, 255) as u8);
    }
    // Before anything loads a library that prints on descriptor 1 (QNN's do).
    llmctl::output::isolate();
    // With --local, a model file's chat template renders in a child llmctl with bounded memory
    // and CPU, as in llmd. Without its own path (rare), it renders in-process.
    if let Ok(program) = std::env::current_exe() {
        llmd_engine::chat::set_sandbox(llmd_engine::chat::Sandbox { program, args: vec![RENDER_CHAT_TEMPLATE.into()] });
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("LLMD_LOG"))
        .init();
    // An empty LLMD_SOCKET means "not set" (clap would reject it as a missing value).
    if std::env::var_os("LLMD_SOCKET").is_some_and(|v| v.is_empty()) {
        std::env::remove_var("LLMD_SOCKET");
    }
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Run(args) if args.local => cli::run_local(args),
        Command::Bench(args) if args.load && args.batch > 0 => {
            Err("--batch measures the engine inside llmctl: use it with --local (--load has --clients)".into())
        }
        Command::Bench(args) if args.soak.is_some() && (args.batch > 0 || args.compare_llamacpp) => {
            Err("--soak runs against a daemon: --batch and --compare-llamacpp belong to --local".into())
        }
        Command::Bench(args) if args.soak.is_some() => bench::soak::run(
            cli.socket.as_deref(),
            &cli.service,
            &args.load_args,
            &bench::soak::SoakArgs { minutes: args.soak.unwrap_or_default(), max_rss_drift_pct: args.max_rss_drift },
            args.json,
        ),
        Command::Bench(args) if args.load => {
            bench::load::run(cli.socket.as_deref(), &cli.service, &args.load_args, args.decode_tokens, args.json)
        }
        Command::Bench(args) => bench::local::bench(args),
        Command::Convert(args) => modeltools::convert(args),
        Command::Models(cli::ModelsArgs { local: Some(path) }) => cli::models_local(path),
        Command::Perplexity(args) => modeltools::perplexity(args),
        Command::AttentionRecall(args) => llmctl::attention::recall(args),
        Command::AttentionModel(args) => llmctl::attention::model(args),
        Command::NpuAccuracy(args) => modeltools::npu_accuracy(args),
        Command::NpuModel(args) => llmctl::npu_model::run(args),
        Command::Plan(args) => llmctl::plan::run(args),
        Command::SyncBench(args) => llmctl::sync_bench::run(args),
        Command::NpuInfo(args) => llmctl::npu::info(args),
        Command::GpuInfo(args) => llmctl::gpu::info(args),
        cmd => client::connect(cli.socket.as_deref(), &cli.service).and_then(|conn| match cmd {
            Command::Run(args) => cli::run_remote(&conn, args),
            Command::Chat(args) => cli::chat(&conn, args),
            Command::Models(_) => cli::models(&conn),
            Command::Status => cli::status(&conn),
            Command::Prefetch { model } => cli::prefetch(&conn, model),
            Command::Dump(args) => cli::dump(&conn, args),
            // Handled above, without this connection.
            Command::Bench(_)
            | Command::Convert(_)
            | Command::Perplexity(_)
            | Command::AttentionRecall(_)
            | Command::AttentionModel(_)
            | Command::NpuAccuracy(_)
            | Command::NpuModel(_)
            | Command::Plan(_)
            | Command::SyncBench(_)
            | Command::NpuInfo(_)
            | Command::GpuInfo(_) => Ok(()),
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, whatever the cause's own formatting.
            eprintln!("llmctl: error: {}", e.split_whitespace().collect::<Vec<_>>().join(" "));
            ExitCode::FAILURE
        }
    }
}
