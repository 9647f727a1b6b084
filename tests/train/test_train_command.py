"""``shardfc train``'s command line and launch dispatch (:mod:`shardfc.cli.train`) with stand-ins for the
training loop and the launchers: which mode each strategy and environment picks, what each mode hands
on and tears down, how each failure is reported and which exit code it gives, the preflight checks and
the summary. The real launches run in ``test_trainer.py``, ``test_torchrun*.py``, ``test_signals.py``
and ``test_horovod_signals.py`` (spawned processes, out of mutmut's sight)."""

from __future__ import annotations

import logging
import signal

import pytest
import torch

from shardfc import checkpoint as ckpt
from shardfc.cli import train as cli
from shardfc.parallel.launch import StoppedBySignal, WorkerError
from shardfc.train.config import ConfigError, TrainConfig


class _Launch:
    """Stand-ins for everything ``run`` starts or asks; ``calls`` records them in order."""

    def __init__(self, monkeypatch, summary=None, torchrun=False, rank=0, cuda=False, devices=0, cpus=4):
        self.calls = []
        self.summary = {"step": 3} if summary is None else summary
        rec = self.calls.append

        def train(cfg):
            rec(("train", cfg.strategy))
            if isinstance(self.summary, BaseException):
                raise self.summary
            return self.summary

        monkeypatch.setattr(cli, "train", train)
        monkeypatch.setattr(cli, "check_launch", lambda cfg: rec(("check_launch", cfg.strategy)))
        monkeypatch.setattr(cli, "launched_by_torchrun", lambda: torchrun)
        monkeypatch.setattr(cli, "die_with_parent", lambda pid: rec(("die_with_parent", pid)))
        monkeypatch.setattr(cli.os, "getppid", lambda: 4242)
        monkeypatch.setattr(cli, "init_from_env", lambda backend, timeout_s: rec(("init", backend, timeout_s)) or (rank, 2))
        monkeypatch.setattr(cli, "warn_if_restarts_unsafe", lambda r: rec(("warn_restarts", r)))
        monkeypatch.setattr(cli.dist, "barrier", lambda: rec(("barrier",)))
        monkeypatch.setattr(cli.dist, "destroy_process_group", lambda: rec(("destroy",)))
        monkeypatch.setattr(cli.gc, "collect", lambda: rec(("collect",)) or 0)
        monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(cli.os, "cpu_count", lambda: cpus)
        self.spawned = []

        def spawn(fn, nproc, cfg, backend, timeout_s):
            rec(("spawn", nproc, backend, timeout_s))
            return self.spawned or [fn(r, nproc, cfg) for r in range(nproc)]

        monkeypatch.setattr(cli, "spawn", spawn)

    def names(self):
        return [c[0] for c in self.calls]


def _cfg(**kw):
    return TrainConfig(**{"nproc": 1, **kw})


# ------------------------------------------------------------------ which mode, and what it hands on
def test_one_process_trains_here(monkeypatch):
    launch = _Launch(monkeypatch)
    assert cli.run(_cfg()) == {"step": 3}
    assert launch.calls == [("check_launch", "ddp"), ("train", "ddp")]


@pytest.mark.parametrize("device, cuda, backend", [("cpu", True, "gloo"), ("auto", False, "gloo"),
                                                   ("auto", True, "nccl"), ("cuda", True, "nccl")])
def test_spawned_ranks_and_their_backend(monkeypatch, device, cuda, backend):
    launch = _Launch(monkeypatch, cuda=cuda, devices=4)
    assert cli.run(_cfg(nproc=3, device=device, pg_timeout=77)) == {"step": 3}
    assert launch.calls == [("check_launch", "ddp"), ("spawn", 3, backend, 77)] + [("train", "ddp")] * 3


def test_under_torchrun_the_group_is_joined_and_torn_down(monkeypatch):
    launch = _Launch(monkeypatch, torchrun=True, summary={"step": 5, "stopped_by": "SIGTERM"})
    assert cli.run(_cfg(nproc=4, pg_timeout=30)) == {"step": 5, "stopped_by": "SIGTERM"}
    assert launch.calls == [("check_launch", "ddp"), ("die_with_parent", 4242), ("init", "gloo", 30),
                            ("warn_restarts", 0), ("train", "ddp"), ("barrier",), ("collect",), ("destroy",)]


