use super::*;

#[test]
fn type_table_matches_the_gguf_specification() {
    // (id, block size, bytes per block) from ggml's type traits.
    let spec = [
        (0, 1, 4),
        (1, 1, 2),
        (2, 32, 18),
        (3, 32, 20),
        (6, 32, 22),
        (7, 32, 24),
        (8, 32, 34),
        (9, 32, 36),
        (12, 256, 144),
        (13, 256, 176),
        (14, 256, 210),
        (15, 256, 292),
        (30, 1, 2),
    ];
    for (id, bs, ts) in spec {
        let t = GgmlType::from_id(id).expect("known id");
        assert_eq!((t.id(), t.block_size(), t.type_size()), (id, bs, ts), "{t}");
    }
    assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed from GGUF");
    assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
    assert_eq!(GgmlType::Q4_K.row_bytes(500), None);
}

#[test]
fn length_mismatches_are_errors_not_panics() {
    let mut out = [0f32; 32];
    assert!(dequantize_row(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_K, &[0u8; 144], &mut out).is_err());
    assert!(quantize_row(GgmlType::Q8_0, &[0.0; 31], &mut [0u8; 34]).is_err());
    assert!(quantize_row(GgmlType::Q4_0, &[0.0; 32], &mut [0u8; 18]).is_err(), "Q4_0 is not an activation type");
    assert!(vec_dot(GgmlType::Q4_1, 32, &[0u8; 20], &[0u8; 34]).is_err(), "Q4_1 pairs with Q8_1 (36 bytes)");
}

#[test]
fn activation_quantization_errs_by_at_most_half_a_step() {
    let x: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
    for t in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
        let mut q = vec![0u8; t.row_bytes(256).expect("blocks")];
        quantize_row(t, &x, &mut q).expect("quantizes");
        let mut back = vec![0f32; 256];
        dequantize_row(t, &q, &mut back).expect("dequantizes");
        for block in 0..256 / t.block_size() {
            let r = block * t.block_size()..(block + 1) * t.block_size();
            let amax = x[r.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
            // Half a step of amax/127, plus the f16 rounding of the scale (2^-11 relative).
            let bound = amax / 127.0 * 0.5 + amax * 2f32.powi(-10);
            for i in r {
                assert!((x[i] - back[i]).abs() <= bound, "{t} element {i}: {} vs {}", x[i], back[i]);
            }
        }
    }
}
