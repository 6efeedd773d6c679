//! The engine's fuzz targets replayed on the stable toolchain: every stored input of
//! `fuzz/corpus/<target>/` (the seeds and what `cargo fuzz cmin` kept) and of
//! `fuzz/regressions/<target>/` (inputs that once crashed, hung or ran out of memory) goes
//! through the target's body (`llmd_engine::fuzzing`), which must return without a panic and
//! well within the fuzzing time limit. `scripts/fuzz.sh` runs the targets themselves.
//!
//! `write_seeds` (ignored) regenerates the seeds Rust makes: llmd heads converted from the GGUF
//! seeds, and HF `tokenizer.json` inputs of the tokenizer target. `fuzz/seeds.py` makes the rest.

use llmd_engine::fuzzing;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// libFuzzer's `-timeout` in `scripts/fuzz.sh` is 10 s per input (with sanitizers and
/// instrumentation); a replay in release takes a fraction of that.
const PER_INPUT: Duration = Duration::from_secs(10);

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// Runs every stored input of `target` through `body`; returns how many there were.
fn replay(target: &str, body: fn(&[u8])) -> usize {
    let mut n = 0;
    for kind in ["corpus", "regressions"] {
        for path in inputs(&fuzz_dir().join(kind).join(target)) {
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let t0 = Instant::now();
            if std::panic::catch_unwind(|| body(&data)).is_err() {
                panic!("fuzz target {target} panics on {}", path.display());
            }
            let took = t0.elapsed();
            assert!(took < PER_INPUT, "fuzz target {target} took {took:?} on {}", path.display());
            n += 1;
        }
    }
    assert!(n > 0, "no stored input for fuzz target {target} (fuzz/corpus/{target}/)");
    n
}

#[test]
fn gguf_inputs_replay_without_a_panic() {
    replay("gguf", fuzzing::gguf);
}

#[test]
fn llmd_inputs_replay_without_a_panic() {
    replay("llmd", fuzzing::llmd);
}

#[test]
fn hf_inputs_replay_without_a_panic() {
    replay("hf", fuzzing::hf);
}

#[test]
fn tokenizer_inputs_replay_without_a_panic() {
    replay("tokenizer", fuzzing::tokenizer);
}

#[test]
fn chat_template_inputs_replay_without_a_panic() {
    replay("chat_template", fuzzing::chat_template);
}

/// Regenerates the Rust-made seeds: `cargo test --release -p llmd-engine --test fuzz_replay --
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
