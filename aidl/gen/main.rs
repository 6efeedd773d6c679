//! `llmd_aidl_gen OUT.rs IN.aidl...`: the Soong host tool behind the `llmd_aidl_rs` genrule.

include!("generate.rs");

fn main() -> std::process::ExitCode {
    let args: Vec<std::path::PathBuf> = std::env::args_os().skip(1).map(Into::into).collect();
    let Some((out, inputs)) = args.split_first() else {
        eprintln!("usage: llmd_aidl_gen OUT.rs IN.aidl...");
        return std::process::ExitCode::FAILURE;
    };
    match generate(inputs, out) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llmd_aidl_gen: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
