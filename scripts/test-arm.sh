#!/usr/bin/env bash
# The engine's ARM code paths (NEON dotprod kernels, their dispatch) run under qemu-user against
# the scalar references: `cargo test --target aarch64-unknown-linux-gnu -p llmd-engine --lib`.
# Installs what it needs on first use (root, apt): the cross linker and qemu-user-static.
# Emulation checks correctness only; ARM speed cannot be measured on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null 2>&1 || missing+=(qemu-user-static)
if [ ${#missing[@]} -gt 0 ]; then
  echo "test-arm: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! rustup target list --installed | grep -qx aarch64-unknown-linux-gnu; then
  rustup target add aarch64-unknown-linux-gnu
fi
# qemu's default CPU ("max") has the dot-product and i8mm extensions, so the NEON kernels run.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# The whole output goes to a log; on failure all of it is shown, on success a summary.
if ! cargo test --release --target aarch64-unknown-linux-gnu -p llmd-engine --lib -- --nocapture >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
grep -E "kernels here|test result" "$log" >&2
