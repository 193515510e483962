"""On-disk cache of compiled kernel modules.

A cache file holds one module's cubin, the mangled names of its kernels and
the full cache key it was compiled for:

    b"RAWKV-CUBIN-2\\n" | u32 header length | JSON header {key, lowered, arch} | cubin
    | sha256 of all before

The key covers everything that changes the binary: rawkv's version, the
program's name (its path in rawkv/cu: NVRTC's first directory for a quoted
#include), the NVRTC
version and the identity (path, size, mtime) of the NVRTC library (of each
one mapped), the full compile options (architecture, numeric flags, -D constants,
-I include directories), the identity (path, size, mtime) of the CUDA headers
rawkv includes, the name expressions and the text of every file under rawkv/cu
(so editing a shared header invalidates every module that might include it).
A file is used only when its checksum holds and its header names this exact
key and these kernels; anything else is treated as damaged: the module is
recompiled and the new file renamed over it (it is not deleted first: another
process may have just renamed a good one into place).

The cache trusts nothing it did not write. The directory must be a real
directory (not a symbolic link) owned by this user and writable by nobody
else; rawkv creates it, and the parents it has to create, with mode 0700. A
directory that fails the check is not used (a warning names the reason, and
kernels are compiled in memory). Once checked, the directory is held open and
every file is opened relative to that descriptor, so a parent that is or
becomes a symbolic link cannot redirect a read or a write after the check.
Files are opened without following links and without blocking, and only a
regular file owned by this user is read (a FIFO, device, directory or link is
damaged, never waited on). Writes go to a new 0600 temporary file in the same
directory, renamed into place (atomic on POSIX), so a crash or a concurrent
writer never leaves half a file under the final name. Every filesystem step is
guarded: an unusable cache directory only costs a recompile.

A file larger than MAX_FILE_BYTES is damaged without being read (its size
is checked on the open descriptor first), and a header that cannot be parsed
(however deeply nested) is damaged too: the cache never raises. A directory
where the temporary file cannot be created or written (read-only, full)
costs a recompile on every call and one warning per directory and process. Once
per directory and process, temporary files of ours older than STALE_TMP_S
(left by a writer that was killed mid-write) are removed.

The directory is $RAWKV_CACHE_DIR, else $XDG_CACHE_HOME/rawkv (an absolute
path: a relative one is ignored, as the XDG spec says), else ~/.cache/rawkv
(a leading ~ is expanded; where it cannot be, with no $HOME and no password
database entry for this user, the disk cache is not used, with a warning,
rather than a directory named ~ made in the working directory). A relative
RAWKV_CACHE_DIR is resolved against the working directory when rawkv was
imported, once for the process. RAWKV_CACHE_DIR=off, 0, none (any case) or
an empty value disables the disk cache.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import struct
import time
import warnings
from pathlib import Path

from . import _nvrtc

MAGIC = b"RAWKV-CUBIN-2\n"
# No cubin rawkv compiles comes near this (the largest are a few MiB): a
# larger file is damaged, and is not read into memory to find that out.
MAX_FILE_BYTES = 256 << 20
# A temporary file this old (seconds) belongs to a writer that died: a live
# one writes a few MiB and renames it within seconds.
STALE_TMP_S = 3600


# The values of RAWKV_CACHE_DIR that turn the disk cache off (any case,
# spaces around ignored): each is a usual way to say "no cache", none a
# directory anyone means to make in the working directory.
OFF_VALUES = ("off", "0", "none", "")


def _getcwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:         # the working directory was removed
        return None


# The working directory when rawkv was imported: a relative RAWKV_CACHE_DIR
# is resolved against it, once for the process (resolved on every compile, a
# process that changed directory made a cache in each). Where it could not be
# read, the working directory of the first compile that resolves one.
_START_CWD = _getcwd()


def cache_dir() -> Path | None:
    global _START_CWD
    env = os.environ.get("RAWKV_CACHE_DIR")
    if env is not None:
        if env.strip().lower() in OFF_VALUES:
            return None
        path = os.path.expanduser(env)
        # (a ~ left unexpanded stays as it is: _open_dir refuses it by name)
        if not os.path.isabs(path) and not path.startswith("~"):
            if _START_CWD is None:
                _START_CWD = _getcwd()
            if _START_CWD is not None:
                path = os.path.join(_START_CWD, path)
        return Path(path)
    base = os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "")
    if not os.path.isabs(base):         # unset, or relative: invalid (the XDG spec)
        base = os.path.expanduser(os.path.join("~", ".cache"))
    return Path(base) / "rawkv"


def sources_digest() -> str:
    """The hash of every file under rawkv/cu, part of every key: a caller
    keying many entries at once computes it once and passes it in."""
    h = hashlib.sha256()
    for p in sorted(_nvrtc.CU_DIR.iterdir()):
        if p.suffix in (".cu", ".cuh"):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# The CUDA headers rawkv's sources include (through common.cuh).
CUDA_HEADERS = tuple(f"cuda_{t}.{ext}" for t in ("fp8", "bf16", "fp16") for ext in ("h", "hpp"))


def _headers_identity() -> str:
    """Path, size and mtime of each CUDA header in the include directories:
    a different or updated CUDA runtime package gives a different key."""
    parts = []
    for d in _nvrtc.cuda_include_dirs():
        for name in CUDA_HEADERS:
            p = os.path.join(d, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            parts.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def cache_key(filename: str, arch: str, names, extra_options=(), version: str = "",
              sources: str | None = None) -> str:
    """`version`: the package version the runtime passes in (this module
    imports nothing of rawkv beyond NVRTC). `sources`: sources_digest(),
    computed here when not given."""
    h = hashlib.sha256()
    # (the program's name: the directory NVRTC searches first for a quoted
    # #include; keys made before it was a path are never read again)
    parts = [version, repr(_nvrtc.nvrtc_version()), _nvrtc.nvrtc_library(), arch,
             _nvrtc.program_name(filename),
             repr(_nvrtc.compile_options(arch, tuple(extra_options))), _headers_identity(),
             repr(tuple(names)), sources if sources is not None else sources_digest()]
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _encode(result: _nvrtc.CompileResult, key: str) -> bytes:
    header = json.dumps({"key": key, "lowered": result.lowered, "arch": result.arch}).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + result.cubin
    return body + hashlib.sha256(body).digest()


def _decode(blob: bytes, key: str) -> _nvrtc.CompileResult | None:
    """Parse a cache file written for `key`; None if it is damaged in any
    way, or was written for another key (the checksum alone proves nothing:
    anyone can recompute it)."""
    if len(blob) < len(MAGIC) + 4 + 32 or not blob.startswith(MAGIC):
        return None
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        return None
    (hlen,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start:start + hlen])
        if header["key"] != key:
            return None
        lowered = dict(header["lowered"])
    except (ValueError, KeyError, TypeError, RecursionError):
        # RecursionError: a deeply nested header (json recurses per level).
        return None
    return _nvrtc.CompileResult(body[start + hlen:], lowered, "", header.get("arch", ""))


def _file_name(filename: str, arch: str, key: str) -> str:
    return f"{Path(filename).stem}-{arch}-{key[:24]}.cubin.rkv"


def path_for(filename: str, arch: str, key: str) -> Path | None:
    d = cache_dir()
    if d is None:
        return None
    return d / _file_name(filename, arch, key)


# Directories are opened without following a link in the last component; a
# file without following links and without blocking (a FIFO opens at once).
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | _O_CLOEXEC
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | _O_CLOEXEC
# Without these (not POSIX) nothing here can be opened safely: no disk cache.
_SUPPORTED = hasattr(os, "O_NOFOLLOW") and os.open in os.supports_dir_fd


def _make_dirs(d: str) -> None:
    """Create `d` and the missing parents, each with mode 0700 (os.makedirs
    gives the parents the umask's default mode)."""
    missing = []
    p = d
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if not parent or parent == p:
            break
        p = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:      # another process created it first
            pass


def _untrusted(st: os.stat_result) -> str | None:
    """Why a directory's stat makes it unfit to hold the cache, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _open_dir(d: Path) -> int | None:
    """A descriptor of the cache directory, created if missing and checked
    (see the module docstring); None, with a warning naming the reason, when
    it cannot be used."""
    if not _SUPPORTED:
        reason = "cannot be opened safely on this platform (no O_NOFOLLOW / dir_fd)"
    elif d.parts[:1] and d.parts[0].startswith("~"):
        # expanduser leaves ~ as it is without $HOME and a password database
        # entry (a container's arbitrary uid): a relative "~/.cache/rawkv"
        # made a directory named ~ in the working directory.
        reason = ("names a home directory that cannot be found (no $HOME, and no password "
                  "database entry for this user)")
    else:
        try:
            _make_dirs(str(d))
            reason = _untrusted(os.lstat(d))      # names a link as a link
            if reason is None:
                fd = os.open(d, _O_DIR)
                try:
                    # The descriptor is what is used: check it, not the path.
                    reason = _untrusted(os.fstat(fd))
                except OSError:
                    os.close(fd)
                    raise
                if reason is None:
                    return fd
                os.close(fd)
        except OSError as exc:   # missing parent that cannot be created, too long a name...
            reason = f"cannot be created or opened ({exc.strerror or exc})"
    warnings.warn(f"rawkv: kernel cache directory {d} is not used: it {reason}; kernels are "
                  "compiled in memory (set RAWKV_CACHE_DIR to a private directory, or to off)",
                  RuntimeWarning, stacklevel=3)
    return None


def _read(dir_fd: int, name: str) -> bytes | None:
    """The bytes of `name` if it is a regular file of this user; None when
    it does not exist. Anything else there (a link, FIFO, device, directory,
    a file of another user) gives b"", which never decodes: it is damaged."""
    try:
        fd = os.open(name, _O_READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError:      # ELOOP: a symbolic link; or unreadable
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_FILE_BYTES:
            return b""
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_FILE_BYTES:       # it grew after the fstat
                return b""
            chunks.append(chunk)
    except OSError:
        return b""
    finally:
        os.close(fd)


# The temporary files _atomic_write names: .<entry>.<pid>.<16 hex>.tmp
_TMP_NAME = re.compile(r"\..+\.cubin\.rkv\.[0-9]+\.[0-9a-f]{16}\.tmp")
_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)
_SWEPT: set = set()          # directories whose stale temporary files were removed
_WARNED_UNWRITABLE: set = set()


def _sweep_stale_tmp(dir_fd: int, d: Path) -> None:
    """Once per directory and process: remove our temporary files (by name,
    regular files of this user) older than STALE_TMP_S. Never an error."""
    if d in _SWEPT:
        return
    _SWEPT.add(d)
    cutoff = time.time() - STALE_TMP_S
    try:
        with os.scandir(dir_fd) as it:
            entries = [e for e in it if _TMP_NAME.fullmatch(e.name)]
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mtime < cutoff:
                os.unlink(e.name, dir_fd=dir_fd)
    except OSError:
        pass


def _warn_unwritable(d: Path, exc: OSError) -> None:
    """One warning per directory and process: without it a read-only or full
    cache directory recompiles every kernel on every start, silently."""
    if d in _WARNED_UNWRITABLE:
        return
    _WARNED_UNWRITABLE.add(d)
    warnings.warn(f"rawkv: kernel cache directory {d} cannot be written ({exc.strerror or exc}); "
                  "kernels are compiled on every start (make it writable, or set RAWKV_CACHE_DIR "
                  "to a writable private directory, or to off)", RuntimeWarning, stacklevel=4)


def _atomic_write(dir_fd: int, name: str, data: bytes, d: Path) -> bool:
    """Write `name` in the directory `d` (open as dir_fd) through a new 0600
    temporary file and a rename; False (nothing left behind) if any step
    fails, with a warning (once) when the directory takes no new file."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, _O_NEW, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        return True
    except OSError as exc:
        # A read-only or full cache directory (or a directory where the file
        # should be) costs a recompile next time, never a failure now. A full
        # one usually fails the write or the fsync, not the create (an empty
        # file takes no block).
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, _EDQUOT):
            _warn_unwritable(d, exc)
        return False


