#!/usr/bin/env bash
# Installs the llama.cpp peer for `llmctl bench --compare-llamacpp`: PyPI llama-cpp-python 0.3.36,
# built from source (about 15 minutes on 2 cores the first time). Not needed by the tests.
#
# Built with explicit instruction sets instead of -march=native: the native build crashes with a
# general-protection fault in libggml-cpu.so on its first decode on this machine kind (a Xeon with
# AMX). The build enables AVX2/FMA/F16C/AVX-512 (F, VNNI, VBMI, BF16) and leaves AMX off, which is
# what our own kernels use, so the comparison is like for like. A crashing installed build is
# detected by a one-token run and rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
works() {
  python3 - <<'PY' 2>/dev/null
import sys, llama_cpp
if llama_cpp.__version__ != "0.3.36":
    sys.exit(1)
m = llama_cpp.Llama("models/SmolLM2-135M-Instruct.Q4_1.gguf", n_threads=1, n_ctx=64, verbose=False)
m("Hi", max_tokens=1, temperature=0)
PY
}
scripts/fetch-model.sh
if works; then
  exit 0
fi
echo "setup-llamacpp: building llama-cpp-python 0.3.36 (about 15 minutes)" >&2
flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if grep -qw avx512_vnni /proc/cpuinfo; then
  flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON"
  grep -qw avx512vbmi /proc/cpuinfo && flags="$flags -DGGML_AVX512_VBMI=ON"
  grep -qw avx512_bf16 /proc/cpuinfo && flags="$flags -DGGML_AVX512_BF16=ON"
fi
flags="$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
# Its run-time dependencies (llama-cpp-python 0.3.36's own requirements), then the package itself
# without them, so a forced rebuild does not reinstall numpy.
python3 -m pip install --quiet "diskcache>=5.6.1" "numpy>=1.20.0" "typing-extensions>=4.5.0" "jinja2>=2.11.3"
CMAKE_ARGS="$flags" python3 -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
  --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
works || { echo "setup-llamacpp: the built llama-cpp-python does not run" >&2; exit 1; }
