"""The documentation: the site builds with warnings as errors (broken links, pages left out of the
navigation, docstrings the API reference cannot render), the README's links resolve, and every
Python block of the guides runs (a block preceded by ``<!-- not run by the docs test: why -->``
needs what a test machine has not; the comment says what). ``pip install -e '.[test]'`` brings
mkdocs."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = "<!-- not run by the docs test:"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]' brings it)")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is not installed")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("index.html", "api/index.html", "head/index.html", "gpu/index.html"):
        assert (tmp_path / page).is_file(), page
    api = (tmp_path / "api" / "index.html").read_text()
    assert "ShardedMarginHead" in api and "PartialFC_V2" in api and "head_optimizer" in api


def test_readme_links_resolve():
    text = open(os.path.join(ROOT, "README.md")).read()
    links = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if not t.startswith("http")]
    assert links  # the README points into the site
    missing = [t for t in links if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, missing


def _blocks():
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = open(path).read()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            before = text[: m.start()].rstrip().splitlines()[-1:] or [""]
            yield os.path.relpath(path, ROOT), m.group(1), before[0].startswith(SKIP)


BLOCKS = list(_blocks())


@pytest.mark.parametrize("page", sorted({p for p, _, _ in BLOCKS}))
def test_guide_code_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__docs__"}
    ran = 0
    for i, (p, code, skipped) in enumerate(BLOCKS):
        if p != page or skipped:
            continue
        exec(compile(code, f"{page} (python block {i})", "exec"), ns)
        ran += 1
    assert ran or all(skipped for p, _, skipped in BLOCKS if p == page)
