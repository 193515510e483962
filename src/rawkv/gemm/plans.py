"""The launch plans of the grouped FP4 GEMM: pure functions from the checked
arguments (rawkv.gemm._rules: the activation, the weight's sizes and
format), the device properties (`dev`: a rawkv._plan.Device with its arch,
or the Runtime) and the dispatch tunables to the list of launches
(rawkv._plan.Launch). The ops check, plan and run; the tests read the plans
as data (tests/gemm/test_plans.py). An empty list: nothing to do.

Kernels: rawkv.kernels.gemm_fp4, the mma.sync kernel (GEMM, every GPU from
sm_80) and the wgmma kernel (GEMM_SM90, and GEMM_SM90_SPLITK where a
cluster of two blocks splits K; sm_90 only).
"""
from __future__ import annotations

from typing import NamedTuple

from .. import _args as A
from .._plan import Launch
from ..kernels import gemm_fp4 as K
from ..kernels import gemm_w4a8 as K8
from . import _rules as R
from . import tma


class Tuning(NamedTuple):
    """Which kernel serves a launch (docs/gemm.md, "Dispatch"). The ops
    pass rawkv.gemm.linear itself, whose module attributes of these names
    are the tunables tests and tools/probe_gemm_paths.py set; TUNED holds
    their values.

    KERNEL_PATH: "auto" (the rule below), or "mma" / "sm90" to force one
    (tests compare the two paths on the same inputs). On an sm_90 device the
    wgmma kernel (rawkv/cu/gemm_fp4_sm90.cu) serves, from
    tools/probe_gemm_paths.py on the H100: batched calls from
    SM90_MIN_TOKENS tokens per group, or from SM90_MIN_TOKENS_SMALL when its
    grid has SM90_MIN_BLOCKS blocks or more (at 128 tokens it wins with 48
    and 64 blocks, loses with 32); ragged calls from SM90_MIN_EXPERT_TOKENS
    tokens per expert on average (on an H200 against the mma.sync kernel's
    ragged tiles it wins at 32 and 43 and loses at 21 and 24).
    MMA_RAGGED_MIN_BLOCKS: ragged calls below SM90_MIN_EXPERT_TOKENS take the mma.sync
    kernel's ragged tiles (RAGGED_CONFIGS: one warp streams all of K) when
    their grid has at least this many blocks per SM, else tiles whose warps
    split K, so that a few rows still keep every SM streaming
    (RAGGED_SMALL_CONFIG up to 8 tokens per expert, the batched tiles
    above): at 1 token over 256 experts (192 blocks on 132 SMs) the ragged
    tiles lose, at 2 tokens (384 blocks) they win.
    SM90_MIN_TOKENS_SPLIT: batched calls from this many tokens per group
    (below SM90_MIN_TOKENS_SMALL) take the wgmma kernel when its tile splits
    K (sm90_tile) and the split grid has SM90_MIN_BLOCKS blocks: on an
    H200 at 48 and 64 tokens it won on all three wo_a shapes (seed 004 at
    64: 44.5 against 65.0 us), at 32 it lost on all three.
    SM90_FORCE_KSPLIT: the wgmma kernel's split of K across a cluster of
    blocks (1 or 2), None to let sm90_tile choose; a split part has at
    least SM90_MIN_SPLIT_CHUNKS chunks of 64 columns.
    MMA_PREFETCH_MAX_BLOCKS_PER_SM: the mma.sync kernel loads the
    activations one step ahead (its PF instances, K.prefetches: tiles of 2+
    n-tiles, 16-bit activations) when its grid has at most this many blocks
    per SM: the second register set costs blocks per SM, so it pays where
    the grid runs in one wave anyway. H100 (2026-11-26, against loading at
    each step's start): Flash M = 16 and 32 (256 blocks) 13.6 -> 11.1 and
    17.8 -> 14.2 us, seed 004 (384 blocks) 29.6 -> 26.0 and 37.6 -> 33.0;
    Pro (512 blocks) 21.2 -> 23.3 and 25.2 -> 31.3. A batched call of 9-16
    tokens with 16-bit activations whose CONFIGS[16] grid is past this
    limit takes K.CONFIG_16_LARGE_GRID instead (64-feature blocks, half the
    grid; PF again by this rule): H100, Pro at 16 tokens 18.7-19.0 against
    19.6 us.
    MMA_SMALL_GRID_BLOCKS_PER_SM, MMA_SMALL_GRID_MIN_K: on sm_90, a batched
    call of up to 16 tokens per group with 16-bit activations whose CONFIGS[8]
    or CONFIGS[16] grid has fewer than this many blocks per SM, and K of at
    least this many columns, takes K.SMALL_GRID_CONFIGS' tile (eight warps
    splitting K instead of four; 9-16 tokens the same grid, 1-8 tokens 16
    features a block, twice the grid: H100 figures at the tiles). H100 (2026-11-27, us,
    under the programmatic dependent launch, CONFIGS against it, two runs):
    Flash wo_a (256 blocks) at 1 / 8 / 16 tokens 8.69-9.89 / 9.48-9.52 /
    11.43-11.47 against 7.83-7.89 / 8.40-8.43 / 9.58-9.60; one group of K
    7,168, N 2,048 (64 blocks) at 1 and 16 tokens 8.17-8.18 / 10.93-11.01
    against 7.33-7.34 / 9.16-9.21; K 4,096, N 4,096 (128 blocks) 5.78-5.80 /
    7.36-7.38 against 5.43-5.47 / 6.31-6.44; but at K 1,024 (N 7,168, 224
    blocks; two chunks a warp) 2.90-3.00 against 2.96-3.09 at 1 token and at
    K 512 (8 x 1,024) 2.25-2.27 against 2.36-2.49 (16 tokens gained there
    too: one rule for both tiles keeps calls of 1 to 16 tokens on the same
    bits). seed 004 (384 blocks) and Pro (512) keep CONFIGS' features a
    block (eight warps on 32 features measured 8-25% slower there).
    MMA_WIDE_MIN_BLOCKS_PER_SM, MMA_WIDE_MAX_BLOCKS_PER_SM: on
    sm_90, such a call (16-bit activations, K from MMA_SMALL_GRID_MIN_K)
    whose CONFIGS[8] / CONFIGS[16] grid has more than the first and at most
    the second many blocks per SM takes K.WIDE_GRID_CONFIGS' tile instead
    (64 features a block, half the grid, eight warps splitting K: the same
    bits for 1 to 16 tokens; DeepSeek-V4-Pro's wo_a, 512 blocks; its H100
    measurements are at the tiles). seed 004 (384 blocks, 2.9 per SM) keeps
    CONFIGS: the wide tiles measured 2-7% slower there at 8 and 16 tokens.
    W4A8_PATH: the W4A8 kernel, "auto" (the rule below), or "mma" / "sm90"
    to force one (tests run every shape class through both). W4A8 calls of
    at most W4A8_MMA_MAX_TOKENS tokens per group (batched) or
    W4A8_MMA_MAX_EXPERT_TOKENS per expert on average (ragged) take the
    mma.sync kernel (K8.GEMM_MMA), the rest the wgmma kernel, except batched
    calls whose wgmma grid already fills W4A8_SM90_MIN_FILL of the SMs (its
    blocks then stream all of K at once: DeepSeek-V4-Pro's wo_a, 128 blocks
    on 132 SMs). The wgmma kernel's 16-token tile (K8.CONFIGS[16]) measured
    on an H100 (2026-11-26, us, mma.sync kernel against it): Pro wo_a at 1
    and 16 tokens 21.1 / 18.6 and 21.5 / 19.1, Flash at 16 (split in two)
    16.2 / 13.4, seed 004 at 16 34.8 / 31.6 and at 8 31.9 / 31.2; at 1 token
    Flash 12.8 / 13.4 and seed 004 30.2 / 31.1 (so W4A8_MMA_MAX_TOKENS is 8);
    ragged calls at 1 token 15-30% slower at one block per SM; at two per SM
    (the 16-token tile's registers allow it) and with its E4M3 table written
    off the path to the first chunk, ragged calls of K >= 4096 (gate_up) ran
    2-15% faster than on the mma.sync kernel (Flash gate_up at 1, 16, 64
    and 256 tokens 31.5 / 32.4, 262 / 266, 631-652 / 640-674, 872-895 /
    991-1,050 us; Pro gate_up at 1 78 / 83) and those of smaller K mixed
    (Flash down at 1 and 64 tokens 18.8 / 19.5 and 361 / 330, Pro down at 1
    and 16 47.5-50.4 / 50.8-51.2 and 495 / 489-493): so ragged calls of at
    most W4A8_MMA_MAX_EXPERT_TOKENS per expert take the mma.sync kernel only
    where K is below W4A8_RAGGED_SM90_MIN_K. Since the wgmma kernel's blocks
    multiply only their own tokens (rounded up to 16), it also wins below
    that K from a few tokens per expert: H100 (2026-11-26, us, mma.sync /
    wgmma, two runs each), Flash down at 128, 256 and 512 tokens (3, 6 and
    12 per expert) 435-432 / 458-455, 501-498 / 483-480, 710-689 / 547-545;
    Pro down at 128, 256 and 512 (3, 6, 11) 1,578-1,584 / 1,620, 1,847 /
    1,712-1,716, 2,489-2,535 / 1,869-1,870; so W4A8_MMA_MAX_EXPERT_TOKENS is
    3 (it was 16). A ragged call on the mma.sync kernel takes
    K8.MMA_RAGGED_CONFIGS
    when its grid has MMA_RAGGED_MIN_BLOCKS blocks per SM, as the W4A16
    mma.sync kernel's ragged tiles do.
    W4A8_MMA_FEW_ROWS: a ragged call of K >= W4A8_RAGGED_SM90_MIN_K with at
    most this many rows (a token or two over the experts) takes the mma.sync
    kernel's small tile (K8.MMA_RAGGED_SMALL_CONFIG: two warps split K) all
    the same: since both kernels' dependent launch (sessions 42-43) it is the
    faster there. H100 (2026-11-27, us, wgmma / small tile / ragged tile):
    Flash gate_up at 1 token (6 rows) 26.9-29.3 / 26.65-26.66, at 2 (12
    rows) 52.4-54.5 / 49.7-49.8 / 49.2-49.3; Pro gate_up at 1 (8 rows)
    84.0-84.4 / 78.1-79.1 / 81.2-84.1, at 2 (16 rows) 140.0-140.3 /
    149.8-150.1 / 171.0. Ragged calls of at most this many rows that take
    K8.MMA_RAGGED_CONFIGS[8] take its two-stage form instead
    (K8.MMA_RAGGED_FEW_ROWS_CONFIG: the same bits).
    W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM, W4A8_MMA_SMALL_GRID_MIN_K,
    W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM, W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM: a
    batched call of at most W4A8_MMA_MAX_TOKENS tokens per group (W4A8_PATH
    "auto") whose K8.MMA_CONFIGS[8] grid has fewer than
    W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM blocks per SM, K from
    W4A8_MMA_SMALL_GRID_MIN_K (two chunks for each of its eight warps),
    takes K8.MMA_SMALL_GRID_CONFIG (DeepSeek-V4-Flash's wo_a); one whose
    grid has more than W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM (past the one wave
    MMA_CONFIGS[8]'s registers allow) and at most
    W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM (the wide tile's half as many blocks in
    one wave at its two per SM) takes K8.MMA_WIDE_CONFIG, in place of the
    wgmma kernel's 16-token tile (DeepSeek-V4-Pro's wo_a); both run as
    programmatic dependent launches (their H100 measurements are at the
    tiles, rawkv.kernels.gemm_w4a8; launched the plain way Flash M = 1 took
    10.8-10.9 us against 8.9-9.0, Pro 17.1 against 15.1).
    W4A8_MMA_PDL_MIN_BLOCKS_PER_SM: the W4A8 mma.sync kernel is a
    programmatic dependent launch (docs/runtime.md) in ragged calls, on the
    two tiles above and in batched calls whose grid has at least this many
    blocks per SM; other batched calls launch it the plain way. Its 80
    registers hold 3 blocks of 256 threads per SM: a grid of about two per
    SM (Flash wo_a, 256 blocks) leaves the next call room for only some of
    its blocks, while one that fills the slots hands them over as its
    blocks finish. H100
    (2026-11-27, us, plain / dependent, two runs): seed 004 (384 blocks) at
    1 and 8 tokens 25.13-25.21 / 23.71-23.78 and 26.12-26.22 / 25.79-25.86,
    Flash (256) 10.73-10.74 / 11.06 and 11.91-11.92 / 13.22-13.25; MoE Flash
    down at 1 token 16.51-16.54 / 16.09-16.14, Pro down at 1 44.66-48.52 /
    43.92-44.26, at 16 and 64 tokens within the noise.
    W4A8_KSPLIT: the W4A8 wgmma kernel's split of K across a cluster of
    blocks (1 or 2; batched calls only), None for the rule: split in two
    when the grid fills less than W4A8_SM90_MIN_FILL of the SMs, twice the
    grid still fits one wave (K8.blocks_per_sm: one block per SM, two of the
    16-token tile) and each half has at least W4A8_MIN_SPLIT_CHUNKS chunks
    of 128 columns. (H100, 16 tokens: seed 004's 96 blocks split 30.8-30.9
    against 31.6-31.8 us; Pro's 128 split 21.5 against 19.3; a split in four
    took 21 us at Flash against 13.3 in two.)
    SM90_FORCE_BN: the wgmma kernel's token tile (64, 128 or 256), None to
    let the plan choose (sm90_tile: 64 or 128 up to 64 tokens, 128 or, where
    the 256-token tile can serve the call (`wide`), 256 above). SM90_FORCE_BM: its feature tile (128 or 256), None
    to let sm90_tile's cost model choose (the rule it replaced: 128 when
    twice the grid of 256-feature blocks still fits in one wave; on the
    H100 128-feature blocks won with 48 and 64 blocks of 256 and lost with
    96 and 128, each of them adding a pass over the activations).
    SM90_ACT_TMA: the W4A16 wgmma kernel's 16-bit activation tiles by TMA
    (rawkv.gemm.tma) where the view allows it; False: its producer threads
    copy them (the same bits)."""
    KERNEL_PATH: str = "auto"
    SM90_MIN_TOKENS: int = 256
    SM90_MIN_TOKENS_SMALL: int = 128
    SM90_MIN_BLOCKS: int = 48
    SM90_MIN_EXPERT_TOKENS: int = 28
    MMA_RAGGED_MIN_BLOCKS: int = 2
    SM90_FORCE_BN: int | None = None
    SM90_FORCE_BM: int | None = None
    SM90_MIN_TOKENS_SPLIT: int = 48
    SM90_FORCE_KSPLIT: int | None = None
    SM90_MIN_SPLIT_CHUNKS: int = 16
    MMA_PREFETCH_MAX_BLOCKS_PER_SM: int = 3
    MMA_SMALL_GRID_BLOCKS_PER_SM: float = 2
    MMA_SMALL_GRID_MIN_K: int = 2048
    MMA_WIDE_MIN_BLOCKS_PER_SM: float = 3
    MMA_WIDE_MAX_BLOCKS_PER_SM: float = 4
    W4A8_PATH: str = "auto"
    W4A8_MMA_MAX_TOKENS: int = 8
    W4A8_MMA_MAX_EXPERT_TOKENS: int = 3
    W4A8_RAGGED_SM90_MIN_K: int = 4096
    W4A8_MMA_FEW_ROWS: int = 12
    W4A8_SM90_MIN_FILL: float = 0.9
    W4A8_KSPLIT: int | None = None
    W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM: float = 2
    W4A8_MMA_SMALL_GRID_MIN_K: int = 2048
    W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM: float = 3
    W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM: float = 4
    W4A8_MMA_PDL_MIN_BLOCKS_PER_SM: float = 2.5
    W4A8_MIN_SPLIT_CHUNKS: int = 8
    SM90_ACT_TMA: bool = True


