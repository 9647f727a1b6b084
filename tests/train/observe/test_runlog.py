"""The run's log: train.log on rank 0 only, metrics.csv (cut back on a resume), TensorBoard, the progress bar,
and metrics.csv drawn into curves.png, with the metric names the trainer writes."""

import csv
import logging
import math
import re
import sys
import types

import numpy as np
import pytest

from shardfc.evaluation.verification import verification_metrics
from shardfc.train.observe import runlog
from shardfc.train.observe.runlog import RunLog, format_metrics, plot_metrics, read_series


def test_plot_metrics_draws_the_scalars_the_trainer_writes(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    lines = ["step,name,value,elapsed_s"]
    for step in range(0, 200, 10):
        lines += [
            f"{step},train/loss,{10 - step / 40},1.0",
            f"{step},train/lr,0.1,1.0",
            f"{step},train/images_per_s,500,1.0",
            f"{step},train/epoch,{step // 50},1.0",  # bookkeeping: no panel
        ]
    lines += [
        "100,val/synthetic/accuracy,0.8,2.0",
        "199,val/synthetic/accuracy,0.9,3.0",
        "199,val/lfw/tar@far=0.001,0.7,3.0",
        "199,val/lfw/achieved_far@far=0.001,0.001,3.0",  # bookkeeping: no panel
        "199,val/market/mAP,0.5,3.0",
        "200,train/lo",  # the torn last line of an interrupted run
    ]
    csv_path.write_text("\n".join(lines) + "\n")
    png = tmp_path / "curves.png"
    drawn = plot_metrics(csv_path, png)
    assert drawn[0] == "train/loss"
    assert set(drawn) == {
        "train/loss", "train/lr", "train/images_per_s",
        "val/synthetic/accuracy", "val/lfw/tar@far=0.001", "val/market/mAP",
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_with_nothing_to_draw(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("step,name,value,elapsed_s\n")
    assert plot_metrics(csv_path, tmp_path / "curves.png") == []
    assert not (tmp_path / "curves.png").exists()


def test_a_far_too_small_for_the_pairs_is_na_in_csv_log_and_curves(tmp_path):
    # 1200 pairs, 600 negatives: FAR 1e-3 needs 1000 of them, FAR 1e-2 only 100.
    rng = np.random.default_rng(0)
    same = np.arange(1200) % 2 == 0
    a = rng.normal(size=(1200, 8))
    b = np.where(same[:, None], a + 0.5 * rng.normal(size=(1200, 8)), rng.normal(size=(1200, 8)))
    m = verification_metrics(a, b, same, far_targets=(1e-2, 1e-3))
    assert math.isfinite(m["tar@far=1e-2"]) and math.isnan(m["tar@far=1e-3"])

    line = format_metrics(m)
    assert f"tar@far=1e-2 {100 * m['tar@far=1e-2']:.2f}%" in line
    assert "tar@far=1e-3 n/a (FAR 1e-3 needs at least 1000 negative pairs, this set has 600)" in line
    assert "nan" not in line.lower()

    with RunLog(tmp_path, is_main=True, progress=False) as log:
        log.start_at(0)
        log.scalars(5, {"train/loss": 3.0})
        log.scalars(10, {f"val/lfw/{k}": v for k, v in m.items()})
        log.scalars(20, {"train/loss": 2.0, "val/lfw/tar@far=1e-2": 0.5, "val/lfw/tar@far=1e-3": float("nan")})
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = {(int(r["step"]), r["name"]): r["value"] for r in csv.DictReader(f)}
    assert rows[(10, "val/lfw/tar@far=1e-3")] == "n/a" and rows[(10, "val/lfw/exact_tar@far=1e-3")] == "n/a"
    assert rows[(20, "val/lfw/tar@far=1e-3")] == "n/a"
    assert float(rows[(10, "val/lfw/tar@far=1e-2")]) == float(f"{m['tar@far=1e-2']:.6g}")
    assert not any(v.lower() == "nan" for v in rows.values())
    # curves.png: no point for n/a, and no panel for a metric that never had a number
    series = read_series(tmp_path / "metrics.csv")
    assert series["val/lfw/tar@far=1e-2"] == [(10, float(f"{m['tar@far=1e-2']:.6g}")), (20, 0.5)]
    assert "val/lfw/tar@far=1e-3" not in series and "val/lfw/exact_tar@far=1e-3" not in series
    drawn = plot_metrics(tmp_path / "metrics.csv", tmp_path / "again.png")
    assert "val/lfw/tar@far=1e-2" in drawn and not any(n.endswith("@far=1e-3") for n in drawn)
    assert (tmp_path / "curves.png").is_file()


# ---------------------------------------------------------------- the log's lifecycle, the bar, TensorBoard


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_rank_0_writes_train_log_and_leaves_the_library_logger_as_it_found_it(tmp_path, capsys):
    lib = logging.getLogger("shardfc")
    before = (lib.level, lib.propagate, list(lib.handlers))
    run = tmp_path / "runs" / "run"  # a folder whose parent does not exist yet
    with RunLog(run, is_main=True, progress=False):
        assert lib.level == logging.INFO and lib.propagate is False and len(lib.handlers) == len(before[2]) + 2
        logging.getLogger("shardfc.data").info("a library line")
        logging.getLogger("shardfc.train").debug("not shown")
    assert (lib.level, lib.propagate, list(lib.handlers)) == before
    lines = _lines(run / "train.log")
    assert len(lines) == 1 and lines[0].endswith(" INFO shardfc.data: a library line")
    assert re.fullmatch(r"\d\d:\d\d:\d\d a library line\n", capsys.readouterr().err)  # the console: time and text
    assert not (run / "metrics.csv").exists()  # nothing before start_at


def test_the_saved_propagation_is_restored_whatever_it_was(tmp_path):
    lib = logging.getLogger("shardfc")
    saved = lib.propagate
    try:
        for value in (False, True):
            lib.propagate = value
            with RunLog(tmp_path, is_main=True, progress=False):
                assert lib.propagate is False
            assert lib.propagate is value
    finally:
        lib.propagate = saved


def test_other_ranks_write_nothing_and_only_errors_get_through(tmp_path, capsys):
    lib = logging.getLogger("shardfc")
    level = lib.level
    log = RunLog(tmp_path / "run", is_main=False, progress=True)
    with log:
        assert lib.level == logging.ERROR
        log.start_at(3)
        log.scalars(4, {"train/loss": 1.0})  # no-op, not an error
        log.open_bar(0, 10)
        log.advance()
        log.set_postfix({"loss": 1.0})
    assert lib.level == level and not (tmp_path / "run").exists()
    assert log._bar is None and capsys.readouterr().err == ""  # no bar drawn by a rank that is not 0


def test_a_failed_run_keeps_its_traceback_in_train_log(tmp_path):
    with pytest.raises(KeyError):
        with RunLog(tmp_path, is_main=True, progress=False):
            raise KeyError("lost")
    text = (tmp_path / "train.log").read_text(encoding="utf-8")
    assert " ERROR shardfc.train: run failed" in text and "Traceback" in text and "KeyError: 'lost'" in text


def test_scalars_before_start_at_is_a_programming_error(tmp_path):
    with RunLog(tmp_path, is_main=True, progress=False) as log:
        with pytest.raises(RuntimeError, match=r"^RunLog.scalars\(\) before start_at\(\)$"):
            log.scalars(1, {"train/loss": 1.0})


def test_scalars_are_written_to_six_figures_with_the_step_and_the_time(tmp_path, monkeypatch):
    calls = []  # the first call is the run's start, every later one 1.2345 s after it (logging reads it too)
    monkeypatch.setattr(runlog.time, "time", lambda: 100.0 if not calls.append(1) and len(calls) == 1 else 101.2345)
    with RunLog(tmp_path, is_main=True, progress=False) as log:
        log.start_at(0)
        log.scalars(7, {"train/loss": 1.23456789, "train/lr": float("inf")})
        log.skip_curves("the test says so")
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "name", "value", "elapsed_s"], ["7", "train/loss", "1.23457", "1.234"],
                                       ["7", "train/lr", "n/a", "1.234"]]
    assert not (tmp_path / "curves.png").exists()
    assert _lines(tmp_path / "train.log")[-1].endswith("curves.png not redrawn: the test says so")


def test_curves_are_drawn_on_the_way_out_and_a_drawing_failure_is_a_warning(tmp_path, monkeypatch):
    with RunLog(tmp_path / "a", is_main=True, progress=False) as log:
        log.start_at(0)
        log.scalars(1, {"train/loss": 2.0})
    assert (tmp_path / "a" / "curves.png").is_file()
    assert _lines(tmp_path / "a" / "train.log")[-1].endswith(f"curves: {tmp_path / 'a' / 'curves.png'}")

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(runlog, "plot_metrics", broken)
    with RunLog(tmp_path / "b", is_main=True, progress=False) as log:
        log.start_at(0)
        log.scalars(1, {"train/loss": 2.0})
    assert _lines(tmp_path / "b" / "train.log")[-1].endswith("WARNING shardfc.train: could not draw curves.png: disk full")


def test_a_resume_drops_the_rows_after_its_step_and_says_how_many(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,name,value,elapsed_s\n1,a,1,0\n2,a,2,0\n3,a,3,0\n3,b,3,0\n4,a\n",
                                          encoding="utf-8")
    with RunLog(tmp_path, is_main=True, progress=False) as log:
        log.start_at(2)
        log.scalars(3, {"a": 5.0})
        log.skip_curves("test")
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "name", "value", "elapsed_s"] and [r[:3] for r in rows[1:]] == [
        ["1", "a", "1"], ["2", "a", "2"], ["3", "a", "5"]]
    said = [line.split(": ", 1)[1] for line in _lines(tmp_path / "train.log")]
    assert "metrics.csv: dropped 3 row(s) after step 2, written before the run was interrupted" in said


