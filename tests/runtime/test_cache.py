"""The on-disk kernel cache: hits, damaged files, atomic writes, opt-out,
and what it refuses to trust (planted files, links, FIFOs, directories of
others or writable by others).

These compile with NVRTC (cuda-python) and need no GPU. The tests run as
root here, which bypasses permission checks: they check what the cache
checks (owner, mode, file type), not what the OS would enforce."""
import ast
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
import warnings

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


def test_created_directories_and_files_are_private(tmp_path, monkeypatch):
    """The directory and each parent rawkv creates are 0700 whatever the
    umask allows; a parent that already exists keeps its mode; files 0600."""
    d = tmp_path / "a" / "b" / "kc"
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(d))
    os.chmod(tmp_path, 0o755)
    old = os.umask(0o022)            # would give 0755 directories and 0644 files
    try:
        _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    finally:
        os.umask(old)
    for p in (d, d.parent, d.parent.parent):
        assert stat.S_IMODE(p.lstat().st_mode) == 0o700, p
    assert stat.S_IMODE(tmp_path.lstat().st_mode) == 0o755
    assert stat.S_IMODE(path.lstat().st_mode) == 0o600


def test_key_depends_on_arch_names_options_and_version(cache_dir):
    k = _cache.cache_key(FILE, "sm_90", _names())
    assert k != _cache.cache_key(FILE, "sm_80", _names())
    assert k != _cache.cache_key(FILE, "sm_90", _names()[:-1])
    assert k != _cache.cache_key(FILE, "sm_90", _names(), ("-DX=1",))
    assert k != _cache.cache_key(FILE, "sm_90", _names(), version="9.9")
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
    key = _cache.cache_key(FILE, "sm_90", _names())
    assert _cache._decode(path2.read_bytes(), key) is not None and res.cubin[:4] == b"\x7fELF"


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
        with pytest.warns(RuntimeWarning, match="cannot be created or opened"):
            res, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
        assert path is None and res.cubin[:4] == b"\x7fELF" and stats == {"compiles": 1}


# ---- what the cache refuses to trust -------------------------------------------------
def _refused(d, match):
    """Compile with the cache at `d`, expecting the directory to be refused
    with a warning matching `match`: a recompile, and nothing written."""
    before = sorted(os.listdir(d)) if d.is_dir() and not d.is_symlink() else None
    for _ in range(2):
        stats = {}
        with pytest.warns(RuntimeWarning, match=match):
            res, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
        assert path is None and stats == {"compiles": 1} and res.cubin[:4] == b"\x7fELF"
    if before is not None:
        assert sorted(os.listdir(d)) == before


@pytest.mark.parametrize("mode", [0o770, 0o730, 0o707, 0o702, 0o1777])
def test_directory_writable_by_others_is_refused(cache_dir, mode):
    cache_dir.mkdir()
    _cache.load_or_compile(FILE, "sm_90", _names())           # a good entry while it was private
    os.chmod(cache_dir, mode)
    _refused(cache_dir, f"writable by group or others \\(mode {mode:04o}\\)")


def test_directory_of_another_user_is_refused(cache_dir, monkeypatch):
    cache_dir.mkdir(mode=0o700)
    _cache.load_or_compile(FILE, "sm_90", _names())           # a good entry: still not used
    owner = cache_dir.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)     # this process is someone else
    _refused(cache_dir, f"owned by uid {owner}, not by this user \\(uid {owner + 1}\\)")


def test_directory_that_is_a_link_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "kc"
    link.symlink_to(real)
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(link))
    _refused(link, "is a symbolic link")
    assert os.listdir(real) == []


def test_directory_that_is_a_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "kc").write_text("")
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(tmp_path / "kc"))
    _refused(tmp_path / "kc", "is not a directory")