@pytest.mark.parametrize("summary, returned", [({"step": 5, "stopped_by": "SIGTERM"}, {"stopped_by": "SIGTERM"}),
                                               ({"step": 5}, None), ({"step": 5, "stopped_by": None}, None)])
def test_under_torchrun_other_ranks_return_only_the_signal(monkeypatch, summary, returned):
    launch = _Launch(monkeypatch, torchrun=True, rank=2, cuda=True, summary=summary)
    assert cli.run(_cfg(device="cuda")) == returned
    assert ("init", "nccl", TrainConfig().pg_timeout) in launch.calls and ("warn_restarts", 2) in launch.calls


def test_under_torchrun_an_error_still_tears_the_group_down(monkeypatch):
    launch = _Launch(monkeypatch, torchrun=True, summary=ValueError("bad data"))
    with pytest.raises(ValueError, match="bad data"):
        cli.run(_cfg())
    assert launch.names()[-3:] == ["train", "collect", "destroy"]  # no barrier: the others fail in theirs


def test_dp_is_one_process_and_says_nproc_is_unused(monkeypatch, caplog):
    launch = _Launch(monkeypatch)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert cli.run(_cfg(strategy="dp", nproc=3)) == {"step": 3}
    assert launch.calls == [("check_launch", "dp"), ("train", "dp")]
    assert caplog.messages == ["strategy='dp' is one process: --nproc 3 is not used"]
    assert caplog.records[0].name == "shardfc.train"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        cli.run(_cfg(strategy="dp", nproc=1))
    assert caplog.messages == []


class _Horovod:
    def __init__(self, rank):
        self._rank, self.shut = rank, 0

    def rank(self):
        return self._rank

    def shutdown(self):
        self.shut += 1


@pytest.mark.parametrize("rank, summary, returned", [
    (0, {"step": 2}, {"step": 2}),
    (1, {"step": 2}, None),
    (1, {"step": 2, "stopped_by": "SIGINT"}, {"stopped_by": "SIGINT"}),
])
def test_horovod_rank_and_its_shutdown(monkeypatch, rank, summary, returned):
    launch = _Launch(monkeypatch, summary=summary)
    hvd = _Horovod(rank)
    monkeypatch.setattr(cli, "horovod_module", lambda: hvd)
    assert cli.run(_cfg(strategy="horovod", nproc=2)) == returned
    assert launch.calls == [("check_launch", "horovod"), ("train", "horovod")] and hvd.shut == 1


def test_horovod_shuts_down_on_an_error(monkeypatch):
    _Launch(monkeypatch, summary=RuntimeError("collective failed"))
    hvd = _Horovod(0)
    monkeypatch.setattr(cli, "horovod_module", lambda: hvd)
    with pytest.raises(RuntimeError, match="collective failed"):
        cli.run(_cfg(strategy="horovod"))
    assert hvd.shut == 1


def test_more_cuda_ranks_than_devices_is_refused(monkeypatch):
    launch = _Launch(monkeypatch, cuda=True, devices=2)
    with pytest.raises(ConfigError, match=r"^nproc=3 but only 2 CUDA device\(s\) are visible: NCCL needs one device "
                                          r"per rank \(lower --nproc, or --device cpu\)$"):
        cli.run(_cfg(nproc=3))
    assert "spawn" not in launch.names()
    cli.run(_cfg(nproc=2))  # as many as there are
    assert "spawn" in launch.names()


@pytest.mark.parametrize("nproc, cpus, said", [(3, 2, 2), (2, 2, None), (2, None, 1)])  # None: not known
def test_more_cpu_ranks_than_cores_is_a_warning(monkeypatch, caplog, nproc, cpus, said):
    _Launch(monkeypatch, cpus=cpus)
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        cli.run(_cfg(nproc=nproc))
    expected = [f"nproc={nproc} exceeds the {said} CPU core(s) here: processes will share cores"] if said else []
    assert caplog.messages == expected and {r.name for r in caplog.records} <= {"shardfc.train"}


def test_the_config_is_validated_and_made_absolute_first(monkeypatch, tmp_path):
    launch = _Launch(monkeypatch)
    seen = []
    monkeypatch.setattr(cli, "train", lambda cfg: seen.append(cfg) or {"step": 1})
    monkeypatch.chdir(tmp_path)
    cli.run(_cfg(output_dir="runs/x"))
    assert seen[0].output_dir == str(tmp_path / "runs" / "x")
    with pytest.raises(ConfigError, match="nproc"):
        cli.run(_cfg(nproc=0))
    assert launch.calls[-1] == ("check_launch", "ddp")  # the bad one never reached check_launch


