//! `llmctl bench --local --cold`: time to first token from a cold page cache (EdgeFlow's
//! measure), for the same model three ways in one run:
//!
//! * **llmd EdgeFlow** — the model converted to an llmd file at `--bits` (5 by default;
//!   converted once and cached beside the other bench files), loaded through the streaming
//!   read → unpack → compute pipeline that prefills the prompt as layers arrive;
//! * **llmd GGUF** — the GGUF loaded by our engine (repacked from `pread`s), then prefilled;
//! * **llama.cpp** — the GGUF in llama.cpp through PyPI `llama-cpp-python` (`mmap`, demand
//!   paging), then `eval` of the same token ids (with `--compare-llamacpp`).
//!
//! Each run starts with the file's pages evicted: `posix_fadvise(DONTNEED)` on the file (any
//! user), plus `drop_caches` when writable (root), and `fincore` (util-linux) shows what stayed
//! resident. The timer runs from the load call to the first token's argmax; bytes read come from
//! `/proc/<pid>/io` (storage reads this process caused). Runs alternate between engines; each
//! figure is the median of `--reps` runs.

use llmd_engine::convert::{self, ConvertOptions};
use llmd_engine::generate::DEFAULT_PREFILL_CHUNK;
use llmd_engine::model::stream::{LoadReport, StreamOptions};
use llmd_engine::model::Logits;
use llmd_engine::sampling::argmax;
use llmd_engine::{LoadOptions, Model};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Bytes this process has caused to be read from storage.
pub fn io_read_bytes(pid: Option<u32>) -> u64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/io"),
        None => "/proc/self/io".into(),
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("read_bytes:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(0)
}

/// Evicts `path`'s pages from the page cache; returns how it did it.
pub fn drop_file_cache(path: &Path) -> Result<&'static str, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .map_err(|e| format!("posix_fadvise on {}: {e}", path.display()))?;
    // Root (a rooted phone, this host): also drop every clean page, which covers files the
    // engines open beside the model.
    let dropped = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sys/vm/drop_caches")
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"1\n"))
        .is_ok();
    Ok(if dropped { "fadvise+drop_caches" } else { "fadvise" })
}

