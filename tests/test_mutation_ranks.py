"""scripts/mutation_ranks/: how a mutation run sees what the processes its tests start do.

The two pieces are run here against a stand-in of the two names of mutmut they touch (mutmut is not
installed in CI), and those names are checked on the real mutmut where it is installed."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

RANKS = Path(__file__).resolve().parents[1] / "scripts" / "mutation_ranks"


def _stand_in_mutmut(root: Path) -> Path:
    """A package ``mutmut`` whose trampoline's recorder raises: only sitecustomize's may be called."""
    pkg = root / "mutmut"
    (pkg / "mutation").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mutation" / "__init__.py").write_text("")
    (pkg / "mutation" / "trampoline.py").write_text(
        "def record_trampoline_hit(name, caller=None):\n    raise AssertionError('mutmut recorded ' + name)\n")
    return root


def _started_process(tmp_path: Path, mutant: str | None):
    """A process a test starts: records three calls of two functions, prints its pid and whether ``src``
    comes first on its path (after ``python -c``'s own '' or a script's folder, put there after start-up)."""
    hits, src = tmp_path / "hits", tmp_path / "src"
    hits.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MUTANT_UNDER_TEST"}
    env.update(PYTHONPATH=f"{RANKS}{os.pathsep}{_stand_in_mutmut(tmp_path / 'site')}", SHARDFC_MUTMUT_HITS=str(hits),
               SHARDFC_MUTMUT_SRC=str(src))
    if mutant is not None:
        env["MUTANT_UNDER_TEST"] = mutant
    code = ("import os, sys\nimport mutmut.mutation.trampoline as t\nprint(os.getpid(), sys.path[1] == os.environ['SHARDFC_MUTMUT_SRC'])\n"
            "try:\n    [t.record_trampoline_hit(n) for n in ('a.f', 'a.f', 'b.g')]\n"
            "except AssertionError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return out.splitlines(), hits, src


def test_in_the_stats_run_a_started_process_writes_each_function_it_reaches_once(tmp_path):
    (first, *rest), hits, src = _started_process(tmp_path, "stats")
    pid, src_first = first.split(" ", 1)
    assert rest == [] and src_first == "True"  # nothing reached mutmut's own recorder; the mutated copy first
    assert [p.name for p in hits.iterdir()] == [f"{pid}.hits"]
    assert (hits / f"{pid}.hits").read_text() == "a.f\nb.g\n"


@pytest.mark.parametrize("mutant", ["shardfc.parallel.pipeline.x_create_layout__mutmut_3", None])
def test_outside_the_stats_run_nothing_is_recorded(tmp_path, mutant):
    # a mutant's run: the process imports the mutated copy and runs the mutant, records nothing;
    # mutmut's own process (no MUTANT_UNDER_TEST when it starts): left as it is
    (first, *rest), hits, src = _started_process(tmp_path, mutant)
    assert rest == ["mutmut recorded a.f"] and list(hits.iterdir()) == []
    assert first.split(" ", 1)[1] == str(mutant is not None)


@pytest.fixture
def plugin(monkeypatch, tmp_path):
    """The pytest plugin, with a stand-in for mutmut's state and this folder's sitecustomize."""
    recorded = types.SimpleNamespace(_stats={"seen.in.process"})
    state = types.ModuleType("mutmut.state")
    state.state = lambda: recorded
    monkeypatch.setitem(sys.modules, "mutmut.state", state)
    monkeypatch.setitem(sys.modules, "mutmut", types.ModuleType("mutmut"))
    site = types.ModuleType("sitecustomize")
    site.seen = {"a.f"}
    monkeypatch.setitem(sys.modules, "sitecustomize", site)
    spec = importlib.util.spec_from_file_location("shardfc_mutmut_ranks", RANKS / "shardfc_mutmut_ranks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hits = tmp_path / "hits"
    hits.mkdir()
    (hits / "11.hits").write_text("a.f\nb.g\n")
    (hits / "12.hits").write_text("c.h\n")
    monkeypatch.setenv("SHARDFC_MUTMUT_HITS", str(hits))
    return module, recorded, site, hits


def test_at_a_tests_end_what_its_processes_reached_joins_mutmuts_record(plugin, monkeypatch):
    module, recorded, site, hits = plugin
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    module.pytest_runtest_teardown(None, None)
    assert recorded._stats == {"seen.in.process", "a.f", "b.g", "c.h"}
    assert list(hits.iterdir()) == [] and site.seen == set()  # the next test starts its record afresh


@pytest.mark.parametrize("env", [{"MUTANT_UNDER_TEST": "shardfc.x__mutmut_1"}, {}, {"SHARDFC_MUTMUT_HITS": ""}])
def test_outside_the_stats_run_the_plugin_does_nothing(plugin, monkeypatch, env):
    module, recorded, site, hits = plugin
    monkeypatch.delenv("MUTANT_UNDER_TEST", raising=False)
    if "SHARDFC_MUTMUT_HITS" in env:
        monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    module.pytest_runtest_teardown(None, None)
    assert recorded._stats == {"seen.in.process"} and len(list(hits.iterdir())) == 2 and site.seen == {"a.f"}


def test_the_names_it_touches_are_mutmuts():
    trampoline = pytest.importorskip("mutmut.mutation.trampoline")  # the 'mutation' extra
    from mutmut.state import state

    assert callable(trampoline.record_trampoline_hit) and isinstance(state()._stats, set)


def _timeout_seen_by_run(monkeypatch):
    """``launch._run`` stood in for by one that returns the ``timeout_s`` spawn hands it (its real signature)."""
    from shardfc.parallel import launch

    real = launch._run
    monkeypatch.setattr(launch, "_run", functools.wraps(real)(
        lambda *a, **k: inspect.signature(real).bind(*a, **k).arguments["timeout_s"]))
    return launch


def test_a_capped_launch_waits_at_most_the_cap_in_a_collective(plugin, monkeypatch):
    module = plugin[0]
    launch = _timeout_seen_by_run(monkeypatch)
    monkeypatch.setenv("SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S", "30")
    module.pytest_runtest_setup(None)
    module.pytest_runtest_setup(None)  # every test's setup: capped once, not wrapped again
    assert launch._run.capped_at == 30.0 and not hasattr(launch._run.__wrapped__, "capped_at")
    assert launch.spawn(print, 1, timeout_s=300.0) == 30.0  # the default of spawn and of the tests
    assert launch.spawn(print, 2, timeout_s=5.0) == 5.0  # a shorter one stays


def test_without_a_cap_launches_keep_their_timeout(plugin, monkeypatch):
    module = plugin[0]
    launch = _timeout_seen_by_run(monkeypatch)
    monkeypatch.delenv("SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S", raising=False)
    module.pytest_runtest_setup(None)
    assert launch.spawn(print, 1) == 300.0 and not hasattr(launch._run, "capped_at")


_SHARED_FIXTURE_TESTS = '''
import os, time, pytest
from mutmut.state import state

@pytest.fixture(scope="module", params=[1, 2])
def world(request):  # as a module's spawned worlds: reached here and in a "rank", set up once per parameter
    state()._stats.add(f"setup.here.{request.param}")
    with open(os.path.join(os.environ["SHARDFC_MUTMUT_HITS"], f"rank{request.param}.hits"), "w") as f:
        f.write(f"setup.in.rank.{request.param}\\n")
    time.sleep(0.3)
    return request.param

def test_first(world):
    state()._stats.add("first.call")

def test_second(world):
    pass

def test_alone():
    pass
'''


def test_each_test_of_a_shared_fixture_counts_as_reaching_and_taking_what_its_setup_did(pytester, monkeypatch,
                                                                                        tmp_path):
    """mutmut's stats run as harness.py records it (a stand-in of its collector), with the plugin: every test
    that uses a module fixture reaches what the fixture's setup reached (here and in the processes it
    started) and takes its seconds, not only the test inside whose setup it ran."""
    recorded = types.SimpleNamespace(_stats=set(), duration_by_test={})
    state = types.ModuleType("mutmut.state")
    state.state = lambda: recorded
    monkeypatch.setitem(sys.modules, "mutmut.state", state)
    monkeypatch.setitem(sys.modules, "mutmut", types.ModuleType("mutmut"))
    hits = tmp_path / "hits"
    hits.mkdir()
    monkeypatch.setenv("SHARDFC_MUTMUT_HITS", str(hits))
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    monkeypatch.delenv("SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S", raising=False)
    reached = {}

    class MutmutsCollector:  # what mutmut's StatsCollector does (runners/harness.py)
        def pytest_runtest_logstart(self, nodeid, location):
            recorded.duration_by_test[nodeid] = 0

        def pytest_runtest_teardown(self, item, nextitem):
            reached[item.name] = set(recorded._stats)
            recorded._stats.clear()

        def pytest_runtest_makereport(self, item, call):
            if call.when == "call":
                recorded.duration_by_test[item.nodeid] += call.duration

    spec = importlib.util.spec_from_file_location("shardfc_mutmut_ranks", RANKS / "shardfc_mutmut_ranks.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    pytester.makepyfile(test_shared=_SHARED_FIXTURE_TESTS)
    result = pytester.inline_run("-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:randomly",
                                 plugins=[plugin, MutmutsCollector()])
    result.assertoutcome(passed=5)
    for p in (1, 2):
        setup = {f"setup.here.{p}", f"setup.in.rank.{p}"}
        assert reached[f"test_first[{p}]"] == setup | {"first.call"}
        assert reached[f"test_second[{p}]"] == setup  # without the plugin: nothing, its fixture set up earlier
    assert reached["test_alone"] == set()
    seconds = {nodeid.split("::")[1]: s for nodeid, s in recorded.duration_by_test.items()}
    assert all(seconds[f"test_{which}[{p}]"] >= 0.3 for which in ("first", "second") for p in (1, 2))
    assert seconds["test_alone"] < 0.3
    assert list(hits.iterdir()) == []
