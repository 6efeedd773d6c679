//! The NPU context cache (`backend::npu::cache`): a second start loads the finalized graphs
//! instead of building them, with the same results; a changed model, quantization, chunk size
//! or library is never served from a stale file, and a damaged file is rebuilt. Timed on the
//! default model with Qualcomm's x86-64 HTP library (finalize vs load) and checked on the
//! emulator provider.

mod common;

use llmd_engine::backend::npu::cache::{graphs, key_for, load_or_build, path_for, CacheOutcome};
use llmd_engine::backend::npu::graph::{run_linear_group, LinearGroup};
use llmd_engine::prefill::{calibrate, quantized_groups, WeightQuant};
use std::path::PathBuf;

const SM8650: u32 = 57;
const CHUNK: usize = 32;

/// The default model's groups, calibrated on a short text.
fn model_groups(out_bits: u8) -> Vec<LinearGroup> {
    let m = common::default_model();
    let tokens = m.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice, and then rests in the shade of an old oak tree by the river.", false, false).expect("text");
    let cal = calibrate(&m.transformer, &tokens).expect("calibrates");
    quantized_groups(&m.transformer, &cal, WeightQuant::PerTensor, out_bits, &[])
        .expect("quantizes")
        .into_iter()
        .flatten()
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("llmd-npu-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// One chunk of every group on the context's graphs, as output codes.
fn outputs(
    context: &llmd_engine::backend::npu::NpuContext,
    groups: &[LinearGroup],
    ids: &[(u32, Vec<u32>)],
) -> Vec<Vec<u16>> {
    let mut gs = graphs(context, groups, CHUNK, ids).expect("graphs found");
    let mut all = Vec::new();
    for (g, graph) in groups.iter().zip(gs.iter_mut()).step_by(17) {
        let x: Vec<u8> = (0..CHUNK * g.k()).map(|i| (i * 31 % 256) as u8).collect();
        all.extend(run_linear_group(graph, g, CHUNK, &x).expect("runs"));
    }
    all
}

#[test]
fn a_second_start_loads_the_graphs_and_anything_changed_or_damaged_is_rebuilt() {
    let groups = model_groups(16);
    let dir = scratch("emu");
    let device =
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("the QNN library opens");
    let key = key_for(&device, &groups, CHUNK).expect("key");

    let (ctx, ids, first) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("built");
    assert!(matches!(first, CacheOutcome::Built { .. }), "{first:?}");
    let built = outputs(&ctx, &groups, &ids);
    drop(ctx);
    let (ctx, ids, second) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("loaded");
    assert_eq!(second, CacheOutcome::Loaded);
    assert_eq!(outputs(&ctx, &groups, &ids), built, "the loaded graphs compute what the built ones did");
    drop(ctx);

    // Another chunk size, another quantization, another chip: other keys, never this file.
    let key_chunk = key_for(&device, &groups, 64).expect("key");
    let mut changed = groups.clone();
    changed[5].projections[0].weights.q[0] ^= 1;
    let key_weights = key_for(&device, &changed, CHUNK).expect("key");
    let other_chip = llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), 43).expect("opens");
    let key_soc = key_for(&other_chip, &groups, CHUNK).expect("key");
    for k in [&key_chunk, &key_weights, &key_soc] {
        assert_ne!(k, &key);
        assert_ne!(path_for(&dir, k).expect("path"), path_for(&dir, &key).expect("path"));
    }
    let (_, _, o) = load_or_build(&device, &dir, &key_weights, &changed, CHUNK).expect("built");
    assert!(matches!(o, CacheOutcome::Built { .. }), "a changed weight was served from the cache: {o:?}");

    // A file under this key's name but holding another key (as if the library had been
    // upgraded and its build id changed while the name's CRC collided): refused, rebuilt.
    let path = path_for(&dir, &key).expect("path");
    let mut other_lib = key.clone();
    other_lib.build_id.push_str("-upgraded");
    std::fs::copy(path_for(&dir, &key_weights).expect("path"), &path).expect("copied");
    let (_, _, o) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("rebuilt");
    match o {
        CacheOutcome::Built { reason } => assert!(reason.contains("another model"), "{reason}"),
        o => panic!("a file of another key was served: {o:?}"),
    }
    // The library upgraded: the sound file of the old library's key (rebuilt just above) put
    // under the new key's name is refused, not served.
    std::fs::copy(&path, path_for(&dir, &other_lib).expect("path")).expect("copied");
    let (_, _, o) = load_or_build(&device, &dir, &other_lib, &groups, CHUNK).expect("built");
    match o {
        CacheOutcome::Built { reason } => assert!(reason.contains("another model"), "{reason}"),
        o => panic!("another library's binary was served: {o:?}"),
    }

    // Truncated: rebuilt and replaced, then loaded again.
    let len = std::fs::metadata(&path).expect("file").len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
    f.set_len(len / 2).expect("truncated");
    let (ctx, ids, o) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("rebuilt");
    match &o {
        CacheOutcome::Built { reason } => assert!(reason.contains("truncated or corrupt"), "{reason}"),
        o => panic!("a truncated file was served: {o:?}"),
    }
    assert_eq!(outputs(&ctx, &groups, &ids), built);
    drop(ctx);
    let (_, _, o) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("loaded");
    assert_eq!(o, CacheOutcome::Loaded, "the rebuilt file is served next time");
    assert!(
        std::fs::read_dir(&dir).expect("dir").all(|e| !e
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .contains(".tmp")),
        "no temporary file left"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qualcomms_library_loads_the_cached_graphs_faster_than_it_finalizes_them() {
    let groups = model_groups(16);
    let dir = scratch("htp");
    let device =
        llmd_engine::backend::npu::QnnDevice::open(&common::htp_library(), SM8650).expect("the QNN library opens");
    let key = key_for(&device, &groups, CHUNK).expect("key");
    let t = std::time::Instant::now();
    let (ctx, ids, first) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("built");
    let build_s = t.elapsed().as_secs_f64();
    assert!(matches!(first, CacheOutcome::Built { .. }));
    let size = std::fs::metadata(path_for(&dir, &key).expect("path")).expect("file").len();
    let built = outputs(&ctx, &groups, &ids);
    drop(ctx);
    let t = std::time::Instant::now();
    let (ctx, ids, second) = load_or_build(&device, &dir, &key, &groups, CHUNK).expect("loaded");
    let load_s = t.elapsed().as_secs_f64();
    assert_eq!(second, CacheOutcome::Loaded);
    let t = std::time::Instant::now();
    let found = graphs(&ctx, &groups, CHUNK, &ids).expect("graphs");
    let retrieve_s = t.elapsed().as_secs_f64();
    drop(found);
    assert_eq!(outputs(&ctx, &groups, &ids), built, "the loaded graphs compute what the built ones did");
    eprintln!(
        "Qualcomm's HTP library, {} graphs of SmolLM2-135M at chunk {CHUNK}: build and finalize {build_s:.2} s, load from the cache {load_s:.2} s (+ {retrieve_s:.3} s to retrieve the graphs); cache file {:.1} MB",
        groups.len(),
        size as f64 / 1e6
    );
    let _ = std::fs::remove_dir_all(&dir);
}
