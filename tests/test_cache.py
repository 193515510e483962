"""The on-disk kernel cache: hits, damaged files, atomic writes, opt-out.

These compile with NVRTC (cuda-python) and need no GPU."""
import json
import os
import subprocess
import sys

import pytest

from rawkv import _cache, _nvrtc, runtime

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")

FILE = "fp8.cu"


def _names():
    return runtime.registered_kernels()[FILE]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(tmp_path / "kc"))
    return tmp_path / "kc"


def test_compile_then_disk_hit(cache_dir):
    stats = {}
    res, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"compiles": 1} and path is not None and path.is_file()
    assert path.parent == cache_dir
    assert set(res.lowered) == set(_names()) and res.cubin[:4] == b"\x7fELF"
    res2, path2 = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"compiles": 1, "disk_hits": 1} and path2 == path
    assert res2.cubin == res.cubin and res2.lowered == res.lowered
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]


def test_key_depends_on_arch_and_names(cache_dir):
    k = _cache.cache_key(FILE, "sm_90", _names())
    assert k != _cache.cache_key(FILE, "sm_80", _names())
    assert k != _cache.cache_key(FILE, "sm_90", _names()[:-1])
    assert k == _cache.cache_key(FILE, "sm_90", _names())


def test_key_covers_include_dirs_and_cuda_headers(tmp_path, monkeypatch):
    k = _cache.cache_key(FILE, "sm_90", _names())
    inc = tmp_path / "include"
    inc.mkdir()
    header = inc / "cuda_fp8.h"
    header.write_text("// another CUDA's header\n")
    monkeypatch.setattr(_nvrtc, "cuda_include_dirs", lambda: (str(inc),))
    k_other_dir = _cache.cache_key(FILE, "sm_90", _names())
    assert k_other_dir != k
    st = header.stat()
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))    # the header was updated
    assert _cache.cache_key(FILE, "sm_90", _names()) != k_other_dir


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_file_is_recompiled(cache_dir, damage, monkeypatch):
    _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "truncate":
        blob = blob[: len(blob) // 3]
    elif damage == "empty":
        blob = bytearray()
    else:
        blob = bytearray(b"RAWKV-CUBIN-1\n" + os.urandom(200))
    path.write_bytes(bytes(blob))
    # The damaged file is replaced by the atomic rename, never unlinked first
    # (that could delete a good file another process has just put there).
    unlinked = []
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (unlinked.append(str(p)), real_unlink(p, *a, **k)))
    stats = {}
    res, path2 = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert str(path) not in unlinked
    assert stats == {"damaged": 1, "compiles": 1}
    assert _cache._decode(path2.read_bytes()) is not None and res.cubin[:4] == b"\x7fELF"


def test_cache_off(monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")
    stats = {}
    res, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert path is None and res.cubin and stats == {"compiles": 1}


@pytest.mark.parametrize("where", ["under_a_file", "name_too_long"])
def test_unusable_cache_dir_costs_only_a_recompile(tmp_path, monkeypatch, where):
    if where == "under_a_file":      # a path component is a regular file (fails even as root)
        (tmp_path / "file").write_text("")
        d = tmp_path / "file" / "sub"
    else:                            # ENAMETOOLONG from the first stat/open
        d = tmp_path / ("x" * 300)
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(d))
    for _ in range(2):
        stats = {}
        res, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
        assert path is None and res.cubin[:4] == b"\x7fELF" and stats == {"compiles": 1}


def test_second_process_loads_without_compiling(cache_dir):
    code = ("import json, rawkv; from rawkv import _cache, runtime; s = {}; "
            f"_cache.load_or_compile({FILE!r}, 'sm_90', runtime.registered_kernels()[{FILE!r}], stats=s); "
            "print(json.dumps(s))")
    env = dict(os.environ, RAWKV_CACHE_DIR=str(cache_dir))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert json.loads(runs[0].stdout) == {"compiles": 1}
    assert json.loads(runs[1].stdout) == {"disk_hits": 1}
