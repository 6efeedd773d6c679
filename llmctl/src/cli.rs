//! `llmctl` subcommands: `run` (in-process with `--local`, or through the daemon), `chat`,
//! `models`, `status`, `dump`.

use crate::client::{self, Connection};
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::{Flow, GenerateRequest, Prompt};
use llmd_engine::sampling::SamplingParams;
use llmd_engine::{LoadOptions, Model};
use std::io::{BufRead, Write};
use std::path::PathBuf;

/// Largest `--max-tokens` accepted (the context window and the daemon's limits bound it further).
pub const MAX_NEW_TOKENS: u64 = 1 << 20;

/// Sampling options shared by `run` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample from the K most likely tokens only (0 = no limit).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one.
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise recently generated tokens (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Random seed; the same seed and parameters give the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }
}

/// Builds the wire request for a prompt or a chat turn.
pub fn request(
    prompt: Option<&str>,
    messages: Vec<(String, String)>,
    p: &SamplingArgs,
    max_tokens: u64,
    stop: &[String],
) -> llmd_aidl::GenerateRequest::GenerateRequest {
    // The wire types (the engine's `ChatMessage` and `GenerateRequest` are imported above).
    use llmd_aidl::ChatMessage::ChatMessage;
    use llmd_aidl::GenerateRequest::GenerateRequest;
    GenerateRequest {
        prompt: prompt.unwrap_or_default().to_owned(),
        messages: messages.into_iter().map(|(role, content)| ChatMessage { role, content }).collect(),
        temperature: p.temperature,
        topK: p.top_k.min(i32::MAX as usize) as i32,
        topP: p.top_p,
        minP: p.min_p,
        repetitionPenalty: p.repetition_penalty,
        seed: p.seed as i64,
        maxTokens: max_tokens.min(i32::MAX as u64) as i32,
        stop: stop.to_vec(),
        ..GenerateRequest::default()
    }
}

/// Options of `llmctl run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Run the engine inside llmctl instead of asking the llmd daemon.
    #[arg(long)]
    pub local: bool,
    /// With --local: a model file (GGUF) or HF directory. Otherwise: the id of an installed
    /// model (default: the first one `llmctl models` lists).
    #[arg(long, value_name = "PATH|ID")]
    pub model: Option<String>,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (the template's default if omitted).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=MAX_NEW_TOKENS))]
    pub max_tokens: u64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Stop when this text appears (may be given several times).
    #[arg(long)]
    pub stop: Vec<String>,
    /// With --local: CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// With --local: KV cache storage, f16 or q8 (int8: half the memory).
    #[arg(long, default_value = "f16")]
    pub kv_type: llmd_engine::model::kv::KvType,
    /// With --local: cpu; npu (the prompt's linear layers as W8A8 QNN graphs on the library
    /// --qnn-lib names, calibrated at load; decode on the CPU); or gpu (the prompt on the CPU,
    /// decode on the OpenCL device of --gpu-device, with --opencl-lib's library).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: crate::npu::BackendChoice,
    #[command(flatten)]
    pub npu: crate::npu::NpuArgs,
    #[command(flatten)]
    pub gpu: crate::gpu::GpuArgs,
    /// Prompt attention with --local (a daemon's is set by its configuration).
    #[command(flatten)]
    pub attn: crate::attention::AttentionArgs,
    /// The prompt; "-" reads it from standard input.
    pub prompt: String,
}

/// Options of `llmctl chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// Id of an installed model (default: the first one).
    #[arg(long)]
    pub model: Option<String>,
    /// System message opening the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=MAX_NEW_TOKENS))]
    pub max_tokens: u64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

fn read_prompt(arg: &str) -> Result<String, String> {
    let text = if arg == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| format!("reading the prompt from standard input: {e}"))?;
        s
    } else {
        arg.to_owned()
    };
    if text.is_empty() {
        return Err("the prompt is empty".into());
    }
    Ok(text)
}

/// Keeps a shell prompt off the last line, but writes only the generated text into pipes.
fn end_line(out: &mut impl Write) {
    if crate::output::is_terminal() {
        let _ = writeln!(out);
    }
}

