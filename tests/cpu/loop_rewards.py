"""The reward functions of the controller loop tests, given to --custom-rm-path by path (a file of its own, small:
every reward worker loads it)."""


def reward_exact(sample):
    """1 for the exact answer."""
    return float(sample.response == sample.label)


def reward_one(sample):
    """Every response right: every group uniform, none carries signal."""
    return 1.0
