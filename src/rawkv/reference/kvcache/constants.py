"""Model constants of the DeepSeek-V4 compressed layers (config.json /
inference/model.py; docs/kvcache.md, section 1)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEAD_DIM = 512            # attention cache entry width
ROPE_DIM = 64             # last 64 dims carry RoPE (qk_rope_head_dim)
NOPE_DIM = HEAD_DIM - ROPE_DIM
INDEX_HEAD_DIM = 128      # CSA indexer key width
CSA_RATIO = 4             # m for CSA (overlapping windows, coff = 2)
HCA_RATIO = 128           # m for HCA (one stream, coff = 1)
RMS_EPS = 1e-6
COMPRESS_ROPE_THETA = 160000.0
FP8_MAX = 448.0
NVFP4_BLOCK = 16
#: z of a score row that holds no token (b-stream before the first window,
#: cleared a-stream rows): exp(-inf - max) = 0 exactly, so it never counts.
Z_EMPTY = np.float32(-np.inf)


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation (no magnitude scaling: the reference
    builds cos/sin with unit modulus)."""
    factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float


#: rope_scaling of DeepSeek-V4-Flash/Pro config.json; the compressed (CSA/HCA)
#: layers use it together with compress_rope_theta.
DSV4_YARN = YarnConfig(factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)
