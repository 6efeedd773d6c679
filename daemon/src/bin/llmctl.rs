//! `llmctl`: the engineer's command line for llmd.

use clap::{Parser, Subcommand};
use llmd_daemon::cli::{self, RunArgs};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "llmctl", version, about = "Command line for the llmd on-device LLM service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt, streaming it to standard output.
    Run(RunArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("LLMD_LOG"))
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Run(args) if !args.local => {
            Err("talking to the llmd daemon is not in this build yet; pass --local to run the engine in-process"
                .to_owned())
        }
        Command::Run(args) => cli::run_local(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llmctl: error: {e}");
            ExitCode::FAILURE
        }
    }
}
