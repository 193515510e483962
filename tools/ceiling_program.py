"""What the wgmma ceiling microbenchmarks (wgmma_bf16_ceiling.py,
wgmma_fp8_ceiling.py) share: a kernel file's constants as #defines, and
building and running the standalone CUDA program with nvcc for sm_90a."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

#: The kernels' headers, which the programs include from the source tree.
CU = pathlib.Path(__file__).resolve().parent.parent / "src" / "rawkv" / "cu"


def defines(kernel_file) -> str:
    """A KernelFile's constants as #defines (nvcc would split a -D value at
    its commas, and the E4M3 table has them)."""
    return "".join(f"#define {k} {v}\n" for k, v in kernel_file.constants.items())


def build_and_run(source: str) -> int:
    """Write `source` to a temporary directory, compile it for sm_90a and run
    it (its output goes to ours); nvcc's log on a failed build."""
    with tempfile.TemporaryDirectory() as d:
        cu, exe = pathlib.Path(d, "ceiling.cu"), pathlib.Path(d, "ceiling")
        cu.write_text(source)
        build = subprocess.run(["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                                f"-I{CU}", str(cu), "-o", str(exe)], capture_output=True, text=True)
        if build.returncode:
            print(build.stdout + build.stderr, file=sys.stderr)
            return build.returncode
        return subprocess.run([str(exe)]).returncode
