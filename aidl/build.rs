//! Generates Rust from the AIDL files with rsbinder-aidl.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from("aidl/com/llmd");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("aidl directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "aidl"))
        .collect();
    files.sort();
    let mut b = rsbinder_aidl::Builder::new();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        b = b.source(f.clone());
    }
    b.output(PathBuf::from("llmd_aidl.rs")).generate().expect("AIDL compiles");
}
