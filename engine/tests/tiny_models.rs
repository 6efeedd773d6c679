//! Architectures and tokenizers the default model does not exercise, on tiny random models
//! (tests/fixtures/, made with llama.cpp's outputs by tools/golden/make_tiny_models.py):
//! llama + SentencePiece vocabulary + GQA + separate output head + linear RoPE scaling, and
//! qwen2 + Q/K/V biases + rotate-half RoPE + GPT-2 BPE (qwen2 pre-tokenizer) + tied embeddings.

mod common;

use llmd_engine::model::config::{Arch, RopeStyle};
use llmd_engine::model::Logits;
use llmd_engine::sampling::argmax;
use llmd_engine::{LoadOptions, Model};

/// F32 weights pair with F32 activations in both engines, so only float summation order and
/// the f16 KV cache (the same in both) separate them. Measured: |Δlogit| ≤ 1.1e-4 on logits
/// spanning ±20; the bound leaves a factor of ~10 for other compilers and CPUs.
const LOGIT_ABS_TOL: f32 = 1e-3;
/// Greedy steps whose llama.cpp lead is below this could flip on that summation noise.
const NEAR_TIE_MARGIN: f64 = 1e-2;

fn tiny(name: &str) -> Model {
    let p = common::repo_root().join(format!("tests/fixtures/{name}.gguf"));
    Model::load(&p, &LoadOptions { threads: 2, ..Default::default() }).unwrap_or_else(|e| panic!("{name} loads: {e}"))
}

fn check(name: &str, m: &Model) {
    let text = std::fs::read_to_string(common::repo_root().join("tests/golden/tiny.json")).expect("golden");
    let g: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let g = &g[name];
    for case in g["tokenizer_cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let ids = m.tokenizer.encode(text, false, m.tokenizer.add_bos).expect("encodes");
        assert_eq!(ids, common::ids(&case["ids"]), "{name}: ids of {text:?}");
        let body: Vec<u32> = ids.iter().copied().filter(|&t| Some(t) != m.tokenizer.bos).collect();
        let back = m.tokenizer.decode(&body).expect("decodes");
        // SentencePiece adds a leading space; llama.cpp strips it when detokenizing.
        assert_eq!(back.strip_prefix(' ').unwrap_or(&back), text, "{name}: round trip of {text:?}");
    }
    for p in g["prompts"].as_array().expect("prompts") {
        let text = p["text"].as_str().expect("text");
        let ids = common::ids(&p["prompt_ids"]);
        let mut kv = m.transformer.new_kv();
        let mut logits = m.transformer.forward(&mut kv, &ids, Logits::Last).expect("prefill");
        let want: Vec<f32> =
            p["logits"].as_array().expect("logits").iter().map(|x| x.as_f64().expect("f") as f32).collect();
        let diff = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{name} {text:?}: max |Δlogit| {diff}");
        assert!(diff <= LOGIT_ABS_TOL, "{name} {text:?}: max |Δlogit| {diff}");
        let greedy = common::ids(&p["greedy_ids"]);
        for (step, &want_tok) in greedy.iter().enumerate() {
            let t = argmax(&logits);
            if t != want_tok {
                let margin = p["margins"][step].as_f64().expect("margin");
                assert!(
                    margin < NEAR_TIE_MARGIN,
                    "{name} {text:?} step {step}: {t} vs llama.cpp {want_tok} (lead {margin})"
                );
                break;
            }
            logits = m.transformer.forward(&mut kv, &[t], Logits::Last).expect("decode");
        }
    }
}

#[test]
fn llama_with_sentencepiece_vocab_gqa_separate_head_and_rope_scaling() {
    let m = tiny("tiny-llama-spm");
    let c = m.config();
    assert_eq!((c.arch, c.rope_style, c.n_heads, c.n_kv_heads), (Arch::Llama, RopeStyle::Interleaved, 4, 2));
    assert_eq!(c.rope_freq_scale, 0.5);
    assert!(!std::ptr::eq(
        m.transformer.weights.output.bytes().as_ptr(),
        m.transformer.weights.token_embd.bytes().as_ptr()
    ));
    check("tiny-llama-spm", &m);
}

#[test]
fn qwen2_with_biases_bpe_vocab_and_tied_embeddings() {
    let m = tiny("tiny-qwen2");
    let c = m.config();
    assert_eq!((c.arch, c.rope_style), (Arch::Qwen2, RopeStyle::Neox));
    assert!(m.transformer.weights.layers[0].bq.is_some());
    assert!(m.tokenizer.is_eog(m.tokenizer.eos.expect("eos")));
    check("tiny-qwen2", &m);
}

/// Embeddings on flash (MNN-LLM's DRAM–flash split): with a separate output head, the embedding
/// table is not copied into memory, rows are read from storage on demand, and the logits are
/// the same bit for bit; with a tied head the option changes nothing.
#[test]
fn embeddings_on_flash_give_the_same_logits_with_less_memory() {
    let p = common::repo_root().join("tests/fixtures/tiny-llama-spm.gguf");
    let load = |flash| {
        llmd_engine::Model::load(
            &p,
            &llmd_engine::LoadOptions { threads: 2, embeddings_on_flash: flash, ..Default::default() },
        )
        .expect("loads")
    };
    let (dram, flash) = (load(false), load(true));
    assert!(flash.transformer.weights.token_embd.on_flash);
    let saved = dram.transformer.weights.size_bytes() - flash.transformer.weights.size_bytes();
    assert_eq!(saved, dram.transformer.weights.token_embd.size_bytes());
    let toks = dram.tokenizer.encode("hello world, once more", false, true).expect("tokens");
    let run = |m: &llmd_engine::Model| {
        m.transformer.forward(&mut m.transformer.new_kv(), &toks, llmd_engine::model::Logits::All).expect("forward")
    };
    assert_eq!(run(&dram), run(&flash));
    let q = common::repo_root().join("tests/fixtures/tiny-qwen2.gguf");
    let tied =
        llmd_engine::Model::load(&q, &llmd_engine::LoadOptions { embeddings_on_flash: true, ..Default::default() })
            .expect("loads");
    assert!(!tied.transformer.weights.token_embd.on_flash, "a tied head keeps the table in memory");
}
