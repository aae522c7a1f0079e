"""How much of its GPU a launched SGLang server may take for weights and KV cache (SGLang's --mem-fraction-static),
so that the generator rank computing on the same GPU has room for what it allocates after the server started.

SGLang sizes its KV pool once, at start: the memory free after its weights, less (1 - fraction) x the GPU's
memory. That remainder must hold SGLang's own activations and CUDA graphs, which its default fraction reserves, and
what the generator rank allocates later, which it does not know of:
- DDMA's receive buffers: the most bytes of runtime tensors the rank holds during an update
  (`ddma.sync.Schedule.receive_peak`: tensors allocated as their rounds are posted and handed to SGLang at the
  bucket commits; caching-allocator blocks are reused across updates, so this is the rank's peak, not a per-update
  growth);
- NCCL's buffers for each DDMA peer, connected at the first transfer: `NCCL_BYTES_PER_PEER`, NCCL's defaults
  (NCCL_BUFFSIZE 4 MiB, 2 channels per peer, a send and a receive buffer each), an estimate.
The rank's CUDA context and its NCCL communicator are made before the server starts, so SGLang measures them.

SGLang's own reserve is its 0.5 heuristic (`ServerArgs._handle_gpu_memory_settings`), restated: 512 MiB, 1.5 MiB
per token of chunked prefill, 2 MiB per CUDA-graph batch size, TP x PP / 8 GiB, at least 10 GiB on GPUs of more than
60 GiB, with the chunked prefill and graph batch sizes SGLang picks for the GPU's memory unless given.
"""

from __future__ import annotations

import dataclasses
import math

MIB, GIB = 2**20, 2**30
NCCL_BYTES_PER_PEER = 4 * MIB * 2 * 2


def sglang_defaults(gpu_bytes: int, tp: int) -> tuple[int, int]:
    """(chunked prefill tokens, CUDA-graph max batch size) SGLang 0.5 picks for a CUDA GPU of `gpu_bytes`."""
    mib = gpu_bytes / MIB
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 2048, 24 if tp < 4 else 80
    if mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def sglang_reserve_bytes(gpu_bytes: int, tp: int, chunked_prefill: int | None = None,
                         cuda_graph_max_bs: int | None = None) -> int:
    """What SGLang's default --mem-fraction-static leaves of the GPU for its activations and CUDA graphs."""
    default_prefill, default_bs = sglang_defaults(gpu_bytes, tp)
    chunked_prefill = default_prefill if chunked_prefill is None else chunked_prefill
    cuda_graph_max_bs = default_bs if cuda_graph_max_bs is None else cuda_graph_max_bs
    mib = 512 + max(chunked_prefill, 2048) * 1.5 + cuda_graph_max_bs * 2 + tp / 8 * 1024
    if gpu_bytes > 60 * GIB:
        mib = max(mib, 10 * 1024)
    return int(mib * MIB)


@dataclasses.dataclass(frozen=True)
class ServerMemory:
    """The memory plan of one replica's GPUs: the fraction its server gets and what it is made of."""

    gpu_bytes: int
    sglang_reserve_bytes: int  # SGLang's activations and CUDA graphs
    receive_bytes: int  # DDMA's receive buffers, the busiest rank of the replica
    nccl_bytes: int  # NCCL's buffers for its DDMA peers
    fraction: float  # --mem-fraction-static the server gets
    given: bool  # --sglang-mem-fraction-static set it

    @property
    def generator_bytes(self) -> int:
        return self.receive_bytes + self.nccl_bytes

    def describe(self) -> str:
        source = "--sglang-mem-fraction-static" if self.given else "computed"
        return (f"SGLang --mem-fraction-static {self.fraction:.3f} ({source}) of a {self.gpu_bytes / GIB:.1f} GiB GPU: "
                f"SGLang's own room {self.sglang_reserve_bytes / GIB:.1f} GiB, the generator rank's "
                f"{self.generator_bytes / GIB:.2f} GiB (DDMA receive peak {self.receive_bytes / GIB:.2f}, NCCL "
                f"buffers {self.nccl_bytes / GIB:.2f}); {(1 - self.fraction) * self.gpu_bytes / GIB:.1f} GiB left "
                f"outside weights and KV cache")


def server_memory(plan, schedule, replica_ranks: list[int], gpu_bytes: int, bucketed: bool,
                  server_flags: dict) -> ServerMemory:
    """The memory plan of the replica whose generator ranks are `replica_ranks` (each on a GPU of `gpu_bytes`, its
    server's TP worker's): `bucketed`, whether the engine installs in buckets (SGLang on GPUs); `server_flags`, the
    run's --sglang-<flag> server flags (a given mem_fraction_static is kept, and chunked_prefill_size and
    cuda_graph_max_bs change SGLang's own reserve)."""
    tp = len(replica_ranks)
    reserve = sglang_reserve_bytes(gpu_bytes, tp, server_flags.get("chunked_prefill_size"),
                                   server_flags.get("cuda_graph_max_bs"))
    receive = max(schedule.receive_peak(g, bucketed) for g in replica_ranks)
    peers = max(len({p.src for p in plan.recvs(g)}) for g in replica_ranks)
    nccl = peers * NCCL_BYTES_PER_PEER
    given = server_flags.get("mem_fraction_static")
    if given is not None:
        fraction = float(given)
    else:
        fraction = math.floor(1000 * (gpu_bytes - reserve - receive - nccl) / gpu_bytes) / 1000
    if fraction <= 0:
        raise ValueError(f"a generator GPU of {gpu_bytes / GIB:.1f} GiB leaves nothing for SGLang's weights and KV "
                         f"cache after its own {reserve / GIB:.1f} GiB and the generator rank's "
                         f"{(receive + nccl) / GIB:.2f} GiB: lower --ddma-bucket-mb, or more "
                         "--rollout-tensor-parallel-size")
    return ServerMemory(gpu_bytes, reserve, receive, nccl, fraction, given is not None)
