#!/usr/bin/env bash
# Runs llmd's fuzz targets (cargo-fuzz, libFuzzer; fuzz/) for a given wall time each and records
# every run in fuzz/RUNS.md, so CPU time accumulates across sessions.
#
#   scripts/fuzz.sh [--jobs N] TARGET|all SECONDS   fuzz (N processes per target, default 1)
#   scripts/fuzz.sh --merge TARGET|all              fold new coverage of the working corpus
#                                                   into the committed corpus (libFuzzer -merge)
#   scripts/fuzz.sh --totals                        CPU time, executions and crashes per target
#   scripts/fuzz.sh --list                          the targets
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
# Limits: an input taking more than 10 s is a hang (-timeout=10), more
# than 2 GB of memory an out-of-memory (-rss_limit_mb=2048, also the largest single malloc).
# Each target reads its seeds (fuzz/corpus/TARGET, committed) and grows a working corpus
# (fuzz/work/TARGET, not committed). Crashing inputs land in fuzz/artifacts/TARGET/: fix the
# product, then store the (minimised: `cargo +nightly fuzz tmin TARGET FILE`) input in
# fuzz/regressions/TARGET/ — `cargo test` replays those and the corpus on stable
# (daemon/tests/fuzz_replay.rs). Every target binary renders model files' chat templates in a
# sandbox process, itself started with --render-chat-template (llmd_engine::fuzzing::init).
# Targets are built with debug assertions (integer overflow panics, as in tests) and, by
# default, no sanitizer: the targets run safe Rust almost only, and AddressSanitizer costs ~5x
# the executions. FUZZ_SANITIZER=address runs with it (a build of its own, fuzz/target/address).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(gguf llmd hf tokenizer chat_template aidl config)
LEDGER=fuzz/RUNS.md
SANITIZER=${FUZZ_SANITIZER:-none}
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
BIN_DIR=fuzz/target/$SANITIZER/$TRIPLE/release

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

targets_of() {
  if [ "$1" = all ]; then echo "${TARGETS[@]}"; return; fi
  for t in "${TARGETS[@]}"; do [ "$t" = "$1" ] && { echo "$1"; return; }; done
  echo "fuzz.sh: no target $1 (targets: ${TARGETS[*]})" >&2; exit 2
}

build() {
  echo "== building the fuzz targets (nightly, sanitizer $SANITIZER)" >&2
  nice -n 10 cargo +nightly fuzz build --sanitizer "$SANITIZER" --debug-assertions \
    --target-dir "fuzz/target/$SANITIZER" >&2
}

# CPU seconds (user + system) of this shell's waited-for children so far, from the `times` builtin
# (run in this shell, not a subshell: a subshell counts only its own children).
TIMES_FILE=$(mktemp); trap 'rm -f "$TIMES_FILE"' EXIT
children_cpu() {
  tail -1 "$TIMES_FILE" | awk '{ t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); sub(/s$/, "", a[2]); t += a[1] * 60 + a[2] } printf "%d\n", t }'
}

totals() {
  # Columns: date | target | seconds | jobs | executions | cov | ft | crashes | corpus | sanitizer
  # | commit | CPU seconds. A row with an empty CPU column counts seconds x jobs.
  awk -F'|' '/^\| 20/ {
      t=$3; gsub(/ /,"",t); s=$4+0; j=$5+0; e=$6+0; c=$9; gsub(/ /,"",c)
      m=$13; gsub(/ /,"",m); cpu[t]+=(m != "" ? m+0 : s*j); ex[t]+=e; n[t]++; split(c, k, "/"); cr[t]+=k[1]+k[2]+k[3]
      cov=$7+0; ft=$8+0; if (cov>mc[t]) mc[t]=cov; if (ft>mf[t]) mf[t]=ft }
    END { for (t in cpu) printf "%-14s %10.2f %6d %14d %8d %8d %8d\n", t, cpu[t]/3600, n[t], ex[t], mc[t], mf[t], cr[t] }' \
    "$LEDGER" | sort | { printf "%-14s %10s %6s %14s %8s %8s %8s\n" target CPU-hours runs executions "max cov" "max ft" crashes; cat; }
}

JOBS=1
MODE=run
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) JOBS=$2; shift 2 ;;
    --merge) MODE=merge; shift ;;
    --totals) totals; exit 0 ;;
    --list) echo "${TARGETS[@]}"; exit 0 ;;
    -h|--help) usage ;;
    *) break ;;
  esac
