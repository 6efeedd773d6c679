#!/usr/bin/env bash
# Installs what building and testing need on a fresh machine, skipping what is already there:
# the Rust targets used by the cross-checks, and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v rustup >/dev/null 2>&1; then
  for target in aarch64-linux-android; do
    if ! rustup target list --installed | grep -qx "$target"; then
      echo "setup: adding Rust target $target" >&2
      rustup target add "$target"
    fi
  done
fi
scripts/fetch-model.sh
scripts/fetch-text.sh