def test_a_parent_link_is_followed_but_the_checked_directory_is_used(tmp_path, monkeypatch):
    """A link among the parents is resolved once: the directory found there
    is checked and then used through its descriptor."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "parent").symlink_to(real)
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(tmp_path / "parent" / "kc"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    assert path is not None and (real / "kc" / path.name).is_file()
    assert stat.S_IMODE((real / "kc").stat().st_mode) == 0o700


def _encode_for(key, cubin=b"\x7fELF planted"):
    lowered = {n: f"_Z{i}planted" for i, n in enumerate(_names())}
    return _cache._encode(_nvrtc.CompileResult(cubin, lowered, "", "sm_90"), key)


def test_planted_file_with_a_valid_checksum_for_another_key_is_damaged(cache_dir):
    key = _cache.cache_key(FILE, "sm_90", _names())
    path = _cache.path_for(FILE, "sm_90", key)
    cache_dir.mkdir(mode=0o700)
    path.write_bytes(_encode_for("0" * 64))     # well formed, checksum recomputed, other key
    stats = {}
    res, _ = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"damaged": 1, "compiles": 1} and b"planted" not in res.cubin
    assert _cache._decode(path.read_bytes(), key).cubin == res.cubin       # replaced
    # The key in the header is what refused it: the same file for this key loads.
    path.write_bytes(_encode_for(key))
    stats = {}
    res, _ = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"disk_hits": 1} and res.cubin == b"\x7fELF planted"


def test_file_from_another_version_is_damaged(cache_dir):
    _, path_a = _cache.load_or_compile(FILE, "sm_90", _names(), version="1.0")
    key_b = _cache.cache_key(FILE, "sm_90", _names(), version="2.0")
    path_b = _cache.path_for(FILE, "sm_90", key_b)
    path_b.write_bytes(path_a.read_bytes())     # a genuine file, under another key's name
    stats = {}
    _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats, version="2.0")
    assert stats == {"damaged": 1, "compiles": 1}


def _entry(cache_dir):
    cache_dir.mkdir(mode=0o700, exist_ok=True)
    return _cache.path_for(FILE, "sm_90", _cache.cache_key(FILE, "sm_90", _names()))


def _load_in_thread(**kw):
    """load_or_compile in a thread: a FIFO must not block it."""
    done = {}
    t = threading.Thread(target=lambda: done.update(
        r=_cache.load_or_compile(FILE, "sm_90", _names(), **kw)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "load_or_compile blocked"
    return done["r"]


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_link_or_fifo_at_the_entry_is_damaged_and_replaced(cache_dir, tmp_path, kind):
    path = _entry(cache_dir)
    if kind == "symlink":          # to a genuine, valid entry: still not followed
        good = tmp_path / "good.rkv"
        stats = {}
        _, p = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
        os.replace(p, good)
        path.symlink_to(good)
    else:
        os.mkfifo(path)
    stats = {}
    res, path2 = _load_in_thread(stats=stats)
    assert stats == {"damaged": 1, "compiles": 1} and path2 == path
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600   # the rename replaced it
    if kind == "symlink":
        assert good.is_file() and not good.is_symlink()
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]


def test_directory_at_the_entry_is_damaged_and_left(cache_dir):
    path = _entry(cache_dir)
    path.mkdir()
    stats = {}
    res, path2 = _load_in_thread(stats=stats)
    assert stats == {"damaged": 1, "compiles": 1} and path2 is None and res.cubin[:4] == b"\x7fELF"
    assert path.is_dir() and not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]


def test_file_of_another_user_is_damaged(cache_dir, monkeypatch):
    """A regular file this user did not write (owner checked on the open
    descriptor) is not trusted, even with the right key and checksum."""
    _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    real_fstat = os.fstat

    def fstat(fd):
        st = real_fstat(fd)
        if stat.S_ISREG(st.st_mode):       # as if chowned to another uid
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1,
                                   st.st_gid, st.st_size, st.st_atime, st.st_mtime, st.st_ctime))
        return st
    monkeypatch.setattr(os, "fstat", fstat)
    stats = {}
    _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"damaged": 1, "compiles": 1}
    monkeypatch.setattr(os, "fstat", real_fstat)
    stats = {}
    _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"disk_hits": 1}



# ---- what an attacker or a crash can leave behind (issue 21, item 9) -------------------
def _hostile(cache_dir, body: bytes):
    """A file at this key's entry: `body` in the cache format, its checksum
    valid, so only the parsing can refuse it."""
    path = _entry(cache_dir)
    blob = _cache.MAGIC + len(body).to_bytes(4, "little") + body + b"\x7fELF"
    path.write_bytes(blob + hashlib.sha256(blob).digest())
    return path


def test_deeply_nested_header_is_damaged_not_an_error(cache_dir):
    """json recurses once per nesting level: 100,000 levels raised
    RecursionError out of load_or_compile."""
    _hostile(cache_dir, b"[" * 100_000 + b"]" * 100_000)
    stats = {}
    res, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"damaged": 1, "compiles": 1} and res.cubin[:4] == b"\x7fELF"
    assert _cache._decode(path.read_bytes(), _cache.cache_key(FILE, "sm_90", _names())) is not None


def test_huge_file_is_damaged_without_being_read(cache_dir, monkeypatch):
    """A sparse file beyond MAX_FILE_BYTES is refused from its size: not one
    read of it (a 3 GiB one took 6.4 GB and 9.5 s)."""
    path = _entry(cache_dir)
    with open(path, "wb") as f:
        f.truncate(_cache.MAX_FILE_BYTES + 1)          # sparse: no disk space used
    real_read = os.read
    read_fds = []

    def read(fd, n):
        if stat.S_ISREG(os.fstat(fd).st_mode) and os.fstat(fd).st_size > _cache.MAX_FILE_BYTES:
            read_fds.append(fd)
        return real_read(fd, n)
    monkeypatch.setattr(os, "read", read)
    stats = {}
    _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert stats == {"damaged": 1, "compiles": 1} and read_fds == []
    assert path.stat().st_size < _cache.MAX_FILE_BYTES                 # replaced


def test_read_only_directory_warns_once(cache_dir, monkeypatch):
    """A directory that takes no new file (EROFS here: the tests run as root,
    which bypasses a 0500 mode) recompiles each time, with one warning."""
    cache_dir.mkdir(mode=0o700)
    real_open = os.open

    def read_only_open(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise OSError(__import__("errno").EROFS, "Read-only file system", path)
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", read_only_open)
    monkeypatch.setattr(_cache, "_WARNED_UNWRITABLE", set())
    with pytest.warns(RuntimeWarning, match="cannot be written .Read-only file system"):
        _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    assert path is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = {}
        _, path = _cache.load_or_compile(FILE, "sm_90", _names(), stats=stats)
    assert path is None and stats == {"compiles": 1} and os.listdir(cache_dir) == []


@pytest.mark.parametrize("step", ["write", "fsync"])
def test_full_directory_warns_once(cache_dir, monkeypatch, step):
    """A full disk or quota: creating the empty temporary file succeeds (it
    needs an inode, not a block), its write or fsync fails with ENOSPC /
    EDQUOT. That costs a recompile on every start like a read-only
    directory, and warns the same way, once; it was silent (only a failed
    create warned)."""
    import errno
    cache_dir.mkdir(mode=0o700)
    full = OSError(errno.ENOSPC, "No space left on device")
    if step == "write":
        real_fdopen = os.fdopen

        class _Full:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                raise full

        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _Full(real_fdopen(fd, *a, **k)))
    else:
        def fsync(fd):
            raise full
        monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(_cache, "_WARNED_UNWRITABLE", set())
    with pytest.warns(RuntimeWarning, match="cannot be written .No space left on device"):
        _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    assert path is None and os.listdir(cache_dir) == []            # the temporary file is gone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    assert path is None


def test_stale_temporary_files_are_removed(cache_dir, monkeypatch):
    """A writer killed between its write and its rename leaves a .tmp file:
    ours and over an hour old, it goes; a fresh one (a live writer), a file
    of another name or a directory stays."""
    cache_dir.mkdir(mode=0o700)
    name = _entry(cache_dir).name
    stale = cache_dir / f".{name}.123.{'ab' * 8}.tmp"
    fresh = cache_dir / f".{name}.124.{'cd' * 8}.tmp"
    other = cache_dir / "notes.tmp"
    folder = cache_dir / f".{name}.125.{'ef' * 8}.tmp"
    for p in (stale, fresh, other):
        p.write_bytes(b"half a file")
    folder.mkdir()
    old = time.time() - _cache.STALE_TMP_S - 60
    for p in (stale, other, folder):
        os.utime(p, (old, old))
    monkeypatch.setattr(_cache, "_SWEPT", set())
    _cache.load_or_compile(FILE, "sm_90", _names())
    assert not stale.exists() and fresh.exists() and other.exists() and folder.is_dir()


def test_tilde_in_cache_dir_is_expanded(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAWKV_CACHE_DIR", "~/kc")
    assert _cache.cache_dir() == home / "kc"
    _, path = _cache.load_or_compile(FILE, "sm_90", _names())
    assert path.parent == home / "kc" and not (tmp_path / "~").exists()
    monkeypatch.delenv("RAWKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert _cache.cache_dir() == home / "xdg" / "rawkv"


@pytest.mark.parametrize("env", [None, "~/kc"])
def test_a_home_that_cannot_be_found_is_not_a_directory_named_tilde(tmp_path, monkeypatch, env):
    """Without $HOME and a password database entry (a container's arbitrary
    uid) expanduser leaves ~ as it is: the default ~/.cache/rawkv (or a
    RAWKV_CACHE_DIR of ~/kc) was a relative path, and a directory named ~
    was made in the working directory. Now the disk cache is not used, with
    the warning of an unusable directory, and the module is compiled."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    if env is None:
        monkeypatch.delenv("RAWKV_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("RAWKV_CACHE_DIR", env)
    monkeypatch.chdir(tmp_path)
    with pytest.warns(RuntimeWarning, match="home directory that cannot be found"):
        res, path = _cache.load_or_compile(FILE, "sm_90", _names())
    assert path is None and set(res.lowered) == set(_names())
    assert list(tmp_path.iterdir()) == []

def test_cache_module_imports_nothing_of_rawkv_but_nvrtc():
    tree = ast.parse(open(_cache.__file__).read())
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("rawkv")):
            ours |= {f"{node.module or ''}.{a.name}".strip(".") for a in node.names}
        elif isinstance(node, ast.Import):
            ours |= {a.name for a in node.names if a.name.split(".")[0] == "rawkv"}
    assert ours == {"_nvrtc"}


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


