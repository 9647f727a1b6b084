"""pytest plugin of ``scripts/mutation.sh`` (``PYTEST_PLUGINS``): at the end of each test of mutmut's
stats run, the functions that the test reached in any process (written by this folder's
``sitecustomize``: the processes the test started, and this one when it started in the stats run)
join those mutmut recorded itself, so that the test counts as reaching them."""

import os
from pathlib import Path

import pytest


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
