#!/usr/bin/env bash
# The measurements of docs/BENCHMARKS.md, one name each: `scripts/bench.sh NAME [ARGS...]` does
# the set-up the measurement needs (release build, model, text, llama.cpp, OpenCL runtime), then
# runs the command that produced the table; ARGS go to that llmctl command (or script, or test).
# `scripts/bench.sh` or `scripts/bench.sh --help` lists the names. Every figure moves 10-20%
# from run to run on a 2-core machine: compare only figures measured in the same run.
#
# Names:
#   cpu                default model against llama.cpp: prefill@64/256/1024, decode; 5 reps
#   cpu-batch          default model against llama.cpp: prefill@64, decode of 1 and 8 at once
#   cpu-engine         default model, llmd alone: prefill@64/256, decode of 1 and 8 at once
#   cpu-engine-1.5b    the 1.5B model, llmd alone: prefill@64/256, decode of 1 and 8 at once
#   cpu-1.5b           the 1.5B model (K-quants) against llama.cpp: prefill@64/256, decode
#   batch-hugepages    ms per decode pass of 1 and 8 sequences, weights on the heap vs huge pages
#   kbench             the CPU kernels' G MAC/s (default model's kinds; engine example kbench)
#   kkbench            the K-quant kernels' G MAC/s, Q4_K and Q6_K, one thread
#   prefillbench-1.5b  the 1.5B model's prompt chunks of 64/128/256 tokens, AMX vs VNNI kernels
#   golden-1.5b        the 1.5B model's greedy tokens and logits against llama.cpp's (test)
#   perplexity         perplexity against EdgeFlow bits, default model (bench-perplexity.sh)
#   perplexity-1.5b    the 1.5B model's perplexity: GGUF, EdgeFlow 4/5/6 bits without smoothing
#   cold               time to first token from a cold page cache, default model, vs llama.cpp
#   cold-1.5b          the same on the 1.5B model, its K-quant records kept in the llmd file
#   residency          prefetched vs on-demand model, through the daemon (bench-residency.sh)
#   embeddings-flash   embeddings in DRAM vs read from flash (bench-embeddings-flash.sh)
#   npu-accuracy       the NPU path's quantization schemes (llm.npu's Table 6), default model
#   npu-accuracy-1.5b  the same on the 1.5B model
#   npu-perplexity     perplexity through the NPU path on the emulator (shadow execution)
#   npu-prefill        prefill through the NPU path on the emulator, then a short perplexity
#   npu-vs-cpu         prefill on the CPU and through the NPU path, with the modelled NPU time
#   npu-daemon         the daemon: one app's prompt on the NPU while another decodes on the CPU
#   npu-daemon-run     the daemon on --backend npu ([npu] chunk = 32): one request, its dump
#   npu-ooe-threads    out-of-order prefill on real threads, NPU and CPU (engine test)
#   npu-ooe            prefill through the NPU path in chunks of 64: in order, 4 out of order
#   gpu-decode         decode on the GPU (PoCL) against llama.cpp on the CPU, default model
#   gpu-decode-1.5b    the same on the 1.5B model
#   gpu-build          OpenCL program build with llmd's and PoCL's caches empty or present
#   gpu-memory         peak RSS of a run on the CPU alone vs decode on the GPU, default model
#   gpu-memory-1.5b    the same on the 1.5B model
#   gpu-fp16           f32 vs fp16 GPU kernels on Intel's CPU OpenCL runtime
#   gpu-daemon         the daemon: one app decodes on the GPU while another's prompt runs on CPU
#   plan-llama3        the HeteroLLM solver's cuts on Llama-3-8B, prompts of 32 to 1024 tokens (modelled)
#   hetero-sync        fast synchronisation inside the daemon on a partitioned plan (test)
#   load               arbitration and batching under load through the daemon (bench-load.sh)
#   load-devices       the same with the NPU and GPU under backend "auto", emulated
#   soak               the 30-minute soak (bench-soak.sh 30; docs/RELIABILITY.md)
set -euo pipefail
cd "$(dirname "$0")/.."

SMOL=models/SmolLM2-135M-Instruct.Q4_1.gguf
QWEN=models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
TEXT=texts/jargon.txt
LLMCTL=target/release/llmctl
EMULATOR="$PWD/target/release/libllmd_qnn_emu.so"

