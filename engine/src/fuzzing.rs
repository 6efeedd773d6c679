//! The bodies of the engine's fuzz targets (`fuzz/fuzz_targets/*.rs`, run with cargo-fuzz by
//! `scripts/fuzz.sh`) and of the replay of their stored corpora on the stable toolchain
//! (`daemon/tests/fuzz_replay.rs`, part of `cargo test`, with llmd as the chat-template sandbox).
//!
//! Each body hands its bytes to the entry points the product uses on a model file — the same
//! functions [`crate::Model::load`], [`crate::probe`] and `llmctl convert` call — and must return:
//! never panic, hang, or allocate in proportion to a size the input claims rather than holds.
//! Errors are the expected outcome for most inputs and are dropped.

use crate::chat::{ChatMessage, ChatTemplate, Sandbox, SANDBOX_ARG};
use crate::error::{ChatTemplateError, GenerateError};
use crate::format::gguf::{Array, GgufFile, Value};
use crate::format::{hf, llmd, ModelBytes, TensorMap};
use crate::model::weights::ModelWeights;
use crate::tokenizer::Tokenizer;
use crate::{generate, llmd_tokenizer_and_template, probe_of_llmd, Source};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// Target `gguf`: a GGUF file loaded as [`crate::Model::load`] loads one — parsed and validated,
/// its configuration, tensor map and tokenizer read ([`Source::from_gguf`]), its weights
/// checked against the configuration and repacked, its chat template compiled.
pub fn gguf(data: &[u8]) {
    let Ok(g) = GgufFile::parse(ModelBytes::Owned(data.to_vec())) else { return };
    // What `llmctl` and `probe` read of any parsed file.
    let _bytes: usize = g.tensors.iter().map(|t| g.tensor_data(t).len()).sum();
    let Ok(src) = Source::from_gguf(g) else { return };
    load(&src);
}

/// The rest of [`crate::Model::load_with_progress`] after the source is open.
fn load(src: &Source) {
    if ModelWeights::load_progress(&src.config, &src.tensors, false, &|_, _| {}).is_ok() {
        if let Some(t) = src.chat_template.as_deref() {
            let _ = ChatTemplate::new(t);
        }
    }
}

/// Target `llmd`: an llmd file's head (header and metadata) read as [`crate::probe`] and the
/// streaming loader read it: [`llmd::parse_head`] (header, checksums, metadata, tensor and
/// region tables), then the tokenizer and chat template it describes
/// ([`llmd_tokenizer_and_template`]) and the probe's figures. The input is read twice: as
/// is (the whole input is the file), and with its header and metadata checksums made right and
/// the file length the header claims, so that mutations get past the checksums to the tables.
pub fn llmd(data: &[u8]) {
    llmd_head(data, data.len() as u64);
    if let Some((fixed, file_len)) = with_llmd_checksums(data) {
        llmd_head(&fixed, file_len);
    }
}

fn llmd_head(head: &[u8], file_len: u64) {
    let Ok((_, meta)) = llmd::parse_head(head, file_len) else { return };
    let _ = llmd_tokenizer_and_template(&meta);
    let _ = probe_of_llmd(meta, file_len);
}

/// `data` with the header CRC and the metadata CRC an llmd writer would store, and the file
/// length its header's data offset and length add up to.
fn with_llmd_checksums(data: &[u8]) -> Option<(Vec<u8>, u64)> {
    let mut b = data.to_vec();
    if b.len() < llmd::HEADER_BYTES {
        return None;
    }
    let u64_at = |b: &[u8], o: usize| -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let data_offset = u64_at(&b, 32);
    let data_len = u64_at(&b, 40);
    let meta_end = usize::try_from(data_offset).unwrap_or(usize::MAX).clamp(llmd::HEADER_BYTES, b.len());
    let meta_crc = crc32fast::hash(&b[llmd::HEADER_BYTES..meta_end]);
    b[52..56].copy_from_slice(&meta_crc.to_le_bytes());
    b[12..16].fill(0);
    let head_crc = crc32fast::hash(&b[..llmd::HEADER_BYTES]);
    b[12..16].copy_from_slice(&head_crc.to_le_bytes());
    let file_len = data_offset.checked_add(data_len).unwrap_or(data.len() as u64);
    Some((b, file_len))
}

