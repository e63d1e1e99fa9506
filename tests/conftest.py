import os
import random

import pytest
import torch

import seeding
import sharding

# Tests run on 2 cores; keep torch from oversubscribing them (scripts/test.sh runs two shards side
# by side, one thread each: MOEGRAPH_TEST_THREADS=1).
torch.set_num_threads(int(os.environ.get("MOEGRAPH_TEST_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))

SEED = pytest.StashKey[int]()


def pytest_configure(config):
    try:
        seeding.session_seed()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def pytest_report_header(config):
    return f"test seed: {seeding.ENV}={seeding.session_seed()} (tests/seeding.py)"


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run shard K of N (0-based): whole test files, balanced by tests/shard_weights.json "
                          "(scripts/test.sh runs two side by side)")


def pytest_collection_modifyitems(config, items):
    """A test that takes ``rank_results`` (directly or through a fixture) is slow: the first one to
    run spawns every registered case of its rank count (helpers.RankBatch), tens of seconds.
    With ``--shard K/N`` only shard K's files run (``sharding.shard_of``)."""
    for item in items:
        if "rank_results" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    spec = config.getoption("--shard")
    if spec:
        try:
            keep = sharding.shard_of(items, spec)
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = [item for item in items if item in keep]


@pytest.fixture(autouse=True)
def test_seed(request):
    """This test's seed (tests/seeding.py); torch's and ``random``'s global generators start from it."""
    seed = seeding.begin_test(request.node.nodeid)
    request.node.stash[SEED] = seed
    request.node.user_properties.append((seeding.ENV, seeding.session_seed()))
    torch.manual_seed(seed)
    random.seed(seed)
    yield seed
    seeding.end_test()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under a failing test: the session seed that replays it."""
    report = yield
    if report.failed and SEED in item.stash:
        report.sections.append(("test seed", f"{seeding.ENV}={seeding.session_seed()} "
                                f"(this test's seed {item.stash[SEED]}); replay: "
                                f"{seeding.ENV}={seeding.session_seed()} pytest '{item.nodeid}'"))
    return report


@pytest.fixture
def rng(test_seed):
    """A generator seeded with this test's seed: fresh numbers every run, never zeros, replayable."""
    return torch.Generator().manual_seed(test_seed)


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
