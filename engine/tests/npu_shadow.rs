//! Shadow outlier execution (llm.npu §3.3) on the NPU path as it runs — the default model's
//! groups as W8A8 graphs on the emulator provider, the CPU half from `backend::npu::shadow`:
//! - with an infinite threshold it is plain W8A8, bit for bit;
//! - what it adds is the float product of the extracted outliers and the int8 weights' rows;
//! - an output the NPU saturated is the float product on the CPU's own weights.

mod common;

use llmd_engine::backend::blocks::CaptureSite;
use llmd_engine::backend::npu::graph::LinearGroup;
use llmd_engine::prefill::{
    calibrate, quantized_groups, shadow_sites, Calibration, NpuLinears, ShadowConfig, WeightQuant, CALIBRATION_TEXT,
    SITES,
};

const SM8650: u32 = 57;
/// Graph rows; the inputs below are 40 rows, so two chunks, the second padded.
const CHUNK: usize = 32;
const ROWS: usize = 40;
/// The shadow product in f32 (sums of up to a few hundred terms) against an f64 reference of
/// the same product: relative to the sum of the terms' magnitudes, a few f32 ulps per term.
const PRODUCT_REL_TOL: f64 = 1e-5;
/// A float dot product of one row against the CPU's dequantized weights (f32, `k` ≤ 1536
/// terms) against its f64 reference, relative to the sum of magnitudes.
const DOT_REL_TOL: f64 = 1e-5;

fn lcg(seed: &mut u64) -> f64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 11) as f64 / (1u64 << 53) as f64
}

fn calibration() -> Calibration {
    let m = common::default_model();
    let tokens = m.tokenizer.encode(CALIBRATION_TEXT, false, false).expect("calibration text");
    calibrate(&m.transformer, &tokens).expect("calibrates")
}

/// `ROWS` rows of `k` values uniform in `lo..hi`.
fn inside(lo: f32, hi: f32, k: usize, seed: &mut u64) -> Vec<f32> {
    (0..ROWS * k).map(|_| lo + (hi - lo) * lcg(seed) as f32).collect()
}

/// Runs group `site` of layer `li` on `l`, one output vector per projection.
fn run(l: &NpuLinears, g: &LinearGroup, li: usize, site: CaptureSite, x: &[f32]) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = g.projections.iter().map(|p| vec![0f32; ROWS * p.weights.rows]).collect();
    let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    l.run(li, site, x, ROWS, &mut refs).expect("group runs");
    outs
}

/// Layers to probe: first, middle, last.
fn layers(n: usize) -> [usize; 3] {
    [0, n / 2, n - 1]
}

#[test]
fn shadow_with_an_infinite_threshold_is_plain_w8a8_bit_for_bit() {
    let m = common::default_model();
    let mut cal = calibration();
    for r in cal.layers.iter_mut().flatten() {
        r.tau = f32::INFINITY;
    }
    let all = vec![[true; 4]; cal.layers.len()];
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &all).expect("quantizes");
    let flat: Vec<LinearGroup> = groups.iter().flatten().cloned().collect();
    let device =
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("the QNN library opens");
    let (c1, c2) = (device.context().expect("context"), device.context().expect("context"));
    let plain = NpuLinears::build(&c1, groups.clone(), CHUNK).expect("graphs");
    let mut shadow = NpuLinears::build(&c2, groups, CHUNK).expect("graphs");
    let config = ShadowConfig { recompute_saturated: false, ..Default::default() };
    shadow.set_shadow(shadow_sites(&m.transformer, &flat, &cal, &all, &config, None).expect("sites")).expect("set");
    let mut seed = 1;
    for li in layers(cal.layers.len()) {
        for site in SITES {
            let g = &flat[li * 4 + site as usize];
            // τ = ∞: the clipped range is the whole calibrated range, and these values are in it.
            let (lo, hi) = cal.input_range(li, site, true);
            let x = inside(lo, hi, g.k(), &mut seed);
            let a = run(&plain, g, li, site, &x);
            let b = run(&shadow, g, li, site, &x);
            for (pa, pb) in a.iter().zip(&b) {
                assert!(pa.iter().zip(pb).all(|(u, v)| u.to_bits() == v.to_bits()), "layer {li} {site:?} differs");
            }
        }
    }
    let st = shadow.shadow_stats();
    assert_eq!((st.sites, st.outlier_elements), (cal.layers.len() * 4, 0));
    assert!(st.chunks >= 24, "{st:?}");
}

