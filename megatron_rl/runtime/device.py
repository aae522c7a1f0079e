"""The one place a rank's device is chosen, and what follows from it (the process-group backend).

A rank runs on `cuda:LOCAL_RANK` (modulo the GPUs it can see) when CUDA is present, else on the CPU; `--device`
overrides (`cpu`, `cuda`, `cuda:N`). Every tensor a rank computes with (the trainer's model, batches and
log-probs, the built-in engine's weights and KV cache, DDMA's buffers) is put on this device, and its own
process groups use NCCL on a GPU and gloo on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def select_device(requested: str = "auto", local_rank: int | None = None) -> torch.device:
    """This rank's device: `requested` ("auto" = CUDA when present), a bare "cuda" meaning the GPU of this
    node-local rank (LOCAL_RANK, wrapping around when there are fewer GPUs than ranks). Makes it torch's current
    CUDA device, as Megatron-Core and NCCL expect."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError as e:
        raise ValueError(f"--device {requested!r}: not a device ({', '.join(DEVICE_CHOICES)})") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {requested!r}: only {', '.join(DEVICE_CHOICES)} are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {requested}: torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", local_rank % count)
        elif device.index >= count:
            raise ValueError(f"--device {requested}: only {count} CUDA device(s) are visible")
        torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend of a group whose tensors live on `device`."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclasses.dataclass(frozen=True)
class DeviceId:
    """Which physical device a rank computes on, comparable across processes and hosts: two ranks with equal
    ids share one GPU (or are both on CPUs)."""

    host: str
    type: str
    uuid: str  # the GPU's UUID; "" for a CPU

    @classmethod
    def of(cls, device: torch.device) -> DeviceId:
        device = torch.device(device)
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
        return cls(socket.gethostname(), device.type, uuid)

    def __str__(self) -> str:
        return f"{self.type} {self.uuid[:13]} on {self.host}" if self.uuid else f"{self.type} on {self.host}"
