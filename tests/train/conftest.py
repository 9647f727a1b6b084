"""Shared fixture of the ``shardfc train`` tests: one finished 2-process run."""

from __future__ import annotations

import pytest

from shardfc.cli import train as train_cli

from .tiny import tiny_config


@pytest.fixture(scope="session")
def run2(tmp_path_factory):
    """A finished 2-rank run: (config, summary)."""
    out = tmp_path_factory.mktemp("run2")
    cfg = tiny_config(out)
    summary = train_cli.run(cfg)
    return cfg, summary
