"""Tests of the runtime: compiling, the kernel cache, launching, importing."""
