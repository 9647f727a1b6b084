"""What a run tells the person watching it (``train/observe/reporting.py``): the loss / lr / throughput
window, the report at a log point (its log line and metrics.csv rows, the divergence stop, corrupt
images named once and counted over ranks), the setup lines and the evaluation of targets.

In the test's process (ranks as threads where the report is collective): the trainer's own runs
(tests/train/test_trainer.py) reach this code too, but only in spawned ranks or through the whole loop.
"""

from __future__ import annotations

import csv
import logging
import math
import types

import pytest
import torch

from shardfc.parallel.context import DistContext
from shardfc.train.config import TrainConfig
from shardfc.train.observe import reporting
from shardfc.train.observe.reporting import ReportWindow, evaluate_targets, log_setup, report
from shardfc.train.observe.runlog import RunLog
from shardfc.train.state import Parts, RunState
from thread_world import ThreadWorld

ALONE = DistContext()  # no process group: one rank


class _Clock:
    """``time.time`` for reporting.py: the seconds a test sets."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(reporting, "time", c)
    return c


def _parts(lr: float = 0.05, fp16_scale: float | None = None) -> Parts:
    w = torch.nn.Parameter(torch.zeros(2))
    scaler = torch.amp.GradScaler("cpu", enabled=fp16_scale is not None, init_scale=fp16_scale or 1.0)
    return Parts(torch.nn.Linear(2, 2), None, torch.optim.SGD([w], lr=lr), None, [], scaler)


def _rows(path) -> list[tuple[int, str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [(int(r["step"]), r["name"], r["value"]) for r in csv.DictReader(f)]


@pytest.fixture
def runlog(tmp_path):
    with RunLog(tmp_path, is_main=True, progress=False) as log:
        log.start_at(0)
        log.skip_curves("a test")
        yield log


# ---------------------------------------------------------------------------- the window


def test_the_window_is_the_mean_loss_and_the_images_per_second_since_the_last_take(clock):
    state = RunState(samples_seen=100)
    window = ReportWindow(state)
    for loss, seen in ((2.0, 164), (4.0, 228), (9.0, 292)):
        clock.now += 0.5
        state.samples_seen = seen
        window.add(torch.tensor(loss), [("a.png", "truncated")] if loss == 4.0 else [])
    assert window.take() == (5.0, 192 / 1.5, [("a.png", "truncated")])
    clock.now += 2.0
    state.samples_seen += 64
    window.add(torch.tensor(1.0), [("b.png", "empty")])
    assert window.take() == (1.0, 32.0, [("b.png", "empty")])  # counted from the previous take, not the start


def test_a_window_without_steps_has_no_loss_and_never_divides_by_no_time(clock):
    window = ReportWindow(RunState(samples_seen=8))
    loss, rate, corrupt = window.take()
    assert math.isnan(loss) and rate == 0.0 and corrupt == []
    window.state.samples_seen = 9
    assert window.take()[1] == pytest.approx(1e9)  # a step within the clock's resolution: a large rate, no error


def test_the_window_keeps_the_loss_on_its_device_until_the_take():
    window = ReportWindow(RunState())
    for v in (1.5, 2.5):
        window.add(torch.tensor(v, dtype=torch.float64), [])
    assert isinstance(window.loss, torch.Tensor) and window.steps == 2  # no float() per step: no host sync
    assert window.take()[0] == 2.0
    assert window.loss is None and window.steps == 0 and window.corrupt == []


# ---------------------------------------------------------------------------- the report


def test_a_report_logs_the_step_and_writes_its_scalars(runlog, clock, tmp_path, caplog):
    state = RunState(step=40, epoch=3, samples_seen=0)
    window = ReportWindow(state)
    clock.now += 2.0
    state.samples_seen = 512
    window.add(torch.tensor(3.0), [])
    window.add(torch.tensor(4.0), [])
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        report(runlog, window, _parts(lr=0.0125), state, 100, ALONE)
    assert caplog.messages[-1] == "step 40/100  epoch 3  loss 3.5000  lr 0.0125  256 images/s"
    assert _rows(tmp_path / "metrics.csv") == [
        (40, "train/loss", "3.5"), (40, "train/lr", "0.0125"), (40, "train/images_per_s", "256"), (40, "train/epoch", "3"),
    ]


def test_an_fp16_run_also_records_its_loss_scale(runlog, tmp_path):
    window = ReportWindow(RunState(step=5))
    window.add(torch.tensor(1.0), [])
    report(runlog, window, _parts(fp16_scale=1024.0), window.state, 10, ALONE)
    assert (5, "train/loss_scale", "1024") in _rows(tmp_path / "metrics.csv")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_diverged_loss_stops_the_run_with_what_to_change(runlog, tmp_path, bad):
    window = ReportWindow(RunState(step=7))
    window.add(torch.tensor(1.0), [])
    window.add(torch.tensor(bad), [])  # one bad step in the window is enough
    with pytest.raises(FloatingPointError) as info:
        report(runlog, window, _parts(), window.state, 10, ALONE)
    assert str(info.value) == (f"the training loss is {bad} at step 7: training diverged; lower --lr, raise "
                               "--warmup-steps or set --grad-clip")
    assert _rows(tmp_path / "metrics.csv") == []  # nothing logged as if the step were fine


def test_a_report_on_another_rank_logs_and_writes_nothing(tmp_path, caplog):
    with RunLog(tmp_path, is_main=False, progress=False) as log:
        log.start_at(0)
        window = ReportWindow(RunState(step=2))
        window.add(torch.tensor(1.0), [])
        with caplog.at_level(logging.INFO, logger="shardfc.train"):
            report(log, window, _parts(), window.state, 4, DistContext(rank=1, world_size=2))
    assert not caplog.records and not (tmp_path / "metrics.csv").exists()
    assert window.steps == 0  # its window was taken all the same


def _report_on_ranks(tmp_path, corrupt_by_rank, named=(), max_corrupt=-1, step=10):
    """Two ranks (threads) each report a window holding their own corrupt images, after ``named`` were
    named at earlier reports; returns (the messages logged, each rank's named set or exception)."""
    world = ThreadWorld(2, timeout=20.0)
    records: list[logging.LogRecord] = []
    keep = logging.Handler()
    keep.emit = records.append
    lib = logging.getLogger("shardfc.train")
    lib.addHandler(keep)

    def rank(r):
        window = ReportWindow(RunState(step=step), max_corrupt)
        window.named = set(named)
        window.add(torch.tensor(1.0), corrupt_by_rank[r])
        report(log, window, _parts(), window.state, 100, world.context())
        return window.named

    try:
        with RunLog(tmp_path, is_main=True, progress=False) as log:  # rank 1's writes are skipped by is_main
            log.start_at(0)
            log.skip_curves("a test")
            out = world.run(rank)
    finally:
        lib.removeHandler(keep)
    return [rec.getMessage() for rec in records], out


def _step_line(messages: list[str]) -> str:
    (line,) = [m for m in messages if m.startswith("step ")]
    return line


def test_corrupt_images_met_on_any_rank_are_named_once_by_rank_0_and_counted(tmp_path):
    corrupt = [[("b.png", "truncated"), ("a.png", "empty"), ("b.png", "truncated")], [("a.png", "empty"), ("c.png", "bad")]]
    messages, named = _report_on_ranks(tmp_path, corrupt, named={"c.png"})  # c.png was named at an earlier report
    assert named == [{"a.png", "b.png", "c.png"}] * 2  # every rank holds the same set
    warnings = [m for m in messages if m.startswith("corrupt image")]
    assert warnings == [
        "corrupt image skipped (the next valid sample is used instead): a.png (empty)",
        "corrupt image skipped (the next valid sample is used instead): b.png (truncated)",
    ]
    # the count is of skips (5 over both ranks), not of distinct images
    assert _step_line(messages) == "step 10/100  epoch 0  loss 1.0000  lr 0.05  0 images/s  (5 corrupt image(s) skipped)"
    assert (10, "data/corrupt_skipped", "5") in _rows(tmp_path / "metrics.csv")


def test_past_max_corrupt_images_every_rank_stops_at_the_same_report(tmp_path):
    corrupt = [[("a.png", "empty")], [("b.png", "bad")]]
    _, out = _report_on_ranks(tmp_path, corrupt, max_corrupt=1, step=12)
    assert all(isinstance(e, ValueError) for e in out)  # none left waiting in a collective
    assert str(out[0]) == ("2 different corrupt images skipped by step 12, more than max_corrupt_images=1 (train.log "
                           "names each): fix or remove them, or raise --max-corrupt-images (-1: no limit)")
    _, out = _report_on_ranks(tmp_path, corrupt, max_corrupt=2)
    assert out == [{"a.png", "b.png"}] * 2  # at the limit: on
    _, out = _report_on_ranks(tmp_path, corrupt, max_corrupt=0, named={"a.png", "b.png"}, step=14)
    assert all(isinstance(e, ValueError) for e in out) and "2 different corrupt images skipped by step 14" in str(out[1])


def test_a_report_without_corrupt_images_says_nothing_of_them(tmp_path):
    messages, out = _report_on_ranks(tmp_path, [[], []], max_corrupt=0)
    assert out == [set(), set()] and _step_line(messages) == "step 10/100  epoch 0  loss 1.0000  lr 0.05  0 images/s"
    assert all(name != "data/corrupt_skipped" for _, name, _ in _rows(tmp_path / "metrics.csv"))


# ---------------------------------------------------------------------------- evaluation


def test_targets_are_evaluated_logged_and_recorded_unless_told_not_to(runlog, tmp_path, caplog, monkeypatch):
    target = types.SimpleNamespace(name="lfw", description="1000 pairs")
    seen = []
    monkeypatch.setattr(reporting, "run_targets", lambda ts, module: seen.append((ts, module)) or {"lfw": {"accuracy": 0.75}})
    parts = _parts()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert evaluate_targets([target], parts, 30, runlog) == {"lfw": {"accuracy": 0.75}}
        assert evaluate_targets([target], parts, 30, runlog, record=False) == {"lfw": {"accuracy": 0.75}}
    assert seen == [([target], parts.module)] * 2
    assert _rows(tmp_path / "metrics.csv") == [(30, "val/lfw/accuracy", "0.75")]  # once
    assert sum(m.startswith("eval step 30  lfw: ") and m.endswith("(1000 pairs)") for m in caplog.messages) == 2
    assert evaluate_targets([], parts, 31, runlog) == {} and len(seen) == 2  # nothing to evaluate: nothing run


# ---------------------------------------------------------------------------- the setup lines


class _Data(list):
    num_classes = 10

    def __str__(self):
        return "synthetic"


class _Batches:
    batch_size = 8

    def __len__(self):
        return 3


def test_the_setup_lines_say_the_global_batch_and_warn_of_a_warm_up_past_the_run(tmp_path, caplog):
    cfg = TrainConfig(output_dir=str(tmp_path), batch_size=8, grad_accum=3, warmup_steps=50, lr=0.1)
    parts = _parts()
    parts.head = types.SimpleNamespace(devices=[torch.device("cpu")], mode="ranks", margin="ArcFace(s=32.0, m=0.5)",
                                       num_classes=10, class_range=range(0, 5))
    run = types.SimpleNamespace(dataset=_Data(range(40)), parts=parts, image_size=(16, 16), amp_dtype=torch.bfloat16,
                                batches=_Batches(), total_steps=50, pipeline=None,
                                data_ctx=types.SimpleNamespace(world_size=2))
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        log_setup(cfg, DistContext(world_size=2), run)
    text = "\n".join(caplog.messages)
    assert "data: synthetic, 40 images, 10 classes, 16x16 input" in text
    assert "head ArcFace(s=32.0, m=0.5) over 10 classes, 5 per rank (rank 0: 0..4)" in text
    assert ("50 steps of 48 images (8 per rank x 2 rank(s) x 3 accumulated), 3 micro-batches per epoch per rank; "
            "precision bfloat16") in text
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.messages[-1] == "warmup_steps=50 >= the 50 steps of this run: the learning rate never reaches lr=0.1"
    run.total_steps = 51
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        log_setup(cfg, DistContext(world_size=2), run)
    assert all(r.levelno == logging.INFO for r in caplog.records)  # warm-up ends inside the run: no warning
