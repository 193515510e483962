"""The W4A8 grouped GEMM kernels (docs/gemm.md, "W4A8"): MXFP4 weights in
their W4A8 form (rawkv.reference.gemm_w4a8: packed codes and shifts, a
power of two per row), FP8 block activations (E4M3, one scale per token per
128 channels: FP32, or E8M0 bytes). Both are built for sm_90 devices only
(the W4A8 ops run there).

rawkv/cu/gemm_w4a8_sm90.cu (GEMM, wgmma, sm_90a): a block computes BM = 128
output features x BN tokens, STAGES pipeline stages of 128 columns each
(BN x 128 B of activations, 8 x (1024 + 64) B of packed codes and shifts,
BN x 4 B of scales).

rawkv/cu/gemm_w4a8_mma.cu (GEMM_MMA, FP16 mma.sync on exact conversions of
both operands) for few tokens per group or expert: (MT, NT, KS, RW, S) as the W4A16 mma.sync kernel's tiles, a ring
of S stages of one 128-column chunk per warp."""
from ..reference import gemm_w4a8 as ref8
from ._decl import KernelFile, TParam
from .gemm_fp4 import FILE as _FP4

BM = 128
THREADS = 384
#: Columns of K per chunk (one activation scale block, one pipeline stage).
CHUNK = 128
#: The E4M3 table (SHIFT_TABLE) as little-endian words, two per shift row.
TABLE_WORDS = ref8.SHIFT_TABLE.reshape(-1).view("<u4")
_CONSTANTS = {**_FP4.constants, "RKV_W4A8_TABLE": ",".join(f"{int(w):#010x}u" for w in TABLE_WORDS),
              "RKV_W4A8_SHIFT_BIAS": ref8.SHIFT_BIAS}
#: The wgmma kernel's token tiles of at most this many tokens fit two blocks
#: per SM (their launch bounds; blocks_per_sm).
TWO_BLOCKS_MAX_BN = 16
FILE = KernelFile("gemm_w4a8_sm90.cu", targets={"sm_90": "sm_90a"},
                  constants={**_CONSTANTS, "RKV_W4A8_TWO_BLOCKS_MAX_BN": TWO_BLOCKS_MAX_BN})
#: (BN, STAGES) by the most tokens per group (or per expert) each serves.
#: 16: decode calls the wgmma kernel takes (rawkv.gemm.plans: batched calls
#: of 9 to 16 tokens per group, or fewer where its grid fills the SMs); on an
#: H100 against its 64-token tile at 1 token on DeepSeek-V4-Pro's wo_a, 18.6
#: against 21.1 us (docs/gemm.md, "W4A8 for few tokens").
CONFIGS = {16: (16, 8), 64: (64, 8), "large": (128, 6)}


def blocks_per_sm(bn: int) -> int:
    """Blocks of the wgmma kernel an SM holds at once (its launch bounds:
    the 16-token tile's registers allow two, gemm_w4a8_sm90.cu)."""
    return 2 if bn <= TWO_BLOCKS_MAX_BN else 1


