//! Continuous batching: several sequences in one forward pass (decode steps of some batched with
//! prefill chunks of others) give exactly the tokens each gives alone — and so the golden
//! tokens, where the golden test matches them.

mod common;

use common::*;
use llmd_engine::generate::{GenerateRequest, Generation, Prompt};
use llmd_engine::model::Logits;
use llmd_engine::sampling::SamplingParams;

const STEPS: usize = 24;

fn request() -> GenerateRequest {
    GenerateRequest {
        prompt: Prompt::Text(String::new()),
        sampling: SamplingParams::default(),
        max_tokens: STEPS,
        stop: vec![],
    }
}

#[test]
fn batched_decode_and_prefill_equal_one_sequence_at_a_time() {
    let model = default_model();
    let g = golden();
    let prompts: Vec<Vec<u32>> = g["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .filter(|p| p["chat"].as_bool() != Some(true))
        .take(6)
        .map(|p| ids(&p["prompt_ids"]))
        .collect();
    // Alone.
    let mut alone = Vec::new();
    for p in &prompts {
        let mut kv = model.transformer.new_kv();
        let mut gen = Generation::new(model, &kv, p.clone(), &request()).expect("generation").with_prefill_chunk(16);
        let mut ids = Vec::new();
        loop {
            let out = gen.step(model, &mut kv).expect("step");
            ids.extend(out.ids);
            if out.done.is_some() {
                break;
            }
        }
        alone.push(ids);
    }
    // Together: sequence i joins at step 3*i, so prefill chunks of late joiners share passes
    // with decode steps of the others.
    let mut kvs: Vec<_> = prompts.iter().map(|_| model.transformer.new_kv()).collect();
    let mut gens: Vec<Option<Generation>> = prompts.iter().map(|_| None).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut done = vec![false; prompts.len()];
    let mut step = 0;
    let mut max_batch = 0;
    while done.iter().any(|d| !d) {
        for (i, p) in prompts.iter().enumerate() {
            if gens[i].is_none() && step >= 3 * i {
                gens[i] =
                    Some(Generation::new(model, &kvs[i], p.clone(), &request()).expect("gen").with_prefill_chunk(16));
            }
        }
        // Sample every decoding sequence; collect what each feeds.
        let mut feeds: Vec<(usize, Vec<u32>, bool)> = Vec::new();
        for i in 0..prompts.len() {
            let Some(gen) = gens[i].as_mut() else { continue };
            if done[i] {
                continue;
            }
            if let Some(chunk) = gen.prefill_chunk_tokens() {
                feeds.push((i, chunk.to_vec(), true));
                continue;
            }
            let (out, feed) = gen.sample(model, kvs[i].len()).expect("sample");
            got[i].extend(out.ids);
            if out.done.is_some() {
                done[i] = true;
            }
            if let Some(t) = feed {
                feeds.push((i, vec![t], false));
            }
        }
        max_batch = max_batch.max(feeds.len());
        let mut batch: Vec<(&mut llmd_engine::model::kv::KvCache, &[u32])> = Vec::new();
        let mut order = Vec::new();
        for (i, kv) in kvs.iter_mut().enumerate() {
            if let Some((_, toks, prefill)) = feeds.iter().find(|f| f.0 == i) {
                batch.push((kv, toks.as_slice()));
                order.push((i, toks.len(), *prefill));
            }
        }
        if !batch.is_empty() {
            let logits = model.transformer.run(&mut batch, llmd_engine::model::Run::LAST).expect("batch");
            for ((i, n, prefill), l) in order.into_iter().zip(logits) {
                let gen = gens[i].as_mut().expect("started");
                if prefill {
                    gen.accept_prefill(n, l);
                } else {
                    gen.accept_logits(l);
                }
            }
        }
        step += 1;
    }
    assert!(max_batch >= 4, "sequences really shared passes ({max_batch})");
    for (i, (a, b)) in alone.iter().zip(&got).enumerate() {
        assert_eq!(a, b, "prompt {i}: batched tokens differ from the sequence alone");
    }
}

/// A KV cache spilled to bytes and read back continues the sequence exactly (the daemon spills
/// idle sessions under memory pressure); a corrupt or foreign spill is refused.
#[test]
fn spilled_kv_cache_continues_exactly() {
    let m = common::default_model();
    let toks = m.tokenizer.encode("Once upon a time, in a quiet village,", false, true).expect("tokens");
    for ty in [llmd_engine::model::kv::KvType::F16, llmd_engine::model::kv::KvType::Q8] {
        let c = m.config();
        let mut kv = llmd_engine::model::kv::KvCache::with_type(c.n_layers, c.kv_dim(), c.head_dim, ty);
        m.transformer.forward(&mut kv, &toks, llmd_engine::model::Logits::Last).expect("prefill");
        let mut bytes = Vec::new();
        kv.write_to(&mut bytes).expect("spill");
        let mut back =
            llmd_engine::model::kv::KvCache::read_from(&mut bytes.as_slice(), c.n_layers, c.kv_dim()).expect("restore");
        assert_eq!(back.len(), kv.len());
        let a = m.transformer.forward(&mut kv, &[42], llmd_engine::model::Logits::Last).expect("step");
        let b = m.transformer.forward(&mut back, &[42], llmd_engine::model::Logits::Last).expect("step");
        assert_eq!(a, b, "{ty:?}");
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n / 2] ^= 1;
        assert!(llmd_engine::model::kv::KvCache::read_from(&mut bad.as_slice(), c.n_layers, c.kv_dim()).is_err());
        assert!(llmd_engine::model::kv::KvCache::read_from(&mut bytes.as_slice(), c.n_layers + 1, c.kv_dim()).is_err());
    }
}

