"""``shardfc eval``'s command line (:mod:`shardfc.cli.eval`) at its edges: what each flag hands the
evaluation (stand-ins for the checkpoint and the targets record it), each refusal as one line, the
report as text and as strict JSON. ``tests/train/test_tools.py`` evaluates real checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
from types import SimpleNamespace

import pytest
import torch

from shardfc.cli import eval as cli
from shardfc.train.config import TrainConfig
from shardfc.train.observe.evaluate import IJBOptions


class _Run:
    """Records what ``main`` asks of the checkpoint and the targets."""

    def __init__(self, monkeypatch, targets=("lfw",), metrics=None):
        self.loaded, self.built = [], []
        self.metrics = metrics or {name: {"acc": 0.9} for name in targets}
        self.targets = [SimpleNamespace(name=n, description=f"{n} pairs") for n in targets]
        self.trained = SimpleNamespace(config=TrainConfig(backbone="tiny", embedding_dim=8), image_size=(16, 16),
                                       model="model", path="/runs/a/step_1")
        monkeypatch.setattr(cli, "load_backbone", lambda path, device, trust_pickle: self.loaded.append(
            (path, device, trust_pickle)) or self.trained)
        monkeypatch.setattr(cli, "build_targets", lambda cfg, size, device, autocast, **kw: self.built.append(
            (cfg, size, device, autocast, kw)) or self.targets)
        self.ran = []
        monkeypatch.setattr(cli, "run_targets", lambda targets, model, bars: self.ran.append((targets, model, bars))
                            or self.metrics)


def test_without_a_target_flag_the_runs_own_targets(monkeypatch, capsys):
    run = _Run(monkeypatch)
    assert cli.main(["--checkpoint", "ck"]) == 0
    assert run.loaded == [("ck", torch.device("cpu"), False)]
    cfg, size, device, autocast, kw = run.built[0]
    assert (cfg.eval_batch_size, cfg.eval_flip, size, device) == (256, True, (16, 16), torch.device("cpu"))
    assert autocast is contextlib.nullcontext
    assert kw == dict(bins=None, reid_root=None, synthetic_pairs=None, ijb=None)
    assert capsys.readouterr().out == "checkpoint /runs/a/step_1 (tiny, 8-d)\n  lfw: acc 0.9  [lfw pairs]\n"
    assert run.ran == [(run.targets, "model", True)]  # a bar per target, on a terminal


@pytest.mark.parametrize("flags, expected", [
    (["--bin", "a.bin", "b.bin"], dict(bins=["a.bin", "b.bin"], reid_root="", synthetic_pairs=0)),
    (["--reid-root", "m"], dict(bins=[], reid_root="m", synthetic_pairs=0)),
    (["--synthetic-pairs", "10"], dict(bins=[], reid_root="", synthetic_pairs=10)),
    (["--synthetic-pairs", "0"], dict(bins=[], reid_root="", synthetic_pairs=0)),
])
def test_a_target_flag_names_the_targets_alone(monkeypatch, flags, expected):
    run = _Run(monkeypatch)
    assert cli.main(["--checkpoint", "ck", *flags]) == 0
    kw = run.built[0][4]
    assert kw == dict(expected, ijb=None)


def test_the_evaluation_flags_reach_it(monkeypatch):
    run = _Run(monkeypatch, targets=("ijbb",), metrics={"ijbb": {"auc": 0.5}})
    argv = ["--checkpoint", "ck", "--trust-checkpoint", "--batch-size", "1", "--no-flip", "--device", "cpu", "--amp", "bf16",
            "--ijb", "root", "--ijb-target", "IJBB", "--ijb-out", "out", "--no-ijb-norm-score", "--no-ijb-detector-score",
            "--workers", "3"]
    assert cli.main(argv) == 0
    assert run.loaded == [("ck", torch.device("cpu"), True)]
    cfg, _, _, autocast, kw = run.built[0]
    assert (cfg.eval_batch_size, cfg.eval_flip) == (1, False)
    assert kw == dict(bins=[], reid_root="", synthetic_pairs=0, ijb=IJBOptions("root", "IJBB", "out", False, False, 3))
    with autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    assert cli.main(["--checkpoint", "ck", "--amp", "fp16", "--ijb", "r"]) == 0
    _, _, _, autocast, kw = run.built[1]
    assert kw["ijb"] == IJBOptions("r", "IJBC", None, True, True, 0)
    assert cli.main(["--checkpoint", "ck", "--ijb", "r", "--workers", "0", "--ijb-norm-score"]) == 0  # the bounds
    assert run.built[2][4]["ijb"] == IJBOptions("r", "IJBC", None, True, True, 0)
    with autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--workers", "-1", "--ijb", "r"], "--workers must be >= 0, got -1"),
    # an IJB option without --ijb was dropped silently
    (["--workers", "4"], "--workers applies to --ijb ROOT, which was not given"),
    (["--ijb-target", "IJBB", "--bin", "x.bin"], "--ijb-target applies to --ijb ROOT, which was not given"),
    (["--ijb-out", "d"], "--ijb-out applies to --ijb ROOT, which was not given"),
    (["--no-ijb-norm-score"], "--ijb-norm-score/--no-ijb-norm-score applies to --ijb ROOT, which was not given"),
    (["--ijb-detector-score"], "--ijb-detector-score/--no-ijb-detector-score applies to --ijb ROOT, which was not given"),
    # fewer pairs than the protocol's 10 folds failed after embedding them; a negative count was taken for 'some'
    (["--synthetic-pairs", "9"], "--synthetic-pairs must be 0 (none) or at least 10 (the verification protocol's folds), got 9"),
    (["--synthetic-pairs", "1"], "--synthetic-pairs must be 0 (none) or at least 10 (the verification protocol's folds), got 1"),
    (["--synthetic-pairs", "-1"], "--synthetic-pairs must be 0 (none) or at least 10 (the verification protocol's folds), got -1"),
])
def test_bad_numbers_are_refused(monkeypatch, capsys, flags, message):
    run = _Run(monkeypatch)
    assert cli.main(["--checkpoint", "ck", *flags]) == 2
    assert capsys.readouterr().err == f"shardfc eval: error: {message}\n" and run.loaded == []


def test_nothing_to_evaluate_and_a_checkpoint_that_fails_are_one_line(monkeypatch, capsys):
    _Run(monkeypatch, targets=())
    assert cli.main(["--checkpoint", "ck"]) == 2
    assert capsys.readouterr().err == ("shardfc eval: error: nothing to evaluate: pass --bin FILE..., --ijb ROOT, "
                                       "--reid-root DIR or --synthetic-pairs N\n")

    def broken(*a, **k):
        raise ValueError("not a checkpoint")

    monkeypatch.setattr(cli, "load_backbone", broken)
    assert cli.main(["--checkpoint", "ck"]) == 2
    assert capsys.readouterr().err == "shardfc eval: error: not a checkpoint\n"
    with pytest.raises(SystemExit):
        cli.main(["--checkpoint", "ck", "--batch", "2"])  # no flag taken by a prefix
    assert "unrecognized arguments: --batch 2" in capsys.readouterr().err


def test_the_json_report_is_strict(monkeypatch, capsys):
    metrics = {"lfw": {"acc": 0.9, "tar@far=1e-06": math.nan, "num_negative_pairs": 3.0}}
    _Run(monkeypatch, metrics=metrics)
    assert cli.main(["--checkpoint", "ck", "--json"]) == 0
    out = capsys.readouterr().out
    assert out == cli.json_report("/runs/a/step_1", metrics) + "\n"
    assert json.loads(out) == {"checkpoint": "/runs/a/step_1", "metrics": {"lfw": {
        "acc": 0.9, "tar@far=1e-06": None, "num_negative_pairs": 3.0}},
        "undefined": {"lfw": {"tar@far=1e-06": cli.why_undefined("tar@far=1e-06", metrics["lfw"])}}}
    assert out.startswith('{\n  "checkpoint": "/runs/a/step_1",\n  "metrics": {\n')  # indented by 2
    assert json.loads(cli.json_report("c", {"t": {"x": math.inf}}))["metrics"] == {"t": {"x": None}}


def test_the_ijb_line(monkeypatch, capsys):
    values = {"tar@far=1e-06": math.nan, "tar@far=1e-05": 0.25, "tar@far=0.0001": 0.5, "auc": 0.987654,
              "num_negative_pairs": 4000.0}
    assert cli._ijb_table(values) == ("TAR@FAR 1e-06 n/a | 1e-05 25.00% | 0.0001 50.00%, AUC 98.77% "
                                      "(n/a: fewer impostor pairs than 1/FAR; 4000 here)")
    assert cli._ijb_table({"tar@far=0.1": 0.125, "auc": 0.5}) == "TAR@FAR 0.1 12.50%, AUC 50.00%"
    assert cli._ijb_table({"tar@far=0.1": math.nan, "auc": 0.5}) == (
        "TAR@FAR 0.1 n/a, AUC 50.00% (n/a: fewer impostor pairs than 1/FAR; 0 here)")
    _Run(monkeypatch, targets=("ijbc", "lfw"), metrics={"ijbc": {"tar@far=0.1": 0.125, "auc": 0.5}, "lfw": {"acc": 1.0}})
    assert cli.main(["--checkpoint", "ck", "--ijb", "root"]) == 0
    assert capsys.readouterr().out == ("checkpoint /runs/a/step_1 (tiny, 8-d)\n"
                                       "  ijbc: TAR@FAR 0.1 12.50%, AUC 50.00%  [ijbc pairs]\n"
                                       "  lfw: acc 1  [lfw pairs]\n")


def test_an_ijb_out_where_a_file_stands_is_refused_before_the_checkpoint_is_read(monkeypatch, capsys, tmp_path):
    """The report is written after the whole IJB run: a file in its way ended it in a FileExistsError."""
    run = _Run(monkeypatch)
    (tmp_path / "report").write_text("keep")
    for out in (tmp_path / "report", tmp_path / "report" / "deeper"):
        assert cli.main(["--checkpoint", "ck", "--ijb", "root", "--ijb-out", str(out)]) == 2
        assert capsys.readouterr().err == (f"shardfc eval: error: --ijb-out {str(out)!r}: {str(tmp_path / 'report')!r} "
                                           "is a file, not a folder\n")
    assert run.loaded == [] and (tmp_path / "report").read_text() == "keep"


def test_embeddings_that_are_not_finite_are_the_commands_error(monkeypatch, capsys):
    from shardfc.evaluation.finite import NonFiniteEmbeddings

    _Run(monkeypatch)

    def overflowing(targets, model, bars):
        raise NonFiniteEmbeddings("lfw: embeddings_a holds NaN or inf in 3 of 6000 rows (the first: row 12): ...")

    monkeypatch.setattr(cli, "run_targets", overflowing)
    assert cli.main(["--checkpoint", "ck", "--amp", "fp16"]) == 2
    assert capsys.readouterr().err == ("shardfc eval: error: lfw: embeddings_a holds NaN or inf in 3 of 6000 rows "
                                       "(the first: row 12): ...\n")
