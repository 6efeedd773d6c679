//! `llmctl bench`: its options and what its parts share (the prompt text, the llama.cpp
//! worker). The parts import from here and never the reverse: `local` (`--local`, which hands
//! `--cold` to `cold`), `cold` (`--local --cold`), `load` (`--load`, against a running daemon)
//! and `soak` (`--soak MINUTES`, against a running daemon).

pub mod cold;
pub mod load;
pub mod local;
pub mod soak;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The llama.cpp worker, embedded so the command works from any directory.
const LLAMACPP_WORKER: &str = include_str!("../../../tools/bench/llamacpp_worker.py");

/// English prose for benchmark prompts, repeated as needed (the same ids go to both engines).
pub(crate) const BENCH_TEXT: &str = "The harbour town woke slowly that morning. Fishing boats came in one by one, \
their decks stacked with crates of silver fish, and the gulls followed them in wide, noisy circles. \
On the quay, traders set up their stalls and argued about prices while children ran between the \
nets. An old woman sold bread from a wooden cart; she had done so for forty years and knew every \
sailor by name. Further up the hill, the school bell rang, and the streets filled with the sound of \
footsteps and laughter. By noon the fog had lifted, and the lighthouse stood white against a clear \
blue sky. Visitors walked along the cliffs to watch the waves break on the rocks below, and some \
stopped at the small museum that told the story of the great storm of the last century, when the \
sea had swallowed half the harbour wall in a single night. ";

/// The nearest-rank `p`th percentile of `v` (NaN when empty), for `load` and `soak`.
pub(crate) fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// The options of `llmctl bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Run the engine inside llmctl on --model.
    #[arg(long, conflicts_with = "load")]
    pub local: bool,
    /// With --local: a model file (GGUF) or HF directory.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Load test of a running daemon (over --socket or kernel Binder): many clients, foreground
    /// and background, time to first token and batched decode throughput.
    #[arg(long)]
    pub load: bool,
    #[command(flatten)]
    pub load_args: LoadArgs,
    /// Soak test of a running daemon (over --socket or kernel Binder) for this many minutes:
    /// --clients clients with short and long prompts, chat, cancels, refused requests, session
    /// churn, reconnects and killed clients; prints requests answered, answers by code,
    /// latencies, and the daemon's RSS and descriptors over time, and fails unless there was no
    /// crash, every request was answered exactly once, RSS did not drift and descriptors
    /// stayed flat. Needs an admin uid (it reads the daemon's dump).
    #[arg(long, value_name = "MINUTES", conflicts_with_all = ["local", "load"])]
    pub soak: Option<f64>,
    /// With --soak: the most RSS may grow, in percent, from the minute ending at a sixth of the
    /// run to the last minute.
    #[arg(long, value_name = "PCT", default_value_t = 5.0, requires = "soak")]
    pub max_rss_drift: f64,
    /// CPU threads for both engines (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Also run llama.cpp (Python module `llama_cpp`) on the same model and print ratios.
    #[arg(long)]
    pub compare_llamacpp: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Measured runs per figure (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub reps: u64,
    /// Prompt lengths for prefill, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    pub prefill: Vec<usize>,
    /// Prompt tokens before the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub decode_prompt: usize,
    /// Decode steps measured.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Also measure continuous batching: this many sequences decoding at once (each with its own
    /// prompt and continuation, --decode-prompt + --decode-tokens), one token of each per pass,
    /// against one sequence; prints tokens/s in all and the gain. 0 = off.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=64))]
    pub batch: u64,
    /// KV cache storage for our engine: f16 (as llama.cpp) or q8.
    #[arg(long, default_value = "f16")]
    pub kv_type: llmd_engine::model::kv::KvType,
    /// Cold start (with --local): time to first token from a cold page cache for the model as
    /// an llmd EdgeFlow file (converted at --bits, or --llmd), as GGUF in llmd, and in llama.cpp
    /// (with --compare-llamacpp). --model is the GGUF.
    #[arg(long, requires = "local")]
    pub cold: bool,
    /// With --cold: convert with this EdgeFlow budget (as `llmctl convert --bits`); without it,
    /// the source's natively-run tensors are kept and the rest are EdgeFlow at 5 bits.
    #[arg(long)]
    pub bits: Option<f64>,
    /// With --cold: use this llmd file instead of converting --model.
    #[arg(long, value_name = "PATH")]
    pub llmd: Option<PathBuf>,
    /// With --cold: prompt tokens before the first token.
    #[arg(long, default_value_t = 128)]
    pub cold_prompt: usize,
    /// Leave the token embedding on storage (rows read on demand; models with a separate
    /// output head) — compare resident memory and decode speed with and without.
    #[arg(long)]
    pub embeddings_on_flash: bool,
    /// With --local: cpu; npu (prompts' linear layers as W8A8 QNN graphs on the library
    /// --qnn-lib names; decode on the CPU: prefill rows are the host's time through the
    /// library — on the emulator, emulation, not a phone — and each prompt's modelled NPU time
    /// is printed beside them, labelled modelled); or gpu (prompts on the CPU, decode on the
    /// OpenCL device: the decode rows are that device's, with its kernels, host waits and
    /// bytes per token).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: crate::npu::BackendChoice,
    #[command(flatten)]
    pub npu: crate::npu::NpuArgs,
    #[command(flatten)]
    pub gpu: crate::gpu::GpuArgs,
    /// Prompt attention of --local (llama.cpp's, with --compare-llamacpp, stays dense).
    #[command(flatten)]
    pub attn: crate::attention::AttentionArgs,
    /// Python interpreter for --compare-llamacpp.
    #[arg(long, default_value = "python3", env = "LLMD_BENCH_PYTHON")]
    pub python: String,
}

