"""The ``shardfc`` dispatcher and the demo."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardfc import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_unknown_command_suggests_the_closest(capsys):
    assert cli.main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_demo_trains_on_two_processes():
    out = subprocess.run(
        [sys.executable, "-m", "shardfc", "demo", "--steps", "25", "--classes", "200", "--batch", "64"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 ranks; rank 0 holds classes 0..99 of 200" in out.stdout
    first, last = out.stdout.strip().splitlines()[-1].split("loss ")[1].split(" in ")[0].split(" -> ")
    assert float(last) < float(first)


def test_the_reference_page_is_every_commands_help():
    """docs/cli.md is what the commands print: regenerate it (python -m shardfc.cli.reference >
    docs/cli.md) when an option, a default or a help text changes."""
    from shardfc.cli import reference

    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
    version = f"Python {sys.version_info[0]}.{sys.version_info[1]}'s argparse"
    if version not in page:
        pytest.skip(f"docs/cli.md was rendered by another Python's argparse (this is {version})")
    assert reference.render() == page, "docs/cli.md is out of date: python -m shardfc.cli.reference > docs/cli.md"
    assert {name for name, _ in reference.PAGES} == set(cli.COMMANDS)


def test_the_reference_renders_at_its_width_and_restores_columns(monkeypatch):
    from shardfc.cli import reference

    monkeypatch.setenv("COLUMNS", "40")
    text = reference.command_help("data", ["pack"])
    assert text.startswith("usage: shardfc data pack [-h]") and not text.endswith("\n")
    assert max(len(line) for line in text.splitlines()) <= reference.WIDTH
    assert max(len(line) for line in text.splitlines()) > 40  # laid out in 100 columns, not the 40 set
    assert os.environ["COLUMNS"] == "40"
    monkeypatch.delenv("COLUMNS")
    reference.command_help("demo", [])
    assert "COLUMNS" not in os.environ
    with pytest.raises(RuntimeError) as info:
        reference.command_help("data", ["nosuch"])
    assert str(info.value) == "shardfc data nosuch --help exited with status 2"
    with pytest.raises(RuntimeError) as info:  # a command whose parser exits itself
        reference.command_help("import-arcface", ["--network"])
    assert str(info.value) == "shardfc import-arcface --network --help exited with status 2"


@pytest.mark.parametrize("flag", ["--nproc", "--classes", "--dim", "--batch", "--steps"])
def test_demo_names_a_bad_count_in_one_line(flag, capsys):
    from shardfc.cli import demo

    # --nproc 0 and --dim 0 were tracebacks from a spawned rank; --steps 0 an IndexError after training
    assert demo.main([flag, "0"]) == 2
    assert capsys.readouterr().err == f"shardfc demo: error: {flag} must be >= 1, got 0\n"

