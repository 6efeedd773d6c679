//! Chat templates: the model's own Jinja template (GGUF `tokenizer.chat_template` or HF
//! `tokenizer_config.json`), rendered with minijinja, or a built-in ChatML / Llama-3 template.
//!
//! A model file's template is a program from a file llmd does not control. minijinja bounds
//! its instructions ([`RENDER_FUEL`]) and this module its output ([`render_limit`]), but not
//! the memory of its values: a string doubled in a loop reaches terabytes in forty
//! instructions, and a filter such as `indent(10**12)` asks for it in one. So a binary that
//! serves model files (llmd, llmctl) sets a [`Sandbox`]: every template that is not one of the
//! built-ins is then rendered in a child process of its own ([`sandbox_child_main`]) limited to
//! [`SANDBOX_MEMORY`] bytes of address space beyond its start and [`SANDBOX_CPU_S`] seconds of
//! CPU, and killed if it has not answered within [`SANDBOX_WALL`]. A template that goes past
//! them kills only that child, and the request gets
//! [`ChatTemplateError::Sandbox`]. Without a sandbox set (tests, the fuzz targets, library
//! users) templates render in the calling process.
//!
//! Cost: a child per rendering, 2–6 ms here (spawn, exec, compile), paid on the daemon's engine
//! worker when a chat turn starts (where the conversation is rendered and tokenized), so it
//! delays the other streams by about one decode step.

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
    /// The compiled template; `None` for a model's template checked in the sandbox (compiling
    /// runs minijinja's constant folding, itself unbounded: `'y' in ['x'] * 999999999` took
    /// 56 s to compile), which is compiled only where it renders.
    env: Option<minijinja::Environment<'static>>,
    pub source: String,
    /// Rendered in this process even with a sandbox set: the built-in templates (ours, trusted),
    /// and copies made by [`Self::in_process`].
    in_process: bool,
}

/// How model files' templates are rendered out of process: `program` with `args` runs
/// [`sandbox_child_main`] (llmd and llmctl: their own executable with a hidden argument).
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub program: std::path::PathBuf,
    pub args: Vec<String>,
}

/// The hidden first argument that makes llmd, llmctl or a fuzz binary the sandbox process
/// ([`sandbox_child_main`]).
pub const SANDBOX_ARG: &str = "--render-chat-template";

static SANDBOX: std::sync::OnceLock<Sandbox> = std::sync::OnceLock::new();

/// Renders every non-built-in template in `sandbox` from now on, for the life of the process.
/// False if one was set already.
pub fn set_sandbox(sandbox: Sandbox) -> bool {
    SANDBOX.set(sandbox).is_ok()
}

/// Address space the sandbox process may take beyond what it holds when it starts (its own
/// executable and libraries): real templates need well under a megabyte for any conversation a
/// request can carry (256 KiB of messages, rendered at most three times over).
pub const SANDBOX_MEMORY: u64 = 512 << 20;
/// CPU seconds the sandbox process may use: real templates render in milliseconds, and the
/// worker waits for the sandbox, so a template that spins must cost it little.
pub const SANDBOX_CPU_S: u64 = 2;
/// How long the parent waits for the sandbox's answer before it kills it (a child that
/// sleeps or is starved of CPU is stopped too).
pub const SANDBOX_WALL: std::time::Duration = std::time::Duration::from_secs(3);

/// What the parent sends the sandbox process (JSON on its standard input).
#[derive(Serialize, Deserialize)]
struct RenderJob {
    /// Only compile the template (its check when a model is loaded).
    #[serde(default)]
    compile_only: bool,
    source: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    bos_token: String,
    eos_token: String,
}

/// What the sandbox process answers (JSON on its standard output).
#[derive(Serialize, Deserialize)]
enum RenderReply {
    Text(String),
    Compile(String),
    Render(String),
    OutOfFuel(u64),
    TooLong(usize),
}

/// The sandbox process's side: reads a [`RenderJob`] from standard input, limits itself,
/// renders, writes the [`RenderReply`] to standard output. Returns the exit status (0 when it
/// answered, even with a template error; 2 for a malformed job; 3 if the limits cannot be set,
/// so nothing is rendered unbounded).
pub fn sandbox_child_main() -> i32 {
    use std::io::{Read, Write};
    let start = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmSize:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(64 << 20, |kb| kb * 1024);
    if let Err(e) = llmd_alloc_sys::limit_process(start + SANDBOX_MEMORY, SANDBOX_CPU_S) {
        eprintln!("chat template sandbox: cannot limit itself: {e}");
        return 3;
    }
    let mut input = String::new();
    if std::io::stdin().read_to_string(&mut input).is_err() {
        return 2;
    }
    let Ok(job) = serde_json::from_str::<RenderJob>(&input) else { return 2 };
    let reply = match ChatTemplate::compile(&job.source, false) {
        Err(ChatTemplateError::Compile(e)) => RenderReply::Compile(e),
        Err(e) => RenderReply::Render(e.to_string()),
        Ok(_) if job.compile_only => RenderReply::Text(String::new()),
        Ok(t) => match t.render_here(&job.messages, job.add_generation_prompt, &job.bos_token, &job.eos_token) {
            Ok(text) => RenderReply::Text(text),
            Err(ChatTemplateError::OutOfFuel { fuel }) => RenderReply::OutOfFuel(fuel),
            Err(ChatTemplateError::TooLong { limit }) => RenderReply::TooLong(limit),
            Err(ChatTemplateError::Compile(e)) => RenderReply::Compile(e),
            Err(e) => RenderReply::Render(e.to_string()),
        },
    };
    let Ok(out) = serde_json::to_vec(&reply) else { return 2 };
    let mut stdout = std::io::stdout().lock();
    if stdout.write_all(&out).and_then(|()| stdout.flush()).is_err() {
        return 2;
    }
    0
}

