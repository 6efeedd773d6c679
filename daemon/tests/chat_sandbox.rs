//! The chat-template sandbox (`llmd_engine::chat`, module doc): a model file's template renders
//! in a child `llmd --render-chat-template` limited to `SANDBOX_MEMORY` and `SANDBOX_CPU_S`. A
//! template that would exhaust memory kills only that child; real templates give the same text
//! as in-process rendering.

use llmd_engine::chat::{ChatMessage, ChatTemplate, Sandbox, SANDBOX_MEMORY};
use llmd_engine::error::ChatTemplateError;
use std::time::{Duration, Instant};

fn sandbox() -> Sandbox {
    let s = Sandbox { program: env!("CARGO_BIN_EXE_llmd").into(), args: vec!["--render-chat-template".into()] };
    // As llmd does at start: model files' templates are then checked (compiled) in the sandbox
    // too, not only rendered there.
    llmd_engine::chat::set_sandbox(s.clone());
    s
}

fn chat() -> Vec<ChatMessage> {
    vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "What is the capital of France?")]
}

/// A rendering in the sandbox ends within this: the parent kills the child at `SANDBOX_WALL`
/// (3 s), its CPU limit is 2 s; the templates that fit end in well under one.
const SANDBOX_BOUND: Duration = Duration::from_secs(5);

/// This process's resident memory in kB.
fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn real_templates_render_the_same_in_the_sandbox_as_in_process() {
    let smollm2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    for source in [smollm2, llmd_engine::chat::CHATML, llmd_engine::chat::LLAMA3] {
        let t = ChatTemplate::new(source).expect("compiles");
        let here = t.render_here(&chat(), true, "<s>", "</s>").expect("renders");
        let t0 = Instant::now();
        let there = t.render_sandboxed(&sandbox(), &chat(), true, "<s>", "</s>").expect("renders in the sandbox");
        eprintln!("rendered in the sandbox in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
        assert_eq!(here, there);
    }
    // Template errors come back as the same errors.
    let looping = ChatTemplate::new("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}")
        .expect("compiles");
    assert!(matches!(
        looping.render_sandboxed(&sandbox(), &chat(), true, "", ""),
        Err(ChatTemplateError::OutOfFuel { .. })
    ));
    let raising = ChatTemplate::new("{{ raise_exception('no system messages') }}").expect("compiles");
    match raising.render_sandboxed(&sandbox(), &chat(), true, "", "") {
        Err(ChatTemplateError::Render(m)) => assert!(m.contains("no system messages"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_template_that_exhausts_memory_is_stopped_in_its_sandbox() {
    // A string doubled 45 times (512 TB) in a few hundred instructions, and one filter call
    // asking for a terabyte at once: in-process, the first exhausts the machine's memory and the
    // second aborts the whole daemon ("memory allocation of 1000000000000 bytes failed").
    let doubling = "{% set ns = namespace(s='0123456789abcdef') %}{% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
    let one_alloc = "{{ 'a\nb' | indent(1000000000000) }}";
    let before = rss_kb();
    for source in [doubling, one_alloc] {
        let t = ChatTemplate::new(source).expect("compiles");
        let t0 = Instant::now();
        let r = t.render_sandboxed(&sandbox(), &chat(), true, "", "");
        let took = t0.elapsed();
        eprintln!("{source:.40}…: {r:?} in {took:?}");
        match r {
            Err(ChatTemplateError::Sandbox(m)) => assert!(m.contains(&format!("{} MB", SANDBOX_MEMORY >> 20)), "{m}"),
            other => panic!("not stopped: {other:?}"),
        }
        assert!(took < SANDBOX_BOUND, "{took:?}");
    }
    // None of it landed in this process.
    assert!(rss_kb() < before + 64 * 1024, "RSS {} kB -> {} kB", before, rss_kb());
}

#[test]
fn a_template_that_spins_outside_its_fuel_is_stopped_in_its_sandbox() {
    // `in` walks a billion-item sequence inside minijinja, where fuel does not reach: the child
    // spins until its CPU limit (or the parent's wall-clock limit) stops it. The sandbox is set
    // before the template is made, as in llmd.
    // minijinja folds the constant expression while compiling: in-process that took 56 s.
    let sandbox = sandbox();
    let t0 = Instant::now();
    let r = ChatTemplate::new("{{ 'y' in ['x'] * 999999999 }}")
        .and_then(|t| t.render_sandboxed(&sandbox, &chat(), true, "", ""));
    let took = t0.elapsed();
    eprintln!("{r:?} in {took:?}");
    assert!(matches!(r, Err(ChatTemplateError::Sandbox(_))), "{r:?}");
    assert!(took < SANDBOX_BOUND, "{took:?}");
}
