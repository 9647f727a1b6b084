"""What a run tells a person: log lines, a progress bar, and scalar logs (CSV, TensorBoard if installed).

Only rank 0 writes anything; on the other ranks every method is a no-op and the ``shardfc``
loggers are raised to ERROR, so a multi-process run prints one stream.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from shardfc import files
from shardfc.checks import digits_value
from shardfc.evaluation.far import why_undefined
from shardfc.outputs import write_atomically

__all__ = ["NOT_AVAILABLE", "RunLog", "format_metrics", "plot_metrics", "read_series", "truncate_metrics"]

logger = logging.getLogger("shardfc.train")

#: Loggers of the library whose records a run shows (data warnings, checkpoint saves, ...).
_LIBRARY_LOGGER = "shardfc"


class _TqdmHandler(logging.StreamHandler):
    """Writes records above an active tqdm bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never kill the run
            self.handleError(record)


class RunLog:
    """Logging, progress bar and scalar files of one run; use as a context manager.

    Args:
        output_dir: run folder; ``train.log`` and ``metrics.csv`` are appended to (a resumed run
            continues them; :meth:`start_at` drops the rows an interrupted attempt wrote after the
            checkpoint it resumes from).
        is_main: this process writes (rank 0).
        progress: show a bar (tqdm when installed and stderr is a terminal); without one, the
            periodic log lines are the progress report.
    """

    def __init__(self, output_dir: Path, is_main: bool, progress: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.is_main = is_main
        self.progress = progress
        self._handlers: list = []
        self._saved_level: Optional[int] = None
        self._saved_propagate = True
        self._csv_file = None
        self._csv = None
        self._tb = None
        self._bar = None
        self._use_bar = False
        self._logfile: Optional[logging.Handler] = None
        self._start = time.time()
        self._no_curves: Optional[str] = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "RunLog":
        lib = logging.getLogger(_LIBRARY_LOGGER)
        self._saved_level, self._saved_propagate = lib.level, lib.propagate
        if not self.is_main:
            lib.setLevel(logging.ERROR)
            return self
        lib.setLevel(logging.INFO)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        use_bar = self.progress and sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None
        console = _TqdmHandler() if use_bar else logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logfile = logging.FileHandler(self.output_dir / "train.log", encoding="utf-8")
        logfile.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for h in (console, logfile):
            lib.addHandler(h)
            self._handlers.append(h)
        self._logfile = logfile
        lib.propagate = False  # the run's handlers are the single place records go
        self._use_bar = use_bar
        return self

    def start_at(self, step: int) -> None:
        """Open the scalar logs for a run that continues from ``step`` (0: a fresh start).

        Rows of ``metrics.csv`` after ``step`` were written by an earlier attempt past its last
        checkpoint; the run trains those steps again, so they are dropped (as are TensorBoard's
        events after ``step``): the curves then go one way, without a zig-zag back in time.
        """
        if not self.is_main:
            return
        csv_path = self.output_dir / "metrics.csv"
        dropped = truncate_metrics(csv_path, step) if csv_path.exists() else 0
        if dropped:
            logger.info("metrics.csv: dropped %d row(s) after step %d, written before the run was interrupted",
                        dropped, step)
        new = not csv_path.exists() or csv_path.stat().st_size == 0
        self._csv_file = open(csv_path, "a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._csv_file)
        if new:
            self._csv.writerow(_CSV_HEADER)
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=step or None)

    def skip_curves(self, reason: str) -> None:
        """Do not draw curves.png on the way out (logged with ``reason``); metrics.csv is complete."""
        self._no_curves = reason

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close_bar()
        if exc is not None and self._logfile is not None:
            # The console gets a one-line error from the CLI; the log keeps the traceback.
            record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "run failed", (), (exc_type, exc, tb))
            self._logfile.handle(record)
        if self._csv_file is not None:
            self._csv_file.close()
            if self._no_curves is not None:
                logger.info("curves.png not redrawn: %s", self._no_curves)
            else:
                try:  # a picture of the run is a convenience: it must never fail the run
                    if plot_metrics(self.output_dir / "metrics.csv", self.output_dir / "curves.png"):
                        logger.info("curves: %s", self.output_dir / "curves.png")
                except Exception as e:  # noqa: BLE001
                    logger.warning("could not draw curves.png: %s", e)
        if self._tb is not None:
            self._tb.close()
        lib = logging.getLogger(_LIBRARY_LOGGER)
        for h in self._handlers:
            lib.removeHandler(h)
            h.close()
        if self._saved_level is not None:
            lib.setLevel(self._saved_level)
            lib.propagate = self._saved_propagate

    # ------------------------------------------------------------------ progress
    def open_bar(self, start: int, total: int) -> None:
        if self._use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def set_postfix(self, values: Mapping[str, float]) -> None:
        """Show ``values`` (loss, lr, images/s) next to the bar."""
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=True)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ------------------------------------------------------------------ scalars
    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Append ``values`` at ``step`` to metrics.csv (and TensorBoard); after :meth:`start_at`."""
        if not self.is_main:
            return
        if self._csv is None:
            raise RuntimeError("RunLog.scalars() before start_at()")
        now = round(time.time() - self._start, 3)
        for name, value in values.items():
            value = float(value)
            # NaN is a metric its data cannot support (a TAR at a FAR too small for the pairs): "n/a"
            self._csv.writerow([step, name, f"{value:.6g}" if math.isfinite(value) else NOT_AVAILABLE, now])
            if self._tb is not None and math.isfinite(value):
                self._tb.add_scalar(name, value, step)
        self._csv_file.flush()


_CSV_HEADER = ["step", "name", "value", "elapsed_s"]


def truncate_metrics(csv_path: Path, step: int) -> int:
    """Keep the rows of ``csv_path`` up to ``step`` (and drop a torn last line); returns how many were dropped."""
    # Through the gate: the run folder is the user's, and a FIFO or /dev/zero there would hang a resume.
    with io.TextIOWrapper(files.open_file(csv_path, "csv", "metrics file"), newline="", encoding="utf-8",
                          errors="replace") as f:
        rows = list(csv.reader(f))
    if not rows:
        return 0
    body = rows[1:] if rows[0] == _CSV_HEADER else rows
    steps = [digits_value(r[0]) if len(r) == len(_CSV_HEADER) else None for r in body]
    kept = [r for r, at in zip(body, steps) if at is not None and at <= step]
    if len(kept) == len(body):
        return 0
    def write(scratch: Path) -> None:
        with open(scratch, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(_CSV_HEADER)
            writer.writerows(kept)

    write_atomically(Path(csv_path), write)  # never half a file, even if this is interrupted too
    return len(body) - len(kept)


#: How metrics.csv (and the logs) write a value that its data cannot support: no number at all.
NOT_AVAILABLE = "n/a"


def format_metrics(values: Dict[str, float], keys: Optional[Sequence[str]] = None) -> str:
    """``accuracy 93.10% ± 1.20, tar@far=1e-3 41.20%, tar@far=1e-4 n/a (FAR 1e-4 needs at least
    10000 negative pairs, this set has 3000)`` from a verification metrics dict.

    ``keys``: the rate metrics after the accuracy; by default every ``tar@far=`` of insightface's
    protocol present. One its data cannot support (NaN) is ``n/a`` with the reason, never a number.
    """
    parts = []
    if "accuracy" in values:
        parts.append(f"accuracy {100 * values['accuracy']:.2f}% ± {100 * values.get('accuracy_std', 0.0):.2f}")
    if keys is None:
        keys = [k for k in values if k.startswith("tar@far=")]
    for k in keys:
        if k not in values:
            continue
        if math.isfinite(values[k]):
            parts.append(f"{k} {100 * values[k]:.2f}%")
        else:
            parts.append(f"{k} {NOT_AVAILABLE} ({why_undefined(k, values)})")
    for k in ("mAP", "rank1", "rank5"):
        if k in values:
            parts.append(f"{k} {100 * values[k]:.2f}%")
    return ", ".join(parts) if parts else ", ".join(f"{k} {v:.4g}" for k, v in values.items())


#: The scalars a person looks at; the rest (epoch, thresholds, counts) stay in the CSV.
_PANELS = ("train/loss", "train/lr", "train/images_per_s", "/accuracy", "/tar@far", "/mAP", "/rank1")


def _worth_a_panel(name: str) -> bool:
    return name.startswith(_PANELS[:3]) or any(name.endswith(p) or p + "=" in name for p in _PANELS[3:])


def read_series(csv_path: Path) -> Dict[str, List[Tuple[int, float]]]:
    """The points ``curves.png`` draws: ``{name: [(step, value), ...]}`` of the scalars worth a
    panel, numbers only (``n/a``, NaN and a torn last line are no point)."""
    series: Dict[str, List[Tuple[int, float]]] = {}
    with io.TextIOWrapper(files.open_file(csv_path, "csv", "metrics file"), newline="", encoding="utf-8",
                          errors="replace") as f:
        for row in csv.DictReader(f):
            try:
                name, step, value = row["name"], int(row["step"]), float(row["value"])
            except (KeyError, TypeError, ValueError):
                continue  # "n/a", or the torn last line of an interrupted run
            if _worth_a_panel(name) and math.isfinite(value):
                series.setdefault(name, []).append((step, value))
    return series


def plot_metrics(csv_path: Path, png_path: Path) -> List[str]:
    """Draw every scalar of ``metrics.csv`` against the step, one panel each, into ``png_path``.

    A value that is not a number (``n/a``: the data cannot support it; or NaN in an older file) is
    no point, and a metric with no point at all gets no panel.

    Returns the names drawn, in panel order: empty (and nothing drawn) when matplotlib is not
    installed or there is nothing to draw.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return []
    series = read_series(csv_path)
    if not series:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(series, key=lambda n: (not n.startswith("train/loss"), n))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        steps, values = zip(*sorted(series[name]))
        ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    try:  # a reader never sees half a picture
        write_atomically(Path(png_path), lambda scratch: fig.savefig(scratch, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return names
