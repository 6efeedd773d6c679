//! Tokenizer: the `tokenizers` crate, built from a GGUF vocabulary (GPT-2 byte-level BPE or
//! SentencePiece-style "llama" BPE) or loaded from an HF `tokenizer.json`.
//!
//! Both routes produce a `tokenizer.json` document, so one code path serves both. Pre-tokenizer
//! regexes are llama.cpp's for each `tokenizer.ggml.pre` name, so ids match llama.cpp's.
//! Decoding goes through a per-token byte table, which lets the generator stream text without
//! ever splitting a UTF-8 character.

use crate::error::TokenizerError;
use crate::format::gguf::GgufFile;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts that end a turn in common chat formats (as llama.cpp's end-of-generation set).
const EOG_TEXTS: &[&str] =
    &["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "</s>"];

/// GGUF token types.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_BYTE: i64 = 6;

pub use crate::format::llmd::TokenizerSnapshot;

#[derive(Clone)]
pub struct Tokenizer {
    /// Splits special (control) tokens out of the text.
    full: tokenizers::Tokenizer,
    /// The `tokenizer.json` document this tokenizer was built from.
    hf_json: String,
    /// Treats special-token text as plain text (user-defined tokens are still matched).
    plain: tokenizers::Tokenizer,
    /// The bytes each token stands for when decoded (empty for control tokens).
    pieces: Vec<Vec<u8>>,
    texts: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Whether prompts get a BOS token prepended.
    pub add_bos: bool,
    eog: Vec<u32>,
    /// The texts of the special (control) tokens that [`Self::encode`] with `parse_special`
    /// turns into those tokens.
    control_texts: Vec<String>,
}

fn tok_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Backend(e.to_string())
}

/// GPT-2's byte ↔ printable-character table: which byte each character of a byte-level token stands for.
pub(crate) fn gpt2_char_to_byte() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// Pre-tokenizer and `ignore_merges` for a llama.cpp `tokenizer.ggml.pre` name.
fn byte_level_pre(pre: &str) -> Result<(Json, bool), TokenizerError> {
    let regexes: Vec<&str> = match pre {
        "default" | "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "mpt" | "olmo" | "jais" => vec![GPT2_REGEX],
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2_REGEX]
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => vec![LLAMA3_REGEX],
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "hunyuan" | "megrez" => vec![QWEN2_REGEX],
        other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_owned())),
    };
    let mut seq: Vec<Json> = regexes.into_iter().map(split).collect();
    seq.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}));
    let ignore_merges = matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral");
    Ok((json!({"type": "Sequence", "pretokenizers": seq}), ignore_merges))
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's `tokenizer.ggml.*` keys.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TokenizerError> {
        let bad = |s: &str| TokenizerError::BadVocabulary(s.to_owned());
        let model = g
            .get("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad("tokenizer.ggml.model is missing"))?;
        let tokens: Vec<String> = g
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .and_then(|a| a.as_strings())
            .ok_or_else(|| bad("tokenizer.ggml.tokens is missing or not an array of strings"))?
            .to_vec();
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(bad("empty vocabulary"));
        }
        let types: Vec<i64> =
            match g.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()).and_then(|a| a.to_f64()) {
                Some(a) if a.len() == tokens.len() => a.iter().map(|&v| v as i64).collect(),
                Some(_) => return Err(bad("token_type length differs from the vocabulary")),
                None => vec![1; tokens.len()],
            };
        let id_key = |k: &str| -> Result<Option<u32>, TokenizerError> {
            match g.get(k).and_then(|v| v.as_u64()) {
                Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
                Some(id) => Err(TokenizerError::TokenOutOfRange { id: id as u32, vocab: tokens.len() }),
                None => Ok(None),
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        let unk = id_key("tokenizer.ggml.unknown_token_id")?;
        let add_bos_key = g.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool());

        let vocab: serde_json::Map<String, Json> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        let added: Vec<Json> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(i, &t)| added_token(i as u32, &tokens[i], t == TOKEN_TYPE_CONTROL))
            .collect();

        let (doc, pieces, add_bos_default) = match model {
            "gpt2" => {
                let merges = gguf_merges(g)?;
                let pre = g.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
                let (pre_tok, ignore_merges) = byte_level_pre(pre)?;
                let c2b = gpt2_char_to_byte();
                let pieces = tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, &ty)| match ty {
                        TOKEN_TYPE_CONTROL => Vec::new(),
                        TOKEN_TYPE_USER_DEFINED => t.as_bytes().to_vec(),
                        _ => t.chars().map(|c| c2b.get(&c).copied().unwrap_or(b'?')).collect(),
                    })
                    .collect();
                let doc = json!({
                    "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                    "normalizer": null, "pre_tokenizer": pre_tok, "post_processor": null,
                    "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
                    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                              "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
                });
                (doc, pieces, false)
            }
            "llama" => {
                let scores: Vec<f32> =
                    match g.get("tokenizer.ggml.scores").and_then(|v| v.as_array()).and_then(|a| a.to_f64()) {
                        Some(a) if a.len() == tokens.len() => a.iter().map(|&v| v as f32).collect(),
                        _ => return Err(bad("tokenizer.ggml.scores is missing or of the wrong length")),
                    };
                let merges = spm_merges(&tokens, &types, &scores);
                let add_space_prefix =
                    g.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.as_bool()).unwrap_or(true);
                let mut norm = vec![];
                if add_space_prefix {
                    norm.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
                }
                norm.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
                let pieces = tokens.iter().zip(&types).map(|(t, &ty)| spm_piece(t, ty)).collect();
                let unk_token = unk.map(|u| tokens[u as usize].clone());
                let doc = json!({
                    "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
                    "normalizer": {"type": "Sequence", "normalizers": norm}, "pre_tokenizer": null, "post_processor": null,
                    "decoder": null,
                    "model": {"type": "BPE", "dropout": null, "unk_token": unk_token, "continuing_subword_prefix": null,
                              "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                              "ignore_merges": false, "vocab": vocab, "merges": merges},
                });
                (doc, pieces, true)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        let mut eog: Vec<u32> = [eos, eot].into_iter().flatten().collect();
        for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL && EOG_TEXTS.contains(&t.as_str()) && !eog.contains(&(i as u32)) {
                eog.push(i as u32);
            }
        }
        Self::from_json(doc.to_string(), pieces, tokens, bos, eos, add_bos_key.unwrap_or(add_bos_default), eog)
    }

    /// Loads an HF `tokenizer.json`, with BOS/EOS and `add_bos_token` from `tokenizer_config.json`
    /// and `eos_token_id` from `config.json` / `generation_config.json` beside it, when present.
    pub fn from_hf(path: &Path) -> Result<Self, TokenizerError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| TokenizerError::Backend(format!("{}: {e}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let eos_sources: Vec<String> =
            [read("generation_config.json"), read("config.json")].into_iter().flatten().collect();
        let eos_sources: Vec<&str> = eos_sources.iter().map(String::as_str).collect();
        Self::from_hf_texts(&text, read("tokenizer_config.json").as_deref(), &eos_sources)
    }

    /// [`Self::from_hf`] from the files' texts: `tokenizer.json`, `tokenizer_config.json` if
    /// present, and the files that may name `eos_token_id` (`generation_config.json`,
    /// `config.json`) in that order. The optional files are ignored when they are not JSON.
    pub fn from_hf_texts(
        text: &str,
        tokenizer_config: Option<&str>,
        eos_sources: &[&str],
    ) -> Result<Self, TokenizerError> {
        let doc: Json = serde_json::from_str(text).map_err(tok_err)?;
        let probe = load_tokenizer_json(text)?;
        let n = probe.get_vocab_size(true);
        let mut texts = vec![String::new(); n];
        for (t, id) in probe.get_vocab(true) {
            if let Some(slot) = texts.get_mut(id as usize) {
                *slot = t;
            }
        }
        let special: std::collections::HashSet<u32> =
            probe.get_added_tokens_decoder().iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let byte_level = doc.get("decoder").is_some_and(|d| d.to_string().contains("\"ByteLevel\""));
        let c2b = gpt2_char_to_byte();
        let pieces = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if special.contains(&(i as u32)) {
                    Vec::new()
                } else if byte_level {
                    t.chars().map(|c| c2b.get(&c).copied().unwrap_or(b'?')).collect()
                } else {
                    let is_byte = t.len() == 6 && t.starts_with("<0x") && t.ends_with('>');
                    spm_piece(t, if is_byte { TOKEN_TYPE_BYTE } else { 1 })
                }
            })
            .collect();
        let json = |t: &str| serde_json::from_str::<Json>(t).ok();
        let tcfg = tokenizer_config.and_then(json);
        let token_of = |v: Option<&Json>| -> Option<u32> {
            let s = v.and_then(|v| v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str())))?;
            probe.token_to_id(s)
        };
        let bos = token_of(tcfg.as_ref().and_then(|c| c.get("bos_token")));
        let mut eos = token_of(tcfg.as_ref().and_then(|c| c.get("eos_token")));
        let bos_text = bos.and_then(|b| texts.get(b as usize)).cloned().unwrap_or_default();
        let add_bos = tcfg
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or_else(|| post_processor_prepends(doc.get("post_processor"), &bos_text));
        let mut eog: Vec<u32> = eos.into_iter().collect();
        for cfg in eos_sources.iter().filter_map(|t| json(t)) {
            let ids: Vec<u64> = match cfg.get("eos_token_id") {
                Some(Json::Number(x)) => x.as_u64().into_iter().collect(),
                Some(Json::Array(a)) => a.iter().filter_map(|x| x.as_u64()).collect(),
                _ => vec![],
            };
            for id in ids.into_iter().filter(|&id| (id as usize) < n).map(|id| id as u32) {
                eos.get_or_insert(id);
                if !eog.contains(&id) {
                    eog.push(id);
                }
            }
        }
        for &id in &special {
            // An added token may carry an id past the vocabulary the model's rows cover (the
            // fuzzer's crash-b35ca740: an index out of bounds here); such a token ends nothing.
            let ends = texts.get(id as usize).is_some_and(|t| EOG_TEXTS.contains(&t.as_str()));
            if ends && !eog.contains(&id) {
                eog.push(id);
            }
        }
        Self::from_json(doc.to_string(), pieces, texts, bos, eos, add_bos, eog)
    }

    /// Builds the tokenizer once from its `tokenizer.json` text; the plain variant is a copy
    /// that treats special-token text as text (`encode_special_tokens`), user-defined added
    /// tokens still matched.
    fn from_json(
        hf_json: String,
        pieces: Vec<Vec<u8>>,
        texts: Vec<String>,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: bool,
        eog: Vec<u32>,
    ) -> Result<Self, TokenizerError> {
        let full = load_tokenizer_json(&hf_json)?;
        let mut plain = full.clone();
        plain.set_encode_special_tokens(true);
        let control_texts = full
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        Ok(Self { full, hf_json, plain, pieces, texts, bos, eos, add_bos, eog, control_texts })
    }

    /// Everything this tokenizer was built from, to store it in another file (`llmctl convert`).
    pub fn snapshot(&self) -> TokenizerSnapshot {
        TokenizerSnapshot {
            hf_json: self.hf_json.clone(),
            pieces: self.pieces.iter().map(|p| p.iter().map(|b| format!("{b:02x}")).collect()).collect(),
            texts: self.texts.clone(),
            bos: self.bos,
            eos: self.eos,
            add_bos: self.add_bos,
            eog: self.eog.clone(),
        }
    }

    /// Rebuilds a tokenizer from a [`Self::snapshot`], checking it as it goes.
    pub fn from_snapshot(s: TokenizerSnapshot) -> Result<Self, TokenizerError> {
        let bad = |m: String| TokenizerError::BadVocabulary(m);
        if s.pieces.len() != s.texts.len() {
            return Err(bad(format!("{} pieces for {} tokens", s.pieces.len(), s.texts.len())));
        }
        let n = s.texts.len();
        let pieces = s
            .pieces
            .iter()
            .map(|h| {
                if h.len() % 2 != 0 || !h.is_ascii() {
                    return Err(bad(format!("token bytes {h:?} are not hex")));
                }
                (0..h.len())
                    .step_by(2)
                    .map(|i| {
                        u8::from_str_radix(&h[i..i + 2], 16).map_err(|_| bad(format!("token bytes {h:?} are not hex")))
                    })
                    .collect()
            })
            .collect::<Result<Vec<Vec<u8>>, _>>()?;
        for id in s.bos.iter().chain(&s.eos).chain(&s.eog) {
            if *id as usize >= n {
                return Err(bad(format!("special token id {id} outside the vocabulary of {n}")));
            }
        }
        Self::from_json(s.hf_json, pieces, s.texts, s.bos, s.eos, s.add_bos, s.eog)
    }

    /// This tokenizer as an HF `tokenizer.json` document (e.g. to export a GGUF model's).
    pub fn hf_json(&self) -> &str {
        &self.hf_json
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Whether `text` holds the text of a control token (which `encode` with `parse_special`
    /// would turn into that token).
    pub fn has_control_text(&self, text: &str) -> bool {
        self.control_texts.iter().any(|c| text.contains(c.as_str()))
    }

    /// Token ids for `text`. With `parse_special`, control-token text such as `<|im_start|>`
    /// becomes that token (for rendered chat templates); without, it is tokenized as text.
    pub fn encode(&self, text: &str, parse_special: bool, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        let t = if parse_special { &self.full } else { &self.plain };
        let enc = t.encode_fast(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The bytes a token decodes to (empty for control tokens).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .ok_or(TokenizerError::TokenOutOfRange { id, vocab: self.pieces.len() })
    }

    /// The vocabulary text of a token (as stored in the model).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// Text of a sequence of tokens; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Whether a token ends generation (EOS, end of turn).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    /// The BOS token's text, for chat templates.
    pub fn bos_text(&self) -> &str {
        self.bos.and_then(|b| self.token_text(b)).unwrap_or("")
    }

    /// The EOS token's text, for chat templates.
    pub fn eos_text(&self) -> &str {
        self.eos.and_then(|b| self.token_text(b)).unwrap_or("")
    }
}

/// A BPE `tokenizer.json` (already parsed) built the fast way: the model from its vocabulary
/// and merges through `BPE::builder`, the rest (normalizer, pre-tokenizer, decoder, …) by the
/// crate's own deserializer around a placeholder model, then the added tokens. The same
/// tokenizer as `Tokenizer::from_str` (its serialization is identical: tested), built in a
/// fraction of the time — the crate deserializes its model through serde's buffered untagged
/// path, 0.3–0.4 s of a 1.5B model's cold start for a 151,936-token vocabulary. None for
/// anything else, or anything unexpected, which then takes the crate's path (and its errors).
fn bpe_from_doc(doc: &Json) -> Option<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::{Vocab, BPE};
    let model = doc.get("model")?;
    if model.get("type")?.as_str()? != "BPE" {
        return None;
    }
    let vocab_doc = model.get("vocab")?.as_object()?;
    let mut vocab = Vocab::with_capacity(vocab_doc.len());
    for (k, v) in vocab_doc {
        vocab.insert(k.clone(), u32::try_from(v.as_u64()?).ok()?);
    }
    let mut merges = Vec::new();
    for m in model.get("merges")?.as_array()? {
        match m {
            Json::Array(pair) if pair.len() == 2 => {
                merges.push((pair[0].as_str()?.to_owned(), pair[1].as_str()?.to_owned()))
            }
            Json::String(line) if line.starts_with("#version") => {}
            Json::String(line) => {
                let mut parts = line.split(' ');
                let (a, b) = (parts.next()?, parts.next()?);
                if parts.next().is_some() {
                    return None;
                }
                merges.push((a.to_owned(), b.to_owned()));
            }
            _ => return None,
        }
    }
    let opt_str = |k: &str| model.get(k).and_then(Json::as_str).map(str::to_owned);
    let opt_bool = |k: &str| model.get(k).and_then(Json::as_bool);
    let mut b = BPE::builder().vocab_and_merges(vocab, merges);
    if let Some(d) = model.get("dropout").and_then(Json::as_f64) {
        b = b.dropout(d as f32);
    }
    if let Some(u) = opt_str("unk_token") {
        b = b.unk_token(u);
    }
    if let Some(p) = opt_str("continuing_subword_prefix") {
        b = b.continuing_subword_prefix(p);
    }
    if let Some(s) = opt_str("end_of_word_suffix") {
        b = b.end_of_word_suffix(s);
    }
    if let Some(f) = opt_bool("fuse_unk") {
        b = b.fuse_unk(f);
    }
    if let Some(f) = opt_bool("byte_fallback") {
        b = b.byte_fallback(f);
    }
    if let Some(f) = opt_bool("ignore_merges") {
        b = b.ignore_merges(f);
    }
    let bpe = b.build().ok()?;
    let mut rest = serde_json::Map::new();
    for (k, v) in doc.as_object()? {
        match k.as_str() {
            "model" => {
                rest.insert(k.clone(), serde_json::json!({ "type": "BPE", "vocab": {}, "merges": [] }));
            }
            "added_tokens" => {
                rest.insert(k.clone(), Json::Array(Vec::new()));
            }
            _ => {
                rest.insert(k.clone(), v.clone());
            }
        }
    }
    let mut t: tokenizers::Tokenizer = serde_json::from_value(Json::Object(rest)).ok()?;
    t.with_model(bpe);
    let added: Vec<tokenizers::AddedToken> = match doc.get("added_tokens") {
        Some(a) => serde_json::from_value(a.clone()).ok()?,
        None => Vec::new(),
    };
    t.add_tokens(&added);
    Some(t)
}

/// A `tokenizer.json` loaded by the `tokenizers` crate, without letting a malformed one reach
/// the places where that crate (0.21) panics instead of failing: a syntax error inside the
/// decoder (found by the `llmd` fuzz target), a `Precompiled` normalizer whose character map
/// does not load, a `FixedLength` pre-tokenizer of length 0, truncation whose stride is not
/// below its length. What llmd does not use is dropped: post-processors add BOS themselves
/// (llmd adds it explicitly), and truncation and padding are the daemon's limits' business.
fn load_tokenizer_json(text: &str) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let doc: Json = serde_json::from_str(text).map_err(tok_err)?;
    let bad = |m: String| Err(TokenizerError::BadVocabulary(m));
    let mut normalizers: Vec<&Json> = doc.get("normalizer").into_iter().collect();
    while let Some(n) = normalizers.pop() {
        match n.get("type").and_then(Json::as_str) {
            Some("Sequence") => normalizers.extend(n.get("normalizers").and_then(Json::as_array).into_iter().flatten()),
            Some("Precompiled") => {
                if let Err(e) = serde_json::from_value::<tokenizers::normalizers::Precompiled>(n.clone()) {
                    return bad(format!("the Precompiled normalizer does not load: {e}"));
                }
            }
            _ => {}
        }
    }
    let mut pre: Vec<&Json> = doc.get("pre_tokenizer").into_iter().collect();
    while let Some(p) = pre.pop() {
        match p.get("type").and_then(Json::as_str) {
            Some("Sequence") => pre.extend(p.get("pretokenizers").and_then(Json::as_array).into_iter().flatten()),
            Some("FixedLength") if p.get("length").and_then(Json::as_u64) == Some(0) => {
                return bad("a FixedLength pre-tokenizer of length 0".into());
            }
            _ => {}
        }
    }
    let mut t = match bpe_from_doc(&doc) {
        Some(t) => t,
        None => tokenizers::Tokenizer::from_str(text).map_err(tok_err)?,
    };
    t.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
    t.with_truncation(None).map_err(tok_err)?;
    t.with_padding(None);
    Ok(t)
}

