"""Make Megatron-Core 0.16 run on a CPU-only machine (gloo backend).

Megatron-Core assumes CUDA throughout. Each patch below exists because the named code path failed on a
CPU machine without it (each patch's docstring says which). `apply()` installs them all once, and only
when the rank computes on a CPU: on a GPU nothing here runs and Megatron-Core is used as shipped.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An integer device means a CUDA ordinal (what torch.cuda.current_device() returns).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Redirects tensors that Megatron-Core places on "cuda" to the CPU.

    About 60 places hard-code `device="cuda"` (for example the pipeline schedules' `torch.zeros([],
    device="cuda")`) and many call `.cuda()`; rewriting each call here is cheaper (0-3 ms per step) and
    safer than patching each site.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads.py asserts `param.grad.type() == 'torch.cuda.FloatTensor'`.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        return func(*args, **kwargs)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # ~175 call sites (e.g. GlobalMemoryBuffer in attention) ask for the current CUDA device; ordinal 0 is
    # then mapped to the CPU by _CudaToCpu.
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 0
    # Megatron seeds and forks a "CUDA" generator (model_parallel_cuda_manual_seed, the RNG tracker). The
    # CPU default generator stands in. Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which
    # would recurse into these patches.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.default_generator.get_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.default_generator.set_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # Pipeline p2p and inference paths synchronize and create streams/events: no-ops on the CPU.
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    # The RNG tracker reads and writes CUDA generator states through these module-level helpers.
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.default_generator.get_state()
    )
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.default_generator.set_state(new_state)
    )

    # The backward pass runs with _CudaToCpu off (a mode is popped while its handler runs `torch.autograd.backward`),
    # and activation recomputation reruns attention there, whose causal mask is made with device="cuda".
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = functools.lru_cache(maxsize=None)(
        lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool())

    # Mistral's sliding window builds its mask with device="cuda" too (the same recomputation path).
    fused_softmax.get_sliding_window_causal_mask = functools.lru_cache(maxsize=None)(
        lambda sq, skv, window_size: ~torch.tril(torch.triu(torch.ones(sq, skv, dtype=torch.bool),
                                                            diagonal=skv - sq - window_size[0]),
                                                 diagonal=skv - sq + window_size[1]))

    _patch_moe()

    with contextlib.suppress(ImportError):
        from megatron.core.inference import communication_utils

        # Inference pipeline broadcasts assert `tensor.is_cuda`.
        communication_utils._is_cuda = lambda tensor: None


def _with_cuda_to_cpu(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _CudaToCpu():
            return fn(*args, **kwargs)
    return wrapped


def _patch_moe() -> None:
    """Mixture-of-experts layers (a 2-layer MoE GPTModel at EP 1 and 2 over gloo failed without these)."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    # The router's gating matmul tests `te_general_gemm is not None`, a name moe_utils binds only when Transformer
    # Engine imports (NameError without it): None selects its torch matmul.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # The alltoall dispatcher's split sizes are numpy arrays (or tensors); gloo's all_to_all_single takes only
    # lists of Python ints. Its backward reuses the converted sizes.
    forward = mappings._AllToAll.forward

    def all_to_all_forward(ctx, group, input, output_split_sizes, input_split_sizes):
        def ints(sizes):
            return None if sizes is None else [int(x) for x in sizes]
        return forward(ctx, group, input, ints(output_split_sizes), ints(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(all_to_all_forward)

    # The token dispatchers' collectives (gather / reduce-scatter along the token dim, all-to-all) allocate their
    # outputs on torch.cuda.current_device(); in the backward pass _CudaToCpu is off (see get_default_causal_mask
    # above), so each collective's backward runs with it on again.
    for cls in vars(mappings).values():
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and "backward" in vars(cls):
            cls.backward = staticmethod(_with_cuda_to_cpu(vars(cls)["backward"].__func__))


def apply(force: bool = False) -> bool:
    """Install the CPU patches if CUDA is absent, or when `force`d (a rank told to compute on the CPU of a GPU
    machine). Returns True when patches are active. Idempotent."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        return False
    _patch_torch_cuda()
    _patch_megatron()
    _CudaToCpu().__enter__()  # stays active for the life of the process (main thread)
    _applied = True
    return True

