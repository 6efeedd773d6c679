#!/usr/bin/env bash
# The arbitration load benchmark: starts llmd on a socket with the default model and
# daemon/config/bench-load.toml, then runs `llmctl bench --load` against it (8 clients: 2
# foreground, 6 background). Extra arguments go to `llmctl bench`, e.g. --json --duration-s 60.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet -p llmd-daemon --bins
dir=$(mktemp -d)
sock="$dir/llmd.sock"
target/release/llmd --config daemon/config/bench-load.toml --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --socket "$sock" 2>"${LLMD_BENCH_LOG:-$dir/llmd.log}" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 600); do
  [ -S "$sock" ] && break
  kill -0 $pid 2>/dev/null || { cat "$dir/llmd.log" >&2; exit 1; }
  sleep 0.1
done
target/release/llmctl --socket "$sock" bench --load "$@"
