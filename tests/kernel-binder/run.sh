#!/usr/bin/env bash
# Tier 4: real kernel Binder. Boots a Debian kernel with the binder_linux module in QEMU
# (software emulation; no KVM needed), with an initramfs holding rsb_hub (rsbinder's service
# manager), llmd, llmctl and the default model. In the VM, llmd registers "llmd" with the
# service manager on /dev/binder and llmctl generates text through it; the host checks the
# greedy reply against llama.cpp's golden tokens. Then a subset of the permission matrix
# (docs/RELIABILITY.md) with uids the kernel vouches for: a uid without the permission is
# refused, an allowed app is served but refused the admin dump, and an app handed another
# app's session object (through the service manager) is refused every call on it while the
# owner's session goes on working.
#
# Cached in ~/.cache/llmd/kernel-binder (kernel, module) and ~/.cache/llmd/rsbinder-tools
# (rsb_hub); static builds of llmd/llmctl live in target/x86_64-unknown-linux-gnu. A rerun
# with everything cached takes about a minute. Needs root for apt-get on first use.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/llmd"
KDIR="$CACHE/kernel-binder"
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED=" Paris.

The United States has"   # llama.cpp's first 8 greedy tokens (tests/golden/smollm2.json, "capital")
log() { echo "kernel-binder: $*" >&2; }

