#!/usr/bin/env python3
"""A/B timing of the GEMM kernels of two source trees on one GPU, interleaved:
the rows a kernel change touches, each row's time (CUDA-graph replays,
rawkv.bench.timing.warm_cuda_time_us) and the SHA-1 of its output bytes, so a
change meant to keep the bits shows that it does, and a timing is compared only
with one taken in the same call.

    python3 tools/ab_gemm.py --base HEAD~1 [--rounds 2] [--rows moe,wo_a,w4a8]
    python3 tools/ab_gemm.py --base-src DIR ...    # DIR/src the base tree's sources

The base revision is checked out with `git worktree add` under a temporary
directory (removed afterwards), or `--base-src` names a directory holding
the base tree's src/ (`git archive REV src | tar -x -C DIR`: for a machine
whose copy of the repository's history is not the tree's, as the device
machines' is); each round runs the base tree, then the working
tree, each in a process of its own with its own src/ on PYTHONPATH (the kernel
cache is keyed by the sources' digest, so each compiles its own kernels).
Inputs are drawn from fixed seeds, the same in every process. Rows:
  wo_a  the wo_a shapes (Flash, Pro) at 128, 512, 2,048 and 4,096 tokens (W4A16)
  moe   DeepSeek-V4-Flash's MoE gate_up and down at 256 and 4,096 tokens (W4A16)
  w4a8  the same wo_a and MoE rows with W4A8 weights and FP8 block activations
  decode  the three wo_a shapes at 1, 8 and 16 tokens and Flash's MoE gate_up and
        down at 1, 16 and 64 tokens (W4A16: the mma.sync kernel's rows)
  w4a8dec the decode rows with W4A8 weights and FP8 block activations
  fp8   the FP8 block quantizer and producers that feed the W4A8 GEMM
        (quantize_blocks, rmsnorm / swiglu _quantize_fp8, moe_stage_fp8; UE8M0
        bytes into out= buffers; quantize_blocks and rmsnorm_quantize_fp8 with FP32
        scales too) at 1, 64 and 16,384 rows of 7,168
  fused the NVFP4 fused producers (rmsnorm_quantize: row scope with a float32
        and a BF16 weight, tensor scope; mhc_rmsnorm_quantize of four streams;
        swiglu_quantize; moe_stage) at the same sizes
The weights are random NVFP4 checkpoint bytes through the loaders
(rawkv.bench.gemm), rotated over four copies for the wo_a rows and, for the
MoE rows, over as many copies as the benchmark's rule gives (moe_copies:
rawkv.bench.gemm.moe_sets' rule; Flash 3 of gate_up, 4 of down), so that a
token's experts are read from DRAM as in the benchmark's rows (one copy of
Flash's down weights, 28 MB at one token, stayed in L2 between calls)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_SETS = ("wo_a", "moe", "w4a8", "decode", "w4a8dec", "fp8", "fused")
# The benchmark's shapes (rawkv.bench.gemm, read in the worker from its own
# tree): these of them are timed.
WO_A_SHAPES = ("flash", "pro")
WO_A_MS = (128, 512, 2048, 4096)
MOE_MODEL = "flash"
MOE_TOKENS = (256, 4096)
DECODE_SHAPES = ("flash", "pro", "seed004")
DECODE_MS = (1, 8, 16)
DECODE_MOE_TOKENS = (1, 16, 64)
FP8_ROWS, FP8_WIDTH = (1, 64, 16384), 7168
#: the MoE rows' weight copies: at most MOE_MAX_COPIES, as many as fit
#: MOE_COPY_BYTES (rawkv.bench.gemm's MOE_MAX_SETS and MOE_SET_BYTES)
MOE_MAX_COPIES, MOE_COPY_BYTES = 4, 8 << 30


def moe_copies(experts: int, top_k: int, n: int, k: int, l2_bytes: int) -> int:
    """How many copies of an MoE weight the rows rotate over: the
    benchmark's rule (rawkv.bench.gemm.moe_sets), written here so that a
    base tree without it runs the same rows: enough copies that one token's
    top_k experts of all of them are 4x L2, at most MOE_MAX_COPIES and as
    many as fit MOE_COPY_BYTES."""
    per_expert = n * k // 2 + n * k // 16
    per_token = top_k * per_expert
    want = 1 if per_token >= 4 * l2_bytes else max(2, -(-4 * l2_bytes // max(per_token, 1)))
    fit = max(1, MOE_COPY_BYTES // max(1, experts * per_expert))
    return max(1, min(MOE_MAX_COPIES, fit, want))


def parse_rows(text: str) -> tuple[str, ...]:
    """The row sets named in `text` (comma-separated, from ROW_SETS), in the
    order given, each once."""
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in ROW_SETS]
    if bad or not names:
        raise ValueError(f"--rows: expected names from {', '.join(ROW_SETS)}, got {text!r}")
    return names


def summary(base: list[dict], new: list[dict]) -> list[str]:
    """Lines comparing the rounds of both trees: per row the base and new
    times (us, every round), new / base of the fastest of each, and whether
    every output's SHA-1 was the same in every round of both."""
    rows = list(dict.fromkeys(r for res in base + new for r in res))
    lines = [f"{'row':24} {'base us':>22} {'new us':>22} {'new/base':>8}  bytes"]
    for r in rows:
        b = [res[r] for res in base if r in res]
        n = [res[r] for res in new if r in res]
        ratio = f"{min(x[0] for x in n) / min(x[0] for x in b):8.3f}" if b and n else f"{'-':>8}"
        same = "same" if len({x[1] for x in b + n}) == 1 else "DIFFER"
        lines.append(f"{r:24} {' '.join(f'{x[0]:.1f}' for x in b):>22} {' '.join(f'{x[0]:.1f}' for x in n):>22} "
                     f"{ratio}  {same}")
    return lines