/// Renders `job` in a `sandbox` process (see the module doc).
fn render_in(sandbox: &Sandbox, job: &RenderJob, limit: usize) -> Result<String, ChatTemplateError> {
    use std::io::{Read, Write};
    let fail = |what: String| ChatTemplateError::Sandbox(what);
    let input = serde_json::to_vec(job).map_err(|e| fail(format!("encoding the job: {e}")))?;
    let mut child = std::process::Command::new(&sandbox.program)
        .args(&sandbox.args)
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("cannot start {}: {e}", sandbox.program.display())))?;
    // The answer is read on a thread of its own, so the child can be killed after SANDBOX_WALL
    // however it stalls. An answer longer than the longest rendering allowed (plus its JSON
    // escaping) is not read.
    let stdout = child.stdout.take();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let r = stdout.map(|o| o.take(limit as u64 * 6 + 4096).read_to_end(&mut out));
        let _ = tx.send(());
        (r, out)
    });
    // The child reads all of its input before it writes, so writing first cannot deadlock. A
    // child that died early makes this write fail; its status says why.
    let wrote = child.stdin.take().map(|mut i| i.write_all(&input));
    let timed_out = rx.recv_timeout(SANDBOX_WALL).is_err();
    if timed_out {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| fail(format!("waiting for it: {e}")))?;
    let (read, out) = reader.join().map_err(|_| fail("its reader failed".into()))?;
    if timed_out {
        return Err(fail(format!("no answer within {} s: stopped", SANDBOX_WALL.as_secs())));
    }
    if !status.success() {
        use std::os::unix::process::ExitStatusExt;
        return Err(fail(match (status.signal(), status.code()) {
            (Some(sig), _) => format!(
                "stopped by signal {sig}: the template went past {} MB of memory or {SANDBOX_CPU_S} s of CPU",
                SANDBOX_MEMORY >> 20
            ),
            (None, Some(3)) => "it could not limit its memory".into(),
            (None, code) => format!("it exited with status {}", code.unwrap_or(-1)),
        }));
    }
    if let Some(Err(e)) = wrote {
        return Err(fail(format!("sending the job: {e}")));
    }
    if let Some(Err(e)) = read {
        return Err(fail(format!("reading the answer: {e}")));
    }
    match serde_json::from_slice::<RenderReply>(&out) {
        Ok(RenderReply::Text(t)) if t.len() <= limit => Ok(t),
        Ok(RenderReply::Text(_)) | Ok(RenderReply::TooLong(_)) => Err(ChatTemplateError::TooLong { limit }),
        Ok(RenderReply::Compile(e)) => Err(ChatTemplateError::Compile(e)),
        Ok(RenderReply::Render(e)) => Err(ChatTemplateError::Render(e)),
        Ok(RenderReply::OutOfFuel(fuel)) => Err(ChatTemplateError::OutOfFuel { fuel }),
        Err(e) => Err(fail(format!("an unreadable answer: {e}"))),
    }
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

/// Items (counted through nested sequences and maps) one printed value may hold: each prints
/// as at least two bytes, so more than this cannot fit in any rendering allowed.
pub const MAX_PRINTED_ITEMS: usize = 1 << 20;

/// Whether `value` holds at most `budget` items, nested ones included, counted without walking
/// more than that many (a sized sequence's length is read before its items).
fn printable_within(value: &minijinja::Value, budget: &mut usize) -> bool {
    use minijinja::value::ValueKind;
    if !matches!(value.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::Iterable) {
        return true;
    }
    if value.len().is_some_and(|n| n > *budget) {
        return false;
    }
    let Ok(items) = value.try_iter() else { return true };
    for item in items {
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        // A map's items are its keys: print their values too.
        let v = if value.kind() == ValueKind::Map { value.get_item(&item).unwrap_or_default() } else { item };
        if !printable_within(&v, budget) {
            return false;
        }
    }
    true
}

