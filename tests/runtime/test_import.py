"""`import rawkv` needs only numpy; a GPU op without the GPU stack fails clearly."""
import subprocess
import sys
import textwrap

import pytest

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split('.')[0] in ('cupy', 'torch', 'cuda', 'cupy_backends'):
                raise ImportError('blocked for the test: ' + name)
    sys.meta_path.insert(0, Block())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_import_touches_no_cuda_stack():
    r = _run("""
        import sys, numpy as np
        before = set(sys.modules)   # cuda-bindings' .pth may pre-load a 'cuda' namespace
        import rawkv
        loaded = [m for m in set(sys.modules) - before
                  if m.split('.')[0] in ('cupy', 'torch', 'cuda', 'cupy_backends')]
        assert not loaded, loaded
        codes = rawkv.fp8.e4m3_encode(np.array([1.0, -2.0, 1000.0], np.float32))
        assert codes.tolist() == [0x38, 0xC0, 0x7E], codes
        print('ok')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_gpu_op_without_cupy_says_what_is_missing():
    r = _run("""
        import rawkv
        try:
            rawkv.get_runtime(0)
        except rawkv.GpuUnavailableError as e:
            print('error:', e)
    """)
    assert r.returncode == 0, r.stderr
    assert "CuPy" in r.stdout and "pip install" in r.stdout, r.stdout


def _cpu_only_torch():
    try:
        import torch
    except ImportError:
        return False
    return not torch.cuda.is_available()


def test_without_a_cuda_torch_every_entry_point_says_what_is_missing():
    """With a CPU-only torch (as in CI) torch.cuda calls fail with a bare
    AssertionError; rawkv must raise its own error before making any."""
    if not _cpu_only_torch():
        pytest.skip("needs torch without a usable CUDA device")
    import rawkv
    for call in (rawkv.get_runtime, rawkv.warmup, lambda: rawkv.get_runtime(0),
                 lambda: rawkv.get_runtime("cuda:0"), lambda: rawkv.warmup("cuda")):
        with pytest.raises(rawkv.GpuUnavailableError, match="CUDA"):
            call()
    r = subprocess.run([sys.executable, "-m", "rawkv", "warmup"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "rawkv warmup:" in r.stderr and "CUDA" in r.stderr and "Traceback" not in r.stderr


def test_device_argument_is_parsed_or_refused():
    from rawkv.runtime import _device_index
    assert _device_index(None) is None and _device_index("cuda") is None
    assert _device_index(3) == 3 and _device_index("cuda:12") == 12
    for bad, exc in (("cuda:x", ValueError), ("cpu", ValueError), ("cuda:0:1", ValueError),
                     (-1, ValueError), (1.0, TypeError), (True, TypeError), ([0], TypeError)):
        with pytest.raises(exc, match="^device: "):
            _device_index(bad)
    torch = pytest.importorskip("torch")
    assert _device_index(torch.device("cuda:2")) == 2 and _device_index(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="^device: .*cpu"):
        _device_index(torch.device("cpu"))


def _run_plain(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


def test_operators_exist_when_torch_is_imported_after_rawkv():
    """`import rawkv` before `import torch` left torch.ops.rawkv empty; the
    operators are now registered when torch's import has run, torch keeps
    its own loader, and a compiled public op finds its operator."""
    pytest.importorskip("torch")
    r = _run_plain("""
        import sys
        import rawkv
        assert 'torch' not in sys.modules
        import torch
        from rawkv import _opdecl
        assert all(hasattr(torch.ops.rawkv, n) for n in _opdecl.declared()), 'not registered'
        assert type(torch.__spec__.loader).__module__ != 'rawkv._op', torch.__spec__.loader
        assert torch.__loader__ is torch.__spec__.loader
        assert not [f for f in sys.meta_path if type(f).__module__ == 'rawkv._op']
        x = torch.linspace(-500, 500, 64)
        out = torch.empty(64, dtype=torch.uint8)
        torch.ops.rawkv.e4m3_encode(x, out)
        f = torch.compile(lambda x: rawkv.fp8.e4m3_encode(x), fullgraph=True, backend='aot_eager')
        assert torch.equal(f(x).view(torch.uint8), out)
        print('ok')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_failing_registration_does_not_break_import_torch():
    """The hook runs inside `import torch`: an error of rawkv's is a warning
    there (and raised by `import rawkv.library`), never a failed torch import."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import warnings
        import rawkv
        def fail():
            raise RuntimeError('planted')
        rawkv._register_ops = fail
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            import torch
        assert torch.ones(1).item() == 1.0
        assert any('planted' in str(m.message) for m in w), [str(m.message) for m in w]
        print('ok')
    """)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


