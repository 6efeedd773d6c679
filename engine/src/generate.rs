//! Generation: prompt → tokens → chunked prefill → decode loop → streamed text.
//!
//! Text is streamed as whole UTF-8 characters only; text that might be the start of a stop
//! sequence is held back until it is known not to be one.

use crate::chat::ChatMessage;
use crate::error::GenerateError;
use crate::model::kv::KvCache;
use crate::sampling::{Sampler, SamplingParams};
use crate::Model;
use std::time::{Duration, Instant};

/// Tokens per prefill chunk (each chunk is one bounded unit of work).
pub const DEFAULT_PREFILL_CHUNK: usize = 256;
/// Longest stop sequence accepted, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Raw text, tokenized as is (special-token text is not parsed).
    Text(String),
    /// A conversation, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
}

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-generation token.
    Eos,
    /// `max_tokens` were generated.
    Length,
    /// A stop sequence appeared.
    Stop,
    /// The context window is full.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Request start to the first generated token.
    pub time_to_first_token: Duration,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub finish: FinishReason,
}

impl GenerationStats {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    /// Decode rate over the tokens after the first (the first comes out of prefill).
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Whether the consumer wants more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// Turns token bytes into text that is safe to show: whole characters, stop sequences cut.
pub struct TextStream {
    pending: Vec<u8>,
    stop: Vec<String>,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        Self { pending: Vec::new(), stop }
    }

    /// Adds bytes; returns the text now safe to emit and whether a stop sequence was hit.
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        self.pending.extend_from_slice(bytes);
        // Whole valid characters; a truncated tail waits, an invalid sequence becomes U+FFFD.
        let (mut text, rest) = decode_prefix(&self.pending);
        for s in &self.stop {
            if let Some(at) = text.find(s.as_str()) {
                text.truncate(at);
                self.pending.clear();
                return (text, true);
            }
        }
        let hold = self.stop.iter().map(|s| longest_suffix_prefix(&text, s)).max().unwrap_or(0);
        let emit_len = text.len() - hold;
        let held: Vec<u8> = text.as_bytes()[emit_len..].to_vec();
        text.truncate(emit_len);
        let mut pending = held;
        pending.extend_from_slice(&self.pending[self.pending.len() - rest..]);
        self.pending = pending;
        (text, false)
    }

    /// Whatever is left at the end (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Longest valid-UTF-8 prefix as text (invalid bytes replaced), and how many trailing bytes
/// form an incomplete character that may still be completed.
fn decode_prefix(b: &[u8]) -> (String, usize) {
    let mut out = String::new();
    let mut rest = b;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                return (out, 0);
            }
            Err(e) => {
                let (good, bad) = rest.split_at(e.valid_up_to());
                out.push_str(std::str::from_utf8(good).unwrap_or_default());
                match e.error_len() {
                    None => return (out, bad.len()),
                    Some(n) => {
                        out.push('\u{FFFD}');
                        rest = &bad[n..];
                    }
                }
            }
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on char boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

impl Model {
    /// Token ids of a prompt: chat prompts go through the chat template and have their
    /// special tokens parsed; raw text does not.
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<Vec<u32>, GenerateError> {
        let tk = &self.tokenizer;
        let ids = match prompt {
            Prompt::Text(t) => tk.encode(t, false, tk.add_bos)?,
            Prompt::Chat(messages) => self.chat_tokens(messages)?,
        };
        if ids.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        Ok(ids)
    }

    /// [`chat_tokens`] with this model's tokenizer and template.
    fn chat_tokens(&self, messages: &[crate::chat::ChatMessage]) -> Result<Vec<u32>, GenerateError> {
        let tmpl = self.chat_template.as_ref().ok_or(crate::error::ChatTemplateError::Missing)?;
        chat_tokens(&self.tokenizer, tmpl, messages)
    }

    /// Generates a reply into a fresh KV cache. See [`Model::generate_in`].
    pub fn generate(
        &self,
        req: &GenerateRequest,
        on_text: impl FnMut(&str, &[u32]) -> Flow,
    ) -> Result<GenerationStats, GenerateError> {
        let mut kv = self.transformer.new_kv();
        let tokens = self.prompt_tokens(&req.prompt)?;
        self.generate_in(&mut kv, &tokens, req, on_text)
    }

    /// Feeds `prompt` after what `kv` holds and generates up to `req.max_tokens` tokens,
    /// calling `on_text(text, ids)` as text becomes safe to show.
    pub fn generate_in(
        &self,
        kv: &mut KvCache,
        prompt: &[u32],
        req: &GenerateRequest,
        on_text: impl FnMut(&str, &[u32]) -> Flow,
    ) -> Result<GenerationStats, GenerateError> {
        self.generate_in_with(kv, prompt, req, None, on_text)
    }

