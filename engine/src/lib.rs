//! llmd's inference engine: model formats (GGUF, HF layout), tokenizer and chat templates,
//! llama-family architectures, quantized kernels, backends, KV cache, sampling and generation.
//!
//! No Binder or Android dependency lives here; the daemon drives the engine through [`Model`],
//! [`model::Transformer::forward`] (one bounded unit of work per call) and [`generate`].

pub mod backend;
pub mod chat;
pub mod config;
pub mod convert;
pub mod error;
pub mod format;
pub mod fuzzing;
pub mod generate;
pub mod hetero;
pub mod model;
pub mod prefill;
pub mod quant;
pub mod quantsim;
pub mod sampling;
pub mod sched;
pub mod sequence;
pub mod shadowattn;
pub mod smooth;
pub mod tokenizer;

use backend::Planner;
use chat::ChatTemplate;
use error::{EngineError, FormatError};
use format::gguf::GgufFile;
use model::config::ModelConfig;
use model::weights::ModelWeights;
use model::Transformer;
use std::path::Path;
use tokenizer::Tokenizer;

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// CPU worker threads (0 = one per core).
    pub threads: usize,
    /// How KV caches store keys and values (f16 by default; int8 halves their memory).
    pub kv_type: model::kv::KvType,
    /// Leave the token embedding on storage and read the rows a prompt needs on demand
    /// (MNN-LLM's DRAM–flash split). Only for models whose output head is separate: a tied head
    /// needs the whole table in memory anyway. GGUF and HF files.
    pub embeddings_on_flash: bool,
}

impl LoadOptions {
    /// The op planner of the host (the CPU backend with `threads` workers) a loaded model runs on.
    pub fn host_planner(&self) -> Planner {
        Planner::cpu(self.threads)
    }
}

/// A loaded model: network, tokenizer and chat template.
pub struct Model {
    /// The file's base name without extension (the model's id).
    pub name: String,
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

impl Model {
    /// Loads a GGUF file, an llmd file (`llmctl convert`) or an HF directory (`config.json` +
    /// `*.safetensors` + `tokenizer.json`).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self, EngineError> {
        Self::load_with_progress(path, opts, &|_, _| {})
    }

    /// [`Self::load`], calling `progress(bytes done, bytes in all)` as weights are read.
    pub fn load_with_progress(
        path: &Path,
        opts: &LoadOptions,
        progress: &(dyn Fn(u64, u64) + Send + Sync),
    ) -> Result<Self, EngineError> {
        if format::llmd::path_is_llmd(path) {
            // The pipeline's callback must be 'static, `progress` is borrowed: the counts are
            // collected and reported once, at the end (`load_llmd` reports as it reads).
            let counts =
                std::sync::Arc::new((std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0)));
            let c2 = counts.clone();
            let stream = model::stream::StreamOptions {
                progress: Some(std::sync::Arc::new(move |p: &model::stream::Progress| {
                    c2.0.store(p.read_bytes, std::sync::atomic::Ordering::Relaxed);
                    c2.1.store(p.total_bytes, std::sync::atomic::Ordering::Relaxed);
                })),
                ..Default::default()
            };
            let r = Self::load_llmd(path, opts, &stream, None).map(|(m, _, _)| m);
            progress(
                counts.0.load(std::sync::atomic::Ordering::Relaxed),
                counts.1.load(std::sync::atomic::Ordering::Relaxed),
            );
            return r;
        }
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let planner = opts.host_planner();
        let src = Source::open(path)?;
        // Parsing the file and building the tokenizer leave freed heap behind; with the packed
        // weights in their own mapping (`quant::packed::weight_arena`) nothing would reuse it,
        // and it would stay resident (~35 MB for SmolLM2-135M, most of it at the peak too).
        llmd_alloc_sys::release_free_memory();
        let mut weights = ModelWeights::load_progress(&src.config, &src.tensors, opts.embeddings_on_flash, progress)?;
        if weights.rope_freqs.is_none() {
            weights.rope_freqs = src.rope_freqs;
        }
        let chat_template = src.chat_template.as_deref().map(ChatTemplate::new).transpose()?;
        let mut transformer = Transformer::new(src.config, weights, planner);
        transformer.kv_type = opts.kv_type;
        Ok(Self { name, transformer, tokenizer: src.tokenizer, chat_template })
    }

    /// Loads an llmd file through the streaming pipeline (read → unpack → compute). With a
    /// prompt (token ids), prefills it layer by layer as the weights arrive — the cold start —
    /// and returns its last token's logits and KV cache with the pipeline's report.
    pub fn load_llmd(
        path: &Path,
        opts: &LoadOptions,
        stream: &model::stream::StreamOptions,
        prompt: Option<&[u32]>,
    ) -> Result<(Self, Option<model::stream::Prefilled>, model::stream::LoadReport), EngineError> {
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let planner = opts.host_planner();
        let (meta, (tokenizer, chat_template), weights, prefilled, report) =
            model::stream::load(path, &planner, opts.kv_type, stream, prompt, llmd_tokenizer_and_template)?;
        let mut transformer = Transformer::new(meta.config, weights, planner);
        transformer.kv_type = opts.kv_type;
        // As in `load_with_progress`: the pipeline's freed buffers back to the OS.
        llmd_alloc_sys::release_free_memory();
        Ok((Self { name, transformer, tokenizer, chat_template }, prefilled, report))
    }

    pub fn config(&self) -> &ModelConfig {
        &self.transformer.config
    }
}

