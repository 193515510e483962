"""The driver of python -m rawkv bench (rawkv.bench's docstring says what it
does): its options, the run over the groups, and the pieces of its output
that need no GPU (the table, the JSON document and file, the commit, the
figure beside the JSON), each a function of its own so it can be tested on
a CPU."""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from . import GROUPS, timing
from .plot import bars

#: the folder above the package's `src/`: a git checkout's top when rawkv runs
#: from its source tree (src/rawkv/bench/cli.py)
_SOURCE_ROOT = Path(__file__).resolve().parents[3]


# ---- options -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=os.path.join("bench", "results"),
                   help="folder for the JSON files and figures (default %(default)s, under the "
                        "working directory)")
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated groups, of {', '.join(GROUPS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    p.add_argument("--peer", action="store_true",
                   help="also time the peers that are installed (gemm: humming-kernels, "
                        "pip install 'rawkv[bench]'); the torch baselines always run")


def parse_groups(only: str) -> list:
    """The groups --only names, in its order, each once; an unknown or empty
    list is refused with a ValueError naming --only."""
    names = [g.strip() for g in only.split(",") if g.strip()]
    unknown = [g for g in names if g not in GROUPS]
    if unknown:
        raise ValueError(f"argument --only: unknown group(s) {', '.join(map(repr, unknown))}; "
                         f"the groups are {', '.join(GROUPS)}")
    if not names:
        raise ValueError(f"argument --only: names no group; the groups are {', '.join(GROUPS)}")
    return list(dict.fromkeys(names))


def check_arguments(a, error) -> None:
    """The options' values, checked before anything runs or is written;
    refused through `error` (argparse's one-line usage error, status 2).
    Fills in a.groups."""
    try:
        a.groups = parse_groups(a.only)
    except ValueError as exc:
        error(str(exc))
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        error(f"argument --out: {a.out} exists and is not a folder")


# ---- output ------------------------------------------------------------------------
def commit(root=None) -> str:
    """What the JSON's `commit` records: RAWKV_COMMIT when set
    (tools/gpu_check.sh runs on a copy of the tree whose .git, if any, may
    not be the code measured); else git's HEAD when `root` (default: the
    folder holding the rawkv package that runs) is the top of a git checkout,
    whatever the working directory; else rawkv's version (an installed wheel,
    whose site-packages may lie inside some other repository)."""
    if os.environ.get("RAWKV_COMMIT"):
        return os.environ["RAWKV_COMMIT"]
    root = Path(root) if root is not None else _SOURCE_ROOT
    try:
        out = subprocess.check_output(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                                      text=True, stderr=subprocess.DEVNULL).splitlines()
    except (OSError, subprocess.CalledProcessError):
        out = []
    if len(out) == 2 and Path(out[0]).resolve() == root.resolve():
        return out[1].strip()
    from .._version import __version__
    return __version__


def device_short(name: str) -> str:
    """The device part of the file names: h100, h200, else the name's last word."""
    return "h200" if "H200" in name else "h100" if "H100" in name else name.split()[-1].lower()


def document(device: str, torch_version: str, cupy_version: str, commit_: str, copy_GBps: float,
             results: list, eager=None) -> dict:
    """One group's JSON document (docs/benchmarks.md, "How to read them");
    eager: why the group's timings that could not be captured in a CUDA
    graph fell back to eager calls (timing.EAGER), written as eager_timings
    when there are any."""
    doc = {"device": device, "torch": torch_version, "cupy": cupy_version, "commit": commit_,
           "copy_GBps": round(copy_GBps, 1)}
    if eager:
        doc["eager_timings"] = list(eager)
    doc["results"] = results
    return doc


def write_json(folder: str, date: str, device: str, group: str, doc: dict) -> str:
    """Write doc to folder/<date>-<device>-<group>.json; returns the path."""
    path = os.path.join(folder, f"{date}-{device}-{group}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def write_plot(mod, results, json_path: str):
    """The group's figure beside its JSON file (same name, .png): the module's
    plot(results, png_path) if it has one, else the generic bars. Returns the
    path written, or None (nothing drawn, e.g. matplotlib missing, or the
    plot failed: reported, the run goes on)."""
    draw = getattr(mod, "plot", bars)
    try:
        return draw(results, os.path.splitext(json_path)[0] + ".png")
    except Exception as exc:  # noqa: BLE001 - a figure is not worth the run
        print(f"[bench] plot failed: {type(exc).__name__}: {exc}")
        return None


def _number(v, fmt="{:,.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _frac_cell(v) -> str:
    """A fraction in percent, with a decimal below 10% (decode sizes sit at 0.1-5% of copy)."""
    return _number(v, "{:.1%}" if isinstance(v, (int, float)) and abs(v) < 0.1 else "{:.0%}")


def _us_cell(r: dict) -> str:
    if "us" in r:
        return _number(r["us"])
    if "host_us" in r:          # launch_overhead: the host's time per call, not the device's
        return f"{_number(r['host_us'])} host"
    return "-"


def _peer_cell(r: dict) -> str:
    if r.get("peer_us") is not None:
        return _number(r["peer_us"])
    return "failed" if r.get("peer") is not None else "-"


def format_table(results: list) -> str:
    """The rows as an aligned text table: op, shape, us, the baseline's us,
    the fraction (of the byte floor where a row has one, the GEMM's; else of
    the copy bandwidth) and, when any row has a peer field, the peer's us.
    Error rows follow the table, one line each."""
    rows = [r for r in results if "error" not in r]
    floor = any("frac_of_floor" in r for r in rows)
    peer = any("peer" in r or "peer_us" in r for r in rows)
    head = ["op", "shape", "us", "baseline us", "of floor" if floor else "of copy"] + (["peer us"] if peer else [])
    body = []
    for r in rows:
        frac = r.get("frac_of_floor") if floor and "frac_of_floor" in r else r.get("frac_of_copy")
        cells = [str(r.get("op", "?")), "x".join(map(str, r.get("shape") or ())) or "-", _us_cell(r),
                 _number(r.get("baseline_us")), _frac_cell(frac)]
        body.append(cells + ([_peer_cell(r)] if peer else []))
    width = [max(len(c[j]) for c in [head] + body) for j in range(len(head))]
    lines = ["  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, width))).rstrip()
             for cells in [head] + body]
    lines += [f"{r.get('op', '?')}: {r['error']}" for r in results if "error" in r]
    return "\n".join(lines)


# ---- the run -----------------------------------------------------------------------
def _gpu_problem():
    """None when the GPU stack works, else the reason on one line."""
    import rawkv
    try:
        rawkv.get_runtime(0)
    except rawkv.GpuUnavailableError as exc:
        return " ".join(str(exc).split())
    return None


def _run_group(mod, rt, results: list, a) -> None:
    """The group's run; a group that names peers (PEERS) gets --peer."""
    kw = {"peers": a.peer} if getattr(mod, "PEERS", ()) else {}
    mod.run(rt, results, a.quick, **kw)


def run(a) -> int:
    """Every group of a.groups (check_arguments filled it in): 0, 1 when a
    group failed (its error is a row of its file), 2 without a GPU."""
    problem = _gpu_problem()
    if problem is not None:       # an expected state, not a crash: one line, no traceback
        print(f"rawkv bench: needs a CUDA GPU: {problem}", file=sys.stderr)
        return 2
    import cupy
    import torch
    import rawkv
    rt = rawkv.warmup(0)
    timing.COPY["GBps"] = timing.copy_bandwidth_GBps()
    dev = torch.cuda.get_device_name(0)
    short = device_short(dev)
    date = datetime.date.today().isoformat()
    commit_ = commit()
    os.makedirs(a.out, exist_ok=True)
    status = 0
    for group in a.groups:
        results: list = []
        mod = None
        eager0 = len(timing.EAGER)
        try:
            mod = importlib.import_module(f"{__package__}.{group}")
            _run_group(mod, rt, results, a)
        except ModuleNotFoundError as exc:
            print(f"[bench] {group}: skipped ({exc})")
            continue
        except Exception as exc:  # report and go on with the other groups
            import traceback
            traceback.print_exc()
            results.append({"op": f"{group}/error", "error": repr(exc)})
            status = 1
        doc = document(dev, torch.__version__, cupy.__version__, commit_, timing.COPY["GBps"], results,
                       timing.EAGER[eager0:])
        path = write_json(a.out, date, short, group, doc)
        print(f"[bench] {group} -> {path}")
        png = write_plot(mod, results, path)
        if png:
            print(f"[bench] {group} plot -> {png}")
        print(format_table(results), flush=True)
    return status
