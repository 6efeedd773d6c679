#!/usr/bin/env bash
# The soak benchmark: starts llmd on a socket with the default model and
# daemon/config/bench-soak.toml, then runs `llmctl bench --soak MINUTES` against it (8 clients
# by default). Usage: scripts/bench-soak.sh MINUTES [more llmctl bench options, e.g. --json]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/bench-soak.sh MINUTES [llmctl bench options]" >&2; exit 2; }
minutes=$1
shift
scripts/setup.sh
cargo build --release --quiet -p llmd-daemon -p llmctl --bins
. scripts/serve-llmd.sh
serve_llmd "${LLMD_BENCH_LOG:-}" --config daemon/config/bench-soak.toml --model models/SmolLM2-135M-Instruct.Q4_1.gguf
target/release/llmctl --socket "$sock" bench --soak "$minutes" "$@"
