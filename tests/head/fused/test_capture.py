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
from shardfc.head import capture, catch_up, partial_fc
from shardfc.head.capture import CapturedHeadStep, capture_unavailable
from shardfc.head.fused import device_scalars
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
    (lambda: (_head(sample_rate=0.5, sparse_grad=True), "sgd"),
     "Partial FC with sparse_grad=True hands each backward's compact gradient to host-side lists; the fused "
     "update needs no gradient at all: build the head with sparse_grad=False"),
    (lambda: (_head(), None), NOT_FUSED),
    (lambda: (_head(), "sgd-unfused"), NOT_FUSED),
])
def test_what_cannot_be_captured_is_named(setup, reason):
    head, opt = setup()
    optimizer = None if opt is None else head_optimizer(head, "sgd", lr=0.1, fused_update=opt == "sgd")
    assert capture_unavailable(head, optimizer, cuda_available=True) == reason


def test_partial_fc_is_captured_with_sgd_and_with_lazy_adamw_but_not_exact_adamw():
    head = _head(sample_rate=0.5)
    for name, idle, reason in [
        ("sgd", "exact", None), ("sgd", "lazy", None), ("adamw", "lazy", None),
        ("adamw", "exact", "RowSparseAdamW with idle_rows='exact' catches idle rows up by iterating their missed "
                           "steps a number of times the host counts; capture SGD, or AdamW with idle_rows='lazy'")]:
        opt = head_optimizer(head, name, lr=0.1, fused_update=True, idle_rows=idle)
        expect = reason or (None if DEVICE.type == "cuda" else f"the head's shards are on ['{DEVICE}'], not on one CUDA device")
        assert capture_unavailable(head, opt, cuda_available=True) == expect, (name, idle)
    dense = _head()  # an exact AdamW of a head without sampling keeps no idle rows: captured
    opt = head_optimizer(dense, "adamw", lr=0.1, fused_update=True)
    assert opt.capture_unavailable() is None


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
#: CapturedHeadStep's, numbered by it); the weights' versions when the head last noted its sampled
#: rows say when a new step's rows begin, and the optimizer takes a captured step's rows inside it.
#: (The rounding step, Partial FC's step and the idle clocks' lengths a replay does move: after it,
#: ``CapturedHeadStep._host_follows`` — see the Partial FC test below.)
_COUNTERS = {"head._forward_calls", "head._pending_versions"}
#: Moved by the body and followed after a replay (``_host_follows``)
_FOLLOWED = {"group0.rounding_step"}


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
    moved = {k: (before[k], after.get(k)) for k in before
             if before[k] != after.get(k) and k not in _COUNTERS | _FOLLOWED}
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
    held = device_scalars.DeviceScalars()
    copies = []
    real = device_scalars.scalars_on
    monkeypatch.setattr(device_scalars, "scalars_on", lambda *a, **k: copies.append(a[0]) or real(*a, **k))
    cpu = torch.device("cpu")
    t = held.get(0, (0.1, 0.9, 5e-4), cpu)
    assert held.get(0, (0.1, 0.9, 5e-4), cpu) is t and len(copies) == 1  # the same numbers: no copy
    assert held.get(0, (0.05, 0.9, 5e-4), cpu) is t and len(copies) == 2  # new numbers, same address
    torch.testing.assert_close(t, torch.tensor([0.05, 0.9, 5e-4]))
    assert held.get(1, (1.0,), cpu) is not t  # another key, its own tensor
    monkeypatch.setattr(capture, "capturing", lambda: True)
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
    nothing then) and runs the captured step on each replay, rewriting ``outputs``, with
    ``capture.capturing()`` saying yes, as it does while a graph records: code that would skip work
    on a condition the host knows, or set a number from the host, takes the capture's path, so a
    replay here computes what a replay of the recorded graph computes."""

    made = 0

    def __init__(self, body):
        type(self).made += 1
        self.body, self.outputs = body, None

    def replay(self):
        real = capture.capturing
        capture.capturing = lambda: True
        try:
            self.outputs = self.body()
        finally:
            capture.capturing = real


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
    made = CapturedHeadStep(None, None, eager_steps=1)
    assert made.eager_steps == 1 and made._held == []

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


# --------------------------------------------------------------------------- Partial FC, captured


def _pfc_pair(name="sgd", idle_rows="exact", **kw):
    """Two equal Partial FC heads (C = 45, r = 0.2: 9 classes a step, most rows idle most steps) with
    fused optimizers: one to step eagerly, one to capture."""
    eager = _head(sample_rate=0.2, **kw)
    graphed = copy.deepcopy(eager)
    args = dict(lr=0.05, momentum=0.9, weight_decay=5e-3) if name == "sgd" else dict(lr=1e-2, weight_decay=1e-2)
    opts = [head_optimizer(h, name, fused_update=True, idle_rows=idle_rows, **args) for h in (eager, graphed)]
    return eager, graphed, opts


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
@pytest.mark.parametrize("name, idle_rows", [("sgd", "exact"), ("sgd", "lazy"), ("adamw", "lazy")])
def test_partial_fc_replays_draw_and_catch_up_as_the_eager_steps_do(rehearsed, monkeypatch, name, idle_rows):
    """Partial FC captured: every replay draws the sample the eager step of its number draws (the
    losses and gradients agree only if it does), catches its rows up from the clock on the device,
    and the host's counts follow; a full catch-up falls due twice (every 4 steps here) between
    replays, and an evaluation forward reads every row in the middle: the two runs stay equal."""
    monkeypatch.setattr(partial_fc, "FULL_CATCH_UP_EVERY", 4)
    monkeypatch.setattr(catch_up, "FULL_CATCH_UP_EVERY", 4)
    eager, graphed, opts = _pfc_pair(name, idle_rows)
    step = CapturedHeadStep(graphed, opts[1], eager_steps=1)
    lrs = [0.05, 0.04, 0.03, 0.03, 0.02, 0.02, 0.01, 0.01, 0.005] if name == "sgd" else [1e-2, 8e-3, 6e-3, 5e-3, 4e-3]
    calls = _against_eager(eager, graphed, opts, step, lrs[:5], rtol=1e-5, atol=1e-6)
    assert calls[:3] == ["eager", "captured", "replayed"] and step.captures == 1
    x, y = _batch(50)
    eager.eval(), graphed.eval()  # every row read between steps: caught up, the clocks restart
    with torch.no_grad():
        torch.testing.assert_close(graphed(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
    eager.train(), graphed.train()
    eager.sample_step = graphed.sample_step = 100  # as a loaded checkpoint sets it: staged before the replay
    calls += _against_eager(eager, graphed, opts, step, lrs[5:], rtol=1e-5, atol=1e-6)
    assert set(calls[1:]) == {"captured", "replayed"} and step.captures == 1, calls
    assert graphed.sample_step == eager.sample_step == 100 + len(lrs) - 5
    assert opts[1].param_groups[0]["rounding_step"] == opts[0].param_groups[0]["rounding_step"] == len(lrs)
    if idle_rows == "exact":  # the full catch-ups fell due at the same steps
        (ce,), (cg,) = opts[0]._clocks.values(), opts[1]._clocks.values()
        assert ce.length == cg.length <= 4 and int(cg.now) == cg.length - 1
    for opt in opts:
        opt.catch_up_all_()
    torch.testing.assert_close(graphed.weight, eager.weight, rtol=1e-5, atol=1e-6)
    for key, value in opts[0].state[eager.weight].items():
        torch.testing.assert_close(opts[1].state[graphed.weight][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
def test_a_capture_waits_for_the_clock_the_first_sampled_step_makes_and_recaptures_after_a_load(rehearsed):
    """The idle rows' clock is made by the first sampled step (never inside a capture: its tensors
    would be zeroed by each replay), so a capture waits for it; a loaded optimizer state puts other
    tensors where the graph wrote (a stale graph would update the old ones): eager again, then a
    new capture."""
    eager, graphed, opts = _pfc_pair()
    step = CapturedHeadStep(graphed, opts[1], eager_steps=1)
    opts[1].rows_are_current()  # as after a load: no clock yet
    graphed.eval()
    step.step(*_batch(0))  # evaluation mode: no sampled step, so no clock: eager again
    assert step.last_call == "eager" and not opts[1]._clocks
    graphed.train()
    step.step(*_batch(1))
    assert step.last_call == "eager" and opts[1]._clocks  # its first sampled step made the clock
    step.step(*_batch(2))
    assert step.last_call == "captured"
    opts[1].load_state_dict(opts[1].state_dict())  # new state tensors at other addresses, no clock
    step.step(*_batch(3))
    assert step.last_call == "eager" and step.captures == 1
    step.step(*_batch(4))
    assert step.last_call == "captured" and step.captures == 2
    # Any one tensor the graph writes put elsewhere (the momentum, the clock's table or stamps): the
    # graph would write the old one, so eager again and a new capture
    (clock,) = opts[1]._clocks.values()
    state = opts[1].state[graphed.weight]
    held = {id(t) for t in step._held}  # kept alive while the graph lives: no other tensor takes their address
    assert {id(graphed.weight), id(state["momentum_buffer"]), id(clock.table), id(clock.stamps), id(clock.now)} <= held
    for i, swap in enumerate([lambda: state.update(momentum_buffer=state["momentum_buffer"].clone()),
                              lambda: setattr(clock, "table", clock.table.clone()),
                              lambda: setattr(clock, "stamps", clock.stamps.clone())]):
        step.step(*_batch(5 + 3 * i))
        assert step.last_call == "replayed"
        swap()
        step.step(*_batch(6 + 3 * i))
        assert step.last_call == "eager", i
        step.step(*_batch(7 + 3 * i))
        assert step.last_call == "captured" and step.captures == 3 + i


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's rehearsal of the captured step")
def test_a_captured_partial_fc_step_moves_on_the_host_only_what_the_replay_says(monkeypatch):
    """The body a graph records, run once as a capture runs it: no host read, and the Python-side
    numbers it moves are exactly those ``_host_follows`` moves after a replay, to the same values."""
    monkeypatch.setattr(capture, "capture_unavailable", lambda *a, **k: None)
    _, head, (_, opt) = _pfc_pair()
    step = CapturedHeadStep(head, opt, eager_steps=3)
    step.step(*_batch(0))  # eager: the clock and the state made
    step.step(*_batch(1))
    assert step.last_call == "eager"
    clock = opt._clocks[head.weight]

    def numbers():
        return dict(_Recorder.of(head, opt), length=clock.length, now=int(clock.now),
                    draw=int(head.draw_tensors()[0]), mirror=head._draw_steps._held[str(DEVICE)][1])

    step._stage()
    before, marks = numbers(), step._host_marks()
    monkeypatch.setattr(capture, "capturing", lambda: True)
    x, y = _batch(2)
    with HostSyncCounter() as syncs:
        step._run(x.requires_grad_(), y)
    assert syncs.count == 0, syncs.report()
    after = numbers()
    moved = {k for k in before if before[k] != after[k]} - _COUNTERS
    assert moved == {"head.sample_step", "group0.rounding_step", "length", "now", "draw", "mirror"}, moved
    # What a replay leaves instead: the device's side moved (here by the body), the host's by _host_follows
    head.sample_step, clock.length = before["head.sample_step"], before["length"]
    head._draw_steps._held[str(DEVICE)][1] = before["mirror"]
    opt.param_groups[0]["rounding_step"] = before["group0.rounding_step"]
    step._host_follows(marks)
    assert numbers() == after


def test_inside_a_capture_no_work_is_skipped_on_what_the_host_knows_now(monkeypatch):
    """What a capture records runs at every replay, whatever the host's state then: so inside a
    capture rows with nothing behind are still caught up (a replay's may be behind), a step that
    moves nothing is still recorded, a due full catch-up waits for the host's side (it would
    repeat at every replay), and no clock or draw number is made or set there."""
    head = _head(sample_rate=0.2)
    opt = head_optimizer(head, "sgd", lr=0.05, momentum=0.9, fused_update=True)
    opt.zero_grad(set_to_none=False)
    head(*_batch(0)).backward()
    opt.step()
    opt.catch_up_all_()
    clock = opt._clocks[head.weight]
    assert clock.all_current
    rows = torch.tensor([1, 2, 3], device=DEVICE)
    caught = []
    monkeypatch.setattr(clock, "catch_up_", lambda *a, **k: caught.append(a[2]))
    assert opt.catch_up_(head.weight, rows) is False and not caught  # eager: nothing behind, nothing done
    monkeypatch.setattr(capture, "capturing", lambda: True)
    assert opt.catch_up_(head.weight, rows) is True and caught[0] is rows  # captured: done anyway
    length = clock.length
    group = opt.param_groups[0]
    group.update(lr=0.0, momentum=0.0)
    monkeypatch.setattr(capture, "capturing", lambda: False)
    opt.stage_device_scalars()  # the numbers staged before the capture, as CapturedHeadStep does
    monkeypatch.setattr(capture, "capturing", lambda: True)
    opt._record_step(clock, group)  # a step that moves nothing, recorded anyway
    assert clock.length == length + 1 and int(clock.now) == length
    group.update(lr=0.05, momentum=0.9)
    monkeypatch.setattr(capture, "capturing", lambda: False)
    opt.stage_device_scalars()
    monkeypatch.setattr(capture, "capturing", lambda: True)
    monkeypatch.setattr(partial_fc, "FULL_CATCH_UP_EVERY", 0)
    opt._advance(head.weight, opt.param_groups[0], rows)
    assert not caught[1:] and clock.length == length + 2  # due, but left to the host after the replay
    fresh = head_optimizer(_head(sample_rate=0.2), "sgd", lr=0.05, fused_update=True)
    w = fresh.param_groups[0]["params"][0]
    with pytest.raises(RuntimeError, match=r"^a CUDA graph capture reached a parameter's first sampled step: run one "
                       r"step eagerly first \(CapturedHeadStep does\)$"):
        fresh._advance(w, fresh.param_groups[0], rows)
    with pytest.raises(RuntimeError, match=r"^the Partial FC step counter was set to 7 inside a CUDA graph capture \(the "
                       r"device holds 1\): stage it before capturing or replaying \(CapturedHeadStep does\)$"):
        head._draw_steps.on(head.weight.device, 7)
    with pytest.raises(RuntimeError, match=r"step counter was set to 0 inside a CUDA graph capture \(the device holds none\)"):
        head._draw_steps.on(torch.device("meta"), 0)  # a counter made inside a capture: zeroed by every replay
