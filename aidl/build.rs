//! Generates Rust from the AIDL files with rsbinder-aidl (the same function the Soong host
//! tool `llmd_aidl_gen` runs).

include!("gen/generate.rs");

fn main() {
    let dir = std::path::PathBuf::from("aidl/com/llmd");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .expect("aidl directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "aidl"))
        .collect();
    files.sort();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    println!("cargo:rerun-if-changed=gen/generate.rs");
    generate(&files, std::path::Path::new("llmd_aidl.rs")).expect("AIDL compiles");
}
