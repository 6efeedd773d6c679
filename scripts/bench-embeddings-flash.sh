#!/usr/bin/env bash
# Embeddings on flash (docs/BENCHMARKS.md): resident memory and decode speed of a model with a
# separate output head, with its embedding table in DRAM vs read from storage on demand.
# The default model ties its head to the embedding (so the option cannot apply to it); this
# script makes a copy whose head is a separate tensor equal to the embedding
# (tools/bench/untie_head.py, PyPI gguf) — the same network in the layout of Llama 3 and other
# separate-head models — cached in ~/.cache/llmd/bench. Prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-5}
scripts/fetch-model.sh
python3 -c "import gguf" 2>/dev/null || python3 -m pip install --quiet "gguf==0.19.0"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llmd/bench"
mkdir -p "$cache"
untied="$cache/SmolLM2-135M-Instruct.Q4_1.untied.gguf"
[ -f "$untied" ] || python3 tools/bench/untie_head.py models/SmolLM2-135M-Instruct.Q4_1.gguf "$untied"
cargo build --release --quiet -p llmctl --bin llmctl
run() { target/release/llmctl bench --local --model "$untied" --threads 2 --reps "$REPS" --prefill 128 --json "$@"; }
dram=$(run)
flash=$(run --embeddings-on-flash)
python3 - "$dram" "$flash" <<'PY'
import json, sys
d, f = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print("| embeddings | weights in memory MB | peak RSS MB | decode tok/s | prefill@128 tok/s |")
print("|---|---|---|---|---|")
for name, x in (("in DRAM", d), ("on flash (rows read on demand)", f)):
    print(f"| {name} | {x['weight_bytes_in_memory'] / 1e6:.1f} | {x['peak_rss_mb']:.1f} | {x['decode_tok_s']:.1f} | {x['prefill_128_tok_s']:.1f} |")
print(f"\nDRAM saved: {(d['weight_bytes_in_memory'] - f['weight_bytes_in_memory']) / 1e6:.1f} MB of weights "
      f"({100 * (1 - f['weight_bytes_in_memory'] / d['weight_bytes_in_memory']):.1f}%), peak RSS "
      f"{100 * (1 - f['peak_rss_mb'] / d['peak_rss_mb']):.1f}% lower; decode {100 * (f['decode_tok_s'] / d['decode_tok_s'] - 1):+.1f}%")
PY