def test_processes_compiling_the_same_key_at_once(cache_dir, tmp_path):
    """N processes all miss, compile, and write the same entry at the same
    moment (each waits before its write until all have compiled): every one
    succeeds, one valid file remains, no temporary file, and the next
    processes, reading at once, all hit."""
    n = 4
    gate = tmp_path / "gate"
    gate.mkdir()
    code = f"""
import json, os, sys, time
from rawkv import _cache, runtime
gate, n = {str(gate)!r}, {n}
real_write = _cache._atomic_write
def write(*a):
    open(os.path.join(gate, str(os.getpid())), "w").close()
    t0 = time.time()
    while len(os.listdir(gate)) < n and time.time() - t0 < 240:
        time.sleep(0.01)
    return real_write(*a)
_cache._atomic_write = write
s = {{}}
res, path = _cache.load_or_compile({FILE!r}, "sm_90", runtime.registered_kernels()[{FILE!r}], stats=s)
print(json.dumps([s, str(path), res.cubin.hex()]))
"""
    env = dict(os.environ, RAWKV_CACHE_DIR=str(cache_dir))

    def run_all():
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(n)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err
        return [json.loads(o) for o, _ in outs]

    first = run_all()
    assert len(os.listdir(gate)) == n                          # all of them wrote
    assert [s for s, _, _ in first] == [{"compiles": 1}] * n
    entries = os.listdir(cache_dir)
    assert len(entries) == 1 and {p for _, p, _ in first} == {str(cache_dir / entries[0])}
    key = _cache.cache_key(FILE, "sm_90", _names())
    on_disk = _cache._decode((cache_dir / entries[0]).read_bytes(), key)
    assert on_disk is not None and on_disk.cubin.hex() in {c for _, _, c in first}
    for f in os.listdir(gate):
        os.unlink(gate / f)
    second = run_all()
    assert [s for s, _, _ in second] == [{"disk_hits": 1}] * n