/// Target `hf`: the HF layout as [`hf::load`] and [`Source::open`] read it. The input is
/// `config.json`, a NUL byte, `tokenizer_config.json` (may be empty), a NUL byte, then one
/// `*.safetensors` file. The configuration is parsed and validated, the safetensors file's
/// tensors mapped to GGUF names, the chat template taken from `tokenizer_config.json`, then
/// the model opened ([`Source::from_hf`], with a small fixed tokenizer: tokenizers have their
/// own target) and loaded.
pub fn hf(data: &[u8]) {
    let (config, rest) = split_nul(data);
    let (tokenizer_config, safetensors) = split_nul(rest);
    let Ok(config) = std::str::from_utf8(config) else { return };
    let parsed = hf::parse_config(config, Path::new("config.json"));
    let mut tensors = TensorMap::new();
    let bytes = Arc::new(ModelBytes::Owned(safetensors.to_vec()));
    let added = hf::add_safetensors(bytes, Path::new("model.safetensors"), &mut tensors);
    let chat_template = std::str::from_utf8(tokenizer_config).ok().and_then(hf::chat_template_of);
    let (Ok(cfg), Ok(())) = (parsed, added) else { return };
    let model = hf::HfModel::new(cfg, tensors, PathBuf::new(), chat_template);
    let Ok(src) = Source::from_hf(model, small_tokenizer().clone()) else { return };
    load(&src);
}

fn split_nul(b: &[u8]) -> (&[u8], &[u8]) {
    match b.iter().position(|&x| x == 0) {
        Some(i) => (&b[..i], &b[i + 1..]),
        None => (b, &[]),
    }
}

/// Target `tokenizer`: a tokenizer built from a model's vocabulary, then used as the generator
/// and `llmctl convert` use it.
///
/// An input starting with `{` is an HF `tokenizer.json`, optionally followed by a NUL byte and
/// `tokenizer_config.json`, and a NUL byte and `config.json` ([`Tokenizer::from_hf_texts`]).
/// Any other input is a GGUF vocabulary written as lines ([`vocabulary`]) and built with
/// [`Tokenizer::from_gguf`], as a GGUF file's `tokenizer.ggml.*` keys are.
///
/// The built tokenizer encodes the input's texts (and a few fixed ones) with and without
/// control tokens, decodes the ids back, and is stored and rebuilt as an llmd file stores it
/// ([`Tokenizer::snapshot`], [`Tokenizer::from_snapshot`]).
pub fn tokenizer(data: &[u8]) {
    let (tk, texts) = if data.first() == Some(&b'{') {
        let (json, rest) = split_nul(data);
        let (tcfg, config) = split_nul(rest);
        let (Ok(json), Ok(tcfg), Ok(config)) =
            (std::str::from_utf8(json), std::str::from_utf8(tcfg), std::str::from_utf8(config))
        else {
            return;
        };
        let tcfg = (!tcfg.is_empty()).then_some(tcfg);
        let eos_sources: Vec<&str> = [config].into_iter().filter(|c| !c.is_empty()).collect();
        (Tokenizer::from_hf_texts(json, tcfg, &eos_sources), Vec::new())
    } else {
        let (metadata, texts) = vocabulary(&String::from_utf8_lossy(data));
        (Tokenizer::from_gguf(&GgufFile::from_metadata(metadata)), texts)
    };
    let Ok(tk) = tk else { return };
    use_tokenizer(&tk, &texts);
    if let Ok(back) = Tokenizer::from_snapshot(tk.snapshot()) {
        use_tokenizer(&back, &texts[..texts.len().min(1)]);
    }
}

/// Texts every tokenizer under test encodes: words, digits, white space, control-token text,
/// byte-fallback material and characters from several scripts.
const TEXTS: &[&str] = &[
    "Hello, world! It's 2025.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  \t\n\n  a  b\r\n12345 3.14159 ÄÖÜ ß",
    "漢字かな交じり文 🙂🚀 \u{0}\u{7f}\u{fffd}",
    "<s></s><unk>▁▁x",
];

