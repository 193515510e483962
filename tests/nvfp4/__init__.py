"""rawkv.nvfp4: quantize, dequantize, gather, the scale swizzle, the global-scale scopes."""
