"""On-disk cache of compiled kernel modules.

A cache file holds one module's cubin and the mangled names of its kernels:

    b"RAWKV-CUBIN-1\\n" | u32 header length | JSON header | cubin | sha256 of all before

The key covers everything that changes the binary: rawkv's version, the NVRTC
version, the full compile options (architecture, numeric flags, -I include
directories), the identity (path, size, mtime) of the CUDA headers rawkv
includes, the name expressions and the text of every file under rawkv/cu (so
editing a shared header invalidates every module that might include it).
Files are written to a temporary name and renamed into place (atomic on
POSIX), so a crash or a concurrent writer never leaves half a file under the
final name. A file that fails its checksum is never trusted: the module is
recompiled and the rename replaces the file (it is not deleted first: another
process may have just renamed a good one into place). Every filesystem step
is guarded: a bad or unwritable cache directory only costs a recompile.

The directory is $RAWKV_CACHE_DIR, else $XDG_CACHE_HOME/rawkv, else
~/.cache/rawkv. RAWKV_CACHE_DIR=off disables the disk cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

from . import _nvrtc

MAGIC = b"RAWKV-CUBIN-1\n"


def cache_dir() -> Path | None:
    env = os.environ.get("RAWKV_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rawkv"


def _sources_digest() -> str:
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


def cache_key(filename: str, arch: str, names, extra_options=(), version: str = "") -> str:
    """`version`: the package version the runtime passes in (this module
    imports nothing of rawkv beyond NVRTC)."""
    h = hashlib.sha256()
    parts = [version, repr(_nvrtc.nvrtc_version()), arch, filename,
             repr(_nvrtc.compile_options(arch, tuple(extra_options))), _headers_identity(),
             repr(tuple(names)), _sources_digest()]
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _encode(result: _nvrtc.CompileResult) -> bytes:
    header = json.dumps({"lowered": result.lowered, "arch": result.arch}).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + result.cubin
    return body + hashlib.sha256(body).digest()


def _decode(blob: bytes) -> _nvrtc.CompileResult | None:
    """Parse a cache file; None if it is damaged in any way."""
    if len(blob) < len(MAGIC) + 4 + 32 or not blob.startswith(MAGIC):
        return None
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        return None
    (hlen,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start:start + hlen])
        lowered = dict(header["lowered"])
    except (ValueError, KeyError, TypeError):
        return None
    return _nvrtc.CompileResult(body[start + hlen:], lowered, "", header.get("arch", ""))


def path_for(filename: str, arch: str, key: str) -> Path | None:
    d = cache_dir()
    if d is None:
        return None
    return d / f"{Path(filename).stem}-{arch}-{key[:24]}.cubin.rkv"


def load_or_compile(filename: str, arch: str, names, extra_options=(), stats=None,
                    version: str = "") -> tuple[_nvrtc.CompileResult, Path | None]:
    """Return the compiled module (from disk when a valid entry exists) and
    the path of its cache file (None when the disk cache is off or failed).
    `stats`, if given, counts 'disk_hits', 'compiles' and 'damaged'."""
    stats = stats if stats is not None else {}
    names = tuple(names)
    key = cache_key(filename, arch, names, extra_options, version)
    path = path_for(filename, arch, key)
    blob = None
    if path is not None:
        try:
            blob = path.read_bytes()
        except OSError:   # missing, or a bad directory (too long a name, not a directory...)
            pass
    if blob is not None:
        cached = _decode(blob)
        if cached is not None and set(cached.lowered) == set(names):
            stats["disk_hits"] = stats.get("disk_hits", 0) + 1
            return cached, path
        # Not deleted: the atomic write below replaces it, and an unlink here
        # could remove a good file another process has just renamed into place.
        stats["damaged"] = stats.get("damaged", 0) + 1
    source = (_nvrtc.CU_DIR / filename).read_text()
    result = _nvrtc.compile_cu(source, filename, arch, names, extra_options)
    stats["compiles"] = stats.get("compiles", 0) + 1
    if path is not None and _atomic_write(path, _encode(result)):
        return result, path
    return result, None


def _atomic_write(path: Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return True
    except OSError:
        # A read-only or full cache directory costs a recompile next time,
        # never a failure now.
        return False
