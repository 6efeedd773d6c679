//! Against Qualcomm's own HTP library built for x86-64 (`scripts/fetch-qnn.sh` fills the cache;
//! `LLMD_QNN_LIB` names another copy).

use std::path::PathBuf;

/// Where Qualcomm's HTP library is: `LLMD_QNN_LIB`, else the cache `scripts/fetch-qnn.sh` fills
/// (run here if it is not filled yet).
fn htp_library() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(find_htp_library).clone()
}

fn find_htp_library() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMD_QNN_LIB") {
        return p.into();
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(root.join("scripts/fetch-qnn.sh"))
        .output()
        .expect("scripts/fetch-qnn.sh runs");
    assert!(out.status.success(), "scripts/fetch-qnn.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("libQnnHtp.so")
}

#[test]
fn the_htp_library_offers_one_htp_provider_with_api_2() {
    let lib = qnn_sys::Library::open(&htp_library()).expect("libQnnHtp.so loads");
    let p = lib.providers();
    eprintln!("{p:?}");
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].backend_id, qnn_sys::BACKEND_ID_HTP);
    assert_eq!(p[0].name, "HTP_QTI_AISW");
    assert_eq!(p[0].api.core.major, 2, "{p:?}");
}

#[test]
fn a_file_that_is_not_a_qnn_library_is_a_typed_error() {
    let e = qnn_sys::Library::open(std::path::Path::new("/nonexistent/libQnnHtp.so")).err().expect("refused");
    assert!(matches!(e, qnn_sys::LoadError::Open(_)), "{e}");
}

/// A QNN call's result, with the library's own message when it failed.
fn check(t: &qnn_sys::FunctionTable, what: &str, e: qnn_sys::ErrorHandle) {
    if e == qnn_sys::QNN_SUCCESS {
        return;
    }
    let mut msg: *const std::ffi::c_char = std::ptr::null();
    if let Some(f) = t.error_get_message {
        // SAFETY: `msg` is valid for a write; the library points it at a static string.
        unsafe { f(e, &mut msg) };
    }
    let text = if msg.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated string the library keeps.
        unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned()
    };
    panic!("{what} failed: QNN error {} ({text})", qnn_sys::error_code(e));
}

/// A float tensor description (no data yet).
fn tensor(name: &std::ffi::CStr, kind: u32, dims: &mut [u32]) -> qnn_sys::Tensor {
    quantized(name, kind, dims, qnn_sys::data_type::FLOAT_32, qnn_sys::QuantizeParams::NONE)
}

/// A tensor description of any type (no data yet).
fn quantized(
    name: &std::ffi::CStr,
    kind: u32,
    dims: &mut [u32],
    data_type: u32,
    quantize_params: qnn_sys::QuantizeParams,
) -> qnn_sys::Tensor {
    qnn_sys::Tensor {
        version: qnn_sys::TENSOR_VERSION_1,
        v: qnn_sys::TensorVersions {
            v1: qnn_sys::TensorV1 {
                id: 0,
                name: name.as_ptr(),
                tensor_type: kind,
                data_format: 0,
                data_type,
                quantize_params,
                rank: dims.len() as u32,
                dimensions: dims.as_mut_ptr(),
                mem_type: qnn_sys::TENSOR_MEM_RAW,
                memory: qnn_sys::TensorMemory {
                    client_buf: qnn_sys::ClientBuffer { data: std::ptr::null_mut(), data_size: 0 },
                },
            },
        },
    }
}

fn with_data<T>(mut t: qnn_sys::Tensor, data: &mut [T]) -> qnn_sys::Tensor {
    // Writing a union field is safe; `t` was made by `tensor` as version 1, and the caller keeps
    // the buffer alive while QNN may read or write it.
    t.v.v1.memory.client_buf =
        qnn_sys::ClientBuffer { data: data.as_mut_ptr().cast(), data_size: std::mem::size_of_val(data) as u32 };
    t
}

