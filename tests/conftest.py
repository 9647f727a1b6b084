"""Fixtures shared by every test folder: running a command under ``horovodrun``; NVIDIA DALI present
(or the test skipped); the head's step measured on real tensors (what ``shardfc plan`` predicts).
And how many test processes pytest-xdist starts (pyproject's ``-n auto``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` (scripts/mutation.sh) leaves it unknown
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): :func:`xdist_workers.auto_workers`."""
    from xdist_workers import auto_workers

    return auto_workers()


#: Set to 1 (CI does) to make the Horovod tests fail instead of skipping when Horovod is missing.
REQUIRE_HOROVOD = "SHARDFC_REQUIRE_HOROVOD"

INSTALL_HINT = "install it with `bash scripts/install_horovod.sh` (horovod 0.28.1 built with PyTorch and Gloo)"


def _horovodrun_path() -> Optional[str]:
    beside = Path(sys.executable).with_name("horovodrun")  # the launcher of this interpreter's venv
    if beside.is_file():
        return str(beside)
    import shutil

    return shutil.which("horovodrun")


def horovod_missing() -> Optional[str]:
    """Why Horovod tests cannot run here, or None."""
    try:
        import horovod.torch as hvd
    except ImportError as e:
        return f"horovod.torch is not importable ({e}); {INSTALL_HINT}"
    if not hvd.gloo_built():
        return f"horovod is built without Gloo, which these CPU tests launch with; {INSTALL_HINT}"
    if _horovodrun_path() is None:
        return f"horovod imports but its launcher `horovodrun` is not on PATH; {INSTALL_HINT}"
    return None


