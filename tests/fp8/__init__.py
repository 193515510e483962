"""rawkv.fp8: E4M3 encode and decode, and the block quantizer (quantize_blocks, dequantize_blocks)."""
