#!/usr/bin/env bash
# Fetches Qualcomm's QNN libraries built for x86-64 Linux (the HTP backend `libQnnHtp.so`, QAIRT
# 2.51, and what it loads) from the PyPI wheel onnxruntime-qnn 2.7.0 into a cache outside the
# repository, and prints the folder holding `libQnnHtp.so`. Skips the work when the cache is
# whole. Cache: $LLMD_QNN_CACHE, else ~/.cache/llmd/qnn-2.7.0.
#
# Licence (Qualcomm AI Stack License, in the wheel): use to develop and benchmark our software
# only. Never commit, vendor, package or disassemble these files; llmd loads them at run time
# (the NPU backend's tests against Qualcomm's own arithmetic) and builds without them.
set -euo pipefail
VERSION=2.7.0
cache=${LLMD_QNN_CACHE:-$HOME/.cache/llmd/qnn-$VERSION}
lib="$cache/onnxruntime_qnn/libQnnHtp.so"
if [ -f "$lib" ] && [ -f "$cache/.complete" ]; then
  echo "$cache/onnxruntime_qnn"
  exit 0
fi
# One fetch at a time (tests may ask at once); the second finds the cache whole.
mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
if [ -f "$lib" ] && [ -f "$cache/.complete" ]; then
  echo "$cache/onnxruntime_qnn"
  exit 0
fi
case "$cache" in
  "$(cd "$(dirname "$0")/.." && pwd)"/*) echo "fetch-qnn: the cache must be outside the repository" >&2; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-qnn: downloading onnxruntime-qnn $VERSION (~99 MB) for its QNN libraries" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 311 \
  --platform manylinux_2_35_x86_64 -d "$tmp" "onnxruntime-qnn==$VERSION" >&2
rm -rf "$cache"
mkdir -p "$cache"
# The libraries find their bundled C++ runtime through a relative rpath: keep both folders.
python3 - "$tmp"/onnxruntime_qnn-"$VERSION"-*.whl "$cache" <<'PY'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist()
             if (n.startswith("onnxruntime_qnn/") and ".so" in n) or n.startswith("onnxruntime_qnn.libs/")
             or n.endswith("LICENSE.pdf") or n.endswith("Qualcomm_LICENSE.pdf")]
    z.extractall(dest, names)
PY
[ -f "$lib" ] || { echo "fetch-qnn: the wheel held no onnxruntime_qnn/libQnnHtp.so" >&2; exit 1; }
touch "$cache/.complete"
echo "$cache/onnxruntime_qnn"