def dynamic_smem(bn: int, stages: int) -> int:
    """Bytes of dynamic shared memory of one block: 1024 for aligning the
    swizzled B stages, the stages, the E4M3 table in shared memory (one
    8-byte row per shift byte, 2048 bytes: the exact rows, and zeros for the
    bytes past the table) and two mbarriers per stage."""
    return 1024 + stages * (bn * 128 + (BM // 16) * (ref8.LANE_BYTES * 32 + ref8.SHIFT_BYTES * 8) + bn * 4) \
        + 256 * 8 + 16 * stages


#: Both kernels' last template argument, SB: the activation scales are E8M0
#: bytes (else float32); every tile has both instances (a module each,
#: compiled where used: rawkv.runtime). Read per call instead, the load kind
#: cost the mma.sync kernel's loop 4-31 registers and the wgmma kernel's
#: 16-token tile 3-7% (docs/gemm.md, "E8M0-byte scales").
SCALE_BYTES = (False, True)
GEMM = FILE.kernel(
    "rkv_gemm_w4a8_sm90",
    (TParam("int", "BN", (16, 64, 96, 112, 128)), TParam("int", "STAGES", (2, 3, 4, 5, 6, 7, 8)),
     TParam("bool", "SB", SCALE_BYTES)),
    instances=[(*cfg, sb) for cfg in dict.fromkeys(CONFIGS.values()) for sb in SCALE_BYTES],
    dynamic_smem=lambda bn, stages, sb: dynamic_smem(bn, stages))
#: Split K (rkv_gemm_w4a8_sm90_splitk): a cluster of KSPLIT blocks per output
#: tile, each a KSPLIT-th of the chunks, for batched calls whose grid leaves
#: SMs idle; the partial sums stay in the stages' shared memory. The
#: instances are CONFIGS' tiles with KSPLIT = 2.
SPLITS = (2,)
GEMM_SPLITK = FILE.kernel(
    "rkv_gemm_w4a8_sm90_splitk",
    (TParam("int", "BN", (16, 64, 96, 112, 128)), TParam("int", "STAGES", (2, 3, 4, 5, 6, 7, 8)),
     TParam("int", "KSPLIT", SPLITS), TParam("bool", "SB", SCALE_BYTES)),
    instances=[(*cfg, sp, sb) for cfg in dict.fromkeys(CONFIGS.values()) for sp in SPLITS for sb in SCALE_BYTES],
    dynamic_smem=lambda bn, stages, ksplit, sb: dynamic_smem(bn, stages))


# ---- the mma.sync kernel (rawkv/cu/gemm_w4a8_mma.cu) ---------------------------------------------
MMA_FILE = KernelFile("gemm_w4a8_mma.cu", targets={"sm_90": "sm_90"}, constants=_CONSTANTS)
#: (MT, NT, KS, RW, S) by the most tokens per group each serves ("large":
#: the 16-token tile, for calls forced onto this kernel): a block covers
#: 8 NT tokens and 16 MT RW output features; small token counts split K
#: across warps so that every SM has weight bytes in flight at M = 1. From an
#: H100 sweep (docs/gemm.md, "W4A8 for few tokens"): deeper rings (S = 4),
#: two m-tiles per warp at 8 tokens, and KS = 2 were slower. The 8-token
#: tile's ring is two stages (three until session 45; H100, interleaved
#: twice, us: seed 004 wo_a at 1 and 8 tokens 21.9-22.3 / 24.1-24.2
#: against 22.8-23.1 / 25.5-25.6; the same bits).
MMA_CONFIGS = {8: (1, 1, 4, 2, 2), 16: (2, 2, 4, 1, 3), "large": (2, 2, 4, 1, 3)}
#: Ragged calls (per expert on average) whose grid has enough blocks: one
#: warp per m-tile row streams all of K (no partial sums through shared
#: memory), four warps per block.
MMA_RAGGED_CONFIGS = {8: (2, 1, 1, 4, 3), 16: (2, 2, 1, 4, 3)}
#: MMA_RAGGED_CONFIGS[8] with a ring of two stages, for ragged calls of a
#: few rows (Tuning.W4A8_MMA_FEW_ROWS: a token or two over the experts);
#: the same bits. H100 (session 45, us): Pro down at 1 token 41.3-41.4
#: against 42.9-43.8 (W4A16 42.1-47.2); at 16 and 64 tokens two stages were
#: 1-5% slower (Pro down 16 458-474 against 442-450).
MMA_RAGGED_FEW_ROWS_CONFIG = (2, 1, 1, 4, 2)
#: Ragged calls of a few rows (a token over a few experts) whose grid is
#: too small for MMA_RAGGED_CONFIGS: two warps split K. Its ring is two
#: stages (three until session 45; H100, us: Flash down at 1 and 2 tokens
#: 14.4-14.9 and 27.9-28.1 against 15.7-16.2 and 29.3-29.9, gate_up at 1
#: 25.0-25.3 against 26.1-26.7, Pro gate_up at 1 75.6-76.1 against
#: 75.9-76.5; the same bits).
MMA_RAGGED_SMALL_CONFIG = (1, 1, 2, 4, 2)
#: Batched calls of up to 8 tokens per group by the size of MMA_CONFIGS[8]'s
#: grid (rawkv.gemm.plans, Tuning.W4A8_MMA_SMALL_GRID_* / _WIDE_*): two
#: m-tiles per warp, so a warp converts its tokens' activations once for
#: twice the weights, at 118-119 registers (two blocks of 256 threads per
#: SM). Grids below two blocks per SM (DeepSeek-V4-Flash's wo_a) take
#: MMA_SMALL_GRID_CONFIG: the same 32 features a block, eight warps split K
#: (other bits than MMA_CONFIGS'); grids past the three per SM that
#: MMA_CONFIGS[8]'s 80 registers allow (DeepSeek-V4-Pro's wo_a) take
#: MMA_WIDE_CONFIG: 64 features a block, half the blocks, K split in four
#: as MMA_CONFIGS' (the same bits). H100 (2026-11-27, .probe/w8sweep.py,
#: CUDA-graph replays of back-to-back calls, us, the plan before / this
#: tile; W4A16 beside): Flash M = 1, 2, 4, 8 10.7-10.9, 10.7-11.1, 11.3, 11.9-12.4 /
#: 8.9-9.1, 9.1, 9.1-9.2, 9.7 (W4A16 7.8-8.2); Pro M = 1, 2, 4, 8 (the
#: wgmma kernel's 16-token tile served it) 17.0-17.1, 17.0, 17.1-17.2,
#: 17.3-17.4 / 14.9-15.1, 15.1-15.2, 15.3-15.4, 15.8-16.0 (W4A16 15.2,
#: 15.3, 15.6, 16.0); seed 004 (384 blocks: one wave at three per SM) keeps
#: MMA_CONFIGS[8], 23.1-23.6 at 1-2 tokens against 25.3-25.4 and 28.7-29.1.
MMA_SMALL_GRID_CONFIG = (2, 1, 8, 1, 2)
MMA_WIDE_CONFIG = (2, 1, 4, 2, 2)

GEMM_MMA = MMA_FILE.kernel(
    "rkv_gemm_w4a8_mma",
    (TParam("int", "MT", (1, 2)), TParam("int", "NT", (1, 2, 4)), TParam("int", "KS", (1, 2, 4, 8)),
     TParam("int", "RW", (1, 2, 4)), TParam("int", "S", (2, 3, 4)), TParam("bool", "SB", SCALE_BYTES)),
    instances=[(*cfg, sb) for cfg in dict.fromkeys((*MMA_CONFIGS.values(), *MMA_RAGGED_CONFIGS.values(),
                                                    MMA_RAGGED_FEW_ROWS_CONFIG, MMA_RAGGED_SMALL_CONFIG,
                                                    MMA_SMALL_GRID_CONFIG, MMA_WIDE_CONFIG))
               for sb in SCALE_BYTES],
    pdl=True)    # (rawkv.gemm.plans launches it plainly where that measured faster: Tuning.W4A8_MMA_PDL_*)
