"""Fixtures of the distill tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread (two threads contend with other jobs on a 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def block_cache(tmp_path_factory):
    """One packed-block cache per test module (``$SPECDRAFT_CACHE``), so a module's tiny tokenizer's blocks are
    tokenized once and nothing touches the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield
