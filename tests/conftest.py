import os

import pytest
import torch

# Tests run on 2 cores; keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def rng():
    """A fresh generator per test: numerics are never tested on zeros or on a shared seed."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.fixture
def one_thread():
    """One torch thread: tiny tensors run fastest that way on the busy 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def rank_results(tmp_path_factory):
    """``rank_results(n, name)``: per rank, the result of the n-rank case ``name`` registered with
    helpers.RANK_BATCH (all registered n-rank cases run in one spawn, on first use)."""
    from helpers import RANK_BATCH
    root = tmp_path_factory.mktemp("rank-batch")
    return lambda n, name: RANK_BATCH.get(n, name, root)