class CacheDir:
    """The checked cache directory, open for a batch of lookups and stores
    (`with CacheDir() as d`): `fd` its descriptor, None when the disk cache
    is off or unusable (warned once per opening), `path` its path. Lookups
    and stores from several threads may share one."""

    def __init__(self):
        self.path = cache_dir()
        self.fd = _open_dir(self.path) if self.path is not None else None
        if self.fd is not None:
            _sweep_stale_tmp(self.fd, self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _count(stats, what: str) -> None:
    if stats is not None:
        stats[what] = stats.get(what, 0) + 1


class Entry:
    """One module of the cache: a .cu file compiled for `arch` with the
    kernels `names` and the file's extra options; `key` hashes all of it
    (cache_key), `name` is its file's name."""
    __slots__ = ("filename", "arch", "names", "options", "key", "name")

    def __init__(self, filename: str, arch: str, names, extra_options=(), version: str = "",
                 sources: str | None = None):
        self.filename, self.arch = filename, arch
        self.names, self.options = tuple(names), tuple(extra_options)
        self.key = cache_key(filename, arch, self.names, self.options, version, sources)
        self.name = _file_name(filename, arch, self.key)

    def __repr__(self):
        return f"<cache entry {self.filename} {self.arch} {', '.join(self.names)}>"


def lookup(entry: Entry, d: CacheDir, stats=None) -> tuple[_nvrtc.CompileResult | None, Path | None]:
    """The cached module of `entry` and its path, or (None, None) when the
    directory holds no valid file for its key. `stats` counts a valid file
    as 'disk_hits', any other file there as 'damaged'."""
    if d.fd is None:
        return None, None
    blob = _read(d.fd, entry.name)
    if blob is None:
        return None, None
    cached = _decode(blob, entry.key)
    if cached is not None and set(cached.lowered) == set(entry.names):
        _count(stats, "disk_hits")
        return cached, d.path / entry.name
    # Not deleted: store() replaces it atomically, and an unlink here could
    # remove a good file another process has just renamed into place.
    _count(stats, "damaged")
    return None, None


def compile_entry(entry: Entry) -> _nvrtc.CompileResult:
    """NVRTC on the entry's source (raises CompileError with the log)."""
    source = (_nvrtc.CU_DIR / entry.filename).read_text()
    return _nvrtc.compile_cu(source, entry.filename, entry.arch, entry.names, entry.options)


def store(entry: Entry, result: _nvrtc.CompileResult, d: CacheDir) -> Path | None:
    """Write the entry's file (atomically); its path, or None when the disk
    cache is off or the write failed."""
    if d.fd is not None and _atomic_write(d.fd, entry.name, _encode(result, entry.key), d.path):
        return d.path / entry.name
    return None


def load_or_compile(filename: str, arch: str, names, extra_options=(), stats=None,
                    version: str = "") -> tuple[_nvrtc.CompileResult, Path | None]:
    """Return the compiled module (from disk when a valid entry exists) and
    the path of its cache file (None when the disk cache is off or failed).
    `stats`, if given, counts 'disk_hits', 'compiles' and 'damaged'."""
    entry = Entry(filename, arch, names, extra_options, version)
    with CacheDir() as d:
        cached, path = lookup(entry, d, stats)
        if cached is not None:
            return cached, path
        result = compile_entry(entry)
        _count(stats, "compiles")
        return result, store(entry, result, d)
