"""The indented snippets an engine developer copies from docs/engines.md (the
block-table call, the admission call, the FP4 weights, the FP8 activations in DeepGEMM's scale
layout), README.md's GPU example, docs/gemm.md's "Ops" and its engine module holding
a layer run as written on
CPU tensors: "cuda" becomes "cpu", sizes shrink, and the names a snippet
takes from its surroundings are supplied here."""
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def _indented_block(page: str, first_line_start: str) -> str:
    """The indented block (4 or more spaces, blank lines inside allowed) of
    `page` whose first line, stripped, starts with `first_line_start`."""
    lines = (ROOT / page).read_text().splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("    ") and line.strip().startswith(first_line_start)), None)
    assert start is not None, f"{page}: no indented block starting {first_line_start!r}"
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        block.append(line[indent:])
    return "\n".join(block).strip() + "\n"


def _on_cpu(code: str) -> str:
    return code.replace('"cuda"', '"cpu"')


def test_engines_assign_pages_call():
    import rawkv
    from rawkv.kvcache import PagedKVPool
    from rawkv.kvcache.views import pool_args
    code = _indented_block("docs/engines.md", "torch.ops.rawkv.kv_assign_pages(")
    pool = PagedKVPool("csa", num_blocks=8, entries_per_block=16, max_requests=2, max_blocks_per_request=2,
                       device="cpu")
    slots = [pool.add_request(), pool.add_request()]
    pool.block_table[slots[0], 0] = 3
    slot_t = torch.tensor(slots, dtype=torch.int32)
    block_t = torch.tensor([3, -1], dtype=torch.int32)             # -1 is padding
    exec(code, {"torch": torch, "rawkv": rawkv, "pool_args": pool_args, "pool": pool,  # noqa: S102
                "slot_t": slot_t, "block_t": block_t})
    owners = pool_args(pool)["owners"]
    assert int(owners[3]) == int(pool.request_ids[slots[0]]) > 0
    assert int((torch.as_tensor(owners) != 0).sum()) == 1
    assert pool.read_errors() == 0


def test_engines_admission_with_own_buffers_empties_the_decode_states():
    """docs/engines.md's admission by an engine that writes the pool's ids
    itself: a slot whose previous request left rows of an unfinished window
    in the decode states gives the new request the entries a fresh slot
    gives, once the documented state call has run (without it, the old rows
    are pooled into the new request's first entry with no pool error)."""
    import rawkv
    from rawkv.kvcache import DecodeState, PagedKVPool
    from rawkv.kvcache.views import pool_args, state_args
    code = _indented_block("docs/engines.md", "torch.ops.rawkv.kv_state_clear(")
    D, DI = 512, 128

    def first_entry(leftover, admit):
        pool = PagedKVPool("csa", num_blocks=4, entries_per_block=16, max_requests=1, max_blocks_per_request=1,
                           device="cpu")
        states = DecodeState("csa", 1, device="cpu"), DecodeState("csa", 1, DI, device="cpu")
        pool.attach(*states)
        slot = pool.add_request()
        slot_t, one = torch.tensor([slot], dtype=torch.int32), torch.ones(1, dtype=torch.bool)

        def append(g):
            for st, w in zip(states, (2 * D, 2 * DI)):
                rawkv.kvcache.state_append(st, torch.randn(1, w, generator=g), torch.randn(1, w, generator=g),
                                           one, slot_t)
        if leftover:                     # the previous request: two rows of a window, then it leaves
            append(torch.Generator().manual_seed(0))
            pool.request_ids[slot] = 0
        # the engine admits the next request with its own id and block
        pool.request_ids[slot] = 77
        pool.written[slot] = 0
        pool.block_table[slot, 0] = 2
        torch.ops.rawkv.kv_assign_pages(**pool_args(pool), slots=slot_t, blocks=torch.tensor([2], dtype=torch.int32))
        if admit:
            for state in states:
                exec(code, {"torch": torch, "state_args": state_args, "state": state,  # noqa: S102
                            "slot_t": slot_t})
        g = torch.Generator().manual_seed(1)
        for p in range(4):               # its first window: entry 0
            append(g)
            rawkv.kvcache.compress_decode(pool, states[0], torch.ones(D), one, slot_t,
                                          torch.tensor([p], dtype=torch.int32), index=(states[1], torch.ones(DI)))
            for st in states:
                rawkv.kvcache.csa_rotate(st, torch.tensor([p == 3]), slot_t)
        out = torch.empty(1, 1, D, dtype=torch.bfloat16)
        torch.ops.rawkv.kv_gather_topk(**pool_args(pool), slots=slot_t, topk_ids=torch.zeros(1, 1, dtype=torch.int32),
                                       n_entries=None, valid_mask=None, out=out)
        assert pool.read_errors() == 0
        return out

    fresh = first_entry(leftover=False, admit=False)
    assert not torch.equal(first_entry(leftover=True, admit=False), fresh)    # what the call prevents
    assert torch.equal(first_entry(leftover=True, admit=True), fresh)


