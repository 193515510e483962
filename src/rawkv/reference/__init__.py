"""numpy reference implementations: they *define* every rawkv operation.

Every function here works on plain numpy arrays, needs no GPU and follows
docs/format.md step by step in float32 IEEE arithmetic, in the order the spec
gives, so that CUDA kernels can be compared with them bit for bit.
"""
from .formats import (  # noqa: F401
    E2M1_VALUES, E4M3_MAX, bf16_round, bf16_bits, e2m1_decode, e2m1_encode,
    e4m3_decode, e4m3_encode, round_to_dtype,
)
