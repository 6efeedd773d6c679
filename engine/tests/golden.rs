//! Tier 2: the real default model against llama.cpp's outputs on the same GGUF
//! (tests/golden/smollm2.*, made by tools/golden/make_golden.py).

mod common;

use common::*;
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::Prompt;
use llmd_engine::model::Logits;
use llmd_engine::sampling::argmax;

// Logit tolerances. Both engines quantize activations to Q8_1/Q8_0 blocks before every
// matmul and keep an f16 KV cache, so a one-ulp difference in a float sum can flip one
// activation's rounding and move logits by ~0.1: agreement is bounded by that noise, not by
// exactness. tools/golden/noise_floor.py measures llama.cpp against itself (one batch vs one
// token at a time) on these 12 prompts: KL up to 7.9e-3, max |Δp| up to 0.033, max centred
// |Δlogit| up to 0.65. Our engine against llama.cpp (x86, deterministic for a given build)
// measured KL ≤ 5.1e-3, |Δp| ≤ 0.040 ("rust"), centred |Δlogit| ≤ 0.89 ("chat"). The bounds
// sit at llama.cpp's own disagreement plus a small margin.
/// KL(llama.cpp ‖ ours) of the next-token distributions, in nats.
const KL_TOL: f64 = 1e-2;
/// Largest difference of any token's probability.
const PROB_ABS_TOL: f64 = 0.04;
/// Largest |Δlogit| after removing the mean difference (softmax ignores a constant shift).
const CENTRED_LOGIT_TOL: f64 = 1.0;
/// A greedy step where llama.cpp's best and second-best logits are closer than this is a near
/// tie: the logit noise above (centred |Δlogit| up to ~0.8) can order them either way, and
/// llama.cpp itself flips such steps when the batch shape changes (it did at margins of 0.019,
/// 0.039 and 0.072 on these prompts). At a near tie our token must be one llama.cpp scores
/// within this margin of its best; after it the two continuations differ and are not compared.
const NEAR_TIE_MARGIN: f64 = 0.25;
/// The 1.5B Q4_K_M against llama.cpp: llama.cpp against itself on this model
/// (tools/golden/noise_floor.py, one batch vs one token at a time) measured KL up to 7.8e-3,
/// max |Δp| up to 0.051 ("capital") and centred |Δlogit| up to 0.68 ("story"). Our engine
/// measured KL ≤ 5.9e-3, |Δp| ≤ 0.042 ("long"), centred ≤ 0.56: inside that floor. The bounds
/// are the floor plus a small margin, as for the default model.
const LARGE: Tolerances = Tolerances { kl: 1e-2, prob: 0.06, centred: 1.0 };
/// The default model's bounds (above).
const DEFAULT: Tolerances = Tolerances { kl: KL_TOL, prob: PROB_ABS_TOL, centred: CENTRED_LOGIT_TOL };

struct Tolerances {
    kl: f64,
    prob: f64,
    centred: f64,
}

/// The bar: at least this many prompts match llama.cpp's 32 greedy tokens exactly.
const MIN_EXACT_PROMPTS: usize = 5;
/// Chunk size used to split the prompt in this test, so prefill crosses chunk boundaries.
const TEST_CHUNK: usize = 64;

#[test]
fn the_golden_model_runs_from_its_weight_arena() {
    assert_weights_in_arena(default_model());
}

#[test]
fn greedy_tokens_and_logits_match_llama_cpp() {
    check_against_llama_cpp(default_model(), golden(), &golden_logits(), &DEFAULT, MIN_EXACT_PROMPTS);
}