/// `llmctl run --local`: generated text only on stdout, rates on stderr.
pub fn run_local(args: &RunArgs) -> Result<(), String> {
    let model_path = PathBuf::from(args.model.as_deref().ok_or("--local needs --model PATH")?);
    let prompt_text = read_prompt(&args.prompt)?;
    let sampling = args.sampling.params();
    sampling.validate().map_err(|e| e.to_string())?;
    let load_start = std::time::Instant::now();
    let opts = LoadOptions { threads: args.threads, kv_type: args.kv_type, embeddings_on_flash: false };
    let model = if llmd_engine::format::llmd::path_is_llmd(&model_path) {
        // The streaming loader: a progress bar (on a terminal) and its stage timings.
        let pb = indicatif::ProgressBar::new(0);
        pb.set_style(
            indicatif::ProgressStyle::with_template("loading [{bar:30}] {bytes}/{total_bytes}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let bar = pb.clone();
        let stream = llmd_engine::model::stream::StreamOptions {
            progress: Some(std::sync::Arc::new(move |p: &llmd_engine::model::stream::Progress| {
                bar.set_length(p.total_bytes);
                bar.set_position(p.read_bytes);
            })),
            ..Default::default()
        };
        let (m, _, r) = Model::load_llmd(&model_path, &opts, &stream, None)
            .map_err(|e| format!("{}: {e}", model_path.display()))?;
        pb.finish_and_clear();
        eprintln!(
            "loaded {:.1} MB: read {:.3} s, unpack {:.3} s (busy, summed over threads), setup {:.3} s, wall {:.3} s",
            r.bytes_read as f64 / 1e6,
            r.read_busy_s,
            r.unpack_busy_s,
            r.setup_s,
            r.wall_s
        );
        m
    } else {
        Model::load(&model_path, &opts).map_err(|e| format!("{}: {e}", model_path.display()))?
    };
    crate::attention::apply(&model, &args.attn)?;
    let load_time = load_start.elapsed();
    let prompt = if args.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", &prompt_text));
        Prompt::Chat(msgs)
    } else {
        Prompt::Text(prompt_text)
    };
    let req = GenerateRequest { prompt, sampling, max_tokens: args.max_tokens as usize, stop: args.stop.clone() };
    let tokens = model.prompt_tokens(&req.prompt).map_err(|e| e.to_string())?;
    let ctx = model.config().context_length;
    if tokens.len() >= ctx {
        return Err(format!("the prompt has {} tokens; the model's context holds {ctx}", tokens.len()));
    }
    let mut model = model;
    // Resident memory before the OpenCL runtime is loaded, and after it built its program.
    let mut rss_kb = [crate::bench::local::status_kb("VmRSS"), 0];
    let gpu = match args.backend {
        crate::npu::BackendChoice::Gpu => {
            let g = crate::gpu::open(&args.gpu)?;
            rss_kb[1] = crate::bench::local::status_kb("VmRSS");
            crate::gpu::attach(&mut model, g.clone());
            Some(g)
        }
        _ => None,
    };
    let npu = match args.backend {
        crate::npu::BackendChoice::Npu => Some(crate::npu::prepare(&model, &args.npu)?),
        _ => None,
    };
    let gpu_before = gpu.as_ref().map(|g| g.stats());
    let prefill = npu.as_ref().map(|n| (&n.devs, n.chunk));
    let mut kv = model.transformer.new_kv();
    let mut out = crate::output::stdout();
    let mut write_err = None;
    let stats = model
        .generate_in_chunks(&mut kv, &tokens, &req, prefill, args.npu.npu_ooe_chunks as usize, |text, _| {
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                write_err = Some(e);
                return Flow::Stop;
            }
            Flow::Continue
        })
        .map_err(|e| e.to_string())?;
    if let Some(e) = write_err {
        crate::output::write_failed(&e);
    }
    end_line(&mut out);
    eprintln!(
        "load {:.2} s | prompt {} tokens, {:.1} tok/s | generation {} tokens, {:.1} tok/s | first token {:.0} ms | finish {:?}",
        load_time.as_secs_f64(),
        stats.prompt_tokens,
        stats.prefill_tokens_per_s(),
        stats.generated_tokens,
        stats.decode_tokens_per_s(),
        stats.time_to_first_token.as_secs_f64() * 1e3,
        stats.finish,
    );
    if let (Some(g), Some(before)) = (&gpu, gpu_before) {
        let s = g.stats();
        // The first token comes from the prompt's pass (on the CPU): the GPU ran one step for
        // each later one. The prompt's cache went up in two writes a layer, once.
        let steps = stats.generated_tokens.saturating_sub(1).max(1) as f64;
        let handoff_writes = (2 * model.config().n_layers) as u64;
        eprintln!(
            "gpu: per decode step {:.0} kernels, {:.2} host waits (besides the cache's hand-off); {:.1} MB up in all (the weights once, each turn's cache once), {:.0} B down per step",
            (s.kernels - before.kernels) as f64 / steps,
            (s.host_waits - before.host_waits).saturating_sub(handoff_writes) as f64 / steps,
            (s.bytes_to_device - before.bytes_to_device) as f64 / 1e6,
            (s.bytes_from_device - before.bytes_from_device) as f64 / steps,
        );
        let (in_place, copied) = g.weight_bytes();
        let now = crate::bench::local::status_kb("VmRSS");
        eprintln!(
            "gpu: weights {:.1} MB read in place in the CPU's memory, {:.1} MB copied to the device; resident {:.0} MB with the model on the CPU, +{:.0} MB the OpenCL runtime and program, +{:.0} MB the run (device KV caches, buffers)",
            in_place as f64 / 1e6,
            copied as f64 / 1e6,
            rss_kb[0] as f64 / 1024.0,
            rss_kb[1].saturating_sub(rss_kb[0]) as f64 / 1024.0,
            now.saturating_sub(rss_kb[1]) as f64 / 1024.0,
        );
    }
    if let Some(n) = &npu {
        let (execs, modelled) = n.groups.stats();
        if modelled > 0 {
            eprintln!(
                "npu: {execs} graph executions; modelled NPU time {:.1} ms on the emulated chip (a model of the phone, not measured)",
                modelled as f64 / 1e6
            );
        } else {
            eprintln!("npu: {execs} graph executions");
        }
    }
    Ok(())
}

