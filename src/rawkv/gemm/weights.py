"""Fp4Weight: an FP4 weight of G groups (or experts) in the packed layout the
grouped GEMM reads (docs/gemm.md), built once at load.

    w = Fp4Weight.from_float(bf16_weight)                     # ModelOpt's NVFP4 bytes
    w = Fp4Weight.from_nvfp4(weight, weight_scale, weight_scale_2, input_scale, groups=8)
    w = Fp4Weight.from_mxfp4(codes, scale)                     # DeepSeek's FP4 experts
    codes, scales, gs = w.unpack()                             # the checkpoint form back

Load-time code: it may synchronize with the host (the MXFP4 window check
reads the scale range); nothing here is on an op's hot path. Every argument
is checked before anything is packed.
"""
from __future__ import annotations

import numpy as np

from .._args import check_gs_number, is_int, is_number, is_torch, positive_int, require_array
from ..reference import gemm as ref
from ..runtime import get_runtime
from . import pack

FORMATS = ("nvfp4", "mxfp4")
#: MXFP4 scale bytes the GEMM kernel dequantizes exactly (its contract,
#: docs/gemm.md "MXFP4 exponent window"): with BF16 or NVFP4 activations, and
#: with FP16 activations.
MX_WINDOW = (4, 137)
MX_WINDOW_FP16 = (113, 137)
#: The largest NVFP4 block-scale byte a loader takes: E4M3 0x7E = 448. Above
#: it are NaN (0x7F) and the negative scales (0x80 ..), which no exporter
#: writes and which would load as NaN or sign-flipped weights.
NV_SCALE_MAX = 0x7E


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def require_torch(what: str):
    """torch, or an ImportError saying that `what` needs it (rawkv itself
    imports without torch; its GEMM weights are torch tensors)."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"{what} needs PyTorch (pip install torch); the GEMM's numpy definition "
                          "is rawkv.reference.gemm") from exc
    return torch


def _torch_tensor(t, name: str):
    """`t`, which must be a torch tensor: checked before torch is imported, so
    that without torch an array is a TypeError naming it."""
    require_array(t, name)
    if not is_torch(t):
        raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    return t


def checked_device(device):
    """`device` ('cpu', 'cuda', 'cuda:N', a CUDA index or a torch.device) as
    a torch.device. A CUDA one goes through rawkv's runtime first, so a
    missing GPU stack (a CPU-only torch: torch's own error is a bare
    AssertionError) is a rawkv.GpuUnavailableError and a missing index a
    ValueError naming `device`."""
    torch = require_torch("rawkv.gemm")
    if getattr(device, "type", None) == "cpu":
        return torch.device(device)
    if isinstance(device, str) and device.partition(":")[0].strip() == "cpu":
        try:
            return torch.device(device.strip())
        except RuntimeError:
            raise ValueError(f"device: {device!r} is not a device torch knows ('cpu', 'cuda', 'cuda:N')") from None
    if device is None:
        raise TypeError("device: expected 'cpu', 'cuda', 'cuda:N', a CUDA index or a torch.device, got None")
    return torch.device("cuda", get_runtime(device).device_index)


def _same_device(t, name: str, device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device} but weight is on {device}; rawkv does not move data")


def _byte_tensor(t, name: str, view: str):
    """`t` as uint8: a torch tensor of uint8 or of torch's `view` dtype."""
    _torch_tensor(t, name)
    import torch
    allowed = [torch.uint8] + [getattr(torch, view)] * hasattr(torch, view)
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {_dtype_name(t.dtype)} is not supported "
                        f"(expected {', '.join(_dtype_name(d) for d in allowed)})")
    return t.view(torch.uint8)


def _packed_bytes(t, name: str):
    """`t`, a packed weight's codes or scales: a torch tensor of uint8 (the
    packed form's bytes; the scales' rules read them as bytes), else a
    TypeError naming it."""
    _torch_tensor(t, name)
    if _dtype_name(t.dtype) != "uint8":
        raise TypeError(f"{name}: dtype {_dtype_name(t.dtype)} is not supported (expected uint8: the packed "
                        "form's bytes)")
    return t


