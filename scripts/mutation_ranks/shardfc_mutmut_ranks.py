"""pytest plugin of ``scripts/mutation.sh`` (``PYTEST_PLUGINS``): what mutmut learns of a test in its
stats run, and how long a mutant's world may wait.

mutmut's stats run records, for each test, the functions its trampolines saw in this process from the
test's start to its teardown, and the seconds of its call phase. A fixture shared by several tests
(a module's spawned worlds, a trained run) is set up inside the first test only, so on its own mutmut
would count only that test as reaching what the fixture ran, and no test as taking the fixture's time:
mutants there were checked against one test's asserts, and ones whose tests need the fixture set up
were cut off by a wall-clock limit ((estimate + 1) x 15 s) sized for the call alone and counted as
"timeout" (caught). Here, in the stats run (``MUTANT_UNDER_TEST=stats``):

- each fixture's setup is recorded on its own: the functions reached in this process and in the
  processes it started (the files this folder's ``sitecustomize`` writes to ``SHARDFC_MUTMUT_HITS``),
  and its seconds;
- at each test's teardown (before mutmut's own hook reads and clears its record) the test gets what
  its own processes reached and what the setups of all the fixtures it uses reached;
- each test's estimate gets the setup seconds of all the fixtures it uses: a test run alone, as mutmut
  runs the tests of one mutant, sets them up again. (A mutant's estimate, the sum over its tests, so
  overstates a shared fixture: its limit is generous; a hang in a launched world ends by the next point.)

In every run, when ``SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S`` is set, the worlds that
:func:`shardfc.parallel.launch.spawn` starts in this process wait at most that long in a collective: a
mutant that leaves a rank out of one (a skipped broadcast, a gather over the wrong group) would hold
its world for the tests' own timeout, minutes, and fails in seconds instead, as it would anyway.
"""

import functools
import inspect
import os
import sys
import time
from pathlib import Path

import pytest

#: fixture instance (its definition, its parameter) -> (setup seconds, functions its setup reached)
_setups: dict = {}


def _stats_run() -> bool:
    return os.environ.get("MUTANT_UNDER_TEST") == "stats"


def _rank_hits() -> set:
    """What the processes started since the last call reached (their files read and removed)."""
    hits = os.environ.get("SHARDFC_MUTMUT_HITS")
    names: set = set()
    if hits:
        for path in Path(hits).glob("*.hits"):
            names.update(path.read_text(encoding="utf-8").split())
            path.unlink()
    return names


def _this_process_writes_again() -> None:
    """This process's own recorder (sitecustomize's, where it replaced mutmut's) writes each name once
    per record: a new record starts, so it writes them again."""
    site = sys.modules.get("sitecustomize")
    if site is not None and hasattr(site, "seen"):
        site.seen.clear()


def _instance(fixturedef, param) -> tuple:
    return id(fixturedef), repr(param)


def _instances_of(item) -> list:
    """The fixture instances ``item`` uses (with the parameter each has in it)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [_instance(info.name2fixturedefs[name][-1], params.get(name))
            for name in item.fixturenames if name in info.name2fixturedefs]


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if not _stats_run():
        yield
        return
    from mutmut.state import state

    record = state()._stats
    before = set(record) | _rank_hits()
    record.clear()
    _this_process_writes_again()
    start = time.perf_counter()
    try:
        yield
    finally:
        reached = set(record) | _rank_hits()
        _setups[_instance(fixturedef, getattr(request, "param", None))] = (time.perf_counter() - start, reached)
        record.update(before | reached)  # the test being set up keeps all it had, and this too


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cap_launch_timeouts()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    if call.when != "call" or not _stats_run():
        return
    from mutmut.state import state

    state().duration_by_test[item.nodeid] += sum(_setups.get(key, (0.0, ()))[0] for key in _instances_of(item))


def cap_launch_timeouts() -> None:
    """Cap the ``timeout_s`` of every launch from now on at ``SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S`` (once)."""
    cap = os.environ.get("SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S")
    if not cap:
        return
    from shardfc.parallel import launch

    run = launch._run  # what spawn calls for each attempt, looked up at the call: however spawn was imported
    if getattr(run, "capped_at", None) is not None:
        return
    signature = inspect.signature(run)

    @functools.wraps(run)
    def capped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["timeout_s"] = min(bound.arguments["timeout_s"], float(cap))
        return run(*bound.args, **bound.kwargs)

    capped.capped_at = float(cap)
    launch._run = capped


@pytest.hookimpl(tryfirst=True)  # before mutmut's own teardown hook reads and clears what it saw
def pytest_runtest_teardown(item, nextitem):
    if not _stats_run() or not os.environ.get("SHARDFC_MUTMUT_HITS"):
        return
    from mutmut.state import state

    record = state()._stats
    record.update(_rank_hits())
    for key in _instances_of(item):
        record.update(_setups.get(key, (0.0, set()))[1])
    _this_process_writes_again()  # the next test's record starts afresh
