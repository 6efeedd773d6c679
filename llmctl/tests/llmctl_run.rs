//! `llmctl run --local` as a user runs it: the real binary, the real default model.

mod common;

use common::{llmctl, model};
use std::process::Output;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Greedy text of the golden prompt "capital" for its first 8 tokens, as llama.cpp decodes them
/// (tests/golden/smollm2.json: ids 7042 30 198 198 504 1797 1918 553).
const CAPITAL_8: &str = " Paris.\n\nThe United States has";

#[test]
fn run_local_prints_only_the_generated_text_and_rates_on_stderr() {
    let m = model();
    let o = llmctl(&[
        "run",
        "--local",
        "--model",
        m.to_str().expect("utf-8 path"),
        "--max-tokens",
        "8",
        "The capital of France is",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), CAPITAL_8);
    let e = stderr(&o);
    assert!(e.contains("prompt 5 tokens") && e.contains("generation 8 tokens") && e.contains("tok/s"), "{e}");
}

#[test]
fn chat_mode_streams_a_reply_and_stops_at_end_of_turn() {
    let m = model();
    let o = llmctl(&[
        "run",
        "--local",
        "--model",
        m.to_str().expect("utf-8 path"),
        "--chat",
        "--max-tokens",
        "64",
        "Say hello.",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).expect("utf-8");
    assert!(!text.trim().is_empty());
    assert!(!text.contains("<|im_end|>") && !text.contains("<|im_start|>"), "control tokens leaked: {text:?}");
}

#[test]
fn sampling_with_a_seed_is_reproducible() {
    let m = model();
    let args = [
        "run",
        "--local",
        "--model",
        m.to_str().expect("utf-8 path"),
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "42",
        "Once upon a time",
    ];
    let a = llmctl(&args);
    let b = llmctl(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn bad_input_exits_non_zero_with_a_one_line_reason() {
    let m = model();
    let m = m.to_str().expect("utf-8 path");
    let garbage = std::env::temp_dir().join(format!("llmd-garbage-{}.gguf", std::process::id()));
    std::fs::write(&garbage, b"GGUF\x03\x00\x00\x00 not really a model").expect("write");
    // A socket file nothing listens on (a daemon that died): connecting is refused.
    let stale = std::env::temp_dir().join(format!("llmd-stale-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&stale);
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["run", "--local", "--model", "/nonexistent/model.gguf", "hi"], "cannot open"),
        (vec!["run", "--local", "--model", garbage.to_str().expect("path"), "hi"], "tensor count"),
        (vec!["run", "--local", "--model", m, "--temperature", "-1", "hi"], "temperature"),
        (vec!["run", "--local", "--model", m, "--top-p", "0", "hi"], "top_p"),
        (vec!["run", "--local", "--model", m, ""], "empty"),
        (vec!["--socket", "/nonexistent/llmd.sock", "run", "--model", m, "hi"], "no socket at /nonexistent/llmd.sock"),
        (vec!["--socket", stale.to_str().expect("path"), "status"], "Connection refused"),
    ];
    for (args, needle) in cases {
        let o = llmctl(&args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(o.stdout.is_empty(), "{args:?} wrote to stdout");
        assert!(e.contains(needle), "{args:?}: {e:?} does not mention {needle:?}");
        assert_eq!(e.trim_end().lines().count(), 1, "{args:?}: reason is not one line: {e:?}");
        assert!(!e.contains("Errno(") && !e.contains("ErrorCode("), "{args:?}: a raw code, not words: {e:?}");
    }
    let o = llmctl(&["run", "--local", "--model", m, "--max-tokens", "0", "hi"]);
    assert!(!o.status.success(), "max-tokens 0 accepted");
    let _ = std::fs::remove_file(garbage);
    let _ = std::fs::remove_file(stale);
}

#[test]
fn bench_local_prints_the_documented_json_and_refuses_bad_arguments() {
    let m = model();
    let o = llmctl(&[
        "bench",
        "--local",
        "--model",
        m.to_str().expect("utf-8 path"),
        "--threads",
        "2",
        "--reps",
        "1",
        "--prefill",
        "8,16",
        "--decode-prompt",
        "8",
        "--decode-tokens",
        "4",
        "--batch",
        "3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object on stdout");
    for key in [
        "prefill_8_tok_s",
        "prefill_16_tok_s",
        "decode_tok_s",
        "batch_decode_tok_s",
        "batch_gain",
        "peak_rss_mb",
        "read_bandwidth_gb_s",
    ] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {v}");
    }
    assert!(v.get("llamacpp").is_none(), "no peer unless --compare-llamacpp");
    let bad = llmctl(&["bench", "--local", "--model", m.to_str().expect("utf-8 path"), "--prefill", "0"]);
    assert!(!bad.status.success() && stderr(&bad).contains("at least 1"), "{}", stderr(&bad));
    let missing = llmctl(&["bench", "--local", "--model", "/nonexistent.gguf"]);
    assert!(!missing.status.success() && stderr(&missing).contains("/nonexistent.gguf"), "{}", stderr(&missing));
    let batch_load = llmctl(&["bench", "--load", "--batch", "3"]);
    assert!(!batch_load.status.success() && stderr(&batch_load).contains("--local"), "{}", stderr(&batch_load));
    let neither = llmctl(&["bench", "--model", m.to_str().expect("utf-8 path")]);
    assert!(!neither.status.success() && stderr(&neither).contains("--local"), "{}", stderr(&neither));
}

#[test]
fn a_reader_that_goes_away_ends_llmctl_quietly_as_sigpipe_would() {
    // `llmctl run ... | head -c 1` and `llmctl status | head -1`: the read end closes early.
    let m = model();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_llmctl"))
        .args(["run", "--local", "--model", m.to_str().expect("utf-8 path"), "--max-tokens", "64"])
        .arg("Count from one to a hundred.")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("llmctl starts");
    drop(child.stdout.take()); // the reader is gone before the first token
    let o = child.wait_with_output().expect("llmctl ends");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!e.contains("panicked"), "llmctl panicked on a broken pipe: {e}");
    assert_eq!(o.status.code(), Some(llmctl::output::BROKEN_PIPE_STATUS), "status {:?}: {e}", o.status);
}

/// `llmctl npu-accuracy`: the table's JSON on a short text (the default model, built-in
/// calibration), W8A8 clearly worse than shadow execution; bad arguments refused in one line.
#[test]
fn npu_accuracy_compares_schemes_and_refuses_bad_arguments() {
    let m = model();
    let m = m.to_str().expect("utf-8 path");
    let text = std::env::temp_dir().join(format!("llmd-acc-{}.txt", std::process::id()));
    let para = "The history of computing is a story of machines that grew smaller while their reach grew larger. \
                Early computers filled whole rooms and were tended by teams who fed them punched cards. ";
    std::fs::write(&text, para.repeat(12)).expect("write");
    let t = text.to_str().expect("path");
    let o = llmctl(&[
        "npu-accuracy",
        "--model",
        m,
        "--text",
        t,
        "--tokens",
        "256",
        "--ctx",
        "128",
        "--chunk",
        "64",
        "--schemes",
        "w8a8,shadow-0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let rows = v["schemes"].as_array().expect("schemes");
    let ppl =
        |name: &str| rows.iter().find(|r| r["scheme"] == name).and_then(|r| r["perplexity"].as_f64()).expect(name);
    assert_eq!(rows.len(), 3, "float first, then the two asked for");
    assert!(ppl("float") > 1.0 && ppl("shadow-0") < ppl("w8a8"), "{v}");
    assert!(rows.iter().all(|r| (0.0..=1.0).contains(&r["agreement"].as_f64().unwrap_or(-1.0))));
    for (args, needle) in [
        (vec!["npu-accuracy", "--model", m, "--text", t, "--schemes", "int4"], "unknown scheme"),
        (vec!["npu-accuracy", "--model", m, "--text", t, "--schemes", "shadow-150"], "outside 0..=100"),
        (
            vec!["npu-accuracy", "--model", m, "--text", t, "--calibration", t, "--tokens", "128", "--ctx", "64"],
            "overlap",
        ),
        (vec!["npu-model", "--prune", "2"], "between 0 and 1"),
    ] {
        let o = llmctl(&args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(e.contains(needle), "{args:?}: {e:?} does not mention {needle:?}");
    }
    let _ = std::fs::remove_file(text);
}

/// `llmctl npu-model --json`: labelled modelled, out of order never slower than in order.
#[test]
fn npu_model_is_labelled_modelled_and_out_of_order_never_loses() {
    let o = llmctl(&["npu-model", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["labelled"], "modelled");
    for r in v["scheduler"].as_array().expect("scheduler rows") {
        assert!(r["ooe_makespan_s"].as_f64() <= r["in_order_makespan_s"].as_f64(), "{r}");
    }
}

/// `llmctl plan`: labelled modelled; on the default model's file and on a known shape; the
/// paper report within ±25% on most rows; an OEM's profile file; bad input named.
#[test]
fn plan_models_a_soc_and_names_bad_input() {
    let m = common::model();
    let m = m.to_str().expect("path");
    let o = llmctl(&["plan", "--model", m, "--prompt", "100", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["labelled"], "modelled");
    assert_eq!(v["model"]["layers"], 30);
    assert!(v["prefill"]["tok_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
    let o = llmctl(&["plan", "--paper", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let rows = v["rows"].as_array().expect("rows");
    // Fitted and held-out figures apart; every held-out one within ±25% or explained.
    let held_out: Vec<_> = rows.iter().filter(|r| r["fitted"] == false).collect();
    assert!(held_out.len() >= 6 && rows.iter().any(|r| r["fitted"] == true), "{v}");
    for r in &held_out {
        let ratio = r["ratio"].as_f64().unwrap_or(0.0);
        let explained = r["explained"].as_str().unwrap_or("");
        assert_eq!(r["within_tolerance"], (0.75..=1.25).contains(&ratio), "{r}");
        assert!((0.75..=1.25).contains(&ratio) || explained.len() > 40, "held out, off and unexplained: {r}");
    }
    let o = llmctl(&["plan", "--paper"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("\nFitted:") && text.contains("\nHeld out:"), "{text}");
    // The plan's decision and how each assumed figure moves it.
    let o = llmctl(&["plan", "--model", "qwen1_5_1_8b", "--prompt", "512", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert!(["int8_chunked", "fp16_partitioned"].contains(&v["plan"]["prefill"].as_str().unwrap_or("")), "{v}");
    let moves = v["sensitivity"].as_array().expect("sensitivity");
    assert!(moves.iter().any(|m| m["figure"] == "npu.launch_us" && m["label"] == "assumption"), "{v}");
    assert!(moves.iter().any(|m| m["flips_at"].is_number()), "some figure flips the decision: {v}");
    let dir = std::env::temp_dir().join(format!("llmctl-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let socs = dir.join("socs.toml");
    std::fs::write(&socs, "[fast_gpu]\nname = \"A faster GPU\"\nbase = \"snapdragon_8gen3\"\ngpu_speed = 4.0\n")
        .expect("file");
    let o = llmctl(&[
        "plan",
        "--soc-file",
        socs.to_str().expect("path"),
        "--soc",
        "fast_gpu",
        "--model",
        "llama3_8b",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["soc"]["gpu_speed"], 4.0);
    std::fs::write(&socs, "[broken]\nname = \"x\"\nbase = \"snapdragon_8gen3\"\ngpu_speed = -1.0\n").expect("file");
    for (args, needle) in [
        (vec!["plan", "--soc", "nope"], "no SoC profile"),
        (vec!["plan", "--model", "no_such_model"], "neither a file nor a known shape"),
        (vec!["plan", "--prompt", "0"], "--prompt"),
        (vec!["plan", "--soc-file", socs.to_str().expect("path"), "--soc", "broken"], "positive"),
        (vec!["sync-bench", "--rounds", "0"], "--rounds"),
    ] {
        let o = llmctl(&args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(e.contains(needle), "{args:?}: {e:?} does not mention {needle:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The lanes of a Gantt chart `llmctl` wrote, and its bars' (lane, start ms) in file order.
fn gantt(svg: &str) -> (Vec<String>, Vec<(String, f64)>) {
    let attr = |at: &str, key: &str| -> Option<String> {
        let i = at.find(&format!("{key}=\""))? + key.len() + 2;
        Some(at[i..].split('"').next()?.to_owned())
    };
    let lanes = svg.split("<g class=\"lane\"").skip(1).filter_map(|g| attr(g, "data-lane")).collect();
    let bars = svg
        .split("<rect class=\"bar\"")
        .skip(1)
        .filter_map(|b| Some((attr(b, "data-lane")?, attr(b, "data-start-ms")?.parse().ok()?)))
        .collect();
    (lanes, bars)
}

/// `llmctl plan --svg`: the modelled schedule as a chart, a lane per processor and bars in
/// time order — HeteroLLM's float prefill on the 8 Gen 3 profile (NPU and GPU), llm.npu's
/// INT8 chunks on a profile whose INT8 graphs and CPU side are fast enough for the plan to
/// choose them (NPU and CPU, then decode on the GPU).
#[test]
fn plan_draws_the_modelled_schedule_a_lane_per_processor() {
    let dir = std::env::temp_dir().join(format!("llmctl-plan-svg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let builtin = std::fs::read_to_string(common::root().join("engine/data/socs.toml")).expect("profiles");
    let gen3 = &builtin
        [builtin.find("[snapdragon_8gen3]").expect("8 Gen 3")..builtin.find("[snapdragon_8gen2]").expect("8 Gen 2")];
    let fast_int8: String = gen3
        .replace("snapdragon_8gen3", "fast_int8")
        .lines()
        .map(|l| match l.split_whitespace().next() {
            // llm.npu's CPU side (attention, norms) bounds INT8 prefill on the 8 Gen 3.
            Some("attention_gflops") => "attention_gflops = 500.0".to_owned(),
            Some("elementwise_gelems_per_s") => "elementwise_gelems_per_s = 60.0".to_owned(),
            Some("cpu_npu_handoff_us") => "cpu_npu_handoff_us = 20.0".to_owned(),
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let socs = dir.join("socs.toml");
    std::fs::write(&socs, fast_int8).expect("file");
    for (soc, recommended, lanes_used) in
        [("snapdragon_8gen3", "float", ["npu", "gpu"]), ("fast_int8", "INT8", ["npu", "cpu"])]
    {
        let file = dir.join(format!("{soc}.svg"));
        let args = ["plan", "--soc-file", socs.to_str().expect("path"), "--soc", soc, "--model", "qwen1_5_1_8b"];
        let o = llmctl(&[&args[..], &["--prompt", "520", "--svg", file.to_str().expect("path")]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains(&format!("recommended: {recommended}")), "{soc}: {text}");
        let svg = std::fs::read_to_string(&file).expect("written");
        assert!(svg.contains("MODELLED"), "labelled modelled");
        let (lanes, bars) = gantt(&svg);
        assert_eq!(lanes, ["npu", "gpu", "cpu"], "{soc}: one lane per processor");
        assert!(bars.windows(2).all(|w| w[0].1 <= w[1].1), "{soc}: bars in time order");
        for l in lanes_used {
            assert!(bars.iter().any(|(lane, _)| lane == l), "{soc}: nothing on the {l}");
        }
        assert!(bars.iter().any(|(lane, _)| lane == "gpu"), "{soc}: decode on the GPU");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `llmctl sync-bench --json`: labelled measured, the three waiters at the wait asked for, each
/// with its figures (no timing is asserted: the machine may be busy with other tests).
#[test]
fn sync_bench_measures_the_three_waiters() {
    let o = llmctl(&["sync-bench", "--waits-us", "300", "--rounds", "60", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["labelled"], "measured");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 3);
    for m in ["predicted sleep + poll", "condition variable", "sleep only"] {
        let r = rows.iter().find(|r| r["method"] == m).unwrap_or_else(|| panic!("{m}: {v}"));
        assert_eq!(r["wait_us"], 300);
        assert!(r["p50_us"].as_f64().is_some_and(|x| x >= 0.0) && r["cpu_us_per_wait"].as_f64().is_some(), "{r}");
    }
}

/// What a library prints never reaches llmctl's standard output: Qualcomm's HTP library prints
/// `# LIBNATIVE: …` and `<E> unexpected GraphHtpSettings option 66` on descriptor 1 when its
/// backend starts and its graphs finalize; llmctl's own lines are all that standard output holds,
/// and the library's text is on standard error.
#[test]
fn what_a_library_prints_goes_to_stderr_never_to_the_reply_stream() {
    let htp = common::htp_library();
    let cache = tempfile_dir("llmctl-npu-info");
    let o = llmctl(&[
        "npu-info",
        "--qnn-lib",
        htp.to_str().expect("utf-8 path"),
        "--npu-cache",
        cache.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    const OURS: [&str; 7] = ["library ", "provider ", "build id ", "chip ", "context cache ", "self-check ", "      "];
    for line in out.lines() {
        assert!(
            OURS.iter().any(|p| line.starts_with(p)),
            "a line on stdout that llmctl did not write: {line:?}\n{out}"
        );
    }
    assert!(out.contains("self-check"), "{out}");
    // The library did print (else this test shows nothing): its text went to standard error.
    let e = stderr(&o);
    assert!(e.contains("LIBNATIVE") || e.contains("GraphHtpSettings"), "the library printed nothing: {e}");
    let _ = std::fs::remove_dir_all(&cache);
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// `run --local --backend npu` prefills several chunks per unit out of order (llm.npu's
/// out-of-order execution on the product path: the emulated NPU's linear groups on this thread,
/// attention on a CPU thread, in the scheduler's order) and replies exactly as one chunk at a
/// time does.
#[test]
fn npu_prefill_out_of_order_replies_as_in_order() {
    let m = model();
    let emu = llmd_qnn_emu::built_library().unwrap_or_else(|e| panic!("{e}"));
    let prompt = "The history of computing is long and varied, and it began with counting. ".repeat(6);
    let run = |chunks: &str| {
        let o = llmctl(&[
            "run",
            "--local",
            "--backend",
            "npu",
            "--qnn-lib",
            emu.to_str().expect("utf-8 path"),
            "--npu-cache",
            "none",
            "--npu-chunk",
            "16",
            "--npu-ooe-chunks",
            chunks,
            "--model",
            m.to_str().expect("utf-8 path"),
            "--max-tokens",
            "8",
            &prompt,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let (in_order, out_of_order) = (run("1"), run("4"));
    assert!(!in_order.is_empty());
    assert_eq!(out_of_order, in_order, "the same reply in and out of order");
}
