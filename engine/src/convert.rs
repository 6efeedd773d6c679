//! `llmctl convert`: a GGUF file or HF directory → an llmd file with EdgeFlow mixed-precision
//! linear weights (see [`crate::format::llmd`] for the layout, [`crate::quant::edgeflow`] for the
//! method).
//!
//! Decisions where the paper is silent:
//! * **Which tensors.** The seven linear weights of every layer (Q, K, V, O, gate, up, down) are
//!   EdgeFlow-quantized. The token embedding and an untied output head keep their source type
//!   when the CPU kernels run it natively (Q4_0, Q4_1, Q8_0 and the K-quants Q2_K–Q6_K), else
//!   become Q8_0; norms, biases and RoPE factors are stored as f32. (Widening a K-quant
//!   embedding or head to Q8_0 made a converted 0.5B Q4_K_M file larger than its source.)
//! * **Budget.** The same average `bits` for every linear tensor (the paper's per-tensor budget).
//! * **A quantized source's tensors are kept when requantizing would not make them smaller.**
//!   A linear tensor the source already stores in a group-quantized type the CPU kernels run
//!   natively (Q4_0, Q4_1, Q8_0, Q2_K–Q6_K) is kept as it is when its bits per weight (scales
//!   included: Q4_K 4.5, Q6_K 6.56) are at most `bits`, and always when no `bits` is asked
//!   for: EdgeFlow's per-channel scales on weights that are already quantized only add error
//!   (measured on Qwen2.5-Coder-1.5B Q4_K_M, 10,240 tokens: perplexity 12.33 as is, 12.76 at
//!   5 bits, from a larger file), so requantizing pays only where it saves bytes. Kept K-quant
//!   tensors (and K-quant embeddings and heads) are written in the CPU kernels' tile records
//!   (`TensorKind::KPacked`), so loading them is a read with no repacking. With smoothing,
//!   every linear tensor is requantized (smoothing changes the weights).
//! * **Source precision.** Requantized weights are dequantized from the source type to f32
//!   first, so a quantized source's own error is inherited (8 bits from a Q4_1 source is Q4_1
//!   plus int8).
//! * **Smoothing** (NPU-aware, calibration-based) is applied when calibration tokens are given:
//!   see [`crate::smooth`].

use crate::backend::layout::kpacked::{self, KKind, KPackedMatrix};
use crate::error::{EngineError, FormatError};
use crate::format::llmd::{Metadata, QuantInfo, TensorKind, Writer};
use crate::format::TensorRef;
use crate::quant::edgeflow;
use crate::quant::{self, GgmlType};
use crate::Source;
use std::path::Path;

/// The EdgeFlow budget when none is given (for tensors that are not kept).
pub const DEFAULT_BITS: f64 = 5.0;

/// What to convert to.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Average bits per weight of every requantized linear tensor, 1–8 (fractions allowed).
    /// None: keep every tensor the kernels run natively, [`DEFAULT_BITS`] for the others.
    pub bits: Option<f64>,
    /// Threads that quantize rows (0 = all cores).
    pub threads: usize,
    /// Per-layer smoothing (column scales folded into the norms/previous layers), if calibrated.
    pub smoothing: Option<crate::smooth::Smoothing>,
}

/// What a conversion did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ConvertReport {
    pub tensors: usize,
    pub linear_weights: u64,
    /// Channels per bit-width (index = bits).
    pub channels_by_bits: [u64; 9],
    /// Bytes of the EdgeFlow linear weights as stored (bit-widths, scales and planes).
    pub linear_bytes: u64,
    /// Linear tensors kept in the source's type, their weights and bytes.
    pub kept_tensors: usize,
    pub kept_weights: u64,
    pub kept_bytes: u64,
    pub output_bytes: u64,
    /// Source tensors not used by the architecture (not converted).
    pub skipped: Vec<String>,
}

impl ConvertReport {
    /// The achieved average bits per EdgeFlow weight, counting only the planes.
    pub fn average_bits(&self) -> f64 {
        let (mut bits, mut ch) = (0u64, 0u64);
        for (b, &n) in self.channels_by_bits.iter().enumerate() {
            bits += b as u64 * n;
            ch += n;
        }
        if ch == 0 {
            0.0
        } else {
            bits as f64 / ch as f64
        }
    }
}

/// The linear weights EdgeFlow quantizes, by their name inside a layer.
pub const LINEAR: [&str; 7] = [
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
];

