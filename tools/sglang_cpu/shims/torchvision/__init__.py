"""Import-only stand-in for torchvision (see ../README.md). PyPI's torchvision is a CUDA build whose C ops
fail to load beside the CPU torch wheel, and its import then raises; SGLang and transformers import it at
module level for multimodal models that a text-only RL run never uses."""
import sys

from _cpu_shim import stand_in_package

__version__ = "0.0.0+megatron-rl-cpu-stand-in"
stand_in_package(__name__, sys.modules[__name__])