/// `llmctl run` through the daemon: the same output contract as `--local`; Ctrl-C cancels.
pub fn run_remote(conn: &Connection, args: &RunArgs) -> Result<(), String> {
    if args.attn.shadow() {
        return Err("--attention belongs to --local: a daemon's attention is set in its configuration".into());
    }
    let prompt_text = read_prompt(&args.prompt)?;
    let opened = std::time::Instant::now();
    // Opening a session loads its model if it is not resident (the time shows it).
    let session = client::open_session(conn, args.model.as_deref())?;
    let open_ms = opened.elapsed().as_secs_f64() * 1e3;
    let req = if args.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(("system".to_owned(), s.clone()));
        }
        msgs.push(("user".to_owned(), prompt_text));
        request(None, msgs, &args.sampling, args.max_tokens, &args.stop)
    } else {
        request(Some(&prompt_text), vec![], &args.sampling, args.max_tokens, &args.stop)
    };
    let mut out = crate::output::stdout();
    let stats = client::stream(&session, &req, &mut out)?;
    end_line(&mut out);
    eprintln!("open {open_ms:.0} ms | {}", client::stats_line(&stats));
    let _ = session.close();
    if stats.finishReason == "cancelled" {
        return Err("cancelled".into());
    }
    Ok(())
}

