//! `llmctl bench --local`: prefill and decode speed and peak memory of the engine on one model,
//! optionally side by side with llama.cpp (through PyPI `llama-cpp-python`) in the same run.
//!
//! What is timed: the forward passes only — no tokenization, no sampling. Prefill of N tokens
//! runs the prompt in the engine's own prefill chunks (`DEFAULT_PREFILL_CHUNK`) from an empty
//! cache and returns the last token's logits; decode feeds a fixed 128-token continuation one
//! token at a time after a 128-token prompt (teacher-forced, so both engines do identical work).
//! llama.cpp gets the same token ids, the same thread count, `n_batch` 512 (its default).
//! Runs alternate between the engines; each figure is the median over `--reps` runs after one
//! warm-up. Peak memory is VmHWM minus the RSS just before the model was loaded (so Python's own
//! interpreter is not charged to llama.cpp), and the absolute VmHWM is printed beside it.

use super::{BenchArgs, Peer, BENCH_TEXT};
use llmd_engine::generate::DEFAULT_PREFILL_CHUNK;
use llmd_engine::model::{Logits, Run};
use llmd_engine::{LoadOptions, Model};
use serde_json::{json, Value};
use std::time::Instant;

pub(crate) fn status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One engine's figures.
#[derive(Default, Clone)]
struct Figures {
    prefill: Vec<(usize, f64)>,
    decode: f64,
    /// With --batch: tokens/s in all with `--batch` sequences, and the median over runs of
    /// (that / one sequence's tokens/s in the same run).
    batch: Option<(f64, f64)>,
    peak_rss_mb: f64,
    hwm_mb: f64,
}

/// One engine's figures under the documented JSON keys.
fn figures_json(f: &Figures) -> serde_json::Map<String, Value> {
    let mut o = serde_json::Map::new();
    for &(n, v) in &f.prefill {
        o.insert(format!("prefill_{n}_tok_s"), json!(v));
    }
    o.insert("decode_tok_s".into(), json!(f.decode));
    if let Some((tok_s, gain)) = f.batch {
        o.insert("batch_decode_tok_s".into(), json!(tok_s));
        o.insert("batch_gain".into(), json!(gain));
    }
    o.insert("peak_rss_mb".into(), json!(f.peak_rss_mb));
    o.insert("vm_hwm_mb".into(), json!(f.hwm_mb));
    o
}

