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
        for s in 0..steps {
            let toks: Vec<[u32; 1]> = (0..b).map(|i| [(200 + s + i) as u32]).collect();
            let mut batch: Vec<_> = kvs.iter_mut().zip(&toks).map(|(kv, t)| (kv, &t[..])).collect();
            model.transformer.run(&mut batch, llmd_engine::model::Run::LAST).map_err(|e| e.to_string())?;
        }
        let per = t0.elapsed().as_secs_f64() / steps as f64;
        println!("B={b}: {:.2} ms per pass, {:.1} tok/s in all", per * 1e3, b as f64 / per);
    }
    Ok(())
}
