//! K-quant kernel microbenchmark (one thread): `cargo run --release --example kkbench`
//! [KIND=q4_k|q6_k|q5_k|q3_k|q2_k] [NT=256] [ROWS=1536] [COLS=1536]: G MAC/s of every kernel this
//! CPU has over one matrix, one tile at a time as the backend runs them.
use llmd_engine::backend::cpu::kpacked::*;
use llmd_engine::backend::cpu::packed::{Kernel, TILE_ROWS};

fn env(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn main() {
    let kind = match std::env::var("KIND").as_deref() {
        Ok("q6_k") => KKind::Q6K,
        Ok("q5_k") => KKind::Q5K,
        Ok("q3_k") => KKind::Q3K,
        Ok("q2_k") => KKind::Q2K,
        _ => KKind::Q4K,
    };
    let (nt, rows, cols) = (env("NT", 256), env("ROWS", 1536), env("COLS", 1536));
    let ts = kind.ggml().type_size();
    let mut s = 0x1234_5678u64;
    let mut raw: Vec<u8> = (0..rows * cols / SB * ts)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    for b in raw.chunks_exact_mut(ts) {
        // Small positive f16 scales wherever this type keeps them (0x2000 ≈ 0.0078).
        for at in [0, 2, 80, 82, 108, 208] {
            if at + 2 <= ts {
                b[at] = 0;
                b[at + 1] = 0x20;
            }
        }
    }
    let rb = kind.ggml().row_bytes(cols).expect("whole super-blocks");
    let t0 = std::time::Instant::now();
    let w = KPackedMatrix::pack_in(None, kind, rows, cols, |r0, b| {
        b.copy_from_slice(&raw[r0 * rb..r0 * rb + b.len()]);
        Ok(())
    })
    .expect("packs");
    let pack_s = t0.elapsed().as_secs_f64();
    println!(
        "pack: {:.1} MB of {} in {:.1} ms, {:.2} GB/s (one thread)",
        (rows * rb) as f64 / 1e6,
        kind.ggml().name(),
        pack_s * 1e3,
        (rows * rb) as f64 / pack_s / 1e9
    );
    let x: Vec<f32> = (0..nt * cols).map(|i| ((i * 13 % 101) as f32) / 50.0 - 1.0).collect();
    let mut a = KActs::default();
    a.quantize(&x, nt, cols);
    let mut out = vec![0f32; nt * TILE_ROWS];
    for k in Kernel::available() {
        if k.name() == "scalar" {
            continue;
        }
        let reps = (2_000_000_000 / (rows * cols * nt)).max(2);
        // BLOCK=b: every tile over tokens b at a time, block after block (as the backend does
        // for wide matrices, to keep a block's activations in L2); default: all tokens at once.
        let block = env("BLOCK", nt).clamp(1, nt);
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            for b0 in (0..nt).step_by(block) {
                let bn = block.min(nt - b0);
                for tile in 0..w.tiles() {
                    run(k, &w, tile, &a, b0, bn, &mut out[..bn * TILE_ROWS]);
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{:?} {} nt={nt} {rows}x{cols}: {:.1} G MAC/s",
            kind,
            k.name(),
            (rows * cols * nt) as f64 / secs / 1e9
        );
    }
}
