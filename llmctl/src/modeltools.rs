//! `llmctl convert` (GGUF / HF → llmd EdgeFlow file) and `llmctl perplexity`.

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use llmd_engine::convert::{self, ConvertOptions};
use llmd_engine::model::Logits;
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
    let step = npu.as_ref().map_or(128, |(_, chunk)| *chunk);
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
                Some((n, _)) => model.transformer.forward_with(&mut kv, chunk, n, Logits::All),
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