    /// [`Self::generate_in`] with the prompt's linear groups where the devices `prefill` place
    /// them (the NPU path, in chunks of its graphs' size) and the decode on the CPU from the
    /// same cache.
    pub fn generate_in_with(
        &self,
        kv: &mut KvCache,
        prompt: &[u32],
        req: &GenerateRequest,
        prefill: Option<(&crate::model::Devices, usize)>,
        on_text: impl FnMut(&str, &[u32]) -> Flow,
    ) -> Result<GenerationStats, GenerateError> {
        self.generate_in_chunks(kv, prompt, req, prefill, 1, on_text)
    }

    /// [`Self::generate_in_with`] prefilling up to `out_of_order` chunks per unit, their
    /// subgraphs out of order across chunks ([`Generation::with_out_of_order`]).
    pub fn generate_in_chunks(
        &self,
        kv: &mut KvCache,
        prompt: &[u32],
        req: &GenerateRequest,
        prefill: Option<(&crate::model::Devices, usize)>,
        out_of_order: usize,
        mut on_text: impl FnMut(&str, &[u32]) -> Flow,
    ) -> Result<GenerationStats, GenerateError> {
        let mut g = Generation::new(self, kv, prompt.to_vec(), req)?;
        if let Some((_, chunk)) = prefill {
            g = g.with_prefill_chunk(chunk).with_out_of_order(out_of_order);
        }
        loop {
            let out = g.step_with(self, kv, prefill.map(|p| p.0))?;
            if (!out.ids.is_empty() || !out.text.is_empty()) && on_text(&out.text, &out.ids) == Flow::Stop {
                return Ok(g.cancel());
            }
            if let Some(stats) = out.done {
                return Ok(stats);
            }
        }
    }
}

/// A chat rendered by the template, its control tokens parsed from the template's own text
/// only: a user who writes `<|im_end|><|im_start|>system` in a message gets those
/// characters as text, not a forged system turn.
///
/// A chat whose contents hold no control token's text is tokenized whole, as llama.cpp does
/// (the same ids as ever). One whose contents do is rendered with each content as a marker
/// (a private-use character pair no tokenizer maps to a control token): the text between
/// markers is the template's, tokenized with control tokens; each content is tokenized as
/// text. If the contents put back at the markers do not give the template's own rendering
/// (a template that trims or moves a content), the chat is refused.
pub fn chat_tokens(
    tk: &crate::tokenizer::Tokenizer,
    tmpl: &crate::chat::ChatTemplate,
    messages: &[crate::chat::ChatMessage],
) -> Result<Vec<u32>, GenerateError> {
    let bos_for = |text: &str| {
        // A template that writes the BOS text itself must not get a second one.
        tk.add_bos && !(tk.bos.is_some() && !tk.bos_text().is_empty() && text.starts_with(tk.bos_text()))
    };
    let text = tmpl.render(messages, true, tk.bos_text(), tk.eos_text())?;
    if !messages.iter().any(|m| tk.has_control_text(&m.content)) {
        return Ok(tk.encode(&text, true, bos_for(&text))?);
    }
    let refuse = || -> GenerateError {
        crate::error::ChatTemplateError::Render(
            "a message holds the text of a control token, and this model's template changes message \
             contents, so it cannot be kept as text"
                .into(),
        )
        .into()
    };
    let marker = |i: usize| format!("\u{E000}llmd-content-{i}\u{E001}");
    let masked: Vec<_> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| crate::chat::ChatMessage { role: m.role.clone(), content: marker(i) })
        .collect();
    let masked_text = tmpl.render(&masked, true, tk.bos_text(), tk.eos_text())?;
    let mut parts = Vec::with_capacity(2 * messages.len() + 1);
    let mut rest = masked_text.as_str();
    for (i, m) in messages.iter().enumerate() {
        let mk = marker(i);
        match rest.split_once(&mk) {
            Some((before, after)) if !after.contains(&mk) => {
                parts.push((before, true));
                parts.push((m.content.as_str(), false));
                rest = after;
            }
            _ => return Err(refuse()),
        }
    }
    parts.push((rest, true));
    let rebuilt: String = parts.iter().map(|(t, _)| *t).collect();
    if rebuilt != text {
        return Err(refuse());
    }
    let mut ids = Vec::new();
    let mut bos = bos_for(&text);
    for (t, special) in parts {
        if t.is_empty() && !bos {
            continue;
        }
        ids.extend(tk.encode(t, special, bos)?);
        bos = false;
    }
    Ok(ids)
}

