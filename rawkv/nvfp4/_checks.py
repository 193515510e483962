"""The NVFP4 rules rawkv.fused still imports under their old module name
(it moves to rawkv.nvfp4._rules with the fused family's own move to the
op layer, issue 22)."""
from ._rules import check_given_gs_number, given_gs_host  # noqa: F401
