//! `llmctl convert` (GGUF / HF → llmd EdgeFlow file) and `llmctl perplexity`.

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use llmd_engine::convert::{self, ConvertOptions};
use llmd_engine::model::{Logits, Run};
use llmd_engine::smooth::Smoothing;
use llmd_engine::{LoadOptions, Model};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Average bits per weight of every requantized linear tensor (EdgeFlow budget), 1 to 8;
    /// fractions allowed. A source tensor of a type the kernels run natively (Q4_0, Q4_1, Q8_0,
    /// Q2_K-Q6_K) at no more bits per weight than this is kept as it is. Without --bits: keep
    /// every such tensor, EdgeFlow at 5 bits for the others.
    #[arg(long)]
    pub bits: Option<f64>,
    /// A plain-text file to calibrate the smoothing step with (EdgeFlow §4.1); without it, no
    /// smoothing.
    #[arg(long, value_name = "FILE")]
    pub calibrate: Option<PathBuf>,
    /// Calibration tokens to use from the text.
    #[arg(long, default_value_t = 2048)]
    pub calibration_tokens: usize,
    /// Skip this many tokens of the calibration text first (keep it apart from evaluation text).
    #[arg(long, default_value_t = 0)]
    pub calibration_offset: usize,
    /// Threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The source: a GGUF file or an HF directory (config.json + *.safetensors + tokenizer.json).
    pub input: PathBuf,
    /// The llmd file to write (replaced only when the conversion succeeds).
    pub output: PathBuf,
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:30}] {pos}/{len} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

/// Tokens of a text file (plain text, no special tokens), `skip` dropped, at most `take`.
fn text_tokens(model: &Model, path: &Path, skip: usize, take: usize) -> Result<Vec<u32>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let toks = model.tokenizer.encode(&text, false, false).map_err(|e| e.to_string())?;
    if toks.len() <= skip {
        return Err(format!("{} has {} tokens, fewer than the {skip} to skip", path.display(), toks.len()));
    }
    Ok(toks[skip..].iter().take(take).copied().collect())
}

pub fn convert(a: &ConvertArgs) -> Result<(), String> {
    let start = Instant::now();
    if a.output.exists() && a.output.canonicalize().ok() == a.input.canonicalize().ok() {
        return Err("the output would overwrite the input".into());
    }
    let smoothing = match &a.calibrate {
        None => None,
        Some(text) => {
            eprintln!("calibrating the smoothing step on {} tokens of {}", a.calibration_tokens, text.display());
            let model = Model::load(&a.input, &LoadOptions { threads: a.threads, ..Default::default() })
                .map_err(|e| format!("{}: {e}", a.input.display()))?;
            let toks = text_tokens(&model, text, a.calibration_offset, a.calibration_tokens)?;
            let s = Smoothing::calibrate(&model, &toks, a.bits.unwrap_or(convert::DEFAULT_BITS), a.threads)
                .map_err(|e| e.to_string())?;
            eprintln!("smoothing calibrated in {:.1} s", start.elapsed().as_secs_f64());
            Some(s)
        }
    };
    let opts = ConvertOptions { bits: a.bits, threads: a.threads, smoothing };
    let pb = bar(0, "convert");
    let report = convert::convert(&a.input, &a.output, &opts, &|done, total, name| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(name.to_owned());
    })
    .map_err(|e| format!("{}: {e}", a.input.display()))?;
    pb.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&report).map_err(|e| e.to_string())?;
        v["average_bits"] = report.average_bits().into();
        v["seconds"] = secs.into();
        crate::out!("{v}");
    } else {
        crate::out!(
            "wrote {} ({:.1} MB) in {:.1} s: {} tensors; EdgeFlow: {:.1} M linear weights at {:.3} average bits ({:.1} MB); kept in the source's types: {} linear tensors, {:.1} M weights ({:.1} MB)",
            a.output.display(),
            report.output_bytes as f64 / 1e6,
            secs,
            report.tensors,
            report.linear_weights as f64 / 1e6,
            report.average_bits(),
            report.linear_bytes as f64 / 1e6,
            report.kept_tensors,
            report.kept_weights as f64 / 1e6,
            report.kept_bytes as f64 / 1e6,
        );
        let hist: Vec<String> = (1..=8)
            .filter(|&b| report.channels_by_bits[b] > 0)
            .map(|b| format!("{b} bits: {}", report.channels_by_bits[b]))
            .collect();
        if !hist.is_empty() {
            crate::out!("channels by bit-width: {}", hist.join(", "));
        }
        if !report.skipped.is_empty() {
            crate::out!("not converted (unused by the architecture): {}", report.skipped.join(", "));
        }
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// The model: GGUF, llmd or HF directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The text to score (plain UTF-8).
    #[arg(long)]
    pub text: PathBuf,
    /// Tokens per window; each window starts fresh (BOS, if the model adds one) and every
    /// token after the first is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Tokens of the text to score (rounded down to whole windows).
    #[arg(long, default_value_t = 51200)]
    pub tokens: usize,
    /// Skip this many tokens of the text first.
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Where the linear layers run: cpu, or npu (the NPU path's W8A8 QNN graphs, as `run
    /// --backend npu`; windows then run in chunks of --npu-chunk tokens).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: crate::npu::BackendChoice,
    #[command(flatten)]
    pub npu: crate::npu::NpuArgs,
    #[command(flatten)]
    pub attn: crate::attention::AttentionArgs,
}

/// `−log p(target)` from one row of logits, in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lt = logits.get(target as usize).copied().unwrap_or(f32::NEG_INFINITY) as f64;
    (sum.ln() + max) - lt
}

