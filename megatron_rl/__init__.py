"""megatron-rl: asynchronous off-policy RL post-training of LLMs on Megatron-Core (LlamaRL design)."""

import warnings

# Megatron-Core warns on every import that the optional Transformer-Engine/Apex kernels are missing; on a
# CPU machine that is the expected state (see megatron_rl.runtime.cpu_compat), so say it once in the docs instead.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed.*")

__version__ = "0.1.0"