def _digest(torch, t) -> str:
    """SHA-1 of a tensor's bytes, or of a tuple's tensors' in turn (an
    Fp8Activation: codes, scales, inv_rms; a QuantizedActivation, whose gs
    may have no dimension; None entries skipped)."""
    import hashlib
    h = hashlib.sha1()
    for x in (t if isinstance(t, tuple) else (t,)):
        if x is not None:
            h.update(x.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def worker(rows: tuple[str, ...]) -> dict:
    """{"rawkv": the package file imported, "rows": {row: (us, sha1)}} for
    the row sets on this process's rawkv (CUDA)."""
    import torch
    import rawkv
    from rawkv.bench.gemm import MOE, WO_A, _checkpoint, _rawkv_weight, _routing, _w4a8_weight
    from rawkv.bench.timing import warm_cuda_time_us

    res = {}

    def row(name, fn):
        res[name] = (round(warm_cuda_time_us(fn), 2), _digest(torch, fn(0)))

    def wo_a_rows(prefix, shapes, ms, w16, w8):
        """The wo_a shapes at ms tokens, W4A16 (w16) and / or W4A8 (w8),
        each over four rotated weight copies."""
        for shape in shapes:
            g, k, n = WO_A[shape]
            torch.manual_seed(1)
            ws = [_rawkv_weight(torch, *_checkpoint(torch, g, n, k, "cuda")) for _ in range(4)] if w16 else None
            w8s = [_w4a8_weight(torch, g, n, k, "cuda") for _ in range(4)] if w8 else None
            for m in ms:
                torch.manual_seed(2)
                x = torch.randn(m, g, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, g, n, device="cuda", dtype=torch.bfloat16)
                if ws:
                    row(f"{prefix}wo_a {shape} {m}", lambda i: rawkv.gemm.grouped_linear(x, ws[i % 4], out=out))
                if w8s:
                    xa = rawkv.fp8.quantize_blocks(x)
                    row(f"{prefix}w4a8 wo_a {shape} {m}", lambda i: rawkv.gemm.grouped_linear(xa, w8s[i % 4], out=out))
            ws = w8s = None

    def moe_rows(prefix, token_counts, w16, w8):
        """MOE_MODEL's MoE layers at each token count (the benchmark's
        routing), W4A16 (w16) and / or W4A8 (w8)."""
        experts, top_k, layers = MOE[MOE_MODEL]
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        for layer, (n, k) in layers.items():
            c = moe_copies(experts, top_k, n, k, l2)
            torch.manual_seed(3)
            ws = [_rawkv_weight(torch, *_checkpoint(torch, experts, n, k, "cuda")) for _ in range(c)] if w16 else None
            was = [_w4a8_weight(torch, experts, n, k, "cuda") for _ in range(c)] if w8 else None
            for tokens in token_counts:
                _, offs = _routing(torch, torch.Generator().manual_seed(0), experts, top_k, tokens)
                offs = offs.cuda()
                torch.manual_seed(4)
                x = torch.randn(tokens * top_k, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(tokens * top_k, n, device="cuda", dtype=torch.bfloat16)
                if ws:
                    row(f"{prefix}moe {layer} {tokens}",
                        lambda i: rawkv.gemm.moe_linear(x, ws[i % c], offs, out=out))
                if was:
                    xa = rawkv.fp8.quantize_blocks(x)
                    row(f"{prefix}w4a8 moe {layer} {tokens}",
                        lambda i: rawkv.gemm.moe_linear(xa, was[i % c], offs, out=out))
            ws = was = None
            torch.cuda.empty_cache()

    def fp8_rows():
        """The FP8 producers of the W4A8 GEMM's activations, UE8M0 bytes into
        out= buffers (the same calls a captured step makes), and the
        quantizer and RMSNorm producer with FP32 scales."""
        n = FP8_WIDTH
        for m in FP8_ROWS:
            torch.manual_seed(5)
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
            ids, wts = torch.zeros(m, 8, dtype=torch.int32, device="cuda"), torch.rand(m, 8, device="cuda")
            codes = torch.empty(m, n, dtype=torch.uint8, device="cuda")
            sf = torch.empty(m, n // 128, dtype=torch.uint8, device="cuda")
            inv, ids_out = torch.empty(m, device="cuda"), torch.empty(m, 8, dtype=torch.int64, device="cuda")
            w_out = torch.empty(m, 8, device="cuda")
            fmt = "ue8m0"
            row(f"fp8 quantize_blocks {m}", lambda i: rawkv.fp8.quantize_blocks(x, scale_format=fmt, out=(codes, sf)))
            row(f"fp8 rmsnorm {m}", lambda i: rawkv.fused.rmsnorm_quantize_fp8(x, w, scale_format=fmt,
                                                                              out=(codes, sf, inv)))
            row(f"fp8 swiglu {m}", lambda i: rawkv.fused.swiglu_quantize_fp8(h, scale_format=fmt, out=(codes, sf)))
            row(f"fp8 moe_stage {m}", lambda i: rawkv.fused.moe_stage_fp8(x, ids, wts, scale_format=fmt,
                                                                         out=(codes, sf, ids_out, w_out)))
            sf32 = torch.empty(m, n // 128, device="cuda")      # FP32 scales: the quotient path apart
            row(f"fp8 quantize_blocks/fp32 {m}",
                lambda i: rawkv.fp8.quantize_blocks(x, scale_format="fp32", out=(codes, sf32)))
            row(f"fp8 rmsnorm/fp32 {m}", lambda i: rawkv.fused.rmsnorm_quantize_fp8(x, w, scale_format="fp32",
                                                                                   out=(codes, sf32, inv)))
            x = h = None
            torch.cuda.empty_cache()

    def fused_rows():
        """The NVFP4 fused producers (rawkv.fused) at the FP8 rows' sizes,
        into out= buffers made by a first call: RMSNorm (row scope, float32
        and BF16 weight; tensor scope: three launches), the mHC form (four
        streams), SwiGLU (row scope) and MoE staging."""
        F, n = rawkv.fused, FP8_WIDTH
        for m in FP8_ROWS:
            torch.manual_seed(6)
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            xs = torch.randn(m, 4, n, device="cuda", dtype=torch.bfloat16)
            mix = torch.rand(m, 4, device="cuda")
            w = torch.rand(n, device="cuda") + 0.5
            wb = w.bfloat16()
            ids, wts = torch.zeros(m, 8, dtype=torch.int32, device="cuda"), torch.rand(m, 8, device="cuda")
            calls = {"rmsnorm": lambda o: F.rmsnorm_quantize(x, w, out=o),
                     "rmsnorm/bf16w": lambda o: F.rmsnorm_quantize(x, wb, out=o),
                     "rmsnorm/tensor": lambda o: F.rmsnorm_quantize(x, w, scope="tensor", out=o),
                     "mhc_rmsnorm": lambda o: F.mhc_rmsnorm_quantize(xs, mix, w, out=o),
                     "swiglu": lambda o: F.swiglu_quantize(x, out=o),
                     "moe_stage": lambda o: F.moe_stage(x, ids, wts, out=o)}
            for name, call in calls.items():
                out = call(None)
                row(f"nvfp4 {name} {m}", lambda i, call=call, out=out: call(out))
            x = xs = None
            torch.cuda.empty_cache()

    w8 = "w4a8" in rows
    if "wo_a" in rows or w8:
        wo_a_rows("", WO_A_SHAPES, WO_A_MS, "wo_a" in rows, w8)
    if "moe" in rows or w8:
        moe_rows("", MOE_TOKENS, "moe" in rows, w8)
    if "decode" in rows or "w4a8dec" in rows:
        wo_a_rows("dec ", DECODE_SHAPES, DECODE_MS, "decode" in rows, "w4a8dec" in rows)
        moe_rows("dec ", DECODE_MOE_TOKENS, "decode" in rows, "w4a8dec" in rows)
    if "fp8" in rows:
        fp8_rows()
    if "fused" in rows:
        fused_rows()
    return {"rawkv": rawkv.__file__, "rows": res}


def _run_tree(src: str, rows: tuple[str, ...]) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--rows", ",".join(rows)],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the worker on {src} failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not os.path.realpath(got["rawkv"]).startswith(os.path.realpath(src) + os.sep):
        raise RuntimeError(f"the worker for {src} imported rawkv from {got['rawkv']} (an installed copy?)")
    return {r: tuple(v) for r, v in got["rows"].items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the git revision to compare the working tree with")
    ap.add_argument("--base-src", help="a directory with the base tree's src/, in place of --base")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of base then new (default 2)")
    ap.add_argument("--rows", default="wo_a,moe", help=f"comma-separated from {', '.join(ROW_SETS)}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        rows = parse_rows(args.rows)
    except ValueError as exc:
        ap.error(str(exc))
    if args.worker:
        print(json.dumps(worker(rows)))
        return 0
    if bool(args.base) == bool(args.base_src) or args.rounds < 1:
        ap.error("one of --base REV or --base-src DIR is required, and --rounds at least 1")
    if args.base_src:
        if not os.path.isdir(os.path.join(args.base_src, "src", "rawkv")):
            ap.error(f"--base-src: {args.base_src} has no src/rawkv")
        base, new = _rounds(os.path.abspath(args.base_src), rows, args.rounds)
    else:
        with tempfile.TemporaryDirectory(prefix="ab-gemm-") as tmp:
            tree = os.path.join(tmp, "base")
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree, args.base], check=True)
            try:
                base, new = _rounds(tree, rows, args.rounds)
            finally:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
    print("\n".join(summary(base, new)))
    return 0


def _rounds(tree: str, rows, rounds: int) -> tuple[list, list]:
    """`rounds` of the base tree's process, then the working tree's."""
    base, new = [], []
    for r in range(rounds):
        base.append(_run_tree(os.path.join(tree, "src"), rows))
        new.append(_run_tree(os.path.join(ROOT, "src"), rows))
        print(f"round {r + 1} of {rounds} done", file=sys.stderr, flush=True)
    return base, new


if __name__ == "__main__":
    sys.exit(main())
