"""The head's step as one CUDA graph (issue 42 item 3), as far as a CPU can hold it: the step's
kernels take no number that changes per step (the learning rate reaches them in a device tensor,
so a replay uses the value staged before it), nothing in the step reads the host or changes a
Python-side number a replay would leave stale, the graph is refused with a clear reason where it
cannot run, and the pieces around the replay (the device scalars, the loss handed to the backbone)
do what the replay needs. The replay itself, against the eager step, is the GPU check's
(``scripts/gpu_step.py``'s graph rows)."""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch
from fused_pairs import DEVICE

import shardfc
from shardfc.head import capture
from shardfc.head.capture import CapturedHeadStep, capture_unavailable
from shardfc.head.fused import optimizer as fused_optimizer
from shardfc.head.partial_fc import head_optimizer
from shardfc.tools.host_syncs import HostSyncCounter

C, D, B = 45, 16, 8


def _head(**kw):
    return shardfc.ShardedMarginHead(D, C, device=DEVICE, impl=kw.pop("impl", "gemm"), **kw)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g).to(DEVICE)
    y = torch.randint(0, C, (B,), generator=g).to(DEVICE)
    return x, y


def _against_eager(eager, graphed, opts, step, lrs, **tol):
    """Each of ``lrs`` set on both optimizers, then one eager step of ``eager`` and one call of the
    captured ``step`` of ``graphed`` on the same batch: their losses and embedding gradients equal
    (``tol``: assert_close's). Returns the captured step's ``last_call`` after each."""
    calls = []
    for i, lr in enumerate(lrs):
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = lr
        x, y = _batch(i)
        xe = x.clone().requires_grad_()
        opts[0].zero_grad(set_to_none=False)
        ref = eager(xe, y)
        ref.backward()
        opts[0].step()
        loss, grad = step.step(x, y)
        calls.append(step.last_call)
        torch.testing.assert_close(loss, ref.detach(), **tol)
        torch.testing.assert_close(grad, xe.grad, **tol)
    return calls


NOT_FUSED = ("the optimizer does not apply its step in the backward: use head_optimizer(head, ..., "
             "fused_update=True), so the update is inside the captured step")


@pytest.mark.parametrize("setup, reason", [
    (lambda: (_head(impl="torch"), "sgd"), "impl='torch' has no fused update; use impl 'auto', 'triton' or 'gemm'"),
    (lambda: (_head(sample_rate=0.5), "sgd"),
     "Partial FC (sample_rate=0.5) draws its rows and catches idle rows up through host-side state every step"),
    (lambda: (_head(), None), NOT_FUSED),
    (lambda: (_head(), "sgd-unfused"), NOT_FUSED),
])
def test_what_cannot_be_captured_is_named(setup, reason):
    head, opt = setup()
    optimizer = None if opt is None else head_optimizer(head, "sgd", lr=0.1, fused_update=opt == "sgd")
    assert capture_unavailable(head, optimizer, cuda_available=True) == reason


def test_a_head_sharded_over_a_process_group_is_refused():
    head = _head()
    opt = head_optimizer(head, "sgd", lr=0.1, fused_update=True)
    head.ctx = types.SimpleNamespace(distributed=True)  # what a process group's context says
    assert capture_unavailable(head, opt, cuda_available=True) == (
        "the head is sharded over a process group: its forward exchanges the batch sizes through the host, "
        "which a graph cannot do; capture single-process heads")


def test_a_head_clipped_by_its_norm_is_refused():
    head = _head()
    head.measure_weight_grad_norm()
    opt = head_optimizer(head, "sgd", lr=0.1, fused_update=True)
    assert capture_unavailable(head, opt, cuda_available=True) == (
        "the head's gradient is clipped by its norm (measure_weight_grad_norm), read between backward and step")


def test_without_cuda_the_graph_is_refused_with_one_clear_error():
    head = _head()
    opt = head_optimizer(head, "sgd", lr=0.1, fused_update=True)
    assert "CUDA is not available" in capture_unavailable(head, opt, cuda_available=False)
    assert capture_unavailable(head, opt, cuda_available=True) == (
        None if DEVICE.type == "cuda" else f"the head's shards are on ['{DEVICE}'], not on one CUDA device")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cannot capture the head's step as a CUDA graph: CUDA is not available"):
            CapturedHeadStep(head, opt)


