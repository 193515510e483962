"""rawkv/cu/gemm_fp4.cu: the grouped FP4-weight GEMM (docs/gemm.md).

One kernel, instantiated per activation kind, weight format and tile
configuration: ACT 0 BF16, 1 FP16, 2 NVFP4 (codes + E4M3 scales); MX the
weight's block scales (false E4M3 per 16, true UE8M0 per 32); MT m-tiles (16 output
features each) and NT n-tiles (8 tokens each) per warp; KS warps splitting K
inside a block; RW warps along the rows; per warp a ring of S stages of U
chunks of 64 columns.
"""
from ._decl import KernelFile, TParam

# Columns per chunk of the packed weight layout (docs/gemm.md).
CHUNK = 64
# Largest experts + 1 a ragged launch takes (the block stages the offsets in
# shared memory to find its segment).
MAX_SEGMENTS = 1024

FILE = KernelFile("gemm_fp4.cu", constants={"RKV_GEMM_CHUNK": CHUNK,
                                            "RKV_GEMM_MAX_SEGMENTS": MAX_SEGMENTS})

ACT_CODES = {"bfloat16": 0, "float16": 1, "nvfp4": 2}

# Tile configurations, (MT, NT, KS, RW, U, S), by the most tokens (per group or
# expert) each serves: a block covers 8 * NT tokens and 16 * MT * RW output
# features. Chosen by a sweep on an H100 (docs/gemm.md, "Tuning"): small
# token counts split K across warps so that every SM has weight bytes in
# flight at M = 1; larger ones give each warp more m-tiles so that every
# activation fragment feeds several MMAs.
CONFIGS = {
    8: (1, 1, 4, 2, 2, 3),
    16: (2, 2, 4, 1, 2, 3),
    32: (2, 4, 4, 1, 1, 3),
    64: (2, 4, 2, 2, 1, 3),
    "large": (2, 4, 2, 2, 1, 3),
}

# Tile configurations of ragged (MoE) calls, by the most tokens per expert on
# average each serves, where the grid has enough blocks (rawkv.gemm.plans):
# one warp per m-tile row streams all of K (KS = 1: no partial sums through
# shared memory, more blocks instead), four warps per block. From sweeps on
# an H200 (docs/gemm.md, "Tuning"): at 64 tokens over 256 experts the
# gate_up and down GEMMs take 22% and 37% less time than with CONFIGS[8].
# The 8-token tile's ring is 2 stages of 4 chunks (was 4 of 2: the same
# bytes, fewer waits; on an H100, 2026-11-26: 2-5% less time on Flash
# gate_up / down at 16 and 64 tokens and Pro down at 16, the same bits).
RAGGED_CONFIGS = {
    8: (2, 1, 1, 4, 4, 2),
    16: (2, 2, 1, 4, 1, 4),
    32: (2, 4, 1, 4, 1, 4),
}
# Ragged calls whose grid is too small for RAGGED_CONFIGS (a token or two per
# expert, a few experts: rawkv.gemm.plans): two warps split K, four along the
# rows. On an H100 at 1 token against CONFIGS[8]: Flash gate_up 27.2 / 30.1
# us, down 16.3 / 21.7, Pro down 45.4 / 56.5, Pro gate_up 85.6 / 82.2. Its
# ring is 2 stages of 4 chunks (was 3 of 2; H100, 2026-11-26, 1 token: Pro
# gate_up 76.1 against 85.4 us, Flash gate_up and Pro down 3% less, Flash
# down the same; the same bits).
RAGGED_SMALL_CONFIG = (1, 1, 2, 4, 4, 2)
# The tile of 9-16 tokens per group, 16-bit activations, where CONFIGS[16]'s
# grid is too large for its PF instance (rawkv.gemm.plans: DeepSeek-V4-Pro's
# wo_a, 512 blocks): eight warps over 64 features, so each block's activation
# loads feed twice the weights, and with half the blocks its own PF instance
# fits. The same KS, so the same bits. H100 (2026-11-27, .probe sweep, two
# runs): Pro M = 16 18.73-18.97 us against CONFIGS[16]'s 19.55-19.62; 64-feature
# tiles of four warps (MT = 4) 20.1-20.6. Where CONFIGS[16] prefetches it
# loses (Flash 12.4-12.6 against 11.5-11.6, seed 004 29.9 against 25.8).
CONFIG_16_LARGE_GRID = (2, 2, 4, 2, 1, 2)
# The tiles of up to 8 and 9-16 tokens per group, 16-bit activations, on
# sm_90, for grids that CONFIGS[8] / CONFIGS[16] would leave below two
# blocks per SM, K from 2,048 (rawkv.gemm.plans, Tuning.MMA_SMALL_GRID_*:
# DeepSeek-V4-Flash's wo_a, 256 blocks on 132 SMs): eight warps split K
# instead of four, so twice the warps stream half as much each and hide each
# other's latency. Both split K in eight (the same bits as each other, not
# CONFIGS[8]'s). The 9-16-token tile keeps CONFIGS[16]'s 32 features and grid;
# the 1-8-token one has 16 features a block (one warp along the rows, twice
# the grid: since session 51; until then two, 32 features). H100 (2026-11-27,
# .probe sweep under the programmatic dependent launch, two runs, us): Flash
# wo_a M = 1 / 8 / 16 7.83-7.89 / 8.40-8.43 / 9.58-9.60 against CONFIGS'
# 8.69-9.89 / 9.48-9.52 / 11.43-11.47. (2026-11-28, .probe/tdec.py, three
# rounds, us, 32 against 16 features a block, the same bits: Flash M = 1 / 2 /
# 4 / 8 7.86-7.91 / 8.09-8.12 / 8.18-8.27 / 8.27-8.33 against 7.57-7.68 /
# 7.77-7.82 / 7.98-7.99 / 8.19-8.23; one group of K 7,168, N 2,048 at 1 / 8
# 5.54-5.95 / 5.96-6.00 against 4.52-4.55 / 4.95-5.11; K 2,048, N 1,024
# 2.58-2.62 / 2.81-2.84 against 2.19-2.21 / 2.38-2.43; K 4,096, N 4,096 the
# same, 4.16-4.57 either way.)
# The 16-token one's ring is 2 stages of 2 chunks (3 of 1 until session 46,
# when its split-K sums could take the rings' bytes: gemm_fp4.cu; the same
# bits; H100, us: Flash M = 12 / 16 8.96-9.12 / 9.05 against 9.33-9.46 /
# 9.35-9.38, 4 stages of 1 9.87-9.93 / 9.90-9.91).
SMALL_GRID_CONFIGS = {8: (1, 1, 8, 1, 2, 2), 16: (2, 2, 8, 1, 2, 2)}
# The tiles of up to 8 and 9-16 tokens per group, 16-bit activations, on
# sm_90, for grids that CONFIGS[8] / CONFIGS[16] would give past three and up
# to four blocks per SM, K from 2,048 (rawkv.gemm.plans, Tuning.MMA_WIDE_*:
# DeepSeek-V4-Pro's wo_a, 512 blocks on 132 SMs): 64 features a block, four
# m-tiles a warp, eight warps split K, so half the grid streams in one wave at
# two blocks per SM and each activation load feeds twice the weights. Both
# split K in eight (the same bits as each other and as SMALL_GRID_CONFIGS';
# the split partial sums take the rings' bytes: gemm_fp4.cu). H100
# (2026-11-27, .probe sweep, the plan's tiles against them, two runs, us):
# Pro wo_a M = 1 / 8 / 12 / 16 15.06-15.18 / 15.89 / 16.88-17.01 / 17.16
# against 14.42-14.48 / 15.46-15.47 / 15.97-16.00 / 16.20-16.22. On seed 004
# (384 blocks, 2.9 per SM) 64-feature tiles were slower at 8 and 16 tokens
# (23.3 / 26.4-26.7 against 22.8 / 24.6) and on Flash at every count.
WIDE_GRID_CONFIGS = {8: (4, 1, 8, 1, 1, 2), 16: (4, 2, 8, 1, 1, 2)}