class HorovodRun:
    """``horovodrun -np N --gloo python ARGS...``, output to a file, killed after a timeout."""

    def __init__(self, launcher: str) -> None:
        self.launcher = launcher

    def __call__(self, np: int, args: List[str], log: Path, timeout_s: float = 600.0, cwd: Optional[Path] = None):
        """Run; returns ``(exit code, the log's text)``; the code is None when the run timed out."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        src = str(Path(__file__).resolve().parents[1] / "src")
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        cmd = [self.launcher, "-np", str(np), "--gloo", sys.executable, *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
            try:
                code: Optional[int] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it started
                proc.wait()
                code = None
        return code, log.read_text(errors="replace")


def skip_unless_installed(reason: Optional[str], require_variable: str) -> None:
    """Skip the test when an optional dependency is missing (``reason``: why, or None when present);
    fail instead when ``require_variable`` is 1, as CI sets it for what it installs."""
    if reason is not None:
        if os.environ.get(require_variable) == "1":
            pytest.fail(f"{require_variable}=1 but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def horovodrun() -> HorovodRun:
    """A :class:`HorovodRun`; skips the test when Horovod is missing (fails with SHARDFC_REQUIRE_HOROVOD=1)."""
    skip_unless_installed(horovod_missing(), REQUIRE_HOROVOD)
    return HorovodRun(_horovodrun_path())


#: Set to 1 (CI does) to make the DALI tests fail instead of skipping when DALI is missing.
REQUIRE_DALI = "SHARDFC_REQUIRE_DALI"


@pytest.fixture(scope="session")
def dali() -> None:
    """Skips the test when NVIDIA DALI is missing (fails with SHARDFC_REQUIRE_DALI=1)."""
    from shardfc.train.loader.dali_loader import dali_missing

    skip_unless_installed(dali_missing(), REQUIRE_DALI)


def _measured_step_peak(C, D, B, grads_kept=True, optimizer="sgd", dtype="float32", margin="arcface", impl="torch",
                        **head_options) -> int:
    """Bytes the bench's training step allocates above its resting state (``LiveTensorBytes``), on
    real CPU tensors, W = 1, after a real warm-up step; labels distinct. ``impl="triton"`` runs the
    fused kernels, the fused row-sparse SGD and the idle rows' kernel (their choice on CUDA; here
    under the interpreter)."""
    import torch

    from shardfc.head.margins import build_margin
    from shardfc.head.module import ShardedMarginHead
    from shardfc.head.partial_fc import RowSparseSGD, head_optimizer
    from shardfc.tools.bench.memory import LiveTensorBytes
    from shardfc.tools.bench.runner import train_step

    torch.manual_seed(0)
    dtype = getattr(torch, dtype)
    head = ShardedMarginHead(D, C, margin=build_margin(margin), dtype=dtype, impl=impl, **head_options)
    name = "adamw" if optimizer == "adamw" else "sgd"
    own = {} if name == "adamw" else {"momentum": 0.9 if optimizer == "sgd" else 0.0}  # SGD's own, to SGD only
    opt = head_optimizer(head, name, lr=0.1, weight_decay=0.0, **own)
    if impl == "triton" and isinstance(opt, RowSparseSGD):
        opt.fused = True
    if impl in ("triton", "gemm") and hasattr(opt, "catch_up_kernel"):
        opt.catch_up_kernel = True  # the idle rows' kernel, as on CUDA

    def inputs():
        return torch.randn(B, D, dtype=dtype, requires_grad=True), torch.arange(B) * (C // B)

    train_step(head, opt, *inputs(), set_to_none=not grads_kept)
    x, y = inputs()
    with LiveTensorBytes() as mode:
        train_step(head, opt, x, y, set_to_none=not grads_kept)
    assert head.last_impl == impl
    return mode.peak


@pytest.fixture
def measured_step_peak():
    """:func:`_measured_step_peak`: ``(C, D, B, grads_kept, optimizer, **head_options) -> bytes``."""
    return _measured_step_peak


#: The alarm behind a test of a hostile input (:func:`no_hang`), unless its module sets ``HANG_S``: many
#: times what any such test needs on an idle machine, so a machine busy on every core still meets it,
#: while a regression that blocks (a FIFO read, an endless loop on a crafted count) fails instead of
#: stalling the suite.
HANG_S = 60


@pytest.fixture
def no_hang(request):
    """SIGALRM after the module's ``HANG_S`` seconds (default :data:`HANG_S`): a hang is a TimeoutError."""
    def stop(signum, frame):
        raise TimeoutError("a hostile input made the code under test hang")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(getattr(request.module, "HANG_S", HANG_S))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def special_file():
    """``make(path, kind)``: ``path`` made as what a reader of regular files must refuse — ``"fifo"``
    (a read would block forever) or ``"dev_zero"`` (a link to an endless device) — returning True;
    False for any other kind, which the test makes itself."""
    def make(path, kind: str) -> bool:
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dev_zero":
            os.symlink("/dev/zero", path)
        else:
            return False
        return True

    return make


@pytest.fixture
def bars(monkeypatch):
    """A terminal on stderr and a stand-in tqdm: the list of what each bar was asked for (a bar
    without an iterable, advanced by hand, also records ``updated``, the count, and ``closed``)."""
    import importlib.machinery
    import io
    import sys
    import types

    class Tty(io.StringIO):
        def isatty(self):
            return True

    made = []

    class Manual:  # a bar advanced by hand (progress.counter): records its updates and its end in its kwargs
        def __init__(self, kw):
            self.kw = kw
            kw.update(updated=0, closed=False)

        def update(self, n=1):
            self.kw["updated"] += n

        def close(self):
            self.kw["closed"] = True

    def tqdm(iterable=None, **kw):
        made.append(kw)
        return iterable if iterable is not None else Manual(kw)

    stand_in = types.ModuleType("tqdm")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("tqdm", None)  # torch's imports ask find_spec("tqdm")
    stand_in.tqdm = tqdm
    monkeypatch.setitem(sys.modules, "tqdm", stand_in)
    # the module's own sys: pytest puts its capture back on sys.stderr after fixtures run
    from shardfc import progress as progress_mod

    monkeypatch.setattr(progress_mod, "sys", types.SimpleNamespace(stderr=Tty()))
    return made