#[test]
fn shadow_adds_the_float_product_of_the_extracted_outliers() {
    let m = common::default_model();
    let cal = calibration();
    let all = vec![[true; 4]; cal.layers.len()];
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &all).expect("quantizes");
    let flat: Vec<LinearGroup> = groups.iter().flatten().cloned().collect();
    let device =
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("the QNN library opens");
    let (c1, c2) = (device.context().expect("context"), device.context().expect("context"));
    let plain = NpuLinears::build(&c1, groups.clone(), CHUNK).expect("graphs");
    let mut shadow = NpuLinears::build(&c2, groups, CHUNK).expect("graphs");
    let config = ShadowConfig { recompute_saturated: false, ..Default::default() };
    shadow.set_shadow(shadow_sites(&m.transformer, &flat, &cal, &all, &config, None).expect("sites")).expect("set");
    let mut seed = 2;
    let mut checked = 0;
    for li in layers(cal.layers.len()) {
        for site in SITES {
            let g = &flat[li * 4 + site as usize];
            let q = g.input;
            let (lo, hi) = (q.scale * (0 - q.zero_point) as f32, q.scale * (255 - q.zero_point) as f32);
            let k = g.k();
            let mut x = inside(lo * 0.9, hi * 0.9, k, &mut seed);
            // Outliers: three channels, a few rows each, 2–6 times past the range.
            let mut want: Vec<(usize, usize, f64)> = Vec::new();
            for c in [3usize, k / 2, k - 1] {
                for r in (c % 7..ROWS).step_by(9) {
                    let v = if (r + c) % 2 == 0 { hi * (2.0 + 4.0 * lcg(&mut seed) as f32) } else { lo * 3.0 };
                    x[r * k + c] = v;
                    let clipped = if v > hi { hi } else { lo };
                    want.push((r, c, f64::from(v) - f64::from(clipped)));
                }
            }
            let a = run(&plain, g, li, site, &x);
            let b = run(&shadow, g, li, site, &x);
            for (pi, p) in g.projections.iter().enumerate() {
                let w = &p.weights;
                for r in 0..ROWS {
                    for o in 0..w.rows {
                        let scale = f64::from(w.scales.of(o)) * p.gain.as_ref().map_or(1.0, |g| f64::from(g[o]));
                        let (mut sum, mut mag) = (0f64, 0f64);
                        for &(rr, c, res) in want.iter().filter(|t| t.0 == r) {
                            let _ = rr;
                            let t = res * f64::from(w.q[o * k + c]) * scale;
                            sum += t;
                            mag += t.abs();
                        }
                        let got = f64::from(b[pi][r * w.rows + o]) - f64::from(a[pi][r * w.rows + o]);
                        // The NPU's output is f32 too: its own rounding at this magnitude.
                        let base = f64::from(a[pi][r * w.rows + o].abs()) * f64::from(f32::EPSILON);
                        assert!(
                            (got - sum).abs() <= PRODUCT_REL_TOL * mag + 2.0 * base,
                            "layer {li} {site:?} {} row {r} out {o}: added {got}, the outliers' product is {sum}",
                            p.name
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    let st = shadow.shadow_stats();
    assert!(st.outlier_elements > 0 && st.outlier_channels > 0, "{st:?}");
    eprintln!("{checked} outputs checked; {st:?}");
}

#[test]
fn an_output_the_npu_saturated_is_recomputed_in_float() {
    let m = common::default_model();
    let cal = calibration();
    let all = vec![[true; 4]; cal.layers.len()];
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &all).expect("quantizes");
    let flat: Vec<LinearGroup> = groups.iter().flatten().cloned().collect();
    let device =
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("the QNN library opens");
    let context = device.context().expect("context");
    let mut shadow = NpuLinears::build(&context, groups, CHUNK).expect("graphs");
    shadow
        .set_shadow(shadow_sites(&m.transformer, &flat, &cal, &all, &ShadowConfig::default(), None).expect("sites"))
        .expect("set");
    // Layer 0's O group: inputs at the top of the clipped range on every channel whose weight
    // for output 0 is positive (and the bottom elsewhere) drive output 0 past its calibrated
    // range.
    let (li, site) = (0, CaptureSite::O);
    let g = &flat[li * 4 + site as usize];
    let (k, q) = (g.k(), g.input);
    let (lo, hi) = (q.scale * (0 - q.zero_point) as f32, q.scale * (255 - q.zero_point) as f32);
    let p = &g.projections[0];
    let mut x = vec![0f32; ROWS * k];
    for r in 0..ROWS {
        for c in 0..k {
            x[r * k + c] = if p.weights.q[c] > 0 { hi } else { lo };
        }
    }
    let out = run(&shadow, g, li, site, &x);
    let st = shadow.shadow_stats();
    assert!(st.saturated_outputs >= ROWS as u64, "{st:?}");
    // Output 0 of every row: the float product on the CPU's weights (dequantized here in f64).
    let cpu = &m.transformer.weights.layers[li].wo;
    let mut row = vec![0f32; k];
    llmd_engine::quant::dequantize_row(cpu.ty, cpu.row(0).expect("row 0 of wo"), &mut row).expect("dequantizes");
    let want: f64 = x[..k].iter().zip(&row).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
    let mag: f64 = x[..k].iter().zip(&row).map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs()).sum();
    for r in 0..ROWS {
        let got = f64::from(out[0][r * p.weights.rows]);
        assert!((got - want).abs() <= DOT_REL_TOL * mag, "row {r}: {got} vs the float product {want}");
    }
    let (olo, ohi) = (
        p.output.scale * (0 - p.output.zero_point) as f32,
        p.output.scale * (p.output.max_code() - p.output.zero_point) as f32,
    );
    let top = f64::from(ohi.max(-olo)) * f64::from(p.gain.as_ref().map_or(1.0, |g| g[0]));
    eprintln!("output 0: {want:.3}, past the NPU's range (±{top:.3}); {st:?}");
}

#[test]
fn cold_rows_live_in_a_file_that_is_reused_only_while_it_holds_these_rows() {
    let m = common::default_model();
    let cal = calibration();
    let sites = cal.shadow_sites(llmd_engine::prefill::DEFAULT_PRUNE);
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &sites).expect("quantizes");
    let flat: Vec<LinearGroup> = groups.iter().flatten().cloned().collect();
    let dir = std::env::temp_dir().join(format!("llmd-cold-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("rows.shadow");
    let config = ShadowConfig::default();
    let made = shadow_sites(&m.transformer, &flat, &cal, &sites, &config, Some(&path)).expect("sites");
    let rows: usize = made.iter().flatten().map(|s| s.weights.k * s.weights.n()).sum();
    let resident: usize = made.iter().flatten().map(|s| s.weights.resident_bytes()).sum();
    let len = std::fs::metadata(&path).expect("the file").len();
    assert_eq!(len, rows as u64 + 8, "the rows and an 8-byte trailer");
    assert!(resident * 10 < rows, "{resident} B of {rows} B in memory: the hot rows only");
    let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
    std::thread::sleep(std::time::Duration::from_millis(20));
    shadow_sites(&m.transformer, &flat, &cal, &sites, &config, Some(&path)).expect("again");
    assert_eq!(std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime"), mtime, "a sound file is reused");
    // A damaged trailer (or another model's rows of the same length) is rewritten.
    let mut bytes = std::fs::read(&path).expect("read");
    let n = bytes.len();
    bytes[n - 6] ^= 0xFF;
    std::fs::write(&path, &bytes).expect("write");
    shadow_sites(&m.transformer, &flat, &cal, &sites, &config, Some(&path)).expect("rewritten");
    let again = std::fs::read(&path).expect("read");
    assert_ne!(again[n - 6], bytes[n - 6], "the trailer was rewritten");
    // Without a cache directory the rows still leave memory (an unlinked scratch file).
    let scratch = shadow_sites(&m.transformer, &flat, &cal, &sites, &config, None).expect("scratch");
    let resident2: usize = scratch.iter().flatten().map(|s| s.weights.resident_bytes()).sum();
    assert_eq!(resident2, resident);
    std::fs::remove_dir_all(&dir).ok();
}
