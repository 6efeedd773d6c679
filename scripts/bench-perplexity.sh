#!/usr/bin/env bash
# The accuracy table of docs/BENCHMARKS.md: perplexity of a model (default: the default model)
# at the source precision and converted to EdgeFlow at 4, 5, 6, 7 and 8 average bits (with the
# calibrated smoothing step), plus 4 and 5 bits without smoothing (the ablation), on a fixed
# text: the Jargon File from Debian's jargon-text (scripts/fetch-text.sh).
# Evaluation: EVAL_TOKENS tokens from token EVAL_OFFSET, windows of 512 (llmctl perplexity).
# Calibration: CAL_TOKENS tokens from token CAL_OFFSET — a disjoint part of the same text.
# Usage: scripts/bench-perplexity.sh [MODEL.gguf] ; prints one line per row, then a table.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TEXT=texts/jargon.txt
EVAL_OFFSET=${EVAL_OFFSET:-20000}
EVAL_TOKENS=${EVAL_TOKENS:-51200}
CAL_OFFSET=${CAL_OFFSET:-300000}
CAL_TOKENS=${CAL_TOKENS:-2048}
BITS=${BITS:-"4 5 6 7 8"}
ABLATION_BITS=${ABLATION_BITS:-"4 5"}
scripts/fetch-model.sh
scripts/fetch-text.sh
cargo build --release --quiet -p llmctl --bin llmctl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ppl() { target/release/llmctl perplexity --model "$1" --text "$TEXT" --offset "$EVAL_OFFSET" --tokens "$EVAL_TOKENS" --json | python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["perplexity"])'; }
rows=()
p=$(ppl "$MODEL"); echo "source $(basename "$MODEL"): $p" >&2; rows+=("source|-|$p")
for b in $BITS; do
  target/release/llmctl convert --bits "$b" --calibrate "$TEXT" --calibration-offset "$CAL_OFFSET" \
    --calibration-tokens "$CAL_TOKENS" "$MODEL" "$work/m.llmd" >/dev/null
  p=$(ppl "$work/m.llmd"); echo "edgeflow $b bits (smoothed): $p" >&2; rows+=("edgeflow + smoothing|$b|$p")
done
for b in $ABLATION_BITS; do
  target/release/llmctl convert --bits "$b" "$MODEL" "$work/m.llmd" >/dev/null
  p=$(ppl "$work/m.llmd"); echo "edgeflow $b bits (no smoothing): $p" >&2; rows+=("edgeflow, no smoothing|$b|$p")
done
echo "| weights | bits | perplexity |"
echo "|---|---|---|"
for r in "${rows[@]}"; do echo "| ${r//|/ | } |"; done
