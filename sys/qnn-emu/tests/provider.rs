//! The emulator provider through its C ABI, loaded as any QNN library is (`qnn_sys::Library`),
//! driven through `qnn-sys`'s safe interface as the engine drives Qualcomm's library.

use qnn_sys::api::{Backend, Quantization, TensorSpec};
use qnn_sys::data_type as dt;
use std::path::PathBuf;

const SM8650: u32 = 57;

/// The cdylib cargo built for this test: beside the test binary's directory (as the package's
/// own library) or in it (as a dependency).
fn emulator_library() -> PathBuf {
    llmd_qnn_emu::built_library().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_emulator_is_one_htp_provider_of_core_api_2_27() {
    let lib = std::sync::Arc::new(qnn_sys::Library::open(&emulator_library()).expect("loads"));
    let p = lib.providers();
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].backend_id, qnn_sys::BACKEND_ID_HTP);
    assert_eq!(p[0].name, "LLMD_HTP_EMULATOR");
    assert_eq!(p[0].api.core, qnn_sys::MIN_CORE_API);
    let backend = Backend::htp(lib.clone(), SM8650).expect("backend");
    assert!(backend.build_id().expect("build id").starts_with("llmd-qnn-emu "));
}

/// A W8A8 FullyConnected: `m × k` uint8 input, `n × k` int8 weights, int32 bias.
fn fc(backend: &Backend, m: u32, k: u32, n: u32) -> (qnn_sys::api::Context, Vec<u8>, qnn_sys::api::GraphIo) {
    let context = backend.context().expect("context");
    let w: Vec<u8> = (0..n * k).map(|i| ((i * 29 % 255) as i32 - 127) as i8 as u8).collect();
    let b: Vec<u8> = (0..n as i32).flat_map(|i| (i * 100 - 300).to_le_bytes()).collect();
    let io = {
        let mut g = context.graph("fc").expect("graph");
        let q = |scale, offset| Quantization::PerTensor { scale, offset };
        let x = g.input(&TensorSpec::new("x", &[m, k], dt::UFIXED_POINT_8, q(0.02, -128))).expect("x");
        let tw = g.constant(&TensorSpec::new("w", &[n, k], dt::SFIXED_POINT_8, q(0.004, 0)), &w).expect("w");
        let tb = g.constant(&TensorSpec::new("b", &[n], dt::SFIXED_POINT_32, q(0.02 * 0.004, 0)), &b).expect("b");
        let y = g.output(&TensorSpec::new("y", &[m, n], dt::UFIXED_POINT_8, q(0.05, -128))).expect("y");
        g.node("fc0", "FullyConnected", &[x, tw, tb], &[y], &[]).expect("node");
        g.finalize().expect("finalize").io()
    };
    let xs: Vec<u8> = (0..m * k).map(|i| (i * 37 % 256) as u8).collect();
    (context, xs, io)
}

#[test]
fn a_context_binary_reloads_to_the_same_results_and_a_damaged_one_is_refused() {
    let lib = std::sync::Arc::new(qnn_sys::Library::open(&emulator_library()).expect("loads"));
    let backend = Backend::htp(lib.clone(), SM8650).expect("backend");
    let (m, k, n) = (8u32, 64u32, 16u32);
    let (context, xs, io) = fc(&backend, m, k, n);
    let (io, y_reloaded) = {
        // The context saved as a binary and loaded again runs the graph by the same ids.
        let bin = context.binary().expect("binary");
        let reloaded = backend.context_from_binary(&bin).expect("reloads");
        let mut g = reloaded.retrieve("fc", &io).expect("retrieved");
        let mut y = vec![0u8; (m * n) as usize];
        g.execute(&[&xs], &mut [&mut y]).expect("runs");
        // Damaged copies: cut short, one byte flipped, another magic.
        for (what, bad) in [
            ("truncated", bin[..bin.len() - 7].to_vec()),
            ("flipped", {
                let mut b = bin.clone();
                b[bin.len() / 2] ^= 0x40;
                b
            }),
            ("not ours", {
                let mut b = bin.clone();
                b[0] = b'X';
                b
            }),
        ] {
            let e = backend.context_from_binary(&bad).err().unwrap_or_else(|| panic!("a {what} binary was loaded"));
            assert_eq!(e.code, 5005, "{what}: {e}");
            assert!(!e.message.is_empty(), "{what}: the error says why");
        }
        (io, y)
    };
    // The graph as built (not reloaded) gives the same bytes.
    let mut g = context.retrieve("fc", &io).expect("retrieved");
    let mut y = vec![0u8; (m * n) as usize];
    g.execute(&[&xs], &mut [&mut y]).expect("runs");
    assert_eq!(y, y_reloaded);
    assert!(y.iter().any(|&v| v != y[0]), "the test data should give varied outputs");
}

#[test]
fn a_graph_keeps_its_context_and_backend_alive_and_runs_on_another_thread() {
    let lib = std::sync::Arc::new(qnn_sys::Library::open(&emulator_library()).expect("loads"));
    let (m, k, n) = (4u32, 32u32, 8u32);
    let (mut g, xs, want) = {
        let backend = Backend::htp(lib.clone(), SM8650).expect("backend");
        let (context, xs, io) = fc(&backend, m, k, n);
        let mut g = context.retrieve("fc", &io).expect("retrieved");
        let mut want = vec![0u8; (m * n) as usize];
        g.execute(&[&xs], &mut [&mut want]).expect("runs");
        (g, xs, want)
        // The backend and the context are dropped here: the graph holds them.
    };
    drop(lib);
    let got = std::thread::spawn(move || {
        let mut y = vec![0u8; (m * n) as usize];
        g.execute(&[&xs], &mut [&mut y]).expect("runs after its context's and backend's handles are gone");
        y
    })
    .join()
    .expect("the thread ran");
    assert_eq!(got, want);
}

#[test]
fn each_execution_is_charged_its_modelled_duration() {
    let lib = std::sync::Arc::new(qnn_sys::Library::open(&emulator_library()).expect("loads"));
    let backend = Backend::htp(lib.clone(), SM8650).expect("backend");
    let (m, k, n) = (32u32, 256u32, 512u32);
    let (context, xs, io) = fc(&backend, m, k, n);
    let mut g = context.retrieve("fc", &io).expect("retrieved");
    assert_eq!(g.modelled_ns(), Some((0, 0)), "nothing run yet");
    let mut y = vec![0u8; (m * n) as usize];
    g.execute(&[&xs], &mut [&mut y]).expect("runs");
    g.execute(&[&xs], &mut [&mut y]).expect("runs");
    let want = llmd_qnn_emu::emu::cost::launch_ns(SM8650) + llmd_qnn_emu::emu::cost::fc_ns(SM8650, 32, 256, 512);
    assert_eq!(g.modelled_ns(), Some((want, 2 * want)));
}

#[test]
fn an_announced_core_api_version_parses_only_when_well_formed() {
    use llmd_qnn_emu::parse_version;
    use qnn_sys::Version;
    assert_eq!(parse_version("2.20"), Some(Version { major: 2, minor: 20, patch: 0 }));
    assert_eq!(parse_version(" 2.40.1 "), Some(Version { major: 2, minor: 40, patch: 1 }));
    for bad in ["", "2", "2.", "2.x", "2.20.1.0", "-1.2"] {
        assert_eq!(parse_version(bad), None, "{bad:?}");
    }
}
