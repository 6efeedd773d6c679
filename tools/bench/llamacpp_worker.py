"""llama.cpp side of `llmctl bench --compare-llamacpp` (embedded in llmctl; kept here for review).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.
  {"op": "load", "model": PATH, "threads": T, "n_ctx": C, "n_batch": B}
      -> {"ok": true, "rss_before_load_kb": .., "load_s": ..}
  {"op": "prefill", "tokens": [ids]}             -> {"ok": true, "seconds": ..}
  {"op": "decode", "prompt": [ids], "steps": [ids]} -> {"ok": true, "seconds": .., "prompt_seconds": ..}
  {"op": "batch_decode", "prompts": [[ids], ..], "steps": [[ids], ..], "threads": T}
      -> {"ok": true, "seconds": ..}
      (continuous batching: a context of the loaded model with one sequence per prompt; each
      prompt is prefilled alone, then every step decodes one token of every sequence in one
      llama_decode; seconds covers the steps only)
  {"op": "rss"}                                   -> {"ok": true, "vm_hwm_kb": .., "vm_rss_kb": ..}
  {"op": "cold", "model": PATH, "threads": T, "n_ctx": C, "n_batch": B, "prompt": [ids]}
      -> {"ok": true, "seconds": .., "load_s": .., "eval_s": .., "read_bytes": .., "first_token": id}
      (a cold start: any loaded model is freed first; timed from the load call to the first
      token's logits and argmax; read_bytes from /proc/self/io over the same span)
  {"op": "quit"}
Timing covers llama_decode only (through Llama.eval); no sampling, no tokenization.
Decode feeds a fixed token sequence one token at a time, so both engines do identical work.
"""
import json
import sys
import time


def status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def io_read_bytes():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def open_model(llama_cpp, req):
    """The model as every op loads it: the request's file, context, threads and batch."""
    return llama_cpp.Llama(
        model_path=req["model"],
        n_ctx=req["n_ctx"],
        n_threads=req["threads"],
        n_threads_batch=req["threads"],
        n_batch=req["n_batch"],
        n_ubatch=req["n_batch"],
        logits_all=False,
        verbose=False,
    )


def batch_decode(llama_cpp, llm, req):
    """Seconds for len(steps[0]) batched steps of len(prompts) sequences (see the protocol)."""
    L = llama_cpp
    prompts, steps = req["prompts"], req["steps"]
    b = len(prompts)
    if b == 0 or len(steps) != b or len({len(s) for s in steps}) != 1:
        raise ValueError("batch_decode needs one step list per prompt, all of one length")
    per_seq = max(len(p) + len(s) for p, s in zip(prompts, steps))
    cp = L.llama_context_default_params()
    cp.n_seq_max = b
    cp.n_ctx = b * ((per_seq + 255) // 256 * 256)
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_threads = req["threads"]
    cp.n_threads_batch = req["threads"]
    # A second context on the model `load` opened (llama-cpp-python 0.3.36 keeps the raw
    # llama_model pointer in the private `_model.model`; the high-level Llama has no
    # multi-sequence decode).
    ctx = L.llama_init_from_model(llm._model.model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    batch = L.llama_batch_init(max(512, b), 0, b)
    try:
        def decode(items):
            batch.n_tokens = len(items)
            for i, (seq, pos, tok, want) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        for seq, p in enumerate(prompts):
            for at in range(0, len(p), 512):
                chunk = p[at:at + 512]
                decode([(seq, at + i, t, at + i == len(p) - 1) for i, t in enumerate(chunk)])
        t0 = time.perf_counter()
        for k in range(len(steps[0])):
            decode([(seq, len(prompts[seq]) + k, steps[seq][k], True) for seq in range(b)])
        return time.perf_counter() - t0
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    try:
        import llama_cpp
    except Exception as e:  # not installed: say so in one line
        reply({"ok": False, "error": f"python module llama_cpp is not importable: {e}"})
        return
    llm = None
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "load":
                before = status_kb("VmRSS")
                t0 = time.perf_counter()
                llm = open_model(llama_cpp, req)
                reply({"ok": True, "rss_before_load_kb": before, "load_s": time.perf_counter() - t0,
                       "version": llama_cpp.__version__})
            elif op == "prefill":
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(req["tokens"])
                reply({"ok": True, "seconds": time.perf_counter() - t0})
            elif op == "decode":
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(req["prompt"])
                t1 = time.perf_counter()
                total = 0.0
                for tok in req["steps"]:
                    s = time.perf_counter()
                    llm.eval([tok])
                    total += time.perf_counter() - s
                reply({"ok": True, "seconds": total, "prompt_seconds": t1 - t0})
            elif op == "cold":
                if llm is not None:
                    llm.close() if hasattr(llm, "close") else None
                    llm = None
                import gc
                gc.collect()
                r0 = io_read_bytes()
                t0 = time.perf_counter()
                llm = open_model(llama_cpp, req)
                t1 = time.perf_counter()
                llm.eval(req["prompt"])
                import numpy as np
                vocab = llm.n_vocab()
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
                first = int(logits.argmax())
                t2 = time.perf_counter()
                read = io_read_bytes() - r0
                # Unmap the model now: a mapped file's pages cannot be evicted before the next run.
                llm.close()
                llm = None
                gc.collect()
                reply({"ok": True, "seconds": t2 - t0, "load_s": t1 - t0, "eval_s": t2 - t1,
                       "read_bytes": read, "first_token": first,
                       "version": llama_cpp.__version__})
            elif op == "batch_decode":
                reply({"ok": True, "seconds": batch_decode(llama_cpp, llm, req)})
            elif op == "rss":
                reply({"ok": True, "vm_hwm_kb": status_kb("VmHWM"), "vm_rss_kb": status_kb("VmRSS")})
            elif op == "quit":
                return
            else:
                reply({"ok": False, "error": f"unknown op {op}"})
        except Exception as e:
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