/// What one [`Generation::step`] produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Text now safe to show (possibly empty).
    pub text: String,
    /// Tokens sampled in this step (empty for a prefill chunk).
    pub ids: Vec<u32>,
    /// Set when the generation has ended.
    pub done: Option<GenerationStats>,
}

/// One request's generation as a sequence of bounded steps — a prefill chunk or one decode
/// step each — so a scheduler can interleave requests and cancel between steps.
///
/// States: prefilling (chunks of the prompt left) → decoding (sample, emit, feed) → done.
/// The model and KV cache are passed to every step rather than held, so the caller decides
/// where they live; the same `kv` must be passed each time.
pub struct Generation {
    sampler: Sampler,
    stream: TextStream,
    history: Vec<u32>,
    prompt: Vec<u32>,
    prefilled: usize,
    prefill_chunk: usize,
    /// Decode steps also go through the devices `step_with` is given (HeteroLLM's decode).
    decode_with_linears: bool,
    /// Prompt chunks one unit of work prefills out of order through the devices `step_with` is
    /// given (llm.npu's out-of-order execution across chunks; 1: one chunk per unit, in order).
    out_of_order: usize,
    logits: Vec<f32>,
    generated: usize,
    max_tokens: usize,
    start: Instant,
    prefill_time: Option<Duration>,
    decode_start: Option<Instant>,
    first_token: Option<Duration>,
    /// The last sampled token when it has not been fed to the model (it ended the turn).
    unfed: Option<u32>,
    /// Why it ended, once it has.
    finished: Option<FinishReason>,
}

impl Generation {
    /// Validates the request against the model and the cache's free context.
    /// [`Self::new`] for a [`crate::sequence::Sequence`].
    pub fn for_sequence(
        model: &Model,
        seq: &crate::sequence::Sequence,
        prompt: Vec<u32>,
        req: &GenerateRequest,
    ) -> Result<Self, GenerateError> {
        Self::new(model, seq.kv(), prompt, req)
    }