def test_a_fresh_start_drops_nothing_and_an_empty_metrics_file_gets_its_header(tmp_path):
    for existing in (None, ""):
        run = tmp_path / f"run{existing is None}"
        run.mkdir()
        if existing is not None:
            (run / "metrics.csv").write_text(existing, encoding="utf-8")
        with RunLog(run, is_main=True, progress=False) as log:
            log.start_at(0)
            log.scalars(1, {"a": 1.0})
            log.skip_curves("test")
        assert (run / "metrics.csv").read_text(encoding="utf-8").splitlines()[0] == "step,name,value,elapsed_s"
        assert not any("dropped" in line for line in _lines(run / "train.log"))


def test_a_stray_byte_in_metrics_csv_neither_stops_a_resume_nor_the_curves(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,name,value,elapsed_s\n1,train/loss,2,0\n2,train/loss,1,0\n3,caf\xe9,1,0\n9,train/loss,0,0\n")
    data = path.read_bytes()
    assert runlog.truncate_metrics(path, 3) == 1
    path.write_bytes(data)  # (the cut file was written back as UTF-8)
    assert read_series(path) == {"train/loss": [(1, 2.0), (2, 1.0), (9, 0.0)]}
    assert plot_metrics(path, tmp_path / "c.png") == ["train/loss"]


def test_a_metrics_file_that_is_not_a_file_is_refused_by_its_name(tmp_path):
    from shardfc.files import FileRefused

    (tmp_path / "metrics.csv").mkdir()
    for read in (lambda p: runlog.truncate_metrics(p, 0), read_series):
        with pytest.raises(FileRefused, match=r"\bmetrics file\b"):
            read(tmp_path / "metrics.csv")


def test_truncate_metrics_on_files_without_a_header_or_with_nothing_to_drop(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("", encoding="utf-8")
    assert runlog.truncate_metrics(path, 5) == 0
    path.write_text("1,a,1,0\nx,a,2,0\n9,a,3,0\n", encoding="utf-8")  # no header: a row named x is no step
    assert runlog.truncate_metrics(path, 5) == 2
    assert path.read_text(encoding="utf-8").splitlines() == ["step,name,value,elapsed_s", "1,a,1,0"]
    assert runlog.truncate_metrics(path, 5) == 0 and [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]
    assert runlog.truncate_metrics(path, 1) == 0  # a row at the step itself is kept
    path.write_text("step,name,value,elapsed_s\n1,a,1,0\n²,a,2,0\n", encoding="utf-8")
    assert runlog.truncate_metrics(path, 5) == 1  # "²" (a digit to isdigit, no int) is no step: a resume went on


def test_the_bar_counts_steps_and_shows_the_numbers_on_a_terminal(tmp_path, monkeypatch, capsys):
    bars, writes = [], []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n, self.postfix, self.closed = kw, kw["initial"], None, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def set_postfix(self, values, refresh):
            self.postfix = (values, refresh)

        def close(self):
            self.closed = True

        @staticmethod
        def write(text, file):
            writes.append(text.split(" ", 1)[1])
            file.write(text + "\n")

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    monkeypatch.setattr(runlog.importlib.util, "find_spec", lambda name: object() if name == "tqdm" else None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with RunLog(tmp_path, is_main=True) as log:  # a bar by default, on a terminal
        log.open_bar(3, 10)
        log.advance()
        log.advance()
        log.set_postfix({"loss": 1.234567, "lr": 0.1})
        logging.getLogger("shardfc.train").info("above the bar")
        log.close_bar()
        log.close_bar()  # twice, and the bar's methods after it: nothing left to do
        log.advance()
        log.set_postfix({"loss": 1.0})
    (bar,) = bars
    assert bar.kw == dict(total=10, initial=3, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    assert bar.n == 5 and bar.postfix == ({"loss": "1.235", "lr": "0.1"}, True) and bar.closed
    assert _lines(tmp_path / "train.log")[-1].endswith("above the bar")
    assert re.fullmatch(r"\d\d:\d\d:\d\d above the bar\n", capsys.readouterr().err)  # through tqdm.write
    with RunLog(tmp_path, is_main=True, progress=False) as log:  # no bar asked for: none opened, no tqdm.write
        log.open_bar(0, 10)
        log.advance()
        logging.getLogger("shardfc.train").info("no bar")
    assert len(bars) == 1 and writes == ["above the bar"]


def test_a_console_that_fails_under_the_bar_never_stops_the_run(tmp_path, monkeypatch, capsys):
    class Bar:
        @staticmethod
        def write(text, file):
            raise OSError("the terminal went away")

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    monkeypatch.setattr(runlog.importlib.util, "find_spec", lambda name: object() if name == "tqdm" else None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(logging, "raiseExceptions", True)
    with RunLog(tmp_path, is_main=True, progress=True):
        logging.getLogger("shardfc.train").info("still logged")
    assert _lines(tmp_path / "train.log")[-1].endswith("still logged")
    err = capsys.readouterr().err  # logging's own report of the failure, naming the record
    assert "OSError: the terminal went away" in err and "Message: 'still logged'" in err


def test_tensorboard_gets_the_finite_scalars_and_is_purged_after_the_resumed_step(tmp_path, monkeypatch):
    writers = []

    class Writer:
        def __init__(self, logdir, purge_step):
            self.logdir, self.purge_step, self.points, self.closed = logdir, purge_step, [], False
            writers.append(self)

        def add_scalar(self, name, value, step):
            self.points.append((name, value, step))

        def close(self):
            self.closed = True

    real = runlog.importlib.util.find_spec
    monkeypatch.setattr(runlog.importlib.util, "find_spec", lambda name: object() if name == "tensorboard" else real(name))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    for start, purge in ((0, None), (4, 4)):
        with RunLog(tmp_path, is_main=True, progress=False) as log:
            log.start_at(start)
            log.scalars(start + 1, {"train/loss": 2.0, "val/x/tar@far=1e-4": float("nan")})
            log.skip_curves("test")
        writer = writers[-1]
        assert writer.logdir == str(tmp_path / "tensorboard") and writer.purge_step == purge and writer.closed
        assert writer.points == [("train/loss", 2.0, start + 1)]


def test_format_metrics_in_every_form():
    assert runlog.format_metrics({"accuracy": 0.931, "accuracy_std": 0.012, "tar@far=1e-3": 0.412}) == (
        "accuracy 93.10% ± 1.20, tar@far=1e-3 41.20%")
    assert runlog.format_metrics({"accuracy": 0.5}) == "accuracy 50.00% ± 0.00"
    assert runlog.format_metrics({"accuracy": 0.5, "tar@far=1e-3": 0.4, "tar@far=1e-2": 0.6}, keys=["tar@far=1e-6",
                                                                                                      "tar@far=1e-2"]) == (
        "accuracy 50.00% ± 0.00, tar@far=1e-2 60.00%")  # a key not measured is left out, the rest still shown
    assert runlog.format_metrics({"mAP": 0.5, "rank1": 0.75, "rank5": 0.9}) == "mAP 50.00%, rank1 75.00%, rank5 90.00%"
    assert runlog.format_metrics({"loss": 1.23456, "n": 3}) == "loss 1.235, n 3"


@pytest.mark.parametrize("name, drawn", [
    ("train/loss", True), ("train/lr", True), ("train/images_per_s", True), ("train/epoch", False),
    ("val/lfw/accuracy", True), ("val/lfw/accuracy_std", False), ("val/lfw/tar@far=1e-3", True),
    ("val/lfw/exact_tar@far=1e-3", False), ("val/lfw/threshold", False), ("val/m/mAP", True), ("val/m/rank1", True),
    ("val/m/rank5", False), ("other/train/loss", False),
])
def test_which_scalars_get_a_panel(name, drawn):
    assert runlog._worth_a_panel(name) is drawn


def test_the_panels_are_laid_out_loss_first_three_to_a_row(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    asked = {}
    real = plt.subplots

    def subplots(rows, cols, **kw):
        asked.update(rows=rows, cols=cols, **kw)
        return real(rows, cols, **kw)

    monkeypatch.setattr(plt, "subplots", subplots)
    csv_path = tmp_path / "metrics.csv"
    names = ["val/a/accuracy", "train/lr", "train/loss", "val/b/mAP"]
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    csv_path.write_text("step,name,value,elapsed_s\n" + "".join(f"{s},{n},{v},0\n" for n in names for s, v in ((1, 1), (2, 2)))
                        + "".join(f"{s},train/loss,{30 - s},0\n" for s in range(3, 21)), encoding="utf-8")
    assert plot_metrics(csv_path, tmp_path / "c.png") == ["train/loss", "train/lr", "val/a/accuracy", "val/b/mAP"]
    assert (asked["rows"], asked["cols"], asked["figsize"], asked["squeeze"]) == (2, 3, (13.5, 6.4), False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "metrics.csv"]  # no scratch file left
    png = (tmp_path / "c.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (
        1350, 640)  # 100 dpi
    (fig,) = figures
    axes = fig.axes
    for ax, name in zip(axes, ["train/loss", "train/lr", "val/a/accuracy", "val/b/mAP"]):
        (line,) = ax.get_lines()
        assert ax.get_title() == name and ax.title.get_fontsize() == 10 and ax.get_xlabel() == "step"
        points = 20 if name == "train/loss" else 2  # each panel: its steps against its values
        assert list(line.get_xdata()) == list(range(1, points + 1))
        assert list(line.get_ydata()) == ([1, 2] + [30 - s for s in range(3, 21)] if name == "train/loss" else [1, 2])
        assert line.get_marker() == ("None" if points >= 20 else "o") and line.get_markersize() == 3
        assert ax.xaxis.get_gridlines()[0].get_alpha() == 0.3 and ax.axison
    assert [ax.axison for ax in axes[4:]] == [False, False]  # the empty places of the grid: no frame
    close(fig)