def _exp_range(v):
    """An exp_range argument: None or a pair of ints (NumPy ints as theirs),
    else a TypeError naming it."""
    if v is None:
        return None
    if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(map(is_int, v))):
        raise TypeError(f"exp_range: expected None or (min, max) scale bytes as two ints, got {v!r}")
    return int(v[0]), int(v[1])


def _rows_of(weight, groups: int, name: str = "weight") -> tuple[int, int]:
    """(G, N) of a (G*N, .) or (G, N, .) weight stacked over `groups`."""
    if weight.dim() == 2:
        if weight.shape[0] % groups:
            raise ValueError(f"groups: {groups} does not divide the {weight.shape[0]} rows of {name}")
        return groups, weight.shape[0] // groups
    if weight.dim() == 3:
        if weight.shape[0] == 0:       # (as from_float: a weight has at least one group)
            raise ValueError(f"{name}: has no groups (shape {tuple(weight.shape)})")
        if groups not in (1, weight.shape[0]):
            raise ValueError(f"groups: {groups} does not match {name}'s {weight.shape[0]} groups "
                             f"(shape {tuple(weight.shape)})")
        return weight.shape[0], weight.shape[1]
    raise ValueError(f"{name}: expected (G*N, K/2) or (G, N, K/2), got shape {tuple(weight.shape)}")


def _as_groups(t, name: str, g: int, n: int, cols: int, device):
    """t (G*N, cols) or (G, N, cols) on `device` -> (G, N, cols)."""
    if tuple(t.shape) not in ((g * n, cols), (g, n, cols)):
        raise ValueError(f"{name}: expected shape {(g * n, cols)} or {(g, n, cols)}, "
                         f"got {tuple(t.shape)}")
    _same_device(t, name, device)
    return t.reshape(g, n, cols)


