import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs of a minute or more")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