/// The K-quant kernels end to end: the 1.5B Q4_K_M (Q4_K and Q6_K matrices, a Q6_K output head)
/// against llama.cpp on the same file (tests/golden/qwen2.5-coder-1.5b.*). Needs the model
/// (scripts/fetch-model-1.5b.sh, 1.1 GB), so it runs on request: `LLMD_LARGE_MODEL_TESTS=1
/// scripts/test.sh`, or `cargo test --release -p llmd-engine --test golden -- --ignored`.
#[test]
#[ignore = "needs the 1.5B model (scripts/fetch-model-1.5b.sh)"]
fn the_k_quant_model_matches_llama_cpp() {
    let model =
        llmd_engine::Model::load(&large_model_path(), &llmd_engine::LoadOptions { threads: 2, ..Default::default() })
            .expect("the 1.5B model loads");
    assert_weights_in_arena(&model);
    let name = "qwen2.5-coder-1.5b";
    check_against_llama_cpp(&model, &golden_named(name), &golden_logits_named(name), &LARGE, MIN_EXACT_PROMPTS);
}

/// Prefill (in chunks of [`TEST_CHUNK`]) and 32 greedy steps of every golden prompt: logits at
/// the prompt's end within the tolerances above, greedy tokens equal to llama.cpp's up to a
/// near tie, and at least `min_exact` prompts equal all the way.
fn check_against_llama_cpp(
    model: &llmd_engine::Model,
    g: &serde_json::Value,
    logits_ref: &[f32],
    tol: &Tolerances,
    min_exact: usize,
) {
    let n_vocab = g["n_vocab"].as_u64().expect("n_vocab") as usize;
    assert_eq!(n_vocab, model.tokenizer.vocab_size());
    let prompts = g["prompts"].as_array().expect("prompts");
    let mut exact = Vec::new();
    assert!(prompts.len() >= 5);
    for (i, p) in prompts.iter().enumerate() {
        let name = p["name"].as_str().expect("name");
        let prompt = if p["chat"].as_bool() == Some(true) {
            let msgs: Vec<ChatMessage> = serde_json::from_value(p["messages"].clone()).expect("messages");
            Prompt::Chat(msgs)
        } else {
            Prompt::Text(p["text"].as_str().expect("text").to_owned())
        };
        let expected_prompt = ids(&p["prompt_ids"]);
        let tokens = model.prompt_tokens(&prompt).expect("prompt tokenizes");
        assert_eq!(tokens, expected_prompt, "prompt ids differ for {name}");

        let mut kv = model.transformer.new_kv();
        let mut logits = Vec::new();
        for chunk in tokens.chunks(TEST_CHUNK) {
            logits = model.transformer.forward(&mut kv, chunk, Logits::Last).expect("prefill");
        }
        let reference = &logits_ref[i * n_vocab..(i + 1) * n_vocab];
        let agreement = compare_logits(&logits, reference);
        eprintln!("{name}: {agreement:?}");
        assert!(agreement.kl <= tol.kl, "{name}: KL {} > {}", agreement.kl, tol.kl);
        assert!(agreement.max_prob_diff <= tol.prob, "{name}: max |Δp| {} > {}", agreement.max_prob_diff, tol.prob);
        assert!(
            agreement.centred_max <= tol.centred,
            "{name}: centred |Δlogit| {} > {}",
            agreement.centred_max,
            tol.centred
        );

        let mut greedy = Vec::new();
        for _ in 0..g["n_greedy"].as_u64().expect("n_greedy") {
            let t = argmax(&logits);
            greedy.push(t);
            logits = model.transformer.forward(&mut kv, &[t], Logits::Last).expect("decode");
        }
        let want = ids(&p["greedy_ids"]);
        match greedy.iter().zip(&want).position(|(a, b)| a != b) {
            None => exact.push(name.to_owned()),
            Some(step) => {
                let margin = p["margins"][step].as_f64().expect("margin");
                let near = ids(&p["near"][step]);
                eprintln!(
                    "{name}: step {step} is a near tie (llama.cpp margin {margin:.3}): ours {} vs {}",
                    greedy[step], want[step]
                );
                assert!(
                    margin < NEAR_TIE_MARGIN,
                    "{name}: greedy token {step} differs where llama.cpp is sure (margin {margin})"
                );
                assert!(
                    near.contains(&greedy[step]),
                    "{name}: token {} at step {step} is not among llama.cpp's near-best {near:?}",
                    greedy[step]
                );
            }
        }
    }
    eprintln!("prompts matching all greedy tokens: {exact:?}");
    assert!(exact.len() >= min_exact, "only {} prompts match exactly: {exact:?}", exact.len());
}