fn use_tokenizer(tk: &Tokenizer, texts: &[String]) {
    for text in texts.iter().map(String::as_str).chain(TEXTS.iter().copied()) {
        let _ = tk.has_control_text(text);
        for parse_special in [false, true] {
            if let Ok(ids) = tk.encode(text, parse_special, true) {
                let _ = tk.decode(&ids);
                for &id in &ids {
                    let _ = (tk.token_text(id), tk.is_eog(id));
                }
            }
        }
    }
    let _ = (tk.bos_text(), tk.eos_text(), tk.eog_tokens());
    for id in 0..tk.vocab_size().min(1 << 16) as u32 {
        let _ = tk.token_bytes(id);
    }
}

/// A GGUF vocabulary written as lines, for fuzzing: `KEY VALUE`, one per line.
///
/// ```text
/// model gpt2            tokenizer.ggml.model (gpt2 or llama)
/// pre qwen2             tokenizer.ggml.pre
/// bos 1                 tokenizer.ggml.bos_token_id (also eos, eot, unk)
/// add_bos true          tokenizer.ggml.add_bos_token (also add_space_prefix)
/// t 1 -1.5 hello        a token: its type, its score, its text
/// m h ello              a merge
/// merges                write tokenizer.ggml.merges even when there is no merge
/// notypes               leave tokenizer.ggml.token_type out (also noscores)
/// e some text           a text to encode
/// ```
///
/// Texts are escaped: `\n`, `\r`, `\t`, `\\` and `\xHH` (a byte). Returns the metadata and
/// the texts to encode.
pub fn vocabulary(text: &str) -> (BTreeMap<String, Value>, Vec<String>) {
    let mut m = BTreeMap::new();
    let (mut tokens, mut types, mut scores, mut merges, mut texts) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut with_merges, mut with_types, mut with_scores) = (false, true, true);
    for line in text.lines() {
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        let mut set = |k: &str, v: Value| {
            m.insert(format!("tokenizer.ggml.{k}"), v);
        };
        match key {
            "model" | "pre" => set(key, Value::String(unescape(rest))),
            "bos" | "eos" | "eot" | "unk" => {
                if let Ok(v) = rest.trim().parse::<i64>() {
                    let k = format!("{key}_token_id");
                    set(&k, u32::try_from(v).map_or(Value::I64(v), Value::U32));
                }
            }
            "add_bos" => set("add_bos_token", Value::Bool(rest.trim() == "true")),
            "add_space_prefix" => set(key, Value::Bool(rest.trim() == "true")),
            "t" => {
                let mut it = rest.splitn(3, ' ');
                types.push(it.next().and_then(|t| t.parse::<i32>().ok()).unwrap_or(1));
                scores.push(it.next().and_then(|s| s.parse::<f32>().ok()).unwrap_or(0.0));
                tokens.push(unescape(it.next().unwrap_or("")));
            }
            "m" => merges.push(unescape(rest)),
            "merges" => with_merges = true,
            "notypes" => with_types = false,
            "noscores" => with_scores = false,
            "e" => texts.push(unescape(rest)),
            _ => {}
        }
    }
    if !tokens.is_empty() {
        m.insert("tokenizer.ggml.tokens".into(), Value::Array(Array::String(tokens)));
        if with_types {
            m.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(types)));
        }
        if with_scores {
            m.insert("tokenizer.ggml.scores".into(), Value::Array(Array::F32(scores)));
        }
    }
    if with_merges || !merges.is_empty() {
        m.insert("tokenizer.ggml.merges".into(), Value::Array(Array::String(merges)));
    }
    (m, texts)
}