/// The declared layouts, end to end on Qualcomm's library: a float FullyConnected layer is
/// built, finalized for SM8650, run, saved as a context binary, loaded back and run again.
/// y = x·Wᵀ + b must match a direct computation (the library computes float graphs at fp16
/// precision from SM8550 on: FP16_TOLERANCE) and the reloaded graph must give the same bytes.
#[test]
fn a_fully_connected_layer_runs_and_reloads_from_its_context_binary() {
    /// fp16 rounding of inputs, weights and result: ~1e-3 relative, with K = 8.
    const FP16_TOLERANCE: f32 = 4e-3;
    let lib = qnn_sys::Library::open(&htp_library()).expect("libQnnHtp.so loads");
    let t = &lib.provider(qnn_sys::BACKEND_ID_HTP).expect("an HTP provider with API 2.27+").table;
    let null = std::ptr::null_mut();
    let (n_out, k) = (4usize, 8usize);
    let mut w: Vec<f32> = (0..n_out * k).map(|i| ((i * 7 % 11) as f32 - 5.0) / 8.0).collect();
    let mut b: Vec<f32> = (0..n_out).map(|i| i as f32 * 0.25 - 0.5).collect();
    let mut x: Vec<f32> = (0..2 * k).map(|i| ((i * 5 % 9) as f32 - 4.0) / 4.0).collect();
    let want: Vec<f32> = (0..2 * n_out)
        .map(|i| {
            let (r, o) = (i / n_out, i % n_out);
            b[o] + (0..k).map(|j| x[r * k + j] * w[o * k + j]).sum::<f32>()
        })
        .collect();
    let (mut backend, mut device, mut context, mut graph) = (null, null, null, null);
    let soc = qnn_sys::HtpDeviceCustomConfig::soc(57);
    let dev_cfg = qnn_sys::Config { option: qnn_sys::CONFIG_OPTION_CUSTOM, value: &soc as *const _ as *mut _ };
    let dev_cfgs = [&dev_cfg as *const qnn_sys::Config, std::ptr::null()];
    let (mut dx, mut dw, mut db, mut dy) = ([2u32, k as u32], [n_out as u32, k as u32], [n_out as u32], [2u32, n_out as u32]);
    let mut y = vec![0f32; 2 * n_out];
    // SAFETY: every call follows QNN's documented sequence with the table of a provider whose
    // API version was checked; every pointer passed is valid for the call (out-pointers to
    // locals, NULL-terminated config arrays, tensors and buffers that outlive the graph).
    unsafe {
        check(t, "backendCreate", t.backend_create.expect("backendCreate")(null, std::ptr::null(), &mut backend));
        check(t, "deviceCreate", t.device_create.expect("deviceCreate")(null, dev_cfgs.as_ptr(), &mut device));
        check(t, "contextCreate", t.context_create.expect("contextCreate")(backend, device, std::ptr::null(), &mut context));
        check(t, "graphCreate", t.graph_create.expect("graphCreate")(context, c"fc".as_ptr(), std::ptr::null(), &mut graph));
        let mut tx = tensor(c"x", qnn_sys::tensor_type::APP_WRITE, &mut dx);
        let mut tw = with_data(tensor(c"w", qnn_sys::tensor_type::STATIC, &mut dw), &mut w);
        let mut tb = with_data(tensor(c"b", qnn_sys::tensor_type::STATIC, &mut db), &mut b);
        let mut ty = tensor(c"y", qnn_sys::tensor_type::APP_READ, &mut dy);
        for (name, tn) in [("x", &mut tx), ("w", &mut tw), ("b", &mut tb), ("y", &mut ty)] {
            check(t, name, t.tensor_create_graph_tensor.expect("tensorCreateGraphTensor")(graph, tn));
        }
        let mut ins = [tx, tw, tb];
        let mut outs = [ty];
        let op = qnn_sys::OpConfig {
            version: qnn_sys::OPCONFIG_VERSION_1,
            v1: qnn_sys::OpConfigV1 {
                name: c"fc0".as_ptr(),
                package_name: qnn_sys::OP_PACKAGE_QTI_AISW.as_ptr(),
                type_name: c"FullyConnected".as_ptr(),
                num_of_params: 0,
                params: std::ptr::null_mut(),
                num_of_inputs: 3,
                input_tensors: ins.as_mut_ptr(),
                num_of_outputs: 1,
                output_tensors: outs.as_mut_ptr(),
            },
        };
        check(t, "backendValidateOpConfig", t.backend_validate_op_config.expect("validate")(backend, op));
        check(t, "graphAddNode", t.graph_add_node.expect("graphAddNode")(graph, op));
        check(t, "graphFinalize", t.graph_finalize.expect("graphFinalize")(graph, null, null));
        let mut run = |graph: qnn_sys::Handle, y: &mut [f32]| {
            let input = with_data(tx, &mut x);
            let mut output = with_data(ty, y);
            check(
                t,
                "graphExecute",
                t.graph_execute.expect("graphExecute")(graph, &input, 1, &mut output, 1, std::ptr::null_mut(), std::ptr::null_mut()),
            );
        };
        run(graph, &mut y);
        for (got, want) in y.iter().zip(&want) {
            assert!((got - want).abs() <= FP16_TOLERANCE * want.abs().max(1.0), "{y:?} vs {want:?}");
        }
        // Save the finalized context, load it into a new one, and run the graph it holds.
        let mut size = 0u64;
        check(t, "contextGetBinarySize", t.context_get_binary_size.expect("size")(context, &mut size));
        let mut blob = vec![0u8; size as usize];
        let mut written = 0u64;
        check(t, "contextGetBinary", t.context_get_binary.expect("binary")(context, blob.as_mut_ptr().cast(), size, &mut written));
        blob.truncate(written as usize);
        eprintln!("context binary: {written} bytes");
        let mut loaded = null;
        check(
            t,
            "contextCreateFromBinary",
            t.context_create_from_binary.expect("fromBinary")(
                backend,
                device,
                std::ptr::null(),
                blob.as_ptr().cast(),
                blob.len() as u64,
                &mut loaded,
                null,
            ),
        );
        let mut again = null;
        check(t, "graphRetrieve", t.graph_retrieve.expect("graphRetrieve")(loaded, c"fc".as_ptr(), &mut again));
        let mut y2 = vec![0f32; 2 * n_out];
        run(again, &mut y2);
        assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), y2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        check(t, "contextFree", t.context_free.expect("contextFree")(loaded, null));
        check(t, "contextFree", t.context_free.expect("contextFree")(context, null));
        check(t, "deviceFree", t.device_free.expect("deviceFree")(device));
        check(t, "backendFree", t.backend_free.expect("backendFree")(backend));
    }
}

