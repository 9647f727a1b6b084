"""Where a step's time goes (``--profile``'s phases), and no host sync in the loop between its log points."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardfc.parallel.context import DistContext
from shardfc.train import loop
from shardfc.train import step as step_module
from shardfc.train.config import TrainConfig
from shardfc.train.loader import data as data_module
from shardfc.train.loop import train
from shardfc.train.observe.phases import PHASES, PhaseClock, format_phases, summarize_phases
from shardfc.train.observe.profile import profile_path
from shardfc.train.state import RunState

from ..tiny import tiny_config


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_charges_each_phase_the_time_since_the_previous_lap(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr("shardfc.train.observe.phases.time.perf_counter", fake)
    clock = PhaseClock("cpu")
    clock.begin_step()
    fake.now = 5.0
    clock.lap("forward")
    clock.end_step("optimizer")
    assert clock.steps == []  # not enabled: nothing read, nothing kept
    clock.enabled = True
    for forward in (0.002, 0.004):
        clock.begin_step()
        fake.now += 0.001
        clock.lap("loader wait")
        fake.now += forward
        clock.lap("forward")
        fake.now += 0.0005
        clock.lap("loader wait")  # a second micro-batch adds to the phase
        fake.now += 0.0001
        clock.end_step("logging/metrics")
    clock.begin_step()
    clock.drop_step()  # a step that trained nothing
    clock.lap("forward")  # no open step: ignored
    assert clock.steps == [pytest.approx({"loader wait": 0.0015, "forward": f, "logging/metrics": 0.0001})
                           for f in (0.002, 0.004)]
    s = summarize_phases(clock.steps)
    assert list(s["ms_per_step"]) == ["loader wait", "forward", "logging/metrics"]  # in the step's order
    assert s["ms_per_step"]["forward"] == pytest.approx(3.0) and s["total_ms"] == pytest.approx(4.6)
    assert s["outside_ms"] == pytest.approx(0.1) and s["outside_share"] == pytest.approx(0.1 / 4.6)
    table = format_phases(s, beside=s, beside_name="ceiling")
    assert "| forward | 3.000 | 65.2% | 3.000 |" in table and "| step | 4.600 | 100% | 4.600 |" in table
    assert "| outside the data path and the bare step | 0.100 | 2.2% | 0.100 |" in table


def test_the_head_phase_ends_when_the_backward_reaches_the_embeddings(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr("shardfc.train.observe.phases.time.perf_counter", fake)
    clock = PhaseClock("cpu", enabled=True)
    x = torch.ones(3, requires_grad=True)
    clock.begin_step()
    embeddings = x * 2
    clock.lap_on_backward(embeddings, "head")
    loss = (embeddings**2).sum()
    fake.now = 1.0
    hooked = torch.Tensor.register_hook

    def later(t, fn):  # the head's backward takes 2 s, then the backbone's 3 s
        def timed(grad):
            fake.now += 2.0
            fn(grad)
            fake.now += 3.0
        return hooked(t, timed)

    monkeypatch.setattr(torch.Tensor, "register_hook", later)
    embeddings = x * 2
    clock.lap_on_backward(embeddings, "head")
    (embeddings**2).sum().backward()
    clock.end_step("backward")
    assert clock.steps == [{"head": 3.0, "backward": 3.0}]
    del loss


#: Tensor methods that read a value back to the host (a GPU sync when the tensor is on a GPU).
_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__format__", "__repr__", "nonzero", "cpu", "numpy")
#: Code that reads host tensors by design: the data on its way in, the (host) stop flag.
_HOST_SIDE = ("shardfc/data/", "shardfc/train/loader/data.py", "shardfc/train/stopping.py")


def test_the_loop_reads_no_tensor_back_between_its_log_points(tmp_path, monkeypatch):
    """One process on the CPU, 4 steps, a report every 2: every read of a tensor value from shardfc's
    code (other than the data's and the stop flag's host tensors) inside a step happens in a report,
    but for the head's one read per forward."""
    where = {"step": False, "report": False}
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if where["step"] and not where["report"]:
                frame = sys._getframe(1)
                while frame is not None and "/shardfc/" not in frame.f_code.co_filename.replace("\\", "/"):
                    frame = frame.f_back  # torch's own code: charged to the shardfc line that called it
                if frame is not None:
                    path = frame.f_code.co_filename.replace("\\", "/")
                    if not any(zone in path for zone in _HOST_SIDE):
                        reads.append(f"{name} at {path.split('/shardfc/')[-1]}:{frame.f_lineno}")
            return original(self, *args, **kwargs)

        return read

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))

    def flagged(key, fn):
        def wrapped(*args, **kwargs):
            where[key] = True
            try:
                return fn(*args, **kwargs)
            finally:
                where[key] = False
        return wrapped

    monkeypatch.setattr(loop, "trainer_step", flagged("step", loop.trainer_step))
    monkeypatch.setattr(loop, "report", flagged("report", loop.report))
    cfg = tiny_config(tmp_path, nproc=1, max_steps=4, log_every=2, eval_every=0, ckpt_every=0,
                      synthetic_val_pairs=0, profile=True, grad_clip=5.0)
    train(cfg)
    # The head's one read per forward: its input checks, read with the batch-size exchange that a
    # process group needs anyway (head/validation.py); a second read anywhere fails here.
    exchange = [r for r in reads if r.startswith("tolist at head/validation.py:")]
    others = [r for r in reads if r not in exchange]
    assert others == [], "\n".join(others)
    assert len(exchange) == cfg.max_steps * cfg.grad_accum
    # --profile split every step into the loop's phases, and rank 0 logged their table
    p = json.loads(profile_path(Path(tmp_path), 0).read_text())
    assert len(p["step_phases_s"]) == 4
    for step in p["step_phases_s"]:
        assert set(step) == set(PHASES) and min(step.values()) >= 0
    log = (Path(tmp_path) / "train.log").read_text()
    assert "where a step's time went" in log and "| outside the data path and the bare step |" in log


