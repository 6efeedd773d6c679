fn kb(k: &str) -> u64 { std::fs::read_to_string("/proc/self/status").unwrap().lines().find(|l| l.starts_with(k)).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap() }
fn main() {
    let p = std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    println!("start rss {} hwm {}", kb("VmRSS:"), kb("VmHWM:"));
    let g = llmd_engine::format::gguf::GgufFile::open(p).unwrap();
    println!("gguf open rss {} hwm {}", kb("VmRSS:"), kb("VmHWM:"));
    let t = llmd_engine::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    println!("tokenizer rss {} hwm {}", kb("VmRSS:"), kb("VmHWM:"));
    drop(t); drop(g);
    println!("dropped rss {} hwm {}", kb("VmRSS:"), kb("VmHWM:"));
    let m = llmd_engine::Model::load(p, &Default::default()).unwrap();
    println!("model rss {} hwm {} weights {}", kb("VmRSS:"), kb("VmHWM:"), m.transformer.weights.size_bytes());
}