def test_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """The XDG base directory spec: a relative XDG_CACHE_HOME is invalid and
    ignored. It was taken relative to the working directory, so each
    directory a program started in got a cache of its own (a project's
    checkout one too)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAWKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert _cache.cache_dir() == home / ".cache" / "rawkv"


def test_a_relative_cache_dir_is_resolved_once_against_the_start_directory(tmp_path):
    """A relative RAWKV_CACHE_DIR was resolved against the working directory
    of every compile, so a process that changed directory made (and filled) a
    cache in each one. It is resolved against the working directory when
    rawkv was imported, for the life of the process."""
    for d in ("start", "a", "b"):
        (tmp_path / d).mkdir()
    env = dict(os.environ, RAWKV_CACHE_DIR="rel/kc")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_nvrtc.CU_DIR.parent.parent), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", (
        "import os\n"
        "from rawkv import _cache\n"
        "for d in ('../a', '../b'):\n"
        "    os.chdir(d)\n"
        "    with _cache.CacheDir() as c:\n"
        "        print(c.path, c.fd is not None)\n")],
        cwd=tmp_path / "start", env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    want = f"{tmp_path / 'start' / 'rel' / 'kc'} True"
    assert r.stdout.split("\n")[:2] == [want, want], r.stdout
    assert (tmp_path / "start" / "rel" / "kc").is_dir()
    assert not (tmp_path / "a" / "rel").exists() and not (tmp_path / "b" / "rel").exists()


@pytest.mark.parametrize("value", ["off", "OFF", " off ", "", "  ", "0", "none", "None"])
def test_the_values_that_turn_the_disk_cache_off(monkeypatch, value):
    """off, 0, none (any case, spaces around ignored) and an empty value turn
    the disk cache off; docs/runtime.md names each (it named only off)."""
    monkeypatch.setenv("RAWKV_CACHE_DIR", value)
    assert _cache.cache_dir() is None
    with _cache.CacheDir() as d:
        assert d.fd is None and d.path is None


def test_the_docs_name_every_value_that_turns_the_disk_cache_off():
    text = (_nvrtc.CU_DIR.parents[2] / "docs" / "runtime.md").read_text()
    section = text[text.index("## The disk cache"):text.index("## Streams and launches")]
    for value in _cache.OFF_VALUES:
        assert f"`{value}`" in section or (value == "" and "an empty value" in section), value
