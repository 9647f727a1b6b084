"""Loaded at start-up by every Python process a mutation run starts, through the PYTHONPATH that
``scripts/mutation.sh`` sets (nothing else puts this folder on a path): mutmut's own process, and the
spawned ranks and ``shardfc`` subprocesses of the tests.

mutmut learns which tests reach which function in a "stats" run, by recording the calls its
trampolines see in the process that runs the tests: a function called only inside a rank would count
as reached by no test, and its mutants would never be run. During that run (``MUTANT_UNDER_TEST=stats``
when the process starts), each process writes the functions its trampolines reach, each once, to a
file of its own in ``SHARDFC_MUTMUT_HITS``; ``shardfc_mutmut_ranks`` (a pytest plugin) hands what the
files hold to mutmut at the end of each test, and starts the next test's record afresh.
"""

import os
import sys

_HITS = os.environ.get("SHARDFC_MUTMUT_HITS")

# A process a test started (MUTANT_UNDER_TEST is set: mutmut's own process starts without it) imports
# the mutated copy, as the test's process does; a `shardfc` subprocess would find the checkout's src/.
# Not on PYTHONPATH: mutmut's process would then import the copy at start-up, before mutmut writes it.
if os.environ.get("MUTANT_UNDER_TEST") and os.environ.get("SHARDFC_MUTMUT_SRC"):
    sys.path.insert(0, os.environ["SHARDFC_MUTMUT_SRC"])

#: functions this process has written since the current test began (the plugin empties it)
seen = set()

if _HITS and os.environ.get("MUTANT_UNDER_TEST") == "stats":
    import mutmut.mutation.trampoline as _trampoline

    def _record(name, caller=None):
        if name not in seen:  # a hot loop's calls write nothing after the first
            seen.add(name)
            with open(os.path.join(_HITS, f"{os.getpid()}.hits"), "a", encoding="utf-8") as f:
                f.write(name + "\n")

    _trampoline.record_trampoline_hit = _record
