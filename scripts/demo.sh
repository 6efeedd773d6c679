#!/usr/bin/env bash
# The demo: the default model streams an answer to a chat prompt.
# Usage: scripts/demo.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet -p llmd-daemon --bin llmctl
prompt=${1:-"Give me three tips for writing clear code."}
exec target/release/llmctl run --local --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat --max-tokens 128 "$prompt"
