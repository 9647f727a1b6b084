"""pytest plugin of ``scripts/mutation.sh`` (``PYTEST_PLUGINS``), two jobs.

- At the end of each test of mutmut's stats run, the functions that the test reached in any process
  (written by this folder's ``sitecustomize``: the processes the test started, and this one when it
  started in the stats run) join those mutmut recorded itself, so that the test counts as reaching them.
- Before each test, when ``SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S`` is set, the worlds that
  :func:`shardfc.parallel.launch.spawn` starts in this process wait at most that long in a collective.
  A mutant that leaves a rank out of a collective (a skipped broadcast, a gather over the wrong group)
  holds its world until that timeout, which tests leave at minutes; mutmut's own limit is on CPU time,
  which a waiting rank hardly uses. Capped, such a mutant fails in seconds, as it would have anyway.
"""

import functools
import inspect
import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cap_launch_timeouts()


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
    hits = os.environ.get("SHARDFC_MUTMUT_HITS")
    if not hits or os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    import sitecustomize
    from mutmut.state import state

    for path in Path(hits).glob("*.hits"):
        names = path.read_text(encoding="utf-8").split()
        path.unlink()
        state()._stats.update(names)
    sitecustomize.seen.clear()  # this process's next test writes what it reaches again
