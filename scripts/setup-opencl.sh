#!/usr/bin/env bash
# Installs a real OpenCL runtime for the GPU backend's tests, skipping what is there: Debian's
# ICD loader (libOpenCL.so.1) and PoCL, whose device is this machine's CPU (OpenCL C 1.2, no
# cl_khr_fp16, no subgroups; device type CPU, which the backend finds with CL_DEVICE_TYPE_ALL).
# PoCL says nothing about a phone GPU's speed: it is for correctness.
# Prints the environment to use (source-able lines) on stdout.
set -euo pipefail
have_pocl() { [ -e /etc/OpenCL/vendors/pocl.icd ] && ldconfig -p | grep -q 'libOpenCL.so.1'; }
if ! have_pocl; then
  echo "setup-opencl: installing pocl-opencl-icd and ocl-icd-libopencl1 (Debian)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends pocl-opencl-icd ocl-icd-libopencl1 >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends pocl-opencl-icd ocl-icd-libopencl1 >/dev/null; }
fi
have_pocl || { echo "setup-opencl: PoCL is still missing after installing it" >&2; exit 1; }
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llmd/pocl"
mkdir -p "$cache"
# PoCL's kernel cache outside the repository; one PoCL worker thread (with its default two on a
# 2-core machine, the host's own loop runs at 63% speed).
echo "export POCL_CACHE_DIR=$cache"
echo "export POCL_MAX_PTHREAD_COUNT=1"
