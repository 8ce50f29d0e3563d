"""Test utilities users can reuse: a spawn harness and small models."""

from fsdp_lite.testing.models import GPT, ConvNet, GPTConfig
from fsdp_lite.testing.spawn import DistributedTestError, fake_group, run_distributed

__all__ = ["GPT", "ConvNet", "GPTConfig", "DistributedTestError", "fake_group", "run_distributed"]
