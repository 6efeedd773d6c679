#!/usr/bin/env python3
"""Tiny random models that cover what the default model does not, with llama.cpp's outputs.

    pip install gguf==0.19.0 numpy llama-cpp-python==0.3.36
    python3 tools/golden/make_tiny_models.py tests/fixtures tests/golden/tiny.json

- tiny-llama-spm.gguf: llama architecture, SentencePiece-style vocabulary (scores, byte-fallback
  tokens, add_bos), grouped-query attention (4 query / 2 KV heads), a separate output head,
  RoPE with linear scaling (factor 2).
- tiny-qwen2.gguf: qwen2 architecture (Q/K/V biases, rotate-half RoPE), GPT-2 byte-level BPE
  with the qwen2 pre-tokenizer, tied embeddings, ChatML special tokens and template.
Weights are F32 random normals from a fixed seed, the output head scaled so the next token is
usually clear. The golden file holds llama.cpp's token ids for test strings, last-position
logits and greedy tokens with their margins.
"""
import json, os, sys
import numpy as np
import gguf
from llama_cpp import Llama

rng = np.random.default_rng(7)
D, HEADS, KV, FFN, LAYERS, CTX = 32, 4, 2, 64, 2, 256
CORPUS = ("the quick brown fox jumps over the lazy dog . the cat sat on the mat and the dog ran "
          "in the park ; there is more to the story than that , she said , then they went home")


def bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def learn_merges(words, n_merges):
    """Plain BPE on a word list: returns merges (a, b) in order."""
    seqs = [list(w) for w in words]
    merges = []
    for _ in range(n_merges):
        counts = {}
        for s in seqs:
            for a, b in zip(s, s[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda k: counts[k])
        merges.append(best)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i:i + 2] = [s[i] + s[i + 1]]
                i += 1
    return merges


def weights(w, vocab, arch, tied):
    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or 1 / np.sqrt(cols))).astype(np.float32)
    hd = D // HEADS
    w.add_tensor("token_embd.weight", mat(vocab, D, 1.0))
    for l in range(LAYERS):
        p = f"blk.{l}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
        w.add_tensor(p + "attn_q.weight", mat(HEADS * hd, D))
        w.add_tensor(p + "attn_k.weight", mat(KV * hd, D))
        w.add_tensor(p + "attn_v.weight", mat(KV * hd, D))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", (0.5 * rng.standard_normal(HEADS * hd)).astype(np.float32))
            w.add_tensor(p + "attn_k.bias", (0.5 * rng.standard_normal(KV * hd)).astype(np.float32))
            w.add_tensor(p + "attn_v.bias", (0.5 * rng.standard_normal(KV * hd)).astype(np.float32))
        w.add_tensor(p + "attn_output.weight", mat(D, HEADS * hd))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(FFN, D))
        w.add_tensor(p + "ffn_up.weight", mat(FFN, D))
        w.add_tensor(p + "ffn_down.weight", mat(D, FFN))
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", mat(vocab, D, 1.0))


def hparams(w, vocab):
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)


def llama_spm(path):
    words = ["\u2581" + x for x in CORPUS.split()]
    merges = learn_merges(words, 60)
    chars = sorted(set("".join(words)))
    pieces = chars + [a + b for a, b in merges]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    seen = set()
    for i, p in enumerate(pieces):
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        types.append(1)
        # Later merges score lower (as sentencepiece's -rank); single characters lowest.
        scores.append(-1000.0 - i if len(p) == 1 else -float(i))
    w = gguf.GGUFWriter(path, "llama")
    hparams(w, len(tokens))
    w.add_rope_freq_base(10000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    weights(w, len(tokens), "llama", tied=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def qwen2_bpe(path):
    b2u = bytes_to_unicode()
    enc = lambda s: "".join(b2u[b] for b in s.encode("utf-8"))
    words = [enc(" " + x) for x in CORPUS.split()]
    merges = learn_merges(words, 60)
    tokens = [b2u[b] for b in range(256)]
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types += [3, 3, 3]
    w = gguf.GGUFWriter(path, "qwen2")
    hparams(w, len(tokens))
    w.add_rope_freq_base(1000000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    weights(w, len(tokens), "qwen2", tied=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TEXTS = ["the quick brown fox", "The Cat sat; on THE mat!", "there   is  more\n\nto it 123", "héllo wörld ✓ 東京", ""]
PROMPTS = ["the quick brown fox jumps", "she said , then they", "the dog ran in the park and"]


def golden(path):
    m = Llama(model_path=path, n_ctx=CTX, n_threads=2, verbose=False)
    n_vocab = m.n_vocab()
    out = {"tokenizer_cases": [], "prompts": []}
    for t in TEXTS:
        out["tokenizer_cases"].append({"text": t, "ids": m.tokenize(t.encode(), add_bos=True, special=False)})
    for p in PROMPTS:
        ids = m.tokenize(p.encode(), add_bos=True, special=False)
        m.reset()
        m.eval(ids)
        lg = lambda: np.ctypeslib.as_array(m._ctx.get_logits(), shape=(n_vocab,)).copy()
        first = lg()
        greedy, margins = [], []
        for _ in range(16):
            l = lg()
            s = np.sort(l)[::-1]
            t = int(np.argmax(l))
            greedy.append(t)
            margins.append(float(s[0] - s[1]))
            m.eval([t])
        out["prompts"].append({"text": p, "prompt_ids": ids, "logits": [float(x) for x in first],
                               "greedy_ids": greedy, "margins": margins})
    return out


def main(fixtures, golden_path):
    os.makedirs(fixtures, exist_ok=True)
    models = {"tiny-llama-spm": llama_spm, "tiny-qwen2": qwen2_bpe}
    doc = {"source": "llama-cpp-python 0.3.36, CPU, greedy argmax, EOS ignored"}
    for name, make in models.items():
        path = os.path.join(fixtures, name + ".gguf")
        make(path)
        doc[name] = golden(path)
        print(name, os.path.getsize(path), "bytes; greedy", [p["greedy_ids"][:8] for p in doc[name]["prompts"]],
              "min margins", [round(min(p["margins"]), 3) for p in doc[name]["prompts"]])
    with open(golden_path, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