# Tiles with an instance that loads the activations one step ahead (PF,
# for 16-bit activations; rawkv.gemm.plans takes it for grids of at most 3
# blocks per SM): the tiles of two or more n-tiles, whose PF instances still
# fit 3 blocks per SM. Not the one-n-tile tiles: the one-token MoE tile's
# PF instance fits 2 blocks (H100: 21% slower at one token), the 8-token
# ragged tile's grids are never that small, and CONFIGS[8]'s (Flash and
# seed 004 at M = 1 6-7% faster on the H100) spills 32 bytes on sm_100.
# NVFP4 activations, converted at each load, were not measured.
PREFETCH_TILES = frozenset((CONFIGS[16], CONFIGS[32], CONFIGS["large"], RAGGED_CONFIGS[16], RAGGED_CONFIGS[32],
                            CONFIG_16_LARGE_GRID, SMALL_GRID_CONFIGS[16], WIDE_GRID_CONFIGS[16]))
# Tiles only the 16-bit activations' calls take (no NVFP4 instances).
SIXTEEN_BIT_TILES = frozenset((CONFIG_16_LARGE_GRID, *SMALL_GRID_CONFIGS.values(), *WIDE_GRID_CONFIGS.values()))
# The 16-token tiles taken only with PF (rawkv.gemm.plans: grids this small prefetch).
PREFETCH_ONLY_TILES = frozenset((SMALL_GRID_CONFIGS[16], WIDE_GRID_CONFIGS[16]))


def prefetches(act: int, cfg: tuple) -> bool:
    """Whether tile `cfg` has a PF instance for activation kind `act`."""
    return cfg in PREFETCH_TILES and act != ACT_CODES["nvfp4"]


GEMM = FILE.kernel(
    "rkv_gemm_fp4",
    (TParam("int", "ACT", (0, 1, 2)), TParam("bool", "MX", (False, True)), TParam("int", "MT", (1, 2, 4)), TParam("int", "NT", (1, 2, 4, 8)),
     TParam("int", "KS", (1, 2, 4, 8)), TParam("int", "RW", (1, 2, 4)), TParam("int", "U", (1, 2, 4)),
     TParam("int", "S", (2, 3, 4)), TParam("bool", "PF", (False, True))),
    instances=[(a, mx, *cfg, pf) for a in ACT_CODES.values() for mx in (False, True)
               for cfg in dict.fromkeys((*CONFIGS.values(), *RAGGED_CONFIGS.values(), RAGGED_SMALL_CONFIG,
                                          CONFIG_16_LARGE_GRID, *SMALL_GRID_CONFIGS.values(),
                                          *WIDE_GRID_CONFIGS.values()))
               if cfg not in SIXTEEN_BIT_TILES or a != ACT_CODES["nvfp4"]
               for pf in ((True,) if cfg in PREFETCH_ONLY_TILES
                          else (False, True) if prefetches(a, cfg) else (False,))], pdl=True)

