#!/usr/bin/env bash
# The whole test suite (what CI runs): unit and integration tests with the real default model,
# then the Android cross-check of every crate.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== cargo test (release; the real model runs in these tests)" >&2
cargo test --release --workspace
echo "== cargo check --target aarch64-linux-android" >&2
cargo check --release --target aarch64-linux-android --workspace
