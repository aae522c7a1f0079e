"""Rollout programs for the agent tests, loaded by --custom-generate-function-path from this file."""

from megatron_rl.rollout.agent import EnvironmentFailure, Trajectory

OBSERVATION = " obs "


async def two_turns(sample, client):
    """Three sampled tokens, an observation the policy did not write, three more sampled tokens."""
    trajectory = Trajectory(list(sample.prompt_token_ids))
    await client.sample(trajectory, max_new_tokens=3, stop_token_ids=(), ignore_eos=True)
    trajectory.add_observation(client.tokenizer.encode(OBSERVATION, add_special_tokens=False))
    await client.sample(trajectory, max_new_tokens=3, stop_token_ids=(), ignore_eos=True)
    trajectory.metadata = {"program": "two_turns"}
    return trajectory


async def environment_down(sample, client):
    raise EnvironmentFailure("the tool server is unreachable")
