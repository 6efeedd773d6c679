#!/usr/bin/env bash
# Fetches Intel's CPU OpenCL runtime (PyPI `intel-opencl-rt` 2026.2.0 with the compiler runtime,
# TBB and TCM it loads: ~235 MB of wheels, ~800 MB unpacked) into a cache outside the
# repository, for the GPU kernels' variants PoCL cannot run: it has subgroups
# (cl_intel_subgroups), fp16 arithmetic (cl_khr_fp16) and integer dot products. Skips what is
# already there. Prints `export LLMD_INTEL_OPENCL_LIB=<its libintelocl.so>` on stdout: the GPU
# tests open that library directly as a second OpenCL library (it exports the OpenCL API itself
# and finds its companions through its RUNPATH, $ORIGIN; Debian's ICD loader does not bring it
# up beside PoCL). Never committed, vendored or packaged.
set -euo pipefail
VERSION=2026.2.0
# The exact wheels (what intel-opencl-rt 2026.2.0 requires, pinned so a cache stays valid).
WHEELS=("intel-opencl-rt==$VERSION" "intel-cmplr-lib-rt==$VERSION" "tbb==2023.2.0" "tcmlib==1.6.0")
cache="${LLMD_INTEL_OPENCL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmd/intel-opencl-rt-$VERSION}"
case "$cache" in
  "$(cd "$(dirname "$0")/.." && pwd)"/*) echo "setup-intel-opencl: the cache must be outside the repository" >&2; exit 2 ;;
esac
lib="$cache/lib"
if [ ! -f "$lib/libintelocl.so" ]; then
  echo "setup-intel-opencl: downloading intel-opencl-rt $VERSION and its runtime libraries (~235 MB)" >&2
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --dest "$tmp" "${WHEELS[@]}" >&2
  python3 - "$tmp/x" "$tmp"/*.whl <<'PY'
import sys, zipfile
for whl in sys.argv[2:]:
    zipfile.ZipFile(whl).extractall(sys.argv[1])
PY
  mkdir -p "$lib.new"
  # Its own ICD loader (libOpenCL.so*) is left out; symbolic links were stored as copies.
  find "$tmp/x" -path '*/data/lib/*' -type f ! -name 'libOpenCL.so*' -exec cp {} "$lib.new/" \;
  rm -rf "$lib" && mv "$lib.new" "$lib"
fi
[ -f "$lib/libintelocl.so" ] || { echo "setup-intel-opencl: no libintelocl.so in the wheel" >&2; exit 1; }
echo "export LLMD_INTEL_OPENCL_LIB=$lib/libintelocl.so"