    pub fn new(model: &Model, kv: &KvCache, prompt: Vec<u32>, req: &GenerateRequest) -> Result<Self, GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let context = model.transformer.config.context_length;
        if kv.len() + prompt.len() > context {
            return Err(GenerateError::ContextOverflow {
                prompt: kv.len() + prompt.len(),
                max_new: req.max_tokens,
                context,
            });
        }
        for s in &req.stop {
            if s.is_empty() || s.len() > MAX_STOP_BYTES {
                return Err(GenerateError::InvalidSampling {
                    name: "stop",
                    detail: format!("stop sequences must be 1..={MAX_STOP_BYTES} bytes"),
                });
            }
        }
        let vocab = model.tokenizer.vocab_size();
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(crate::error::TokenizerError::TokenOutOfRange { id: bad, vocab }.into());
        }
        Ok(Self {
            sampler: Sampler::new(req.sampling.clone())?,
            stream: TextStream::new(req.stop.clone()),
            history: prompt.clone(),
            prompt,
            prefilled: 0,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            out_of_order: 1,
            decode_with_linears: false,
            logits: Vec::new(),
            generated: 0,
            max_tokens: req.max_tokens,
            start: Instant::now(),
            prefill_time: None,
            decode_start: None,
            first_token: None,
            unfed: None,
            finished: None,
        })
    }

    /// Sets the prefill chunk size (tokens per prefill step).
    pub fn with_prefill_chunk(mut self, chunk: usize) -> Self {
        self.prefill_chunk = chunk.max(1);
        self
    }

    /// Up to `chunks` prompt chunks per unit of work when [`Self::step_with`] is given devices
    /// (the NPU path): their subgraphs run out of order across the chunks, on the caller's
    /// (NPU) thread and a CPU thread (`Transformer::prefill_out_of_order`), with the same bits as one
    /// chunk at a time. 1 (the default): one chunk per unit.
    pub fn with_out_of_order(mut self, chunks: usize) -> Self {
        self.out_of_order = chunks.max(1);
        self
    }

    /// Prompt tokens one unit of work prefills: a chunk, or several out of order.
    pub fn prefill_unit(&self) -> usize {
        self.prefill_chunk.saturating_mul(self.out_of_order)
    }

    /// Decode steps through the devices [`Self::step_with`] is given as well (HeteroLLM's
    /// decode: the GPU leads, the NPU takes a slice), not only prefill chunks.
    pub fn with_linears_for_decode(mut self) -> Self {
        self.decode_with_linears = true;
        self
    }

    /// Whether the prompt is still being read.
    pub fn is_prefilling(&self) -> bool {
        self.prefilled < self.prompt.len()
    }

    /// The token that ended the turn without being fed to the model, if any: a multi-turn
    /// caller feeds it before the next turn (or drops it, as for an end-of-turn token the
    /// chat template writes again).
    pub fn unfed_token(&self) -> Option<u32> {
        self.unfed
    }

    /// Tokens sampled so far (excluding the prompt).
    pub fn generated_ids(&self) -> &[u32] {
        &self.history[self.prompt.len()..]
    }

    /// Runs one unit of work.
    pub fn step(&mut self, model: &Model, kv: &mut KvCache) -> Result<StepOutput, GenerateError> {
        self.step_with(model, kv, None)
    }

    /// [`Self::step`] with prefill chunks' linear groups where the devices `prefill` place
    /// them, when given (the NPU's W8A8 groups, HeteroLLM's cuts).
    pub fn step_with(
        &mut self,
        model: &Model,
        kv: &mut KvCache,
        prefill: Option<&crate::model::Devices>,
    ) -> Result<StepOutput, GenerateError> {
        if let Some(l) = prefill.filter(|_| self.out_of_order > 1) {
            if let Some(tokens) = self.prefill_at_most(self.prefill_unit()) {
                let n = tokens.len();
                let r = crate::model::Run::LAST.on(l).chunked(self.prefill_chunk);
                let logits = model.transformer.run(&mut [(kv, tokens)], r)?.pop().unwrap_or_default();
                self.accept_prefill(n, logits);
                return Ok(StepOutput::default());
            }
        }
        if let Some(chunk) = self.prefill_chunk_tokens() {
            let n = chunk.len();
            let r = prefill.map_or(crate::model::Run::LAST, |l| crate::model::Run::LAST.on(l));
            let logits = model.transformer.run(&mut [(kv, chunk)], r)?.pop().unwrap_or_default();
            self.accept_prefill(n, logits);
            return Ok(StepOutput::default());
        }
        let (out, feed) = self.sample(model, kv.len())?;
        if let Some(tok) = feed {
            let r = match prefill {
                Some(l) if self.decode_with_linears => crate::model::Run::LAST.on(l),
                _ => crate::model::Run::LAST,
            };
            let logits = model.transformer.run(&mut [(kv, &[tok])], r)?.pop().unwrap_or_default();
            self.accept_logits(logits);
        }
        Ok(out)
    }

    /// The next prefill chunk, while the prompt is still being read (a scheduler feeds it,
    /// possibly batched with other sequences, then calls [`Self::accept_prefill`]).
    pub fn prefill_chunk_tokens(&self) -> Option<&[u32]> {
        if self.finished.is_some() || !self.is_prefilling() {
            return None;
        }
        let end = (self.prefilled + self.prefill_chunk).min(self.prompt.len());
        Some(&self.prompt[self.prefilled..end])
    }

    /// The next `limit` prompt tokens at most, whatever the chunk size (a unit of work that
    /// prefills several chunks: the NPU's out-of-order jobs), while the prompt is being read.
    pub fn prefill_at_most(&self, limit: usize) -> Option<&[u32]> {
        if self.finished.is_some() || !self.is_prefilling() {
            return None;
        }
        let end = (self.prefilled + limit.max(1)).min(self.prompt.len());
        Some(&self.prompt[self.prefilled..end])
    }

    /// Prompt tokens fed so far.
    pub fn prefilled(&self) -> usize {
        self.prefilled
    }

    /// Prompt tokens not yet fed.
    pub fn prefill_left(&self) -> usize {
        self.prompt.len() - self.prefilled
    }

    /// Like [`Self::prefill_chunk_tokens`], at most `limit` tokens.
    pub fn prefill_chunk_at_most(&self, limit: usize) -> Option<&[u32]> {
        self.prefill_chunk_tokens().map(|c| &c[..c.len().min(limit.max(1))])
    }

    /// Records that `n` prompt tokens were fed and the logits after the last of them.
    pub fn accept_prefill(&mut self, n: usize, logits: Vec<f32>) {
        self.logits = logits;
        self.prefilled = (self.prefilled + n).min(self.prompt.len());
        if !self.is_prefilling() {
            self.prefill_time = Some(self.start.elapsed());
            self.decode_start = Some(Instant::now());
        }
    }

    /// The decode half of a step before the model runs: samples the next token from the last
    /// logits and emits its text. Returns what to stream and, unless the generation ended, the
    /// token to feed (then pass the model's logits to [`Self::accept_logits`]). `kv_len` is the
    /// sequence's cache length.
    pub fn sample(&mut self, model: &Model, kv_len: usize) -> Result<(StepOutput, Option<u32>), GenerateError> {
        if let Some(reason) = self.finished {
            return Ok((StepOutput { done: Some(self.stats(reason)), ..Default::default() }, None));
        }
        if self.generated >= self.max_tokens {
            return Ok((self.finish(FinishReason::Length, String::new(), vec![]), None));
        }
        let tok = self.sampler.sample(&mut self.logits, &self.history);
        self.generated += 1;
        self.first_token.get_or_insert_with(|| self.start.elapsed());
        if model.tokenizer.is_eog(tok) {
            self.unfed = Some(tok);
            return Ok((self.finish(FinishReason::Eos, String::new(), vec![tok]), None));
        }
        self.history.push(tok);
        let (text, stopped) = self.stream.push(model.tokenizer.token_bytes(tok)?);
        if stopped {
            self.unfed = Some(tok);
            return Ok((self.finish(FinishReason::Stop, text, vec![tok]), None));
        }
        if self.generated >= self.max_tokens {
            self.unfed = Some(tok);
            return Ok((self.finish(FinishReason::Length, text, vec![tok]), None));
        }
        if kv_len >= model.transformer.config.context_length {
            self.unfed = Some(tok);
            return Ok((self.finish(FinishReason::ContextFull, text, vec![tok]), None));
        }
        Ok((StepOutput { text, ids: vec![tok], done: None }, Some(tok)))
    }

    /// The logits after feeding the token [`Self::sample`] returned.
    pub fn accept_logits(&mut self, logits: Vec<f32>) {
        self.logits = logits;
    }

    /// Whether the generation has ended.
    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }

    /// Ends the generation early (the caller cancelled).
    pub fn cancel(&mut self) -> GenerationStats {
        self.finished = Some(FinishReason::Cancelled);
        self.stats(FinishReason::Cancelled)
    }

    fn finish(&mut self, reason: FinishReason, mut text: String, ids: Vec<u32>) -> StepOutput {
        if reason != FinishReason::Stop {
            text.push_str(&self.stream.finish());
        }
        self.finished = Some(reason);
        StepOutput { text, ids, done: Some(self.stats(reason)) }
    }

    fn stats(&self, finish: FinishReason) -> GenerationStats {
        GenerationStats {
            prompt_tokens: self.prompt.len(),
            generated_tokens: self.generated,
            time_to_first_token: self.first_token.unwrap_or_else(|| self.start.elapsed()),
            prefill_time: self.prefill_time.unwrap_or_else(|| self.start.elapsed()),
            decode_time: self.decode_start.map(|d| d.elapsed()).unwrap_or_default(),
            finish,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_split_across_tokens_is_held_until_whole() {
        let mut s = TextStream::new(vec![]);
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(s.push(&euro[..1]), (String::new(), false));
        assert_eq!(s.push(&euro[1..2]), (String::new(), false));
        assert_eq!(s.push(&euro[2..]), ("€".to_owned(), false));
        let emoji = "🎉x".as_bytes();
        assert_eq!(s.push(&emoji[..2]), (String::new(), false));
        assert_eq!(s.push(&emoji[2..]), ("🎉x".to_owned(), false));
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.push(&[b'a', 0xff, b'b']), ("a\u{FFFD}b".to_owned(), false));
        // An incomplete character at the very end is replaced when the stream finishes.
        assert_eq!(s.push(&[0xe2, 0x82]), (String::new(), false));
        assert_eq!(s.finish(), "\u{FFFD}");
    }

    #[test]
    fn stop_sequences_are_cut_even_across_tokens() {
        let mut s = TextStream::new(vec!["STOP".into(), "\n\n".into()]);
        assert_eq!(s.push(b"hello ST"), ("hello ".to_owned(), false));
        assert_eq!(s.push(b"O"), (String::new(), false));
        assert_eq!(s.push(b"P and more"), (String::new(), true));
        let mut s = TextStream::new(vec!["STOP".into()]);
        assert_eq!(s.push(b"ST"), (String::new(), false));
        assert_eq!(s.push(b"AR"), ("STAR".to_owned(), false));
        let mut s = TextStream::new(vec!["\n\n".into()]);
        assert_eq!(s.push(b"line\n"), ("line".to_owned(), false));
        assert_eq!(s.push(b"\nnext"), (String::new(), true));
    }

    #[test]
    fn suffix_prefix_respects_char_boundaries() {
        assert_eq!(longest_suffix_prefix("abcé", "éx"), "é".len());
        assert_eq!(longest_suffix_prefix("abc", "xyz"), 0);
        assert_eq!(longest_suffix_prefix("ab", "b"), 0, "a whole match is not a prefix to hold");
    }
}