# 1. Host packages.
missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
[ -x /bin/busybox ] && /bin/busybox --list | grep -qx insmod || missing+=(busybox-static)
command -v cpio >/dev/null || missing+=(cpio)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. A Debian kernel and its binder module.
if [ ! -f "$KDIR/vmlinuz" ] || [ ! -f "$KDIR/binder_linux.ko" ]; then
  mkdir -p "$KDIR"
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  [ -n "$pkg" ] || { apt-get update -qq; pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'); }
  log "fetching $pkg"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -qq "$pkg" && dpkg -x ./*.deb x)
  cp "$tmp"/x/boot/vmlinuz-* "$KDIR/vmlinuz"
  ko=$(find "$tmp/x/lib/modules" -name 'binder_linux.ko*' | head -1)
  case "$ko" in
    *.xz) xz -dc "$ko" > "$KDIR/binder_linux.ko" ;;
    *.zst) zstd -dc "$ko" > "$KDIR/binder_linux.ko" ;;
    *) cp "$ko" "$KDIR/binder_linux.ko" ;;
  esac
  rm -rf "$tmp"
fi

# 3. rsb_hub, statically linked.
HUB="$CACHE/rsbinder-tools/bin/rsb_hub"
if [ ! -x "$HUB" ]; then
  log "building rsb_hub (rsbinder-tools 0.12.0, a few minutes once)"
  RUSTFLAGS='-C target-feature=+crt-static' cargo install --quiet rsbinder-tools --version 0.12.0 --locked \
    --target x86_64-unknown-linux-gnu --root "$CACHE/rsbinder-tools"
fi

# 4. llmd and llmctl, statically linked.
scripts/fetch-model.sh
log "building static llmd and llmctl"
RUSTFLAGS='-C target-feature=+crt-static' cargo build --quiet --release --target x86_64-unknown-linux-gnu -p llmd-daemon -p llmctl --bins
RUSTFLAGS='-C target-feature=+crt-static' cargo build --quiet --release --target x86_64-unknown-linux-gnu -p llmd-daemon --example session_handoff
BIN="$ROOT/target/x86_64-unknown-linux-gnu/release"

# 5. The initramfs.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fs="$work/fs"
mkdir -p "$fs"/{bin,dev,proc,sys,tmp,lib,models,etc}
cp /bin/busybox "$fs/bin/busybox"
cp "$HUB" "$BIN/llmd" "$BIN/llmctl" "$BIN/examples/session_handoff" "$fs/bin/"
strip --strip-debug "$fs/bin/llmd" "$fs/bin/llmctl" "$fs/bin/rsb_hub" "$fs/bin/session_handoff" 2>/dev/null || true
# Apps as uids for su: two allowed (10001, 10002), one without the permission (10003).
printf '%s\n' root:x:0:0::/:/bin/sh app1:x:10001:10001::/tmp:/bin/sh app2:x:10002:10002::/tmp:/bin/sh \
  app3:x:10003:10003::/tmp:/bin/sh > "$fs/etc/passwd"
printf '%s\n' root:x:0: app1:x:10001: app2:x:10002: app3:x:10003: > "$fs/etc/group"
cp "$KDIR/binder_linux.ko" "$fs/lib/"
cp "$MODEL" "$fs/models/"
cat > "$fs/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
insmod /lib/binder_linux.ko devices=binder,binder2 || echo "E2E: insmod failed"
mkdir -p /dev/binderfs && ln -s /dev/binder /dev/binderfs/binder
chmod 666 /dev/binder
rsb_hub --insecure-allow-all > /tmp/hub.log 2>&1 &
sleep 1
printf '[permissions]\nallowed_uids = [10001, 10002]\n' > /tmp/llmd.toml
LLMD_LOG=info llmd --config /tmp/llmd.toml --model /models/SmolLM2-135M-Instruct.Q4_1.gguf --kernel-binder on --threads 2 > /tmp/llmd.log 2>&1 &
llmctl status > /tmp/status.txt 2>&1; S=$?
OUT=$(llmctl run --max-tokens 8 "The capital of France is" 2>/tmp/llmctl.err); RC=$?
# A client stopped mid-reply must hold up only its own request.
llmctl run --max-tokens 64 "1, 2, 3, 4, 5, 6, 7, 8," > /tmp/bg.out 2>/tmp/bg.err &
BG=$!
n=0; while [ ! -s /tmp/bg.out ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n + 1)); done
kill -STOP $BG
OUT2=$(llmctl run --max-tokens 8 "The capital of France is" 2>/tmp/llmctl2.err); RC2=$?
kill -CONT $BG
wait $BG; BGRC=$?
echo "E2E_STATUS_RC=$S"; cat /tmp/status.txt
echo "E2E_OUT_BEGIN"; printf '%s' "$OUT"; echo; echo "E2E_OUT_END"
echo "--- llmctl stderr"; cat /tmp/llmctl.err
echo "--- llmd log"; tail -n 20 /tmp/llmd.log
echo "--- hub log"; tail -n 5 /tmp/hub.log
echo "E2E_FROZEN_RC=$RC2"
echo "E2E_OUT2_BEGIN"; printf '%s' "$OUT2"; echo; echo "E2E_OUT2_END"
echo "--- stopped client's stderr"; cat /tmp/bg.err
echo "E2E_BG_RC=$BGRC"
# Permissions, uids from the kernel.
run_as() { u=$1; shift; su -s /bin/sh -c "$*" "$u"; }
run_as app3 llmctl run --max-tokens 4 "'The capital of France is'" > /tmp/p1.out 2> /tmp/p1.err; P1=$?
run_as app1 llmctl dump > /tmp/p2.out 2> /tmp/p2.err; P2=$?
OUT3=$(run_as app1 llmctl run --max-tokens 8 "'The capital of France is'" 2> /tmp/p3.err); P3=$?
run_as app1 session_handoff owner /tmp/handoff.done > /tmp/owner.out 2>&1 &
OWN=$!
n=0; while ! grep -q registered /tmp/owner.out && [ $n -lt 600 ]; do sleep 0.1; n=$((n + 1)); done
run_as app2 session_handoff other > /tmp/other.out 2>&1; OTH=$?
touch /tmp/handoff.done
wait $OWN; OWNRC=$?
echo "E2E_PERM_NOPERM_RC=$P1"; echo "E2E_PERM_NOPERM_ERR $(cat /tmp/p1.err)"
echo "E2E_PERM_DUMP_RC=$P2"; echo "E2E_PERM_DUMP_ERR $(cat /tmp/p2.err)"
echo "E2E_PERM_APP_RC=$P3"; cat /tmp/p3.err
echo "E2E_OUT3_BEGIN"; printf '%s' "$OUT3"; echo; echo "E2E_OUT3_END"
echo "E2E_HANDOFF_RC=$OWNRC/$OTH"; cat /tmp/owner.out /tmp/other.out
echo "E2E_RC=$RC"
poweroff -f
INIT
chmod +x "$fs/init"
(cd "$fs" && find . | cpio -o -H newc --quiet) > "$work/initrd"

# 6. Boot; the guest's result comes back on the serial console.
log "booting the VM"
serial="$work/serial.log"
timeout 600 qemu-system-x86_64 -accel tcg -cpu max -m 1536 -smp 2 -nodefaults -no-user-config -display none \
  -serial "file:$serial" -net none -no-reboot -kernel "$KDIR/vmlinuz" -initrd "$work/initrd" \
  -append 'console=ttyS0 quiet panic=-1' || true
tr -d '\r' < "$serial" > "$work/serial.txt"
if ! grep -q '^E2E_RC=0$' "$work/serial.txt" || ! grep -q '^E2E_STATUS_RC=0$' "$work/serial.txt"; then
  cat "$work/serial.txt" >&2
  log "FAILED: the client did not generate over kernel Binder"
  exit 1
fi
out=$(sed -n '/^E2E_OUT_BEGIN$/,/^E2E_OUT_END$/p' "$work/serial.txt" | sed '1d;$d')
if [ "$out" != "$EXPECTED" ]; then
  cat "$work/serial.txt" >&2
  log "FAILED: got $(printf '%q' "$out"), expected $(printf '%q' "$EXPECTED")"
  exit 1
fi
grep -E 'sessions_open|interface_version' "$work/serial.txt" >&2 || true
log "passed: llmd served a greedy reply over kernel Binder: $(printf '%q' "$out")"
out2=$(sed -n '/^E2E_OUT2_BEGIN$/,/^E2E_OUT2_END$/p' "$work/serial.txt" | sed '1d;$d')
if ! grep -q '^E2E_FROZEN_RC=0$' "$work/serial.txt" || [ "$out2" != "$EXPECTED" ]; then
  cat "$work/serial.txt" >&2
  log "FAILED: with a stopped client, another got $(printf '%q' "$out2"), expected $(printf '%q' "$EXPECTED")"
  exit 1
fi
if ! grep -q '^E2E_BG_RC=0$' "$work/serial.txt"; then
  cat "$work/serial.txt" >&2
  log "FAILED: the stopped client's reply did not complete after it was resumed"
  exit 1
fi
log "passed: with a client stopped mid-reply, another got the same reply, and the stopped one finished once resumed"
fail() { cat "$work/serial.txt" >&2; log "FAILED: $*"; exit 1; }
grep -q '^E2E_PERM_NOPERM_RC=1$' "$work/serial.txt" && grep -q '^E2E_PERM_NOPERM_ERR .*PERMISSION_DENIED' "$work/serial.txt" \
  || fail "a uid without the permission (10003) was not refused PERMISSION_DENIED"
grep -q '^E2E_PERM_DUMP_RC=1$' "$work/serial.txt" && grep -q '^E2E_PERM_DUMP_ERR .*PERMISSION_DENIED' "$work/serial.txt" \
  || fail "an app (10001) was not refused the admin dump"
out3=$(sed -n '/^E2E_OUT3_BEGIN$/,/^E2E_OUT3_END$/p' "$work/serial.txt" | sed '1d;$d')
{ grep -q '^E2E_PERM_APP_RC=0$' "$work/serial.txt" && [ "$out3" = "$EXPECTED" ]; } \
  || fail "an allowed app (10001) got $(printf '%q' "$out3"), expected $(printf '%q' "$EXPECTED")"
grep -q '^E2E_HANDOFF_RC=0/0$' "$work/serial.txt" || fail "session_handoff did not run to its end"
for m in generate cancel countTokens reset close; do
  grep -q "^HANDOFF other $m SESSION_CLOSED$" "$work/serial.txt" \
    || fail "another app (10002) handed the owner's session was not refused $m with SESSION_CLOSED"
done
for m in countTokens-after reset-after close; do
  grep -q "^HANDOFF owner $m ok$" "$work/serial.txt" || fail "the owner's session did not work after the other app's calls ($m)"
done
log "passed: permissions with kernel uids: no permission refused, an app refused dump and served, another app holding the owner's session refused every call on it"
log "3 passed, 0 failed"
