"""The modules' names before train/ was arranged by concept (``shardfc._moved``): each imports its new home's module object, warns
once naming the new path, and pickles written under the old name load; nothing runs an old name with
``python -m`` (an alias is no file). The only test that imports the old paths."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pickle
import re
import subprocess
import sys
import warnings

import pytest

import shardfc  # noqa: F401  (installs the alias finder)
from shardfc._moved import MOVED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _forget(old: str) -> None:
    """``old`` as if never imported (its new home stays: other tests hold its objects)."""
    sys.modules.pop(old, None)
    parent, _, name = old.rpartition(".")
    if parent in sys.modules and getattr(sys.modules[parent], name, None) is not None:
        delattr(sys.modules[parent], name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_its_new_module_and_warns_once(old):
    new = importlib.import_module(MOVED[old])
    _forget(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
        again = importlib.import_module(old)
    assert alias is new and again is new and sys.modules[old] is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]  # the module keeps its own name
    moved = [w for w in caught if issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in caught]
    assert str(moved[0].message) == f"{old} moved to {MOVED[old]}; the old name goes in the next release"


@pytest.mark.parametrize("old", ["shardfc.train.cli", "shardfc.train.phases"])
def test_the_warning_points_at_the_import(old):
    """At the ``import`` statement or ``import_module``'s caller, not at the import system. (Not run by
    scripts/mutation.sh: mutmut's trampolines are frames of another file between them.)"""
    for how in ("import_module", "statement"):
        _forget(old)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            importlib.import_module(old) if how == "import_module" else exec(f"import {old}", {})
        moved = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(moved) == 1, [str(w.message) for w in caught]
        if how == "import_module":
            assert (moved[0].filename, moved[0].lineno) == (__file__, line)
        else:  # the statement's own frame: the exec'd code
            assert moved[0].filename == "<string>"


def test_install_puts_one_finder_first(monkeypatch):
    """``install`` (run when shardfc is imported) puts the alias finder first on ``sys.meta_path``, and
    only once however often it runs."""
    from shardfc._moved import _Alias, install

    others = [f for f in sys.meta_path if not isinstance(f, _Alias)]
    monkeypatch.setattr(sys, "meta_path", list(others))
    install()
    install()
    assert isinstance(sys.meta_path[0], _Alias) and sys.meta_path[1:] == others
    _forget("shardfc.train.cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module("shardfc.train.cpu") is importlib.import_module(MOVED["shardfc.train.cpu"])


def test_from_import_of_an_old_name_reaches_the_new_module():
    _forget("shardfc.train.cli")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from shardfc.train import cli as old_cli
    from shardfc.cli import train as new_cli

    assert old_cli is new_cli


def _a_global_of(module):
    """A public class defined in ``module`` (dataclasses first: what a run would pickle), else a function."""
    found = [c for name, c in vars(module).items() if (inspect.isclass(c) or inspect.isfunction(c))
             and not name.startswith("_") and c.__module__ == module.__name__]
    found.sort(key=lambda c: (not inspect.isclass(c), not dataclasses.is_dataclass(c)))
    return found[0] if found else None


def test_a_pickle_written_under_an_old_module_name_loads():
    checked = 0
    for old, new in sorted(MOVED.items()):
        module = importlib.import_module(new)
        cls = _a_global_of(module)
        if cls is None:
            continue
        payload = pickle.dumps(cls, protocol=0)  # by reference: "c<module>\n<name>\n"
        assert new.encode() in payload
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert pickle.loads(payload.replace(new.encode() + b"\n", old.encode() + b"\n")) is cls
        checked += 1
    assert checked


def test_nothing_runs_an_old_path_with_python_m():
    files = subprocess.run(["git", "ls-files", "src", "tests", "scripts", "docs", ".ci", "README.md"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"-m\s+[\"']?(" + "|".join(re.escape(old) for old in MOVED) + r")(?![\w.])")
    found = []
    for path in files:
        if path.endswith((".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt")) or "/" not in path.strip("./"):
            try:
                text = open(os.path.join(ROOT, path), encoding="utf-8").read()
            except (OSError, UnicodeDecodeError):
                continue
            found += [f"{path}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not found, found