#[derive(Debug)]
struct Agreement {
    kl: f64,
    max_prob_diff: f64,
    centred_max: f64,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
    x.iter().map(|&v| v as f64 - m - s.ln()).collect()
}

fn compare_logits(ours: &[f32], reference: &[f32]) -> Agreement {
    let (a, b) = (log_softmax(ours), log_softmax(reference));
    let kl = b.iter().zip(&a).map(|(lb, la)| lb.exp() * (lb - la)).sum();
    let max_prob_diff = b.iter().zip(&a).map(|(lb, la)| (lb.exp() - la.exp()).abs()).fold(0.0, f64::max);
    let mean = ours.iter().zip(reference).map(|(x, y)| (x - y) as f64).sum::<f64>() / ours.len() as f64;
    let centred_max = ours.iter().zip(reference).map(|(x, y)| ((x - y) as f64 - mean).abs()).fold(0.0, f64::max);
    Agreement { kl, max_prob_diff, centred_max }
}

#[test]
fn tokenizer_matches_llama_cpp_and_round_trips() {
    let model = default_model();
    for case in golden()["tokenizer_cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let got = model.tokenizer.encode(text, false, false).expect("encodes");
        assert_eq!(got, ids(&case["ids"]), "ids differ for {text:?}");
        assert_eq!(model.tokenizer.decode(&got).expect("decodes"), text, "round trip of {text:?}");
    }
}

/// int8 KV (one scale per position and head of 64) against the default f16 cache on the 10 raw
/// golden prompts. Measured KL ≤ 1.12e-2 nats ("science"; most ≤ 8e-3), about 1.4× llama.cpp's
/// own batch-shape noise (7.9e-3): int8 keys cost a little accuracy. This bound is a regression
/// guard at the measured value plus a third, not a noise floor.
const Q8_KV_KL_TOL: f64 = 1.5e-2;

#[test]
fn int8_kv_cache_stays_close_to_f16() {
    let f16_model = default_model();
    let mut q8_model =
        llmd_engine::Model::load(&default_model_path(), &llmd_engine::LoadOptions::default()).expect("model loads");
    q8_model.transformer.kv_type = llmd_engine::model::kv::KvType::Q8;
    let g = golden();
    let mut worst = 0f64;
    for p in g["prompts"].as_array().expect("prompts").iter().filter(|p| p["chat"].as_bool() != Some(true)) {
        let tokens = ids(&p["prompt_ids"]);
        let mut logits = Vec::new();
        for m in [f16_model, &q8_model] {
            let mut kv = m.transformer.new_kv();
            logits.push(m.transformer.forward(&mut kv, &tokens, Logits::Last).expect("forward"));
        }
        let a = compare_logits(&logits[1], &logits[0]);
        eprintln!("{}: {a:?}", p["name"]);
        worst = worst.max(a.kl);
    }
    assert!(worst <= Q8_KV_KL_TOL, "worst KL {worst}");
    let prompt: Vec<u32> = (1..=64).collect();
    let mut kv = q8_model.transformer.new_kv();
    q8_model.transformer.forward(&mut kv, &prompt, Logits::Last).expect("forward");
    let mut kv16 = f16_model.transformer.new_kv();
    f16_model.transformer.forward(&mut kv16, &prompt, Logits::Last).expect("forward");
    assert!(kv.size_bytes() * 10 < kv16.size_bytes() * 6, "int8 KV uses ~half the memory");
}
