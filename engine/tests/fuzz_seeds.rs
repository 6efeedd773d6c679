//! The engine's fuzz seeds: `write_seeds` (ignored) regenerates the seeds Rust makes (llmd heads
//! converted from the GGUF seeds, and HF `tokenizer.json` inputs of the tokenizer target;
//! `fuzz/seeds.py` makes the rest), and `the_model_seeds_load` checks the model seeds are whole
//! models. Every target's stored inputs are replayed in `daemon/tests/fuzz_replay.rs`, where
//! llmd is at hand as the chat-template sandbox.

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// Regenerates the Rust-made seeds: `cargo test --release -p llmd-engine --test fuzz_seeds --
/// --ignored write_seeds` (after `python3 fuzz/seeds.py`, whose GGUF seeds it converts).
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the formats change"]
fn write_seeds() {
    use llmd_engine::convert::{convert, ConvertOptions};
    let corpus = fuzz_dir().join("corpus");
    let tmp = std::env::temp_dir().join(format!("llmd-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("temp dir");
    std::fs::create_dir_all(corpus.join("llmd")).expect("corpus dir");
    for name in ["tiny-qwen2-bpe-tied", "tiny-llama-spm-untied", "llama-q8_0-small-vocab"] {
        let out = tmp.join(format!("{name}.llmd"));
        let opts = ConvertOptions { bits: Some(4.0), threads: 1, smoothing: None };
        convert(&corpus.join("gguf").join(name), &out, &opts, &|_, _, _| {}).expect("the GGUF seed converts");
        std::fs::copy(&out, corpus.join("llmd").join(name)).expect("copied");
    }
    // The tokenizer target's HF mode: tokenizer.json \0 tokenizer_config.json \0 config.json.
    for (name, eos) in [("tiny-qwen2-bpe-tied", "<|im_end|>"), ("tiny-llama-spm-untied", "</s>")] {
        let src = llmd_engine::Source::open(&corpus.join("gguf").join(name)).expect("the GGUF seed opens");
        let tk = &src.tokenizer;
        let tcfg =
            serde_json::json!({"bos_token": tk.bos_text(), "eos_token": {"content": eos}, "add_bos_token": true});
        let cfg = serde_json::json!({"eos_token_id": [tk.eos.unwrap_or(0), 0]});
        let input = format!("{}\0{tcfg}\0{cfg}", tk.hf_json());
        std::fs::write(corpus.join("tokenizer").join(format!("hf-json-{name}")), input).expect("written");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The model seeds are whole, valid models: the targets start deep, and mutations explore from
/// there. (A seed that stopped loading after a format change would leave its target shallow.)
#[test]
fn the_model_seeds_load() {
    use llmd_engine::format::gguf::GgufFile;
    use llmd_engine::format::{hf, llmd, ModelBytes, TensorMap};
    use llmd_engine::model::weights::ModelWeights;
    use llmd_engine::Source;
    let corpus = fuzz_dir().join("corpus");
    for name in ["tiny-qwen2-bpe-tied", "tiny-llama-spm-untied", "llama-q8_0-small-vocab"] {
        let bytes = std::fs::read(corpus.join("gguf").join(name)).expect("seed");
        let g = GgufFile::parse(ModelBytes::Owned(bytes)).expect("parses");
        let src = Source::from_gguf(g).unwrap_or_else(|e| panic!("{name}: {e}"));
        ModelWeights::load_progress(&src.config, &src.tensors, false, &|_, _| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let head = std::fs::read(corpus.join("llmd").join(name)).expect("seed");
        let (_, meta) = llmd::parse_head(&head, head.len() as u64).unwrap_or_else(|e| panic!("{name}.llmd: {e}"));
        llmd_engine::llmd_tokenizer_and_template(&meta).unwrap_or_else(|e| panic!("{name}.llmd: {e}"));
    }
    for name in ["qwen2-bias-tied-bf16", "llama-head-f16-llama3-rope", "mistral-f32-linear-rope"] {
        let data = std::fs::read(corpus.join("hf").join(name)).expect("seed");
        let mut parts = data.splitn(3, |&b| b == 0);
        let (config, _tcfg, st) =
            (parts.next().expect("config"), parts.next().expect("tcfg"), parts.next().expect("st"));
        let cfg = hf::parse_config(std::str::from_utf8(config).expect("UTF-8"), Path::new("config.json"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut tensors = TensorMap::new();
        hf::add_safetensors(std::sync::Arc::new(ModelBytes::Owned(st.to_vec())), Path::new(name), &mut tensors)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let src_config = cfg.config.clone();
        let model = hf::HfModel::new(cfg, tensors, PathBuf::new(), None);
        let tensors = if model.tie_word_embeddings {
            let mut t = model.tensors.clone();
            t.remove("output.weight");
            t
        } else {
            model.tensors.clone()
        };
        ModelWeights::load_progress(&src_config, &tensors, false, &|_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}
