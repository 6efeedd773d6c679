#!/usr/bin/env bash
# Fetches Intel's CPU OpenCL runtime (PyPI `opencl-rt` 2021.2.0, ~170 MB, with Debian's libtbb12)
# into a cache outside the repository, for the GPU kernels' subgroup variant: PoCL has no
# subgroups; Intel's runtime has cl_intel_subgroups. Skips what is already there. Prints
# `export LLMD_INTEL_OPENCL_LIB=<its libintelocl.so>` on stdout: the GPU tests open that library
# directly as a second OpenCL library (it exports the OpenCL API itself; Debian's ICD loader
# does not bring it up beside PoCL). Never committed, vendored or packaged.
set -euo pipefail
VERSION=2021.2.0
cache="${LLMD_INTEL_OPENCL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmd/intel-opencl-rt-$VERSION}"
case "$cache" in
  "$(cd "$(dirname "$0")/.." && pwd)"/*) echo "setup-intel-opencl: the cache must be outside the repository" >&2; exit 2 ;;
esac
if ! ldconfig -p | grep -q 'libtbb.so.12'; then
  echo "setup-intel-opencl: installing libtbb12 (Debian)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends libtbb12 >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends libtbb12 >/dev/null; }
fi
lib="$cache/lib"
if [ ! -f "$lib/libintelocl.so" ]; then
  echo "setup-intel-opencl: downloading opencl-rt $VERSION (~170 MB)" >&2
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --dest "$tmp" "opencl-rt==$VERSION" >&2
  python3 - "$tmp"/opencl_rt-*.whl "$tmp/x" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
  mkdir -p "$lib.new"
  # Its own ICD loader (libOpenCL.so*) is left out.
  find "$tmp/x" -path '*/data/lib/*' -type f ! -name 'libOpenCL.so*' -exec cp {} "$lib.new/" \;
  rm -rf "$lib" && mv "$lib.new" "$lib"
fi
[ -f "$lib/libintelocl.so" ] || { echo "setup-intel-opencl: no libintelocl.so in the wheel" >&2; exit 1; }
echo "export LLMD_INTEL_OPENCL_LIB=$lib/libintelocl.so"