done

if [ "$MODE" = merge ]; then
  [ $# -eq 1 ] || usage
  build
  for t in $(targets_of "$1"); do
    mkdir -p "fuzz/work/$t"
    echo "== merging fuzz/work/$t into fuzz/corpus/$t" >&2
    nice -n 10 "$BIN_DIR/$t" -set_cover_merge=1 -rss_limit_mb=2048 -timeout=10 "fuzz/corpus/$t" "fuzz/work/$t" 2>&1 | tail -3 >&2
  done
  exit 0
fi

[ $# -eq 2 ] || usage
SECONDS_EACH=$2
case "$SECONDS_EACH" in ''|*[!0-9]*) usage ;; esac
build
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
failed=0
for t in $(targets_of "$1"); do
  mkdir -p "fuzz/work/$t" "fuzz/artifacts/$t" fuzz/logs
  before=$(ls "fuzz/artifacts/$t" | wc -l)
  stamp=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  echo "== $t: ${SECONDS_EACH} s x $JOBS job(s)" >&2
  pids=()
  times >"$TIMES_FILE"; cpu_before=$(children_cpu)
  for j in $(seq 1 "$JOBS"); do
    log="fuzz/logs/$t-$(date -u +%Y%m%dT%H%M%S)-$j.log"
    logs[$j]=$log
    # The working corpus first: libFuzzer writes new inputs there, reads the seeds too, and
    # (-reload) picks up what the other jobs add.
    nice -n 10 "$BIN_DIR/$t" "fuzz/work/$t" "fuzz/corpus/$t" -max_total_time="$SECONDS_EACH" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  times >"$TIMES_FILE"; cpu=$(( $(children_cpu) - cpu_before ))
  execs=0; cov=0; ft=0
  for j in $(seq 1 "$JOBS"); do
    log=${logs[$j]}
    e=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    execs=$((execs + ${e:-0}))
    last=$(grep -E '^#[0-9]+.* cov: ' "$log" | tail -1 || true)
    c=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last"); f=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    [ "${c:-0}" -gt "$cov" ] && cov=$c
    [ "${f:-0}" -gt "$ft" ] && ft=$f
  done
  new=$(ls -t "fuzz/artifacts/$t" | head -n $(( $(ls "fuzz/artifacts/$t" | wc -l) - before )) || true)
  n_crash=$(grep -c '^crash-' <<<"$new" || true); n_timeout=$(grep -c '^timeout-' <<<"$new" || true)
  n_oom=$(grep -c '^oom-' <<<"$new" || true)
  corp=$(ls "fuzz/work/$t" | wc -l)
  [ -f "$LEDGER" ] || cat >"$LEDGER" <<'EOF'
# Fuzzing ledger

One line per run of `scripts/fuzz.sh` (appended by it): wall seconds per job, jobs (processes,
one core each), executions summed over the jobs, libFuzzer's final `cov:` (code edges) and
`ft:` (features) — the largest of the jobs —, new crashes / timeouts (> 10 s) / out-of-memory
(> 2 GB) artifacts, inputs in the working corpus, sanitizer, commit and CPU time of a run:
the measured user + system CPU seconds of its jobs (last column; rows from before it was
measured count seconds × jobs); `scripts/fuzz.sh --totals` sums them per target. `cov`/`ft` compare only
between runs of the same sanitizer (AddressSanitizer's build counts more edges).

| date (UTC) | target | seconds | jobs | executions | cov | ft | crash/timeout/oom | work corpus | sanitizer | commit | CPU s |
|---|---|---|---|---|---|---|---|---|---|---|---|
EOF
  echo "| $stamp | $t | $SECONDS_EACH | $JOBS | $execs | $cov | $ft | $n_crash/$n_timeout/$n_oom | $corp | $SANITIZER | $commit | $cpu |" >>"$LEDGER"
  echo "   CPU $cpu s, executions $execs, cov $cov, ft $ft, crash/timeout/oom $n_crash/$n_timeout/$n_oom (logs: fuzz/logs/)" >&2
  if [ -n "$new" ]; then
    failed=1
    for a in $new; do echo "   NEW ARTIFACT: fuzz/artifacts/$t/$a" >&2; done
  fi
done
totals >&2
exit $failed