class _Takes(torch.autograd.Function):
    """The identity, taking ``forward_s`` of the fake clock forward and ``backward_s`` backward."""

    @staticmethod
    def forward(ctx, x, fake, forward_s, backward_s):
        ctx.fake, ctx.backward_s = fake, backward_s
        fake.now += forward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.fake.now += ctx.backward_s
        return grad, None, None, None


def test_only_what_is_neither_data_path_nor_bare_step_is_outside():
    """Each phase of a step (a pipeline step's schedule too) at its own power of two of milliseconds:
    what is outside the data path and the bare step is exactly the stop agreement and the logging."""
    phases = PHASES + ("pipeline schedule",)
    step = {p: 2.0 ** i / 1e3 for i, p in enumerate(phases)}
    s = summarize_phases([step, step])
    assert s["ms_per_step"] == pytest.approx({p: 2.0 ** i for i, p in enumerate(phases)})
    outside = 2.0 ** phases.index("stop agreement") + 2.0 ** phases.index("logging/metrics")
    assert s["outside_ms"] == pytest.approx(outside) and s["total_ms"] == pytest.approx(2.0 ** len(phases) - 1)
    assert s["outside_share"] == pytest.approx(outside / s["total_ms"])


def test_each_part_of_a_step_is_charged_to_its_own_phase(monkeypatch):
    """train_step on parts that each take a known time (powers of two, so that any time charged to
    another phase shows): zero_grad, the loader, the backbone's forward and backward, the head's
    forward and backward, the optimizers' step, over 2 micro-batches."""
    fake = _FakeTime()
    monkeypatch.setattr("shardfc.train.observe.phases.time.perf_counter", fake)

    class Optimizer:
        def zero_grad(self, set_to_none=True):
            fake.now += 2.0 ** -10

    class Part(torch.nn.Module):
        def __init__(self, forward_s, backward_s):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.times = forward_s, backward_s

        def forward(self, x, labels=None):
            out = _Takes.apply(x * self.w, fake, *self.times)
            return out.sum() if labels is not None else out

    def stream():
        while True:
            fake.now += 2.0 ** -6
            yield torch.ones(4, 3), torch.zeros(4, dtype=torch.int64), []

    def apply_gradients(*args, **kwargs):
        fake.now += 2.0 ** 4

    monkeypatch.setattr(step_module, "apply_gradients", apply_gradients)
    parts = SimpleNamespace(opt_backbone=Optimizer(), opt_head=Optimizer(), backbone=Part(2.0 ** -3, 2.0 ** 2),
                            head=Part(2.0 ** -1, 2.0 ** 1), head_step=None, triplet=None, scaler=SimpleNamespace(scale=lambda loss: loss))
    cfg = TrainConfig(grad_accum=2)
    clock = PhaseClock("cpu", enabled=True)
    clock.begin_step()
    step_module.train_step(parts, stream(), RunState(), cfg, DistContext(), contextlib.nullcontext, clock)
    clock.end_step()
    assert clock.steps == [{
        "optimizer": 2 * 2.0 ** -10 + 2.0 ** 4,  # zero_grad of both optimizers, then their step
        "loader wait": 2 * 2.0 ** -6,
        "forward": 2 * 2.0 ** -3,
        "head": 2 * (2.0 ** -1 + 2.0 ** 1),  # the loss's forward, and its backward down to the embeddings
        "backward": 2 * 2.0 ** 2,
    }]


def test_a_recording_clock_synchronises_the_gpu_at_each_lap_and_an_idle_one_never(monkeypatch):
    # so that a phase is charged its kernels' time, not their launch's; and no --profile, no sync
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    for device, expected in (("cuda:1", [torch.device("cuda:1")] * 3), ("cpu", [])):
        synced.clear()
        clock = PhaseClock(device)
        clock.begin_step()
        clock.lap("forward")
        clock.end_step("optimizer")
        assert synced == []
        clock.enabled = True
        clock.begin_step()
        clock.lap("forward")
        clock.end_step("optimizer")
        assert synced == expected, device