/// A batch of decode steps large enough to be split over the threads (each thread one whole
/// pass over its run of sequences, `model::split_plan`) gives every sequence the logits it gets
/// alone, bit for bit, with an odd count so the runs differ in length.
#[test]
#[allow(clippy::needless_range_loop)] // a step indexes every sequence's record of steps
fn split_decode_passes_equal_each_sequence_alone() {
    const SEQUENCES: usize = 9;
    const DECODE_STEPS: usize = 4;
    let model = default_model();
    let g = golden();
    let golden_prompts: Vec<Vec<u32>> =
        g["prompts"].as_array().expect("prompts").iter().map(|p| ids(&p["prompt_ids"])).collect();
    // Distinct prompts of different lengths: the golden ones, each cut after a different count.
    let prompts: Vec<Vec<u32>> = (0..SEQUENCES)
        .map(|i| {
            let p = &golden_prompts[i % golden_prompts.len()];
            p[..p.len().min(6 + 3 * i)].to_vec()
        })
        .collect();
    let parts = model.transformer.planner().split_parts();
    assert_eq!(llmd_engine::model::split_plan(&[1; SEQUENCES], parts), Some(2), "the test model runs 2 threads");
    assert_eq!(llmd_engine::model::split_plan(&[1; 7], parts), None, "fewer than 4 per part: one pass");
    let step_logits = |kv: &mut llmd_engine::model::kv::KvCache, t: u32| {
        model.transformer.forward(kv, &[t], Logits::Last).expect("step")
    };
    // Alone: each prompt, then greedy steps.
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for p in &prompts {
        let mut kv = model.transformer.new_kv();
        let mut l = model.transformer.forward(&mut kv, p, Logits::Last).expect("prefill");
        let mut steps = Vec::new();
        for _ in 0..DECODE_STEPS {
            l = step_logits(&mut kv, llmd_engine::sampling::argmax(&l));
            steps.push(l.clone());
        }
        alone.push(steps);
    }
    // Together: every step one batch of all the sequences (split in two runs of 4 and 5).
    let mut kvs: Vec<_> = prompts.iter().map(|_| model.transformer.new_kv()).collect();
    let mut last: Vec<Vec<f32>> = kvs
        .iter_mut()
        .zip(&prompts)
        .map(|(kv, p)| model.transformer.forward(kv, p, Logits::Last).expect("prefill"))
        .collect();
    for step in 0..DECODE_STEPS {
        let next: Vec<[u32; 1]> = last.iter().map(|l| [llmd_engine::sampling::argmax(l)]).collect();
        let mut batch: Vec<(&mut llmd_engine::model::kv::KvCache, &[u32])> =
            kvs.iter_mut().zip(&next).map(|(kv, t)| (kv, &t[..])).collect();
        last = model.transformer.run(&mut batch, llmd_engine::model::Run::LAST).expect("batch");
        for (i, l) in last.iter().enumerate() {
            assert!(l == &alone[i][step], "sequence {i}, step {step}: split batch logits differ from alone");
        }
    }
}

/// A chunk long enough that its FFN runs in token blocks (`ffn_token_block`: the default
/// model's 1,536-wide FFN splits past 426 tokens) gives the same logits, bit for bit, as the
/// same tokens in two chunks that each run whole.
#[test]
fn a_chunk_whose_ffn_runs_in_token_blocks_equals_the_same_tokens_in_smaller_chunks() {
    let model = default_model();
    let n = 480;
    assert!(llmd_engine::backend::blocks::ffn_token_block(1536, n) < n, "the chunk must split");
    let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + (i * 7919) % 20000).collect();
    let mut kv = model.transformer.new_kv();
    let whole = model.transformer.forward(&mut kv, &tokens, Logits::Last).expect("one chunk");
    let mut kv = model.transformer.new_kv();
    model.transformer.forward(&mut kv, &tokens[..n / 2], Logits::Last).expect("first half");
    let halves = model.transformer.forward(&mut kv, &tokens[n / 2..], Logits::Last).expect("second half");
    assert_eq!(format!("{whole:?}"), format!("{halves:?}"));
}
