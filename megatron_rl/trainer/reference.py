"""The frozen reference policy of the KL penalty (--kl-coef): a second copy of the model in the trainer's own
layout (the same TP / PP shard on every trainer rank, on the policy's device, in its dtype), with no DDP wrapper,
no gradients and no optimizer: it only runs forward, through the same Megatron schedule and micro-batches as the
policy, so its log-probs line up with the policy's token for token.

Its weights come from --ref-load (an HF checkpoint directory, or Megatron weights as --load-megatron reads
them), or by default from the policy itself when RL begins (`copy_from`, after any supervised warm-up). RL
checkpoints store them, so a resumed run keeps the reference it started with.
"""

from __future__ import annotations

import torch

from megatron_rl.trainer.policy import Policy, forward_logprobs


class ReferenceModel:
    """This rank's shard of the reference model. `source` says where its weights came from (None: not set yet,
    and `logprobs` refuses to run)."""

    def __init__(self, policy: Policy):
        from megatron_rl.models.megatron_config import transformer_config
        from megatron_rl.trainer.model import build_gpt_model

        self.spec, self.layout, self.device = policy.spec, policy.layout, policy.device
        config = transformer_config(policy.spec, policy.layout, params_dtype=policy.config.params_dtype,
                                    use_cpu_initialization=policy.config.use_cpu_initialization,
                                    perform_initialization=False,  # every weight is overwritten before use
                                    # the policy's kernels (a fused rope rounds differently), but no gradient
                                    fused=policy.device.type == "cuda", gradient_accumulation_fusion=False,
                                    # with routing replay, the reference routes each token as the generator did too
                                    moe_enable_routing_replay=policy.config.moe_enable_routing_replay)
        self.module = build_gpt_model(policy.spec, policy.layout, config).to(policy.device)
        self.module.eval().requires_grad_(False)
        self.source: str | None = None

    def load(self, directory: str) -> None:
        """Read the weights of --ref-load `directory` (checked at start-up by `check_reference_checkpoint`)."""
        from megatron_rl.trainer.weights import load_weights_from

        load_weights_from(self.module, self.spec, self.layout, directory, "--ref-load")
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


