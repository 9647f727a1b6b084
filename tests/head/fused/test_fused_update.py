"""The optimizer's step fused into the backward (``head_optimizer(..., fused_update=True)``): the
weights and the optimizer's state (SGD's momentum; AdamW's moments and per-row step count) after a
few steps equal the unfused path (the gradient stored, then ``step()``: torch's optimizer, or the
row-sparse one under Partial FC and for bf16 centres) to fp32 rounding, for every layout and
option; no ``.grad`` is stored; and where the backward cannot apply it, ``step()`` does, as before."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D, trainer_steps

import shardfc
from shardfc.head import partial_fc

B = 29
STEPS = 2


def _inputs(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, C, (B,), generator=g)
    y[:4] = y[4]  # samples sharing a target: their target terms add up in one row
    y[::9] = -1
    return x.to(dtype), y


#: The optimizers' hyper-parameters of these tests (``opt_kw`` overrides them).
OPT_KW = {"sgd": dict(lr=0.5, momentum=0.9, weight_decay=5e-3, nesterov=False),
          "adamw": dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)}


def _make(fused: bool, *, optimizer="sgd", margin="arcface", impl="triton", opt_kw=None, rounding="nearest",
          **head_kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS[margin]), impl=impl, device=DEVICE, **head_kw)
    kw = dict(OPT_KW[optimizer])
    kw.update(opt_kw or {})
    return head, partial_fc.head_optimizer(head, optimizer, fused_update=fused, rounding=rounding, **kw)


def _step(head, opt, step: int, fused: bool, autocast=None, lr_schedule=None):
    """One training step of the head on ``_inputs(step)``: ``(dJ/dx, loss)``."""
    base = opt.defaults["lr"]
    lr_schedule = lr_schedule or (base, 0.4 * base)
    for group in opt.param_groups:  # a schedule: the backward reads this step's rate
        group["lr"] = lr_schedule[step % len(lr_schedule)]
    opt.zero_grad(set_to_none=False)
    x, y = _inputs(step)
    xr = x.to(DEVICE).requires_grad_()
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        loss = head(xr, y.to(DEVICE))
    loss.backward()
    if fused and head.last_update == "fused":
        assert all(w.grad is None for w in head.shard_weights)  # nothing of [n, D] stored
    opt.step()
    return xr.grad.double().cpu(), float(loss.detach())


def _state(head, opt, optimizer: str) -> list:
    if optimizer == "sgd":
        return [opt.state[w].get("momentum_buffer") for w in head.shard_weights]
    return [_adam_state(opt.state[w], w) for w in head.shard_weights]


def _run(fused: bool, *, optimizer="sgd", autocast=None, steps=STEPS, lr_schedule=None, **kw):
    head, opt = _make(fused, optimizer=optimizer, **kw)
    grads_x, losses = [], []
    for step in range(steps):
        gx, loss = _step(head, opt, step, fused, autocast, lr_schedule)
        grads_x.append(gx)
        losses.append(loss)
    state = _state(head, opt, optimizer)
    return head, [w.detach().double().cpu() for w in head.shard_weights], state, grads_x, losses


def _lockstep(*, optimizer="adamw", autocast=None, steps=3, init=None, **kw):
    """``steps`` steps of the fused path and the unfused one side by side, the unfused head and
    optimizer state set to the fused one's before each step, so every step compares one update from
    the same weights, state and (to its summation order) gradient — the comparison is not blurred
    by the two trajectories drifting apart. Per step: ``(fused head, fused weights and state, the
    unfused one's)``. ``init(head, optimizer)``: sets the fused side's starting state (a row-sparse
    unfused optimizer then starts from a copy of it)."""
    head, opt = _make(True, optimizer=optimizer, **kw)
    ref_head, ref = _make(False, optimizer=optimizer, **kw)
    if init is not None:
        init(head, opt)
    out = []
    for step in range(steps):
        with torch.no_grad():
            for w, r in zip(head.shard_weights, ref_head.shard_weights):
                r.copy_(w)
                for key, t in opt.state[w].items():
                    if key in ref.state[r]:
                        ref.state[r][key].copy_(t)
                    elif isinstance(ref, partial_fc.RowSparseAdamW):
                        ref.state[r][key] = t.clone()
        _step(head, opt, step, True, autocast)
        _step(ref_head, ref, step, False, autocast)
        out.append([(w.detach().double().cpu(), _state(head, opt, optimizer)[i],
                     r.detach().double().cpu(), _state(ref_head, ref, optimizer)[i])
                    for i, (w, r) in enumerate(zip(head.shard_weights, ref_head.shard_weights))])
    return head, out


def _adam_state(state: dict, w) -> dict:
    """AdamW's state of ``w`` as the row-sparse optimizer keeps it: torch's scalar ``step`` as a
    step count per row."""
    out = {k: state[k].double().cpu() for k in ("exp_avg", "exp_avg_sq")}
    step = state["row_step"] if "row_step" in state else torch.full((w.shape[0],), float(state["step"]))
    out["row_step"] = step.double().cpu().clone()  # a copy: on the CPU .double() of fp64 is the live tensor
    return out


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


CASES = {
    "arcface": dict(),
    "nesterov_no_decay": dict(opt_kw=dict(nesterov=True, weight_decay=0.0)),
    "no_momentum": dict(opt_kw=dict(momentum=0.0)),
    "partial_fc": dict(sample_rate=0.5),
    "partial_fc_sparse_grad": dict(sample_rate=0.5, sparse_grad=True),
    "subcenters_smoothing": dict(subcenters=2, label_smoothing=0.1),
    "raw_centres_gemm": dict(margin="softmax", impl="gemm"),
    "filter": dict(interclass_filter_threshold=0.3, margin="cosface"),
    "bf16_autocast": dict(autocast=torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_update_equals_the_optimizers_step(case):
    kw = CASES[case]
    head, w_ref, buf_ref, gx_ref, loss_ref = _run(False, **kw)
    assert head.last_update is None  # no fused optimizer: nothing to say
    head, w, buf, gx, loss = _run(True, **kw)
    assert head.last_update == "fused"
    tol = 1e-5
    assert loss == pytest.approx(loss_ref, rel=tol)
    for a, b in zip(gx, gx_ref):
        assert _rel(a, b) < tol
    for a, b in zip(w, w_ref):
        assert _rel(a, b) < tol
    for a, b in zip(buf, buf_ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert _rel(a, b) < tol


#: SGD's cases without its own options (Nesterov, momentum), plus AdamW's
ADAMW_CASES = {
    "no_decay_odd_betas": dict(opt_kw=dict(weight_decay=0.0, betas=(0.5, 0.95), eps=1e-3)),
    **{k: v for k, v in CASES.items() if "opt_kw" not in v},
}


def _assert_adam_state(got: dict, ref: dict, tol: float) -> None:
    assert torch.equal(got["row_step"], ref["row_step"])  # the same rows stepped, as often
    for key in ("exp_avg", "exp_avg_sq"):
        assert _rel(got[key], ref[key]) < tol, key


@pytest.mark.parametrize("case", list(ADAMW_CASES), ids=list(ADAMW_CASES))
def test_fused_adamw_equals_the_optimizers_step(case):
    """Three steps of AdamW (a learning-rate schedule; Partial FC samples different rows each step,
    so the rows' step counts differ), each from the same weights and state (:func:`_lockstep`): the
    weights differ by fp32 rounding only — far below the update, ≈ lr per element, so a wrong bias
    correction, decay or moment cannot hide in the tolerance — and the moments and each row's step
    count equal the unfused path's (torch's AdamW for a dense fp32 head, the row-sparse one under
    Partial FC)."""
    kw = dict(ADAMW_CASES[case], optimizer="adamw")
    lr = (kw.get("opt_kw") or {}).get("lr", OPT_KW["adamw"]["lr"])
    head, steps = _lockstep(**kw)
    assert head.last_update == "fused"
    for shards in steps:
        for w, st, w_ref, st_ref in shards:
            assert float((w - w_ref).abs().max()) < 1e-5 * lr
            _assert_adam_state(st, st_ref, 1e-5)
    if "sample_rate" in kw:
        counts = steps[-1][0][1]["row_step"]
        assert counts.min() < counts.max()  # rows sampled unequally often: the per-row bias correction matters


@pytest.mark.parametrize("case", ["partial_fc"])
def test_fused_adamw_trajectory(case):
    """Three steps each on its own path (the fused and the unfused ones drift apart by the
    rounding of each step, amplified through the loss and Adam's normalisation): still equal to
    well within the updates, and the loss and ``dJ/dx`` to fp32 rounding."""
    kw = dict(ADAMW_CASES[case], optimizer="adamw", steps=3)
    head, w_ref, st_ref, gx_ref, loss_ref = _run(False, **kw)
    assert head.last_update is None
    head, w, st, gx, loss = _run(True, **kw)
    assert head.last_update == "fused"
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    for a, b in zip(gx, gx_ref):
        assert _rel(a, b) < 1e-5
    assert _rel(w[0], w_ref[0]) < 1e-4
    _assert_adam_state(st[0], st_ref[0], 1e-4)


def test_one_adamw_step_is_exact_to_fp32_rounding():
    """One step, where both paths see the same weights: the fused update differs from torch's by
    fp32 rounding of the weights only, far below the update itself (≈ lr per element), so a bias
    correction, decay or moment formed wrongly could not hide in the tolerance."""
    kw = dict(optimizer="adamw", steps=1)
    _, w_ref, st_ref, _, _ = _run(False, **kw)
    _, w, st, _, _ = _run(True, **kw)
    lr = OPT_KW["adamw"]["lr"]
    assert float((w[0] - w_ref[0]).abs().max()) < 1e-6 * lr
    _assert_adam_state(st[0], st_ref[0], 1e-6)


def test_adamw_bias_correction_at_large_step_counts():
    """Rows whose step counts are large and differ, under betas whose powers stay away from 0 and 1
    for millions of steps (β₂ = 1 − 10⁻⁷): the kernel's fp64 powers (by squaring, every bit of the
    count) give the bias corrections the optimizer computes with ``β ** t``."""
    counts = torch.tensor([0, 1, 6, 1000, 123457, 2**24 + 3, 2**30 - 1, 7 * 2**33 + 5], dtype=torch.float64)

    def init(head, opt):
        w = head.weight
        opt.state[w] = dict(exp_avg=torch.zeros_like(w), exp_avg_sq=torch.full_like(w, 1e-4),
                            row_step=counts.repeat(C // counts.numel() + 1)[:C].to(w.device))

    kw = dict(optimizer="adamw", sample_rate=0.5, opt_kw=dict(betas=(0.999999, 0.9999999)))
    head, steps = _lockstep(init=init, **kw)
    assert head.last_update == "fused"
    for shards in steps:
        for w, st, w_ref, st_ref in shards:
            assert float((w - w_ref).abs().max()) < 1e-5 * OPT_KW["adamw"]["lr"]
            _assert_adam_state(st, st_ref, 1e-5)
    assert steps[-1][0][1]["row_step"].max() > 7 * 2**33


def test_above_the_operand_budget(monkeypatch):
    """A shard whose operand is made per chunk: the fused update reads the fp32 rows it writes,
    each tile before it writes it."""
    from shardfc.head.fused import chunks

    monkeypatch.setattr(chunks, "OPERAND_BYTES", 0)
    _, w_ref, buf_ref, _, _ = _run(False, sample_rate=0.5)
    _, w, buf, _, _ = _run(True, sample_rate=0.5)
    assert _rel(w[0], w_ref[0]) < 1e-5 and _rel(buf[0], buf_ref[0]) < 1e-5
    _, w_ref, st_ref, _, _ = _run(False, optimizer="adamw", steps=3)
    _, w, st, _, _ = _run(True, optimizer="adamw", steps=3)
    assert _rel(w[0], w_ref[0]) < 1e-5
    _assert_adam_state(st[0], st_ref[0], 1e-5)


def test_bf16_centres_round_once():
    """bf16 centres and momentum: the fused update rounds once from the fp32 gradient, the unfused
    path from a bf16 ``.grad``: equal to bf16's resolution."""
    _, w_ref, buf_ref, _, _ = _run(False, dtype=torch.bfloat16)
    head, w, buf, _, _ = _run(True, dtype=torch.bfloat16)
    assert head.last_update == "fused"
    assert _rel(w[0], w_ref[0]) < 2e-2 and _rel(buf[0], buf_ref[0]) < 2e-2


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_bf16_centres_adamw(sample_rate):
    """bf16 centres and moments under AdamW, three steps each from the same weights and state
    (:func:`_lockstep`): the fused update rounds once from the fp32 gradient, the unfused path from
    a bf16 ``.grad``, so the weights differ by at most one bf16 ulp of the largest (an update is
    ≈ lr, six times that), the moments to bf16's resolution, the step counts not at all."""
    head, steps = _lockstep(optimizer="adamw", dtype=torch.bfloat16, sample_rate=sample_rate)
    assert head.last_update == "fused"
    for shards in steps:
        for w, st, w_ref, st_ref in shards:
            assert float((w - w_ref).abs().max()) <= torch.finfo(torch.bfloat16).eps * float(w_ref.abs().max())
            _assert_adam_state(st, st_ref, 2e-2)


def test_step_skips_what_the_backward_updated():
    """A ``.grad`` left from an earlier step (kept by ``zero_grad(set_to_none=False)``) is neither
    written by the fused backward nor stepped on again by ``step()``."""
    _, w_ref, buf_ref, _, _ = _run(False)
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS["arcface"]), impl="triton", device=DEVICE)
    head.weight.grad = torch.zeros_like(head.weight)
    opt = partial_fc.head_optimizer(head, "sgd", lr=0.5, momentum=0.9, weight_decay=5e-3, fused_update=True)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = (0.5, 0.2)[step % 2]
        opt.zero_grad(set_to_none=False)
        x, y = _inputs(step)
        head(x.to(DEVICE).requires_grad_(), y.to(DEVICE)).backward()
        opt.step()
    assert head.last_update == "fused" and not head.weight.grad.any()
    assert _rel(head.weight.detach(), w_ref[0]) < 1e-5
    assert _rel(opt.state[head.weight]["momentum_buffer"], buf_ref[0]) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_second_backward_before_the_step_is_an_error(optimizer):
    head = shardfc.ShardedMarginHead(D, C, impl="triton", device=DEVICE)
    opt = partial_fc.head_optimizer(head, optimizer, lr=0.1, fused_update=True)
    x, y = _inputs(0)
    head(x.to(DEVICE), y.to(DEVICE)).backward()
    with pytest.raises(RuntimeError, match=r"accumulating gradients over several backward passes needs fused_update=False"):
        head(x.to(DEVICE), y.to(DEVICE)).backward()
    opt.step()
    opt.zero_grad()
    head(x.to(DEVICE), y.to(DEVICE)).backward()  # a new step: allowed again


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("why,kw,expect", [
    ("torch", dict(impl="torch"), "optimizer: impl='torch' stores the gradient"),
    ("fp16", dict(autocast=torch.float16), "optimizer: fp16 compute"),
    ("stochastic", dict(dtype=torch.bfloat16, rounding="stochastic"), "optimizer: rounding='stochastic'"),
])
def test_where_the_backward_cannot_the_step_does(why, kw, expect, optimizer):
    _, w_ref, _, _, _ = _run(False, optimizer=optimizer, **kw)
    head, w, _, _, _ = _run(True, optimizer=optimizer, **kw)
    assert head.last_update.startswith(expect)
    assert all(w.grad is not None for w in head.shard_weights)  # stored, for step()
    assert _rel(w[0], w_ref[0]) < 1e-6


