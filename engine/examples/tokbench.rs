//! Times building a model's tokenizer from an llmd file's snapshot (`cargo run --release
//! --example tokbench FILE.llmd`).
fn main() {
    let path = std::env::args().nth(1).expect("an llmd file");
    let bytes = std::fs::read(&path).expect("read");
    let off = u64::from_le_bytes(bytes[32..40].try_into().expect("8")) as usize;
    let t0 = std::time::Instant::now();
    let (_, meta) = llmd_engine::format::llmd::parse_head(&bytes[..off], bytes.len() as u64).expect("parses");
    let parse = t0.elapsed();
    for _ in 0..3 {
        let t1 = std::time::Instant::now();
        let t = llmd_engine::tokenizer::Tokenizer::from_snapshot(meta.tokenizer.clone()).expect("builds");
        println!(
            "metadata {:.0} ms, tokenizer {:.0} ms ({} tokens)",
            parse.as_secs_f64() * 1e3,
            t1.elapsed().as_secs_f64() * 1e3,
            t.vocab_size()
        );
    }
}