/// Whether a `tokenizer.json` post-processor puts `bos` first (how Llama 3 style tokenizers
/// add BOS when `tokenizer_config.json` does not say `add_bos_token`).
fn post_processor_prepends(pp: Option<&Json>, bos: &str) -> bool {
    let Some(pp) = pp else { return false };
    if bos.is_empty() {
        return false;
    }
    match pp.get("type").and_then(|t| t.as_str()) {
        Some("TemplateProcessing") => pp
            .get("single")
            .and_then(|s| s.as_array())
            .and_then(|s| s.first())
            .and_then(|first| first.get("SpecialToken"))
            .and_then(|t| t.get("id"))
            .and_then(|id| id.as_str())
            .is_some_and(|id| id == bos),
        Some("Sequence") => pp
            .get("processors")
            .and_then(|p| p.as_array())
            .is_some_and(|ps| ps.iter().any(|p| post_processor_prepends(Some(p), bos))),
        _ => false,
    }
}

fn added_token(id: u32, content: &str, special: bool) -> Json {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": special})
}

fn gguf_merges(g: &GgufFile) -> Result<Vec<Json>, TokenizerError> {
    let merges = g
        .get("tokenizer.ggml.merges")
        .and_then(|v| v.as_array())
        .and_then(|a| a.as_strings())
        .ok_or_else(|| TokenizerError::BadVocabulary("tokenizer.ggml.merges is missing or not strings".into()))?;
    merges
        .iter()
        .map(|s| {
            let (a, b) =
                s.split_once(' ').ok_or_else(|| TokenizerError::BadVocabulary(format!("merge {s:?} has no space")))?;
            Ok(json!([a, b]))
        })
        .collect()
}

