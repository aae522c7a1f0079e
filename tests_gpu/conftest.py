"""The GPU tier (tools/test_gpu.sh): every test here needs a CUDA device and is skipped, with the reason, without
one. The default CPU suite (tests/) never collects this folder."""

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # helpers


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no GPU: the GPU tier needs a CUDA device")
        for item in items:
            item.add_marker(skip)
