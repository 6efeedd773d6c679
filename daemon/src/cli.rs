//! `llmctl` subcommands that run the engine in-process (`--local`).

use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::{Flow, GenerateRequest, Prompt};
use llmd_engine::sampling::SamplingParams;
use llmd_engine::{LoadOptions, Model};
use std::io::Write;
use std::path::PathBuf;

/// Largest `--max-tokens` accepted (the context window bounds it further).
pub const MAX_NEW_TOKENS: usize = 1 << 20;

/// Options of `llmctl run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Run the engine inside llmctl instead of asking the llmd daemon.
    #[arg(long)]
    pub local: bool,
    /// Model file (GGUF) or HF directory (config.json + *.safetensors + tokenizer.json).
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (the template's default if omitted).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=MAX_NEW_TOKENS as u64))]
    pub max_tokens: u64,
    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample from the K most likely tokens only (0 = no limit).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one.
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise recently generated tokens (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Random seed; the same seed and parameters give the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when this text appears (may be given several times).
    #[arg(long)]
    pub stop: Vec<String>,
    /// CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The prompt; "-" reads it from standard input.
    pub prompt: String,
}

/// Runs `llmctl run --local`: generated text only on stdout, rates on stderr.
pub fn run_local(args: &RunArgs) -> Result<(), String> {
    let prompt_text = if args.prompt == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| format!("reading the prompt from standard input: {e}"))?;
        s
    } else {
        args.prompt.clone()
    };
    if prompt_text.is_empty() {
        return Err("the prompt is empty".into());
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    sampling.validate().map_err(|e| e.to_string())?;
    let load_start = std::time::Instant::now();
    let model = Model::load(&args.model, &LoadOptions { threads: args.threads })
        .map_err(|e| format!("{}: {e}", args.model.display()))?;
    let load_time = load_start.elapsed();
    let prompt = if args.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", &prompt_text));
        Prompt::Chat(msgs)
    } else {
        Prompt::Text(prompt_text)
    };
    let req = GenerateRequest { prompt, sampling, max_tokens: args.max_tokens as usize, stop: args.stop.clone() };
    let tokens = model.prompt_tokens(&req.prompt).map_err(|e| e.to_string())?;
    let ctx = model.config().context_length;
    if tokens.len() >= ctx {
        return Err(format!("the prompt has {} tokens; the model's context holds {ctx}", tokens.len()));
    }
    let mut kv = model.transformer.new_kv();
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let stats = model
        .generate_in(&mut kv, &tokens, &req, |text, _| {
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                write_err = Some(e);
                return Flow::Stop;
            }
            Flow::Continue
        })
        .map_err(|e| e.to_string())?;
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(format!("writing to standard output: {e}"));
        }
    }
    // Keep a shell prompt off the last line, but write only the generated text into pipes.
    if std::io::IsTerminal::is_terminal(&out) {
        let _ = writeln!(out);
    }
    eprintln!(
        "load {:.2} s | prompt {} tokens, {:.1} tok/s | generation {} tokens, {:.1} tok/s | first token {:.0} ms | finish {:?}",
        load_time.as_secs_f64(),
        stats.prompt_tokens,
        stats.prefill_tokens_per_s(),
        stats.generated_tokens,
        stats.decode_tokens_per_s(),
        stats.time_to_first_token.as_secs_f64() * 1e3,
        stats.finish,
    );
    Ok(())
}
