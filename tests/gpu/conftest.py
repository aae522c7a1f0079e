"""The GPU tier (tests/gpu/run.sh): every test here needs a CUDA device and is skipped, with the reason, without
one. The default CPU suite (tests/cpu/) never collects this folder."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no GPU: the GPU tier needs a CUDA device")
        for item in items:
            item.add_marker(skip)