/// Tensors of layer `i` in the order the forward pass uses them.
fn layer_order(i: usize) -> Vec<String> {
    [
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_q.bias",
        "attn_k.bias",
        "attn_v.bias",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ]
    .iter()
    .map(|s| format!("blk.{i}.{s}"))
    .collect()
}

/// Rows of a tensor as f32 (`rows` × `cols`).
pub fn dequantize(t: &TensorRef, rows: usize, cols: usize) -> Result<Vec<f32>, EngineError> {
    let rb = t.ty.row_bytes(cols).ok_or_else(|| FormatError::RowNotBlockAligned {
        name: "tensor".into(),
        row: cols as u64,
        block: t.ty.block_size() as u64,
    })?;
    let bytes = t.bytes();
    if bytes.len() != rb * rows {
        return Err(FormatError::NativeLayout(format!("{} bytes for {rows} rows of {rb}", bytes.len())).into());
    }
    let mut out = vec![0f32; rows * cols];
    for (src, dst) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(cols)) {
        quant::dequantize_row(t.ty, src, dst)?;
    }
    Ok(out)
}

/// Whether the CPU kernels run `ty` natively from a packed layout (kept by the converter).
fn runs_natively(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) || KKind::of(ty).is_some()
}

/// Bits per weight of a block type, its scales included.
fn bits_per_weight(ty: GgmlType) -> f64 {
    (ty.type_size() * 8) as f64 / ty.block_size() as f64
}

/// Writes a tensor kept in its source type: K-quants as the kernels' packed records, other
/// types as their GGUF rows.
fn write_kept(writer: &mut Writer, name: &str, t: &TensorRef, rows: usize, cols: usize) -> Result<u64, EngineError> {
    let werr = |e: std::io::Error| FormatError::Io { path: name.to_owned(), source: e };
    let bytes = t.bytes();
    let Some(kind) = KKind::of(t.ty) else {
        writer.tensor(name, TensorKind::Ggml { type_id: t.ty.id() }, rows, cols, bytes).map_err(werr)?;
        return Ok(bytes.len() as u64);
    };
    let row_bytes = bytes.len() / rows.max(1);
    let k = KPackedMatrix::pack_in(None, kind, rows, cols, |r0, buf| {
        let src = bytes.get(r0 * row_bytes..r0 * row_bytes + buf.len()).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{name}: rows past the tensor's bytes"))
        })?;
        buf.copy_from_slice(src);
        Ok(())
    })
    .map_err(|e| FormatError::NativeLayout(format!("{name}: {e}")))?;
    let kind_tag = TensorKind::KPacked { type_id: t.ty.id(), layout: kpacked::RECORD_LAYOUT };
    writer.tensor(name, kind_tag, rows, cols, k.records()).map_err(werr)?;
    Ok(k.records().len() as u64)
}

fn shape(t: &TensorRef) -> (usize, usize) {
    let cols = t.dims.first().copied().unwrap_or(1) as usize;
    let rows = t.dims.iter().skip(1).product::<u64>() as usize;
    (rows.max(1), cols)
}

pub use crate::format::llmd::encode_edgeflow;