/// `llmctl chat`: a multi-turn conversation on standard input, one user turn per line.
/// `/reset` forgets the conversation; end of input ends it.
pub fn chat(conn: &Connection, args: &ChatArgs) -> Result<(), String> {
    let session = client::open_session(conn, args.model.as_deref())?;
    let mut first = true;
    let stdin = std::io::stdin();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    loop {
        if interactive {
            eprint!("> ");
        }
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).map_err(|e| format!("reading standard input: {e}"))? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            continue;
        }
        if line == "/reset" {
            session.reset().map_err(|e| client::describe(&e))?;
            first = true;
            continue;
        }
        let mut msgs = Vec::new();
        if first {
            if let Some(s) = &args.system {
                msgs.push(("system".to_owned(), s.clone()));
            }
        }
        msgs.push(("user".to_owned(), line.to_owned()));
        let req = request(None, msgs, &args.sampling, args.max_tokens, &[]);
        let mut out = crate::output::stdout();
        match client::stream(&session, &req, &mut out) {
            Ok(stats) => {
                let _ = writeln!(out);
                tracing::debug!("{}", client::stats_line(&stats));
                first = false;
            }
            Err(e) => {
                let _ = writeln!(out);
                eprintln!("llmctl: {e}");
            }
        }
    }
    let _ = session.close();
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct ModelsArgs {
    /// Instead of asking the daemon: list this GGUF or llmd file's matrices by weight type, with
    /// the kernel each type runs on on this machine (and an llmd file's EdgeFlow channels by
    /// bit-width).
    #[arg(long, value_name = "FILE")]
    pub local: Option<std::path::PathBuf>,
}

/// `llmctl models --local FILE`: the file's 2-D tensors by type, and what each type runs on.
pub fn models_local(path: &std::path::Path) -> Result<(), String> {
    if llmd_engine::format::llmd::path_is_llmd(path) {
        return models_local_llmd(path);
    }
    let f = llmd_engine::format::gguf::GgufFile::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut by: std::collections::BTreeMap<&'static str, (usize, u64, llmd_engine::quant::GgmlType)> =
        Default::default();
    for t in f.tensors.iter().filter(|t| t.dims.iter().filter(|&&d| d > 1).count() >= 2) {
        let e = by.entry(t.ty.name()).or_insert((0, 0, t.ty));
        e.0 += 1;
        e.1 += t.size;
    }
    crate::out!("{:<6} {:>8} {:>10}  KERNEL (this machine)", "TYPE", "MATRICES", "MB");
    for (name, (n, bytes, ty)) in by {
        crate::out!(
            "{:<6} {:>8} {:>10.1}  {}",
            name,
            n,
            bytes as f64 / 1e6,
            llmd_engine::backend::cpu::type_kernel(ty)
        );
    }
    Ok(())
}

/// [`models_local`] of an llmd file: its matrices by how they are stored (GGML blocks, K-quant
/// records, EdgeFlow channels), the kernel each runs on, and the EdgeFlow channels by bit-width
/// (read from each tensor's bit-width array; no other tensor data is read).
fn models_local_llmd(path: &std::path::Path) -> Result<(), String> {
    use llmd_engine::format::llmd::{self, TensorKind};
    use llmd_engine::quant::{edgeflow, GgmlType};
    use std::os::unix::fs::FileExt;
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let (header, meta, _) = llmd::read_head(path).map_err(|e| fail(&e))?;
    let file = std::fs::File::open(path).map_err(|e| fail(&e))?;
    let mut by: std::collections::BTreeMap<String, (usize, u64, String)> = Default::default();
    let mut widths = [0usize; 9];
    for t in meta.tensors.iter().filter(|t| t.rows > 1 && t.cols > 1) {
        let (name, kernel) = match t.kind {
            TensorKind::Ggml { type_id } | TensorKind::KPacked { type_id, .. } => {
                let ty = GgmlType::from_id(type_id).ok_or_else(|| fail(&format!("{}: type {type_id}", t.name)))?;
                let records = matches!(t.kind, TensorKind::KPacked { .. });
                let name = if records { format!("{} records", ty.name()) } else { ty.name().to_string() };
                (name, llmd_engine::backend::cpu::type_kernel(ty))
            }
            TensorKind::Edgeflow => {
                let rows = usize::try_from(t.rows).map_err(|e| fail(&e))?;
                let mut bits = vec![0u8; llmd::edgeflow_prefix(rows).0];
                file.read_exact_at(&mut bits, header.data_offset + t.offset).map_err(|e| fail(&e))?;
                let w = edgeflow::unpack_bit_widths(&bits, rows).ok_or_else(|| fail(&"a short bit-width array"))?;
                for b in w {
                    widths[usize::from(b).min(8)] += 1;
                }
                let kernel = llmd_engine::backend::cpu::type_kernel(GgmlType::Q8_0);
                ("EdgeFlow".to_string(), format!("{kernel} (unpacked at load)"))
            }
        };
        let e = by.entry(name).or_insert((0, 0, kernel));
        e.0 += 1;
        e.1 += t.len;
    }
    crate::out!("{:<12} {:>8} {:>10}  KERNEL (this machine)", "TYPE", "MATRICES", "MB");
    for (name, (n, bytes, kernel)) in by {
        crate::out!("{:<12} {:>8} {:>10.1}  {}", name, n, bytes as f64 / 1e6, kernel);
    }
    let channels: usize = widths.iter().sum();
    if channels > 0 {
        let mean = widths.iter().enumerate().map(|(b, n)| b * n).sum::<usize>() as f64 / channels as f64;
        let counts: Vec<String> =
            widths.iter().enumerate().filter(|(_, n)| **n > 0).map(|(b, n)| format!("{b} bits: {n}")).collect();
        crate::out!("EdgeFlow channels: {} (mean {mean:.2} bits; method {})", counts.join(", "), meta.quant.method);
    }
    Ok(())
}

