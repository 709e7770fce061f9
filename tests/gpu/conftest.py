from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def num_gpus():
    count = torch.cuda.device_count()
    if count < 2:
        pytest.fail(f"the GPU suite needs >= 2 GPUs, found {count}")  # never a silent skip
    return count