def test_engines_fp4_weights_snippet():
    import rawkv
    code = _on_cpu(_indented_block("docs/engines.md", "# load time: ModelOpt NVFP4 tensors"))
    assert "from_nvfp4(weight, weight_scale, weight_scale_2, input_scale," in code
    g = torch.Generator().manual_seed(0)
    n_groups, n_out, k, max_tokens, T, E = 2, 64, 256, 8, 3, 3
    env = {
        "torch": torch, "rawkv": rawkv, "n_groups": n_groups, "n_out": n_out, "max_tokens": max_tokens, "T": T,
        "weight": torch.randint(0, 256, (n_groups * n_out, k // 2), dtype=torch.uint8, generator=g),
        "weight_scale": (torch.rand(n_groups * n_out, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(0.01), "input_scale": None,
        "x": torch.randn(T, n_groups, k, dtype=torch.bfloat16, generator=g),
        "experts": rawkv.gemm.Fp4Weight.from_float(torch.randn(E, n_out, k, dtype=torch.bfloat16, generator=g)),
        "x_sorted": torch.randn(7, k, dtype=torch.bfloat16, generator=g),
        "offsets": torch.tensor([0, 2, 5, 7], dtype=torch.int32),
        "expert_out": torch.zeros(7, n_out, dtype=torch.bfloat16),
    }
    exec(code, env)  # noqa: S102 - the documented snippet
    assert env["out"].shape == (max_tokens, n_groups, n_out) and env["out"].dtype == torch.bfloat16
    assert torch.equal(env["out"][:T], rawkv.gemm.grouped_linear(env["x"], env["w"]))
    assert torch.equal(env["expert_out"], rawkv.gemm.moe_linear(env["x_sorted"], env["experts"], env["offsets"]))
    # the operator form the page names, built by operator_args, gives the same bytes
    o = torch.empty(T, n_groups, n_out, dtype=torch.bfloat16)
    torch.ops.rawkv.gemm_grouped_linear(**rawkv.gemm.operator_args(env["x"], env["w"]), out=o)
    assert torch.equal(o, env["out"][:T])


def test_engines_fp8_activations_snippet():
    import rawkv
    code = _on_cpu(_indented_block("docs/engines.md", "# DeepGEMM's MN-major, TMA-aligned scales"))
    g = torch.Generator().manual_seed(0)
    m, k, n, E = 5, 256, 64, 2
    experts = rawkv.gemm.Fp4Weight.from_mxfp4(torch.randint(0, 256, (E * n, k // 2), dtype=torch.uint8, generator=g),
                                              torch.randint(120, 130, (E * n, k // 32), dtype=torch.uint8,
                                                            generator=g), groups=E)
    env = {"torch": torch, "rawkv": rawkv, "m": m, "k": k,
           "x": torch.randn(m, k, dtype=torch.bfloat16, generator=g), "norm_w": torch.ones(k, dtype=torch.bfloat16),
           "experts_w4a8": rawkv.gemm.w4a8_weight(experts), "offsets": torch.tensor([0, 2, m], dtype=torch.int32),
           "expert_out": torch.zeros(m, n, dtype=torch.bfloat16)}
    exec(code, env)  # noqa: S102 - the documented snippet
    assert env["xa"].scales.data_ptr() == env["store"].data_ptr()     # written where the buffer lies
    plain = rawkv.fused.rmsnorm_quantize_fp8(env["x"], env["norm_w"])
    assert torch.equal(env["expert_out"], rawkv.gemm.moe_linear(plain, env["experts_w4a8"], env["offsets"]))


def test_readme_gpu_example_on_cpu():
    """README's "On a GPU" block, with a CPU tensor of 64 rows and no warmup
    (which needs a GPU stack): the dtypes and shapes its comments state."""
    import rawkv
    text = (ROOT / "README.md").read_text()
    m = re.search(r"On a GPU:\n\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no 'On a GPU' example"
    code = m.group(1)
    assert "rawkv.warmup()" in code and 'device="cuda"' in code and "torch.randn(4096, 7168" in code
    code = code.replace("rawkv.warmup()", "pass").replace('device="cuda"', 'device="cpu"').replace("4096", "64")
    env: dict = {}
    exec(code, env)  # noqa: S102 - the documented example
    assert env["codes"].dtype == torch.float8_e4m3fn and env["codes"].shape == (64, 7168)
    assert env["q"].shape == (64, 3584) and env["sf"].shape == (64, 448) and env["sf"].dtype == torch.float8_e4m3fn
    assert env["gs"].shape == (64,) and env["gs"].dtype == torch.float32
    assert env["y"].dtype == torch.bfloat16 and env["y"].shape == (64, 7168)


def test_gemm_ops_snippet_on_cpu():
    """docs/gemm.md's "Ops" block with device="cpu" given to the layer (its
    default is "cuda")."""
    import rawkv
    code = _indented_block("docs/gemm.md", "out = rawkv.gemm.grouped_linear(x, w, out=None)")
    code = code.replace("max_tokens=T)", 'max_tokens=T, device="cpu")')
    assert 'device="cpu"' in code
    g = torch.Generator().manual_seed(0)
    G, K, N, T, E, R = 2, 256, 64, 4, 3, 6
    w_bf16 = torch.randn(G, N, K, dtype=torch.bfloat16, generator=g)
    env = {"rawkv": rawkv, "G": G, "K": K, "N": N, "T": T, "w_bf16": w_bf16,
           "w": rawkv.gemm.Fp4Weight.from_float(w_bf16),
           "x": torch.randn(T, G, K, dtype=torch.bfloat16, generator=g)}
    # the MoE line takes x (R, K) and an E-expert weight: run the block's lines with their own inputs
    lines = code.splitlines()
    exec(lines[0], env)  # noqa: S102
    assert env["out"].shape == (T, G, N) and env["out"].dtype == torch.bfloat16
    moe = {"rawkv": rawkv, "x": torch.randn(R, K, dtype=torch.bfloat16, generator=g),
           "w": rawkv.gemm.Fp4Weight.from_float(torch.randn(E, N, K, dtype=torch.bfloat16, generator=g)),
           "offsets": torch.tensor([0, 1, 4, R], dtype=torch.int32)}
    exec(lines[1], moe)  # noqa: S102
    assert moe["out"].shape == (R, N) and moe["out"].dtype == torch.bfloat16
    exec("\n".join(lines[2:]), env)  # noqa: S102
    layer, y = env["layer"], env["y"]
    assert isinstance(layer, rawkv.gemm.Fp4GroupedLinear)
    assert y.shape == (T, G, N) and y.untyped_storage().data_ptr() == layer.out.untyped_storage().data_ptr()


def test_gemm_layer_state_dict_snippet():
    """docs/gemm.md's module holding an Fp4GroupedLinear (which is no
    torch.nn.Module): its buffers are the layer's packed tensors, in
    state_dict (the page said non-persistent buffers, which state_dict
    leaves out), and load_state_dict of another layer's weights copies
    into the layer's own tensors, in place, after which the layer
    computes what that other layer does."""
    import rawkv
    code = _indented_block("docs/gemm.md", "class Experts(torch.nn.Module):")
    env = {"torch": torch}
    exec(code, env)  # noqa: S102 - the documented snippet
    g = torch.Generator().manual_seed(0)
    G, K, N, T = 2, 64, 16, 3

    def layer():
        return rawkv.gemm.Fp4GroupedLinear(G, K, N, max_tokens=T, device="cpu").set_weight(
            torch.randn(G, N, K, dtype=torch.bfloat16, generator=g))
    mine, theirs = layer(), layer()
    m = env["Experts"](mine)
    held = [t.data_ptr() for t in (mine.weight.codes, mine.weight.scales, mine.weight.gs)]
    assert set(m.state_dict()) == {"codes", "scales", "gs"}
    x = torch.randn(T, G, K, dtype=torch.bfloat16, generator=g)
    want = theirs(x).clone()
    assert not torch.equal(mine(x), want)
    m.load_state_dict(env["Experts"](theirs).state_dict())
    assert [t.data_ptr() for t in (mine.weight.codes, mine.weight.scales, mine.weight.gs)] == held
    assert torch.equal(mine(x), want)
