"""python -m rawkv demo: the CPU mode (numpy reference) runs and reports."""
from __future__ import annotations

import re

from rawkv.demo import main


def test_demo_cpu_small(capsys):
    assert main(["--cpu", "--small"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("rawkv demo: CPU MODE")
    assert "numpy reference" in lines[0]
    assert lines[1].startswith("config: 2 requests")
    bpt = [ln for ln in lines if ln.startswith("bytes/token")]
    assert len(bpt) == 2 and all("vs BF16" in ln for ln in bpt)
    acc = [ln for ln in lines if ln.startswith("accuracy")]
    assert len(acc) == 3 and all("(ok >=" in ln for ln in acc)
    for ln in acc:
        assert float(re.search(r"cosine min ([0-9.]+)", ln).group(1)) >= 0.98
    assert re.match(r"time: [0-9.]+ us per step \(numpy reference", lines[-1])
    # CPU mode runs no kernel, and says so instead of reporting "kernel errors"
    assert lines[-1].endswith("skipped rows 0 (counted by the numpy reference ops; no kernel ran)")
    assert "kernel" not in lines[-1].replace("no kernel ran", "")