usage() {
  echo "usage: scripts/bench.sh NAME [ARGS...]   (ARGS go to the command NAME runs)"
  echo
  sed -n 's/^#   //p' scripts/bench.sh
}

build() { cargo build --release -p llmctl -p llmd-daemon -p qnn-emu-sys; }
model() { scripts/fetch-model.sh; }
model_1_5b() { scripts/fetch-model-1.5b.sh; }
text() { scripts/fetch-text.sh; }
llamacpp() { scripts/setup-llamacpp.sh; }
# PoCL (this machine's CPU as an OpenCL device) and its environment (the script prints it).
pocl() {
  local env
  env=$(scripts/setup-opencl.sh)
  eval "$env"
}
# Intel's CPU OpenCL runtime: exports LLMD_INTEL_OPENCL_LIB.
intel_opencl() {
  local env
  env=$(scripts/setup-intel-opencl.sh)
  eval "$env"
}
# Builds one example of the engine; its binary is target/release/examples/NAME.
example() { cargo build --release -p llmd-engine --example "$1"; }

if [ $# -eq 0 ] || [ "$1" = --help ] || [ "$1" = -h ]; then
  usage
  exit 0
fi
name=$1
shift

case "$name" in
  # ---- CPU against llama.cpp ----
  cpu)
    model; llamacpp; build
    "$LLMCTL" bench --local --model "$SMOL" --threads 2 --reps 5 --compare-llamacpp "$@"
    ;;
  cpu-batch)
    model; llamacpp; build
    "$LLMCTL" bench --local --model "$SMOL" --threads 2 --prefill 64 --batch 8 --compare-llamacpp "$@"
    ;;
  cpu-engine)
    model; build
    "$LLMCTL" bench --local --model "$SMOL" --threads 2 --prefill 64,256 --batch 8 "$@"
    ;;
  cpu-engine-1.5b)
    model_1_5b; build
    "$LLMCTL" bench --local --model "$QWEN" --threads 2 --prefill 64,256 --batch 8 "$@"
    ;;
  cpu-1.5b)
    model; model_1_5b; llamacpp; build
    "$LLMCTL" bench --local --model "$QWEN" --threads 2 --prefill 64,256 --compare-llamacpp "$@"
    ;;
  batch-hugepages)
    # Six pairs of separate processes, alternated: weights on the heap, then in the huge-page arena.
    model; example batchbench
    for pair in 1 2 3 4 5 6; do
      echo "pair $pair: heap (LLMD_HUGE_PAGES=0)" >&2
      LLMD_HUGE_PAGES=0 target/release/examples/batchbench "$SMOL" 2 1,8 "$@"
      echo "pair $pair: huge-page arena" >&2
      target/release/examples/batchbench "$SMOL" 2 1,8 "$@"
    done
    ;;
  kbench)
    example kbench
    target/release/examples/kbench "$@"
    ;;
  kkbench)
    example kkbench
    for kind in q4_k q6_k; do
      echo "KIND=$kind" >&2
      KIND=$kind target/release/examples/kkbench "$@"
    done
    ;;
  prefillbench-1.5b)
    model_1_5b; example prefillbench
    for kernel in avx512-amx avx512-vnni; do
      echo "LLMD_KERNEL=$kernel" >&2
      LLMD_KERNEL=$kernel target/release/examples/prefillbench "$QWEN" 2 64,128,256 4 "$@"
    done
    ;;
  golden-1.5b)
    model_1_5b
    cargo test --release -p llmd-engine --test golden -- --ignored "$@"
    ;;

  # ---- Cold start and EdgeFlow accuracy ----
  perplexity)
    scripts/bench-perplexity.sh "$@"
    ;;
  perplexity-1.5b)
    # Windows of 512; 10,240 tokens from token 20,000; EdgeFlow files without the smoothing step.
    model_1_5b; text; build
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    ppl() {
      local m=$1
      shift
      echo "$m:" >&2
      "$LLMCTL" perplexity --model "$m" --text "$TEXT" --offset 20000 --tokens 10240 "$@"
    }
    ppl "$QWEN" "$@"
    for bits in 4 5 6; do
      "$LLMCTL" convert --bits "$bits" "$QWEN" "$work/q$bits.llmd"
      ppl "$work/q$bits.llmd" "$@"
      rm -f "$work/q$bits.llmd"
    done
    ;;
  cold)
    model; llamacpp; build
    "$LLMCTL" bench --local --cold --model "$SMOL" --compare-llamacpp --reps 5 --threads 2 "$@"
    ;;
  cold-1.5b)
    # The llmd file keeps every K-quant tensor as the kernels' packed records (no --bits).
    model; model_1_5b; llamacpp; build
    [ -f /tmp/q15-kept.llmd ] || "$LLMCTL" convert "$QWEN" /tmp/q15-kept.llmd
    "$LLMCTL" bench --local --cold --model "$QWEN" --llmd /tmp/q15-kept.llmd --compare-llamacpp \
      --reps 3 --threads 2 "$@"
    ;;

  # ---- Residency ----
  residency)
    scripts/bench-residency.sh "$@"
    ;;
  embeddings-flash)
    scripts/bench-embeddings-flash.sh "$@"
    ;;

  # ---- The NPU path (llmd's QNN emulator as the library) ----
  npu-accuracy)
    model; text; build
    "$LLMCTL" npu-accuracy --model "$SMOL" --text "$TEXT" --tokens 4096 --offset 100000 \
      --calibration "$TEXT" --calibration-tokens 4096 --threads 2 \
      --schemes cpu,w8,w8a8,smoothquant,llm-int8,shadow-0,shadow-50,shadow-85,shadow-100,shadow-85-clip "$@"
    ;;
  npu-accuracy-1.5b)
    model_1_5b; text; build
    "$LLMCTL" npu-accuracy --model "$QWEN" --text "$TEXT" --tokens 4096 --offset 100000 \
      --calibration "$TEXT" --calibration-tokens 4096 --threads 2 \
      --schemes cpu,w8,w8a8,smoothquant,llm-int8,shadow-0,shadow-50,shadow-85,shadow-100,shadow-85-clip "$@"
    ;;
  npu-perplexity)
    model; text; build
    LLMD_QNN_LIB="$EMULATOR" "$LLMCTL" perplexity --model "$SMOL" --text "$TEXT" --tokens 4096 --ctx 512 \
      --offset 100000 --backend npu --threads 2 "$@"
    ;;
  npu-prefill)
    model; text; build
    export LLMD_QNN_LIB="$EMULATOR"
    "$LLMCTL" bench --local --model "$SMOL" --threads 2 --reps 3 --prefill 64,256 --backend npu \
      --npu-cache "${TMPDIR:-/tmp}/npubench" "$@"
    "$LLMCTL" perplexity --model "$SMOL" --text "$TEXT" --ctx 256 --tokens 2048 --backend npu
    ;;
  npu-vs-cpu)
    model; build
    export LLMD_QNN_LIB="$EMULATOR"
    for backend in cpu npu; do
      "$LLMCTL" bench --local --model "$SMOL" --backend "$backend" --npu-chunk 256 --prefill 64,256,1024 \
        --reps 3 "$@"
    done
    ;;
  npu-daemon)
    model; build
    cargo test --release -p llmd-daemon --test service_socket -- \
      one_client_prefills_on_the_npu_while_another_decodes_on_the_cpu --nocapture "$@"
    ;;
  npu-daemon-run)
    # ARGS: `llmctl run` options and the prompt (the table's 18-token prompt was not recorded).
    model; build
    [ $# -gt 0 ] || set -- "What is a phone, and how does it talk to other devices?"
    cfg=$(mktemp)
    printf '[npu]\nchunk = 32\n' >"$cfg"
    . scripts/serve-llmd.sh
    # The NPU library: llmd's emulator beside llmd (its default off Android).
    serve_llmd "" --config "$cfg" --backend npu --model "$SMOL" --kernel-binder off
    rm -f "$cfg"
    "$LLMCTL" --socket "$sock" run --temperature 0 --max-tokens 24 "$@"
    "$LLMCTL" --socket "$sock" dump
    ;;
  npu-ooe-threads)
    model; build
    cargo test --release -p llmd-engine --test npu_ooe -- --nocapture "$@"
    ;;
  npu-ooe)
    model; build
    export LLMD_QNN_LIB="$EMULATOR"
    for round in 1 2; do
      for chunks in 1 4; do
        echo "round $round, --npu-ooe-chunks $chunks" >&2
        "$LLMCTL" bench --local --model "$SMOL" --threads 2 --prefill 256 --backend npu --npu-chunk 64 \
          --decode-tokens 16 --npu-ooe-chunks "$chunks" "$@"
      done
    done
    ;;

  # ---- The GPU path (PoCL, or Intel's CPU OpenCL runtime: this machine's CPU) ----
  gpu-decode)
    model; llamacpp; pocl; build
    "$LLMCTL" bench --local --model "$SMOL" --backend gpu --compare-llamacpp --threads 2 --prefill 64 \
      --decode-prompt 128 --decode-tokens 64 --reps 3 "$@"
    ;;
  gpu-decode-1.5b)
    model; model_1_5b; llamacpp; pocl; build
    "$LLMCTL" bench --local --model "$QWEN" --backend gpu --compare-llamacpp --threads 2 --prefill 32 \
      --decode-prompt 64 --decode-tokens 8 --reps 1 "$@"
    ;;
  gpu-build)
    # `llmctl gpu-info --gpu-cache DIR` with llmd's program cache and PoCL's compile cache each
    # emptied or kept, twice each (both caches in a scratch directory).
    model; pocl; build
    caches=$(mktemp -d)
    trap 'rm -rf "$caches"' EXIT
    export POCL_CACHE_DIR="$caches/pocl"
    TIMEFORMAT="whole command %R s"
    for round in 1 2; do
      for state in "empty empty" "empty present" "present empty" "present present"; do
        read -r ours theirs <<<"$state"
        if [ "$ours" = empty ]; then rm -rf "$caches/llmd"; fi
        if [ "$theirs" = empty ]; then rm -rf "$POCL_CACHE_DIR"; fi
        mkdir -p "$caches/llmd" "$POCL_CACHE_DIR"
        echo "round $round: llmd's program cache $ours, PoCL's compile cache $theirs" >&2
        time "$LLMCTL" gpu-info --gpu-cache "$caches/llmd" "$@"
      done
    done
    ;;
  gpu-memory)
    model; pocl; build
    for round in 1 2; do
      for backend in cpu gpu; do
        echo "round $round, --backend $backend: peak RSS in KB" >&2
        /usr/bin/time -f %M "$LLMCTL" run --local --model "$SMOL" --backend "$backend" --max-tokens 32 \
          --temperature 0 "$@" "The capital of France is"
      done
    done
    ;;
  gpu-memory-1.5b)
    model_1_5b; pocl; build
    for backend in cpu gpu; do
      echo "--backend $backend: peak RSS in KB" >&2
      /usr/bin/time -f %M "$LLMCTL" run --local --model "$QWEN" --backend "$backend" --max-tokens 4 \
        --temperature 0 "$@" "The capital of France is"
    done
    ;;
  gpu-fp16)
    model; intel_opencl; build
    for round in 1 2; do
      for fp16 in off on; do
        echo "round $round, --gpu-fp16 $fp16" >&2
        "$LLMCTL" run --local --model "$SMOL" --backend gpu --opencl-lib "$LLMD_INTEL_OPENCL_LIB" \
          --gpu-fp16 "$fp16" --gpu-cache none --max-tokens 32 --temperature 0 "$@" "The capital of France is"
      done
    done
    ;;
  gpu-daemon)
    model; pocl; build
    cargo test --release -p llmd-daemon --test service_socket one_client_decodes_on_the_gpu -- \
      --nocapture "$@"
    ;;

  # ---- HeteroLLM ----
  plan-llama3)
    build
    for prompt in 32 64 128 256 300 525 600 1000 1024; do
      "$LLMCTL" plan --model llama3_8b --prompt "$prompt" "$@"
    done
    ;;
  hetero-sync)
    model; pocl; build
    cargo test --release -p llmd-daemon --test service_socket -- \
      the_hetero_backend_serves_the_default_model_on_a_partitioned_plan_with_the_cpus_tokens --nocapture "$@"
    ;;

  # ---- Arbitration and batching under load ----
  load)
    scripts/bench-load.sh "$@"
    ;;
  load-devices)
    # LLMD_BENCH_DUMP names the file for the daemon's `dump --json` after the run.
    pocl
    LLMD_BENCH_CONFIG=daemon/config/bench-load-devices.toml \
      LLMD_BENCH_DUMP="${LLMD_BENCH_DUMP:-target/bench-load-devices.dump.json}" \
      scripts/bench-load.sh --json "$@"
    ;;

  # ---- Reliability ----
  soak)
    scripts/bench-soak.sh 30 "$@"
    ;;

  *)
    echo "scripts/bench.sh: unknown name '$name' (scripts/bench.sh --help lists the names)" >&2
    exit 2
    ;;
esac
