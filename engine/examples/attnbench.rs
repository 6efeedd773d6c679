//! Attention dot products over a strided f16 cache: ns per position, in cache and streaming
//! from memory. `cargo run --release -p llmd-engine --example attnbench`.
use half::f16;
use llmd_engine::backend::cpu::attn_kernels::AttnKernels;
fn main() {
    let k = AttnKernels::best();
    let (pos, hd) = (104usize, 64usize);
    for (copies, stride) in [(1usize, 192usize), (480, 192), (1440, 64)] {
        let caches: Vec<Vec<f16>> = (0..copies)
            .map(|c| (0..pos * stride).map(|i| f16::from_f32(((i * 7 + c) % 13) as f32 * 0.01)).collect())
            .collect();
        let q: Vec<f32> = (0..hd).map(|i| i as f32 * 0.01).collect();
        let mut out = vec![0f32; pos];
        let reps = 200_000 / copies;
        let t0 = std::time::Instant::now();
        for r in 0..reps {
            for c in &caches {
                (k.dots)(&q, if stride == hd { &c[..] } else { &c[(r % 3) * hd..] }, stride, &mut out);
            }
        }
        let ns = t0.elapsed().as_nanos() as f64 / (reps * copies * pos) as f64;
        println!("{copies} caches, row stride {stride}: {ns:.1} ns per position ({})", k.name);
    }
}
