//! Batched decode in-process: time of one forward pass for B sequences decoding one token each
//! (B = 1, 2, 4, 8), after a 64-token prompt each. `cargo run --release -p llmd-engine --example
//! batchbench -- MODEL [THREADS] [B,B,...]`.
use llmd_engine::model::Logits;
use llmd_engine::{LoadOptions, Model};

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: batchbench MODEL [THREADS]")?;
    let threads = args.get(2).and_then(|t| t.parse().ok()).unwrap_or(0);
    let model = Model::load(std::path::Path::new(path), &LoadOptions { threads, ..Default::default() })
        .map_err(|e| e.to_string())?;
    let prompt: Vec<u32> = (1..=64).map(|i| 100 + i).collect();
    let sizes: Vec<usize> = match args.get(3) {
        Some(list) => {
            list.split(',').map(|b| b.parse().map_err(|_| format!("bad batch size {b}"))).collect::<Result<_, _>>()?
        }
        None => vec![1, 2, 4, 8],
    };
    for b in sizes {
        let mut kvs: Vec<_> = (0..b).map(|_| model.transformer.new_kv()).collect();
        for kv in kvs.iter_mut() {
            model.transformer.forward(kv, &prompt, Logits::Last).map_err(|e| e.to_string())?;
        }
        let steps = if args.get(3).is_some() { 200 } else { 40 };
        let t0 = std::time::Instant::now();
        let ab = std::env::var("AB").is_ok();
        let mut buckets: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut attn: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let steps = std::env::var("STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(steps);
        for s in 0..steps {
            let v = ab && s % 2 == 1;
            llmd_engine::AB.store(v, std::sync::atomic::Ordering::Relaxed);
            let a0 = 0u64;
            let tp = std::time::Instant::now();
            let toks: Vec<[u32; 1]> = (0..b).map(|i| [(200 + s + i) as u32]).collect();
            let mut batch: Vec<_> = kvs.iter_mut().zip(&toks).map(|(kv, t)| (kv, &t[..])).collect();
            model.transformer.forward_batch(&mut batch, Logits::Last).map_err(|e| e.to_string())?;
            buckets[v as usize].push(tp.elapsed().as_secs_f64() * 1e3);
            attn[v as usize].push(a0 as f64);
        }
        if ab {
            let med = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.total_cmp(b));
                v[v.len() / 2]
            };
            let (a, bb) = (med(&mut buckets[0]), med(&mut buckets[1]));
            let (aa, ab2) = (med(&mut attn[0]), med(&mut attn[1]));
            println!("AB B={b}: A {a:.3} ms  B {bb:.3} ms  (B/A {:.4}) | attn A {aa:.3} B {ab2:.3}", bb / a);
        }
        let per = t0.elapsed().as_secs_f64() / steps as f64;
        println!("B={b}: {:.1} ms per pass, {:.1} tok/s in all", per * 1e3, b as f64 / per);
    }
    Ok(())
}
