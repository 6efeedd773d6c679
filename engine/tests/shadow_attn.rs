//! shadowAttn on the real model: keeping every key is dense attention bit for bit, and at the
//! paper's ratio the INT8 pilot picks the float top-k's keys (Table 4 in kind); its profile.

mod common;

use llmd_engine::backend::blocks::Logits;
use llmd_engine::backend::sparse::{Probe, SparseAttn};
use llmd_engine::shadowattn::Profile;
use llmd_engine::Model;
use std::sync::Arc;

fn load(path: &std::path::Path) -> Model {
    Model::load(path, &Default::default()).expect("model loads")
}

/// Logits of every row of `tokens`, prefilled in chunks of `chunk`.
fn logits(m: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut kv = m.transformer.new_kv();
    let mut all = Vec::new();
    for c in tokens.chunks(chunk) {
        all.extend(m.transformer.forward(&mut kv, c, Logits::All).expect("forward"));
    }
    all
}

fn prompt(m: &Model, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(common::repo_root().join("texts/jargon.txt"))
        .unwrap_or_else(|_| "The quick brown fox jumps over the lazy dog. ".repeat(200));
    let mut ids = m.tokenizer.encode(&text, false, false).expect("tokenizes");
    while ids.len() < n {
        ids.extend_from_within(..);
    }
    ids.truncate(n);
    ids
}

#[test]
fn keeping_every_key_is_dense_attention_bit_for_bit() {
    let m = load(&common::default_model_path());
    let toks = prompt(&m, 300);
    let dense = logits(&m, &toks, 128);
    let c = m.config().clone();
    m.transformer
        .set_sparse_attention(Some(Arc::new(SparseAttn::uniform(c.n_layers, c.n_heads, 1.0, None))))
        .expect("settings fit");
    let sparse = logits(&m, &toks, 128);
    assert_eq!(dense.len(), sparse.len());
    let differ = dense.iter().zip(&sparse).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differ, 0, "{differ} of {} logits differ", dense.len());
}

/// The least mean recall at ratio 0.2 accepted here. Measured on this text with 1,024-token
/// windows: 0.9912 at exact scales, 0.9892 with 9 buckets (`llmctl attention-recall`); the
/// paper's Table 4 reports 99.03–99.68% on its four models at 20%.
const RECALL_FLOOR: f64 = 0.985;

#[test]
fn the_pilot_recalls_the_float_top_keys_through_the_buckets() {
    let m = load(&common::default_model_path());
    let cal = m.tokenizer.encode(llmd_engine::prefill::CALIBRATION_TEXT, false, false).expect("tokenizes");
    let (profile, read) = Profile::load_or_build(None, &m.transformer, &cal, false, &|_, _| true).expect("profiles");
    assert!(!read && !profile.has_importance());
    let c = m.config().clone();
    assert_eq!(profile.centres.len(), c.n_layers);
    let mut sa = profile.settings(0.2, true, 9);
    sa.probe = Some(Probe::new(c.n_layers, true));
    let sa = Arc::new(sa);
    m.transformer.set_sparse_attention(Some(sa.clone())).expect("settings fit");
    let toks = prompt(&m, 1024);
    logits(&m, &toks, 128);
    let d = sa.probe.as_ref().expect("a probe").data();
    let (hit, all) = d.recall.iter().fold((0, 0), |a, r| (a.0 + r.0, a.1 + r.1));
    let recall = hit as f64 / all as f64;
    eprintln!("recall {recall:.4} over {all} kept keys");
    assert!(recall >= RECALL_FLOOR, "recall {recall}");
    // Every layer measured, none far below the rest.
    assert!(d.recall.iter().all(|&(h, n)| n > 0 && h as f64 / n as f64 > RECALL_FLOOR - 0.02));
}

/// The profile's importance on the tiny fixture: one loss per head and per layer, ratios whose
/// mean is the global one, written to a cache and read back; a damaged file is made again.
#[test]
fn a_profile_with_importance_is_cached_and_a_damaged_one_rebuilt() {
    let path = common::repo_root().join("tests/fixtures/tiny-qwen2.gguf");
    let m = load(&path);
    let c = m.config().clone();
    let toks: Vec<u32> = (0..40u32).map(|i| (i * 7 + 3) % c.vocab_size as u32).collect();
    let dir = std::env::temp_dir().join(format!("llmd-shadowattn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (p, read) = Profile::load_or_build(Some(&dir), &m.transformer, &toks, true, &|_, _| true).expect("profiles");
    assert!(!read);
    assert_eq!(p.head_loss.len(), c.n_layers * c.n_heads);
    assert_eq!(p.layer_loss.len(), c.n_layers);
    let r = p.ratios(0.3);
    assert!((r.iter().sum::<f32>() / r.len() as f32 - 0.3).abs() < 1e-5, "{r:?}");
    assert!(m.transformer.sparse_attention().is_none(), "the model is left dense");
    let (q, read) = Profile::load_or_build(Some(&dir), &m.transformer, &toks, true, &|_, _| true).expect("reads");
    assert!(read);
    // JSON keeps f64s to within an ulp.
    let same = |a: &Profile, b: &Profile| {
        a.key == b.key
            && a.centres == b.centres
            && a.ratios(0.3).iter().zip(b.ratios(0.3)).all(|(x, y)| (x - y).abs() < 1e-6)
    };
    assert!(same(&p, &q));
    let file = std::fs::read_dir(&dir).expect("dir").next().expect("a file").expect("entry").path();
    std::fs::write(&file, b"{ damaged").expect("writes");
    let (q, read) = Profile::load_or_build(Some(&dir), &m.transformer, &toks, true, &|_, _| true).expect("rebuilds");
    assert!(!read);
    assert!(same(&p, &q));
    let _ = std::fs::remove_dir_all(&dir);
}
