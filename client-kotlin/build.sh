#!/usr/bin/env bash
# Builds the Kotlin client on the JVM and runs its tests: Java stubs from the AIDL (Debian's
# aidl, after tools/lower_aidl.py), host stand-ins for the android.os classes they use
# (host-android/), the client (src/main), and the tests (src/test) against fake services.
# Installs what it needs once (Debian aidl, npm kotlin-compiler into ~/.cache/llmd/kotlin).
set -euo pipefail
cd "$(dirname "$0")"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/llmd"
KOTLIN_VERSION=2.4.20
KOTLINC="$CACHE/kotlin/node_modules/kotlin-compiler/bin/kotlinc"
if ! command -v aidl >/dev/null || ! command -v javac >/dev/null; then
  echo "client-kotlin: installing aidl" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends aidl >/dev/null
fi
if [ ! -x "$KOTLINC" ] || ! grep -q "$KOTLIN_VERSION" "$CACHE/kotlin/node_modules/kotlin-compiler/build.txt" 2>/dev/null; then
  echo "client-kotlin: installing kotlin-compiler $KOTLIN_VERSION from npm" >&2
  mkdir -p "$CACHE/kotlin"
  (cd "$CACHE/kotlin" && npm install --silent --no-audit --no-fund "kotlin-compiler@$KOTLIN_VERSION")
fi
out=build
rm -rf "$out"
mkdir -p "$out/aidl/com/llmd" "$out/java-gen" "$out/classes"
python3 tools/lower_aidl.py ../aidl/aidl/com/llmd "$out/aidl/com/llmd"
for f in "$out"/aidl/com/llmd/*.aidl; do
  aidl --lang=java -I"$out/aidl" -o"$out/java-gen" "$f"
done
javac -nowarn -d "$out/classes" $(find host-android "$out/java-gen" -name '*.java')
echo "client-kotlin: compiling the client and its tests" >&2
"$KOTLINC" -nowarn -cp "$out/classes" -d "$out/classes" src/main/kotlin src/test/kotlin 2>&1 | grep -v '^warning' >&2 || true
[ -f "$out/classes/com/llmd/client/LlmClient.class" ] || { echo "client-kotlin: compilation failed" >&2; exit 1; }
KLIB="$CACHE/kotlin/node_modules/kotlin-compiler/lib"
java -cp "$out/classes:$KLIB/kotlin-stdlib.jar" com.llmd.client.LlmClientTestKt