fn unescape(s: &str) -> String {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 1 < b.len() {
            let (byte, used) = match b[i + 1] {
                b'n' => (b'\n', 2),
                b'r' => (b'\r', 2),
                b't' => (b'\t', 2),
                b'\\' => (b'\\', 2),
                b'x' => match s.get(i + 2..i + 4).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => (v, 4),
                    None => (b'\\', 1),
                },
                _ => (b'\\', 1),
            };
            out.push(byte);
            i += used;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A small byte-level BPE tokenizer with ChatML and Llama-3 control tokens, built once (for
/// the targets that need a tokenizer but do not fuzz it).
fn small_tokenizer() -> &'static Tokenizer {
    static TK: OnceLock<Tokenizer> = OnceLock::new();
    TK.get_or_init(|| {
        let mut chars: Vec<(char, u8)> = crate::tokenizer::gpt2_char_to_byte().into_iter().collect();
        chars.sort_by_key(|&(_, b)| b);
        let mut vocab = String::from("model gpt2\npre qwen2\nmerges\nadd_bos false\n");
        for (c, _) in chars {
            let escaped = match c {
                '\\' => "\\\\".to_string(),
                c => c.to_string(),
            };
            vocab.push_str(&format!("t 1 0 {escaped}\n"));
        }
        let control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"];
        let control2 = ["<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"];
        for c in control.iter().chain(&control2) {
            vocab.push_str(&format!("t 3 0 {c}\n"));
        }
        // <|begin_of_text|> is BOS, <|im_end|> EOS.
        vocab.push_str("bos 259\neos 258\n");
        let (metadata, _) = vocabulary(&vocab);
        Tokenizer::from_gguf(&GgufFile::from_metadata(metadata)).expect("the fixed vocabulary builds")
    })
}

/// Called once by every fuzz binary before it fuzzes (`fuzz_target!(init: ...)`), and by the
/// replay tests' own way (they set llmd as the sandbox). Started with [`SANDBOX_ARG`], the
/// binary is the chat-template sandbox and exits with its status; otherwise it sets itself as
/// the sandbox, so model files' templates render out of process as in llmd
/// ([`crate::chat::set_sandbox`]). libFuzzer calls this before it reads its flags, and ignores
/// flags that start with `--`.
pub fn init() {
    if std::env::args_os().nth(1).is_some_and(|a| a == SANDBOX_ARG) {
        std::process::exit(crate::chat::sandbox_child_main());
    }
    if let Ok(program) = std::env::current_exe() {
        crate::chat::set_sandbox(Sandbox { program, args: vec![SANDBOX_ARG.into()] });
    }
}

/// Target `chat_template`: a chat template and a conversation, both hostile. The input is the
/// template's source, then messages, each after a NUL byte as `role`, a newline and the
/// content (no newline: a user message).
///
/// First as llmd takes a model's template: compiled ([`ChatTemplate::new`]) and the chat
/// tokenized as a request's is ([`generate::chat_tokens`]: control tokens only from the
/// template's own text, with a small ChatML tokenizer), both rendering in the sandbox set by
/// [`init`]. A template that goes past the sandbox's CPU, memory or time is stopped there: the
/// product's answer, and the end of this input (minijinja has no bound on some operations, such
/// as printing a sequence repeated 10^10 times, so such a template would hang this process).
/// A template the sandbox rendered within its bounds is then compiled and rendered again in
/// this process (where the fuzzer sees its coverage) and must give the same tokens, or an
/// error again.
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or("");
    let messages: Vec<ChatMessage> = parts
        .map(|p| match p.split_once('\n') {
            Some((role, content)) => ChatMessage::new(role, content),
            None => ChatMessage::new("user", p),
        })
        .collect();
    let Ok(tmpl) = ChatTemplate::new(source) else { return };
    let sandboxed = generate::chat_tokens(small_tokenizer(), &tmpl, &messages);
    if matches!(sandboxed, Err(GenerateError::ChatTemplate(ChatTemplateError::Sandbox(_)))) {
        return;
    }
    let here = match tmpl.in_process() {
        Ok(t) => generate::chat_tokens(small_tokenizer(), &t, &messages),
        Err(e) => Err(e.into()),
    };
    match (&sandboxed, &here) {
        (Ok(a), Ok(b)) => {
            // The clock differs between the two renderings.
            assert!(a == b || source.contains("strftime_now"), "the sandbox and this process tokenize differently")
        }
        (Err(_), Err(_)) => {}
        _ => panic!(
            "the sandbox and this process disagree: {:?} there, {:?} here",
            sandboxed.map(|t| t.len()),
            here.map(|t| t.len())
        ),
    }
}
