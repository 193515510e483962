"""rawkv/cu/fp8.cu: element-wise E4M3 encode / decode.

VEC = true is the 16-byte vector path (every pointer 16-byte aligned);
false the scalar path for unaligned views."""
from ._decl import KernelFile, TParam

FILE = KernelFile("fp8.cu")
_T = TParam("typename", "T", ("float32", "float16", "bfloat16"))
_VEC = TParam("bool", "VEC", (True, False))

ENCODE = FILE.kernel("rkv_e4m3_encode", (_T, _VEC))
DECODE = FILE.kernel("rkv_e4m3_decode", (_T, _VEC))

# One thread per this many codes per grid-stride iteration (encode: one
# 16-byte vector of codes; decode: two 8-code units for 16-bit outputs): the
# launch geometry counts work in chunks.
CHUNK_BYTES = 16