/// The options of `llmctl bench --load` (`load`).
#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Concurrent clients in the batched and mixed phases (--load), or in all (--soak).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(2..=64))]
    pub clients: u64,
    /// Of those, how many send foreground requests in the mixed phase.
    #[arg(long, default_value_t = 2)]
    pub foreground: u64,
    /// Length of the mixed phase (and of the foreground clients' phase alone), in seconds. At
    /// 70 s two foreground clients send ~115 prompts a phase, so the nearest-rank p99 is the
    /// second slowest or later; at 30 s (~49 prompts) it is the slowest prompt itself, and one
    /// collision or hiccup decides the ratio.
    #[arg(long, default_value_t = 70, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub duration_s: u64,
    /// Requests in the idle phase (about as many as the mixed phase's foreground requests, so
    /// both p99s come from samples of similar size).
    #[arg(long, default_value_t = 110, value_parser = clap::value_parser!(u64).range(2..=1000))]
    pub idle_requests: u64,
    /// Rounds of the decode phases (one sequence, then all clients), alternated; the gain is
    /// the median of the rounds' gains. Five by default: on a shared machine one round's
    /// gain can swing by ±30% with a change of spell between its two phases (observed
    /// 2.0–3.8× within one run), and the median of five is steadier than that of three.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub decode_rounds: u64,
    /// Model id (default: the first installed).
    #[arg(long = "load-model")]
    pub model: Option<String>,
}

/// The llama.cpp worker process.
pub(crate) struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn start(python: &str) -> Result<Self, String> {
        let mut child = Command::new(python)
            .arg("-c")
            .arg(LLAMACPP_WORKER)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {python} for llama.cpp: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin for the llama.cpp worker")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout for the llama.cpp worker")?);
        Ok(Self { child, stdin, stdout })
    }

    pub(crate) fn call(&mut self, req: Value) -> Result<Value, String> {
        writeln!(self.stdin, "{req}").and_then(|_| self.stdin.flush()).map_err(|e| format!("llama.cpp worker: {e}"))?;
        let mut line = String::new();
        self.stdout.read_line(&mut line).map_err(|e| format!("llama.cpp worker: {e}"))?;
        if line.is_empty() {
            return Err("the llama.cpp worker exited (is llama-cpp-python installed? scripts/setup-llamacpp.sh)".into());
        }
        let v: Value = serde_json::from_str(&line).map_err(|e| format!("llama.cpp worker said {line:?}: {e}"))?;
        if v["ok"] != json!(true) {
            return Err(format!("llama.cpp: {}", v["error"].as_str().unwrap_or("unknown error")));
        }
        Ok(v)
    }

    pub(crate) fn seconds(v: &Value) -> Result<f64, String> {
        v["seconds"].as_f64().ok_or_else(|| format!("llama.cpp worker reply without seconds: {v}"))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"op": "quit"}));
        let _ = self.child.wait();
    }
}
