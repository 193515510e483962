"""`import rawkv` needs only numpy; a GPU op without the GPU stack fails clearly."""
import subprocess
import sys
import textwrap

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