/// The W8A8 arithmetic the NPU path will use, on Qualcomm's library against ideal rounding of the
/// exact integer result: uint8 activations with a zero point, int8 symmetric weights, int32 bias,
/// uint8 output. Every output within 1 LSB; the share that differs is printed and bounded
/// (the design's first probe saw 7-9% differ on its data; this data: 0.8%, 4 of 512).
#[test]
fn a_w8a8_fully_connected_layer_is_within_one_lsb_of_ideal_rounding() {
    /// Largest difference from ideal rounding (the design's probe: 1 LSB everywhere).
    const MAX_LSB: i32 = 1;
    /// Most outputs that may differ at all (the probe: 7-9%).
    const MAX_DIFFERING_SHARE: f64 = 0.25;
    let lib = qnn_sys::Library::open(&htp_library()).expect("libQnnHtp.so loads");
    let t = &lib.provider(qnn_sys::BACKEND_ID_HTP).expect("an HTP provider").table;
    let null = std::ptr::null_mut();
    let (m, k, n) = (8usize, 128usize, 64usize);
    // Deterministic data spread over the whole ranges.
    let mut xq: Vec<u8> = (0..m * k).map(|i| ((i * 37 + 11) % 256) as u8).collect();
    let mut wq: Vec<i8> = (0..n * k).map(|i| (((i * 53 + 7) % 255) as i32 - 127) as i8).collect();
    let mut bq: Vec<i32> = (0..n).map(|i| (i as i32 - 32) * 150).collect();
    let (sx, zx) = (0.02f32, 128i32);
    let sw = 0.004f32;
    let (sy, zy) = (0.05f32, 128i32);
    // Ideal: y = round((Σ (x - zx)·w·sx·sw + b·sx·sw) / sy) + zy, clamped to uint8, in f64.
    let ideal: Vec<i32> = (0..m * n)
        .map(|i| {
            let (r, o) = (i / n, i % n);
            let acc: i64 = (0..k).map(|j| (i64::from(xq[r * k + j]) - i64::from(zx)) * i64::from(wq[o * k + j])).sum();
            let real = (acc + i64::from(bq[o])) as f64 * f64::from(sx) * f64::from(sw);
            ((real / f64::from(sy)).round() as i32 + zy).clamp(0, 255)
        })
        .collect();
    let (mut backend, mut device, mut context, mut graph) = (null, null, null, null);
    let soc = qnn_sys::HtpDeviceCustomConfig::soc(57);
    let dev_cfg = qnn_sys::Config { option: qnn_sys::CONFIG_OPTION_CUSTOM, value: &soc as *const _ as *mut _ };
    let dev_cfgs = [&dev_cfg as *const qnn_sys::Config, std::ptr::null()];
    let (mut dx, mut dw, mut db, mut dy) = ([m as u32, k as u32], [n as u32, k as u32], [n as u32], [m as u32, n as u32]);
    let mut y = vec![0u8; m * n];
    use qnn_sys::{data_type as dt, tensor_type as tt, QuantizeParams as Q};
    // SAFETY: as in the float test: QNN's documented sequence, every pointer valid for its call.
    unsafe {
        check(t, "backendCreate", t.backend_create.expect("backendCreate")(null, std::ptr::null(), &mut backend));
        check(t, "deviceCreate", t.device_create.expect("deviceCreate")(null, dev_cfgs.as_ptr(), &mut device));
        check(t, "contextCreate", t.context_create.expect("contextCreate")(backend, device, std::ptr::null(), &mut context));
        check(t, "graphCreate", t.graph_create.expect("graphCreate")(context, c"w8a8".as_ptr(), std::ptr::null(), &mut graph));
        // QNN's offset is the negated zero point: real = (q + offset) * scale.
        let mut tx = quantized(c"x", tt::APP_WRITE, &mut dx, dt::UFIXED_POINT_8, Q::per_tensor(sx, -zx));
        let mut tw = with_data(quantized(c"w", tt::STATIC, &mut dw, dt::SFIXED_POINT_8, Q::per_tensor(sw, 0)), &mut wq);
        let mut tb = with_data(quantized(c"b", tt::STATIC, &mut db, dt::SFIXED_POINT_32, Q::per_tensor(sx * sw, 0)), &mut bq);
        let mut ty = quantized(c"y", tt::APP_READ, &mut dy, dt::UFIXED_POINT_8, Q::per_tensor(sy, -zy));
        for (name, tn) in [("x", &mut tx), ("w", &mut tw), ("b", &mut tb), ("y", &mut ty)] {
            check(t, name, t.tensor_create_graph_tensor.expect("tensorCreateGraphTensor")(graph, tn));
        }
        let mut ins = [tx, tw, tb];
        let mut outs = [ty];
        let op = qnn_sys::OpConfig {
            version: qnn_sys::OPCONFIG_VERSION_1,
            v1: qnn_sys::OpConfigV1 {
                name: c"fc0".as_ptr(),
                package_name: qnn_sys::OP_PACKAGE_QTI_AISW.as_ptr(),
                type_name: c"FullyConnected".as_ptr(),
                num_of_params: 0,
                params: std::ptr::null_mut(),
                num_of_inputs: 3,
                input_tensors: ins.as_mut_ptr(),
                num_of_outputs: 1,
                output_tensors: outs.as_mut_ptr(),
            },
        };
        check(t, "graphAddNode", t.graph_add_node.expect("graphAddNode")(graph, op));
        check(t, "graphFinalize", t.graph_finalize.expect("graphFinalize")(graph, null, null));
        let input = with_data(tx, &mut xq);
        let mut output = with_data(ty, &mut y);
        check(t, "graphExecute", t.graph_execute.expect("graphExecute")(graph, &input, 1, &mut output, 1, null, null));
        check(t, "contextFree", t.context_free.expect("contextFree")(context, null));
        check(t, "deviceFree", t.device_free.expect("deviceFree")(device));
        check(t, "backendFree", t.backend_free.expect("backendFree")(backend));
    }
    let diffs: Vec<i32> = y.iter().zip(&ideal).map(|(&g, &w)| i32::from(g) - w).collect();
    let differing = diffs.iter().filter(|&&d| d != 0).count();
    let max = diffs.iter().map(|d| d.abs()).max().unwrap_or(0);
    let spread = ideal.iter().max().unwrap_or(&0) - ideal.iter().min().unwrap_or(&0);
    eprintln!(
        "W8A8 {m}x{k} by {n}x{k}: {differing} of {} outputs differ from ideal rounding ({:.1}%), at most {max} LSB; outputs span {spread} levels",
        diffs.len(),
        100.0 * differing as f64 / diffs.len() as f64
    );
    assert!(spread > 100, "the test data should use most of the output range: {spread}");
    assert!(max <= MAX_LSB, "{max} LSB");
    assert!((differing as f64) <= MAX_DIFFERING_SHARE * diffs.len() as f64, "{differing} of {} differ", diffs.len());
}