def _launches(monkeypatch):
    """Every interpreted kernel launch: its name and every argument that is not a tensor."""
    from triton.runtime import interpreter

    seen = []
    real = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        numbers = tuple(a for a in args if not isinstance(a, torch.Tensor))
        flags = tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))
        seen.append((self.__name__, numbers, flags, grid if isinstance(grid, tuple) else None))
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    return seen


@pytest.mark.skipif(DEVICE.type == "cuda", reason="spies on the interpreter's launches")
@pytest.mark.parametrize("name, impl", [("sgd", "gemm"), ("adamw", "triton")])
def test_the_step_takes_no_number_that_changes_per_step(monkeypatch, name, impl):
    """Two steps under different learning rates launch the same kernels with the same numbers (a
    graph captured at one replays correctly at the other), and each step's update used its own
    rate: the weights match the optimizer's unfused step under the same schedule."""
    kw = dict(lr=0.1, weight_decay=5e-4) if name == "sgd" else dict(lr=1e-2, weight_decay=1e-2)
    fused = _head(impl=impl)
    plain = copy.deepcopy(fused)
    opt_f = head_optimizer(fused, name, fused_update=True, **kw)
    opt_p = head_optimizer(plain, name, fused_update=False, **kw)
    seen = _launches(monkeypatch)
    per_step = []
    for step, lr in enumerate([kw["lr"], kw["lr"] / 2, kw["lr"] / 5]):
        for opt in (opt_f, opt_p):
            for group in opt.param_groups:
                group["lr"] = lr
        x, y = _batch(step)
        for head, opt in ((fused, opt_f), (plain, opt_p)):
            opt.zero_grad(set_to_none=False)
            head(x, y).backward()
            opt.step()
        per_step.append([launch for launch in seen if "update" in launch[0]])
        seen.clear()
    assert per_step[1] and per_step[1] == per_step[2], "a fused update's launch arguments changed with the learning rate"
    assert fused.last_update == "fused" and plain.last_update != "fused"
    torch.testing.assert_close(fused.weight, plain.weight, rtol=1e-5, atol=1e-6)


class _Recorder(dict):
    """Python-side numbers of a head and its optimizer: what a replay cannot advance."""

    @classmethod
    def of(cls, head, opt) -> "_Recorder":
        out = cls()
        plain = (int, float, str, bool, type(None))
        for k, v in vars(head).items():
            if isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(e, plain) for e in v)):
                out[f"head.{k}"] = v
        for i, group in enumerate(opt.param_groups):
            for k, v in group.items():
                if k != "params":
                    out[f"group{i}.{k}"] = v
        out["opt.updated_in_backward"] = len(opt._updated_in_backward)
        out["opt.clocks"] = len(opt._clocks)
        return out


#: What a replay leaves where the capture left them, and why that changes nothing computed: the
#: forward count only numbers a deferred check's message (the captured step's checks are the
#: CapturedHeadStep's, numbered by it); the optimizer's rounding step seeds stochastic rounding,
#: which the fused update does not do (it rounds to nearest); the weights' versions when the head
#: last noted its sampled rows say when a new step's rows begin, and a captured head scores every
#: row (Partial FC is refused), whatever they say.
_COUNTERS = {"head._forward_calls", "group0.rounding_step", "head._pending_versions"}


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_step_a_graph_captures_reads_no_host_and_moves_no_python_number(monkeypatch, name):
    monkeypatch.setattr(capture, "capture_unavailable", lambda *a, **k: None)  # rehearse on the CPU
    head = _head(validate="deferred")
    opt = head_optimizer(head, name, lr=0.05, fused_update=True)
    step = CapturedHeadStep(head, opt)
    loss0, _ = step.step(*_batch(0))  # the eager steps: impl, state, the next operand settled
    assert step.last_call == "eager"
    before = _Recorder.of(head, opt)
    x, y = _batch(1)
    step._stage()  # outside the region, as before a replay
    with HostSyncCounter() as syncs:
        loss, grad = step._run(x.requires_grad_(), y)  # what _capture records
    assert syncs.count == 0, syncs.report()
    after = _Recorder.of(head, opt)
    moved = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k) and k not in _COUNTERS}
    assert not moved, f"Python-side state a replay would not advance: {moved}"
    assert grad is not None and grad.shape == (B, D) and torch.isfinite(loss)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
