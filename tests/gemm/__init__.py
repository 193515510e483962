"""rawkv.gemm: the grouped FP4 GEMM (grouped_linear, moe_linear, Fp4GroupedLinear) and its weights."""
