"""Import-only stand-in for SGLang's compiled kernel package (see ../README.md).

On a CPU without AMX (`cpu_has_amx_support()` is False) SGLang routes every op to native torch code, but
it imports `sgl_kernel` at module level in many places. Every name here is a placeholder that raises when
called, so a code path that really needs a kernel fails loudly instead of computing something wrong.
"""
import sys

from _cpu_shim import stand_in_package

stand_in_package(__name__, sys.modules[__name__])
