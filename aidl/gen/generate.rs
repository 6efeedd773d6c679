// Shared by build.rs (Cargo) and gen/main.rs (the Soong host tool): Rust from the AIDL files
// with rsbinder-aidl, so both build systems generate the same code from the same sources.

/// Writes the Rust for `sources` to `output` (a file name; rsbinder-aidl puts it in OUT_DIR,
/// or in the directory of an absolute path).
pub fn generate(sources: &[std::path::PathBuf], output: &std::path::Path) -> Result<(), String> {
    let mut b = rsbinder_aidl::Builder::new();
    for f in sources {
        b = b.source(f.clone());
    }
    b.output(output).generate().map_err(|e| format!("{e:?}"))
}
