#!/usr/bin/env bash
# The demo: llmd serves the default model over Binder-over-Unix-socket, and llmctl streams the
# model's answer to a chat prompt through it.
# Usage: scripts/demo.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet -p llmd-daemon --bins
prompt=${1:-"Give me three tips for writing clear code."}
dir=$(mktemp -d)
sock="$dir/llmd.sock"
target/release/llmd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --socket "$sock" --kernel-binder off 2>"$dir/llmd.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 600); do
  [ -S "$sock" ] && break
  kill -0 $pid 2>/dev/null || { cat "$dir/llmd.log" >&2; exit 1; }
  sleep 0.1
done
echo "demo: llmd is serving on $sock; asking: $prompt" >&2
target/release/llmctl --socket "$sock" run --chat --max-tokens 128 "$prompt"
echo >&2
