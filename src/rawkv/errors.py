"""Exceptions rawkv raises on purpose."""


class RawkvError(RuntimeError):
    """Base class for rawkv's runtime errors (argument errors are plain
    ValueError / TypeError naming the argument)."""


class GpuUnavailableError(RawkvError):
    """A GPU op was called but CuPy, cuda-python, torch, a CUDA build of torch
    or a CUDA device is missing; the message lists what."""


class CompileError(RawkvError):
    """NVRTC rejected a kernel source; the message holds the compiler log."""


class CaptureError(RawkvError):
    """The op would compile a kernel or allocate memory while the stream is
    being captured into a CUDA graph. Call rawkv.warmup() and pass out=."""
