#!/usr/bin/env bash
# The demo: llmd serves the default model over Binder-over-Unix-socket, and llmctl streams the
# model's answer to a chat prompt through it.
# Usage: scripts/demo.sh ["your question"]
# Exits 0 after a good run; non-zero, with a message on stderr, when a step fails. The daemon is
# stopped and its temporary directory removed either way (also on Ctrl-C): scripts/serve-llmd.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet -p llmd-daemon -p llmctl --bins
prompt=${1:-"Give me three tips for writing clear code."}
. scripts/serve-llmd.sh
serve_llmd "" --model models/SmolLM2-135M-Instruct.Q4_1.gguf --kernel-binder off
echo "demo: llmd is serving on $sock; asking: $prompt" >&2
status=0
target/release/llmctl --socket "$sock" run --chat --max-tokens 128 "$prompt" || status=$?
echo >&2
if [ "$status" -ne 0 ]; then
  echo "demo: llmctl failed with status $status (its message is above)" >&2
  exit "$status"
fi
