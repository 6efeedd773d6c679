#!/usr/bin/env python3
"""Make the golden file for the engine tests from llama.cpp (PyPI llama-cpp-python).

Run once by a developer (llama-cpp-python builds llama.cpp from source, ~15 min on 2 cores):
    pip install llama-cpp-python==0.3.36 jinja2
    python3 tools/golden/make_golden.py models/SmolLM2-135M-Instruct.Q4_1.gguf tests/golden/smollm2

Writes <out>.json (prompts, prompt token ids, 32 greedy ids, tokenizer cases) and
<out>.logits.f32 (little-endian f32 logits at each prompt's last position, one row per prompt);
with a third argument `f16`, <out>.logits.f16 instead (half the size, for large vocabularies:
    python3 tools/golden/make_golden.py models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \
        tests/golden/qwen2.5-coder-1.5b f16
f16 rounding moves a logit by at most ~0.016 at |logit| < 32, far below the tests' tolerances).
Greedy = argmax of llama.cpp's logits at every step, EOS ignored, 32 tokens. For each step the
file also keeps llama.cpp's margin between its best and second-best logit and every token
within NEAR of the best: where the margin is tiny, llama.cpp itself picks differently when the
same prompt is evaluated in another batch shape (tools/golden/noise_floor.py), so the test
treats such a step as a near tie rather than a fixed answer.
"""
import hashlib, json, sys
import numpy as np
import jinja2
import llama_cpp
from llama_cpp import Llama

N_GREEDY = 32
NEAR = 1.0  # logits below the best still recorded as candidates

LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for wine. "
    "Before that, books were copied by hand, usually in monasteries, and a single volume could take "
    "a scribe many months. The new method spread quickly: by 1500 presses were working in more than "
    "two hundred cities across Europe, and millions of books had been printed. Prices fell, literacy "
    "rose, and ideas travelled faster than ever before. Scholars could compare identical copies of a "
    "text, which changed how knowledge was checked and shared. Religious reformers used pamphlets to "
    "reach ordinary people, and governments soon tried to license and censor what was printed. Over "
    "the following centuries the press was improved with iron frames, steam power and rotary cylinders, "
    "until newspapers could be produced by the hundred thousand every night. In short, the invention "
    "of printing"
)

RAW_PROMPTS = [
    ("capital", "The capital of France is"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("numbers", "1, 1, 2, 3, 5, 8, 13, 21,"),
    ("unicode", "Zürich, São Paulo, Kraków — 東京 and 서울 are cities where"),
    ("long", LONG),
    ("story", "Once upon a time, in a small village by the sea,"),
    ("science", "Water is made of two elements: hydrogen and"),
    ("howto", "To make a cup of tea, first"),
    ("list", "The three primary colors are"),
    ("rust", "fn add(a: i32, b: i32) -> i32 {"),
]

CHAT_PROMPTS = [
    ("chat", [{"role": "user", "content": "Write a haiku about the sea."}]),
    ("chat_system", [{"role": "system", "content": "You answer in one short sentence."},
                     {"role": "user", "content": "Why is the sky blue?"}]),
]

TOKENIZER_CASES = [
    "Hello, world! This is a test.",
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
    "    four leading spaces\t\ttabs\n\n\nthree newlines   trailing   ",
    "Café déjà vu, naïve façade, Ångström, Øresund, ñandú",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 🎉🚀👍🏽 and 👨‍👩‍👧‍👦 family, ✓ ✗ ★",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F 1,000,000",
    "<|im_start|>user not special here<|im_end|> </s> <s>",
    "I'm you're they'll we've she'd IT'S DON'T",
    "Mixed: naïve 東京 🎉 code_snippet(x)=42;\r\n\tEnd.",
]


def main(model_path, out, logits_type="f32"):
    with open(model_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    m = Llama(model_path=model_path, n_ctx=1024, n_batch=512, n_threads=2, logits_all=False, verbose=False)
    template = m.metadata.get("tokenizer.chat_template")
    if template is None:
        sys.exit("model has no chat template")
    env = jinja2.Environment()
    n_vocab = m.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(m._ctx.get_logits(), shape=(n_vocab,)).astype(np.float32).copy()

    prompts, rows = [], []
    items = [(name, text, False) for name, text in RAW_PROMPTS]
    for name, messages in CHAT_PROMPTS:
        text = env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                 bos_token="<|im_start|>", eos_token="<|im_end|>")
        items.append((name, text, True))
    for name, text, special in items:
        ids = m.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        m.reset()
        m.eval(ids)
        logits = last_logits()
        rows.append(logits)
        greedy, margins, near = [], [], []
        for _ in range(N_GREEDY):
            l = last_logits()
            t = int(np.argmax(l))
            top = np.sort(l)[::-1]
            greedy.append(t)
            margins.append(float(top[0] - top[1]))
            near.append([int(i) for i in np.nonzero(l >= top[0] - NEAR)[0]])
            m.eval([t])
        prompts.append({"name": name, "text": text, "chat": special,
                        "messages": dict(CHAT_PROMPTS).get(name), "prompt_ids": ids, "greedy_ids": greedy,
                        "margins": margins, "near": near})
        print(f"{name}: {len(ids)} prompt tokens, min margin {min(margins):.3f} -> {m.detokenize(greedy).decode('utf-8', 'replace')!r}")
    cases = [{"text": t, "ids": m.tokenize(t.encode("utf-8"), add_bos=False, special=False)} for t in TOKENIZER_CASES]
    doc = {
        "source": f"llama-cpp-python {llama_cpp.__version__}, CPU, n_threads=2, n_batch=512, greedy argmax, EOS ignored",
        "model_sha256": sha,
        "n_vocab": n_vocab,
        "n_greedy": N_GREEDY,
        "near": NEAR,
        "prompts": prompts,
        "tokenizer_cases": cases,
    }
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    if logits_type == "f16":
        np.stack(rows).astype("<f2").tofile(out + ".logits.f16")
    else:
        np.stack(rows).astype("<f4").tofile(out + ".logits.f32")


if __name__ == "__main__":
    main(*sys.argv[1:4])
