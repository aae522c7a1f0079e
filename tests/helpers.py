"""Helpers shared by the tests (not part of the package)."""


def gather_vocab_parallel(logits):
    """All-gather the TP vocab shards of the last dim (a full-vocabulary reference for tests; training never
    gathers the vocabulary)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits.contiguous())