def test_eager_steps_check_values_one_call_later_and_hand_the_gradient_back(monkeypatch):
    monkeypatch.setattr(capture, "capture_unavailable", lambda *a, **k: None)
    head = _head()
    opt = head_optimizer(head, "sgd", lr=0.05, fused_update=True)
    ref = copy.deepcopy(head)
    opt_ref = head_optimizer(ref, "sgd", lr=0.05, fused_update=True)
    step = CapturedHeadStep(head, opt)
    x, y = _batch(0)
    emb = x.clone().requires_grad_()
    loss = step.loss(emb * 2, y)  # through a "backbone": the embeddings' gradient flows back
    loss.backward()
    xr = (x.clone().requires_grad_())
    ref_loss = ref(xr * 2, y)
    ref_loss.backward()
    opt_ref.step()
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    torch.testing.assert_close(emb.grad, xr.grad)
    torch.testing.assert_close(head.weight, ref.weight)
    bad = x.clone()
    bad[3, 1] = float("nan")
    step.step(bad, y)  # the values are read at the next call, as validate="deferred" does
    with pytest.raises(ValueError, match="non-finite"):
        step.step(x, y)
    with pytest.raises(ValueError, match="eager_steps must be an integer >= 1"):
        CapturedHeadStep(head, opt, eager_steps=0)


def test_device_scalars_refresh_only_when_the_numbers_change_and_never_inside_a_capture(monkeypatch):
    held = fused_optimizer.DeviceScalars()
    copies = []
    real = fused_optimizer.scalars_on
    monkeypatch.setattr(fused_optimizer, "scalars_on", lambda *a, **k: copies.append(a[0]) or real(*a, **k))
    cpu = torch.device("cpu")
    t = held.get(0, (0.1, 0.9, 5e-4), cpu)
    assert held.get(0, (0.1, 0.9, 5e-4), cpu) is t and len(copies) == 1  # the same numbers: no copy
    assert held.get(0, (0.05, 0.9, 5e-4), cpu) is t and len(copies) == 2  # new numbers, same address
    torch.testing.assert_close(t, torch.tensor([0.05, 0.9, 5e-4]))
    assert held.get(1, (1.0,), cpu) is not t  # another key, its own tensor
    monkeypatch.setattr(fused_optimizer, "capturing", lambda: True)
    assert held.get(0, (0.05, 0.9, 5e-4), cpu) is t  # staged before the capture: read as is
    with pytest.raises(RuntimeError, match=r"changed inside a CUDA graph capture.*before capturing or replaying"):
        held.get(0, (0.01, 0.9, 5e-4), cpu)
    assert copy.deepcopy(held)._held == {}  # a copy makes its own tensors


def test_the_replayed_loss_hands_its_gradient_back_scaled_by_the_incoming_one():
    emb = torch.randn(4, 3, requires_grad=True)
    grad = torch.randn(4, 3)
    loss = capture._StepLoss.apply(emb, torch.tensor(1.5), grad)
    (loss * 1.0).backward()
    torch.testing.assert_close(emb.grad, grad)
    emb.grad = None
    capture._StepLoss.apply(emb, torch.tensor(1.5), grad).backward(torch.tensor(2.0))
    torch.testing.assert_close(emb.grad, 2 * grad)
    half = torch.randn(4, 3).bfloat16().requires_grad_()  # bf16 embeddings, an fp32 loss: the gradient in bf16
    capture._StepLoss.apply(half, torch.tensor(1.5), grad.bfloat16()).backward(torch.tensor(0.5))
    assert half.grad.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs CUDA (the CPU rehearses the step above)")
@pytest.mark.parametrize("name, impl", [("sgd", "gemm"), ("adamw", "triton")])
def test_the_replayed_step_equals_the_eager_one_over_a_schedule_of_learning_rates(name, impl):
    eager = _head(impl=impl)
    graphed = copy.deepcopy(eager)
    opts = [head_optimizer(h, name, lr=0.05, fused_update=True) for h in (eager, graphed)]
    step = CapturedHeadStep(graphed, opts[1])
    calls = _against_eager(eager, graphed, opts, step, [0.05, 0.05, 0.05, 0.02, 0.01, 0.01, 0.005], rtol=1e-5, atol=1e-6)
    assert calls == ["eager", "eager", "captured", "replayed", "replayed", "replayed", "replayed"]
    torch.testing.assert_close(graphed.weight, eager.weight, rtol=1e-5, atol=1e-6)
    graphed.load_state_dict(eager.state_dict())  # weights changed outside the graph: eager again, then recaptured
    step.step(*_batch(9))
    assert step.last_call == "eager"


class _ReplayedEagerly:
    """A stand-in for a CUDA graph on the CPU: records nothing at capture (as CUDA, which runs
    nothing then) and runs the captured step on each replay, rewriting ``outputs``."""

    made = 0

    def __init__(self, body):
        type(self).made += 1
        self.body, self.outputs = body, None

    def replay(self):
        self.outputs = self.body()


