#!/usr/bin/env bash
# Tier 7 (packaging): compiles sepolicy/ with checkpolicy against stand-ins for the platform
# policy and AOSP's macros (tests/sepolicy/), which enforces its neverallow rules, and checks
# with sesearch that the rules that matter hold. Also checks that a policy breaking a
# neverallow is refused, and that every type the context files name exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tests/sepolicy
for tool in checkpolicy sesearch seinfo m4; do
  if ! command -v "$tool" >/dev/null; then
    echo "sepolicy: installing checkpolicy setools m4" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends checkpolicy setools m4 >/dev/null
    break
  fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
build() { # $1: extra rules file (may be empty) -> $work/policy.conf
  { cat "$here/base.conf"
    m4 "$here/te_macros.m4" sepolicy/service.te sepolicy/file.te sepolicy/llmd.te ${1:+"$1"}
    cat "$here/tail.conf"; } > "$work/policy.conf"
}
passed=0; failed=0
ok() { echo "ok   $*"; passed=$((passed+1)); }
bad() { echo "FAIL $*"; failed=$((failed+1)); }

build ""
if checkpolicy -M -c 30 -o "$work/policy.30" "$work/policy.conf" >"$work/cp.log" 2>&1; then
  ok "sepolicy compiles with checkpolicy (neverallows hold)"
else
  cat "$work/cp.log"; bad "sepolicy does not compile"; echo "0 passed, 1 failed"; exit 1
fi
P="$work/policy.30"
# The whole output is captured first: `sesearch | grep -q` under pipefail fails at random when
# grep exits at the first line and sesearch then dies of SIGPIPE.
allowed() { local out; out=$(sesearch -A -s "$1" -t "$2" -c "$3" -p "$4" "$P" 2>/dev/null) || true; [ -n "$out" ]; }
expect_allow() { if allowed "$@"; then ok "allow $*"; else bad "expected allow $*"; fi; }
expect_deny() { if allowed "$@"; then bad "expected no allow $*"; else ok "deny $*"; fi; }

expect_allow llmd llmd_service service_manager add
expect_allow llmd llmd_admin_service service_manager add
expect_allow untrusted_app llmd_service service_manager find
expect_allow untrusted_app llmd binder call
expect_allow llmd untrusted_app binder call
expect_deny  untrusted_app llmd_admin_service service_manager find
expect_deny  platform_app llmd_admin_service service_manager find
expect_allow shell llmd_admin_service service_manager find
expect_allow llmd llmd_model_file file read
expect_allow llmd llmd_model_file file map
expect_deny  llmd llmd_model_file file write
expect_deny  untrusted_app llmd_model_file file read
expect_deny  system_server llmd_model_file file read
expect_deny  shell llmd_model_file file read
expect_allow llmd llmd_state_file file write
expect_deny untrusted_app llmd_state_file file read
expect_allow llmd gpu_device chr_file write
expect_allow llmd llmd_npu_device chr_file write
expect_allow llmd dmabuf_system_heap_device chr_file read
expect_allow init llmd_exec file execute
expect_allow llmd llmd_exec file execute_no_trans
if [[ "$(sesearch -T -s init -t llmd_exec -c process "$P" 2>/dev/null || true)" == *"llmd;"* ]]; then ok "init starts llmd in its domain"; else bad "no init -> llmd transition"; fi

# The neverallows are live: each of these rules must make compilation fail.
for rule in "allow untrusted_app llmd_admin_service:service_manager find;" \
            "allow untrusted_app llmd_model_file:file read;" \
            "allow llmd llmd_model_file:file write;" \
            "allow untrusted_app llmd_state_file:file read;" \
            "allow system_server llmd_service:service_manager add;"; do
  echo "$rule" > "$work/extra.te"
  build "$work/extra.te"
  if checkpolicy -M -c 30 -o "$work/bad.30" "$work/policy.conf" >/dev/null 2>&1; then bad "neverallow did not stop: $rule"; else ok "neverallow stops: $rule"; fi
done

# Every type named in the context files exists in the policy.
for f in sepolicy/file_contexts sepolicy/service_contexts; do
  for t in $(awk '!/^#/ && NF {split($NF, c, ":"); print c[3]}' "$f"); do
    if grep -qw "$t" <<<"$(seinfo -t "$t" "$P" 2>/dev/null || true)"; then ok "$f: type $t exists"; else bad "$f: unknown type $t"; fi
  done
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
