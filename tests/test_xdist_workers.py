"""How the suite runs: the test processes ``-n auto`` starts (tests/xdist_workers.py), and the
pyproject settings that make the README's ``python -m pytest -q`` run them."""

from __future__ import annotations

import os
from pathlib import Path

import xdist_workers
from shardfc import files

ROOT = Path(__file__).resolve().parents[1]


def test_auto_starts_one_process_per_usable_core_at_most_eight(monkeypatch):
    for cores, workers in ((1, 1), (2, 2), (7, 7), (8, 8), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert xdist_workers.auto_workers() == workers, cores
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS: no affinity, the CPU count
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert xdist_workers.auto_workers() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert xdist_workers.auto_workers() == 1


def test_the_test_extra_brings_what_the_addopts_ask_for():
    project = files.load_toml(ROOT / "pyproject.toml")
    assert project["tool"]["pytest"]["ini_options"]["addopts"].split() == ["-ra", "-n", "auto"]
    assert any(dep.startswith("pytest-xdist") for dep in project["project"]["optional-dependencies"]["test"])
