#!/usr/bin/env bash
# Installs the llama.cpp peer for `llmctl bench --compare-llamacpp`: PyPI llama-cpp-python 0.3.36,
# built from source for this CPU (about 15 minutes on 2 cores the first time; pip caches the
# wheel after). Not needed by the tests.
set -euo pipefail
if python3 -c 'import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == "0.3.36" else 1)' 2>/dev/null; then
  exit 0
fi
echo "setup-llamacpp: building llama-cpp-python 0.3.36 (about 15 minutes)" >&2
python3 -m pip install --quiet "llama-cpp-python==0.3.36"
