"""opcheck samples and compiled steps of the fused operators (rawkv.fused;
tests/guards/test_library*.py collect them). Outputs are uint8 buffers where the op
returns FP4 / FP8 views: opcheck compares buffers with allclose, which has
no float8 kernel on CPU. The FP8 producers' samples are in their test file
(tests/fused/test_quantize_fp8.py, opcheck_samples); their compiled step is here."""
import numpy as np
import torch

F32, U8 = torch.float32, torch.uint8


def _t(rng, shape, dtype, device, scale=1.0, lo=None):
    a = rng.standard_normal(shape) * scale if lo is None else rng.uniform(lo, lo + 1, shape)
    return torch.from_numpy(a.astype(np.float32)).to(dtype).to(device)


def _outs(lead, n, gs_shape, device, inv=True):
    """Buffers (q, sf, gs_out[, inv_rms]) of a row producer's result."""
    o = (torch.empty((*lead, n // 2), dtype=U8, device=device), torch.empty((*lead, n // 16), dtype=U8, device=device),
         torch.empty(gs_shape, dtype=F32, device=device))
    return o + (torch.empty(lead, dtype=F32, device=device),) if inv else o


def samples(rng, device="cpu"):
    gs_t = torch.tensor([0.0123], device=device)
    bf, fp = torch.bfloat16, torch.float16
    x = _t(rng, (3, 64), bf, device, 2.0)
    x3 = _t(rng, (2, 3, 128), fp, device)
    w = _t(rng, (64,), F32, device, lo=0.5)
    X = _t(rng, (3, 2, 64), bf, device)
    mix = _t(rng, (3, 2), F32, device, lo=0.0)
    h = _t(rng, (3, 128), bf, device, 2.0)
    h16 = _t(rng, (2, 2, 192), fp, device)
    hid = _t(rng, (4, 256), bf, device)
    ids = torch.from_numpy(rng.integers(0, 64, (4, 2), dtype=np.int32)).to(device)
    wts = _t(rng, (4, 2), F32, device, lo=0.0)
    # (..., scope, gs, gs_value, outputs): every scope, a number and a tensor gs
    return {
        "rmsnorm_quantize": [
            (x, w, 1e-6, "row", None, None, *_outs((3,), 64, (3,), device)),
            (x, w, 1e-5, "tensor", None, None, *_outs((3,), 64, (), device)),
            (x3, _t(rng, (128,), bf, device, lo=0.5), 1e-6, "given", None, 0.05, *_outs((2, 3), 128, (), device)),
            (x, w, 1e-6, "given", gs_t, None, *_outs((3,), 64, (1,), device)),
            (x, w.half(), 1e-6, "none", None, None, *_outs((3,), 64, (), device)),
            (x[:0], w, 1e-6, "tensor", None, None, *_outs((0,), 64, (), device)),
        ],
        "mhc_rmsnorm_quantize": [
            (X, mix, w, 1e-6, "row", None, None, *_outs((3,), 64, (3,), device)),
            (X, mix.bfloat16(), w, 1e-6, "tensor", None, None, *_outs((3,), 64, (), device)),
            (X, mix, w, 1e-6, "given", gs_t, None, *_outs((3,), 64, (), device)),
            (X, mix, w, 1e-6, "none", None, None, *_outs((3,), 64, (), device)),
            (X[:0], mix[:0], w, 1e-6, "row", None, None, *_outs((0,), 64, (0,), device)),
            # a number gs (gs_value); float16 streams with a float16 weight
            (X, mix, w, 1e-6, "given", None, 0.05, *_outs((3,), 64, (), device)),
            (X.half(), mix, w.half(), 1e-5, "tensor", None, None, *_outs((3,), 64, (), device)),
        ],
        "swiglu_quantize": [
            (h, 8, "row", None, None, *_outs((3,), 64, (3,), device, False)),
            (h, 4, "tensor", None, None, *_outs((3,), 64, (), device, False)),
            (h16, 6, "given", None, 0.02, *_outs((2, 2), 96, (), device, False)),
            (h, 8, "given", gs_t, None, *_outs((3,), 64, (1,), device, False)),
            (h, 16, "none", None, None, *_outs((3,), 64, (), device, False)),
            (h[:0], 8, "row", None, None, *_outs((0,), 64, (0,), device, False)),          # no rows
        ],
        "moe_stage": [
            (hid, ids, wts, torch.empty((4, 128), dtype=U8, device=device),
             torch.empty((4, 4), dtype=torch.int32, device=device),
             torch.empty((4, 2), dtype=torch.int64, device=device), torch.empty((4, 2), dtype=F32, device=device)),
            (hid.half(), ids.long(), wts.bfloat16(), torch.empty((4, 128), dtype=U8, device=device),
             torch.empty((4, 4), dtype=torch.int32, device=device),
             torch.empty((4, 2), dtype=torch.int64, device=device),
             torch.empty((4, 2), dtype=torch.bfloat16, device=device)),
            # no tokens
            (hid[:0], ids[:0], wts[:0], torch.empty((0, 128), dtype=U8, device=device),
             torch.empty((0, 4), dtype=torch.int32, device=device),
             torch.empty((0, 2), dtype=torch.int64, device=device), torch.empty((0, 2), dtype=F32, device=device)),
        ],
    }


def _rms(rng, device):
    x = _t(rng, (2, 5, 512), torch.bfloat16, device, 3.0)
    w = _t(rng, (512,), F32, device, lo=0.5)

    def step(x, w):
        import rawkv
        return rawkv.fused.rmsnorm_quantize(x * 2, w, 1e-5)        # a torch op (exact) in the graph
    return step, (x, w)


def _mhc(rng, device):
    X = _t(rng, (3, 4, 256), torch.bfloat16, device)
    mix = _t(rng, (3, 4), F32, device, lo=0.0)
    w = _t(rng, (256,), torch.bfloat16, device, lo=0.5)
    gs = torch.tensor([0.004], device=device)

    def step(X, mix, w, gs):
        import rawkv
        a = rawkv.fused.mhc_rmsnorm_quantize(X, mix, w, gs=gs)     # a device gs
        b = rawkv.fused.mhc_rmsnorm_quantize(X, mix, w, scope="tensor")
        return a, b
    return step, (X, mix, w, gs)


def _swiglu(rng, device):
    h = _t(rng, (4, 1024), torch.float16, device, 2.0)

    def step(h):
        import rawkv
        qa = rawkv.fused.swiglu_quantize(h, 8)
        return qa, rawkv.fused.swiglu_quantize(h, 4, gs=0.0021)    # a number gs
    return step, (h,)


def _moe(rng, device):
    hid = _t(rng, (6, 512), torch.bfloat16, device)
    ids = torch.from_numpy(rng.integers(0, 256, (6, 8), dtype=np.int32)).to(device)
    wts = _t(rng, (6, 8), F32, device, lo=0.0)

    def step(hid, ids, wts):
        import rawkv
        st = rawkv.fused.moe_stage(hid, ids, wts * 0.5)            # exact: the same bits under inductor
        return st.q, st.sf, st.topk_ids, st.topk_weights
    return step, (hid, ids, wts)


def _fp8(rng, device):
    """Every FP8 producer in one step, E8M0 scales (returned as float8_e8m0fnu
    views of the bytes the operators write) and FP32 ones."""
    x = _t(rng, (2, 5, 512), torch.bfloat16, device, 3.0)
    X = _t(rng, (3, 2, 256), torch.bfloat16, device)
    mix = _t(rng, (3, 2), F32, device, lo=0.0)
    w = _t(rng, (512,), F32, device, lo=0.5)
    h = _t(rng, (4, 1024), torch.float16, device, 2.0)
    hid = _t(rng, (6, 512), torch.bfloat16, device)
    ids = torch.from_numpy(rng.integers(0, 256, (6, 8), dtype=np.int32)).to(device)

    def step(x, X, mix, w, h, hid, ids):
        import rawkv
        F = rawkv.fused
        return (F.rmsnorm_quantize_fp8(x * 2, w, scale_format="ue8m0"),          # a torch op (exact) in the graph
                F.mhc_rmsnorm_quantize_fp8(X, mix, w[:256], block=64),
                F.swiglu_quantize_fp8(h, 8, block=32, scale_format="ue8m0"),
                F.moe_stage_fp8(hid, ids, mix.new_ones(6, 8), scale_format="ue8m0"))
    return step, (x, X, mix, w, h, hid, ids)


# (name, make(rng, device) -> (step function, its arguments)): compiled with
# fullgraph=True, the step must give the same bits as eager
STEPS = [("fused_rmsnorm_quantize", _rms), ("fused_mhc_rmsnorm_quantize", _mhc),
         ("fused_swiglu_quantize", _swiglu), ("fused_moe_stage", _moe), ("fused_fp8_outputs", _fp8)]
