//! Chat templates: the model's own Jinja template (GGUF `tokenizer.chat_template` or HF
//! `tokenizer_config.json`), rendered with minijinja, or a built-in ChatML / Llama-3 template.

use crate::error::ChatTemplateError;
use serde::{Deserialize, Serialize};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_owned(), content: content.to_owned() }
    }
}

/// ChatML, as used by SmolLM, Qwen and many others.
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Llama 3's header format.
pub const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Template instructions one rendering may run (minijinja's fuel). A real template runs tens
/// per message (SmolLM2's, ChatML and Llama 3: 18–23), so this covers any conversation a request
/// can carry (256 KiB of messages: at most ~50,000), while a hostile template's loops end in a
/// fraction of a second instead of running for hours.
pub const RENDER_FUEL: u64 = 5_000_000;

/// A rendering may be at most this long, plus twice its messages' text and
/// [`RENDER_BYTES_PER_MESSAGE`] per message: a template writes framing around the contents
/// (and at most a copy of them), not megabytes of its own.
pub const RENDER_BYTES: usize = 64 << 10;
pub const RENDER_BYTES_PER_MESSAGE: usize = 256;

/// The longest rendering of `messages` accepted.
pub fn render_limit(messages: &[ChatMessage]) -> usize {
    let text: usize = messages.iter().map(|m| m.role.len() + m.content.len()).sum();
    RENDER_BYTES.saturating_add(text.saturating_mul(2)).saturating_add(messages.len() * RENDER_BYTES_PER_MESSAGE)
}

/// The rendering's output, refused past its limit (which also ends the rendering there).
struct Capped {
    out: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + b.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("the rendering is too long"));
        }
        self.out.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    pub source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bytes", &self.source.len()).finish()
    }
}

/// HF templates' `strftime_now(format)` (Llama 3.1+ put the date in the system prompt): the
/// current UTC time with `%d %m %Y %y %b %B %H %M %S %%`.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format_utc(secs, &format)
}

fn format_utc(secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles a Jinja template in the dialect HF chat templates use.
    pub fn new(source: &str) -> Result<Self, ChatTemplateError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned("chat", source.to_owned()).map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        Ok(Self { env, source: source.to_owned() })
    }

    /// A built-in template by name: `chatml` or `llama3`.
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "chatml" => Self::new(CHATML).ok(),
            "llama3" => Self::new(LLAMA3).ok(),
            _ => None,
        }
    }

    /// Renders a conversation, ending with the assistant's turn opened when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatTemplateError> {
        let tmpl = self.env.get_template("chat").map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        let limit = render_limit(messages);
        let mut out = Capped { out: Vec::new(), limit, over: false };
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.out).map_err(|e| ChatTemplateError::Render(e.to_string())),
            Err(_) if out.over => Err(ChatTemplateError::TooLong { limit }),
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
                Err(ChatTemplateError::OutOfFuel { fuel: RENDER_FUEL })
            }
            Err(e) => Err(ChatTemplateError::Render(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_with_generation_prompt() {
        let t = ChatTemplate::builtin("chatml").expect("builtin");
        let out = t
            .render(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], true, "", "")
            .expect("renders");
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn llama3_renders_bos_and_headers() {
        let t = ChatTemplate::builtin("llama3").expect("builtin");
        let out =
            t.render(&[ChatMessage::new("user", " Hi ")], true, "<|begin_of_text|>", "<|eot_id|>").expect("renders");
        assert_eq!(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    }

    #[test]
    fn strftime_now_formats_dates_like_python() {
        // 2026-11-22 08:57:03 UTC.
        assert_eq!(format_utc(1_795_337_823, "%d %b %Y"), "22 Nov 2026");
        assert_eq!(format_utc(1_795_337_823, "%Y-%m-%d %H:%M:%S %B %y %%"), "2026-11-22 08:57:03 November 26 %");
        assert_eq!(format_utc(951_782_400, "%d %b %Y"), "29 Feb 2000", "leap day");
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}").expect("compiles");
        assert_eq!(t.render(&[], false, "", "").expect("renders").len(), 4);
    }

    #[test]
    fn a_template_that_loops_for_long_runs_out_of_fuel() {
        // 10^8 iterations: minutes of work before fuel bounded it (found by fuzzing).
        let t = ChatTemplate::new("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}")
            .expect("compiles");
        let t0 = std::time::Instant::now();
        assert!(matches!(t.render(&[], true, "", ""), Err(ChatTemplateError::OutOfFuel { .. })));
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_rendering_longer_than_its_conversation_justifies_is_refused() {
        // A million numbers (~3 MB) for a one-letter message: tokenizing them took longer than
        // the fuzzing limit of 10 s per input (found by fuzzing).
        let t =
            ChatTemplate::new("{% for i in range(1000) %}{% for j in range(1000) %}{{ i }}{% endfor %}{% endfor %}")
                .expect("compiles");
        let msgs = [ChatMessage::new("user", "x")];
        assert!(matches!(t.render(&msgs, true, "", ""), Err(ChatTemplateError::TooLong { .. })));
        // Within the limit, framing around long contents is fine.
        let long = ChatMessage::new("user", &"y".repeat(1 << 20));
        let out = ChatTemplate::builtin("chatml").expect("builtin").render(&[long], true, "", "").expect("renders");
        assert!(out.len() > 1 << 20);
    }

    #[test]
    fn real_templates_use_a_small_part_of_the_fuel() {
        // 2,000 messages through SmolLM2's template (its system-prompt insertion included) and
        // the built-in ones: 36,000–46,000 instructions, far below the fuel.
        let smol = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let msgs: Vec<ChatMessage> =
            (0..2000).map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "hello")).collect();
        for src in [smol, CHATML, LLAMA3] {
            let t = ChatTemplate::new(src).expect("compiles");
            let tmpl = t.env.get_template("chat").expect("template");
            let rendered = tmpl
                .render_captured(minijinja::context! { messages => &msgs, add_generation_prompt => true })
                .expect("renders");
            let (used, _) = rendered.state().fuel_levels().expect("fuel is tracked");
            assert!(used < RENDER_FUEL / 20, "{used} instructions for {} messages", msgs.len());
        }
    }

    #[test]
    fn template_errors_are_typed() {
        assert!(matches!(ChatTemplate::new("{% for %}"), Err(ChatTemplateError::Compile(_))));
        let t = ChatTemplate::new("{{ raise_exception('only user messages') }}").expect("compiles");
        match t.render(&[], true, "", "") {
            Err(ChatTemplateError::Render(m)) => assert!(m.contains("only user messages"), "{m}"),
            other => panic!("expected a render error, got {other:?}"),
        }
        // Python string methods used by HF templates work.
        let t = ChatTemplate::new("{{ messages[0]['content'].strip().upper() }}").expect("compiles");
        assert_eq!(t.render(&[ChatMessage::new("user", " hi ")], false, "", "").expect("renders"), "HI");
    }
}