@pytest.fixture
def rehearsed(monkeypatch):
    """CapturedHeadStep on the CPU: the CUDA check waived, the graph replayed eagerly."""
    monkeypatch.setattr(capture, "capture_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(capture, "_Graph", _ReplayedEagerly)
    _ReplayedEagerly.made = 0
    return _ReplayedEagerly


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
def test_eager_steps_then_one_capture_then_replays_each_equal_to_the_eager_step(rehearsed):
    """The control flow around the graph: ``eager_steps`` eager calls, a capture, replays; the same
    losses, embedding gradients and weights as eager steps under a learning-rate schedule; a new
    capture (after eager steps) when the shapes change or the weights are changed outside."""
    eager = _head()
    graphed = copy.deepcopy(eager)
    opts = [head_optimizer(h, "sgd", lr=0.05, fused_update=True) for h in (eager, graphed)]
    step = CapturedHeadStep(graphed, opts[1], eager_steps=1)
    assert (step.captures, step.replays, step.last_call) == (0, 0, None)
    calls = _against_eager(eager, graphed, opts, step, [0.05, 0.05, 0.02, 0.01])
    assert calls == ["eager", "captured", "replayed", "replayed"]
    assert (step.captures, step.replays, rehearsed.made) == (1, 3, 1)
    torch.testing.assert_close(graphed.weight, eager.weight)
    version = graphed.weight._version
    step.step(*_batch(5))
    assert step.last_call == "replayed" and graphed.weight._version > version  # seen by what keys on the version
    x, y = _batch(7)
    step.step(x[:5], y[:5])  # another batch size: eager again, then a capture of its own
    step.step(x[:5], y[:5])
    assert step.last_call == "captured" and rehearsed.made == 2
    step.step(x[:5], y[:5])
    assert step.last_call == "replayed"
    with torch.no_grad():
        graphed.weight.mul_(1.0)  # an in-place change outside the graph bumps the version
    step.step(x[:5], y[:5])
    assert step.last_call == "eager" and rehearsed.made == 2
    step.step(x[:5], y[:5])
    assert step.last_call == "captured" and rehearsed.made == step.captures == 3


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
def test_a_captured_step_checks_its_inputs_types_and_shapes_at_once_and_values_a_call_later(rehearsed):
    head = _head(ignore_index=-1)
    step = CapturedHeadStep(head, head_optimizer(head, "sgd", lr=0.05, fused_update=True))
    x, y = _batch(0)
    with pytest.raises(ValueError, match="embedding"):
        step.step(x[:, :3], y)
    with pytest.raises(ValueError, match="labels"):
        step.step(x, y[:3])
    y_ignored = y.clone()
    y_ignored[0] = -1  # ignore_index: a valid label, never a value error
    step.step(x, y_ignored)
    step.step(x, y)
    bad = y.clone()
    bad[2] = C + 4
    step.step(x, bad)
    with pytest.raises(ValueError, match=rf"labels.*{C + 4}.*forward call 3\b"):
        step.step(x, y)
    assert step.calls == 3  # the refused ones (and the one that raised the last error first) are not steps
    step.step(x[:0], y[:0])  # an empty batch: nothing to check later
    step.check_pending()


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "2"])
def test_the_number_of_eager_steps_is_checked(monkeypatch, bad):
    monkeypatch.setattr(capture, "capture_unavailable", lambda *a, **k: None)
    with pytest.raises(ValueError, match=rf"eager_steps must be an integer >= 1, got {re.escape(repr(bad))}"):
        CapturedHeadStep(None, None, eager_steps=bad)
    assert CapturedHeadStep(None, None, eager_steps=1).eager_steps == 1

def test_cuda_availability_is_asked_of_torch_when_not_given(monkeypatch):
    head = _head()
    opt = head_optimizer(head, "sgd", lr=0.1, fused_update=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "not on one CUDA device" in capture_unavailable(head, opt) or DEVICE.type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert capture_unavailable(head, opt).startswith("CUDA is not available")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
def test_inputs_on_another_device_are_refused_naming_both(rehearsed):
    head = _head()
    step = CapturedHeadStep(head, head_optimizer(head, "sgd", lr=0.05, fused_update=True))
    x, y = _batch(0)
    with pytest.raises(ValueError, match=r"takes embeddings and labels on cpu, got them on meta and cpu"):
        step.step(x.to("meta"), y)
    assert step.calls == 0 and step._pending is None