def _checkpoint(weight, scale, scale_name: str, scale_view: str, groups, fmt: str):
    """A checkpoint's codes and block scales (2-D stacked over `groups`, or
    3-D) -> uint8 (G, N, K/2), (G, N, K/block), checked."""
    block = ref.BLOCKS[fmt]
    weight = _byte_tensor(weight, "weight", "float4_e2m1fn_x2")
    g, n = _rows_of(weight, positive_int("groups", groups))
    k = 2 * weight.shape[-1]
    if k % block:
        raise ValueError(f"weight: K = {k} (2 x {weight.shape[-1]} bytes per row) must be a "
                         f"multiple of {block} for {fmt.upper()}")
    scales = _as_groups(_byte_tensor(scale, scale_name, scale_view), scale_name, g, n, k // block,
                        weight.device)
    return weight.reshape(g, n, k // 2), scales


def _per_group(v, name: str, g: int, device):
    """A float32 scale per group: a number or a float32 tensor of shape (),
    (1,), (G,) or (G, 1) on `device` -> float32 (G,) (one value: every
    group), a copy, detached from autograd. Each value must be a finite
    positive float32 (the rule of from_float's gs: check_gs_number), since
    0, a negative, NaN or Inf would load as zero, sign-flipped or NaN
    weights. Reads the values (a host sync for a CUDA tensor: load time)."""
    import torch
    if is_number(v) or isinstance(v, (bool, np.bool_)):
        return torch.full((g,), check_gs_number(v, name), dtype=torch.float32, device=device)
    require_array(v, name)
    if not is_torch(v):
        raise TypeError(f"{name}: expected a number or a torch tensor, got {type(v).__name__}")
    if v.dtype != torch.float32:
        raise TypeError(f"{name}: dtype {_dtype_name(v.dtype)} is not supported (expected float32)")
    if tuple(v.shape) not in ((), (1,), (g,), (g, 1)):
        raise ValueError(f"{name}: expected shape (), (1,), ({g},) or ({g}, 1), got {tuple(v.shape)}")
    _same_device(v, name, device)
    for f in v.reshape(-1).tolist():
        check_gs_number(f, name)
    # (a copy: a (G,) or (G, 1) tensor's .contiguous() was the caller's own
    # memory, so a later in-place change of the checkpoint tensor changed
    # the weight's global scales, not its codes; detached: an nn.Parameter's
    # clone kept requires_grad and a grad_fn, and dequantize() raised)
    return v.detach().reshape(-1).expand(g).clone(memory_format=torch.contiguous_format)


def _group_gs_list(gs, g: int) -> list[float]:
    """from_float's gs: a number, or G numbers (a sequence or tensor), each a
    finite positive float32 (rawkv._args.check_gs_number)."""
    if is_number(gs) or isinstance(gs, (bool, np.bool_)):
        vals = [gs] * g
    else:
        try:
            vals = gs.reshape(-1).tolist() if hasattr(gs, "reshape") else list(gs)
        except TypeError:
            raise TypeError(f"gs: expected a number or {g} numbers, got {type(gs).__name__}") from None
        if len(vals) != g:
            raise ValueError(f"gs: expected {g} values (one per group), got {len(vals)}")
    return [check_gs_number(v, "gs") for v in vals]


def check_packed_scales(fmt: str, n: int, k: int, scales, exp_range):
    """The packed scales' rules the kernels rely on that the reference does
    not read (docs/gemm.md, "Packed form"), for a weight given packed: the
    columns past K hold the padding byte (the kernels multiply them by the
    zero activations past K: a NaN factor there made every output NaN on the
    GPU alone); an MXFP4 block's two copies (one per 16-column half) agree
    (each lane of the mma.sync kernel applies its own); and its real blocks'
    bytes lie in `exp_range` where one is given, which the kernels' factor
    arithmetic assumes (None: unknown, and the ops refuse the weight:
    _rules.mx_span). Returns the exp_range (None for NVFP4). A
    ValueError naming `scales` or `exp_range` otherwise; reads the scales
    (a host sync: load time)."""
    import torch
    g, t, c = scales.shape[:3]
    if scales.numel() == 0:
        return exp_range
    by_unit = scales.reshape(g, t, c, 8, 4, 2)            # (.., chunk, row % 8, 16-column unit, row half)
    dev = scales.device
    col = (torch.arange(c, device=dev)[:, None, None, None] * ref.CHUNK
           + 16 * torch.arange(4, device=dev)[None, None, :, None]).expand(c, 8, 4, 2)
    pad = ref.SCALE_PAD[ref.BLOCKS[fmt]]
    pad = int(ref.NV_FACTOR_OF_E4M3[pad]) if fmt == "nvfp4" else pad
    if bool(by_unit.masked_select(col >= k).ne(pad).any()):
        raise ValueError(f"scales: the packed scales of the columns past K = {k} must be the padding byte "
                         f"{pad:#04x} (pack through Fp4Weight.from_float / from_nvfp4 / from_mxfp4)")
    if fmt != "mxfp4":
        return exp_range
    # (Rows past N: computed, never stored; their bytes are not the weight's.)
    row = (torch.arange(t, device=dev)[:, None, None, None, None] * ref.ROWS
           + torch.arange(8, device=dev)[None, None, :, None, None]
           + 8 * torch.arange(2, device=dev)[None, None, None, None, :])
    stored = (row < n).expand(t, c, 8, 2, 2)
    if bool(by_unit[..., 0::2, :].ne(by_unit[..., 1::2, :]).masked_select(stored).any()):
        raise ValueError("scales: an MXFP4 block's two packed copies (its 16-column halves) must be the same "
                         "byte (pack through Fp4Weight.from_mxfp4)")
    if exp_range is None:
        return None
    real = by_unit.masked_select((row < n) & (col < k))
    rng = (int(real.min()), int(real.max())) if real.numel() else (127, 127)
    if not exp_range[0] <= rng[0] <= rng[1] <= exp_range[1]:
        raise ValueError(f"exp_range: {tuple(exp_range)} does not hold the weight's scale bytes, which span "
                         f"[{rng[0]}, {rng[1]}] (the kernels' factors assume it does)")
    return tuple(exp_range)


def check_nv_packed(codes, scales) -> None:
    """An NVFP4 weight's packed scales (docs/gemm.md, "Packed form"): each
    byte a factor byte of an E4M3 scale (rawkv.reference.gemm.NV_FACTOR_OF_E4M3:
    0 or 0x58 .. 0xE6, and 0xFF for NaN), and a block whose byte is 0 has
    zero codes (the kernels read it as 2^-20 in BF16, 0 in FP16; its values
    are zeros). A ValueError naming `scales` or `codes` otherwise. Reads
    both tensors (a host sync: load time)."""
    import torch
    # (A histogram of the bytes: no temporary the size of the weight, which
    # moved later allocations and with them the GEMM's speed in a benchmark.)
    counts = torch.bincount(scales.reshape(-1), minlength=256).cpu().numpy()
    if counts[~ref.NV_FACTOR_VALID].any():
        raise ValueError("scales: an NVFP4 weight's packed scales must be factor bytes of E4M3 scales "
                         "(rawkv.gemm.pack_scales of bytes 0x00 .. 0x7E); got other bytes")
    if codes.numel() and counts[0]:
        zero = scales.eq(0)                                        # (G, T, C, lane, row half)
        # Only the records under a zero scale are read.
        g, t, c, lane, half = zero.nonzero(as_tuple=True)
        slot = torch.as_tensor(ref.SLOT_OF_LANE, device=codes.device)[lane]
        rec = codes[g, t, c, slot]                                  # (Z, 16)
        r0 = torch.as_tensor(np.tile(ref.R0_BITS_OF_BYTE, 4).astype(np.uint8), device=codes.device)
        bits = torch.where(half.unsqueeze(-1) == 0, rec & r0, rec & ~r0)   # the half's rows' code bits
        if bool(bits.ne(0).any()):
            raise ValueError("codes: an NVFP4 block whose packed scale is zero must have zero codes "
                             "(pack through Fp4Weight.from_nvfp4 / from_float, which zero them)")


class Fp4Weight:
    """An FP4 weight of `groups` groups, each `n x k`, packed (docs/gemm.md).

    fmt: 'nvfp4' | 'mxfp4'; codes uint8 (G, NP/16, C, 32, 16), scales uint8
    (G, NP/16, C, 32, 2): packed; gs float32 (G,) (ones for MXFP4);
    input_scale float32 (G,) or None (ModelOpt's activation scale, carried,
    not applied); exp_range (min, max) of the MXFP4 scale bytes (None for
    NVFP4; (127, 127) when there are none). Build one with from_float,
    from_nvfp4 or from_mxfp4; the constructor takes packed tensors as they
    are and checks their sizes (n, k ints >= 0, K a multiple of the block),
    types (torch tensors, codes and scales uint8; exp_range None or two
    ints) and shapes, gs's values (finite positive float32s, the loaders'
    rule), and for NVFP4 the packed scales' rule (check_nv_packed: a
    host sync, load time)."""

    def __init__(self, fmt: str, n: int, k: int, codes, scales, gs, input_scale=None,
                 exp_range=None, *, checked=False):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
        # (sizes the packed form can have: a float, a bool, a negative or a K
        # off the format's blocks was taken, and unpack / dequantize /
        # w4a8_weight / the ops then failed naming an argument not passed)
        n, k = ref.check_size(n, "n"), ref.check_size(k, "k")
        if k % ref.BLOCKS[fmt]:
            raise ValueError(f"k: K = {k} must be a multiple of {ref.BLOCKS[fmt]} for {fmt.upper()}")
        # (what the tensors are, before anything reads them: a numpy array, a
        # list or None failed with an AttributeError, float8 scales in torch's
        # bincount, a malformed exp_range with an IndexError, naming nothing)
        codes, scales = _packed_bytes(codes, "codes"), _packed_bytes(scales, "scales")
        _torch_tensor(gs, "gs")
        if input_scale is not None:
            _torch_tensor(input_scale, "input_scale")
        exp_range = _exp_range(exp_range)
        if codes.dim() == 0:
            raise ValueError("codes: expected shape (G, NP/16, C, 32, 16), got ()")
        g = codes.shape[0]
        npad, chunks = ref.padded_sizes(n, k)
        tile = (g, npad // ref.ROWS, chunks, ref.LANES)
        for name, t, shape in (("codes", codes, (*tile, 16)), ("scales", scales, (*tile, 2)),
                               ("gs", gs, (g,))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if input_scale is not None and tuple(input_scale.shape) != (g,):
            raise ValueError(f"input_scale: expected shape {(g,)}, got {tuple(input_scale.shape)}")
        if not checked:
            # (the loaders' rule for a global scale, _per_group: with gs = inf
            # the CPU's dequantized zero codes were 0 * inf = NaN in every
            # output of the group, where the kernels, applying gs to the FP32
            # sum, give +-inf; a host sync, load time)
            for f in gs.detach().reshape(-1).tolist():
                check_gs_number(f, "gs")
            exp_range = check_packed_scales(fmt, n, k, scales, exp_range)
            if fmt == "nvfp4":
                check_nv_packed(codes, scales)
        self.fmt, self.groups, self.n, self.k = fmt, g, n, k
        self.codes, self.scales, self.gs = codes, scales, gs
        self.input_scale = input_scale
        self.exp_range = exp_range

    @property
    def block(self) -> int:
        """Elements along K per block scale: 16 (NVFP4) or 32 (MXFP4)."""
        return ref.BLOCKS[self.fmt]

    @property
    def device(self):
        return self.codes.device

    def __repr__(self) -> str:
        extra = f", exp_range={self.exp_range}" if self.exp_range is not None else ""
        return (f"Fp4Weight({self.fmt}, groups={self.groups}, n={self.n}, k={self.k}, "
                f"device={self.device}{extra})")

    # -- constructors ------------------------------------------------------------

    @classmethod
    def _packed(cls, fmt, codes, scales, gs, input_scale=None, exp_range=None):
        """From the unpacked form (G, N, K/2), (G, N, K/block) on one device.
        An NVFP4 block whose scale is zero packs with zero codes (its values
        are zeros either way; the kernels read its scale byte 0 as 2^-20 in
        BF16: docs/gemm.md, "Packed form")."""
        n, k = codes.shape[1], 2 * codes.shape[2]
        if fmt == "nvfp4":
            codes = codes * (scales != 0).repeat_interleave(8, dim=-1).to(codes.dtype)
        return cls(fmt, n, k, pack.pack_codes(codes), pack.pack_scales(scales, ref.BLOCKS[fmt]),
                   gs, input_scale, exp_range, checked=True)

    @classmethod
    def from_float(cls, w, *, gs=None) -> "Fp4Weight":
        """Quantize w (G, N, K) or (N, K) (float32 / bfloat16 / float16, CPU
        or CUDA) to NVFP4 along K, each group with rawkv.nvfp4.quantize: its
        own ModelOpt global scale (scope 'tensor') when gs is None, else the
        given one (a number for all groups, or G numbers), so the bytes are
        ModelOpt's NVFP4QTensor.quantize bytes of each group."""
        _torch_tensor(w, "w")
        import torch

        from .. import nvfp4
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"w: dtype {_dtype_name(w.dtype)} is not supported "
                            "(expected float32, bfloat16, float16)")
        if w.dim() not in (2, 3):
            raise ValueError(f"w: expected (G, N, K) or (N, K), got shape {tuple(w.shape)}")
        w3 = (w if w.dim() == 3 else w.unsqueeze(0)).contiguous()
        g, n, k = w3.shape
        if g == 0:
            raise ValueError(f"w: expected at least one group, got shape {tuple(w.shape)}")
        if k % 16:
            raise ValueError(f"w: K ({k}) must be a multiple of 16 for NVFP4 (no silent padding)")
        given = None if gs is None else _group_gs_list(gs, g)
        parts = [nvfp4.quantize(w3[i], scope="tensor") if given is None
                 else nvfp4.quantize(w3[i], scope="given", gs=given[i]) for i in range(g)]
        codes, scales = (torch.stack([p[j].view(torch.uint8) for p in parts]) for j in (0, 1))
        # A block holding inf or NaN quantizes to the flagged scale 0x7F (NaN): the loaders refuse
        # those bytes (from_nvfp4), so this does too rather than load NaN weights (a host sync:
        # load time).
        flagged = int(scales.gt(NV_SCALE_MAX).sum())
        if flagged:
            raise ValueError(f"w: {flagged} block(s) of 16 hold inf or NaN, which NVFP4 cannot hold "
                             "(their scales would load as NaN)")
        gsv = torch.stack([s.reshape(()) for _, _, s in parts]).to(torch.float32)
        return cls._packed("nvfp4", codes, scales, gsv)

    @classmethod
    def from_nvfp4(cls, weight, weight_scale, weight_scale_2, input_scale=None, *,
                   groups: int = 1) -> "Fp4Weight":
        """ModelOpt's NVFP4 export, bytes moved, nothing dequantized: weight
        uint8 (or float4_e2m1fn_x2) (G*N, K/2) or (G, N, K/2); weight_scale
        float8_e4m3fn (or uint8) (G*N, K/16) or (G, N, K/16); weight_scale_2
        float32 () / (1,) / (G,) / (G, 1) (or a number); input_scale None or
        the same forms. groups: G for the 2-D (stacked) form. Refused: block
        scale bytes above NV_SCALE_MAX (NaN or negative), and global scales
        that are not finite positive float32s."""
        codes, scales = _checkpoint(weight, weight_scale, "weight_scale", "float8_e4m3fn", groups,
                                    "nvfp4")
        top = int(scales.max()) if scales.numel() else 0
        if top > NV_SCALE_MAX:
            raise ValueError(f"weight_scale: NVFP4 block scales must be finite and non-negative E4M3 "
                             f"(bytes 0x00 .. {NV_SCALE_MAX:#04x}); got byte {top:#04x} (NaN or negative)")
        g, dev = codes.shape[0], codes.device
        gs = _per_group(weight_scale_2, "weight_scale_2", g, dev)
        inp = None if input_scale is None else _per_group(input_scale, "input_scale", g, dev)
        return cls._packed("nvfp4", codes, scales, gs, inp)

    @classmethod
    def from_mxfp4(cls, weight, scale, *, groups: int = 1) -> "Fp4Weight":
        """MXFP4 as DeepSeek ships it: weight uint8 (or float4_e2m1fn_x2)
        (G*N, K/2) or (G, N, K/2), scale uint8 (or float8_e8m0fnu) (G*N, K/32)
        or (G, N, K/32). Scale bytes outside MX_WINDOW are refused (the
        kernel's dequantization is exact only inside it); exp_range records
        the bytes' range for the FP16-activation window MX_WINDOW_FP16."""
        codes, scales = _checkpoint(weight, scale, "scale", "float8_e8m0fnu", groups, "mxfp4")
        import torch
        if scales.numel():
            lo, hi = torch.aminmax(scales.reshape(-1))
            rng = (int(lo), int(hi))
        else:
            rng = (127, 127)
        if rng[0] < MX_WINDOW[0] or rng[1] > MX_WINDOW[1]:
            raise ValueError(f"scale: MXFP4 scale bytes must lie in [{MX_WINDOW[0]}, {MX_WINDOW[1]}] "
                             f"(2^{MX_WINDOW[0] - 127} .. 2^{MX_WINDOW[1] - 127}), where the GEMM "
                             f"dequantizes exactly; got bytes in [{rng[0]}, {rng[1]}]")
        gs = torch.ones((codes.shape[0],), dtype=torch.float32, device=codes.device)
        return cls._packed("mxfp4", codes, scales, gs, exp_range=rng)

    # -- back out ----------------------------------------------------------------

    def unpack(self):
        """(codes (G, N, K/2) uint8, scales (G, N, K/block) uint8, gs (G,)
        float32) on the weight's device: the checkpoint form, exactly, but
        for the codes of NVFP4 blocks whose scale is zero, which come back
        as zeros (the same values)."""
        # (gs a copy as the others are: it was the weight's own tensor, so a
        # change of the returned checkpoint form changed the weight)
        return (pack.unpack_codes(self.codes, self.n, self.k),
                pack.unpack_scales(self.scales, self.n, self.k, self.block), self.gs.clone())

    def dequantize(self):
        """float32 (G, N, K) on the weight's device: the reference's exact
        float64 values (rawkv.reference.gemm.dequantize_weight) rounded once
        to float32."""
        import torch
        codes, scales, gs = (t.cpu().numpy() for t in self.unpack())
        with np.errstate(over="ignore", under="ignore"):
            w = ref.dequantize_weight(codes, scales, gs, self.fmt).astype(np.float32)
        return torch.from_numpy(w).to(self.device)

    def to(self, device) -> "Fp4Weight":
        """A copy on `device` (the same bytes): 'cpu', 'cuda', 'cuda:N', a CUDA
        index or a torch.device (checked_device: no GPU stack is a
        rawkv.GpuUnavailableError)."""
        device = checked_device(device)
        # (copy=True: on the weight's own device t.to gave t itself, so the
        # "copy" shared every tensor with the weight)
        mv = (lambda t: None if t is None else t.to(device, copy=True))
        return Fp4Weight(self.fmt, self.n, self.k, mv(self.codes), mv(self.scales), mv(self.gs),
                         mv(self.input_scale), self.exp_range, checked=True)
