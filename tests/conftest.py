from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def world1():
    """A one-rank gloo process group in this process, torn down after the test (unit and
    distributed test files both use it)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` skip cleanly where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the CUDA tier: make gpu-check)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
