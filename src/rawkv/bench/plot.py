"""The figure of a group that draws none of its own: one horizontal bar per
row (op and shape) for rawkv's time and, where the row has them, the
baseline's and the peer's, on a log axis."""
from __future__ import annotations

#: (label, row key) of the bars, in drawing order
SERIES = (("rawkv", "us"), ("baseline", "baseline_us"), ("peer", "peer_us"))


def bar_rows(results) -> list:
    """[(label, {series label: us or None})] of the rows with a time, in
    order; error rows and rows without `us` (host overhead) are left out."""
    out = []
    for r in results:
        if not isinstance(r, dict) or not isinstance(r.get("us"), (int, float)):
            continue
        shape = "x".join(map(str, r.get("shape") or ()))
        out.append((f"{r.get('op', '?')} {shape}".strip(),
                    {label: r.get(key) if isinstance(r.get(key), (int, float)) else None
                     for label, key in SERIES}))
    return out


def bars(results, path):
    """Draw bar_rows(results) to path. Returns the path written, or None when
    matplotlib is not importable or there is nothing to draw."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = bar_rows(results)
    if not rows:
        return None
    present = [label for label, _ in SERIES if any(v[label] is not None for _, v in rows)]
    height = 0.8 / len(present)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.28 * len(rows) * len(present)))
    for j, label in enumerate(present):
        pts = [(i + j * height, v[label]) for i, (_, v) in enumerate(rows) if v[label] is not None]
        ax.barh([y for y, _ in pts], [us for _, us in pts], height=height, label=label)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))])
    ax.set_yticklabels([name for name, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("us (device time, median of CUDA-graph replays)", fontsize=8)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
