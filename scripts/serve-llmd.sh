# Sourced by scripts that need a daemon: `serve_llmd LOG ARGS...` starts target/release/llmd
# with ARGS on a socket in a fresh temporary directory, waits until it serves, and sets $sock to
# the socket path. When the calling script exits, for any reason (done, failed, Ctrl-C, SIGTERM),
# the daemon is stopped (SIGTERM, then SIGKILL if it has not exited after
# $LLMD_STOP_TIMEOUT_S seconds, 10 by default) and the directory is removed. The script's own
# exit status is kept: 0 after a good run whatever the daemon's exit on SIGTERM; if the daemon
# had died by itself before the script ended, that is reported and the status is non-zero.
serve_llmd() {
  local log=$1
  shift
  serve_dir=$(mktemp -d "${TMPDIR:-/tmp}/llmd-serve.XXXXXX")
  sock="$serve_dir/llmd.sock"
  serve_log=${log:-"$serve_dir/llmd.log"}
  trap _serve_llmd_exit EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  target/release/llmd "$@" --socket "$sock" 2>"$serve_log" &
  serve_pid=$!
  local _
  for _ in $(seq 600); do
    [ -S "$sock" ] && return 0
    if ! kill -0 "$serve_pid" 2>/dev/null; then
      echo "serve-llmd: llmd exited before it served; its log:" >&2
      cat "$serve_log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "serve-llmd: llmd did not start serving within 60 s (log: $serve_log)" >&2
  exit 1
}

# The EXIT trap. Runs with errexit off so that every step runs; ends with the script's status.
_serve_llmd_exit() {
  local rc=$? status i
  set +e
  trap - INT TERM
  if [ -n "${serve_pid:-}" ]; then
    if kill -0 "$serve_pid" 2>/dev/null; then
      kill -TERM "$serve_pid" 2>/dev/null
      for i in $(seq $((${LLMD_STOP_TIMEOUT_S:-10} * 10))); do
        kill -0 "$serve_pid" 2>/dev/null || break
        sleep 0.1
      done
      if kill -0 "$serve_pid" 2>/dev/null; then
        echo "serve-llmd: llmd did not stop within ${LLMD_STOP_TIMEOUT_S:-10} s of SIGTERM; killed" >&2
        kill -KILL "$serve_pid" 2>/dev/null
      fi
      wait "$serve_pid" 2>/dev/null # its status is that of the stop we asked for: not a failure
    else
      wait "$serve_pid" 2>/dev/null
      status=$?
      if [ "$status" -ne 0 ]; then
        echo "serve-llmd: llmd had exited by itself with status $status; its log's end:" >&2
        tail -n 20 "$serve_log" >&2
        [ "$rc" -ne 0 ] || rc=1
      fi
    fi
    serve_pid=
  fi
  [ -n "${serve_dir:-}" ] && rm -rf "$serve_dir"
  exit "$rc"
}