pub fn models(conn: &Connection) -> Result<(), String> {
    let models = conn.service.listModels().map_err(|e| client::describe(&e))?;
    crate::out!("{:<40} {:<8} {:>6} {:>8} {:>10} {:>5}", "ID", "ARCH", "LAYERS", "CONTEXT", "WEIGHTS_MB", "CHAT");
    for m in models {
        crate::out!(
            "{:<40} {:<8} {:>6} {:>8} {:>10.1} {:>5}",
            m.id,
            m.architecture,
            m.layers,
            m.contextLength,
            m.weightBytes as f64 / 1e6,
            if m.hasChatTemplate { "yes" } else { "no" }
        );
    }
    Ok(())
}

pub fn status(conn: &Connection) -> Result<(), String> {
    let s = conn.service.getStatus().map_err(|e| client::describe(&e))?;
    crate::out!("interface_version {}", s.interfaceVersion);
    crate::out!("models_installed {}", s.modelsInstalled);
    crate::out!("sessions_open {}", s.sessionsOpen);
    crate::out!("requests_queued {}", s.requestsQueued);
    crate::out!("requests_running {}", s.requestsRunning);
    crate::out!("kv_cache_bytes {}", s.kvCacheBytes);
    crate::out!("weight_bytes {}", s.weightBytes);
    // Residency (each model's state, bytes, why it is there; memory pressure and its events)
    // comes from the admin service, when the caller may use it.
    match conn.admin().and_then(|a| a.dumpState().map_err(|e| client::describe(&e))) {
        Ok(d) => {
            let mut keep = false;
            for line in d.lines() {
                if line.starts_with("MODELS")
                    || line.starts_with("MEMORY")
                    || line.starts_with("PRESSURE")
                    || line.starts_with("DEVICES")
                    || line.starts_with("NPU")
                    || line.starts_with("GPU")
                    || line.starts_with("RESIDENCY")
                {
                    keep = true;
                } else if !line.starts_with(' ') && !line.is_empty() {
                    keep = false;
                }
                if keep {
                    crate::out!("{line}");
                }
            }
        }
        Err(_) => crate::out!("(model residency: needs an admin uid; see `llmctl dump`)"),
    }
    Ok(())
}

pub fn prefetch(conn: &Connection, model: &str) -> Result<(), String> {
    let t = std::time::Instant::now();
    conn.admin()?.prefetch(model).map_err(|e| client::describe(&e))?;
    crate::out!("{model} resident ({:.2} s)", t.elapsed().as_secs_f64());
    Ok(())
}

#[derive(clap::Args, Debug, Default)]
pub struct DumpArgs {
    /// Print a JSON document: `"sections"` (each section's lines) and `"jobs"` (the recent
    /// jobs of every processor: request, processor, kind, chunk, tokens, start_ms, end_ms, ok).
    #[arg(long)]
    pub json: bool,
    /// Also write the recent jobs as a Gantt chart (SVG): one lane per processor.
    #[arg(long, value_name = "FILE")]
    pub timeline: Option<PathBuf>,
    /// Only this request's jobs (in `--json` and `--timeline`).
    #[arg(long, value_name = "ID")]
    pub request: Option<u64>,
}