/// Pages of `path` still resident, as `fincore` reports (None if it is not installed).
pub fn resident_bytes(path: &Path) -> Option<u64> {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

struct Run {
    seconds: f64,
    read_bytes: u64,
    first_token: u32,
    report: Option<LoadReport>,
}

fn ours_llmd(path: &Path, threads: usize, prompt: &[u32]) -> Result<Run, String> {
    let r0 = io_read_bytes(None);
    let t0 = Instant::now();
    let (_model, pre, report) =
        Model::load_llmd(path, &LoadOptions { threads, ..Default::default() }, &StreamOptions::default(), Some(prompt))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    let logits = pre.map(|p| p.logits).unwrap_or_default();
    let first = argmax(&logits) as u32;
    let seconds = t0.elapsed().as_secs_f64();
    Ok(Run { seconds, read_bytes: io_read_bytes(None) - r0, first_token: first, report: Some(report) })
}

fn ours_gguf(path: &Path, threads: usize, prompt: &[u32]) -> Result<Run, String> {
    let r0 = io_read_bytes(None);
    let t0 = Instant::now();
    let model = Model::load(path, &LoadOptions { threads, ..Default::default() })
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut kv = model.transformer.new_kv();
    let mut logits = Vec::new();
    for c in prompt.chunks(DEFAULT_PREFILL_CHUNK) {
        logits = model.transformer.forward(&mut kv, c, Logits::Last).map_err(|e| e.to_string())?;
    }
    let first = argmax(&logits) as u32;
    let seconds = t0.elapsed().as_secs_f64();
    Ok(Run { seconds, read_bytes: io_read_bytes(None) - r0, first_token: first, report: None })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Where the converted file for `gguf` at `bits` lives (converted on first use; the name
/// carries the converter's policy — 2, source tensors kept — so a file of another policy is not reused).
fn llmd_path_for(gguf: &Path, bits: Option<f64>) -> PathBuf {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("llmd/bench");
    let stem = gguf.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let len = std::fs::metadata(gguf).map(|m| m.len()).unwrap_or(0);
    let what = bits.map(|b| format!("ef{b}")).unwrap_or_else(|| "kept".into());
    dir.join(format!("{stem}-{len}-p2-{what}.llmd"))
}

pub fn run(args: &super::BenchArgs) -> Result<(), String> {
    let gguf = args.model.clone().ok_or("bench --cold needs --model PATH (a GGUF file)")?;
    if llmd_engine::format::llmd::path_is_llmd(&gguf) || gguf.is_dir() {
        return Err("bench --cold needs the GGUF as --model (it converts it itself, or takes --llmd PATH)".into());
    }
    let threads = if args.threads == 0 {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    } else {
        args.threads
    };
    let llmd = match &args.llmd {
        Some(p) => p.clone(),
        None => {
            let p = llmd_path_for(&gguf, args.bits);
            if !p.is_file() {
                std::fs::create_dir_all(p.parent().unwrap_or(Path::new("."))).map_err(|e| e.to_string())?;
                let how = args.bits.map(|b| format!("{b} bits")).unwrap_or_else(|| "its own types kept".into());
                eprintln!("converting {} ({how}) once: {}", gguf.display(), p.display());
                convert::convert(
                    &gguf,
                    &p,
                    &ConvertOptions { bits: args.bits, threads, smoothing: None },
                    &|_, _, _| {},
                )
                .map_err(|e| format!("{}: {e}", gguf.display()))?;
            }
            p
        }
    };
    // The prompt: the bench text's first --cold-prompt tokens (tokenizer from the GGUF, warm).
    let tok_model = llmd_engine::Source::open(&gguf).map_err(|e| format!("{}: {e}", gguf.display()))?;
    let mut text = String::new();
    let mut prompt = Vec::new();
    while prompt.len() < args.cold_prompt {
        text.push_str(super::BENCH_TEXT);
        prompt = tok_model.tokenizer.encode(&text, false, tok_model.tokenizer.add_bos).map_err(|e| e.to_string())?;
    }
    prompt.truncate(args.cold_prompt);
    let n_ctx = args.cold_prompt.div_ceil(256) * 256;
    drop(tok_model);
    let mut peer = if args.compare_llamacpp { Some(super::Peer::start(&args.python)?) } else { None };
    let reps = args.reps as usize;
    let engines: Vec<&str> = if peer.is_some() {
        vec!["llmd-edgeflow", "llmd-gguf", "llama.cpp"]
    } else {
        vec!["llmd-edgeflow", "llmd-gguf"]
    };
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
    let mut read: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
    let mut firsts: Vec<Option<u32>> = vec![None; engines.len()];
    let mut reports: Vec<LoadReport> = Vec::new();
    let mut how = "";
    let mut resident_before: Vec<u64> = Vec::new();
    for rep in 0..reps {
        let order: Vec<usize> =
            if rep % 2 == 0 { (0..engines.len()).collect() } else { (0..engines.len()).rev().collect() };
        for e in order {
            let file = if e == 0 { &llmd } else { &gguf };
            how = drop_file_cache(file)?;
            if let Some(b) = resident_bytes(file) {
                resident_before.push(b);
            }
            let run = match e {
                0 => ours_llmd(&llmd, threads, &prompt)?,
                1 => ours_gguf(&gguf, threads, &prompt)?,
                _ => {
                    let p = peer.as_mut().ok_or("no llama.cpp worker")?;
                    let pid = p.pid();
                    let _ = pid;
                    let v = p.call(json!({
                        "op": "cold", "model": gguf.display().to_string(), "threads": threads,
                        "n_ctx": n_ctx, "n_batch": 512, "prompt": prompt,
                    }))?;
                    Run {
                        seconds: v["seconds"].as_f64().ok_or("no seconds from llama.cpp")?,
                        read_bytes: v["read_bytes"].as_u64().unwrap_or(0),
                        first_token: v["first_token"].as_u64().unwrap_or(u64::MAX) as u32,
                        report: None,
                    }
                }
            };
            secs[e].push(run.seconds);
            read[e].push(run.read_bytes as f64);
            firsts[e] = Some(run.first_token);
            if let Some(r) = run.report {
                reports.push(r);
            }
            if !args.json {
                eprint!("\rrun {}/{reps}: {} {:.3} s          ", rep + 1, engines[e], run.seconds);
            }
        }
    }
    if !args.json {
        eprintln!();
    }
    let ttft: Vec<f64> = secs.iter().map(|v| median(v.clone())).collect();
    let bytes: Vec<f64> = read.iter().map(|v| median(v.clone())).collect();
    // The pipeline report of the median EdgeFlow run.
    let mut rs = reports.clone();
    rs.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
    let rep = rs.get(rs.len() / 2).cloned().unwrap_or_default();
    let file_sizes: Vec<u64> = engines
        .iter()
        .enumerate()
        .map(|(e, _)| std::fs::metadata(if e == 0 { &llmd } else { &gguf }).map(|m| m.len()).unwrap_or(0))
        .collect();
    let max_resident = resident_before.iter().copied().max();
    let layer0_compute = rep.regions.iter().find(|r| r.name == "layer 0").and_then(|r| r.compute.map(|c| c.0));
    let last_read_end = rep.regions.iter().map(|r| r.read.1).fold(0.0, f64::max);
    if args.json {
        let mut o = serde_json::Map::new();
        o.insert("prompt_tokens".into(), json!(prompt.len()));
        o.insert("threads".into(), json!(threads));
        o.insert("reps".into(), json!(reps));
        o.insert("cache_drop".into(), json!(how));
        o.insert("max_resident_bytes_before_run".into(), json!(max_resident));
        o.insert("cold_ttft_s".into(), json!(ttft[0]));
        o.insert("bits".into(), json!(args.bits));
        for (e, name) in engines.iter().enumerate() {
            o.insert(
                name.replace(['-', '.'], "_"),
                json!({
                    "cold_ttft_s": ttft[e], "bytes_read": bytes[e], "file_bytes": file_sizes[e],
                    "first_token": firsts[e], "runs_s": secs[e],
                }),
            );
        }
        o.insert("ratio_vs_llmd_gguf".into(), json!(ttft[0] / ttft[1]));
        if engines.len() > 2 {
            o.insert("ratio_vs_llamacpp".into(), json!(ttft[0] / ttft[2]));
        }
        o.insert(
            "pipeline".into(),
            json!({
                "setup_s": rep.setup_s, "read_busy_s": rep.read_busy_s, "unpack_busy_s": rep.unpack_busy_s,
                "compute_busy_s": rep.compute_busy_s, "compute_wait_s": rep.compute_wait_s,
                "overlap_s": rep.overlap_s(), "wall_s": rep.wall_s,
                "layer0_compute_start_s": layer0_compute, "last_read_end_s": last_read_end,
                "regions": rep.regions,
            }),
        );
        crate::out!("{}", Value::Object(o));
        return Ok(());
    }
    crate::out!(
        "cold start: {} prompt tokens, {threads} threads, median of {reps} runs, page cache dropped before each ({how}{})",
        prompt.len(),
        max_resident.map(|b| format!("; at most {} bytes of the file resident at the start", b)).unwrap_or_default()
    );
    crate::out!(
        "{:<16} {:>12} {:>12} {:>12} {:>10} {:>8}",
        "engine",
        "file MB",
        "read MB",
        "TTFT s",
        "vs ours",
        "token"
    );
    for (e, name) in engines.iter().enumerate() {
        crate::out!(
            "{:<16} {:>12.1} {:>12.1} {:>12.3} {:>10} {:>8}",
            name,
            file_sizes[e] as f64 / 1e6,
            bytes[e] / 1e6,
            ttft[e],
            if e == 0 { "1.00x".to_string() } else { format!("{:.2}x", ttft[0] / ttft[e]) },
            firsts[e].map(|t| t.to_string()).unwrap_or_default(),
        );
    }
    crate::out!(
        "pipeline (median llmd run): setup {:.3} s; busy read {:.3} s, unpack {:.3} s, compute {:.3} s; compute waited {:.3} s; \
         overlap {:.3} s; layer 0 computed from {:.3} s, last region read by {:.3} s; wall {:.3} s",
        rep.setup_s,
        rep.read_busy_s,
        rep.unpack_busy_s,
        rep.compute_busy_s,
        rep.compute_wait_s,
        rep.overlap_s(),
        layer0_compute.unwrap_or(f64::NAN),
        last_read_end,
        rep.wall_s
    );
    crate::out!("'vs ours' is llmd-edgeflow's TTFT divided by that engine's (below 1: ours is faster).");
    Ok(())
}
