//! The Hugging Face layout: `config.json` + `*.safetensors` + `tokenizer.json` in one directory.
//!
//! Tensors are renamed to their GGUF names so one builder serves both formats. HF checkpoints
//! keep Q/K in rotate-half order, so they run with [`RopeStyle::Neox`].

use super::{ModelBytes, TensorMap, TensorRef};
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::error::FormatError;
use crate::quant::GgmlType;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
}

fn default_context() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}

/// A loaded HF directory.
pub struct HfModel {
    pub config: ModelConfig,
    pub tensors: TensorMap,
    pub tokenizer_json: PathBuf,
    /// `chat_template` from `tokenizer_config.json`, if present.
    pub chat_template: Option<String>,
    pub tie_word_embeddings: bool,
    /// Per-pair RoPE divisors computed from llama-3 style `rope_scaling` (GGUF stores these as
    /// the `rope_freqs.weight` tensor).
    pub rope_freq_factors: Option<Vec<f32>>,
}

/// Llama 3.1's RoPE frequency divisors, as llama.cpp's converter writes them to `rope_freqs`:
/// long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
fn llama3_freq_factors(theta: f64, head_dim: usize, factor: f64, low: f64, high: f64, orig_ctx: f64) -> Vec<f32> {
    let low_wavelen = orig_ctx / low;
    let high_wavelen = orig_ctx / high;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

fn bad(path: &Path, detail: impl Into<String>) -> FormatError {
    FormatError::BadHfLayout { path: path.display().to_string(), detail: detail.into() }
}

/// What `config.json` says: the model's configuration (validated), RoPE frequency divisors
/// from its `rope_scaling`, and `tie_word_embeddings` when it says so.
pub struct HfModelConfig {
    pub config: ModelConfig,
    pub rope_freq_factors: Option<Vec<f32>>,
    pub tie_word_embeddings: Option<bool>,
}

/// Reads `dir/config.json`, maps every `*.safetensors` file and renames tensors to GGUF names.
pub fn load(dir: &Path) -> Result<HfModel, FormatError> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|source| FormatError::Io { path: cfg_path.display().to_string(), source })?;
    let cfg = parse_config(&text, &cfg_path)?;

    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| FormatError::Io { path: dir.display().to_string(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(bad(dir, "no *.safetensors file"));
    }
    let mut tensors = TensorMap::new();
    for path in &files {
        add_safetensors(Arc::new(ModelBytes::map(path)?), path, &mut tensors)?;
    }
    let tokenizer_json = dir.join("tokenizer.json");
    if !tokenizer_json.is_file() {
        return Err(bad(dir, "no tokenizer.json"));
    }
    let chat_template =
        std::fs::read_to_string(dir.join("tokenizer_config.json")).ok().and_then(|t| chat_template_of(&t));
    Ok(HfModel::new(cfg, tensors, tokenizer_json, chat_template))
}

/// The `chat_template` string of a `tokenizer_config.json` text (none if it is not JSON).
pub fn chat_template_of(tokenizer_config: &str) -> Option<String> {
    serde_json::from_str::<serde_json::Value>(tokenizer_config)
        .ok()
        .and_then(|v| v.get("chat_template").and_then(|c| c.as_str()).map(str::to_owned))
}

impl HfModel {
    /// The model a directory's parts make: the head is tied when `config.json` says so, or
    /// when it does not say and there is no `lm_head.weight`.
    pub fn new(cfg: HfModelConfig, tensors: TensorMap, tokenizer_json: PathBuf, chat_template: Option<String>) -> Self {
        let tie_word_embeddings = cfg.tie_word_embeddings.unwrap_or(!tensors.contains_key("output.weight"));
        Self {
            config: cfg.config,
            tensors,
            tokenizer_json,
            chat_template,
            tie_word_embeddings,
            rope_freq_factors: cfg.rope_freq_factors,
        }
    }
}