/// A GGUF file or HF directory opened for use: configuration, tensors by GGUF name (no
/// `output.weight` when the head is tied), tokenizer and chat template source. The loader and
/// `llmctl convert` both start here.
pub struct Source {
    pub config: ModelConfig,
    pub tensors: format::TensorMap,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    /// RoPE frequency divisors computed from an HF `rope_scaling` (GGUF has them as a tensor).
    pub rope_freqs: Option<Vec<f32>>,
}

impl Source {
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        if format::is_hf_dir(path) {
            let hf = format::hf::load(path)?;
            let tokenizer = Tokenizer::from_hf(&hf.tokenizer_json)?;
            return Self::from_hf(hf, tokenizer);
        }
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// A read HF directory and its tokenizer opened for use (what [`Self::open`] does after
    /// reading them).
    pub fn from_hf(hf: format::hf::HfModel, tokenizer: Tokenizer) -> Result<Self, EngineError> {
        let mut tensors = hf.tensors;
        if !hf.tie_word_embeddings && !tensors.contains_key("output.weight") {
            return Err(FormatError::MissingTensor("lm_head.weight".into()).into());
        }
        if hf.tie_word_embeddings {
            tensors.remove("output.weight");
        }
        check_vocab(&hf.config, &tokenizer)?;
        Ok(Self {
            config: hf.config,
            tensors,
            tokenizer,
            chat_template: hf.chat_template,
            rope_freqs: hf.rope_freq_factors,
        })
    }

    /// A parsed GGUF file opened for use (what [`Self::open`] does after parsing).
    pub fn from_gguf(g: GgufFile) -> Result<Self, EngineError> {
        let config = ModelConfig::from_gguf(&g)?;
        let tensors: format::TensorMap = g
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    format::TensorRef {
                        ty: t.ty,
                        dims: t.dims.clone(),
                        file: g.bytes().clone(),
                        range: g.tensor_range(t),
                    },
                )
            })
            .collect();
        // The tokenizer first: its build's transient allocations are freed back to the heap
        // that the (larger) repacked weights then reuse, instead of adding to peak memory.
        let tokenizer = Tokenizer::from_gguf(&g)?;
        check_vocab(&config, &tokenizer)?;
        let chat_template = g.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_owned);
        Ok(Self { config, tensors, tokenizer, chat_template, rope_freqs: None })
    }
}

/// What a model file says about itself without loading it: for listing and residency planning.
#[derive(Clone, Debug)]
pub struct ModelProbe {
    pub config: ModelConfig,
    pub has_chat_template: bool,
    /// Bytes of the file (or HF directory's tensors) on storage.
    pub file_bytes: u64,
    /// Expected resident bytes of the weights once loaded (packed copies).
    pub weight_bytes: u64,
}

/// Reads a model's header only (GGUF metadata, llmd header, HF config): no tokenizer is built,
/// no weight is read.
pub fn probe(path: &Path) -> Result<ModelProbe, EngineError> {
    if format::llmd::path_is_llmd(path) {
        let (_, meta, len) = format::llmd::read_head(path)?;
        return Ok(probe_of_llmd(meta, len));
    }
    if format::is_hf_dir(path) {
        let hf = format::hf::load(path)?;
        let bytes: u64 = hf.tensors.values().map(|t| t.range.len() as u64).sum();
        return Ok(ModelProbe {
            config: hf.config,
            has_chat_template: hf.chat_template.is_some(),
            file_bytes: bytes,
            weight_bytes: bytes,
        });
    }
    let g = GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&g)?;
    let bytes: u64 = g.tensors.iter().map(|t| g.tensor_range(t).len() as u64).sum();
    Ok(ModelProbe {
        config,
        has_chat_template: g.get("tokenizer.chat_template").is_some(),
        file_bytes: std::fs::metadata(path).map(|m| m.len()).unwrap_or(bytes),
        weight_bytes: bytes,
    })
}

/// [`probe`] of an llmd file from its checked metadata and its length.
pub fn probe_of_llmd(meta: format::llmd::Metadata, file_len: u64) -> ModelProbe {
    // EdgeFlow tensors unpack to Q8_0 tiles: 34 bytes per 32 weights.
    let weight_bytes = meta
        .tensors
        .iter()
        .map(|t| match t.kind {
            format::llmd::TensorKind::Edgeflow => t.rows * t.cols * 34 / 32,
            format::llmd::TensorKind::Ggml { .. } | format::llmd::TensorKind::KPacked { .. } => t.len,
        })
        .sum();
    ModelProbe {
        has_chat_template: meta.chat_template.is_some(),
        config: meta.config,
        file_bytes: file_len,
        weight_bytes,
    }
}

/// The tokenizer and chat template an llmd file's metadata describes, checked against its
/// configuration (what the streaming loader builds before the weights arrive).
pub fn llmd_tokenizer_and_template(
    meta: &format::llmd::Metadata,
) -> Result<(Tokenizer, Option<ChatTemplate>), EngineError> {
    let tokenizer = Tokenizer::from_snapshot(meta.tokenizer.clone())?;
    check_vocab(&meta.config, &tokenizer)?;
    let chat_template = meta.chat_template.as_deref().map(ChatTemplate::new).transpose()?;
    Ok((tokenizer, chat_template))
}

fn check_vocab(c: &ModelConfig, t: &Tokenizer) -> Result<(), FormatError> {
    if t.vocab_size() > c.vocab_size {
        return Err(FormatError::BadHyperParameter {
            what: "vocab_size",
            detail: format!("tokenizer has {} tokens, the output head {}", t.vocab_size(), c.vocab_size),
        });
    }
    Ok(())
}
