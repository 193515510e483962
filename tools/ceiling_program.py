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


#: The programs' timing (host code, in place of their "#define TIMING"
#: line): the fastest of `reps` launches of `k` over `iters` chunks, after
#: one warm launch of 10, in milliseconds.
TIMING = r'''
template <typename K>
float best_ms(K k, int sms, int smem, float* out, int iters, int reps) {
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    k<<<sms, 256, smem>>>(out, 10);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best = 1e30f;
    for (int rep = 0; rep < reps; ++rep) {
        cudaEventRecord(e0);
        k<<<sms, 256, smem>>>(out, iters);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        best = ms < best ? ms : best;
    }
    return best;
}
'''


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
