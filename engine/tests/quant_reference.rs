//! Tier 1 against an independent reference: every tensor type's dequantization and dot product
//! against gguf-py's (tests/golden/quant.json, made by tools/golden/make_quant_fixtures.py).

use base64::Engine as _;
use llmd_engine::quant::{dequantize_row, quantize_row, vec_dot, GgmlType};

/// Dequantized values may differ from gguf-py's by float rounding of the two or three
/// operations per element (e.g. `(d·sc)·q − dmin·m` vs `d·(sc·q) − …`): a few ulps of the
/// block's scale. Bound: 4 ulps of f32 relative to max(1, |value|).
const DEQUANT_REL_TOL: f32 = 4.0 * f32::EPSILON;
/// Our integer dot product against the float64 dot of our own dequantized weights and our own
/// dequantized (quantized) activations: only f32 accumulation differs.
const DOT_SELF_REL_TOL: f64 = 1e-5;

fn f32s(b64: &str) -> Vec<f32> {
    let b = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn half_at(b: &[u8]) -> f64 {
    let mut one = [0f32; 1];
    dequantize_row(GgmlType::F16, &b[..2], &mut one).expect("f16");
    one[0] as f64
}

fn fixtures() -> serde_json::Value {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden/quant.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("quant fixtures are committed")).expect("JSON")
}

fn ty(name: &str) -> GgmlType {
    GgmlType::ALL.into_iter().find(|t| t.name() == name).expect("known type")
}

#[test]
fn every_required_type_is_covered() {
    let f = fixtures();
    let names: Vec<&str> =
        f["cases"].as_array().expect("cases").iter().map(|c| c["type"].as_str().expect("type")).collect();
    for t in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"] {
        assert!(names.contains(&t), "no reference case for {t}");
    }
}

#[test]
fn dequantize_matches_gguf_py() {
    let f = fixtures();
    for c in f["cases"].as_array().expect("cases") {
        let t = ty(c["type"].as_str().expect("type"));
        let (rows, cols) = (c["rows"].as_u64().expect("rows") as usize, c["cols"].as_u64().expect("cols") as usize);
        let raw = base64::engine::general_purpose::STANDARD.decode(c["raw"].as_str().expect("raw")).expect("base64");
        let want = f32s(c["dequantized"].as_str().expect("dequantized"));
        let rb = t.row_bytes(cols).expect("whole blocks");
        assert_eq!(raw.len(), rows * rb, "{t}: fixture size");
        let mut got = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(t, &raw[r * rb..(r + 1) * rb], &mut got).expect("dequantizes");
            for (i, (g, w)) in got.iter().zip(&want[r * cols..(r + 1) * cols]).enumerate() {
                assert!(
                    (g - w).abs() <= DEQUANT_REL_TOL * w.abs().max(1.0),
                    "{t} row {r} element {i}: {g} vs gguf-py {w}"
                );
            }
        }
    }
}

#[test]
fn dot_matches_reference_within_activation_quantization_error() {
    let f = fixtures();
    let x = f32s(f["activations"].as_str().expect("activations"));
    for c in f["cases"].as_array().expect("cases") {
        let t = ty(c["type"].as_str().expect("type"));
        let cols = c["cols"].as_u64().expect("cols") as usize;
        let raw = base64::engine::general_purpose::STANDARD.decode(c["raw"].as_str().expect("raw")).expect("base64");
        let deq = f32s(c["dequantized"].as_str().expect("dequantized"));
        let at = t.vec_dot_type();
        let mut xq = vec![0u8; at.row_bytes(cols).expect("blocks")];
        quantize_row(at, &x, &mut xq).expect("quantizes");
        let mut xd = vec![0f32; cols];
        dequantize_row(at, &xq, &mut xd).expect("dequantizes activations");
        let rb = t.row_bytes(cols).expect("whole blocks");
        for (r, want) in c["dots"].as_array().expect("dots").iter().enumerate() {
            let want = want.as_f64().expect("dot");
            let w = &deq[r * cols..(r + 1) * cols];
            let got = vec_dot(t, cols, &raw[r * rb..(r + 1) * rb], &xq).expect("dot") as f64;
            // Independent bound: each activation moved by at most its quantization error
            // |x − x̂|, so the dot moves by at most Σ|w|·|x − x̂| (plus f32 accumulation).
            let magnitude: f64 = w.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let act_err: f64 = w
                .iter()
                .zip(x.iter().zip(&xd))
                .map(|(a, (b, c))| (*a as f64).abs() * (*b as f64 - *c as f64).abs())
                .sum();
            let bound = act_err + 1e-5 * magnitude + 1e-6;
            assert!((got - want).abs() <= bound, "{t} row {r}: dot {got} vs reference {want} (bound {bound})");
            // Tight check of the integer kernel: same inputs, exact arithmetic. Types that pair
            // with Q8_1 use the activation block's stored f16 sum `s` for the min term (as
            // llama.cpp does), so the exact value uses it too.
            let exact: f64 = if at == GgmlType::Q8_1 {
                let wrow = &raw[r * rb..(r + 1) * rb];
                (0..cols / 32)
                    .map(|b| {
                        let m = half_at(&wrow[b * t.type_size() + 2..]);
                        let s = half_at(&xq[b * 36 + 2..]);
                        let scaled: f64 = (0..32).map(|i| (w[b * 32 + i] as f64 - m) * xd[b * 32 + i] as f64).sum();
                        scaled + m * s
                    })
                    .sum()
            } else {
                w.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            assert!(
                (got - exact).abs() <= DOT_SELF_REL_TOL * magnitude.max(1.0),
                "{t} row {r}: kernel {got} vs exact {exact}"
            );
        }
    }
}
