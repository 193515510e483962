"""The GEMM group's figure (rawkv.bench.gemm): time against M per shape."""
from __future__ import annotations


SERIES = (("rawkv", "us"), ("rawkv W4A8", "w4a8_us"), ("humming", "peer_us"), ("humming W4A8", "w4a8_peer_us"),
          ("torch BF16", "baseline_us"),
          ("floor", "floor_us"))


def _panel(row):
    """(panel title, x) of a result row, or None for rows that are not GEMMs."""
    op, shape = row.get("op", ""), row.get("shape")
    if op.startswith("grouped_linear/wo_a-") and shape:
        m, g, k, n = shape
        return f"wo_a {row.get('model', op.split('-', 1)[1])} (G {g}, K {k}, N {n})", m
    if op.startswith("moe_linear/") and shape:
        tokens, experts, top_k, k, n = shape
        return (f"MoE {op.split('/', 1)[1]} {row.get('model', '')} "
                f"({experts} experts top-{top_k}, K {k}, N {n})").replace("  ", " "), tokens
    return None


def plot_series(results) -> dict:
    """{panel title: {"x": [M ...], series name: [us or None ...]}}, panels in
    the rows' order, points sorted by M."""
    panels: dict = {}
    for row in results:
        where = _panel(row)
        if where is None:
            continue
        title, x = where
        # (a series not timed for a row, or reported as unavailable: no point)
        panels.setdefault(title, []).append((x, [v if isinstance(v, (int, float)) else None
                                                 for v in (row.get(key) for _, key in SERIES)]))
    out = {}
    for title, points in panels.items():
        points.sort(key=lambda p: p[0])
        out[title] = {"x": [p[0] for p in points]}
        for j, (label, _) in enumerate(SERIES):
            out[title][label] = [p[1][j] for p in points]
    return out


def plot(results, path):
    """Time against M, log axes, one panel per shape: rawkv, humming (and
    the two's W4A8 rows), torch BF16 and the floor. Returns the path written, or None when matplotlib is
    not importable or there is nothing to draw."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = plot_series(results)
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    style = {"rawkv": "o-", "rawkv W4A8": "D-", "humming": "s-", "humming W4A8": "v:", "torch BF16": "^-",
             "floor": "k--"}
    for ax, (title, s) in zip(axes.flat, panels.items()):
        for label, _ in SERIES:
            pts = [(x, y) for x, y in zip(s["x"], s[label]) if y is not None]
            if pts:
                ax.plot(*zip(*pts), style[label], label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("M (tokens)", fontsize=8)
        ax.set_ylabel("us", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