/// Converts `input` (GGUF or HF directory) to an llmd file at `output`. `progress(done, total,
/// name)` is called after each tensor.
pub fn convert(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    progress: &dyn Fn(usize, usize, &str),
) -> Result<ConvertReport, EngineError> {
    let bits = opts.bits.unwrap_or(DEFAULT_BITS);
    if !(edgeflow::MIN_BITS as f64..=edgeflow::MAX_BITS as f64).contains(&bits) || !bits.is_finite() {
        return Err(FormatError::BadHyperParameter { what: "bits", detail: format!("{bits} (1 to 8)") }.into());
    }
    let src = Source::open(input)?;
    let c = src.config.clone();
    let mut tensors = src.tensors.clone();
    if let (Some(f), false) = (&src.rope_freqs, tensors.contains_key("rope_freqs.weight")) {
        let bytes: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.insert(
            "rope_freqs.weight".into(),
            TensorRef {
                ty: GgmlType::F32,
                dims: vec![f.len() as u64],
                file: std::sync::Arc::new(crate::format::ModelBytes::Owned(bytes.clone())),
                range: 0..bytes.len(),
            },
        );
    }
    let mut regions: Vec<(String, Vec<String>)> =
        vec![("embed".into(), ["token_embd.weight", "rope_freqs.weight"].iter().map(|s| s.to_string()).collect())];
    for i in 0..c.n_layers {
        regions.push((format!("layer {i}"), layer_order(i)));
    }
    regions.push(("head".into(), vec!["output_norm.weight".into(), "output.weight".into()]));
    for (_, names) in regions.iter_mut() {
        names.retain(|n| tensors.contains_key(n));
    }
    let total: usize = regions.iter().map(|(_, n)| n.len()).sum();
    let mut report = ConvertReport::default();
    let mut writer =
        Writer::create(output).map_err(|e| FormatError::Io { path: output.display().to_string(), source: e })?;
    let werr = |e: std::io::Error| FormatError::Io { path: output.display().to_string(), source: e };
    let mut done = 0;
    let mut used = std::collections::HashSet::new();
    for (region, names) in &regions {
        writer.begin_region(region).map_err(werr)?;
        for name in names {
            let t = &tensors[name];
            used.insert(name.clone());
            let (rows, cols) = shape(t);
            let layer =
                name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
            let short = name.splitn(3, '.').nth(2).unwrap_or("");
            let is_linear = layer.is_some() && LINEAR.contains(&short);
            let keep = is_linear
                && opts.smoothing.is_none()
                && runs_natively(t.ty)
                && opts.bits.is_none_or(|b| bits_per_weight(t.ty) <= b);
            if keep {
                report.kept_tensors += 1;
                report.kept_weights += (rows * cols) as u64;
                report.kept_bytes += write_kept(&mut writer, name, t, rows, cols)?;
            } else if is_linear {
                let mut w = dequantize(t, rows, cols)?;
                if let (Some(sm), Some(li)) = (&opts.smoothing, layer) {
                    sm.apply_to_weight(li, short, &mut w, rows, cols);
                }
                let (bytes, widths) = encode_edgeflow(&w, rows, cols, bits, opts.threads);
                for b in widths {
                    report.channels_by_bits[b as usize] += 1;
                }
                report.linear_weights += (rows * cols) as u64;
                report.linear_bytes += bytes.len() as u64;
                writer.tensor(name, TensorKind::Edgeflow, rows, cols, &bytes).map_err(werr)?;
            } else if rows == 1 || t.dims.len() == 1 {
                let mut v = dequantize(t, 1, rows * cols)?;
                if let (Some(sm), Some(li)) = (&opts.smoothing, layer) {
                    sm.apply_to_vector(li, short, &mut v);
                }
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                writer
                    .tensor(name, TensorKind::Ggml { type_id: GgmlType::F32.id() }, 1, rows * cols, &bytes)
                    .map_err(werr)?;
            } else if runs_natively(t.ty) {
                write_kept(&mut writer, name, t, rows, cols)?;
            } else {
                let w = dequantize(t, rows, cols)?;
                let ty = if cols % 32 == 0 { GgmlType::Q8_0 } else { GgmlType::F32 };
                let rb = ty.row_bytes(cols).unwrap_or(cols * 4);
                let mut bytes = vec![0u8; rows * rb];
                for (x, b) in w.chunks_exact(cols).zip(bytes.chunks_exact_mut(rb)) {
                    quant::quantize_row(ty, x, b)?;
                }
                writer.tensor(name, TensorKind::Ggml { type_id: ty.id() }, rows, cols, &bytes).map_err(werr)?;
            }
            report.tensors += 1;
            done += 1;
            progress(done, total, name);
        }
    }
    report.skipped = tensors.keys().filter(|k| !used.contains(*k)).cloned().collect();
    let meta = Metadata {
        producer: format!("llmd {}", env!("CARGO_PKG_VERSION")),
        source: input.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
        quant: QuantInfo {
            method: "edgeflow".into(),
            bits,
            smoothing_alpha: opts.smoothing.as_ref().map(|s| s.alpha.clone()).unwrap_or_default(),
            calibration_tokens: opts.smoothing.as_ref().map(|s| s.calibration_tokens).unwrap_or(0),
        },
        config: c,
        tokenizer: src.tokenizer.snapshot(),
        chat_template: src.chat_template.clone(),
        tensors: Vec::new(),
        regions: Vec::new(),
    };
    report.output_bytes = writer.finish(meta).map_err(werr)?;
    Ok(report)
}