/// Merges equivalent to SentencePiece's score-driven BPE: every way of building a vocabulary
/// token from two vocabulary tokens, ranked by the built token's score (highest first).
fn spm_merges(tokens: &[String], types: &[i64], scores: &[f32]) -> Vec<Json> {
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if types[i] != 1 || t.chars().count() < 2 {
            continue;
        }
        for (cut, _) in t.char_indices().skip(1) {
            if let (Some(&a), Some(&b)) = (index.get(&t[..cut]), index.get(&t[cut..])) {
                merges.push((scores[i], i, a, b));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    merges.into_iter().map(|(_, _, a, b)| json!([tokens[a], tokens[b]])).collect()
}

fn spm_piece(t: &str, ty: i64) -> Vec<u8> {
    match ty {
        TOKEN_TYPE_CONTROL => Vec::new(),
        TOKEN_TYPE_BYTE => t
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .map(|b| vec![b])
            .unwrap_or_default(),
        _ => t.replace('\u{2581}', " ").into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast BPE build is the `tokenizers` crate's own tokenizer: the same serialization
    /// and the same ids, for every BPE vocabulary in the repository (the default model's
    /// GPT-2 style, the tiny fixtures': qwen2 BPE, and SentencePiece converted to BPE with byte
    /// fallback), and for both merge notations.
    #[test]
    fn the_fast_bpe_build_equals_the_crates_own() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut docs = Vec::new();
        for f in [
            "models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "tests/fixtures/tiny-qwen2.gguf",
            "tests/fixtures/tiny-llama-spm.gguf",
            "tests/fixtures/tiny-qwen2-q4km.gguf",
        ] {
            let p = root.join(f);
            if !p.is_file() {
                assert!(f.starts_with("models/"), "{f} is missing");
                continue;
            }
            docs.push((f.to_string(), crate::Source::open(&p).expect("opens").tokenizer.hf_json().to_owned()));
        }
        // The same vocabulary with its merges as "a b" lines (the older notation).
        let (_, first) = docs.last().cloned().expect("a document");
        let mut legacy: Json = serde_json::from_str(&first).expect("JSON");
        let lines: Vec<Json> = legacy["model"]["merges"]
            .as_array()
            .expect("merges")
            .iter()
            .map(|m| match m {
                Json::Array(p) => Json::String(format!("{} {}", p[0].as_str().expect("a"), p[1].as_str().expect("b"))),
                other => other.clone(),
            })
            .collect();
        legacy["model"]["merges"] = Json::Array(lines);
        docs.push(("legacy merges".into(), legacy.to_string()));
        for (name, text) in docs {
            let doc: Json = serde_json::from_str(&text).expect("JSON");
            let fast = bpe_from_doc(&doc).unwrap_or_else(|| panic!("{name}: a BPE document builds the fast way"));
            let slow = tokenizers::Tokenizer::from_str(&text).expect("the crate builds it");
            assert_eq!(fast.to_string(false).expect("json"), slow.to_string(false).expect("json"), "{name}");
            for s in ["Hello, world! 123", " the  quick\nbrown fox ✓ 東京", "<|im_start|>user\nhi<|im_end|>", ""] {
                let a = fast.encode(s, false).expect("encodes");
                let b = slow.encode(s, false).expect("encodes");
                assert_eq!(a.get_ids(), b.get_ids(), "{name}: {s:?}");
            }
        }
        // Not BPE, or not what the builder expects: the crate's own path.
        assert!(bpe_from_doc(&json!({"model": {"type": "WordPiece", "vocab": {}}})).is_none());
        assert!(bpe_from_doc(&json!({"model": {"type": "BPE", "vocab": {"a": -1}, "merges": []}})).is_none());
        assert!(bpe_from_doc(&json!({"model": {"type": "BPE", "vocab": {}, "merges": ["a b c"]}})).is_none());
    }

    #[test]
    fn a_template_post_processor_means_bos_is_added() {
        let llama3 = json!({"type": "Sequence", "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]}
        ]});
        assert!(post_processor_prepends(Some(&llama3), "<|begin_of_text|>"));
        assert!(!post_processor_prepends(Some(&llama3), "<s>"));
        assert!(!post_processor_prepends(Some(&json!({"type": "ByteLevel"})), "<s>"));
        assert!(!post_processor_prepends(None, "<s>"));
    }

    /// A small valid `tokenizer.json` with `edit` applied to its document.
    fn tokenizer_json(edit: impl FnOnce(&mut Json)) -> String {
        let mut doc = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
        });
        edit(&mut doc);
        doc.to_string()
    }

    #[test]
    fn a_tokenizer_json_that_panics_the_tokenizers_crate_is_an_error() {
        let ok = Tokenizer::from_hf_texts(&tokenizer_json(|_| {}), None, &[]).expect("valid");
        assert_eq!(ok.encode("abab", false, false).expect("encodes"), [2, 2]);
        // A syntax error inside the decoder: tokenizers 0.21 panicked ("Helper"), found by the
        // llmd fuzz target in a tokenizer stored in an llmd file.
        let syntax = tokenizer_json(|d| d["decoder"] = json!({"type": "ByteLevel", "trim_offsets": false}))
            .replace("\"trim_offsets\":false", "\"trim_offsets\":fajse");
        assert!(syntax.contains("fajse"));
        let snapshot = |hf_json: String| TokenizerSnapshot {
            hf_json,
            pieces: vec!["61".into(), "62".into(), "6162".into()],
            texts: vec!["a".into(), "b".into(), "ab".into()],
            bos: None,
            eos: None,
            add_bos: false,
            eog: vec![],
        };
        assert!(Tokenizer::from_snapshot(snapshot(syntax.clone())).is_err());
        assert!(Tokenizer::from_hf_texts(&syntax, None, &[]).is_err());
        // A Precompiled normalizer whose character map does not load (panicked: "Precompiled").
        let precompiled = tokenizer_json(|d| {
            d["normalizer"] = json!({"type": "Sequence", "normalizers": [
                {"type": "Precompiled", "precompiled_charsmap": "AAAA"}]})
        });
        assert!(matches!(
            Tokenizer::from_snapshot(snapshot(precompiled)),
            Err(TokenizerError::BadVocabulary(m)) if m.contains("Precompiled")
        ));
        // A FixedLength pre-tokenizer of length 0 (panicked at encode: `chunks(0)`).
        let fixed = tokenizer_json(|d| d["pre_tokenizer"] = json!({"type": "FixedLength", "length": 0}));
        assert!(Tokenizer::from_snapshot(snapshot(fixed)).is_err());
        // Truncation whose stride is not below its length (panicked at encode); llmd drops it.
        let trunc = tokenizer_json(|d| {
            d["truncation"] = json!({"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 4})
        });
        let t = Tokenizer::from_snapshot(snapshot(trunc)).expect("loads");
        assert_eq!(t.encode("abab", false, false).expect("encodes"), [2, 2]);
    }

    #[test]
    fn gpt2_byte_table_covers_every_byte_once() {
        let t = gpt2_char_to_byte();
        assert_eq!(t.len(), 256);
        let mut seen = [false; 256];
        for &b in t.values() {
            seen[b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(t[&'\u{120}'], b' ', "Ġ is the space byte");
    }
}
