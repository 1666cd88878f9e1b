"""Hypothesis runs the same examples on every run by default (``derandomize``), so that a
CI run is reproducible and never red by the draw; ``HYPOTHESIS_PROFILE=explore`` draws
new examples each run, to look for what the fixed ones miss."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist
from hypothesis import settings

settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


@pytest.fixture
def one_rank():
    """A gloo group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    yield
    dist.destroy_process_group()
