#!/usr/bin/env python3
"""Reference data for the engine's tensor-type tests, from the PyPI `gguf` package (gguf-py,
llama.cpp's own Python reader): for each type, weight rows in that type's block layout, their
dequantization by gguf-py, an activation vector, and the float64 dot products of the two.

    pip install gguf==0.19.0 numpy
    python3 tools/golden/make_quant_fixtures.py tests/golden/quant.json

Types gguf-py can quantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) quantize random
normal data; for the K-quants, which gguf-py only dequantizes, the blocks are random bytes with
their f16 scale fields set to sane positive values.
"""
import base64, json, sys
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize, dequantize

ROWS, COLS = 3, 512
rng = np.random.default_rng(20261122)


def b64(a):
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def kquant_blocks(t, rows, cols):
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    def f16(lo, hi, n):
        return rng.uniform(lo, hi, size=n).astype(np.float16).view(np.uint8).reshape(-1, 2)
    for r in range(rows):
        for b in range(cols // bs):
            if t in (T.Q4_K, T.Q5_K):
                raw[r, b, 0:2] = f16(0.001, 0.05, 1)[0]   # d
                raw[r, b, 2:4] = f16(0.001, 0.05, 1)[0]   # dmin
            elif t == T.Q6_K:
                raw[r, b, 208:210] = f16(0.001, 0.05, 1)[0]  # d
            elif t == T.Q2_K:
                raw[r, b, 80:82] = f16(0.001, 0.05, 1)[0]   # d
                raw[r, b, 82:84] = f16(0.001, 0.05, 1)[0]   # dmin
            elif t == T.Q3_K:
                raw[r, b, 108:110] = f16(0.001, 0.05, 1)[0]  # d
    return raw.reshape(rows, -1)


def main(out):
    cases = []
    x = rng.standard_normal(COLS).astype(np.float32)
    for t in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
              T.Q2_K, T.Q3_K]:
        if t in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K):
            raw = kquant_blocks(t, ROWS, COLS)
        elif t == T.F32:
            raw = rng.standard_normal((ROWS, COLS)).astype(np.float32).view(np.uint8)
        else:
            raw = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), t)
        deq = dequantize(raw, t).astype(np.float32).reshape(ROWS, COLS)
        dots = [float(np.dot(deq[r].astype(np.float64), x.astype(np.float64))) for r in range(ROWS)]
        cases.append({"type": t.name, "rows": ROWS, "cols": COLS, "raw": b64(raw),
                      "dequantized": b64(deq.astype("<f4")), "dots": dots})
    doc = {"source": f"gguf-py {gguf.__version__ if hasattr(gguf, '__version__') else '0.19.0'} quantize/dequantize, numpy float64 dots",
           "activations": b64(x.astype("<f4")), "cases": cases}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
