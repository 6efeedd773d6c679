#!/usr/bin/env bash
# Fetches the fixed natural-English text used for perplexity and smoothing calibration: the
# Jargon File 4.4.7 as Debian's `jargon-text` package ships it (jargon.txt.gz), unpacked to
# texts/jargon.txt (not committed). Checks its sha256; does nothing if a verified copy is there.
# Evaluation and calibration use disjoint token ranges of it (see docs/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=texts/jargon.txt
SHA=40dfb4b98191a670a09a183d5798d50f243d23fdbd1495dcc0aca2ce5895ba97
verify() { [ -f "$1" ] && echo "$SHA  $1" | sha256sum --check --status; }
if verify "$TEXT"; then
  exit 0
fi
mkdir -p texts
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llmd/debs"
mkdir -p "$cache"
deb=$(ls "$cache"/jargon-text_4.4.7-*_all.deb 2>/dev/null | head -1 || true)
if [ -z "$deb" ]; then
  echo "fetch-text: downloading Debian's jargon-text package" >&2
  (cd "$cache" && { apt-get download jargon-text >/dev/null 2>&1 || { apt-get update -qq && apt-get download jargon-text >/dev/null; }; })
  deb=$(ls "$cache"/jargon-text_*_all.deb | head -1)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dpkg-deb -x "$deb" "$tmp"
zcat "$tmp/usr/share/doc/jargon-text/jargon.txt.gz" >"$tmp/jargon.txt"
if ! verify "$tmp/jargon.txt"; then
  echo "fetch-text: checksum mismatch for jargon.txt from $deb; deleting the cached package" >&2
  rm -f "$deb"
  exit 1
fi
mv "$tmp/jargon.txt" "$TEXT"
echo "fetch-text: $TEXT ready" >&2
