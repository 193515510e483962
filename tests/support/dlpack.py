"""DLPack producers that offer what the protocol promises and no more, for
tests of ops given another library's arrays (CuPy, JAX, ...)."""


class Bare:
    """A DLPack producer offering the protocol alone: no .shape, no .dtype."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class NoDtype(Bare):
    """One with a .shape but no .dtype."""

    def __init__(self, a):
        super().__init__(a)
        self.shape = a.shape