def test_the_run_returns_rank_0s_summary(monkeypatch):
    launch = _Launch(monkeypatch)
    launch.spawned = [{"step": 3, "rank": 0}, {"stopped_by": None, "rank": 1}]
    assert cli.run(_cfg(nproc=2)) == {"step": 3, "rank": 0}


# ------------------------------------------------------------------ spawned ranks' errors
def test_a_spawned_rank_returns_its_error_as_data(monkeypatch):
    def boom(cfg):
        raise FileNotFoundError("no data")

    monkeypatch.setattr(cli, "train", boom)
    got = cli._spawned(1, 2, _cfg())
    assert (got["error"], got["rank"], got["user_error"]) == ("no data", 1, True)
    assert got["traceback"].startswith("Traceback") and "FileNotFoundError: no data" in got["traceback"]
    monkeypatch.setattr(cli, "train", lambda cfg: 1 / 0)
    got = cli._spawned(0, 2, _cfg())
    assert (got["error"], got["user_error"]) == ("division by zero", False)
    monkeypatch.setattr(cli, "train", lambda cfg: {"step": 9})
    assert cli._spawned(0, 2, _cfg()) == {"step": 9}


def _failure(rank, user, message="boom"):
    return {"error": message, "rank": rank, "user_error": user, "traceback": f"trace of {rank}"}


@pytest.mark.parametrize("results, error, message", [
    ([{"step": 1}, _failure(1, False), _failure(2, True, "bad label")], ConfigError, "^bad label$"),
    ([_failure(0, False), _failure(1, False)], WorkerError, "^rank 0 failed:\ntrace of 0$"),
    ([{"step": 1}, _failure(1, False)], WorkerError, "^rank 1 failed:\ntrace of 1$"),
])
def test_which_spawned_failure_is_reported(monkeypatch, results, error, message):
    launch = _Launch(monkeypatch)
    launch.spawned = results
    with pytest.raises(error, match=message):
        cli.run(_cfg(nproc=len(results)))


# ------------------------------------------------------------------ the command: messages and exit codes
@pytest.mark.parametrize("raised", [ConfigError("c"), ckpt.CheckpointError("k"), FileNotFoundError("f"),
                                    NotADirectoryError("n"), ValueError("v"), FloatingPointError("fp")])
def test_an_input_error_is_one_line_and_exit_2(monkeypatch, capsys, raised):
    monkeypatch.setattr(cli, "run", lambda cfg: (_ for _ in ()).throw(raised))
    assert cli.main([]) == 2
    assert capsys.readouterr() == ("", f"shardfc train: error: {raised}\n")


HINT = (". `shardfc plan --classes C --dim D --batch B --world-size N` predicts the head's memory per rank; more ranks "
        "(--nproc), Partial FC (--sample-rate), a bf16 head (--head-dtype bfloat16) or a smaller --batch-size need less")


@pytest.mark.parametrize("raised, said", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 51200000000 bytes. Error code 12 (Cannot allocate memory)"),
     "DefaultCPUAllocator could not allocate 47.7 GiB"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nGPU 0 has a total capacity of 79 GiB"),
     "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB"),
    (MemoryError(), "MemoryError"),
    (torch.OutOfMemoryError("x" * 300), "x" * 237 + "..."),
    (torch.OutOfMemoryError("x" * 241), "x" * 237 + "..."),
    (torch.OutOfMemoryError("x" * 240), "x" * 240),  # the longest kept whole
])
def test_running_out_of_memory_is_one_line_with_what_needs_less(monkeypatch, capsys, raised, said):
    """Too large a run for its machine is the input's size: a line, as other input errors, in-process
    and from a spawned rank (--synthetic-identities 100000000 ended in the allocator's traceback)."""
    assert cli.out_of_memory(raised) == f"out of memory: {said}{HINT}"
    monkeypatch.setattr(cli, "run", lambda cfg: (_ for _ in ()).throw(raised))
    assert cli.main([]) == 2
    assert capsys.readouterr() == ("", f"shardfc train: error: out of memory: {said}{HINT}\n")
    monkeypatch.setattr(cli, "train", lambda cfg: (_ for _ in ()).throw(raised))
    got = cli._spawned(1, 2, _cfg())
    assert (got["error"], got["user_error"]) == (f"out of memory: {said}{HINT}", True)


