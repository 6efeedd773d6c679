#!/usr/bin/env python3
"""A tiny qwen2 model in llama.cpp's own Q4_K_M mix, with llama.cpp's outputs on it.

    pip install gguf==0.19.0 numpy llama-cpp-python==0.3.36
    python3 tools/golden/make_tiny_kquant.py tests/fixtures tests/golden/tiny-kquant.json

The default model and the other tiny fixtures have no K-quant tensor (their widths are not
multiples of 256, the K-quant super-block). This one is 256 wide (FFN 512, 2 layers, 4 query /
2 KV heads, a separate output head) with F32 random weights from a fixed seed, quantized by
llama.cpp's `llama_model_quantize` to Q4_K_M — so the types and their mix (Q4_K, Q6_K for the
head and some attn_v/ffn_down, ...) are exactly what llama.cpp's own tools write. The golden
file holds llama.cpp's last-position logits and greedy tokens with their margins.
"""
import json, os, sys, tempfile, ctypes
import numpy as np
import gguf
import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(__file__))
from make_tiny_models import bytes_to_unicode, learn_merges, CORPUS  # noqa: E402

rng = np.random.default_rng(11)
D, HEADS, KV, FFN, LAYERS, CTX = 256, 4, 2, 512, 2, 256
CANDIDATES = ["the quick brown fox jumps", "she said , then they", "the dog ran in the park and",
              "there is more to the story", "the cat sat on the mat", "then they went home , she said",
              "over the lazy dog the fox ran", "in the park there is a cat"]


def mat(rows, cols, scale=None):
    return (rng.standard_normal((rows, cols)) * (scale or 1 / np.sqrt(cols))).astype(np.float32)


def write_f32(path):
    b2u = bytes_to_unicode()
    enc = lambda s: "".join(b2u[b] for b in s.encode("utf-8"))
    words = [enc(" " + x) for x in CORPUS.split()]
    merges = learn_merges(words, 60)
    tokens = [b2u[b] for b in range(256)]
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    vocab = len(tokens)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D // HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_rope_freq_base(1000000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)
    hd = D // HEADS
    w.add_tensor("token_embd.weight", mat(vocab, D, 1.0))
    for l in range(LAYERS):
        p = f"blk.{l}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
        # Small queries and keys keep attention away from sharp softmax peaks, where float
        # noise can move the logits of a random model by whole units.
        w.add_tensor(p + "attn_q.weight", mat(HEADS * hd, D, 0.3 / np.sqrt(D)))
        w.add_tensor(p + "attn_k.weight", mat(KV * hd, D, 0.3 / np.sqrt(D)))
        w.add_tensor(p + "attn_v.weight", mat(KV * hd, D))
        w.add_tensor(p + "attn_q.bias", (0.05 * rng.standard_normal(HEADS * hd)).astype(np.float32))
        w.add_tensor(p + "attn_k.bias", (0.05 * rng.standard_normal(KV * hd)).astype(np.float32))
        w.add_tensor(p + "attn_v.bias", (0.5 * rng.standard_normal(KV * hd)).astype(np.float32))
        w.add_tensor(p + "attn_output.weight", mat(D, HEADS * hd))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(FFN, D))
        w.add_tensor(p + "ffn_up.weight", mat(FFN, D))
        w.add_tensor(p + "ffn_down.weight", mat(D, FFN))
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    w.add_tensor("output.weight", mat(vocab, D, 2.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src, dst):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize failed: {rc}")


def logits_without_repack(path, ids, n_vocab):
    """llama.cpp's last-position logits with its repacked CPU weights turned off
    (`use_extra_bufts = false`): its other K-quant code path, for its own noise floor."""
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = CTX, 2, 2
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    batch.n_tokens = len(ids)
    for i, t in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if i == len(ids) - 1 else 0
    if llama_cpp.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed")
    out = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, len(ids) - 1), shape=(n_vocab,)).copy()
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return out


def golden(path):
    m = Llama(model_path=path, n_ctx=CTX, n_threads=2, verbose=False, flash_attn=False)
    n_vocab = m.n_vocab()
    out = {"prompts": []}
    for p in CANDIDATES:
        ids = m.tokenize(p.encode(), add_bos=False, special=False)
        m.reset()
        m.eval(ids)
        lg = lambda: np.ctypeslib.as_array(m._ctx.get_logits(), shape=(n_vocab,)).copy()
        first = lg()
        # A random 2-layer model is sensitive: one activation rounding differently moves its
        # logits by whole units. llama.cpp's two K-quant paths are recorded as its noise floor.
        self_diff = float(np.abs(logits_without_repack(path, ids, n_vocab) - first).max())
        greedy, margins = [], []
        for _ in range(16):
            l = lg()
            s = np.sort(l)[::-1]
            t = int(np.argmax(l))
            greedy.append(t)
            margins.append(float(s[0] - s[1]))
            m.eval([t])
        out["prompts"].append({"text": p, "prompt_ids": ids, "logits": [float(x) for x in first],
                               "greedy_ids": greedy, "margins": margins, "llama_self_diff": self_diff})
    return out


def main(fixtures, golden_path):
    os.makedirs(fixtures, exist_ok=True)
    dst = os.path.join(fixtures, "tiny-qwen2-q4km.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "f32.gguf")
        write_f32(src)
        quantize(src, dst)
    r = gguf.GGUFReader(dst)
    kinds = {}
    for t in r.tensors:
        kinds.setdefault(t.tensor_type.name, []).append(t.name)
    doc = {"source": "llama-cpp-python 0.3.36, CPU, greedy argmax, EOS ignored",
           "types": {k: len(v) for k, v in kinds.items()}, "tiny-qwen2-q4km": golden(dst)}
    print(dst, os.path.getsize(dst), "bytes;", {k: len(v) for k, v in kinds.items()},
          "min margins", [round(min(p["margins"]), 3) for p in doc["tiny-qwen2-q4km"]["prompts"]],
          "llama.cpp self-diff", [round(p["llama_self_diff"], 4) for p in doc["tiny-qwen2-q4km"]["prompts"]])
    with open(golden_path, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
