//! Shared by the engine's integration tests: where the real default model and the golden files are.
#![allow(dead_code)]

use llmd_engine::{LoadOptions, Model};
use std::path::PathBuf;
use std::sync::OnceLock;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The default model, fetched by `scripts/fetch-model.sh` (or `LLMD_MODEL`).
pub fn default_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMD_MODEL") {
        return PathBuf::from(p);
    }
    let p = repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "the default model is missing at {}: run scripts/fetch-model.sh first", p.display());
    p
}

pub fn default_model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        Model::load(&default_model_path(), &LoadOptions { threads: 2, ..Default::default() })
            .expect("the default model loads")
    })
}

pub fn golden() -> &'static serde_json::Value {
    static G: OnceLock<serde_json::Value> = OnceLock::new();
    G.get_or_init(|| golden_named("smollm2"))
}

/// `tests/golden/<name>.json` (tools/golden/make_golden.py).
pub fn golden_named(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(repo_root().join(format!("tests/golden/{name}.json")))
        .expect("golden file is committed");
    serde_json::from_str(&text).expect("golden file is JSON")
}

pub fn golden_logits() -> Vec<f32> {
    golden_logits_named("smollm2")
}

/// `tests/golden/<name>.logits.f32`, or `.logits.f16` (the larger vocabularies), as f32.
pub fn golden_logits_named(name: &str) -> Vec<f32> {
    let root = repo_root().join("tests/golden");
    if let Ok(b) = std::fs::read(root.join(format!("{name}.logits.f16"))) {
        return b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
    }
    let b = std::fs::read(root.join(format!("{name}.logits.f32"))).expect("golden logits are committed");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The larger test model (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M), fetched on request by
/// `scripts/fetch-model-1.5b.sh` (or `LLMD_LARGE_MODEL`).
pub fn large_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMD_LARGE_MODEL") {
        return PathBuf::from(p);
    }
    let p = repo_root().join("models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf");
    assert!(p.is_file(), "the 1.5B model is missing at {}: run scripts/fetch-model-1.5b.sh first", p.display());
    p
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// Every packed matrix of `m` lives in its model's weight arena (on the heap instead when
/// `LLMD_HUGE_PAGES=0`), so the outputs a test checks come from arena-backed weights.
pub fn assert_weights_in_arena(m: &Model) {
    let want = std::env::var("LLMD_HUGE_PAGES").map_or(true, |v| v != "0");
    let w = &m.transformer.weights;
    let mut packed = 0;
    for mat in w
        .layers
        .iter()
        .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
        .chain([&w.token_embd, &w.output])
    {
        if let Some(p) = &mat.packed {
            assert_eq!(p.in_arena(), want, "{}: in the arena", mat.name);
            packed += 1;
        }
        if let Some(p) = &mat.kpacked {
            assert_eq!(p.in_arena(), want, "{}: in the arena", mat.name);
            packed += 1;
        }
    }
    assert!(packed > 7 * w.layers.len(), "only {packed} packed matrices");
}

/// A scratch directory under the system's temporary one, named by `tag` and this process,
/// emptied when made and removed when dropped.
pub struct TempDir(pub PathBuf);
impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("llmd-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Qualcomm's x86-64 HTP library: `LLMD_QNN_LIB`, else the cache `scripts/fetch-qnn.sh` fills
/// (run here if it is not filled yet).
pub fn htp_library() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMD_QNN_LIB") {
        return p.into();
    }
    let out = std::process::Command::new(repo_root().join("scripts/fetch-qnn.sh"))
        .output()
        .expect("scripts/fetch-qnn.sh runs");
    assert!(out.status.success(), "scripts/fetch-qnn.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("libQnnHtp.so")
}

/// llmd's emulator provider, built beside the test (a dependency's cdylib lands in `deps/`).
pub fn emulator_library() -> PathBuf {
    llmd_qnn_emu::built_library().unwrap_or_else(|e| panic!("{e}"))
}

/// The argmax of `logits` and its margin over the runner-up.
#[allow(dead_code)]
pub fn argmax_and_margin(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut second) = ((0usize, f32::NEG_INFINITY), f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0 as u32, best.1 - second)
}