def test_another_runtime_error_keeps_its_traceback(monkeypatch):
    assert cli.out_of_memory(RuntimeError("shape mismatch")) is None and cli.out_of_memory(KeyError("k")) is None
    monkeypatch.setattr(cli, "run", lambda cfg: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main([])
    monkeypatch.setattr(cli, "train", lambda cfg: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    assert cli._spawned(0, 2, _cfg())["user_error"] is False


def test_a_bug_is_not_swallowed(monkeypatch):
    monkeypatch.setattr(cli, "run", lambda cfg: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError):
        cli.main([])


def test_a_signal_or_ctrl_c_before_the_run_stops(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run", lambda cfg: (_ for _ in ()).throw(StoppedBySignal(signal.SIGTERM, "rank 1 killed")))
    assert cli.main([]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "shardfc train: stopped by signal SIGTERM: rank 1 killed\n"
    monkeypatch.setattr(cli, "run", lambda cfg: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert cli.main([]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "shardfc train: interrupted\n"


def test_a_bad_option_is_one_line(capsys):
    assert cli.main(["--nproc", "two"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardfc train: error: ") and "--nproc" in err and err.count("\n") == 1


def test_print_config_runs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run", lambda cfg: pytest.fail("ran"))
    assert cli.main(["--print-config", "--lr", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.25\n" in out and out.endswith("\n\n")  # to_toml's text and print's newline


@pytest.mark.parametrize("summary, code, printed", [
    (None, 0, False),
    ({"stopped_by": "SIGTERM"}, 128 + signal.SIGTERM, False),  # another rank: nothing to print
    ({"step": 4, "wall_time_s": 1.0, "output_dir": "r"}, 0, True),
    ({"step": 4, "wall_time_s": 1.0, "output_dir": "r", "stopped_by": "SIGINT"}, 128 + signal.SIGINT, True),
])
def test_exit_code_of_a_finished_or_stopped_run(monkeypatch, capsys, summary, code, printed):
    monkeypatch.setattr(cli, "run", lambda cfg: summary)
    assert cli.main(["--nproc", "1"]) == code
    assert bool(capsys.readouterr().out) == printed


def test_arguments_from_the_command_line(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run", lambda cfg: seen.append(cfg))
    monkeypatch.setattr("sys.argv", ["shardfc train", "--nproc", "1", "--lr", "0.5"])
    assert cli.main() == 0
    assert seen[0].lr == 0.5


# ------------------------------------------------------------------ preflight
@pytest.mark.parametrize("fields, message", [
    (dict(dataset="folder", data_root="{tmp}/none"), "data_root='{tmp}/none' does not exist or is not a folder"),
    (dict(dataset="folder", data_root="{tmp}/file"), "data_root='{tmp}/file' does not exist or is not a folder"),
    (dict(dataset="list", list_file="{tmp}/none.txt"), "list_file='{tmp}/none.txt' does not exist"),
    (dict(dataset="list", list_file="{tmp}/dir"), "list_file='{tmp}/dir' does not exist"),
    (dict(dataset="market1501", data_root="{tmp}/dir"),
     "data_root='{tmp}/dir' holds no bounding_box_train/ folder (dataset='market1501')"),
    (dict(val_bins=["{tmp}/file", "{tmp}/none.bin"]), "val_bins: '{tmp}/none.bin' does not exist"),
    (dict(val_bins=["{tmp}/dir"]), "val_bins: '{tmp}/dir' does not exist"),
    (dict(reid_root="{tmp}/file"), "reid_root='{tmp}/file' does not exist or is not a folder"),
])
def test_preflight_names_the_missing_input(tmp_path, fields, message):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    fields = {k: [p.format(tmp=tmp_path) for p in v] if isinstance(v, list) else v.format(tmp=tmp_path)
              for k, v in fields.items()}
    with pytest.raises(FileNotFoundError) as info:
        cli.preflight(_cfg(**fields))
    assert str(info.value) == message.format(tmp=tmp_path)


def test_preflight_passes_what_is_there(tmp_path):
    (tmp_path / "bounding_box_train").mkdir()
    (tmp_path / "list.txt").write_text("a.png 0\n")
    (tmp_path / "lfw.bin").write_bytes(b"")
    for fields in (dict(dataset="folder", data_root=str(tmp_path)), dict(dataset="list", list_file=str(tmp_path / "list.txt")),
                   dict(dataset="market1501", data_root=str(tmp_path)),
                   dict(val_bins=[str(tmp_path / "lfw.bin")], reid_root=str(tmp_path)), dict()):
        cli.preflight(_cfg(**fields))
    with pytest.raises(ConfigError, match="nproc"):
        cli.preflight(_cfg(nproc=0))  # and validates


def test_preflight_runs_before_the_ranks_start(monkeypatch, tmp_path):
    launch = _Launch(monkeypatch)
    for strategy, nproc in (("ddp", 1), ("ddp", 2), ("dp", 1)):
        with pytest.raises(FileNotFoundError):
            cli.run(_cfg(strategy=strategy, nproc=nproc, reid_root=str(tmp_path / "none")))
    hvd = _Horovod(0)
    monkeypatch.setattr(cli, "horovod_module", lambda: hvd)
    with pytest.raises(FileNotFoundError):
        cli.run(_cfg(strategy="horovod", reid_root=str(tmp_path / "none")))
    assert "train" not in launch.names() and "spawn" not in launch.names() and hvd.shut == 0


# ------------------------------------------------------------------ the summary
def test_the_summary_in_words(capsys):
    cli.print_summary({
        "step": 120, "wall_time_s": 65.43, "output_dir": "/runs/a", "stopped_by": "SIGTERM",
        "checkpoint": "/runs/a/checkpoints/step_120",
        "metrics": {"lfw": {"accuracy": 0.98765, "accuracy_std": 0.0123}, "market": {"mAP": 0.712345, "rank1": 0.9},
                    "synthetic": {"accuracy": 0.5}},
        "descriptions": {"lfw": "LFW (6,000 pairs)"},
    })
    assert capsys.readouterr().out.splitlines() == [
        "trained 120 steps in 65.4 s; run folder /runs/a",
        "stopped at step 120 by signal SIGTERM",
        "checkpoint: /runs/a/checkpoints/step_120",
        "verification accuracy on LFW (6,000 pairs): 98.77% ± 1.23 (chance: 50%)",
        "market: mAP 0.7123, rank1 0.9",
        "verification accuracy on synthetic: 50.00% ± 0.00 (chance: 50%)",
    ]
    cli.print_summary({"step": 1, "wall_time_s": 0.04, "output_dir": "r", "checkpoint": None, "stopped_by": None})
    assert capsys.readouterr().out == "trained 1 steps in 0.0 s; run folder r\n"
    cli.print_summary({"step": 1, "wall_time_s": 1.0, "output_dir": "r", "metrics": {"lfw": {"accuracy": 0.5}}})
    assert capsys.readouterr().out.splitlines()[1] == "verification accuracy on lfw: 50.00% ± 0.00 (chance: 50%)"


def test_wants_cuda():
    assert cli._wants_cuda(_cfg(device="cuda")) is True
    assert cli._wants_cuda(_cfg(device="cpu")) is False
    assert cli._wants_cuda(_cfg(device="auto")) is torch.cuda.is_available()



@pytest.mark.parametrize("below", ["", "deeper"])
def test_a_run_folder_where_a_file_stands_is_refused_before_the_ranks_start(monkeypatch, tmp_path, capsys, below):
    """Each rank's mkdir raised FileExistsError (or NotADirectoryError) as a traceback."""
    (tmp_path / "taken").write_text("keep")
    out = tmp_path / "taken" / below if below else tmp_path / "taken"
    monkeypatch.setattr(cli, "spawn", lambda *a, **k: pytest.fail("ranks started"))
    monkeypatch.setattr(cli, "train", lambda cfg: pytest.fail("trained"))
    assert cli.main(["--output-dir", str(out), "--nproc", "2"]) == 2
    assert capsys.readouterr().err == (f"shardfc train: error: output_dir={str(out)!r}: {str(tmp_path / 'taken')!r} is a "
                                       "file, not a folder\n")
    cli.check_output_dir(_cfg(output_dir=str(tmp_path / "new" / "run")))  # to be made: no obstacle
    assert (tmp_path / "taken").read_text() == "keep" and not (tmp_path / "new").exists()


def test_under_torchrun_each_rank_checks_the_run_folder_before_joining(monkeypatch, tmp_path):
    (tmp_path / "taken").write_text("keep")
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(cli, "init_from_env", lambda *a, **k: pytest.fail("joined the group"))
    with pytest.raises(ConfigError, match="is a file, not a folder$"):
        cli.run(_cfg(output_dir=str(tmp_path / "taken"), nproc=2))
