//! `llmctl convert`, `llmctl perplexity` and `llmctl bench --local --cold` as a user runs them:
//! the real binary, the real default model (and the text from scripts/fetch-text.sh).

mod common;

use common::{llmctl, model, root};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn text() -> PathBuf {
    let p = root().join("texts/jargon.txt");
    assert!(p.is_file(), "the evaluation text is missing at {}: run scripts/fetch-text.sh", p.display());
    p
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
fn temp(tag: &str) -> TempDir {
    let p = std::env::temp_dir().join(format!("llmctl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("temp dir");
    TempDir(p)
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

/// Convert with and without smoothing, run the file, and score it: fewer bits, higher
/// perplexity; the converted file serves `run --local` like a GGUF.
#[test]
fn convert_then_run_and_score() {
    let dir = temp("convert");
    let (m, t) = (model(), text());
    let out8 = dir.0.join("m8.llmd");
    let r = json(&llmctl(&["convert", "--bits", "8", "--json", s(&m), s(&out8)]));
    // The source's Q4_1 linear weights (5 bits per weight) are within an 8-bit budget: kept.
    assert_eq!(r["kept_tensors"], 210, "{r}");
    assert_eq!(r["linear_weights"], 0, "{r}");
    assert_eq!(r["tensors"], 272);
    let out4 = dir.0.join("m4.llmd");
    let r = json(&llmctl(&[
        "convert",
        "--bits",
        "4",
        "--json",
        "--calibrate",
        s(&t),
        "--calibration-offset",
        "300000",
        "--calibration-tokens",
        "256",
        s(&m),
        s(&out4),
    ]));
    assert_eq!(r["average_bits"], 4.0);
    // `models --local` reads the llmd files: the kept file's Q4_1 matrices, and the 4-bit one's
    // EdgeFlow channels by bit-width, as convert counted them.
    let listed = |p: &Path| {
        let o = llmctl(&["models", "--local", s(p)]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let kept = listed(&out8);
    assert!(kept.lines().any(|l| l.starts_with("Q4_1") && l.contains(" 210 ")), "{kept}");
    let four = listed(&out4);
    assert!(four.lines().any(|l| l.starts_with("EdgeFlow") && l.contains(" 210 ")), "{four}");
    let counts: Vec<String> = r["channels_by_bits"]
        .as_array()
        .expect("channels_by_bits")
        .iter()
        .enumerate()
        .filter(|(_, n)| n.as_u64() != Some(0))
        .map(|(b, n)| format!("{b} bits: {n}"))
        .collect();
    assert!(four.contains(&format!("EdgeFlow channels: {} (mean 4.00 bits", counts.join(", "))), "{four}\n{r}");
    let run = llmctl(&["run", "--local", "--model", s(&out8), "--max-tokens", "4", "The capital of France is"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).contains("Paris"), "{}", String::from_utf8_lossy(&run.stdout));
    let ppl = |p: &Path| {
        json(&llmctl(&[
            "perplexity",
            "--model",
            s(p),
            "--text",
            s(&t),
            "--offset",
            "20000",
            "--tokens",
            "1024",
            "--json",
        ]))["perplexity"]
            .as_f64()
            .expect("a number")
    };
    let (p_src, p8, p4) = (ppl(&m), ppl(&out8), ppl(&out4));
    assert!(p_src.is_finite() && p_src > 1.0);
    assert!(p4 > p8, "4 bits ({p4}) must score worse than 8 ({p8})");
    // Kept weights run on the same kernels as the source's: the same perplexity.
    assert_eq!(p8, p_src, "kept weights {p8} vs source {p_src}");
}

#[test]
fn convert_refuses_bad_input_with_one_clear_line() {
    let dir = temp("refuse");
    let m = model();
    for (args, want) in [
        (vec!["convert", "--bits", "9", s(&m), "/tmp/x.llmd"], "bits"),
        (vec!["convert", "/nonexistent.gguf", "/tmp/x.llmd"], "nonexistent"),
        (vec!["convert", s(&m), s(&m)], "overwrite"),
    ] {
        let o = llmctl(&args);
        assert!(!o.status.success());
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(want), "{args:?}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{e}");
    }
    let garbage = dir.0.join("garbage.llmd");
    std::fs::write(&garbage, b"LLMDWTS\0 not really").expect("write");
    let o = llmctl(&["run", "--local", "--model", s(&garbage), "hi"]);
    assert!(!o.status.success());
}

/// The cold-start benchmark's JSON: cold_ttft_s, bytes read, the pipeline, and the same first
/// token from the converted file and the GGUF at 8 bits.
#[test]
fn bench_cold_prints_the_documented_json() {
    let dir = temp("cold");
    let m = model();
    let l = dir.0.join("m8.llmd");
    json(&llmctl(&["convert", "--bits", "8", "--json", s(&m), s(&l)]));
    let v = json(&llmctl(&[
        "bench",
        "--local",
        "--cold",
        "--model",
        s(&m),
        "--llmd",
        s(&l),
        "--reps",
        "1",
        "--threads",
        "2",
        "--json",
    ]));
    assert!(v["cold_ttft_s"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    let ef = &v["llmd_edgeflow"];
    assert!(ef["bytes_read"].as_f64().is_some(), "{v}");
    assert!(v["pipeline"]["regions"].as_array().is_some_and(|r| r.len() == 32), "embed + 30 layers + head: {v}");
    assert!(v["ratio_vs_llmd_gguf"].as_f64().is_some());
    assert!(v["pipeline"]["layer0_compute_start_s"].as_f64().is_some());
}

/// The daemon serves an llmd file like any model (found by `--model` or in a models directory).
#[test]
fn the_daemon_serves_a_converted_model() {
    let dir = temp("serve");
    let models = dir.0.join("models");
    std::fs::create_dir_all(&models).expect("models dir");
    let l = models.join("smol-8.llmd");
    json(&llmctl(&["convert", "--bits", "8", "--json", s(&model()), s(&l)]));
    let socket = dir.0.join("llmd.sock");
    let mut child = Command::new(common::llmd())
        .args(["--models-dir", s(&models), "--socket", s(&socket), "--kernel-binder", "off", "--threads", "2"])
        .env("LLMD_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("llmd starts");
    let t = std::time::Instant::now();
    while !socket.exists() && t.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let listed = llmctl(&["--socket", s(&socket), "models"]);
    let run =
        llmctl(&["--socket", s(&socket), "run", "--model", "smol-8", "--max-tokens", "4", "The capital of France is"]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(String::from_utf8_lossy(&listed.stdout).contains("smol-8"), "{}", String::from_utf8_lossy(&listed.stderr));
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).contains("Paris"));
}