# ---- the Hopper kernel (rawkv/cu/gemm_fp4_sm90.cu: wgmma, sm_90a) -----------
# Same parameters and packed weights; compiled for sm_90a on sm_90 devices
# only. A block computes BM output features (256, or 128 where a grid of 256
# would not fill the GPU) x BN tokens; STAGES pipeline stages of one
# 64-column chunk each (BN x 128 B of activations and BM / 16 x 576 B of
# packed codes and scales per stage).
SM90_BM = 256
SM90_THREADS = 384
SM90_FILE = KernelFile("gemm_fp4_sm90.cu", constants=FILE.constants, targets={"sm_90": "sm_90a"})
# (BN, STAGES) by the most tokens per group or expert each serves.
SM90_CONFIGS = {64: (64, 6), "large": (128, 5)}
# (A 96-token tile for ragged calls of 65-88 tokens per expert served until a
# block's MMAs covered only its tokens (rounded up to 16, run_tile): with
# that, 128-token tiles were faster there too, H100, DeepSeek-V4-Pro at
# 4,096 tokens (85 per expert): gate_up 6,659 / 6,649 us against 6,857 /
# 6,836, down 3,577 / 3,587 against 3,650 / 3,681; docs/gemm.md.)
# (BN, STAGES) of the 128-feature blocks.
SM90_SMALL_CONFIG = (128, 6)
# (BN, STAGES) of the 256-token tile (128-feature blocks, 16-bit activations
# by TMA only: rawkv/cu/gemm_fp4_sm90.cu, kTmaOnly).
SM90_WIDE_CONFIG = (256, 5)


# Bytes of one packed row tile in a stage: its 512 code bytes and 64 scale bytes.
SM90_TILE_STAGE_BYTES = 512 + 64


def sm90_dynamic_smem(act, mx, bn, stages, bm) -> int:
    """Bytes of dynamic shared memory of one block: 1024 for aligning the
    swizzled B stages, the stages, and two mbarriers per stage."""
    return 1024 + stages * (bn * 128 + (bm // 16) * SM90_TILE_STAGE_BYTES) + 16 * stages


GEMM_SM90 = SM90_FILE.kernel(
    "rkv_gemm_fp4_sm90",
    (TParam("int", "ACT", (0, 1, 2)), TParam("bool", "MX", (False, True)), TParam("int", "BN", (64, 128, 256)),
     TParam("int", "STAGES", (2, 3, 4, 5, 6)), TParam("int", "BM", (128, 256))),
    instances=[(a, mx, *cfg) for a in ACT_CODES.values() for mx in (False, True)
               for cfg in [(*c, SM90_BM) for c in dict.fromkeys(SM90_CONFIGS.values())]
               + [(*SM90_SMALL_CONFIG, 128)]]
    + [(a, mx, *SM90_WIDE_CONFIG, 128) for a in (ACT_CODES["bfloat16"], ACT_CODES["float16"]) for mx in (False, True)],
    dynamic_smem=sm90_dynamic_smem)

# Split K (rkv_gemm_fp4_sm90_splitk): a cluster of KSPLIT = 2 blocks per
# output tile, each half of K, for batched calls whose grid would leave SMs
# idle. The partial sums stay in the stages' shared memory, so the tiles
# are those whose stages hold them: {(BN, BM): STAGES}. (A split in 4 measured
# slower than in 2 on an H200: rank 0 reads three partial tiles over the
# cluster's shared memory.)
SM90_SPLITK_STAGES = {(64, 256): 6, (128, 128): 6, (128, 256): 6, (SM90_WIDE_CONFIG[0], 128): SM90_WIDE_CONFIG[1]}
SM90_SPLITS = (2,)

GEMM_SM90_SPLITK = SM90_FILE.kernel(
    "rkv_gemm_fp4_sm90_splitk",
    (TParam("int", "ACT", (0, 1, 2)), TParam("bool", "MX", (False, True)), TParam("int", "BN", (64, 128, 256)),
     TParam("int", "STAGES", (2, 3, 4, 5, 6)), TParam("int", "BM", (128, 256)), TParam("int", "KSPLIT", SM90_SPLITS)),
    instances=[(a, mx, bn, st, bm, ks) for a in ACT_CODES.values() for mx in (False, True)
               for (bn, bm), st in SM90_SPLITK_STAGES.items() for ks in SM90_SPLITS
               if bn <= 128 or a != ACT_CODES["nvfp4"]],        # (the 256-token tile: 16-bit activations)
    dynamic_smem=lambda act, mx, bn, stages, bm, ksplit: sm90_dynamic_smem(act, mx, bn, stages, bm))
