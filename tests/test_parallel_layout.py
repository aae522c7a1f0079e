"""A bad parallel layout fails at start with a message naming the flag and the numbers."""

import pytest

from megatron_rl.parallel import ParallelLayout
from megatron_rl.models.spec import get_model_spec

TINY = get_model_spec("tiny-llama")  # 4 heads, 2 KV heads, 2 layers


@pytest.mark.parametrize(
    "tp,pp,world,pattern",
    [
        (3, 1, 3, r"--tensor-model-parallel-size 3 does not divide the model's num_attention_heads 4"),
        (4, 1, 4, r"--tensor-model-parallel-size 4 does not divide the model's num_key_value_heads 2"),
        (1, 4, 4, r"--pipeline-model-parallel-size 4 does not divide the model's num_layers 2"),
        (2, 2, 6, r"world size 6 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4"),
        (0, 1, 1, r"--tensor-model-parallel-size must be >= 1, got 0"),
    ],
)
def test_bad_layout_names_flag_and_numbers(tp, pp, world, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(tp, pp).validate(world, TINY)


def test_good_layout_gives_data_parallel_size():
    layout = ParallelLayout(2, 1)
    layout.validate(8, TINY)
    assert layout.data_parallel_size(8) == 4
