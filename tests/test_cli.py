"""The ``shardfc`` dispatcher and the demo."""

import subprocess
import sys

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
