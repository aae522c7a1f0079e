"""Rollout routing replay (R3): the trainer routes each token to the experts the generator routed it to.

A mixture-of-experts policy computed in two places (the generator's kernels and precision, the trainer's) can
pick different top-k experts for the same token: a tiny logit difference flips a near-tie, and the token's
log-prob then comes from a different sub-network. Its importance ratio then measures the routers'
disagreement, not the policy's change. With `--use-rollout-routing-replay` the generator records the top-k
experts of every token in every layer (`RolloutOutput.routed_experts`), and the trainer's forward passes use
exactly those experts; the router's weights for them are still the trainer's own (its softmax over the replayed
experts' scores when top-k is renormalized, else its softmax over all experts taken at the replayed ones), so
gradients reach the router as usual.

This drives Megatron-Core's own mechanism (`moe_enable_routing_replay`, one `RouterReplay` per router): before
each micro-batch's forward, every router of this rank's pipeline stage is given that micro-batch's routes for
its layer, in Megatron's token order (sequence-major: [s, b] flattened), and the split of the sequence over
tensor-parallel ranks when sequence parallelism is on.
"""

from __future__ import annotations

import torch


def routers(model: torch.nn.Module) -> list[tuple[int, object]]:
    """(global layer index, `RouterReplay`) of every MoE layer of this model shard, in layer order (empty for a
    dense model, or one built without `moe_enable_routing_replay`)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [(m.layer_number - 1, m.mlp.router.router_replay) for m in model.modules()
            if isinstance(m, TransformerLayer) and getattr(getattr(m.mlp, "router", None), "router_replay", None)]


def stage_routes(routes: torch.Tensor, layers: list[int], sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Per layer of `layers` (global layer indices), the routes of a micro-batch as Megatron's router sees its
    tokens: `routes` is [b, s, num_layers, topk]; each result is [s_local * b, topk] long."""
    if sequence_parallel:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        share = routes.shape[1] // tp
        routes = routes[:, rank * share:(rank + 1) * share]
    return [routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1]).long() for layer in layers]


def replay(model: torch.nn.Module, routes: torch.Tensor, sequence_parallel: bool = False) -> None:
    """Make the next forward pass of `model` use `routes` ([b, s, num_layers, topk]) in every MoE layer."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = routers(model)
    if not replays:
        raise RuntimeError("rollout routing replay: the model has no router with replay enabled (it must be a "
                           "mixture of experts built with moe_enable_routing_replay)")
    targets = stage_routes(routes, [layer for layer, _ in replays], sequence_parallel)
    for (_, router), target in zip(replays, targets):
        router.clear_indices()
        router.set_target_indices(target.to(next(model.parameters()).device))
        router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def stop_replay(model: torch.nn.Module) -> None:
    """Route with the model's own top-k again."""
    for _, router in routers(model):
        router.clear_indices()
        router.clear_router_replay_action()