/// minijinja's own formatter, refusing first a value with more items than any rendering can
/// hold: minijinja walks every item of a printed sequence even after the output has refused
/// more, so `{{ ['x'] * 999999999 }}` would run for seconds past the output limit (found by the
/// `chat_template` fuzzer).
fn bounded_formatter(
    out: &mut minijinja::Output<'_>,
    state: &minijinja::State<'_, '_>,
    value: &minijinja::Value,
) -> Result<(), minijinja::Error> {
    let mut budget = MAX_PRINTED_ITEMS;
    if !printable_within(value, &mut budget) {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("a printed value holds more than {MAX_PRINTED_ITEMS} items"),
        ));
    }
    minijinja::escape_formatter(out, state, value)
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles a Jinja template in the dialect HF chat templates use (a model file's: rendered
    /// in the [`Sandbox`] when one is set, unless it is a built-in template's exact text).
    pub fn new(source: &str) -> Result<Self, ChatTemplateError> {
        let builtin = source == CHATML || source == LLAMA3;
        match SANDBOX.get() {
            Some(sandbox) if !builtin => {
                let job = RenderJob {
                    compile_only: true,
                    source: source.to_owned(),
                    messages: Vec::new(),
                    add_generation_prompt: false,
                    bos_token: String::new(),
                    eos_token: String::new(),
                };
                render_in(sandbox, &job, RENDER_BYTES)?;
                Ok(Self { env: None, source: source.to_owned(), in_process: false })
            }
            _ => Self::compile(source, builtin),
        }
    }

    fn compile(source: &str, in_process: bool) -> Result<Self, ChatTemplateError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_formatter(bounded_formatter);
        env.add_template_owned("chat", source.to_owned()).map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        Ok(Self { env: Some(env), source: source.to_owned(), in_process })
    }

    /// This template compiled to render in this process whatever the sandbox: for fuzzing, once
    /// the sandbox has shown that the renderings to be made end within its bounds
    /// (`crate::fuzzing::chat_template`).
    pub(crate) fn in_process(&self) -> Result<Self, ChatTemplateError> {
        Self::compile(&self.source, true)
    }

    /// A built-in template by name: `chatml` or `llama3`.
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "chatml" => Self::compile(CHATML, true).ok(),
            "llama3" => Self::compile(LLAMA3, true).ok(),
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
        match SANDBOX.get() {
            Some(sandbox) if !self.in_process => {
                self.render_sandboxed(sandbox, messages, add_generation_prompt, bos_token, eos_token)
            }
            _ => self.render_here(messages, add_generation_prompt, bos_token, eos_token),
        }
    }

    /// [`Self::render`] in `sandbox`'s process, whatever the template (tests of the sandbox).
    pub fn render_sandboxed(
        &self,
        sandbox: &Sandbox,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatTemplateError> {
        let job = RenderJob {
            compile_only: false,
            source: self.source.clone(),
            messages: messages.to_vec(),
            add_generation_prompt,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        };
        render_in(sandbox, &job, render_limit(messages))
    }

    /// [`Self::render`] in this process.
    pub fn render_here(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatTemplateError> {
        let Some(env) = &self.env else {
            // Checked in the sandbox, rendered here on request: compile it now.
            return Self::compile(&self.source, self.in_process)?.render_here(
                messages,
                add_generation_prompt,
                bos_token,
                eos_token,
            );
        };
        let tmpl = env.get_template("chat").map_err(|e| ChatTemplateError::Render(e.to_string()))?;
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
    fn printing_a_sequence_repeated_a_billion_times_is_refused_at_once() {
        // Found by the chat_template fuzzer: 12 s in minijinja's printing of the sequence.
        for source in ["{{-['cod'] * 999999999 }}", "{{ [['x'] * 999999999] }}", "{{ {'a': ['x'] * 999999999} }}"] {
            let t = ChatTemplate::new(source).expect("compiles");
            let t0 = std::time::Instant::now();
            assert!(t.render_here(&[], true, "", "").is_err(), "{source}");
            assert!(t0.elapsed() < std::time::Duration::from_secs(1), "{source}: {:?}", t0.elapsed());
        }
        // Printing ordinary sequences and maps is unchanged.
        let t = ChatTemplate::new("{{ [1, 'a', [2]] }} {{ {'k': 'v'} }} {{ ['x'] * 3 }}").expect("compiles");
        assert_eq!(t.render_here(&[], true, "", "").expect("renders"), r#"[1, "a", [2]] {"k": "v"} ["x", "x", "x"]"#);
    }

    #[test]
    fn a_template_that_loops_for_long_runs_out_of_fuel() {
        // 10^8 iterations: minutes of work without fuel (found by fuzzing).
        let t = ChatTemplate::new("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}")
            .expect("compiles");
        let t0 = std::time::Instant::now();
        assert!(matches!(t.render(&[], true, "", ""), Err(ChatTemplateError::OutOfFuel { .. })));
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_rendering_longer_than_its_conversation_justifies_is_refused() {
        // A million numbers (~3 MB) for a one-letter message: tokenizing them takes longer than
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
            let tmpl = t.env.as_ref().expect("compiled in-process").get_template("chat").expect("template");
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