/// Seconds to prefill `tokens`; on the NPU path (`npu`: its linear groups and chunk rows) also
/// the modelled NPU seconds of its graphs (0 on a library that models none).
fn ours_prefill(model: &Model, tokens: &[u32], npu: Option<&crate::npu::NpuPrefill>) -> Result<(f64, f64), String> {
    let mut kv = model.transformer.new_kv();
    let modelled_before = npu.map_or(0, |n| n.groups.stats().1);
    let t0 = Instant::now();
    match npu {
        None => {
            for c in tokens.chunks(DEFAULT_PREFILL_CHUNK) {
                model.transformer.forward(&mut kv, c, Logits::Last).map_err(|e| e.to_string())?;
            }
        }
        Some(n) => {
            for c in tokens.chunks(n.chunk) {
                model.transformer.run(&mut [(&mut kv, c)], Run::LAST.on(&n.devs)).map_err(|e| e.to_string())?;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let modelled = npu.map_or(0, |n| n.groups.stats().1) - modelled_before;
    Ok((secs, modelled as f64 / 1e9))
}

fn ours_decode(model: &Model, prompt: &[u32], steps: &[u32]) -> Result<f64, String> {
    let mut kv = model.transformer.new_kv();
    for c in prompt.chunks(DEFAULT_PREFILL_CHUNK) {
        model.transformer.forward(&mut kv, c, Logits::Last).map_err(|e| e.to_string())?;
    }
    let t0 = Instant::now();
    for &t in steps {
        model.transformer.forward(&mut kv, &[t], Logits::Last).map_err(|e| e.to_string())?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Seconds for the steps of `prompts.len()` sequences decoding together: each prompt is
/// prefilled alone, then every pass runs one token of every sequence (one `run`).
fn ours_batch_decode(model: &Model, prompts: &[&[u32]], steps: &[&[u32]]) -> Result<f64, String> {
    let mut kvs: Vec<_> = prompts.iter().map(|_| model.transformer.new_kv()).collect();
    for (kv, p) in kvs.iter_mut().zip(prompts) {
        for c in p.chunks(DEFAULT_PREFILL_CHUNK) {
            model.transformer.forward(kv, c, Logits::Last).map_err(|e| e.to_string())?;
        }
    }
    let n = steps.iter().map(|s| s.len()).min().unwrap_or(0);
    let t0 = Instant::now();
    for k in 0..n {
        let toks: Vec<[u32; 1]> = steps.iter().map(|s| [s[k]]).collect();
        let mut batch: Vec<_> = kvs.iter_mut().zip(&toks).map(|(kv, t)| (kv, &t[..])).collect();
        model.transformer.run(&mut batch, Run::LAST).map_err(|e| e.to_string())?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// What one decode run on the GPU moved and did, per token.
struct GpuFigures {
    device: String,
    kernels: f64,
    waits: f64,
    up: f64,
    down: f64,
    handoff: f64,
    read_per_token: f64,
    /// Weight matrices' bytes read in place and copied (`GpuDevice::weight_bytes`).
    in_place: f64,
    copied: f64,
    modelled_tok_s: f64,
}

pub fn bench(args: &BenchArgs) -> Result<(), String> {
    if !args.local {
        return Err("bench needs --local (the engine inside llmctl) or --load (a running daemon)".into());
    }
    if args.cold {
        return super::cold::run(args);
    }
    let model_path = args.model.clone().ok_or("bench --local needs --model PATH")?;
    if args.prefill.is_empty() || args.prefill.contains(&0) || args.decode_prompt == 0 || args.decode_tokens == 0 {
        return Err("prompt lengths and decode steps must be at least 1".into());
    }
    let threads = if args.threads == 0 {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    } else {
        args.threads
    };
    let reps = args.reps as usize;
    let rss_before = status_kb("VmRSS");
    let t0 = Instant::now();
    let model = Model::load(
        &model_path,
        &LoadOptions { threads, kv_type: args.kv_type, embeddings_on_flash: args.embeddings_on_flash },
    )
    .map_err(|e| format!("{}: {e}", model_path.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut model = model;
    crate::attention::apply(&model, &args.attn)?;
    let gpu = match args.backend {
        crate::npu::BackendChoice::Gpu => {
            let g = crate::gpu::open(&args.gpu)?;
            // Decode steps (up to --batch sequences at once) on the GPU, prompts on the CPU.
            let name = llmd_device::Device::desc(&*g).name.clone();
            let decode_on = llmd_engine::sched::DecodeOn { device: name, max_tokens: (args.batch as usize).max(1) };
            model.transformer.attach_devices(vec![g.clone()], std::sync::Arc::new(decode_on));
            Some(g)
        }
        _ => None,
    };
    let npu = match args.backend {
        crate::npu::BackendChoice::Npu => Some(crate::npu::prepare(&model, &args.npu)?),
        _ => None,
    };
    let c = model.config().clone();
    let longest = args.prefill.iter().copied().max().unwrap_or(0).max(args.decode_prompt + args.decode_tokens);
    if longest > c.context_length {
        return Err(format!("{longest} positions exceed the model's context of {}", c.context_length));
    }
    let mut text = String::new();
    let mut ids = Vec::new();
    let b = args.batch as usize;
    while ids.len() < longest + b {
        text.push_str(BENCH_TEXT);
        ids = model.tokenizer.encode(&text, false, model.tokenizer.add_bos).map_err(|e| e.to_string())?;
    }
    let decode_prompt = &ids[..args.decode_prompt];
    let decode_steps = &ids[args.decode_prompt..args.decode_prompt + args.decode_tokens];
    // With --batch: sequence q reads the same text from token q on.
    let batch_prompts: Vec<&[u32]> = (0..b).map(|q| &ids[q..q + args.decode_prompt]).collect();
    let batch_steps: Vec<&[u32]> =
        (0..b).map(|q| &ids[q + args.decode_prompt..q + args.decode_prompt + args.decode_tokens]).collect();

    let mut peer = if args.compare_llamacpp {
        let mut p = Peer::start(&args.python)?;
        let r = p.call(json!({
            "op": "load", "model": model_path.display().to_string(), "threads": threads,
            "n_ctx": longest.div_ceil(256) * 256, "n_batch": 512,
        }))?;
        Some((p, r))
    } else {
        None
    };
    if !args.json {
        eprintln!(
            "model {} ({} layers, d_model {}, {:.1} MB of weights), {threads} threads, load {load_s:.2} s; {reps} runs per figure after a warm-up",
            model_path.display(),
            c.n_layers,
            c.d_model,
            model.transformer.weights.size_bytes() as f64 / 1e6
        );
    }

    // Per figure, one value per run: the prefills, decode, then (with --batch) the batched
    // tokens/s and that run's gain over its own one-sequence decode.
    let (dec, bat, gain) = (args.prefill.len(), args.prefill.len() + 1, args.prefill.len() + 2);
    let mut ours: Vec<Vec<f64>> = vec![Vec::new(); args.prefill.len() + 3];
    let mut theirs: Vec<Vec<f64>> = vec![Vec::new(); args.prefill.len() + 3];
    // On the NPU path: each prompt's modelled NPU milliseconds (the same every run).
    let mut modelled_ms: Vec<f64> = vec![0.0; args.prefill.len()];
    for rep in 0..=reps {
        // Alternate which engine goes first, so neither always runs on a warmer machine.
        for side in if rep % 2 == 0 { [0, 1] } else { [1, 0] } {
            for (i, &n) in args.prefill.iter().enumerate() {
                let toks = &ids[..n];
                let secs = if side == 0 {
                    let (s, m) = ours_prefill(&model, toks, npu.as_ref())?;
                    modelled_ms[i] = m * 1e3;
                    Some(s)
                } else if let Some((p, _)) = peer.as_mut() {
                    Some(Peer::seconds(&p.call(json!({"op": "prefill", "tokens": toks}))?)?)
                } else {
                    None
                };
                if let (Some(s), true) = (secs, rep > 0) {
                    let v = if side == 0 { &mut ours } else { &mut theirs };
                    v[i].push(n as f64 / s);
                }
            }
            let secs = if side == 0 {
                Some(ours_decode(&model, decode_prompt, decode_steps)?)
            } else if let Some((p, _)) = peer.as_mut() {
                Some(Peer::seconds(&p.call(json!({"op": "decode", "prompt": decode_prompt, "steps": decode_steps}))?)?)
            } else {
                None
            };
            if let (Some(s), true) = (secs, rep > 0) {
                let v = if side == 0 { &mut ours } else { &mut theirs };
                v[dec].push(args.decode_tokens as f64 / s);
            }
            if b == 0 {
                continue;
            }
            let secs = if side == 0 {
                Some(ours_batch_decode(&model, &batch_prompts, &batch_steps)?)
            } else if let Some((p, _)) = peer.as_mut() {
                Some(Peer::seconds(&p.call(json!({
                    "op": "batch_decode", "prompts": batch_prompts, "steps": batch_steps, "threads": threads,
                }))?)?)
            } else {
                None
            };
            if let (Some(s), true) = (secs, rep > 0) {
                let v = if side == 0 { &mut ours } else { &mut theirs };
                let tok_s = (b * args.decode_tokens) as f64 / s;
                let one = v[dec].last().copied().unwrap_or(f64::NAN);
                v[bat].push(tok_s);
                v[gain].push(tok_s / one);
            }
        }
        if !args.json {
            eprint!("\r{}/{} runs", rep, reps);
        }
    }
    if !args.json {
        eprintln!();
    }
    let figures = |v: &mut Vec<Vec<f64>>| Figures {
        prefill: args.prefill.iter().enumerate().map(|(i, &n)| (n, median(&mut v[i]))).collect(),
        decode: median(&mut v[dec]),
        batch: (b > 0).then(|| (median(&mut v[bat]), median(&mut v[gain]))),
        ..Figures::default()
    };
    let mut mine = figures(&mut ours);
    mine.hwm_mb = status_kb("VmHWM") as f64 / 1024.0;
    mine.peak_rss_mb = (status_kb("VmHWM").saturating_sub(rss_before)) as f64 / 1024.0;
    let peer_fig = match peer.as_mut() {
        Some((p, load)) => {
            let r = p.call(json!({"op": "rss"}))?;
            let hwm = r["vm_hwm_kb"].as_u64().unwrap_or(0);
            let before = load["rss_before_load_kb"].as_u64().unwrap_or(0);
            let mut f = figures(&mut theirs);
            f.hwm_mb = hwm as f64 / 1024.0;
            f.peak_rss_mb = hwm.saturating_sub(before) as f64 / 1024.0;
            Some((f, load["version"].as_str().unwrap_or("?").to_owned()))
        }
        None => None,
    };

    // This machine's limits for the figures: read bandwidth over a buffer the size of the
    // weights (what decode streams; `read_peak_bytes_per_s`, plain and prefetched reads), and multiply-accumulates per token (what prefill computes).
    let w = &model.transformer.weights;
    let mut weight_bytes_per_token = w.output.size_bytes();
    let mut macs_per_token = w.output.rows * w.output.cols;
    for l in &w.layers {
        for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
            weight_bytes_per_token += m.size_bytes();
            macs_per_token += m.rows * m.cols;
        }
    }
    let bw = llmd_engine::backend::cpu::read_peak_bytes_per_s(weight_bytes_per_token, threads);
    let decode_ceiling = bw / weight_bytes_per_token as f64;
    let int8_peak = llmd_engine::backend::cpu::int8_peak_macs_per_s(threads);
    let prefill_ceiling = int8_peak / macs_per_token as f64;

    // The GPU's figures per decode token (one more decode run, counted), and the phone's
    // decode rate modelled from the bytes a step reads here.
    let gpu_fig = match &gpu {
        Some(g) => {
            let before = g.stats();
            ours_decode(&model, decode_prompt, decode_steps)?;
            let s = g.stats();
            let n = args.decode_tokens as f64;
            // The prompt's cache is handed up at the first step: not a per-token cost.
            let c = model.config();
            let handoff = (args.decode_prompt * c.n_layers * 2 * c.kv_dim() * 2) as f64;
            // The bytes the device reads: the CPU's tiles where it has them (the GPU reads
            // those), else the file's rows.
            let bytes = |m: &llmd_engine::backend::weight::WeightMatrix| {
                m.host_copy().map_or_else(|| m.source_bytes().map_or(0, <[u8]>::len), |h| h.weight_bytes().len())
            };
            let mut read = bytes(&w.output);
            for l in &w.layers {
                for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                    read += bytes(m);
                }
            }
            let mid = args.decode_prompt + args.decode_tokens / 2;
            let kv_read = mid * c.n_layers * 2 * c.kv_dim() * 2;
            Some(GpuFigures {
                kernels: (s.kernels - before.kernels) as f64 / n,
                // Less the hand-off's writes (keys and values of each layer, once).
                waits: ((s.host_waits - before.host_waits) as f64 - (2 * c.n_layers) as f64).max(0.0) / n,
                up: ((s.bytes_to_device - before.bytes_to_device) as f64 - handoff) / n,
                down: (s.bytes_from_device - before.bytes_from_device) as f64 / n,
                handoff,
                read_per_token: (read + kv_read) as f64,
                in_place: g.weight_bytes().0 as f64,
                copied: g.weight_bytes().1 as f64,
                modelled_tok_s: llmd_engine::backend::gpu::SD8GEN3_GPU_DECODE_BYTES_PER_S / (read + kv_read) as f64,
                device: g.info().name.clone(),
            })
        }
        None => None,
    };
    if args.json {
        let mut o = figures_json(&mine);
        if let Some(f) = &gpu_fig {
            o.insert(
                "gpu".into(),
                json!({"device": f.device, "kernels_per_token": f.kernels, "host_waits_per_token": f.waits,
                       "bytes_up_per_token": f.up, "bytes_down_per_token": f.down, "kv_handoff_bytes": f.handoff,
                       "bytes_read_per_token": f.read_per_token,
                       "weight_bytes_in_place": f.in_place,
                       "weight_bytes_copied": f.copied,
                       "modelled_sd8gen3_decode_tok_s": f.modelled_tok_s}),
            );
        }
        o.insert("threads".into(), json!(threads));
        o.insert("backend".into(), json!(format!("{:?}", args.backend).to_lowercase()));
        if npu.is_some() {
            for (&n, m) in args.prefill.iter().zip(&modelled_ms) {
                o.insert(format!("npu_modelled_prefill_{n}_ms"), json!(m));
            }
        }
        o.insert("weight_bytes_in_memory".into(), json!(model.transformer.weights.size_bytes()));
        o.insert("weight_bytes_per_token".into(), json!(weight_bytes_per_token));
        o.insert("macs_per_token".into(), json!(macs_per_token));
        o.insert("read_bandwidth_gb_s".into(), json!(bw / 1e9));
        o.insert("int8_peak_gmac_s".into(), json!(int8_peak / 1e9));
        o.insert("kernel".into(), json!(llmd_engine::backend::cpu::kernel_name()));
        let kernels: Vec<Value> = w
            .kernel_table()
            .iter()
            .map(|k| {
                json!({"type": k.ty, "kernel": k.kernel, "matrices": k.matrices,
                       "file_bytes": k.file_bytes, "memory_bytes": k.memory_bytes})
            })
            .collect();
        o.insert("kernels".into(), Value::Array(kernels));
        if let Some((f, ver)) = &peer_fig {
            let mut l = figures_json(f);
            l.insert("version".into(), json!(ver));
            o.insert("llamacpp".into(), Value::Object(l));
            for (&(n, a), &(_, b)) in mine.prefill.iter().zip(&f.prefill) {
                o.insert(format!("ratio_prefill_{n}"), json!(a / b));
            }
            o.insert("ratio_decode".into(), json!(mine.decode / f.decode));
            if let (Some((a, _)), Some((b, _))) = (mine.batch, f.batch) {
                o.insert("ratio_batch_decode".into(), json!(a / b));
            }
            o.insert("ratio_peak_rss".into(), json!(mine.peak_rss_mb / f.peak_rss_mb));
        }
        crate::out!("{}", Value::Object(o));
        return Ok(());
    }
    let peer_ver = peer_fig.as_ref().map(|(_, v)| v.clone());
    let pf = peer_fig.map(|(f, _)| f);
    crate::out!(
        "{:<22} {:>10} {:>12} {:>8} {:>11}",
        "figure",
        "llmd",
        peer_ver.map(|v| format!("llama.cpp {v}")).unwrap_or_else(|| "llama.cpp".into()),
        "ratio",
        "% ceiling"
    );
    // `digits` after the point: 1 for rates and sizes, 2 for the batch gain.
    let row_digits = |name: String, a: f64, b: Option<f64>, ceil: Option<f64>, digits: usize| {
        crate::out!(
            "{:<22} {:>10.digits$} {:>12} {:>8} {:>11}",
            name,
            a,
            b.map(|b| format!("{b:.digits$}")).unwrap_or_else(|| "-".into()),
            b.map(|b| format!("{:.2}x", a / b)).unwrap_or_else(|| "-".into()),
            ceil.map(|c| format!("{:.0}%", 100.0 * a / c)).unwrap_or_else(|| "-".into()),
        )
    };
    let row = |name: String, a: f64, b: Option<f64>, ceil: Option<f64>| row_digits(name, a, b, ceil, 1);
    for (i, &(n, v)) in mine.prefill.iter().enumerate() {
        match npu {
            // The CPU's int8 ceiling says nothing of a path through a QNN library.
            Some(_) => row(format!("prefill@{n} tok/s npu"), v, pf.as_ref().map(|f| f.prefill[i].1), None),
            None => row(format!("prefill@{n} tok/s"), v, pf.as_ref().map(|f| f.prefill[i].1), Some(prefill_ceiling)),
        }
    }
    row(
        format!("decode tok/s ({}+{})", args.decode_prompt, args.decode_tokens),
        mine.decode,
        pf.as_ref().map(|f| f.decode),
        Some(decode_ceiling),
    );
    if let Some((tok_s, g)) = mine.batch {
        let theirs = pf.as_ref().and_then(|f| f.batch);
        row(format!("decode tok/s, {b} at once"), tok_s, theirs.map(|t| t.0), None);
        row_digits(format!("batch gain ({b} vs 1)"), g, theirs.map(|t| t.1), None, 2);
    }
    row("peak RSS MB (model)".into(), mine.peak_rss_mb, pf.as_ref().map(|f| f.peak_rss_mb), None);
    row("VmHWM MB (process)".into(), mine.hwm_mb, pf.as_ref().map(|f| f.hwm_mb), None);
    if let Some(f) = &gpu_fig {
        crate::out!(
            "decode on the GPU ({}; host, not a phone): per token {:.0} kernels, {:.2} host waits, {:.0} B up, {:.0} B down; the prompt's cache handed up once ({:.1} MB in 2 writes a layer)",
            f.device,
            f.kernels,
            f.waits,
            f.up,
            f.down,
            f.handoff / 1e6
        );
        crate::out!(
            "weights on the GPU: {:.1} MB read in place in the CPU's memory, {:.1} MB copied to the device",
            f.in_place / 1e6,
            f.copied / 1e6
        );
        crate::out!(
            "decode on a Snapdragon 8 Gen 3 GPU, modelled: {:.1} tok/s = 43.3 GB/s (HeteroLLM §5.3, GPU-only decode, measured there) / {:.1} MB read per token here (weights as the GPU reads them, KV at position {}); a bandwidth model, not a measurement",
            f.modelled_tok_s,
            f.read_per_token / 1e6,
            args.decode_prompt + args.decode_tokens / 2
        );
    }
    if let Some(crate::npu::NpuPrefill { groups: l, chunk, .. }) = &npu {
        for (&n, m) in args.prefill.iter().zip(&modelled_ms) {
            if *m > 0.0 {
                crate::out!(
                    "prefill@{n} on the NPU, modelled: {m:.1} ms of NPU graphs ({} graphs of {chunk} rows per chunk; the emulator's SoC model, not a measurement; the CPU's share is not in it)",
                    l.graph_names().len()
                );
            }
        }
    }
    crate::out!(
        "ceilings: decode {:.0} tok/s = {:.1} GB/s (best read bandwidth over a buffer that size) / {:.1} MB of weights per token; \
         prefill {:.0} tok/s = {:.0} G int8 MAC/s ({}) / {:.1} M MAC per token",
        decode_ceiling,
        bw / 1e9,
        weight_bytes_per_token as f64 / 1e6,
        prefill_ceiling,
        int8_peak / 1e9,
        llmd_engine::backend::cpu::kernel_name(),
        macs_per_token as f64 / 1e6,
    );
    for k in w.kernel_table() {
        crate::out!(
            "weights: {:>4} x {:<5} {:>8.1} MB in the file, {:>8.1} MB in memory: {}",
            k.matrices,
            k.ty,
            k.file_bytes as f64 / 1e6,
            k.memory_bytes as f64 / 1e6,
            k.kernel
        );
    }
    Ok(())
}
