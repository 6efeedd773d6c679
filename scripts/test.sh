#!/usr/bin/env bash
# The whole test suite (what CI runs): unit and integration tests with the real default model
# (engine against llama.cpp's golden outputs, the daemon over Binder-over-socket), the Android
# cross-check of every crate, the ARM kernels under qemu-user, the SELinux policy, the Kotlin client on the JVM, the demo script, and real
# kernel Binder in a QEMU VM.
# The GPU backend's OpenCL tests run on PoCL (scripts/setup-opencl.sh) and, for the subgroup
# and fp16 variants, Intel's CPU runtime (scripts/setup-intel-opencl.sh), with LLMD_REQUIRE_OPENCL=1 and
# LLMD_REQUIRE_SUBGROUPS=1 LLMD_REQUIRE_FP16=1: a missing runtime is a failure, not a skip.
# LLMD_SKIP_VM=1 skips the VM test (for quick local runs; CI always runs it).
# LLMD_LARGE_MODEL_TESTS=1 also fetches the 1.5B K-quant model (1.1 GB, scripts/fetch-model-1.5b.sh)
# and runs the tests that need it (its golden test against llama.cpp); CI's quick path does not.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Real OpenCL runtimes for the GPU backend's tests: PoCL, and Intel's CPU runtime (subgroups, fp16)
# for the variants PoCL lacks; a missing one fails them.
eval "$(scripts/setup-opencl.sh)"
eval "$(scripts/setup-intel-opencl.sh)"
export LLMD_REQUIRE_OPENCL=1 LLMD_REQUIRE_SUBGROUPS=1 LLMD_REQUIRE_FP16=1
echo "== no import circles between the top-level modules, nor between the files, of any crate (tools/module_cycles.py)" >&2
python3 tools/module_cycles.py .
python3 tools/module_cycles.py . --files
echo "== accelerator runtimes named only by their backends (tools/confined_imports.py)" >&2
python3 tools/confined_imports.py .
echo "== cargo test (release; the real model runs in these tests)" >&2
cargo test --release --workspace
if [ "${LLMD_LARGE_MODEL_TESTS:-0}" = 1 ]; then
  echo "== the 1.5B K-quant model against llama.cpp (LLMD_LARGE_MODEL_TESTS=1)" >&2
  scripts/fetch-model-1.5b.sh
  cargo test --release -p llmd-engine --test golden -- --ignored
  cargo test --release -p llmd-engine --test gpu_opencl -- --ignored
fi
echo "== cargo check --target aarch64-linux-android" >&2
cargo check --release --target aarch64-linux-android --workspace
echo "== ARM kernels under qemu-user (scripts/test-arm.sh)" >&2
scripts/test-arm.sh
echo "== sepolicy (tests/sepolicy/check.sh)" >&2
tests/sepolicy/check.sh
echo "== Kotlin client on the JVM (client-kotlin/build.sh)" >&2
client-kotlin/build.sh
echo "== the demo command end to end: exit status, reply, clean-up (tests/scripts/demo_script.py)" >&2
python3 tests/scripts/demo_script.py
if [ "${LLMD_SKIP_VM:-0}" != 1 ]; then
  echo "== kernel Binder in a VM (tests/kernel-binder/run.sh)" >&2
  tests/kernel-binder/run.sh
fi
