//! Prompt chunks in-process: tokens/s of one chunk of N tokens from an empty cache, for each N
//! given (`cargo run --release -p llmd-engine --example prefillbench -- MODEL [THREADS]
//! [N,N,...] [REPS]`); `LLMD_KERNEL` picks the kernel. For profiling one chunk size at a time
//! without the benchmark's other phases.
use llmd_engine::model::Logits;
use llmd_engine::{LoadOptions, Model};

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: prefillbench MODEL [THREADS] [N,N,...] [REPS]")?;
    let threads = args.get(2).and_then(|t| t.parse().ok()).unwrap_or(0);
    let sizes: Vec<usize> = match args.get(3) {
        Some(list) => {
            list.split(',').map(|n| n.parse().map_err(|_| format!("bad size {n}"))).collect::<Result<_, _>>()?
        }
        None => vec![64, 256],
    };
    let reps: usize = args.get(4).and_then(|r| r.parse().ok()).unwrap_or(5);
    let model = Model::load(std::path::Path::new(path), &LoadOptions { threads, ..Default::default() })
        .map_err(|e| e.to_string())?;
    for n in sizes {
        let prompt: Vec<u32> = (0..n as u32).map(|i| 100 + (i * 7919) % 20000).collect();
        let mut best = f64::INFINITY;
        for _ in 0..reps + 1 {
            let mut kv = model.transformer.new_kv();
            let t0 = std::time::Instant::now();
            model.transformer.forward(&mut kv, &prompt, Logits::Last).map_err(|e| e.to_string())?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("N={n}: best {:.1} ms, {:.1} tok/s", best * 1e3, n as f64 / best);
    }
    Ok(())
}
