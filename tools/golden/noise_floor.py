#!/usr/bin/env python3
"""How much llama.cpp disagrees with itself: the golden logits (prompt evaluated in one batch)
against the same prompts evaluated one token at a time on one thread. The engine's logit
tolerances in engine/tests/golden.rs are set from this noise floor.

    python3 tools/golden/noise_floor.py models/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 tools/golden/noise_floor.py models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf qwen2.5-coder-1.5b
"""
import sys
import json, numpy as np
from llama_cpp import Llama
import os
name = sys.argv[2] if len(sys.argv) > 2 else 'smollm2'
g = json.load(open(f'tests/golden/{name}.json'))
f16 = f'tests/golden/{name}.logits.f16'
ref = (np.fromfile(f16, dtype='<f2').astype(np.float32) if os.path.exists(f16)
       else np.fromfile(f'tests/golden/{name}.logits.f32', dtype='<f4')).reshape(len(g['prompts']), -1)
m = Llama(model_path=sys.argv[1], n_ctx=1024, n_batch=1, n_ubatch=1, n_threads=1, verbose=False)
def ls(x): x=x.astype(np.float64); x=x-x.max(); return x-np.log(np.exp(x).sum())
for i,p in enumerate(g['prompts']):
    m.reset(); m.eval(p['prompt_ids'])
    l = np.ctypeslib.as_array(m._ctx.get_logits(), shape=(m.n_vocab(),)).copy()
    a, b = ls(l), ls(ref[i])
    kl = (np.exp(b)*(b-a)).sum(); d = l-ref[i]; d=d-d.mean()
    print(p['name'], f"kl={kl:.2e} pmax={np.abs(np.exp(a)-np.exp(b)).max():.4f} centered max={np.abs(d).max():.3f} rms={np.sqrt((d**2).mean()):.3f}")
