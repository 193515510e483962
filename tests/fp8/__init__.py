"""rawkv.fp8: E4M3 encode and decode."""
