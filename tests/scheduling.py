"""How both suites hand their tests to pytest-xdist's workers (tests/conftest.py and experiments/tests/conftest.py
import these hooks)."""


def pytest_configure(config):
    # pytest-xdist's --dist load queues tests on a worker in chunks: with the slow tests first (below), a chunk of
    # them could keep one worker busy for minutes while the other had run out (402 s against 288 s with one test at
    # a time, 2026-11-27). Where a marker expression names them (-m "not slow"), the chunks stay: one at a time
    # costs about 12 ms a test (the fast subset 82 s against 74 s).
    if getattr(config.option, "maxschedchunk", 0) is None and "slow" not in (config.getoption("markexpr", "") or ""):
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """The slow tests first, handed out one at a time: the last tests decide when the suite ends, and in files' order a
    worker that drew a 15-30 s command last kept the other idle for 36 s of 300; slow first, both workers finished
    within a second of each other. Among the slow, each file's first test leads (in files' order), then the rest: a
    folder built once for all workers (tests/shared_builds.py: the mini LLM world, 85 s) is built by the worker that
    drew its file's first test while the other starts on other files, instead of waiting for it."""
    leaders, rest, fast, seen = [], [], [], set()
    for item in items:
        if item.get_closest_marker("slow") is None:
            fast.append(item)
        else:
            (rest if item.path in seen else leaders).append(item)
            seen.add(item.path)
    items[:] = leaders + rest + fast
