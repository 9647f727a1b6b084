"""The tree passes the linter configured in pyproject.toml (ruff: pyflakes' unused imports and
names, undefined names; import order). ``pip install -e '.[test]'`` brings ruff."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff():
    try:
        import ruff  # noqa: F401  (the wheel ships the binary beside the package)
    except ImportError:
        return shutil.which("ruff")
    return [sys.executable, "-m", "ruff"]


def test_the_tree_is_lint_clean():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    cmd = (ruff if isinstance(ruff, list) else [ruff]) + ["check", "--no-cache", "src", "tests", "scripts", "docs"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