/// Parses and validates the text of a `config.json` (`cfg_path` names it in errors).
pub fn parse_config(text: &str, cfg_path: &Path) -> Result<HfModelConfig, FormatError> {
    let hf: HfConfig = serde_json::from_str(text).map_err(|e| bad(cfg_path, e.to_string()))?;
    let kind = hf.model_type.clone().or_else(|| hf.architectures.first().cloned()).unwrap_or_default();
    let arch = match kind.as_str() {
        "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM" => Arch::Llama,
        "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
        other => return Err(FormatError::UnsupportedArchitecture(other.to_owned())),
    };
    let n_heads = hf.num_attention_heads;
    let head_dim = hf.head_dim.unwrap_or(hf.hidden_size.checked_div(n_heads).unwrap_or(0));
    // Llama 3 scaling's parameters; its per-pair divisors are computed once the head size is
    // known to be sane (`validate`): head_dim / 2 of them.
    let mut llama3 = None;
    let rope_freq_scale = match &hf.rope_scaling {
        None | Some(serde_json::Value::Null) => 1.0,
        Some(v) => {
            let ty = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("");
            let num = |k: &str| v.get(k).and_then(|f| f.as_f64());
            let factor = num("factor").unwrap_or(1.0);
            match ty {
                "linear" if factor > 0.0 => (1.0 / factor) as f32,
                "default" => 1.0,
                "llama3" => {
                    let (lo, hi, orig) = match (num("low_freq_factor"), num("high_freq_factor"), num("original_max_position_embeddings")) {
                        (Some(lo), Some(hi), Some(orig)) if hi > lo && lo > 0.0 && orig > 0.0 && factor > 0.0 => (lo, hi, orig),
                        _ => {
                            return Err(FormatError::BadHyperParameter {
                                what: "rope scaling",
                                detail: "llama3 scaling needs factor, low_freq_factor < high_freq_factor and original_max_position_embeddings".into(),
                            })
                        }
                    };
                    llama3 = Some((factor, lo, hi, orig));
                    1.0
                }
                other => {
                    return Err(FormatError::BadHyperParameter {
                        what: "rope scaling",
                        detail: format!("unsupported type {other:?}"),
                    })
                }
            }
        }
    };
    let config = ModelConfig {
        arch,
        n_layers: hf.num_hidden_layers,
        d_model: hf.hidden_size,
        n_heads,
        n_kv_heads: hf.num_key_value_heads.unwrap_or(n_heads),
        head_dim,
        ffn_dim: hf.intermediate_size,
        vocab_size: hf.vocab_size,
        context_length: hf.max_position_embeddings,
        rope_theta: hf.rope_theta as f32,
        rope_dims: head_dim,
        rope_freq_scale,
        rope_style: RopeStyle::Neox,
        norm_eps: hf.rms_norm_eps as f32,
    };
    config.validate()?;
    let rope_freq_factors =
        llama3.map(|(factor, lo, hi, orig)| llama3_freq_factors(hf.rope_theta, head_dim, factor, lo, hi, orig));
    Ok(HfModelConfig { config, rope_freq_factors, tie_word_embeddings: hf.tie_word_embeddings })
}

/// Adds the tensors of one safetensors file (`path` names it in errors) to `tensors`, by their
/// GGUF names; tensors the engine does not use are left out.
pub fn add_safetensors(bytes: Arc<ModelBytes>, path: &Path, tensors: &mut TensorMap) -> Result<(), FormatError> {
    let st_err = |detail: String| FormatError::Safetensors { path: path.display().to_string(), detail };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| st_err(e.to_string()))?;
    let base = bytes.as_ptr() as usize;
    for (name, view) in st.tensors() {
        let ty = match view.dtype() {
            safetensors::Dtype::F32 => GgmlType::F32,
            safetensors::Dtype::F16 => GgmlType::F16,
            safetensors::Dtype::BF16 => GgmlType::BF16,
            other => return Err(st_err(format!("tensor {name:?} has unsupported dtype {other:?}"))),
        };
        let start = view.data().as_ptr() as usize - base;
        let range = start..start + view.data().len();
        let dims: Vec<u64> = view.shape().iter().rev().map(|&d| d as u64).collect();
        if let Some(gguf_name) = gguf_name(&name) {
            if tensors.insert(gguf_name.clone(), TensorRef { ty, dims, file: bytes.clone(), range }).is_some() {
                return Err(FormatError::DuplicateTensor(gguf_name));
            }
        }
    }
    Ok(())
}

/// Maps an HF tensor name to its GGUF name; `None` for tensors the engine does not use
/// (e.g. `rotary_emb.inv_freq`).
fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let mapped = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_follow_the_published_rule() {
        // Llama 3.1 8B: θ = 500000, head 128, factor 8, low 1, high 4, original context 8192.
        let f = llama3_freq_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0, "the fastest frequencies are kept");
        assert_eq!(f[63], 8.0, "the slowest are divided by the factor");
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "monotonic in between");
    }

    #[test]
    fn a_huge_head_size_with_llama3_scaling_is_refused_before_its_divisors_are_made() {
        // head_dim / 2 divisors made before the configuration is validated would be 2^39 of
        // them (2 TB) for this file, an abort, not an error.
        let cfg = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 300, "head_dim": 1099511627776,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}"#;
        match parse_config(cfg, Path::new("config.json")) {
            Err(FormatError::BadHyperParameter { what: "head_dim", .. }) => {}
            other => panic!("expected a bad head_dim, got {:?}", other.map(|c| c.config)),
        }
        let sane = cfg.replace("1099511627776", "4");
        let c = parse_config(&sane, Path::new("config.json")).expect("valid");
        assert_eq!(c.rope_freq_factors.map(|f| f.len()), Some(2));
    }

    #[test]
    fn a_linear_scaling_factor_that_makes_positions_infinite_is_refused() {
        // 1 / 1e-300 is infinite as an f32: every rotated position would be NaN.
        let cfg = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 300, "rope_scaling": {"type": "linear", "factor": 1e-300}}"#;
        assert!(matches!(
            parse_config(cfg, Path::new("config.json")),
            Err(FormatError::BadHyperParameter { what: "rope.scaling.factor", .. })
        ));
    }

    #[test]
    fn tensor_names_map_to_gguf() {
        assert_eq!(gguf_name("model.layers.12.self_attn.k_proj.bias").as_deref(), Some("blk.12.attn_k.bias"));
        assert_eq!(gguf_name("model.embed_tokens.weight").as_deref(), Some("token_embd.weight"));
        assert_eq!(gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
    }
}