/// One job of the dump's `JOBS` section, as `dump --json` lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub request: u64,
    pub processor: String,
    pub kind: String,
    pub chunk: Option<u64>,
    pub tokens: u64,
    pub start_ms: u64,
    pub end_ms: u64,
    pub ok: bool,
}

/// The dump's sections: each name (a line at the left margin) and its indented lines; the last,
/// `CONFIG`, is TOML at the margin and keeps its lines as they are.
pub fn sections(dump: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut config = false;
    for line in dump.lines() {
        if config {
            if let Some((_, lines)) = out.last_mut() {
                lines.push(line.to_owned());
            }
            continue;
        }
        if line.is_empty() {
            continue;
        }
        match (line.starts_with(' '), out.last_mut()) {
            (true, Some((_, lines))) => lines.push(line.trim().to_owned()),
            _ => {
                config = line == "CONFIG";
                out.push((line.trim().to_owned(), Vec::new()))
            }
        }
    }
    out
}

/// The jobs of the dump's `JOBS` section (lines it cannot read are left out).
pub fn jobs(dump: &str) -> Vec<Job> {
    let section = sections(dump).into_iter().find(|(n, _)| n == "JOBS").map(|(_, l)| l).unwrap_or_default();
    section
        .iter()
        .filter_map(|l| {
            let l = l.strip_prefix("job ")?;
            let field = |k: &str| l.split_whitespace().find_map(|w| w.strip_prefix(k)?.strip_prefix('='));
            let num = |k: &str| field(k)?.parse::<u64>().ok();
            Some(Job {
                request: num("request")?,
                processor: field("processor")?.to_owned(),
                kind: field("kind")?.to_owned(),
                chunk: num("chunk"),
                tokens: num("tokens")?,
                start_ms: num("start_ms")?,
                end_ms: num("end_ms")?,
                ok: field("ok")? == "true",
            })
        })
        .collect()
}

/// The jobs as Gantt bars (milliseconds since the Unix epoch; the chart starts at the first).
pub fn job_bars(jobs: &[Job]) -> Vec<crate::gantt::Bar> {
    jobs.iter()
        .map(|j| crate::gantt::Bar {
            lane: j.processor.clone(),
            label: match j.chunk {
                Some(c) => format!("request {} prefill chunk {c} ({} tokens)", j.request, j.tokens),
                None => format!("request {} decode", j.request),
            },
            group: Some(j.request),
            start_ms: j.start_ms as f64,
            end_ms: j.end_ms.max(j.start_ms) as f64,
        })
        .collect()
}

pub fn dump(conn: &Connection, a: &DumpArgs) -> Result<(), String> {
    let text = conn.admin()?.dumpState().map_err(|e| client::describe(&e))?;
    let mut all = jobs(&text);
    all.retain(|j| a.request.is_none_or(|r| j.request == r));
    if let Some(file) = &a.timeline {
        let title = match a.request {
            Some(r) => format!("llmd: request {r}'s jobs (measured)"),
            None => "llmd: recent jobs (measured)".to_owned(),
        };
        let svg = crate::gantt::svg(&title, &["npu", "gpu", "cpu"], &job_bars(&all));
        std::fs::write(file, svg).map_err(|e| format!("{}: {e}", file.display()))?;
        eprintln!("{} jobs drawn in {}", all.len(), file.display());
    }
    if a.json {
        let sections: serde_json::Map<String, serde_json::Value> =
            sections(&text).into_iter().map(|(n, l)| (n, serde_json::json!(l))).collect();
        let jobs: Vec<serde_json::Value> = all
            .iter()
            .map(|j| {
                serde_json::json!({"request": j.request, "processor": j.processor, "kind": j.kind, "chunk": j.chunk,
                    "tokens": j.tokens, "start_ms": j.start_ms, "end_ms": j.end_ms, "ok": j.ok})
            })
            .collect();
        crate::out!("{}", serde_json::json!({"sections": sections, "jobs": jobs}));
    } else if a.timeline.is_none() {
        crate::out_nonl!("{text}");
    }
    Ok(())
}
