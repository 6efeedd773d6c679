use llmd_engine::backend::cpu::packed::*;
fn main() {
    if let Ok(nt) = std::env::var("KBENCH_SCOPED_ONLY") {
        // Scaling check: `KBENCH_SCOPED_ONLY=8` in two processes at once vs two threads.
        let nt: usize = nt.parse().expect("token count");
        let rows: usize = std::env::var("KBENCH_ROWS").ok().and_then(|t| t.parse().ok()).unwrap_or(1536);
        let cols = 576usize;
        let q8 = std::env::var("KBENCH_KIND").is_ok_and(|k| k == "q8_0");
        let (kind, bb) = if q8 { (PackKind::Q8_0, 34) } else { (PackKind::Q4_1, 20) };
        let raw: Vec<u8> = (0..rows * cols / 32 * bb).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
        let rb = cols / 32 * bb;
        let w = PackedMatrix::pack(kind, rows, cols, |r0, b| {
            b.copy_from_slice(&raw[r0 * rb..r0 * rb + b.len()]);
            Ok(())
        })
        .expect("packs");
        let x: Vec<f32> = (0..nt * cols).map(|i| ((i * 13 % 101) as f32) / 50.0 - 1.0).collect();
        let mut a = QuantActs::default();
        a.quantize(&x, nt, cols);
        if std::env::var_os("KBENCH_BACKEND").is_some() {
            use llmd_engine::backend::Backend;
            use std::sync::Arc;
            let cpu = llmd_engine::backend::cpu::CpuBackend::new(2);
            let t = llmd_engine::format::TensorRef {
                ty: if q8 { llmd_engine::quant::GgmlType::Q8_0 } else { llmd_engine::quant::GgmlType::Q4_1 },
                dims: vec![cols as u64, rows as u64],
                file: Arc::new(llmd_engine::format::ModelBytes::Owned(raw.clone())),
                range: 0..raw.len(),
            };
            let wm = llmd_engine::model::weights::WeightMatrix::from_tensor("w", rows, cols, t);
            let mut out = vec![0f32; rows * nt];
            let reps = (20000 * 8 * 1536 / nt / rows).max(3);
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                cpu.matmul(&wm, &x, nt, &mut out).expect("matmul");
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!(
                "backend matmul nt={nt} rows={rows}: {:.1} GMAC/s, {:.1} us",
                (rows * cols * nt) as f64 / s / 1e9,
                s * 1e6
            );
            return;
        }
        let threads: usize = std::env::var("KBENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
        println!(
            "{threads} threads nt={nt}: {:.1} GMAC/s",
            scoped_pair(&w, &a, nt, (20000 * 8 * 1536 / nt / rows).max(3), threads)
        );
        return;
    }
    {
        let pool = llmd_engine::backend::cpu::pool::Pool::new(2);
        let hits = std::sync::atomic::AtomicUsize::new(0);
        let t0 = std::time::Instant::now();
        for _ in 0..100000 {
            pool.run(8, &|_| {
                hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
        }
        println!("pool.run(8 empty tasks): {:.2} us", t0.elapsed().as_secs_f64() / 100000.0 * 1e6);
    }
    for th in [1usize, 2] {
        println!("peak {th} threads: {:.0} GMAC/s", llmd_engine::backend::cpu::int8_peak_macs_per_s(th) / 1e9);
        println!(
            "  in the kernels' rounding order (vpdpbusd + cvt + FMA per 64 MACs): {:.0} GMAC/s",
            llmd_engine::backend::cpu::packed::order_peak_macs_per_s(th) / 1e9
        );
    }
    let (rows, cols, n) = (1536usize, 576usize, 256usize);
    let raw: Vec<u8> = (0..rows * cols / 32 * 20).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
    let w = PackedMatrix::pack(PackKind::Q4_1, rows, cols, |r0, b| {
        b.copy_from_slice(&raw[r0 * 360..r0 * 360 + b.len()]);
        Ok(())
    })
    .expect("packs");
    let x: Vec<f32> = (0..n * cols).map(|i| ((i * 13 % 101) as f32) / 50.0 - 1.0).collect();
    let mut a = QuantActs::default();
    a.quantize(&x, n, cols);
    {
        use llmd_engine::backend::Backend;
        use std::sync::Arc;
        let cpu = llmd_engine::backend::cpu::CpuBackend::new(2);
        let t = llmd_engine::format::TensorRef {
            ty: llmd_engine::quant::GgmlType::Q4_1,
            dims: vec![cols as u64, rows as u64],
            file: Arc::new(llmd_engine::format::ModelBytes::Owned(raw.clone())),
            range: 0..raw.len(),
        };
        let wm = llmd_engine::model::weights::WeightMatrix::from_tensor("w", rows, cols, t);
        for nt in [1usize, 2, 4, 8, 16, 256] {
            let mut out = vec![0f32; rows * nt];
            let reps = if nt <= 16 { 300 } else { 10 };
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                cpu.matmul(&wm, &x[..nt * cols], nt, &mut out).expect("matmul");
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!("backend 2 threads nt={nt}: {:.1} GMAC/s, {:.1} us", (rows * cols * nt) as f64 / s / 1e9, s * 1e6);
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                a.quantize(&x[..nt * cols], nt, cols);
            }
            println!("  quantize alone {:.1} us", t0.elapsed().as_secs_f64() / reps as f64 * 1e6);
        }
    }
    {
        let k = Kernel::best();
        let nt = 256;
        let tiles = w.tiles();
        let t0 = std::time::Instant::now();
        for _ in 0..5 {
            std::thread::scope(|s| {
                for h in 0..2 {
                    let (w, a) = (&w, &a);
                    s.spawn(move || {
                        let mut out = vec![0f32; 16 * nt];
                        for t in (h * tiles / 2)..((h + 1) * tiles / 2) {
                            k.run(w, t, a, 0, nt, &mut out);
                        }
                    });
                }
            });
        }
        let sec = t0.elapsed().as_secs_f64() / 5.0;
        println!("kernel on 2 scoped threads nt=256: {:.1} GMAC/s", (rows * cols * nt) as f64 / sec / 1e9);
    }
    for nt in [8usize, 256] {
        let reps = if nt == 8 { 2000 } else { 40 };
        println!(
            "scoped, spawned once, nt={nt}: 1 thread {:.1} GMAC/s, 2 threads {:.1} GMAC/s",
            scoped_pair(&w, &a, nt, reps, 1),
            scoped_pair(&w, &a, nt, reps, 2)
        );
    }
    for k in Kernel::available() {
        for nt in [1usize, 2, 8, 256] {
            let mut out = vec![0f32; 16 * nt];
            let t0 = std::time::Instant::now();
            let reps = if nt <= 8 { 200 } else { 3 };
            for _ in 0..reps {
                for t in 0..w.tiles() {
                    k.run(&w, t, &a, 0, nt, &mut out);
                }
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!("{} nt={nt}: {:.1} GMAC/s", k.name(), (rows * cols * nt) as f64 / s / 1e9);
        }
    }
}

#[allow(dead_code)]
fn backend_bench() {}

/// Both threads run the kernel over their half of the tiles `reps` times, spawned once.
pub fn scoped_pair(w: &PackedMatrix, a: &QuantActs, nt: usize, reps: usize, threads: usize) -> f64 {
    let k = Kernel::best();
    let tiles = w.tiles();
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        for h in 0..threads {
            s.spawn(move || {
                let mut out = vec![0f32; 16 * nt];
                for _ in 0..reps {
                    for t in (h * tiles / threads)..((h + 1) * tiles / threads) {
                        k.run(w, t, a, 0, nt, &mut out);
                    }
                }
            });
        }
    });
    (w.rows * w.cols * nt * reps) as f64 / t0.elapsed().as_secs_f64() / 1e9
}
