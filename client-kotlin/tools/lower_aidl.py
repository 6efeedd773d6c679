#!/usr/bin/env python3
"""Lowers llmd's AIDL for the Android 10 `aidl` tool Debian ships (used only to build the Java
stubs for the host JVM tests; Soong's aidl_interface compiles the real files on a device build).

That tool predates AIDL enums and knows no Rust annotations, so: `@RustDerive(...)` lines are
dropped, and each `@Backing(type="int") enum E { A = 0, ... }` becomes `int` wherever E is used,
with its values as constants in a Kotlin-free holder (`interface E { const int A = 0; }`). An
int-backed enum is an int32 on the wire, so the lowered stubs are wire-identical.

    lower_aidl.py IN_DIR OUT_DIR
"""
import pathlib, re, sys

src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
files = {p.name: p.read_text() for p in sorted(src.glob("*.aidl"))}
enums = {}
for name, text in files.items():
    m = re.search(r'@Backing\(type="int"\)\s*enum\s+(\w+)\s*\{(.*?)\}', text, re.S)
    if m:
        enums[m.group(1)] = re.findall(r"(\w+)\s*=\s*(-?\d+)", m.group(2))
dst.mkdir(parents=True, exist_ok=True)
for name, text in files.items():
    text = re.sub(r"^\s*@RustDerive\(.*?\)\s*\n", "", text, flags=re.M)
    stem = name[:-5]
    if stem in enums:
        consts = "\n".join(f"    const int {k} = {v};" for k, v in enums[stem])
        text = re.sub(r'@Backing\(type="int"\)\s*enum\s+\w+\s*\{.*?\}', f"interface {stem} {{\n{consts}\n}}", text, flags=re.S)
    for e, values in enums.items():
        if e == stem:
            continue
        text = re.sub(rf"^import com\.llmd\.{e};\n", "", text, flags=re.M)
        for k, v in values:
            text = text.replace(f"{e}.{k}", v)
        text = re.sub(rf"\b{e}\b(?=\s+\w+\s*[=;,)])", "int", text)
    (dst / name).write_text(text)
