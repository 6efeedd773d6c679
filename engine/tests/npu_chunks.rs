//! llm.npu's chunked prefill on the NPU path: a prompt prefilled in passes of C tokens through
//! graphs of C rows equals the same prompt in one pass through a graph that holds it whole
//! (logits and KV cache, within named tolerances), for random prompt lengths and chunk sizes —
//! the default model, its groups quantized as the NPU path ships them (folded weights, 16-bit
//! outputs, shadow execution), the emulator provider.

mod common;

use llmd_engine::prefill::{
    calibrate, quantized_groups, shadow_sites, NpuLinears, ShadowConfig, WeightQuant, CALIBRATION_TEXT, DEFAULT_PRUNE,
};

const SM8650: u32 = 57;
/// The one-pass graph's rows: every prompt below fits it.
const WHOLE: usize = 256;
/// Logits: the largest difference over the logits' spread (standard deviation) on the same
/// prompt — none: the two are bit-identical by construction (the NPU's integer arithmetic is per
/// row; the CPU's norms, RoPE and attention are per row in the same order whatever the pass;
/// the shadow product sums a row's outliers in channel order, and a channel another row brought
/// into the chunk's union adds an exact 0). Measured 0 on every case here.
const LOGIT_REL_TOL: f32 = 0.0;
/// KV cache entries (f16): the largest difference over the largest magnitude — none either.
const KV_REL_TOL: f32 = 0.0;

/// The groups' graphs at `rows` rows in a context of `device`, with shadow execution where
/// `sites` says, held by the device (the executor runs them as its `Group` subgraphs).
fn build(
    device: &std::sync::Arc<llmd_engine::backend::npu::QnnDevice>,
    rows: usize,
    groups: Vec<[llmd_engine::backend::npu::graph::LinearGroup; 4]>,
    flat: &[llmd_engine::backend::npu::graph::LinearGroup],
    cal: &llmd_engine::prefill::Calibration,
    sites: &[[bool; 4]],
) -> llmd_engine::model::Devices {
    let m = common::default_model();
    let ctx = device.context().expect("context");
    let mut n = NpuLinears::build(&ctx, groups, rows).expect("graphs");
    let sh = shadow_sites(&m.transformer, flat, cal, sites, &ShadowConfig::default(), None).expect("shadow");
    n.set_shadow(sh).expect("set");
    llmd_engine::prefill::devices(device.clone(), &std::sync::Arc::new(n))
}

fn kv_values(kv: &llmd_engine::backend::kv::KvCache) -> Vec<f32> {
    let mut bytes = Vec::new();
    kv.write_to(&mut bytes).expect("the cache serializes");
    // Header: magic, length, CRC (20 bytes); then type, layers, kv_dim, head_dim, positions.
    bytes[60..].chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
}

#[test]
fn chunked_prefill_equals_one_pass_for_random_lengths_and_chunk_sizes() {
    let m = common::default_model();
    let cal_tokens = m.tokenizer.encode(CALIBRATION_TEXT, false, false).expect("calibration");
    let cal = calibrate(&m.transformer, &cal_tokens).expect("calibrates");
    let sites = cal.shadow_sites(DEFAULT_PRUNE);
    let groups = quantized_groups(&m.transformer, &cal, WeightQuant::Folded, 16, &sites).expect("quantizes");
    let flat: Vec<_> = groups.iter().flatten().cloned().collect();
    let device = std::sync::Arc::new(
        llmd_engine::backend::npu::QnnDevice::open(&common::emulator_library(), SM8650).expect("the QNN library opens"),
    );
    let whole = build(&device, WHOLE, groups.clone(), &flat, &cal, &sites);
    // A prompt of ordinary text, cut at random lengths (seeded).
    let text = m
        .tokenizer
        .encode(
            "Reading the prompt is called prefill; producing the answer one word at a time is called decoding. \
             A phone carries a central processor, a graphics processor and a neural processor, each suited to \
             different work, and a good system puts each part of the work where it runs best. The neural \
             processor multiplies small integers very quickly, which is what a quantized model needs when it \
             reads a long prompt; the rest stays in floating point on the central processor, beside it. \
             Gardens, recipes, travel and history all reach the same model, so the answers should be clear.",
            false,
            false,
        )
        .expect("prompt");
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: usize| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    let mut worst = (0f32, 0f32);
    for chunk in [16usize, 32, 64] {
        let chunked = build(&device, chunk, groups.clone(), &flat, &cal, &sites);
        for _ in 0..2 {
            let p = 1 + next(text.len().min(WHOLE));
            let prompt = &text[..p];
            let mut kv1 = m.transformer.new_kv();
            let one = m
                .transformer
                .run(&mut [(&mut kv1, prompt)], llmd_engine::model::Run::LAST.on(&whole))
                .expect("one pass")
                .pop()
                .expect("its logits");
            let mut kv2 = m.transformer.new_kv();
            let mut last = Vec::new();
            for part in prompt.chunks(chunk) {
                last = m
                    .transformer
                    .run(&mut [(&mut kv2, part)], llmd_engine::model::Run::LAST.on(&chunked))
                    .expect("a chunk")
                    .pop()
                    .expect("its logits");
            }
            let mean = one.iter().sum::<f32>() / one.len() as f32;
            let spread = (one.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / one.len() as f32).sqrt();
            let dl = one.iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / spread;
            let (k1, k2) = (kv_values(&kv1), kv_values(&kv2));
            assert_eq!(k1.len(), k2.len(), "the caches hold different positions");
            let top = k1.iter().fold(0f32, |m, v| m.max(v.abs()));
            let dk = k1.iter().zip(&k2).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / top;
            eprintln!("prompt {p:3} tokens, chunks of {chunk:2}: logits {dl:.2e} of their spread, KV {dk:.2e} of its largest value");
            assert!(dl <= LOGIT_REL_TOL, "prompt {p}, chunk {chunk}: logits differ by {dl} of their spread");
            assert!(dk <= KV_REL_TOL, "prompt {p}, chunk {chunk}: the KV caches differ by {dk} of the largest value");
            worst = (worst.0.max(dl), worst.1.max(dk));
        }
    }
    eprintln!("worst: logits {:.2e}, KV {:.2e}", worst.0, worst.1);
}
