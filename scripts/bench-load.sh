#!/usr/bin/env bash
# The arbitration load benchmark: starts llmd on a socket with the default model and
# daemon/config/bench-load.toml, then runs `llmctl bench --load` against it (8 clients: 2
# foreground, 6 background). Extra arguments go to `llmctl bench`, e.g. --json --duration-s 60.
# LLMD_BENCH_CONFIG names another config (daemon/config/bench-load-devices.toml: the NPU and GPU
# under backend "auto", emulated devices allowed; source scripts/setup-opencl.sh's output first).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet -p llmd-daemon -p llmctl --bins
# llmd's QNN emulator beside llmd (the NPU of bench-load-devices.toml)
cargo build --release --quiet -p qnn-emu-sys
. scripts/serve-llmd.sh
serve_llmd "${LLMD_BENCH_LOG:-}" --config "${LLMD_BENCH_CONFIG:-daemon/config/bench-load.toml}" --model models/SmolLM2-135M-Instruct.Q4_1.gguf
target/release/llmctl --socket "$sock" bench --load "$@"
# LLMD_BENCH_DUMP=FILE keeps the daemon's state after the run (`dump --json`: its recent jobs).
if [ -n "${LLMD_BENCH_DUMP:-}" ]; then
  target/release/llmctl --socket "$sock" dump --json >"$LLMD_BENCH_DUMP"
fi
