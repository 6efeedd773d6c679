#!/usr/bin/env python3
"""The README's first command, end to end, as a user runs it: scripts/demo.sh in a scratch copy
of the repository (its tracked files; target/, models/ and texts/ linked to this checkout's, so
nothing is fetched twice), with TMPDIR pointing at an empty scratch folder. Checks, for a good
run, a failed run, Ctrl-C, and a daemon that cannot start (scripts/serve-llmd.sh):
  - the exit status (0 only after a good run; non-zero with a message otherwise),
  - the streamed reply (a good run prints one),
  - nothing left behind: the temporary folder is empty and no llmd of the run is alive.
Usage: tests/scripts/demo_script.py   (prints 'N passed, N failed'; exit 1 on any failure)
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# A whole demo: setup (already done), a cargo build with nothing to do, the model's load and
# up to 128 tokens on a 2-core machine take well under a minute; the first run in a scratch
# copy also compiles the workspace's own crates under the copy's path.
RUN_TIMEOUT_S = 900
# How long the Ctrl-C case waits for the demo to reach its reply.
SERVE_TIMEOUT_S = 600
# The daemon gets SIGTERM, then up to 10 s (serve-llmd.sh's default) before SIGKILL.
STOP_GRACE_S = 15

results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)


def scratch_copy(root):
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], check=True, capture_output=True).stdout
    for rel in files.decode().split("\0"):
        if not rel:
            continue
        src, dst = os.path.join(REPO, rel), os.path.join(root, rel)
        if not os.path.lexists(src):
            continue  # deleted in the work tree
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    for shared in ("target", "models", "texts"):
        os.makedirs(os.path.join(REPO, shared), exist_ok=True)
        os.symlink(os.path.join(REPO, shared), os.path.join(root, shared))


def llmd_alive(tmp):
    """Any llmd process serving a socket under `tmp`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llmd") and any(a.startswith(tmp.encode()) for a in argv):
            return True
    return False


def left_behind(tmp):
    return sorted(os.listdir(tmp))


def run(copy, tmp, args, **kw):
    env = dict(os.environ, TMPDIR=tmp)
    return subprocess.run(["bash", *args], cwd=copy, env=env, capture_output=True, text=True, **kw)


def main():
    base = tempfile.mkdtemp(prefix="llmd-demo-test.")
    try:
        copy, tmp = os.path.join(base, "repo"), os.path.join(base, "tmp")
        os.makedirs(tmp)
        scratch_copy(copy)

        # 1. A good run: exit 0, a reply on stdout, nothing left.
        r = run(copy, tmp, ["scripts/demo.sh", "Say hello in one short sentence."], timeout=RUN_TIMEOUT_S)
        check("good run exits 0", r.returncode == 0, f"status {r.returncode}; stderr tail: {r.stderr[-2000:]}")
        check("good run streams a reply", len(r.stdout.strip()) > 0, f"stdout {r.stdout!r}")
        check("good run says where it serves", "demo: llmd is serving" in r.stderr, r.stderr[-500:])
        check("good run leaves no temporary folder", left_behind(tmp) == [], str(left_behind(tmp)))
        check("good run leaves no llmd", not llmd_alive(tmp))

        # 2. A failed run (a prompt over the daemon's 4096-token limit): non-zero, a message.
        long_prompt = "word " * 6000
        r = run(copy, tmp, ["scripts/demo.sh", long_prompt], timeout=RUN_TIMEOUT_S)
        check("failed run exits non-zero", r.returncode != 0, f"status {r.returncode}")
        check(
            "failed run says what failed",
            "demo: llmctl failed" in r.stderr and "REQUEST_TOO_LARGE" in r.stderr.upper().replace(" ", "_"),
            r.stderr[-1500:],
        )
        check("failed run leaves no temporary folder", left_behind(tmp) == [], str(left_behind(tmp)))
        check("failed run leaves no llmd", not llmd_alive(tmp))

        # 3. Ctrl-C while the reply streams: SIGINT to the whole process group, as a terminal
        # sends it. Non-zero, daemon stopped, nothing left.
        env = dict(os.environ, TMPDIR=tmp)
        p = subprocess.Popen(
            ["bash", "scripts/demo.sh", "Write a long story about a lighthouse keeper."],
            cwd=copy,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        first = b""
        os.set_blocking(p.stdout.fileno(), False)
        while time.monotonic() < deadline and p.poll() is None and not first.strip():
            first += p.stdout.read() or b""
            time.sleep(0.05)
        streaming = bool(first.strip()) and p.poll() is None
        check("Ctrl-C case reached the reply", streaming, f"status {p.poll()}")
        os.killpg(p.pid, signal.SIGINT)
        try:
            _, err = p.communicate(timeout=STOP_GRACE_S + 30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
        check("Ctrl-C exits non-zero", p.returncode != 0, f"status {p.returncode}")
        check("Ctrl-C leaves no temporary folder", left_behind(tmp) == [], str(left_behind(tmp)))
        check("Ctrl-C leaves no llmd", not llmd_alive(tmp), err.decode(errors="replace")[-1000:])

        # 4. A daemon that cannot start (a bad flag): serve_llmd says so, exits non-zero, and
        # removes its folder.
        script = ". scripts/serve-llmd.sh; serve_llmd '' --threads not-a-number; echo unreachable"
        r = run(copy, tmp, ["-euo", "pipefail", "-c", script], timeout=120)
        check("daemon that cannot start: non-zero", r.returncode != 0, f"status {r.returncode}")
        check(
            "daemon that cannot start: says so",
            "llmd exited before it served" in r.stderr and "unreachable" not in r.stdout,
            r.stderr[-800:],
        )
        check("daemon that cannot start: no temporary folder", left_behind(tmp) == [], str(left_behind(tmp)))

        # 5. A daemon that died by itself while the script ran: reported, non-zero.
        script = ". scripts/serve-llmd.sh; serve_llmd '' --kernel-binder off --model models/SmolLM2-135M-Instruct.Q4_1.gguf; kill -KILL $serve_pid; sleep 0.5"
        r = run(copy, tmp, ["-euo", "pipefail", "-c", script], timeout=300)
        check("daemon that died: non-zero", r.returncode != 0, f"status {r.returncode}")
        check("daemon that died: says so", "had exited by itself" in r.stderr, r.stderr[-800:])
        check("daemon that died: no temporary folder", left_behind(tmp) == [], str(left_behind(tmp)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
