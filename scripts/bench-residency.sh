#!/usr/bin/env bash
# Residency benchmark (docs/BENCHMARKS.md): time to first token, measured by the client from
# opening the session to the first token, for a model the daemon prefetched because its usage
# history predicted it, and for one it must load on demand (page cache dropped first when
# /proc/sys/vm/drop_caches is writable). Two model ids ("predicted", "other") are links to the
# default model; the budget fits one. Each of REPS rounds restarts the daemon, which prefetches
# "predicted" from the history a first daemon recorded. Prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
scripts/fetch-model.sh
cargo build --release --quiet -p llmd-daemon -p llmctl --bin llmd --bin llmctl
work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/models"
for id in predicted other; do ln -s "$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/models/$id.gguf"; done
sock="$work/llmd.sock"
start() { # $1 = prefetch_predicted
  rm -f "$sock"
  cat >"$work/llmd.toml" <<TOML
models_dir = "$work/models"
threads = 2
[residency]
memory_budget_mb = 230
load_at_start = false
prefetch_predicted = $1
state_dir = "$work/state"
TOML
  LLMD_LOG=warn target/release/llmd --config "$work/llmd.toml" --socket "$sock" --kernel-binder off >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 600); do [ -S "$sock" ] && return; sleep 0.1; done
  echo "llmd did not start" >&2; exit 1
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }
ctl() { target/release/llmctl --socket "$sock" "$@"; }
# One request: prints "open_ms first_token_ms".
ttft() {
  local err
  err=$(ctl run --model "$1" --max-tokens 4 "The capital of France is" 2>&1 >/dev/null)
  python3 - "$err" <<'PY'
import re, sys
s = sys.argv[1]
o = re.search(r"open (\d+) ms", s); f = re.search(r"first token (\d+) ms", s)
print(o.group(1), f.group(1))
PY
}
drop_cache() { [ -w /proc/sys/vm/drop_caches ] && { sync; echo 1 >/proc/sys/vm/drop_caches; } || true; }
start false
for _ in 1 2 3 4 5; do ctl run --model predicted --max-tokens 2 "Hello" >/dev/null 2>&1; done
stop
rows=()
for r in $(seq "$REPS"); do
  drop_cache
  start true
  for _ in $(seq 600); do ctl dump | grep -q "predicted: resident" && break; sleep 0.1; done
  read -r po pf < <(ttft predicted)
  drop_cache
  read -r oo of < <(ttft other)
  echo "round $r: predicted open ${po} ms first token ${pf} ms; other open ${oo} ms first token ${of} ms" >&2
  rows+=("$po $pf $oo $of")
  stop
done
python3 - "${rows[@]}" <<'PY'
import statistics, sys
rows = [list(map(float, r.split())) for r in sys.argv[1:]]
med = lambda i: statistics.median(r[i] for r in rows)
p, o = med(0) + med(1), med(2) + med(3)
print("| model | before the request | session open ms | first token ms | open → first token ms |")
print("|---|---|---|---|---|")
print(f"| predicted | prefetched from the usage history | {med(0):.0f} | {med(1):.0f} | {p:.0f} |")
print(f"| other | not resident (loaded on demand, page cache dropped) | {med(2):.0f} | {med(3):.0f} | {o:.0f} |")
print(f"\nmedians of {len(rows)} rounds; prefetched / on demand = {p / o:.2f}x")
PY
