"""The frozen reference policy of the KL penalty (--kl-coef): a second copy of the model in the trainer's own
layout (the same TP / PP shard on every trainer rank, on the policy's device, in its dtype), with no DDP wrapper,
no gradients and no optimizer: it only runs forward, through the same Megatron schedule and micro-batches as the
policy, so its log-probs line up with the policy's token for token.

Its weights come from --ref-load (an HF checkpoint directory, or a Megatron one written by the converter in the
safetensors format), or by default from the policy itself when RL begins (`copy_from`, after any supervised
warm-up). RL checkpoints store them, so a resumed run keeps the reference it started with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from megatron_rl.models import layout as L
from megatron_rl.models.spec import ModelSpec
from megatron_rl.trainer.policy import Policy, forward_logprobs

MEGATRON_META_FILE = "megatron_rl.json"  # conversion.META_FILE, read here without importing the converter


class ReferenceModel:
    """This rank's shard of the reference model. `source` says where its weights came from (None: not set yet,
    and `logprobs` refuses to run)."""

    def __init__(self, policy: Policy):
        from megatron_rl.trainer.model import build_gpt_model, transformer_config

        self.spec, self.layout, self.device = policy.spec, policy.layout, policy.device
        config = transformer_config(policy.spec, policy.layout, params_dtype=policy.config.params_dtype,
                                    use_cpu_initialization=policy.config.use_cpu_initialization,
                                    perform_initialization=False)  # every weight is overwritten before use
        self.module = build_gpt_model(policy.spec, policy.layout, config).to(policy.device)
        self.module.eval().requires_grad_(False)
        self.source: str | None = None

    def load(self, directory: str) -> None:
        """Read the weights of --ref-load `directory` (checked at start-up by `check_reference_checkpoint`)."""
        from megatron_rl.trainer.weights import load_hf_weights

        load_hf_weights(self.module, self.spec, self.layout, reference_reader(directory))
        self.source = f"--ref-load {directory}"

    @torch.no_grad()
    def copy_from(self, policy: Policy) -> None:
        """Take the policy's current weights (this rank's shard of both: no communication)."""
        params = dict(policy.module.named_parameters())
        for name, p in self.module.named_parameters():
            p.copy_(params[name])
        self.source = "the policy at the start of RL"

    def restored(self) -> None:
        """Its weights were just loaded from an RL checkpoint."""
        self.source = "the reference of the resumed checkpoint"

    def logprobs(self, microbatches: list[dict[str, torch.Tensor]], temperature: float) -> list[torch.Tensor]:
        """Reference log-probs of each micro-batch's tokens[:, 1:] on the last pipeline stage (none elsewhere)."""
        if self.source is None:
            raise RuntimeError("the reference model has no weights yet: the default reference is copied from the "
                               "policy by the 'snapshot_reference' command before the first RL step")
        return forward_logprobs(self.module, microbatches, self.spec.vocab_size, temperature)


def reference_reader(directory: str) -> Callable[[L.Segment, int], torch.Tensor]:
    """The `get_slice` of a --ref-load directory: a Megatron checkpoint (megatron_rl.json) or an HF one."""
    if os.path.isfile(os.path.join(directory, MEGATRON_META_FILE)):
        from megatron_rl.conversion import MegatronCheckpoint

        return MegatronCheckpoint(directory).get_slice
    from megatron_rl.models.safetensors_io import HFCheckpoint

    return HFCheckpoint(directory).get_slice


def check_reference_checkpoint(directory: str, spec: ModelSpec) -> None:
    """Everything about --ref-load that can be checked before any weight exists: the directory holds an HF
    checkpoint (config.json and every tensor of the model, right shapes) or a Megatron checkpoint of the
    converter's safetensors format, of the same architecture as the policy. Errors name the flag."""
    if not os.path.isdir(directory):
        raise ValueError(f"--ref-load {directory!r}: no such directory")
    meta_path = os.path.join(directory, MEGATRON_META_FILE)
    try:
        if os.path.isfile(meta_path):
            from megatron_rl.conversion import MegatronCheckpoint

            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("format") != "safetensors":
                raise ValueError(f"a Megatron checkpoint of format {meta.get('format')!r}; the reference reads "
                                 "the safetensors format (tools/convert_hf_to_megatron.py --megatron-format "
                                 "safetensors) or an HF checkpoint directory")
            ref_spec = MegatronCheckpoint(directory).spec  # checks every rank file's tensors and shapes
        elif os.path.isfile(os.path.join(directory, "config.json")):
            from megatron_rl.conversion import validate_hf_checkpoint
            from megatron_rl.models.safetensors_io import HFCheckpoint

            ckpt = HFCheckpoint(directory)
            ref_spec = ModelSpec.from_hf_config(ckpt.config)
            validate_hf_checkpoint(ref_spec, ckpt)
        else:
            raise ValueError(f"neither config.json (HF) nor {MEGATRON_META_FILE} (Megatron) is there")
    except (OSError, KeyError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"--ref-load {directory!r}: {e}") from None
    for field, value in spec.weight_fields().items():
        if getattr(ref_spec, field) != value:
            raise ValueError(f"--ref-load {directory!r}: the reference model has {field} {getattr(ref_spec, field)}, "
                             f"the policy's is {value} (model {spec.name!r})")
