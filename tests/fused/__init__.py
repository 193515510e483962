"""rawkv.fused: the fused NVFP4 producers (rmsnorm_quantize, mhc_rmsnorm_quantize, swiglu_quantize) and moe_stage."""