_AUTOLOAD_PLUGIN = """
    import rawkv            # imported by torch's backend autoload, while `import torch` runs

    def init():
        pass
"""

# rawkv imported from inside torch's import, before torch has defined most of
# its modules: when torch's import looks up torch.nn.
_MID_IMPORT = """
    import importlib.abc, sys
    class Mid(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == 'torch.nn':
                sys.meta_path.remove(self)
                assert getattr(sys.modules['torch'].__spec__, '_initializing', False)
                import rawkv
    sys.meta_path.insert(0, Mid())
"""


@pytest.mark.parametrize("how", ["backend-autoload", "mid-import"])
def test_operators_exist_when_rawkv_is_imported_during_import_torch(tmp_path, how):
    """`import rawkv` while `import torch` is still running (a torch backend
    autoload plugin, an entry point of the torch.backends group, importing
    it; or any module torch's import runs) found torch in sys.modules with
    its spec initializing, registered nothing and installed no hook:
    torch.ops.rawkv.* never appeared. They are registered once torch's
    import has finished, and torch's spec is left as it was."""
    pytest.importorskip("torch")
    import os
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    prelude = ""
    if how == "backend-autoload":
        (tmp_path / "rawkv_probe_plugin.py").write_text(textwrap.dedent(_AUTOLOAD_PLUGIN))
        info = tmp_path / "rawkv_probe_plugin-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rawkv-probe-plugin\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text("[torch.backends]\nrawkv_probe = rawkv_probe_plugin:init\n")
    else:
        prelude = _MID_IMPORT
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", textwrap.dedent(prelude) +
                        textwrap.dedent("""
        import importlib.machinery, sys
        assert 'rawkv' not in sys.modules and 'torch' not in sys.modules
        import torch
        assert 'rawkv' in sys.modules, 'rawkv was not imported during import torch'
        from rawkv import _opdecl
        missing = [n for n in _opdecl.declared() if not hasattr(torch.ops.rawkv, n)]
        assert not missing, f'not registered: {missing[:3]}...'
        assert type(torch.__spec__) is importlib.machinery.ModuleSpec, type(torch.__spec__)
        assert torch.__spec__._initializing is False
        x = torch.linspace(-500, 500, 64)
        out = torch.empty(64, dtype=torch.uint8)
        torch.ops.rawkv.e4m3_encode(x, out)
        import rawkv
        assert torch.equal(rawkv.fp8.e4m3_encode(x).view(torch.uint8), out)
        print('ok')
    """)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_failing_registration_during_import_torch_is_a_warning():
    """The registration that runs when an `import torch` rawkv was imported
    from has finished: an error of rawkv's is a warning there, never a
    failed torch import."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_MID_IMPORT).replace(
        "import rawkv\n", "import rawkv; rawkv._register_ops = fail\n") + textwrap.dedent("""
        import warnings
        def fail():
            raise RuntimeError('planted')
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            import torch
        assert torch.ones(1).item() == 1.0 and not torch.__spec__._initializing
        assert any('planted' in str(m.message) for m in w), [str(m.message) for m in w]
        print('ok')
    """)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
