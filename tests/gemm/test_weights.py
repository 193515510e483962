"""rawkv.gemm: the torch packer against the reference (rawkv.reference.gemm,
which docs/gemm.md's table pins in tests/gemm/test_reference.py), and
Fp4Weight's constructors: from_float follows rawkv.nvfp4.quantize per group
(ModelOpt's rules, so ModelOpt's bytes: checked against nvidia-modelopt when
it is installed), from_nvfp4 takes ModelOpt's export tensors as they are,
from_mxfp4 refuses scale bytes outside the kernel's exact window
(docs/gemm.md, "MXFP4 exponent window")."""
from __future__ import annotations

import importlib.metadata
import warnings

import numpy as np
import pytest

import rawkv
from rawkv.gemm import MX_WINDOW, Fp4Weight, pack
from rawkv.reference import gemm as R

torch = pytest.importorskip("torch")

SHAPES = [(1, 1, 16), (1, 16, 64), (3, 37, 208), (2, 50, 96), (4, 8, 320)]


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("g,n,k", SHAPES)
def test_torch_packer_equals_reference(rng, g, n, k):
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    packed = pack.pack_codes(_t(codes))
    np.testing.assert_array_equal(packed.numpy(), R.pack_codes(codes))
    np.testing.assert_array_equal(pack.unpack_codes(packed, n, k).numpy(), codes)
    for block in (16, 32):
        if k % block:
            continue
        scales = rng.integers(0, 256, (g, n, k // block), dtype=np.uint8)
        ps = pack.pack_scales(_t(scales), block)
        np.testing.assert_array_equal(ps.numpy(), R.pack_scales(scales, block))
        # (NVFP4 bytes past the E4M3 scales a loader takes, 0x7F .. 0xFF, come back as NaN, 0x7F)
        back = np.where(scales >= 0x7F, 0x7F, scales) if block == 16 else scales
        np.testing.assert_array_equal(pack.unpack_scales(ps, n, k, block).numpy(), back)



def test_torch_packer_refuses_what_the_reference_refuses():
    # issue 21 item 10: the same table, the same errors, on torch tensors
    # (and a numpy array, the reference packer's, is a TypeError naming it)
    from gemm.test_reference import check_bad_packer_cases
    check_bad_packer_cases(pack, _t)
    for call in (lambda: pack.pack_codes(np.zeros((1, 16, 32), np.uint8)),
                 lambda: pack.unpack_scales(np.zeros((1, 1, 1, 32, 2), np.uint8), 16, 64, 16)):
        with pytest.raises(TypeError, match=r"^(codes|packed): expected a torch tensor, got ndarray"):
            call()

def _quantize_groups(w, gs=None):
    """rawkv.nvfp4.quantize of each group, stacked: (codes, scales, gs)."""
    parts = [rawkv.nvfp4.quantize(w[i], scope="tensor") if gs is None else
             rawkv.nvfp4.quantize(w[i], scope="given", gs=float(gs[i])) for i in range(w.shape[0])]
    return (torch.stack([p[0].view(torch.uint8) for p in parts]),
            torch.stack([p[1].view(torch.uint8) for p in parts]),
            torch.stack([p[2].reshape(()) for p in parts]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_float_is_quantize_per_group(rng, dtype):
    g, n, k = 3, 21, 80
    # groups of very different magnitudes: each gets its own gs
    w = _t(rng.standard_normal((g, n, k)) * np.array([1e-3, 1.0, 40.0])[:, None, None]).to(dtype)
    wt = Fp4Weight.from_float(w)
    assert (wt.fmt, wt.groups, wt.n, wt.k, wt.block) == ("nvfp4", g, n, k, 16)
    assert wt.exp_range is None and wt.input_scale is None
    codes, scales, gs = wt.unpack()
    want = _quantize_groups(w)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    assert gs.dtype == torch.float32 and torch.equal(gs, want[2])
    assert len(set(gs.tolist())) == g
    # packed as the reference packs
    np.testing.assert_array_equal(wt.codes.numpy(), R.pack_codes(want[0].numpy()))
    np.testing.assert_array_equal(wt.scales.numpy(), R.pack_scales(want[1].numpy(), 16))


def test_from_float_given_gs(rng):
    g, n, k = 2, 16, 32
    w = _t(rng.standard_normal((g, n, k)).astype(np.float32))
    per = [0.002, 0.0005]
    for gs in (per, torch.tensor(per), np.array(per, np.float32)):
        codes, scales, got = Fp4Weight.from_float(w, gs=gs).unpack()
        want = _quantize_groups(w, per)
        assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
        assert torch.equal(got, torch.tensor(per, dtype=torch.float32))
    one = Fp4Weight.from_float(w, gs=0.001)
    assert torch.equal(one.gs, torch.full((g,), 0.001, dtype=torch.float32))
    # (N, K): one group
    w2 = Fp4Weight.from_float(w[1])
    assert w2.groups == 1 and torch.equal(w2.unpack()[0][0], _quantize_groups(w[1:])[0][0])


def test_from_float_errors():
    w = torch.zeros(2, 8, 32)
    with pytest.raises(ValueError, match="^w:.*multiple of 16"):
        Fp4Weight.from_float(torch.zeros(2, 8, 40))
    with pytest.raises(TypeError, match="^w:"):
        Fp4Weight.from_float(w.to(torch.float64))
    with pytest.raises(TypeError, match="^w:"):
        Fp4Weight.from_float(w.numpy())
    with pytest.raises(ValueError, match="^w:"):
        Fp4Weight.from_float(torch.zeros(32))
    with pytest.raises(ValueError, match="^gs:.*2 values"):
        Fp4Weight.from_float(w, gs=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="^gs:"):
        Fp4Weight.from_float(w, gs=[0.1, -1.0])
    with pytest.raises(ValueError, match="^gs:"):
        Fp4Weight.from_float(w, gs=1e38)             # above the float32-input bound
    # inf / NaN elements: their blocks would load as NaN (from_nvfp4 refuses those scale bytes)
    for bad in (float("inf"), float("-inf"), float("nan")):
        wb = torch.ones(2, 8, 32)
        wb[1, 3, 20] = bad
        with pytest.raises(ValueError, match=r"^w: 1 block\(s\) of 16 hold inf or NaN"):
            Fp4Weight.from_float(wb, gs=1.0 if bad != bad else None)


def _checkpoint(rng, g, n, k):
    """ModelOpt-shaped NVFP4 export tensors of g groups stacked by rows."""
    w = _t(rng.standard_normal((g, n, k)).astype(np.float32))
    codes, scales, gs = _quantize_groups(w)
    return w, codes, scales, gs


@pytest.mark.parametrize("g,n,k", [(1, 24, 64), (3, 17, 48), (8, 32, 128)])
def test_from_nvfp4_forms(rng, g, n, k):
    _, codes, scales, gs = _checkpoint(rng, g, n, k)
    packed_codes, packed_scales = pack.pack_codes(codes), pack.pack_scales(scales, 16)
    e2m1, e4m3 = getattr(torch, "float4_e2m1fn_x2", torch.uint8), torch.float8_e4m3fn
    forms = [
        (codes.reshape(g * n, k // 2), scales.reshape(g * n, k // 16).view(e4m3), gs, g),
        (codes.view(e2m1), scales, gs.reshape(g, 1), 1),
        (codes.reshape(g * n, k // 2).view(e2m1), scales.reshape(g * n, k // 16), gs, g),
    ]
    for weight, ws, ws2, groups in forms:
        wt = Fp4Weight.from_nvfp4(weight, ws, ws2, gs * 2, groups=groups)
        assert (wt.groups, wt.n, wt.k) == (g, n, k)
        assert torch.equal(wt.codes, packed_codes) and torch.equal(wt.scales, packed_scales)
        assert torch.equal(wt.gs, gs) and torch.equal(wt.input_scale, gs * 2)
        back = wt.unpack()
        assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    # one weight_scale_2 / input_scale for every group (a scalar, as ModelOpt exports per tensor)
    wt = Fp4Weight.from_nvfp4(codes.reshape(g * n, -1), scales.reshape(g * n, -1),
                              torch.tensor(0.5), torch.tensor([0.25]), groups=g)
    assert torch.equal(wt.gs, torch.full((g,), 0.5)) and torch.equal(wt.input_scale, torch.full((g,), 0.25))


def test_from_nvfp4_copies_the_global_scales(rng):
    # weight_scale_2 / input_scale of shape (G,) or (G, 1) were held as they
    # were (.contiguous() of the caller's tensor): a later in-place change of
    # the checkpoint tensor (a loader's reused buffer, a weight update copied
    # into the checkpoint parameters) changed the weight's global scales and
    # so the GEMM's output, while its packed codes and scales stayed
    g, n, k = 2, 8, 32
    c2, s2, gs = _stacked(rng, g, n, k)
    x = torch.randn(3, g, k).bfloat16()
    for shape in ((g,), (g, 1)):
        ws2, inp = gs.reshape(shape).clone(), torch.full(shape, 0.25)
        layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu").load_nvfp4(c2, s2, ws2, inp)
        y = layer(x).clone()
        ws2.fill_(1.0)
        inp.zero_()
        assert torch.equal(layer.weight.gs, gs) and torch.equal(layer.weight.input_scale, torch.full((g,), 0.25))
        assert torch.equal(layer(x), y)


def test_from_nvfp4_global_scales_held_without_autograd(rng):
    # A model's checkpoint tensors are often nn.Parameters (requires_grad
    # True): the weight held weight_scale_2 / input_scale as clones that kept
    # requires_grad and a grad_fn, so dequantize() (and anything else that
    # read them through numpy) raised "Can't call numpy() on Tensor that
    # requires grad", and to() / unpack() handed autograd tensors on
    g, n, k = 2, 8, 32
    c2, s2, gs = _stacked(rng, g, n, k)
    for ws2, inp in ((gs, gs * 2), (gs.reshape(g, 1), torch.tensor(0.25)), (torch.tensor(0.5), None)):
        wp = Fp4Weight.from_nvfp4(c2, s2, torch.nn.Parameter(ws2.clone()),
                                  None if inp is None else torch.nn.Parameter(inp.clone()), groups=g)
        want = Fp4Weight.from_nvfp4(c2, s2, ws2, inp, groups=g)
        for t in (wp.gs, wp.input_scale, wp.unpack()[2], wp.to("cpu").gs):
            assert t is None or (not t.requires_grad and t.grad_fn is None)
        assert torch.equal(wp.dequantize(), want.dequantize())


def test_from_nvfp4_errors(rng):
    g, n, k = 2, 8, 32
    _, codes, scales, gs = _checkpoint(rng, g, n, k)
    c2, s2 = codes.reshape(g * n, k // 2), scales.reshape(g * n, k // 16)
    cases = [
        ((c2.float(), s2, gs), dict(groups=g), TypeError, "^weight:"),
        ((c2, s2.float(), gs), dict(groups=g), TypeError, "^weight_scale:"),
        ((c2, s2, gs.double()), dict(groups=g), TypeError, "^weight_scale_2:"),
        ((c2, s2, gs[:1].expand(3).contiguous()), dict(groups=g), ValueError, "^weight_scale_2:"),
        ((c2, s2, gs, torch.ones(3)), dict(groups=g), ValueError, "^input_scale:"),
        ((c2, s2, gs), dict(groups=3), ValueError, "^groups:"),
        ((c2, s2, gs), dict(groups=0), ValueError, "^groups:"),
        ((c2, s2, gs), dict(groups=2.0), TypeError, "^groups:"),
        ((codes, scales, gs), dict(groups=3), ValueError, "^groups:"),
        ((c2, s2[:, :1], gs), dict(groups=g), ValueError, "^weight_scale:"),     # K mismatch
        ((c2, s2[:-1], gs), dict(groups=g), ValueError, "^weight_scale:"),        # rows
        ((c2[:, :4], s2[:, :1], gs), dict(groups=g), ValueError, "^weight:.*multiple of 16"),
        ((c2.reshape(-1), s2, gs), dict(groups=g), ValueError, "^weight:"),
        ((c2, None, gs), dict(groups=g), TypeError, "^weight_scale:"),
        ((codes[:0], scales[:0], gs), {}, ValueError, "^weight: has no groups"),    # (as from_float)
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            Fp4Weight.from_nvfp4(*args, **kw)


def _mx(rng, g, n, k, lo=110, hi=135):
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scales = rng.integers(lo, hi + 1, (g, n, k // 32), dtype=np.uint8)
    return _t(codes), _t(scales)


def test_from_mxfp4(rng):
    g, n, k = 3, 19, 96
    codes, scales = _mx(rng, g, n, k)
    wt = Fp4Weight.from_mxfp4(codes.reshape(g * n, -1), scales.reshape(g * n, -1).view(torch.float8_e8m0fnu),
                              groups=g)
    assert (wt.fmt, wt.block, wt.groups, wt.n, wt.k) == ("mxfp4", 32, g, n, k)
    assert wt.exp_range == (int(scales.min()), int(scales.max()))
    assert torch.equal(wt.gs, torch.ones(g)) and wt.input_scale is None
    np.testing.assert_array_equal(wt.scales.numpy(), R.pack_scales(scales.numpy(), 32))
    back = wt.unpack()
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    np.testing.assert_array_equal(
        wt.dequantize().numpy(),
        R.dequantize_weight(codes.numpy(), scales.numpy(), None, "mxfp4").astype(np.float32))


def test_from_mxfp4_window(rng):
    # docs/gemm.md, "MXFP4 exponent window": bytes in [4, 137] load; the
    # bytes' range is recorded for the FP16-activation window.
    codes, scales = _mx(rng, 1, 4, 64)
    for edge in MX_WINDOW:
        s = scales.clone()
        s[0, 1, 1] = edge
        assert edge in Fp4Weight.from_mxfp4(codes, s).exp_range
    for bad in (0, 3, 138, 254, 255):
        s = scales.clone()
        s[0, 2, 0] = bad
        with pytest.raises(ValueError, match=rf"^scale:.*\[4, 137\].*{bad}"):
            Fp4Weight.from_mxfp4(codes, s)
    with pytest.raises(ValueError, match="^weight:.*multiple of 32"):
        Fp4Weight.from_mxfp4(codes[..., :8], scales[..., :1])
    with pytest.raises(TypeError, match="^scale:"):
        Fp4Weight.from_mxfp4(codes, scales.view(torch.float8_e4m3fn))


@pytest.mark.parametrize("g,n,k", SHAPES)
def test_unpack_dequantize_to(rng, g, n, k):
    w = _t(rng.standard_normal((g, n, k)).astype(np.float32) * 3)
    wt = Fp4Weight.from_float(w)
    codes, scales, gs = wt.unpack()
    deq = wt.dequantize()
    assert deq.dtype == torch.float32 and deq.shape == (g, n, k)
    exact = R.dequantize_weight(codes.numpy(), scales.numpy(), gs.numpy(), "nvfp4")
    np.testing.assert_array_equal(deq.numpy(), exact.astype(np.float32))
    # NVFP4's error: at most half the widest E2M1 step (1, between 4 and 6)
    # times the block's scale es <= bmax / 6 * (1 + 2^-4) (E4M3 RNE, 3
    # mantissa bits), so <= amax * (1 + 2^-4) / 6 over the tensor
    assert np.all(np.abs(deq.numpy() - w.numpy()) <= np.abs(w.numpy()).max() * (1 + 2 ** -4) / 6)
    moved = wt.to("cpu")
    assert moved is not wt and torch.equal(moved.codes, wt.codes) and moved.k == wt.k


def test_to_and_unpack_copy(rng):
    # w.to(its own device) gave the weight's own tensors (t.to(device) is t
    # there) and unpack() its own gs, where both document copies: a change
    # of the "copy" or of the checkpoint form changed the weight
    wt = Fp4Weight.from_nvfp4(*_stacked(rng), torch.tensor([0.5, 0.25]), groups=2)
    want = wt.dequantize()
    moved = wt.to("cpu")
    for t in (moved.codes, moved.scales, moved.gs, moved.input_scale):
        t.zero_()
    wt.unpack()[2].mul_(4)
    assert torch.equal(wt.dequantize(), want) and torch.equal(wt.input_scale, torch.tensor([0.5, 0.25]))


# -- NVIDIA ModelOpt (the `peers` extra; skipped when absent) ------------------------

def _modelopt():
    try:
        importlib.metadata.version("nvidia-modelopt")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-modelopt is not installed (pip install -e '.[peers]')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modelopt_export_round_trips(rng, dtype):
    # NVFP4QTensor.quantize per group, as ModelOpt quantizes each expert /
    # wo_a group (modelopt/torch/quantization/qtensor/nvfp4_tensor.py):
    # from_nvfp4 of its output unpacks to the same bytes, and from_float of
    # the same weight writes them too (byte identity).
    q4 = _modelopt()
    g, n, k = 4, 24, 96
    scale = np.exp(rng.uniform(-6, 6, (g, n, 1)))        # wide range across rows
    w = _t(rng.standard_normal((g, n, k)) * scale).to(dtype)
    qs, sfs, gss = [], [], []
    for i in range(g):
        qt, sf, gsi = q4.quantize(w[i].clone(), 16)
        qs.append(qt._quantized_data)
        sfs.append(sf)
        gss.append(gsi.float().reshape(()))
    weight, ws = torch.cat(qs), torch.cat(sfs)              # ModelOpt's (G*N, K/2), (G*N, K/16)
    assert weight.dtype == torch.uint8 and ws.dtype == torch.float8_e4m3fn
    wt = Fp4Weight.from_nvfp4(weight, ws, torch.stack(gss), groups=g)
    codes, scales, gs = wt.unpack()
    assert torch.equal(codes.reshape(g * n, -1), weight)
    assert torch.equal(scales.reshape(g * n, -1), ws.view(torch.uint8))
    ours = Fp4Weight.from_float(w)
    assert torch.equal(ours.gs, gs)
    assert torch.equal(ours.codes, wt.codes) and torch.equal(ours.scales, wt.scales)


def test_gpu_packer_and_from_float_equal_cpu(cuda, rng):
    # The packer is plain tensor indexing: on CUDA it must give the CPU bytes;
    # from_float on CUDA runs the NVFP4 kernel, which equals the reference.
    g, n, k = 3, 37, 208
    w = _t(rng.standard_normal((g, n, k)).astype(np.float32))
    cpu = Fp4Weight.from_float(w)
    gpu = Fp4Weight.from_float(w.cuda())
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu.scales.cpu(), cpu.scales)
    assert torch.equal(gpu.gs.cpu(), cpu.gs)
    back = gpu.unpack()
    assert torch.equal(back[0].cpu(), cpu.unpack()[0]) and torch.equal(back[1].cpu(), cpu.unpack()[1])
    moved = cpu.to("cuda")
    assert torch.equal(moved.codes.cpu(), cpu.codes)
    mx_codes, mx_scales = _mx(rng, g, n, 192)
    mx = Fp4Weight.from_mxfp4(mx_codes.cuda(), mx_scales.cuda())
    assert torch.equal(mx.scales.cpu(), Fp4Weight.from_mxfp4(mx_codes, mx_scales).scales)


# -- issue 21: every loader refuses what would load as wrong weights -----------------

def _stacked(rng, g=2, n=8, k=32):
    _, codes, scales, gs = _checkpoint(rng, g, n, k)
    return codes.reshape(g * n, k // 2), scales.reshape(g * n, k // 16), gs


@pytest.mark.parametrize("which", ["weight_scale_2", "input_scale"])
@pytest.mark.parametrize("bad", [-1.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e39, 1e-46])
def test_from_nvfp4_global_scales_must_be_finite_and_positive(rng, which, bad):
    # These loaded, and the GEMM then returned zeros, sign-flipped or NaN
    # outputs: the rule of from_float's gs (a finite positive float32) for
    # every form, a number, one value for all groups, or one per group.
    c2, s2, gs = _stacked(rng)
    forms = [bad, torch.tensor(bad, dtype=torch.float32), torch.tensor([0.5, bad], dtype=torch.float32)]
    for form in forms:
        args = (c2, s2, form) if which == "weight_scale_2" else (c2, s2, gs, form)
        with pytest.raises(ValueError, match=f"^{which}:.*finite positive"):
            Fp4Weight.from_nvfp4(*args, groups=2)
    with pytest.raises(TypeError, match=f"^{which}:"):
        Fp4Weight.from_nvfp4(*((c2, s2, True) if which == "weight_scale_2" else (c2, s2, gs, True)), groups=2)


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x80, 0xC0])
def test_from_nvfp4_block_scales_must_be_finite_and_non_negative(rng, byte):
    # E4M3 0x7F / 0xFF are NaN and 0x80.. negative: they would load as NaN or
    # sign-flipped blocks (MXFP4's NaN byte 255 is refused by its window).
    c2, s2, gs = _stacked(rng)
    s = s2.clone()
    s[3, 1] = byte
    with pytest.raises(ValueError, match=rf"^weight_scale:.*{byte:#04x}"):
        Fp4Weight.from_nvfp4(c2, s, gs, groups=2)
    s[3, 1] = 0x7E                      # 448, the largest finite E4M3, loads
    s[4, 0] = 0x00
    assert Fp4Weight.from_nvfp4(c2, s, gs, groups=2).unpack()[1].reshape(16, 2)[3, 1] == 0x7E


def test_every_loader_checks_its_scale_tensors_alike(rng):
    # shape, dtype and device, the same rule for NVFP4's block and global
    # scales and MXFP4's scale: a tensor on another device is refused by
    # name (weight_scale_2 / input_scale were moved silently; a meta tensor
    # made that fail inside torch).
    c2, s2, gs = _stacked(rng)
    meta = {"weight_scale": (c2, s2.to("meta"), gs), "weight_scale_2": (c2, s2, gs.to("meta")),
            "input_scale": (c2, s2, gs, gs.to("meta"))}
    for name, args in meta.items():
        with pytest.raises(ValueError, match=f"^{name}: is on meta but weight is on cpu"):
            Fp4Weight.from_nvfp4(*args, groups=2)
    codes, scales = _mx(rng, 2, 8, 64)
    with pytest.raises(ValueError, match="^scale: is on meta but weight is on cpu"):
        Fp4Weight.from_mxfp4(codes, scales.to("meta"))
    for name, args in {"weight_scale": (c2, s2.to(torch.int8), gs), "weight_scale_2": (c2, s2, gs.half()),
                       "input_scale": (c2, s2, gs, gs.double())}.items():
        with pytest.raises(TypeError, match=f"^{name}: dtype"):
            Fp4Weight.from_nvfp4(*args, groups=2)
    with pytest.raises(TypeError, match="^scale: dtype"):
        Fp4Weight.from_mxfp4(codes, scales.to(torch.int8))
    with pytest.raises(ValueError, match="^scale: expected shape"):
        Fp4Weight.from_mxfp4(codes, scales[:, :, :1])


def test_loaders_check_cuda_scales(cuda, rng):
    # issue 21 items 1 and 6 on CUDA tensors: a bad global scale read back
    # from the device, a scale on another device, a device that does not exist.
    g, n, k = 2, 16, 64
    codes = torch.from_numpy(rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)).cuda()
    scales = torch.from_numpy(rng.integers(0x10, 0x60, (g * n, k // 16), dtype=np.uint8)).cuda()
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="^weight_scale_2:.*finite positive"):
            rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, torch.tensor([0.5, bad], device="cuda"), groups=g)
    with pytest.raises(ValueError, match="^weight_scale_2: is on cpu"):
        rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, torch.tensor([0.5, 0.25]), groups=g)
    bad_sf = scales.clone()
    bad_sf[0, 0] = 0x7F
    with pytest.raises(ValueError, match="^weight_scale:.*0x7f"):
        rawkv.gemm.Fp4Weight.from_nvfp4(codes, bad_sf, 0.5, groups=g)
    w = rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, 0.5, groups=g)
    missing = torch.cuda.device_count()
    with pytest.raises(ValueError, match="^device"):
        w.to(f"cuda:{missing}")
    with pytest.raises(ValueError, match="^device"):
        rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=2, device=missing)
    assert w.to("cpu").to(0).device == torch.device("cuda", 0)


# -- issue 21: no torch, no CUDA ------------------------------------------------------

def _cpu_only_torch():
    return not torch.cuda.is_available()


@pytest.mark.skipif(not _cpu_only_torch(), reason="needs a torch without a usable CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_cuda_without_a_gpu_stack_is_gpu_unavailable(rng, device):
    # torch's own error here is a bare AssertionError ("Torch not compiled
    # with CUDA enabled"): rawkv's runtime says what is missing.
    w = Fp4Weight.from_float(torch.randn(2, 16, 64))
    with pytest.raises(rawkv.GpuUnavailableError, match="CUDA"):
        w.to(device)
    with pytest.raises(rawkv.GpuUnavailableError, match="CUDA"):
        rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device=device)
    with pytest.raises(rawkv.GpuUnavailableError, match="CUDA"):
        rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4)          # the default device


def test_device_arguments_are_refused_by_name():
    w = Fp4Weight.from_float(torch.randn(1, 16, 64))
    for bad, exc in (("meta", ValueError), ("cuda:x", ValueError), (True, TypeError), (1.5, TypeError),
                     (None, TypeError)):
        with pytest.raises(exc, match="^device"):
            w.to(bad)
        with pytest.raises(exc, match="^device"):
            rawkv.gemm.Fp4GroupedLinear(1, 64, 16, max_tokens=2, device=bad)
    assert w.to(torch.device("cpu")).device.type == "cpu"


def test_without_torch_the_loaders_say_what_they_need(monkeypatch):
    # `import rawkv` needs only numpy; without torch a loader got a bare
    # ModuleNotFoundError. A weight is a torch tensor: anything else is a
    # TypeError naming it, checked before torch is imported, and what needs
    # torch outright (a layer) says so.
    w = np.zeros((16, 64), np.float32)
    monkeypatch.setitem(__import__("sys").modules, "torch", None)        # import torch fails
    with pytest.raises(TypeError, match="^w: expected a torch tensor, got ndarray"):
        Fp4Weight.from_float(w)
    with pytest.raises(TypeError, match="^weight: expected a torch tensor"):
        Fp4Weight.from_nvfp4(w.view(np.uint8), w, 1.0)
    with pytest.raises(TypeError, match="^weight: expected a torch tensor"):
        Fp4Weight.from_mxfp4(w.view(np.uint8), w)
    with pytest.raises(ImportError, match="Fp4GroupedLinear needs PyTorch"):
        rawkv.gemm.Fp4GroupedLinear(1, 64, 16, max_tokens=2, device="cpu")


def test_zero_nvfp4_scales_pack_with_zero_codes(rng):
    # docs/gemm.md, "Packed form": a block whose scale is zero packs with
    # zero codes (the kernels read its factor byte 0 as 2^-20 in BF16); the
    # values are unchanged, unpack gives those codes back as zeros.
    g, n, k = 2, 24, 96
    codes = rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)
    scales = rng.integers(0x00, 0x7F, (g * n, k // 16), dtype=np.uint8)
    scales[rng.random(scales.shape) < 0.3] = 0
    w = Fp4Weight.from_nvfp4(_t(codes), _t(scales), 1.0, groups=g)
    got_codes, got_scales, _ = (t.numpy() for t in w.unpack())
    zero = np.repeat(scales.reshape(g, n, -1) == 0, 8, axis=-1)
    np.testing.assert_array_equal(got_scales, scales.reshape(g, n, -1))
    np.testing.assert_array_equal(got_codes, np.where(zero, 0, codes.reshape(g, n, -1)))
    assert zero.any() and (codes.reshape(g, n, -1)[zero] != 0).any()
    want = R.dequantize_weight(codes.reshape(g, n, -1), scales.reshape(g, n, -1), np.ones(g), "nvfp4")
    np.testing.assert_array_equal(w.dequantize().numpy(), want.astype(np.float32))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_constructor_refuses_packed_scales_the_kernels_read_otherwise(rng, fmt):
    """A weight given packed (Fp4Weight(...)): a padding column's scale byte
    other than the padding byte (NaN there made every GPU output NaN, the
    CPU drops padding), an MXFP4 block's two copies differing (each kernel
    lane applies its own, the reference the first), or MXFP4 bytes outside
    the exp_range given (the kernels' factors assume it) are refused by
    name; the form from_* packs is taken as it is."""
    g, n, k = 2, 20, 96                          # K = 96: the second chunk's columns 96 .. 127 are padding
    codes = _t(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8))
    if fmt == "nvfp4":
        w = Fp4Weight.from_nvfp4(codes, _t(rng.integers(0x08, 0x7F, (g, n, k // 16), dtype=np.uint8)), 1.0,
                                 groups=g)
    else:
        w = Fp4Weight.from_mxfp4(codes, _t(rng.integers(120, 131, (g, n, k // 32), dtype=np.uint8)), groups=g)
    Fp4Weight(fmt, n, k, w.codes, w.scales, w.gs, exp_range=w.exp_range)          # as packed: taken
    for lane, half in ((2, 0), (31, 1), (14, 0)):                  # units 2 and 3 of chunk 1: columns 96 .. 127
        sc = w.scales.clone()
        sc[1, 1, 1, lane, half] = 0xFF
        with pytest.raises(ValueError, match="^scales: the packed scales of the columns past K = 96"):
            Fp4Weight(fmt, n, k, w.codes, sc, w.gs, exp_range=w.exp_range)
    if fmt == "nvfp4":
        return
    sc = w.scales.clone()
    sc[0, 0, 0, 5, 1] ^= 1                                         # lane 5: unit 1, block 0's second copy
    with pytest.raises(ValueError, match="^scales: an MXFP4 block's two packed copies"):
        Fp4Weight(fmt, n, k, w.codes, sc, w.gs, exp_range=w.exp_range)
    lo, hi = w.exp_range
    for rng_given in ((lo + 1, hi), (lo, hi - 1)):
        with pytest.raises(ValueError, match=r"^exp_range: .* span \[%d, %d\]" % (lo, hi)):
            Fp4Weight(fmt, n, k, w.codes, w.scales, w.gs, exp_range=rng_given)
    # a padding row's byte (rows past N: computed, never stored) is not the weight's
    sc = w.scales.clone()
    sc[0, 1, 0, 4 * 7, 1] = 200                                    # row 16 + 7 + 8 = 31 >= 20
    assert Fp4Weight(fmt, n, k, w.codes, sc, w.gs, exp_range=w.exp_range).exp_range == (lo, hi)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_constructor_refuses_sizes_the_packed_form_cannot_have(rng, fmt):
    # Fp4Weight(fmt, n, k, ...) took n, k as they were: a K off the format's
    # blocks (48 for MXFP4, 24 for NVFP4), a negative n (padded to no row
    # tiles), a float or a bool, when the packed shapes matched; the weight
    # was built, and unpack / dequantize / w4a8_weight / the ops then failed
    # naming `k` or `weight`, arguments of theirs the caller did not pass.
    w = (Fp4Weight.from_nvfp4(_t(np.zeros((16, 32), np.uint8)), _t(np.full((16, 4), 0x38, np.uint8)), 1.0)
         if fmt == "nvfp4" else Fp4Weight.from_mxfp4(_t(np.zeros((16, 32), np.uint8)),
                                                     _t(np.full((16, 2), 127, np.uint8))))
    assert (w.n, w.k) == (16, 64)
    ctor = lambda n, k: Fp4Weight(fmt, n, k, w.codes, w.scales, w.gs, exp_range=w.exp_range)  # noqa: E731
    assert (ctor(np.int64(9), 64).n, ctor(16, 64).k) == (9, 64) and type(ctor(np.int64(9), 64).n) is int
    off = 48 if fmt == "mxfp4" else 56
    with pytest.raises(ValueError, match=f"^k: K = {off} must be a multiple of {w.block}"):
        ctor(16, off)
    for n, k, exc, name in ((16.0, 64, TypeError, "n"), (True, 64, TypeError, "n"), (16, 64.0, TypeError, "k"),
                            (16, -64, ValueError, "k")):
        with pytest.raises(exc, match=f"^{name}:"):
            ctor(n, k)
    empty = Fp4Weight.from_nvfp4(_t(np.zeros((0, 32), np.uint8)), _t(np.zeros((0, 4), np.uint8)), 1.0)
    with pytest.raises(ValueError, match="^n:"):
        Fp4Weight("nvfp4", -1, 64, empty.codes, empty.scales, empty.gs)


def test_nvfp4_constructor_refuses_packed_scales_off_the_rule(rng):
    # A packed NVFP4 weight built by hand: scale bytes that are no E4M3
    # scale's factor byte, or a zero scale over nonzero codes, are refused
    # by name (the GPU would read them otherwise than the CPU).
    g, n, k = 1, 16, 64
    codes = rng.integers(1, 16, (g, n, k // 2), dtype=np.uint8) * 17      # no zero nibble
    scales = rng.integers(0x08, 0x7F, (g, n, k // 16), dtype=np.uint8)
    w = Fp4Weight.from_nvfp4(_t(codes), _t(scales), 1.0, groups=g)
    Fp4Weight("nvfp4", n, k, w.codes, w.scales, w.gs)                         # as packed: taken
    for bad in (1, 7, 0x50, 0xE7, 0xFE):
        sc = w.scales.clone()
        sc[0, 0, 0, 5, 1] = bad
        with pytest.raises(ValueError, match="^scales:"):
            Fp4Weight("nvfp4", n, k, w.codes, sc, w.gs)
    sc = w.scales.clone()
    sc[0, 0, 0, 5, 1] = 0
    with pytest.raises(ValueError, match="^codes:"):
        Fp4Weight("nvfp4", n, k, w.codes, sc, w.gs)
    cz = w.codes.clone()
    cz[0, 0, 0, R.SLOT_OF_LANE[5]] &= _t(np.tile(R.R0_BITS_OF_BYTE, 4).astype(np.uint8))   # lane 5's r1 codes zero
    Fp4Weight("nvfp4", n, k, cz, sc, w.gs)


def _two_groups(rng, fmt, nvfp4_scales=(0x08, 0x7F)):
    """A 2-group, 16 x 64 weight of random codes and block scales (NVFP4
    scale bytes drawn from nvfp4_scales, MXFP4 exponents 120..130)."""
    codes = _t(rng.integers(0, 256, (2, 16, 32), dtype=np.uint8))
    if fmt == "nvfp4":
        return Fp4Weight.from_nvfp4(codes, _t(rng.integers(*nvfp4_scales, (2, 16, 4), dtype=np.uint8)), 1.0, groups=2)
    return Fp4Weight.from_mxfp4(codes, _t(rng.integers(120, 131, (2, 16, 2), dtype=np.uint8)), groups=2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_constructor_names_packed_arguments_of_the_wrong_type(rng, fmt):
    # Fp4Weight(fmt, n, k, codes, scales, gs, input_scale, exp_range) read
    # its tensors before checking what they were: a numpy array, a list or
    # None failed with AttributeError ('numpy.ndarray' object has no
    # attribute 'numel'), scales viewed as float8_e4m3fn with torch's
    # NotImplementedError ('"bincount_cpu" not implemented'), an exp_range
    # of one number or one value with TypeError / IndexError, none naming
    # the argument. Now a TypeError naming it, before anything is read.
    w = _two_groups(rng, fmt)
    args = dict(codes=w.codes, scales=w.scales, gs=w.gs, input_scale=None, exp_range=w.exp_range)
    Fp4Weight(fmt, 16, 64, **args)                                              # as packed: taken
    bad = [("codes", w.codes.numpy()), ("codes", None), ("codes", w.codes.view(torch.int8)),
           ("scales", w.scales.numpy()), ("scales", w.scales.view(torch.float8_e4m3fn)), ("scales", [1, 2]),
           ("gs", None), ("gs", [1.0, 1.0]), ("gs", w.gs.numpy()), ("input_scale", [1.0, 1.0]),
           ("exp_range", 5), ("exp_range", (4,)), ("exp_range", (4.0, 137)), ("exp_range", (True, 137)),
           ("exp_range", "ab")]
    for name, value in bad:
        with pytest.raises(TypeError, match=f"^{name}:"):
            Fp4Weight(fmt, 16, 64, **{**args, name: value})
    with pytest.raises(ValueError, match="^codes: expected shape"):
        Fp4Weight(fmt, 16, 64, **{**args, "codes": w.codes[0, 0, 0, 0, 0]})     # 0-d: no groups to read
    if fmt == "mxfp4":                                                          # NumPy ints: ints
        assert Fp4Weight(fmt, 16, 64, **{**args, "exp_range": tuple(map(np.int64, w.exp_range))}).exp_range \
            == w.exp_range


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_constructor_refuses_global_scales_the_loaders_refuse(rng, fmt):
    # A packed weight built by hand took any gs: with gs[g] = inf the CPU
    # (the reference dequantizes e2m1 * scale * gs, so a zero code is
    # 0 * inf = NaN) gave NaN in every output of group g, where the kernels,
    # which apply gs to the FP32 sum in the epilogue, give +-inf: the two
    # placements differed without an error. The loaders refuse a global
    # scale that is not a finite positive float32 (0, a negative, NaN or
    # inf); the constructor now holds gs to the same rule, by name.
    w = _two_groups(rng, fmt, (0x30, 0x40))
    for v in (float("inf"), float("-inf"), float("nan"), 0.0, -1.0):
        gs = torch.tensor([1.0, v])
        with pytest.raises(ValueError, match="^gs: a global scale must be a finite positive float32"):
            Fp4Weight(fmt, 16, 64, w.codes, w.scales, gs, exp_range=w.exp_range)
    ok = Fp4Weight(fmt, 16, 64, w.codes, w.scales, torch.tensor([0.5, 3.0]), exp_range=w.exp_range)
    assert torch.equal(ok.gs, torch.tensor([0.5, 3.0]))
