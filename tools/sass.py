#!/usr/bin/env python3
"""The machine code (SASS) of one declared kernel instance, with no GPU: NVRTC
compiles it as the runtime would for `--arch` (default sm_90; the file's
target there, sm_90a for the wgmma kernels) and nvdisasm prints the cubin.

    python3 tools/sass.py gemm_fp4 GEMM_SM90 0 False 128 5 256
    python3 tools/sass.py gemm_fp4 GEMM 0 False 1 1 8 1 2 2 False --arch sm_80

MODULE is a module of rawkv.kernels, KERNEL its declared kernel (its Python
name), then the template arguments as Python literals. nvdisasm comes from
$NVDISASM or PATH; no CUDA toolkit needed: PyPI's wheel has it
(`pip download --no-deps nvidia-cuda-nvdisasm`, unzip, nvidia/cu13/bin/nvdisasm).
`--count` prints, per innermost loop closed by a backward branch that holds
a tensor-core instruction (HGMMA, QGMMA, HMMA, ...), its instruction count
and most common opcodes instead."""
from __future__ import annotations

import argparse
import ast
import collections
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

_INSTR = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*\(\.(L_x_\d+)\)")


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(instruction count, opcode counts) of every innermost loop (a label,
    then a branch back to it, holding no other such loop) whose body holds a
    tensor-core instruction: a main loop's instructions per step."""
    lines = sass.splitlines()
    where, spans = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line.strip())
        if m:
            where[m.group(1)] = i
        m = _BRANCH.search(line)
        if m and m.group(1) in where:
            spans.append((where[m.group(1)], i))
    out = []
    for lo, hi in spans:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
            continue
        body = [_INSTR.match(x).group(1) for x in lines[lo:hi + 1] if _INSTR.match(x)]
        ops = collections.Counter(op.split(".")[0] for op in body)
        if any(op.endswith("MMA") for op in ops):       # (HGMMA, QGMMA, HMMA, IMMA, ...)
            out.append((len(body), ops))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module")
    p.add_argument("kernel")
    p.add_argument("targs", nargs="*")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--count", action="store_true")
    a = p.parse_args(argv)
    from rawkv import _nvrtc
    k = getattr(importlib.import_module(f"rawkv.kernels.{a.module}"), a.kernel)
    f = k.file
    targs = tuple(ast.literal_eval(t) for t in a.targs)
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool:
        print("sass: no nvdisasm ($NVDISASM or PATH; see --help)", file=sys.stderr)
        return 2
    r = _nvrtc.compile_cu(f.source(), f.filename, f.target(a.arch), [k.expr(targs)], f.options())
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(r.cubin)
        res = subprocess.run([tool, "-c", "-g", path], capture_output=True, text=True)
    if res.returncode:
        print(res.stderr, file=sys.stderr)
        return res.returncode
    if not a.count:
        print(res.stdout)
        return 0
    for n, ops in loops(res.stdout):
        print(n, "instructions:", ", ".join(f"{op} {c}" for op, c in ops.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