pub fn perplexity(a: &PerplexityArgs) -> Result<(), String> {
    if a.ctx < 2 {
        return Err("--ctx must be at least 2".into());
    }
    let model = Model::load(&a.model, &LoadOptions { threads: a.threads, ..Default::default() })
        .map_err(|e| format!("{}: {e}", a.model.display()))?;
    crate::attention::apply(&model, &a.attn)?;
    if a.ctx > model.config().context_length {
        return Err(format!("--ctx {} exceeds the model's context of {}", a.ctx, model.config().context_length));
    }
    let bos = model.tokenizer.add_bos.then_some(model.tokenizer.bos).flatten();
    let per = if bos.is_some() { a.ctx - 1 } else { a.ctx };
    let toks = text_tokens(&model, &a.text, a.offset, a.tokens)?;
    let windows = toks.len() / per;
    if windows == 0 {
        return Err(format!("the text has {} tokens, fewer than one window of {per}", toks.len()));
    }
    let npu = match a.backend {
        crate::npu::BackendChoice::Npu => Some(crate::npu::prepare(&model, &a.npu)?),
        crate::npu::BackendChoice::Cpu => None,
        crate::npu::BackendChoice::Gpu => {
            return Err("perplexity reads windows of prompt tokens, which run on the CPU with --backend gpu \
                        (the GPU decodes): use cpu or npu"
                .into())
        }
    };
    let step = npu.as_ref().map_or(128, |n| n.chunk);
    let start = Instant::now();
    let pb = bar(windows as u64, "perplexity");
    let (mut total, mut count) = (0f64, 0usize);
    let vocab = model.transformer.weights.output.rows;
    for w in 0..windows {
        let mut win: Vec<u32> = bos.into_iter().collect();
        win.extend_from_slice(&toks[w * per..(w + 1) * per]);
        let mut kv = model.transformer.new_kv();
        for (ci, chunk) in win.chunks(step).enumerate() {
            let logits = match &npu {
                Some(n) => model
                    .transformer
                    .run(&mut [(&mut kv, chunk)], Run::ALL.on(&n.devs))
                    .map(|mut l| l.pop().unwrap_or_default()),
                None => model.transformer.forward(&mut kv, chunk, Logits::All),
            }
            .map_err(|e| e.to_string())?;
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                let pos = ci * step + i;
                if let Some(&next) = win.get(pos + 1) {
                    total += nll(row, next);
                    count += 1;
                }
            }
        }
        pb.inc(1);
        pb.set_message(format!("ppl {:.3}", (total / count.max(1) as f64).exp()));
    }
    pb.finish_and_clear();
    let ppl = (total / count.max(1) as f64).exp();
    let secs = start.elapsed().as_secs_f64();
    if let Some(n) = &npu {
        eprintln!("{}", crate::npu::shadow_summary(&n.groups));
    }
    if a.json {
        crate::out!(
            "{}",
            serde_json::json!({
                "model": a.model.display().to_string(),
                "text": a.text.display().to_string(),
                "perplexity": ppl,
                "scored_tokens": count,
                "windows": windows,
                "ctx": a.ctx,
                "offset": a.offset,
                "seconds": secs,
                "backend": format!("{:?}", a.backend).to_lowercase(),
            })
        );
    } else {
        crate::out!(
            "perplexity {ppl:.4} over {count} tokens ({windows} windows of {}) of {} in {secs:.1} s ({:?})",
            a.ctx,
            a.text.display(),
            a.backend
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct NpuAccuracyArgs {
    /// The model (GGUF or llmd file).
    #[arg(long)]
    pub model: PathBuf,
    /// The evaluation text (plain text).
    #[arg(long)]
    pub text: PathBuf,
    /// Tokens per window (each starts fresh; every token after the first is scored).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Tokens of the evaluation text to score (rounded down to whole windows).
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Skip this many tokens of the evaluation text first.
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// The calibration text (plain text; without it, the built-in text the NPU path uses).
    /// Its tokens must not overlap the evaluation's when it is the same file.
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Calibration tokens to use from --calibration.
    #[arg(long, default_value_t = 4096)]
    pub calibration_tokens: usize,
    /// Skip this many tokens of --calibration first.
    #[arg(long, default_value_t = 0)]
    pub calibration_offset: usize,
    /// Prompt chunk size (the NPU graphs' rows).
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// Schemes to measure (comma-separated): float, cpu, w8, w8a8, smoothquant, llm-int8,
    /// shadow-0, shadow-50, shadow-85, shadow-100, shadow-85-clip, shadow-100-clip (shadow-P:
    /// P% of sites pruned). The float model always runs first: agreement is measured against it.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cpu,w8,w8a8,smoothquant,llm-int8,shadow-0,shadow-50,shadow-85,shadow-100,shadow-85-clip"
    )]
    pub schemes: Vec<String>,
    /// int8 weight scales: folded (per-channel codes under one graph scale, the channels'
    /// scales applied on the host: the NPU path's default), per-tensor (llm.npu's), or
    /// per-channel (in the graph).
    #[arg(long, default_value = "folded", value_parser = ["folded", "per-tensor", "per-channel"])]
    pub weights: String,
    /// Threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn scheme_of(name: &str) -> Result<Option<llmd_engine::quantsim::Scheme>, String> {
    use llmd_engine::quantsim::{Pruned, Scheme};
    Ok(Some(match name {
        "cpu" => return Ok(None),
        "float" => Scheme::Float,
        "w8" => Scheme::W8,
        "w8a8" => Scheme::W8A8,
        "smoothquant" => Scheme::SmoothQuant { alpha: 0.5 },
        "llm-int8" => Scheme::LlmInt8 { threshold: 6.0 },
        s if s.starts_with("shadow-") => {
            let rest = &s["shadow-".len()..];
            let (p, pruned) =
                if let Some(p) = rest.strip_suffix("-clip") { (p, Pruned::Clip) } else { (rest, Pruned::Widen) };
            let p: f64 = p.parse().map_err(|_| format!("scheme {s}: the pruned percentage is not a number"))?;
            if !(0.0..=100.0).contains(&p) {
                return Err(format!("scheme {s}: the pruned percentage is outside 0..=100"));
            }
            Scheme::Shadow { prune: p / 100.0, pruned }
        }
        s => return Err(format!("unknown scheme {s:?} (see --help)")),
    }))
}

