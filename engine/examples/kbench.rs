use llmd_engine::quant::packed::*;
fn main() {
    let (rows, cols, n) = (1536usize, 576usize, 256usize);
    let raw: Vec<u8> = (0..rows * cols / 32 * 20).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
    let w = PackedMatrix::pack(PackKind::Q4_1, rows, cols, |r0, b| { b.copy_from_slice(&raw[r0 * 360..r0 * 360 + b.len()]); Ok(()) }).unwrap();
    let x: Vec<f32> = (0..n * cols).map(|i| ((i * 13 % 101) as f32) / 50.0 - 1.0).collect();
    let mut a = QuantActs::default();
    a.quantize(&x, n, cols);
    for k in Kernel::available() {
        for nt in [1usize, 256] {
            let mut out = vec![0f32; 16 * nt];
            let t0 = std::time::Instant::now();
            let reps = if nt == 1 { 200 } else { 3 };
            for _ in 0..reps { for t in 0..w.tiles() { k.run(&w, t, &a, 0, nt, &mut out); } }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!("{} nt={nt}: {:.1} GMAC/s", k.name(), (rows * cols * nt) as f64 / s / 1e9);
        }
    }
}
