# Sourced by scripts that need a daemon: `serve_llmd LOG ARGS...` starts target/release/llmd
# with ARGS on a socket in a fresh temporary directory, waits until it serves, and stops it and
# removes the directory when the calling script exits. Sets $sock to the socket path.
serve_llmd() {
  local log=$1
  shift
  serve_dir=$(mktemp -d)
  sock="$serve_dir/llmd.sock"
  [ -n "$log" ] || log="$serve_dir/llmd.log"
  target/release/llmd "$@" --socket "$sock" 2>"$log" &
  serve_pid=$!
  trap 'kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null; rm -rf "$serve_dir"' EXIT
  for _ in $(seq 600); do
    [ -S "$sock" ] && return 0
    kill -0 $serve_pid 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
  done
  echo "llmd did not start serving within 60 s" >&2
  exit 1
}