TUNED = Tuning()


class Tile(NamedTuple):
    """A kernel and its tile: template arguments without ACT / MX, block,
    output features and tokens per block."""
    kernel: object
    targs: tuple
    block: tuple
    rows: int
    tokens: int
    splits: int = 1          # blocks (a cluster) per output tile, each a part of K


def sm90_blocks(w, tokens: int, bm: int, bn: int) -> int:
    """Blocks of a wgmma-kernel grid for `tokens` per group (ragged: per
    expert on average, so about); `w` has the weight's groups and n."""
    return w.groups * -(-w.n // bm) * -(-tokens // bn)


def takes_sm90(w, tokens: int, ragged: bool, tuning=TUNED) -> bool:
    """The dispatch rule (Tuning) for an sm_90 device."""
    if ragged:
        return tokens >= tuning.SM90_MIN_EXPERT_TOKENS
    blocks = sm90_blocks(w, tokens, K.SM90_BM, K.SM90_CONFIGS["large"][0])
    return tokens >= tuning.SM90_MIN_TOKENS or (
        tokens >= tuning.SM90_MIN_TOKENS_SMALL and blocks >= tuning.SM90_MIN_BLOCKS)


# Time of one chunk in a block of the wgmma kernel, relative to the
# (BN, BM) = (128, 256) tile's, from the H200 sweep of 2026-11-26 (one wave
# of blocks, Flash wo_a: 0.64, 0.59 and 0.86 us per chunk); (256, 128) from
# the H100 run of 2026-11-27 (Flash and Pro wo_a at 4,096 tokens, full waves:
# 0.76-0.77 us per chunk against 0.87-0.89 for (128, 256)).
SM90_CHUNK_COST = {(64, 256): 0.75, (128, 128): 0.7, (128, 256): 1.0, (256, 128): 0.86}
# The non-split instances: {(BN, BM): STAGES}.
SM90_STAGES = {(K.SM90_CONFIGS[64][0], K.SM90_BM): K.SM90_CONFIGS[64][1],
               (K.SM90_CONFIGS["large"][0], K.SM90_BM): K.SM90_CONFIGS["large"][1],
               (K.SM90_SMALL_CONFIG[0], 128): K.SM90_SMALL_CONFIG[1],
               (K.SM90_WIDE_CONFIG[0], 128): K.SM90_WIDE_CONFIG[1]}


def sm90_tile(dev, w, tokens: int, ragged: bool = False, tuning=TUNED, wide: bool = False) -> Tile:
    """The wgmma kernel's tile: BN = 64 tokens up to 64 per group, else 128,
    on 256-feature blocks, or 128-token tiles on 128-feature blocks (at any
    token count: Flash wo_a at 48 and 64 tokens fills the SMs that way);
    the (BN, BM) and, batched, the split of K (1 or 2 blocks per output
    tile) of least modelled time: waves of blocks
    (one block per SM) x chunks per block x SM90_CHUNK_COST, ties to fewer
    splits and larger tiles. So a grid that would leave SMs idle or end in a
    thin last wave takes 128-feature blocks or splits K (seed 004 at 64 tokens: 48 blocks of
    256 x 64 become 96 half-K blocks). Ragged calls never split (their grid
    depends on the experts' sizes). `wide`: the call's activations can come
    by TMA in boxes of 256 token rows (wide_tile), which the 256-token tile
    (K.SM90_WIDE_CONFIG, 128 features) needs; it is then one more choice
    for more than 128 tokens. The SM90_FORCE_* tunables fix a choice
    (SM90_FORCE_BN = 256 where the call is not `wide`: 128)."""
    wide_bn = K.SM90_WIDE_CONFIG[0]
    if tuning.SM90_FORCE_BN not in (None, 64, 128, wide_bn):
        raise ValueError(f"SM90_FORCE_BN: expected 64, 128, 256 or None, got {tuning.SM90_FORCE_BN!r}")
    wide = wide and tuning.SM90_FORCE_BM in (None, 128)
    force_bn = tuning.SM90_FORCE_BN
    if force_bn == wide_bn and not wide:
        force_bn = 128                          # (forced where it cannot serve: the 128-token tile)
    bn = force_bn or (64 if tokens <= 64 else 128)
    # The (BN, BM) tiles to weigh.
    if bn == wide_bn:
        tiles = [(wide_bn, 128)]
    else:
        tiles = []
        for bm in (tuning.SM90_FORCE_BM,) if tuning.SM90_FORCE_BM else (256, 128):
            tbn = 128 if bm == 128 else bn      # (128-feature blocks have 128-token tiles only)
            if tbn == bn or force_bn is None or tuning.SM90_FORCE_BM:
                tiles.append((tbn, bm))         # (a forced token tile is kept)
        if wide and tokens > 128 and force_bn is None:
            tiles.append((wide_bn, 128))
    chunks = -(-w.k // K.CHUNK)
    splits = (tuning.SM90_FORCE_KSPLIT,) if tuning.SM90_FORCE_KSPLIT else (1, *K.SM90_SPLITS)
    options = []
    for tbn, bm in tiles:
        for sp in (1,) if ragged else splits:
            if sp > 1 and (tbn, bm) not in K.SM90_SPLITK_STAGES:
                if tuning.SM90_FORCE_KSPLIT:
                    raise ValueError(f"x: the wgmma kernel splits K only with the tiles {list(K.SM90_SPLITK_STAGES)}")
                continue
            if sp > 1 and chunks < sp * tuning.SM90_MIN_SPLIT_CHUNKS and not tuning.SM90_FORCE_KSPLIT:
                continue
            waves = -(-sm90_blocks(w, tokens, bm, tbn) * sp // dev.sm_count)
            options.append((waves * chunks / sp * SM90_CHUNK_COST[tbn, bm], sp, -bm, tbn))
    _, sp, bm, bn = min(options)
    bm = -bm
    if sp > 1:
        return Tile(K.GEMM_SM90_SPLITK, (bn, K.SM90_SPLITK_STAGES[bn, bm], bm, sp), (K.SM90_THREADS,), bm, bn, sp)
    return Tile(K.GEMM_SM90, (bn, SM90_STAGES[bn, bm], bm), (K.SM90_THREADS,), bm, bn)


def mma_config(tokens: int, table=K.CONFIGS) -> tuple:
    """An mma.sync kernel's tile for `tokens` per group (or per expert, from
    K.RAGGED_CONFIGS): the table's entry of the fewest tokens that holds
    them, else its "large" one (K.CONFIGS' when it has none). W4A16's
    (MT, NT, KS, RW, U, S); W4A8's tables (K8.MMA_*) have the same keys."""
    for tt in (8, 16, 32, 64):
        if tokens <= tt and tt in table:
            return table[tt]
    return table.get("large", K.CONFIGS["large"])


def ragged_slots(rows: int, experts: int, tile_tokens: int) -> int:
    """The slots of a ragged grid: enough for every expert's token tiles
    (each expert may end in a partial tile) and the unowned rows before
    the first and after the last expert."""
    return min(rows, -(-rows // tile_tokens) + experts + 2)


def _mma_tile(cfg) -> Tile:
    mt, nt, ks, rw = cfg[:4]
    return Tile(K.GEMM, cfg, (32 * ks * rw,), 16 * mt * rw, 8 * nt)


def tile(dev, w, tokens: int, ragged: bool = False, tuning=TUNED, rows: int = 0, wide: bool = False) -> Tile:
    """The kernel and tile for `tokens` tokens per group (batched) or per
    expert on average (ragged: `rows` the rows in all) on device `dev` (its
    arch and sm_count); `wide`: sm90_tile's."""
    path = tuning.KERNEL_PATH
    if path == "auto":
        path = "sm90" if dev.arch == "sm_90" and takes_sm90(w, tokens, ragged, tuning) else "mma"
        if path == "mma" and dev.arch == "sm_90" and not ragged and tokens >= tuning.SM90_MIN_TOKENS_SPLIT:
            tl = sm90_tile(dev, w, tokens, tuning=tuning, wide=wide)
            if tl.splits > 1 and sm90_blocks(w, tokens, tl.rows, tl.tokens) * tl.splits >= tuning.SM90_MIN_BLOCKS:
                return tl
    if path == "sm90":
        if dev.arch != "sm_90":
            raise ValueError(f"x: the wgmma GEMM kernel runs on sm_90 devices, this one is {dev.arch}")
        return sm90_tile(dev, w, tokens, ragged, tuning, wide)
    if ragged and tokens <= max(K.RAGGED_CONFIGS):
        tl = _mma_tile(mma_config(tokens, K.RAGGED_CONFIGS))
        blocks = -(-w.n // tl.rows) * ragged_slots(rows, w.groups, tl.tokens)
        if blocks >= tuning.MMA_RAGGED_MIN_BLOCKS * dev.sm_count:
            return tl
        if tokens <= 8:
            return _mma_tile(K.RAGGED_SMALL_CONFIG)
    return _mma_tile(mma_config(tokens))


# ---- the plans -------------------------------------------------------------------------------
def grouped(dev, act, w, out, tuning=TUNED) -> list[Launch]:
    """rawkv.gemm.grouped_linear: x (T, G, K) -> out (T, G, N), one launch
    of a grid (feature blocks, token tiles, groups)."""
    t, g = act.lead
    if t == 0 or g == 0 or w.n == 0:        # (nothing to write: no launch, whose grid would be empty)
        return []
    tl = tile(dev, w, t, tuning=tuning, wide=wide_tile(dev, act, t, False, tuning))
    grid = (-(-w.n // tl.rows) * tl.splits, -(-t // tl.tokens), g)
    tl, grid = _tile_by_grid(dev, tl, act, w, grid, tuning)
    pf = _prefetch(dev, tl, act, grid, tuning)
    if pf == (False,) and tl.targs == K.CONFIGS[16] and K.prefetches(act.kind, tl.targs):
        tl = _mma_tile(K.CONFIG_16_LARGE_GRID)      # its grid too large to prefetch: 64-feature blocks
        grid = (-(-w.n // tl.rows), grid[1], g)
        pf = _prefetch(dev, tl, act, grid, tuning)
    return [_launch(tl, act, w, out, grid, t, None, 0, None, pf, tuning)]


def moe(dev, act, w, offsets, out, errors, tuning=TUNED) -> list[Launch]:
    """rawkv.gemm.moe_linear: x (R, K) -> out (R, N) by expert, one launch:
    the tile for the rows per expert on average, a grid of (feature blocks,
    slots) where the slots cover every expert's token tiles (the kernel
    finds each slot's segment). `errors`: the counter's tensor or address."""
    (r,) = act.lead
    if r == 0 or w.n == 0:
        return []
    e = w.groups
    per_expert = -(-r // max(1, min(e, r)))
    tl = tile(dev, w, per_expert, ragged=True, tuning=tuning, rows=r,
              wide=wide_tile(dev, act, per_expert, True, tuning))
    slots = ragged_slots(r, e, tl.tokens)
    grid = (-(-w.n // tl.rows), slots, 1)
    return [_launch(tl, act, w, out, grid, r, offsets, e, errors, _prefetch(dev, tl, act, grid, tuning), tuning)]


def wide_tile(dev, act, tokens: int, ragged: bool, tuning) -> bool:
    """Whether the wgmma kernel's 256-token tile can serve the call (sm90_tile's
    `wide`): an sm_90 device, 16-bit activations with SM90_ACT_TMA on and a
    view TMA can map in boxes of 256 token rows (its producer has no other
    way to bring them), more than 128 tokens per group or expert on average
    (or the tile forced)."""
    if dev.arch != "sm_90" or not tuning.SM90_ACT_TMA or act.kind == K.ACT_CODES["nvfp4"]:
        return False
    if tokens <= 128 and tuning.SM90_FORCE_BN != K.SM90_WIDE_CONFIG[0]:
        return False
    return tma.activation_map(act.x, ragged, K.SM90_WIDE_CONFIG[0]) is not None


def _tile_by_grid(dev, tl: Tile, act, w, grid, tuning) -> tuple[Tile, tuple]:
    """In place of CONFIGS[8] / CONFIGS[16] on sm_90 (16-bit activations, K
    from MMA_SMALL_GRID_MIN_K), by how many blocks per SM their grid has:
    below MMA_SMALL_GRID_BLOCKS_PER_SM K.SMALL_GRID_CONFIGS' tile (the same
    grid at 9-16 tokens, 16-feature blocks, twice the grid, at 1-8), past
    MMA_WIDE_MIN_BLOCKS_PER_SM and up to
    MMA_WIDE_MAX_BLOCKS_PER_SM K.WIDE_GRID_CONFIGS' (64-feature blocks:
    half the grid); with its grid, else (`tl`, `grid`). Their 16-token tiles
    only with PF (their one instance; grids this small prefetch unless
    MMA_PREFETCH_MAX_BLOCKS_PER_SM is set below them)."""
    tokens = 8 if tl.targs == K.CONFIGS[8] else 16 if tl.targs == K.CONFIGS[16] else 0
    if not tokens or dev.arch != "sm_90" or act.kind == K.ACT_CODES["nvfp4"] or w.k < tuning.MMA_SMALL_GRID_MIN_K:
        return tl, grid
    per_sm = grid[0] * grid[1] * grid[2] / dev.sm_count
    if per_sm < tuning.MMA_SMALL_GRID_BLOCKS_PER_SM:
        table = K.SMALL_GRID_CONFIGS
    elif tuning.MMA_WIDE_MIN_BLOCKS_PER_SM < per_sm <= tuning.MMA_WIDE_MAX_BLOCKS_PER_SM:
        table = K.WIDE_GRID_CONFIGS
    else:
        return tl, grid
    by_grid = _mma_tile(table[tokens])
    by_grid_grid = (-(-w.n // by_grid.rows), grid[1], grid[2])
    if tokens == 16 and _prefetch(dev, by_grid, act, by_grid_grid, tuning) != (True,):
        return tl, grid
    return by_grid, by_grid_grid


def _prefetch(dev, tl: Tile, act, grid, tuning) -> tuple:
    """The mma.sync kernel's last template argument, PF (Tuning's
    MMA_PREFETCH_MAX_BLOCKS_PER_SM); nothing for the wgmma kernels."""
    if tl.kernel is not K.GEMM:
        return ()
    blocks = grid[0] * grid[1] * grid[2]
    return (K.prefetches(act.kind, tl.targs)
            and blocks <= tuning.MMA_PREFETCH_MAX_BLOCKS_PER_SM * dev.sm_count,)


def _act_map(tl: Tile, act, ragged: bool, tuning) -> tuple[dict, tuple | None]:
    """The wgmma kernel's activation arguments, `xmap` (the 16-bit
    activations' tensor map, rawkv.gemm.tma) and `act_tma` (1 where there is
    one), and the map's geometry (Launch.tma); no map for NVFP4 activations
    (the producer dequantizes them), SM90_ACT_TMA off, or a view TMA cannot
    take; no arguments for the mma.sync kernel."""
    if tl.kernel is K.GEMM:
        return {}, None
    geo = xmap = None
    if tuning.SM90_ACT_TMA and act.kind != K.ACT_CODES["nvfp4"]:
        geo = tma.geometry(act.x, ragged, tl.tokens)
        xmap = None if geo is None else tma.encode(act.x.data_ptr(), *geo)
    if xmap is None:
        return dict(xmap=tma.NONE, act_tma=0), None
    return dict(xmap=xmap, act_tma=1), geo


def _launch(tl: Tile, act, w, out, grid, tokens, offsets, experts, errors, pf: tuple, tuning=TUNED) -> Launch:
    if grid[1] > R.MAX_GRID_YZ or grid[2] > R.MAX_GRID_YZ:     # (y, z: token tiles or slots, groups)
        raise ValueError(f"x: {tokens} tokens x {w.groups} groups is past the launch grid's limit")
    xs_t, xs_g = _lead_strides(act.x)
    ss_t, ss_g = (0, 0) if act.sf is None else _lead_strides(act.sf)
    if act.gs is None or act.gs.numel() == 1:
        gs_t, gs_g = 0, 0
    else:
        gs_t, gs_g = (*act.gs.stride(), 0)[:2]
    os_t, os_g = _lead_strides(out)
    inst = tl.kernel.instance(act.kind, w.fmt == "mxfp4", *tl.targs, *pf)
    xmap, geo = _act_map(tl, act, offsets is not None, tuning)
    return Launch(inst, grid, tl.block, dict(
        wq=w.codes, wsf=w.scales, wgs=w.gs, x=act.x, xsf=act.sf, xgs=act.gs, xs_t=xs_t, xs_g=xs_g,
        ss_t=ss_t, ss_g=ss_g, gs_t=gs_t, gs_g=gs_g, out=out, os_t=os_t, os_g=os_g, n=w.n, k=w.k,
        tokens=tokens, offsets=offsets, experts=experts, errors=errors, **xmap), geo)


def _lead_strides(x) -> tuple:
    """(token stride, group stride) in elements; 0 for a missing group axis."""
    st = x.stride()
    return (st[0], st[1]) if len(st) == 3 else (st[0], 0)


# ---- W4A8 (rawkv/cu/gemm_w4a8_sm90.cu, gemm_w4a8_mma.cu) -------------------------------------
def w4a8_tile(tokens: int) -> tuple:
    """(BN, STAGES) of the W4A8 wgmma kernel for `tokens` per group (ragged:
    per expert on average)."""
    return K8.CONFIGS[16] if tokens <= 16 else K8.CONFIGS[64] if tokens <= 64 else K8.CONFIGS["large"]


def w4a8_mma_config(w, tokens: int, ragged: bool, rows: int, dev, tuning=TUNED) -> tuple | None:
    """The W4A8 mma.sync kernel's (MT, NT, KS, RW, S) for `tokens` per group
    (ragged: per expert on average, `rows` in all), or None where the wgmma
    kernel serves (Tuning's W4A8_* rule)."""
    path = tuning.W4A8_PATH
    if path == "sm90":
        return None
    if path not in ("auto", "mma"):
        raise ValueError(f"W4A8_PATH: expected 'auto', 'mma' or 'sm90', got {path!r}")
    if path == "auto":
        if tokens > (tuning.W4A8_MMA_MAX_EXPERT_TOKENS if ragged else tuning.W4A8_MMA_MAX_TOKENS):
            return None
        if ragged and w.k >= tuning.W4A8_RAGGED_SM90_MIN_K:
            return K8.MMA_RAGGED_SMALL_CONFIG if rows <= tuning.W4A8_MMA_FEW_ROWS else None
        if not ragged:
            by_grid = _w4a8_tile_by_grid(w, dev, tuning)
            if by_grid is not None:
                return by_grid
            if sm90_blocks(w, tokens, K8.BM, w4a8_tile(tokens)[0]) >= tuning.W4A8_SM90_MIN_FILL * dev.sm_count:
                return None
    if ragged and tokens <= max(K8.MMA_RAGGED_CONFIGS):
        cfg = mma_config(tokens, K8.MMA_RAGGED_CONFIGS)
        blocks = -(-w.n // (16 * cfg[0] * cfg[3])) * ragged_slots(rows, w.groups, 8 * cfg[1])
        if blocks >= tuning.MMA_RAGGED_MIN_BLOCKS * dev.sm_count:
            few = cfg == K8.MMA_RAGGED_CONFIGS[8] and rows <= tuning.W4A8_MMA_FEW_ROWS
            return K8.MMA_RAGGED_FEW_ROWS_CONFIG if few else cfg
        if tokens <= 8:
            return K8.MMA_RAGGED_SMALL_CONFIG
    return mma_config(tokens, K8.MMA_CONFIGS)


def _w4a8_tile_by_grid(w, dev, tuning) -> tuple | None:
    """K8.MMA_SMALL_GRID_CONFIG or K8.MMA_WIDE_CONFIG where the size of
    K8.MMA_CONFIGS[8]'s grid takes one (a batched call of at most
    W4A8_MMA_MAX_TOKENS tokens per group: one token tile; Tuning's
    W4A8_MMA_SMALL_GRID_* / W4A8_MMA_WIDE_* rule), else None."""
    mt, _, _, rw, _ = K8.MMA_CONFIGS[8]
    per_sm = -(-w.n // (16 * mt * rw)) * w.groups / dev.sm_count
    if per_sm < tuning.W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM and w.k >= tuning.W4A8_MMA_SMALL_GRID_MIN_K:
        return K8.MMA_SMALL_GRID_CONFIG
    if tuning.W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM < per_sm <= tuning.W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM:
        return K8.MMA_WIDE_CONFIG
    return None


def w4a8_splits(dev, w, tokens: int, bn: int, tuning=TUNED) -> int:
    """The W4A8 wgmma kernel's split of K for a batched call of `tokens` per
    group on its BN-token tile (Tuning's W4A8_KSPLIT rule)."""
    if tuning.W4A8_KSPLIT is not None:
        if tuning.W4A8_KSPLIT not in (1, *K8.SPLITS):
            raise ValueError(f"W4A8_KSPLIT: expected 1 or one of {K8.SPLITS}, got {tuning.W4A8_KSPLIT}")
        return tuning.W4A8_KSPLIT
    sp = K8.SPLITS[0]
    chunks = -(-w.k // K8.CHUNK)
    blocks = sm90_blocks(w, tokens, K8.BM, bn)
    return sp if blocks < tuning.W4A8_SM90_MIN_FILL * dev.sm_count \
        and blocks * sp <= dev.sm_count * K8.blocks_per_sm(bn) \
        and chunks >= sp * tuning.W4A8_MIN_SPLIT_CHUNKS else 1


def _w4a8_kernel(dev, w, tokens, ragged, experts, tuning) -> tuple:
    """(tokens per group, ragged: per expert on average; the call's mma.sync
    tile, plans.w4a8_mma_config, or None for the wgmma kernel)."""
    if dev.arch != "sm_90":
        raise ValueError(f"weight: the W4A8 GEMM runs on sm_90 (Hopper) devices, this one is {dev.arch}; "
                         "use the W4A16 path (an Fp4Weight and BF16 activations)")
    per = -(-tokens // max(1, min(experts, tokens))) if ragged else tokens
    return per, w4a8_mma_config(w, per, ragged, tokens, dev, tuning)


def _blocks_apart(sf) -> bool:
    """Whether a scales view's 128-column blocks are not adjacent (what the
    mma.sync kernel cannot read)."""
    return sf.shape[-1] > 1 and sf.stride(-1) != 1


def w4a8_scales_read(dev, act, w, offsets, tuning=TUNED):
    """act with the scales the call's kernel reads: the wgmma kernel takes
    them at any strides (its ss_b), the mma.sync kernel (few tokens) with
    their 128-column blocks adjacent, so a view whose blocks are not is
    copied once for it (docs/gemm.md, "Scale layouts": with a run-time block
    stride that kernel measured 5-37% slower on its decode rows). A copy
    is a new tensor, so the fast path does not keep such a call."""
    sf = act.sf
    if not _blocks_apart(sf) or w.n == 0:
        return act
    tokens = act.lead[0]                        # (per group, or the ragged call's rows)
    if 0 in act.lead or _w4a8_kernel(dev, w, tokens, offsets is not None, w.groups, tuning)[1] is None:
        return act
    R.copy_outside_capture(sf, "x.scales", "128-column blocks not adjacent, for the few-token kernel", dev)
    return act._replace(sf=sf.contiguous())


def _w4a8_launch(dev, act, w, out, tokens, offsets, experts, errors, tuning) -> Launch:
    """The launch of either W4A8 kernel: its tile from the tokens per group
    (ragged: per expert on average), a grid of (feature blocks, token tiles
    or slots, groups)."""
    ragged = offsets is not None
    per, cfg = _w4a8_kernel(dev, w, tokens, ragged, experts, tuning)
    if cfg is not None and _blocks_apart(act.sf):
        raise RuntimeError("x.scales: the W4A8 mma.sync kernel reads adjacent blocks; "
                           "rawkv.gemm.plans.w4a8_scales_read copies such a view first")
    sb = A.itemsize(act.sf) == 1                # (E8M0 bytes, else float32 scales: K8.SCALE_BYTES)
    if cfg is None:
        bn, stages = w4a8_tile(per)
        block, rows_per_block = (K8.THREADS,), K8.BM
        splits = 1 if ragged else w4a8_splits(dev, w, tokens, bn, tuning)
    else:
        mt, nt, ks, rw, _ = cfg
        block, rows_per_block, bn, splits = (32 * ks * rw,), 16 * mt * rw, 8 * nt, 1
    if ragged:
        grid = (-(-w.n // rows_per_block), ragged_slots(tokens, experts, bn), 1)
    else:
        grid = (-(-w.n // rows_per_block) * splits, -(-tokens // bn), act.lead[1])
    if grid[1] > R.MAX_GRID_YZ or grid[2] > R.MAX_GRID_YZ:     # (y, z: token tiles or slots, groups)
        raise ValueError(f"x: {tokens} tokens x {w.groups} groups is past the launch grid's limit")
    if cfg is None:
        inst = K8.GEMM_SPLITK.instance(bn, stages, splits, sb) if splits > 1 else K8.GEMM.instance(bn, stages, sb)
    else:                  # the mma.sync kernel: dependent launch or not (Tuning.W4A8_MMA_PDL_MIN_BLOCKS_PER_SM)
        blocks = grid[0] * grid[1] * grid[2]
        pdl = ragged or cfg in (K8.MMA_SMALL_GRID_CONFIG, K8.MMA_WIDE_CONFIG) \
            or blocks >= tuning.W4A8_MMA_PDL_MIN_BLOCKS_PER_SM * dev.sm_count
        inst = K8.GEMM_MMA.instance(*cfg, sb, pdl=pdl)
    xs_t, xs_g = _lead_strides(act.x)
    ss_t, ss_g = _lead_strides(act.sf)
    os_t, os_g = _lead_strides(out)
    block_stride = {} if cfg is not None else dict(ss_b=act.sf.stride(-1))    # (the wgmma kernel's alone)
    return Launch(inst, grid, block, dict(
        wq=w.codes, wsh=w.shifts, wrow=w.row_scale, wgs=w.gs, x=act.x, xsf=act.sf, xs_t=xs_t, xs_g=xs_g,
        ss_t=ss_t, ss_g=ss_g, **block_stride, out=out, os_t=os_t, os_g=os_g, n=w.n, k=w.k, tokens=tokens,
        offsets=offsets, experts=experts, errors=errors))


def w4a8_grouped(dev, act, w, out, errors=None, tuning=TUNED) -> list[Launch]:
    """rawkv.gemm.grouped_linear with a W4A8 weight: x (T, G, K) FP8 ->
    out (T, G, N), one launch of a grid (feature blocks, token tiles, groups).
    `errors`: the counter's tensor or address (shift bytes past the table;
    None: not counted)."""
    t, g = act.lead
    if t == 0 or g == 0 or w.n == 0:        # (nothing to write: no launch, whose grid would be empty)
        return []
    return [_w4a8_launch(dev, act, w, out, t, None, 0, errors, tuning)]


def w4a8_moe(dev, act, w, offsets, out, errors, tuning=TUNED) -> list[Launch]:
    """rawkv.gemm.moe_linear with a W4A8 weight: x (R, K) FP8 -> out (R, N)
    by expert, one launch over (feature blocks, slots) as `moe`."""
    (r,) = act.lead
    if r == 0 or w.n == 0:
        return []
    return [_w4a8_launch(dev, act, w, out, r, offsets, w.groups, errors, tuning)]