def test_bad_arguments():
    head = shardfc.ShardedMarginHead(D, C, impl="triton", device=DEVICE)
    with pytest.raises(ValueError, match=r"optimizer name must be 'sgd' or 'adamw', got 'adam'"):
        partial_fc.head_optimizer(head, "adam", lr=0.1, fused_update=True)
    with pytest.raises(TypeError, match=r"fused_update must be True or False, got 'yes'"):
        partial_fc.head_optimizer(head, "sgd", lr=0.1, fused_update="yes")
    for name in ("sgd", "adamw"):
        with pytest.raises(TypeError, match=r"fused_update=True needs a ShardedMarginHead, got Linear"):
            partial_fc.head_optimizer(torch.nn.Linear(2, 3), name, lr=0.1, fused_update=True)


def test_adamw_from_torchs_state():
    """A fused AdamW resumes from the state torch's AdamW kept (a dense fp32 head stepped with
    fused_update=False), loaded as a checkpoint does: its scalar step becomes every row's count,
    and the steps after equal torch's own."""
    def head_and_opt(fused):
        torch.manual_seed(0)
        head = shardfc.ShardedMarginHead(D, C, impl="triton", device=DEVICE)
        return head, partial_fc.head_optimizer(head, "adamw", fused_update=fused, **OPT_KW["adamw"])

    def step(head, opt, i):
        opt.zero_grad()
        x, y = _inputs(i)
        head(x.to(DEVICE).requires_grad_(), y.to(DEVICE)).backward()
        opt.step()

    ref_head, ref = head_and_opt(False)
    step(ref_head, ref, 0)
    head, opt = head_and_opt(True)
    head.load_state_dict(ref_head.state_dict())
    tensors, extras = partial_fc.optimizer_rows(ref, ref_head.shard_weights)  # as a checkpoint keeps it
    partial_fc.load_optimizer_rows(opt, head.shard_weights, [(0, C)], tensors, extras)
    for i in (1, 2):
        step(ref_head, ref, i)
        step(head, opt, i)
    assert head.last_update == "fused"
    assert _rel(head.weight.detach(), ref_head.weight.detach()) < 1e-5
    got, want = _adam_state(opt.state[head.weight], head.weight), _adam_state(ref.state[ref_head.weight], ref_head.weight)
    assert torch.equal(got["row_step"], torch.full((C,), 3.0, dtype=torch.float64))
    _assert_adam_state(got, want, 1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_trainers_step_with_the_fused_update(monkeypatch, optimizer):
    """``shardfc train``'s step (zero_grad, forward, backward, clip the backbone, both optimizers,
    the schedules) with head_update 'fused' trains the head as with 'optimizer' (faked onto this
    device: the interpreter, or the GPU)."""
    import dataclasses

    import shardfc.train.builder.factory as build
    from shardfc.parallel.context import DistContext
    from shardfc.train.config import TrainConfig

    monkeypatch.setattr(build, "fused_head_update", lambda cfg, device, amp: cfg.head_update == "fused")
    base = TrainConfig(image_size=[16, 16], embedding_dim=D, synthetic_identities=C, head_impl="triton", warmup_steps=1,
                       grad_clip=0.5, backbone="tiny", optimizer=optimizer)
    heads = {}
    for mode in ("optimizer", "fused"):
        cfg = dataclasses.replace(base, head_update=mode).validate()
        torch.manual_seed(0)
        parts = build.build_parts(cfg, DistContext(device=DEVICE), C, (16, 16), total_steps=4, amp_dtype=None)
        trainer_steps(parts, cfg, DistContext(device=DEVICE))
        assert parts.head.last_update == ("fused" if mode == "fused" else None)
        heads[mode] = parts.head.weight.detach().double().cpu()
    assert _rel(heads["fused"], heads["optimizer"]) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_an_empty_batch_between_steps(optimizer):
    """A step with no samples: the fused update still applies the step with a zero gradient
    (decay, momentum, AdamW's moments and step count), as the optimizer does on the zero
    ``.grad`` of the unfused path; the next step reads the operand that update wrote."""
    results = []
    for fused in (False, True):
        head, opt = _make(fused, optimizer=optimizer)
        for step in range(3):
            opt.zero_grad()
            x, y = _inputs(step)
            if step == 1:
                x, y = x[:0], y[:0]
            head(x.to(DEVICE).requires_grad_(), y.to(DEVICE)).backward()
            opt.step()
        assert head.last_update == ("fused" if fused else None)
        results.append((head.weight.detach().double().cpu(), _state(head, opt, optimizer)[0]))
    (w_ref, st_ref), (w, st) = results
    assert _rel(w, w_ref) < 1e-5
    if optimizer == "adamw":
        _assert_adam_state(st, st_ref, 1e-5)
        assert torch.equal(st["row_step"], torch.full((C,), 3.0, dtype=torch.float64))
    else:
        assert _rel(st, st_ref) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bf16_centres_are_the_fp32_update_rounded_to_nearest(optimizer):
    """One fused step on bf16 centres and on fp32 centres of the same values (fp32 compute): the
    kernel's fp32 arithmetic is the same from the same numbers, so the bf16 weights are exactly the
    fp32 step's weights rounded to nearest (the interpreter truncates a bf16 store unless the
    kernel rounds first)."""
    h16, o16 = _make(True, optimizer=optimizer, dtype=torch.bfloat16)
    h32, o32 = _make(True, optimizer=optimizer)
    with torch.no_grad():
        for w32, w16 in zip(h32.shard_weights, h16.shard_weights):
            w32.copy_(w16.float())
    _step(h16, o16, 0, True)
    _step(h32, o32, 0, True)
    assert h16.last_update == h32.last_update == "fused"
    for w16, w32 in zip(h16.shard_weights, h32.shard_weights):
        assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.bfloat16())
        assert not torch.equal(w16.float(), w32)  # the fp32 step's weights were not all bf16 numbers