/// `llmctl npu-accuracy`: llm.npu's Table 6 in kind — perplexity and next-token agreement with
/// the float model, per quantization scheme, on one evaluation text.
pub fn npu_accuracy(a: &NpuAccuracyArgs) -> Result<(), String> {
    use llmd_engine::quantsim::{Scheme, SimDevice, SimLinears};
    use std::sync::atomic::Ordering;
    if a.ctx < 2 || a.chunk == 0 {
        return Err("--ctx must be at least 2 and --chunk at least 1".into());
    }
    let schemes: Vec<(String, Option<Scheme>)> =
        a.schemes.iter().map(|s| scheme_of(s.trim()).map(|x| (s.trim().to_owned(), x))).collect::<Result<_, _>>()?;
    let model = Model::load(&a.model, &LoadOptions { threads: a.threads, ..Default::default() })
        .map_err(|e| format!("{}: {e}", a.model.display()))?;
    if a.ctx > model.config().context_length {
        return Err(format!("--ctx {} exceeds the model's context of {}", a.ctx, model.config().context_length));
    }
    let bos = model.tokenizer.add_bos.then_some(model.tokenizer.bos).flatten();
    let per = if bos.is_some() { a.ctx - 1 } else { a.ctx };
    let toks = text_tokens(&model, &a.text, a.offset, a.tokens)?;
    let windows = toks.len() / per;
    if windows == 0 {
        return Err(format!("the text has {} tokens, fewer than one window of {per}", toks.len()));
    }
    let cal_tokens = match &a.calibration {
        Some(f) => {
            let same = f.canonicalize().ok() == a.text.canonicalize().ok();
            let (c0, c1) = (a.calibration_offset, a.calibration_offset + a.calibration_tokens);
            let (e0, e1) = (a.offset, a.offset + windows * per);
            if same && c0 < e1 && e0 < c1 {
                return Err(format!(
                    "the calibration tokens {c0}..{c1} overlap the evaluation's {e0}..{e1} of the same text"
                ));
            }
            text_tokens(&model, f, a.calibration_offset, a.calibration_tokens)?
        }
        None => {
            model.tokenizer.encode(llmd_engine::prefill::CALIBRATION_TEXT, false, false).map_err(|e| e.to_string())?
        }
    };
    let threads = if a.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { a.threads };
    let t0 = Instant::now();
    let cal = llmd_engine::prefill::calibrate(&model.transformer, &cal_tokens).map_err(|e| e.to_string())?;
    let cal_s = t0.elapsed().as_secs_f64();
    // Outlier statistics (llm.npu Fig. 10–11): channels ever past τ, and how few cover 80%.
    let (mut chans, mut ever, mut hot3_cover, mut occ) = (0usize, 0usize, 0f64, 0u64);
    for l in &cal.layers {
        for r in l {
            let mut c: Vec<u64> = r.outlier_counts.clone();
            chans += c.len();
            ever += c.iter().filter(|&&v| v > 0).count();
            let total: u64 = c.iter().sum();
            occ += total;
            c.sort_unstable_by(|a, b| b.cmp(a));
            let top = c.len().div_ceil(33); // 3%
            if total > 0 {
                hot3_cover += c[..top].iter().sum::<u64>() as f64;
            }
        }
    }
    eprintln!(
        "calibrated on {} tokens in {cal_s:.1} s: {} outlier values ({:.3}% of all), {:.1}% of channels ever past τ, the top 3% of channels hold {:.1}% of outliers",
        cal_tokens.len(),
        occ,
        100.0 * occ as f64 / cal.layers.iter().flatten().map(|r| r.values).sum::<u64>().max(1) as f64,
        100.0 * ever as f64 / chans.max(1) as f64,
        100.0 * hot3_cover / occ.max(1) as f64
    );
    let vocab = model.transformer.weights.output.rows;
    // One scheme over every window: (perplexity, argmax per scored position).
    // A scheme runs as a placement: its simulated groups a device's (`quantsim::SimDevice`),
    // every block on the host, through the engine's executor.
    let eval = |sim: Option<&std::sync::Arc<SimLinears>>, label: &str| -> Result<(f64, Vec<u32>), String> {
        let devs = sim.map(|s| llmd_engine::quantsim::devices(std::sync::Arc::new(SimDevice::new(s.clone(), label))));
        let pb = bar(windows as u64, label);
        let (mut total, mut count, mut top) = (0f64, 0usize, Vec::new());
        for w in 0..windows {
            let mut win: Vec<u32> = bos.into_iter().collect();
            win.extend_from_slice(&toks[w * per..(w + 1) * per]);
            let mut kv = model.transformer.new_kv();
            for (ci, chunk) in win.chunks(a.chunk).enumerate() {
                let logits = match &devs {
                    Some(d) => model
                        .transformer
                        .run(&mut [(&mut kv, chunk)], Run::ALL.on(d))
                        .map(|mut l| l.pop().unwrap_or_default()),
                    None => model.transformer.forward(&mut kv, chunk, Logits::All),
                }
                .map_err(|e| e.to_string())?;
                for (i, row) in logits.chunks_exact(vocab).enumerate() {
                    let pos = ci * a.chunk + i;
                    if let Some(&next) = win.get(pos + 1) {
                        total += nll(row, next);
                        count += 1;
                        let am =
                            row.iter()
                                .enumerate()
                                .fold((0usize, f32::NEG_INFINITY), |m, (j, &v)| if v > m.1 { (j, v) } else { m });
                        top.push(am.0 as u32);
                    }
                }
            }
            pb.inc(1);
            pb.set_message(format!("{label} {:.3}", (total / count.max(1) as f64).exp()));
        }
        pb.finish_and_clear();
        Ok(((total / count.max(1) as f64).exp(), top))
    };
    let opts = llmd_engine::quantsim::SimOptions {
        weights: match a.weights.as_str() {
            "per-tensor" => llmd_engine::prefill::WeightQuant::PerTensor,
            "per-channel" => llmd_engine::prefill::WeightQuant::PerChannel,
            _ => llmd_engine::prefill::WeightQuant::Folded,
        },
    };
    let t0 = Instant::now();
    let float = SimLinears::new(&model.transformer, &cal, Scheme::Float, opts, threads).map_err(|e| e.to_string())?;
    let float = std::sync::Arc::new(float);
    let (float_ppl, float_top) = eval(Some(&float), "float")?;
    drop(float);
    let mut rows = vec![serde_json::json!({
        "scheme": "float", "label": Scheme::Float.label(), "perplexity": float_ppl, "agreement": 1.0,
        "seconds": t0.elapsed().as_secs_f64(),
    })];
    for (name, scheme) in &schemes {
        if *name == "float" {
            continue;
        }
        let t0 = Instant::now();
        let (row, stats) = match scheme {
            None => (eval(None, name)?, serde_json::json!({})),
            Some(s) => {
                let sim = SimLinears::new(&model.transformer, &cal, *s, opts, threads).map_err(|e| e.to_string())?;
                let sim = std::sync::Arc::new(sim);
                let r = eval(Some(&sim), name)?;
                let st = &sim.stats;
                let stats = serde_json::json!({
                    "shadow_sites": sim.shadow_sites,
                    "outlier_elements": st.outlier_elements.load(Ordering::Relaxed),
                    "outlier_channels": st.outlier_channels.load(Ordering::Relaxed),
                    "values": st.values.load(Ordering::Relaxed),
                    "saturated_outputs": st.saturated_outputs.load(Ordering::Relaxed),
                    "groups": st.groups.load(Ordering::Relaxed),
                    "shadow_groups": st.shadow_groups.load(Ordering::Relaxed),
                });
                (r, stats)
            }
        };
        let (ppl, top) = row;
        let agree = top.iter().zip(&float_top).filter(|(a, b)| a == b).count() as f64 / float_top.len().max(1) as f64;
        let mut j = serde_json::json!({
            "scheme": name,
            "label": scheme.map_or("CPU path (its own kernels: Q weights, 8-bit activations per 32)".into(), |s| s.label()),
            "perplexity": ppl, "agreement": agree, "seconds": t0.elapsed().as_secs_f64(),
        });
        if let (Some(o), Some(s)) = (j.as_object_mut(), stats.as_object()) {
            o.extend(s.clone());
        }
        rows.push(j);
    }
    let total_sites = cal.layers.len() * 4;
    // llm.npu Fig. 12: each site's importance (largest |x| over τ) by depth.
    let importance: Vec<serde_json::Value> = cal
        .layers
        .iter()
        .enumerate()
        .map(|(li, l)| {
            serde_json::json!({
                "layer": li,
                "importance": l.iter().map(|r| r.importance()).collect::<Vec<f32>>(),
                "tau": l.iter().map(|r| r.tau).collect::<Vec<f32>>(),
                "max_abs": l.iter().map(|r| r.input.0.abs().max(r.input.1.abs())).collect::<Vec<f32>>(),
            })
        })
        .collect();
    if a.json {
        crate::out!(
            "{}",
            serde_json::json!({
                "model": a.model.display().to_string(), "text": a.text.display().to_string(),
                "offset": a.offset, "ctx": a.ctx, "windows": windows, "scored_tokens": float_top.len(),
                "calibration_tokens": cal_tokens.len(), "chunk": a.chunk, "sites": total_sites, "schemes": rows,
                "importance_by_layer": importance, "weights": a.weights,
            })
        );
        return Ok(());
    }
    crate::out!(
        "{} — {} scored tokens ({windows} windows of {}) of {} from token {}; calibration {} tokens; chunks of {}; {} linear sites",
        a.model.display(),
        float_top.len(),
        a.ctx,
        a.text.display(),
        a.offset,
        cal_tokens.len(),
        a.chunk,
        total_sites
    );
    crate::out!("importance (largest |x| / τ) by layer, sites qkv/o/gate_up/down:");
    for l in &importance {
        let v: Vec<String> = l["importance"]
            .as_array()
            .map_or(Vec::new(), |a| a.iter().map(|x| format!("{:.1}", x.as_f64().unwrap_or(0.0))).collect());
        crate::out!("  layer {:>2}: {}", l["layer"], v.join(" / "));
    }
    crate::out!("| scheme | perplexity | vs float | next-token agreement | shadow sites | outliers per 10k values | saturated outputs | s |");
    crate::out!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let ppl = r["perplexity"].as_f64().unwrap_or(f64::NAN);
        let vals = r["values"].as_u64().unwrap_or(0);
        crate::out!(
            "| {} | {:.3} | {:+.2}% | {:.2}% | {} | {} | {} | {:.0} |",
            r["label"].as_str().unwrap_or(""),
            ppl,
            100.0 * (ppl / float_ppl - 1.0),
            100.0 * r["agreement"].as_f64().unwrap_or(0.0),
            r["shadow_sites"].as_u64().map_or("-".into(), |v| v.to_string()),
            if vals > 0 {
                format!("{:.2}", 1e4 * r["outlier_elements"].as_u64().unwrap_or(0) as f64 / vals as f64)
            } else {
                "-".into()
            },
            r["saturated_outputs"].as_u64().map_or("-".into(), |v| v.to_string()),
            r["seconds"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}