def test_the_data_path_charges_the_loader_and_the_copy_to_their_phases(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr("shardfc.train.observe.phases.time.perf_counter", fake)
    collate, to_device = data_module.collate_keyed, data_module.to_device

    def slow_collate(batch):  # the loader: decoding and collating (0 workers: in this process)
        fake.now += 1.0
        return collate(batch)

    def slow_copy(*args, **kwargs):  # the copy to the device and the normalisation there
        fake.now += 2.0
        return to_device(*args, **kwargs)

    monkeypatch.setattr(data_module, "collate_keyed", slow_collate)
    monkeypatch.setattr(data_module, "to_device", slow_copy)
    cfg = TrainConfig(dataset="synthetic", image_size=[16, 16], synthetic_identities=4, synthetic_images_per_identity=2,
                      num_workers=0, random_erasing=0.5)
    dataset = data_module.train_dataset(cfg, (16, 16))
    shards = data_module.rank_batches(cfg, dataset, 4, DistContext())
    clock = PhaseClock("cpu", enabled=True)
    stream = data_module.micro_batches(dataset, shards, RunState(batches_per_epoch=len(shards)), cfg, DistContext(),
                                       clock=clock)
    for _ in range(3):
        clock.begin_step()
        next(stream)
        clock.end_step()
    stream.close()
    assert clock.steps == [{"loader wait": 1.0, "h2d": 2.0}] * 3


def test_phases_missing_from_a_step_count_as_zero_and_an_empty_record_sums_to_nothing():
    s = summarize_phases([{"forward": 0.004, "head": 0.0005}])  # one step: its own times
    assert s["ms_per_step"] == pytest.approx({"forward": 4.0, "head": 0.5}) and s["steps"] == 1
    assert s["outside_ms"] == 0.0 and s["outside_share"] == 0.0
    s = summarize_phases([{"forward": 0.004, "logging/metrics": 0.0002}, {"forward": 0.002}])
    assert s["ms_per_step"] == pytest.approx({"forward": 3.0, "logging/metrics": 0.1})
    assert s["outside_share"] == pytest.approx(0.1 / 3.1)
    s = summarize_phases([{"logging/metrics": 0.0005}])  # under a millisecond, all of it outside
    assert s["total_ms"] == pytest.approx(0.5) and s["outside_share"] == pytest.approx(1.0)
    assert summarize_phases([]) == {"steps": 0, "ms_per_step": {}, "total_ms": 0, "outside_ms": 0,
                                    "outside_share": 0.0}


def test_the_table_lists_each_phase_of_either_step_once():
    """format_phases, line for line: a phase only the other step has gets a row of 0 here, and the
    other column 0 where it lacks one; a step of no time shows 0% rather than dividing by it."""
    mine = summarize_phases([{"forward": 0.003, "logging/metrics": 0.001}])
    ceiling = summarize_phases([{"forward": 0.002, "optimizer": 0.0005}])
    assert format_phases(mine, beside=ceiling, beside_name="ceiling").split("\n") == [
        "| phase (mean of 1 steps) | ms / step | % of the step | ceiling ms / step |",
        "|---|---:|---:|---:|",
        "| forward | 3.000 | 75.0% | 2.000 |",
        "| logging/metrics | 1.000 | 25.0% | 0.000 |",
        "| optimizer | 0.000 | 0.0% | 0.500 |",
        "| step | 4.000 | 100% | 2.500 |",
        "| outside the data path and the bare step | 1.000 | 25.0% | 0.000 |",
    ]
    assert format_phases(mine, beside=ceiling).split("\n")[0].endswith(" % of the step |  ms / step |")  # untitled
    assert format_phases(summarize_phases([{"forward": 0.0}])).split("\n") == [
        "| phase (mean of 1 steps) | ms / step | % of the step |",
        "|---|---:|---:|",
        "| forward | 0.000 | 0.0% |",
        "| step | 0.000 | 100% |",
        "| outside the data path and the bare step | 0.000 | 0.0% |",
    ]


def test_a_backward_lap_is_hooked_only_while_recording_and_only_on_a_tensor_with_a_gradient():
    x = torch.ones(2, requires_grad=True)
    idle = PhaseClock("cpu")
    idle.begin_step()
    y = x * 2
    idle.lap_on_backward(y, "head")
    assert not y._backward_hooks  # not even registered
    recording = PhaseClock("cpu", enabled=True)
    recording.begin_step()
    recording.lap_on_backward(torch.ones(2), "head")  # no gradient: nothing to hook, no error
    recording.end_step("forward")
    recording.lap("forward")  # after the step: ignored
    assert list(recording.steps[0]) == ["forward"] and len(recording.steps) == 1
