"""Markdown table of two benchmark runs side by side (bench/results files).

    python -m rawkv.bench.compare OLD_DIR NEW_DIR [--group nvfp4]

One row per (op, shape, dtype) present in both runs: device time and
fraction of the same run's copy bandwidth, old and new."""
from __future__ import annotations

import argparse
import glob
import json
import os


def load(folder: str, group: str):
    paths = sorted(glob.glob(os.path.join(folder, f"*-{group}.json")))
    if not paths:
        return None, {}
    data = json.load(open(paths[-1]))
    rows = {(r["op"], tuple(r["shape"]), r.get("dtype")): r for r in data["results"]}
    return data, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--group", action="append", help="core, nvfp4, fused, kvcache (default: all)")
    a = p.parse_args(argv)
    for group in a.group or ["core", "nvfp4", "fused", "kvcache"]:
        old_meta, old = load(a.old, group)
        new_meta, new = load(a.new, group)
        if new_meta is None:
            continue
        print(f"\n### {group}: copy {old_meta and old_meta['copy_GBps']} -> {new_meta['copy_GBps']} GB/s\n")
        print("| op | shape | dtype | us before | us now | of copy before | of copy now |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for key, r in new.items():
            o = old.get(key)
            if "us" not in r:
                continue
            fo = f"{o['frac_of_copy']:.0%}" if o and "frac_of_copy" in o else ""
            fn = f"{r['frac_of_copy']:.0%}" if "frac_of_copy" in r else ""
            print(f"| `{key[0]}` | {'x'.join(map(str, key[1]))} | {key[2]} | "
                  f"{o['us'] if o and 'us' in o else ''} | {r['us']} | {fo} | {fn} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
