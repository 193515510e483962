"""rawkv.gemm.Fp4GroupedLinear: DeepSeek-V4's wo_a as one object (seed
004's Nvfp4GroupedLinear, on every GPU from sm_80): set a BF16 weight or
load a checkpoint once, then call it on each step. The output buffer is
allocated once, at construction, so a call allocates nothing and can be
captured in a CUDA graph."""
from __future__ import annotations

from .._args import is_torch, positive_int
from ._rules import _LARGE_TILE_TOKENS, MAX_GRID_YZ, MAX_NK
from .linear import grouped_linear
from .w4a8 import W4a8Weight, w4a8_weight
from .weights import Fp4Weight, checked_device, require_torch


class Fp4GroupedLinear:
    """out (T, G, N) = x (T, G, K) . weight[g]^T per group, FP4 weights.

    groups G, in_features K, out_features N per group; max_tokens bounds T
    (the output buffer's size). Calls return a view of that buffer (rows
    [0, T)), overwritten by the next call: copy it to keep it, or pass out=."""

    def __init__(self, groups: int, in_features: int, out_features: int, *, max_tokens: int,
                 device="cuda"):
        torch = require_torch("rawkv.gemm.Fp4GroupedLinear")
        groups, in_features, out_features, max_tokens = (
            positive_int(name, v) for name, v in (("groups", groups), ("in_features", in_features),
                                           ("out_features", out_features), ("max_tokens", max_tokens)))
        if in_features % 16:
            raise ValueError(f"in_features: {in_features} is not a multiple of 16 (NVFP4 blocks)")
        # (sizes no weight or call could have, named before the buffer is
        # allocated: torch's overflow / allocation error named nothing, and
        # an in_features of 2**64 made a layer that refused every weight)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if v >= MAX_NK:
                raise ValueError(f"{name}: {v} is not below 2^27 = {MAX_NK} (the GEMM kernels' 32-bit "
                                 "arithmetic; no weight of that size is taken)")
        if groups > MAX_GRID_YZ:
            raise ValueError(f"groups: {groups} is past the launch grid's limit of {MAX_GRID_YZ} groups")
        if -(-max_tokens // _LARGE_TILE_TOKENS) > MAX_GRID_YZ:
            raise ValueError(f"max_tokens: {max_tokens} is past the launch grid's limit of "
                             f"{MAX_GRID_YZ * _LARGE_TILE_TOKENS} tokens a call")
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.max_tokens = max_tokens
        self.weight: Fp4Weight | W4a8Weight | None = None
        # (a plain tensor even when the layer is built under inference_mode,
        # as serving code builds it: torch lets nothing write an inference
        # tensor outside inference_mode, and the layer is called there too)
        with torch.inference_mode(False):
            self.out = torch.empty((max_tokens, groups, out_features), dtype=torch.bfloat16,
                                   device=checked_device(device))

    def set_weight(self, w, *, gs=None) -> "Fp4GroupedLinear":
        """Quantize a BF16/FP32 weight (G, N, K) to NVFP4 with ModelOpt's
        rules (gs per group: computed as ModelOpt does, or given)."""
        if is_torch(w):         # (anything else: from_float's error naming w)
            if w.dim() in (2, 3):       # (another rank: from_float's error naming w)
                # (before the copy and the quantization: a refused call does nothing)
                self._check_sizes("w", tuple(w.shape) if w.dim() == 3 else (1, *w.shape))
            w = w.to(self.out.device)
        self._set(Fp4Weight.from_float(w, gs=gs), "w")
        return self

    def load_nvfp4(self, weight, weight_scale, weight_scale_2, input_scale=None) -> "Fp4GroupedLinear":
        """A ModelOpt NVFP4 checkpoint's tensors, stacked (G*N, ...) or (G, N, ...)."""
        self._check_codes(weight)
        w = Fp4Weight.from_nvfp4(weight, weight_scale, weight_scale_2, input_scale, groups=self.groups)
        self._set(self._here(w), "weight")
        return self

    def load_mxfp4(self, weight, scale, *, w4a8: bool = False) -> "Fp4GroupedLinear":
        """MXFP4 codes and UE8M0 scales as DeepSeek ships FP4 weights. With
        w4a8=True the layer keeps the weight's W4A8 form (rawkv.gemm.w4a8_weight:
        a ValueError naming the blocks E4M3 cannot hold exactly) and its calls
        take FP8 block activations, (codes, scales) from
        rawkv.fp8.quantize_blocks, on the W4A8 GEMM (sm_90; docs/gemm.md).
        w4a8 is a bool (a TypeError naming it before anything is read: any
        truthy value chose the form, and a string 'False' the W4A8 one)."""
        if not isinstance(w4a8, bool):
            raise TypeError(f"w4a8: expected a bool, got {type(w4a8).__name__}")
        self._check_codes(weight)
        w = self._here(Fp4Weight.from_mxfp4(weight, scale, groups=self.groups))
        # (every check, the W4A8 form's included, before the weight is
        # replaced: a refused load leaves the layer as it was)
        self._set(w, "weight", w4a8_weight(w) if w4a8 else w)
        return self

    def _here(self, w: Fp4Weight) -> Fp4Weight:
        """w, built by a loader, on the layer's device (Fp4Weight.to copies:
        not when w is there already)."""
        return w if w.device == self.out.device else w.to(self.out.device)

    def _check_sizes(self, name: str, got: tuple) -> None:
        """The (groups, out_features, in_features) `got` of the weight the
        user passed as `name` against the layer's: a ValueError naming it,
        checked before the weight is copied, quantized or packed."""
        want = (self.groups, self.out_features, self.in_features)
        if got != want:
            raise ValueError(f"{name}: (groups, out_features, in_features) {got}, the layer was built for {want}")

    def _check_codes(self, weight) -> None:
        """A checkpoint's codes against the layer's sizes (_check_sizes),
        before the loader reads them: (G, N, K/2), or (G*N, K/2) stacked
        over the layer's G groups. (The loader, given groups=G, named
        `groups` for a weight of other groups, which the user did not pass.)
        Anything but a 2-D or 3-D tensor: the loader's error naming it."""
        if not is_torch(weight) or weight.dim() not in (2, 3):
            return
        s = tuple(weight.shape)
        if len(s) == 3:
            self._check_sizes("weight", (s[0], s[1], 2 * s[2]))
        elif s != (self.groups * self.out_features, self.in_features // 2):
            raise ValueError(f"weight: expected shape {(self.groups * self.out_features, self.in_features // 2)} "
                             f"(groups x out_features rows of in_features / 2 bytes) or "
                             f"{(self.groups, self.out_features, self.in_features // 2)}, got {s}")

    def _set(self, w: Fp4Weight, name: str, keep=None) -> None:
        """Hold `keep` (w itself by default; its W4A8 form for
        load_mxfp4(w4a8=True)), w's sizes checked against the layer's. A
        weight of the held one's form (same_form) is copied into the held
        tensors, in place: a CUDA graph captured with the layer keeps
        reading the addresses it was captured with, so a reload that
        swapped in new tensors left its replays reading the old weight's
        freed memory. Any other form replaces the weight (re-capture)."""
        self._check_sizes(name, (w.groups, w.n, w.k))
        new = w if keep is None else keep
        if same_form(self.weight, new):
            # (under inference_mode: a weight loaded there has inference
            # tensors, which torch lets nothing change in place outside it,
            # so a reload outside raised; plain tensors take the copy either way)
            with require_torch("rawkv.gemm.Fp4GroupedLinear").inference_mode():
                for old_t, new_t in zip(_tensors(self.weight), _tensors(new)):
                    old_t.copy_(new_t)
            return
        self.weight = new

    def __call__(self, x, *, out=None, stream=None):
        if self.weight is None:
            raise RuntimeError("Fp4GroupedLinear: no weight yet; call set_weight / load_nvfp4 / load_mxfp4")
        # (x: a tensor, a QuantizedActivation's q, FP8 activations' codes)
        lead = x.q if hasattr(x, "q") else x.codes if hasattr(x, "codes") else \
            x[0] if isinstance(x, (tuple, list)) and len(x) == 2 else x
        shape = getattr(lead, "shape", ())
        if out is None and len(shape) == 3:     # (another rank: grouped_linear's error naming x's shape)
            tokens = shape[0]
            if tokens > self.max_tokens:
                raise ValueError(f"x: {tokens} tokens, the layer was built for max_tokens={self.max_tokens}")
            out = self.out[:tokens]
        return grouped_linear(x, self.weight, out=out, stream=stream)


def _fields(w) -> dict:
    return w._asdict() if isinstance(w, tuple) else vars(w)


def _tensors(w) -> list:
    return [v for v in _fields(w).values() if is_torch(v)]


def same_form(old, new) -> bool:
    """Whether `new` can be copied into `old`'s tensors: the same class and
    the same non-tensor fields (format, sizes, MXFP4 exp_range), and in each
    tensor field either None in both or tensors of one shape, dtype,
    strides and device."""
    if old is None or type(old) is not type(new):
        return False
    a, b = _fields(old), _fields(new)
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if is_torch(x) or is_torch(y):
            if not (is_torch(x) and is_torch(y) and x.shape == y.shape and x.dtype == y.dtype
                    and x.stride() == y.stride() and x.device == y.device):
                return False
        elif x != y:
            return False
    return True
