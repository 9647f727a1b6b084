"""Every ``shardfc train`` flag survives torchrun's parser, and ``shardfc torchrun`` builds its command."""

from __future__ import annotations

import contextlib
import io
import logging
import sys

import pytest
from torch.distributed.run import get_args_parser

from shardfc.parallel.torchrun import SHARE_STORE_ENV, torchrun_command, warn_if_restarts_unsafe
from shardfc.train.config import ConfigError, build_parser, parse_config

LAUNCH = ["--standalone", "--nproc-per-node", "2", "-m", "shardfc", "train"]


def _script_args(argv):
    """What torchrun hands to ``shardfc`` for ``torchrun ARGV``, or None if its parser refuses ARGV."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return get_args_parser().parse_args(argv).training_script_args
    except SystemExit:
        return None


def _flags_by_field():
    by_field = {}
    for action in build_parser()._actions:
        if action.dest not in ("help", "preset", "config", "print_config"):
            by_field.setdefault(action.dest, []).extend(action.option_strings)
    return by_field


def test_every_field_has_a_flag_that_torchrun_passes_on_as_it_is():
    unreachable = []
    for field, flags in _flags_by_field().items():
        if not any(_script_args([*LAUNCH, flag, "1"]) == ["train", flag, "1"] for flag in flags):
            unreachable.append(field)
    assert unreachable == []


def test_after_a_separator_every_flag_reaches_shardfc_train():
    for flags in _flags_by_field().values():
        for flag in flags:
            passed = _script_args([*LAUNCH, "--", flag, "1"])
            assert passed is not None and passed[-2:] == [flag, "1"], flag
    # and shardfc train drops the separator that torchrun leaves in
    cfg, _ = parse_config(["--", "--m", "0.3", "--nproc", "3", "--max-steps", "5"])
    assert (cfg.m, cfg.nproc, cfg.max_steps) == (0.3, 3, 5)


def test_the_unambiguous_aliases_set_the_same_fields():
    cfg, _ = parse_config(["--margin-m", "0.3", "--num-procs", "3"])
    assert (cfg.m, cfg.nproc) == (0.3, 3)
    with pytest.raises(ConfigError, match=r"argument --m/--margin-m: m must be float, got 'x'"):
        parse_config(["--margin-m", "x"])


def test_new_run_fields_are_validated():
    cfg, _ = parse_config(["--pg-timeout", "45", "--no-save-on-signal"])
    assert (cfg.pg_timeout, cfg.save_on_signal) == (45.0, False)
    with pytest.raises(ConfigError, match=r"pg_timeout must be > 0, got 0.0"):
        parse_config(["--pg-timeout", "0"])


def test_shardfc_torchrun_puts_the_training_flags_after_a_separator():
    cmd = torchrun_command(["--nproc-per-node", "2", "--max-restarts", "3", "--", "--m", "0.4"])
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "3",
                   "-m", "shardfc", "train", "--", "--m", "0.4"]
    assert _script_args(cmd[3:]) in (["train", "--", "--m", "0.4"], ["train", "--m", "0.4"])
    assert torchrun_command(["--standalone"])[-4:] == ["-m", "shardfc", "train", "--"]


@pytest.mark.parametrize("restarts, share_env, warns", [("2", None, True), ("2", "1", False), ("0", None, False)])
def test_rank_0_warns_when_torchrun_restarts_with_a_shared_store(monkeypatch, caplog, restarts, share_env, warns):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    if share_env is None:
        monkeypatch.delenv(SHARE_STORE_ENV, raising=False)
    else:
        monkeypatch.setenv(SHARE_STORE_ENV, share_env)
    with caplog.at_level(logging.WARNING, logger="shardfc.launch"):
        warn_if_restarts_unsafe(rank=1)
        assert caplog.records == []  # only rank 0 speaks
        warn_if_restarts_unsafe(rank=0)
    assert (f"{SHARE_STORE_ENV}=1" in caplog.text) == warns


@pytest.fixture
def execs(monkeypatch):
    """What ``shardfc torchrun`` would hand to torchrun (``parallel.torchrun.main``, which execs it), recorded."""
    from shardfc.cli import torchrun as cli_torchrun

    seen = []
    monkeypatch.setattr(cli_torchrun.torchrun, "main", lambda argv: seen.append(argv) or 0)
    return seen


@pytest.mark.parametrize("flags, said", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--lr", "-1"], "lr must be > 0, got -1.0"),
    (["--strategy", "dp", "--nproc", "3"], "--nproc is read only with strategy 'ddp' or 'pipeline'"),
])
def test_shardfc_torchrun_refuses_bad_training_flags_before_torchrun_starts(execs, capsys, flags, said):
    """One line, exit 2, no worker: each worker would otherwise fail in turn, with torchrun's report each."""
    from shardfc.cli import main

    assert main(["torchrun", "--standalone", "--nproc-per-node", "2", "--", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardfc torchrun: error: {said}") and err.count("\n") == 1
    assert execs == []


@pytest.mark.parametrize("argv", [
    ["--standalone", "--nproc-per-node", "2", "--", "--max-steps", "3", "--lr", "0.2"],
    ["--standalone"],  # no training flags: the defaults
    ["--help"],
    ["--standalone", "--", "--help"],  # shardfc train's help, printed by the workers' parser
])
def test_shardfc_torchrun_hands_good_flags_and_help_on(execs, argv):
    from shardfc.cli import main

    assert main(["torchrun", *argv]) == 0
    assert execs == [argv]


@pytest.mark.parametrize("launcher, count", [
    (["--nproc-per-node", "0"], "0"), (["--nproc_per_node=-2"], "-2"), (["--nproc-per-node=4", "--nproc-per-node", "0"], "0"),
])
def test_shardfc_torchrun_refuses_fewer_than_one_process_per_node(execs, capsys, launcher, count):
    from shardfc.cli import main

    assert main(["torchrun", "--standalone", *launcher, "--", "--max-steps", "1"]) == 2
    assert capsys.readouterr().err == (
        f"shardfc torchrun: error: --nproc-per-node must be >= 1 (or auto, cpu, gpu), got {count}\n")
    assert execs == []


def test_a_per_node_count_of_digits_int_cannot_read_is_left_to_torchrun(execs):
    """"²" is a digit to str.isdigit, but int() refuses it: the check stopped with a bare ValueError."""
    from shardfc.cli import main

    argv = ["--standalone", "--nproc-per-node", "²", "--", "--max-steps", "1"]
    assert main(["torchrun", *argv]) == 0
    assert execs == [argv]


@pytest.mark.parametrize("launcher, count", [
    ([], None), (["--nproc-per-node", "2"], "2"), (["--nproc_per_node=auto"], "auto"), (["--nproc-per-node"], None),
    (["--nnodes", "0"], None),
])
def test_the_per_node_count_is_read_as_torchrun_spells_it(launcher, count):
    from shardfc.cli.torchrun import nproc_per_node

    assert nproc_per_node(launcher) == count


@pytest.mark.parametrize("argv", [
    ["--standalone", "--", "-h"], ["--standalone", "--", "--lr", "-1", "--help"],
    ["--standalone", "--nproc-per-node", "1", "--", "--max-steps", "1"],  # one process a node: the least there is
])
def test_help_among_the_training_flags_and_one_process_a_node_go_on_to_torchrun(execs, argv):
    from shardfc.cli import main

    assert main(["torchrun", *argv]) == 0
    assert execs == [argv]


def test_shardfc_torchrun_reads_the_command_line_when_given_none(execs, monkeypatch, capsys):
    from shardfc.cli import torchrun as cli_torchrun

    monkeypatch.setattr(sys, "argv", ["shardfc-torchrun", "--standalone", "--", "--bogus"])
    assert cli_torchrun.main() == 2
    assert "unknown argument '--bogus'" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["shardfc-torchrun", "--standalone", "--", "--max-steps", "2"])
    assert cli_torchrun.main() == 0
    assert execs == [["--standalone", "--", "--max-steps", "2"]]


def test_shardfc_torchrun_refuses_a_run_folder_where_a_file_stands(execs, capsys, tmp_path):
    from shardfc.cli import main

    (tmp_path / "taken").write_text("keep")
    assert main(["torchrun", "--standalone", "--", "--output-dir", str(tmp_path / "taken")]) == 2
    assert capsys.readouterr().err.endswith("is a file, not a folder\n") and execs == []
