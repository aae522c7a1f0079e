"""The single controller (trainer rank 0): the RL loop, the rollout buffer and its gates, the reward stage,
the prompt source and evaluations."""
