"""Which files may name a low-level crate: each accelerator's runtime is reached through its one
backend, so a file elsewhere that names it is an error.

Usage: python3 confined_imports.py REPO  -> prints each file that names a confined crate outside
its home; exit 0 if there are none.

Rules (paths relative to REPO; `sys/` holds the crates themselves):
- `opencl_rt_sys` (OpenCL) only under engine/src/backend/gpu/;
- `qnn_sys` (QNN) only under engine/src/backend/npu/ (the daemon and llmctl reach QNN through
  the engine's `QnnDevice`; they do not depend on qnn-sys).
Tests (`*/tests/`) and `sys/` are not checked: they test the crates themselves."""
import os, re, sys

repo = sys.argv[1]
RULES = {
    "opencl_rt_sys": ["engine/src/backend/gpu/"],
    "qnn_sys": ["engine/src/backend/npu/"],
}
errors = []
for root, dirs, files in os.walk(repo):
    dirs[:] = [d for d in dirs if d not in ("target", ".git", "node_modules", "fuzz", "sys", "tests")]
    for f in files:
        if not f.endswith(".rs"):
            continue
        path = os.path.relpath(os.path.join(root, f), repo).replace(os.sep, "/")
        text = re.sub(r"//[^\n]*", "", open(os.path.join(root, f), encoding="utf-8", errors="replace").read())
        for crate, homes in RULES.items():
            if not re.search(r"\b" + crate + r"\b", text):
                continue
            if any(path.startswith(h) for h in homes):
                continue
            errors.append(f"{path}: names {crate} outside {', '.join(homes)}")
for e in errors:
    print(e)
print(f"{len(errors)} confinement error(s)")
sys.exit(0 if not errors else 1)
